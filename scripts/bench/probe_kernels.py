"""A small driver for Nsight Compute (GPU): launches the few-token MXFP4 expert kernels and the
router top-k at K3 per-rank shapes, each config a few times, outside any CUDA graph, so
`ncu -k regex:...` sees named launches. Also prints each config's time in a CUDA graph over
rotating routings (the same timing as the layer benchmark's MoE sweep), so a profile and a time
come from one process.

    ncu --clock-control none --set full -k regex:"_gate_up|_down_kernel|_route" \
        python3 -m raydecode.scripts.bench.probe_kernels --tp 16 --batch 1

Configs: the TUNED one, then the `--config` JSON dicts of `DecodeConfig` fields (optional), then
with `--mma` every `moe_mxfp4_decode_mma.candidates` config (tensor cores).

`--mla-splits 8,16,32`: instead, times MLA split attention + output (`mla_decode`, 2 kernels)
per KV split count S at the TP16 per-rank shape (6 heads, latent 512 + rope 64), context
`--context`, 64-row pages, 8 copies of the cache in one graph (out of L2), and prints a JSON row
per S (`--min-chunk` replaces the kernel's MIN_CHUNK = 64 floor for the probe).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json

import torch

from raydecode.kernels import mla_decode as MLA
from raydecode.kernels import mla_decode_triton as MT
from raydecode.kernels import moe_mxfp4_decode as D
from raydecode.kernels import moe_mxfp4_decode_mma as MM
from raydecode.kernels.router import route_topk
from raydecode.kernels.router_triton import route_topk_triton
from raydecode.models.config import load_config

from .layer_moe_sweep import check_and_time, expert_bank, random_calls
from .layer_timing import GraphTimer


def mla_splits(splits: list[int], batch: int, context: int, min_chunk: int,
               copies: int = 8) -> list[dict]:
    h, kl, r, v, bs = 6, 512, 64, 128, 64
    MT.MIN_CHUNK = min_chunk         # the kernel's floor on rows per split (module constant)
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    rn = lambda *sh: torch.randn(*sh, generator=g, device="cuda").to(bf)   # noqa: E731
    pages = -(-context // bs)
    sets = []
    for _ in range(copies):
        cache = rn(batch * pages, bs, kl + r)
        bt = torch.arange(batch * pages, device="cuda", dtype=torch.int32).view(batch, pages)
        seq = torch.full((batch,), context, device="cuda", dtype=torch.int32)
        sets.append((rn(batch, h, kl + r), cache, bt, seq, rn(h, kl, v) * kl ** -0.5,
                     rn(batch, h * v)))
    ref = MLA.mla_decode(*sets[0][:4], sets[0][4], sets[0][5], kv_lora=kl, scale=0.07,
                         num_splits=1).float()
    rows = []
    for S in splits:
        fns = [lambda a=a, S=S: MLA.mla_decode(*a[:4], a[4], a[5], kv_lora=kl, scale=0.07,
                                               num_splits=S) for a in sets]
        err = float((fns[0]().float() - ref).norm() / ref.norm())
        t = GraphTimer(replays=20, warm=3).run(fns, count_nodes=False)
        rows.append({"probe": "mla_splits", "batch": batch, "context": context, "S": S,
                     "min_chunk": min_chunk,
                     "heuristic_S": MLA.default_num_splits(batch, pages * bs),
                     "us": t.us_per_call, "rel_err_vs_S1": err})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _write(path: str, rows: list[dict], commit: str) -> None:
    meta = {"gpu": torch.cuda.get_device_name(), "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "rows": rows}
    with open(path, "w") as f:
        json.dump(meta, f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--launches", type=int, default=2, help="eager launches per config")
    ap.add_argument("--config", action="append", default=[],
                    help="extra DecodeConfig fields as JSON (repeatable)")
    ap.add_argument("--out", default=None, help="JSON of the graph timings")
    ap.add_argument("--commit", default="unknown", help="recorded in the --out JSON")
    ap.add_argument("--mma", action="store_true", help="also the tensor-core MoE candidates")
    ap.add_argument("--no-time", action="store_true", help="eager launches only (under ncu)")
    ap.add_argument("--mla-splits", default=None, help="comma list of S: MLA split probe")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--min-chunk", type=int, default=32, help="MLA split floor for the probe")
    a = ap.parse_args(argv)
    if a.mla_splits:
        rows = mla_splits([int(x) for x in a.mla_splits.split(",")], a.batch, a.context,
                          a.min_chunk)
        if a.out:
            _write(a.out, rows, a.commit)
        return 0
    cfg = load_config("k3").moe
    bank = expert_bank(cfg, a.tp, seed=0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    z, routes, touched, nbytes, ref = random_calls(bank, a.batch, cfg.top_k, 12, gen)
    I, L = bank.intermediate, bank.latent
    base = D.default_decode_config(bank.num_experts, I, L)
    configs = [base] + [dataclasses.replace(base, **json.loads(c)) for c in a.config]
    rows = []
    for c in configs:
        row = {"tp": a.tp, "batch": a.batch, "config": dataclasses.asdict(c),
               "bytes_per_call": nbytes, "touched_experts": touched}
        for _ in range(a.launches):
            D.moe_mxfp4_decode(z, *routes[0], bank, c)
        if not a.no_time:
            check_and_time(lambda r, c=c: D.moe_mxfp4_decode(z, *r, bank, c), routes, ref,
                           nbytes, row)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.mma:               # the tensor-core variant's sweep candidates, same checks/timing
        for c in MM.candidates(bank.num_experts, I, L):
            row = {"tp": a.tp, "batch": a.batch, "kernel": "mma", "config": dataclasses.asdict(c),
                   "bytes_per_call": nbytes, "touched_experts": touched}
            for _ in range(a.launches):
                MM.moe_mxfp4_decode_mma(z, *routes[0], bank, c)
            if not a.no_time:
                check_and_time(lambda r, c=c: MM.moe_mxfp4_decode_mma(z, *r, bank, c), routes,
                               ref, nbytes, row)
            rows.append(row)
            print(json.dumps(row), flush=True)
    logits = torch.randn(16, a.batch, bank.num_experts, device="cuda")
    bias = torch.randn(bank.num_experts, device="cuda") * 0.1
    for _ in range(a.launches):
        route_topk(logits[0], bias, cfg.top_k)
    torch.cuda.synchronize()
    if not a.no_time:       # the router's two selection algorithms, 16 calls per graph
        for sort in (False, True):
            fns = [lambda x=x, s=sort: route_topk_triton(x, bias, cfg.top_k, sort=s)
                   for x in logits]
            t = GraphTimer(replays=20, warm=3).run(fns, count_nodes=False)
            rows.append({"probe": "route_topk", "batch": a.batch, "sort": sort,
                         "us": t.us_per_call})
            print(json.dumps(rows[-1]), flush=True)
    if a.out:
        _write(a.out, rows, a.commit)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
