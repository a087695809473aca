"""`raydecode demo`: the tiny K3 model end to end on this machine: local Ray, one replica at
TP=2/DCP=2 behind the OpenAI endpoint on a free loopback port, 4 concurrent requests through the
official `openai` client, then the answers and a table of steps by path and tokens/s."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (default 32)")
    p.add_argument("--tp", type=int, default=2, help="tensor_parallel_size (default 2)")
    p.add_argument("--dcp", type=int, default=2, help="decode_context_parallel_size (default 2)")


APP_NAME = "raydecode"
PROMPTS = [("chat", "What is the capital of France?"),
           ("completion", "Once upon a time"),
           ("chat", "Write a haiku about GPUs."),
           ("completion", "def fibonacci(n):")]


async def _ask(client, model: str, kind: str, text: str, max_tokens: int, stream: bool):
    """(answer text, completion tokens) of one greedy request."""
    kw = dict(model=model, max_tokens=max_tokens, temperature=0)
    if kind == "chat":
        api, kw["messages"] = client.chat.completions, [{"role": "user", "content": text}]
    else:
        api, kw["prompt"] = client.completions, text
    if not stream:
        r = await api.create(**kw)
        c = r.choices[0]
        return (c.message.content if kind == "chat" else c.text), r.usage.completion_tokens
    parts, used = [], 0
    async for ch in await api.create(stream=True, stream_options={"include_usage": True}, **kw):
        if ch.choices:
            parts.append((ch.choices[0].delta.content or "") if kind == "chat"
                         else ch.choices[0].text)
        if ch.usage:
            used = ch.usage.completion_tokens
    return "".join(parts), used


async def _requests(url: str, model: str, max_tokens: int):
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
    t0 = time.perf_counter()
    answers = await asyncio.gather(*[_ask(client, model, kind, text, max_tokens, i % 2 == 1)
                                     for i, (kind, text) in enumerate(PROMPTS)])
    return answers, time.perf_counter() - t0


# the envelope's fall-back reasons (actors/envelope.py) as the table names them
REASON_WORDS = {"prefill_in_batch": "prefill", "batch_too_large": "batch > envelope",
                "kernels_not_ready": "kernels not ready", "tp_size_not_supported": "TP size",
                "domain_not_verified": "no verified domain", "envelope_disabled": "disabled",
                "spec_k_out_of_range": "spec k", "spec_tokens_too_many": "spec tokens"}
TP_DCP = ((1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4))      # what shards the tiny model


def _path_table(metrics_text: str) -> list[tuple[str, float, float, float, str]]:
    """(path, steps, tokens, tokens/s of model time, why stock) per path."""
    from prometheus_client.parser import text_string_to_metric_families

    rows: dict[str, dict[str, float]] = {}
    reasons: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            if "path" in s.labels and s.name in ("raydecode_steps_total",
                                                 "raydecode_step_tokens_total",
                                                 "raydecode_step_tokens_per_second"):
                rows.setdefault(s.labels["path"], {})[s.name] = s.value
            elif s.name == "raydecode_stock_fallback_steps_total" and s.value:
                reasons[s.labels["reason"]] = s.value
    why = ", ".join(f"{REASON_WORDS.get(r, r)} {n:.0f}" for r, n in sorted(reasons.items()))
    return [(p, v.get("raydecode_steps_total", 0), v.get("raydecode_step_tokens_total", 0),
             v.get("raydecode_step_tokens_per_second", 0), why if p == "stock" else "decode")
            for p, v in sorted(rows.items())]


def run(args: argparse.Namespace) -> int:
    import urllib.request

    import ray
    from ray import serve

    from raydecode.actors.config import parse_deploy_config
    from raydecode.actors.coordinator import executor_supports
    from raydecode.actors.envelope import DEVELOPMENT_NOTE

    from .serve import free_loopback_port, start_serving

    def config(tp: int, dcp: int):
        return parse_deploy_config({
            "model": "tiny", "tensor_parallel_size": tp, "decode_context_parallel_size": dcp,
            "max_model_len": 256, "max_num_seqs": 8, "placement": {"profile": "development"},
            # K3's thinking preamble alone fills most of 256 tokens; the demo answers directly
            "default_chat_template_kwargs": {"thinking": False},
            "serve": {"host": "127.0.0.1", "port": free_loopback_port(), "num_cpus": 0}})

    if (args.tp, args.dcp) not in TP_DCP:
        ok = ", ".join(f"{tp}/{dcp}" for tp, dcp in TP_DCP)
        print(f"error: --tp {args.tp} --dcp {args.dcp} cannot shard the tiny model (4 heads, "
              f"hidden 64); accepted TP/DCP: {ok}", file=sys.stderr)
        return 2
    cfg = config(args.tp, args.dcp)
    if not executor_supports(cfg):      # TP_DCP above is meant to be exactly what shards it
        print(f"error: TP={args.tp}/DCP={args.dcp} cannot shard the tiny model",
              file=sys.stderr)
        return 2
    local = not os.environ.get("RAY_ADDRESS")
    t0 = time.perf_counter()
    try:
        url = start_serving(cfg, retry_free_port=2, num_cpus=2, include_dashboard=False,
                            object_store_memory=100 * 2**20, log_to_driver=False)
        print(f"endpoint: {url}  (tiny K3 with random weights: the text is noise; "
              f"TP={cfg.tensor_parallel_size}, DCP={cfg.decode_context_parallel_size}, "
              f"ready after {time.perf_counter() - t0:.0f} s)")
        answers, wall = asyncio.run(_requests(url, cfg.model_name, args.max_tokens))
        for (kind, text), (ans, _) in zip(PROMPTS, answers):
            print(f"\n[{kind}] {text}\n  -> {ans!r}")
        metrics = urllib.request.urlopen(url.removesuffix("/v1") + "/metrics",
                                         timeout=60).read().decode()
        print(f"\n{'path':<12}{'steps':>8}{'tokens':>9}{'tokens/s (model time)':>24}  steps of")
        for path, steps, tokens, rate, why in _path_table(metrics):
            print(f"{path:<12}{steps:>8.0f}{tokens:>9.0f}{rate:>24.1f}  {why}")
        print("(a prefill step runs a whole prompt, many tokens at once; a decode step one token "
              "per sequence: their tokens/s are not comparable)")
        n = sum(used for _, used in answers)
        print(f"\n{len(PROMPTS)} concurrent requests: {n} tokens in {wall:.2f} s wall, "
              f"{n / wall:.1f} tok/s end to end")
        print(f"note: {DEVELOPMENT_NOTE}", flush=True)
    finally:
        if ray.is_initialized():
            # the local Ray this command started goes down whole (serve.shutdown() would have
            # the raylet print the controller's killed graceful_shutdown task); on a cluster
            # only this app is deleted
            if not local:
                serve.delete(APP_NAME)
            ray.shutdown()
    return 0
