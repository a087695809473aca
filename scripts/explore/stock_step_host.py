"""Where the host time of a piecewise-graphed stock step goes (GPU): per case, the step's wall
time, then one step under torch.profiler (host and device activity) — the host ops by self
time, the CUDA runtime calls (launches, copies, synchronizations) — and one under
`torch.cuda.set_sync_debug_mode("warn")`, which names every synchronizing call and where.

    python3 -m raydecode.scripts.explore.stock_step_host --out X.json [--tp 16] [--layers 8] \
        [--cap 512] [--cases 1:0,256:0,0:63,256:63]

Why: the first H100 round with every bucket captured (5da1403, bench/results/
prefill-h100-2026-12-06-graphs.json, 8 layers, TP16) left a graphed one-token chunk at 9.1
ms and a 256-token chunk at 8.7 ms, where 9 graph launches and 8 eager attention cores were
predicted at 3-4 ms: the cores' host time (about 1 ms each) is the step now. A case is
CHUNK:DECODES on the bench's rank (scripts/bench/prefill.py `PrefillRank`): a chunk of
CHUNK tokens of the prompt slot at the bench's context beside DECODES one-token decoders.
"""
from __future__ import annotations

import statistics
import time
import warnings

import torch

from raydecode.scripts.bench.prefill import PrefillRank
from raydecode.scripts.bench.report_io import report_header, write_report
from raydecode.scripts.bench.step import build_model, device_sync, layer_config
from raydecode.scripts.explore.common import rank_parser


def _cases(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        c, d = item.split(":")
        out.append((int(c), int(d)))
    return out


def host_profile(rank: PrefillRank, chunk: int, decodes: int, top: int = 25) -> dict:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if rank.device.type == "cuda"
                                     else [])
    plan = rank.plan(chunk, decodes)
    device_sync(rank.device)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        rank.runner.execute(plan)
        device_sync(rank.device)
        wall = time.perf_counter() - t0
    ev = prof.key_averages()
    rows = sorted(ev, key=lambda e: e.self_cpu_time_total, reverse=True)
    runtime = {e.key: {"calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3)}
               for e in ev if e.key.startswith("cuda") or e.key.startswith("cu")}
    return {"wall_ms_profiled": round(wall * 1e3, 3),
            "host_top": [{"op": e.key[:120], "calls": e.count,
                          "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3),
                          "cpu_total_ms": round(e.cpu_time_total / 1e3, 3)}
                         for e in rows[:top]],
            "runtime_calls": runtime,
            "host_self_ms_total": round(sum(e.self_cpu_time_total for e in ev) / 1e3, 3)}


def syncs(rank: PrefillRank, chunk: int, decodes: int) -> list[dict]:
    """Every synchronizing CUDA call one step makes: the Python line that made it (a
    warning's location), counted."""
    if rank.device.type != "cuda":
        return []
    plan = rank.plan(chunk, decodes)
    device_sync(rank.device)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            rank.runner.execute(plan)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    seen: dict[str, int] = {}
    for w in got:
        where = f"{w.filename}:{w.lineno}: {str(w.message)[:60]}"
        seen[where] = seen.get(where, 0) + 1
    return [{"where": k, "count": v} for k, v in sorted(seen.items(), key=lambda x: -x[1])]


def core_times(rank: PrefillRank, chunk: int, decodes: int) -> dict | None:
    """One graphed step with StockGraph.replay timed on the host: each graph launch and each
    eager core (perf_counter around the call, no sync: the host's own time), by core kind."""
    from raydecode.engine.piecewise import StockGraph

    plan = rank.plan(chunk, decodes)
    if rank.runner.stock_graph_of(plan) is None:
        return None
    real = StockGraph.replay
    got = {"graph_ms": [], "core_ms": [], "core": []}

    def timed(self, batch, observe=None):
        for graph, c in zip(self.graphs, self.cores):
            t0 = time.perf_counter()
            graph.replay()
            t1 = time.perf_counter()
            c.out.copy_(c.fn(batch, c.caches, *c.ins))
            t2 = time.perf_counter()
            got["graph_ms"].append((t1 - t0) * 1e3)
            got["core_ms"].append((t2 - t1) * 1e3)
            got["core"].append(type(getattr(c.fn, "__self__", None)).__name__)
        t0 = time.perf_counter()
        self.graphs[-1].replay()
        got["graph_ms"].append((time.perf_counter() - t0) * 1e3)
        self.replays += 1
        return self.hidden

    device_sync(rank.device)
    StockGraph.replay = timed
    try:
        t0 = time.perf_counter()
        rank.runner.execute(plan)
        host = time.perf_counter() - t0
        device_sync(rank.device)
        wall = time.perf_counter() - t0
    finally:
        StockGraph.replay = real
    by: dict[str, list[float]] = {}
    for name, ms in zip(got["core"], got["core_ms"]):
        by.setdefault(name, []).append(ms)
    return {"step_host_ms": round(host * 1e3, 3), "step_wall_ms": round(wall * 1e3, 3),
            "graphs_ms": round(sum(got["graph_ms"]), 3),
            "cores_ms": round(sum(got["core_ms"]), 3),
            "per_core_ms": {k: round(statistics.median(v), 3) for k, v in by.items()},
            "cores": {k: len(v) for k, v in by.items()}}


def main(argv=None) -> int:
    ap = rank_parser(__doc__)
    ap.add_argument("--cap", type=int, default=512)
    ap.add_argument("--cases", default="1:0,256:0,0:63,256:63")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    cases = _cases(args.cases)
    cfg = layer_config("k3", args.layers)
    model, _ = build_model(cfg, args.tp, args.device, args.seed)
    rank = PrefillRank(model, args.device, 8192, args.cap, 63, 1024, args.seed,
                       graphed=True, pad=True, stock_graphs=args.cap)
    t0 = time.time()
    rank.runner.warm_prefill(args.cap)
    report = report_header(args.commit, bench="stock_step_host", tp=args.tp,
                           layers=args.layers, cap=args.cap, method=__doc__,
                           captured=sorted(rank.runner.stock_graphs),
                           failed={str(k): v for k, v in rank.runner.stock_failed.items()})
    report["cases"] = []
    for chunk, decodes in cases:
        for _ in range(2):
            rank.step(chunk, decodes)
        ms = [rank.step(chunk, decodes) * 1e3 for _ in range(args.reps)]
        row = {"chunk": chunk, "decodes": decodes, "wall_ms": round(statistics.median(ms), 3),
               "graphed": rank.runner.stock_graph_of(rank.plan(chunk, decodes)) is not None}
        row["core_times"] = ct = core_times(rank, chunk, decodes)
        row["profile"] = host_profile(rank, chunk, decodes)
        row["syncs"] = syncs(rank, chunk, decodes)
        report["cases"].append(row)
        print(f"[host] chunk {chunk} decodes {decodes}: {row['wall_ms']} ms graphed "
              f"{row['graphed']} host self {row['profile']['host_self_ms_total']} ms; syncs "
              f"{row['syncs'][:6]}; replay host {ct}", flush=True)
        for r in row["profile"]["host_top"][:18]:
            print(f"[host]    {r['self_cpu_ms']:8.3f} ms {r['calls']:5d}x {r['op']}", flush=True)
        write_report(report, args.out, t0)
    if rank.graphs:
        ms = [rank.step(0, 63, "specialized") * 1e3 for _ in range(args.reps)]
        report["decode_graphed_ms"] = round(statistics.median(ms), 3)
        print(f"[host] graphed decode 63: {report['decode_graphed_ms']} ms", flush=True)
    write_report(report, args.out, t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
