"""Hostile input, the fast subset of scripts/fuzz.py (the ≥ 2,000-request run is in
docs/RELIABILITY.md): a few hundred schema-driven requests against the real app over real HTTP
(uvicorn, a real coordinator with the tiny model), and generated deployment configs.

The seed is fixed so CI is repeatable; `python -m raydecode.scripts.fuzz` draws a new one.
"""
import pytest
import torch

from raydecode.scripts import fuzz

torch.set_num_threads(1)
SEED = 20261129


@pytest.fixture(scope="module")
def server():
    srv = fuzz.start_local_server()
    yield srv
    srv.stop()


def test_http_fuzz_no_5xx_openai_errors_canary_unaffected(server):
    r = fuzz.fuzz_http(server.url, 300, SEED, app=server.server.config.app)
    assert r.requests >= 300
    assert r.failures == [], r.failures[:5]
    # the generated requests reached generation, validation, routing and the body limit
    assert {"200", "400", "404", "413"} <= set(r.by_status), r.by_status
    assert not any(s.startswith("5") for s in r.by_status), r.by_status
    # a greedy canary ran meanwhile and always got the undisturbed answer
    assert r.canary_requests >= 3 and r.canary_bad == []
    # healthy, idle, and no hostile request ever failed a step (e.g. a 65-bit seed)
    assert r.end_state["ok"], r.end_state
    assert r.fixed["seed beyond 64 bits"][0] == 400
    # an oversized body is refused from its Content-Length, before 16 MiB are read and parsed
    status, seconds = r.fixed["16 MiB prompt, refused before reading"]
    assert status == 413 and seconds < 2.0


def test_config_fuzz_accepts_or_names_the_error():
    r = fuzz.fuzz_config(300, SEED)
    assert r.configs == 300
    assert r.config_failures == [], r.config_failures[:5]
    assert 0 < r.configs_accepted < r.configs      # both sides of the validation reached
