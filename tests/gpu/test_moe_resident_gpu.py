"""models/moe.py `RoutedExperts` with MXFP4-resident experts on CUDA: the stock path (grouped
`fused_moe_mxfp4`, chunked past 65536 pairs) and the specialized path (`moe_mxfp4_decode` for
few pairs) against `moe_mxfp4_reference` on the same packed bytes, fp32 and bf16 z, and CUDA
graph capture + replay with new inputs (no host sync). Needs CUDA + Triton.

Fresh random experts / inputs / routing per case (seed from os.urandom, in the message); the
caching allocator is NaN-poisoned first so unwritten output rows show up."""
from __future__ import annotations

import os

import pytest
import torch

from raydecode.kernels import moe_mxfp4 as M
from raydecode.models.moe import RoutedExperts
from raydecode.models.parallel import Parallel

from _numerics import fresh_seed, rel_err

ON_GPU = torch.cuda.is_available() and M.triton is not None
pytestmark = pytest.mark.skipif(not ON_GPU, reason="needs CUDA + Triton")
DEV = "cuda"
REL_TOL = 1e-2
# (E, L, full I, TP, top_k): K3 per rank at TP16 (I_local 192) and TP8 (384); the tiny preset
# (L 32, I 128); a small bench shape
SHAPES = [(896, 3584, 3072, 16, 16), (896, 3584, 3072, 8, 16), (8, 32, 128, 1, 2),
          (32, 128, 256, 2, 4)]


def _experts(E, L, I, tp, seed) -> RoutedExperts:
    with torch.device(DEV):
        ex = RoutedExperts(E, L, I, 4.0, 25.0, Parallel(0, tp), torch.bfloat16, mxfp4=True)
    ex.copy_experts_(M.MXFP4Experts.random(E, L, I // tp, 4.0, 25.0, device=DEV,
                                           seed=seed).validate())
    return ex


def _inputs(T, E, L, k, gen, dtype=torch.bfloat16):
    z = torch.randn(T, L, generator=gen, device=DEV).to(dtype)
    w, ids = torch.rand(T, E, generator=gen, device=DEV).topk(k, dim=-1)
    return z, (w / w.sum(-1, keepdim=True)).float(), ids


@pytest.mark.parametrize("E,L,I,tp,k", SHAPES)
@pytest.mark.parametrize("T", [1, 2, 4, 64])
@pytest.mark.parametrize("path", ["stock", "specialized"])
@pytest.mark.parametrize("zdtype", [torch.bfloat16, torch.float32])
def test_resident_paths_match_reference(E, L, I, tp, k, T, path, zdtype):
    seed = fresh_seed()
    ex = _experts(E, L, I, tp, seed)
    z, w, ids = _inputs(T, E, L, k, torch.Generator(device=DEV).manual_seed(seed), zdtype)
    torch.empty(1 << 26, device=DEV).fill_(float("nan"))            # freed, then reused
    out = ex(z, w, ids, path)
    ref = M.moe_mxfp4_reference(z.to(torch.bfloat16), w, ids, ex.packed())
    assert out.shape == (T, L) and out.dtype == torch.float32
    assert torch.isfinite(out).all(), f"seed {seed}: unwritten (NaN) output"
    assert rel_err(out, ref) < REL_TOL, f"seed {seed}: {path} rel err {rel_err(out, ref):.2e}"


def test_stock_path_chunks_past_the_runs_kernel_limit():
    """T·k > 65536 pairs: the stock path splits the tokens into launch groups."""
    seed = fresh_seed()
    E, L, I, k, T = 32, 128, 128, 4, 16_500
    ex = _experts(E, L, I, 1, seed)
    z, w, ids = _inputs(T, E, L, k, torch.Generator(device=DEV).manual_seed(seed))
    out = ex(z, w, ids, "stock")
    ref = M.moe_mxfp4_reference(z, w, ids, ex.packed())
    assert torch.isfinite(out).all() and rel_err(out, ref) < REL_TOL, f"seed {seed}"


@pytest.mark.parametrize("E,L,I,tp,k", SHAPES[:2])
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("path", ["stock", "specialized"])
def test_graph_capture_replays_new_inputs(E, L, I, tp, k, T, path):
    seed = fresh_seed()
    ex = _experts(E, L, I, tp, seed)
    z, w, ids = _inputs(T, E, L, k, torch.Generator(device=DEV).manual_seed(seed))
    ex(z, w, ids, path)                                  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ex(z, w, ids, path)
    for _ in range(2):
        z2, w2, ids2 = _inputs(T, E, L, k, torch.Generator(device=DEV).manual_seed(fresh_seed()))
        z.copy_(z2), w.copy_(w2), ids.copy_(ids2)
        g.replay()
        torch.cuda.synchronize()
        ref = M.moe_mxfp4_reference(z, w, ids, ex.packed())
        assert rel_err(out, ref) < REL_TOL, f"seed {seed}: {path} replay"
