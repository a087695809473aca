"""OpenAI API shapes: request models (strict types: a wrong type is a 400, never a coercion),
response and stream-chunk bodies, SSE framing and the error body
`{"error": {"message", "type", "param", "code"}}`.

vLLM's extensions that the stock pool protocol needs are accepted too: `top_k`, `ignore_eos`,
`stop_token_ids`, `return_token_ids` (choices then carry the generated `token_ids`; in a stream
each chunk carries its delta ids).
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class APIError(Exception):
    """An error answered with the OpenAI error body and `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unavailable(message: str, retry_after_s: int = 5) -> APIError:
    return APIError(503, message, "server_error", None, "service_unavailable",
                    {"Retry-After": str(retry_after_s)})


# ---- requests -------------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Common(_Body):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    # torch generators take 64-bit seeds; a wider one would fail the whole batch's step
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False

    def unsupported(self) -> list[str]:
        """Names of set parameters this server does not implement (answered with a 400)."""
        out = [k for k in ("presence_penalty", "frequency_penalty") if getattr(self, k)]
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        return super().unsupported() + [k for k in ("echo", "logprobs", "suffix")
                                        if getattr(self, k)]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    tools: list[dict] | None = None

    def unsupported(self) -> list[str]:
        return super().unsupported() + [k for k in ("logprobs", "tools") if getattr(self, k)]

    def missing_content(self) -> tuple[int, str] | None:
        """(index, role) of the first message that needs content and has none: only an
        assistant message may omit it (OpenAI: one carrying tool calls)."""
        for i, m in enumerate(self.messages):
            if m.content is None and m.role != "assistant":
                return i, m.role
        return None


def parse_request(cls: type[_Common], raw: bytes) -> _Common:
    """Raw body → request model; malformed JSON or a wrong field → APIError 400."""
    try:
        return cls.model_validate_json(raw or b"")
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            raise bad_request(f"We could not parse the JSON body of your request ({err['msg']}); "
                              "expected a JSON object.", code="invalid_json") from None
        if not err["loc"]:
            raise bad_request(f"The request body must be a JSON object ({err['msg']}).") from None
        param = str(err["loc"][0])
        where = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("list[", "str")))
        got = "" if err["type"] == "missing" else f"; got {json.dumps(err.get('input'))[:80]}"
        raise bad_request(f"Invalid value for '{where}': {err['msg']}{got}.", param=param,
                          code="missing_required_parameter" if err["type"] == "missing"
                          else "invalid_type") from None


# ---- responses --------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _base(rid: str, obj: str, model: str, created: int | None) -> dict:
    return {"id": rid, "object": obj, "created": created or int(time.time()), "model": model}


def completion_body(rid: str, model: str, text: str, finish: str | None, use: dict,
                    token_ids: list[int] | None = None, created: int | None = None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {**_base(rid, "text_completion", model, created), "choices": [choice], "usage": use}


def completion_chunk(rid: str, model: str, created: int, text: str, finish: str | None,
                     token_ids: list[int] | None = None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {**_base(rid, "text_completion", model, created), "choices": [choice]}


def chat_body(rid: str, model: str, text: str, finish: str | None, use: dict,
              token_ids: list[int] | None = None, created: int | None = None) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": text},
              "logprobs": None, "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {**_base(rid, "chat.completion", model, created), "choices": [choice], "usage": use}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish: str | None,
               token_ids: list[int] | None = None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {**_base(rid, "chat.completion.chunk", model, created), "choices": [choice]}


def usage_chunk(rid: str, obj: str, model: str, created: int, use: dict) -> dict:
    return {**_base(rid, obj, model, created), "choices": [], "usage": use}


def models_body(name: str, max_model_len: int, created: int) -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                        "owned_by": "raydecode", "max_model_len": max_model_len}]}


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
