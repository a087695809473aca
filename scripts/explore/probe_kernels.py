"""A small driver for Nsight Compute (GPU): launches the few-token MXFP4 expert kernels and the
router top-k at K3 per-rank shapes, each config a few times, outside any CUDA graph, so
`ncu -k regex:...` sees named launches. Also prints each config's time in a CUDA graph over
rotating routings (the same timing as the layer benchmark's MoE sweep), so a profile and a time
come from one process.

    ncu --clock-control none --set full -k regex:"_gate_up|_down_kernel|_route" \
        python3 -m raydecode.scripts.explore.probe_kernels --tp 16 --batch 1

Configs: the TUNED one, then the `--config` JSON dicts of `DecodeConfig` fields (optional), then
with `--mma` every `moe_mxfp4_decode_mma.candidates` config (tensor cores).

`--mla-fused 1,2,8,64`: instead, the MLA block after the q_b GEMV as 4 kernels vs the fused
one, and a %globaltimer trace of the fused kernel's phases (`mla_fused`).

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
from raydecode.kernels.experimental import moe_mxfp4_decode_mma as MM
from raydecode.kernels.router import route_topk_reference
from raydecode.kernels.router_triton import route_topk_triton
from raydecode.models.config import load_config

from .layer_moe_sweep import check_and_time, expert_bank, random_calls
from raydecode.scripts.bench.layer_timing import GraphTimer


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


def mla_fused(batch: int, context: int, heads: int, copies: int = 8) -> list[dict]:
    """The MLA attention block after the q_b GEMV: prep + absorb + split + output (4 kernels)
    vs the fused kernel (one launch at 8 and at 4 warps) vs phase A + split + output (3),
    each in a graph over `copies` caches; then traced eager launches of the fused kernel: per
    phase, programs, the spread of their starts, the mean wait and work, the phase end (ns
    from the first start; %globaltimer)."""
    kl, r, nope, v, ql, bs = 512, 64, 128, 128, 1536, 64
    g = torch.Generator(device="cuda").manual_seed(1)
    bf = torch.bfloat16
    rn = lambda *sh, sc=1.0: (torch.randn(*sh, generator=g, device="cuda") * sc).to(bf)  # noqa
    pages = -(-context // bs)
    w_uk, w_uv = rn(heads, nope, kl, sc=nope ** -0.5), rn(heads, kl, v, sc=kl ** -0.5)
    wq = torch.ones(ql, device="cuda")
    wkv = torch.ones(kl, device="cuda")
    sync = torch.zeros(8, dtype=torch.int32, device="cuda")
    sets = []
    for _ in range(copies):
        cache = rn(batch * pages, bs, kl + r)
        bt = torch.arange(batch * pages, device="cuda", dtype=torch.int32).view(batch, pages)
        seq = torch.full((batch,), context, device="cuda", dtype=torch.int32)
        sets.append(dict(qkv=rn(batch, ql + kl + r), q=rn(batch, heads, nope + r),
                         cache=cache, bt=bt, seq=seq, pos=(seq - 1).long(),
                         gate=rn(batch, heads * v)))
    kw = dict(kv_lora=kl, scale=(nope + r) ** -0.5)

    def four(a):
        MLA.mla_prep(a["qkv"], wq, wkv, a["cache"], a["bt"], a["pos"], q_lora=ql, kv_lora=kl,
                     eps=1e-6)
        q_abs = MLA.mla_absorb(a["q"], w_uk, nope=nope)
        return MLA.mla_decode(q_abs, a["cache"], a["bt"], a["seq"], w_uv, a["gate"], **kw)

    S = MLA.default_num_splits(batch, pages * bs)

    def fused(a, trace=None, warps=None, three=False):
        q_abs = a["q"].new_empty(batch, heads, kl + r)
        o_p = a["q"].new_empty(batch, S, heads, kl, dtype=torch.float32)
        l_p = a["q"].new_empty(batch, S, heads, dtype=torch.float32)
        out = a["gate"].new_empty(batch, heads * v)
        MT.fused_triton(a["qkv"], a["q"], wkv, w_uk, a["cache"], a["bt"], a["pos"], a["seq"],
                        w_uv, a["gate"], ql, kl, 1e-6, kw["scale"], q_abs, o_p, l_p, sync, out,
                        only_a=three, num_warps=warps, trace=trace)
        if three:
            MT.split_triton(q_abs, a["cache"], a["bt"], a["seq"], kl, kw["scale"], o_p, l_p)
            MT.output_triton(o_p, l_p, w_uv, a["gate"], out)
        return out

    ref = MLA.mla_decode_fused_reference(**{k: sets[0][k].clone() if k == "cache" else
                                            sets[0][k] for k in ("qkv", "q", "cache")},
                                         kv_norm_w=wkv, w_uk=w_uk, block_table=sets[0]["bt"],
                                         positions=sets[0]["pos"], seq_lens=sets[0]["seq"],
                                         w_uv_t=w_uv, gate=sets[0]["gate"], q_lora=ql,
                                         eps=1e-6, **kw).float()
    row = {"probe": "mla_fused", "batch": batch, "context": context, "heads": heads,
           "splits": S}
    variants = {"four": four, "fused": fused, "fused_w4": lambda a: fused(a, warps=4),
                "three": lambda a: fused(a, three=True)}
    for name, fn in variants.items():
        if name != "four":
            row[f"rel_err_{name}"] = float((fn(sets[0]).float() - ref).norm() / ref.norm())
        t = GraphTimer(replays=20, warm=3).run([lambda a=a, fn=fn: fn(a) for a in sets],
                                               count_nodes=False)
        row[f"{name}_us"] = t.us_per_call
    MLA.check_fused_sync(sync)
    n = MT.fused_grid(batch, heads, S, kl, v)
    bounds = [("A", 0, n["A"]), ("B", n["A"], n["A"] + n["B"]),
              ("C", n["A"] + n["B"], n["total"])]
    for warps in (8, 4):
        trace = torch.zeros(n["total"], 4, dtype=torch.int64, device="cuda")
        for _ in range(3):
            fused(sets[1], trace, warps)
        torch.cuda.synchronize()
        tr = trace.cpu()
        t0 = int(tr[:, 1].min())
        row[f"trace_w{warps}"] = {ph: {
            "programs": hi - lo, "sms": len(set(tr[lo:hi, 0].tolist())),
            "start_spread_ns": int(tr[lo:hi, 1].max() - tr[lo:hi, 1].min()),
            "first_start_ns": int(tr[lo:hi, 1].min()) - t0,
            "mean_wait_ns": float((tr[lo:hi, 2] - tr[lo:hi, 1]).float().mean()),
            "mean_work_ns": float((tr[lo:hi, 3] - tr[lo:hi, 2]).float().mean()),
            "max_work_ns": int((tr[lo:hi, 3] - tr[lo:hi, 2]).max()),
            "end_ns": int(tr[lo:hi, 3].max()) - t0} for ph, lo, hi in bounds}
    print(json.dumps(row), flush=True)
    return [row]


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
    ap.add_argument("--router-only", action="store_true",
                    help="only the router forms (selection × weight gather), interleaved rounds")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds of the router forms")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--min-chunk", type=int, default=32, help="MLA split floor for the probe")
    ap.add_argument("--mla-fused", default=None,
                    help="comma list of batches: MLA 4-kernel vs fused probe (+ phase trace)")
    ap.add_argument("--heads", type=int, default=6, help="MLA heads per rank (TP16: 6)")
    a = ap.parse_args(argv)
    if a.mla_fused:
        rows = [r for b in a.mla_fused.split(",")
                for r in mla_fused(int(b), a.context, a.heads)]
        if a.out:
            _write(a.out, rows, a.commit)
        return 0
    if a.mla_splits:
        rows = mla_splits([int(x) for x in a.mla_splits.split(",")], a.batch, a.context,
                          a.min_chunk)
        if a.out:
            _write(a.out, rows, a.commit)
        return 0
    cfg = load_config("k3").moe
    if a.router_only:
        rows = router_rows(cfg, a.batch, a.rounds, time_it=not a.no_time)
        if a.out:
            _write(a.out, rows, a.commit)
        return 0
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
    rows += router_rows(cfg, a.batch, a.rounds, time_it=not a.no_time)
    if a.out:
        _write(a.out, rows, a.commit)
    return 0


# (sort, gather, warps; None: the launch's default): r4, r5, r22, then the warps a prefill
# step's thousands of one-token programs might prefer (fewer: reductions in shuffles alone)
ROUTER_FORMS = ((False, False, None), (True, False, None), (True, True, None), (True, True, 1),
                (True, True, 2), (False, True, 1), (False, True, 2))


def router_rows(cfg, batch: int, rounds: int, time_it: bool = True) -> list[dict]:
    """The router's forms, 16 calls per graph over 16 logit rows (E = cfg.num_experts), in
    `rounds` interleaved rounds; each form first checked against the reference (same ids,
    weights within 1e-6), which is all that runs without `time_it` (eager launches, ncu)."""
    logits = torch.randn(16, batch, cfg.num_experts, device="cuda")
    bias = torch.randn(cfg.num_experts, device="cuda") * 0.1
    rw, rid = route_topk_reference(logits[0], bias, cfg.top_k)
    for sort, gather, warps in ROUTER_FORMS:
        w, ids = route_topk_triton(logits[0], bias, cfg.top_k, sort=sort, gather=gather,
                                   num_warps=warps)
        if not torch.equal(ids, rid) or float((w - rw).abs().max()) > 1e-6:
            raise SystemExit(f"route_topk sort={sort} gather={gather} warps={warps} differs "
                             "from the reference")
    torch.cuda.synchronize()
    rows = []
    for r in range(rounds if time_it else 0):
        for sort, gather, warps in ROUTER_FORMS:
            fns = [lambda x=x, s=sort, g=gather, nw=warps: route_topk_triton(
                       x, bias, cfg.top_k, sort=s, gather=g, num_warps=nw)
                   for x in logits]
            t = GraphTimer(replays=20, warm=3).run(fns, count_nodes=False)
            rows.append({"probe": "route_topk", "batch": batch, "sort": sort, "gather": gather,
                         "warps": warps, "round": r, "us": t.us_per_call})
            print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
