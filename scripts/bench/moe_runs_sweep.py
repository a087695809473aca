"""The chunked tensor-core MoE (`moe_mxfp4_decode_mma.moe_mxfp4_decode_runs`) against the
stock grouped kernel (kernels/moe_mxfp4.py, its TUNED config: what the specialized step runs
past the per-pair kernels today) at the batches between them, K3 per-rank shapes (GPU; PERF
round 29).

    python -m raydecode.scripts.bench.moe_runs_sweep --out OUT.json --commit SHA

Per shape (`--shapes tp16b32,…`): one random expert bank (E = 896, L = 3584, I = 3072 / TP),
`--calls` back-to-back calls in one CUDA graph, each with its own random top-16 routing. Every
variant's call 0 is checked against `moe_mxfp4_reference` (‖out − ref‖ / ‖ref‖ < 1e-2) before
it is timed; a variant that fails to build or match is recorded with its error and skipped.
Variants: stock; pairs (the per-pair CUDA-core kernels, only where T·k ≤ MAX_PAIRS); runs0 …
(each of `runs_candidates`, runs0 = `default_runs_config`). Roofline: distinct experts' bytes
/ the HBM read bandwidth measured in the same run. Rounds interleave the variants.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch

from raydecode.kernels import moe_mxfp4 as M
from raydecode.kernels import moe_mxfp4_decode as D
from raydecode.kernels import moe_mxfp4_decode_mma as MM

from .layer_moe_sweep import check_and_time, random_calls
from .layer_timing import hbm_read_bandwidth
from .moe_resident import _bank
from .report_io import report_header, write_report

SHAPES = {f"tp{tp}b{b}": (tp, b) for tp in (16, 8) for b in (8, 16, 32, 64)}
K = 16


def variant_fns(z, bank) -> dict:
    """name → (config as a dict, fn(route) -> out) for this call shape."""
    E, I, L = bank.num_experts, bank.intermediate, bank.latent
    P = z.shape[0] * K
    stock = M.default_config(P, E, I, L)
    out = {"stock": (dataclasses.asdict(stock),
                     lambda r: M.fused_moe_mxfp4_triton(z, r[0], r[1], bank, stock))}
    if P <= D.MAX_PAIRS:
        out["pairs"] = ({}, lambda r: D.moe_mxfp4_decode(z, r[0], r[1], bank))
    for i, c in enumerate(MM.runs_candidates(E, I, L)):
        out[f"runs{i}"] = (dataclasses.asdict(c),
                           lambda r, c=c: MM.moe_mxfp4_decode_runs(z, r[0], r[1], bank, c))
    return out


def run(args) -> dict:
    t0 = time.time()
    report = report_header(args.commit, calls=args.calls, rounds=args.rounds,
                           method=__doc__.split("\n\n")[2].strip(), results=[])
    report["hbm_read_Bps"] = hbm = hbm_read_bandwidth()
    for shape in args.shapes.split(","):
        tp, B = SHAPES[shape]
        bank = _bank(tp, args.seed)
        gen = torch.Generator(device="cuda").manual_seed(args.seed)
        z, routes, touched, nbytes, ref = random_calls(bank, B, K, args.calls, gen)
        row = {"shape": shape, "tp": tp, "batch": B, "I": bank.intermediate,
               "touched_experts": touched, "bytes_per_call": nbytes,
               "roofline_us": nbytes / hbm * 1e6, "variants": {}}
        fns = variant_fns(z, bank)
        for _ in range(args.rounds):
            for v, (cfg, fn) in fns.items():
                cell = row["variants"].setdefault(v, {"config": cfg, "us": []})
                if "error" in cell:
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
        base = row["variants"]["stock"].get("median_us")
        for v, cell in row["variants"].items():
            if base and cell.get("median_us"):
                cell["speedup_vs_stock"] = base / cell["median_us"]
        report["results"].append(row)
        write_report(report, args.out, t0)               # a run cut short keeps its shapes
        print(f"[moe-runs] {shape} roofline {row['roofline_us']:.1f} us: " + "  ".join(
            f"{v} {c['median_us']:.1f}" if c.get("median_us") else f"{v} ERR"
            for v, c in row["variants"].items()), flush=True)
        del bank
        torch.cuda.empty_cache()
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--shapes", default="tp16b16,tp16b32,tp16b64,tp8b32,tp8b64")
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    bad = [s for s in args.shapes.split(",") if s not in SHAPES]
    if bad:
        ap.error(f"unknown shape {bad}; shapes {sorted(SHAPES)}")
    if args.calls < 1 or args.rounds < 1:
        ap.error(f"--calls {args.calls} / --rounds {args.rounds}: need ≥ 1 each")
    if not torch.cuda.is_available():
        print("moe_runs_sweep: needs a CUDA GPU", file=sys.stderr)
        return 2
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
