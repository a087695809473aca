"""The whole served path on one GPU host: HTTP through Ray Serve, the coordinator, a rank actor
on the GPU, against the graphed step of the same batch measured in the same run.

    python -m raydecode.scripts.bench.serve [--tp 16] [--layers 0] [--levels 1,4,16,64]
        [--prompt-tokens 16] [--output-tokens 96] [--control-plane PATH]
        [--out bench/results/serve-….json] [--png bench/results/serve-….png]

The replica is the real stack — the Serve ingress (`actors/serve.py` deployment), its
Coordinator actor, a RankGroupExecutor whose one rank actor runs the persistent step loop on
the GPU — with one change: the rank's runner is rank 0's shard of K3 at TP `--tp` (all layers,
random weights drawn on the device, `SoloRankComm`: all-reduces skipped and counted, gathers
tiled), a GraphedRunner whose buckets are captured at build, as a rank of a TP16 replica runs
them. Clients are the official `openai` async client, streaming completions of token-id
prompts (greedy, `ignore_eos`, `return_token_ids`).

Per concurrency c: a warm-up round, then c requests sent at once. TTFT is send → first token;
the decode rate is the steady window in which all c streams decode (after the last first
token, before the first finish): each stream's token interval there is its TPOT at batch c
(the prompts' stock prefill steps are outside it), p50 / p90 over streams; the conventional
first-to-last-token TPOT is reported too. Output tok/s = tokens of the round / its wall time.
After Serve is shut down the same model (same seed) is built in this process and the step
bench's graphed step is timed at batch c, context = prompt + output / 2
(`scripts/bench/step.py`), so `served_over_graphed_c{c}` = steady TPOT p50 / graphed step.
The control-plane counters of /metrics say what crossed from the rank per step (no logits).
Greedy check: the c = 1 request's tokens against an in-process LLMEngine on the same weights.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import math
import os
import random
import shutil
import statistics
import tempfile
import time
import urllib.request

import torch

from .report_io import git_commit, report_header, write_report

MODEL_NAME = "k3-solo"
BLOCK = 16


# ---- the rank's runner: rank 0's shard of K3 at TP `tp`, graphed ------------------------------
def solo_model(config: str, tp: int, layers: int, seed: int, device: str = "cuda",
               dtype: torch.dtype = torch.bfloat16):
    from raydecode.models.config import load_config
    from raydecode.models.k3 import K3ForCausalLM
    from raydecode.models.parallel import Parallel

    from .random_init import SoloRankComm, init_on_device_

    cfg = load_config(config)
    if layers:
        cfg = dataclasses.replace(cfg, num_layers=layers)
    par = Parallel(0, tp)
    with torch.device(device):
        return init_on_device_(K3ForCausalLM(cfg, par, SoloRankComm(par), dtype), seed)


def solo_runner(config: str, tp: int, layers: int, seed: int, num_slots: int, num_blocks: int,
                max_blocks: int, par, comm, device, *, num_snapshots: int = 0,
                dtype: torch.dtype = torch.bfloat16):
    """RunnerFactory of the benchmark's rank (ignores the group's par/comm: it plays rank 0 of
    TP `tp` alone); num_snapshots KDA snapshot slots for prefix caching. The decode steps are
    graph-shaped for bf16 (a float32 model runs every step on the plain path)."""
    from raydecode.actors.rank_worker import ShardSpec
    from raydecode.engine.step_graph import GraphedRunner, graph_cache_sizes
    from raydecode.models.k3 import make_caches

    model = solo_model(config, tp, layers, seed, device, dtype)
    buckets = ShardSpec("", num_slots=num_slots).graph_buckets      # up to num_slots' bucket
    ns, nb = graph_cache_sizes(num_slots, num_blocks, buckets)
    caches = make_caches(model.cfg, model.par, ns, nb, BLOCK, dtype, device=device,
                         num_snapshots=num_snapshots)
    return GraphedRunner(model, caches, device, num_slots=num_slots, num_blocks=num_blocks,
                         max_blocks=max_blocks, buckets=buckets)


def solo_executor(runner_factory, num_slots: int, num_blocks: int, step_timeout_s: float,
                  gpu: bool = True, num_snapshots: int = 0):
    """The replica's executor: one rank actor running `runner_factory`; num_snapshots: the
    KDA snapshot slots that factory's caches hold (what the coordinator's prefix cache may
    address)."""
    from raydecode.actors.rank_group import make_rank_group_executor

    ex = make_rank_group_executor(
        "tiny", 1, 1, "bfloat16", num_slots, num_blocks, BLOCK, step_timeout_s,
        init_timeout_s=1800.0, num_gpus_per_rank=1.0 if gpu else 0.0,
        num_cpus_per_rank=0.5, runner_factory=runner_factory)
    ex.kda_snapshot_slots = num_snapshots
    return ex


def prompt_id_range(config: str, tp: int) -> tuple[int, int]:
    """[lo, hi) of the prompt token ids: ids that rank 0 of TP `tp` embeds as themselves."""
    from raydecode.models.config import load_config

    V = load_config(config).vocab_size
    hi = min(10000, V // tp, V - 64)
    return hi // 2, hi


def checkpoint_dir(config: str) -> str:
    """K3's config.json and a byte-level test tokenizer over its 163,840 ids: what the
    coordinator and ingress read (the rank builds its own weights; the layer cut is its alone).
    `tiny`: a copy of the tiny checkpoint folder."""
    from raydecode.engine.loader import resolve_checkpoint
    from raydecode.models.bpe import write_test_tokenizer
    from raydecode.models.config import load_config

    if config == "tiny":
        d = tempfile.mkdtemp(prefix="raydecode-serve-bench-")
        shutil.copytree(resolve_checkpoint("tiny"), d, dirs_exist_ok=True)
        return d
    d = tempfile.mkdtemp(prefix="raydecode-serve-bench-")
    src = os.path.join(os.path.dirname(load_config.__code__.co_filename), "data",
                       "kimi-k3-config.json")
    shutil.copy(src, os.path.join(d, "config.json"))
    write_test_tokenizer(d, load_config("k3").vocab_size)
    return d


# ---- clients ----------------------------------------------------------------------------------
async def one_request(client, prompt: list[int], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    stamps, ids, finish = [], [], None
    stream = await client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    async for chunk in stream:
        ch = chunk.choices[0]
        new = getattr(ch, "token_ids", None) or []
        now = time.perf_counter()
        for t in new:
            stamps.append(now)
            ids.append(t)
        finish = ch.finish_reason or finish
    return {"t0": t0, "stamps": stamps, "ids": ids, "finish": finish}


async def round_(base_url: str, c: int, prompts: list[list[int]], max_tokens: int) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=3600)
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(one_request(client, prompts[i], max_tokens) for i in range(c)))
    wall = time.perf_counter() - t0
    await client.close()
    return {"outs": outs, "wall": wall}


def level_stats(c: int, r: dict, max_tokens: int) -> dict:
    outs = r["outs"]
    bad = [i for i, o in enumerate(outs) if len(o["ids"]) != max_tokens or o["finish"] != "length"]
    ttft = sorted(o["stamps"][0] - o["t0"] for o in outs if o["stamps"])
    full = sorted((o["stamps"][-1] - o["stamps"][0]) / (len(o["stamps"]) - 1)
                  for o in outs if len(o["stamps"]) > 1)
    lo = max(o["stamps"][0] for o in outs)            # every stream is decoding after lo
    hi = min(o["stamps"][-1] for o in outs)           # ... and before hi
    steady = []
    for o in outs:
        inside = [t for t in o["stamps"] if lo <= t <= hi]
        if len(inside) > 1:
            steady.append((inside[-1] - inside[0]) / (len(inside) - 1))
    steady.sort()
    q = lambda xs, f: round(xs[min(len(xs) - 1, int(f * len(xs)))] * 1e3, 3) if xs else None  # noqa: E731
    toks = sum(len(o["ids"]) for o in outs)
    return {"concurrency": c, "requests": c, "failed": len(bad),
            "ttft_ms_p50": q(ttft, 0.5), "ttft_ms_p90": q(ttft, 0.9),
            "tpot_ms_p50": q(steady, 0.5), "tpot_ms_p90": q(steady, 0.9),
            "tpot_first_to_last_ms_p50": q(full, 0.5), "tpot_first_to_last_ms_p90": q(full, 0.9),
            "steady_window_s": round(hi - lo, 3), "steady_streams": len(steady),
            "output_tok_s": round(toks / r["wall"], 1), "wall_s": round(r["wall"], 3)}


def metrics(root: str) -> dict[str, float]:
    with urllib.request.urlopen(root + "/metrics", timeout=60) as f:
        text = f.read().decode()
    out = {}
    for ln in text.splitlines():
        if ln.startswith("raydecode_") and " " in ln:
            k, v = ln.rsplit(" ", 1)
            try:
                out[k] = float(v)
            except ValueError:
                pass
    return out


def wait_healthy(root: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(root + "/health?wait_s=10", timeout=30) as f:
                if json.loads(f.read()).get("status") == "ok":
                    return
        except Exception:  # noqa: BLE001 — not up yet
            time.sleep(2)
    raise SystemExit(f"the replica did not become healthy within {timeout_s:g} s")


def step_breakdown(d: dict) -> dict:
    """Per-step means (ms) over a round from /metrics deltas: where a served step's time goes.
    loop_*: the coordinator's step loop (cycle = step start to next start, the TPOT of a
    decoding stream; engine = inside engine.step; handoff = a step's end to the next one's
    start; dispatch = outputs to the streams, on the event loop, overlapping the next step);
    execute: the executor's step as the engine sees it (publish → rank 0's result), by path;
    rank0_*: rank 0's step loop (wait for the plan, decode, step = inputs + replay + sampling
    + the host sync, send). engine − execute = the coordinator's host work per step;
    execute − rank0_step = the control plane's round trip."""
    def per(total_key: str, count_key: str):
        n = d.get(count_key, 0)
        return round(1e3 * d.get(total_key, 0.0) / n, 4) if n else None
    out = {f"loop_{p}": per(f'raydecode_step_loop_seconds_total{{part="{p}"}}',
                            "raydecode_step_loop_steps_total")
           for p in ("cycle", "handoff", "engine", "dispatch")}
    for path in ("specialized", "stock"):
        n = d.get(f'raydecode_steps_total{{path="{path}"}}', 0)
        tok = d.get(f'raydecode_step_tokens_total{{path="{path}"}}', 0)
        out[f"steps_{path}"] = n
        out[f"tokens_per_step_{path}"] = round(tok / n, 2) if n else None
        out[f"execute_{path}"] = per(f'raydecode_step_seconds_total{{path="{path}"}}',
                                     f'raydecode_steps_total{{path="{path}"}}')
    both = ("specialized", "stock")
    n_all = sum(d.get(f'raydecode_steps_total{{path="{p}"}}', 0) for p in both)
    t_all = sum(d.get(f'raydecode_step_seconds_total{{path="{p}"}}', 0) for p in both)
    out["execute_all"] = round(1e3 * t_all / n_all, 4) if n_all else None
    for p in ("wait", "decode", "step", "send"):
        out[f"rank0_{p}"] = per(f'raydecode_rank0_step_loop_seconds_total{{part="{p}"}}',
                                "raydecode_rank0_step_loop_steps_total")
    return out


