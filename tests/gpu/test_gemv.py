"""CuTe GEMV vs the fp64 reference on K3 per-rank shapes (needs CUDA + nvidia-cutlass-dsl).

Fresh random inputs every case (seed printed on failure), output poisoned with NaN before each
call so an unwritten element fails, error measured as ‖y − ref‖ / ‖ref‖ against an fp64 product.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

from raydecode.kernels import gemv as G
from raydecode.kernels import linear as LN
from raydecode.kernels.settings import DEFAULT_OPTIONS
from raydecode.kernels._cute import cute_available

pytestmark = pytest.mark.skipif(not cute_available(), reason="needs CUDA and nvidia-cutlass-dsl")

# Unique K3 per-rank (N, K) at TP16 and TP8 (scripts/bench/gemv.py names them).
SHAPES = [
    (1152, 1536), (2304, 1536), (2112, 7168), (3216, 7168), (6288, 7168), (7168, 768),
    (7168, 1536), (3584, 7168), (7168, 3584), (896, 7168), (768, 7168), (1536, 7168),
    (7168, 384), (10240, 7168), (20480, 7168),
    (1048, 7168), (7168, 640), (900, 7168), (2096, 7168), (7168, 1280), (1800, 7168),
]
MS = [1, 2, 4, 16, 64]

# ‖y − ref‖/‖ref‖ bound per dtype: bf16 output rounding alone is ≈ 2⁻⁹/√3 ≈ 1.1e-3 relative rms;
# fp32 accumulation adds < 1e-5 at K ≤ 7168.
REL_TOL = {torch.bfloat16: 4e-3}
# elementwise: |y − ref| ≤ 2⁻⁸·|ref| (one bf16 ulp) + ATOL_SCALE·‖ref‖∞ (accumulation-order slack)
ATOL_SCALE = 1e-3


def _inputs(M: int, N: int, K: int, dtype=torch.bfloat16):
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", dtype=dtype, generator=gen)
    w = torch.randn(N, K, device="cuda", dtype=dtype, generator=gen) / K**0.5
    return x, w, seed


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, seed: int) -> None:
    ref = x.double() @ w.double().t()
    assert torch.isfinite(out).all(), f"unwritten/NaN outputs (seed {seed})"
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < REL_TOL[x.dtype], f"rel err {rel:.2e} (seed {seed})"
    bound = 2.0**-8 * ref.abs() + ATOL_SCALE * ref.abs().max()
    bad = ((out.double() - ref).abs() > bound).sum().item()
    assert bad == 0, f"{bad} elements outside one bf16 ulp + slack (seed {seed})"


@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("N,K", SHAPES)
def test_gemv_matches_reference(M: int, N: int, K: int):
    x, w, seed = _inputs(M, N, K)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=x.dtype)
    G.gemv(x, w, out=out)
    torch.cuda.synchronize()
    _check(out, x, w, seed)


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize(
    "cfg",
    [
        G.GemvConfig(32, 1, 1, 4, 1),  # one row per lane group, no split-K
        G.GemvConfig(32, 4, 1, 2, 1),  # split-K over 4 warps through shared memory
        G.GemvConfig(32, 7, 1, 1, 1, 2),  # odd split-K, small load batch
        G.GemvConfig(16, 1, 2, 4, 1),  # two lane groups per warp, two rows each
        G.GemvConfig(32, 14, 4, 1, 1),  # 14 split-K warps × 4 rows (tuned router mapping)
    ],
)
def test_gemv_configs_agree(cfg: G.GemvConfig, pdl: bool):
    """Every thread mapping, with and without PDL, computes the same function (896×7168, M=1)."""
    cfg = dataclasses.replace(cfg, pdl=pdl)
    M, N, K = 1, 896, 7168
    x, w, seed = _inputs(M, N, K)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=x.dtype)
    G.gemv_into(x, w, out, cfg)
    torch.cuda.synchronize()
    _check(out, x, w, seed)


@pytest.mark.parametrize("mib", [1, 32])
@pytest.mark.parametrize("M,N,K", [(1, 3584, 7168), (1, 7168, 768), (2, 896, 7168), (1, 10240, 7168)])
def test_gemv_l2_prefetch_computes_the_same_function(M: int, N: int, K: int, mib: int):
    """The entry L2 prefetch (whole rows under the budget, leading bytes past it: 1 MiB gives
    partial rows everywhere, 32 MiB whole rows except lm_head) only warms L2: the result is the
    reference's, in a graph replayed after the weights change too."""
    cfg = dataclasses.replace(G.config_for(M, N, K), pdl=True, l2_prefetch_mib=mib)
    assert 0 < cfg.prefetch_row_bytes(N, K) <= 2 * K
    _graph_follows_new_inputs(M, N, K, cfg, replays=1)


def _graph_follows_new_inputs(M: int, N: int, K: int, cfg=None, replays: int = 2) -> None:
    """Captured once (after a compile and a side-stream warm-up), replayed after x and W change
    in place: each replay's result is the new inputs' reference."""
    x, w, _ = _inputs(M, N, K)
    out = torch.empty((M, N), device="cuda", dtype=x.dtype)
    G.gemv_into(x, w, out, cfg)  # compile outside capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        G.gemv_into(x, w, out, cfg)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        G.gemv_into(x, w, out, cfg)
    for _ in range(replays):
        x2, w2, seed = _inputs(M, N, K)
        x.copy_(x2)
        w.copy_(w2)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        _check(out, x, w, seed)


