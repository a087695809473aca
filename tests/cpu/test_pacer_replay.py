"""scripts/explore/pacer_replay.py: the pacer replayed on a paced schedule's measured step
times (a synthetic source here: chunk steps 2 ms + 10 µs per token, decode steps 4 ms)."""
import json

import pytest

from raydecode.scripts.explore import pacer_replay


def _source(tmp_path, samples):
    row = {"mode": "split", "pacer_limit": 2.0, "decodes": 63, "prompt_tokens": 4096,
           "chunk_cap": 448, "prompt_ttft_s": 9.9, "p99_over_decode_only": 2.5,
           "samples": samples}
    p = tmp_path / "src.json"
    p.write_text(json.dumps({"gpu": "X", "commit": "abc", "date": "d",
                             "runs": [{"schedule": [row]}]}))
    return p


def test_replay_settles_where_the_measured_line_fits(tmp_path):
    samples = [{"chunk_tokens": n, "chunk_ms": 2.0 + 0.01 * n, "decode_ms": 4.0}
               for n in (16, 256) for _ in range(12)]
    out = tmp_path / "r.json"
    pacer_replay.main(["--source", str(_source(tmp_path, samples)), "--out", str(out),
                       "--seeds", "2"])
    rep = json.loads(out.read_text())
    assert rep["source_gpu"] == "X" and rep["measured"]["source_pacer_prompt_s"] == 9.9
    for r in rep["runs"]:
        chosen = {int(k): v for k, v in r["chunks_chosen"].items()}
        assert sum(n * c for n, c in chosen.items()) == 4096     # the prompt, once
        assert sum(chosen.values()) == r["pairs"]
        # the allowance is one decode step (4 ms): 128 tokens (3.28 ms) fit, 256 (4.56) not
        assert max(chosen, key=chosen.get) == 128
        assert r["p99_over_decode_only"] <= 2.0 + 1e-9     # reprobes: under 1 % of pairs
        assert r["infeasible"] == 0


def test_replay_needs_two_sampled_sizes(tmp_path):
    samples = [{"chunk_tokens": 16, "chunk_ms": 2.2, "decode_ms": 4.0}] * 12
    with pytest.raises(SystemExit, match="fewer than two chunk sizes"):
        pacer_replay.main(["--source", str(_source(tmp_path, samples)),
                           "--out", str(tmp_path / "r.json")])


def test_replay_takes_the_stretch_and_refuses_a_bad_one(tmp_path):
    """Chunk steps with a large fixed cost (8 ms + 10 µs per token) against 4 ms decode steps
    at limit 2: nothing fits, so at stretch 4 the chunk is the smallest size keeping 1/4 of
    the cap's rate (448 tokens per 16.48 ms of chunk + decode step: 27.2 per ms, a quarter
    6.8; 128: 9.6, 64: 5.1), at stretch 1 the cap."""
    samples = [{"chunk_tokens": n, "chunk_ms": 8.0 + 0.01 * n, "decode_ms": 4.0}
               for n in (16, 256) for _ in range(12)]
    src = _source(tmp_path, samples)
    for stretch, want in (("4", 128), ("1", 448)):
        out = tmp_path / f"r{stretch}.json"
        pacer_replay.main(["--source", str(src), "--out", str(out), "--seeds", "1",
                           "--stretch", stretch])
        rep = json.loads(out.read_text())
        assert rep["stretch"] == float(stretch)
        r = rep["runs"][0]
        chosen = {int(k): v for k, v in r["chunks_chosen"].items()}
        assert max(chosen, key=chosen.get) == want and r["stretched"] > 0.9 * r["pairs"]
    with pytest.raises(SystemExit):
        pacer_replay.main(["--source", str(src), "--out", str(tmp_path / "x.json"),
                           "--stretch", "0.5"])


def _mixed_source(tmp_path, name, cost, chunks, decodes=63, prompt=4096):
    """A prefill JSON with one fixed-chunk mixed schedule row per chunk size: every step's
    time `cost(step bucket)` ms; the decode-only median 4 ms."""
    rows = []
    for c in chunks:
        samples = [{"pos": p, "mixed_ms": cost(1 << (min(c, prompt - p) + decodes - 1)
                                               .bit_length())}
                   for p in range(0, prompt, c)]
        rows.append({"mode": "mixed", "decodes": decodes, "prompt_tokens": prompt,
                     "chunk_tokens": c, "tpot_ms_decode_only": 4.0, "samples": samples})
    p = tmp_path / name
    p.write_text(json.dumps({"gpu": "X", "commit": "abc", "date": "d",
                             "runs": [{"schedule": rows}]}))
    return p


def test_mixed_replay_pools_the_step_buckets_and_fills_one(tmp_path):
    """Mixed steps costing 5 / 6 / 9 ms in step buckets 128 / 256 / 512 (whatever the chunk
    inside), decode 4 ms, limit 1.6 (6.4 ms): the pacer settles on 193 tokens, the chunk that
    fills bucket 256 beside 63 rows; two sources' rows pool into one table per bucket."""
    table = {128: 5.0, 256: 6.0, 512: 9.0}
    a = _mixed_source(tmp_path, "a.json", table.get, [64, 128])
    b = _mixed_source(tmp_path, "b.json", table.get, [256, 448])
    out = tmp_path / "r.json"
    pacer_replay.main(["--mode", "mixed", "--limit", "1.6", "--cap", "448", "--source",
                       f"{a},{b}", "--out", str(out), "--seeds", "2"])
    rep = json.loads(out.read_text())
    assert rep["mode"] == "mixed" and rep["limit"] == 1.6 and rep["chunk_cap"] == 448
    # 64-token chunks: 64 steps of 127 tokens; 128: 32 of 191; 256: 16 of 319; 448: 9 of
    # 511 and the last 64 tokens in one of 127
    assert rep["measured"]["step_buckets_sampled"] == {"128": 64 + 1, "256": 32,
                                                       "512": 16 + 9}
    for r in rep["runs"]:
        chosen = {int(k): v for k, v in r["chunks_chosen"].items()}
        assert sum(n * c for n, c in chosen.items()) == 4096
        assert max(chosen, key=chosen.get) == 256 - 63
        assert r["p50_over_decode_only"] == pytest.approx(1.5)


def test_mixed_replay_refuses_sources_of_other_schedules(tmp_path):
    a = _mixed_source(tmp_path, "a.json", lambda k: 5.0, [64])
    b = _mixed_source(tmp_path, "b.json", lambda k: 5.0, [64], decodes=31)
    with pytest.raises(SystemExit, match="pool one schedule"):
        pacer_replay.main(["--mode", "mixed", "--limit", "1.6", "--source", f"{a},{b}",
                           "--out", str(tmp_path / "r.json")])
    with pytest.raises(SystemExit, match="give --limit"):
        pacer_replay.main(["--mode", "mixed", "--source", str(a),
                           "--out", str(tmp_path / "r.json")])