# ---- the run ----------------------------------------------------------------------------------
def serve_levels(args, ckpt: str, report: dict, out_path) -> tuple[list, list, list]:
    import ray
    from ray import serve

    from raydecode.actors.config import parse_deploy_config
    from raydecode.actors.serve import deployment_for
    from raydecode.commands.serve import start_http
    from raydecode.scripts.load import free_port

    levels = [int(x) for x in args.levels.split(",")]
    S = max(levels)
    mml = args.prompt_tokens + args.output_tokens + BLOCK
    per_seq = math.ceil(mml / BLOCK)
    factory = functools.partial(
        solo_executor, functools.partial(solo_runner, args.config, args.tp, args.layers,
                                         args.seed, S, S * per_seq, per_seq), S, S * per_seq,
        args.step_timeout, args.device == "cuda")
    cfg = parse_deploy_config({
        "model": ckpt, "served_model_name": MODEL_NAME, "tensor_parallel_size": 1,
        "max_num_seqs": S, "max_model_len": mml, "block_size": BLOCK,
        "max_num_batched_tokens": args.prefill_budget, "dtype": "bfloat16",
        "rank_step_timeout_s": args.step_timeout, "placement": {"profile": "development"},
        "serve": {"num_cpus": 1}})
    port = free_port()
    ray.init(address="local", num_gpus=1 if args.device == "cuda" else 0,
             num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False,
             log_to_driver=True)
    rng = random.Random(args.seed)
    from raydecode.models.config import load_config
    V = load_config(args.config).vocab_size
    lo, hi = prompt_id_range(args.config, args.tp)
    prompts = [[rng.randrange(lo, hi) for _ in range(args.prompt_tokens)] for _ in range(S)]
    rows = []
    try:
        port = start_http("127.0.0.1", port, retry_free=2)
        t = time.perf_counter()
        serve.run(deployment_for(cfg, factory), name="bench", route_prefix="/",
                  blocking=False)
        root = f"http://127.0.0.1:{port}"
        wait_healthy(root, args.start_timeout)
        report["replica_start_s"] = round(time.perf_counter() - t, 1)
        base = root + "/v1"
        c1_ids = None
        for c in levels:
            asyncio.run(round_(base, c, prompts, args.warm_tokens))        # compiles, caches
            m0 = metrics(root)
            r = asyncio.run(round_(base, c, prompts, args.output_tokens))
            m1 = metrics(root)
            row = level_stats(c, r, args.output_tokens)
            d = {k: m1.get(k, 0) - m0.get(k, 0) for k in m1}
            steps = d.get("raydecode_control_plane_steps_total", 0)
            row["control_plane"] = {
                "steps": steps,
                "result_bytes_per_step": round(d.get("raydecode_control_plane_result_bytes_total",
                                                     0) / max(steps, 1), 1),
                "max_result_bytes": m1.get("raydecode_control_plane_max_result_bytes"),
                "plan_bytes_per_step": round(d.get("raydecode_control_plane_plan_bytes_total",
                                                   0) / max(steps, 1), 1),
                "logits_bytes_per_row_if_sent": 4 * V}
            row["steps_by_path"] = {p: d.get(f'raydecode_steps_total{{path="{p}"}}', 0)
                                    for p in ("specialized", "stock")}
            row["step_breakdown_ms"] = step_breakdown(d)
            rows.append(row)
            if c == 1:
                c1_ids = r["outs"][0]["ids"]
            print(f"[serve] c={c}: {row}", flush=True)
            report["levels"] = rows
            if out_path:
                write_report(report, out_path)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return rows, c1_ids, prompts


