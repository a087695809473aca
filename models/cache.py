"""Per-rank cache storage a model shard reads and writes during a step, and the step's layout.

The engine (engine/cache.py) decides *which* slots and blocks a sequence owns; this module only
holds the tensors and the addressing:

- `MLALatentCache`: paged latent rows, one pool per MLA layer, shape
  (num_mla_layers, num_blocks, block_size, latent_dim). With DCP size D this rank stores only the
  tokens t with t mod D == dcp_rank, at local index t // D of the sequence's block table.
- `KDAStateCache`: per slot, the short-conv tail (last conv_size-1 inputs of q, k, v; model dtype)
  and the recurrent state (heads_local, dk, dv) in fp32; plus `num_snapshots` snapshot slots of
  the same shapes (prefix caching: a sequence's state at a position where it may resume).

Both take the prefix cache's copies (engine/prefix_cache.py): `KDAStateCache.copy(src, dst)`
between slots and snapshot slots, `MLALatentCache.copy_block(src, dst)` of this rank's rows of
one block; device copies in stream order, no host sync.

`StepBatch` is the flat layout of one step: tokens of all sequences concatenated, each sequence a
`SeqSlice` (its slot, where its tokens start in the flat tensor, how many, and the absolute
position of the first one). A decode token is a slice of length 1; a prefill chunk is longer.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch


class SeqSlice(NamedTuple):
    """Immutable; a NamedTuple (not a frozen dataclass) because every rank builds one per
    sequence per step from the plan frame (≈ 0.3 µs against 1 µs)."""
    slot: int      # KDA state slot and MLA block-table key
    start: int     # offset of this sequence's first token in the flat step tensor
    length: int    # tokens of this sequence in this step
    pos: int       # absolute position of the first token (= tokens already cached)

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass
class StepBatch:
    seqs: list[SeqSlice]

    def __post_init__(self) -> None:
        # the flat step tensor is the sequences back to back in list order: `positions()` and
        # every per-sequence slice (s.start, s.end) rely on it
        at = 0
        for s in self.seqs:
            if s.start != at or s.length < 1:
                raise ValueError(f"StepBatch: sequence at slot {s.slot} starts at {s.start} "
                                 f"with length {s.length}; expected start {at}, length ≥ 1 "
                                 "(sequences back to back in list order)")
            at = s.end

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.seqs)

    @property
    def is_decode_only(self) -> bool:
        return all(s.length == 1 for s in self.seqs)

    def positions(self, device=None) -> torch.Tensor:
        """(T,) absolute position of every flat token (built on the host, one non-blocking
        copy: no host sync)."""
        host = torch.cat([torch.arange(s.pos, s.pos + s.length) for s in self.seqs])
        return host_to_device(host, device)

    @staticmethod
    def decode(slots: list[int], positions: list[int]) -> "StepBatch":
        return StepBatch([SeqSlice(slot=s, start=i, length=1, pos=p)
                          for i, (s, p) in enumerate(zip(slots, positions))])


# `MLALatentCache._rows_index` keeps at most this many memoized indices (int64 on the device,
# 32 MB): every sequence of a step (64 decoders of a mixed step, each read by every MLA layer)
# stays memoized through the step.
INDEX_MEMO_ELEMS = 1 << 22

# Whether a stock step's one-token continuations run batched (models/kda.py `_decode_rows`,
# models/mla.py `_attend_singles`, `MLALatentCache.write_seqs`): "cuda" (default) on CUDA
# tensors only, True everywhere (the CPU tests of the batched code), False nowhere. The CPU
# path stays the per-sequence reference, so a request's values there do not depend on what it
# shares a step with, to the bit (the fuzz's canary: a greedy request under hostile traffic
# must return exactly its undisturbed text; the padded MLA batch reduces over the longest
# sequence, which moves the last bits). On CUDA the GEMMs already pick kernels by batch shape.
BATCH_DECODE_ROWS: bool | str = "cuda"


def batch_decode_rows(x: torch.Tensor) -> bool:
    """`BATCH_DECODE_ROWS` for a step whose tensors live where x does."""
    return x.is_cuda if BATCH_DECODE_ROWS == "cuda" else bool(BATCH_DECODE_ROWS)


class MLALatentCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, latent_dim: int,
                 dtype: torch.dtype, device=None, dcp_rank: int = 0, dcp_size: int = 1):
        self.pool = torch.zeros(num_layers, num_blocks, block_size, latent_dim, dtype=dtype,
                                device=device)
        self.block_size, self.dcp_rank, self.dcp_size = block_size, dcp_rank, dcp_size
        self.block_tables: dict[int, list[int]] = {}   # slot -> block ids (set by the engine)
        self._index_memo: dict[tuple, torch.Tensor] = {}   # `_rows_index`, by table contents
        self._memo_elems = 0                                # their indices, oldest evicted first

    def copy_block(self, src: int, dst: int) -> None:
        """Every layer's rows of block src into block dst (this rank's DCP share of both)."""
        n = self.pool.shape[1]
        if not (0 <= src < n and 0 <= dst < n):
            raise ValueError(f"block copy {src} -> {dst}: this rank holds blocks [0, {n})")
        self.pool[:, dst].copy_(self.pool[:, src])

    def local_len(self, n_tokens: int) -> int:
        """How many of a sequence's first n_tokens positions this DCP rank stores."""
        d, r = self.dcp_size, self.dcp_rank
        return (n_tokens - r + d - 1) // d if n_tokens > r else 0

    def _rows_index(self, slot: int, first: int, count: int, device) -> torch.Tensor:
        """Pool rows (block · block_size + offset, flat over a layer's (blocks · block_size)
        rows) of this rank's local positions first .. first + count − 1 of `slot`, as an int64
        index on `device`: built on the host from the block table with tensor ops, one pinned
        non-blocking copy (no host sync); memoized on the table's contents (INDEX_MEMO_ELEMS),
        so the MLA layers of a step share one build and one copy per sequence. RuntimeError
        past the slot's blocks."""
        table, bs = self.block_tables[slot], self.block_size
        if count and (first + count - 1) // bs >= len(table):
            raise RuntimeError(f"slot {slot}: position beyond its {len(table)} cache blocks")
        key = (first, count, bs, str(device), tuple(table))
        hit = self._index_memo.get(key)
        if hit is not None:
            return hit
        b0, b1 = first // bs, (first + count - 1) // bs + 1 if count else first // bs
        blocks = torch.tensor(table[b0:b1], dtype=torch.long)
        rows = (blocks[:, None] * bs + torch.arange(bs)).flatten()
        idx = host_to_device(rows[first - b0 * bs:first - b0 * bs + count], device)
        self._remember(key, idx)
        return idx

    def write(self, layer: int, slot: int, pos: int, rows: torch.Tensor) -> None:
        """Store rows (n, latent_dim) of positions pos .. pos + n − 1, keeping this rank's
        share (position p lives on DCP rank p mod D, at local row p // D). The index comes
        from the host table: no host sync."""
        D, r, n = self.dcp_size, self.dcp_rank, rows.shape[0]
        i0 = (r - pos) % D                        # the chunk's first row this rank stores
        count = len(range(i0, n, D))
        if not count:
            return
        idx = self._rows_index(slot, (pos + i0) // D, count, rows.device)
        pool = self.pool[layer].view(-1, self.pool.shape[-1])
        pool.index_copy_(0, idx, rows[i0::D].to(self.pool.dtype))

    def write_seqs(self, layer: int, seqs, rows: torch.Tensor) -> None:
        """`write` of every sequence of a step (SeqSlice: slot, start, length, pos; rows
        (T, latent_dim) the step's): the one-token ones as one index_copy_ (a decode step of D
        sequences: one copy, not D), the others one `write` each. No host sync."""
        singles = [x for x in seqs if x.length == 1] if batch_decode_rows(rows) else []
        if len(singles) < 2:
            singles = []
        for x in seqs:
            if x.length != 1 or not singles:
                self.write(layer, x.slot, x.pos, rows[x.start:x.end])
        if not singles:
            return
        dst, src = self._singles_index(singles, rows.device)
        if dst.numel():
            pool = self.pool[layer].view(-1, self.pool.shape[-1])
            pool.index_copy_(0, dst, rows.index_select(0, src).to(self.pool.dtype))

    def _singles_index(self, seqs, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(pool rows, step rows) of the one-token sequences whose position this DCP rank
        stores, built on the host, one pinned copy, memoized like `_rows_index` (a step's MLA
        layers share it)."""
        key = ("singles", str(device), tuple((x.slot, x.pos, x.start) for x in seqs))
        hit = self._index_memo.get(key)
        if hit is None:
            D, r, bs = self.dcp_size, self.dcp_rank, self.block_size
            dst, src = [], []
            for x in seqs:
                if x.pos % D != r:
                    continue
                local, table = x.pos // D, self.block_tables[x.slot]
                if local // bs >= len(table):
                    raise RuntimeError(f"slot {x.slot}: position beyond its {len(table)} "
                                       "cache blocks")
                dst.append(table[local // bs] * bs + local % bs)
                src.append(x.start)
            hit = host_to_device(torch.tensor(dst + src, dtype=torch.long), device)
            self._remember(key, hit)
        n = hit.numel() // 2
        return hit[:n], hit[n:]

    def gather_singles(self, layer: int, seqs) -> tuple[torch.Tensor, torch.Tensor]:
        """DCP 1: the cached rows of one-token sequences at positions 0 .. pos, padded to the
        longest: (rows (D, L, latent_dim) in the pool dtype, lengths (D,) int64; row j of
        sequence i is valid iff j < lengths[i], padding reads row 0 of the pool). The index is
        built on the host (one pinned copy, memoized like `_rows_index`: the step's other MLA
        layers reuse it)."""
        if self.dcp_size != 1:
            raise RuntimeError("gather_singles: DCP > 1 splits a sequence's rows over ranks")
        bs, lens = self.block_size, [x.pos + 1 for x in seqs]
        L = max(lens)
        used = [self.block_tables[x.slot][:-(-n // bs)] for x, n in zip(seqs, lens)]
        key = ("gather", str(self.pool.device),
               tuple((x.slot, n, tuple(t)) for x, n, t in zip(seqs, lens, used)))
        hit = self._index_memo.get(key)
        if hit is None:
            nb = -(-L // bs)
            for x, n, t in zip(seqs, lens, used):
                if len(t) * bs < n:
                    raise RuntimeError(f"slot {x.slot}: position beyond its {len(t)} cache "
                                       "blocks")
            tabs = [t + [0] * (nb - len(t)) for t in used]
            rows = (torch.tensor(tabs, dtype=torch.long)[:, :, None] * bs
                    + torch.arange(bs)).view(len(seqs), -1)[:, :L]
            valid = torch.arange(L)[None, :] < torch.tensor(lens)[:, None]
            rows = torch.where(valid, rows, 0)
            hit = host_to_device(torch.cat([rows.flatten(), torch.tensor(lens)]),
                                 self.pool.device)
            self._remember(key, hit)
        D = len(seqs)
        idx, n = hit[:D * L], hit[D * L:]
        pool = self.pool[layer].view(-1, self.pool.shape[-1])
        return pool.index_select(0, idx).view(D, L, -1), n

    def _remember(self, key: tuple, idx: torch.Tensor) -> None:
        self._index_memo[key] = idx
        self._memo_elems += idx.numel()
        while self._memo_elems > INDEX_MEMO_ELEMS and len(self._index_memo) > 1:
            self._memo_elems -= self._index_memo.pop(next(iter(self._index_memo))).numel()

    def read(self, layer: int, slot: int, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows among the first n_tokens positions: (rows (m, latent_dim),
        absolute positions (m,)), in position order. No host sync."""
        m = self.local_len(n_tokens)
        idx = self._rows_index(slot, 0, m, self.pool.device)
        rows = self.pool[layer].view(-1, self.pool.shape[-1]).index_select(0, idx)
        local = torch.arange(m, device=self.pool.device)
        return rows, local * self.dcp_size + self.dcp_rank


@functools.lru_cache(maxsize=64)
def device_index(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """(n,) int64 of host ints on `device`, built once per tuple (every layer of a step and
    every step with the same batch composition reuse it; never written): `host_to_device`, so
    no host sync. KDA state rows (models/kda.py `slot_index`), a step's token rows."""
    return host_to_device(torch.tensor(values, dtype=torch.int64), device)


def host_to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A small host tensor on `device`: on CUDA through pinned memory, non-blocking (a plain
    copy from pageable memory synchronizes the stream: the host would wait for every queued
    kernel, so host and device stop overlapping); elsewhere a plain `.to`."""
    device = torch.device(device) if device is not None else t.device
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class KDAStateCache:
    def __init__(self, num_layers: int, num_slots: int, heads_local: int, head_dim: int,
                 conv_size: int, dtype: torch.dtype, device=None, num_snapshots: int = 0):
        inner = heads_local * head_dim
        # (layers, slots, 3·inner_local, conv_size-1): q, k, v pre-conv inputs, oldest first
        self.conv = torch.zeros(num_layers, num_slots, 3 * inner, conv_size - 1, dtype=dtype,
                                device=device)
        # (layers, slots, heads_local, dk, dv) fp32 recurrent state S
        self.rec = torch.zeros(num_layers, num_slots, heads_local, head_dim, head_dim,
                               dtype=torch.float32, device=device)
        # the same per snapshot slot (layers, snapshots, ...); never read by a forward
        self.snap_conv = torch.zeros(num_layers, num_snapshots, *self.conv.shape[2:],
                                     dtype=dtype, device=device)
        self.snap_rec = torch.zeros(num_layers, num_snapshots, *self.rec.shape[2:],
                                    dtype=torch.float32, device=device)

    def reset(self, slot: int) -> None:
        self.conv[:, slot].zero_()
        self.rec[:, slot].zero_()

    def _state(self, ref: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv, rec) views of a slot (ref ≥ 0) or of snapshot slot -1 - ref (ref < 0)."""
        conv, rec, i = (self.conv, self.rec, ref) if ref >= 0 else \
            (self.snap_conv, self.snap_rec, -1 - ref)
        if i >= conv.shape[1]:
            what = "slot" if ref >= 0 else "snapshot slot"
            raise ValueError(f"KDA state copy names {what} {i}; this rank holds "
                             f"{conv.shape[1]} (deployment kda_snapshot_slots for snapshots)")
        return conv[:, i], rec[:, i]

    def copy(self, src: int, dst: int) -> None:
        """Every layer's conv tail and recurrent state of src into dst (slots ≥ 0, snapshot
        slots -1 - i)."""
        (c0, r0), (c1, r1) = self._state(src), self._state(dst)
        c1.copy_(c0)
        r1.copy_(r0)


@dataclass
class ModelCaches:
    """All cache storage of one rank; layer indices inside are per kind (i-th MLA layer)."""
    mla: MLALatentCache | None
    kda: KDAStateCache | None
    mla_index: dict[int, int] = field(default_factory=dict)   # model layer -> MLA pool row
    kda_index: dict[int, int] = field(default_factory=dict)   # model layer -> KDA state row
    # Speculative decoding: when set, every KDA layer calls
    # kda_observer(state row, SeqSlice, xs (W-1+L, 3·inner) conv input, (q, k, v, g, beta) of the
    # L tokens, S0 (h, dk, dv) state before them) before it overwrites the slot, so the slot can
    # be rolled back to any prefix of the L tokens (engine/spec_runner.py). S0 is a view of the
    # slot: copy it to keep it.
    kda_observer: Callable[..., None] | None = None
    # Graph-shaped step (engine/step_graph.py StepStatics): while set, the fused MLA and KDA
    # decode read the step's paging (table (B, W), store (B,), seq_lens (B,) int32) and KDA
    # slots (B,) int64 from these preallocated device tensors instead of building them from
    # the batch, and refuse any step they cannot run fused. None: the batch decides (default).
    statics: Any = None
    # Piecewise-graphed stock step (engine/piecewise.py): while set, every attention layer's
    # core goes through it (models/pieces.py `attention_core`). None: plain calls (default).
    pieces: Any = None
    # A padded stock step's scratch sequence (engine/step_graph.py `GraphedRunner`): while
    # set, the attention cores skip the sequence on this slot — its rows of their output are
    # zeros, nothing of it is read or stored. None: every sequence runs (default; the build's
    # warm-up runs the pad sequence for real, so its kernels compile there).
    pad_slot: int | None = None
