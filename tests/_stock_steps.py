"""The step sequence the stock-graph tests run (tests/cpu/test_stock_graphs.py on an emulated
graph backend, tests/gpu/test_stock_graphs_gpu.py on CUDA graphs): every kind of stock step a
replay must get right."""
from __future__ import annotations

import torch

from raydecode.engine.scheduler import StepPlan
from raydecode.models.cache import SeqSlice, StepBatch

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