def graphed_steps(args, levels: list[int]) -> tuple[dict, object]:
    from .step import Bench, run_batch

    model = solo_model(args.config, args.tp, args.layers, args.seed, args.device)
    ctx = args.prompt_tokens + args.output_tokens // 2
    bench = Bench(model, args.device, max(levels), ctx, ("graphed",))
    out = {}
    for c in levels:
        row, _ = run_batch(bench, c, args.graph_steps)
        out[c] = {"ms": row["ms"]["graphed"], "ms_min": row["ms_min"]["graphed"],
                  "graph_counts": row.get("graph_counts")}
        print(f"[serve] graphed step batch {c}: {out[c]['ms']} ms", flush=True)
    return out, model


def greedy_reference(model, prompt: list[int], n: int, device: str) -> list[int]:
    """The c = 1 request through an in-process LLMEngine on the same weights (the runner a
    TP 1 replica builds: graphed decode, stock prefill)."""
    from raydecode.engine.engine import EngineConfig, LLMEngine, LocalExecutor
    from raydecode.engine.request import SamplingParams
    from raydecode.engine.step_graph import GraphedRunner, graph_cache_sizes
    from raydecode.models.k3 import make_caches

    mml = len(prompt) + n + BLOCK
    ecfg = EngineConfig(max_num_seqs=1, max_model_len=mml, block_size=BLOCK,
                        max_num_batched_tokens=64)
    ns, nb = graph_cache_sizes(1, ecfg.blocks, (1,))
    caches = make_caches(model.cfg, model.par, ns, nb, BLOCK, torch.bfloat16, device=device)
    runner = GraphedRunner(model, caches, device, num_slots=1, num_blocks=ecfg.blocks,
                           buckets=(1,))
    runner.capture_all()

    class Tok:       # ids only: the engine needs decode() for stop strings
        eos_ids = ()

        def decode(self, ids, skip_special=False, markers=False):
            return ""

    eng = LLMEngine(Specialized(LocalExecutor(runner)), Tok(), ecfg, eos_ids=())
    req = eng.add_request(list(prompt), SamplingParams(max_tokens=n, temperature=0.0,
                                                       ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    return req.output_ids


class Specialized:
    """Decode-only steps on the specialized path, as the replica's envelope chooses them."""

    def __init__(self, inner):
        self.inner = inner

    def execute(self, plan):
        if plan.batch.is_decode_only and all(s.pos > 0 for s in plan.batch.seqs):
            plan.path = "specialized"
        return self.inner.execute(plan)


def plot(rows: list[dict], graphed: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(cs, [r["tpot_ms_p50"] for r in rows], "o-", label="served TPOT p50 (steady)")
    ax.plot(cs, [r["tpot_ms_p90"] for r in rows], "o--", label="served TPOT p90 (steady)")
    ax.plot(cs, [graphed[c]["ms"] for c in cs], "s-", label="graphed step, same batch")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (= decode batch)")
    ax.set_ylabel("ms per token")
    ax.set_title("K3 TP16 rank 0 on one H200: served vs graphed step")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="k3", choices=("k3", "tiny"),
                    help="k3 (the benchmark) or tiny (a CPU smoke run of the same code)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tp", type=int, default=16)
    ap.add_argument("--layers", type=int, default=0, help="first N layers (0: all)")
    ap.add_argument("--levels", default="1,4,16,64")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--output-tokens", type=int, default=96)
    ap.add_argument("--warm-tokens", type=int, default=4)
    ap.add_argument("--prefill-budget", type=int, default=1024,
                    help="max_num_batched_tokens (1024: all 64 prompts prefill in one stock "
                         "step, no mixed steps of many decoding sequences on the eager stock "
                         "path, issue 28)")
    ap.add_argument("--graph-steps", type=int, default=20)
    ap.add_argument("--step-timeout", type=float, default=900.0)
    ap.add_argument("--start-timeout", type=float, default=1800.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--control-plane", default=None,
                    help="control-plane-….json of the same host: its summary joins this one")
    ap.add_argument("--out", default=None)
    ap.add_argument("--png", default=None)
    ap.add_argument("--commit", default=None)
    args = ap.parse_args(argv)
    t0 = time.time()
    levels = [int(x) for x in args.levels.split(",")]
    report = report_header(args.commit or git_commit(), bench="serve", tp=args.tp,
                           layers=args.layers or 93, prompt_tokens=args.prompt_tokens,
                           output_tokens=args.output_tokens, prefill_budget=args.prefill_budget,
                           method=__doc__.split("\n\n", 2)[2])
    ckpt = checkpoint_dir(args.config)
    try:
        rows, c1_ids, prompts = serve_levels(args, ckpt, report, args.out)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    if args.device == "cuda":
        torch.cuda.empty_cache()
    graphed, model = graphed_steps(args, levels)
    report["graphed_step"] = {str(c): v for c, v in graphed.items()}
    for r in rows:
        g = graphed[r["concurrency"]]["ms"]
        r["graphed_step_ms"] = g
        r["served_over_graphed"] = round(r["tpot_ms_p50"] / g, 3) if r["tpot_ms_p50"] else None
    if c1_ids is not None:
        ref = greedy_reference(model, prompts[0], args.output_tokens, args.device)
        report["greedy_check"] = {"served_equals_in_process": c1_ids == ref,
                                  "first_mismatch": next((i for i, (a, b) in
                                                          enumerate(zip(c1_ids, ref)) if a != b),
                                                         None), "tokens": len(ref)}
    summary = {f"served_over_graphed_c{c}": next((r["served_over_graphed"] for r in rows
                                                  if r["concurrency"] == c), None)
               for c in (1, 16, 64)}
    if args.control_plane and os.path.exists(args.control_plane):
        summary.update(json.load(open(args.control_plane)).get("summary", {}))
    report["summary"] = summary
    print("[serve] summary", summary, report.get("greedy_check"), flush=True)
    if args.out:
        write_report(report, args.out, t0)
    if args.png:
        plot(rows, graphed, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
