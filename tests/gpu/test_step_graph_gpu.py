"""Whole-step CUDA graphs (engine/step_graph.py) on one CUDA GPU, TP1, the tiny K3 model in
bf16: per-bucket capture + replay gives the eager specialized step's logits and cache contents
over steps with changing positions, slots and batch sizes (buckets 1..64, 31 padded rows at
T = 33), the statics are re-read by every replay, `capture_all` captures every bucket up front,
and the eager vs graphed step time is printed. Not run in CI; needs a CUDA device.

Tolerances, not bit equality: the graph's MLA block table is max_blocks wide, so the split-KV
heuristic (kernels/mla_decode.py default_num_splits) may pick another split count than the
eager step's table width does, and the MoE decode kernels sum with fp32 atomics (order varies
run to run)."""
from __future__ import annotations

import dataclasses
import statistics
import time

import pytest
import torch

from raydecode.engine.cache import BlockAllocator, SlotAllocator
from raydecode.engine.runner import ModelRunner
from raydecode.engine.scheduler import StepPlan
from raydecode.engine.step_graph import BUCKETS, GraphedRunner, graph_cache_sizes
from raydecode.models.cache import SeqSlice, StepBatch
from raydecode.models.config import load_config
from raydecode.models.k3 import K3ForCausalLM, init_random_, make_caches

from _numerics import TOL as NUM_TOL
from _numerics import max_rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BF = torch.bfloat16
NS, NB, BS, MAXB = 64, 1024, 16, 16     # real slots, real blocks, block size, table width
TOL = NUM_TOL["bf16_path"]              # bf16, as tests/gpu/test_specialized_gpu.py
SENTINEL = 7.0
SEED = 20261129


@pytest.fixture(scope="module")
def model():
    with torch.device("cuda"):
        return init_random_(K3ForCausalLM(load_config("tiny"), dtype=BF), seed=5)


class Driver:
    """Runners named in `kinds` ('plain', 'graph', 'eager': GraphedRunner without capture) on
    twin caches (scratch-sized, sentinel-filled), fed identical plans from engine allocators."""

    def __init__(self, model, kinds=("plain", "graph"), seed=SEED):
        self.cfg = model.cfg
        ns, nb = graph_cache_sizes(NS, NB)
        self.caches, self.runners = {}, {}
        for k in kinds:
            c = self.caches[k] = make_caches(self.cfg, model.par, ns, nb, BS, BF, device="cuda")
            for t in (c.kda.conv, c.kda.rec, c.mla.pool):
                t.fill_(SENTINEL)
            self.runners[k] = (ModelRunner(model, c, "cuda") if k == "plain" else
                               GraphedRunner(model, c, "cuda", num_slots=NS, num_blocks=NB,
                                             max_blocks=MAXB, capture=k == "graph"))
        self.slots, self.blocks = SlotAllocator(NS), BlockAllocator(NB, BS)
        self.pos: dict[int, int] = {}
        self.gen = torch.Generator().manual_seed(seed)
        self.step_id = 0

    def _plan(self, seqs, changed, reset) -> StepPlan:
        self.step_id += 1
        T = sum(s.length for s in seqs)
        toks = torch.randint(0, self.cfg.vocab_size, (T,), generator=self.gen).tolist()
        return StepPlan(self.step_id, StepBatch(seqs), toks, [s.end - 1 for s in seqs],
                        changed, reset, "specialized")

    def run(self, plan) -> dict[str, torch.Tensor]:
        out = {k: r.run(plan) for k, r in self.runners.items()}
        for k, v in out.items():
            assert torch.isfinite(v).all(), (k, plan.step_id, SEED)
            if k != "plain":
                assert max_rel_err(v, out["plain"]) < TOL, (k, plan.step_id, max_rel_err(v, out["plain"]),
                                                     f"seed {SEED}")
        return out

    def admit(self, lengths) -> list[int]:
        seqs, changed, at = [], {}, 0
        for n in lengths:
            s = self.slots.allocate()
            self.blocks.ensure(s, n)
            changed[s] = list(self.blocks.tables[s])
            seqs.append(SeqSlice(s, at, n, 0))
            at += n
            self.pos[s] = n
        self.run(self._plan(seqs, changed, [s.slot for s in seqs]))
        return [s.slot for s in seqs]

    def decode(self, slots) -> dict[str, torch.Tensor]:
        changed = {}
        for s in slots:
            if self.blocks.ensure(s, self.pos[s] + 1):
                changed[s] = list(self.blocks.tables[s])
        out = self.run(self._plan(StepBatch.decode(slots, [self.pos[s] for s in slots]).seqs,
                                  changed, []))
        for s in slots:
            self.pos[s] += 1
        return out

    def check_caches(self, used: list[int]) -> None:
        p = self.caches["plain"]
        free = [s for s in range(NS) if s not in used]
        for k, c in self.caches.items():
            assert max_rel_err(c.kda.rec[:, used], p.kda.rec[:, used]) < TOL, k
            assert max_rel_err(c.mla.pool[:, :NB], p.mla.pool[:, :NB]) < TOL, k
            assert (c.kda.rec[:, free] == SENTINEL).all(), k


