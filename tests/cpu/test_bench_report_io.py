"""scripts/bench/report_io.py: every benchmark's JSON carries the header fields the house rules
ask for (GPU, commit, date) and the writer records the run's wall time when given its start."""
import datetime
import json
import time

from raydecode.scripts.bench.report_io import report_header, write_report


def test_header_names_commit_date_and_versions_and_keeps_extras():
    h = report_header("abc123", tp=16, results=[])
    assert h["commit"] == "abc123" and h["tp"] == 16 and h["results"] == []
    assert {"gpu", "torch", "triton"} <= h.keys()
    age = datetime.datetime.now(datetime.timezone.utc) - datetime.datetime.fromisoformat(h["date"])
    assert abs(age.total_seconds()) < 60


def test_write_sets_wall_time_only_when_given_a_start(tmp_path):
    p = tmp_path / "r.json"
    write_report({"a": 1}, str(p))
    assert json.loads(p.read_text()) == {"a": 1}
    rep = {"a": 2}
    write_report(rep, str(p), time.time() - 5)
    got = json.loads(p.read_text())
    assert got["a"] == 2 and 5 <= got["wall_s"] < 60 and rep["wall_s"] == got["wall_s"]
