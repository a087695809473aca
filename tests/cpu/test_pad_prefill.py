"""Padded stock steps (engine/step_graph.py `GraphedRunner` with pad_prefill): a stock step
padded to its token bucket by one scratch sequence gives the unpadded step's logits and real
caches, for a chunk at position 0, a continued chunk beside a new sequence, and a mixed step
with a decode row; the attention cores skip the pad sequence (its scratch state unchanged), its
table is gone after the step, and the build's warm-up runs every bucket — the pad sequence
for real there, so its kernels compile — without touching a real slot. On the CPU the
tiny model in fp32 (what the CUDA rank runs at the bucket's shapes is the same code)."""
from __future__ import annotations

import pytest
import torch

from raydecode.engine.runner import ModelRunner
from raydecode.engine.scheduler import StepPlan
from raydecode.engine.step_graph import (GraphedRunner, PAD_MAX, graph_cache_sizes,
                                         prefill_bucket, prefill_buckets, unpadded_buckets)
from raydecode.kernels import settings
from raydecode.models.cache import SeqSlice, StepBatch
from raydecode.models.config import load_config
from raydecode.models.k3 import K3ForCausalLM, init_random_, make_caches

torch.set_num_threads(1)
NS, NB, BS = 4, 40, 16
SENTINEL = 3.0
TABLES = {0: list(range(0, 12)), 1: list(range(12, 24))}


@pytest.fixture(scope="module")
def model():
    return init_random_(K3ForCausalLM(load_config("tiny"), dtype=torch.float32), seed=7)


def _runners(model):
    ns, nb = graph_cache_sizes(NS, NB)
    caches = [make_caches(model.cfg, model.par, ns, nb, BS, torch.float32) for _ in range(2)]
    for c in caches:
        c.kda.conv.fill_(SENTINEL)
        c.kda.rec.fill_(SENTINEL)
        c.mla.pool.fill_(SENTINEL)
    plain = ModelRunner(model, caches[0])
    padded = GraphedRunner(model, caches[1], num_slots=NS, num_blocks=NB, pad_prefill=True)
    return plain, padded


def _plan(step: int, seqs: list[SeqSlice], V: int, tables=None) -> StepPlan:
    g = torch.Generator().manual_seed(step)
    n = sum(s.length for s in seqs)
    toks = torch.randint(0, V, (n,), generator=g).tolist()
    return StepPlan(step, StepBatch(seqs), toks, [s.start + s.length - 1 for s in seqs],
                    tables or {}, [])


def _real(c):
    """The real slots' and blocks' contents."""
    return (c.kda.rec[:, :NS], c.kda.conv[:, :NS], c.mla.pool[:, :NB])


def test_prefill_bucket_shapes():
    assert [prefill_bucket(t) for t in (1, 3, 200, 256, 257, 2047, 2049)] == \
        [1, 4, 256, 256, 512, 2048, 2304]
    assert prefill_bucket(PAD_MAX + 1) is None
    assert prefill_buckets(700) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 768]
    with pytest.raises(ValueError, match="0 tokens"):
        prefill_bucket(0)


def test_padded_stock_steps_equal_the_unpadded_ones(model):
    plain, padded = _runners(model)
    V = model.cfg.vocab_size
    steps = [[SeqSlice(0, 0, 37, 0)],                                   # 37 -> 64
             [SeqSlice(0, 0, 100, 37), SeqSlice(1, 100, 20, 0)],        # 120 -> 128
             [SeqSlice(0, 0, 1, 137), SeqSlice(1, 1, 50, 20)]]          # mixed: 51 -> 64
    scratch = padded.scratch.slots[0]
    for i, seqs in enumerate(steps):
        plan = _plan(i + 1, seqs, V, TABLES if i == 0 else None)
        before = padded.caches.kda.rec[:, scratch].clone()
        want = plain.logits(plan)
        got = padded.logits(plan)
        assert got.shape == want.shape
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (i, (got - want).abs().max())
        for a, b in zip(_real(plain.caches), _real(padded.caches)):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), i
        # the pad tokens ran the per-token work only: the cores skipped their sequence
        assert torch.equal(padded.caches.kda.rec[:, scratch], before)
        assert scratch not in padded.caches.mla.block_tables
        assert padded.caches.pad_slot is None
    assert padded.counts["padded"] == 3


def test_a_step_at_its_bucket_or_with_padding_off_runs_as_is(model):
    plain, padded = _runners(model)
    plan = _plan(1, [SeqSlice(0, 0, 64, 0)], model.cfg.vocab_size, TABLES)
    assert padded.pad_of(plan) is None                  # 64 tokens: already a bucket
    padded.logits(plan)
    assert padded.counts["padded"] == 0
    off = GraphedRunner(model, plain.caches, num_slots=NS, num_blocks=NB, pad_prefill=False)
    assert off.pad_of(_plan(2, [SeqSlice(0, 0, 5, 64)], model.cfg.vocab_size)) is None


