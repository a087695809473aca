"""The stock step's one-token continuations as one kernel (kernels/kda_decode.py
`kda_decode_rows`, Triton `_kda_rows_kernel`) vs its PyTorch reference (the chain
models/kda.py `_decode_rows` ran before).

Runs on CUDA, or on CPU through the Triton interpreter (TRITON_INTERPRET=1: the small cases).
Fresh random inputs per case (seed in every failure message): qkv is a column slice of a wider
in_proj-like buffer, the rows are a shuffled subset of the step's rows, the slots a shuffled
subset of a pool. o's other rows, the pool's other slots stay NaN (poisoned: a stray write or
read shows). Tolerances as tests/gpu/test_kda_decode.py: both sides round the conv output to
bf16 at the same point (RNE), so differences are fp32 reduction order and exp/rsqrt ulps,
plus the rare bf16 flip of a conv output near a rounding boundary (it moves one row or column
of the state: the bulk check bounds how many elements move).
"""
from __future__ import annotations

import os

import pytest
import torch

from raydecode.kernels import kda_decode as K
from raydecode.kernels import kda_decode_triton as KT

from _numerics import fresh_seed, rel_err

ON_GPU = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(KT.triton is None or not (ON_GPU or INTERP),
                                reason="needs Triton and CUDA (or TRITON_INTERPRET=1)")
gpu_only = pytest.mark.skipif(not ON_GPU, reason="K3 shapes: GPU only (slow in the interpreter)")
DEV = "cuda" if ON_GPU else "cpu"
BF = torch.bfloat16
TOL = {"o": 2e-3, "rec": 2.5e-4, "rec_bulk": 1e-2}


def _case(T, n, h, d, S, W=4, seed=None):
    seed = fresh_seed() if seed is None else seed
    g = torch.Generator(device=DEV).manual_seed(seed)
    gc = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g, device=DEV)      # noqa: E731
    C = h * d
    rows = torch.randperm(T, generator=gc)[:n].to(DEV)
    slots = torch.randperm(S, generator=gc)[:n].to(DEV)
    x = dict(qkv=rn(T, 3 * C + 40).to(BF)[:, :3 * C],
             g=-torch.rand(T, h, d, generator=g, device=DEV) * 0.7,
             beta=torch.rand(T, h, generator=g, device=DEV),
             conv_state=torch.full((S, 3 * C, W - 1), float("nan"), dtype=BF, device=DEV),
             conv_w=(0.5 * rn(3 * C, W)).to(BF),
             rec_state=torch.full((S, h, d, d), float("nan"), device=DEV),
             o=torch.full((T, h, d), float("nan"), device=DEV))
    x["conv_state"][slots] = rn(n, 3 * C, W - 1).to(BF)
    x["rec_state"][slots] = 0.05 * rn(n, h, d, d)
    return x, rows, slots, seed


def _run(fn, x, rows, slots, h, d):
    y = {k: v.clone() for k, v in x.items()}
    fn(y["qkv"], y["g"], y["beta"], y["conv_state"], y["conv_w"], y["rec_state"], y["o"],
       rows, slots, heads=h, head_dim=d, scale=d ** -0.5)
    return y


def _check(T, n, h, d, S):
    x, rows, slots, seed = _case(T, n, h, d, S)
    what = f"seed {seed} T={T} n={n} h={h} d={d} S={S}"
    ref = _run(K.kda_decode_rows_reference, x, rows, slots, h, d)
    got = _run(lambda *a, **kw: KT.kda_rows_triton(*a[:9], kw["heads"], kw["head_dim"],
                                                    kw["scale"]), x, rows, slots, h, d)
    assert rel_err(got["o"][rows], ref["o"][rows]) < TOL["o"], what
    assert rel_err(got["rec_state"][slots], ref["rec_state"][slots]) < TOL["rec"], what
    moved = (got["rec_state"][slots] - ref["rec_state"][slots]).abs() > 1e-5
    assert moved.float().mean().item() < TOL["rec_bulk"], what
    assert torch.equal(got["conv_state"][slots], ref["conv_state"][slots]), what
    rest_rows = torch.ones(T, dtype=torch.bool, device=DEV)
    rest_rows[rows] = False
    rest = torch.ones(S, dtype=torch.bool, device=DEV)
    rest[slots] = False
    assert got["o"][rest_rows].isnan().all(), f"{what}: o row outside rows written"
    for k in ("conv_state", "rec_state"):
        assert got[k][rest].isnan().all(), f"{what}: {k} slot outside slots written"
    assert torch.isfinite(got["o"][rows]).all(), what


