"""KDA verify kernels (DSpark's verify step) against the decode kernel fed one position at a time.

    python -m raydecode.scripts.bench.kda_verify [--out OUT.json] [--commit SHA]
        [--heads 6,12] [--batches 1,2,4,8] [--positions 8] [--variants auto,s16w1,…]
        [--ref FILE.py]

Per (heads, sequences B, positions T), GPU only: K3-like random inputs (scripts/bench/
kda_decode.py `k3_inputs`, head_dim 128, W = 4) in enough copies that state + weights exceed
`--rotate-mb` (256 MB ≫ the H200's 60 MB L2), as a step meets each layer's state cold. Each
variant is first checked on fresh inputs against `kda_verify_reference` (out and every
per-position state within tests/gpu/test_kda_verify_gpu.py TOL, conv windows bit for bit) and
dropped if it fails; then each round times every variant in turn (interleaved), a CUDA graph
of `calls` launches over the rotated copies, µs per call = median of `--replays` replays; us =
median over rounds.

Variants: auto (the launcher's defaults), sNwM (chain kernel splits=N, warps=M), ref (the
`kda_verify_triton` of another commit, loaded from --ref: an A/B in one lease) and the
baseline `decode`, always run: the fused decode kernel once per position on B tokens (T
launches, no per-position slots: what a verify step costs without this op's own kernels).
Bytes per call (`call_bytes`) against the HBM read bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import re
import statistics
import sys
import time

import torch

from raydecode.kernels import kda_decode_triton as KT
from raydecode.kernels import kda_verify as V
from raydecode.kernels import kda_verify_triton as VT
from raydecode.kernels._triton import sm_count

from .kda_decode import EPS, LB, W, _rel, k3_inputs, parse_ints
from .layer_timing import GraphTimer, hbm_read_bandwidth
from .report_io import gpu_bench_main, report_header, write_report

D = 128
TOL = {"out": 2e-3, "rec": 2.5e-4}            # tests/gpu/test_kda_verify_gpu.py TOL
DEFAULT_VARIANTS = "auto,s16w1,s16w2,s16w4,s8w1,s8w2,s32w1,s4w4,s2w4,s2w8"


def variant_kwargs(name: str) -> dict:
    """{'splits': N, 'warps': M} of sNwM, {} for auto / ref / decode; ValueError otherwise."""
    if name in ("auto", "ref", "decode"):
        return {}
    m = re.fullmatch(r"s(\d+)w(\d+)", name)
    if not m or D % int(m[1]) or int(m[2]) not in (1, 2, 4, 8):
        raise ValueError(f"variant {name!r}: expected auto, ref, decode or sNwM with N "
                         f"dividing {D} and M in 1, 2, 4, 8")
    return {"splits": int(m[1]), "warps": int(m[2])}


def call_bytes(B: int, T: int, h: int) -> dict:
    """HBM bytes of one call by part (weights once; scratch rows re-read by the chain's
    programs hit L2 and are not counted)."""
    C = h * D
    return {"state_read": B * h * D * D * 4, "pos_state_written": B * T * h * D * D * 4,
            "conv": B * 3 * C * (W - 1) * 2 * (1 + T), "fb_w": C * D * 2,
            "conv_w": 3 * C * W * 4, "proj": B * T * (4 * C + h + D) * 2, "out": B * T * C * 2}


def _inputs(B: int, T: int, h: int, gen, copies: int) -> list[dict]:
    """`copies` input sets: B sequences (state rows 0..B−1), B·T proj rows, NaN-filled
    per-position rows and output."""
    sets = []
    for _ in range(copies):
        x = k3_inputs(B * T, h, D, gen, "cuda")
        x["conv_state"] = x["conv_state"][:B].contiguous()
        x["rec_state"] = x["rec_state"][:B].contiguous()
        x["pos_conv"] = torch.full((B * T, *x["conv_state"].shape[1:]), float("nan"),
                                   device="cuda").to(torch.bfloat16)
        x["pos_rec"] = torch.full((B * T, h, D, D), float("nan"), device="cuda")
        x["out"] = torch.full((B * T, h * D), float("nan"), device="cuda").to(torch.bfloat16)
        x["slots"] = torch.arange(B, device="cuda")
        sets.append(x)
    return sets


def _launcher(variant: str, ref_mod, B: int, T: int, h: int):
    """fn(x) running one call of the variant on input set x."""
    kw = dict(positions=T, heads=h, head_dim=D, lower_bound=LB, eps=EPS)
    if variant == "decode":
        def fn(x):
            rows = x["proj"].view(B, T, -1)
            for j in range(T):
                KT.kda_decode_triton(rows[:, j], x["fb_w"], x["conv_state"], x["conv_w"],
                                     x["exp_a"], x["dt_bias"], x["o_norm_w"], x["rec_state"],
                                     x["out"][j * B:(j + 1) * B], heads=h, head_dim=D,
                                     lower_bound=LB, eps=EPS, slots=x["slots"])
        return fn
    mod = ref_mod if variant == "ref" else VT
    extra = variant_kwargs(variant)
    return lambda x: mod.kda_verify_triton(**x, **kw, **extra)


def check(variant: str, ref_mod, B: int, T: int, h: int, seed: int) -> dict:
    """{out_rel, rec_rel, conv_equal} against the reference on fresh inputs, 'error' when
    outside TOL; the decode baseline is not checked here (tests/gpu/test_kda_decode.py)."""
    if variant == "decode":
        return {}
    x = _inputs(B, T, h, torch.Generator(device="cuda").manual_seed(seed), 1)[0]
    want = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in x.items()}
    try:
        _launcher(variant, ref_mod, B, T, h)(x)
    except Exception as e:            # recorded; the other variants still run
        return {"error": f"launch failed: {e!r}"}
    V.kda_verify_reference(**want, positions=T, heads=h, head_dim=D, lower_bound=LB, eps=EPS)
    res = {"out_rel": _rel(x["out"], want["out"]),
           "rec_rel": _rel(x["pos_rec"], want["pos_rec"]),
           "conv_equal": bool(torch.equal(x["pos_conv"], want["pos_conv"]))}
    bad = [f"{k} rel {res[k + '_rel']:.2e} > {TOL[k]:.1e}" for k in TOL
           if not res[k + "_rel"] <= TOL[k]]
    bad += [] if res["conv_equal"] else ["per-position conv windows differ"]
    return res | ({"error": "; ".join(bad)} if bad else {})


def shape_row(args, ref_mod, h: int, B: int, T: int, hbm: float) -> dict:
    parts = call_bytes(B, T, h)
    nbytes = sum(parts.values())
    one = nbytes + B * T * h * D * D * 4          # + the NaN-filled rows of a copy
    n = max(2, math.ceil(args.rotate_mb * 10**6 / one))
    xs = _inputs(B, T, h, torch.Generator(device="cuda").manual_seed(args.seed + B), n)
    calls = max(n, args.min_calls)
    ns, nw = VT.chain_config(D, B, h)
    row = {"heads": h, "seqs": B, "positions": T, "copies": n, "calls": calls,
           "bytes": parts, "bytes_per_call": nbytes, "roofline_us": nbytes / hbm * 1e6,
           "auto": {"splits": ns, "warps": nw}, "variants": {}}
    fns = {}
    for v in args.variants:
        cell = row["variants"][v] = {"launch": variant_kwargs(v), "us_rounds": []}
        cell |= check(v, ref_mod, B, T, h, args.seed + 17 * B + T)
        if "error" not in cell:
            f = _launcher(v, ref_mod, B, T, h)
            fns[v] = [lambda i=i, f=f: f(xs[i % n]) for i in range(calls)]
    for _ in range(args.rounds):
        for v, f in fns.items():
            t = GraphTimer(replays=args.replays).run(f, count_nodes=False)
            row["variants"][v]["us_rounds"].append(t.us_per_call)
    for v in fns:
        cell = row["variants"][v]
        cell["us"] = statistics.median(cell["us_rounds"])
        cell["hbm_fraction"] = nbytes / (cell["us"] * 1e-6) / hbm
    base = row["variants"]["decode"].get("us")
    row["baseline_us"] = base
    for cell in row["variants"].values():
        if base and "us" in cell:
            cell["time_ratio_to_decode"] = cell["us"] / base
    return row


def run(args) -> dict:
    t0 = time.time()
    ref_mod = None
    if args.ref:
        spec = importlib.util.spec_from_file_location("kda_verify_ref", args.ref)
        ref_mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ref_mod)
    report = report_header(args.commit, method=__doc__.split("\n\n")[1].strip(),
                           sm_count=sm_count("cuda:0"), head_dim=D, conv_taps=W,
                           heads=args.heads, batches=args.batches, positions=args.positions,
                           variants=args.variants, ref=args.ref or None, rounds=args.rounds,
                           replays=args.replays, rotate_bytes=args.rotate_mb * 10**6,
                           tolerances=TOL, results=[])
    report["hbm_read_Bps"] = hbm = hbm_read_bandwidth()
    for h in args.heads:
        for B in args.batches:
            row = shape_row(args, ref_mod, h, B, args.positions, hbm)
            report["results"].append(row)
            for v, c in row["variants"].items():
                print(f"h={h:<3d} B={B:<2d} T={args.positions} {v:<7s} "
                      + (f"{c['us']:8.2f} us  {100 * c['hbm_fraction']:4.1f}% HBM  "
                         f"x{c.get('time_ratio_to_decode', float('nan')):.3f} of decode"
                         if "us" in c else str(c.get("error"))), flush=True)
            write_report(report, args.out, t0)
            torch.cuda.empty_cache()
    report["summary"] = summary(report)
    write_report(report, args.out, t0)
    return report


def summary(report: dict) -> dict:
    """auto's µs at K3 TP16 (6 heads), B = 1, and its ratio to the ref variant and to the
    decode baseline of the same row (None where not run)."""
    row = next((r for r in report["results"] if r["heads"] == 6 and r["seqs"] == 1), None)
    cells = row["variants"] if row else {}
    us = lambda v: cells.get(v, {}).get("us")         # noqa: E731
    a = us("auto")
    return {"verify_us_tp16_b1": a,
            "auto_over_ref_tp16_b1": a / us("ref") if a and us("ref") else None,
            "auto_over_decode_tp16_b1": a / us("decode") if a and us("decode") else None}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="", help="JSON file (default bench/results/"
                    "kda-verify-<gpu>-<date>.json)")
    ap.add_argument("--commit", default="", help="git commit (default: git rev-parse HEAD)")
    ap.add_argument("--heads", default="6,12", help="per-rank heads (K3: 6 at TP16, 12 at TP8)")
    ap.add_argument("--batches", default="1,2,4,8", help="sequences B per call")
    ap.add_argument("--positions", type=int, default=8, help="T = k + 1 (DSpark k = 7: 8)")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS,
                    help="comma list: auto, ref, sNwM (decode is always added)")
    ap.add_argument("--ref", default="", help="kda_verify_triton.py of another commit (ref)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--rotate-mb", type=int, default=256)
    ap.add_argument("--min-calls", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        args.heads = parse_ints(args.heads, "--heads")
        args.batches = parse_ints(args.batches, "--batches")
        names = [v.strip() for v in args.variants.split(",") if v.strip()]
        for v in names:
            variant_kwargs(v)
    except ValueError as e:
        ap.error(str(e))
    if "ref" in names and not args.ref:
        ap.error("variant ref needs --ref FILE.py")
    if not 1 <= args.positions <= V.MAX_POSITIONS:
        ap.error(f"--positions {args.positions}: expected 1..{V.MAX_POSITIONS}")
    args.variants = ["decode"] + [v for v in dict.fromkeys(names) if v != "decode"]
    return args


def main(argv=None) -> int:
    return gpu_bench_main(parse_args(argv), run, "kda_verify", "kda-verify", VT)


if __name__ == "__main__":
    sys.exit(main())
