"""Serving under faults and hostile clients (issue 30 §2, and the request shapes of §3): the
coordinator's step-loop watchdog, the non-streaming deadline, header and body read timeouts, a
client that goes away counted 499, 503 messages without internal class names, stock-pool
admissions bounded while the replica is unhealthy, unknown routes and content-less messages in
the OpenAI error shape. Real coordinator (tiny model) behind the real app on uvicorn; raw
sockets where a client misbehaves, the `openai` client where one behaves."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch

from raydecode.actors import coordinator as C
from raydecode.actors import http_timeouts
from raydecode.actors.config import parse_deploy_config
from raydecode.actors.coordinator import CoordinatorCore, Overloaded, build_executor
from raydecode.actors.serve import LocalServer, _map_error
from raydecode.engine.request import SamplingParams

torch.set_num_threads(1)
MML = 512          # room for K3's chat template (~300 tokens) and an answer


def cfg(**kw):
    base = {"model": "tiny", "max_model_len": MML, "max_num_seqs": 4,
            "placement": {"profile": "development"}}
    return parse_deploy_config({**base, **kw})


def _get(url: str, timeout: float = 30.0):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read()), {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null"), {k.lower(): v for k, v in e.headers.items()}


def _post(url: str, body: dict, timeout: float = 60.0):
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null"), {k.lower(): v for k, v in e.headers.items()}


def _metric(url: str, endpoint: str, status: int) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    key = f'raydecode_requests_total{{endpoint="{endpoint}",status="{status}"}} '
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(key))


def _openai_shaped(body) -> bool:
    return isinstance(body, dict) and set(body.get("error", {})) == {"message", "type", "param",
                                                                     "code"}


@pytest.fixture(scope="module")
def server():
    srv = LocalServer(cfg())
    url = srv.start()
    assert _get(url + "/health?wait_s=120")[0] == 200
    yield url, srv
    srv.stop()


def _call_on_loop(srv: LocalServer, fn):
    """Run fn() on the server's event loop (where the coordinator lives) and wait for it."""
    loop = srv.core._wake._get_loop() if hasattr(srv.core._wake, "_get_loop") else None
    done = threading.Event()
    out = {}

    def run():
        out["v"] = fn()
        done.set()
    loop.call_soon_threadsafe(run)
    assert done.wait(10)
    return out["v"]


# ---- request shapes ---------------------------------------------------------------------------

def test_user_message_without_content_is_a_400(server):
    url, _ = server
    status, body, _ = _post(url + "/v1/chat/completions",
                            {"model": "tiny", "messages": [{"role": "user"}]})
    assert status == 400 and _openai_shaped(body)
    assert body["error"]["param"] == "messages[0].content"
    assert "no 'content'" in body["error"]["message"]
    status, _, _ = _post(url + "/v1/chat/completions",                 # assistant may omit it
                         {"model": "tiny", "max_tokens": 2, "messages": [
                             {"role": "user", "content": "hi"}, {"role": "assistant"},
                             {"role": "user", "content": "again"}]})
    assert status == 200


@pytest.mark.parametrize("method,path,status", [("POST", "/v1/embeddings", 404),
                                                ("GET", "/v2/anything", 404),
                                                ("GET", "/v1/completions", 405)])
def test_unknown_routes_answer_in_the_openai_error_shape(server, method, path, status):
    url, _ = server
    req = urllib.request.Request(url + path, b"{}" if method == "POST" else None,
                                 method=method)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    body = json.loads(e.value.read())
    assert e.value.code == status and _openai_shaped(body), body
    assert path in body["error"]["message"]


def test_embeddings_through_the_openai_client_is_a_clear_not_found(server):
    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model="tiny", input="hi")
    assert "/v1/embeddings" in str(e.value) and "/v1/completions" in str(e.value)


def test_bad_query_parameter_is_a_400_in_the_openai_shape(server):
    url, _ = server
    status, body, _ = _get(url + "/health?wait_s=abc")
    assert status == 400 and _openai_shaped(body) and body["error"]["param"] == "wait_s"


# ---- read timeouts and clients that go away ----------------------------------------------------

