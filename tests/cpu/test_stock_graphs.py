"""Piecewise-graphed stock steps (engine/piecewise.py, GraphedRunner `stock_graphs`) on the
tiny K3 model, fp32, TP1, CPU, with the graph backend emulated by recorded ATen operations
(tests/_graph_emulator.py): every bucket up to the cap is warmed and captured at the build on
scratch rows, then prefill chunks, continued chunks beside new sequences, mixed steps and
stock decode steps replay their bucket's pieces with the attention cores run eagerly on the
real batch. Logits and the real slots' and blocks' contents must equal a plain eager runner's
on twin caches (sentinel values everywhere).

The CPU MoE reference reads the selected experts' ids on the host (not capturable); both
runners here run a gathered form of it without that read (`gathered_moe`), so the routed
experts sit inside the pieces as the CUDA kernels do."""
from __future__ import annotations

import pytest
import torch

import raydecode.models.moe as moe_mod
from raydecode.engine import piecewise
from raydecode.engine import step_graph as step_graph_mod
from raydecode.engine.runner import ModelRunner
from raydecode.engine.scheduler import StepPlan
from raydecode.engine.step_graph import GraphedRunner, graph_cache_sizes, prefill_buckets
from raydecode.kernels import settings
from raydecode.models import mla as mla_mod
from raydecode.models.cache import SeqSlice, StepBatch
from raydecode.models.config import load_config
from raydecode.models.k3 import K3ForCausalLM, init_random_, make_caches

from _graph_emulator import CaptureError, EmulatedGraphs, capture, gathered_moe
from _stock_steps import (MIXED_STEPS, SINGLE_STEPS, STEPS, plan as _step_plan, real_rows,
                          tables)

torch.set_num_threads(1)
NS, NB, BS = 4, 48, 16
CAP = 64
SENTINEL = 3.0
TOL = 1e-4           # fp32: the bucket's shapes vs the unpadded step's (GEMM blocking)


@pytest.fixture(scope="module")
def model():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe_mod, "routed_moe", gathered_moe)
        yield init_random_(K3ForCausalLM(load_config("tiny"), dtype=torch.float32), seed=11)


def _caches(model):
    ns, nb = graph_cache_sizes(NS, NB)
    c = make_caches(model.cfg, model.par, ns, nb, BS, torch.float32)
    c.kda.conv.fill_(SENTINEL)
    c.kda.rec.fill_(SENTINEL)
    c.mla.pool.fill_(SENTINEL)
    return c


def _graphed(model, cap=CAP, backend=None, **kw) -> GraphedRunner:
    kw.setdefault("stock_single", False)      # the general graphs (the single ones: their test)
    return GraphedRunner(model, _caches(model), num_slots=NS, num_blocks=NB, stock_graphs=cap,
                         stock_backend=backend or EmulatedGraphs(), **kw)


TABLES = tables(NS, 12)


def _plan(step: int, seqs: list[SeqSlice], V: int, block_tables=None) -> StepPlan:
    return _step_plan(step, seqs, range(V), block_tables)


def _real(c):
    return real_rows(c, NS, NB)


def _twin_steps(model, plain, g, steps) -> None:
    """Each step on both runners: logits and the real slots' and blocks' contents equal."""
    V = model.cfg.vocab_size
    for i, seqs in enumerate(steps):
        plan = _plan(i + 1, seqs, V, TABLES if i == 0 else None)
        want, got = plain.logits(plan), g.logits(plan)
        assert torch.allclose(got, want, rtol=TOL, atol=TOL), (i, (got - want).abs().max())
        for a, b in zip(_real(plain.caches), _real(g.caches)):
            assert torch.allclose(a, b, rtol=TOL, atol=TOL), i


