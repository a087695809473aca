"""scripts/bench/prefill.py on the CPU (tiny config, eager: no graphs, no kernel count): the
report's shape, the FLOP model against the analytic inventory of models/params.py, chunked
prefill through the bench's Scheduler-driven chunks against a one-shot prefill, and the
extrapolation of a prompt cut short."""
from __future__ import annotations

import json

import pytest
import torch

from raydecode.models import params
from raydecode.models.config import load_config
from raydecode.models.k3 import K3ForCausalLM, init_random_
from raydecode.models.parallel import Parallel
from raydecode.scripts.bench import prefill
from raydecode.scripts.bench.random_init import SoloRankComm

torch.set_num_threads(1)


def test_prefill_bench_cpu(tmp_path):
    out, png = tmp_path / "prefill.json", tmp_path / "prefill.png"
    assert prefill.main(["--config", "tiny", "--device", "cpu", "--tp", "2",
                         "--prompts", "64,160", "--prefill-budget", "32", "--mixed-decodes", "3",
                         "--context", "24", "--random-counts", "4", "--repeats", "2",
                         "--gc-modes", "live,frozen",
                         "--steps", "2", "--out", str(out), "--png", str(png)]) == 0
    rep = json.loads(out.read_text())
    # the three keys, null here: no TP16 run (tiny has 4 heads) and no CUDA kernel count
    assert tuple(rep["summary"]) == prefill.SUMMARY_KEYS
    assert set(rep["summary"].values()) == {None}
    assert rep["layers"] == rep["layers_total"] == 6 and rep["all_layers_scale"] == 1
    assert rep["flops_method"] == prefill.FLOPS_METHOD and rep["gpu"] is None
    rate = rep["dense_bf16"]["flops_per_s"]
    (run,) = rep["runs"]
    assert run["tp"] == 2 and "stock_kernels_b1" not in run
    p64, p160 = run["prompts"]
    assert [p["chunks_total"] for p in (p64, p160)] == [2, 5]
    assert [p["chunks_run"] for p in (p64, p160)] == [2, 5]
    assert not p64["extrapolated"] and not p160["extrapolated"]
    assert p160["ttft_s"] > p64["ttft_s"] > 0
    assert p160["ttft_s"] == pytest.approx(sum(p160["chunk_ms"]) / 1e3, rel=1e-3)
    fm = run["flops_model"]
    for p in (p64, p160):        # the scheduler's chunks: 32 tokens at 0, 32, 64, ...
        want = sum(prefill.chunk_flops(fm, pos, 32) for pos in range(0, p["prompt_tokens"], 32))
        assert p["flops"] == pytest.approx(want)
        assert p["mfu"] == pytest.approx(p["flops"] / p["ttft_s"] / rate)
        assert p["prefill_tok_s"] == pytest.approx(p["prompt_tokens"] / p["ttft_s"])
    rc = run["random_counts"]
    assert rc["counts_run"] == 4 and not rc["truncated"] and rc["jit_compiles_after_warmup"] is None
    assert rc["gc_modes"] == ["live", "frozen"] and list(rc["modes"]) == ["live", "frozen"]
    buckets = [1, 2, 4, 8, 16, 32]
    for kind in ("prefill", "mixed"):
        assert sorted(int(b) for b in rc["steady_ms"][kind]) == buckets
        assert set(run["warmup_first_ms"][kind]) == {str(b) for b in buckets}
    assert sorted(int(b) for b in rc["steady_ms"]["start"]) == buckets
    for mode in rc["modes"].values():
        assert mode["counts_run"] == 4
        for r in mode["rows"]:
            assert 1 <= r["tokens"] <= 32
            assert r["bucket"] == min(b for b in buckets if b >= r["tokens"])
            for kind in ("prefill", "mixed", "start"):       # start: a new prompt, at 0
                steady = rc["steady_ms"][kind][str(r["bucket"])]
                assert r[kind]["first_over_steady"] == pytest.approx(
                    r[kind]["first_ms"] / steady, abs=2e-3)
                assert r[kind]["gc_ms"] >= 0 and r[kind]["new_segments"] == 0   # CPU: none
        over = [r for r in mode["rows"] if max(r[k]["first_over_steady"]
                                               for k in ("prefill", "mixed", "start")) > 2.0]
        assert mode["over_2x"] == len(over) == len(mode["over_2x_gc_ms"])
    # the top-level figures are the last mode's
    assert rc["max_first_over_steady"] == rc["modes"]["frozen"]["max_first_over_steady"]
    assert rc["max_first_over_steady"]["mixed"] == max(
        r["mixed"]["first_over_steady"] for r in rc["modes"]["frozen"]["rows"])
    mx = run["mixed"]
    assert mx["decodes"] == 3 and mx["chunk_tokens"] == 32
    assert mx["mixed_over_decode_stock"] == pytest.approx(
        mx["tpot_ms_mixed"] / mx["tpot_ms_decode_only_stock"], abs=2e-3)
    # tiny TP2 bf16 runs the specialized decode (eagerly on the statics here)
    split = mx["ms"]["chunk_alone"] + mx["ms"]["decode_graphed"]
    assert mx["tpot_ms_split"] == pytest.approx(split, abs=2e-3)
    # --router balanced (the default): the bias set on a budget-sized step, no prompt fits
    # one step here, so no random-router baseline row
    rb = run["router_balance"]
    assert rep["router"] == "balanced" and "prompt_random_router" not in run
    assert rb["tokens"] == 32 and len(rb["max_over_mean_per_pass"]) == rb["passes"] == 3
    assert rb["after"]["mean"]["max_over_mean"] <= rb["before"]["mean"]["max_over_mean"]
    # the routing of a budget-sized step (32 tokens): every MoE layer of the tiny model
    rt, moe = run["routing"], prefill.load_config("tiny").moe
    n_moe = sum(prefill.load_config("tiny").is_moe_layer(i) for i in range(6))
    assert rt["tokens"] == 32 and rt["experts"] == moe.num_experts
    assert len(rt["layers"]) == n_moe > 0
    for layer in rt["layers"]:
        assert layer["pairs"] == 32 * moe.top_k
        assert 1 <= layer["experts_touched"] <= moe.num_experts
        assert layer["max_over_mean"] >= 1.0 and layer["chunks"] >= layer["experts_touched"]
    pytest.importorskip("matplotlib")
    assert png.stat().st_size > 0