def test_replay_equals_eager_over_buckets(model):
    d = Driver(model, kinds=("plain", "graph", "eager"))
    slots = d.admit([3 + (i % 29) for i in range(40)])     # blocks of 16: boundaries crossed
    g = d.runners["graph"]
    schedule = [slots[:40], slots[5:8], slots[9:10], slots[10:15], slots[:17], slots[20:22],
                slots[:40], slots[30:33], slots[:33], slots[1:2]]
    for _ in range(2):                   # first pass captures each bucket, second replays
        for sl in schedule:
            d.decode(sl)
    assert not g.capture_failed, g.capture_failed
    assert g.counts["captured"] == len({1, 2, 4, 8, 32, 64}) == len(g.graphs)
    assert g.counts["graphed"] == 2 * len(schedule)
    d.check_caches(slots)
    sc = g.scratch        # T = 33 in bucket 64: all 31 scratch slots ran
    touched = [(d.caches["graph"].kda.rec[:, s] != SENTINEL).any().item() for s in sc.slots]
    assert all(touched), touched


def test_replay_rereads_statics(model):
    """Two steps in one bucket with different sequences, positions and tokens: each replay
    matches the eager step for ITS plan, and the two outputs differ (a stale replay would
    repeat the first)."""
    d = Driver(model)
    slots = d.admit([5, 9, 17, 2, 30, 11])
    first = d.decode(slots[:3])                  # bucket 4: warm-up + capture
    a = d.decode(slots[3:6])["graph"]            # replay, other slots
    b = d.decode(slots[:3])["graph"]             # replay, the first slots one step on
    assert not d.runners["graph"].capture_failed, d.runners["graph"].capture_failed
    assert d.runners["graph"].counts["captured"] == 1
    assert max_rel_err(a, b) > 0.1 and max_rel_err(b, first["graph"]) > 0.05
    d.check_caches(slots)


def test_capture_all_then_every_step_replays(model):
    d = Driver(model)
    g = d.runners["graph"]
    assert g.capture_all() == sorted(BUCKETS, reverse=True)
    assert not g.capture_failed, g.capture_failed
    assert all(g.ready(n) for n in range(1, 65)) and not g.ready(65)
    # capture_all's warm-up wrote real slots 0..32 (bucket 64); they were reset to zero
    assert (d.caches["graph"].kda.rec[:, :33] == 0).all()
    slots = d.admit([4, 7, 12, 3, 9])
    for sl in (slots, slots[:2], slots[1:4], slots[4:], slots):
        d.decode(sl)
    assert g.counts["captured"] == len(BUCKETS) and g.counts["graphed"] == 5


def test_time_eager_vs_graphed_step(model):
    """Prints the tiny model's decode step time, eager specialized vs graph replay (host
    fill + replay + logits copy); no assertion on the times."""
    for T in (1, 8, 64):
        d = Driver(model, seed=SEED + T)
        slots = d.admit([8] * T)
        for _ in range(3):                      # capture + warm replays
            d.decode(slots)
        times = {k: [] for k in d.runners}
        for _ in range(20):
            changed = {}
            for s in slots:
                if d.blocks.ensure(s, d.pos[s] + 1):
                    changed[s] = list(d.blocks.tables[s])
            plan = d._plan(StepBatch.decode(slots, [d.pos[s] for s in slots]).seqs, changed, [])
            for k, r in d.runners.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                r.run(plan)
                torch.cuda.synchronize()
                times[k].append(time.perf_counter() - t0)
            for s in slots:
                d.pos[s] += 1
        eager, graph = (statistics.median(times[k]) * 1e3 for k in ("plain", "graph"))
        print(f"\n[step graph] tiny bf16 T={T}: eager {eager:.2f} ms, graphed {graph:.2f} ms, "
              f"eager/graphed {eager / graph:.1f}x")


def test_rank_runner_defaults_to_graphs_on_cuda(monkeypatch):
    """RAYDECODE_STEP_GRAPHS unset (auto): a CUDA rank builds a GraphedRunner for a model the
    graphs support, the eager ModelRunner for one they do not (fp32: eager specialized, where
    '1' would capture nothing and run stock); '0' turns them off."""
    from raydecode.actors.rank_worker import ShardSpec, load_runner
    from raydecode.models.parallel import LocalComm, Parallel

    monkeypatch.delenv("RAYDECODE_STEP_GRAPHS", raising=False)
    spec = ShardSpec("tiny", dtype="bfloat16", num_slots=4)

    def build(**kw):
        return load_runner(dataclasses.replace(spec, **kw), Parallel(), LocalComm(), "cuda")

    auto = build()
    assert isinstance(auto, GraphedRunner) and auto.support == (True, "ok")
    assert type(build(step_graphs=False)) is ModelRunner
    assert type(build(dtype="float32")) is ModelRunner
    forced = build(dtype="float32", step_graphs=True)
    assert isinstance(forced, GraphedRunner) and not forced.support[0]
