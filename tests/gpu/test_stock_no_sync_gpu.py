"""The stock forward of a prefill step and of a mixed step queues its work without a host sync
(issue 28: the profile of a 2,047-token prefill step counted 20 stream syncs per 8 layers,
which stop the host from running ahead of the device; the MLA cache's device-side index
checks and pageable host-to-device copies were most of them). Under
`torch.cuda.set_sync_debug_mode("error")` any synchronizing call in the forward raises.
Sampling (the step's one intended sync) is outside the checked block."""
from __future__ import annotations

import pytest
import torch

from raydecode.models.cache import SeqSlice, StepBatch
from raydecode.models.k3 import make_caches

from _prefill_forced import tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("mixed", [False, True])
def test_stock_forward_has_no_host_sync(mixed):
    model, _ = tiny_model("cuda")
    caches = make_caches(model.cfg, model.par, 4, 64, 16, model.dtype, device="cuda")
    caches.mla.block_tables.update({0: list(range(0, 16)), 1: list(range(16, 32)),
                                    2: [32, 33], 3: [34]})
    V = model.cfg.vocab_size
    with torch.inference_mode():
        # slot 0 prefilled to 100 first, so the checked step continues a chunk at pos 100
        model(torch.randint(0, V, (100,), device="cuda"),
              StepBatch([SeqSlice(0, 0, 100, 0)]), caches)
        model(torch.randint(0, V, (20,), device="cuda"),
              StepBatch([SeqSlice(2, 0, 20, 0)]), caches)
        model(torch.randint(0, V, (9,), device="cuda"),
              StepBatch([SeqSlice(3, 0, 9, 0)]), caches)
        seqs = [SeqSlice(0, 0, 60, 100), SeqSlice(1, 60, 37, 0)]
        if mixed:       # two decode rows: the batched one-token path (models/kda.py, mla.py)
            seqs += [SeqSlice(2, 97, 1, 20), SeqSlice(3, 98, 1, 9)]
        batch = StepBatch(seqs)
        tokens = torch.randint(0, V, (batch.num_tokens,), device="cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            hidden = model(tokens, batch, caches)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(hidden.float()).all()