def test_gemv_replays_in_cuda_graph_with_new_inputs():
    """Captured once, replayed after the inputs change in place: the result follows the inputs."""
    _graph_follows_new_inputs(1, 3584, 7168)


def test_pdl_chain_in_graph_orders_dependent_gemvs():
    """y1 = x·W1ᵀ then y2 = y1·W2ᵀ, both PDL launches in one graph: the second kernel's early W
    loads may overlap the first, but its x (= y1) reads must wait for the first to finish."""
    K, H = 7168, 1536
    x, w1, _ = _inputs(1, H, K)
    _, w2, _ = _inputs(1, K, H)
    cfg1 = dataclasses.replace(G.config_for(1, H, K), pdl=True)
    cfg2 = dataclasses.replace(G.config_for(1, K, H), pdl=True)
    y1 = torch.empty(1, H, device="cuda", dtype=x.dtype)
    y2 = torch.empty(1, K, device="cuda", dtype=x.dtype)
    G.gemv_into(x, w1, y1, cfg1)
    G.gemv_into(y1, w2, y2, cfg2)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        G.gemv_into(x, w1, y1, cfg1)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        G.gemv_into(x, w1, y1, cfg1)
        G.gemv_into(y1, w2, y2, cfg2)
    for _ in range(3):
        x2, w12, seed = _inputs(1, H, K)
        x.copy_(x2)
        w1.copy_(w12)
        y1.fill_(float("nan"))
        y2.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        _check(y1, x, w1, seed)
        _check(y2, y1, w2, seed)  # reference from the y1 the first kernel wrote


def test_linear_dispatch_uses_kernel_and_falls_back():
    x, w, seed = _inputs(2, 2304, 1536)
    assert LN.linear_uses_cute(2, 2304, 1536)
    _check(LN.linear(x, w), x, w, seed)
    x3 = x.reshape(1, 2, 1536)
    assert LN.linear(x3, w).shape == (1, 2, 2304)
    big, w2, _ = _inputs(32, 2304, 1536)  # M > 2: cuBLAS, bit-identical to F.linear
    assert torch.equal(LN.linear(big, w2), F.linear(big, w2))
    odd = torch.randn(1, 1540, device="cuda", dtype=torch.bfloat16)  # K not 16-byte aligned
    wo = torch.randn(64, 1540, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(LN.linear(odd, wo), F.linear(odd, wo))


def test_gemv_rejects_bad_out():
    x, w, _ = _inputs(1, 1152, 1536)
    with pytest.raises(ValueError, match="out must be"):
        G.gemv(x, w, out=torch.empty(1, 1151, device="cuda", dtype=x.dtype))
    with pytest.raises(ValueError, match="unsupported"):
        G.gemv(x.float(), w.float())


# The packed GEMVs of the specialized step: [router ‖ latent down ‖ shared gate|up] rows with
# fp32 output (TP16 1048, TP8 2096 rows) and [latent up ‖ shared down ‖ 0] over a padded K.
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("N,K", [(1048, 7168), (2096, 7168), (7168, 640), (7168, 1280)])
def test_gemv_fp32_out_and_fused_shapes(M: int, N: int, K: int):
    x, w, seed = _inputs(M, N, K)
    y32 = torch.full((M, N), float("nan"), device="cuda")
    G.gemv(x, w, out=y32)
    ref = x.double() @ w.double().t()
    assert torch.isfinite(y32).all(), f"seed {seed}"
    rel = ((y32.double() - ref).norm() / ref.norm()).item()
    assert rel < 1e-5, f"fp32 out rel err {rel:.2e} (seed {seed})"     # no bf16 rounding
    y16 = G.gemv(x, w)
    assert (y16.float() - y32.to(torch.bfloat16).float()).abs().max() <= \
        2.0**-7 * y32.abs().max(), f"bf16 out is not the rounded fp32 out (seed {seed})"
    l32 = LN.linear(x, w, torch.float32)     # the kernel where `linear` picks it, else cuBLAS
    want = y32 if LN.linear_uses_cute(M, N, K) else LN.linear_f32_reference(x, w)
    assert l32.dtype == torch.float32 and torch.equal(l32, want), f"seed {seed}"


def test_linear_fp32_out_above_kernel_batches_is_cublas_fp32():
    """Past the CuTe GEMV's and the skinny GEMM's batches (M > skinny_max_m), fp32 output is
    cuBLAS's fp32 product, bit for bit (tests/gpu/test_skinny.py covers M ≤ skinny_max_m)."""
    x, w, seed = _inputs(DEFAULT_OPTIONS.skinny_max_m + 8, 1048, 7168)
    y = LN.linear(x, w, torch.float32)
    assert y.dtype == torch.float32
    assert torch.equal(y, LN.linear_f32_reference(x, w)), f"seed {seed}"
