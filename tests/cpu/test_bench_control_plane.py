"""scripts/bench/control_plane.py at a small scale: real rank actors with the trivial runner, every
variant measured, the summary keys present and the served channel faster than a Ray call per
rank (the number the issue moves; the 16-rank figure comes from the GPU host's 16 cores)."""
import json

from raydecode.scripts.bench import control_plane


def test_control_plane_bench_runs_every_variant(tmp_path):
    out = tmp_path / "cp.json"
    assert control_plane.main(["--ranks", "1,2", "--batches", "1,8", "--steps", "60",
                               "--warm", "10", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert set(rep["summary"]) == {"overhead_ms_p50_16_ranks", "overhead_ms_p50_4_ranks"}
    rows = {(g["ranks"], r["variant"], r["batch"], r.get("switch_interval_ms")): r
            for g in rep["groups"] for r in g["rows"]}
    assert len(rows) == 2 * 4 * 2 + 2 * 2 * 2          # + channel_gil_busy at 5 and 0.2 ms
    rows = {k[:3]: r for k, r in rows.items() if k[3] in (None, 0.2)}
    busy = [r for g in rep["groups"] for r in g["rows"] if r["variant"] == "channel_gil_busy"]
    assert {r["switch_interval_ms"] for r in busy} == {5.0, 0.2}
    assert all(r["steps"] == 60 and r["mean_ms"] > 0 for r in busy)
    for n in (1, 2):
        for b in (1, 8):
            ch, ray_call = rows[(n, "channel", b)], rows[(n, "ray_call", b)]
            assert "error" not in ch and "error" not in rows[(n, "channel_tcp", b)]
            assert ch["p50_ms"] < ray_call["p50_ms"], (n, b, ch, ray_call)
    assert rep["groups"][1]["transports"] == ["uds", "uds"]
