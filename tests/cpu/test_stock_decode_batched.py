"""The stock path's one-token continuations run batched (issue 28: a mixed step of 63 decoders
+ a chunk cost 318 ms for 8 K3 layers on the H200, the per-sequence loops of KDA and MLA
launching ~50 kernels per decoder and layer): models/kda.py `_decode_rows`, models/cache.py
`write_seqs` / `gather_singles`, models/mla.py `_attend_singles`; on by default on CUDA only
(models/cache.py `BATCH_DECODE_ROWS`), here forced on. The ground truth is the per-sequence code: each sequence in a step of its own (MLA's loop) with a speculative
observer set (KDA keeps its loop under one); in fp32 both give the same hidden states and
caches to summation order."""
from __future__ import annotations

import pytest
import torch

from raydecode.models import cache as cache_mod
from raydecode.models.cache import SeqSlice, StepBatch
from raydecode.models.kda import KDAAttention
from raydecode.models.mla import MLAAttention, singles_groups

from _numerics import rel_err
from _prefill_forced import clone_caches
from _stock_steps import PROMPTS, prefilled_tiny

torch.set_num_threads(1)
BS = 8


@pytest.fixture(autouse=True)
def batched_on_cpu(monkeypatch):
    monkeypatch.setattr(cache_mod, "BATCH_DECODE_ROWS", True)


@pytest.fixture(scope="module")
def setup():
    return prefilled_tiny(torch.float32, block_size=BS)


@pytest.mark.parametrize("chunk,impl", [(0, "auto"), (9, "auto"), (9, "sdpa")])
def test_batched_decode_rows_equal_the_per_sequence_code(setup, chunk, impl, monkeypatch):
    """Four decoders (+ a 9-token chunk on slot 4: a mixed step; with "sdpa" the chunk's
    MLA runs the flash route, as on CUDA, and the decode rows its separate branch) in one step
    against each sequence in a step of its own, KDA's loop forced by an observer."""
    model, base, V = setup
    monkeypatch.setattr(MLAAttention, "prefill_impl", impl)
    ran = []
    for cls, name in ((KDAAttention, "_decode_rows"), (MLAAttention, "_attend_singles")):
        orig = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda self, *a, _o=orig, _n=name: (   # (name, D)
            ran.append((_n, len(next(x for x in a if isinstance(x, list))))),
            _o(self, *a))[1])
    g = torch.Generator().manual_seed(1)
    dec = [SeqSlice(s, i, 1, PROMPTS[s]) for i, s in enumerate((3, 0, 2, 1))]
    seqs = dec + ([SeqSlice(4, len(dec), chunk, PROMPTS[4])] if chunk else [])
    tokens = torch.randint(0, V, (len(dec) + chunk,), generator=g)
    batched, alone = clone_caches(base), clone_caches(base)
    alone.kda_observer = lambda *a: None
    with torch.inference_mode():
        got = model(tokens, StepBatch(seqs), batched)
        want = torch.cat([model(tokens[s.start:s.end], StepBatch([s._replace(start=0)]), alone)
                          for s in seqs])
    L = model.cfg.num_layers
    n_mla = sum(isinstance(layer.self_attn, MLAAttention) for layer in model.model.layers)
    # the batched code ran in the batched step (all four decoders at once), never alone
    assert ran.count(("_decode_rows", 4)) == L - n_mla and ran.count(("_attend_singles", 4)) \
        == n_mla and len(ran) == L
    assert rel_err(got, want) < 1e-5, rel_err(got, want)
    for s in seqs:
        assert rel_err(got[s.start:s.end], want[s.start:s.end]) < 1e-5, s
    for a, b in ((batched.kda.conv, alone.kda.conv), (batched.kda.rec, alone.kda.rec),
                 (batched.mla.pool, alone.mla.pool)):
        assert rel_err(a, b) < 1e-5
    # the step changed the caches: a dropped write would leave them equal to the base
    assert not torch.equal(batched.kda.rec, base.kda.rec)
    assert not torch.equal(batched.mla.pool, base.mla.pool)


def test_a_wrong_slot_state_shows(setup):
    """The check can fail: a decoder whose state row is another slot's moves its output."""
    model, base, V = setup
    tokens = torch.tensor([5, 6])
    seqs = [SeqSlice(0, 0, 1, PROMPTS[0]), SeqSlice(1, 1, 1, PROMPTS[1])]
    a, b = clone_caches(base), clone_caches(base)
    b.kda.rec[:, 0] = base.kda.rec[:, 1]
    with torch.inference_mode():
        ha, hb = model(tokens, StepBatch(seqs), a), model(tokens, StepBatch(seqs), b)
    assert rel_err(hb[:1], ha[:1]) > 1e-3 and rel_err(hb[1:], ha[1:]) < 1e-6


def test_singles_groups_bound_the_padded_gather():
    seqs = [SeqSlice(i, i, 1, p) for i, p in enumerate([9, 99, 10, 500, 3, 3])]
    groups = singles_groups(seqs, max_rows=400)
    assert [s for grp in groups for s in grp] == seqs                       # in order, all
    for grp in groups:
        assert len(grp) == 1 or len(grp) * max(s.pos + 1 for s in grp) <= 400
    assert [len(grp) for grp in groups] == [3, 1, 2]
    assert singles_groups([]) == []


def test_the_cpu_path_keeps_the_per_sequence_code_by_default(setup, monkeypatch):
    """Default setting: on CPU tensors no batched code runs, so a request's values do not
    depend on what shares its step (what the fuzz's canary checks to the bit)."""
    model, base, V = setup
    monkeypatch.setattr(cache_mod, "BATCH_DECODE_ROWS", "cuda")
    ran = []
    for cls, name in ((KDAAttention, "_decode_rows"), (MLAAttention, "_attend_singles")):
        monkeypatch.setattr(cls, name, lambda self, *a, _n=name: ran.append(_n))
    seqs = [SeqSlice(0, 0, 1, PROMPTS[0]), SeqSlice(1, 1, 1, PROMPTS[1])]
    with torch.inference_mode():
        model(torch.tensor([5, 6]), StepBatch(seqs), clone_caches(base))
    assert ran == [] and not cache_mod.batch_decode_rows(torch.zeros(1))