def test_replayed_stock_steps_equal_the_eager_ones(model):
    plain = ModelRunner(model, _caches(model))
    g = _graphed(model)
    real = [t.clone() for t in _real(g.caches)]
    assert g.warm_prefill(CAP) == prefill_buckets(CAP)
    assert sorted(g.stock_graphs) == prefill_buckets(CAP) and not g.stock_failed
    assert all(torch.equal(a, b) for a, b in zip(real, _real(g.caches)))   # scratch rows only
    assert not g.caches.mla.block_tables
    # every layer has an attention core: one graph more than the layers per bucket
    assert all(len(sg.graphs) == model.cfg.num_layers + 1 for sg in g.stock_graphs.values())
    pad = g.scratch.slots[0]
    pad_state = g.caches.kda.rec[:, pad].clone()
    V = model.cfg.vocab_size
    for i, seqs in enumerate(STEPS):
        plan = _plan(i + 1, seqs, V, TABLES if i == 0 else None)
        want, got = plain.logits(plan), g.logits(plan)
        assert got.shape == want.shape
        assert torch.allclose(got, want, rtol=TOL, atol=TOL), (i, (got - want).abs().max())
        for a, b in zip(_real(plain.caches), _real(g.caches)):
            assert torch.allclose(a, b, rtol=TOL, atol=TOL), i
        assert g.caches.pieces is None and g.scratch.slots[0] not in g.caches.mla.block_tables
        assert g.caches.pad_slot is None
    assert g.counts["stock_graphed"] == len(STEPS)
    assert torch.equal(g.caches.kda.rec[:, pad], pad_state)   # the cores skipped the pads
    assert sum(sg.replays for sg in g.stock_graphs.values()) == len(STEPS) + len(g.stock_graphs)


def test_single_sequence_graphs_keep_the_kda_cores_inside(model):
    """RAYDECODE_STOCK_SINGLE: each bucket also gets a graph for steps of one sequence whose
    KDA cores run inside it (models/kda.py `_core_single`: the slot, start and length from
    device tensors, the pad rows with β = g = 0), only the MLA cores eager between the pieces.
    Over one-sequence steps (from 0, continued, one token, an exact bucket, a one-token prompt)
    and a two-sequence step between them (the general graph), logits and the real slots' and
    blocks' contents equal a plain eager runner's."""
    plain = ModelRunner(model, _caches(model))
    g = _graphed(model, stock_single=True)
    g.warm_prefill(CAP)
    assert sorted(g.stock_single_graphs) == [b for b in prefill_buckets(CAP) if b >= 2], \
        g.stock_single_failed
    assert sorted(g.stock_graphs) == prefill_buckets(CAP)
    mla = sum(k == "mla" for k in model.cfg.layer_kinds)
    assert 0 < mla < model.cfg.num_layers
    assert all(len(sg.graphs) == mla + 1 and sg.single is not None
               for sg in g.stock_single_graphs.values())
    _twin_steps(model, plain, g, SINGLE_STEPS)
    # a one-token step keeps the general graph (its fp32 recurrent core, as the eager step)
    singles = sum(len(seqs) == 1 and seqs[0].length > 1 for seqs in SINGLE_STEPS)
    assert 0 < singles < len(SINGLE_STEPS) - 1
    assert g.counts["stock_single"] == singles
    assert g.counts["stock_graphed"] == len(SINGLE_STEPS)


