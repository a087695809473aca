"""Coordinator logic without Ray: the envelope decision per step and its counters, greedy output
equal to the in-process engine, and fail-over to a real stock-only replica over HTTP (uvicorn on
a loopback port) when the model raises or hangs in the middle of the streams."""
import asyncio
import threading

import pytest
import torch

from raydecode.actors import envelope as env
from raydecode.actors.config import parse_deploy_config
from raydecode.actors.coordinator import (CoordinatorCore, EnvelopeExecutor, Overloaded,
                                          PathCounters, build_executor)
from raydecode.actors.serve import LocalServer
from raydecode.actors.stock_pool import Continuation
from raydecode.engine.engine import LLMEngine
from raydecode.engine.loader import build_local_engine
from raydecode.engine.request import RequestError, SamplingParams

torch.set_num_threads(1)
MML = 96
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
PROMPTS = ["The capital of France", "Once upon a time", "def fib(n):", "1, 2, 3, 4,"]


def cfg(**kw):
    base = {"model": "tiny", "max_model_len": MML, "placement": {"profile": "development"}}
    return parse_deploy_config({**base, **kw})


@pytest.fixture(scope="module")
def reference():
    """Undisturbed greedy outputs of PROMPTS from the in-process engine."""
    eng = build_local_engine("tiny", max_num_seqs=8, max_model_len=MML)
    reqs = eng.generate(PROMPTS, GREEDY)
    return eng.tokenizer, [(r.prompt_ids, r.output_ids, r.output_text) for r in reqs]


@pytest.fixture(scope="module")
def stock_pool():
    srv = LocalServer(cfg(envelope={"enabled": False}, max_num_seqs=8))
    url = srv.start()
    yield url + "/v1"
    srv.stop()


async def _collect(core, rid, ids, params):
    outs = [o async for o in core.generate(rid, ids, params)]
    return (sum((o.new_token_ids for o in outs), []), "".join(o.delta_text for o in outs),
            outs[-1].finish_reason)


# ---- the envelope decision ----------------------------------------------------------------
def _shape(**kw):
    base = dict(num_seqs=8, decode_only=True, tp_size=8, domain_verified=True, kernels_ready=True)
    return env.StepShape(**{**base, **kw})


def test_envelope_reasons():
    prod, dev = env.EnvelopePolicy(), env.EnvelopePolicy(profile="development")
    assert env.decide(_shape(), prod) == env.Decision("specialized", ())
    assert env.decide(_shape(num_seqs=64), prod).path == "specialized"
    assert env.decide(_shape(num_seqs=65), prod).reasons == (env.BATCH,)
    assert env.decide(_shape(decode_only=False), prod).reasons == (env.PREFILL,)
    assert env.decide(_shape(tp_size=4), prod).reasons == (env.TP_SIZE,)
    assert env.decide(_shape(tp_size=16, domain_verified=False), prod).reasons == (env.DOMAIN,)
    assert env.decide(_shape(kernels_ready=False), prod).reasons == (env.KERNELS,)
    assert env.decide(_shape(tp_size=2, domain_verified=False), dev).path == "specialized"
    assert dev.note and "development" in dev.note and prod.note is None
    # speculative verification: k in [3, 7] and batch·(k+1) <= 64
    assert env.decide(_shape(num_seqs=8, spec_k=7), prod).path == "specialized"
    assert env.decide(_shape(num_seqs=9, spec_k=7), prod).reasons == (env.SPEC_BATCH,)
    assert env.decide(_shape(num_seqs=2, spec_k=2), prod).reasons == (env.SPEC_K_RANGE,)
    assert env.decide(_shape(), env.EnvelopePolicy(enabled=False)).reasons == (env.DISABLED,)
    with pytest.raises(ValueError, match="profile"):
        env.EnvelopePolicy(profile="fast")


class PathRecorder:
    """The real TP=1 executor, recording the path each plan reached it with."""

    def __init__(self, inner):
        self.inner, self.paths = inner, []
        self.tp_size, self.dcp_size, self.domain_verified = 1, 1, False

    def specialized_ready(self, n):
        return True

    def execute(self, plan):
        self.paths.append((plan.path, plan.batch.is_decode_only, plan.num_seqs))
        return self.inner.execute(plan)

    def close(self):
        pass


