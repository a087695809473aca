"""Loopback load generator for the OpenAI endpoint (issue 8, docs/RELIABILITY.md).

Concurrency levels run one after another, each for an equal share of the duration (and at most
`max_requests` requests in all): `c` workers send requests back to back with the official
`openai` async client, a mix of prompt and output lengths, completions and chat, streaming and
not. Every answer is checked (finish_reason "length" and exactly max_tokens tokens, since
requests ask ignore_eos), so a truncated or short answer counts as an error, never as a success.
While it runs, the RSS of the server's processes (Ray workers of this run: ingress, coordinator,
ranks, proxy) is sampled from /proc.

    python -m raydecode.scripts.load --levels 1,4,16,64 --duration 600 --out load.json

Without --url it starts its own server (local Ray, Serve, the tiny model); traffic goes to
127.0.0.1 only.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field

# ---- the server's processes and their memory ---------------------------------------------------
ROLES = {"ServeReplica": "ingress", "CoordinatorActor": "coordinator", "RankWorker": "rank",
         "ProxyActor": "proxy", "ServeController": "controller"}


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[1])      # field 4, after "(comm) S"


def descendants(root: int) -> list[int]:
    """Every live process below `root` (its children, theirs, ...)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            pp = _ppid(int(name))
            if pp is not None:
                children.setdefault(pp, []).append(int(name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def proc_role(pid: int) -> str | None:
    """'ingress', 'coordinator', 'rank', 'proxy', 'controller' from a Ray worker's title
    (`ray::CoordinatorActor.generate` …), or None."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            title = f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return None
    if not title.startswith("ray::"):
        return None
    name = title[5:].split(".")[0].split(":")[0].split(" ")[0]
    return ROLES.get(name)


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def server_processes(root: int | None = None) -> dict[int, str]:
    """pid -> role of the serving processes started below `root` (default: this process, which
    started Ray with address='local'). Only processes of this run: never another cluster's."""
    root = os.getpid() if root is None else root
    return {p: r for p in descendants(root) if (r := proc_role(p)) is not None}


@dataclass
class RssSample:
    t: float                        # seconds since the sampler started
    by_role: dict[str, int]         # role -> summed RSS bytes


class RssSampler:
    """Samples the serving processes' RSS every period_s (bounded: at most max_samples)."""

    def __init__(self, period_s: float = 5.0, max_samples: int = 2000,
                 extra: dict[int, str] | None = None, root: int | None = None):
        self.period_s, self.max_samples = period_s, max_samples
        self.extra, self.root = dict(extra or {}), root
        self.samples: list[RssSample] = []

    def sample(self, t: float) -> RssSample:
        by: dict[str, int] = {}
        for pid, role in {**server_processes(self.root), **self.extra}.items():
            rss = rss_bytes(pid)
            if rss is not None:
                by[role] = by.get(role, 0) + rss
        s = RssSample(round(t, 2), by)
        self.samples.append(s)
        return s

    async def run(self, stop: asyncio.Event) -> None:
        t0 = time.monotonic()
        while len(self.samples) < self.max_samples:
            self.sample(time.monotonic() - t0)
            try:
                await asyncio.wait_for(stop.wait(), self.period_s)
                self.sample(time.monotonic() - t0)
                return
            except asyncio.TimeoutError:
                pass

    def summary(self, warmup_s: float) -> dict:
        """Per role and in total, over samples after warm-up: first, last, min, max (MiB) and
        spread = (max - min) / min, growth = (last - first) / first."""
        after = [s for s in self.samples if s.t >= warmup_s] or self.samples[-1:]
        roles = sorted({r for s in after for r in s.by_role})
        out = {}
        for role in roles + ["total"]:
            vals = [sum(s.by_role.values()) if role == "total" else s.by_role.get(role, 0)
                    for s in after]
            if not vals or min(vals) <= 0:
                continue
            mib = [v / 2**20 for v in vals]
            out[role] = {"first_mib": round(mib[0], 1), "last_mib": round(mib[-1], 1),
                         "min_mib": round(min(mib), 1), "max_mib": round(max(mib), 1),
                         "spread": round((max(mib) - min(mib)) / min(mib), 4),
                         "growth": round((mib[-1] - mib[0]) / mib[0], 4)}
        return {"warmup_s": warmup_s, "samples": len(after), "roles": out}


# ---- requests -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """What each request looks like, drawn per request from these mixes."""
    prompt_tokens: tuple[int, ...] = (8, 32, 128)
    output_tokens: tuple[int, ...] = (8, 32, 64)
    stream_fraction: float = 0.5
    chat_fraction: float = 0.25
    temperatures: tuple[float, ...] = (0.0, 0.8)
    vocab: tuple[int, int] = (32, 480)          # token ids of completion prompts: [lo, hi)


WORDS = ("the", "model", "decode", "step", "ray", "serve", "token", "cache", "rank", "batch",
         "stream", "path", "fast", "slow", "kernel", "graph", "node", "load", "test", "hello")


@dataclass
class Spec:
    endpoint: str                   # "completions" | "chat"
    stream: bool
    prompt: list[int] | str         # ids for completions, text for chat
    max_tokens: int
    temperature: float
    seed: int | None = None


def draw_spec(rng: random.Random, w: Workload) -> Spec:
    n_in, n_out = rng.choice(w.prompt_tokens), rng.choice(w.output_tokens)
    temp = rng.choice(w.temperatures)
    seed = rng.randrange(2**31) if temp > 0 else None
    stream = rng.random() < w.stream_fraction
    if rng.random() < w.chat_fraction:
        text = " ".join(rng.choice(WORDS) for _ in range(max(1, n_in // 2)))
        return Spec("chat", stream, text, n_out, temp, seed)
    return Spec("completions", stream, [rng.randrange(*w.vocab) for _ in range(n_in)], n_out,
                temp, seed)


SILENT = ("truncated", "short", "bad_finish")


@dataclass
class Result:
    """One request's outcome. error: None when the answer is complete and checked; else a
    class. Visible failures: 'http_<status>', 'stream_error:<code>' (an SSE error event),
    'connection', 'cut' (the connection closed mid-stream), 'timeout'. Silent ones, where the
    server claimed success: 'truncated' (no finish_reason), 'short' (fewer tokens than asked),
    'bad_finish' (finish_reason other than 'length' although ignore_eos was asked)."""
    level: int
    stream: bool
    endpoint: str
    status: int | None = None
    error: str | None = None
    retry_after: str | None = None
    message: str = ""
    ttft: float | None = None
    tpot: float | None = None
    latency: float = 0.0
    tokens: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def silent(self) -> bool:
        return self.error in SILENT

    @property
    def retriable(self) -> bool:
        """A clear retriable failure: 503 + Retry-After, or (after the stream started) an SSE
        error event with code service_unavailable."""
        return (self.status == 503 and bool(self.retry_after)) or \
            self.error == "stream_error:service_unavailable"


def _choice_ids(choice) -> list[int]:
    extra = getattr(choice, "model_extra", None) or {}
    return list(extra.get("token_ids") or [])


async def issue(client, model: str, spec: Spec, level: int = 0, check_length: bool = True,
                extra: dict | None = None, on_tokens=None) -> Result:
    """Send one request; never raises for server behaviour, the Result says what happened.
    on_tokens(n): called with the stream's token count so far after each chunk."""
    import openai
    try:                                # the openai client's HTTP library (httpx2 in 3.x)
        import httpx2 as httpx
    except ImportError:
        import httpx

    r = Result(level, spec.stream, spec.endpoint)
    body = {"return_token_ids": True, "ignore_eos": True, **(extra or {})}
    kw = dict(model=model, max_tokens=spec.max_tokens, temperature=spec.temperature,
              seed=spec.seed, extra_body=body)
    if spec.endpoint == "chat":
        api, kw["messages"] = client.chat.completions, [{"role": "user", "content": spec.prompt}]
    else:
        api, kw["prompt"] = client.completions, spec.prompt
    t0 = time.perf_counter()
    t_first = t_last = None
    parts: list[str] = []
    try:
        if spec.stream:
            stream = await api.create(stream=True, stream_options={"include_usage": True}, **kw)
            r.status = 200
            async with stream:
                async for ch in stream:
                    if ch.usage is not None:
                        r.tokens = ch.usage.completion_tokens
                    for c in ch.choices:
                        text = (c.delta.content or "") if spec.endpoint == "chat" else c.text
                        ids = _choice_ids(c)
                        if text or ids:
                            t_last = time.perf_counter()
                            t_first = t_first or t_last
                        parts.append(text)
                        r.token_ids += ids
                        r.finish_reason = c.finish_reason or r.finish_reason
                    if on_tokens is not None:
                        on_tokens(len(r.token_ids))
        else:
            resp = await api.create(**kw)
            r.status = 200
            c = resp.choices[0]
            parts.append(c.message.content if spec.endpoint == "chat" else c.text)
            r.token_ids, r.finish_reason = _choice_ids(c), c.finish_reason
            r.tokens = resp.usage.completion_tokens
    except openai.APIStatusError as e:
        r.status, r.error = e.status_code, f"http_{e.status_code}"
        r.retry_after = e.response.headers.get("retry-after")
        r.message = str(e)[:300]
    except openai.APITimeoutError as e:
        r.error, r.message = "timeout", str(e)[:300]
    except openai.APIConnectionError as e:
        r.error, r.message = "connection", str(e)[:300]
    except openai.APIError as e:                         # an SSE error event mid-stream
        code = (e.body or {}).get("code") if isinstance(e.body, dict) else None
        r.error, r.message = f"stream_error:{code}", str(e)[:300]
    except httpx.HTTPError as e:                         # the stream was cut (peer closed)
        r.error, r.message = "cut", f"{type(e).__name__}: {e}"[:300]
    r.latency = time.perf_counter() - t0
    r.text = "".join(parts)
    if t_first is not None:
        r.ttft = t_first - t0
        if r.tokens > 1 and t_last > t_first:
            r.tpot = (t_last - t_first) / (r.tokens - 1)
    if r.error is None:
        if r.finish_reason is None:
            r.error = "truncated"
        elif check_length and r.finish_reason != "length":
            r.error = "bad_finish"
        elif check_length and (r.tokens != spec.max_tokens or
                               len(r.token_ids) != spec.max_tokens):
            r.error = "short"
    return r


# ---- the run --------------------------------------------------------------------------------------
def _pct(vals: list[float], q: float) -> float | None:
    if not vals:
        return None
    s = sorted(vals)
    return round(s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))], 4)


def summarize_level(level: int, results: list[Result], wall: float) -> dict:
    ok = [r for r in results if r.error is None]
    errors: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    ttft = [r.ttft for r in ok if r.stream and r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    lat = [r.latency for r in ok]
    toks = sum(r.tokens for r in ok)
    return {"concurrency": level, "requests": len(results), "ok": len(ok), "errors": errors,
            "clean_503": sum(1 for r in results if r.error and r.retriable),
            "wall_s": round(wall, 2), "requests_per_s": round(len(ok) / wall, 3) if wall else 0,
            "tokens_per_s": round(toks / wall, 2) if wall else 0, "output_tokens": toks,
            "ttft_p50": _pct(ttft, 0.5), "ttft_p99": _pct(ttft, 0.99),
            "tpot_p50": _pct(tpot, 0.5), "tpot_p99": _pct(tpot, 0.99),
            "latency_p50": _pct(lat, 0.5), "latency_p99": _pct(lat, 0.99)}


async def run_load(base_url: str, model: str, levels: list[int], duration_s: float,
                   max_requests: int, workload: Workload = Workload(), seed: int = 0,
                   rss_period_s: float = 5.0, warmup_s: float | None = None,
                   request_timeout_s: float = 300.0, rss_root: int | None = None,
                   rss_extra: dict[int, str] | None = None, log=print) -> dict:
    """Run every level for duration_s / len(levels) seconds; at most max_requests in all.
    RSS is judged after warmup_s (default: the first level, at most 120 s)."""
    import openai

    if not base_url.startswith(("http://127.", "http://localhost", "http://[::1]")):
        raise ValueError(f"base_url = {base_url!r}; the load generator only targets loopback")
    if not levels or any(c < 1 for c in levels):
        raise ValueError(f"levels = {levels}; expected positive concurrency levels")
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0,
                                timeout=request_timeout_s,
                                http_client=None)
    rng = random.Random(seed)
    sampler = RssSampler(rss_period_s, extra=rss_extra, root=rss_root)
    stop = asyncio.Event()
    sampler_task = asyncio.create_task(sampler.run(stop))
    per_level = duration_s / len(levels)
    budget = {"left": max_requests}
    report_levels, t_start = [], time.monotonic()

    async def worker(level: int, deadline: float, out: list[Result]) -> None:
        while time.monotonic() < deadline and budget["left"] > 0:
            budget["left"] -= 1
            out.append(await issue(client, model, draw_spec(rng, workload), level))

    try:
        for c in levels:
            t0 = time.monotonic()
            results: list[Result] = []
            await asyncio.gather(*[worker(c, t0 + per_level, results) for _ in range(c)])
            summary = summarize_level(c, results, time.monotonic() - t0)
            report_levels.append(summary)
            log(json.dumps(summary))
    finally:
        stop.set()
        await sampler_task
        await client.close()
    wall = time.monotonic() - t_start
    warm = min(per_level, 120.0) if warmup_s is None else warmup_s
    return {"base_url": base_url, "model": model, "levels": report_levels,
            "duration_s": round(wall, 1), "workload": asdict(workload), "seed": seed,
            "requests": sum(lv["requests"] for lv in report_levels),
            "failed": sum(lv["requests"] - lv["ok"] for lv in report_levels),
            "rss": sampler.summary(warm),
            "rss_samples": [asdict(s) for s in sampler.samples]}


# ---- a server of its own ------------------------------------------------------------------------
def tiny_config(port: int, tp: int = 1, dcp: int = 1, max_model_len: int = 512,
                max_num_seqs: int = 64, **extra) -> dict:
    return {"model": "tiny", "tensor_parallel_size": tp, "decode_context_parallel_size": dcp,
            "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
            "placement": {"profile": "development"},
            "serve": {"host": "127.0.0.1", "port": port, "num_cpus": 0}, **extra}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (raydecode.commands.serve `free_loopback_port`)."""
    from raydecode.commands.serve import free_loopback_port
    return free_loopback_port()


def start_server(config: dict, num_cpus: int = 4) -> str:
    """Local Ray (address='local', never another cluster) + Serve with `config`; -> base URL."""
    from raydecode.actors.config import parse_deploy_config
    from raydecode.commands.serve import start_serving

    return start_serving(parse_deploy_config(config, "load config"), num_cpus=num_cpus,
                         include_dashboard=False, object_store_memory=200 * 2**20,
                         log_to_driver=False)


def stop_server() -> None:
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="OpenAI base URL of a running server on loopback (…/v1); "
                                 "default: start the tiny model here")
    p.add_argument("--model", default="tiny", help="served model name (default tiny)")
    p.add_argument("--levels", default="1,4,16,64", help="concurrency levels, in order")
    p.add_argument("--duration", type=float, default=600.0, help="seconds in all (split "
                                                                   "evenly over the levels)")
    p.add_argument("--max-requests", type=int, default=200_000, help="request cap in all")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dcp", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rss-period", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--out", help="write the JSON report here")
    a = p.parse_args(argv)
    levels = [int(x) for x in a.levels.split(",") if x.strip()]
    url = a.url
    try:
        if url is None:
            url = start_server(tiny_config(free_port(), a.tp, a.dcp,
                                           max_num_seqs=a.max_num_seqs))
            print(f"server: {url}", flush=True)
        report = asyncio.run(run_load(url, a.model, levels, a.duration, a.max_requests,
                                      seed=a.seed, rss_period_s=a.rss_period,
                                      log=lambda s: print(s, flush=True)))
    finally:
        if a.url is None:
            stop_server()
    report["server"] = {"url": url, "tp": a.tp, "dcp": a.dcp, "max_num_seqs": a.max_num_seqs,
                        "started_here": a.url is None}
    print(json.dumps({k: v for k, v in report.items() if k != "rss_samples"}, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    # issue 8: no failure at concurrency <= 16; above, only clean 503s + Retry-After
    bad = sum(lv["requests"] - lv["ok"] - (lv["clean_503"] if lv["concurrency"] > 16 else 0)
              for lv in report["levels"])
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
