"""scripts/explore/host_step_inputs.py: one run times the shipped host inputs against the
forms they replaced, after checking both give the same values; the JSON names each case."""
from __future__ import annotations

import json

import pytest

from raydecode.scripts.explore import host_step_inputs as H


def test_host_step_inputs_writes_both_forms_per_case(tmp_path):
    out = tmp_path / "h.json"
    assert H.main(["--out", str(out), "--reps", "2"]) == 0
    rep = json.loads(out.read_text())
    assert rep["bench"] == "host_step_inputs" and rep["commit"] and rep["date"]
    cases = [(r["case"], r.get("width")) for r in rep["rows"]]
    assert cases == [("decode_meta", 65), ("decode_meta", 2100), ("token_ids", None)]
    for r in rep["rows"]:
        assert r["shipped_ms"] > 0 and r["baseline_ms"] > 0
        assert r["speedup"] == pytest.approx(r["baseline_ms"] / r["shipped_ms"], rel=1e-2)


def test_host_step_inputs_refuses_no_reps():
    with pytest.raises(SystemExit, match="--reps 0: expected ≥ 1"):
        H.main(["--out", "unused.json", "--reps", "0"])