def test_routing_balance_counts_chunks_against_a_balanced_routing(monkeypatch):
    """The routing record on routes the test sets: 64 tokens × top-2 over 8 experts, all
    on experts 0 and 1 (2 experts touched, 64 pairs each: 1 chunk of 128 each), against a
    balanced routing's 8 experts × ⌈16 / 128⌉ = 8 chunks."""
    from raydecode.models import moe as moe_mod

    class Rank:
        model = type("M", (), {"cfg": type("C", (), {"moe": type("E", (), {
            "num_experts": 8})})})

        def step(self, tokens, decodes, pos=None):
            ids = torch.tensor([[0, 1]] * (tokens or decodes))
            moe_mod.route_topk(ids)
            moe_mod.route(ids)

    def fake(ids):
        return None, ids

    monkeypatch.setattr(moe_mod, "route_topk", fake)
    monkeypatch.setattr(moe_mod, "route", fake)
    rt = prefill.routing_balance(Rank(), 64)
    assert [x["experts_touched"] for x in rt["layers"]] == [2, 2]
    assert rt["layers"][0] == {"pairs": 128, "experts_touched": 2, "max_over_mean": 1.0,
                               "chunks": 2, "chunks_balanced": 8}
    assert rt["chunks_over_balanced"] == pytest.approx(0.25)
    assert moe_mod.route_topk is fake and moe_mod.route is fake       # put back
    # the streams' routing: one decode-only step of 5 rows
    rt = prefill.routing_balance(Rank(), 0, decodes=5)
    assert rt["decodes"] == 5 and rt["layers"][0]["pairs"] == 10


def test_balance_router_spreads_a_skewed_routing_in_place():
    """Two layers' routers on fixed logits that favour experts 0-1 (512 tokens, top-2 of 8):
    the bias, updated in place on the tensors the routes use, brings each layer's max / mean
    load from ≈ 4 to within 10 % of even, and the records say so before and after."""
    from raydecode.models import moe as moe_mod
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(512, 8, generator=g) + torch.tensor([3.0, 2.5] + [0.0] * 6)
              for _ in range(2)]
    biases = [torch.zeros(8) for _ in range(2)]

    class Rank:
        model = type("M", (), {"cfg": type("C", (), {"moe": type("E", (), {
            "num_experts": 8})})})

        def step(self, tokens, decodes, pos=None):
            for lg, b in zip(logits, biases):
                moe_mod.route(lg[:tokens], b, 2)

    rb = prefill.balance_router(Rank(), 512)
    assert rb["before"]["mean"]["max_over_mean"] > 2.5
    assert rb["after"]["mean"]["max_over_mean"] < 1.1
    assert rb["max_over_mean_per_pass"][0] > 2.5 and rb["max_over_mean_per_pass"][-1] < 1.1
    assert all(b.abs().sum() > 0 for b in biases)          # the routes' own tensors
    for lg, b in zip(logits, biases):
        _, ids = moe_mod.route(lg, b, 2)
        load = torch.bincount(ids.reshape(-1), minlength=8).float()
        assert load.max() / load.mean() < 1.1


@pytest.mark.parametrize("config,tp", [("tiny", 1), ("tiny", 2), ("tiny", 4), ("k3", 16),
                                       ("k3", 8)])