def test_warm_prefill_runs_every_bucket_on_scratch_rows_only(model):
    _, padded = _runners(model)
    real = [t.clone() for t in _real(padded.caches)]
    scratch = padded.scratch.slots[0]
    before = padded.caches.kda.rec[:, scratch].clone()
    assert padded.warm_prefill(300) == prefill_buckets(300)
    assert all(torch.equal(a, b) for a, b in zip(real, _real(padded.caches)))
    # the warm-up's pad sequence runs its attention cores (their kernels' first runs)
    assert not torch.equal(padded.caches.kda.rec[:, scratch], before)
    assert not padded.caches.mla.block_tables
    assert padded.counts["padded"] == len(prefill_buckets(300))


def _unpadded(model) -> GraphedRunner:
    ns, nb = graph_cache_sizes(NS, NB)
    caches = make_caches(model.cfg, model.par, ns, nb, BS, torch.float32)
    caches.kda.rec.fill_(SENTINEL)
    caches.mla.pool.fill_(SENTINEL)
    return GraphedRunner(model, caches, num_slots=NS, num_blocks=NB, pad_prefill=False)


def test_unpadded_warm_up_runs_the_powers_of_two_and_the_budget_on_scratch_rows(model):
    plain = _unpadded(model)
    assert unpadded_buckets(300) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300]
    assert unpadded_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert unpadded_buckets(1) == [1]
    with pytest.raises(ValueError, match="budget 0"):
        unpadded_buckets(0)
    real = [t.clone() for t in _real(plain.caches)]
    assert plain.warm_prefill(300) == unpadded_buckets(300)
    assert all(torch.equal(a, b) for a, b in zip(real, _real(plain.caches)))
    assert not plain.caches.mla.block_tables and plain.counts["padded"] == 10


def test_prepare_runner_warms_stock_buckets_on_cuda_or_padded_only(model, monkeypatch):
    from raydecode.actors import rank_worker
    from raydecode.kernels import aot
    from raydecode.models.parallel import Parallel
    plain, (_, padded) = _unpadded(model), _runners(model)
    monkeypatch.setattr(aot, "prepare_kernel_cache", lambda *a, **kw: None)
    warmed = []
    monkeypatch.setattr(GraphedRunner, "capture_all", lambda self: [])
    monkeypatch.setattr(GraphedRunner, "warm_prefill", lambda self, b: warmed.append(
        (self.pad_prefill, b)) or [])
    monkeypatch.setattr(rank_worker, "freeze_host_heap", lambda: 0)
    for r in (plain, padded):
        r.prefill_budget = 300
        rank_worker.prepare_runner(r, Parallel(), "cpu")
    assert warmed == [(True, 300)]          # a CPU rank warms only what padding needs
    rank_worker.prepare_runner(plain, Parallel(), "cuda:0")
    assert warmed[-1] == (False, 300)


def test_pad_prefill_setting_is_strict(monkeypatch):
    monkeypatch.setenv("RAYDECODE_PAD_PREFILL", "yes")
    with pytest.raises(ValueError, match="RAYDECODE_PAD_PREFILL='yes'"):
        settings.pad_prefill()
    monkeypatch.setenv("RAYDECODE_PAD_PREFILL", "1")
    assert settings.pad_prefill() is True
    monkeypatch.setenv("RAYDECODE_PAD_PREFILL", "0")
    assert settings.pad_prefill() is False
    monkeypatch.delenv("RAYDECODE_PAD_PREFILL")
    assert settings.pad_prefill() is None


def test_padding_is_on_by_default_for_cuda_runners_only(monkeypatch):
    """Unset: a CUDA runner pads (its unwarmed eager shapes' first runs cost up to 2.4x),
    a CPU one does not; the setting and an explicit argument override the device."""
    from raydecode.engine.step_graph import resolve_pad
    monkeypatch.delenv("RAYDECODE_PAD_PREFILL", raising=False)
    assert resolve_pad(None, "cuda") is True and resolve_pad(None, "cpu") is False
    assert resolve_pad(None, "cuda:1") is True
    monkeypatch.setenv("RAYDECODE_PAD_PREFILL", "0")
    assert resolve_pad(None, "cuda") is False and resolve_pad(True, "cuda") is True
    monkeypatch.setenv("RAYDECODE_PAD_PREFILL", "1")
    assert resolve_pad(None, "cpu") is True and resolve_pad(False, "cpu") is False