def test_mixed_step_graphs_keep_every_kda_core_inside(model):
    """RAYDECODE_STOCK_MIXED: each bucket from 4 tokens also gets a graph for a prompt chunk
    beside one-token continuations, its KDA cores inside (models/kda.py `_core_mixed`: the
    chunk's rows rotated to the front for the single-sequence core, the continuations through
    the decode-row op on fixed-length device lists with a live count), only the MLA cores eager.
    Over mixed steps with the chunk first, last and between continuations, and steps the
    mixed graph must leave to the others, logits and the real slots' and blocks' contents
    equal a plain eager runner's, and the scratch slot the spare entries name is untouched."""
    from raydecode.engine.step_graph import MIXED_MIN_BUCKET, mixed_parts
    plain = ModelRunner(model, _caches(model))
    g = _graphed(model, stock_single=True, stock_mixed=True)
    g.warm_prefill(CAP)
    assert sorted(g.stock_mixed_graphs) == [b for b in prefill_buckets(CAP)
                                           if b >= MIXED_MIN_BUCKET], g.stock_mixed_failed
    mla = sum(k == "mla" for k in model.cfg.layer_kinds)
    assert all(len(sg.graphs) == mla + 1 and sg.single.mixed
               for sg in g.stock_mixed_graphs.values())
    pad = g.scratch.slots[0]
    pad_state = g.caches.kda.rec[:, pad].clone()
    _twin_steps(model, plain, g, MIXED_STEPS)
    mixed = sum(mixed_parts(StepBatch(seqs)) is not None for seqs in MIXED_STEPS)
    assert 3 < mixed < len(MIXED_STEPS) - 3
    assert g.counts["stock_mixed"] == mixed
    assert g.counts["stock_graphed"] == len(MIXED_STEPS)
    assert torch.equal(g.caches.kda.rec[:, pad], pad_state)


def test_mixed_parts_names_what_a_mixed_graph_serves():
    from raydecode.engine.step_graph import mixed_parts

    def batch(*spec):           # (slot, length, pos) back to back
        seqs, at = [], 0
        for slot, n, pos in spec:
            seqs.append(SeqSlice(slot, at, n, pos))
            at += n
        return StepBatch(seqs)

    b = batch((0, 1, 39), (2, 5, 12), (1, 1, 29))
    assert mixed_parts(b) == (b.seqs[1], [b.seqs[0], b.seqs[2]])
    assert mixed_parts(batch((2, 5, 12))) is None                      # a chunk alone
    assert mixed_parts(batch((0, 1, 39), (1, 1, 29))) is None           # decodes only
    assert mixed_parts(batch((2, 5, 12), (3, 2, 0))) is None            # two chunks
    assert mixed_parts(batch((2, 5, 12), (3, 1, 0))) is None            # a one-token prompt


def test_mixed_seq_lists_and_their_limits():
    from raydecode.engine.piecewise import MixedSeq
    m = MixedSeq("cpu", 8)
    c, ds = SeqSlice(5, 2, 4, 9), [SeqSlice(1, 0, 1, 3), SeqSlice(3, 1, 1, 7)]
    m.set_mixed(c, ds, pad_slot=9)
    assert (int(m.slot), bool(m.cont), int(m.n), int(m.start)) == (5, True, 4, 2)
    assert int(m.dec_count) == 2 and m.dec_rows.tolist() == [0, 1] + [2] * 5
    assert m.dec_slots.tolist() == [1, 3] + [9] * 5
    with pytest.raises(ValueError, match="8 decode rows in a mixed graph of 7 entries"):
        m.set_mixed(c, [SeqSlice(i, i, 1, 1) for i in range(8)], pad_slot=9)


