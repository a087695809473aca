"""A 30-second load smoke of scripts/load.py against `raydecode serve`'s stack (local Ray, Serve,
the tiny model): two concurrency levels of mixed completions/chat, streaming and not, through
the official openai client; every answer checked; latency percentiles and the RSS of the
server's processes reported. The 10-minute runs (concurrency 1 → 64) are in
docs/RELIABILITY.md."""
import asyncio

import pytest
import torch

from raydecode.scripts import load

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def url():
    u = load.start_server(load.tiny_config(load.free_port(), max_num_seqs=16), num_cpus=2)
    yield u
    load.stop_server()


def test_30_second_load_smoke(url):
    report = asyncio.run(load.run_load(url, "tiny", [2, 8], 30.0, 400, seed=1,
                                       rss_period_s=2.0, log=lambda s: None))
    assert 25 <= report["duration_s"] <= 120
    assert report["requests"] >= 10
    # every answer had finish_reason 'length' and exactly max_tokens tokens (ignore_eos)
    assert report["failed"] == 0, [lv["errors"] for lv in report["levels"]]
    for lv in report["levels"]:
        assert lv["ok"] > 0 and lv["tokens_per_s"] > 0
        assert 0 < lv["ttft_p50"] <= lv["ttft_p99"]
        assert 0 < lv["tpot_p50"] <= lv["tpot_p99"]
    # higher concurrency: more requests in flight, so more tokens per second in total
    assert report["levels"][1]["tokens_per_s"] > report["levels"][0]["tokens_per_s"]
    # the server's processes were found and sampled (this run's Ray only)
    roles = report["rss"]["roles"]
    assert {"ingress", "coordinator", "proxy", "total"} <= set(roles), roles
    assert all(r["min_mib"] > 20 for r in roles.values())
    assert roles["total"]["spread"] < 0.25, roles["total"]
