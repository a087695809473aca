"""The OpenAI endpoint under real Ray Serve, driven over real HTTP by the official `openai`
client: chat and completions, streaming and not, 8 concurrent requests with malformed ones
among them, greedy output equal to the in-process engine, /health, /v1/models, /metrics; and
fail-over: the replica's model raises in the middle of 4 streaming requests (a fault injected
through the executor factory), all 4 complete through the stock pool (a second, stock-only
raydecode replica, served by uvicorn on a loopback port) with the undisturbed greedy text, the
counters show it, and the replica rebuilds."""
import asyncio
import json
import re
import sys

import urllib.error
import urllib.request
import openai
import pytest
import torch

from raydecode.actors.config import parse_deploy_config
from raydecode.actors.coordinator import build_executor
from raydecode.actors.serve import LocalServer, deployment_for
from raydecode.commands.serve import start_http
from raydecode.engine.k3_channels import parse
from raydecode.engine.k3_chat import ChatOptions
from raydecode.engine.loader import build_local_engine
from raydecode.engine.request import SamplingParams

from _net import free_port

torch.set_num_threads(1)
MML = 128
NAME = "tiny-k3"


POISON = 509        # a reserved special: never produced by text encoding or the chat template


class FailingModel(torch.nn.Module):
    """Fault injection: the real model, raising `after` forward calls past the first prefill
    that contains the POISON token (so only the fail-over test's requests trigger it)."""

    def __init__(self, inner, after: int):
        super().__init__()
        self.inner, self.after, self.calls, self.armed_at = inner, after, 0, None

    def forward(self, tokens, batch, caches, **kw):
        self.calls += 1
        if self.armed_at is None and not batch.is_decode_only and bool((tokens == POISON).any()):
            self.armed_at = self.calls
        if self.armed_at is not None and self.calls == self.armed_at + self.after:
            raise RuntimeError(f"injected fault at forward call {self.calls}")
        return self.inner(tokens, batch, caches, **kw)

    def compute_logits(self, hidden):
        return self.inner.compute_logits(hidden)


class FaultyFactory:
    """Runs in the coordinator actor: the first executor's model carries the fault."""

    def __init__(self, config, after: int):
        self.config, self.after, self.builds = config, after, 0

    def __call__(self):
        ex = build_executor(self.config)
        self.builds += 1
        if self.builds == 1:
            ex.runner.model = FailingModel(ex.runner.model, self.after)
        return ex


def cfg(**kw):
    return parse_deploy_config({"model": "tiny", "max_model_len": MML, "max_num_seqs": 8,
                                "placement": {"profile": "development"},
                                "serve": {"num_cpus": 0}, **kw})


@pytest.fixture(scope="module")
def server():
    import ray
    import ray.cloudpickle
    from ray import serve

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the fault injection
    ray.init(address="local", num_cpus=2, include_dashboard=False,
             object_store_memory=80 * 2**20, log_to_driver=False)
    # the stock pool: a stock-only raydecode replica served by uvicorn in this process
    stock = LocalServer(cfg(served_model_name=NAME, envelope={"enabled": False}))
    stock_url = stock.start()
    port = free_port()
    port = start_http("127.0.0.1", port, retry_free=2)
    replica = cfg(served_model_name=NAME, stock_pool={"base_url": stock_url + "/v1"})
    serve.run(deployment_for(replica, FaultyFactory(replica, after=5)), name="replica",
              route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()
    stock.stop()


@pytest.fixture(scope="module")
def engine():
    return build_local_engine("tiny", max_num_seqs=8, max_model_len=MML)


def reference(engine, prompt, max_tokens):
    """Greedy text of one prompt (str or ids) from the in-process engine."""
    req = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0]
    return req.output_text, len(req.prompt_ids), len(req.output_ids), req.finish_reason


