"""Read timeouts for the HTTP servers in front of a replica (uvicorn: the Serve proxy's and
`LocalServer`'s).

uvicorn has a keep-alive timeout but none for a request still arriving: a client that opens a
connection and sends half a request line, or headers without their blank line, holds the socket
as long as it likes (200 such clients held theirs for the whole 63 s of a review run). Here a
request's headers must be complete HEADER_TIMEOUT_S after the connection opened or the previous
response ended; past it the connection is closed. The body has its own limits in the app
(`actors/serve.py` `_read_body`: BODY_IDLE_TIMEOUT_S without a byte, BODY_TIMEOUT_S in all,
answered 408).

`protocol_class(base)` wraps a uvicorn HTTP protocol class (h11 or httptools) with the header
timer; `install()` makes it the class uvicorn picks in this process (its `HTTP_PROTOCOLS` table),
which is how the Serve proxy, whose uvicorn config Serve builds, gets it: `proxy_guard`'s
callback runs in the proxy process before its server starts.
"""
from __future__ import annotations

import asyncio

HEADER_TIMEOUT_S = 10.0       # request line + headers, from connection open / last response
BODY_IDLE_TIMEOUT_S = 10.0    # longest wait for the next body chunk
BODY_TIMEOUT_S = 60.0         # the whole body

_WRAPPED: dict[type, type] = {}


def protocol_class(base: type) -> type:
    """`base` (a uvicorn HTTP protocol class) with the header deadline."""
    if base in _WRAPPED:
        return _WRAPPED[base]

    class HeaderDeadline(base):
        _header_timer: asyncio.TimerHandle | None = None

        def _waiting_for_headers(self) -> bool:
            cycle = getattr(self, "cycle", None)
            return cycle is None or cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            if self._waiting_for_headers():
                self._header_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._expire)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self) -> None:
            self._header_timer = None
            # a pipelined request may have started since: only an unfinished header is cut
            if self._waiting_for_headers() and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self._waiting_for_headers():
                self._disarm()          # the request started: the body has its own limits

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()             # the next request's headers get the same deadline

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    HeaderDeadline.__name__ = HeaderDeadline.__qualname__ = f"HeaderDeadline{base.__name__}"
    _WRAPPED[base] = HeaderDeadline
    return HeaderDeadline


def default_protocol() -> type:
    """uvicorn's 'auto' HTTP protocol (httptools when installed, else h11), wrapped."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return protocol_class(AutoHTTPProtocol)


def install() -> None:
    """Make every uvicorn server started later in this process use the wrapped protocols."""
    from uvicorn import config

    from uvicorn.importer import import_from_string

    for name, path in list(config.HTTP_PROTOCOLS.items()):
        if name not in ("auto", "h11", "httptools") or path.startswith(f"{__name__}:"):
            continue                    # another protocol, or installed already
        cls = protocol_class(import_from_string(path))
        key = f"_raydecode_{name}"
        globals()[key] = cls
        config.HTTP_PROTOCOLS[name] = f"{__name__}:{key}"
