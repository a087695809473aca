"""kernels/moe_grouped.py on the CPU (its PyTorch path: `unpack_mxfp4`, `torch._grouped_mm`,
an fp32 index_add): the dequantize-then-grouped-GEMM experts against `moe_mxfp4_reference`
on fresh random weights, inputs and routing, into a column block of a wider buffer, and its
input checks. The Triton kernels are tests/gpu/test_moe_grouped.py's."""
from __future__ import annotations

import pytest
import torch

from raydecode.kernels import moe_grouped as G
from raydecode.kernels import moe_mxfp4 as M

from _numerics import fresh_seed, rel_err

pytestmark = pytest.mark.skipif(M._use_triton(torch.zeros(1)),
                                reason="TRITON_INTERPRET=1: the GPU test file runs Triton")


def _case(E, L, I, k, T, seed, skew=False):
    gen = torch.Generator().manual_seed(seed)
    ex = M.MXFP4Experts.random(E, L, I, 4.0, 25.0, seed=seed).validate()
    z = torch.randn(T, L, generator=gen).to(torch.bfloat16)
    scores = torch.rand(T, E, generator=gen)
    if skew:                        # every token's first choice expert 2; some experts unused
        scores[:, 2] = 2.0
        scores[:, E // 2:] = -1.0
    w, ids = scores.topk(k, dim=-1)
    return ex, z, (w / w.sum(-1, keepdim=True)).float(), ids


@pytest.mark.parametrize("E,L,I,k,T", [(8, 64, 32, 2, 40), (16, 128, 96, 4, 33)])
@pytest.mark.parametrize("skew", [False, True])
def test_grouped_matches_the_reference(E, L, I, k, T, skew):
    seed = fresh_seed()
    ex, z, w, ids = _case(E, L, I, k, T, seed, skew)
    out = G.moe_mxfp4_grouped(z, w, ids, ex)
    ref = M.moe_mxfp4_reference(z, w, ids, ex)
    assert out.shape == (T, L) and out.dtype == torch.float32
    assert rel_err(out, ref) < 1e-2, f"seed {seed}: rel err {rel_err(out, ref):.2e}"


def test_grouped_writes_a_column_block_and_is_the_configs_path():
    """`out` a column block of a (T, L + 8) buffer: the block written, the rest untouched;
    MoEConfig.grouped_bf16 sends fused_moe_mxfp4_triton here (called directly: the CPU has
    no Triton launch to make on this path)."""
    seed = fresh_seed()
    ex, z, w, ids = _case(8, 64, 32, 2, 24, seed)
    buf = torch.full((24, 72), 7.0)
    G.moe_mxfp4_grouped(z, w, ids, ex, out=buf[:, :64])
    ref = M.moe_mxfp4_reference(z, w, ids, ex)
    assert rel_err(buf[:, :64], ref) < 1e-2, f"seed {seed}"
    assert (buf[:, 64:] == 7.0).all()
    cfg = M.MoEConfig(64, 64, 64, 32, grouped_bf16=True)
    via = M.fused_moe_mxfp4_triton(z, w, ids, ex, cfg)
    assert torch.equal(via, G.moe_mxfp4_grouped(z, w, ids, ex))


def test_grouped_refuses_a_non_bf16_input():
    ex, z, w, ids = _case(8, 64, 32, 2, 4, 0)
    with pytest.raises(ValueError, match="grouped experts: z torch.float32"):
        G.moe_mxfp4_grouped(z.float(), w, ids, ex)


def test_grouped_pairs_switch(monkeypatch):
    """GROUPED_PAIRS picks the grouped path for an eager CUDA call of that many pairs or more
    and never on the CPU, below it, at 0 (as shipped), or where an explicit config says
    otherwise."""
    assert M.GROUPED_PAIRS == 0, "shipped off: measured slower than the split kernel"
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(M, "GROUPED_PAIRS", 4096)
    assert M.grouped_wanted(4096, cuda) and M.grouped_wanted(1 << 17, cuda)
    assert not M.grouped_wanted(4095, cuda)
    assert not M.grouped_wanted(1 << 17, torch.device("cpu"))
    assert not M.grouped_wanted(1 << 17, cuda, M.prefill_config(64, 32))
    assert M.grouped_wanted(8, torch.device("cpu"), M.MoEConfig(64, 64, 64, 32,
                                                                grouped_bf16=True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not M.grouped_wanted(1 << 17, cuda), "a graph capture never takes the grouped path"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    assert not M.grouped_wanted(1 << 17, cuda), "sm80 has no grouped_mm kernels"
    monkeypatch.setattr(M, "GROUPED_PAIRS", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert not M.grouped_wanted(1 << 17, cuda)
