"""The agent-facing chat API over real HTTP with the official `openai` client (uvicorn serving
a real coordinator): K3 tool calls and reasoning streamed as deltas that reassemble exactly to
the non-streamed answer, tool_choice, tool results sent back, invalid tool schemas, malformed
model output; logprobs against the model's own log-softmax.

The model's output is forced by a scripted executor injected through the coordinator's
executor_factory: every request's k-th sampled token is script[k] (the plan's per-row sampling
counter), so the whole engine, detokenizer and HTTP stack run as in production."""
import asyncio
import json
import urllib.error
import urllib.request

import openai
import pytest
import torch

from raydecode.actors.config import parse_deploy_config
from raydecode.actors.serve import LocalServer
from raydecode.engine.k3_chat import ChatOptions
from raydecode.engine.loader import load_shard, load_tokenizer
from raydecode.engine.sampling import StepResult
from raydecode.models.cache import SeqSlice, StepBatch

torch.set_num_threads(1)
NAME = "tiny-k3"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
TOOL_OUTPUT = (  # after the generation prefix (think open)
    'The user wants the weather; call the tool.<|close|>think<|sep|><|open|>response<|sep|>'
    'Checking.<|close|>response<|sep|><|open|>tools<|sep|>'
    '<|open|>call tool="get_weather" index="1"<|sep|>'
    '<|open|>argument key="city" type="string"<|sep|>Paris, "Île-de-France"'
    '<|close|>argument<|sep|>'
    '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|>'
    '<|open|>call tool="get_weather" index="2"<|sep|>'
    '<|open|>argument key="city" type="string"<|sep|>Lyon<|close|>argument<|sep|>'
    '<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>')


class ScriptedExecutor:
    """A replica executor without a model: sample row r returns script[counter_r] (the index of
    the token its request draws), then <|end_of_msg|>."""
    tp_size, dcp_size, domain_verified = 1, 1, False

    def __init__(self, script: list[int], eos: int):
        self.script, self.eos = script, eos

    def specialized_ready(self, num_seqs: int) -> bool:
        return True

    def execute(self, plan) -> StepResult:
        return StepResult([self.script[c] if c < len(self.script) else self.eos
                           for c in plan.sampling.counter])

    def close(self) -> None:
        pass


def cfg(**kw):
    return parse_deploy_config({"model": "tiny", "served_model_name": NAME,
                                "max_model_len": 2048, "max_num_seqs": 4, **kw})


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


@pytest.fixture
def scripted(tok):
    """scripted(text) -> the URL of a server whose model writes `text` (markup as specials)."""
    servers = []

    def start(text: str, **kw) -> str:
        ids = tok.encode(text)
        eos = tok.special_tokens["<|end_of_msg|>"]
        srv = LocalServer(cfg(**kw), lambda: ScriptedExecutor(ids, eos))
        servers.append(srv)
        return srv.start()

    yield start
    for s in servers:
        s.stop()


