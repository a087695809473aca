"""Graph-shaped decode steps (engine/step_graph.py) on the tiny K3 model, bf16, TP1, CPU: the
statics path (bucket padding, scratch rows, the model reading caches.statics) runs eagerly here,
everything but the CUDA capture/replay (tests/gpu/test_step_graph_gpu.py).

A plain ModelRunner and a GraphedRunner get identical plans from engine allocators on
identically initialised caches (sentinel values everywhere); their logits and the real slots'
and blocks' contents must agree, the unused real slots keep the sentinel, and the scratch rows
show that the padding ran."""
from __future__ import annotations

import pytest
import torch

import raydecode.models.mla as mla
from raydecode.engine.cache import BlockAllocator, SlotAllocator
from raydecode.engine.runner import ModelRunner
from raydecode.engine.scheduler import StepPlan
from raydecode.engine.step_graph import (PAD_POS, GraphedRunner, ScratchRows, StepStatics,
                                         bucket_for, graph_cache_sizes, max_padding, resolve,
                                         scratch_bytes, setting)
from raydecode.kernels import kda_decode as kda_decode_op
from raydecode.models.cache import MLALatentCache, SeqSlice, StepBatch
from raydecode.models.config import load_config
from raydecode.models.k3 import K3ForCausalLM, init_random_, make_caches
from raydecode.models.mla import decode_meta

from _numerics import max_rel_err

torch.set_num_threads(1)
BF = torch.bfloat16
NS, NB, BS = 8, 40, 4          # real slots, real blocks, block size
BUCKETS = (1, 2, 4, 8)         # max padding 3: T = 5 runs in bucket 8
SENTINEL = 7.0
# Not bit for bit: the CPU references batch T (plain) vs B (padded) rows through bmm/GEMM
# calls whose blocking depends on the row count (the fp32 KDA state differs by ~1 ulp at
# T = 3 vs B = 4), so a downstream bf16 rounding may differ. Observed: logits equal bit for bit.
TOL = 1e-2           # max-abs relative, logits and bf16 caches
STATE_TOL = 1e-5     # fp32 recurrent state


@pytest.fixture(scope="module")
def model():
    return init_random_(K3ForCausalLM(load_config("tiny"), dtype=BF), seed=5)


class Twin:
    """Plain and graphed runners on twin caches, driven by engine-side allocators."""

    def __init__(self, model, buckets=BUCKETS, seed=0):
        self.cfg = model.cfg
        ns, nb = graph_cache_sizes(NS, NB, buckets)
        self.caches = [make_caches(self.cfg, model.par, ns, nb, BS, BF) for _ in range(2)]
        for c in self.caches:
            c.kda.conv.fill_(SENTINEL)
            c.kda.rec.fill_(SENTINEL)
            c.mla.pool.fill_(SENTINEL)
        self.plain = ModelRunner(model, self.caches[0])
        self.graphed = GraphedRunner(model, self.caches[1], num_slots=NS, num_blocks=NB,
                                     buckets=buckets)
        self.slots, self.blocks = SlotAllocator(NS), BlockAllocator(NB, BS)
        self.pos: dict[int, int] = {}          # slot -> tokens cached
        self.used: set[int] = set()            # real slots ever stepped
        self.gen = torch.Generator().manual_seed(seed)
        self.step_id = 0

    def _plan(self, seqs, changed, reset, path="specialized") -> StepPlan:
        self.step_id += 1
        T = sum(s.length for s in seqs)
        toks = torch.randint(0, self.cfg.vocab_size, (T,), generator=self.gen).tolist()
        return StepPlan(self.step_id, StepBatch(seqs), toks, [s.end - 1 for s in seqs],
                        changed, reset, path)

    def run(self, plan) -> None:
        a, b = self.plain.run(plan), self.graphed.run(plan)
        assert a.shape == b.shape == (len(plan.sample_rows), self.cfg.vocab_size)
        assert torch.isfinite(b).all()
        assert max_rel_err(b, a) < TOL, f"step {plan.step_id}: {max_rel_err(b, a)}"

    def admit(self, lengths: list[int]) -> list[int]:
        """Prefill new sequences (multi-token: both runners take ModelRunner.run)."""
        seqs, changed, slots, at = [], {}, [], 0
        for n in lengths:
            s = self.slots.allocate()
            self.blocks.ensure(s, n)
            changed[s] = list(self.blocks.tables[s])
            seqs.append(SeqSlice(s, at, n, 0))
            at += n
            slots.append(s)
            self.pos[s] = n
        self.used |= set(slots)
        self.run(self._plan(seqs, changed, list(slots)))
        return slots

    def decode(self, slots: list[int], path="specialized") -> StepPlan:
        changed = {}
        for s in slots:
            if self.blocks.ensure(s, self.pos[s] + 1):
                changed[s] = list(self.blocks.tables[s])
        plan = self._plan(StepBatch.decode(slots, [self.pos[s] for s in slots]).seqs,
                          changed, [], path)
        self.run(plan)
        for s in slots:
            self.pos[s] += 1
        return plan

    def release(self, slot: int) -> None:
        for r in (self.plain, self.graphed):
            r.release([slot])
        self.blocks.release(slot)
        self.slots.release(slot)
        del self.pos[slot]

    def check_caches(self) -> None:
        p, g = self.caches
        u = sorted(self.used)
        assert max_rel_err(g.kda.rec[:, u], p.kda.rec[:, u]) < STATE_TOL
        assert max_rel_err(g.kda.conv[:, u], p.kda.conv[:, u]) < TOL
        assert max_rel_err(g.mla.pool[:, :NB], p.mla.pool[:, :NB]) < TOL     # every real block
        free = [s for s in range(NS) if s not in self.used]
        for c in (p, g):      # no real slot outside the batches was written, by either runner
            assert (c.kda.rec[:, free] == SENTINEL).all()
            assert (c.kda.conv[:, free] == SENTINEL).all()
        sc = self.graphed.scratch
        assert (p.kda.rec[:, NS:] == SENTINEL).all() and (p.mla.pool[:, sc.block] == SENTINEL).all()


