"""The per-step channel between a replica's coordinator and its rank step loops (no Ray per step).

The coordinator owns a `ChannelServer`: a Unix socket in Linux's abstract namespace for ranks on
its host and a TCP socket for the others, both on names/ports chosen at start (a unique suffix,
an OS port). Each rank's loop connects once (`ChannelClient`, UDS when it shares the host) and
announces its rank; then per step:

    coordinator ── plan frame ──▶ every rank        (N sends of ~0.1-2 KB)
    rank 0      ── result frame ─▶ coordinator      (token ids; logprobs when asked)
    any rank    ── error frame ──▶ coordinator      (only when its step raised)

Ranks block in recv (no spinning, no CPU while idle) and the coordinator in one select over all
rank sockets, so a rank that dies is seen at once (its socket reaches EOF), a rank that raises
is named by its error frame, and silence past the deadline is a timeout the caller names with
the ranks' progress. The frames are engine/plan_codec.py's.
"""
from __future__ import annotations

import os
import selectors
import socket
import struct
import time
import uuid
from dataclasses import dataclass

from .plan_codec import (ERROR, HEADER, HELLO, PLAN_MAGIC, RESULT_MAGIC, hello_frame,
                         parse_header)

_UDS_OK = hasattr(socket, "AF_UNIX") and os.uname().sysname == "Linux"


