"""Where a piecewise-graphed stock step's replay leaves its eager pass (GPU): per attention
core, the core's inputs (what the graph before it made) and output, eager against eager and
replay against eager.

    python3 -m raydecode.scripts.explore.stock_graph_probe --out X.json [--tp 16] \
        [--layers 8] [--buckets 2048,256,16] [--tokens zeros|random]

Why: the first H100 round of the stock graphs (engine/piecewise.py) captured bucket 2,048 but
its check replay left the warm pass by 0.68 (relative max-abs of the hidden state), where the
CPU's emulated graphs replay bit-exactly. Per bucket, on the bench's rank (scripts/bench/
prefill.py `PrefillRank`, the runner's scratch rows, the bucket's pad table as the capture
uses it): two eager passes recording every core's tensors (the second says how far eager is
from itself: kernels whose sums are not ordered), then the capture (capture_stock_graph, on
the runner's side stream), then a replay recording the same tensors, on the default stream and
again on the side stream. The first core whose inputs leave the eager ones by more than eager
leaves itself names the graph piece that replays something else than it ran.
"""
from __future__ import annotations

import contextlib
import time

import torch

from raydecode.engine.piecewise import Pieces, capture_stock_graph
from raydecode.engine.scheduler import StepPlan
from raydecode.models.cache import StepBatch
from raydecode.scripts.bench.prefill import PrefillRank
from raydecode.scripts.bench.report_io import report_header, write_report
from raydecode.scripts.bench.step import build_model, layer_config
from raydecode.scripts.explore.common import rank_parser


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b| (b the reference), fp64."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


class Recording(Pieces):
    """An eager pass ("warm" mode) that keeps a copy of every core's tensors and output."""

    def __init__(self, tokens: int):
        super().__init__("warm", tokens)
        self.log: list[tuple[list[torch.Tensor], torch.Tensor, str]] = []

    def core(self, fn, batch, caches, *tensors):
        out = fn(batch, caches, *tensors)
        owner = getattr(fn, "__self__", None)
        name = f"{type(owner).__name__}[{getattr(owner, 'layer_idx', '?')}]"
        self.log.append(([t.clone() for t in tensors], out.clone(), name))
        return out


def eager_pass(forward, caches, bucket: int):
    rec = Recording(bucket)
    caches.pieces = rec
    try:
        hidden = forward().clone()
    finally:
        caches.pieces = None
    return hidden, rec.log


def replay_pass(sg, batch):
    log = []
    for graph, c in zip(sg.graphs, sg.cores):
        graph.replay()
        ins = [x.clone() for x in c.ins]
        out = c.fn(batch, c.caches, *c.ins)
        log.append((ins, out.clone(), ""))
        c.out.copy_(out)
    sg.graphs[-1].replay()
    return sg.hidden.clone(), log


def compare(log, ref) -> list[dict]:
    rows = []
    for k, ((ins, out, _), (rins, rout, name)) in enumerate(zip(log, ref)):
        rows.append({"core": k, "layer": name,
                     "ins": [round(_err(a, b), 6) for a, b in zip(ins, rins)],
                     "out": round(_err(out, rout), 6)})
    return rows


def first_off(rows, floor: list[dict], factor: float = 10.0, atol: float = 1e-3):
    for r, f in zip(rows, floor):
        if max(r["ins"]) > max(atol, factor * max(f["ins"])):
            return r["core"], "ins"
        if r["out"] > max(atol, factor * f["out"]):
            return r["core"], "out"
    return None


@torch.inference_mode()
def probe(rank: PrefillRank, bucket: int, which: str, seed: int) -> dict:
    r = rank.runner
    plan = r._padded(StepPlan(0, StepBatch([]), [], [], {}, [], "stock"), bucket)
    if which == "zeros":
        tokens = torch.zeros(bucket, dtype=torch.long, device=r.device)
    else:
        g = torch.Generator().manual_seed(seed)
        lo, hi = rank.vocab.start, rank.vocab.stop
        tokens = torch.randint(lo, hi, (bucket,), generator=g).to(r.device)

    def forward():
        return r.model(tokens, plan.batch, r.caches, path="stock")

    cuda = r.device.type == "cuda"
    side = r._capture_stream()
    on_side = (lambda: torch.cuda.stream(side)) if cuda else contextlib.nullcontext
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        side.wait_stream(torch.cuda.current_stream())
    t0 = time.perf_counter()
    with r._pad_table(bucket, skip=False), on_side():
        h1, log1 = eager_pass(forward, r.caches, bucket)
        h2, log2 = eager_pass(forward, r.caches, bucket)
        _, sg = capture_stock_graph(forward, r.caches, bucket, tokens, r._stock_buffers,
                                    r.stock_backend)
    if cuda:
        torch.cuda.current_stream().wait_stream(side)
    sync()
    with r._pad_table(bucket, skip=False):
        hr, logr = replay_pass(sg, plan.batch)
        sync()
        with on_side():
            hs, logs = replay_pass(sg, plan.batch)
        sync()
        h3, log3 = eager_pass(forward, r.caches, bucket)
    sync()
    floor = compare(log2, log1)
    rep, rep_side, after = compare(logr, log1), compare(logs, log1), compare(log3, log1)
    out = {"bucket": bucket, "tokens": which, "cores": len(log1), "graphs": len(sg.graphs),
           "seconds": round(time.perf_counter() - t0, 2),
           "hidden": {"eager2": _err(h2, h1), "replay": _err(hr, h1),
                      "replay_side_stream": _err(hs, h1), "eager_after": _err(h3, h1)},
           "first_off": {"replay": first_off(rep, floor),
                         "replay_side_stream": first_off(rep_side, floor),
                         "eager_after": first_off(after, floor)},
           "per_core": {"eager2": floor, "replay": rep, "replay_side_stream": rep_side,
                        "eager_after": after}}
    print(f"[probe] bucket {bucket} tokens {which}: hidden {out['hidden']} first off "
          f"{out['first_off']}", flush=True)
    for k, (f, a) in enumerate(zip(floor, rep)):
        print(f"[probe]   core {k:2d} {a['layer']:18s} eager2 ins {f['ins']} out {f['out']} | "
              f"replay ins {a['ins']} out {a['out']}", flush=True)
    return out


def main(argv=None) -> int:
    ap = rank_parser(__doc__)
    ap.add_argument("--buckets", default="2048,256,16")
    ap.add_argument("--tokens", default="zeros,random")
    args = ap.parse_args(argv)
    buckets = sorted({int(b) for b in args.buckets.split(",")}, reverse=True)
    cfg = layer_config("k3", args.layers)
    model, _ = build_model(cfg, args.tp, args.device, args.seed)
    rank = PrefillRank(model, args.device, max(buckets) + 64, max(buckets), 1, 64, args.seed,
                       graphed=False, pad=True, stock_graphs=max(buckets))
    report = report_header(args.commit, bench="stock_graph_probe", tp=args.tp,
                           layers=args.layers, buckets=buckets, method=__doc__)
    report["runs"] = []
    t0 = time.time()
    for b in buckets:
        for which in args.tokens.split(","):
            try:
                report["runs"].append(probe(rank, b, which, args.seed))
            except Exception as e:  # noqa: BLE001 — the next bucket still runs
                print(f"[probe] bucket {b} {which}: {type(e).__name__}: {e}", flush=True)
                report["runs"].append({"bucket": b, "tokens": which,
                                       "error": f"{type(e).__name__}: {e}"})
            write_report(report, args.out, t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
