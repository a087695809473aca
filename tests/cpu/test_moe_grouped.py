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
