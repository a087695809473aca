"""kernels/moe_grouped.py's Triton path (CUDA, or the interpreter with TRITON_INTERPRET=1):
the dequantization kernel against `unpack_mxfp4` (bitwise, experts without pairs skipped),
and the dequantize-then-grouped-GEMM experts against `moe_mxfp4_reference` (fresh random
weights, inputs and routing; the allocator poisoned with NaN so an unwritten row shows)."""
from __future__ import annotations

import os

import pytest
import torch

from raydecode.kernels import moe_grouped as G
from raydecode.kernels import moe_mxfp4 as M
from raydecode.models.mxfp4 import unpack_mxfp4

from _numerics import fresh_seed, rel_err

ON_GPU = (torch.cuda.is_available() and M.triton is not None
          and torch.cuda.get_device_capability() >= (9, 0))
INTERPRET = (not torch.cuda.is_available() and M.triton is not None
             and os.environ.get("TRITON_INTERPRET") == "1")
pytestmark = pytest.mark.skipif(not (ON_GPU or INTERPRET),
                                reason="needs CUDA sm90+ and Triton (or TRITON_INTERPRET=1)")
DEV = "cuda" if ON_GPU else "cpu"
REL_TOL = 1e-2 if ON_GPU else 2.5e-2      # the interpreter truncates fp32 -> bf16
SHAPES = [(16, 128, 96, 2, 24)] + ([(896, 3584, 192, 16, 256)] if ON_GPU else [])


def _case(E, L, I, k, T, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    ex = M.MXFP4Experts.random(E, L, I, 4.0, 25.0, device=DEV, seed=seed).validate()
    z = torch.randn(T, L, generator=gen, device=DEV).to(torch.bfloat16)
    scores = torch.rand(T, E, generator=gen, device=DEV)
    scores[:, E // 2:] = -1.0                   # half the experts never chosen: skipped
    w, ids = scores.topk(k, dim=-1)
    return ex, z, (w / w.sum(-1, keepdim=True)).float(), ids


def test_dequant_kernel_equals_unpack_and_skips_unused_experts():
    seed = fresh_seed()
    ex = M.MXFP4Experts.random(6, 128, 96, 4.0, None, device=DEV, seed=seed)
    counts = torch.tensor([3, 0, 1, 0, 0, 7], device=DEV)
    for packed, scales in ((ex.w13, ex.s13), (ex.w2, ex.s2)):
        got = G.dequant_experts(packed, scales, counts)
        want = unpack_mxfp4(packed, scales, torch.bfloat16)
        used = counts > 0
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert torch.equal(got[used], want[used]), f"seed {seed}"


@pytest.mark.parametrize("E,L,I,k,T", SHAPES)
def test_grouped_matches_the_reference(E, L, I, k, T):
    seed = fresh_seed()
    ex, z, w, ids = _case(E, L, I, k, T, seed)
    if DEV == "cuda":
        torch.empty(1 << 26, device=DEV).fill_(float("nan"))     # freed, then reused
    out = M.fused_moe_mxfp4(z, w, ids, ex, M.MoEConfig(64, 64, 64, 32, grouped_bf16=True))
    ref = M.moe_mxfp4_reference(z, w, ids, ex)
    assert torch.isfinite(out).all(), f"seed {seed}: unwritten (NaN) output"
    assert rel_err(out, ref) < REL_TOL, f"seed {seed}: rel err {rel_err(out, ref):.2e}"
