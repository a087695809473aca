"""K3's output channel parser: reasoning / content / typed tool calls, streamed deltas that sum
to the one-shot parse however the text is split, and malformed output degrading to content."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raydecode.engine.k3_channels import (ChannelParser, ChannelResult, C, O, S, literal,
                                          parse)


def m(s: str) -> str:
    """Spelled-out markup -> the marker characters the engine's chat detokenization writes."""
    return s.replace("<|open|>", O).replace("<|close|>", C).replace("<|sep|>", S)


CALL = ('<|open|>call tool="get_weather" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Pa"ris\n\\<|close|>argument<|sep|>'
        '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
        '<|open|>argument key="o" type="object"<|sep|>{"u": [1, "c"]}<|close|>argument<|sep|>'
        '<|close|>call<|sep|>')
FULL = m('Think first.<|close|>think<|sep|><|open|>response<|sep|>Let me look.'
         '<|close|>response<|sep|><|open|>tools<|sep|>' + CALL +
         '<|open|>call tool="ping" index="2"<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
         '<|close|>message<|sep|>')


def streamed(text: str, cuts: list[int], **kw) -> tuple[ChannelResult, list]:
    p, r, deltas = ChannelParser(**kw), ChannelResult(), []
    bounds = [0, *sorted(set(c % (len(text) + 1) for c in cuts)), len(text)]
    for a, b in zip(bounds, bounds[1:]):
        d = p.feed(text[a:b])
        r.add(d)
        deltas.append(d)
    d = p.finish()
    r.add(d)
    return r, deltas + [d]


def test_a_full_message_splits_into_channels_and_typed_calls():
    r = parse(FULL, "think")
    assert (r.reasoning, r.content) == ("Think first.", "Let me look.")
    assert [(c["id"], c["function"]["name"]) for c in r.tool_calls] == [
        ("functions.get_weather:0", "get_weather"), ("functions.ping:1", "ping")]
    assert json.loads(r.tool_calls[0]["function"]["arguments"]) == {
        "city": 'Pa"ris\n\\', "days": 3, "o": {"u": [1, "c"]}}
    assert r.tool_calls[1]["function"]["arguments"] == "{}"


def test_deltas_name_each_call_once_then_stream_its_arguments():
    r, deltas = streamed(FULL, list(range(len(FULL))))          # one character at a time
    assert r == parse(FULL, "think")
    firsts = [tc for d in deltas for tc in d.tool_calls if "id" in tc]
    assert [(tc["index"], tc["function"]["name"]) for tc in firsts] == [(0, "get_weather"),
                                                                      (1, "ping")]
    pieces = [tc["function"]["arguments"] for d in deltas for tc in d.tool_calls
              if tc["index"] == 0 and tc["function"]["arguments"]]
    assert len(pieces) > 5                     # the string value streamed, not sent at the end
    assert all(d.reasoning or d.content or d.tool_calls or not d for d in deltas)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 10_000), max_size=12))
def test_any_split_sums_to_the_one_shot_parse(cuts):
    for text, start in ((FULL, "think"), (m("Hi <|open|>odd<|sep|> x<|close|>response<|sep|>"
                                            "tail <|open|>tools<|sep|>junk" + CALL), "response")):
        assert streamed(text, cuts, start=start)[0] == parse(text, start)


PIECES = [O, C, S, "think", "response", "tools", "call", "argument", "json", "message",
          ' tool="f"', ' index="1"', ' key="k"', ' type="string"', ' type="number"',
          ' type="object"', "hello", "{", "}", "12", " ", "\n", '"', "&quot;", "x" * 40]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=60), st.sampled_from(["think", "response"]),
       st.booleans(), st.lists(st.integers(0, 10_000), max_size=6))
def test_random_markup_never_raises_and_arguments_are_always_json(pieces, start, tools, cuts):
    text = "".join(pieces)
    r = parse(text, start, tools=tools)
    assert streamed(text, cuts, start=start, tools=tools)[0] == r
    for tc in r.tool_calls:
        assert isinstance(json.loads(tc["function"]["arguments"]), dict)
        assert tc["function"]["name"]
    for s in (r.reasoning, r.content):
        assert not {O, C, S} & set(s)          # markers reach the client spelled out, if at all
    assert tools or not r.tool_calls


@pytest.mark.parametrize("text, start, tools, want", [
    # unknown element at message level and inside a channel: literal
    ('<|close|>response<|sep|><|open|>foo<|sep|>bar<|close|>foo<|sep|>', "response", True,
     ("", "<|open|>foo<|sep|>bar<|close|>foo<|sep|>", 0)),
    ('a<|open|>x y<|sep|>b', "think", True, ("a<|open|>x y<|sep|>b", "", 0)),
    # a response opened without closing think: think ends there
    ('r<|open|>response<|sep|>c', "think", True, ("r", "c", 0)),
    # text between calls and a call without a tool name: content, the good call survives
    ('<|close|>response<|sep|><|open|>tools<|sep|>stray<|open|>call index="1"<|sep|>'
     + CALL + '<|close|>tools<|sep|>', "response", True,
     ("", 'stray<|open|>call index="1"<|sep|>', 1)),
    # tools not enabled for this request: the channel is plain content
    ('ok<|close|>response<|sep|><|open|>tools<|sep|>' + CALL, "response", False,
     ("", "ok<|open|>tools<|sep|>" + CALL, 0)),
    # a dangling tag at the end and a stray sep
    ('x<|sep|>y<|open|>respo', "response", True, ("", "x<|sep|>y<|open|>respo", 0)),
])
def test_malformed_markup_degrades_to_content(text, start, tools, want):
    r = parse(m(text), start, tools=tools)
    assert (r.reasoning, r.content, len(r.tool_calls)) == want


def test_truncated_and_odd_arguments_still_make_a_json_object():
    t = m('<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
          '<|open|>argument key="n" type="number"<|sep|>not json<|close|>argument<|sep|>'
          '<|open|>argument key="s" type="string"<|sep|>cut he')
    r = parse(t, "response")
    assert json.loads(r.tool_calls[0]["function"]["arguments"]) == {"n": "not json",
                                                                    "s": "cut he"}
    whole = parse(m('<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
                    '<|open|>json type="object"<|sep|>{"a": 1}<|close|>json<|sep|>'
                    '<|close|>call<|sep|>'), "response")
    assert json.loads(whole.tool_calls[0]["function"]["arguments"]) == {"a": 1}


def test_a_forced_call_starts_inside_the_named_call():
    r = parse(m('<|open|>argument key="city" type="string"<|sep|>Rome<|close|>argument<|sep|>'
                '<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>'),
              "call", function="get_weather")
    assert [c["function"]["name"] for c in r.tool_calls] == ["get_weather"]
    assert json.loads(r.tool_calls[0]["function"]["arguments"]) == {"city": "Rome"}
    assert (r.reasoning, r.content) == ("", "")


def test_literal_spells_markers_out():
    assert literal(m("<|open|>a<|sep|>")) == "<|open|>a<|sep|>"
