"""The fused decode kernels on a CPU-only machine: every public op falls back to its PyTorch
reference (bit for bit), the bank-view detection the AttnRes kernel relies on, and the MoE
decode kernel's tile validation. The kernels themselves are tested in
tests/gpu/test_fused_triton.py."""
from __future__ import annotations

import pytest
import torch

from raydecode.kernels import attnres_norm as A
from raydecode.kernels import attnres_norm_triton as AT
from raydecode.kernels import decode_elementwise_triton as X
from raydecode.kernels import moe_mxfp4 as M
from raydecode.kernels import moe_mxfp4_decode as D
from raydecode.kernels import router as R

torch.set_num_threads(1)
BF = torch.bfloat16


def _bank(T=3, n=4, H=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    bank = torch.randn(T, n + 1, H, generator=g).to(BF)
    w = [1 + 0.1 * torch.randn(H, generator=g), torch.randn(1, H, generator=g),
         1 + 0.1 * torch.randn(H, generator=g)]
    return bank, w


def test_attnres_ops_fall_back_to_reference_on_cpu():
    bank, (wr, wp, wo) = _bank()
    blocks, pre = [bank[:, j] for j in range(4)], bank[:, 4]
    out = torch.randn(3, 64).to(BF)
    assert torch.equal(A.attnres_mix_norm(blocks, pre, wr, wp, wo, 1e-6, 1e-5),
                       A.attnres_mix_norm_reference(blocks, pre, wr, wp, wo, 1e-6, 1e-5))
    p, h = A.attnres_add_mix_norm(blocks, pre, out, wr, wp, wo, 1e-6, 1e-5)
    rp, rh = A.attnres_add_mix_norm_reference(blocks, pre, out, wr, wp, wo, 1e-6, 1e-5)
    assert torch.equal(p, rp) and torch.equal(h, rh)
    assert not A.triton_serves(pre)


def test_attnres_bad_shapes_are_named():
    bank, (wr, wp, wo) = _bank()
    with pytest.raises(ValueError, match="projection"):
        A.attnres_mix_norm([bank[:, 0]], bank[:, 4], wr, wp[:, :10], wo, 1e-6, 1e-5)
    with pytest.raises(ValueError, match="sublayer output"):
        A.attnres_add_mix_norm([bank[:, 0]], bank[:, 4], bank[:2, 1], wr, wp, wo, 1e-6, 1e-5)


def test_bank_view_detects_uniform_slots_only():
    bank, _ = _bank(n=4)
    blocks = [bank[:, j] for j in range(4)]
    v = AT.bank_view(blocks, bank[:, 4])
    assert v is not None and torch.equal(v, bank[:, :4])
    assert v.data_ptr() == bank.data_ptr()                   # a view, no copy
    assert AT.bank_view([bank[:, 0], bank[:, 2]], bank[:, 4]) is not None   # stride 2 slots
    assert AT.bank_view([bank[:, 0], bank[:, 2], bank[:, 3]], bank[:, 4]) is None
    assert AT.bank_view([b.clone() for b in blocks], bank[:, 4]) is None
    assert AT.bank_view([], bank[:, 4]) is None


@pytest.mark.parametrize("bias", [True, False])
def test_route_topk_falls_back_to_reference_on_cpu(bias):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 96, generator=g)
    b = 0.1 * torch.randn(96, generator=g) if bias else None
    w, ids = R.route_topk(logits, b, 8, True, 2.0)
    rw, rid = R.route_topk_reference(logits, b, 8, True, 2.0)
    assert torch.equal(w, rw) and torch.equal(ids, rid)
    with pytest.raises(ValueError, match="top_k"):
        R.route_topk(logits, b, 97)


def test_elementwise_ops_fall_back_to_reference_on_cpu():
    g = torch.Generator().manual_seed(2)
    gu = (3 * torch.randn(2, 64, generator=g)).to(BF)
    assert torch.equal(X.situ_mul(gu, 4.0, 25.0), X.situ_mul_reference(gu, 4.0, 25.0))
    x, w = torch.randn(2, 48, generator=g), 1 + 0.1 * torch.randn(48, generator=g)
    y = X.rms_norm_cast(x, w, 1e-6)
    assert y.dtype == BF and torch.equal(y, X.rms_norm_cast_reference(x, w, 1e-6))
    with pytest.raises(ValueError, match="2I"):
        X.situ_mul(gu[:, :63], 4.0, None)
    with pytest.raises(ValueError, match="rms_norm_cast"):
        X.rms_norm_cast(x, w[:10], 1e-6)


