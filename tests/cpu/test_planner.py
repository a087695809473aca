"""Capacity planner (scripts/planner*.py, `raydecode plan`): memory, errors, the step-time
model's bookkeeping, benchmark-JSON and catalog inputs, workload sizing, CLI and JSON output."""
import dataclasses
import json
import math
import time

import pytest

from raydecode.cli import build_parser, main
from raydecode.models import params as P
from raydecode.models.config import load_config
from raydecode.scripts import planner as PL
from raydecode.scripts.planner_hw import PlanError, find_gpu, load_catalog
from raydecode.scripts.planner_perf import (KERNELS, Efficiency, collective_us, load_efficiency,
                                            step_time)


@pytest.fixture(scope="module")
def k3():
    return load_config("k3")


@pytest.fixture(scope="module")
def cat():
    return load_catalog()


def gb300(cat):
    return find_gpu(cat, "gb300")


# ---- memory ------------------------------------------------------------------------------------

@pytest.mark.parametrize("tp", [8, 16])
def test_memory_budget_arithmetic(k3, cat, tp):
    g = gb300(cat)
    dep = PL.Deployment(tp=tp, context=4096, batch=3)
    m = PL.memory(k3, g, dep)
    assert m["hbm"] == 288e9 and m["usable"] == pytest.approx(0.9 * 288e9)
    assert m["weights"] == pytest.approx(sum(P.weight_bytes_per_rank(k3, tp, "stock").values()))
    assert m["cache_budget"] == pytest.approx(m["usable"] - m["weights"] - m["workspace"])
    heads = 96 // tp
    per_seq = 4096 * 27_648 + 69 * (heads * 128 * 128 * 4 + 3 * heads * 128 * 3 * 2)
    assert m["bytes_per_seq"] == per_seq and m["cache_used"] == 3 * per_seq
    assert m["max_concurrency"] == int(m["cache_budget"] // per_seq)
    # the max context at batch 3 fills the budget to within one token per sequence
    c = m["max_context_at_batch"]
    assert 3 * (c * 27_648 + per_seq - 4096 * 27_648) <= m["cache_budget"]
    assert 3 * ((c + 1) * 27_648 + per_seq - 4096 * 27_648) > m["cache_budget"] or \
        c == k3.max_position_embeddings


def test_memory_dcp_and_dspark(k3, cat):
    g = gb300(cat)
    m1 = PL.memory(k3, g, PL.Deployment(tp=16, dcp=1))
    m4 = PL.memory(k3, g, PL.Deployment(tp=16, dcp=4))
    assert m4["kv_bytes_per_token"] == m1["kv_bytes_per_token"] / 4
    assert m4["max_context_single"] >= m1["max_context_single"]
    md = PL.memory(k3, g, PL.Deployment(tp=16, dspark_k=7, acceptance=6.0))
    assert md["drafter"] == pytest.approx(P.drafter_bytes_per_rank(k3, 16))
    assert md["kv_bytes_per_token"] == (24 + 5) * 576 * 2


def test_kda_snapshots_come_out_of_the_cache_budget(k3, cat):
    g = gb300(cat)
    base = PL.memory(k3, g, PL.Deployment(tp=16, context=32768))
    snap = PL.memory(k3, g, PL.Deployment(tp=16, context=32768, kda_snapshots=32))
    per = base["kda_state_bytes_per_seq"]                   # 28.09 MB at TP16
    assert snap["kda_snapshots"] == 32 * per and base["kda_snapshots"] == 0
    assert snap["cache_budget"] == pytest.approx(base["cache_budget"] - 32 * per)
    assert snap["max_concurrency"] <= base["max_concurrency"]
    with pytest.raises(PlanError, match=r"--kda-snapshots -1: expected an integer >= 0"):
        PL.plan(k3, g, PL.Deployment(kda_snapshots=-1))


def test_prefill_experts_ogs_hopper_holds_a_second_copy_of_the_routed_experts(k3, cat):
    """RAYDECODE_PREFILL_EXPERTS=ogs-hopper (engine/loader.py `prepare_prefill_experts`): the
    routed experts again, padded, out of the cache budget; a deployment it does not fit says
    so and names the setting."""
    g = gb300(cat)
    base = PL.memory(k3, g, PL.Deployment(tp=16))
    ogs = PL.memory(k3, g, PL.Deployment(tp=16, prefill_experts="ogs-hopper"))
    routed = base["weights_by_kind"]["routed_experts"]
    assert base["prefill_experts_copy"] == 0.0
    assert ogs["prefill_experts_copy"] == pytest.approx(routed * PL.PREFILL_COPY_PAD)
    assert ogs["weights"] == pytest.approx(base["weights"] + routed * PL.PREFILL_COPY_PAD)
    assert ogs["cache_budget"] == pytest.approx(base["cache_budget"] - routed * PL.PREFILL_COPY_PAD)
    for kind in ("split", "blocked", "hybrid", "ogs"):
        assert PL.memory(k3, g, PL.Deployment(tp=16, prefill_experts=kind))["weights"] == \
            base["weights"]
    with pytest.raises(PlanError, match=r"--prefill-experts: prefill experts 'fast'; accepted: "
                                        r"auto, "):
        PL.plan(k3, g, PL.Deployment(prefill_experts="fast"), sweep=False)
    with pytest.raises(PlanError, match=r"'auto\+down_bn=x'.*down_bn='x'; expected an integer"):
        PL.plan(k3, g, PL.Deployment(prefill_experts="auto+down_bn=x"), sweep=False)
    assert PL.memory(k3, g, PL.Deployment(tp=16, prefill_experts="auto+fuse_situ=1"))[
        "weights"] == base["weights"]
    with pytest.raises(PlanError, match=r"over by .*--prefill-experts auto \(its Hopper copy "
                                        r"of the experts: [0-9.]+ GB"):
        PL.plan(k3, find_gpu(cat, "GB200"), PL.Deployment(tp=16, prefill_experts="ogs-hopper"),
                sweep=False)


# ---- bad input -------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,gpu,match", [
    ({"tp": 5}, "GB300", r"96 MLA heads.*\[1, 2, 4, 8, 16, 32\]"),
    ({"tp": 16, "dcp": 3}, "GB300", r"--dcp 3 must divide --tp 16"),
    ({"context": 2_000_000}, "GB300", r"1,048,576"),
    ({"tp": 16}, "H100", r"exceeds the NVLink domain of H100 \(8 GPUs\)"),
    ({"tp": 8}, "H200", r"over by [0-9.]+ GB.*GPU with more HBM"),
    ({"tp": 8}, "GB200", r"over by [0-9.]+ GB.*--tp 16"),
    ({"tp": 16, "batch": 64, "context": 1_000_000}, "GB300",
     r"over by.*--batch <= \d+.*--context <=.*--dcp 16 .*more HBM"),
    ({"dspark_k": 9, "acceptance": 3.0}, "GB300", r"blocks of 7"),
    ({"dspark_k": 7}, "GB300", r"needs --acceptance-length"),
    ({"dspark_k": 3, "acceptance": 5.0}, "GB300", r"\[1, 4\]"),
])
def test_bad_input_says_what_to_change(k3, cat, kw, gpu, match):
    with pytest.raises(PlanError, match=match):
        PL.plan(k3, find_gpu(cat, gpu), PL.Deployment(**kw), sweep=False)


