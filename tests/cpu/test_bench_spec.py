"""scripts/bench/spec.py on the CPU (tiny config, eager, a solo TP2 rank): the report's shape,
effective tok/s from the measured step, the two summary keys, the batch·(k+1) ≤ 64 rule, exactly
L accepted drafts per step under synthetic acceptance with drafts on this rank's vocab rows,
the drafter's taps at fewer layers, and the KDA state after a step that accepted L drafts
against stepping its L + 1 tokens one at a time."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from raydecode.models.cache import StepBatch
from raydecode.models.config import load_config
from raydecode.scripts.bench import spec

torch.set_num_threads(1)


def test_spec_bench_cpu(tmp_path):
    out, png = tmp_path / "spec.json", tmp_path / "spec.png"
    steps, warmup = 1, 1
    assert spec.main(["--config", "tiny", "--device", "cpu", "--tp", "2", "--ks", "2,3",
                      "--accepts", "1,3", "--batches", "1,16,22", "--context", "24",
                      "--steps", str(steps), "--warmup", str(warmup), "--out", str(out),
                      "--png", str(png), "--runners", "graphed,eager"]) == 0
    rep = json.loads(out.read_text())
    assert tuple(rep["summary"]) == spec.SUMMARY_KEYS          # exactly the two, null here
    assert set(rep["summary"].values()) == {None}
    assert rep["synthetic"] and rep["outputs_meaningless"] and rep["verify_graphed"]
    assert rep["runners"] == ["graphed", "eager"]
    assert "synthetic" in rep["acceptance"] and "eager" in rep["verify_note"]
    assert rep["layers"] == rep["layers_total"] == 6 and rep["gpu"] is None
    (run,) = rep["runs"]
    assert run["tp"] == 2 and run["drafter"]["taps"] == [0, 2, 4]
    assert run["drafter"]["heads_on_rank"] == 2
    # batch·(k+1) ≤ 64: b16 k3 (64) runs, b22 (66, 88) does not, nor its baseline
    assert sorted((s["batch"], s["k"]) for s in run["skipped"]) == [(22, 2), (22, 3)]
    assert all(s["verify_tokens"] > 64 for s in run["skipped"])
    assert set(run["baseline"]) == {"1", "16"}
    got = sorted((r["runner"], r["batch"], r["k"], r["accepted"]) for r in run["rows"])
    cases = [(1, 2, 1), (1, 3, 1), (1, 3, 3), (16, 2, 1), (16, 3, 1), (16, 3, 3)]
    assert got == sorted((n, *c) for n in ("eager", "graphed") for c in cases)
    for r in run["rows"]:
        B, k, L = r["batch"], r["k"], r["accepted"]
        assert r["verify_tokens"] == B * (k + 1) <= 64
        assert r["path"] == ("specialized" if k >= 3 else "stock")      # the envelope
        # the spec graphs take the specialized verify steps (eager statics on the CPU); the
        # stock path and the eager runner stay eager
        graphed = r["runner"] == "graphed" and r["path"] == "specialized"
        n = 2 * (warmup + steps)
        assert r["runner_counts"] == ({"graphed": n, "eager": 0} if graphed else
                                      {"graphed": 0, "eager": n})
        assert r["synthetic"] and r["synthetic_length"] == L + 1
        # every sequence of every step (plain and staged, warm-up included) accepted exactly L
        assert r["accepted_per_sequence_step"] == {str(L): B * 2 * (warmup + steps)}
        assert r["accepted_as_asked"]
        assert r["effective_tok_s"] == pytest.approx(B * (L + 1) / (r["step_ms"] * 1e-3),
                                                     rel=1e-4)
        base = run["baseline"][str(B)]
        assert base["variant"] == "specialized" and base["logits_finite"]
        assert base["tok_s"] == pytest.approx(B / (base["ms"] * 1e-3))
        assert r["nonspec_tok_s"] == base["tok_s"]
        assert r["spec_over_nonspec"] == pytest.approx(r["effective_tok_s"] / base["tok_s"])
        assert set(r["stage_ms"]) == set(spec.STAGES)
        assert all(v > 0 for v in r["stage_ms"].values())
        assert r["stage_sum_ms"] == pytest.approx(sum(r["stage_ms"].values()), abs=1e-3)
    pytest.importorskip("matplotlib")
    assert png.stat().st_size > 0


def test_summary_takes_b1_k7_l6_per_tp():
    rows = [{"batch": 1, "k": 7, "accepted": 5, "spec_over_nonspec": 1.5},
            {"batch": 1, "k": 7, "accepted": 6, "spec_over_nonspec": 1.75},
            {"batch": 2, "k": 7, "accepted": 6, "spec_over_nonspec": 2.0}]
    assert spec.summarize([{"tp": 16, "rows": rows}]) == {
        "spec_over_nonspec_k7_L6_b1_tp16": 1.75, "spec_over_nonspec_k7_L6_b1_tp8": None}
    assert spec.summarize([{"tp": 8, "rows": rows[:1]}]) == dict.fromkeys(spec.SUMMARY_KEYS)


def test_drafter_taps_follow_the_layer_cut():
    cfg = load_config("k3")
    assert spec.drafter_config("k3", cfg).target_layer_ids == (2, 23, 47, 71, 89)
    cut = spec.drafter_config("k3", spec.layer_config("k3", 8))
    assert cut.target_layer_ids == (0, 1, 4, 6, 7) and cut.target_num_layers == 8
    assert (cut.hidden_size, cut.num_layers, cut.context_width) == (7168, 5, 5 * 7168)
    with pytest.raises(ValueError, match="taps"):
        spec.drafter_config("k3", spec.layer_config("k3", 4))


def test_kda_state_after_accepting_L_equals_stepping_its_tokens():
    """One step at k = 3 accepting L = 1: each slot's KDA conv tail and state equal those of
    decoding [anchor, d_1] one token at a time from the pre-step caches (float32), and one token
    fewer is visibly different (the tolerance tells one token apart)."""
    cfg = load_config("tiny")
    model, _ = spec.build_model(cfg, 2, "cpu", 0, dtype=torch.float32)
    drafter = spec.build_drafter(spec.drafter_config("tiny", cfg), model, 1)
    spec.keep_drafts_on_rank_(drafter, spec.rank_vocab_rows(model))
    rank = spec.SpecRank(model, drafter, "cpu", 2, 24, 64)
    rank.start(2)
    k, L = 3, 1
    rank.step(k, L, "specialized", False)                 # the fresh slots' reset step
    caches = rank.runner.caches
    before = copy.deepcopy(caches)
    seqs = {s: (q.pos, q.anchor) for s, q in rank.seqs.items()}
    _, emitted, stages = rank.step(k, L, "specialized", True)
    assert set(stages) == set(spec.STAGES)
    before.mla.block_tables.update(caches.mla.block_tables)
    with torch.inference_mode():
        for (slot, (pos, anchor)), e in zip(seqs.items(), emitted):
            assert len(e) == L + 1 and all(t in rank.vocab for t in e)   # drafts on the rank
            errs = []
            for j, t in enumerate([anchor] + e[:L]):
                model(torch.tensor([t]), StepBatch.decode([slot], [pos + j]), before,
                      path="specialized")
                errs.append(max(float((a[:, slot] - b[:, slot]).abs().max()) for a, b in
                                ((caches.kda.conv, before.kda.conv),
                                 (caches.kda.rec, before.kda.rec))))
            assert errs[-1] < 1e-4, errs
            assert errs[-2] > 100 * max(errs[-1], 1e-6), errs
