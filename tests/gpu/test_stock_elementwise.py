"""The stock KDA layer's fused elementwise ops (kernels/stock_elementwise.py, Triton) vs the
PyTorch chains they replace, on CUDA or on CPU through the Triton interpreter
(TRITON_INTERPRET=1). Fresh random inputs per case (seed in every failure message); inputs are
column views of wider buffers as the in_proj output gives them. g and β are fp32 math on the
same bf16 inputs: within a few fp32 ulps. The gated norm rounds once to bf16 on both sides: at
most one bf16 ulp apart where the fp32 values straddle a rounding boundary."""
from __future__ import annotations

import os

import pytest
import torch

from raydecode.kernels import stock_elementwise as E

from _numerics import fresh_seed

ON_GPU = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(E.triton is None or not (ON_GPU or INTERP),
                                reason="needs Triton and CUDA (or TRITON_INTERPRET=1)")
DEV = "cuda" if ON_GPU else "cpu"
BF = torch.bfloat16
SHAPES = [(1, 4, 128), (7, 3, 32), (64, 6, 128), (5, 2, 24)]   # (T, h, d); d 24: masked lanes


def _gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


@pytest.mark.parametrize("T,h,d", SHAPES)
def test_gate_beta_equals_the_chain(T, h, d):
    seed = fresh_seed()
    g = _gen(seed)
    C = h * d
    proj = torch.randn(T, C + h + 40, generator=g, device=DEV).to(BF)
    raw, b = proj[:, :C], proj[:, C:C + h]
    exp_a = (torch.rand(h, generator=g, device=DEV) * 1.4).exp()
    dt_bias = 0.5 * torch.randn(C, generator=g, device=DEV) - 1.0
    got_g, got_b = E.kda_gate_beta(raw, b, exp_a, dt_bias, -5.0, h)
    want_g, want_b = E.kda_gate_beta_reference(raw, b, exp_a, dt_bias, -5.0, h)
    assert got_g.shape == (T, h, d) and got_b.shape == (T, h)
    assert torch.allclose(got_g, want_g, rtol=1e-5, atol=1e-6), f"seed {seed}"
    assert torch.allclose(got_b, want_b, rtol=1e-5, atol=1e-6), f"seed {seed}"


@pytest.mark.parametrize("T,h,d", SHAPES)
def test_gated_norm_equals_the_chain(T, h, d):
    seed = fresh_seed()
    g = _gen(seed)
    o = torch.randn(T, h, d, generator=g, device=DEV) * 0.3
    w = 1.0 + 0.1 * torch.randn(d, generator=g, device=DEV)
    gate = torch.randn(T, h * d + 17, generator=g, device=DEV).to(BF)[:, 5:5 + h * d]
    got = E.gated_rms_norm(o, w.to(BF), 1e-5, gate)
    want = E.gated_rms_norm_reference(o, w.to(BF), 1e-5, gate)
    assert got.dtype == BF and got.shape == (T, h * d)
    ulp = (want.float().abs() * 2 ** -7).clamp_min(1e-30)
    assert ((got.float() - want.float()).abs() <= ulp).all(), f"seed {seed}"
    assert (got != want).float().mean().item() < 0.01, f"seed {seed}"


def test_shapes_are_named():
    o = torch.zeros(2, 3, 8, device=DEV)
    with pytest.raises(ValueError, match="gated_rms_norm"):
        E.gated_rms_norm(o, torch.ones(7, device=DEV), 1e-5, torch.zeros(2, 24, device=DEV))
    with pytest.raises(ValueError, match="situ_pair"):
        E.situ_pair(torch.zeros(2, 8, device=DEV), torch.zeros(2, 9, device=DEV), 2.0, None)
    with pytest.raises(ValueError, match="kda_gate_beta"):
        E.kda_gate_beta(torch.zeros(2, 24, device=DEV), torch.zeros(2, 2, device=DEV),
                        torch.ones(3, device=DEV), torch.zeros(24, device=DEV), -5.0, 3)


@pytest.mark.parametrize("T,I,lin", [(1, 256, 25.0), (9, 300, None), (33, 1024, 25.0)])
def test_situ_pair_equals_the_chain(T, I, lin):
    """SiTU of two GEMM outputs (column views): the kernel's tanh is 2·sigmoid(2x) − 1, so
    the bf16 outputs may differ by an ulp where the fp32 values straddle a rounding boundary."""
    seed = fresh_seed()
    g = _gen(seed)
    buf = (3 * torch.randn(T, 2 * I + 8, generator=g, device=DEV)).to(BF)
    gate, up = buf[:, :I], buf[:, I + 8:]
    got = E.situ_pair(gate, up, 2.0, lin)
    want = E.situ_pair_reference(gate, up, 2.0, lin)
    assert got.dtype == BF and got.shape == (T, I)
    ulp = (want.float().abs() * 2 ** -7).clamp_min(1e-30)
    assert ((got.float() - want.float()).abs() <= ulp).all(), f"seed {seed}"
    assert (got != want).float().mean().item() < 0.01, f"seed {seed}"


@pytest.mark.parametrize("T,N", [(1, 7168), (5, 300), (17, 2048), (3, 4097)])
def test_add_rounded_is_the_bf16_add_of_the_rounded_sum(T, N, monkeypatch):
    """The MoE block's last add: the latent-up output (bf16) plus the shared experts' fp32
    sum, read as a column view of the (T, L + H) buffer, rounded as the chain rounds it (b to
    bf16, then the bf16 add): bit-equal on the GPU, written into a; the wrong width is
    named. On the CPU the interpreter runs the kernel (the CUDA-only dispatch check lifted);
    its fp32 → bf16 casts truncate whatever the rounding asked for, so there the two
    roundings may land two bf16 ulps from the chain's."""
    if not ON_GPU:
        monkeypatch.setattr(E, "_serves", lambda *ts: True)
    seed = fresh_seed()
    g = _gen(seed)
    a = torch.randn(T, N, generator=g, device=DEV).to(BF)
    both = 4 * torch.randn(T, 96 + N, generator=g, device=DEV)
    b = both[:, 96:]
    a0 = a.clone()
    want = E.add_rounded_reference(a0, b)
    assert not torch.equal(want, a0), f"seed {seed}: b added nothing"
    got = E.add_rounded(a, b)
    assert got.dtype == BF and got.shape == (T, N)
    if ON_GPU:
        assert torch.equal(got, want), f"seed {seed}"
    else:
        mag = torch.maximum(a0.float().abs(), b.abs()).maximum(want.float().abs())
        ulp2 = (mag * 2 ** -6).clamp_min(2 ** -126)         # the inputs' ulps (cancellation)
        assert ((got.float() - want.float()).abs() <= ulp2).all(), f"seed {seed}"
    assert got.data_ptr() == a.data_ptr()               # in place: no new (T, N) tensor
    with pytest.raises(ValueError, match="add_rounded"):
        E.add_rounded(a, both)