def test_unknown_gpu_lists_known(cat):
    with pytest.raises(PlanError, match="B300, GB200, GB300, H100, H200"):
        find_gpu(cat, "A100")


# ---- the step-time model's bookkeeping --------------------------------------------------------

@pytest.mark.parametrize("path", ["stock", "specialized"])
def test_every_piece_is_read_by_exactly_one_kernel(k3, path):
    reads = P.decode_reads(k3, 16, path, seqs=2, context=100)
    reads.update(P.drafter_reads(k3, 16, path, seqs=2, k=4, context=100))
    for kind, pieces in reads.items():
        used = [r for kern in KERNELS[path][kind] for r in kern.reads]
        for piece in pieces:
            assert used.count(piece) == 1, (path, kind, piece)


def test_kernel_time_is_bytes_over_bandwidth_or_floor(k3, cat):
    g = gb300(cat)
    eff = Efficiency.defaults()
    r = P.Read(bytes=70e6)
    from raydecode.scripts.planner_perf import sublayer_time
    t = sublayer_time(k3, "markov_step", {"markov": r}, 1, "specialized", 1, 1, g, eff)
    assert t.us == pytest.approx(70e6 / (8e12 * 0.875) * 1e6)
    tiny = sublayer_time(k3, "markov_step", {"markov": P.Read(bytes=10)}, 1, "specialized", 1,
                         1, g, eff)
    assert tiny.us == eff.launch_floor_us
    # stock: between DESIGN's H200 points: 2048×7168 bf16 at its ideal time → 2.2/4.8
    ideal = 2048 * 7168 * 2 / 4.8e12 * 1e6
    assert eff.mem_eff("stock", ideal) == pytest.approx(2.2 / 4.8)
    assert eff.mem_eff("stock", 1e-3) == pytest.approx(1.6 / 4.8)


