"""scripts/bench/prefix_cache.py on the CPU with the tiny model (the GPU run uses K3 TP16 rank
0): through Ray Serve, the coordinator and a rank actor's step loop, two agent turns sharing a
2,000-token prefix; with caching the second turn reports >= 1,900 cached tokens and a TTFT
under 0.2x the first's, without caching none and about the first's; float32, so the tokens of
both deployments are identical (docs: bfloat16 agent turns may differ on random weights)."""
import json

from raydecode.scripts.bench import prefix_cache


def test_prefix_cache_bench_cpu(tmp_path):
    out = tmp_path / "prefix_cache.json"
    assert prefix_cache.main(["--config", "tiny", "--device", "cpu", "--tp", "1",
                              "--dtype", "float32", "--repeats", "1", "--warmup", "0",
                              "--output-tokens", "6",
                              "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    s = rep["summary"]
    assert {"cached_tokens_turn2", "ttft_ratio_turn2_over_turn1",
            "outputs_identical"} <= set(s)
    assert s["cached_tokens_turn2"] >= 1900 and s["prompt_tokens_turn2"] > 2048
    assert s["ttft_ratio_turn2_over_turn1"] <= 0.2, s
    assert s["ttft_ratio_turn2_over_turn1_uncached"] > 0.5, s
    assert s["outputs_identical"] is True
    on, off = rep["cached"], rep["uncached"]
    assert on["prefix_cache_hits"] >= 1 and off["prefix_cache_hits"] is None
    assert on["prefill_tokens"] < off["prefill_tokens"] / 1.5
    assert all(r["turn2"]["cached_tokens"] == 0 for r in off["runs"])
    assert rep["gpu"] is None and rep["commit"]
