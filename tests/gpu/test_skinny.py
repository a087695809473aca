"""The skinny tensor-core GEMM (kernels/gemm_skinny_triton.py) against the fp64 product, and its
place in `gemv.linear`'s dispatch.

GPU: every case, the K3 TP16 shapes and CUDA graph replays. CPU: the small cases through the
interpreter, `TRITON_INTERPRET=1 python -m pytest tests/gpu/test_skinny.py -q`.

Fresh random inputs per case (seed from os.urandom, in every failure message); `out` is NaN
before the call, so an element the kernel never writes fails. Tolerance, ‖y − x·Wᵀ‖ / ‖x·Wᵀ‖
in fp64: 1e-5 for the fp32 output (exact bf16 products, fp32 sums), 4e-3 for bf16 (one
rounding). Split-K cases run twice on the same output: the second call only finds its row
blocks' counters at zero if the first call's last programs reset them.
"""
from __future__ import annotations

import os

import pytest
import torch

from raydecode.kernels import gemm_skinny_triton as S
from raydecode.kernels import gemv as G
from raydecode.kernels import linear as LN
from raydecode.kernels.settings import DecodeOptions

from _numerics import fresh_seed, rel_err

ON_GPU = torch.cuda.is_available() and S.triton is not None
INTERPRET = (not torch.cuda.is_available() and S.triton is not None
             and os.environ.get("TRITON_INTERPRET") == "1")
pytestmark = pytest.mark.skipif(not (ON_GPU or INTERPRET),
                                reason="needs CUDA and Triton (or TRITON_INTERPRET=1)")
gpu_only = pytest.mark.skipif(not ON_GPU, reason="K3 shapes / CUDA graphs: GPU only")
DEV = "cuda" if ON_GPU else "cpu"
BF = torch.bfloat16