def test_flop_model_counts_the_rank_inventory(config, tp):
    """The parameters counted on the built rank equal models/params.py's analytic per-rank
    counts of the stock layout (an MXFP4 byte holds two parameters)."""
    cfg = load_config(config)
    par = Parallel(0, tp)
    with torch.device("meta"):
        m = K3ForCausalLM(cfg, par, SoloRankComm(par), torch.bfloat16)
    fm = prefill.flop_model(m)
    inv = params.inventory(cfg)

    def count(keep) -> int:
        return sum(t.rank_numel(tp, "stock") * t.copies for t in inv if keep(t.kind))

    assert fm["dense_params"] == count(lambda k: k not in ("embedding", "lm_head",
                                                            "routed_experts"))
    assert fm["routed_params"] == count(lambda k: k == "routed_experts")
    assert fm["lm_head_params"] == count(lambda k: k == "lm_head")
    assert fm["routed_share"] == cfg.moe.top_k / cfg.moe.num_experts
    # a chunk's FLOPs: linear in its tokens, attention growing with its position
    one = prefill.chunk_flops(fm, 0, 1)
    assert one == pytest.approx(2 * fm["active_params"] + 2 * fm["lm_head_params"]
                                + fm["mla_layers"] * 2 * fm["mla_heads"]
                                * (fm["mla_qk_dim"] + fm["mla_v_dim"])
                                + fm["kda_layers"] * 7 * fm["kda_heads"] * fm["kda_dk"]
                                * fm["kda_dv"])
    assert prefill.chunk_flops(fm, 1000, 8) > prefill.chunk_flops(fm, 0, 8)


def test_chunked_prefill_matches_one_shot_and_extrapolates():
    """The Scheduler-driven chunks (positions, block tables, resets) give the first token's
    logits of a one-shot prefill of the same prompt (float32); a prompt cut short by its time
    limit runs its first and last chunks and extrapolates the rest."""
    cfg = load_config("tiny")
    model = init_random_(K3ForCausalLM(cfg, Parallel(), SoloRankComm(Parallel()),
                                       torch.float32), 5)
    rank = prefill.PrefillRank(model, "cpu", 70, 16, 2, 8)
    ids = rank.ids(70)
    chunks, logits, first = rank.prompt(ids)
    assert [(p, n) for p, n, _ in chunks] == [(0, 16), (16, 16), (32, 16), (48, 16), (64, 6)]
    with torch.inference_mode():
        h = model(torch.tensor(ids))                        # caches=None: naive, one step
        want = model.compute_logits(h[-1:]).float()
    rel = float((logits - want).abs().max() / want.abs().max())
    assert rel < 1e-4, rel
    assert first == int(want.argmax())
    cut, _, _ = rank.prompt(rank.ids(70), max_seconds=0.0)
    assert [t is None for *_, t in cut] == [False, True, True, True, False]
    ttft, fit = prefill.ttft_of(cut)
    assert fit is not None and ttft > sum(t for *_, t in cut if t is not None)
    # the slot's own table is shipped again for the bench's next chunk step
    assert rank.pending[rank.slot] == rank.tables[rank.slot]


def test_ttft_extrapolation_and_buckets():
    # seconds per token 0.1 at mean position 5 and 0.3 at 25: 0.2 at 15, so 2 s for the middle
    ttft, fit = prefill.ttft_of([(0, 10, 1.0), (10, 10, None), (20, 10, 3.0)])
    assert ttft == pytest.approx(6.0) and fit["skipped_s"] == pytest.approx(2.0)
    assert prefill.ttft_of([(0, 4, 0.5), (4, 2, 0.25)]) == (0.75, None)
    assert prefill.buckets_for(32) == [1, 2, 4, 8, 16, 32]
    assert prefill.buckets_for(48) == [1, 2, 4, 8, 16, 32, 48]
    assert prefill.buckets_for(1) == [1]
    rate = prefill.dense_bf16_rate("cpu")
    assert rate["n"] == 256 and rate["flops_per_s"] > 0


@pytest.mark.parametrize("argv,match", [
    (["--prompts", "0"], "--prompts 0: expected comma-separated integers >= 1"),
    (["--mixed-decodes", "65"], "--mixed-decodes 65: expected 1..64"),
    (["--layers", "7"], "--layers 7: expected 1..6"),
    (["--schedule-pairs", "0"], "--schedule-pairs 0: expected"),
    (["--schedule-prompt", "-1"], "--schedule-prompt -1"),
    (["--grouped-pairs", "-5"], "--grouped-pairs -5: expected comma-separated integers >= 0"),
])
def test_bad_flags_exit_with_the_value(argv, match):
    with pytest.raises(SystemExit, match=match):
        prefill.main(["--config", "tiny", "--device", "cpu"] + argv)


