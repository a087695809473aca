"""KDA verify kernel (Triton, kernels/kda_verify_triton.py) against its reference and against
itself fed one token at a time (issue 27's acceptance: after accepting j drafts the state
equals feeding those tokens one at a time, fp32, ≤ 1e-5 relative on the GPU).

CUDA, or CPU through the Triton interpreter (TRITON_INTERPRET=1, small shapes). Fresh random
inputs per case (seed in every message); outputs and per-position slots preallocated NaN."""
from __future__ import annotations

import os

import pytest
import torch

from raydecode.kernels import kda_verify as V
from raydecode.kernels import kda_verify_triton as VT

from _numerics import fresh_seed, rel_err

ON_GPU = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(VT.triton is None or not (ON_GPU or INTERP),
                                reason="needs Triton and CUDA (or TRITON_INTERPRET=1)")
gpu_only = pytest.mark.skipif(not ON_GPU, reason="K3 shapes / graphs: GPU only")
DEV = "cuda" if ON_GPU else "cpu"
BF = torch.bfloat16
LB, EPS = -5.0, 1e-5
TOL = {"out": 2e-3, "rec": 2.5e-4,     # against the torch reference (kda_decode's table)
       "seq_rec": 1e-5}                 # against the decode KERNEL one token at a time


def _inputs(B, T, h, d, S, seed, W=4, pad=48):
    g = torch.Generator(device=DEV).manual_seed(seed)
    C, P = h * d, 4 * h * d + h + d
    rn = lambda *s: torch.randn(*s, generator=g, device=DEV)      # noqa: E731
    return dict(proj=rn(B * T, P + pad).to(BF)[:, :P], fb_w=(rn(C, d) / d ** 0.5).to(BF),
                conv_state=rn(S, 3 * C, W - 1).to(BF), conv_w=0.5 * rn(3 * C, W),
                exp_a=(torch.rand(h, generator=g, device=DEV) * 1.386).exp(),
                dt_bias=0.5 * rn(C) - 1.0, o_norm_w=1.0 + 0.1 * rn(d),
                rec_state=0.05 * rn(S, h, d, d))


def _run(x, B, T, h, d, slots, splits=None, op=V.kda_verify):
    pc = torch.full((B * T, *x["conv_state"].shape[1:]), float("nan"), device=DEV).to(BF)
    pr = torch.full((B * T, *x["rec_state"].shape[1:]), float("nan"), device=DEV)
    out = torch.full((B * T, h * d), float("nan"), device=DEV).to(BF)
    kw = dict(splits=splits) if op is V.kda_verify else {}
    op(**x, pos_conv=pc, pos_rec=pr, slots=slots, positions=T, heads=h, head_dim=d,
       lower_bound=LB, eps=EPS, out=out, **kw)
    return out, pc, pr


CASES = [(1, 8, 2, 16, None), (3, 4, 2, 32, 2), (2, 5, 1, 16, 1)]
if ON_GPU:
    CASES += [(1, 8, 6, 128, None), (4, 8, 6, 128, None), (8, 8, 6, 128, None),
              (2, 4, 12, 128, None)]


@pytest.mark.parametrize("B,T,h,d,splits", CASES)
def test_kernel_matches_reference(B, T, h, d, splits):
    seed = fresh_seed()
    S = B + 3
    x = _inputs(B, T, h, d, S, seed)
    slots = torch.randperm(S, device=DEV)[:B]
    before = (x["conv_state"].clone(), x["rec_state"].clone())
    got = _run(x, B, T, h, d, slots, splits)
    want = _run({k: v.clone() for k, v in x.items()}, B, T, h, d, slots,
                op=V.kda_verify_reference)
    msg = f"seed {seed}, B {B} T {T} h {h} d {d} splits {splits}"
    assert torch.equal(x["conv_state"], before[0]) and torch.equal(x["rec_state"], before[1]), \
        f"slots written ({msg})"
    assert not got[0].isnan().any() and not got[2].isnan().any(), f"unwritten rows ({msg})"
    assert rel_err(got[0], want[0]) < TOL["out"], msg
    assert torch.equal(got[1], want[1]), f"conv taps ({msg})"
    assert rel_err(got[2], want[2]) < TOL["rec"], msg


