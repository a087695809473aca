"""Prefix caching and n > 1 through the official `openai` client over real HTTP (a replica
served by uvicorn in this process: FastAPI app, CoordinatorCore, the tiny model on the CPU).

Issue 29's acceptance on the CPU: two agent turns sharing a ~2,000-token prefix — the second
reports usage.prompt_tokens_details.cached_tokens >= 1,900 (streamed, in the include_usage
chunk, and in the body) and its time to first token is <= 0.2x the first turn's; both turns
generate the same tokens with caching on and off. n = 2 returns two choices (streamed with
their indices, reassembling to the non-streamed ones) from one prefill (/metrics' prefill
token counter grows by the prompt once); n out of range is a 400 naming n."""
from __future__ import annotations

import json
import random
import time
import urllib.request

import openai
import pytest
import torch

from raydecode.actors.config import parse_deploy_config
from raydecode.actors.serve import LocalServer

torch.set_num_threads(1)
NAME = "tiny-k3"
WORDS = ("alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "lambda", "theta")


def cfg(caching: bool):
    return parse_deploy_config({
        "model": "tiny", "served_model_name": NAME, "max_model_len": 4096, "max_num_seqs": 4,
        "max_num_batched_tokens": 512, "enable_prefix_caching": caching,
        "kda_snapshot_slots": 8, "placement": {"profile": "development"},
        "serve": {"num_cpus": 0}})


@pytest.fixture(scope="module")
def servers():
    on, off = LocalServer(cfg(True)), LocalServer(cfg(False))
    urls = {True: on.start(), False: off.start()}
    yield urls
    on.stop()
    off.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)


def conversation() -> list[dict]:
    rng = random.Random(29)
    prefix = " ".join(rng.choice(WORDS) for _ in range(470))      # ~2,300 prompt tokens
    return [{"role": "system", "content": "You are a coding agent. Repository notes: " + prefix},
            {"role": "user", "content": "List the files you would open first."}]


def streamed_turn(c: openai.OpenAI, messages: list[dict]) -> dict:
    """One streamed greedy chat turn: TTFT (send -> first content), text, token ids, usage."""
    t0 = time.perf_counter()
    ttft, text, ids, use = None, [], [], None
    for ch in c.chat.completions.create(
            model=NAME, messages=messages, max_tokens=12, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"return_token_ids": True,
                                                                "ignore_eos": True}):
        if ch.usage is not None:
            use = ch.usage
        for choice in ch.choices:
            new = getattr(choice, "token_ids", None) or []
            if new and ttft is None:
                ttft = time.perf_counter() - t0
            ids += new
            text.append(choice.delta.content or "")
    return {"ttft": ttft, "text": "".join(text), "ids": ids, "usage": use}


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=60) as f:
        for ln in f.read().decode().splitlines():
            if ln.startswith(name + " "):
                return float(ln.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def test_second_turn_is_served_from_the_cache_and_equals_recompute(servers):
    got = {}
    for on in (True, False):
        c = client(servers[on])
        msgs = conversation()
        t1 = streamed_turn(c, msgs)
        msgs += [{"role": "assistant", "content": t1["text"]},
                 {"role": "user", "content": "Now open the first one."}]
        t2 = streamed_turn(c, msgs)
        body = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=4,
                                         temperature=0.0)
        got[on] = (t1, t2, body)
    t1, t2, body = got[True]
    assert 2000 <= t1["usage"].prompt_tokens <= 2500
    assert t1["usage"].prompt_tokens_details.cached_tokens == 0
    # the first turn's prompt-end snapshot: everything up to its generation prompt
    assert t2["usage"].prompt_tokens_details.cached_tokens >= 1900
    assert t2["ttft"] <= 0.2 * t1["ttft"], (t2["ttft"], t1["ttft"])
    # the same prompt once more (non-streamed): the block-aligned end of its last chunk
    assert body.usage.prompt_tokens_details.cached_tokens >= body.usage.prompt_tokens - 512
    off1, off2, off_body = got[False]
    assert off2["usage"].prompt_tokens_details.cached_tokens == 0
    assert (t1["ids"], t2["ids"]) == (off1["ids"], off2["ids"]) and len(t2["ids"]) == 12
    assert body.choices[0].message.content == off_body.choices[0].message.content
    assert metric(servers[True], "raydecode_prefix_cache_hits_total") >= 2


def test_n2_returns_two_choices_from_one_prefill(servers):
    url = servers[False]                  # no cache: the prefill counter shows the sharing
    c = client(url)
    prompt = [random.Random(2).randrange(3, 490) for _ in range(300)]
    before = metric(url, "raydecode_prefill_tokens_total")
    forks = metric(url, "raydecode_forked_samples_total")
    out = c.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0.9,
                               seed=7, n=2, extra_body={"ignore_eos": True})
    assert [ch.index for ch in out.choices] == [0, 1]
    assert out.usage.prompt_tokens == 300 and out.usage.completion_tokens == 16
    assert metric(url, "raydecode_prefill_tokens_total") - before == 300    # one prefill
    assert metric(url, "raydecode_forked_samples_total") - forks == 1
    assert out.choices[0].text != out.choices[1].text        # distinct seeds per sample
    # sample 0 is the n = 1 answer of the same seed
    one = c.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0.9,
                               seed=7, extra_body={"ignore_eos": True})
    assert one.choices[0].text == out.choices[0].text
    # streamed chat, n = 2: every chunk names its choice; the pieces reassemble the bodies
    msgs = [{"role": "user", "content": "Name two sorting algorithms."}]
    kw = dict(model=NAME, messages=msgs, max_tokens=6, temperature=1.0, seed=3, n=2)
    full = c.chat.completions.create(**kw)
    parts, fins, use = {0: "", 1: ""}, {}, None
    for ch in c.chat.completions.create(**kw, stream=True,
                                        stream_options={"include_usage": True}):
        use = ch.usage or use
        for choice in ch.choices:
            parts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                fins[choice.index] = choice.finish_reason
    assert [parts[i] for i in (0, 1)] == [ch.message.content for ch in full.choices]
    assert fins == {0: full.choices[0].finish_reason, 1: full.choices[1].finish_reason}
    assert use.completion_tokens == full.usage.completion_tokens


def test_n_out_of_range_is_a_400_naming_n(servers):
    c = client(servers[False])
    for n in (0, 129):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=NAME, prompt="hi", max_tokens=2, n=n)
        assert e.value.body["param"] == "n" and f"n = {n}" in e.value.body["message"]
    raw = json.dumps({"model": NAME, "prompt": "hi", "n": "two"}).encode()
    req = urllib.request.Request(servers[False] + "/v1/completions", data=raw,
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 400 and json.loads(e.value.read())["error"]["param"] == "n"


def test_an_executor_without_snapshot_slots_serves_without_caching():
    """A replica's executor built elsewhere (a benchmark's factory, a test double) that does
    not report its KDA snapshot slots gets caching off, never plans naming slots it lacks."""
    from raydecode.actors.coordinator import fit_prefix_cache

    ecfg = cfg(True).engine_config(4096)
    assert ecfg.enable_prefix_caching and ecfg.num_snapshots == 8
    off = fit_prefix_cache(ecfg, object())
    assert not off.enable_prefix_caching and off.num_snapshots == 0
    fewer = fit_prefix_cache(ecfg, type("Ex", (), {"kda_snapshot_slots": 3})())
    assert fewer.enable_prefix_caching and fewer.num_snapshots == 3
    assert fit_prefix_cache(ecfg, type("Ex", (), {"kda_snapshot_slots": 99})()) is ecfg
