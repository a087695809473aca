"""The few-token MoE at K3 per-rank shapes: the Triton pair (kernels/moe_mxfp4_decode.py, its
TUNED config: the served default) vs the resident CuTe kernel (kernels/moe_resident_cute.py),
each timed in the same process (GPU only; PERF round 19).

    python -m raydecode.scripts.explore.moe_resident --out OUT.json --commit SHA [--trace]

Per shape (TP16 batch 1 by default; `--shapes tp16b1,…`): one random expert bank (E = 896,
L = 3584, I = 3072 / TP), `--calls` back-to-back calls in one CUDA graph, each with its own
random top-16 routing, so the graph touches > 2 × L2 of experts. Every variant's call 0 is
checked against `moe_mxfp4_reference` (‖out − ref‖ / ‖ref‖ < 1e-2) before it is timed; the
variants are timed in `--rounds` interleaved rounds and the JSON keeps every round.
Variants: triton (the pair, PDL); resident (as served: 16 warps, PDL, the down rows
`moe_decode.RESIDENT_PREDECODE` decodes before the wait); resident_pre8 (all rows
decoded before the wait: the fastest call, 128 registers); resident_late (none); resident_w8
(8 warps); resident_nopdl. Roofline: the touched experts' bytes / the HBM read bandwidth
measured in the same run. `--trace`: one traced launch each of resident and resident_late; per
event the min / median / max over CTAs of (stamp − the CTA's entry stamp) in ns.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from raydecode.kernels import moe_mxfp4_decode as D
from raydecode.kernels import moe_resident_cute as R

from .layer_moe_sweep import check_and_time, random_calls
from raydecode.scripts.bench.layer_timing import hbm_read_bandwidth
from raydecode.scripts.bench.report_io import report_header, write_report

SHAPES = {"tp16b1": (16, 1), "tp16b2": (16, 2), "tp8b1": (8, 1)}
VARIANTS = ("triton", "resident", "resident_pre8", "resident_late", "resident_w8", "resident_nopdl")
E, L, I_FULL, K = 896, 3584, 3072, 16


def _bank(tp: int, seed: int):
    from raydecode.kernels.moe_mxfp4 import MXFP4Experts
    return MXFP4Experts.random(E, L, I_FULL // tp, 4.0, 25.0, fan_in_13=L, fan_in_2=I_FULL,
                               device="cuda", seed=seed + tp)


def _predecode(name: str) -> int:
    from raydecode.kernels.moe_decode import RESIDENT_PREDECODE
    return {"resident_pre8": 8, "resident_late": 0}.get(name, RESIDENT_PREDECODE)


def variant_fn(name: str, z, bank):
    """fn(route) -> out for one variant, or None where the resident plan does not fit."""
    if name == "triton":
        return lambda r: D.moe_mxfp4_decode(z, r[0], r[1], bank)
    warps = 8 if name == "resident_w8" else 16
    plan = R.plan_for(z, torch.empty(z.shape[0], K), bank, warps=warps,
                      pdl=name != "resident_nopdl", predecode=_predecode(name))
    if plan is None:
        return None
    out = torch.empty(z.shape[0], L, dtype=torch.float32, device=z.device)
    return lambda r: R.resident_moe_into(plan, z, r[0], r[1], bank, out)


def trace_once(z, route, bank, predecode: int) -> dict:
    plan = R.plan_for(z, route[1], bank, trace=True, predecode=predecode)
    tr = torch.zeros(plan.trace_words, dtype=torch.int64, device="cuda")
    out = torch.empty(z.shape[0], L, dtype=torch.float32, device="cuda")
    for _ in range(3):      # warm: compile, then the experts leave L2 on the next routings
        R.resident_moe_into(plan, z, route[0], route[1], bank, out, tr)
    torch.cuda.synchronize()
    t = tr.view(plan.ctas, -1).cpu()
    rel = (t - t[:, :1]).tolist()
    return {name: {"min": min(r[i] for r in rel), "median": statistics.median(r[i] for r in rel),
                   "max": max(r[i] for r in rel)} for i, name in enumerate(R.TRACE_NAMES)} | {
        "span_ns": int(t.max() - t[:, 0].min())}


def run(args) -> dict:
    t0 = time.time()
    report = report_header(args.commit, calls=args.calls, rounds=args.rounds,
                           sm_count=torch.cuda.get_device_properties(0).multi_processor_count,
                           method=__doc__.split("\n\n")[2].strip(), results=[])
    report["hbm_read_Bps"] = hbm = hbm_read_bandwidth()
    for shape in args.shapes.split(","):
        tp, B = SHAPES[shape]
        bank = _bank(tp, args.seed)
        gen = torch.Generator(device="cuda").manual_seed(args.seed)
        z, routes, touched, nbytes, ref = random_calls(bank, B, K, args.calls, gen)
        row = {"shape": shape, "tp": tp, "batch": B, "E": E, "I": I_FULL // tp, "L": L,
               "touched_experts": touched, "bytes_per_call": nbytes,
               "roofline_us": nbytes / hbm * 1e6, "variants": {}}
        fns = {v: variant_fn(v, z, bank) for v in args.variants.split(",")}
        for rnd in range(args.rounds):
            for v, fn in fns.items():
                cell = row["variants"].setdefault(v, {"us": []})
                if fn is None:
                    cell["error"] = "does not fit one resident launch (plan_for: None)"
                    continue
                res = {}
                us = check_and_time(fn, routes, ref, nbytes, res)
                if us is None:
                    cell["error"] = res.get("error")
                else:
                    cell["us"].append(us)
                    cell["rel_err"] = res["rel_err"]
        for v, cell in row["variants"].items():
            if cell["us"]:
                cell["median_us"] = statistics.median(cell["us"])
                cell["of_roofline"] = row["roofline_us"] / cell["median_us"]
        base = row["variants"].get("triton", {}).get("median_us")
        for v, cell in row["variants"].items():
            if base and cell.get("median_us"):
                cell["speedup_vs_triton"] = base / cell["median_us"]
        if args.trace and fns.get("resident") is not None:
            row["trace_ns"] = trace_once(z, routes[0], bank, predecode=_predecode("resident"))
            row["trace_ns_late"] = trace_once(z, routes[0], bank, predecode=0)
            plan = R.plan_for(z, routes[0][1], bank)
            row["spin_flag"] = R.spin_flag(plan, z.device)
        report["results"].append(row)
        write_report(report, args.out, t0)               # a run cut short keeps its shapes
        print(json.dumps(row), flush=True)
        del bank
        torch.cuda.empty_cache()
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--shapes", default="tp16b1")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", action="store_true")
    args = ap.parse_args(argv)
    bad = [s for s in args.shapes.split(",") if s not in SHAPES]
    bad += [v for v in args.variants.split(",") if v not in VARIANTS]
    if bad:
        ap.error(f"unknown shape/variant {bad}; shapes {sorted(SHAPES)}, variants {VARIANTS}")
    if not torch.cuda.is_available():
        print("moe_resident: needs a CUDA GPU", file=sys.stderr)
        return 2
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
