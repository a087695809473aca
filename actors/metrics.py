"""Prometheus metrics of one replica, served at /metrics.

Request-level series (TTFT, TPOT, tokens, requests by status) are measured where the client is,
in the ingress; step-level series (steps and tokens by path, fall-back reasons, fail-overs, queue
depth, health, prefill tokens and the prefix cache's hits) come from the coordinator's
`stats()` snapshot, rendered at scrape time; so do
the speculative-decoding series of a DSpark replica (mean acceptance length, the acceptance
length histogram over 1..k+1, per-position acceptance rates, the synthetic-acceptance flag).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class RequestMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("raydecode_time_to_first_token_seconds",
                              "Request arrival to first generated token", ["endpoint"],
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("raydecode_time_per_output_token_seconds",
                              "Mean time between output tokens of a request (after the first)",
                              ["endpoint"], buckets=_TPOT_BUCKETS, registry=r)
        self.requests = Counter("raydecode_requests", "Finished requests by HTTP status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("raydecode_prompt_tokens", "Prompt tokens accepted",
                                     registry=r)
        self.generation_tokens = Counter("raydecode_generation_tokens",
                                         "Tokens generated and returned", registry=r)

    def observe_request(self, endpoint: str, t_arrival: float, t_first: float | None,
                        t_last: float | None, n_tokens: int, n_prompt: int) -> None:
        if t_first is not None:
            self.ttft.labels(endpoint).observe(t_first - t_arrival)
        if t_first is not None and t_last is not None and n_tokens > 1:
            self.tpot.labels(endpoint).observe((t_last - t_first) / (n_tokens - 1))
        self.generation_tokens.inc(n_tokens)
        self.prompt_tokens.inc(n_prompt)

    def render(self, stats: dict | None) -> bytes:
        out = generate_latest(self.registry)
        if stats is not None:
            snap = CollectorRegistry()
            snap.register(_StatsCollector(stats))
            out += generate_latest(snap)
        return out


class _StatsCollector:
    """The coordinator's stats() as Prometheus families (counters are monotone there)."""

    def __init__(self, stats: dict):
        self.s = stats

    def collect(self):
        s = self.s
        steps = CounterMetricFamily("raydecode_steps", "Engine steps by path", labels=["path"])
        toks = CounterMetricFamily("raydecode_step_tokens", "Tokens run through the model by "
                                   "path", labels=["path"])
        rate = GaugeMetricFamily("raydecode_step_tokens_per_second", "Tokens per second of "
                                 "model time, by path", labels=["path"])
        secs = CounterMetricFamily("raydecode_step_seconds", "Time inside the executor's step "
                                   "(plan out, result back) by path", labels=["path"])
        for path, v in s["paths"].items():
            steps.add_metric([path], v["steps"])
            toks.add_metric([path], v["tokens"])
            secs.add_metric([path], v["seconds"])
            rate.add_metric([path], v["tokens"] / v["seconds"] if v["seconds"] else 0.0)
        yield from (steps, toks, secs, rate)
        why = CounterMetricFamily("raydecode_stock_fallback_steps", "Steps that ran stock, by "
                                  "envelope reason", labels=["reason"])
        for reason, n in s["fallback_reasons"].items():
            why.add_metric([reason], n)
        yield why
        for key, help_ in (("failover_events", "Times the replica turned unhealthy"),
                           ("failover_requests", "In-flight requests continued on the stock "
                                                 "pool after a failure"),
                           ("routed_to_stock", "New requests sent to the stock pool while "
                                               "unhealthy"),
                           ("rebuilds", "Executor rebuilds after a failure")):
            yield CounterMetricFamily(f"raydecode_{key}", help_, value=s[key])
        for key, help_ in (("waiting", "Requests queued, not yet running (queue depth)"),
                           ("running", "Requests running on the replica"),
                           ("on_stock", "Requests currently continuing on the stock pool")):
            yield GaugeMetricFamily(f"raydecode_{key}_requests", help_, value=s[key])
        yield GaugeMetricFamily("raydecode_replica_healthy", "1 when the replica takes requests",
                                value=1.0 if s["healthy"] else 0.0)
        g = GaugeMetricFamily("raydecode_replica_info", "Replica layout and profile",
                              labels=["profile", "tp", "dcp"])
        g.add_metric([s["profile"], str(s["tensor_parallel_size"]),
                      str(s["decode_context_parallel_size"])], 1.0)
        yield g
        if s.get("speculative"):
            yield from _spec_families(s["speculative"])
        if s.get("cache"):
            yield from _cache_families(s["cache"])
        cp = s.get("control_plane")
        if cp:      # the step channel: what crossed between coordinator and ranks (no logits)
            for key, help_ in (("steps", "Steps sent over the rank step channel"),
                               ("plan_bytes", "Plan frame bytes sent to the ranks (all ranks)"),
                               ("result_bytes", "Result frame bytes received from rank 0 "
                                                "(token ids, logprobs when asked)"),
                               ("result_rows", "Sample rows answered by rank 0")):
                yield CounterMetricFamily(f"raydecode_control_plane_{key}", help_,
                                          value=cp[key])
            yield GaugeMetricFamily("raydecode_control_plane_max_result_bytes",
                                    "Largest result frame of one step, bytes",
                                    value=cp["max_result_bytes"])
            r0 = cp.get("rank0_timing")
            if r0:
                yield from _loop_families(
                    "raydecode_rank0_step_loop", r0, ("wait", "decode", "step", "send"),
                    "Rank 0's step loop time by part: waiting for a plan, decoding it, the "
                    "step (inputs, replay, sampling, host sync), sending the result",
                    "Steps rank 0's loop ran")
        lt = s.get("step_loop_timing")
        if lt:
            yield from _loop_families(
                "raydecode_step_loop", lt, ("engine", "handoff", "dispatch", "cycle"),
                "The coordinator's step loop time by part: engine (inside engine.step), "
                "handoff (a step's end to the next one's start), dispatch (outputs to streams, "
                "event loop), cycle (step start to next step start while requests run)",
                "Steps the coordinator's loop ran")