def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing, or None if still open after `seconds`."""
    sock.settimeout(seconds)
    got = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return got
            got += chunk
    except socket.timeout:
        return None


def test_half_sent_headers_are_closed_after_the_header_timeout(server, monkeypatch):
    url, _ = server
    monkeypatch.setattr(http_timeouts, "HEADER_TIMEOUT_S", 1.0)
    socks = [_connect(url) for _ in range(20)]
    t0 = time.monotonic()
    for s in socks:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
    closed = [_closed_within(s, 10) for s in socks]
    assert all(c is not None for c in closed)           # every socket closed by the server
    assert time.monotonic() - t0 < 8
    for s in socks:
        s.close()
    assert _get(url + "/health")[0] == 200               # and it still serves


def test_half_sent_body_gets_408_after_the_idle_timeout(server, monkeypatch):
    url, _ = server
    monkeypatch.setattr(http_timeouts, "BODY_IDLE_TIMEOUT_S", 1.0)
    s = _connect(url)
    body = json.dumps({"model": "tiny", "prompt": "hi"}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body) + 50}\r\n\r\n".encode() + body)
    t0 = time.monotonic()
    got = _closed_within(s, 10)
    s.close()
    assert got is not None and time.monotonic() - t0 < 8
    head, _, rest = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
    assert _openai_shaped(json.loads(rest))


def test_client_gone_mid_body_is_counted_499_not_500(server):
    url, _ = server
    before = (_metric(url, "completions", 499), _metric(url, "completions", 500))
    s = _connect(url)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 500\r\n\r\n{\"model\": \"tiny\", ")
    time.sleep(0.3)
    s.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _metric(url, "completions", 499) == before[0]:
        time.sleep(0.2)
    assert _metric(url, "completions", 499) == before[0] + 1
    assert _metric(url, "completions", 500) == before[1]


def test_cancelled_and_remote_errors_map_to_499_and_clean_503():
    """What Serve hands the ingress: a TaskCancelledError when the client went away, and the
    coordinator's Overloaded wrapped in a RayTaskError (its text carried the remote traceback
    and `raydecode.actors.coordinator.Overloaded:`)."""
    import ray.exceptions as rx

    assert _map_error(rx.TaskCancelledError()).status == 499
    assert _map_error(asyncio.CancelledError()).status == 499
    cause = Overloaded("3 requests already wait (max_waiting_requests = 3)")
    wrapped = rx.RayTaskError("CoordinatorActor.generate", "Traceback …\n  File x\n"
                              "raydecode.actors.coordinator.Overloaded: 3 requests already "
                              "wait", cause).as_instanceof_cause()
    err = _map_error(wrapped)
    assert err.status == 503 and err.headers.get("Retry-After")
    assert err.message == "3 requests already wait (max_waiting_requests = 3)"
    assert "raydecode." not in err.message and "Overloaded" not in err.message
    died = _map_error(rx.ActorDiedError())
    assert died.status == 503 and "Error" not in died.message


# ---- the step-loop watchdog and the request deadline --------------------------------------------

def _fresh(**kw) -> tuple[str, LocalServer]:
    srv = LocalServer(cfg(**kw))
    url = srv.start()
    assert _get(url + "/health?wait_s=120")[0] == 200
    return url, srv


def test_dead_step_loop_fails_health_and_answers_503_at_once():
    url, srv = _fresh()
    try:
        def boom(outs):
            raise RuntimeError("injected: dispatch bug")
        srv.core._dispatch = boom                 # the loop dies after its next step
        t0 = time.monotonic()
        status, body, headers = _post(url + "/v1/completions",
                                      {"model": "tiny", "prompt": "hi", "max_tokens": 8})
        assert status == 503 and headers.get("retry-after") and _openai_shaped(body)
        assert time.monotonic() - t0 < 10
        assert "Error" not in body["error"]["message"]
        st, hb, _ = _get(url + "/health")
        assert st == 503 and hb["status"] == "failed" and "died" in hb["last_failure"]
        assert srv.core.stats()["step_loop"].startswith("died: RuntimeError")
        st, _, _ = _post(url + "/v1/completions", {"model": "tiny", "prompt": "x"})
        assert st == 503                                        # new ones too, no waiting
    finally:
        srv.stop()


def test_stalled_step_loop_is_caught_by_the_watchdog():
    url, srv = _fresh(rank_step_timeout_s=1.0)    # watchdog limit 1 + 1 s
    try:
        async def hang():
            await asyncio.Event().wait()           # an await that never returns
        srv.core._burst = hang
        t0 = time.monotonic()
        status, body, headers = _post(url + "/v1/completions",
                                      {"model": "tiny", "prompt": "hi", "max_tokens": 8})
        waited = time.monotonic() - t0
        assert status == 503 and headers.get("retry-after"), body
        assert waited < 8, waited
        st, hb, _ = _get(url + "/health")
        assert st == 503 and "stalled" in hb["last_failure"]
    finally:
        srv.stop()


class SlowExecutor:
    """The real TP=1 executor, 0.4 s slower per step."""

    def __init__(self, inner):
        self.inner = inner
        self.tp_size, self.dcp_size, self.domain_verified = 1, 1, False

    def specialized_ready(self, n):
        return True

    def execute(self, plan):
        time.sleep(0.4)
        return self.inner.execute(plan)

    def close(self):
        self.inner.close()


def test_non_streaming_request_gets_its_deadline():
    c = cfg(serve={"request_timeout_s": 2.0})
    srv = LocalServer(c, lambda: SlowExecutor(build_executor(c)))
    url = srv.start()
    try:
        assert _get(url + "/health?wait_s=120")[0] == 200
        t0 = time.monotonic()
        status, body, headers = _post(url + "/v1/completions", {
            "model": "tiny", "prompt": "hi", "max_tokens": 60, "ignore_eos": True})
        waited = time.monotonic() - t0
        assert status == 503 and headers.get("retry-after")
        assert "2 s" in body["error"]["message"] and 1.9 < waited < 6
        deadline = time.monotonic() + 20                 # the request was aborted, not left
        while time.monotonic() < deadline and srv.core.stats()["running"]:
            time.sleep(0.2)
        assert srv.core.stats()["running"] == 0
        assert srv.core.stats()["healthy"]
    finally:
        srv.stop()


# ---- stock-pool admissions while the replica is unhealthy ---------------------------------------

def test_stock_pool_admissions_are_bounded_while_rebuilding():
    async def run():
        c = cfg(max_num_seqs=2, max_waiting_requests=3,
                stock_pool={"base_url": "http://127.0.0.1:9/v1"})
        core = CoordinatorCore(c)
        core._set_healthy(False)                  # as after a failed step, before the rebuild
        core.last_failure = "injected"
        core._to_stock = lambda s: setattr(s, "where", "stock")   # no real pool needed
        params = SamplingParams(max_tokens=4, temperature=0.0)
        for i in range(5):                        # max_num_seqs + max_waiting_requests
            core._admit(f"r{i}", [1, 2, 3], params)
        with pytest.raises(Overloaded, match="at most max_num_seqs"):
            core._admit("r5", [1, 2, 3], params)
        core.abort("r0")                          # one finishes: room for one more
        core.streams["r0"].done = True
        core._admit("r6", [1, 2, 3], params)
        return core.counts["routed_to_stock"]

    assert asyncio.run(run()) == 6
