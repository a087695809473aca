"""The graphed speculative step (engine/spec_graph.py) on the CPU: its statics path runs
eagerly here (kda_verify's reference per position, MLA rows stored before the causal
attention, the drafter's static forward, the device acceptance and the KDA commit); the
capture itself: tests/gpu/test_spec_graph_gpu.py."""
from __future__ import annotations

import torch

from raydecode.engine.spec_graph import SPEC_BUCKETS, spec_bucket

from _spec_graph_case import run_case

torch.set_num_threads(1)


def test_greedy_speculative_on_the_spec_graphs_equals_non_speculative():
    ref, got, runner, engine = run_case("cpu")
    assert got == ref
    assert runner.counts["graphed"] > 0 and runner.counts["eager"] == 0
    assert runner.graphs.counts["eager_statics"] > 0 and runner.graphs.counts["captured"] == 0
    acc = engine.acceptance
    # high acceptance on the first prompt, rejections elsewhere: both the full-accept commit
    # (keep = k) and partial ones ran
    assert acc.accepted_at[0] > 0 and acc.emitted < acc.steps * (engine.spec.num_drafts + 1)


def test_warm_up_at_build_touches_no_live_state():
    """capture_all on idle scratch rows (on the CPU: the eager statics path once per bucket
    and mode) before serving; the generation after it is unchanged."""
    ref, got, runner, _ = run_case("cpu", k=4, max_tokens=24, at_build=True)
    assert runner.built == []                                   # nothing captured off CUDA
    buckets = [b for b in SPEC_BUCKETS if spec_bucket(b, 4) == b]
    assert {(b, 4, gr) for b in buckets for gr in (True, False)} <= set(runner.graphs.graphs)
    assert got == ref


def test_buckets_respect_the_verify_envelope():
    assert spec_bucket(1, 7) == 1 and spec_bucket(3, 7) == 4 and spec_bucket(8, 7) == 8
    assert spec_bucket(9, 7) is None                   # 16 · 8 > 64
    assert spec_bucket(16, 3) == 16 and spec_bucket(17, 3) is None
    assert all(b * 4 <= 64 for b in SPEC_BUCKETS if spec_bucket(b, 3) == b)


def test_steps_outside_the_graphs_say_why():
    from raydecode.engine.spec_runner import SpecSeq, SpecStepPlan
    from raydecode.engine.request import SamplingParams
    from raydecode.models.cache import SeqSlice, StepBatch

    _, _, runner, _ = run_case("cpu", max_tokens=2)
    g = SamplingParams(temperature=0.0)

    def plan(seqs, spec, rows=(), path="specialized"):
        toks = [1] * sum(s.length for s in seqs)
        return SpecStepPlan(1, StepBatch(seqs), toks, list(rows), {}, [], path, spec=spec,
                            num_drafts=3)
    s0 = SpecSeq("a", 0, 0, 5, g, 0)
    assert runner.why_eager(plan([SeqSlice(0, 0, 4, 5)], [s0])) is None
    assert "path 'stock'" in runner.why_eager(plan([SeqSlice(0, 0, 4, 5)], [s0], path="stock"))
    mixed = plan([SeqSlice(0, 0, 4, 5), SeqSlice(1, 4, 1, 9)], [s0], rows=[4])
    assert "plain sequences" in runner.why_eager(mixed)
    at0 = plan([SeqSlice(0, 0, 4, 0)], [SpecSeq("a", 0, 0, 0, g, 0)])
    assert "position 0" in runner.why_eager(at0)


# ---- TP = 2, DCP = 1 and 2, over gloo ----------------------------------------------------------

def _tp2_rank(rank: int, world: int, port: int) -> None:
    """Per DCP: the non-speculative graphed greedy output and the spec graphs' output on the
    same shard (the drafter's static forward merging DCP partials, context rows of other DCP
    ranks sent to the scratch block, MLA rows stored on their owner before the attention)."""
    import torch.distributed as dist

    from raydecode.engine.engine import EngineConfig
    from raydecode.engine.loader import load_tokenizer
    from raydecode.engine.request import SamplingParams
    from raydecode.models.dspark_checkpoint import load_drafter
    from raydecode.models.parallel import Parallel, TorchComm
    from raydecode.models.weights import load_model

    from _spec_graph_case import BF, PROMPTS, plain_greedy, spec_engine_on_graphs

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        tok = load_tokenizer("tiny")
        ecfg = EngineConfig(max_num_seqs=2, max_model_len=256, block_size=8)
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        for dcp in (1, 2):
            par = Parallel(rank, world, dcp)
            comm = TorchComm(par)
            model = load_model("tiny", par, comm, BF)[1]
            ref = plain_greedy(model, tok, ecfg, PROMPTS[:1], params)[0]
            drafter = load_drafter("tiny", model, par, comm, BF, "cpu")
            engine, runner = spec_engine_on_graphs(model, drafter, tok, ecfg, 3)
            got = engine.generate(PROMPTS[:1], params)[0].output_ids
            assert got == ref, (rank, dcp, ref, got)
            assert runner.counts["graphed"] > 0 and runner.counts["eager"] == 0, runner.counts
    finally:
        dist.destroy_process_group()


def test_tp2_dcp1_and_dcp2_spec_graphs_equal_non_speculative_graphs():
    import torch.multiprocessing as mp

    from _net import free_port

    mp.spawn(_tp2_rank, args=(2, free_port()), nprocs=2, join=True)
