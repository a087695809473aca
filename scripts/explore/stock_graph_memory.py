"""The memory a rank's stock graphs take (GPU): per (layers, cap), the caching allocator's
reserved bytes added by the build's stock-graph warm-up and capture (what
scripts/bench/prefill.py `capture_stock` reports) and the bytes of the runner's graph pool
(`torch.cuda.memory._snapshot()` segments of its pool id), to see how they grow with depth.

    python3 -m raydecode.scripts.explore.stock_graph_memory --out X.json [--configs 16:2048]

Why: 8 K3 layers at TP16 added 1.75 GB at cap 2048 and 0.85 GB at cap 512 on the H100
(bench/results/prefill-h100-2026-12-06-graphs*.json); whether that is per layer decides the
default cap for the 93-layer model.
"""
from __future__ import annotations

import argparse
import time

import torch

from raydecode.scripts.bench.prefill import PrefillRank
from raydecode.scripts.bench.report_io import report_header, write_report
from raydecode.scripts.bench.step import build_model, layer_config


def pool_bytes(pool) -> int:
    segs = torch.cuda.memory._snapshot()["segments"]
    return sum(s["total_size"] for s in segs if tuple(s.get("segment_pool_id", ())) == tuple(pool))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--tp", type=int, default=16)
    ap.add_argument("--configs", default="16:2048")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    report = report_header(args.commit, bench="stock_graph_memory", tp=args.tp, method=__doc__)
    report["rows"] = []
    t0 = time.time()
    for item in args.configs.split(","):
        layers, cap = (int(x) for x in item.split(":"))
        model, _ = build_model(layer_config("k3", layers), args.tp, "cuda", args.seed)
        rank = PrefillRank(model, "cuda", 8192, cap, 63, 1024, args.seed, graphed=True,
                           pad=True, stock_graphs=cap)
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        t1 = time.perf_counter()
        rank.runner.warm_prefill(cap)
        torch.cuda.synchronize()
        row = {"layers": layers, "cap": cap, "capture_s": round(time.perf_counter() - t1, 1),
               "reserved_bytes_added": torch.cuda.memory_reserved() - before,
               "graph_pool_bytes": pool_bytes(rank.runner._pool),
               "captured": sorted(rank.runner.stock_graphs),
               "failed": {str(k): v for k, v in rank.runner.stock_failed.items()}}
        report["rows"].append(row)
        print(f"[mem] {row}", flush=True)
        write_report(report, args.out, t0)
        del rank, model
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
