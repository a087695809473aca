"""A middleware for Ray Serve's HTTP proxy: a request whose ingress replica dies under it gets
a clear, retriable answer instead of a bare 500 or a cut connection.

When a replica process dies mid-request, Serve's proxy answers nothing itself for the
`ActorDiedError` (uvicorn then sends a body-less 500) and, once a stream has started, just ends
it without its last chunk (clients see "peer closed connection"). Wrapped by this middleware:
- no response started → 503 + Retry-After with the OpenAI error body (code
  service_unavailable), the same answer the ingress gives when its coordinator is gone;
- an SSE stream started but not finished → a final SSE error event (code service_unavailable)
  and `data: [DONE]`, the same event the ingress sends when a replica fails mid-stream.
Complete responses pass through untouched.

Serve loads proxy middlewares from the environment of the Ray nodes:
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=raydecode.actors.proxy_guard:proxy_middlewares`
(`raydecode serve` sets it for the local Ray it starts; on a cluster, set it in every node's
environment, e.g. the KubeRay container env).
"""
from __future__ import annotations

import json
import logging

ENV_VAR = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
IMPORT_PATH = "raydecode.actors.proxy_guard:proxy_middlewares"
RETRY_AFTER_S = 5
MESSAGE = "the replica serving this request failed before answering it; retry"

log = logging.getLogger("raydecode.proxy_guard")


def _error(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                 "code": "service_unavailable"}}).encode()


class ReplicaLossGuard:
    """Pure ASGI middleware (no buffering: stream chunks pass through as they come)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = {"started": False, "done": False, "sse": False}

        async def tracked(message):
            if message["type"] == "http.response.start":
                state["started"] = True
                ctype = dict(message.get("headers") or []).get(b"content-type", b"")
                state["sse"] = ctype.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                state["done"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:  # noqa: BLE001 — answered below, like a replica loss
            log.warning("proxy app raised %s: %s", type(e).__name__, e)
        if not state["started"]:
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"retry-after", str(RETRY_AFTER_S).encode())]})
            await send({"type": "http.response.body", "body": _error(MESSAGE)})
        elif not state["done"] and state["sse"]:
            tail = b"data: " + _error(MESSAGE) + b"\n\ndata: [DONE]\n\n"
            await send({"type": "http.response.body", "body": tail})


def proxy_middlewares() -> list:
    """The callback Serve's proxy calls (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH), before its
    uvicorn server starts: the header read timeout (actors/http_timeouts.py) goes in here too."""
    from starlette.middleware import Middleware

    from . import http_timeouts

    http_timeouts.install()
    return [Middleware(ReplicaLossGuard)]