def test_collective_latency_model(cat):
    g, eff = gb300(cat), Efficiency.defaults()
    ring = collective_us("all_reduce", 16, 14336, "stock", g, eff)
    assert ring == pytest.approx(8.0 + 2 * 15 / 16 * 14336 / 900e9 * 1e6)
    one = collective_us("all_reduce", 16, 14336, "specialized", g, eff)
    assert one == pytest.approx(3.0 + 15 * 14336 / 900e9 * 1e6)


def test_step_time_grows_with_batch_and_specialized_is_faster(k3, cat):
    g, eff = gb300(cat), Efficiency.defaults()
    prev = {}
    for b in (1, 8, 32, 64):
        for p in ("stock", "specialized"):
            s = step_time(k3, g, eff, p, 16, 1, b, 2048)
            assert s.us > prev.get(p, 0)
            prev[p] = s.us
        assert prev["specialized"] < prev["stock"]
    kinds = step_time(k3, g, eff, "stock", 16, 1, 1, 2048).layer_kinds_us(k3)
    assert {k: v["layers"] for k, v in kinds.items()} == {"kda+dense": 1, "kda+moe": 68,
                                                          "mla+moe": 24}


def test_envelope():
    assert PL.runs_as("specialized", 64) == "specialized"
    assert PL.runs_as("specialized", 65) == "stock"
    assert PL.runs_as("specialized", 8, k=7) == "specialized"     # 8 · 8 = 64
    assert PL.runs_as("specialized", 9, k=7) == "stock"
    assert PL.runs_as("specialized", 1, k=2) == "stock"          # k ∉ [3, 7]
    assert PL.runs_as("stock", 1) == "stock"


def test_anchors_use_the_same_model_as_a_plan(k3, cat):
    g = gb300(cat)
    rows = {a["anchor"]: a for a in PL.anchors(k3, g, Efficiency.defaults())}
    assert len(rows) == len(PL.ANCHORS)
    r = PL.plan(k3, g, PL.Deployment(tp=16, batch=64, context=PL.ANCHOR_CONTEXT), sweep=False)
    a = rows["batch 64, specialized (aggregate)"]
    assert a["predicted_tok_s"] == pytest.approx(r["speed"]["specialized"]["tok_s"])
    assert a["error_pct"] == pytest.approx(100 * (a["predicted_tok_s"] / 3606.0 - 1))
    d = PL.plan(k3, g, PL.Deployment(tp=16, dspark_k=7, acceptance=6.0,
                                     context=PL.ANCHOR_CONTEXT), sweep=False)
    assert rows["DSpark k=7 L=6, batch 1, specialized"]["predicted_tok_s"] == \
        pytest.approx(d["speed"]["specialized"]["tok_s"])


# ---- benchmark JSON and catalog ---------------------------------------------------------------

def test_bench_json_replaces_defaults(k3, cat, tmp_path):
    (tmp_path / "gemv-h200.json").write_text(json.dumps({
        "gpu": "NVIDIA H200", "hbm_bytes_per_s": 4.3e12,
        "results": [{"impl": "specialized", "n": 1024, "k": 7168, "m": 1, "dtype": "bf16",
                     "achieved_bytes_per_s": 2.4e12},
                    {"impl": "specialized", "n": 16384, "k": 7168, "m": 1,
                     "achieved_bytes_per_s": 2.4e12}]}))
    (tmp_path / "comm-gb300.json").write_text(json.dumps({
        "results": [{"impl": "oneshot", "op": "all_reduce", "ranks": 16, "bytes": 14336,
                     "latency_us": 5.5}]}))
    (tmp_path / "gemv-broken.json").write_text("{not json")
    eff, notes = load_efficiency(tmp_path, cat)
    assert eff.mem_eff("specialized", 10.0) == pytest.approx(2.4 / 4.8)   # catalog H200 peak
    assert eff.alpha_us["specialized"] == 5.5
    assert eff.curves["stock"] == Efficiency.defaults().curves["stock"]
    assert any(n.startswith("skipped gemv-broken.json") for n in notes)
    g = gb300(cat)
    slow = step_time(k3, g, eff, "specialized", 16, 1, 1, 2048).us
    assert slow > step_time(k3, g, Efficiency.defaults(), "specialized", 16, 1, 1, 2048).us


