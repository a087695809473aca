"""Fused KDA decode op on a CPU-only machine: its reference against the model's math
(models/kda.py, fp32 tolerance); the public op falls back to the reference on CPU; bad input
is named. The Triton kernel itself is tested in tests/gpu/test_kda_decode.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raydecode.kernels import kda_decode as K
from raydecode.models import kda as model_kda
from raydecode.models.layers import rms_norm

torch.set_num_threads(1)
BF = torch.bfloat16
LB, EPS = -5.0, 1e-5


def _inputs(T, h, d, W=4, seed=0, pad=16):
    """Random op inputs at the benchmarks' weight scales; proj is a column slice of a wider buffer
    (row stride P + pad) like a GEMV output view."""
    g = torch.Generator().manual_seed(seed)
    C = h * d
    P = 4 * C + h + d
    rn = lambda *s: torch.randn(*s, generator=g)                 # noqa: E731
    return dict(
        proj=rn(T, P + pad).to(BF)[:, :P],
        fb_w=(rn(C, d) / d ** 0.5).to(BF),
        conv_state=rn(T, 3 * C, W - 1).to(BF),
        conv_w=0.5 * rn(3 * C, W),
        exp_a=(torch.rand(h, generator=g) * 1.386).exp(),
        dt_bias=0.5 * rn(C) - 1.0,
        o_norm_w=1.0 + 0.1 * rn(d),
        rec_state=0.05 * rn(T, h, d, d))


def _clone(x):
    return {k: v.clone() for k, v in x.items()}


def _ref(x, h, d, **kw):
    return K.kda_decode_reference(**x, heads=h, head_dim=d, lower_bound=LB, eps=EPS, **kw)


def test_reference_matches_model_math():
    """One token through models/kda.py's functions (conv, L2, gate, kda_recurrent, o_norm)."""
    T, h, d, W = 3, 2, 32, 4
    x = _inputs(T, h, d, W, seed=7)
    x0 = _clone(x)
    out = _ref(x, h, d)
    C = h * d
    p = x0["proj"]
    for t in range(T):
        xs = torch.cat([x0["conv_state"][t].t(), p[t:t + 1, :3 * C]], 0)        # (W, 3C)
        y = model_kda.causal_conv_silu(xs, x0["conv_w"]).to(BF).float()
        q, k, v = (z.reshape(1, h, d) for z in y.split(C, -1))
        q, k = model_kda.l2_normalize(q), model_kda.l2_normalize(k)
        fb = F.linear(p[t:t + 1, 4 * C + h:4 * C + h + d], x0["fb_w"]).view(1, h, d)
        gt = model_kda.kda_gate(fb, x0["exp_a"].log(), x0["dt_bias"], LB)
        beta = torch.sigmoid(p[t:t + 1, 4 * C:4 * C + h].float())
        o, S = model_kda.kda_recurrent(q, k, v, gt, beta, d ** -0.5, x0["rec_state"][t])
        gate = torch.sigmoid(p[t, 3 * C:4 * C].float()).view(1, h, d)
        ref = (rms_norm(o, x0["o_norm_w"], EPS) * gate).to(BF).view(C)
        torch.testing.assert_close(x["rec_state"][t], S, rtol=1e-5, atol=1e-6)
        assert torch.equal(x["conv_state"][t], xs[1:].t())
        assert (out[t].float() - ref.float()).abs().max() <= 1e-2 * ref.float().abs().max()


def test_public_op_falls_back_to_reference_on_cpu():
    T, h, d = 2, 3, 16
    x = _inputs(T, h, d, seed=3)
    xr = _clone(x)
    assert not K._use_triton(x["proj"])
    out = torch.full((T, h * d), float("nan"), dtype=BF)
    got = K.kda_decode(**x, heads=h, head_dim=d, lower_bound=LB, eps=EPS, out=out)
    ref = _ref(xr, h, d)
    assert got is out and torch.equal(out, ref)
    assert torch.equal(x["rec_state"], xr["rec_state"])
    assert torch.equal(x["conv_state"], xr["conv_state"])
    assert not torch.equal(x["rec_state"], _inputs(T, h, d, seed=3)["rec_state"])  # updated


def test_strided_state_is_updated_in_place():
    """rec_state a non-contiguous view (every other sequence slot): updated through the view."""
    T, h, d = 2, 2, 16
    x = _inputs(T, h, d, seed=4)
    xr = _clone(x)
    big = torch.zeros(2 * T, h, d, d)
    big[::2] = x["rec_state"]
    x["rec_state"] = big[::2]
    out = K.kda_decode(**x, heads=h, head_dim=d, lower_bound=LB, eps=EPS)
    assert torch.equal(out, _ref(xr, h, d))
    assert torch.equal(big[::2], xr["rec_state"]) and not big[1::2].any()


def _pool(x, slots, S):
    """x's per-sequence state rows placed at rows `slots` of an S-row pool; other rows NaN."""
    conv = torch.full((S,) + tuple(x["conv_state"].shape[1:]), float("nan"), dtype=BF)
    rec = torch.full((S,) + tuple(x["rec_state"].shape[1:]), float("nan"))
    idx = torch.tensor(slots)
    conv[idx], rec[idx] = x["conv_state"], x["rec_state"]
    return conv, rec


