"""Kimi K3's chat format (XTML): OpenAI-style messages + tools -> prompt token ids.

K3 ships no Jinja template; its tokenizer renders conversations in Python. XTML elements are
opened by the special token <|open|>, carry a header (a tag name and `key="value"` attributes,
values escaped `&` -> `&amp;`, `"` -> `&quot;`), end their header with <|sep|> and close with
<|close|>NAME<|sep|>; every top-level message ends with <|end_of_msg|>. Writing
MSG(attrs, body) for <|open|>message attrs<|sep|>body<|close|>message<|sep|><|end_of_msg|>
and OPEN(x) / CLOSE(x) for <|open|>x<|sep|> / <|close|>x<|sep|>, a prompt reads, in order:

  MSG(role="system" type="tool-declare", "# Tools … ```json\n[TOOLS]\n```")
        with tools: the tool objects as compact, key-sorted JSON
  MSG(role="system" type="thinking-effort", "… `thinking_effort=max`.")      thinking on
  MSG(role="user", TEXT)                            system and user alike; name="…" if given
  MSG(role="assistant", [OPEN(think) R CLOSE(think)] OPEN(response) C CLOSE(response) [CALLS])
        the think channel, even empty, only with thinking on
  MSG(role="tool" tool="NAME" index="I", RESULT)
  MSG(role="system" type="tool-choice", …)         tool_choice required, none, or a function
  <|open|>message role="assistant"<|sep|>OPEN(think)          (generation; thinking off:
                                                                OPEN(response))

CALLS = OPEN(tools) OPEN(call tool="N" index="1") OPEN(argument key="K" type="T") V
        CLOSE(argument) … CLOSE(call) … CLOSE(tools)
with T the JSON type of the value (string values raw, the others as JSON; integer -> number) and
index counting the message's calls from 1; arguments that are not a JSON object keep their text
in <|open|>json type="object"<|sep|>…<|close|>json<|sep|>. Tool results are matched to the
preceding assistant's calls by tool_call_id (then reordered to the calls' order) and take
their tool name and index from the call.

tool_choice "required" and "none" are K3's control messages only (no grammar constrains the
output). A named tool_choice gets the "required" message and is forced by the generation
prefix: the assistant message is opened up to the start of that call (an empty think channel
first when thinking is on), so the model writes only its arguments. `ChatPrompt.start` says where the prefix leaves the model, for the output
parser (engine/k3_channels.py).

Text from the request (content, names, arguments) is always encoded as ordinary text: a user
writing "<|open|>" cannot open an element.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

from raydecode.models.bpe import TokenizerError

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
MARKUP_TOKENS = (OPEN, CLOSE, SEP, END_OF_MSG)
# Output text of a chat request carries the structural tokens as these characters (lone
# surrogates: no UTF-8 decoding ever yields one, so model-written text cannot forge them);
# `Tokenizer.decode(markers=True)` writes them, engine/k3_channels.py reads them.
MARKS = {OPEN: "\udc00", CLOSE: "\udc01", SEP: "\udc02"}
THINKING_EFFORTS = ("low", "high", "max")
DEFAULT_THINKING_EFFORT = "max"
TOOL_CHOICES = ("auto", "none", "required", "function")

_TOOL_DECLARE = ("# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
                 "{tools}\n```")
_THINKING_EFFORT = ("`thinking_effort` guides on how much to think in your thinking channel (not "
                    "including the response channel), supported values include `low`, `medium`, "
                    "`high`, and `max`.\nNow the system is invoked with "
                    "`thinking_effort={effort}`.")
_TOOL_CHOICE = {
    "required": "The system is invoked with `tool_choice=required`.\n"
                "You MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\n"
            "You MUST NOT call any tools in the next message.",
}


class ChatFormatError(TokenizerError):
    """A conversation that cannot be rendered; `param` names the request field (e.g.
    'messages[2].tool_call_id')."""

    def __init__(self, message: str, param: str = "messages"):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatOptions:
    thinking: bool = True
    thinking_effort: str = DEFAULT_THINKING_EFFORT
    tool_choice: str = "auto"          # auto | none | required | function
    function: str | None = None        # the forced call's name when tool_choice == "function"

    def __post_init__(self) -> None:
        if self.thinking_effort not in THINKING_EFFORTS:
            raise ChatFormatError(f"thinking_effort = {self.thinking_effort!r}; accepted: "
                                  f"{', '.join(THINKING_EFFORTS)}",
                                  "chat_template_kwargs.thinking_effort")
        if self.tool_choice not in TOOL_CHOICES:
            raise ChatFormatError(f"tool_choice = {self.tool_choice!r}; accepted: "
                                  f"{', '.join(TOOL_CHOICES)}", "tool_choice")
        if (self.tool_choice == "function") != bool(self.function):
            raise ChatFormatError("a named tool_choice needs the function's name (and only it "
                                  "does)", "tool_choice")


@dataclass(frozen=True)
class ChatPrompt:
    ids: list[int]
    start: str                  # where generation begins: "think" | "response" | "call"
    function: str | None = None  # start == "call": the forced call's tool name (index 1)


# ---- segments: (text, is_markup) ------------------------------------------------------------
Segments = list[tuple[str, bool]]


def _attr(value) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def _open(out: Segments, tag: str, **attrs) -> None:
    out.append((OPEN, True))
    out.append((tag + "".join(f' {k}="{_attr(v)}"' for k, v in attrs.items()), False))
    out.append((SEP, True))


def _close(out: Segments, tag: str) -> None:
    out += [(CLOSE, True), (tag, False), (SEP, True)]


def _text(out: Segments, text: str) -> None:
    if text:
        out.append((text, False))


def _message(out: Segments, attrs: dict, body: Segments) -> None:
    _open(out, "message", **attrs)
    out += body
    _close(out, "message")
    out.append((END_OF_MSG, True))


def _json(value, compact: bool = False) -> str:
    if compact:
        return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return json.dumps(value, ensure_ascii=False)


def xtml_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def _content(m: dict, i: int) -> str:
    c = m.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for p in c:
            if not (isinstance(p, dict) and p.get("type") == "text"
                    and isinstance(p.get("text"), str)):
                raise ChatFormatError(f"messages[{i}].content part {p!r}: only "
                                      "{'type': 'text', 'text': str} parts are supported",
                                      f"messages[{i}].content")
            parts.append(p["text"])
        return "".join(parts)
    raise ChatFormatError(f"messages[{i}].content = {c!r}; expected a string or a list of "
                          "text parts", f"messages[{i}].content")


def _tool_calls(out: Segments, calls: Sequence[dict], i: int) -> None:
    _open(out, "tools")
    for n, call in enumerate(calls, start=1):
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise ChatFormatError(f"messages[{i}].tool_calls[{n - 1}]: expected "
                                  "{'function': {'name': str, 'arguments': str}}",
                                  f"messages[{i}].tool_calls")
        _open(out, "call", tool=name, index=n)
        args = fn.get("arguments")
        raw = args if isinstance(args, str) else None
        if raw is not None:
            try:
                args = json.loads(raw) if raw.strip() else {}
            except json.JSONDecodeError:
                args = None
        if isinstance(args, dict):
            for k, v in args.items():
                _open(out, "argument", key=k, type=xtml_type(v))
                _text(out, v if isinstance(v, str) else _json(v))
                _close(out, "argument")
        elif args is not None or raw is not None:
            # not a JSON object: its text as it came
            _open(out, "json", type="object")
            _text(out, raw if raw is not None else _json(args))
            _close(out, "json")
        _close(out, "call")
    _close(out, "tools")


def _tool_targets(messages: Sequence[dict]) -> list[tuple[str, int] | None]:
    """Per message: (tool name, index) for tool results, None for the others. A run of tool
    messages after an assistant message with tool_calls is matched by tool_call_id (or the
    alias 'NAME:POSITION'); if every one matches, the run is reordered to the calls' order
    (`_order`), else each takes its own `name` or the positional call's name."""
    out: list[tuple[str, int] | None] = [None] * len(messages)
    calls: list[dict] = []
    i = 0
    while i < len(messages):
        m = messages[i]
        if m.get("role") == "assistant":
            calls = list(m.get("tool_calls") or [])
        if m.get("role") != "tool":
            i += 1
            continue
        j = i
        while j < len(messages) and messages[j].get("role") == "tool":
            j += 1
        by_id: dict[str, tuple[str, int]] = {}
        for pos, c in enumerate(calls):
            name = (c.get("function") or {}).get("name")
            if isinstance(name, str) and name:
                if c.get("id"):
                    by_id.setdefault(str(c["id"]), (name, pos + 1))
                by_id.setdefault(f"{name}:{pos}", (name, pos + 1))
        hits = [by_id.get(str(messages[k].get("tool_call_id"))) for k in range(i, j)]
        for k in range(i, j):
            hit = hits[k - i] if all(hits) else None
            if hit is None:
                pos = k - i
                name = messages[k].get("name") or (
                    (calls[pos].get("function") or {}).get("name") if pos < len(calls) else None)
                if not name:
                    raise ChatFormatError(
                        f"messages[{k}]: a tool message needs a tool_call_id naming one of the "
                        "preceding assistant message's tool_calls, or a name",
                        f"messages[{k}].tool_call_id")
                hit = (name, pos + 1)
            out[k] = hit
        calls = []
        i = j
    return out