def test_bench_json_in_gemv_script_format(cat, tmp_path):
    """The row form scripts/bench/gemv.py writes: both impls per shape, M sweep."""
    rows = [{"N": n, "K": 7168, "M": m, "weight_bytes": n * 7168 * 2,
             "cublas_bytes_per_s": cb, "cute_bytes_per_s": cu, "name": "x", "tp": 8}
            for n, m, cb, cu in ((1024, 1, 1.5e12, 3.6e12), (16384, 1, 4.0e12, 4.1e12),
                                 (1024, 64, 0.1e12, 0.1e12))]
    rows.append({"name": "dup", "tp": 16, "same_as": "1024x7168 M=1"})
    (tmp_path / "gemv-h200-x.json").write_text(json.dumps({
        "gpu": "NVIDIA H200", "hbm": {"read_reduction_bytes_per_s": 4.3e12}, "results": rows}))
    eff, notes = load_efficiency(tmp_path, cat)
    assert notes == ["read gemv-h200-x.json (4 points)"]            # M=64 and same_as skipped
    small = 1024 * 7168 * 2 / 4.8e12 * 1e6
    assert eff.mem_eff("stock", small) == pytest.approx(1.5 / 4.8)
    assert eff.mem_eff("specialized", small) == pytest.approx(3.6 / 4.8)
    assert eff.mem_eff("specialized", 1e3) == pytest.approx(4.1 / 4.8)
    # without a catalog match the measured read bandwidth is the reference
    eff2, _ = load_efficiency(tmp_path, {})
    assert eff2.mem_eff("stock", 1e-3) == pytest.approx(1.5 / 4.3)


def test_measured_control_plane_enters_the_step_and_the_served_tpot(k3, cat, tmp_path):
    """A control-plane-*.json (scripts/bench/control_plane.py) replaces the estimated control
    plane: per step exactly its channel p50 for the fewest measured ranks >= TP, linear in
    batch; the served TPOT a plan reports is the step with it, per token."""
    rows = [{"variant": "channel", "batch": b, "p50_ms": ms} for b, ms in ((1, 0.2), (64, 0.6))]
    rows.append({"variant": "ray_call", "batch": 1, "p50_ms": 9.0})       # not the served one
    (tmp_path / "control-plane-h200-x.json").write_text(json.dumps({"groups": [
        {"ranks": 4, "rows": rows[:2]}, {"ranks": 16, "rows": [dict(r, p50_ms=r["p50_ms"] * 2)
                                                               for r in rows]}]}))
    eff, notes = load_efficiency(tmp_path, cat)
    assert "read control-plane-h200-x.json (4 points)" in notes
    assert eff.control_plane_us(4, 1) == pytest.approx(200.0)
    assert eff.control_plane_us(8, 1) == pytest.approx(400.0)       # 16 ranks' points
    assert eff.control_plane_us(16, 64) == pytest.approx(1200.0)
    assert eff.control_plane_us(16, 32) == pytest.approx(400 + 31 / 63 * 800)
    g = gb300(cat)
    base = dataclasses.replace(eff, control_plane=())
    a = step_time(k3, g, eff, "specialized", 16, 1, 1, 2048)
    b = step_time(k3, g, base, "specialized", 16, 1, 1, 2048)
    assert a.us - b.us == pytest.approx(400.0) and a.control_plane_us == pytest.approx(400.0)
    dep = PL.Deployment(tp=16, batch=1, context=2048)
    s = PL.speed(k3, g, eff, dep, "specialized", 1)
    assert s["served_tpot_ms"] == pytest.approx(s["step_us"] / 1e3)
    assert s["control_plane_us"] == pytest.approx(400.0)


def test_measured_served_host_work_enters_the_served_tpot(k3, cat, tmp_path):
    """A serve-*.json (scripts/bench/serve.py, one rank) gives the coordinator's host work per
    step: served TPOT p50 − graphed step − the 1-rank channel, linear in batch; it enters the
    step and the served TPOT; a negative difference counts as 0."""
    rows = [{"variant": "channel", "batch": b, "p50_ms": ms} for b, ms in ((1, 0.1), (64, 0.3))]
    (tmp_path / "control-plane-h200-x.json").write_text(json.dumps({"groups": [
        {"ranks": 1, "rows": rows}, {"ranks": 16, "rows": rows}]}))
    (tmp_path / "serve-h200-x.json").write_text(json.dumps({"levels": [
        {"concurrency": 1, "tpot_ms_p50": 7.0, "graphed_step_ms": 6.0},
        {"concurrency": 64, "tpot_ms_p50": 60.0, "graphed_step_ms": 44.0},
        {"concurrency": 4, "tpot_ms_p50": 10.0, "graphed_step_ms": 11.0}]}))
    eff, notes = load_efficiency(tmp_path, cat)
    assert "read serve-h200-x.json (3 points)" in notes
    assert eff.host_us(1) == pytest.approx(900.0)                 # 1000 − 100 µs channel
    assert eff.host_us(4) == pytest.approx(0.0)                   # noise: never negative
    assert eff.host_us(64) == pytest.approx(16000.0 - 300.0)
    assert eff.host_us(34) == pytest.approx(0 + 30 / 60 * 15700.0)
    g = gb300(cat)
    a = step_time(k3, g, eff, "specialized", 16, 1, 1, 2048)
    b = step_time(k3, g, dataclasses.replace(eff, host=()), "specialized", 16, 1, 1, 2048)
    assert a.us - b.us == pytest.approx(900.0) and a.host_us == pytest.approx(900.0)
    s = PL.speed(k3, g, eff, PL.Deployment(tp=16, batch=1, context=2048), "specialized", 1)
    assert s["host_us"] == pytest.approx(900.0)
    assert s["served_tpot_ms"] == pytest.approx(s["step_us"] / 1e3)