def test_graph_shaped_decode_equals_plain(model, monkeypatch):
    seen = {"kda": 0, "mla": 0}       # fused calls that received the statics' own tensors
    absorbed = model.options.mla_absorbed_q
    op = "mla_decode_absorbed" if absorbed else "mla_decode_fused"   # the DCP-1 op
    real_kda, real_mla = kda_decode_op.kda_decode, getattr(mla, op)
    n_pre = 3 if absorbed else 4            # arguments before (pool, table, store, lens)

    def kda_spy(*a, **kw):
        st = twin.graphed.caches.statics
        seen["kda"] += st is not None and kw["slots"] is st.slots
        return real_kda(*a, **kw)

    def mla_spy(*a, **kw):
        st = twin.graphed.caches.statics
        _, table, store, seq_lens = a[n_pre:n_pre + 4]
        seen["mla"] += (st is not None and table is st.table and store is st.store
                        and seq_lens is st.seq_lens)
        return real_mla(*a, **kw)

    monkeypatch.setattr(kda_decode_op, "kda_decode", kda_spy)
    monkeypatch.setattr(mla, op, mla_spy)
    twin = Twin(model)
    a, b, c, d, e = twin.admit([3, 6, 2, 7, 4])           # slots 0..4
    decode_steps = 0
    for _ in range(2):                                    # T = 3 -> bucket 4 (1 pad row)
        twin.decode([c, a, e])
        decode_steps += 1
    for _ in range(3):                                    # T = 5 -> bucket 8 (3 pad rows);
        twin.decode([a, b, c, d, e])                      # positions cross block boundaries
        decode_steps += 1
    twin.release(b)                                       # slot reuse: b's slot, new blocks
    (f,) = twin.admit([5])
    assert f == b
    for sl in ([a, f, c, d, e], [f, d], [d]):            # buckets 8, 2, 1 (no padding)
        twin.decode(sl)
        decode_steps += 1
    twin.decode([e, f, a], path="stock")                 # stock decode: the plain path
    twin.check_caches()
    g = twin.graphed
    assert g.counts == {"graphed": 0, "eager_statics": decode_steps, "plain": 3, "captured": 0,
                        "padded": 0, "stock_graphed": 0, "stock_captured": 0,
                        "stock_single": 0, "stock_mixed": 0}
    kda_layers, mla_layers = len(model.cfg.kda_layer_ids), len(model.cfg.mla_layers)
    assert seen == {"kda": kda_layers * decode_steps, "mla": mla_layers * decode_steps}
    sc = g.scratch
    cg = twin.caches[1]           # the padding ran on the scratch rows, and only there
    assert not (cg.kda.rec[:, list(sc.slots)] == SENTINEL).all()
    assert not (cg.mla.pool[:, sc.block] == SENTINEL).all()
    assert set(g.statics) == {1, 2, 4, 8}


