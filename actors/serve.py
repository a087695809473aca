"""The OpenAI-compatible HTTP front of a replica.

`make_app(backend, ctx)` builds the FastAPI app over a backend that streams `StepOutput`s: the
Coordinator actor (`RayBackend`, under Ray Serve) or a `CoordinatorCore` in this process
(`LocalBackend`: a stock-only pool or a test replica served by uvicorn). `OpenAIServer` is the
Serve ingress deployment and `build_app(args)` its import path for `serve run` and KubeRay's
serveConfigV2: `raydecode.actors.serve:build_app` with `args: {config: path.yaml}` (or the
config's keys inline).
"""
from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Protocol

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from raydecode.engine.engine import StepOutput
from raydecode.engine.k3_chat import ChatFormatError, ChatPrompt
from raydecode.engine.request import RequestError, SamplingParams

from . import http_timeouts
from . import openai_api as oa
from .auth import APIKeys, resolve_api_keys
from .config import DeployConfig, check_speculative, load_deploy_config, parse_deploy_config
from .coordinator import CoordinatorCore, Overloaded, ReplicaExecutor, _model_config
from .metrics import CONTENT_TYPE, RequestMetrics
from .outputs import ChoiceOutput
from .stock_pool import StockPoolError

RETRY_AFTER_S = 5
MAX_N = 128                                # choices per request (OpenAI's bound)
WARNING_HEADER = "X-Raydecode-Warning"     # set on every completion in synthetic-acceptance mode
CLIENT_CLOSED = 499                        # nginx's status for a client that went away
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class Backend(Protocol):
    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 n: int = 1) -> AsyncIterator[StepOutput]: ...    # n > 1: outputs by .index

    def abort(self, request_id: str) -> None: ...          # non-blocking

    async def stats(self, detail: bool = False) -> dict: ...   # detail: the /metrics scrape

    async def wait_healthy(self, timeout_s: float) -> bool: ...


class LocalBackend:
    def __init__(self, core: CoordinatorCore):
        self.core = core

    def generate(self, request_id, prompt_ids, params, n=1):
        return self.core.generate(request_id, prompt_ids, params, n)

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)

    async def stats(self, detail: bool = False) -> dict:
        return self.core.stats(detail)

    async def wait_healthy(self, timeout_s: float) -> bool:
        return await self.core.wait_healthy(timeout_s)


class RayBackend:
    def __init__(self, actor):
        self.actor = actor

    async def generate(self, request_id, prompt_ids, params, n=1):
        async for ref in self.actor.generate.remote(request_id, prompt_ids, params, n):
            yield await ref

    def abort(self, request_id: str) -> None:
        self.actor.abort.remote(request_id)

    async def stats(self, detail: bool = False) -> dict:
        return await self.actor.stats.remote(detail)

    async def wait_healthy(self, timeout_s: float) -> bool:
        return await self.actor.wait_healthy.remote(timeout_s)


@dataclass(frozen=True)
class ServingContext:
    """What the HTTP layer needs to validate and tokenize requests."""
    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: object
    created: int
    warning: str | None = None      # synthetic acceptance: outputs are meaningless
    default_chat_template_kwargs: dict | None = None
    api_keys: APIKeys = APIKeys()   # none: the /v1 routes are open
    ops_separate: bool = False      # /health and /metrics on their own app (serve.metrics_port)
    speculative: bool = False       # DSpark replica: its verification steps report no logprobs
    request_timeout_s: float = 600.0   # a non-streaming request unfinished by then: 503

    @staticmethod
    def from_config(cfg: DeployConfig) -> "ServingContext":
        from raydecode.engine.loader import load_tokenizer
        mcfg = _model_config(cfg.model)
        return ServingContext(cfg.model_name, cfg.resolved_max_model_len(
            mcfg.max_position_embeddings), mcfg.vocab_size, load_tokenizer(cfg.model),
            int(time.time()), cfg.synthetic_warning, cfg.default_chat_template_kwargs,
            resolve_api_keys(cfg.serve), cfg.serve.metrics_port is not None,
            cfg.speculative_config is not None, cfg.serve.request_timeout_s)