def test_path_flows_into_executor_and_prefill_chunk_forces_stock():
    c = cfg(max_num_seqs=8)
    rec = PathRecorder(build_executor(c))
    counters = PathCounters()
    base = build_local_engine("tiny", max_num_seqs=1, max_model_len=MML)   # tokenizer, eos
    eng = LLMEngine(EnvelopeExecutor(rec, c.envelope_policy(), counters, 1), base.tokenizer,
                    c.engine_config(MML), tuple(base.eos_ids))
    for p in PROMPTS[:3]:
        eng.add_request(p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    eng.step()                                   # prefill of 3 prompts
    eng.step()                                   # 3 decodes
    eng.add_request(PROMPTS[3], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    eng.step()                                   # 3 decodes + 1 prefill chunk
    eng.step()                                   # 4 decodes
    assert rec.paths == [("stock", False, 3), ("specialized", True, 3), ("stock", False, 4),
                         ("specialized", True, 4)]
    assert counters.steps == {"specialized": 2, "stock": 2}
    assert counters.reasons[env.PREFILL] == 2 and counters.reasons[env.BATCH] == 0


@pytest.mark.parametrize("n", [64, 65])
def test_64_decode_only_sequences_run_specialized_65_run_stock(n):
    async def run():
        core = CoordinatorCore(cfg(max_num_seqs=n, max_num_batched_tokens=1024))
        await core.start()
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        ids = core.tokenizer.encode("Hi")
        res = await asyncio.gather(*[_collect(core, f"r{i}", ids, params) for i in range(n)])
        await core.close()
        return core.stats(), res, len(ids)

    stats, res, n_prompt = asyncio.run(run())
    assert all(len(toks) == 3 for toks, _, _ in res)
    paths, why = stats["paths"], stats["fallback_reasons"]
    # one prefill step (all prompts fit the token budget), then 2 decode-only steps of n seqs
    if n == 64:
        assert paths["specialized"] == {**paths["specialized"], "steps": 2, "tokens": 2 * n}
        assert paths["stock"]["steps"] == 1 and paths["stock"]["tokens"] == n * n_prompt
        assert why[env.PREFILL] == 1 and why[env.BATCH] == 0
    else:
        assert paths["specialized"]["steps"] == 0
        assert paths["stock"]["steps"] == 3 and paths["stock"]["tokens"] == n * n_prompt + 2 * n
        assert why[env.PREFILL] == 1 and why[env.BATCH] == 3


def test_greedy_output_equals_in_process_engine(reference):
    tok, ref = reference

    async def run():
        core = CoordinatorCore(cfg(max_num_seqs=8))
        await core.start()
        res = await asyncio.gather(*[_collect(core, f"g{i}", p, GREEDY)
                                     for i, (p, _, _) in enumerate(ref)])
        await core.close()
        return res

    for (toks, text, _), (_, out_ids, out_text) in zip(asyncio.run(run()), ref):
        assert toks == out_ids and text == out_text


# ---- fail-over --------------------------------------------------------------------------------
class FailingModel(torch.nn.Module):
    """Fault injection: the real model, raising (or first blocking on `hang`) at forward call n."""

    def __init__(self, inner, fail_at: int, hang: threading.Event | None = None):
        super().__init__()
        self.inner, self.fail_at, self.hang, self.calls = inner, fail_at, hang, 0

    def forward(self, tokens, batch, caches, **kw):
        self.calls += 1
        if self.calls == self.fail_at:
            if self.hang is not None:
                self.hang.wait()
            raise RuntimeError(f"injected fault at forward call {self.calls}")
        return self.inner(tokens, batch, caches, **kw)

    def compute_logits(self, hidden):
        return self.inner.compute_logits(hidden)


class FaultyFactory:
    """Builds the real executor; the first one's model fails at step `fail_at`."""

    def __init__(self, config, fail_at: int, hang: threading.Event | None = None):
        self.config, self.fail_at, self.hang, self.builds = config, fail_at, hang, 0

    def __call__(self):
        ex = build_executor(self.config)
        self.builds += 1
        if self.builds == 1:
            ex.runner.model = FailingModel(ex.runner.model, self.fail_at, self.hang)
        return ex


@pytest.mark.parametrize("mode", ["raise", "hang"])
def test_failover_mid_stream_continues_on_stock_pool(mode, reference, stock_pool):
    tok, ref = reference
    hang = threading.Event() if mode == "hang" else None
    c = cfg(max_num_seqs=8, stock_pool={"base_url": stock_pool, "model": "tiny"},
            rank_step_timeout_s=4.0 if mode == "hang" else 60.0)

    async def run():
        core = CoordinatorCore(c, FaultyFactory(c, fail_at=5, hang=hang))
        await core.start()
        res = await asyncio.gather(*[_collect(core, f"f{i}", p, GREEDY)
                                     for i, (p, _, _) in enumerate(ref)])
        stats = core.stats()
        assert await core.wait_healthy(60)        # the replica rebuilds its executor …
        again = await _collect(core, "after", ref[0][0], GREEDY)   # … and serves again
        after = core.stats()
        await core.close()
        return res, stats, again, after

    try:
        res, stats, again, after = asyncio.run(run())
    finally:
        if hang is not None:
            hang.set()                            # let the hung step thread end
    for (toks, text, reason), (_, out_ids, out_text) in zip(res, ref):
        assert toks == out_ids, "tokens lost or duplicated across the fail-over"
        assert text == out_text
    assert stats["failover_events"] == 1 and stats["failover_requests"] == len(ref)
    assert "step 5" in stats["last_failure"]
    assert ("did not finish within 4.0 s" if mode == "hang" else "injected fault") \
        in stats["last_failure"]
    assert after["healthy"] and after["rebuilds"] == 1
    assert again[0] == ref[0][1]
    assert after["paths"]["specialized"]["steps"] > stats["paths"]["specialized"]["steps"]


def test_without_stock_pool_failure_and_full_queue_are_overloaded(reference):
    tok, ref = reference
    c = cfg(max_num_seqs=8, max_waiting_requests=1)

    async def run():
        core = CoordinatorCore(c, FaultyFactory(c, fail_at=3))
        await core.start()
        g1 = core.generate("a", ref[0][0], GREEDY)
        g2 = core.generate("b", ref[1][0], GREEDY)
        await g1.__anext__()                      # admitted: one request waits now
        with pytest.raises(Overloaded, match="max_waiting_requests = 1"):
            await g2.__anext__()
        with pytest.raises(Overloaded, match="no stock pool"):
            async for _ in g1:                    # the step fails: nowhere to continue
                pass
        with pytest.raises(Overloaded, match="unhealthy"):
            await core.generate("c", ref[0][0], GREEDY).__anext__()
        assert await core.wait_healthy(60)
        toks, _, _ = await _collect(core, "d", ref[0][0], GREEDY)
        await core.close()
        return toks

    assert asyncio.run(run()) == ref[0][1]


def test_abort_ends_the_stream_and_frees_the_engine(reference):
    tok, ref = reference

    async def run():
        core = CoordinatorCore(cfg(max_num_seqs=8))
        await core.start()
        gen = core.generate("x", ref[0][0], SamplingParams(max_tokens=50, temperature=0.0,
                                                           ignore_eos=True))
        outs = []
        async for o in gen:
            outs.append(o)
            if o.new_token_ids:
                core.abort("x")
        # the abort enters the engine between steps, before the next request's first step
        await _collect(core, "y", ref[1][0], SamplingParams(max_tokens=2, temperature=0.0))
        stats, left = core.stats(), dict(core.engine.requests)
        await core.close()
        return outs, stats, left, core

    outs, stats, left, core = asyncio.run(run())
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert sum(len(o.new_token_ids) for o in outs) < 50
    assert stats["running"] == 0 and left == {} and core.streams == {}


def test_continuation_matches_engine_across_the_hand_over():
    """A request continued from any prefix ends with the engine's text, stop string included."""
    eng = build_local_engine("tiny", max_num_seqs=1, max_model_len=MML)
    probe = eng.generate(["Once upon a time"], SamplingParams(max_tokens=20, temperature=0.0,
                                                               ignore_eos=True))[0]
    stop = probe.output_text[5:8]                # a stop string that occurs in the output
    assert stop
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=(stop,))
    eng2 = build_local_engine("tiny", max_num_seqs=1, max_model_len=MML)
    req = eng2.add_request("Once upon a time", params)
    deltas = []
    while eng2.has_unfinished():
        deltas += eng2.step()
    assert req.finish_reason == "stop"
    text_engine = LLMEngine(None, eng2.tokenizer, eng2.cfg, tuple(eng2.eos_ids))
    for k in range(len(deltas)):
        sent_ids = sum((d.new_token_ids for d in deltas[:k]), [])
        sent_text = "".join(d.delta_text for d in deltas[:k])
        cont = Continuation(text_engine, f"c{k}", req.prompt_ids, params, sent_ids, sent_text)
        text = sent_text
        for t in probe.output_ids[len(sent_ids):]:
            text += cont.push(t).delta_text
            if cont.done:
                break
        cont.close()
        assert cont.req.finish_reason == "stop" and text == req.output_text, k
    assert text_engine.requests == {}


def test_n_beyond_the_queue_is_a_request_error_not_overloaded(reference):
    """A request whose n alone exceeds max_waiting_requests can never be queued: a 400 naming
    n and the limit (the fuzz found it as a 503 on an empty queue, which a client retries
    forever); n at the limit is admitted and completes."""
    tok, ref = reference
    c = cfg(max_num_seqs=8, max_waiting_requests=3)

    async def run():
        core = CoordinatorCore(c)
        await core.start()
        with pytest.raises(RequestError, match="n = 4; .*max_waiting_requests = 3.*n must be ≤ 3"):
            await core.generate("a", ref[0][0], GREEDY, n=4).__anext__()
        assert core.num_waiting == 0 and not core.streams
        outs = [o async for o in core.generate("b", ref[0][0], GREEDY, n=3)]
        await core.close()
        return outs

    outs = asyncio.run(run())
    assert sum(o.finished for o in outs) == 3


def test_http_503_retry_after_and_mid_stream_error_event_without_stock_pool(reference):
    """Over real HTTP (uvicorn): a full queue is a 503 with Retry-After; a replica failure in
    the middle of a stream, with no stock pool to continue on, ends the stream with an error
    event the openai client raises."""
    import openai

    tok, ref = reference
    full = LocalServer(cfg(max_waiting_requests=0))
    c = cfg(max_num_seqs=8)
    failing = LocalServer(c, FaultyFactory(c, fail_at=4))

    async def run():
        a = openai.AsyncOpenAI(base_url=full.start() + "/v1", api_key="x", max_retries=0)
        b = openai.AsyncOpenAI(base_url=failing.start() + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as busy:
            await a.completions.create(model="tiny", prompt="hi", max_tokens=4)
        got = []
        with pytest.raises(openai.APIError, match="no stock pool") as broken:
            async for ch in await b.completions.create(model="tiny", prompt=ref[0][0],
                                                       max_tokens=12, temperature=0,
                                                       stream=True):
                got.append(ch.choices[0].text)
        return busy.value, broken.value, got

    try:
        busy, broken, got = asyncio.run(run())
    finally:
        full.stop()
        failing.stop()
    assert busy.status_code == 503 and busy.response.headers["Retry-After"] == "5"
    assert busy.body["code"] == "service_unavailable" and "max_waiting_requests" in \
        busy.body["message"]
    # the stream had started (HTTP 200) with the first tokens' text before the failure
    assert got and ref[0][2].startswith("".join(got)) and "".join(got) != ref[0][2]


def test_coordinator_sets_its_gil_switch_interval_and_bad_values_are_named():
    """The coordinator process hands the GIL to its step thread within the configured interval
    (actors/config.py coordinator_switch_interval_ms); a bad value is refused at parse time."""
    import sys

    from raydecode.actors.config import DeployConfigError
    from raydecode.actors.coordinator import CoordinatorCore

    prev = sys.getswitchinterval()
    try:
        CoordinatorCore(cfg(coordinator_switch_interval_ms=0.7))
        assert sys.getswitchinterval() == pytest.approx(0.7e-3)
        CoordinatorCore(cfg())
        assert sys.getswitchinterval() == pytest.approx(0.2e-3)      # the default
    finally:
        sys.setswitchinterval(prev)
    for bad in (0, -1, 1000):
        with pytest.raises(DeployConfigError, match="coordinator_switch_interval_ms"):
            cfg(coordinator_switch_interval_ms=bad)


def test_split_mixed_steps_auto_follows_graphed_decode(monkeypatch):
    """split_mixed_steps null: on when the executor's decode steps replay captured graphs and
    the envelope is on (a decode token riding a prefill step would run eager stock), off
    with mixed-step graphs (RAYDECODE_STOCK_MIXED=1); an explicit value wins; the CPU tiny
    replica (no graphs) keeps mixed steps."""
    from raydecode.actors.coordinator import CoordinatorCore, build_executor

    class Graphed:
        decode_graphed = True

        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

    def split(config, graphed):
        core = CoordinatorCore(config, (lambda: Graphed(build_executor(config))) if graphed
                               else None)
        core._build_engine()
        try:
            return core.engine.scheduler.cfg.split_mixed, core.stats()["split_mixed_steps"]
        finally:
            core._pool.shutdown(wait=False)

    assert split(cfg(), graphed=True) == (True, True)
    assert split(cfg(), graphed=False) == (False, False)
    assert split(cfg(split_mixed_steps=False), graphed=True) == (False, False)
    assert split(cfg(split_mixed_steps=True), graphed=False) == (True, True)
    assert split(cfg(envelope={"enabled": False}), graphed=True) == (False, False)
    monkeypatch.setenv("RAYDECODE_STOCK_MIXED", "1")
    assert split(cfg(), graphed=True) == (False, False)
    assert split(cfg(split_mixed_steps=True), graphed=True) == (True, True)


def test_stats_show_the_pacer_where_one_paces():
    """/stats carries the pacer's limit, its schedule and its counters when the deployment
    sets decode_slowdown_limit, and null otherwise."""
    from raydecode.actors.coordinator import CoordinatorCore

    def pacer(config):
        core = CoordinatorCore(config)
        core._build_engine()
        try:
            p = core.engine.scheduler.pacer
            if p is not None:
                p.observe(0, 3, 0.004)
                p.observe(8, 3, 0.006)
            return core.stats()["pacer"]
        finally:
            core._pool.shutdown(wait=False)

    assert pacer(cfg()) is None
    assert pacer(cfg(decode_slowdown_limit=2.5)) == {
        "limit": 2.5, "mixed_steps": True, "stretch": 4.0, "infeasible": 0, "stretched": 0,
        "reprobes": 0, "decode_ms": {4: 4.0}, "chunk_ms": {16: 6.0}}   # mixed: 8 + 3 rows
    assert pacer(cfg(decode_slowdown_limit=2.5, prompt_stretch_limit=6))["stretch"] == 6.0


def test_step_thread_runs_at_most_max_ahead_steps_before_the_streams():
    """Backpressure: with a slow dispatch (the event loop behind), the step thread never runs
    more than MAX_AHEAD steps whose outputs the streams have not received; tokens unchanged."""
    import time as _time

    from raydecode.actors import coordinator as co

    async def main():
        core = co.CoordinatorCore(cfg(max_num_seqs=4))
        await core.start()
        inner = core._dispatch
        lag = []

        def slow(outs):
            lag.append(core.loop_timing["steps"] - (len(lag) + 1))
            _time.sleep(0.03)
            inner(outs)
        core._dispatch = slow
        try:
            got = await _collect(core, "r0", [5, 6, 7], SamplingParams(max_tokens=16,
                                                                        temperature=0.0,
                                                                        ignore_eos=True))
        finally:
            await core.close()
        return got, lag

    (ids, _, reason), lag = asyncio.run(main())
    assert len(ids) == 16 and reason == "length"
    assert co.MAX_AHEAD == 2 and lag and max(lag) <= 2, lag
    assert max(lag) >= 1                    # it did run ahead while the loop was busy