def test_prefill_bench_padded_steps_cpu(tmp_path):
    """--pad-prefill 1: the counts' buckets are the runner's padded token buckets, and the
    prompts' chunks run padded."""
    from raydecode.engine.step_graph import prefill_bucket
    args = ["--config", "tiny", "--device", "cpu", "--tp", "1", "--prompts", "40",
            "--prefill-budget", "24", "--mixed-decodes", "2", "--context", "8",
            "--random-counts", "3", "--repeats", "1", "--steps", "1"]
    reps = []
    for pad in ("0", "1"):
        out = tmp_path / f"prefill-{pad}.json"
        assert prefill.main(args + ["--pad-prefill", pad, "--out", str(out)]) == 0
        reps.append(json.loads(out.read_text()))
    off, on = reps
    assert on["pad_prefill"] is True and off["pad_prefill"] is False
    rc = on["runs"][0]["random_counts"]
    # a 17..24-token step runs padded to 32: the steady state is measured at 32
    assert sorted(int(b) for b in rc["steady_ms"]["prefill"]) == [1, 2, 4, 8, 16, 32]
    for r in rc["modes"]["frozen"]["rows"]:
        assert r["bucket"] == prefill_bucket(r["tokens"])
    # (the padded step's values: tests/cpu/test_pad_prefill.py; here bf16 near ties may flip)
    p_on, p_off = on["runs"][0]["prompts"][0], off["runs"][0]["prompts"][0]
    assert p_on["chunks_run"] == p_off["chunks_run"] == p_on["chunks_total"] == 2


def test_prefill_bench_refuses_an_unknown_gc_mode():
    with pytest.raises(SystemExit, match="--gc-modes 'live,tepid'"):
        prefill.main(["--config", "tiny", "--device", "cpu", "--gc-modes", "live,tepid"])