def http(url, body: bytes | None = None) -> tuple[int, bytes]:
    """A plain HTTP GET (or POST of raw bytes) with the standard library: status, body."""
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def client(url):
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_models_health_and_metrics(server):
    status, body = http(server + "/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == [NAME]
    status, body = http(server + "/health")
    health = json.loads(body)
    assert status == 200 and health["status"] == "ok"
    assert health["profile"] == "development" and "development" in health["note"]


def test_completion_and_chat_match_the_engine(server, engine):
    async def run():
        c = client(server)
        comp = await c.completions.create(model=NAME, prompt="The capital of France is",
                                          max_tokens=10, temperature=0)
        chunks = [ch async for ch in await c.completions.create(
            model=NAME, prompt="The capital of France is", max_tokens=10, temperature=0,
            stream=True, stream_options={"include_usage": True})]
        msgs = [{"role": "user", "content": "Say hello"}]
        no_think = {"chat_template_kwargs": {"thinking": False}}   # the preamble fills MML
        chat = await c.chat.completions.create(model=NAME, messages=msgs, max_tokens=8,
                                               temperature=0, extra_body=no_think)
        chat_chunks = [ch async for ch in await c.chat.completions.create(
            model=NAME, messages=msgs, max_tokens=8, temperature=0, stream=True,
            extra_body=no_think)]
        return comp, chunks, chat, chat_chunks

    comp, chunks, chat, chat_chunks = asyncio.run(run())
    text, n_prompt, n_out, reason = reference(engine, "The capital of France is", 10)
    assert comp.choices[0].text == text and comp.choices[0].finish_reason == reason
    assert (comp.usage.prompt_tokens, comp.usage.completion_tokens) == (n_prompt, n_out)
    assert comp.usage.total_tokens == n_prompt + n_out
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n_out
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == reason

    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Say hello"}],
                                               options=ChatOptions(thinking=False))
    req = engine.generate([list(ids)], SamplingParams(max_tokens=8, temperature=0.0,
                                                      channel_markers=True))[0]
    ctext = parse(req.output_text, "response").content       # the response channel's text
    assert chat.choices[0].message.content == ctext
    assert chat.choices[0].finish_reason == req.finish_reason
    assert chat.usage.prompt_tokens == len(ids)
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chat_chunks) == ctext


BAD = [  # (raw body or kwargs, expected status, expected param)
    (b'{"model": "tiny-k3", "prompt": "hi", ', 400, None),                   # malformed JSON
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),                     # unknown model
    ({"model": NAME, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "hi", "max_tokens": MML}, 400, "max_tokens"),  # beyond context
    ({"model": NAME, "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"model": NAME, "prompt": 42}, 400, "prompt"),
    ({"model": NAME, "prompt": "hi", "n": 0}, 400, "n"),
    ({"model": NAME, "prompt": "x " * MML, "max_tokens": 1}, 400, "prompt"),
    # hostile sampling values that underflow in fp32: once they failed the whole batch's step
    ({"model": NAME, "prompt": "hi", "temperature": 1.0, "top_p": 1e-300}, 400, "top_p"),
    ({"model": NAME, "prompt": "hi", "temperature": 1.0, "top_p": 2.2e-313}, 400, "top_p"),
    ({"model": NAME, "prompt": "hi", "temperature": 1e-300}, 400, "temperature"),
]


def test_concurrent_good_requests_finish_while_bad_ones_get_openai_errors(server, engine):
    prompts = [f"Request number {i} says" for i in range(8)]
    refs = [reference(engine, p, 12)[0] for p in prompts]

    async def good(c, i):
        if i % 2:
            stream = await c.completions.create(model=NAME, prompt=prompts[i], max_tokens=12,
                                                temperature=0, stream=True)
            return "".join([ch.choices[0].text async for ch in stream])
        r = await c.completions.create(model=NAME, prompt=prompts[i], max_tokens=12,
                                       temperature=0)
        return r.choices[0].text

    async def bad(body):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, raw = await asyncio.to_thread(http, server + "/v1/completions", data)
        return status, json.loads(raw)

    async def run():
        c = client(server)
        res = await asyncio.gather(*[good(c, i) for i in range(8)], *[bad(b) for b, _, _ in BAD])
        return res[:8], res[8:]

    goods, bads = asyncio.run(run())
    assert goods == refs
    for (body, status, param), (got_status, got) in zip(BAD, bads):
        assert got_status == status, (body, got)
        err = got["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, (body, err)
    assert bads[1][1]["error"]["code"] == "model_not_found"
    assert bads[4][1]["error"]["code"] == "context_length_exceeded"

    text = http(server + "/metrics")[1].decode()
    steps = {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
             for line in text.splitlines() if line.startswith("raydecode_steps_total{")}
    assert steps['path="specialized"'] > 0 and steps['path="stock"'] > 0     # development profile
    assert 'raydecode_requests_total{endpoint="completions",status="404"} 1.0' in text
    assert "raydecode_time_to_first_token_seconds_count" in text
    assert "raydecode_waiting_requests 0.0" in text


def test_stop_seed_and_top_p(server, engine):
    prompt = "A list of colours:"
    full = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0))[0]
    stop = full.output_text[4:7]
    want = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0,
                                                    stop=(stop,)))[0]
    assert want.finish_reason == "stop"

    async def run():
        c = client(server)
        kw = dict(model=NAME, prompt=prompt, max_tokens=16)
        stopped = await c.completions.create(temperature=0, stop=[stop], **kw)
        seeded = [await c.completions.create(temperature=1.0, seed=7, **kw) for _ in range(2)]
        nucleus = await c.completions.create(temperature=1.0, top_p=1e-6, **kw)
        return stopped, seeded, nucleus

    stopped, seeded, nucleus = asyncio.run(run())
    assert stopped.choices[0].text == want.output_text and stopped.choices[0].finish_reason \
        == "stop"
    assert stopped.choices[0].text == full.output_text[:full.output_text.find(stop)]
    assert seeded[0].choices[0].text == seeded[1].choices[0].text      # same seed, same sample
    assert nucleus.choices[0].text == full.output_text                 # top_p → only the argmax