def _case(M, N, K, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(M, K, generator=g, device=DEV).to(BF)
    w = (torch.randn(N, K, generator=g, device=DEV) / K ** 0.5).to(BF)
    return x, w, x.double() @ w.double().t()


def _check(M, N, K, cfg, dt, calls=2):
    seed = fresh_seed()
    x, w, ref = _case(M, N, K, seed)
    out = torch.full((M, N), float("nan"), dtype=dt, device=DEV)
    for _ in range(calls):
        res = S.skinny_gemm(x, w, out_dtype=dt, config=cfg, out=out)
        assert res is out
        err = rel_err(out, ref)
        tol = 1e-5 if dt == torch.float32 else 4e-3
        assert torch.isfinite(out).all() and err <= tol, \
            f"seed {seed} M={M} N={N} K={K} {cfg} {dt}: rel err {err:.3g}"
        out.fill_(float("nan"))


SMALL = [(1, 200, 256, None), (2, 130, 512, S.SkinnyConfig(bn=32, bk=64, ks=4)),
         (3, 200, 256, None), (8, 130, 512, S.SkinnyConfig(bn=32, bk=64, ks=4)),
         (16, 64, 384, S.SkinnyConfig(bn=16, bk=128, ks=3)),
         (33, 96, 384, S.SkinnyConfig(bn=64, bk=32, ks=12)),
         (64, 72, 256, S.SkinnyConfig(bn=64, bk=32, ks=8, stages=3))]


@pytest.mark.parametrize("M,N,K,cfg", SMALL)
@pytest.mark.parametrize("dt", [torch.float32, BF], ids=["f32", "bf16"])
def test_skinny_matches_the_product(M, N, K, cfg, dt):
    _check(M, N, K, cfg, dt)


K3_TP16 = [(3216, 7168), (7168, 768), (1048, 7168), (900, 7168), (1152, 1536), (7168, 640)]


@gpu_only
@pytest.mark.parametrize("N,K", K3_TP16)
@pytest.mark.parametrize("M", [1, 2, 4, 8, 16, 32, 64])
def test_skinny_k3_shapes_default_config(M, N, K):
    _check(M, N, K, None, BF)
    _check(M, N, K, None, torch.float32, calls=1)


@gpu_only
def test_skinny_graph_replays_follow_new_inputs():
    """Captured once (split-K: the counters must reset inside the graph), replayed over new x."""
    seed = fresh_seed()
    M, N, K = 8, 900, 7168
    cfg = S.default_config(M, N, K)
    assert cfg.ks > 1
    x, w, _ = _case(M, N, K, seed)
    out = torch.empty(M, N, dtype=BF, device=DEV)
    S.skinny_gemm(x, w, config=cfg, out=out)          # warm-up: compile, scratch
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        S.skinny_gemm(x, w, config=cfg, out=out)
    for i in range(3):
        x.copy_(torch.randn(M, K, device=DEV).to(BF))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref = x.double() @ w.double().t()
        assert rel_err(out, ref) <= 4e-3, f"seed {seed} replay {i}"


def test_bad_inputs_and_configs_are_named():
    x = torch.zeros(8, 256, dtype=BF, device=DEV)
    w = torch.zeros(64, 256, dtype=BF, device=DEV)
    with pytest.raises(ValueError, match="ks 3: need ≥ 1 dividing K/bk = 2"):
        S.skinny_gemm(x, w, config=S.SkinnyConfig(bk=128, ks=3))
    with pytest.raises(ValueError, match="M=0: the skinny GEMM serves 1 ≤ M ≤ 64"):
        S.skinny_gemm(x[:0], w)
    with pytest.raises(ValueError, match="out_dtype=torch.float16"):
        S.skinny_gemm(x, w, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="x torch.float32"):
        S.skinny_gemm(x.float(), w)
    assert not S.supports(x[:, :250].contiguous(), w[:, :250].contiguous())     # K % 32


@gpu_only
def test_linear_takes_the_skinny_gemm_when_enabled(monkeypatch):
    """`linear` at M = 8: cuBLAS while skinny_max_m = 0, the skinny kernel (recorded) once it
    covers M; both within bf16 tolerance of the product, fp32 output unrounded."""
    seed = fresh_seed()
    x, w, ref = _case(8, 1048, 7168, seed)
    ran = []
    real = S.skinny_gemm
    monkeypatch.setattr(S, "skinny_gemm", lambda *a, **k: ran.append(1) or real(*a, **k))
    off, on = DecodeOptions(skinny_max_m=0), DecodeOptions(skinny_max_m=64)
    assert rel_err(LN.linear(x, w, options=off), ref) <= 4e-3 and not ran
    assert rel_err(LN.linear(x, w, options=on), ref) <= 4e-3 and len(ran) == 1
    y32 = LN.linear(x, w, torch.float32, options=on)
    assert y32.dtype == torch.float32 and rel_err(y32, ref) <= 1e-5 and len(ran) == 2


@gpu_only
@pytest.mark.parametrize("M", [1, 5, 16, 17])
def test_stock_linear_takes_the_skinny_gemm_for_decode_batches(M, monkeypatch):
    """The stock path's GEMM (models/layers.py `stock_linear`: `linear_for("stock")` and the
    stock MoE's latent projections): the skinny kernel (recorded) for CUDA bf16 rows 1 to
    STOCK_SKINNY_MAX_M, F.linear past it and with STOCK_SKINNY_MAX_M = 0; within bf16
    tolerance either way, the leading dims kept."""
    from raydecode.models import layers
    seed = fresh_seed()
    x, w, ref = _case(M, 1048, 7168, seed)
    ran = []
    real = S.skinny_gemm
    monkeypatch.setattr(S, "skinny_gemm", lambda *a, **k: ran.append(1) or real(*a, **k))
    y = layers.stock_linear(x.view(1, M, -1), w)
    assert y.shape == (1, M, 1048) and rel_err(y[0], ref) <= 4e-3, f"seed {seed}"
    assert len(ran) == (M <= layers.STOCK_SKINNY_MAX_M), f"M={M}: skinny calls {ran}"
    n = len(ran)
    monkeypatch.setattr(layers, "STOCK_SKINNY_MAX_M", 0)
    assert rel_err(layers.stock_linear(x, w), ref) <= 4e-3
    assert len(ran) == n, "STOCK_SKINNY_MAX_M = 0 still ran the skinny kernel"


@gpu_only
def test_first_split_k_call_under_capture_is_refused_and_linear_falls_back(monkeypatch):
    """Split-K counters zeroed inside a capture would be zeroed by that graph only: a first
    split-K call under capture raises (naming the shape), `supports` says no, and
    `gemv.linear` runs cuBLAS in the graph instead; after one eager call both go through."""
    seed = fresh_seed()
    N, K = 900, 7168
    x, w, ref = _case(8, N, K, seed)
    cfg = S.default_config(8, N, K)
    assert cfg.ks > 1
    monkeypatch.setattr(S, "_SCRATCH", {})
    on = DecodeOptions(skinny_max_m=16)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        assert not S.supports(x, w)
        with pytest.raises(ValueError, match="first split-K call for N=900"):
            S.skinny_gemm(x, w)
        y = LN.linear(x, w, options=on)                     # cuBLAS in the graph
    g.replay()
    torch.cuda.synchronize()
    assert rel_err(y, ref) <= 4e-3, f"seed {seed}"
    S.skinny_gemm(x, w)                                     # eager: scratch allocated
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):
        assert S.supports(x, w)
        y2 = LN.linear(x, w, options=on)
    y2.fill_(float("nan"))
    g2.replay()
    torch.cuda.synchronize()
    assert rel_err(y2, ref) <= 4e-3, f"seed {seed}"
