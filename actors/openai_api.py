"""OpenAI API shapes: request models (strict types: a wrong type is a 400, never a coercion),
response and stream-chunk bodies, SSE framing and the error body
`{"error": {"message", "type", "param", "code"}}`.

vLLM's extensions that the stock pool protocol needs are accepted too: `top_k`, `ignore_eos`,
`stop_token_ids`, `return_token_ids` (choices then carry the generated `token_ids`; in a stream
each chunk carries its delta ids); and vLLM's `chat_template_kwargs` (K3: `thinking` /
`enable_thinking`, `thinking_effort`) and `reasoning_content` on assistant messages and deltas.

Chat requests carry `tools` (function tools whose `parameters` must be a valid JSON Schema of an
object), `tool_choice` and assistant `tool_calls` / `tool` results; both endpoints take
`logprobs` (completions: the number of alternatives; chat: `logprobs` + `top_logprobs`).
"""
from __future__ import annotations

import json
import re
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from raydecode.engine.k3_chat import THINKING_EFFORTS, ChatOptions
from raydecode.engine.request import MAX_LOGPROBS


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
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        return super().unsupported() + [k for k in ("echo", "suffix") if getattr(self, k)]

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None = off, n = the sampled token + the top n."""
        return self.logprobs


class TextPart(_Body):
    type: Literal["text"]
    text: str


FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


class FunctionCall(_Body):
    name: str
    arguments: str | dict = ""          # a JSON string (OpenAI); an object is taken too


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None       # assistant
    tool_call_id: str | None = None                # tool
    reasoning_content: str | None = None           # assistant (vLLM; `reasoning` as alias)
    reasoning: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def to_template(self) -> dict:
        """The message as engine/k3_chat.py reads it (developer is system)."""
        m = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name:
            m["name"] = self.name
        if self.role == "assistant":
            m["reasoning_content"] = self.reasoning_content or self.reasoning or ""
            if self.tool_calls:
                m["tool_calls"] = [tc.model_dump() for tc in self.tool_calls]
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        return m


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not FUNCTION_NAME.match(v):
            raise ValueError(f"function name {v[:80]!r} must be 1-64 characters of a-z, A-Z, "
                             "0-9, '_', '.', ':' and '-'")
        return v

    @field_validator("parameters")
    @classmethod
    def _schema(cls, v: dict | None) -> dict | None:
        if v is not None:
            check_parameters_schema(v)
        return v


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


def check_parameters_schema(schema: dict) -> None:
    """A function's `parameters`: a valid JSON Schema (its draft's meta-schema; 2020-12 when
    it names none) describing a JSON object, as the arguments of a call are."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator) \
            .check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path)
        raise ValueError(f"not a valid JSON Schema: at 'parameters{where}': "
                         f"{e.message[:200]}") from None
    t = schema.get("type")
    if t is not None and t != "object" and not (isinstance(t, list) and "object" in t):
        raise ValueError(f"type = {json.dumps(t)[:40]}; the parameters of a function describe "
                         "its arguments, a JSON object: expected type 'object'")


CHAT_TEMPLATE_KWARGS = ("thinking", "enable_thinking", "thinking_effort")