def test_a_single_sequence_graph_left_reading_the_batch_is_refused(model, monkeypatch):
    """The inline KDA core must take the sequence's length from the device tensors: one that
    uses the bucket's length (what reading the capture's batch would bake in) passes the
    build's check, whose step fills the bucket, but on a real 40-token step in bucket 64 it
    runs the pad rows into the state and the conv tail: the real caches or the logits leave
    the plain runner's (the CPU test above can fail)."""
    from raydecode.models import kda as kda_mod
    real_single = kda_mod.KDAAttention._core_single

    class Baked:
        """`single` with its length frozen at the bucket: what reading the batch at capture
        time would bake in."""
        def __init__(self, single, n):
            self.slot, self.cont, self._n, self.index = single.slot, single.cont, n, single.index

        @property
        def n(self):
            return self._n

    def baked(self, caches, single, qkv_in, g, beta):
        n = torch.full((1,), qkv_in.shape[0], dtype=torch.int64)
        return real_single(self, caches, Baked(single, n), qkv_in, g, beta)

    monkeypatch.setattr(kda_mod.KDAAttention, "_core_single", baked)
    plain = ModelRunner(model, _caches(model))
    g = _graphed(model, cap=64, stock_single=True)
    assert g.capture_stock(64) and 64 in g.stock_single_graphs     # n = bucket at the check
    plan = _plan(1, [SeqSlice(0, 0, 40, 0)], model.cfg.vocab_size, dict(TABLES))
    want, got = plain.logits(plan), g.logits(plan)
    assert g.counts["stock_single"] == 1
    bad = [not torch.allclose(a, b, rtol=TOL, atol=TOL)
           for a, b in zip(_real(plain.caches), _real(g.caches))]
    assert any(bad) or not torch.allclose(got, want, rtol=TOL, atol=TOL)


def test_a_piece_that_reads_the_batch_replays_wrong(model, monkeypatch):
    """The emulator can fail: with the MLA core captured inside the pieces (its batch layout
    baked in at the capture), the build's check step (another batch: the pad's attention
    skipped) already differs and leaves the bucket eager; forced in past the check, a replay
    on another batch differs from the eager step."""
    plain = ModelRunner(model, _caches(model))
    g = _graphed(model, cap=64)
    monkeypatch.setattr(mla_mod, "attention_core", lambda caches, fn, batch, *t:
                        fn(batch, caches, *t))
    assert not g.capture_stock(64)
    assert "replay left the eager step" in g.stock_failed.pop(64)
    monkeypatch.setattr(step_graph_mod, "check_replay", lambda *a: (0.0, "not checked"))
    assert g.capture_stock(64)
    plan = StepPlan(1, StepBatch([SeqSlice(0, 0, 40, 0), SeqSlice(1, 40, 24, 0)]),
                    _plan(1, [SeqSlice(0, 0, 64, 0)], model.cfg.vocab_size).tokens,
                    [39, 63], dict(TABLES), [])
    want, got = plain.logits(plan), g.logits(plan)
    assert g.counts["stock_graphed"] == 1
    assert not torch.allclose(got, want, rtol=1e-2, atol=1e-2)


class _CorruptingGraphs(EmulatedGraphs):
    """Emulated graphs whose piece `bad` replays its recorded operations, then changes every
    floating tensor it copied into (its core's input buffers): adds one ("add"), or moves its
    rows by one ("roll", invisible on a step whose rows are all equal): a graph that replays
    something else than it ran."""

    def __init__(self, bad: int, how: str = "add"):
        super().__init__()
        self.bad, self.how = bad, how

    def end(self):
        piece = super().end()
        if len(self.pieces) - 1 == self.bad:
            replay = piece.replay

            def corrupted():
                replay()
                for func, args, *_ in piece.ops:
                    if func is torch.ops.aten.copy_.default and args[0].is_floating_point():
                        if self.how == "add":
                            args[0].add_(1.0)
                        else:
                            args[0].copy_(args[0].roll(1, 0))
            piece.replay = corrupted
        return piece


def test_the_build_check_refuses_a_graph_that_replays_other_values(model):
    """capture_stock's check compares every core's inputs as the replay's graphs made them
    with the eager step's: a graph whose replay writes other values leaves its bucket eager,
    naming the first core input it reaches."""
    for how in ("add", "roll"):          # roll: the check's tokens differ row by row
        g = _graphed(model, cap=16, backend=_CorruptingGraphs(bad=1, how=how))
        assert not g.capture_stock(16)
        assert "core 1 input" in g.stock_failed[16], (how, g.stock_failed)
        assert g.stock_graph_of(_plan(1, [SeqSlice(0, 0, 9, 0)], model.cfg.vocab_size)) is None


