"""Piecewise-graphed stock steps on CUDA (engine/piecewise.py; the CPU side with an emulated
backend: tests/cpu/test_stock_graphs.py): real CUDA graphs of the per-token work, the
attention cores (fla's KDA, MLA SDPA, the batched decode rows) eager between the replays.

Twin runners on twin caches (sentinel values everywhere): one replays its bucket's stock
graphs, the other runs the same steps eagerly, padded to the same bucket — the same kernels on
the same shapes, so their logits and real caches agree to the last bits the kernels' own
nondeterminism leaves (bf16: 1e-2 relative max-abs, fp32: 1e-4; measured equal where
deterministic). Steps: a prompt chunk from 0, a continued chunk beside a new prompt, a mixed
step with decode rows, a stock decode step, an exact bucket, a one-token prompt, and for the
K3 slice a chunk of 200 tokens (bucket 256). Every bucket must capture (`stock_failed`
empty), and a replayed step must not synchronize with the host."""
from __future__ import annotations

import pytest
import torch

from raydecode.engine.step_graph import GraphedRunner, graph_cache_sizes, prefill_buckets
from raydecode.models.cache import SeqSlice, StepBatch
from raydecode.models.k3 import make_caches

from _numerics import max_rel_err
from _prefill_forced import k3_slice, tiny_model
from _stock_steps import MIXED_STEPS, SINGLE_STEPS, STEPS, plan as _plan, real_rows, tables

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
NS, NB, BS = 4, 96, 16
SENTINEL = 3.0
TABLES = tables(NS, 24)
BIG = [[SeqSlice(0, 0, 200, 59)]]          # the K3 slice: bucket 256


def _model(which: str, dtype):
    if which == "tiny":
        return tiny_model("cuda", dtype)[0], range(0, 512), 64
    model, _ = k3_slice("cuda", dtype=dtype)
    from raydecode.scripts.bench.step import rank_vocab_rows
    return model, rank_vocab_rows(model), 256


def _runner(model, cap: int, single: bool = False, mixed: bool = False) -> GraphedRunner:
    ns, nb = graph_cache_sizes(NS, NB)
    c = make_caches(model.cfg, model.par, ns, nb, BS, model.dtype, device="cuda")
    c.kda.conv.fill_(SENTINEL)
    c.kda.rec.fill_(SENTINEL)
    c.mla.pool.fill_(SENTINEL)
    return GraphedRunner(model, c, "cuda", num_slots=NS, num_blocks=NB, pad_prefill=True,
                         stock_graphs=cap, stock_single=single, stock_mixed=mixed)


def _real(c):
    return real_rows(c, NS, NB)


def _twin_steps(graphed, eager, steps, ids, tol: float, what) -> None:
    """Each step on both runners: the graphed one's logits finite and within `tol` of the
    eager one's (relative max-abs), and so are the real caches after it."""
    for i, seqs in enumerate(steps):
        plan = _plan(i + 1, seqs, ids, TABLES if i == 0 else None)
        want, got = eager.logits(plan).float(), graphed.logits(plan).float()
        torch.cuda.synchronize()
        assert torch.isfinite(got).all(), (what, i)
        assert max_rel_err(got, want) <= tol, (what, i, max_rel_err(got, want))
        for a, b in zip(_real(eager.caches), _real(graphed.caches)):
            assert max_rel_err(b.float(), a.float()) <= tol, (what, i)


@pytest.mark.parametrize("which,dtype", [("tiny", torch.float32), ("tiny", torch.bfloat16),
                                         ("k3", torch.bfloat16)])
def test_replayed_stock_steps_equal_the_eager_padded_ones(which, dtype):
    model, ids, cap = _model(which, dtype)
    graphed, eager = _runner(model, cap), _runner(model, 0)
    with torch.inference_mode():
        assert graphed.warm_prefill(cap) == prefill_buckets(cap)
        eager.warm_prefill(cap)
    assert graphed.stock_failed == {} and sorted(graphed.stock_graphs) == prefill_buckets(cap)
    assert eager.stock_graphs == {}
    steps = STEPS + (BIG if which == "k3" else [])
    _twin_steps(graphed, eager, steps, ids, 1e-4 if dtype == torch.float32 else 1e-2,
                (which, dtype))
    assert graphed.counts["stock_graphed"] == len(steps)
    assert eager.counts["stock_graphed"] == 0