def client(url: str, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def reassemble(chunks) -> dict:
    """The streamed deltas summed as a client would: per field, tool calls by index."""
    out = {"content": "", "reasoning_content": "", "tool_calls": [], "finish": None}
    for ch in chunks:
        if not ch.choices:
            continue
        c = ch.choices[0]
        d = c.delta
        out["content"] += d.content or ""
        out["reasoning_content"] += (d.model_extra or {}).get("reasoning_content") or ""
        for tc in d.tool_calls or []:
            if tc.index == len(out["tool_calls"]):
                out["tool_calls"].append({"id": tc.id, "type": tc.type, "function": {
                    "name": tc.function.name, "arguments": ""}})
            out["tool_calls"][tc.index]["function"]["arguments"] += tc.function.arguments or ""
        out["finish"] = c.finish_reason or out["finish"]
    return out


def test_streamed_tool_calls_reassemble_exactly_to_the_non_streamed_answer(scripted):
    url = scripted(TOOL_OUTPUT)

    async def run():
        c = client(url)
        kw = dict(model=NAME, messages=ASK, tools=[WEATHER], max_tokens=400)
        whole = await c.chat.completions.create(**kw)
        chunks = [ch async for ch in await c.chat.completions.create(stream=True, **kw)]
        return whole, chunks

    whole, chunks = asyncio.run(run())
    msg = whole.choices[0].message
    calls = [tc.model_dump() for tc in msg.tool_calls]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_weather"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": 'Paris, "Île-de-France"', "days": 3}, {"city": "Lyon"}]
    assert [c["id"] for c in calls] == ["functions.get_weather:0", "functions.get_weather:1"]
    assert msg.model_extra["reasoning_content"] == "The user wants the weather; call the tool."
    assert msg.content == "Checking."
    assert whole.choices[0].finish_reason == "tool_calls"
    # the stream: the same calls, reasoning and content, with arguments in several pieces
    got = reassemble(chunks)
    assert got["tool_calls"] == calls
    assert (got["reasoning_content"], got["content"]) == (msg.model_extra["reasoning_content"],
                                                          msg.content)
    assert got["finish"] == "tool_calls"
    pieces = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert len(pieces) > 4 and sum(tc.id is not None for tc in pieces) == 2
    assert chunks[0].choices[0].delta.role == "assistant"


