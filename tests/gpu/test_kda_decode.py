"""Fused KDA decode kernel (Triton) vs its PyTorch reference (kernels/kda_decode.py).

Runs on CUDA, or on CPU through the Triton interpreter (TRITON_INTERPRET=1: the small cases
only; the K3 shapes and graph capture need the GPU). Fresh random inputs per case (seed from
os.urandom, in every failure message); `out` is preallocated NaN; proj is a column slice of a
wider GEMV-like buffer (row stride), conv and recurrent state are checked after the in-place
update (conv state bit for bit: it is a shift of bf16 values).

Tolerances (`TOL`, ‖x − ref‖ / ‖ref‖ in fp64): both sides round at the same points (f_b and
the conv output to bf16, the output to bf16) with round-to-nearest-even, so differences come
from fp32 reduction order and exp/sigmoid/rsqrt ulps, plus the rare bf16 flip of an
intermediate near a rounding boundary.
"""
from __future__ import annotations

import os

import pytest
import torch

from raydecode.kernels import kda_decode as K
from raydecode.kernels import kda_decode_triton as KT

ON_GPU = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(KT.triton is None or not (ON_GPU or INTERP),
                                reason="needs Triton and CUDA (or TRITON_INTERPRET=1)")
gpu_only = pytest.mark.skipif(not ON_GPU, reason="K3 shapes / graphs: GPU only (slow or "
                                                "unsupported in the interpreter)")
DEV = "cuda" if ON_GPU else "cpu"
BF = torch.bfloat16
LB, EPS = -5.0, 1e-5
TOL = {               # H200, 160 random cases (T 4..64, 6/12 × 128, 4 × 32): max ×~4-6
    "out": 2e-3,      # measured max 3.3e-4
    "rec": 2.5e-4,    # fp32 state, measured max 6.0e-5 (one flipped bf16 k/v/fb element
                      # moves a whole row or column of the state)
    "rec_bulk": 1e-2,  # fraction of state elements off by > 1e-5 (measured max 2.7e-3)
}


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little") % (1 << 31)


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _inputs(T, h, d, seed, W=4, pad=48):
    g = torch.Generator(device=DEV).manual_seed(seed)
    C = h * d
    P = 4 * C + h + d
    rn = lambda *s: torch.randn(*s, generator=g, device=DEV)      # noqa: E731
    return dict(
        proj=rn(T, P + pad).to(BF)[:, :P],
        fb_w=(rn(C, d) / d ** 0.5).to(BF),
        conv_state=rn(T, 3 * C, W - 1).to(BF),
        conv_w=0.5 * rn(3 * C, W),
        exp_a=(torch.rand(h, generator=g, device=DEV) * 1.386).exp(),
        dt_bias=0.5 * rn(C) - 1.0,
        o_norm_w=1.0 + 0.1 * rn(d),
        rec_state=0.05 * rn(T, h, d, d))


def _clone(x):
    return {k: v.clone() for k, v in x.items()}


def _run_kernel(x, h, d, out, **cfg):
    return KT.kda_decode_triton(**x, out=out, heads=h, head_dim=d, lower_bound=LB, eps=EPS,
                                **cfg)


def _ref(x, h, d):
    return K.kda_decode_reference(**x, heads=h, head_dim=d, lower_bound=LB, eps=EPS)


def _check(x, xr, out, ref, seed, what=""):
    msg = f"seed {seed} {what}"
    assert not out.isnan().any(), f"{msg}: unwritten output"
    assert torch.equal(x["conv_state"], xr["conv_state"]), f"{msg}: conv state"
    e_out, e_rec = _rel(out, ref), _rel(x["rec_state"], xr["rec_state"])
    assert e_out <= TOL["out"], f"{msg}: out rel {e_out:.2e}"
    assert e_rec <= TOL["rec"], f"{msg}: rec_state rel {e_rec:.2e}"
    bulk = float(((x["rec_state"] - xr["rec_state"]).abs() > 1e-5).double().mean())
    assert bulk <= TOL["rec_bulk"], f"{msg}: {bulk:.2e} of the state off by > 1e-5"
    return e_out, e_rec


