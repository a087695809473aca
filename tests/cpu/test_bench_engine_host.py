"""scripts/bench/engine_host.py: the report has the summary keys and each variant; the full
decode of every output, per token, costs more than the incremental decoder once outputs are a
few hundred tokens long (what the served path now does)."""
import json

from raydecode.scripts.bench import engine_host


def test_engine_host_bench_smoke(tmp_path):
    out = tmp_path / "eh.json"
    assert engine_host.main(["--batches", "16,64", "--after", "400,1000", "--steps", "20",
                             "--repeats", "1", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert set(rep["summary"]) == {"host_ms_b64_after1000", "full_over_incremental_b64_after1000"}
    assert rep["summary"]["host_ms_b64_after1000"] > 0
    for row in rep["rows"]:
        assert set(row["ms"]) == {"incremental", "full_decode"}
        assert row["ms"]["full_decode"] > 1.3 * row["ms"]["incremental"], row
