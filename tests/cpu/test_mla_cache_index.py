"""MLALatentCache's host-built row index (models/cache.py): writes land where the block table
says for every DCP share, reads return a sequence's rows in position order, the memoized index
follows a replaced table, and a position past the slot's blocks is refused."""
from __future__ import annotations

import pytest
import torch

from raydecode.models.cache import MLALatentCache

BS, W = 4, 6


def _cache(rank: int = 0, size: int = 1) -> MLALatentCache:
    c = MLALatentCache(2, 12, BS, W, torch.float32, dcp_rank=rank, dcp_size=size)
    c.block_tables[3] = [7, 2, 9]                  # slot 3: 12 local rows
    return c


def _naive(c: MLALatentCache, layer: int, slot: int, pos: int, rows: torch.Tensor):
    """Position by position: p on rank p % D at local row p // D."""
    for i in range(rows.shape[0]):
        p = pos + i
        if p % c.dcp_size == c.dcp_rank:
            j = p // c.dcp_size
            c.pool[layer, c.block_tables[slot][j // BS], j % BS] = rows[i]


@pytest.mark.parametrize("rank,size", [(0, 1), (0, 2), (1, 2), (2, 3)])
@pytest.mark.parametrize("pos,n", [(0, 1), (0, 9), (5, 7), (3, 1)])
def test_write_puts_each_row_where_the_table_says(rank, size, pos, n):
    got, want = _cache(rank, size), _cache(rank, size)
    rows = torch.randn(n, W)
    got.write(1, 3, pos, rows)
    _naive(want, 1, 3, pos, rows)
    assert torch.equal(got.pool, want.pool)


@pytest.mark.parametrize("rank,size", [(0, 1), (1, 2)])
def test_read_returns_the_rows_in_position_order(rank, size):
    c = _cache(rank, size)
    rows = torch.randn(12, W)
    c.write(0, 3, 0, rows)
    got, pos = c.read(0, 3, 11)
    mine = [p for p in range(11) if p % size == rank]
    assert pos.tolist() == mine
    assert torch.equal(got, rows[mine])


def test_the_memoized_index_follows_a_replaced_table():
    c = _cache()
    c.write(0, 3, 0, torch.ones(8, W))
    first, _ = c.read(0, 3, 8)
    c.block_tables[3] = [5, 6, 9]                  # same length, other blocks
    c.pool[0, 5] = 2.0
    c.pool[0, 6] = 3.0
    again, _ = c.read(0, 3, 8)
    assert torch.equal(first, torch.ones(8, W))
    assert torch.equal(again[:4], torch.full((4, W), 2.0))
    assert torch.equal(again[4:], torch.full((4, W), 3.0))


def test_a_position_past_the_slot_blocks_is_refused():
    c = _cache()
    with pytest.raises(RuntimeError, match="beyond its 3 cache blocks"):
        c.write(0, 3, 10, torch.zeros(3, W))      # rows 10..12: block 3 does not exist
    with pytest.raises(RuntimeError, match="beyond its 3 cache blocks"):
        c.read(0, 3, 13)


def test_the_memo_keeps_a_step_of_many_sequences_and_stays_bounded(monkeypatch):
    import raydecode.models.cache as cache_mod
    c = MLALatentCache(1, 200, BS, W, torch.float32)
    for s in range(64):
        c.block_tables[s] = [3 * s, 3 * s + 1, 3 * s + 2]
    first = [c.read(0, s, 10)[0] for s in range(64)]
    assert len(c._index_memo) == 64 and c._memo_elems == 640      # one per sequence
    again = [c._rows_index(s, 0, 10, "cpu") for s in range(64)]
    assert all(a is c._index_memo[k] for a, k in zip(again, c._index_memo))   # all hits
    assert all(torch.equal(a, b) for a, b in zip(first, (c.read(0, s, 10)[0] for s in range(64))))
    monkeypatch.setattr(cache_mod, "INDEX_MEMO_ELEMS", 100)
    c.read(0, 0, 12)                                                # a new key past the cap
    assert c._memo_elems <= 100 and len(c._index_memo) <= 10
    assert c._memo_elems == sum(t.numel() for t in c._index_memo.values())
