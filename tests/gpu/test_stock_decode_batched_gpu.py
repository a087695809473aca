"""The stock step's batched one-token continuations on CUDA (their default there: models/cache.py
`BATCH_DECODE_ROWS`) against the per-sequence code on the same device (the setting off), fp32,
the tiny model: a decode step of four sequences and a mixed step (+ a 9-token chunk through
fla's KDA and the MLA flash route). The CPU twin (tests/cpu/test_stock_decode_batched.py)
checks the same math on the CPU; here the device's kernels (index_select / index_copy_ on
the caches, the batched einsums, the fused AttnRes around them) run it."""
from __future__ import annotations

import pytest
import torch

from raydecode.models import cache as cache_mod
from raydecode.models.cache import SeqSlice, StepBatch

from _numerics import rel_err
from _prefill_forced import clone_caches
from _stock_steps import PROMPTS, prefilled_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _setup():
    return prefilled_tiny(torch.float32, "cuda")


@pytest.mark.parametrize("chunk", [0, 9])
def test_batched_decode_rows_on_cuda_equal_the_per_sequence_code(chunk, monkeypatch):
    model, base, V = _setup()
    dec = [SeqSlice(s, i, 1, PROMPTS[s]) for i, s in enumerate((3, 0, 2, 1))]
    seqs = dec + ([SeqSlice(4, len(dec), chunk, PROMPTS[4])] if chunk else [])
    tokens = torch.randint(0, V, (len(dec) + chunk,), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(1))
    batched, loop = clone_caches(base), clone_caches(base)
    with torch.inference_mode():
        assert cache_mod.batch_decode_rows(tokens)               # the CUDA default
        got = model(tokens, StepBatch(seqs), batched)
        monkeypatch.setattr(cache_mod, "BATCH_DECODE_ROWS", False)
        want = model(tokens, StepBatch(seqs), loop)
    for s in seqs:
        assert rel_err(got[s.start:s.end], want[s.start:s.end]) < 1e-4, s
    for a, b in ((batched.kda.conv, loop.kda.conv), (batched.kda.rec, loop.kda.rec),
                 (batched.mla.pool, loop.mla.pool)):
        assert rel_err(a, b) < 1e-4
    assert not torch.equal(batched.kda.rec, base.kda.rec)       # the step wrote the slots