def test_n2_choices_and_cached_tokens_through_ray_serve(server, engine):
    """n = 2 through the Serve ingress and the Coordinator actor (its generator carries every
    sample's deltas by index); the same prompt again is served partly from the prefix cache."""
    prompt = "A haiku about caches:"
    want = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]

    async def run():
        c = client(server)
        kw = dict(model=NAME, prompt=prompt, max_tokens=8, temperature=0, n=2)
        body = await c.completions.create(**kw)
        parts = {0: "", 1: ""}
        async for ch in await c.completions.create(**kw, stream=True):
            for choice in ch.choices:
                parts[choice.index] += choice.text
        return body, parts

    body, parts = asyncio.run(run())
    assert [ch.index for ch in body.choices] == [0, 1]
    assert [ch.text for ch in body.choices] == [want.output_text] * 2 == [parts[0], parts[1]]
    assert body.usage.completion_tokens == 2 * len(want.output_ids)
    assert body.usage.prompt_tokens_details.cached_tokens == 0       # shorter than a chunk


def test_raw_sse_framing(server):
    body = json.dumps({"model": NAME, "prompt": "Hello", "max_tokens": 4, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    status, raw = http(server + "/v1/completions", body)
    events = raw.decode().split("\n\n")
    assert status == 200 and events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
    assert chunks[-2]["choices"][0]["finish_reason"] in ("length", "stop")


def test_openai_client_raises_typed_errors(server):
    async def run():
        c = client(server)
        with pytest.raises(openai.NotFoundError):
            await c.chat.completions.create(model="nope", messages=[{"role": "user",
                                                                     "content": "x"}])
        with pytest.raises(openai.BadRequestError, match="context length"):
            await c.chat.completions.create(model=NAME, max_tokens=MML,
                                            messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.BadRequestError, match="messages"):
            await c.chat.completions.create(model=NAME, messages=[])

    asyncio.run(run())


def test_streams_fail_over_mid_flight_without_loss_or_duplication(server, engine):
    prompts = [[POISON] + engine.tokenizer.encode(p) for p in
               ("The capital of France", "Once upon a time", "def fib(n):", "1, 2, 3, 4,")]
    reqs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0))

    async def one(c, p):
        stream = await c.completions.create(model=NAME, prompt=p, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
        chunks = [ch async for ch in stream]
        return "".join(ch.choices[0].text for ch in chunks if ch.choices), chunks[-1].usage

    async def run():
        c = client(server)
        got = await asyncio.gather(*[one(c, p) for p in prompts])
        # waits (on an event in the coordinator) until the executor is rebuilt
        health = json.loads((await asyncio.to_thread(http, server + "/health?wait_s=120"))[1])
        again = await c.completions.create(model=NAME, prompt=prompts[0], max_tokens=16,
                                           temperature=0)
        return got, health, again

    got, health, again = asyncio.run(run())
    for (text, use), r in zip(got, reqs):
        assert text == r.output_text, "text lost or duplicated across the fail-over"
        assert (use.prompt_tokens, use.completion_tokens) == (len(r.prompt_ids),
                                                              len(r.output_ids))
    assert health["status"] == "ok" and "injected fault" in health["last_failure"]
    assert re.search(r"step \d+ \((specialized|stock), \d+ seqs", health["last_failure"])
    assert again.choices[0].text == reqs[0].output_text

    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
              for line in http(server + "/metrics")[1].decode().splitlines()
              if line.startswith("raydecode_")}
    assert values["raydecode_failover_events_total"] == 1.0
    assert values["raydecode_failover_requests_total"] == len(prompts)
    assert values["raydecode_rebuilds_total"] == 1.0
    assert values["raydecode_routed_to_stock_total"] == 0.0      # `again` ran on the replica
    assert values["raydecode_replica_healthy"] == 1.0