def _order(messages: Sequence[dict], targets: list) -> list[int]:
    """Message order: each run of matched tool results sorted by its calls' index."""
    order, i = [], 0
    while i < len(messages):
        if targets[i] is None:
            order.append(i)
            i += 1
            continue
        j = i
        while j < len(messages) and targets[j] is not None:
            j += 1
        order += sorted(range(i, j), key=lambda k: targets[k][1])
        i = j
    return order


def render_segments(messages: Sequence[dict], tools: Sequence[dict] | None = None,
                    options: ChatOptions = ChatOptions(),
                    add_generation_prompt: bool = True) -> tuple[Segments, ChatPrompt]:
    """The prompt as (text, is_markup) segments, and where generation starts (ids empty)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatFormatError("messages must be a non-empty list of {'role', 'content'}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise ChatFormatError(f"messages[{i}] = {m!r}; role must be one of assistant, "
                                  "system, tool, user", f"messages[{i}].role")
    out: Segments = []
    if tools:
        _message(out, {"role": "system", "type": "tool-declare"},
                 [(_TOOL_DECLARE.format(tools=_json(list(tools), compact=True)), False)])
    if options.thinking:
        _message(out, {"role": "system", "type": "thinking-effort"},
                 [(_THINKING_EFFORT.format(effort=options.thinking_effort), False)])
    targets = _tool_targets(messages)
    for i in _order(messages, targets):
        m = messages[i]
        role, body = m["role"], []
        attrs = {"role": role}
        if role == "tool":
            attrs["tool"], attrs["index"] = targets[i]
        elif m.get("name"):
            attrs["name"] = m["name"]
        if role == "assistant":
            if options.thinking:
                _open(body, "think")
                _text(body, m.get("reasoning_content") or "")
                _close(body, "think")
            _open(body, "response")
            _text(body, _content(m, i))
            _close(body, "response")
            if m.get("tool_calls"):
                _tool_calls(body, m["tool_calls"], i)
        else:
            _text(body, _content(m, i))
        _message(out, attrs, body)
    choice = "required" if options.tool_choice == "function" else options.tool_choice
    if tools and choice in _TOOL_CHOICE:
        _message(out, {"role": "system", "type": "tool-choice"}, [(_TOOL_CHOICE[choice], False)])
    start, function = ("think" if options.thinking else "response"), None
    if add_generation_prompt:
        _open(out, "message", role="assistant")
        if options.tool_choice == "function":
            if options.thinking:
                _open(out, "think")
                _close(out, "think")
            _open(out, "response")
            _close(out, "response")
            _open(out, "tools")
            _open(out, "call", tool=options.function, index=1)
            start, function = "call", options.function
        else:
            _open(out, start)
    return out, ChatPrompt([], start, function)


def render(tokenizer, messages: Sequence[dict], tools: Sequence[dict] | None = None,
           options: ChatOptions = ChatOptions(), add_generation_prompt: bool = True) -> ChatPrompt:
    """Prompt ids: markup segments as their special ids, runs of text encoded as ordinary text
    (never as specials)."""
    segs, prompt = render_segments(messages, tools, options, add_generation_prompt)
    sp = tokenizer.special_tokens
    missing = [t for t in MARKUP_TOKENS if t not in sp]
    if missing:
        raise ChatFormatError(f"the tokenizer lacks K3's XTML special tokens {missing}")
    ids: list[int] = []
    text: list[str] = []
    for s, markup in segs:
        if markup:
            if text:
                ids += tokenizer.encode("".join(text), allow_special=False)
                text.clear()
            ids.append(sp[s])
        else:
            text.append(s)
    if text:
        ids += tokenizer.encode("".join(text), allow_special=False)
    return ChatPrompt(ids, prompt.start, prompt.function)


def segments_text(segs: Segments) -> str:
    """The rendered prompt as one string (markup tokens spelled out): for tests and logs."""
    return "".join(s for s, _ in segs)
