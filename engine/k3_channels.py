"""K3's output channels -> OpenAI `reasoning_content`, `content` and `tool_calls` deltas.

The parser reads an assistant message as the engine detokenizes it for a chat request: text
with K3's structural tokens as the characters of `k3_chat.MARKS` (O = <|open|>, C = <|close|>,
S = <|sep|>), fed in arbitrary pieces. The message it expects (engine/k3_chat.py):

    [O think S REASONING C think S] O response S CONTENT C response S
    [O tools S (O call tool="N" index="I" S (O argument key="K" type="T" S VALUE C argument S)*
                C call S)+ C tools S] C message S

beginning where the prompt's generation prefix left off (`start`: inside think, inside
response, or inside a forced call). State: a stack of open elements,

    message -> think | response | tools -> call -> argument | json     (+ "other": unknown)

and a pending tag (the text after an O or C until its S). A delta is emitted as soon as what it
says is certain: reasoning and content text at once; a call's id and name when its header is
complete; its arguments as a JSON object built from the typed XTML arguments — '{"K": ' when an
argument opens, a string value's text JSON-escaped as it streams, any other value once its
close marker has come (JSON-decoded, or kept as a string if it does not parse), '}' when the
call closes. The concatenated deltas are the same however the text is split (`feed` is
chunking-invariant), so a stream reassembles exactly to the one-shot answer.

Malformed output never raises: markup that does not fit where it appears (an unknown element,
a call without a tool name, text between calls, a tools channel the request did not enable)
becomes literal content (markers spelled out), an element left open by a truncated output is
closed (a call's arguments are always a complete JSON object), and a misplaced channel open
closes the channel before it.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from .k3_chat import CLOSE, MARKS, OPEN, SEP

O, C, S = MARKS[OPEN], MARKS[CLOSE], MARKS[SEP]
_LITERAL = {O: OPEN, C: CLOSE, S: SEP}
_SPLIT = re.compile(f"([{O}{C}{S}])")
_ATTR = re.compile(r'([\w-]+)="([^"]*)"')
MAX_TAG_CHARS = 512          # a longer O/C header is not markup: it becomes text
_CHANNELS = ("think", "response")


def literal(text: str) -> str:
    """`text` with marker characters spelled as their tokens (what a client may see)."""
    for mark, tok in _LITERAL.items():
        text = text.replace(mark, tok)
    return text


def _unescape(v: str) -> str:
    return v.replace("&quot;", '"').replace("&amp;", "&")


def _header(h: str) -> tuple[str, dict[str, str]]:
    name, _, rest = h.strip().partition(" ")
    return name, {k: _unescape(v) for k, v in _ATTR.findall(rest)}


@dataclass
class ChannelDelta:
    reasoning: str = ""
    content: str = ""
    # OpenAI delta.tool_calls entries: {"index", ["id", "type",] "function": {["name",]
    # "arguments"}}; the first entry of a call carries its id, type and name
    tool_calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def extend(self, d: "ChannelDelta") -> "ChannelDelta":
        """`d` appended (a call's pieces merged into its last entry)."""
        self.reasoning += d.reasoning
        self.content += d.content
        for tc in d.tool_calls:
            last = self.tool_calls[-1] if self.tool_calls else None
            if last is not None and last["index"] == tc["index"] and "id" not in tc:
                last["function"]["arguments"] += tc["function"]["arguments"]
            else:
                self.tool_calls.append(tc)
        return self


@dataclass
class _El:
    tag: str
    kind: str                   # message think response tools call argument json other
    key: str = ""               # argument: its key; call: its tool name
    type: str = "string"        # argument: XTML type
    buf: str = ""               # argument (non-string) / json: the raw value so far
    index: int = -1             # call: its index in the response's tool_calls
    n_args: int = 0             # call: arguments emitted
    done: bool = False          # call: its arguments are complete (a json element)


class ChannelParser:
    def __init__(self, start: str = "think", function: str | None = None, tools: bool = True):
        if start not in ("think", "response", "call"):
            raise ValueError(f"start = {start!r}; expected think, response or call")
        self.tools = tools
        self._stack = [_El("message", "message")]
        self._tag: str | None = None            # pending markup: mark + header so far
        self._gap = ""                          # whitespace held between elements
        self._d = ChannelDelta()
        self.n_calls = 0
        if start == "call":
            if not function:
                raise ValueError("start = 'call' needs the forced function's name")
            self._stack.append(_El("tools", "tools"))
            self._start_call(function)
        else:
            self._stack.append(_El(start, start))

    # ---- input -------------------------------------------------------------------------------
    def feed(self, text: str) -> ChannelDelta:
        for piece in _SPLIT.split(text):
            if not piece:
                continue
            if piece in (O, C):
                if self._tag is not None:
                    self._emit_text(literal(self._tag))      # an unfinished tag is text
                self._tag = piece
            elif piece == S:
                if self._tag is None:
                    self._emit_text(SEP)
                else:
                    tag, self._tag = self._tag, None
                    (self._open if tag[0] == O else self._close)(tag[1:], tag)
            elif self._tag is not None:
                self._tag += piece
                if len(self._tag) > MAX_TAG_CHARS:
                    tag, self._tag = self._tag, None
                    self._emit_text(literal(tag))
            else:
                self._emit_text(piece)
        return self._take()

    def finish(self) -> ChannelDelta:
        """End of output: a pending tag becomes text, open elements are closed."""
        if self._tag is not None:
            tag, self._tag = self._tag, None
            self._emit_text(literal(tag))
        while len(self._stack) > 1:
            self._end(self._stack.pop())
        return self._take()

    # ---- structure ---------------------------------------------------------------------------
    @property
    def _top(self) -> _El:
        return self._stack[-1]

    def _open(self, header: str, raw: str) -> None:
        name, attrs = _header(header)
        top = self._top
        if top.kind in ("argument", "json"):                  # a missing argument close
            self._end(self._stack.pop())
            top = self._top
        if top.kind in _CHANNELS:
            if name in _CHANNELS or (name == "tools" and self.tools):
                self._end(self._stack.pop())                  # a missing channel close
                top = self._top
            else:
                self._emit_text(literal(raw + S))
                return
        self._gap = ""
        if top.kind == "message":
            if name in _CHANNELS or (name == "tools" and self.tools):
                self._stack.append(_El(name, name))
                return
        elif top.kind == "tools":
            if name == "call" and attrs.get("tool"):
                self._start_call(attrs["tool"])
                return
        elif top.kind == "call":
            if name == "argument" and "key" in attrs and not top.done:
                self._start_argument(top, attrs["key"], attrs.get("type", "string"))
                return
            if name == "json" and top.n_args == 0 and not top.done:
                self._stack.append(_El("json", "json"))
                return
        elif top.kind == "end":
            self._emit_text(literal(raw + S))
            return
        # markup that does not belong here: literal content; an unknown element at message
        # level (or inside one) is tracked so its close is literal too
        self._d.content += literal(raw + S)
        if top.kind in ("message", "other"):
            self._stack.append(_El(name, "other"))

    def _close(self, name: str, raw: str) -> None:
        name = name.strip()
        k = next((i for i in range(len(self._stack) - 1, -1, -1)
                  if name and self._stack[i].tag == name), None)
        if k is None:
            self._emit_text(literal(raw + S))
            return
        self._gap = ""
        if self._stack[k].kind == "other":              # its close is as literal as its open
            self._d.content += literal(raw + S)
        while len(self._stack) > k:
            self._end(self._stack.pop())
        if name == "message":
            self._stack.append(_El("", "end"))

    def _start_call(self, name: str) -> None:
        el = _El("call", "call", key=name, index=self.n_calls)
        self.n_calls += 1
        self._stack.append(el)
        self._d.tool_calls.append({"index": el.index, "id": f"functions.{name}:{el.index}",
                                   "type": "function",
                                   "function": {"name": name, "arguments": ""}})

    def _start_argument(self, call: _El, key: str, type_: str) -> None:
        head = ("{" if call.n_args == 0 else ", ") + json.dumps(key, ensure_ascii=False) + ": "
        call.n_args += 1
        self._args(call, head + ('"' if type_ == "string" else ""))
        self._stack.append(_El("argument", "argument", key=key, type=type_))

    def _end(self, el: _El) -> None:
        """Close `el` (popped): what its JSON still needs."""
        call = self._top if self._stack else None
        if el.kind == "argument":
            if el.type == "string":
                self._args(call, '"')
            else:
                try:
                    value = json.loads(el.buf)
                except json.JSONDecodeError:
                    value = el.buf                      # not JSON: kept as its text
                self._args(call, json.dumps(value, ensure_ascii=False))
        elif el.kind == "json":
            try:
                value = json.loads(el.buf)
            except json.JSONDecodeError:
                value = None
            if isinstance(value, dict):
                self._args(call, json.dumps(value, ensure_ascii=False))
                call.done = True
            else:
                self._d.content += el.buf               # not a JSON object: plain content
        elif el.kind == "call":
            if not el.done:
                self._args(el, "}" if el.n_args else "{}")

    # ---- output ------------------------------------------------------------------------------
    def _emit_text(self, text: str) -> None:
        top = self._top
        if top.kind == "think":
            self._d.reasoning += text
        elif top.kind == "response" or top.kind == "other":
            self._d.content += text
        elif top.kind == "argument":
            if top.type == "string":
                self._args(self._stack[-2], json.dumps(text, ensure_ascii=False)[1:-1])
            else:
                top.buf += text
        elif top.kind == "json":
            top.buf += text
        else:                   # between elements (message, tools, call, end): whitespace drops
            kept = text.rstrip()
            if kept:
                self._d.content += self._gap + kept
                self._gap = text[len(kept):]
            else:
                self._gap += text

    def _args(self, call: _El, piece: str) -> None:
        if not piece:
            return
        last = self._d.tool_calls[-1] if self._d.tool_calls else None
        if last is not None and last["index"] == call.index:
            last["function"]["arguments"] += piece
        else:
            self._d.tool_calls.append({"index": call.index, "function": {"arguments": piece}})

    def _take(self) -> ChannelDelta:
        d, self._d = self._d, ChannelDelta()
        return d


@dataclass
class ChannelResult:
    """Deltas summed: what a non-streamed response carries."""
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)   # {"id", "type", "function"}

    def add(self, d: ChannelDelta) -> None:
        self.reasoning += d.reasoning
        self.content += d.content
        for tc in d.tool_calls:
            i = tc["index"]
            if i == len(self.tool_calls):
                self.tool_calls.append({"id": tc["id"], "type": "function",
                                        "function": {"name": tc["function"]["name"],
                                                     "arguments": ""}})
            self.tool_calls[i]["function"]["arguments"] += tc["function"]["arguments"]


def parse(text: str, start: str = "think", function: str | None = None,
          tools: bool = True) -> ChannelResult:
    """The whole output at once."""
    p, r = ChannelParser(start, function, tools), ChannelResult()
    r.add(p.feed(text))
    r.add(p.finish())
    return r