def test_the_build_check_ignores_the_pad_sequence_attention(model, monkeypatch):
    """The build's warm-up and capture run the scratch sequence's attention (the kernels must
    meet the shapes), whose MLA rows share one scratch block: on a GPU its writes race, so
    two such passes differ (0.7 at bucket 2,048 on the H100). The check step skips the pad's
    attention, as served steps do: a core whose pad output changes from run to run does not
    fail a correct capture."""
    real_core = mla_mod.MLAAttention._core
    calls = []

    def racing_core(self, batch, caches, q, rows):
        out = real_core(self, batch, caches, q, rows)
        calls.append(caches.pad_slot)
        if caches.pad_slot is None:        # the pad's attention runs: a different race each time
            out = out + torch.randn_like(out)
        return out

    monkeypatch.setattr(mla_mod.MLAAttention, "_core", racing_core)
    g = _graphed(model, cap=16)
    assert g.capture_stock(16), g.stock_failed
    assert None in calls and g.scratch.slots[0] in calls     # both kinds of step ran


def test_a_host_read_under_capture_leaves_the_bucket_eager(model, monkeypatch):
    """A per-token op that reads a tensor on the host cannot be captured: the bucket's capture
    fails with the reason, and its steps run eagerly with the eager step's results."""
    real_route = moe_mod.route

    def route_with_host_read(logits, *a, **kw):
        float(logits.sum())                         # .item(): a host sync on a GPU
        return real_route(logits, *a, **kw)

    monkeypatch.setattr(moe_mod, "route", route_with_host_read)
    with pytest.raises(CaptureError, match="on the host"):
        capture(lambda: float(torch.ones(2).sum()))
    g = _graphed(model, cap=16)
    assert not g.capture_stock(16)
    assert "host" in g.stock_failed[16] and 16 not in g.stock_graphs
    plain = ModelRunner(model, _caches(model))
    plan = _plan(1, [SeqSlice(0, 0, 11, 0)], model.cfg.vocab_size, dict(TABLES))
    assert g.stock_graph_of(plan) is None
    assert torch.allclose(g.logits(plan), plain.logits(plan), rtol=TOL, atol=TOL)
    assert g.counts["stock_graphed"] == 0 and g.caches.pieces is None


def test_steps_above_the_cap_or_with_an_observer_run_eagerly(model):
    g = _graphed(model, cap=16)
    g.warm_prefill(64)
    assert sorted(g.stock_graphs) == prefill_buckets(16)
    V = model.cfg.vocab_size
    assert g.stock_graph_of(_plan(1, [SeqSlice(0, 0, 17, 0)], V)) is None
    assert g.stock_graph_of(_plan(1, [SeqSlice(0, 0, 9, 0)], V)).bucket == 16
    g.caches.kda_observer = lambda *a: None
    try:
        assert g.stock_graph_of(_plan(1, [SeqSlice(0, 0, 9, 0)], V)) is None
    finally:
        g.caches.kda_observer = None
    spec = _plan(1, [SeqSlice(0, 0, 1, 5)], V)
    assert g.stock_graph_of(StepPlan(1, spec.batch, spec.tokens, [0], {}, [],
                                     "specialized")) is None


def test_core_buffers_are_shared_and_sized_by_the_largest_bucket():
    bufs = piecewise.Buffers("cpu")
    a = bufs.get(("in", 0), (3,), torch.float32, 8)
    b = bufs.get(("in", 0), (3,), torch.float32, 4)
    assert b.data_ptr() == a.data_ptr() and b.shape == (4, 3)
    assert bufs.nbytes == 8 * 3 * 4
    with pytest.raises(RuntimeError, match="largest bucket first"):
        bufs.get(("in", 0), (3,), torch.float32, 16)


