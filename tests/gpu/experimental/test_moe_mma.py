"""Tensor-core few-token MXFP4 experts (kernels/experimental/moe_mxfp4_decode_mma.py) vs `moe_mxfp4_reference`
and vs the CUDA-core `moe_mxfp4_decode`, on the GPU (K3 TP16 / TP8 per-rank shapes, every sweep
candidate, CUDA graphs) and, small shapes only, under the CPU interpreter:

    TRITON_INTERPRET=1 python -m pytest tests/gpu/experimental/test_moe_mma.py -q

Fresh random inputs per case (seed from os.urandom, in every failure message); `out` starts as
NaN and on the GPU the caching allocator is poisoned with NaN first, so an element of `out` or
of the partials a kernel never writes fails the check. Tolerance: ‖out − ref‖ / ‖ref‖
≤ 1e-2 (three bf16 rounding points, as tests/gpu/test_fused_triton.py), 2.5e-2 under the
interpreter (it truncates fp32 → bf16 instead of rounding).
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from raydecode.kernels import moe_mxfp4 as M
from raydecode.kernels import moe_mxfp4_decode as D
from raydecode.kernels.experimental import moe_mxfp4_decode_mma as MM

from _numerics import TOL as NUM_TOL
from _numerics import fresh_seed, rel_err

ON_GPU = torch.cuda.is_available() and MM.triton is not None
INTERPRET = (not torch.cuda.is_available() and MM.triton is not None
             and os.environ.get("TRITON_INTERPRET") == "1")
pytestmark = pytest.mark.skipif(not (ON_GPU or INTERPRET),
                                reason="needs CUDA and Triton, or TRITON_INTERPRET=1 (small cases)")
gpu_only = pytest.mark.skipif(not ON_GPU, reason="K3 shapes / CUDA graphs: GPU only")
DEV = "cuda" if ON_GPU else "cpu"
BF = torch.bfloat16
TOL = NUM_TOL["bf16_3round"] if ON_GPU else NUM_TOL["interpreter"]
K3 = [(896, 3584, 192, 16), (896, 3584, 384, 16)]          # (E, L, I, k): TP16, TP8 per rank
SMALL = (16, 256, 64, 4)
# small-shape configs: split 4 / 1 and weights on M (interpreter: ~5 s per call at most)
SMALL_CFGS = [MM.MmaConfig(8, 64, 4, 2, 1, 16, 64, 2, 1),
              MM.MmaConfig(16, 128, 1, 4, 2, 32, 64, 4, 1, weights_m=True)]


def _poison(nbytes: int = 1 << 28) -> None:
    if ON_GPU:      # freed, then reused by the next allocations (the partials)
        torch.empty(nbytes // 4, device=DEV).fill_(float("nan"))


def _nan_out(T, L):
    return torch.full((T, L), float("nan"), dtype=torch.float32, device=DEV)


def _routing(T, E, k, g):
    w, ids = torch.rand(T, E, generator=g, device=DEV).topk(k, dim=-1)
    if T > 1:       # two tokens share an expert: both pairs read it and add into their rows
        ids[1, 0] = ids[0, 0] if ids[0, 0] not in ids[1] else ids[1, 0]
    return (w / w.sum(-1, keepdim=True)).float(), ids


def _case(E, L, I, k, T, seed, lin=25.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    ex = M.MXFP4Experts.random(E, L, I, 4.0, lin, device=DEV, seed=seed).validate()
    z = torch.randn(T, L, generator=g, device=DEV).to(BF)
    w, ids = _routing(T, E, k, g)
    return ex, z, w, ids, g


def _check(out, ref, seed, what=""):
    assert not out.isnan().any(), f"seed {seed} {what}: unwritten / unzeroed elements"
    assert rel_err(out, ref) <= TOL, f"seed {seed} {what}: rel {rel_err(out, ref):.3g}"


@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("cfg", SMALL_CFGS, ids=["split4", "weights_m"])
def test_mma_small_matches_reference_and_decode(T, cfg):
    """Small shapes (the interpreter's cases): vs the reference and the CUDA-core kernel."""
    seed = fresh_seed()
    ex, z, w, ids, _ = _case(*SMALL, T, seed, lin=None if T == 1 else 25.0)
    ref = M.moe_mxfp4_reference(z, w, ids, ex)
    out = _nan_out(T, SMALL[1])
    _poison()
    res = MM.moe_mxfp4_decode_mma(z, w, ids, ex, cfg, out=out)
    assert res is out
    _check(out, ref, seed, str(cfg))
    dec = D.moe_mxfp4_decode(z, w, ids, ex)
    assert rel_err(out, dec) <= TOL, f"seed {seed}: vs moe_mxfp4_decode {rel_err(out, dec):.3g}"


def test_mma_fp32_z_rounds_like_bf16():
    """fp32 z is rounded to bf16 on load: the same result as the bf16 call (atomics order
    only). Under the interpreter (which truncates) z32 holds bf16 values exactly."""
    seed = fresh_seed()
    E, L, I, k = K3[0] if ON_GPU else SMALL
    ex, zb, w, ids, g = _case(E, L, I, k, 2, seed)
    z32 = torch.randn(2, L, generator=g, device=DEV) if ON_GPU else zb.float()
    a = MM.moe_mxfp4_decode_mma(z32, w, ids, ex)
    b = MM.moe_mxfp4_decode_mma(z32.to(BF), w, ids, ex)
    assert rel_err(a, b) <= 1e-6, f"seed {seed}: {rel_err(a, b)}"


def test_mma_bad_config_and_inputs_rejected():
    ex, z, w, ids, _ = _case(*SMALL, 1, 0)
    I, L = ex.intermediate, ex.latent
    bad = {"gate_up_bn": ({"gate_up_bn": 12}, "gate_up_bn 12"),
           "gate_up_ks": ({"gate_up_ks": 3}, "gate_up_ks 3"),
           "gate_up_bk": ({"gate_up_ks": 2, "gate_up_bk": 256}, "gate_up_bk 256"),
           "down_bn": ({"down_bn": 8}, "down_bn 8"),
           "down_bk": ({"down_bk": 128}, "down_bk 128"),
           "warps": ({"down_warps": 3}, "down_warps 3"),
           "stages": ({"gate_up_stages": 0}, "gate_up_stages 0")}
    for name, (kw, msg) in bad.items():
        cfg = dataclasses.replace(MM.MmaConfig(), **kw)
        with pytest.raises(ValueError, match=msg):
            cfg.validate(I, L)
        with pytest.raises(ValueError, match=msg):      # refused before any launch
            MM.moe_mxfp4_decode_mma(z, w, ids, ex, cfg)
    for c in MM.candidates(ex.num_experts, I, L) + [MM.default_mma_config(16, I, L)]:
        assert c.validate(I, L) is c
    T = MM._cuda_core.MAX_PAIRS // 4 + 1                  # P = T·k past the pair limit
    ex2, z2, w2, ids2, _ = _case(*SMALL, T, 1)
    with pytest.raises(ValueError, match=f"{T * 4} \\(token, expert\\) pairs"):
        MM.moe_mxfp4_decode_mma(z2, w2, ids2, ex2)
    with pytest.raises(ValueError, match="z must be bf16 or fp32"):
        MM.moe_mxfp4_decode_mma(z.half(), w, ids, ex)


@gpu_only
@pytest.mark.parametrize("E,L,I,k", K3)
@pytest.mark.parametrize("T", [1, 2, 4])
@pytest.mark.parametrize("lin", [None, 25.0])
def test_mma_k3_default_matches_reference_and_decode(E, L, I, k, T, lin):
    seed = fresh_seed()
    ex, z, w, ids, _ = _case(E, L, I, k, T, seed, lin)
    ref = M.moe_mxfp4_reference(z, w, ids, ex)
    out = _nan_out(T, L)
    _poison()
    MM.moe_mxfp4_decode_mma(z, w, ids, ex, out=out)
    _check(out, ref, seed)
    dec = D.moe_mxfp4_decode(z, w, ids, ex)
    assert rel_err(out, dec) <= TOL, f"seed {seed}: vs moe_mxfp4_decode {rel_err(out, dec):.3g}"


@gpu_only
@pytest.mark.parametrize("E,L,I,k", K3)
@pytest.mark.parametrize("T", [1, 4])
def test_mma_every_candidate(E, L, I, k, T):
    """Each sweep candidate compiles and matches the reference (NaN out, poisoned partials)."""
    seed = fresh_seed()
    ex, z, w, ids, _ = _case(E, L, I, k, T, seed)
    ref = M.moe_mxfp4_reference(z, w, ids, ex)
    cands = MM.candidates(E, I, L)
    assert len(cands) >= 8 and any(c.weights_m for c in cands)
    for cfg in cands:
        out = _nan_out(T, L)
        _poison()
        MM.moe_mxfp4_decode_mma(z, w, ids, ex, cfg, out=out)
        _check(out, ref, seed, str(cfg))


@gpu_only
@pytest.mark.parametrize("I,weights_m", [(192, False), (192, True), (384, False)])
def test_mma_graph_replays_new_routing(I, weights_m):
    """Captured once (partials allocated inside the capture, PDL launches), replayed with new
    routings and new z; out re-zeroed by the kernel each replay."""
    seed = fresh_seed()
    E, L, k, T = 896, 3584, 16, 2
    ex, z, w, ids, g = _case(E, L, I, k, T, seed)
    cfg = next(c for c in MM.candidates(E, I, L) if c.weights_m == weights_m)
    out = torch.empty(T, L, device=DEV)
    MM.moe_mxfp4_decode_mma(z, w, ids, ex, cfg, out=out)
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        MM.moe_mxfp4_decode_mma(z, w, ids, ex, cfg, out=out)
    for _ in range(2):
        w2, i2 = _routing(T, E, k, g)
        w.copy_(w2)
        ids.copy_(i2)
        z.copy_(torch.randn(T, L, generator=g, device=DEV).to(BF))
        out.fill_(float("nan"))
        gr.replay()
        torch.cuda.synchronize()
        _check(out, M.moe_mxfp4_reference(z, w, ids, ex), seed, "replay")
