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