def chat_options(kwargs: dict | None, defaults: dict | None = None,
                 reasoning_effort: str | None = None) -> tuple[bool, str]:
    """(thinking, thinking_effort) from `chat_template_kwargs` over the deployment's defaults
    (request values win); `reasoning_effort` 'none' turns thinking off, else sets the effort."""
    merged = {**(defaults or {}), **(kwargs or {})}
    for k, v in merged.items():
        where = "chat_template_kwargs" if k in (kwargs or {}) else "default_chat_template_kwargs"
        if k not in CHAT_TEMPLATE_KWARGS:
            raise bad_request(f"'{where}.{k}' is not supported; accepted keys: "
                              f"{', '.join(CHAT_TEMPLATE_KWARGS)}", f"{where}.{k}")
        if k in ("thinking", "enable_thinking") and not isinstance(v, bool):
            raise bad_request(f"'{where}.{k}' = {json.dumps(v)[:40]}; expected true or false",
                              f"{where}.{k}")
        if k == "thinking_effort" and v not in THINKING_EFFORTS:
            raise bad_request(f"'{where}.{k}' = {json.dumps(v)[:40]}; accepted: "
                              f"{', '.join(THINKING_EFFORTS)}", f"{where}.{k}")
    thinking = merged.get("thinking", merged.get("enable_thinking", True))
    effort = merged.get("thinking_effort", ChatOptions.thinking_effort)
    if reasoning_effort is not None:
        if reasoning_effort == "none":
            thinking = False
        elif reasoning_effort in THINKING_EFFORTS:
            effort = reasoning_effort
        else:
            raise bad_request(f"reasoning_effort = {json.dumps(reasoning_effort)[:40]}; "
                              f"accepted: none, {', '.join(THINKING_EFFORTS)}",
                              "reasoning_effort")
    return thinking, effort


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    chat_template_kwargs: dict | None = None
    reasoning_effort: str | None = None

    @property
    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs = true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat_options(self, defaults: dict | None = None) -> ChatOptions:
        """K3's rendering options; tool_choice checked against the declared tools."""
        thinking, effort = chat_options(self.chat_template_kwargs, defaults,
                                        self.reasoning_effort)
        tools, tc = self.tools or [], self.tool_choice
        names = [t.function.name for t in tools]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise bad_request(f"tools declares the function {dup[0]!r} more than once", "tools")
        if isinstance(tc, NamedToolChoice):
            if tc.function.name not in names:
                raise bad_request(f"tool_choice names the function {tc.function.name!r}, which "
                                  f"is not among the tools ({', '.join(names) or 'none'})",
                                  "tool_choice")
            return ChatOptions(thinking, effort, "function", tc.function.name)
        if tc == "required" and not tools:
            raise bad_request("tool_choice = 'required' needs at least one tool in 'tools'",
                              "tool_choice")
        return ChatOptions(thinking, effort, tc or "auto")

    @property
    def tools_enabled(self) -> bool:
        """Whether the model's tools channel is read as tool calls (else it is content)."""
        return bool(self.tools) and self.tool_choice != "none"

    def template_tools(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def missing_content(self) -> tuple[int, str] | None:
        """(index, role) of the first message that needs content and has none: only an
        assistant message may omit it (OpenAI: one carrying tool calls)."""
        for i, m in enumerate(self.messages):
            if m.content is None and m.role != "assistant":
                return i, m.role
        return None


def _field_path(loc: tuple) -> str:
    """A pydantic error location as a request path, e.g. 'tools[0].function.parameters'
    (union-member tags such as 'str' or 'list[TextPart]' left out)."""
    out = ""
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif re.fullmatch(r"[a-z_][a-z0-9_]*", p) and p not in ("str", "int", "float", "bool",
                                                                 "dict", "list", "none"):
            out += f".{p}" if out else p
    return out


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
        where = _field_path(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        got = "" if err["type"] in ("missing", "value_error") else \
            f"; got {json.dumps(err.get('input'))[:80]}"
        raise bad_request(f"Invalid value for '{where}': {msg}{got}.", param=where,
                          code="missing_required_parameter" if err["type"] == "missing"
                          else "invalid_type" if err["type"] != "value_error"
                          else "invalid_value") from None


# ---- responses --------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """The usage object; cached_tokens (prompt tokens served from the prefix cache) as
    OpenAI's prompt_tokens_details.cached_tokens when given."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def _base(rid: str, obj: str, model: str, created: int | None) -> dict:
    return {"id": rid, "object": obj, "created": created or int(time.time()), "model": model}


def response_body(rid: str, obj: str, model: str, created: int | None, choice: dict,
                  use: dict, token_ids: list[int] | None = None) -> dict:
    """A whole response: `choice` is {"text" | "message", "logprobs", "finish_reason"}."""
    c = {"index": 0, **choice}
    if token_ids is not None:
        c["token_ids"] = token_ids
    return {**_base(rid, obj, model, created), "choices": [c], "usage": use}


def chunk_body(rid: str, obj: str, model: str, created: int, choice: dict,
               token_ids: list[int] | None = None) -> dict:
    """One stream chunk: `choice` is {"text" | "delta", "logprobs", "finish_reason"}."""
    c = {"index": 0, "logprobs": None, "finish_reason": None, **choice}
    if token_ids is not None:
        c["token_ids"] = token_ids
    return {**_base(rid, obj, model, created), "choices": [c]}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish: str | None,
               token_ids: list[int] | None = None) -> dict:
    return chunk_body(rid, "chat.completion.chunk", model, created,
                      {"delta": delta, "finish_reason": finish}, token_ids)


def usage_chunk(rid: str, obj: str, model: str, created: int, use: dict) -> dict:
    return {**_base(rid, obj, model, created), "choices": [], "usage": use}


def models_body(name: str, max_model_len: int, created: int) -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                        "owned_by": "raydecode", "max_model_len": max_model_len}]}


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