@pytest.mark.parametrize("T,n,h,d,S", [(5, 3, 2, 32, 7), (1, 1, 3, 16, 2), (4, 4, 1, 128, 6),
                                       (9, 2, 2, 64, 3)])
def test_rows_small(T, n, h, d, S):
    _check(T, n, h, d, S)


@gpu_only
@pytest.mark.parametrize("h", [4, 6, 12])
@pytest.mark.parametrize("T,n", [(1, 1), (64, 63), (300, 8)])
def test_rows_k3_shapes(T, n, h):
    """K3's head_dim 128 at TP16/TP8 head counts: a batch-1 stock decode, 63 decode rows
    beside a one-token chunk, 8 decode rows in a long mixed step."""
    _check(T, n, h, 128, 2 * n + 5)


def test_public_op_dispatch_and_errors():
    """The public op: the kernel where it serves (bit-identical to a direct launch), the
    reference elsewhere; a qkv that is not (T, 3·h·d) and rows without a slot each are named."""
    T, n, h, d, S = 4, 2, 2, 32, 5
    x, rows, slots, seed = _case(T, n, h, d, S)
    a = _run(K.kda_decode_rows, x, rows, slots, h, d)
    b = _run(lambda *p, **kw: KT.kda_rows_triton(*p[:9], kw["heads"], kw["head_dim"],
                                                  kw["scale"]), x, rows, slots, h, d)
    if ON_GPU:
        assert torch.equal(a["o"][rows], b["o"][rows]), f"seed {seed}"
    with pytest.raises(ValueError, match="qkv"):
        K.kda_decode_rows(x["qkv"][:, :-1], x["g"], x["beta"], x["conv_state"], x["conv_w"],
                          x["rec_state"], x["o"], rows, slots, heads=h, head_dim=d, scale=1.0)
    with pytest.raises(ValueError, match="one slot per row"):
        K.kda_decode_rows(x["qkv"], x["g"], x["beta"], x["conv_state"], x["conv_w"],
                          x["rec_state"], x["o"], rows, slots[:1], heads=h, head_dim=d,
                          scale=1.0)


@pytest.mark.parametrize("counted", [0, 1, 3])
def test_a_device_count_limits_the_rows(counted):
    """`count` (a mixed step's graph: fixed-length row and slot lists, the live count on the
    device): the first count[0] entries are stepped exactly as a call on those entries alone;
    the others (here all naming one pad row and one pad slot, as the graph's spare entries do)
    leave o, the conv taps and the states as they were — the kernel and the reference."""
    T, n, h, d, S = 7, 3, 2, 32, 8
    x, rows, slots, seed = _case(T, n, h, d, S)
    pad_row = int(torch.ones(T).index_fill_(0, rows.cpu(), 0).nonzero()[0])
    pad_slot = int(torch.ones(S).index_fill_(0, slots.cpu(), 0).nonzero()[0])
    spare = 4
    lr = torch.cat([rows[:counted], torch.full((n - counted + spare,), pad_row, device=DEV)])
    ls = torch.cat([slots[:counted], torch.full((n - counted + spare,), pad_slot, device=DEV)])
    count = torch.tensor([counted], device=DEV)
    want = _run(K.kda_decode_rows_reference, x, rows[:counted], slots[:counted], h, d)
    def kernel(*a, heads, head_dim, scale, count):      # the launch itself (also on CPU)
        return KT.kda_rows_triton(*a, heads, head_dim, scale, count=count)

    for fn in (kernel, K.kda_decode_rows, K.kda_decode_rows_reference):
        got = {k: v.clone() for k, v in x.items()}
        fn(got["qkv"], got["g"], got["beta"], got["conv_state"], got["conv_w"],
           got["rec_state"], got["o"], lr, ls, heads=h, head_dim=d, scale=d ** -0.5,
           count=count)
        what = f"seed {seed} counted={counted} {fn.__name__}"
        for k, tol in (("o", TOL["o"]), ("rec_state", TOL["rec"])):
            a, b = got[k], want[k]
            live = torch.isfinite(b)
            assert torch.equal(torch.isfinite(a), live), f"{what}: {k} written outside the count"
            if live.any():
                assert rel_err(a[live], b[live]) < tol, what
        assert torch.equal(got["conv_state"].isnan(), want["conv_state"].isnan()), what
