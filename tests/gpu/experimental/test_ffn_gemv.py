"""The fused latent-norm + SiTU + FFN-out GEMV kernels (kernels/experimental/ffn_gemv_triton.py and its CuTe
form kernels/gemv_norm_situ.py, every case once per form on a GPU) against the composition they
replace, `latent_norm_situ_reference` then F.linear.

GPU: every case. CPU: the small cases and K3's columns on 96 rows run the kernel through the
interpreter, `TRITON_INTERPRET=1 python -m pytest tests/gpu/test_ffn_gemv.py -q`; the full K3
shapes (N = 7168), T > 8 and CUDA graphs are GPU only.

Fresh random inputs per case (seed from os.urandom, in every failure message); `out` is
preallocated NaN (or the caching allocator is poisoned with NaN first), so an element the
kernel never writes fails the check. Tolerance: ‖out − ref‖ / ‖ref‖ (fp64) ≤ 4e-3 against
the reference composition and against x_ref · Wᵀ in fp64: both sides round x and the output
to bf16 at the same points; they differ by the fp32 summation order and the SiTU/rsqrt forms
(a rare 1-ulp flip of an x element). The kernel rounds by hand under the interpreter (whose
.to(bf16) truncates), so the same tolerance holds there.
"""
from __future__ import annotations

import os

import pytest
import torch

from raydecode.kernels import decode_elementwise_triton as X
from raydecode.kernels.experimental import ffn_gemv_triton as FG
from raydecode.kernels import gemv_norm_situ as NS

from _numerics import fresh_seed, rel_err

ON_GPU = torch.cuda.is_available() and FG.triton is not None
INTERPRET = (not torch.cuda.is_available() and FG.triton is not None
             and os.environ.get("TRITON_INTERPRET") == "1")
pytestmark = pytest.mark.skipif(not (ON_GPU or INTERPRET),
                                reason="needs CUDA and Triton (or TRITON_INTERPRET=1 for the "
                                       "small cases)")
gpu_only = pytest.mark.skipif(not ON_GPU, reason="K3 shapes / T > 8 / CUDA graphs: GPU only")
DEV = "cuda" if ON_GPU else "cpu"
BF = torch.bfloat16
TOL = 4e-3
BETA, LIN = 4.0, 25.0          # K3 situ_beta, situ_linear_beta
K3 = {"tp16": (3584, 224, 384, 640, 7168), "tp8": (3584, 448, 768, 1280, 7168)}  # D n I K N


@pytest.fixture(autouse=True, params=[True, False] if ON_GPU else [False],
                ids=["cute", "triton"] if ON_GPU else ["triton"])
def form(request, monkeypatch):
    """Each case with the CuTe form (kernels/gemv_norm_situ.py, T ≤ 2 where it serves) and
    with the Triton kernel alone (ffn_gemv_triton.USE_CUTE)."""
    monkeypatch.setattr(FG, "USE_CUTE", request.param)
    return request.param