def test_prefill_bench_budget_sweep_cpu(tmp_path):
    """--sweep-budgets: every prompt again at each budget, chunked at that budget, with the
    mixed step's time at that chunk; the main cases keep --prefill-budget."""
    out = tmp_path / "sweep.json"
    assert prefill.main(["--config", "tiny", "--device", "cpu", "--tp", "1", "--prompts", "40,70",
                         "--prefill-budget", "16", "--sweep-budgets", "32,64",
                         "--mixed-decodes", "2", "--context", "8", "--random-counts", "0",
                         "--repeats", "1", "--steps", "1", "--graphed", "0",
                         "--out", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert [p["chunks_total"] for p in run["prompts"]] == [3, 5]          # at 16
    sweep = run["budget_sweep"]
    assert [(r["budget"], r["prompt_tokens"]) for r in sweep] == [(32, 40), (32, 70), (64, 40),
                                                                 (64, 70)]
    assert [r["chunks_total"] for r in sweep] == [2, 3, 1, 2]
    for r in sweep:
        assert r["ttft_s"] == pytest.approx(sum(r["chunk_ms"]) / 1e3, rel=1e-3)
        assert r["mfu"] > 0 and r["mixed_step_ms"] > 0


def _tiny_alternatives(out, prompts: str, flag: str, values: str, *more: str) -> dict:
    """The tiny model's prompts under a same-run alternatives flag (CPU, no graphs): its run."""
    assert prefill.main(["--config", "tiny", "--device", "cpu", "--tp", "1", "--prompts", prompts,
                         "--prefill-budget", "16", flag, values, "--mixed-decodes", "2",
                         "--context", "8", "--random-counts", "0", "--repeats", "1",
                         "--steps", "1", "--graphed", "0", "--out", str(out), *more]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    return run


def test_prefill_bench_grouped_pairs_alternatives_cpu(tmp_path):
    """--grouped-pairs: every prompt once per value, interleaved, each row naming its value
    and whether it is the shipped one; the module's value restored after; the summary from
    the shipped row (none here: the tiny run is not TP16, so the rows are checked)."""
    from raydecode.kernels import moe_mxfp4
    out = tmp_path / "grouped.json"
    shipped = moe_mxfp4.GROUPED_PAIRS
    other = shipped + 64
    run = _tiny_alternatives(out, "20,40", "--grouped-pairs", f"{shipped},{other}")
    assert [(p["prompt_tokens"], p["grouped_pairs"], p["shipped"]) for p in run["prompts"]] == [
        (20, shipped, True), (20, other, False), (40, shipped, True), (40, other, False)]
    assert moe_mxfp4.GROUPED_PAIRS == shipped
    assert {p["prefill_experts"] for p in run["prompts"]} == {moe_mxfp4.PREFILL_EXPERTS}
    walls = [p["wall"] for p in run["prompts"]]          # in run order, each a real interval
    assert all(a <= b for a, b in walls)
    assert all(walls[i][1] <= walls[i + 1][0] for i in range(len(walls) - 1))
    rows = [{"tp": 16, "prompts": [dict(p, prompt_tokens=8192, mfu=m, ttft_s_all_layers=1.0)
                                   for p, m in zip(run["prompts"][:2], (0.3, 0.5))]}]
    assert prefill.summarize(rows)["mfu_8k_tp16"] == 0.3
    rows[0]["prompts"].reverse()
    assert prefill.summarize(rows)["mfu_8k_tp16"] == 0.3


def test_prefill_bench_refuses_a_padded_sweep():
    with pytest.raises(SystemExit, match=r"--sweep-budgets \[64\] with --pad-prefill 1"):
        prefill.main(["--config", "tiny", "--device", "cpu", "--sweep-budgets", "64",
                      "--pad-prefill", "1"])


def test_mixed_chunk_default_is_the_deployments():
    """The bench's mixed-case chunk is the deployment's default prompt tokens per step while
    streams decode (the bench does not import actors/: its GPU host lacks pydantic)."""
    from raydecode.actors.config import DeployConfig
    field = DeployConfig.model_fields["max_prefill_tokens_while_decoding"]
    assert prefill.CHUNK_WHILE_DECODING == field.default


def _emulated_graphs(monkeypatch) -> None:
    """The bench's runner with the graph backend emulated (tests/_graph_emulator.py) and the
    MoE without the CPU reference's host read."""
    import raydecode.models.moe as moe_mod
    from raydecode.engine.step_graph import GraphedRunner
    from _graph_emulator import EmulatedGraphs, gathered_moe

    class Emulated(GraphedRunner):
        def __init__(self, *a, **kw):
            super().__init__(*a, stock_backend=EmulatedGraphs(), **kw)

    monkeypatch.setattr(moe_mod, "routed_moe", gathered_moe)
    monkeypatch.setattr(prefill, "GraphedRunner", Emulated)


def test_prefill_bench_stock_graphs_cpu(tmp_path, monkeypatch):
    """--stock-graphs: the build captures every bucket up to the cap before the warm-up, and
    the eager-vs-graphed case runs each --tpot-chunks size ≤ the cap both ways (the CPU
    runner's graph backend emulated, tests/_graph_emulator.py; its MoE without the
    reference's host read)."""
    _emulated_graphs(monkeypatch)
    out = tmp_path / "graphs.json"
    assert prefill.main(["--config", "tiny", "--device", "cpu", "--tp", "1", "--prompts", "40",
                         "--prefill-budget", "32", "--stock-graphs", "16",
                         "--tpot-chunks", "1,8,16,32", "--mixed-decodes", "3",
                         "--context", "8", "--random-counts", "2", "--repeats", "1",
                         "--steps", "1", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["stock_graphs"] == 16
    (run,) = rep["runs"]
    sg = run["stock_graphs"]
    assert sg["captured"] == [1, 2, 4, 8, 16] and sg["failed"] == {} and sg["why_off"] is None
    assert sg["graphs_per_bucket"] == [7] and sg["core_buffer_bytes"] > 0    # 6 cores + 1
    ab = run["stock_graphs_ab"]
    assert [r["chunk"] for r in ab] == [1, 8, 16]                 # 32 > the cap: not a case
    for r in ab:
        for case in ("chunk", "mixed", "decode_stock"):
            assert r["ms"][f"{case}_eager"] > 0 and r["ms"][f"{case}_graphed"] > 0
            assert r["speedup"][case] == pytest.approx(
                r["ms"][f"{case}_eager"] / r["ms"][f"{case}_graphed"], rel=1e-2)
        g = r["ms"]["decode_graphed"]           # the split schedule: chunk + graphed decode
        assert r["tpot_ms_split"] == pytest.approx(
            {m: r["ms"][f"chunk_{m}"] + g for m in ("eager", "graphed")}, abs=2e-3)
    counts = run["mixed"]["graph_counts"]
    assert counts["stock_captured"] == 5 and counts["stock_graphed"] > 0


def test_prefill_bench_single_sequence_graphs_cpu(tmp_path, monkeypatch):
    """--stock-single 1: every bucket's single-sequence graph captured too (one piece more
    than the MLA layers: the KDA cores inside), and the chunk-alone steps replay it."""
    from raydecode.models.config import load_config

    _emulated_graphs(monkeypatch)
    out = tmp_path / "single.json"
    assert prefill.main(["--config", "tiny", "--device", "cpu", "--tp", "1", "--prompts", "16",
                         "--prefill-budget", "16", "--stock-graphs", "16", "--stock-single",
                         "1", "--tpot-chunks", "8", "--mixed-decodes", "2", "--context", "8",
                         "--random-counts", "1", "--repeats", "1", "--steps", "1",
                         "--out", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    sg = run["stock_graphs"]
    mla = sum(k == "mla" for k in load_config("tiny").layer_kinds)
    assert sg["single"] and sg["single_captured"] == [2, 4, 8, 16]    # from bucket 2 up
    assert sg["single_failed"] == {} and sg["single_graphs_per_bucket"] == [mla + 1]
    assert run["mixed"]["graph_counts"]["stock_single"] > 0


@pytest.mark.parametrize("flag", ["300", "-2"])
def test_prefill_bench_refuses_a_stock_graph_cap_off_the_buckets(flag):
    with pytest.raises(SystemExit, match=f"--stock-graphs {flag}: expected 0 or a token"):
        prefill.main(["--config", "tiny", "--device", "cpu", "--stock-graphs", flag])


def test_prefill_bench_schedule_case_cpu(tmp_path):
    """--schedule-prompt: the streams' TPOT beside a prompt prefilling in chunks on the split
    schedule, each pair's time one sample; more chunks than --schedule-pairs: an evenly
    spaced subset of positions, first and last included; the percentiles are of the samples
    and the ratio is against the decode-only TPOT of the same run."""
    out = tmp_path / "schedule.json"
    assert prefill.main(["--config", "tiny", "--device", "cpu", "--tp", "1", "--prompts", "16",
                         "--prefill-budget", "16", "--mixed-decodes", "2", "--context", "8",
                         "--chunk-while-decoding", "8", "--schedule-prompt", "60",
                         "--schedule-chunks", "8,32", "--schedule-modes", "split,mixed",
                         "--schedule-pairs", "4",
                         "--random-counts", "1", "--repeats", "1",
                         "--steps", "2", "--out", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    sc, big, mixed, _ = run["schedule"]
    assert [r["mode"] for r in run["schedule"]] == ["split", "split", "mixed", "mixed"]
    # mixed: one stock step per sample, the decode rows and the chunk together
    assert mixed["chunk_tokens"] == 8 and mixed["pairs_run"] == 4
    for x in mixed["samples"]:
        assert x["tpot_ms"] == x["mixed_ms"] and "decode_ms" not in x
        # what the host paid besides the kernels (CPU: no allocator, so no segments)
        assert x["gc_ms"] >= 0 and x["new_segments"] == x["alloc_retries"] == 0
    assert mixed["prompt_ttft_s_est"] == pytest.approx(
        8 * sum(x["mixed_ms"] for x in mixed["samples"]) / 4 / 1e3, abs=2e-3)
    # 32 is above the 16-token budget: a chunk holds at most the budget
    assert big["chunk_tokens"] == 16 and big["pairs_total"] == 4 and big["pairs_run"] == 4
    assert [x["pos"] for x in big["samples"]] == [0, 16, 32, 48]
    # the prompt's TTFT on the schedule: 4 chunk steps and the 3 decode steps between them
    mean = lambda key: sum(x[key] for x in big["samples"]) / 4
    assert big["prompt_ttft_s_est"] == pytest.approx(
        (4 * mean("chunk_ms") + 3 * mean("decode_ms")) / 1e3, abs=2e-3)
    assert sc["pairs_total"] == 8 and sc["pairs_run"] == 4                 # 60 tokens / 8
    assert [x["pos"] for x in sc["samples"]] == [0, 16, 40, 56]            # spread, last in
    tp = sorted(x["tpot_ms"] for x in sc["samples"])
    for x in sc["samples"]:
        assert x["tpot_ms"] == pytest.approx(x["chunk_ms"] + x["decode_ms"], abs=2e-3)
    assert sc["tpot_ms_p50"] == tp[1] and sc["tpot_ms_p99"] == sc["tpot_ms_max"] == tp[-1]
    assert sc["p99_over_decode_only"] == pytest.approx(
        sc["tpot_ms_p99"] / sc["tpot_ms_decode_only"], rel=1e-2)
    assert sc["decode_path"] == "specialized"    # the served decode path (--graphed 1)


def test_prefill_bench_paced_schedule_cpu(tmp_path):
    """--schedule-pacer: the whole prompt runs, each chunk the size the scheduler's pacer
    asks for from the steps' times (at most the while-decoding cap), every position covered
    once; the TTFT is the measured steps' sum; one row per schedule mode."""
    out = tmp_path / "paced.json"
    assert prefill.main(["--config", "tiny", "--device", "cpu", "--tp", "1", "--prompts", "16",
                         "--prefill-budget", "16", "--mixed-decodes", "2", "--context", "8",
                         "--chunk-while-decoding", "8", "--schedule-prompt", "40",
                         "--schedule-chunks", "8", "--schedule-modes", "split,mixed",
                         "--schedule-pacer", "3", "--random-counts", "1", "--repeats", "1",
                         "--steps", "2", "--profile-steps", "--out", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    paced = [r for r in run["schedule"] if "pacer_limit" in r]
    # --profile-steps: the mixed mode's first one-token step ran under the profiler, in place
    split_row, mixed_row = paced
    assert split_row["one_token_step_profile"] is None
    one = mixed_row["one_token_step_profile"]
    first = next(i for i, x in enumerate(mixed_row["samples"]) if x["chunk_tokens"] == 1)
    assert one["pos"] == mixed_row["samples"][first]["pos"] and one["host_top_ops"]
    assert one["ms"] == mixed_row["samples"][first]["mixed_ms"] and one["ms"] > 0
    assert [i for i, x in enumerate(mixed_row["samples"]) if x.get("profiled")] == [first]
    assert [r["mode"] for r in paced] == ["split", "mixed"]
    for r in paced:
        assert r["pacer_limit"] == 3 and r["chunk_cap"] == 8
        assert r["samples"][0]["chunk_tokens"] == 1              # the cold probe: 8 / 8
        assert all(1 <= x["chunk_tokens"] <= 8 for x in r["samples"])
        assert sum(r["chunks_chosen"].values()) == r["pairs_run"]
        assert type(r["pacer"]["infeasible"]) is int and type(r["pacer"]["reprobes"]) is int
        # step buckets ≤ the cap's step: split the chunk alone (8), mixed with 2 rows (16)
        top = 8 if r["mode"] == "split" else 16
        assert {int(b) for b in r["pacer"]["chunk_ms"]} <= {b for b in (1, 2, 4, 8, 16)
                                                             if b <= top}
    split, mixed = paced
    # mixed: every chunk is a sample and the chunks tile the prompt
    assert all(x["gc_ms"] >= 0 and "new_segments" in x for x in mixed["samples"])
    assert sum(x["chunk_tokens"] for x in mixed["samples"]) == 40
    assert mixed["prompt_ttft_s"] == pytest.approx(
        sum(x["mixed_ms"] for x in mixed["samples"]) / 1e3, abs=2e-3)
    # split: the last chunk has no decode step after it (the prompt is done): not a sample
    assert sum(x["chunk_tokens"] for x in split["samples"]) < 40
    assert [x["pos"] for x in split["samples"]] == sorted(x["pos"] for x in split["samples"])


def test_prefill_bench_refuses_a_pacer_limit_of_one_or_less():
    with pytest.raises(SystemExit, match="--schedule-pacer 1.0: expected 0 .off. or a limit"):
        prefill.main(["--config", "tiny", "--device", "cpu", "--schedule-pacer", "1"])


def test_tpot_stats_name_the_slow_samples_and_what_the_host_paid():
    """Samples over 1.5× the median are listed with their device time and, where the step
    was probed, its GC ms, new allocator segments and alloc retries."""
    samples = [{"pos": i, "tpot_ms": 10.0, "device_ms": 9.5, "gc_ms": 0.0, "new_segments": 0,
                "alloc_retries": 0, "mixed_ms": 10.0} for i in range(9)]
    samples.append({"pos": 9, "tpot_ms": 40.0, "device_ms": 39.0, "gc_ms": 0.1,
                    "new_segments": 2, "alloc_retries": 1, "mixed_ms": 40.0})
    st = prefill._tpot_stats(samples, [0.008, 0.008], 1.0)
    assert st["slow_samples"] == [{"pos": 9, "tpot_ms": 40.0, "device_ms": 39.0, "gc_ms": 0.1,
                                   "new_segments": 2, "alloc_retries": 1}]
    assert st["p99_over_decode_only"] == 5.0 and st["device_ms_max"] == 39.0


def test_prefill_bench_prefill_experts_alternatives_cpu(tmp_path):
    """--prefill-experts split,blocked: every prompt once per kind, interleaved, each row
    naming its kind; the shipped kind's row is the shipped one; the module's value restored;
    an unknown kind is refused naming it and the accepted ones."""
    from raydecode.kernels import moe_mxfp4
    out = tmp_path / "experts.json"
    shipped = moe_mxfp4.PREFILL_EXPERTS
    other = next(k for k in moe_mxfp4.PREFILL_EXPERT_KINDS if k != shipped)
    run = _tiny_alternatives(out, "20", "--prefill-experts", f"{shipped},{other}")
    assert [(p["prefill_experts"], p["shipped"]) for p in run["prompts"]] == [
        (shipped, True), (other, False)]
    assert moe_mxfp4.PREFILL_EXPERTS == shipped
    with pytest.raises(SystemExit, match="--prefill-experts bogus: .*accepted: .*blocked"):
        prefill.main(["--config", "tiny", "--device", "cpu", "--prefill-experts", "bogus"])
    with pytest.raises(SystemExit, match=r"--prefill-experts auto\+down_bn=: .*expected an "
                                         "integer"):
        prefill.main(["--config", "tiny", "--device", "cpu", "--prefill-experts",
                      "auto+down_bn="])


def test_prefill_bench_final_mix_alternatives_cpu(tmp_path):
    """--final-mix rows,all: every prompt once with the final mix on the sample rows (shipped)
    and once on every row, interleaved, each row naming its form (the values' equality:
    test_model's rows test); ModelRunner.final_rows restored; an unknown form refused naming
    it and the accepted ones."""
    from raydecode.engine.runner import ModelRunner
    run = _tiny_alternatives(tmp_path / "final.json", "20,40", "--final-mix", "rows,all")
    assert [(p["prompt_tokens"], p["final_mix"], p["shipped"]) for p in run["prompts"]] == [
        (20, "rows", True), (20, "all", False), (40, "rows", True), (40, "all", False)]
    assert ModelRunner.final_rows is True
    with pytest.raises(SystemExit, match="--final-mix rows,some: expected .*rows, all"):
        prefill.main(["--config", "tiny", "--device", "cpu", "--final-mix", "rows,some"])


def test_prefill_bench_profiles_one_step_per_experts_kind_cpu(tmp_path):
    """--profile-steps: after the prompts, one budget-sized step profiled under each kind, in
    the variants' order, each with its kind, a wall time, host ops and its wall interval; the
    module's kind restored after."""
    from raydecode.kernels import moe_mxfp4
    shipped = moe_mxfp4.PREFILL_EXPERTS
    other = next(k for k in moe_mxfp4.PREFILL_EXPERT_KINDS if k != shipped)
    run = _tiny_alternatives(tmp_path / "steps.json", "20", "--prefill-experts",
                             f"{shipped},{other}", "--profile-steps")
    rows = run["step_profiles"]
    assert [r["prefill_experts"] for r in rows] == [shipped, other]
    for r in rows:
        assert r["tokens"] == 16 and r["ms"] > 0 and r["host_top_ops"]
        assert r["wall"][0] <= r["wall"][1]
        assert r["device_span_ms"] is r["device_gaps_ms"] is r["ends_idle_ms"] is None
    assert rows[0]["wall"][1] <= rows[1]["wall"][0]
    assert moe_mxfp4.PREFILL_EXPERTS == shipped


def test_kernel_timeline_splits_the_idle_between_and_around_the_kernels():
    """`kernel_timeline`: the span from the first kernel's start to the last one's end, the
    idle inside it counted once where kernels overlap (two streams), the wall time outside
    it; in any order of the kernels; nothing without kernels."""
    ks = [(1500.0, 4000.0), (100.0, 1000.0), (800.0, 1200.0), (4500.0, 5100.0)]
    t = prefill.kernel_timeline(ks, 6000.0)
    # span 100 → 5100 = 5 ms; busy: [100, 1200] ∪ [1500, 4000] ∪ [4500, 5100] = 4.2 ms
    assert t == {"device_span_ms": 5.0, "device_gaps_ms": 0.8, "ends_idle_ms": 1.0}
    assert prefill.kernel_timeline(list(reversed(ks)), 6000.0) == t
    nested = prefill.kernel_timeline([(0.0, 1000.0), (200.0, 300.0)], 1000.0)
    assert nested == {"device_span_ms": 1.0, "device_gaps_ms": 0.0, "ends_idle_ms": 0.0}
    assert prefill.kernel_timeline([], 10.0)["device_span_ms"] is None


def test_stock_gemms_sets_and_restores_the_skinny_cap():
    """`prefill.stock_gemms(m)`: models/layers.py STOCK_SKINNY_MAX_M is m inside (the stock
    count's cuBLAS baseline at 0) and the shipped value again after, an exception included."""
    from raydecode.models import layers
    shipped = layers.STOCK_SKINNY_MAX_M
    with prefill.stock_gemms(0):
        assert layers.STOCK_SKINNY_MAX_M == 0
    assert layers.STOCK_SKINNY_MAX_M == shipped
    with pytest.raises(RuntimeError, match="inside"):
        with prefill.stock_gemms(3):
            assert layers.STOCK_SKINNY_MAX_M == 3
            raise RuntimeError("inside")
    assert layers.STOCK_SKINNY_MAX_M == shipped


def test_device_sites_name_the_project_lines_and_the_host_waits():
    """`_device_sites` (--profile-steps' stack-recording pass) keys each op by the innermost
    project frames above it: a stock GEMM is found under models/layers.py's stock_linear
    (on the CPU the ops' host time stands in for the device's); no CUDA, no waits."""
    from raydecode.models import layers

    def step():
        x, w = torch.randn(8, 16), torch.randn(4, 16)
        return layers.stock_linear(x, w).sum().item()

    got = prefill._device_sites(step, 20, device=False)
    mm = [r for r in got["device"] if r["op"] == "aten::mm"]
    assert mm and mm[0]["site"].startswith("models/layers.py(") and "stock_linear" in mm[0]["site"]
    assert mm[0]["calls"] == 1 and mm[0]["ms"] > 0
    assert got["host_syncs"] == []


def test_sync_sites_count_each_synchronizing_call_by_its_lines():
    """`_sync_sites`: what the sync debug mode would report (a warning per synchronizing call;
    here raised by hand, the mode setter a stand-in), counted per message and the innermost
    frames outside torch, the mode armed during the run and disarmed after."""
    import warnings
    modes = []

    def sync_point():
        warnings.warn("called a synchronizing CUDA operation")

    def step():
        for _ in range(3):
            sync_point()
        warnings.warn("another")

    got = prefill._sync_sites(step, 10, arm=modes.append)
    assert modes == ["warn", 0]
    assert got[0]["calls"] == 3 and got[0]["message"].startswith("called a synchronizing")
    assert "sync_point" in got[0]["site"] and "step" in got[0]["site"]
    assert got[1]["calls"] == 1 and got[1]["message"] == "another"
