"""GEMV mapping sweep on the decode step's per-rank shapes, then an A/B inside the layer (GPU only).

    python -m raydecode.scripts.explore.gemv_tune --out OUT.json --commit SHA [--tp 16]
        [--shapes N1xK1,…] [--max-configs 24] [--confirm-layer --layer-runs 2]

Stage 1: for each shape (default: `decode_gemv_shapes(k3, tp, "specialized")`, the GEMVs one
rank of the specialized step launches), the production mapping (`config_for(1, N, K)`) and up
to `--max-configs` others from `candidate_configs` are timed at M = 1 with PDL, exactly as
scripts/bench/gemv.py times them (`bench_shape`: a CUDA graph of back-to-back GEMVs over
rotating weight copies, checked against fp64 first). The winner is the fastest; it replaces the
production mapping only when it is faster by more than `--min-gain` (run-to-run spread of a
fixed mapping is ≈ 1.3%, docs/PERF.md).

Stage 2 (`--confirm-layer`): the layer benchmark (scripts/bench/layer.py) at this TP, batch 1,
with the shipped TUNED table and with the stage-1 winners (`--gemv-config`), interleaved
`--layer-runs` times in this process. A sweep's ranking must be confirmed inside the layer
before TUNED changes (docs/PERF.md round 11): isolated GEMVs follow GEMVs, in the layer they
follow the AttnRes, KDA and MoE kernels.

Output: every mapping's µs and HBM fraction per shape, the winners as a TUNED snippet, and the
layer arms' µs per layer kind (each run's full JSON next to OUT as OUT-layer-<arm>-<i>.json).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time

from raydecode.kernels import gemv as G
from raydecode.kernels import linear as LN

from raydecode.scripts.bench.report_io import report_header, write_report

SM_COUNT = 132
WARP_SLOTS = SM_COUNT * 64          # H200: 64 resident warps per SM


def candidate_configs(N: int, K: int, limit: int) -> list:
    """Valid M = 1 mappings (PDL on), the production one first, then up to `limit` others:
    lanes per row L0 (the widest that splits K's 16-byte chunks), L0/2 and L0/4; every split-K
    warp count that leaves ≥ 2 chunks per lane; rows per group 1, 2, 4; warp rows 1, 2, 4, 8;
    ≤ 512 threads. Ranked by how close their warp count is to half the warp slots, then by how
    evenly their CTAs spread over the SMs (a 1.7-wave grid leaves a third of the SMs idle for
    the last wave), keeping at most 4 per warp count."""
    base = dataclasses.replace(G.config_for(1, N, K), pdl=True, l2_prefetch_mib=0)
    L0 = G._lanes_per_row(K)
    out = []
    for L in sorted({L0, max(1, L0 // 2), max(1, L0 // 4)}, reverse=True):
        per_lane = K // G.VEC // L
        for KW in (d for d in range(1, 17) if per_lane % d == 0 and per_lane // d >= 2):
            for R in (1, 2, 4):
                for WR in (1, 2, 4, 8):
                    c = G.GemvConfig(L, KW, R, WR, 1, pdl=True)
                    if c.threads > 512 or c == base:
                        continue
                    try:
                        c.validate(1, N, K)
                    except ValueError:
                        continue
                    out.append(c)
    out.sort(key=lambda c: (abs(math.log(max(1, warps(c, N)) / (WARP_SLOTS / 2))),
                            -spread(c, N)))
    picked, per_count = [], {}
    for c in out:                   # ≤ 4 per warp count, so the sweep spans several counts
        n = per_count[warps(c, N)] = per_count.get(warps(c, N), 0) + 1
        if n <= 4 and len(picked) < limit:
            picked.append(c)
    return [base] + picked


def warps(c, N: int) -> int:
    return N // c.rows_per_cta * c.threads // G.WARP


def spread(c, N: int) -> float:
    """CTAs / (SMs × CTAs on the busiest SM): 1.0 when every SM gets the same number."""
    ctas = N // c.rows_per_cta
    return ctas / (math.ceil(ctas / SM_COUNT) * SM_COUNT)


def mapping_json(c) -> str:
    return json.dumps({"lanes_per_row": c.lanes_per_row, "k_warps": c.k_warps,
                       "rows_per_group": c.rows_per_group, "row_warps": c.row_warps})


def default_shapes(tp: int) -> list[tuple[str, int, int]]:
    from raydecode.models.params import decode_gemv_shapes
    from raydecode.scripts.bench.step import load_config
    seen, out = set(), []
    for name, (N, K) in decode_gemv_shapes(load_config("k3"), tp, "specialized").items():
        if (N, K) not in seen and LN.linear_uses_cute(1, N, K):
            seen.add((N, K))
            out.append((name, N, K))
    return out


def sweep(shapes, limit: int, min_gain: float, hbm: float, log=print) -> list[dict]:
    from raydecode.scripts.bench.gemv import bench_shape
    rows = []
    for name, N, K in shapes:
        configs = candidate_configs(N, K, limit)
        r = bench_shape(N, K, 1, configs)
        timed = [c for c in r["cute"] if "us" in c]
        for c in timed:
            c["frac_hbm"] = r["weight_bytes"] / (c["us"] * 1e-6) / hbm
        prod = r["cute"][0].get("us")
        best = min(timed, key=lambda c: c["us"]) if timed else None
        r.update(name=name, production_us=prod, best=best)
        r["adopt"] = bool(best and prod and best is not r["cute"][0]
                          and best["us"] < prod * (1 - min_gain))
        rows.append(r)
        log(f"{name:14s} {N:5d}x{K:<5d} production {prod:7.2f} us "
            f"({r['weight_bytes'] / (prod * 1e-6) / hbm:.2f})  best {best['us']:7.2f} us "
            f"({best['frac_hbm']:.2f}) {tuple(best['config'][k] for k in ('lanes_per_row', 'k_warps', 'rows_per_group', 'row_warps'))}"
            f"{'  ADOPT' if r['adopt'] else ''}  cublas {r['cublas_us']:.2f}  [{len(timed)} mappings]",
            flush=True)
    return rows


def confirm_in_layer(rows, tp: int, runs: int, out: str, commit: str, log=print) -> dict:
    from raydecode.scripts.bench import layer
    overrides = [f"{r['N']},{r['K']}={json.dumps({k: r['best']['config'][k] for k in ('lanes_per_row', 'k_warps', 'rows_per_group', 'row_warps')})}"
                 for r in rows if r["adopt"]]
    arms = {"shipped": [], "tuned": overrides}
    res = {a: {} for a in arms}
    for i in range(runs):
        for arm, extra in arms.items():    # --gemv-config: decode options of that run only
            path = out.replace(".json", f"-layer-{arm}-{i + 1}.json")
            argv = ["--tps", str(tp), "--batches", "1", "--kinds", "kda,mla", "--no-check",
                    "--out", path, "--commit", commit]
            for o in extra:
                argv += ["--gemv-config", o]
            layer.main(argv)
            with open(path) as f:
                for r in json.load(f)["results"]:
                    if r["variant"] == "specialized" and "us" in r:
                        res[arm].setdefault(r["kind"], []).append(r["us"])
            log(f"layer arm {arm} run {i + 1}: {res[arm]}", flush=True)
    return {"overrides": overrides, "us": res,
            "median_us": {a: {k: statistics.median(v) for k, v in d.items()} for a, d in res.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--tp", type=int, default=16, choices=(8, 16))
    ap.add_argument("--shapes", default="", help="comma-separated NxK (default: the specialized step's)")
    ap.add_argument("--max-configs", type=int, default=24, help="mappings per shape beside production")
    ap.add_argument("--min-gain", type=float, default=0.03, help="fractional gain a winner needs")
    ap.add_argument("--confirm-layer", action="store_true", help="stage 2: A/B inside the layer")
    ap.add_argument("--layer-runs", type=int, default=2)
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("gemv_tune needs a CUDA GPU", file=sys.stderr)
        return 2
    from raydecode.scripts.bench.gemv import hbm_read_bandwidth
    t0 = time.time()
    if args.shapes:
        try:
            shapes = [("given", *(int(v) for v in s.split("x"))) for s in args.shapes.split(",")]
        except ValueError:
            ap.error(f"--shapes {args.shapes!r}: expected comma-separated NxK, e.g. 3584x7168")
    else:
        shapes = default_shapes(args.tp)
    hbm = hbm_read_bandwidth()["read_reduction_bytes_per_s"]
    print(f"HBM read {hbm / 1e12:.2f} TB/s; {len(shapes)} shapes", flush=True)
    report = report_header(args.commit, tp=args.tp, hbm_read_bytes_per_s=hbm,
                           min_gain=args.min_gain, method=__doc__.split("\n\n", 2)[1:])
    report["shapes"] = sweep(shapes, args.max_configs, args.min_gain, hbm)
    report["tuned_snippet"] = {f"({r['N']}, {r['K']})": mapping_json(G.GemvConfig(**{k: r["best"]["config"][k] for k in ("lanes_per_row", "k_warps", "rows_per_group", "row_warps", "m_tile")}))
                               for r in report["shapes"] if r["adopt"]}
    write_report(report, args.out)
    if args.confirm_layer and report["tuned_snippet"]:
        report["layer"] = confirm_in_layer(report["shapes"], args.tp, args.layer_runs, args.out,
                                           args.commit)
    write_report(report, args.out, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
