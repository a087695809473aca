"""The KDA decode bench's pure-Python parts (scripts/bench/kda_decode.py): variant names ->
launcher keywords, the split skip rule, the bytes-per-call accounting (against the kernel
docstring's K3 figure and against the tensors the bench builds), the rotation count, the CLI's
rejection of bad values. The timing itself needs a GPU (run by the lead)."""
from __future__ import annotations

import pytest
import torch

from raydecode.scripts.bench import kda_decode as B


def test_variant_kwargs_table():
    want = {"single": {"splits": 1}, "auto": {"splits": None}, "split2": {"splits": 2},
            "split4": {"splits": 4}, "split8": {"splits": 8}, "split16": {"splits": 16},
            "split16w8": {"splits": 16, "num_warps": 8},
            "split8w8": {"splits": 8, "num_warps": 8}}
    assert set(want) == set(B.VARIANTS)
    for name, kw in want.items():
        assert B.variant_kwargs(name) == kw, name


@pytest.mark.parametrize("bad", ["split3", "split16w", "Single", "split32", ""])
def test_unknown_variant_named(bad):
    with pytest.raises(ValueError, match=repr(bad)):
        B.variant_kwargs(bad)


def test_parse_variants_single_first_once():
    assert B.parse_variants(B.DEFAULT_VARIANTS) == ["single", "auto", "split8", "split16",
                                                    "split16w8"]
    assert B.parse_variants("split8w8, auto,single,auto") == ["single", "split8w8", "auto"]
    with pytest.raises(ValueError, match="'split5'"):
        B.parse_variants("auto,split5")


def test_skip_rule():
    for v in B.VARIANTS:                           # K3: every variant runs at head_dim 128
        assert B.skip_reason(v, 128) is None, v
    assert "4 < 8" in B.skip_reason("split16", 64)
    assert "4 < 8" in B.skip_reason("split16w8", 64)
    assert B.skip_reason("split8", 64) is None
    assert B.skip_reason("split4", 16) is not None and B.skip_reason("split2", 16) is None
    assert "not divisible" in B.skip_reason("split16", 24)
    assert B.skip_reason("single", 16) is None and B.skip_reason("auto", 16) is None


def test_call_bytes_k3_tp16_batch1():
    """kernels/kda_decode_triton.py: T = 1, 6 heads × 128: state 2·6·64 KiB, fb_w 192 KiB,
    conv state 2·13.5 KiB, conv_w 36 KiB, proj/out ≈ 8 KiB, 1.06 MB in all."""
    b = B.call_bytes(1, 6, 128)
    assert b["state"] == 2 * 6 * 64 * 1024
    assert (b["fb_w"], b["conv_state"], b["conv_w"]) == (192 * 1024, 27 * 1024, 36 * 1024)
    assert 7.5 * 1024 < b["proj"] + b["out"] < 8 * 1024
    assert round(sum(b.values()) / 1e6, 2) == 1.06
    b8 = B.call_bytes(8, 12, 128)                 # state scales with T·h, fb_w with h only
    assert b8["state"] == 16 * b["state"] and b8["fb_w"] == 2 * b["fb_w"]


@pytest.mark.parametrize("T,h,d", [(1, 6, 128), (3, 2, 32), (2, 5, 16)])
def test_bytes_match_the_bench_tensors(T, h, d):
    """call_bytes == the nbytes of what one call reads and writes among k3_inputs' tensors;
    footprint == what one copy allocates (proj's padded buffer, out)."""
    x = B.k3_inputs(T, h, d, torch.Generator().manual_seed(T * 100 + h), "cpu")
    C = h * d
    assert x["proj"].shape == (T, 4 * C + h + d) and x["rec_state"].shape == (T, h, d, d)
    out_bytes = T * C * 2
    moved = (2 * x["rec_state"].nbytes + 2 * x["conv_state"].nbytes + x["proj"].nbytes
             + sum(x[k].nbytes for k in ("fb_w", "conv_w", "exp_a", "dt_bias", "o_norm_w"))
             + out_bytes)
    assert sum(B.call_bytes(T, h, d).values()) == moved
    alloc = sum(t.untyped_storage().nbytes() for t in x.values()) + out_bytes
    assert B.footprint(T, h, d) == alloc
    assert x["proj"].untyped_storage().nbytes() == T * (4 * C + h + d + B.PAD) * 2


@pytest.mark.parametrize("T,h", [(1, 6), (8, 12), (64, 12), (512, 12)])
def test_copies_cover_the_rotation(T, h):
    n, f = B.copies_for(T, h, 128, 256 * 10**6), B.footprint(T, h, 128)
    assert n >= 2 and n * f >= 256 * 10**6
    assert n == 2 or (n - 1) * f < 256 * 10**6


def test_cli_defaults():
    a = B.parse_args([])
    assert (a.heads, a.batches, a.head_dim) == ([6, 12], [1, 2, 4, 8], 128)
    assert a.variants == ["single", "auto", "split8", "split16", "split16w8"]
    assert a.rounds >= 3 and a.replays >= 10 and a.rotate_mb >= 256


@pytest.mark.parametrize("argv,named", [(["--variants", "auto,split3"], "split3"),
                                        (["--batches", "1,0"], "--batches"),
                                        (["--heads", "six"], "--heads"),
                                        (["--rounds", "2"], "--rounds")])
def test_cli_rejects_bad_values(argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        B.main(argv)
    assert e.value.code == 2 and named in capsys.readouterr().err


def test_stdout_line():
    cell = {"us": 5.0, "us_min": 4.9, "us_max": 5.3, "achieved_Bps": 2.0e11,
            "hbm_fraction": 0.05, "time_ratio_to_single": 0.625, "out_rel": 3e-4,
            "rec_rel": 5e-5}
    line = B._line(6, 1, "split16", cell, 10**6)
    assert "5.00 us" in line and "200 GB/s" in line and "5.0% HBM" in line
    assert "x0.625 of single" in line and "out 3.0e-04" in line
    assert B._line(6, 1, "split16", {"skipped": "why not"}, 10**6).endswith("why not")
