"""The fast rows of the fault matrix (scripts/faults.py) on real Ray Serve, real rank processes
and real HTTP through the official `openai` client; the full matrix runs from
`python -m raydecode.scripts.faults` (docs/RELIABILITY.md).

- A rank worker of the TP=2 group is SIGKILLed in the middle of 4 streaming requests: all 4
  complete with exactly the text and token ids of an undisturbed run of the same requests (on
  the stock pool, from their generated prefix), the fail-over counter shows 4, the replica
  rebuilds a new group and serves again (issue 4).
- A rank worker is SIGSTOPped (it hangs, it does not die): the step deadline turns it into the
  same fail-over, the stopped process is gone afterwards.
- The Serve ingress replica is SIGKILLed mid-stream: with the proxy guard, every request in
  flight gets a 503 + Retry-After or a service_unavailable SSE event (never a bare 500 or a
  cut connection), and a new replica serves the same requests as before.
"""
import pytest
import torch

from raydecode.scripts import faults

torch.set_num_threads(1)
STEP_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def stack():
    s = faults.ServeStack(tp=2, step_timeout_s=STEP_TIMEOUT_S).start()
    yield s
    s.close()


def completed_all(res) -> bool:
    return [q["kind"] for q in res.requests] == ["completed"] * len(res.requests)


def test_killed_rank_mid_stream_4_streams_complete_as_undisturbed(stack):
    res = faults.rank_kill(stack, n_stream=4, n_unary=0, probes=False)
    assert res.checks["fault injected mid-stream"], res
    assert len(res.requests) == 4 and all(q["stream"] for q in res.requests)
    # 'completed' = finish_reason length, 32 tokens, text and ids equal to the undisturbed run
    assert completed_all(res), res.requests
    assert res.counters["failover_requests_total"] == 4, res.counters
    assert res.counters["failover_events_total"] == 1 and res.counters["rebuilds_total"] == 1
    assert res.checks["old rank processes gone"] and res.checks["a new rank group serves"]
    assert res.checks["same requests complete after recovery, as undisturbed"]
    assert res.holds, {k: v for k, v in res.checks.items() if not v}


def test_hung_rank_becomes_a_fail_over_at_the_step_deadline(stack):
    res = faults.rank_hang(stack, n_stream=3, n_unary=1, probes=False)
    assert completed_all(res), res.requests
    assert res.counters["failover_requests_total"] == 4, res.counters
    assert res.checks["the failure names the missed step deadline"]
    # the requests waited for the deadline, not for ever
    assert STEP_TIMEOUT_S <= res.seconds["requests_after_fault"] < STEP_TIMEOUT_S + 60
    assert res.checks["old rank processes gone (the stopped one too)"]
    assert res.holds, {k: v for k, v in res.checks.items() if not v}


def test_killed_serve_replica_gives_clean_retriable_errors_and_comes_back(stack):
    res = faults.replica_kill(stack)
    kinds = {q["kind"] for q in res.requests}
    assert kinds <= {"retriable", "completed"}, res.requests
    for q in res.requests:
        if q["kind"] == "retriable" and not q["stream"]:
            assert q["status"] == 503 and q["retry_after"] == "5"
        elif q["kind"] == "retriable":
            assert q["error"] == "stream_error:service_unavailable"
    assert "failed" not in res.outcomes and "lost" not in res.outcomes
    assert res.checks["a new ingress replica serves"]
    assert res.holds, {k: v for k, v in res.checks.items() if not v}
