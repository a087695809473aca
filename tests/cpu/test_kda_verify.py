"""KDA verify op on a CPU-only machine (kernels/kda_verify.py): the reference equals feeding the
tokens one at a time through the decode reference, per position; the slots' own state is never
written; the commit keeps exactly the accepted position's state; bad input is named. The Triton
kernel: tests/gpu/test_kda_verify_gpu.py (also under TRITON_INTERPRET=1)."""
from __future__ import annotations

import pytest
import torch

from raydecode.kernels import kda_decode as K
from raydecode.kernels import kda_verify as V

torch.set_num_threads(1)
BF = torch.bfloat16
LB, EPS = -5.0, 1e-5


def _inputs(B, T, h, d, S, W=4, seed=0, pad=16):
    g = torch.Generator().manual_seed(seed)
    C, P = h * d, 4 * h * d + h + d
    rn = lambda *s: torch.randn(*s, generator=g)                 # noqa: E731
    return dict(proj=rn(B * T, P + pad).to(BF)[:, :P], fb_w=(rn(C, d) / d ** 0.5).to(BF),
                conv_state=rn(S, 3 * C, W - 1).to(BF), conv_w=0.5 * rn(3 * C, W),
                exp_a=(torch.rand(h, generator=g) * 1.386).exp(), dt_bias=0.5 * rn(C) - 1.0,
                o_norm_w=1.0 + 0.1 * rn(d), rec_state=0.05 * rn(S, h, d, d))


def _pos(x, B, T):
    return (torch.full((B * T, *x["conv_state"].shape[1:]), float("nan")).to(BF),
            torch.full((B * T, *x["rec_state"].shape[1:]), float("nan")))


@pytest.mark.parametrize("B,T", [(1, 1), (1, 8), (3, 4)])
def test_reference_is_the_decode_op_one_token_at_a_time(B, T):
    h, d, S = 2, 16, 6
    x = _inputs(B, T, h, d, S, seed=B * 10 + T)
    slots = torch.tensor([5, 0, 3][:B])
    before = (x["conv_state"].clone(), x["rec_state"].clone())
    pc, pr = _pos(x, B, T)
    out = V.kda_verify(**x, pos_conv=pc, pos_rec=pr, slots=slots, positions=T, heads=h,
                       head_dim=d, lower_bound=LB, eps=EPS)
    assert torch.equal(x["conv_state"], before[0]) and torch.equal(x["rec_state"], before[1])
    seq = {k: v.clone() for k, v in x.items()}
    rows = x["proj"].reshape(B, T, -1)
    for j in range(T):       # the decode op over the slot pool, token j of every sequence
        o = K.kda_decode(rows[:, j], seq["fb_w"], seq["conv_state"], seq["conv_w"],
                         seq["exp_a"], seq["dt_bias"], seq["o_norm_w"], seq["rec_state"],
                         heads=h, head_dim=d, lower_bound=LB, eps=EPS, slots=slots)
        at = torch.arange(B) * T + j
        assert torch.equal(out[at], o)
        assert torch.equal(pc[at], seq["conv_state"][slots])
        assert torch.equal(pr[at], seq["rec_state"][slots])


def test_commit_keeps_the_accepted_position_in_every_layer():
    L, S, B, T, h, d, W = 3, 5, 2, 4, 2, 16, 4
    g = torch.Generator().manual_seed(1)
    conv = torch.randn(L, S, 3 * h * d, W - 1, generator=g).to(BF)
    rec = torch.randn(L, S, h, d, d, generator=g)
    pconv = torch.randn(L, B * T, 3 * h * d, W - 1, generator=g).to(BF)
    prec = torch.randn(L, B * T, h, d, d, generator=g)
    slots, keep = torch.tensor([4, 1]), torch.tensor([2, 0])
    c0, r0 = conv.clone(), rec.clone()
    V.kda_verify_commit(conv, rec, pconv, prec, slots, keep, T)
    for b, (s, a) in enumerate(zip(slots.tolist(), keep.tolist())):
        assert torch.equal(conv[:, s], pconv[:, b * T + a])
        assert torch.equal(rec[:, s], prec[:, b * T + a])
    others = [s for s in range(S) if s not in slots.tolist()]
    assert torch.equal(conv[:, others], c0[:, others]) and torch.equal(rec[:, others],
                                                                        r0[:, others])


@pytest.mark.parametrize("change,match", [
    (dict(positions=0), r"positions=0: expected an int in \[1, 16\]"),
    (dict(positions=17), r"positions=17"),
    (dict(proj_rows=7), r"proj of shape \(7, .*\): expected \(B·T, P\) = \(8, P\)"),
    (dict(pos_rows=7), r"pos_rec of shape \(7, 2, 16, 16\).*N ≥ 8"),
    (dict(slots=torch.tensor([1, 1])), r"slots \[1, 1\]: expected distinct"),
])
def test_bad_input_is_named(change, match):
    B, T, h, d = 2, 4, 2, 16
    x = _inputs(B, T, h, d, 4)
    pc, pr = _pos(x, B, T)
    slots = change.get("slots", torch.tensor([0, 2]))
    if "proj_rows" in change:
        x["proj"] = x["proj"][:change["proj_rows"]]
    if "pos_rows" in change:
        pr = pr[:change["pos_rows"]]
    with pytest.raises(ValueError, match=match):
        V.kda_verify(**x, pos_conv=pc, pos_rec=pr, slots=slots,
                     positions=change.get("positions", T), heads=h, head_dim=d,
                     lower_bound=LB, eps=EPS)


def test_per_position_bytes_at_k3_tp16():
    from raydecode.engine.step_graph import scratch_bytes
    from raydecode.models.config import load_config
    from raydecode.models.parallel import Parallel

    cfg = load_config("k3")
    slot = scratch_bytes(cfg, Parallel(tp_size=16, tp_rank=0), 64)["per_kda_slot"]
    assert V.per_position_bytes(slot, 8, 7) == slot * 64
    assert 1.7e9 < V.per_position_bytes(slot, 8, 7) < 1.9e9     # the docstring's 1.8 GB