# ---- request → (prompt ids, sampling params) -----------------------------------------------
def _chat_prompt(req: oa.ChatCompletionRequest, ctx: ServingContext) -> ChatPrompt:
    """The chat request in K3's format (engine/k3_chat.py): tools, tool_choice, thinking."""
    if not req.messages:
        raise oa.bad_request("'messages' is empty; expected at least one message", "messages")
    missing = req.missing_content()
    if missing is not None:
        i, role = missing
        raise oa.bad_request(f"messages[{i}] (role '{role}') has no 'content'; a {role} "
                             "message needs its text", f"messages[{i}].content")
    options = req.chat_options(ctx.default_chat_template_kwargs)
    try:
        return ctx.tokenizer.render_chat([m.to_template() for m in req.messages],
                                         req.template_tools(), options)
    except ChatFormatError as e:
        raise oa.bad_request(f"'{e.param}': {e}", e.param) from None
    except ValueError as e:                           # the tokenizer's TokenizerError
        raise oa.bad_request(f"'messages': {e}", "messages") from None


def _prompt_ids(req: oa._Common, ctx: ServingContext) -> tuple[list[int], str,
                                                               ChatPrompt | None]:
    """Token ids of the request's prompt, the parameter name to blame for its length and,
    for chat, the rendered prompt (where generation starts)."""
    tok = ctx.tokenizer
    if isinstance(req, oa.ChatCompletionRequest):
        prompt = _chat_prompt(req, ctx)
        return list(prompt.ids), "messages", prompt
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise oa.bad_request(f"'prompt' holds {len(p)} prompts; this server takes one "
                                 "prompt per request", "prompt")
        p = p[0]
    try:
        ids = tok.encode(p) if isinstance(p, str) else list(p)
    except ValueError as e:
        raise oa.bad_request(f"'prompt': {e}", "prompt") from None
    bad = [t for t in ids if not 0 <= t < ctx.vocab_size]
    if bad:
        raise oa.bad_request(f"'prompt' token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {ctx.vocab_size})", "prompt")
    if not ids:
        raise oa.bad_request("'prompt' is empty; expected at least one token", "prompt")
    return ids, "prompt", None


def _sampling(req: oa._Common, n_prompt: int, blame: str, ctx: ServingContext) -> SamplingParams:
    if req.unsupported():
        name = req.unsupported()[0]
        raise oa.bad_request(f"'{name}' is not supported by this server", name)
    if not 1 <= req.n <= MAX_N:
        raise oa.bad_request(f"n = {req.n}; expected 1 <= n <= {MAX_N} choices", "n")
    if req.num_logprobs is not None and ctx.speculative:
        raise oa.bad_request("logprobs are not reported by this deployment's speculative "
                             "decoding (speculative_config); send the request without them",
                             "logprobs")
    mml = ctx.max_model_len
    if n_prompt >= mml:
        raise oa.bad_request(f"This model's maximum context length is {mml} tokens; your "
                             f"{blame} has {n_prompt} tokens, leaving no room for output.",
                             blame, "context_length_exceeded")
    max_tokens = req.max_tokens
    if isinstance(req, oa.ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    if max_tokens is None:
        max_tokens = 16 if isinstance(req, oa.CompletionRequest) else mml - n_prompt
    name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None \
        else "max_tokens"
    if max_tokens < 1:
        raise oa.bad_request(f"{name} = {max_tokens}; expected an integer >= 1", name)
    if n_prompt + max_tokens > mml:
        raise oa.bad_request(f"This model's maximum context length is {mml} tokens. However, "
                             f"you requested {n_prompt + max_tokens} tokens ({n_prompt} in the "
                             f"{blame}, {max_tokens} in the completion).", name,
                             "context_length_exceeded")
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, seed=req.seed,
            stop=req.stop_list, stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos, logprobs=req.num_logprobs,
            channel_markers=isinstance(req, oa.ChatCompletionRequest))
    except RequestError as e:
        raise oa.bad_request(str(e), str(e).split(" ", 1)[0]) from None