def _loop_families(name: str, timing: dict, parts: tuple, help_: str, steps_help: str):
    """A step loop's seconds by part (`{part}_s` keys of `timing`) and its step count."""
    fam = CounterMetricFamily(f"{name}_seconds", help_, labels=["part"])
    for part in parts:
        fam.add_metric([part], timing[f"{part}_s"])
    yield fam
    yield CounterMetricFamily(f"{name}_steps", steps_help, value=timing["steps"])


def _cache_families(c: dict):
    """Prefill work and what the prefix cache (engine/prefix_cache.py) and n > 1 forks saved;
    counters restart with the engine (a rebuild)."""
    yield CounterMetricFamily("raydecode_prefill_tokens", "Prompt tokens run through prefill "
                              "chunks", value=c["prefill_tokens"])
    yield CounterMetricFamily("raydecode_forked_samples", "n > 1 samples that shared their "
                              "request's prefill", value=c["forks"])
    if not c.get("prefix_caching"):
        return
    for key, help_ in (("queries", "Admissions that looked the prefix cache up"),
                       ("hits", "Admissions restored from a cached prefix"),
                       ("hit_tokens", "Tokens restored from cached prefixes"),
                       ("saves", "KDA + MLA snapshots made"),
                       ("evictions", "Snapshots evicted (least recently used)")):
        yield CounterMetricFamily(f"raydecode_prefix_cache_{key}", help_, value=c[key])
    yield GaugeMetricFamily("raydecode_prefix_cache_snapshots", "KDA state snapshots held "
                            "(of kda_snapshot_slots per rank)", value=c["snapshots"])


def _spec_families(sp: dict):
    """DSpark acceptance: L = tokens emitted per verified sequence-step ∈ [1, k+1] (the bonus
    token counts), rate_i = P(draft i accepted), i = 1..k."""
    k = sp["num_drafts"]
    yield GaugeMetricFamily("raydecode_spec_num_drafts", "Drafts proposed per sequence and "
                            "verification step (k)", value=k)
    yield GaugeMetricFamily("raydecode_spec_mean_acceptance_length", "Mean acceptance length "
                            "(tokens emitted per verified sequence-step, in [1, k+1]; 0 before "
                            "the first)", value=sp["mean_acceptance_length"])
    cum, buckets = 0, []
    for j, n in enumerate(sp["acceptance_length_counts"], start=1):
        cum += n
        buckets.append((str(float(j)), cum))
    buckets.append(("+Inf", cum))
    yield HistogramMetricFamily("raydecode_spec_acceptance_length", "Acceptance length per "
                                "verified sequence-step (1..k+1)", buckets=buckets,
                                sum_value=sp["emitted_tokens"])
    rate = GaugeMetricFamily("raydecode_spec_acceptance_rate", "Fraction of verified "
                             "sequence-steps whose draft at this position (1..k) was accepted",
                             labels=["position"])
    for i, r in enumerate(sp["acceptance_rate_per_position"], start=1):
        rate.add_metric([str(i)], r)
    yield rate
    flag = GaugeMetricFamily("raydecode_spec_synthetic_acceptance", "1 when synthetic "
                             "acceptance is on (benchmarks only: generated text is meaningless)",
                             labels=["length"])
    L = sp["synthetic_acceptance_length"]
    flag.add_metric(["" if L is None else f"{L:g}"], 1.0 if sp["synthetic"] else 0.0)
    yield flag