def _poison(nbytes: int = 1 << 28) -> None:
    if ON_GPU:      # freed, then reused by the next allocations of the caching allocator
        torch.empty(nbytes // 4, device=DEV).fill_(float("nan"))


def _inputs(T, D, I, K, N, seed, gu_dtype=torch.float32, lead=56):
    """lat (T, D) fp32, w (D,), gu (T, 2I) a strided column slice of a wider GEMV output
    (`lead` columns before it, as y2[:, router ‖ latent down ‖ gate|up]), W (N, K) bf16."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    lat = 3 * torch.randn(T, D, generator=g, device=DEV)
    w = 1 + 0.1 * torch.randn(D, generator=g, device=DEV)
    wide = 4 * torch.randn(T, lead + 2 * I, generator=g, device=DEV)
    gu = wide.to(gu_dtype)[:, lead:]
    W = (torch.randn(N, K, generator=g, device=DEV) / K ** 0.5).to(BF)
    return lat, w, gu, W


def _check(T, D, c0, n, I, K, N, lin, seed, gu_dtype=torch.float32, kernel=True):
    lat, w, gu, W = _inputs(T, D, I, K, N, seed, gu_dtype)
    assert FG.uses_kernel(lat, n, gu, W) == kernel, f"seed {seed}"
    out = torch.full((T, N), float("nan"), dtype=BF, device=DEV)
    FG.norm_situ_gemv(lat, w, 1e-6, c0, n, gu, BETA, lin, W, out=out)
    x = X.latent_norm_situ_reference(lat, w, 1e-6, c0, n, gu, BETA, lin, K)
    ref = torch.nn.functional.linear(x, W)
    exact = x.double() @ W.double().t()
    msg = f"seed {seed} T={T} c0={c0} n={n} I={I} K={K} N={N} lin={lin}"
    assert not out.isnan().any(), f"{msg}: unwritten {out.isnan().nonzero()[:4].tolist()}"
    assert rel_err(out, ref) <= TOL, f"{msg}: rel {rel_err(out, ref):.2e} vs reference"
    assert rel_err(out, exact) <= TOL, f"{msg}: rel {rel_err(out, exact):.2e} vs fp64"
    return out


# (D, c0, n, I, K, N): c0 ≠ 0 and n not a multiple of 8; I = 48 → SiTU pieces 32 + 16; N not a
# multiple of BN (row mask); I = 64 → one SiTU piece; n = 0 → no latent columns
SMALL = [(256, 40, 36, 48, 96, 72), (200, 0, 16, 64, 88, 32), (64, 0, 0, 40, 48, 40)]


@pytest.mark.parametrize("T", [1, 2, 3, 8])
@pytest.mark.parametrize("shape", SMALL)
@pytest.mark.parametrize("lin", [None, LIN])
def test_small_shapes(T, shape, lin):
    _check(T, *shape, lin, fresh_seed())


@pytest.mark.parametrize("T", [1, 3])
def test_bf16_gate_up(T):
    _check(T, 256, 40, 36, 48, 96, 72, LIN, fresh_seed(), gu_dtype=BF)


@pytest.mark.parametrize("tp", ["tp16", "tp8"])
@pytest.mark.parametrize("T", [1, 3, 8])
def test_k3_columns_few_rows(tp, T):
    """K3's D, n, I, K (the real column pieces) on 96 rows of W: fast under the interpreter."""
    D, n, I, K, _ = K3[tp]
    _check(T, D, D - n, n, I, K, 96, LIN, fresh_seed())


@gpu_only
@pytest.mark.parametrize("tp", ["tp16", "tp8"])
@pytest.mark.parametrize("T", [1, 2, 3, 4, 8])
def test_k3_shapes(tp, T, form):
    D, n, I, K, N = K3[tp]
    lat, w, gu, W = _inputs(T, D, I, K, N, 0)
    # the CuTe form serves K3 TP16 at T = 1, where it beats the pair (bf16 and fp32 norm
    # weights: model and layer bench); TP8 and T ≥ 2 take the Triton kernel or the pair
    on = T == 1 and tp == "tp16" and NS.cute_available()
    assert NS.supports(lat, w, n, gu, W) == on
    assert NS.supports(lat, w.to(BF), n, gu, W) == on
    for c0 in (0, D - n):                 # rank 0 and the last rank's latent slice
        _check(T, D, c0, n, I, K, N, LIN, fresh_seed())


@gpu_only
@pytest.mark.parametrize("T", [16, 64])
def test_k3_above_max_t_uses_the_pair(T):
    D, n, I, K, N = K3["tp16"]
    _check(T, D, n, n, I, K, N, LIN, fresh_seed(), kernel=False)


@gpu_only
def test_allocating_call_writes_every_output():
    D, n, I, K, N = K3["tp8"]
    seed = fresh_seed()
    lat, w, gu, W = _inputs(2, D, I, K, N, seed)
    _poison()
    out = FG.norm_situ_gemv(lat, w, 1e-6, 0, n, gu, BETA, LIN, W)
    ref = FG.norm_situ_gemv_reference(lat, w, 1e-6, 0, n, gu, BETA, LIN, W)
    assert not out.isnan().any() and rel_err(out, ref) <= TOL, f"seed {seed}"


@gpu_only
@pytest.mark.parametrize("T", [1, 2])
def test_graph_replay_reads_new_inputs(T):
    D, n, I, K, N = K3["tp16"]
    seed = fresh_seed()
    lat, w, gu, W = _inputs(T, D, I, K, N, seed)
    out = torch.full((T, N), float("nan"), dtype=BF, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):            # warm-up outside capture: the Triton compile
        FG.norm_situ_gemv(lat, w, 1e-6, n, n, gu, BETA, LIN, W, out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        FG.norm_situ_gemv(lat, w, 1e-6, n, n, gu, BETA, LIN, W, out=out)
    for step in range(2):                 # new lat / gate|up in the captured buffers
        lat2, _, gu2, _ = _inputs(T, D, I, K, N, seed + 1 + step)
        lat.copy_(lat2)
        gu.copy_(gu2)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref = FG.norm_situ_gemv_reference(lat, w, 1e-6, n, n, gu, BETA, LIN, W)
        assert not out.isnan().any(), f"seed {seed} step {step}"
        assert rel_err(out, ref) <= TOL, f"seed {seed} step {step}: {rel_err(out, ref):.2e}"