def test_a_core_whose_capture_differs_from_its_warm_pass_is_refused():
    def core(batch, caches, x):
        return x * 2

    warm = piecewise.Pieces("warm", 4)
    warm.core(core, None, None, torch.ones(4, 3))
    with pytest.raises(RuntimeError, match=r"\(T, \.\.\.\) with T = 4"):
        warm.core(core, None, None, torch.ones(5, 3))
    cap = piecewise.Pieces("capture", 4, signatures=warm.signatures,
                           buffers=piecewise.Buffers("cpu"), backend=EmulatedGraphs())
    cap.backend.begin()
    with pytest.raises(RuntimeError, match="in the warm pass"):
        cap.core(core, None, None, torch.ones(4, 2))
    cap.backend.abort()
    with pytest.raises(ValueError, match="accepted: warm, capture"):
        piecewise.Pieces("replay", 4)


def test_stock_graphs_setting_and_argument_are_checked(model, monkeypatch):
    for bad in ("300", "-1", "x", "16384"):
        monkeypatch.setenv("RAYDECODE_STOCK_GRAPHS", bad)
        with pytest.raises(ValueError, match=f"RAYDECODE_STOCK_GRAPHS={bad!r}"):
            settings.stock_graphs()
    monkeypatch.setenv("RAYDECODE_STOCK_GRAPHS", "2048")
    assert settings.stock_graphs() == 2048
    monkeypatch.setenv("RAYDECODE_STOCK_GRAPHS", "0")
    assert settings.stock_graphs() == 0
    monkeypatch.delenv("RAYDECODE_STOCK_GRAPHS")
    assert settings.stock_graphs() == 512          # the default: every chunk beside decodes
    assert settings.stock_single() is True         # and single-sequence graphs with it
    with pytest.raises(ValueError, match="stock_graphs=300"):
        _graphed(model, cap=300)
    # no backend (a CPU runner without capture): no stock graphs, whatever the cap
    off = GraphedRunner(model, _caches(model), num_slots=NS, num_blocks=NB, stock_graphs=64)
    assert off.stock_graph_tokens == 0 and off.stock_support == (False, "no graph backend "
                                                                 "(graphs off)")


def test_a_capture_failed_on_another_rank_leaves_the_bucket_eager_here(model, monkeypatch):
    """The ranks agree after the capture: a group sum of failures above this rank's own (as if
    another rank's capture raised) leaves the bucket eager here too, before the replay whose
    all-reduces the failed rank would not join."""
    class OtherRankFailed:
        def __init__(self):
            self.calls = 0

        def all_reduce(self, x):
            self.calls += 1
            return x + 1                        # one more failure in the group

    comm = OtherRankFailed()
    g = _graphed(model, cap=16)
    monkeypatch.setattr(g.model, "comm", comm, raising=False)
    replays = []
    monkeypatch.setattr(piecewise.StockGraph, "replay",
                        lambda self, batch: replays.append(batch) or self.hidden)
    assert not g.capture_stock(16)
    assert g.stock_failed[16] == "the capture failed on another rank of the group"
    assert comm.calls == 1 and replays == []    # agreed before the replay, which never ran


def test_single_seq_tensors_and_the_captures_own_index():
    """SingleSeq: `set` writes slot / continues / length into the device tensors the inline
    cores read; `index` is a fresh fla varlen index per eager call and, while a capture is
    open, the bucket's own held one (what fla caches for an eager pass never reaches a
    graph)."""
    s = piecewise.SingleSeq("cpu")
    s.set(3, 5, 40)
    assert (int(s.slot), bool(s.cont), int(s.n)) == (3, True, 40)
    s.set(2, 0, 1)
    assert (int(s.slot), bool(s.cont), int(s.n)) == (2, False, 1)
    a, b = s.index(64), s.index(64)
    assert a is not b and all(torch.equal(x, y) for x, y in zip(a, b))
    assert a[1].tolist() == [0, 64] and a[2].tolist() == [[0, 0]]     # one 64-row chunk
    s.capturing = True
    c, d = s.index(64), s.index(64)
    assert c is d and c is not a and s.index(128) is not c