def test_tool_results_go_back_and_tool_choice_shapes_the_answer(scripted, tok):
    url = scripted(TOOL_OUTPUT)
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "functions.get_weather:0", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18C"}]

    async def run():
        c = client(url)
        again = await c.chat.completions.create(model=NAME, messages=turn, tools=[WEATHER],
                                                max_tokens=400)
        none = await c.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER],
                                               tool_choice="none", max_tokens=400)
        return again, none

    again, none = asyncio.run(run())
    # the follow-up turn's prompt is K3's rendering of the tool call and its result
    want = tok.apply_chat_template([
        *ASK, {"role": "assistant", "content": "", "tool_calls": turn[1]["tool_calls"]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18C"}],
        tools=[WEATHER])
    assert again.usage.prompt_tokens == len(want)
    assert len(again.choices[0].message.tool_calls) == 2
    # tool_choice none: the tools channel is not read as calls; it reaches the client as text
    m = none.choices[0].message
    assert m.tool_calls is None and none.choices[0].finish_reason == "stop"
    assert m.content.startswith("Checking.<|open|>tools<|sep|><|open|>call tool=")


def test_a_named_tool_choice_forces_that_call(scripted):
    # the prompt already opened the call: the model writes only its arguments
    url = scripted('<|open|>argument key="city" type="string"<|sep|>Rome<|close|>argument<|sep|>'
                   '<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>')

    async def run():
        c = client(url)
        kw = dict(model=NAME, messages=ASK, tools=[WEATHER], max_tokens=100,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
        return (await c.chat.completions.create(**kw),
                [ch async for ch in await c.chat.completions.create(stream=True, **kw)])

    whole, chunks = asyncio.run(run())
    calls = [tc.model_dump() for tc in whole.choices[0].message.tool_calls]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Rome"})]
    assert reassemble(chunks)["tool_calls"] == calls


def test_malformed_tool_output_degrades_to_content_not_a_500(scripted):
    url = scripted('hmm<|close|>think<|sep|><|open|>tools<|sep|>garbage<|open|>call index="x"'
                   '<|sep|><|open|>argument key="a" type="number"<|sep|>not json'
                   '<|close|>argument<|sep|><|open|>call tool="get_weather" index="2"<|sep|>'
                   '<|open|>argument key="city" type="string"<|sep|>Pa')   # cut mid-argument

    async def run():
        c = client(url)
        kw = dict(model=NAME, messages=ASK, tools=[WEATHER], max_tokens=400)
        return (await c.chat.completions.create(**kw),
                [ch async for ch in await c.chat.completions.create(stream=True, **kw)])

    whole, chunks = asyncio.run(run())
    m = whole.choices[0].message
    assert m.model_extra["reasoning_content"] == "hmm"
    assert m.content.startswith("garbage<|open|>call index=\"x\"<|sep|>")
    # the well-formed call survives, its truncated argument closed into valid JSON
    assert [json.loads(tc.function.arguments) for tc in m.tool_calls] == [{"city": "Pa"}]
    got = reassemble(chunks)
    assert got["content"] == m.content and got["tool_calls"] == [tc.model_dump()
                                                                for tc in m.tool_calls]


@pytest.mark.parametrize("tools, tool_choice, param", [
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strng"}}}}}], None,
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None,
     "tools[0].function.parameters"),
    ([WEATHER, {"type": "function", "function": {"name": "bad name!"}}], None,
     "tools[1].function.name"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_invalid_tools_are_a_400_naming_the_field(scripted, tools, tool_choice, param):
    url = scripted("unused")

    async def run():
        kw = {"tools": tools} if tools else {}
        if tool_choice:
            kw["tool_choice"] = tool_choice
        with pytest.raises(openai.BadRequestError) as e:
            await client(url).chat.completions.create(model=NAME, messages=ASK, **kw)
        return e.value

    err = asyncio.run(run())
    assert err.status_code == 400 and err.body["param"] == param, err.body
    assert param.split(".")[0].split("[")[0] in err.body["message"]


def test_thinking_off_through_chat_template_kwargs(scripted):
    url = scripted("Just the answer.<|close|>response<|sep|><|close|>message<|sep|>")

    async def run():
        c = client(url)
        off = await c.chat.completions.create(
            model=NAME, messages=ASK, extra_body={"chat_template_kwargs": {"thinking": False}})
        on = await c.chat.completions.create(model=NAME, messages=ASK)
        with pytest.raises(openai.BadRequestError, match="thinking_effort"):
            await c.chat.completions.create(model=NAME, messages=ASK, extra_body={
                "chat_template_kwargs": {"thinking_effort": "medium"}})
        return off, on

    off, on = asyncio.run(run())
    assert off.choices[0].message.content == "Just the answer."
    assert "reasoning_content" not in off.choices[0].message.model_extra
    # with thinking on the same tokens are read as (unterminated) reasoning
    assert on.choices[0].message.model_extra["reasoning_content"].startswith("Just the answer.")
    assert off.usage.prompt_tokens < on.usage.prompt_tokens       # no thinking-effort block


# ---- logprobs against the model itself -------------------------------------------------------
@pytest.fixture(scope="module")
def real():
    srv = LocalServer(cfg(max_model_len=256))
    url = srv.start()
    yield url
    srv.stop()


@pytest.fixture(scope="module")
def model():
    return load_shard("tiny", num_slots=1, num_blocks=16, block_size=16).model


def log_softmax_rows(model, ids: list[int]) -> torch.Tensor:
    """(len(ids), V) log-softmax of the next-token logits at every position, one cacheless pass."""
    with torch.inference_mode():
        h = model(torch.tensor(ids), StepBatch([SeqSlice(slot=0, start=0, length=len(ids),
                                                         pos=0)]), None)
        return torch.log_softmax(model.compute_logits(h).float(), dim=-1)


def test_chat_logprobs_match_the_models_log_softmax(real, model, tok):
    async def run():
        c = client(real)
        kw = dict(model=NAME, messages=[{"role": "user", "content": "Say hi"}], max_tokens=6,
                  logprobs=True, top_logprobs=2, extra_body={
                      "chat_template_kwargs": {"thinking": False}, "return_token_ids": True})
        return (await c.chat.completions.create(temperature=0, **kw),
                [ch async for ch in await c.chat.completions.create(temperature=0, stream=True,
                                                                    **kw)],
                await c.chat.completions.create(temperature=0.9, seed=7, **kw))

    greedy, chunks, sampled = asyncio.run(run())
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hi"}],
                                     options=ChatOptions(thinking=False))
    for r in (greedy, sampled):
        out = r.choices[0].model_extra["token_ids"]
        entries = r.choices[0].logprobs.content
        assert len(entries) == len(out) > 0
        ref = log_softmax_rows(model, prompt + out)[len(prompt) - 1:len(prompt) - 1 + len(out)]
        for j, (tid, e) in enumerate(zip(out, entries)):
            assert bytes(e.bytes) == tok.decode_bytes([tid])
            assert abs(e.logprob - ref[j, tid].item()) < 1e-4
            top_lp, top_ids = torch.topk(ref[j], 2)
            assert [bytes(t.bytes) for t in e.top_logprobs] == [tok.decode_bytes([int(i)])
                                                                for i in top_ids]
            assert max(abs(t.logprob - v) for t, v in zip(e.top_logprobs, top_lp.tolist())) < 1e-4
    # greedy: the chosen token is the top alternative; the stream carries the same entries
    assert all(e.top_logprobs[0].logprob == e.logprob for e in greedy.choices[0].logprobs.content)
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump()
                                                  for e in greedy.choices[0].logprobs.content]


def test_completion_logprobs_match_the_models_log_softmax(real, model, tok):
    async def run():
        return await client(real).completions.create(
            model=NAME, prompt="The river ran", max_tokens=5, temperature=0, logprobs=2,
            extra_body={"return_token_ids": True})

    r = asyncio.run(run())
    prompt = tok.encode("The river ran")
    out = r.choices[0].model_extra["token_ids"]
    lp = r.choices[0].logprobs
    ref = log_softmax_rows(model, prompt + out)[len(prompt) - 1:len(prompt) - 1 + len(out)]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(out)
    for j, tid in enumerate(out):
        assert abs(lp.token_logprobs[j] - ref[j, tid].item()) < 1e-4
        assert len(lp.top_logprobs[j]) == 2            # greedy: the sampled token is the top one
        top_lp, _ = torch.topk(ref[j], 2)
        assert sorted(lp.top_logprobs[j].values(), reverse=True) == pytest.approx(
            top_lp.tolist(), abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_logprobs_out_of_range_are_400s(real):
    async def run():
        c = client(real)
        for kw, param in ((dict(logprobs=True, top_logprobs=21), "top_logprobs"),
                          (dict(top_logprobs=2), "top_logprobs")):
            with pytest.raises(openai.BadRequestError) as e:
                await c.chat.completions.create(model=NAME, messages=ASK, **kw)
            assert e.value.body["param"] == param
        with pytest.raises(openai.BadRequestError) as e:
            await c.completions.create(model=NAME, prompt="x", logprobs=21)
        assert e.value.body["param"] == "logprobs"

    asyncio.run(run())


def test_speculative_deployments_refuse_logprobs_and_unencodable_text_is_a_400(tok):
    eos = tok.special_tokens["<|end_of_msg|>"]
    srv = LocalServer(cfg(speculative_config={"method": "dspark", "num_speculative_tokens": 3}),
                      lambda: ScriptedExecutor([eos], eos))
    url = srv.start()
    try:
        async def run():
            c = client(url)
            with pytest.raises(openai.BadRequestError) as e:
                await c.completions.create(model=NAME, prompt="x", logprobs=1)
            return e.value

        assert asyncio.run(run()).body["param"] == "logprobs"
    finally:
        srv.stop()
    # a lone surrogate escape (text no tokenizer can encode, and the marker characters' range)
    srv = LocalServer(cfg(), lambda: ScriptedExecutor([eos], eos))
    base = srv.start()
    try:
        body = (b'{"model": "%s", "messages": [{"role": "user", "content": "a\\udc00b"}]}'
                % NAME.encode())
        req = urllib.request.Request(base + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        assert e.value.code == 400 and "surrogate" in json.loads(e.value.read())["error"][
            "message"]
    finally:
        srv.stop()
