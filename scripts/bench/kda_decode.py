"""Fused KDA decode kernel A/B: one program per (token, head) vs value columns split over N.

    python -m raydecode.scripts.bench.kda_decode [--out OUT.json] [--commit SHA]
        [--heads 6,12] [--head-dim 128] [--batches 1,2,4,8] [--variants single,auto,split8,…]

Per (heads, batch T), GPU only: K3-like random inputs (kernels/kda_decode.py layout, W = 4) in
enough copies that state + weights exceed `--rotate-mb` (256 MB ≫ the H200's 60 MB L2). Each
variant is first checked on fresh inputs against `kda_decode_reference` (out and rec_state
‖x − ref‖ / ‖ref‖ within tests/gpu/test_kda_decode.py TOL, conv state bit for bit) and dropped
if it fails; then each round times every variant in turn (interleaved: drift hits all alike),
a CUDA graph of `calls` launches over the rotated copies, µs per call = median of `--replays`
replays. us = median over rounds (all kept), us_min / us_max over all replays.
Variants (kda_decode_triton keywords): single (splits=1, default block_v / num_warps), auto
(splits=None), splitN (splits=N), splitNwM (+ num_warps=M); `single` always runs, the baseline
of time_ratio_to_single (< 1: faster). Bytes per call: `call_bytes`; achieved B/s is compared
with the HBM read bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import time

import torch

from raydecode.kernels import kda_decode as K
from raydecode.kernels import kda_decode_triton as KT
from raydecode.kernels._triton import sm_count

from .layer_timing import GraphTimer, hbm_read_bandwidth
from .report_io import gpu_bench_main, report_header, write_report

VARIANTS = ("single", "auto", "split2", "split4", "split8", "split16", "split16w8", "split8w8")
DEFAULT_VARIANTS = "single,auto,split8,split16,split16w8"
TOL = {"out": 2e-3, "rec": 2.5e-4}       # tests/gpu/test_kda_decode.py TOL
LB, EPS, W, PAD = -5.0, 1e-5, 4, 48      # gate lower bound, RMSNorm eps, conv taps, proj pad
MIN_SPLIT_COLS = KT.MIN_SPLIT_COLUMNS    # value columns per program (splitN skipped below)


def variant_kwargs(name: str) -> dict:
    """Launcher keywords of a variant: {'splits': N | None, 'num_warps': M} (only those set)."""
    if name not in VARIANTS:
        raise ValueError(f"variant {name!r}: expected one of {', '.join(VARIANTS)}")
    if name == "single":
        return {"splits": 1}
    if name == "auto":
        return {"splits": None}
    n, w = re.fullmatch(r"split(\d+)(?:w(\d+))?", name).groups()
    return {"splits": int(n)} | ({"num_warps": int(w)} if w else {})


def skip_reason(name: str, head_dim: int) -> str | None:
    """Why a variant cannot run at head_dim (None: it can): splits must divide head_dim into
    blocks of ≥ MIN_SPLIT_COLS value columns."""
    n = variant_kwargs(name)["splits"]
    if n is None or n == 1:
        return None
    if head_dim % n:
        return f"head_dim {head_dim} not divisible by splits={n}"
    if head_dim // n < MIN_SPLIT_COLS:
        return f"head_dim {head_dim} / splits={n} = {head_dim // n} < {MIN_SPLIT_COLS} columns"
    return None


def parse_variants(text: str) -> list[str]:
    """'a,b' -> ['single', a, b] (single first, once; every name checked)."""
    names = [v.strip() for v in text.split(",") if v.strip()]
    for v in names:
        variant_kwargs(v)
    return ["single"] + [v for v in dict.fromkeys(names) if v != "single"]


def parse_ints(text: str, flag: str) -> list[int]:
    vals = [s.strip() for s in text.split(",") if s.strip()]
    if not vals or not all(s.isdigit() and int(s) > 0 for s in vals):
        raise ValueError(f"{flag} {text!r}: expected comma-separated positive integers")
    return [int(s) for s in vals]


def call_bytes(T: int, h: int, d: int, w: int = W) -> dict:
    """HBM bytes one call moves, by part (fb_w, conv_w, vectors once per call; f_a and the
    weights re-read by other programs of the call hit L2)."""
    C = h * d
    return {"state": 2 * T * h * d * d * 4,                # rec_state fp32, read + write
            "fb_w": C * d * 2,                               # (C, d) bf16
            "conv_state": 2 * T * 3 * C * (w - 1) * 2,       # (T, 3C, W−1) bf16, read + write
            "conv_w": 3 * C * w * 4,                         # (3C, W) fp32
            "vectors": (h + C + d) * 4,                      # exp_a, dt_bias, o_norm_w fp32
            "proj": T * (4 * C + h + d) * 2,                 # the used columns, bf16
            "out": T * C * 2}


def footprint(T: int, h: int, d: int, w: int = W) -> int:
    """Bytes one copy of the inputs allocates (state once, proj with its pad)."""
    b = call_bytes(T, h, d, w)
    return (b["state"] // 2 + b["conv_state"] // 2 + b["fb_w"] + b["conv_w"] + b["vectors"]
            + T * (4 * h * d + h + d + PAD) * 2 + b["out"])


def copies_for(T: int, h: int, d: int, rotate_bytes: int) -> int:
    return max(2, math.ceil(rotate_bytes / footprint(T, h, d)))


def k3_inputs(T: int, h: int, d: int, gen: torch.Generator, device) -> dict:
    """Random inputs at K3 scales (tests/gpu/test_kda_decode.py `_inputs`); proj a column
    slice of a wider (T, P + PAD) buffer, as the in_proj GEMV output is."""
    C = h * d
    P = 4 * C + h + d
    rn = lambda *s: torch.randn(*s, generator=gen, device=device)      # noqa: E731
    return dict(proj=rn(T, P + PAD).to(torch.bfloat16)[:, :P],
                fb_w=(rn(C, d) / d ** 0.5).to(torch.bfloat16),
                conv_state=rn(T, 3 * C, W - 1).to(torch.bfloat16),
                conv_w=0.5 * rn(3 * C, W),
                exp_a=(torch.rand(h, generator=gen, device=device) * 1.386).exp(),
                dt_bias=0.5 * rn(C) - 1.0,
                o_norm_w=1.0 + 0.1 * rn(d),
                rec_state=0.05 * rn(T, h, d, d))


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _launch(x: dict, out, h: int, d: int, kw: dict):
    cfg = {k: v for k, v in kw.items() if v is not None}    # splits=None: the launcher default
    return KT.kda_decode_triton(**x, out=out, heads=h, head_dim=d, lower_bound=LB, eps=EPS,
                                **cfg)


def check(T: int, h: int, d: int, kw: dict, seed: int, device="cuda") -> dict:
    """{out_rel, rec_rel, conv_equal} of one launch vs the reference on fresh inputs, plus
    'error' when outside TOL (or the launch raised)."""
    x = k3_inputs(T, h, d, torch.Generator(device=device).manual_seed(seed), device)
    xr = {k: v.clone() for k, v in x.items()}
    out = torch.full((T, h * d), float("nan"), dtype=torch.bfloat16, device=device)
    try:
        _launch(x, out, h, d, kw)
    except Exception as e:                 # recorded; the other variants still run
        return {"error": f"launch failed: {e!r}"}
    ref = K.kda_decode_reference(**xr, heads=h, head_dim=d, lower_bound=LB, eps=EPS)
    res = {"out_rel": _rel(out, ref), "rec_rel": _rel(x["rec_state"], xr["rec_state"]),
           "conv_equal": bool(torch.equal(x["conv_state"], xr["conv_state"]))}
    bad = [f"{k} rel {res[k + '_rel']:.2e} > {TOL[k]:.1e}" for k in TOL
           if not res[k + "_rel"] <= TOL[k]]           # `not <=`: NaN fails
    bad += [] if res["conv_equal"] else ["conv state differs from the reference"]
    return res | ({"error": "; ".join(bad)} if bad else {})


def shape_row(args, h: int, T: int, hbm: float) -> dict:
    """Check, then time in interleaved rounds, every variant at (heads h, batch T)."""
    d, parts = args.head_dim, call_bytes(T, h, args.head_dim)
    nbytes, n = sum(parts.values()), copies_for(T, h, d, args.rotate_mb * 10**6)
    gen = torch.Generator(device="cuda").manual_seed(args.seed + 1000 * h + T)
    xs = [k3_inputs(T, h, d, gen, "cuda") for _ in range(n)]
    outs = [torch.empty(T, h * d, dtype=torch.bfloat16, device="cuda") for _ in xs]
    calls = max(n, args.min_calls)
    row = {"heads": h, "batch": T, "head_dim": d, "copies": n, "calls": calls,
           "rotated_bytes": n * footprint(T, h, d), "bytes_per_call": nbytes, "bytes": parts,
           "roofline_us": nbytes / hbm * 1e6, "variants": {}}
    fns = {}
    for v in args.variants:
        kw = variant_kwargs(v)
        cell = row["variants"][v] = {"launch": kw, "us_rounds": []}
        if kw["splits"] is None:                     # what the launcher's auto choice is here
            cell["auto_splits"] = KT.split_count(d, T * h, sm_count("cuda:0"))
        if (why := skip_reason(v, d)) is not None:
            cell["skipped"] = why
            continue
        cell |= check(T, h, d, kw, args.seed + T)
        if "error" not in cell:
            fns[v] = [lambda i=i, kw=kw: _launch(xs[i % n], outs[i % n], h, d, kw)
                      for i in range(calls)]
    for _ in range(args.rounds):
        for v, f in fns.items():
            t = GraphTimer(replays=args.replays).run(f, count_nodes=False)
            cell = row["variants"][v]
            cell["us_rounds"].append(t.us_per_call)
            cell["us_min"] = min(cell.get("us_min", math.inf), t.us_min)
            cell["us_max"] = max(cell.get("us_max", 0.0), t.us_max)
    for v in fns:
        cell = row["variants"][v]
        cell["us"] = us = statistics.median(cell["us_rounds"])
        cell["achieved_Bps"] = nbytes / (us * 1e-6)
        cell["hbm_fraction"] = cell["achieved_Bps"] / hbm
    row["baseline_us"] = base = row["variants"]["single"].get("us")
    for cell in row["variants"].values():
        if base and "us" in cell:
            cell["time_ratio_to_single"] = cell["us"] / base
    return row


def run(args) -> dict:
    t0 = time.time()
    report = report_header(args.commit, method=__doc__.split("\n\n")[2].strip(),
                           sm_count=sm_count("cuda:0"),
                           head_dim=args.head_dim, conv_taps=W, heads=args.heads,
                           batches=args.batches, variants=args.variants, rounds=args.rounds,
                           replays=args.replays, rotate_bytes=args.rotate_mb * 10**6,
                           tolerances=TOL, results=[])
    report["hbm_read_Bps"] = hbm = hbm_read_bandwidth()
    for h in args.heads:
        for T in args.batches:
            row = shape_row(args, h, T, hbm)
            report["results"].append(row)
            write_report(report, args.out, t0)           # a run cut short keeps its shapes
            for v, cell in row["variants"].items():
                print(_line(h, T, v, cell, row["bytes_per_call"]), flush=True)
            torch.cuda.empty_cache()
    return report


def _line(h: int, T: int, v: str, c: dict, nbytes: int) -> str:
    """One stdout line per (heads, batch, variant)."""
    head = f"h={h:<3d} T={T:<3d} {v:<10s}"
    if "us" not in c:
        return f"{head} {c.get('skipped') or c.get('error')}"
    ratio = c.get("time_ratio_to_single")
    return (f"{head} {c['us']:7.2f} us [{c['us_min']:.2f}, {c['us_max']:.2f}]  "
            f"{nbytes / 1e6:.3f} MB {c['achieved_Bps'] / 1e9:6.0f} GB/s "
            f"({100 * c['hbm_fraction']:4.1f}% HBM)  "
            + (f"x{ratio:.3f} of single  " if ratio else "")
            + f"out {c['out_rel']:.1e} rec {c['rec_rel']:.1e}")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="", help="JSON file (default bench/results/"
                    "kda-decode-<gpu>-<date>.json)")
    ap.add_argument("--commit", default="", help="git commit of the benchmarked tree "
                    "(default: git rev-parse HEAD)")
    ap.add_argument("--heads", default="6,12", help="per-rank heads (K3: 6 at TP16, 12 at TP8)")
    ap.add_argument("--head-dim", type=int, default=128, choices=K.HEAD_DIMS)
    ap.add_argument("--batches", default="1,2,4,8", help="tokens T per call")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS,
                    help=f"comma list from {','.join(VARIANTS)} (single is always added)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--replays", type=int, default=15)
    ap.add_argument("--rotate-mb", type=int, default=256, help="input copies rotated ≥ this")
    ap.add_argument("--min-calls", type=int, default=32, help="launches per graph, at least")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        args.heads = parse_ints(args.heads, "--heads")
        args.batches = parse_ints(args.batches, "--batches")
        args.variants = parse_variants(args.variants)
    except ValueError as e:
        ap.error(str(e))
    if args.rounds < 3 or args.replays < 10:
        ap.error(f"--rounds {args.rounds} / --replays {args.replays}: need ≥ 3 / ≥ 10")
    return args


def main(argv=None) -> int:
    return gpu_bench_main(parse_args(argv), run, "kda_decode", "kda-decode", KT)


if __name__ == "__main__":
    sys.exit(main())
