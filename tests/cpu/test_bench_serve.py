"""scripts/bench/serve.py on the CPU with the tiny model (the GPU run uses K3 TP16 rank 0): the
whole served stack — Serve, coordinator, a rank actor's step loop — answers every level, the
report has the issue's summary keys, only token ids crossed from the rank, and the served greedy
tokens equal an in-process engine's on the same weights."""
import json

from raydecode.scripts.bench import serve


def test_serve_bench_cpu_smoke(tmp_path):
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    assert serve.main(["--config", "tiny", "--device", "cpu", "--tp", "1", "--levels", "1,2",
                       "--prompt-tokens", "6", "--output-tokens", "12", "--graph-steps", "2",
                       "--out", str(out), "--png", str(png)]) == 0
    rep = json.loads(out.read_text())
    assert set(rep["summary"]) == {"served_over_graphed_c1", "served_over_graphed_c16",
                                   "served_over_graphed_c64"}
    assert rep["summary"]["served_over_graphed_c1"] > 0
    assert rep["greedy_check"]["served_equals_in_process"] is True
    for row in rep["levels"]:
        assert row["failed"] == 0 and row["tpot_ms_p50"] > 0
        cp = row["control_plane"]
        # ≤ 40 bytes per sample row: token ids, never a logits row (4·V bytes)
        assert 0 < cp["result_bytes_per_step"] <= 40 * row["concurrency"]
        assert row["steps_by_path"]["specialized"] > 0
        b = row["step_breakdown_ms"]     # nested parts: each inside the one that holds it
        assert 0 < b["rank0_step"] < b["execute_all"] * 1.05 + 0.05
        # cycle = engine + handoff per step (the first step of a round has no cycle)
        assert b["loop_handoff"] >= 0 and b["loop_cycle"] > 0
        assert abs(b["loop_engine"] + b["loop_handoff"] - b["loop_cycle"]) \
            < 0.25 * b["loop_cycle"] + 0.2
    assert png.stat().st_size > 1000
