"""The per-step channel (engine/step_channel.py) with real sockets between threads: frames
reach every rank and rank 0's result comes back; a rank whose socket closes is named at once,
an error frame names the rank and its text, silence becomes RankSilent at the deadline, and a
connection without the channel's secret never joins."""
import socket
import struct
import threading
import time

import pytest

from raydecode.engine import plan_codec as pc
from raydecode.engine.sampling import StepResult
from raydecode.engine.scheduler import StepPlan
from raydecode.engine.step_channel import (ChannelClient, ChannelClosed, ChannelServer,
                                           RankRaised, RankSilent)
from raydecode.models.cache import StepBatch


def plan(step_id: int) -> StepPlan:
    return StepPlan(step_id, StepBatch.decode([0, 1], [5, 9]), [11, 12], [0, 1], {}, [])


def start(n: int, local: bool = True):
    server = ChannelServer(n, local=local)
    clients = [None] * n
    threads = [threading.Thread(target=lambda r=r: clients.__setitem__(
        r, ChannelClient(server.address, r, 10.0))) for r in range(n)]
    for t in threads:
        t.start()
    server.accept(10.0)
    for t in threads:
        t.join()
    return server, clients


def serve_one(client, reply=True):
    kind, sid, payload = client.recv_plan()
    p = pc.decode_plan(kind, sid, payload)
    if reply:
        client.send(pc.encode_result(sid, StepResult([t + 1 for t in p.tokens])))
    return p


@pytest.mark.parametrize("local", [True, False])
def test_plans_reach_every_rank_and_rank0_answers(local):
    server, clients = start(3, local)
    assert server.transport == (["uds"] * 3 if local else ["tcp"] * 3)
    for step in range(1, 4):
        got = []
        ts = [threading.Thread(target=lambda c=c, r=r: got.append(serve_one(c, r == 0)))
              for r, c in enumerate(clients)]
        for t in ts:
            t.start()
        server.publish(pc.encode_plan(plan(step)))
        kind, payload = server.wait_result(step, 10.0)
        assert pc.decode_result(kind, payload).token_ids == [12, 13]
        for t in ts:
            t.join()
        assert len(got) == 3 and all(p.step_id == step for p in got)
    server.close()


def test_a_closed_rank_is_named_at_once():
    server, clients = start(2)
    clients[1].close()                     # its process died: the kernel closes the socket
    t0 = time.monotonic()
    with pytest.raises(ChannelClosed) as e:   # at the send (UDS: EPIPE) or at the wait (EOF)
        server.publish(pc.encode_plan(plan(1)))
        server.wait_result(1, 30.0)
    assert e.value.rank == 1 and time.monotonic() - t0 < 5
    server.close()


def test_an_error_frame_names_the_rank_and_its_text():
    server, clients = start(2)
    clients[1].send(pc.error_frame(4, "RuntimeError: CUDA out of memory"))
    with pytest.raises(RankRaised, match="rank 1 raised: RuntimeError: CUDA out of memory"):
        server.wait_result(4, 10.0)
    server.close()


def test_silence_is_a_timeout_not_a_hang():
    server, clients = start(1)
    server.publish(pc.encode_plan(plan(1)))
    t0 = time.monotonic()
    with pytest.raises(RankSilent, match="no result for step 1 within 0.3 s"):
        server.wait_result(1, 0.3)
    assert time.monotonic() - t0 < 2
    server.close()


def test_a_stale_result_is_skipped():
    server, clients = start(1)
    clients[0].send(pc.encode_result(1, StepResult([1])))
    clients[0].send(pc.encode_result(2, StepResult([2])))
    kind, payload = server.wait_result(2, 5.0)
    assert pc.decode_result(kind, payload).token_ids == [2]
    server.close()


def test_a_connection_without_the_secret_never_joins():
    server = ChannelServer(1, local=False)
    intruder = socket.create_connection((server.address.tcp_host, server.address.tcp_port))
    intruder.sendall(pc.header(pc.RESULT_MAGIC, pc.HELLO, -1, struct.pack("<i", 0) + b"guess"))
    real = []
    t = threading.Thread(target=lambda: real.append(ChannelClient(server.address, 0, 10.0)))
    t.start()
    server.accept(10.0)
    t.join()
    assert server.socks[0] is not None
    # the intruder's connection was closed: it reads EOF
    intruder.settimeout(5)
    assert intruder.recv(1) == b""
    server.close()