def _message(e: BaseException) -> str:
    """The exception's own message: for an error raised in the coordinator actor, that of the
    original exception (Ray's wrapper prints the remote traceback and a `module.Class:` prefix,
    never meant for a client)."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException) and cause is not e:
        e = cause
    text = str(e).strip().splitlines()
    last = text[-1] if text else type(e).__name__
    head, sep, rest = last.partition(": ")
    if sep and "." in head and head.replace(".", "").replace("_", "").isalnum():
        last = rest                     # 'raydecode.actors.coordinator.Overloaded: …' -> '…'
    return last


def _map_error(e: BaseException) -> oa.APIError:
    if isinstance(e, oa.APIError):
        return e
    import ray.exceptions
    if isinstance(e, ray.exceptions.RayTaskError) and isinstance(e.cause, BaseException):
        e = e.cause                     # the coordinator's own exception, not Ray's wrapper
    if isinstance(e, RequestError):
        return oa.bad_request(_message(e))
    if isinstance(e, (Overloaded, StockPoolError)):
        return oa.unavailable(_message(e), RETRY_AFTER_S)
    if isinstance(e, (ClientDisconnect, ray.exceptions.TaskCancelledError,
                      asyncio.CancelledError)):
        # the client went away (Serve cancels the handler): nobody reads this answer, it is
        # counted as such, not as a server error
        return oa.APIError(CLIENT_CLOSED, "client closed the request", "invalid_request_error",
                           None, "client_closed_request")
    if isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
        return oa.unavailable("replica unavailable; retry", RETRY_AFTER_S)
    return oa.APIError(500, f"internal error: {type(e).__name__}: {str(e)[:200]}",
                       "server_error", None, "internal_error")


def max_body_bytes(max_model_len: int) -> int:
    """Largest request body read: 1 MiB of parameters and messages plus 32 bytes per context
    token (a prompt token in JSON takes ≤ 8 bytes as an id, ~4-12 as text)."""
    return 2**20 + 32 * max_model_len


async def _read_body(request: Request, max_model_len: int) -> bytes:
    """The body, or a 413 as soon as it is known to exceed max_body_bytes: from Content-Length
    before reading anything, else while a chunked body arrives; or a 408 (connection closed)
    when no byte came for BODY_IDLE_TIMEOUT_S or the whole body took longer than
    BODY_TIMEOUT_S (actors/http_timeouts.py)."""
    limit = max_body_bytes(max_model_len)
    err = oa.APIError(413, f"The request body exceeds {limit} bytes, the most this server "
                           f"reads for a context of {max_model_len} tokens; send a shorter "
                           "prompt.", "invalid_request_error", None, "request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise err
    idle_s, total_s = http_timeouts.BODY_IDLE_TIMEOUT_S, http_timeouts.BODY_TIMEOUT_S
    buf = bytearray()
    chunks = request.stream().__aiter__()
    deadline = time.monotonic() + total_s
    while True:
        wait = min(idle_s, deadline - time.monotonic())
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), max(wait, 0.0))
        except StopAsyncIteration:
            return bytes(buf)
        except asyncio.TimeoutError:
            slow = "took longer than" if time.monotonic() >= deadline else "sent nothing for"
            limit_s = total_s if slow == "took longer than" else idle_s
            raise oa.APIError(408, f"The request body {slow} {limit_s:g} s; send the whole "
                                   "body at once.", "invalid_request_error", None,
                              "request_timeout", {"Connection": "close"}) from None
        buf += chunk
        if len(buf) > limit:
            raise err


def _error_response(e: oa.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


# ---- API keys and the operations routes ---------------------------------------------------
_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat",
              "/v1/models": "models"}


def _authorizer(keys: APIKeys, metrics: RequestMetrics):
    """The /v1 routes' dependency: 401 in the OpenAI error shape without an accepted bearer
    key (actors/auth.py); the message never repeats what was sent."""
    async def authorize(request: Request) -> None:
        why = keys.check(request.headers.get("authorization"))
        if why is None:
            return
        endpoint = next((e for p, e in _ENDPOINTS.items()
                         if request.url.path.endswith(p)), "other")
        metrics.requests.labels(endpoint, "401").inc()
        msg = ("You didn't provide an API key. Send it in the Authorization header as "
               "'Authorization: Bearer YOUR_KEY'." if why == "missing" else
               "Incorrect API key provided.")
        raise oa.APIError(401, msg, "invalid_request_error", None, "invalid_api_key",
                          {"WWW-Authenticate": "Bearer"})
    return authorize


def _add_ops_routes(app: FastAPI, backend: Backend, ctx: ServingContext,
                    metrics: RequestMetrics) -> None:
    @app.get("/health")
    async def health(wait_s: float = 0.0):
        """Replica health; `?wait_s=N` first waits up to N s (≤ 300) for it to be healthy."""
        try:
            if wait_s > 0:
                await backend.wait_healthy(min(wait_s, 300.0))
            s = await backend.stats()
        except Exception as e:  # noqa: BLE001 — the coordinator is gone: not healthy
            return _error_response(_map_error(e))
        loop_ok = s.get("step_loop", "ok") == "ok"
        body = {"status": "ok" if s["healthy"] else "degraded" if loop_ok else "failed",
                "profile": s["profile"], "note": s["profile_note"],
                "last_failure": s["last_failure"]}
        if ctx.warning:
            body["warning"] = ctx.warning
        # a dead or stalled step loop never recovers by itself (the watchdog says so): fail
        if not loop_ok or not s["healthy"] and s.get("stock_pool") is False:
            return JSONResponse(body, 503, {"Retry-After": str(RETRY_AFTER_S)})
        return body

    @app.get("/metrics")
    async def prometheus():
        try:
            stats = await backend.stats(detail=True)
        except Exception:  # noqa: BLE001 — request metrics still render without the coordinator
            stats = None
        return Response(metrics.render(stats), media_type=CONTENT_TYPE)


class OpsServer:
    """/health and /metrics served by uvicorn on a thread, on their own (local) port."""

    def __init__(self, app: FastAPI, host: str, port: int):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as e:
            self.sock.close()
            raise RuntimeError(f"serve.metrics_port: cannot bind {host}:{port} for /health and "
                               f"/metrics ({e.strerror}); choose a free port (replica r of a "
                               "node binds metrics_port + r)") from None
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True, name="raydecode-ops-server")

    def start(self) -> str:
        self.sock.listen(64)
        self.thread.start()
        return self.url

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.sock.close()


# ---- the app ----------------------------------------------------------------------------------
def make_app(backend: Backend, ctx: ServingContext, lifespan=None) -> FastAPI:
    """The OpenAI app. With `ctx.ops_separate`, /health and /metrics live on a second app,
    `app.state.ops_app`, for a local port (`OpsServer`)."""
    app = FastAPI(title="raydecode", lifespan=lifespan)
    metrics = RequestMetrics()
    app.state.metrics = metrics

    @app.exception_handler(oa.APIError)
    async def _api_error(_: Request, e: oa.APIError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        """Unknown routes (/v1/embeddings, …) and methods, in the OpenAI error shape."""
        where = f"{request.method} {request.url.path}"
        if e.status_code == 404:
            err = oa.APIError(404, f"Invalid URL ({where}): this server serves "
                                   f"{', '.join(ROUTES)}", "invalid_request_error", None,
                              "unknown_url")
        elif e.status_code == 405:
            err = oa.APIError(405, f"Method not allowed ({where})", "invalid_request_error",
                              None, "method_not_allowed", dict(e.headers or {}))
        else:
            err = oa.APIError(e.status_code, str(e.detail), "invalid_request_error")
        metrics.requests.labels("other", str(err.status)).inc()
        return _error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _query_error(_: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        param = str(first.get("loc", ("", "?"))[-1])
        return _error_response(oa.bad_request(f"Invalid value for '{param}': "
                                              f"{first.get('msg', 'invalid')}", param))

    authorized = [Depends(_authorizer(ctx.api_keys, metrics))]

    @app.get("/v1/models", dependencies=authorized)
    async def models():
        return oa.models_body(ctx.model_name, ctx.max_model_len, ctx.created)

    ops = FastAPI(title="raydecode-ops") if ctx.ops_separate else app
    _add_ops_routes(ops, backend, ctx, metrics)
    app.state.ops_app = ops if ctx.ops_separate else None

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(request: Request):
        return await _serve(request, oa.CompletionRequest, "completions")

    @app.post("/v1/chat/completions", dependencies=authorized)
    async def chat(request: Request):
        return await _serve(request, oa.ChatCompletionRequest, "chat")

    async def _serve(request: Request, cls, endpoint: str):
        t0 = time.perf_counter()
        try:
            raw = await _read_body(request, ctx.max_model_len)
            req = oa.parse_request(cls, raw)
            if req.model != ctx.model_name:
                raise oa.APIError(404, f"The model `{req.model}` does not exist; this server "
                                       f"serves `{ctx.model_name}`.", "invalid_request_error",
                                  "model", "model_not_found")
            # a long prompt is tokenized off the event loop: other streams keep flowing
            ids, blame, chat_prompt = await asyncio.to_thread(_prompt_ids, req, ctx) \
                if len(raw) > 2**16 else _prompt_ids(req, ctx)
            params = _sampling(req, len(ids), blame, ctx)
            new_output = lambda: ChoiceOutput(  # noqa: E731 — one per choice (n > 1)
                endpoint == "chat", ctx.tokenizer, params.logprobs, chat_prompt,
                endpoint == "chat" and req.tools_enabled)
            output = new_output()
            rid = oa.new_id("chatcmpl" if endpoint == "chat" else "cmpl")
            gen = backend.generate(rid, ids, params, req.n)
            await gen.__anext__()                 # admission: errors here are HTTP errors
        except asyncio.CancelledError:    # the client went away (Serve cancels the handler)
            metrics.requests.labels(endpoint, str(CLIENT_CLOSED)).inc()
            raise
        except Exception as e:  # noqa: BLE001 — every failure becomes an OpenAI error body
            err = _map_error(e)
            metrics.requests.labels(endpoint, str(err.status)).inc()
            return _error_response(err)
        if req.n > 1:                     # one ChoiceOutput per choice (actors/choices.py)
            from .choices import Choices
            run = Choices(_Run, endpoint, rid, req, ids, gen, backend, metrics, t0,
                          ctx.model_name, [output] + [new_output() for _ in range(req.n - 1)],
                          ctx.warning, ctx.request_timeout_s)
        else:
            run = _Run(endpoint, rid, req, ids, gen, backend, metrics, t0, ctx.model_name,
                       output, ctx.warning, ctx.request_timeout_s)
        headers = {WARNING_HEADER: ctx.warning} if ctx.warning else None
        if req.stream:
            try:
                await run.first()
            except asyncio.CancelledError:
                run.abandon(CLIENT_CLOSED)
                raise
            except Exception as e:  # noqa: BLE001 — failed before any output: an HTTP error
                err = _map_error(e)
                run.abandon(err.status)
                return _error_response(err)
            return StreamingResponse(run.sse(), media_type="text/event-stream", headers=headers)
        out = await run.collect()
        return JSONResponse(out, headers=headers) if headers and isinstance(out, dict) else out

    return app


class _Run:
    """One admitted request: its stream of deltas → SSE chunks or one response body."""

    def __init__(self, endpoint, rid, req, ids, gen, backend, metrics, t0, model,
                 output: ChoiceOutput, warning=None, timeout_s: float = 600.0):
        self.endpoint, self.rid, self.req, self.n_prompt = endpoint, rid, req, len(ids)
        self.gen, self.backend, self.metrics, self.t0, self.model = gen, backend, metrics, t0, model
        self.warning, self.timeout_s = warning, timeout_s
        self.output = output
        self.created = int(time.time())
        self.t_first = self.t_last = None
        self.ids: list[int] = []
        self.cached = 0                          # prompt tokens served from the prefix cache
        self.finish: str | None = None
        self._head: list[StepOutput] = []        # deltas taken by first(), replayed by sse()
        self._it: AsyncIterator[StepOutput] | None = None

    async def first(self) -> None:
        """Wait for the first delta with output (or the end) before a stream's HTTP status is
        sent, so a request that fails before its first token (the replica failed and the stock
        pool is down, the coordinator died) is a 503 + Retry-After, not a 200 stream that ends
        in an error event."""
        self._it = self._deltas()
        async for out in self._it:
            self._head.append(out)
            if out.new_token_ids or out.delta_text or out.finished:
                return

    def abandon(self, status: int) -> None:
        if self.finish is None:
            self.backend.abort(self.rid)
        self._done(status)

    async def _replay(self) -> AsyncIterator[StepOutput]:
        for out in self._head:
            yield out
        async for out in self._it or self._deltas():
            yield out

    async def _deltas(self) -> AsyncIterator[StepOutput]:
        async for out in self.gen:
            if out.new_token_ids:
                now = time.perf_counter()
                self.t_first = self.t_first or now
                self.t_last = now
                self.ids += out.new_token_ids
            self.cached = max(self.cached, out.cached_tokens)
            if out.finished:
                self.finish = out.finish_reason
            yield out

    def _done(self, status: int) -> None:
        self.metrics.requests.labels(self.endpoint, str(status)).inc()
        self.metrics.observe_request(self.endpoint, self.t0, self.t_first, self.t_last,
                                     len(self.ids), self.n_prompt)

    async def collect(self):
        """The whole answer, within the request deadline (timeout_s from arrival): a request
        still unfinished then is aborted and answered 503 + Retry-After, so a stuck replica
        never holds a non-streaming client forever."""
        async def gather():
            async for out in self._deltas():
                self.output.step(out)

        left = self.timeout_s - (time.perf_counter() - self.t0)
        try:
            await asyncio.wait_for(gather(), max(left, 0.0))
        except asyncio.TimeoutError:
            err = oa.unavailable(f"the request did not finish within {self.timeout_s:g} s "
                                 "(serve.request_timeout_s); retry", RETRY_AFTER_S)
            self._done(err.status)
            return _error_response(err)
        except asyncio.CancelledError:
            self._done(CLIENT_CLOSED)
            raise
        except Exception as e:  # noqa: BLE001
            err = _map_error(e)
            self._done(err.status)
            return _error_response(err)
        finally:
            if self.finish is None:
                self.backend.abort(self.rid)
        self._done(200)
        use = oa.usage(self.n_prompt, len(self.ids), self.cached)
        tids = self.ids if self.req.return_token_ids else None
        obj = "chat.completion" if self.endpoint == "chat" else "text_completion"
        out = oa.response_body(self.rid, obj, self.model, self.created,
                               self.output.choice(self.finish), use, tids)
        return {**out, "warning": self.warning} if self.warning else out

    async def sse(self):
        it = self.chunks(self.req.include_usage)
        try:
            async for obj in it:
                yield oa.sse(obj)
        finally:                  # a client gone mid-stream: chunks' cleanup runs now
            await it.aclose()
        yield oa.SSE_DONE

    async def chunks(self, include_usage: bool):
        """The stream's chunk objects (an error body last if it fails mid-stream), without
        the [DONE] line."""
        chat, tids = self.endpoint == "chat", self.req.return_token_ids
        status = 499                       # stays so if the client goes away mid-stream
        try:
            if chat:
                yield oa.chat_chunk(self.rid, self.model, self.created,
                                    {"role": "assistant", "content": ""}, None)
            obj = "chat.completion.chunk" if chat else "text_completion"
            async for out in self._replay():
                choice = self.output.step(out)
                if choice is None and not (tids and out.new_token_ids):
                    continue
                if choice is None:
                    choice = {"delta": {}} if chat else {"text": ""}
                ids = out.new_token_ids if tids else None
                yield oa.chunk_body(self.rid, obj, self.model, self.created, choice, ids)
            if include_usage:
                yield oa.usage_chunk(self.rid, obj, self.model, self.created,
                                     oa.usage(self.n_prompt, len(self.ids), self.cached))
            status = 200
        except Exception as e:  # noqa: BLE001 — a failure mid-stream is an SSE error event
            err = _map_error(e)
            status = err.status
            yield err.body()
        finally:
            if self.finish is None:
                self.backend.abort(self.rid)
            self._done(status)


# ---- Ray Serve ----------------------------------------------------------------------------------
def _ingress_class():
    from ray import serve

    @serve.deployment(name="raydecode")
    @serve.ingress()
    class OpenAIServer:
        """One replica: this ingress + its Coordinator actor (+ the coordinator's ranks)."""

        async def __init__(self, config: dict,
                           executor_factory: Callable[[], ReplicaExecutor] | None = None):
            from .coordinator import coordinator_actor_class

            cfg = parse_deploy_config(config)
            self.actor = coordinator_actor_class().options(
                num_cpus=cfg.serve.num_cpus, max_concurrency=100_000).remote(
                cfg.model_dump(), executor_factory)
            await self.actor.start.remote()
            self._http = make_app(RayBackend(self.actor), ServingContext.from_config(cfg))
            self._ops = None
            if self._http.state.ops_app is not None:
                port = cfg.serve.metrics_port
                # the replica's rank among this deployment's replicas on its node
                rank = getattr(getattr(serve.get_replica_context(), "rank", None),
                               "local_rank", 0) or 0
                self._ops = OpsServer(self._http.state.ops_app, cfg.serve.metrics_host,
                                      port + rank if port else 0)
                self._ops.start()

        def __serve_build_asgi_app__(self):
            return self._http

        async def check_health(self) -> None:
            s = await asyncio.wait_for(self.actor.stats.remote(), 30)   # raises if it died
            if s.get("step_loop", "ok") != "ok":    # dead / stalled: Serve replaces the replica
                raise RuntimeError(f"coordinator step loop {s['step_loop']}")

    return OpenAIServer


def deployment_for(cfg: DeployConfig,
                   executor_factory: Callable[[], ReplicaExecutor] | None = None):
    """The bound Serve application of a deployment config. A drafter whose files are on this
    machine is checked here (num_speculative_tokens <= its block size); else each replica's
    coordinator checks it at start."""
    check_speculative(cfg, require_drafter=False)
    s = cfg.serve
    return _ingress_class().options(
        num_replicas=s.num_replicas, max_ongoing_requests=s.max_ongoing_requests,
        ray_actor_options={"num_cpus": s.num_cpus}).bind(cfg.model_dump(), executor_factory)


def build_app(args: dict):
    """`serve run raydecode.actors.serve:build_app config=deploy.yaml`, or serveConfigV2
    `args: {config: deploy.yaml}` / `args: {config: {model: …}}` / the config's keys inline."""
    args = dict(args or {})
    if "config" in args:
        src = args.pop("config")
        if args:
            raise ValueError(f"build_app args: {sorted(args)} next to 'config'; pass either "
                             "'config' (a path or a mapping) or the config's keys inline")
        cfg = load_deploy_config(src) if isinstance(src, str) else parse_deploy_config(src)
    else:
        cfg = parse_deploy_config(args, "build_app args")
    return deployment_for(cfg)


# ---- one replica in this process, without Ray ---------------------------------------------------
class LocalServer:
    """A replica served by uvicorn on a thread of this process (a stock-only pool for tests and
    development). The socket is bound before start, so the URL is valid at once; clients that
    connect while the model loads wait in the listen backlog."""

    def __init__(self, cfg: DeployConfig, executor_factory=None, host: str = "127.0.0.1",
                 port: int = 0):
        import contextlib

        import uvicorn

        self.cfg = cfg
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.core: CoordinatorCore | None = None

        @contextlib.asynccontextmanager
        async def lifespan(_app):
            await self.core.start()
            yield
            await self.core.close()

        self.core = CoordinatorCore(cfg, executor_factory)
        app = make_app(LocalBackend(self.core), ServingContext.from_config(cfg), lifespan)
        self.ops = None if app.state.ops_app is None else OpsServer(
            app.state.ops_app, cfg.serve.metrics_host, cfg.serve.metrics_port)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                    http=http_timeouts.default_protocol()))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True, name="raydecode-local-server")

    def start(self) -> str:
        self.sock.listen(128)
        self.thread.start()
        if self.ops is not None:
            self.ops.start()
        return self.url

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.ops is not None:
            self.ops.stop()
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.sock.close()