def test_the_newest_serve_run_by_its_date_wins_over_name_order(k3, cat, tmp_path):
    """Two serve runs of one day: `-r2` sorts before the first by name, but its `date` is
    later, so its points are the ones read; a file that is not JSON is skipped with a note."""
    first = {"date": "2026-12-02T10:00:00+00:00", "levels": [
        {"concurrency": 1, "tpot_ms_p50": 9.0, "graphed_step_ms": 6.0}]}
    second = {"date": "2026-12-02T15:00:00+00:00", "levels": [
        {"concurrency": 1, "tpot_ms_p50": 6.5, "graphed_step_ms": 6.0}]}
    (tmp_path / "serve-h200-2026-12-02.json").write_text(json.dumps(first))
    (tmp_path / "serve-h200-2026-12-02-r2.json").write_text(json.dumps(second))
    (tmp_path / "serve-h200-broken.json").write_text("{not json")
    eff, notes = load_efficiency(tmp_path, cat)
    assert "read serve-h200-2026-12-02-r2.json (1 points)" in notes
    assert any(n.startswith("skipped serve-h200-broken.json") for n in notes)
    assert eff.host_us(1) == pytest.approx(500.0 - eff.control_plane_us(1, 1))


def test_measured_prefill_mfu_replaces_the_estimate(cat, tmp_path):
    """The newest prefill-*.json of the served kernels sets prefill_mfu (its longest prompt);
    a newer `--kernels reference` run (the baseline) is not what a replica runs: ignored."""
    def doc(date, kernels, rows):
        return json.dumps({"date": date, "kernels": kernels, "runs": [{"tp": 16, "prompts": [
            {"prompt_tokens": n, "mfu": m} for n, m in rows]}]})
    (tmp_path / "prefill-h200-a.json").write_text(
        doc("2026-12-02T10:00:00", "prefill", [(1024, 0.03), (32768, 0.115), (8192, 0.12)]))
    (tmp_path / "prefill-h200-b.json").write_text(
        doc("2026-12-02T11:00:00", "reference", [(8192, 0.025)]))
    # a newer run without a prompt case (cut short before it): nothing to read, no warning
    (tmp_path / "prefill-h200-c.json").write_text(json.dumps(
        {"date": "2026-12-02T12:00:00", "kernels": "prefill", "runs": [{"tp": 16}]}))
    eff, notes = load_efficiency(tmp_path, cat)
    assert eff.prefill_mfu == pytest.approx(0.115)
    assert "read prefill-h200-a.json (prefill MFU 0.115)" in notes
    assert not any("prefill-h200-c.json" in n for n in notes)
    assert "prefill-h200-a.json" in eff.sources["prefill_mfu"]
    (tmp_path / "prefill-h200-a.json").unlink()
    eff, _ = load_efficiency(tmp_path, cat)
    assert eff.prefill_mfu == Efficiency.defaults().prefill_mfu


