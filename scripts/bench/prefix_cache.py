"""Prefix caching through the served path: two agent turns sharing a long prefix, with the
replica's prefix cache on and off.

    python -m raydecode.scripts.bench.prefix_cache [--config k3|tiny] [--device cuda|cpu]
        [--tp 16] [--layers 0] [--dtype bfloat16|float32] [--turn2 agent|branch]
        [--prefix-tokens 2000] [--turn-tokens 48] [--output-tokens 16] [--repeats 3]
        [--prefill-budget 128] [--out bench/results/prefix-cache-….json]

The replica is the stack of scripts/bench/serve.py — the Serve ingress, its Coordinator actor,
one rank actor running rank 0's shard of K3 at TP `--tp` (random weights, graphed decode;
`solo_runner` / `solo_executor`) — deployed twice in one Ray session: with
`enable_prefix_caching` (and `--snapshots` KDA snapshot slots on the rank) and without. Clients
are the official `openai` client, streaming greedy completions of token-id prompts
(`ignore_eos`, `return_token_ids`, `stream_options.include_usage`).

Per repeat (a fresh random prefix each time, the same prompts in both deployments):
    turn 1   prefix (P tokens) + a question (Q tokens)                    -> O tokens
    turn 2   agent:  turn 1's prompt + its O output tokens + a follow-up (Q)  -> O tokens
             branch: turn 1's prompt + a follow-up (Q)                        -> O tokens
TTFT is send -> first token id; cached_tokens is the include_usage chunk's
usage.prompt_tokens_details.cached_tokens. With caching an agent turn resumes from the
snapshot the finished first turn left (its prompt and all output tokens but the last), a branch
from the one its prompt's end left, and prefills only the rest. Summary: the medians over
repeats of turn 2's cached tokens and of TTFT(turn 2) / TTFT(turn 1) with caching on (and off,
for reference), and whether every turn's tokens are the same in both deployments (with the
first differing position of turn 2 where they are not).

Equality is exact only where both deployments compute the same thing. A branch whose first
prompt is a multiple of the prefill budget (the defaults: 2000 + 48 = 16 × 128) runs the same
chunks either way, so its tokens match bit for bit in any dtype: a difference is a bug. An
agent turn resumes at positions its first turn decoded (fused decode kernels) where the
uncached deployment prefills them (chunked kernels): the same math in another order, equal in
float32, and in bfloat16 on random weights (near-tied logits) possibly a few tokens apart.
`--warmup` conversations of the same shapes precede the measured repeats in each deployment
(compilation, first-touch allocations).
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import math
import os
import random
import shutil
import statistics
import time

import torch

from .report_io import git_commit, report_header, write_report
from .serve import (BLOCK, MODEL_NAME, checkpoint_dir, metrics, prompt_id_range, solo_executor,
                    solo_runner, wait_healthy)


async def turn(client, prompt: list[int], max_tokens: int) -> dict:
    """One streamed greedy completion: TTFT, token ids, cached prompt tokens."""
    t0 = time.perf_counter()
    ttft, ids, cached, prompt_tokens = None, [], None, None
    stream = await client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True})
    async for chunk in stream:
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
            det = chunk.usage.prompt_tokens_details
            cached = det.cached_tokens if det is not None else None
        for ch in chunk.choices:
            new = getattr(ch, "token_ids", None) or []
            if new and ttft is None:
                ttft = time.perf_counter() - t0
            ids += new
    return {"ttft_s": ttft, "ids": ids, "cached_tokens": cached, "prompt_tokens": prompt_tokens}


async def conversation(base_url: str, prefix: list[int], q1: list[int], q2: list[int],
                       max_tokens: int, agent: bool = True) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=3600)
    try:
        t1 = await turn(client, prefix + q1, max_tokens)
        t2 = await turn(client, prefix + q1 + (t1["ids"] if agent else []) + q2, max_tokens)
    finally:
        await client.close()
    return {"turn1": t1, "turn2": t2}


def prompts(args, n: int) -> list[tuple[list[int], list[int], list[int]]]:
    """n (prefix, question, follow-up) triples of random ids rank 0 embeds as themselves."""
    lo, hi = prompt_id_range(args.config, args.tp)
    rng = random.Random(args.seed)
    draw = lambda k: [rng.randrange(lo, hi) for _ in range(k)]     # noqa: E731
    return [(draw(args.prefix_tokens), draw(args.turn_tokens), draw(args.turn_tokens))
            for _ in range(n)]


def deploy_config(args, ckpt: str, caching: bool, mml: int):
    from raydecode.actors.config import parse_deploy_config

    return parse_deploy_config({
        "model": ckpt, "served_model_name": MODEL_NAME, "tensor_parallel_size": 1,
        "max_num_seqs": args.num_seqs, "max_model_len": mml, "block_size": BLOCK,
        "max_num_batched_tokens": args.prefill_budget, "dtype": "bfloat16",
        "rank_step_timeout_s": args.step_timeout, "enable_prefix_caching": caching,
        "kda_snapshot_slots": args.snapshots, "placement": {"profile": "development"},
        "serve": {"num_cpus": 1}})


def run_mode(args, ckpt: str, caching: bool, port: int, convs: list) -> dict:
    """Deploy the replica (caching on or off), warm up, run every conversation, tear down."""
    from ray import serve

    from raydecode.actors.serve import deployment_for

    mml = args.prefix_tokens + 2 * (args.turn_tokens + args.output_tokens) + BLOCK
    per_seq = math.ceil(mml / BLOCK)
    S, nb = args.num_seqs, args.num_seqs * per_seq
    snaps = args.snapshots if caching else 0
    runner = functools.partial(solo_runner, args.config, args.tp, args.layers, args.seed, S, nb,
                               per_seq, num_snapshots=snaps, dtype=getattr(torch, args.dtype))
    factory = functools.partial(solo_executor, runner, S, nb, args.step_timeout,
                                args.device == "cuda", snaps)
    name = "cached" if caching else "uncached"
    t = time.perf_counter()
    serve.run(deployment_for(deploy_config(args, ckpt, caching, mml), factory), name=name,
              route_prefix="/", blocking=False)
    root = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(root, args.start_timeout)
        start_s = time.perf_counter() - t
        base = root + "/v1"
        agent = args.turn2 == "agent"
        for c in convs[:args.warmup]:                                         # warm-up
            asyncio.run(conversation(base, *c, args.output_tokens, agent))
        m0 = metrics(root)
        runs = [asyncio.run(conversation(base, *c, args.output_tokens, agent))
                for c in convs[args.warmup:]]
        m1 = metrics(root)
    finally:
        serve.delete(name)
    d = {k: m1.get(k, 0) - m0.get(k, 0) for k in m1}
    for r in runs:
        r["ttft_ratio_turn2_over_turn1"] = round(r["turn2"]["ttft_s"] / r["turn1"]["ttft_s"], 4)
    return {"prefix_caching": caching, "replica_start_s": round(start_s, 1), "runs": runs,
            "prefill_tokens": d.get("raydecode_prefill_tokens_total"),
            "prefix_cache_hits": d.get("raydecode_prefix_cache_hits_total"),
            "steps_by_path": {p: d.get(f'raydecode_steps_total{{path="{p}"}}', 0)
                              for p in ("specialized", "stock")}}


def compare(on: dict, off: dict) -> bool:
    """Per run and turn: identical (and non-empty) tokens in both deployments, else the first
    differing position. -> all identical."""
    same = True
    for a, b in zip(on["runs"], off["runs"]):
        for t in ("turn1", "turn2"):
            x, y = a[t]["ids"], b[t]["ids"]
            a[t]["identical_uncached"] = ok = x == y and len(x) > 0
            a[t]["first_mismatch"] = None if ok else next(
                (i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            same = same and ok
    return same


def summarize(on: dict, off: dict) -> dict:
    med = lambda xs: statistics.median(xs) if xs else None            # noqa: E731
    same = compare(on, off)
    return {
        "cached_tokens_turn2": med([r["turn2"]["cached_tokens"] for r in on["runs"]]),
        "prompt_tokens_turn2": med([r["turn2"]["prompt_tokens"] for r in on["runs"]]),
        "ttft_ratio_turn2_over_turn1": med([r["ttft_ratio_turn2_over_turn1"]
                                            for r in on["runs"]]),
        "ttft_ratio_turn2_over_turn1_uncached": med([r["ttft_ratio_turn2_over_turn1"]
                                                     for r in off["runs"]]),
        "ttft_turn1_ms": round(med([r["turn1"]["ttft_s"] for r in on["runs"]]) * 1e3, 2),
        "ttft_turn2_ms": round(med([r["turn2"]["ttft_s"] for r in on["runs"]]) * 1e3, 2),
        "ttft_turn2_ms_uncached": round(med([r["turn2"]["ttft_s"] for r in off["runs"]]) * 1e3,
                                        2),
        "outputs_identical": same,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="k3", choices=("k3", "tiny"),
                    help="k3 (rank 0's TP shard on a GPU) or tiny (a CPU run of the same code)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tp", type=int, default=16)
    ap.add_argument("--layers", type=int, default=0, help="first N layers (0: all)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="the rank's model and caches (float32: no graph-shaped decode)")
    ap.add_argument("--turn2", default="agent", choices=("agent", "branch"),
                    help="agent: turn 2 continues after turn 1's output; branch: after its "
                         "prompt (exact equality check, see the module docstring)")
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--turn-tokens", type=int, default=48, help="question / follow-up tokens")
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="measured conversations per mode")
    ap.add_argument("--warmup", type=int, default=1, help="conversations before measuring")
    ap.add_argument("--prefill-budget", type=int, default=128,
                    help="max_num_batched_tokens (the prefill chunk)")
    ap.add_argument("--num-seqs", type=int, default=2, help="max_num_seqs of the replica")
    ap.add_argument("--snapshots", type=int, default=8, help="kda_snapshot_slots")
    ap.add_argument("--step-timeout", type=float, default=900.0)
    ap.add_argument("--start-timeout", type=float, default=1800.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None)
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        raise SystemExit(f"--repeats {args.repeats} --warmup {args.warmup}: expected "
                         "repeats >= 1, warmup >= 0")
    t0 = time.time()
    report = report_header(args.commit or git_commit(), bench="prefix_cache", config=args.config,
                           device=args.device, tp=args.tp, layers=args.layers or None,
                           dtype=args.dtype, turn2=args.turn2,
                           prefix_tokens=args.prefix_tokens, turn_tokens=args.turn_tokens,
                           output_tokens=args.output_tokens, prefill_budget=args.prefill_budget,
                           snapshots=args.snapshots, method=__doc__.split("\n\n", 2)[2])
    import ray
    from ray import serve

    from raydecode.commands.serve import start_http
    from raydecode.scripts.load import free_port

    convs = prompts(args, args.warmup + args.repeats)
    ckpt = checkpoint_dir(args.config)
    port = free_port()
    ray.init(address="local", num_gpus=1 if args.device == "cuda" else 0,
             num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, log_to_driver=True)
    try:
        port = start_http("127.0.0.1", port, retry_free=2)
        for caching, mode in ((True, "cached"), (False, "uncached")):
            report[mode] = run_mode(args, ckpt, caching, port, convs)
            ratios = [r["ttft_ratio_turn2_over_turn1"] for r in report[mode]["runs"]]
            print(f"[prefix_cache] {mode}: TTFT turn 2 / turn 1 = {ratios}", flush=True)
            if args.out:
                write_report(report, args.out)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            shutil.rmtree(ckpt, ignore_errors=True)
    report["summary"] = summarize(report["cached"], report["uncached"])
    for mode in ("cached", "uncached"):          # the ids made the comparison; keep counts
        for r in report[mode]["runs"]:
            for t in ("turn1", "turn2"):
                r[t]["output_tokens"] = len(r[t].pop("ids"))
    print("[prefix_cache] summary", report["summary"], flush=True)
    if args.out:
        write_report(report, args.out, t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
