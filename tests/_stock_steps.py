"""The step sequence the stock-graph tests run (tests/cpu/test_stock_graphs.py on an emulated
graph backend, tests/gpu/test_stock_graphs_gpu.py on CUDA graphs): every kind of stock step a
replay must get right."""
from __future__ import annotations

import torch

from raydecode.engine.scheduler import StepPlan
from raydecode.models.cache import SeqSlice, StepBatch
from raydecode.models.config import load_config
from raydecode.models.k3 import K3ForCausalLM, init_random_, make_caches

# prompts prefilled on slots 0..4 by `prefilled_tiny` (slot -> tokens)
PROMPTS = {0: 20, 1: 37, 2: 5, 3: 50, 4: 16}


def prefilled_tiny(dtype: torch.dtype, device: str = "cpu", block_size: int = 8):
    """The tiny model (seed 3) and caches of 6 slots × 10 blocks with `PROMPTS` prefilled on
    the stock path (random tokens, seed 0): the base the batched decode-row tests step from.
    -> (model, caches, vocab size)."""
    with torch.device(device):
        model = init_random_(K3ForCausalLM(load_config("tiny"), dtype=dtype), seed=3)
    caches = make_caches(model.cfg, model.par, 6, 60, block_size, dtype, device=device)
    caches.mla.block_tables.update({s: list(range(10 * s, 10 * s + 10)) for s in range(6)})
    g = torch.Generator(device=device).manual_seed(0)
    V = model.cfg.vocab_size
    with torch.inference_mode():
        for slot, n in PROMPTS.items():
            model(torch.randint(0, V, (n,), device=device, generator=g),
                  StepBatch([SeqSlice(slot, 0, n, 0)]), caches)
    return model, caches, V

# (sequences of one step, in order): a chunk from 0; a continued chunk beside a new prompt; a
# mixed step with decode rows; a stock decode step; a chunk of exactly a bucket; a one-token
# prompt. Slots 0..3; positions stay under 64.
STEPS = [[SeqSlice(0, 0, 37, 0)],
         [SeqSlice(0, 0, 20, 37), SeqSlice(1, 20, 9, 0)],
         [SeqSlice(0, 0, 1, 57), SeqSlice(1, 1, 1, 9), SeqSlice(2, 2, 30, 0)],
         [SeqSlice(0, 0, 1, 58), SeqSlice(2, 1, 1, 30)],
         [SeqSlice(1, 0, 32, 10)],
         [SeqSlice(3, 0, 1, 0)]]


# single-sequence graphs (RAYDECODE_STOCK_SINGLE): steps of one sequence — a prompt chunk from
# 0, a continued chunk, one token at pos > 0, a chunk of exactly a bucket that continues, a
# one-token prompt, a short prompt — and one two-sequence step between them (the general
# graph). Slots 0..3; positions stay under 64.
SINGLE_STEPS = [[SeqSlice(0, 0, 37, 0)],
                [SeqSlice(0, 0, 20, 37)],
                [SeqSlice(0, 0, 1, 57)],
                [SeqSlice(1, 0, 3, 0), SeqSlice(0, 3, 1, 58)],
                [SeqSlice(1, 0, 32, 3)],
                [SeqSlice(2, 0, 1, 0)],
                [SeqSlice(3, 0, 9, 0)]]


# mixed-step graphs (RAYDECODE_STOCK_MIXED): a prompt chunk beside one-token continuations,
# the chunk after, before and between them, a new prompt's first chunk and a continued one,
# one and several continuations, a bucket filled exactly (16 tokens); between them steps a
# mixed graph must not take (a chunk alone, two chunks, decodes only, a one-token prompt
# beside a decode). Slots 0..3; positions stay under 64.
MIXED_STEPS = [[SeqSlice(0, 0, 37, 0)],
               [SeqSlice(1, 0, 20, 0)],
               [SeqSlice(0, 0, 1, 37), SeqSlice(1, 1, 9, 20)],
               [SeqSlice(2, 0, 12, 0), SeqSlice(0, 12, 1, 38)],
               [SeqSlice(0, 0, 1, 39), SeqSlice(2, 1, 5, 12), SeqSlice(1, 6, 1, 29)],
               [SeqSlice(0, 0, 1, 40), SeqSlice(1, 1, 1, 30)],
               [SeqSlice(3, 0, 15, 0), SeqSlice(0, 15, 1, 41)],
               [SeqSlice(2, 0, 3, 17), SeqSlice(3, 3, 4, 15)],
               [SeqSlice(1, 0, 1, 31), SeqSlice(2, 1, 1, 0)],
               [SeqSlice(0, 0, 1, 42), SeqSlice(1, 1, 1, 32), SeqSlice(3, 2, 2, 19)]]


def tables(num_slots: int, blocks_each: int) -> dict[int, list[int]]:
    """Slot s owns blocks [s·n, (s+1)·n): the block tables the first step ships."""
    return {s: list(range(blocks_each * s, blocks_each * (s + 1))) for s in range(num_slots)}


def plan(step: int, seqs: list[SeqSlice], ids: range, block_tables=None) -> StepPlan:
    """A stock plan of `seqs` with seeded random tokens from `ids`, every sequence sampling its
    last token."""
    g = torch.Generator().manual_seed(100 + step)
    n = sum(s.length for s in seqs)
    toks = (torch.randint(0, ids.stop - ids.start, (n,), generator=g) + ids.start).tolist()
    return StepPlan(step, StepBatch(seqs), toks, [s.end - 1 for s in seqs],
                    block_tables or {}, [])


def real_rows(caches, num_slots: int, num_blocks: int) -> tuple[torch.Tensor, ...]:
    """The real slots' KDA state and conv tails and the real blocks' MLA rows (not the
    scratch rows)."""
    return (caches.kda.rec[:, :num_slots], caches.kda.conv[:, :num_slots],
            caches.mla.pool[:, :num_blocks])