def test_prefill_mfu_is_the_deployments_expert_kernels(cat, tmp_path):
    """With kind A/B rows in one run, the planner reads the rows of the deployment's
    RAYDECODE_PREFILL_EXPERTS (auto: ours, shipped or named auto; ogs-hopper: its own rows),
    and an older run without the kind for the other (rows of earlier runs name no kind: the
    defaults of their day)."""
    def doc(date, rows):
        return json.dumps({"date": date, "kernels": "prefill", "runs": [{"tp": 16, "prompts": [
            dict({"prompt_tokens": n, "mfu": m}, **kw) for n, m, kw in rows]}]})
    (tmp_path / "prefill-h100-old.json").write_text(doc("2026-12-01T10:00:00", [
        (8192, 0.30, {})]))
    (tmp_path / "prefill-h100-ab.json").write_text(doc("2026-12-07T10:00:00", [
        (8192, 0.426, {"prefill_experts": "ogs-hopper", "shipped": False}),
        (8192, 0.350, {"prefill_experts": "auto", "shipped": True})]))
    assert load_efficiency(tmp_path, cat)[0].prefill_mfu == pytest.approx(0.350)
    eff, notes = load_efficiency(tmp_path, cat, prefill_experts="ogs-hopper")
    assert eff.prefill_mfu == pytest.approx(0.426) and "ogs-hopper experts" in \
        eff.sources["prefill_mfu"]
    # a run whose shipped kind was ogs-hopper (the setting on): not the default deployment's
    (tmp_path / "prefill-h100-ogs.json").write_text(doc("2026-12-08T10:00:00", [
        (8192, 0.43, {"prefill_experts": "ogs-hopper", "shipped": True})]))
    assert load_efficiency(tmp_path, cat)[0].prefill_mfu == pytest.approx(0.350)
    assert load_efficiency(tmp_path, cat, prefill_experts="ogs-hopper")[0].prefill_mfu == \
        pytest.approx(0.43)
    assert load_efficiency(tmp_path, cat, prefill_experts="split")[0].prefill_mfu == \
        Efficiency.defaults().prefill_mfu              # no split row anywhere: the estimate


def test_prefill_mfu_skips_the_every_row_final_mix_baseline(cat, tmp_path):
    """A run with --final-mix rows,all: the planner reads the rows of the served form (the
    final mix on the sample rows), whichever order the rows come in, never the baseline's."""
    rows = [{"prompt_tokens": 131072, "mfu": 0.379, "prefill_experts": "auto",
             "final_mix": "all", "shipped": False},
            {"prompt_tokens": 131072, "mfu": 0.385, "prefill_experts": "auto",
             "final_mix": "rows", "shipped": True}]
    for order in (rows, rows[::-1]):
        (tmp_path / "prefill-h100-fm.json").write_text(json.dumps(
            {"date": "2026-12-07T22:00:00", "kernels": "prefill",
             "runs": [{"tp": 16, "prompts": order}]}))
        assert load_efficiency(tmp_path, cat)[0].prefill_mfu == pytest.approx(0.385)


def test_missing_bench_dir_gives_defaults(tmp_path):
    eff, notes = load_efficiency(tmp_path / "absent")
    assert eff == Efficiency.defaults() and notes == []


def test_catalog_extension_and_validation(tmp_path):
    f = tmp_path / "hw.yaml"
    f.write_text("gpus:\n  X200:\n    hbm_gb: 500\n    hbm_tb_s: 10\n    nvlink_gb_s: 900\n"
                 "    nvlink_domain: 32\n    bf16_tflops: 3000\n")
    cat = load_catalog([f])
    assert find_gpu(cat, "x200").hbm_bytes == 500e9 and "GB300" in cat
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpus:\n  Y:\n    hbm_gb: 1\n    hbm_tb_s: 1\n    nvlink_gb_s: 1\n"
                   "    nvlink_domain: 8\n    bf16_tflops: 1\n    hbm_gib: 3\n")
    with pytest.raises(PlanError, match="hbm_gib"):
        load_catalog([bad])


# ---- workload ----------------------------------------------------------------------------------