def _case(T, h, d, W=4, **cfg):
    seed = _seed()
    x = _inputs(T, h, d, seed, W)
    xr = _clone(x)
    out = torch.full((T, h * d), float("nan"), dtype=BF, device=DEV)
    _run_kernel(x, h, d, out, **cfg)
    ref = _ref(xr, h, d)
    e = _check(x, xr, out, ref, seed, f"T={T} h={h} d={d} W={W} {cfg}")
    print(f"T={T} h={h} d={d} W={W} {cfg} seed {seed}: out {e[0]:.2e} rec {e[1]:.2e}")


@pytest.mark.parametrize("T,h,d,W", [(1, 4, 32, 4), (2, 4, 32, 4), (3, 3, 16, 4),
                                     (2, 2, 64, 4), (2, 2, 16, 2), (1, 1, 128, 4)])
def test_small(T, h, d, W):
    """The bench's small config (4 × 32), odd heads, every head_dim class, W = 2."""
    _case(T, h, d, W)


@pytest.mark.parametrize("h", [6, 12], ids=["tp16", "tp8"])
@pytest.mark.parametrize("T", [1, 2, 4, 64])
def test_k3_shapes(T, h):
    if T > 4 and not ON_GPU:
        pytest.skip("batch 64 at K3 shapes: GPU only (slow in the interpreter)")
    _case(T, h, 128)


@pytest.mark.parametrize("bv,nw", [(16, 1), (32, 4), (64, 4), (128, 8)])
def test_block_v_variants(bv, nw):
    """Every dv blocking the launcher may pick (the looped form, NV = D / BV steps)."""
    _case(2, 2, 128, block_v=bv, num_warps=nw)


@gpu_only
@pytest.mark.parametrize("T", [1, 4, 64])
def test_small_config_batches(T):
    _case(T, 4, 32)


def test_public_op_dispatch():
    """On CUDA the public op is the kernel (bit-identical to a direct launch); elsewhere the
    reference."""
    T, h, d, seed = 2, 4, 32, _seed()
    x = _inputs(T, h, d, seed)
    x2 = _clone(x)
    got = K.kda_decode(**x, heads=h, head_dim=d, lower_bound=LB, eps=EPS)
    out = torch.full((T, h * d), float("nan"), dtype=BF, device=DEV)
    if ON_GPU:
        _run_kernel(x2, h, d, out)
    else:
        out = _ref(x2, h, d)
    assert torch.equal(got, out), f"seed {seed}"
    assert torch.equal(x["rec_state"], x2["rec_state"]), f"seed {seed}"


@gpu_only
@pytest.mark.parametrize("T,h,d", [(4, 6, 128), (3, 4, 32)])
def test_graph_replay_reads_new_inputs(T, h, d):
    """Capture once, then replay three times on new proj / weights / state values written into
    the captured buffers; each replay equals the reference on the same values."""
    seed = _seed()
    x = _inputs(T, h, d, seed)
    out = torch.full((T, h * d), float("nan"), dtype=BF, device=DEV)
    kw = dict(heads=h, head_dim=d, lower_bound=LB, eps=EPS, out=out)
    K.kda_decode(**_clone(x), **kw)                                      # compile, warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        K.kda_decode(**x, **kw)
    for r in range(3):
        new = _inputs(T, h, d, seed + 1 + r)
        for k, v in new.items():
            x[k].copy_(v)
        xr = _clone(x)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(x, xr, out, _ref(xr, h, d), seed, f"replay {r}")


@gpu_only
def test_two_steps_chain_state():
    """Two consecutive steps on the same state buffers (the second reads what the first
    wrote), kernel vs reference each carrying its own state."""
    T, h, d, seed = 4, 6, 128, _seed()
    x = _inputs(T, h, d, seed)
    xr = _clone(x)
    for step in range(2):
        p = _inputs(T, h, d, seed + 7 + step)["proj"]
        x["proj"], xr["proj"] = p, p.clone()
        out = torch.full((T, h * d), float("nan"), dtype=BF, device=DEV)
        _run_kernel(x, h, d, out)
        _check(x, xr, out, _ref(xr, h, d), seed, f"step {step}")
