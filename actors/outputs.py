"""One choice's output for the OpenAI routes: the engine's deltas (`StepOutput`) in, the
choice of a stream chunk or of the whole response out.

Chat: the text (detokenized with K3's structural tokens as marker characters) goes through
the channel parser (engine/k3_channels.py): `delta.reasoning_content`, `delta.content` and
`delta.tool_calls` per chunk; the non-streamed message is the sum of the same deltas, so a
stream reassembles exactly to it. A response that called tools and stopped finishes with
"tool_calls".

Logprobs (the engine's per-token (logprob, [(id, logprob) × n])) in OpenAI's shapes:
  chat         logprobs.content = [{token, logprob, bytes, top_logprobs: [{token, logprob,
               bytes}]}]
  completions  logprobs = {tokens, token_logprobs, top_logprobs: [{token: logprob}],
               text_offset}   (top_logprobs holds the top n and the sampled token)
A token is its text when its bytes are whole UTF-8, else "bytes:\\xNN…" (vLLM's form); a
special token is its name.
"""
from __future__ import annotations

import codecs

from raydecode.engine.engine import StepOutput
from raydecode.engine.k3_channels import ChannelDelta, ChannelParser, ChannelResult
from raydecode.engine.k3_chat import ChatPrompt


def token_text(tokenizer, tid: int) -> tuple[str, bytes]:
    b = tokenizer.decode_bytes([tid])
    try:
        return b.decode("utf-8"), b
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{x:02x}" for x in b), b


class ChoiceOutput:
    def __init__(self, chat: bool, tokenizer, logprobs: int | None = None,
                 prompt: ChatPrompt | None = None, tools: bool = False):
        self.chat, self.tok, self.n_logprobs = chat, tokenizer, logprobs
        self.parser = ChannelParser(prompt.start, prompt.function, tools) if chat else None
        self.result = ChannelResult()
        self.text: list[str] = []
        self.lp: dict | list | None = None
        if logprobs is not None:
            self.lp = [] if chat else {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                       "text_offset": []}
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0                 # completion text decoded so far (for text_offset)
        self._specials = set(tokenizer.special_tokens.values())
        self._closed = False            # the parser has seen the end

    # ---- per delta -------------------------------------------------------------------------
    def step(self, out: StepOutput) -> dict | None:
        """The stream choice for this delta (without index / token_ids), None if it carries
        nothing to send."""
        lp = self._logprobs(out)
        fin = self.finish_reason(out.finish_reason) if out.finished else None
        if not self.chat:
            self.text.append(out.delta_text)
            if not (out.delta_text or lp or fin):
                return None
            return {"text": out.delta_text, "logprobs": lp, "finish_reason": fin}
        d = self.parser.feed(out.delta_text)
        if out.finished:
            d.extend(self.parser.finish())
            self._closed = True
            fin = self.finish_reason(out.finish_reason)
        self.result.add(d)
        delta = _delta_body(d)
        if not (delta or lp or fin):
            return None
        return {"delta": delta, "logprobs": None if lp is None else {"content": lp},
                "finish_reason": fin}

    def finish_reason(self, reason: str | None) -> str | None:
        if self.chat and reason == "stop" and (self.parser.n_calls or self.result.tool_calls):
            return "tool_calls"
        return reason

    # ---- the whole response ----------------------------------------------------------------
    def choice(self, reason: str | None) -> dict:
        if not self.chat:
            return {"text": "".join(self.text), "logprobs": self.lp,
                    "finish_reason": reason}
        if not self._closed:
            self.result.add(self.parser.finish())
            self._closed = True
        r = self.result
        msg: dict = {"role": "assistant",
                     "content": r.content if r.content or not r.tool_calls else None}
        if r.reasoning:
            msg["reasoning_content"] = r.reasoning
        if r.tool_calls:
            msg["tool_calls"] = r.tool_calls
        return {"message": msg, "logprobs": None if self.lp is None else {"content": self.lp},
                "finish_reason": self.finish_reason(reason)}

    # ---- logprobs --------------------------------------------------------------------------
    def _logprobs(self, out: StepOutput):
        if self.n_logprobs is None or not out.logprobs:
            return None
        ids = out.new_token_ids
        if self.chat:
            entries = []
            for tid, (lp, tops) in zip(ids, out.logprobs):
                t, b = token_text(self.tok, tid)
                entries.append({"token": t, "logprob": lp, "bytes": list(b), "top_logprobs": [
                    {"token": tt, "logprob": tl, "bytes": list(tb)}
                    for tt, tb, tl in ((*token_text(self.tok, i), l) for i, l in tops)]})
            self.lp += entries
            return entries
        piece = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, (lp, tops) in zip(ids, out.logprobs):
            t, b = token_text(self.tok, tid)
            top = {token_text(self.tok, i)[0]: l for i, l in tops}
            top.setdefault(t, lp)
            piece["tokens"].append(t)
            piece["token_logprobs"].append(lp)
            piece["top_logprobs"].append(top)
            piece["text_offset"].append(self._chars)
            if tid not in self._specials:
                self._chars += len(self._utf8.decode(b))
        for k, v in piece.items():
            self.lp[k] += v
        return piece


def _delta_body(d: ChannelDelta) -> dict:
    out: dict = {}
    if d.reasoning:
        out["reasoning_content"] = d.reasoning
    if d.content:
        out["content"] = d.content
    if d.tool_calls:
        out["tool_calls"] = d.tool_calls
    return out