def test_latent_norm_situ_falls_back_and_names_bad_shapes():
    g = torch.Generator().manual_seed(3)
    lat, w = torch.randn(2, 48, generator=g), 1 + 0.1 * torch.randn(48, generator=g)
    gu = 3 * torch.randn(2, 40, generator=g)                      # fp32, rounded inside
    out = torch.full((2, 40), float("nan")).to(BF)
    X.latent_norm_situ(lat, w, 1e-6, 12, 12, gu, 4.0, 25.0, out)
    ln = X.rms_norm_cast_reference(lat, w, 1e-6)[:, 12:24]
    assert torch.equal(out[:, :12], ln)
    assert torch.equal(out[:, 12:32], X.situ_mul_reference(gu.to(BF), 4.0, 25.0))
    assert torch.equal(out[:, 32:], torch.zeros(2, 8, dtype=BF))
    with pytest.raises(ValueError, match="columns"):
        X.latent_norm_situ(lat, w, 1e-6, 40, 12, gu, 4.0, None, out)
    with pytest.raises(ValueError, match="2I"):
        X.latent_norm_situ(lat, w, 1e-6, 0, 12, gu[:, :39], 4.0, None, out)


def test_moe_decode_not_used_on_cpu_and_tiles_validate():
    ex = M.MXFP4Experts.random(8, 128, 64, 4.0, None, seed=0)
    z = torch.randn(1, 128).to(BF)
    ids = torch.arange(4).view(1, 4)
    assert not D.use_decode_kernel(z, ids, ex)
    for I in (192, 384, 128, 64):            # K3 TP16 / TP8 and small shapes
        D.default_decode_config(896, I, 3584).validate(I, 3584)
    with pytest.raises(ValueError, match="gate_up BN 40"):
        D.DecodeConfig(gate_up_bn=40).validate(192, 3584)
    with pytest.raises(ValueError, match="down BN"):
        D.DecodeConfig(down_bn=96).validate(192, 3584)


def test_moe_decode_split_k_validates():
    """gate_up_ks must divide L/32/GB (3584: 112 groups, 7 steps of GB 16)."""
    for I in (192, 384):    # untuned rule: one GB step per program; TUNED: measured splits
        c = D.default_decode_config(896, I, 3584, tuned=False)
        assert c.gate_up_ks * c.gate_up_gb == 3584 // 32
        t = D.default_decode_config(896, I, 3584)
        assert t.gate_up_ks > 1 and t.validate(I, 3584) is t
    for ks in (1, 7):
        D.DecodeConfig(gate_up_gb=16, gate_up_ks=ks).validate(192, 3584)
    D.DecodeConfig(gate_up_gb=8, gate_up_ks=14).validate(192, 3584)
    for ks in (2, 14, 0, -7):
        with pytest.raises(ValueError, match=f"gate_up KS {ks}: .* L/32/GB = 7"):
            D.DecodeConfig(gate_up_gb=16, gate_up_ks=ks).validate(192, 3584)


def test_skinny_default_configs_fill_the_gpu_and_cpu_linear_stays_on_torch(monkeypatch):
    """`gemm_skinny_triton.default_config` on the K3 per-rank GEMVs: valid for every M it
    serves, ≥ 1.5 programs per SM where ≤ 8 K slices give it (else the most slices ≤ 8), x
    padded to 16/32/64 rows; M = 0 or > 64 and bad tiles are refused by name (M = 1, 2: the
    stock path's decode GEMMs). `gemv.linear` with the skinny path on still runs torch on CPU
    tensors (the kernel is CUDA-only in dispatch)."""
    from raydecode.kernels import gemm_skinny_triton as S
    from raydecode.kernels import linear as G
    from raydecode.kernels.settings import DecodeOptions
    shapes = [(3216, 7168), (7168, 768), (1048, 7168), (900, 7168), (1152, 1536), (7168, 640),
              (7168, 384), (10240, 7168)]
    for N, K in shapes:
        for M in (1, 2, 3, 4, 8, 16, 17, 32, 64):
            c = S.default_config(M, N, K)
            assert c.validate(M, N, K) is c
            programs = -(-N // c.bn) * c.ks
            steps = K // c.bk
            assert 2 * programs >= 3 * 132 or c.ks == max(
                d for d in range(1, min(steps, 8) + 1) if steps % d == 0), (N, K, M, c)
    assert [S.m_block(m) for m in (3, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]
    assert S.default_config(8, 7168, 768).ks == 1          # 224 row blocks of 32: no split
    assert S.default_config(8, 900, 7168).ks == 7          # 29 row blocks × 7 slices of 8 steps
    assert S.default_config(8, 900, 7168, bn=16).ks == 4   # 57 row blocks × 4
    with pytest.raises(ValueError, match="M=0: the skinny GEMM serves 1 ≤ M ≤ 64"):
        S.SkinnyConfig().validate(0, 64, 256)
    with pytest.raises(ValueError, match="M=65: the skinny GEMM serves 1 ≤ M ≤ 64"):
        S.SkinnyConfig().validate(65, 64, 256)
    with pytest.raises(ValueError, match="bn 48: need one of 16, 32, 64, 128"):
        S.SkinnyConfig(bn=48).validate(8, 64, 256)
    on = DecodeOptions(skinny_max_m=64)
    x, w = torch.randn(8, 256).to(BF), torch.randn(64, 256).to(BF)
    assert torch.equal(G.linear(x, w, options=on), torch.nn.functional.linear(x, w))