@pytest.mark.parametrize("which,dtype", [("tiny", torch.bfloat16), ("k3", torch.bfloat16)])
def test_single_sequence_graphs_equal_the_eager_padded_steps(which, dtype):
    """RAYDECODE_STOCK_SINGLE: the single-sequence graphs (fla's KDA forward and the conv op
    captured inside, slot / start / length from device tensors, the pad rows with β = g = 0)
    against the eager padded step, over one-sequence steps and a two-sequence one (the K3
    slice adds a 200-token chunk in bucket 256). Where the real sequence ends inside fla's
    last 64-row chunk the eager step runs a shorter chunk: the same rows, the same sums, so
    bf16's 1e-2 holds."""
    model, ids, cap = _model(which, dtype)
    graphed, eager = _runner(model, cap, single=True), _runner(model, 0)
    with torch.inference_mode():
        graphed.warm_prefill(cap)
        eager.warm_prefill(cap)
    assert graphed.stock_single_failed == {} and graphed.stock_failed == {}
    assert sorted(graphed.stock_single_graphs) == [b for b in prefill_buckets(cap) if b >= 2]
    steps = SINGLE_STEPS + (BIG if which == "k3" else [])
    _twin_steps(graphed, eager, steps, ids, 1e-2, (which, dtype, "single"))
    # one-token steps keep the general graph (the eager core's fp32 recurrent update)
    assert graphed.counts["stock_single"] == sum(len(q) == 1 and q[0].length > 1
                                                for q in steps)


BIG_MIXED = [[SeqSlice(0, 0, 1, 60), SeqSlice(1, 1, 180, 33), SeqSlice(2, 181, 1, 23)]]


@pytest.mark.parametrize("which,dtype", [("tiny", torch.bfloat16), ("k3", torch.bfloat16)])
def test_mixed_step_graphs_equal_the_eager_padded_steps(which, dtype):
    """RAYDECODE_STOCK_MIXED: the mixed-step graphs (the chunk rotated to the front through
    fla's forward inside the graph, the continuations through the decode-row kernel on
    fixed-length device lists with a live count) against the eager padded step, over
    tests/_stock_steps.py `MIXED_STEPS` (the K3 slice adds a 180-token chunk between two
    continuations, bucket 256)."""
    from raydecode.engine.step_graph import MIXED_MIN_BUCKET, mixed_parts
    model, ids, cap = _model(which, dtype)
    graphed, eager = _runner(model, cap, single=True, mixed=True), _runner(model, 0)
    with torch.inference_mode():
        graphed.warm_prefill(cap)
        eager.warm_prefill(cap)
    assert graphed.stock_mixed_failed == {} and graphed.stock_failed == {}
    assert sorted(graphed.stock_mixed_graphs) == [b for b in prefill_buckets(cap)
                                                 if b >= MIXED_MIN_BUCKET]
    steps = MIXED_STEPS + (BIG_MIXED if which == "k3" else [])
    _twin_steps(graphed, eager, steps, ids, 1e-2, (which, dtype, "mixed"))
    assert graphed.counts["stock_mixed"] == sum(mixed_parts(StepBatch(q)) is not None
                                               for q in steps)


def test_a_replayed_step_does_not_sync_with_the_host():
    model, ids, cap = _model("tiny", torch.bfloat16)
    g = _runner(model, cap)
    with torch.inference_mode():
        g.warm_prefill(cap)
        g.logits(_plan(1, [SeqSlice(0, 0, 40, 0)], ids, TABLES))     # memos of this layout
        plan = _plan(2, [SeqSlice(0, 0, 20, 40), SeqSlice(1, 20, 9, 0),
                         SeqSlice(2, 29, 1, 0)], ids)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = g.logits(plan)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert g.counts["stock_graphed"] == 2 and torch.isfinite(out).all()