def host_key() -> str:
    """Identifies this host's kernel (hostname + boot id): processes with the same key can
    reach each other's abstract Unix sockets."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True)
class ChannelAddress:
    """Where the ranks connect (picklable, handed to each rank's loop through Ray)."""
    host_key: str
    uds: str | None            # abstract socket name (no leading NUL), None off Linux
    tcp_host: str
    tcp_port: int
    secret: str                # a rank's HELLO must carry it: nobody else joins the replica


class ChannelClosed(ConnectionError):
    """The peer's socket reached EOF (its process died or closed the channel); `rank` names
    it on the coordinator's side."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


class RankSilent(TimeoutError):
    """No answer from rank 0 by the deadline (and no rank raised or died)."""


class RankRaised(RuntimeError):
    def __init__(self, rank: int, text: str):
        super().__init__(f"rank {rank} raised: {text}")
        self.rank, self.text = rank, text


def _nodelay(s: socket.socket) -> None:
    if s.family in (socket.AF_INET, socket.AF_INET6):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = s.recv_into(view[got:], n - got)
        if k == 0:
            raise ChannelClosed("peer closed the channel")
        got += k
    return bytes(buf)


def recv_frame(s: socket.socket, magic: bytes) -> tuple[int, int, bytes]:
    """One whole frame from a blocking socket -> (kind, step_id, payload)."""
    kind, step_id, n = parse_header(_recv_exact(s, HEADER.size), magic)
    return kind, step_id, _recv_exact(s, n) if n else b""


class ChannelServer:
    """The coordinator's end. `accept` the ranks, then per step `publish(frame)` and
    `wait_result(step_id, timeout)`."""

    def __init__(self, num_ranks: int, tcp_host: str = "127.0.0.1", local: bool = True):
        """local False: no Unix socket, every rank connects over TCP (what ranks on other
        hosts do; benchmarks compare the two)."""
        self.num_ranks = num_ranks
        self._listeners: list[socket.socket] = []
        uds = None
        if _UDS_OK and local:
            uds = f"raydecode-{os.getpid()}-{uuid.uuid4().hex[:12]}"
            u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            u.bind("\0" + uds)
            u.listen(num_ranks)
            self._listeners.append(u)
        t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        t.bind((tcp_host, 0))
        t.listen(num_ranks)
        self._listeners.append(t)
        self.address = ChannelAddress(host_key(), uds, tcp_host, t.getsockname()[1],
                                      uuid.uuid4().hex)
        self.socks: list[socket.socket | None] = [None] * num_ranks
        self.transport: list[str] = [""] * num_ranks
        self._sel = selectors.DefaultSelector()
        self.closed: set[int] = set()          # ranks whose socket reached EOF

    def accept(self, timeout_s: float) -> None:
        """Until every rank has connected and said HELLO; TimeoutError names the missing."""
        deadline = time.monotonic() + timeout_s
        sel = selectors.DefaultSelector()
        for lst in self._listeners:
            sel.register(lst, selectors.EVENT_READ)
        try:
            while None in self.socks:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [r for r, s in enumerate(self.socks) if s is None]
                    raise TimeoutError(f"rank(s) {missing} did not connect to the step "
                                       f"channel within {timeout_s:g} s")
                for key, _ in sel.select(left):
                    conn, _ = key.fileobj.accept()
                    conn.settimeout(max(1.0, left))
                    _nodelay(conn)
                    try:
                        kind, _, payload = recv_frame(conn, RESULT_MAGIC)
                    except (OSError, ValueError):
                        conn.close()
                        continue
                    if kind != HELLO or payload[4:].decode(errors="replace") != \
                            self.address.secret:
                        conn.close()          # not one of this replica's ranks
                        continue
                    rank = struct.unpack_from("<i", payload)[0]
                    if not 0 <= rank < self.num_ranks or self.socks[rank] is not None:
                        conn.close()
                        raise ValueError(f"step channel: unexpected HELLO from rank {rank}")
                    conn.settimeout(None)
                    self.socks[rank] = conn
                    self.transport[rank] = "uds" if conn.family == socket.AF_UNIX else "tcp"
                    self._sel.register(conn, selectors.EVENT_READ, rank)
        finally:
            sel.close()

    def publish(self, frame: bytes) -> None:
        """The same frame to every rank (in rank order); a rank gone raises ChannelClosed."""
        for r, s in enumerate(self.socks):
            try:
                s.sendall(frame)
            except OSError as e:
                self.closed.add(r)
                raise ChannelClosed(f"rank {r}'s channel closed ({type(e).__name__}: {e})",
                                    r) from None

    def wait_result(self, step_id: int, timeout_s: float) -> tuple[int, bytes]:
        """Rank 0's frame for step_id -> (kind, payload). Raises ChannelClosed (.rank set) when a
        rank's socket reaches EOF, RankRaised when a rank sends an error frame, RankSilent at
        the deadline. Frames of older steps are skipped."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankSilent(f"no result for step {step_id} within {timeout_s:g} s")
            for key, _ in self._sel.select(left):
                rank = key.data
                try:
                    kind, sid, payload = recv_frame(key.fileobj, RESULT_MAGIC)
                except (ChannelClosed, OSError) as e:
                    self._sel.unregister(key.fileobj)
                    self.closed.add(rank)
                    raise ChannelClosed(f"rank {rank}'s channel closed ({e})", rank) from None
                if kind == ERROR:
                    raise RankRaised(rank, payload.decode("utf-8", "replace"))
                if rank == 0 and sid == step_id:
                    return kind, payload

    def poll_failures(self, wait_s: float) -> tuple[list[int], dict[int, str]]:
        """After a failure: for up to wait_s, collect further deaths (EOF) and error frames ->
        (dead ranks, {rank: error text})."""
        dead, errors = [], {}
        deadline = time.monotonic() + wait_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            events = self._sel.select(left)
            if not events:
                break
            for key, _ in events:
                rank = key.data
                try:
                    kind, _, payload = recv_frame(key.fileobj, RESULT_MAGIC)
                except (ChannelClosed, OSError):
                    self._sel.unregister(key.fileobj)
                    self.closed.add(rank)
                    dead.append(rank)
                    continue
                if kind == ERROR:
                    errors[rank] = payload.decode("utf-8", "replace")
            if len(dead) + len(self.closed - set(dead)) >= self.num_ranks:
                break
        return sorted(set(dead)), errors

    def close(self) -> None:
        for s in [*self.socks, *self._listeners]:
            if s is not None:
                try:
                    s.close()
                except OSError:
                    pass
        self._sel.close()


class ChannelClient:
    """A rank's end: connect once, then `recv_plan()` per step; rank 0 `send(result frame)`."""

    def __init__(self, address: ChannelAddress, rank: int, timeout_s: float = 60.0):
        self.rank = rank
        if address.uds is not None and _UDS_OK and address.host_key == host_key():
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            target = "\0" + address.uds
            self.transport = "uds"
        else:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            target = (address.tcp_host, address.tcp_port)
            self.transport = "tcp"
        s.settimeout(timeout_s)
        s.connect(target)
        _nodelay(s)
        s.sendall(hello_frame(rank, address.secret))
        s.settimeout(None)
        self.sock = s

    def recv_plan(self) -> tuple[int, int, bytes]:
        return recv_frame(self.sock, PLAN_MAGIC)

    def send(self, frame: bytes) -> None:
        self.sock.sendall(frame)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


__all__ = ["ChannelAddress", "ChannelServer", "ChannelClient", "ChannelClosed", "RankSilent",
           "RankRaised", "host_key", "recv_frame"]