@pytest.mark.parametrize("slots,S", [([5, 0, 3], 7), ([2], 4), ([1, 0], 2), ([6, 2, 4, 0], 8)],
                         ids=["shuffled", "one", "all-reversed", "subset"])
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_slots_address_a_state_pool(slots, S, idx_dtype):
    """With slots, sequence t steps pool row slots[t]: equal to the op on the gathered rows,
    bit for bit; rows not named (NaN) untouched."""
    T, h, d = len(slots), 2, 16
    x = _inputs(T, h, d, seed=10 + S)
    xr = _clone(x)
    conv, rec = _pool(x, slots, S)
    x["conv_state"], x["rec_state"] = conv, rec
    out = K.kda_decode(**x, heads=h, head_dim=d, lower_bound=LB, eps=EPS,
                       slots=torch.tensor(slots, dtype=idx_dtype))
    ref = _ref(xr, h, d)
    assert torch.equal(out, ref)
    idx = torch.tensor(slots)
    assert torch.equal(conv[idx], xr["conv_state"]) and torch.equal(rec[idx], xr["rec_state"])
    rest = [i for i in range(S) if i not in slots]
    assert conv[rest].isnan().all() and rec[rest].isnan().all()


@pytest.mark.parametrize("slots,match", [
    (lambda: torch.tensor([0, 1.0]), "slots .* dtype torch.float32"),
    (lambda: torch.tensor([0, 1, 2]), r"slots of shape \(3,\)"),
    (lambda: torch.tensor([[0, 1]]), r"slots of shape \(1, 2\)"),
    (lambda: torch.tensor([0, 5]), r"slots \[0, 5\]: expected distinct state rows in \[0, 5\)"),
    (lambda: torch.tensor([-1, 2]), r"slots \[-1, 2\]"),
    (lambda: torch.tensor([3, 3]), r"slots \[3, 3\]: expected distinct"),
])
def test_bad_slots_are_named(slots, match):
    T, h, d, S = 2, 2, 16, 5
    x = _inputs(T, h, d, seed=2)
    x["conv_state"], x["rec_state"] = _pool(x, [0, 1], S)
    with pytest.raises(ValueError, match=match):
        K.kda_decode(**x, heads=h, head_dim=d, lower_bound=LB, eps=EPS, slots=slots())


def test_slot_pool_states_must_agree():
    """conv_state and rec_state are one pool: their slot counts must match."""
    T, h, d = 2, 2, 16
    x = _inputs(T, h, d, seed=2)
    conv, _ = _pool(x, [0, 1], 4)
    _, rec = _pool(x, [0, 1], 3)
    x["conv_state"], x["rec_state"] = conv, rec
    with pytest.raises(ValueError, match=r"rec_state of shape \(3, 2, 16, 16\).*S state slots"):
        K.kda_decode(**x, heads=h, head_dim=d, lower_bound=LB, eps=EPS,
                     slots=torch.tensor([0, 1]))


@pytest.mark.parametrize("change,match", [
    (dict(head_dim=48), "head_dim=48"),
    (dict(heads=0), "heads=0"),
    (dict(proj=lambda x: x["proj"][:, :100]), "columns"),
    (dict(rec_state=lambda x: x["rec_state"].half()), "rec_state"),
    (dict(conv_state=lambda x: x["conv_state"][:, :, :2]), "conv_state"),
    (dict(conv_w=lambda x: x["conv_w"][:-1]), "conv_w"),
    (dict(fb_w=lambda x: x["fb_w"].float()), "fb_w"),
    (dict(exp_a=lambda x: x["exp_a"][:1]), "exp_a"),
    (dict(out=lambda x: torch.empty(2, 48)), "out"),
])
def test_bad_input_is_named(change, match):
    h, d = 3, 16
    x = _inputs(2, h, d, seed=1)
    kw = dict(heads=h, head_dim=d, lower_bound=LB, eps=EPS)
    for k, v in change.items():
        if callable(v):
            (x if k in x else kw)[k] = v(x)
        else:
            kw[k] = v
    with pytest.raises(ValueError, match=match):
        K.kda_decode(**x, **kw)


# ---- the launcher's split choice (kernels/kda_decode_triton.py; pure Python, no Triton) ------

@pytest.mark.parametrize("sms", [132, 78, 16])
@pytest.mark.parametrize("d", [16, 32, 64, 128])
@pytest.mark.parametrize("programs", [1, 2, 6, 12, 24, 48, 66, 96, 128, 384])
def test_split_count_is_the_largest_fitting_power_of_two(programs, d, sms):
    from raydecode.kernels.kda_decode_triton import MIN_SPLIT_COLUMNS, MIN_SPLITS, split_count
    ns = split_count(d, programs, sms)

    def fits(n):
        return d % n == 0 and d // n >= MIN_SPLIT_COLUMNS and programs * n <= sms
    largest = 1
    while fits(2 * largest):
        largest *= 2
    assert ns == (largest if largest >= MIN_SPLITS else 1)


def test_split_count_at_k3_shapes():
    """K3 head_dim 128 on an H200 (132 SMs): TP16 (6 heads) batch 1 -> 16 programs of 8 value
    columns per head (96 programs); TP8 -> 8; one program per head where fewer than 4 fit
    (TP16 from batch 8, TP8 from batch 4)."""
    from raydecode.kernels.kda_decode_triton import split_count
    assert [split_count(128, 6 * T) for T in (1, 2, 4, 8, 16)] == [16, 8, 4, 1, 1]
    assert [split_count(128, 12 * T) for T in (1, 2, 4, 8)] == [8, 4, 1, 1]


def test_launcher_names_bad_splits():
    from raydecode.kernels.kda_decode_triton import kda_decode_triton
    T, h, d = 1, 2, 32
    z = torch.zeros
    args = (z(T, 4 * h * d + h + d), z(h * d, d), z(T, 3 * h * d, 3), z(3 * h * d, 4), z(h),
            z(h * d), z(d), z(T, h, d, d), z(T, h * d))
    with pytest.raises(ValueError, match="splits = 3: expected a divisor of head_dim = 32"):
        kda_decode_triton(*args, heads=h, head_dim=d, lower_bound=-5.0, eps=1e-5, splits=3)