def test_statics_rows_match_decode_meta_and_pad_with_scratch():
    """Per DCP rank: the statics' first T rows are decode_meta's (the eager path's paging),
    the padded rows point only at scratch; a table replaced by one of the same length (slot
    reuse) is re-copied; a smaller step resets the rows it no longer uses."""
    sc = ScratchRows(num_slots=6, count=3, block=12)
    tables = {4: [3, 7], 0: [1], 2: [5, 6, 8, 9]}
    seqs = StepBatch.decode([4, 0, 2], [6, 3, 13]).seqs
    plan = StepPlan(1, StepBatch(seqs), [11, 12, 13], [0, 1, 2], {}, [], "specialized")
    for D in (1, 2, 4):
        for r in range(D):
            cache = MLALatentCache(1, 13, 4, 8, BF, dcp_rank=r, dcp_size=D)
            cache.block_tables.update(tables)
            st = StepStatics(4, 6, sc, 4, r, D)
            st.fill(plan, cache.block_tables)
            table, store, lens = decode_meta(plan.batch, cache, "cpu")
            for t, s in enumerate(plan.batch.seqs):     # decode_meta pads with 0, statics
                n = len(tables[s.slot])                  # with the scratch block
                assert torch.equal(st.table[t, :n], table[t, :n])
                assert (st.table[t, n:] == sc.block).all()
            assert torch.equal(st.store[:3], store)
            assert torch.equal(st.seq_lens[:3], lens)
            assert st.tokens.tolist() == [11, 12, 13, 0] and st.slots.tolist() == [4, 0, 2, 6]
            assert (st.table[3] == sc.block).all()
            assert st.store[3] == (PAD_POS // D if PAD_POS % D == r else -1)
            assert st.seq_lens[3] == (PAD_POS + D - r) // D
    tables[0] = [10]                      # slot 0 released and reused: same length, new block
    st.fill(plan, tables)
    assert st.table[1, 0] == 10 and (st.table[1, 1:] == sc.block).all()
    one = StepPlan(2, StepBatch.decode([2], [14]), [5], [0], {}, [], "specialized")
    st.fill(one, tables)
    assert (st.table[1:] == sc.block).all() and st.slots.tolist() == [2, 6, 7, 8]
    # a refused fill leaves no half-updated row behind: row 0's new table is still copied later
    tables[2] = [11, 6, 8, 9]
    with pytest.raises(RuntimeError, match="position 20"):
        st.fill(StepPlan(3, StepBatch.decode([2, 0], [14, 20]), [1, 2], [0, 1], {}, [],
                         "specialized"), tables)
    st.fill(one, tables)
    assert st.table[0, :4].tolist() == [11, 6, 8, 9] and st.tokens.tolist() == [5, 0, 0, 0]


def test_capture_all_uses_idle_rows_and_resets_them(model):
    twin = Twin(model)
    g, c = twin.graphed, twin.caches[1]
    assert g.capture is False and g.capture_all() == [8, 4, 2, 1]
    # bucket 8 = 3 scratch slots + real slots 0..4, reset afterwards; real blocks untouched
    assert (c.kda.rec[:, :5] == 0).all() and (c.kda.rec[:, 5:NS] == SENTINEL).all()
    assert (c.mla.pool[:, :NB] == SENTINEL).all()
    assert not (c.mla.pool[:, g.scratch.block] == SENTINEL).all()
    assert g.ready(5) and g.ready(1) and not g.ready(9)
    twin.admit([3])
    with pytest.raises(RuntimeError, match="live sequences"):
        g.capture_all()


def test_plans_outside_the_envelope_run_the_plain_path(model):
    twin = Twin(model)
    g = twin.graphed
    slots = twin.admit([2, 2, 2])                                    # prefill: plain
    twin.decode(slots[:3])                                         # graph-shaped
    assert g.counts["plain"] == 1 and g.counts["eager_statics"] == 1
    big = Twin(model, buckets=(1, 2, 4))                           # 5 > largest bucket 4
    s5 = big.admit([2] * 5)
    big.decode(s5)
    big.decode(s5[:4])
    assert big.graphed.counts == {"graphed": 0, "eager_statics": 1, "plain": 2, "captured": 0,
                                  "padded": 0, "stock_graphed": 0, "stock_captured": 0,
                                  "stock_single": 0, "stock_mixed": 0}
    plan = StepPlan(99, StepBatch.decode([0, 1], [3, 0]), [1, 2], [0, 1], {}, [], "specialized")
    assert "position 0" in g.why_not(plan)
    assert "path 'stock'" in g.why_not(StepPlan(99, plan.batch, [1, 2], [0, 1], {}, []))
    assert "prefill" in g.why_not(StepPlan(99, StepBatch([SeqSlice(0, 0, 2, 3)]), [1, 2], [1],
                                           {}, [], "specialized"))
    fp32 = init_random_(K3ForCausalLM(load_config("tiny")), seed=1)
    ns, nb = graph_cache_sizes(NS, NB)
    r32 = GraphedRunner(fp32, make_caches(fp32.cfg, fp32.par, ns, nb, BS), num_slots=NS,
                        num_blocks=NB)
    assert not r32.support[0] and "bf16" in r32.support[1] and not r32.ready(1)


def test_bad_inputs_are_named():
    sc = ScratchRows(num_slots=4, count=1, block=8)
    st = StepStatics(2, 3, sc, 4)
    dec = lambda slots, pos: StepPlan(1, StepBatch.decode(slots, pos), [1] * len(slots),
                                      list(range(len(slots))), {}, [], "specialized")
    with pytest.raises(ValueError, match="3 sequences for bucket 2"):
        st.fill(dec([0, 1, 2], [1, 1, 1]), {0: [0], 1: [1], 2: [2]})
    with pytest.raises(ValueError, match="slot 4 outside the real slots"):
        st.fill(dec([4], [1]), {4: [0]})
    with pytest.raises(ValueError, match="repeat"):
        st.fill(dec([1, 1], [1, 2]), {1: [0]})
    with pytest.raises(ValueError, match="block 8 is scratch"):
        st.fill(dec([1], [1]), {1: [8]})
    with pytest.raises(ValueError, match="max_blocks = 3"):
        st.fill(dec([1], [1]), {1: [0, 1, 2, 3]})
    with pytest.raises(RuntimeError, match="position 9 with 2 cache blocks"):
        st.fill(dec([1], [9]), {1: [0, 1]})
    with pytest.raises(ValueError, match="no block table"):
        st.fill(dec([1], [1]), {})
    with pytest.raises(ValueError, match="decode-only"):
        st.fill(StepPlan(1, StepBatch([SeqSlice(0, 0, 2, 1)]), [1, 2], [1], {}, []), {0: [0]})
    assert bucket_for(3) == 4 and bucket_for(5) == 8 and bucket_for(65) is None
    assert max_padding() == 31 and max_padding((1, 2, 4, 8)) == 3
    for bad in ((), (2, 1), (0, 4), (1, 1, 2), (1.5,)):
        with pytest.raises(ValueError, match="strictly ascending"):
            graph_cache_sizes(4, 4, bad)


def test_runner_and_env_validation(model, monkeypatch):
    small = make_caches(model.cfg, model.par, NS, NB, BS, BF)      # no scratch rows
    with pytest.raises(ValueError, match="build the caches with graph_cache_sizes"):
        GraphedRunner(model, small, num_slots=NS, num_blocks=NB, buckets=BUCKETS)
    ns, nb = graph_cache_sizes(NS, NB, BUCKETS)
    ok = make_caches(model.cfg, model.par, ns, nb, BS, BF)
    with pytest.raises(ValueError, match="max_blocks=0"):
        GraphedRunner(model, ok, num_slots=NS, num_blocks=NB, buckets=BUCKETS, max_blocks=0)
    with pytest.raises(ValueError, match="capture=True on device cpu"):
        GraphedRunner(model, ok, num_slots=NS, num_blocks=NB, buckets=BUCKETS, capture=True)
    monkeypatch.delenv("RAYDECODE_STEP_GRAPHS", raising=False)
    assert setting() is None                                  # auto
    assert resolve(None, "cuda:0") and not resolve(None, "cpu")
    monkeypatch.setenv("RAYDECODE_STEP_GRAPHS", "1")
    assert setting() is True and resolve(True, "cpu")
    monkeypatch.setenv("RAYDECODE_STEP_GRAPHS", "0")
    assert setting() is False and not resolve(False, "cuda")
    monkeypatch.setenv("RAYDECODE_STEP_GRAPHS", "yes")
    with pytest.raises(ValueError, match="RAYDECODE_STEP_GRAPHS='yes'; accepted"):
        setting()


def test_statics_set_but_not_fused_raises(model):
    """A layer that would build its own paging from the batch under caches.statics (here: the
    stock path) refuses, so a captured graph can never bake in one step's host values."""
    ns, nb = graph_cache_sizes(NS, NB, BUCKETS)
    c = make_caches(model.cfg, model.par, ns, nb, BS, BF)
    c.statics = StepStatics(1, 4, ScratchRows(NS, 3, NB), BS)
    with pytest.raises(RuntimeError, match="graph-shaped step"), torch.inference_mode():
        model(torch.tensor([1]), StepBatch.decode([0], [1]), c, path="stock")


def test_scratch_bytes_is_what_the_scratch_rows_allocate(model):
    cfg = model.cfg
    size = lambda c: sum(t.numel() * t.element_size()
                         for t in (c.kda.conv, c.kda.rec, c.mla.pool))
    base = make_caches(cfg, model.par, NS, NB, BS, BF)
    more = make_caches(cfg, model.par, *graph_cache_sizes(NS, NB), BS, BF)
    got = scratch_bytes(cfg, model.par, BS, BF)
    assert size(more) - size(base) == got["kda_slots"] + got["mla_block"] > 0