def test_workload_sizing_meets_target_with_fewest_replicas(k3, cat):
    g = gb300(cat)
    wl = PL.Workload(concurrent_users=1000, input_len=1024, output_len=512, target_tps_user=60)
    dep = PL.Deployment(tp=16, context=2048)
    r = PL.plan(k3, g, dep, wl, price=10.0, sweep=False)
    f = r["fleet"]
    assert f["replicas"] * f["users_per_replica"] >= 1000
    assert f["tok_s_user"] >= 60
    assert f["domains"] == math.ceil(f["replicas"] / (72 // 16))
    assert f["gpus"] == 16 * f["replicas"]
    # one replica fewer cannot hold the users at the target
    u = math.ceil(1000 / (f["replicas"] - 1))
    s = PL.speed(k3, g, Efficiency.defaults(), dep, "specialized", u, detail=False)
    assert u > f["batch_limit_target"] or s["tok_s_user"] * (1 - f["prefill_share"]) < 60
    assert f["usd_per_million_output_tokens"] == pytest.approx(
        f["replicas"] * 16 * 10.0 / (f["output_tok_s"] * 3600) * 1e6)


def test_unreachable_target_warns(k3, cat):
    r = PL.plan(k3, gb300(cat), PL.Deployment(tp=16, context=4096),
                PL.Workload(requests_per_s=1.0, target_tps_user=10_000), sweep=False)
    assert any("out of reach" in w for w in r["warnings"])
    assert r["fleet"]["users_per_replica"] == 1


# ---- CLI ------------------------------------------------------------------------------------

def test_help_documents_every_input():
    parser = build_parser(only="plan")
    sub = next(a for a in parser._actions if a.dest == "command").choices["plan"]
    opts = [a for a in sub._actions if a.option_strings and a.dest != "help"]
    assert len(opts) >= 25
    for a in opts:
        assert a.help and len(a.help) > 10, a.option_strings


def test_cli_run_json_fields_and_speed(capsys):
    t0 = time.process_time()
    rc = main(["plan", "--model", "k3", "--gpu", "GB300", "--tp", "16", "--batch", "4",
               "--context", "16384", "--json", "--concurrent-users", "200",
               "--input-len", "4096", "--output-len", "1024", "--target-tps-user", "40"])
    cpu = time.process_time() - t0
    assert rc == 0 and cpu < 2.0
    r = json.loads(capsys.readouterr().out)
    for key in ("model", "gpu", "deployment", "memory", "capacity", "speed", "sweep", "cost",
                "fleet", "anchors", "efficiency", "warnings"):
        assert key in r
    assert r["memory"]["kv_bytes_per_token"] == 27_648
    assert r["memory"]["kda_state_bytes_per_seq"] == 28_085_760
    # the deployment default keeps 32 KDA snapshots per rank for prefix caching
    assert r["deployment"]["kda_snapshots"] == 32
    assert r["memory"]["kda_snapshots"] == 32 * 28_085_760
    assert r["speed"]["specialized"]["batch"] == 4
    assert set(r["speed"]["specialized"]["layer_kinds"]) == {"kda+dense", "kda+moe", "mla+moe"}
    assert [a["public_tok_s"] for a in r["anchors"]] == [256.4, 136.0, 3606.0, 842.0, 488.0]
    assert r["sweep"][0]["batch"] == 1 and r["sweep"][-1]["specialized"]["runs_as"] == "stock"
    assert r["fleet"]["replicas"] >= 1


def test_cli_table_errors_and_tiny(capsys, tmp_path):
    assert main(["plan", "--tp", "5"]) == 2
    assert "does not divide the 96 MLA heads" in capsys.readouterr().err
    assert main(["plan", "--gpu", "nope"]) == 2
    assert "known: B300" in capsys.readouterr().err
    assert main(["plan", "--model", "tiny", "--gpu", "H100", "--tp", "4", "--batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "tiny on H100 (TP4" in out and "public anchors" not in out
    assert main(["plan", "--model", "tiny", "--gpu", "H100", "--tp", "2", "--anchors"]) == 0
    assert "public anchors" in capsys.readouterr().out


def test_cli_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["plan", "--plot", str(tmp_path), "--batch", "2"]) == 0
    for name in ("tok_s_user_vs_batch.png", "memory_breakdown.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


# ---- issue 30: suggestions that fit, --context, the repo's own bench files, wording, docs ------

def _suggested(msg: str, flag: str) -> list[int]:
    import re
    return [int(x) for x in re.findall(rf"{flag} (\d+)", msg)]


@pytest.mark.parametrize("tp", [8, 16])
def test_cache_error_suggests_only_what_fits(k3, cat, tp):
    """TP16/TP8 at batch 64, 131k context: every --tp / --dcp / --batch / --context the error
    proposes is checked to fit (it once proposed --tp 32, still 34.8 GB over)."""
    g = gb300(cat)
    dep = PL.Deployment(tp=tp, batch=64, context=131072)
    with pytest.raises(PlanError) as e:
        PL.check_fits(k3, g, dep, PL.memory(k3, g, dep))
    msg = str(e.value)
    for t in _suggested(msg, "--tp"):
        if t != tp:
            assert PL._fits(k3, g, PL.Deployment(tp=t, batch=64, context=131072)), msg
    for d in _suggested(msg, "--dcp"):
        assert PL._fits(k3, g, PL.Deployment(tp=tp, dcp=d, batch=64, context=131072)), msg
    for b in _suggested(msg, "--batch <="):
        assert PL._fits(k3, g, PL.Deployment(tp=tp, batch=b, context=131072)), msg
    assert not any(t > tp for t in _suggested(msg, "--tp")) or "more HBM" not in msg
    if not any(PL._fits(k3, g, PL.Deployment(tp=t, batch=64, context=131072))
               for t in PL.larger_tps(k3, g, tp)):
        assert "more HBM" in msg and not [t for t in _suggested(msg, "--tp") if t != tp]


@pytest.mark.parametrize("ctx", [0, -5])
def test_non_positive_context_is_not_told_to_shorten(k3, cat, ctx):
    with pytest.raises(PlanError) as e:
        PL.validate(k3, gb300(cat), PL.Deployment(context=ctx))
    assert "positive" in str(e.value) and "shorter" not in str(e.value)


def test_repo_bench_results_read_without_warnings(cat):
    from raydecode.commands.plan import _default_bench_dir

    _, notes = load_efficiency(_default_bench_dir(), cat)
    assert notes and not [n for n in notes if n.startswith("skipped")], notes


def test_envelope_warning_names_the_tp_set(cat):
    r = PL.plan(load_config("tiny"), find_gpu(cat, "H200"), PL.Deployment(tp=2, context=512),
                sweep=False)
    w = [x for x in r["warnings"] if "outside the specialized envelope" in x]
    assert w and "TP ∈ {8, 16}" in w[0] and "(8, 16)" not in w[0]


def test_planner_doc_anchor_table_is_the_planners_output(k3, cat):
    """docs/PLANNER.md's anchors table, as `raydecode plan` prints it with the repo's bench."""
    import re
    from pathlib import Path

    from raydecode.commands.plan import _default_bench_dir

    doc = (Path(__file__).resolve().parents[2] / "docs" / "PLANNER.md").read_text()
    table = doc.split("## Public anchors", 1)[1].split("Reading the errors", 1)[0]
    rows = {m[0].strip(): float(m[1].replace(",", ""))
            for m in re.findall(r"^\| ([^|]+) \| [\d,.]+ \| ([\d,.]+) \|", table, re.M)}
    eff, _ = load_efficiency(_default_bench_dir(), cat)
    got = {a["anchor"]: a["predicted_tok_s"] for a in PL.anchors(k3, gb300(cat), eff)}
    assert set(rows) == set(got)
    for k, v in got.items():
        assert rows[k] == round(v, 1), k


def test_dspark_step_from_the_measured_spec_bench(k3, cat, tmp_path):
    """A committed all-layer spec-*.json (graphed runner) sets the DSpark step: the modeled
    decode step × the measured spec/non-spec step ratio (median over L, linear in batch);
    a fewer-layer run or the eager runner's rows are not read."""
    def doc(layers, runner, ratios, date):
        rows = [{"runner": runner, "k": 7, "batch": b, "accepted": L,
                 "step_ms": r * 10.0 + L * 0.01, "nonspec_ms": 10.0}
                for b, r in ratios.items() for L in (1, 6, 7)]
        return {"date": date, "layers": layers, "layers_total": 93, "runs": [{"rows": rows}]}
    (tmp_path / "spec-a.json").write_text(json.dumps(doc(93, "graphed", {1: 2.0, 8: 4.0},
                                                         "2026-12-01T00:00:00")))
    (tmp_path / "spec-b.json").write_text(json.dumps(doc(24, "graphed", {1: 9.0},
                                                         "2026-12-02T00:00:00")))
    (tmp_path / "spec-c.json").write_text(json.dumps(doc(93, "eager", {1: 9.0},
                                                         "2026-12-03T00:00:00")))
    eff, notes = load_efficiency(tmp_path)
    assert any("spec-a.json" in n for n in notes) and "spec-a.json" in eff.sources["spec_ratio"]
    assert eff.spec_step_ratio(7, 1) == pytest.approx(2.006)         # the median, L = 6
    assert eff.spec_step_ratio(7, 4) == pytest.approx(2.006 + 3 / 7 * 2.0)
    assert eff.spec_step_ratio(5, 1) is None
    g = gb300(cat)
    dep = PL.Deployment(tp=16, dspark_k=7, acceptance=6.0, context=2048)
    got = PL.speed(k3, g, eff, dep, "specialized", 1, detail=False)
    plain = PL.speed(k3, g, eff, PL.Deployment(tp=16, context=2048), "specialized", 1,
                     detail=False)
    assert got["step_us"] == pytest.approx(plain["step_us"] * 2.006)
    assert got["tok_s"] == pytest.approx(6 * 1e6 / got["step_us"])
    assert got["spec_step"].startswith("measured: 2.006")
    k5 = PL.speed(k3, g, eff, PL.Deployment(tp=16, dspark_k=5, acceptance=4.0, context=2048),
                  "specialized", 1, detail=False)
    assert k5["spec_step"].startswith("modeled")
    assert PL.memory(k3, g, dep)["spec_per_position_state"] == pytest.approx(
        64 * PL.memory(k3, g, dep)["kda_state_bytes_per_seq"])