@pytest.mark.parametrize("B,T,h,d", [(1, 8, 2, 16), (2, 4, 2, 64)] + (
    [(1, 8, 6, 128), (4, 8, 6, 128), (8, 8, 6, 128)] if ON_GPU else []))
def test_accepted_state_equals_feeding_the_tokens_one_at_a_time(B, T, h, d):
    """Per position j: pos_rec[b·T + j] == the state after feeding tokens 0 … j one at a time
    (the op at positions = 1 per token, each step's state written back to the slot),
    ≤ 1e-5 relative; conv windows exact. Accepting j drafts selects exactly that state."""
    seed = fresh_seed()
    S = B + 2
    x = _inputs(B, T, h, d, S, seed)
    slots = torch.arange(S - B, S, device=DEV)
    _, pc, pr = _run(x, B, T, h, d, slots)
    seq = {k: v.clone() for k, v in x.items()}
    rows = x["proj"].reshape(B, T, -1)
    for j in range(T):
        one = {**seq, "proj": rows[:, j].contiguous()}
        _, c1, r1 = _run(one, B, 1, h, d, slots)
        seq["conv_state"][slots] = c1[:B]
        seq["rec_state"][slots] = r1[:B]
        at = torch.arange(B, device=DEV) * T + j
        err = rel_err(pr[at], seq["rec_state"][slots])
        assert err <= TOL["seq_rec"], f"seed {seed} position {j}: state rel err {err:.2e}"
        assert torch.equal(pc[at], seq["conv_state"][slots]), f"seed {seed} position {j}"


@gpu_only
def test_captured_verify_and_commit_replay():
    """One graph of verify + commit at K3 TP16 shapes: the replay with new proj values equals
    the eager op on the same values, and the counters need no reset between replays."""
    B, T, h, d = 2, 8, 6, 128
    seed = fresh_seed()
    x = _inputs(B, T, h, d, 4, seed)
    slots = torch.tensor([3, 1], device=DEV)
    keep = torch.tensor([5, 7], device=DEV)
    pc = torch.empty(1, B * T, *x["conv_state"].shape[1:], device=DEV, dtype=BF)
    pr = torch.empty(1, B * T, *x["rec_state"].shape[1:], device=DEV)
    out = torch.empty(B * T, h * d, device=DEV, dtype=BF)
    conv, rec = x["conv_state"].unsqueeze(0).clone(), x["rec_state"].unsqueeze(0).clone()

    def step():
        V.kda_verify(x["proj"], x["fb_w"], conv[0], x["conv_w"], x["exp_a"], x["dt_bias"],
                     x["o_norm_w"], rec[0], pc[0], pr[0], slots, positions=T, heads=h,
                     head_dim=d, lower_bound=LB, eps=EPS, out=out)
        V.kda_verify_commit(conv, rec, pc, pr, slots, keep, T)

    c0, r0 = conv.clone(), rec.clone()
    step()                                   # warm-up (compiles, scratch)
    torch.cuda.synchronize()
    conv.copy_(c0), rec.copy_(r0)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for _ in range(2):
        x["proj"].copy_(torch.randn_like(x["proj"], dtype=torch.float32).to(BF))
        conv.copy_(c0), rec.copy_(r0)
        g.replay()
        got = (out.clone(), conv.clone(), rec.clone())
        want_out, want_pc, want_pr = _run(
            {**x, "conv_state": c0[0].clone(), "rec_state": r0[0].clone()}, B, T, h, d, slots)
        assert rel_err(got[0], want_out) < 1e-6, f"seed {seed}"
        for b in range(B):
            a = b * T + int(keep[b])
            assert torch.equal(got[1][0, slots[b]], want_pc[a]), f"seed {seed}"
            assert rel_err(got[2][0, slots[b]], want_pr[a]) < 1e-6, f"seed {seed}"
