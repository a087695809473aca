"""Per-rank cache storage a model shard reads and writes during a step, and the step's layout.

The engine (engine/cache.py) decides *which* slots and blocks a sequence owns; this module only
holds the tensors and the addressing:

- `MLALatentCache`: paged latent rows, one pool per MLA layer, shape
  (num_mla_layers, num_blocks, block_size, latent_dim). With DCP size D this rank stores only the
  tokens t with t mod D == dcp_rank, at local index t // D of the sequence's block table.
- `KDAStateCache`: per slot, the short-conv tail (last conv_size-1 inputs of q, k, v; model dtype)
  and the recurrent state (heads_local, dk, dv) in fp32.

`StepBatch` is the flat layout of one step: tokens of all sequences concatenated, each sequence a
`SeqSlice` (its slot, where its tokens start in the flat tensor, how many, and the absolute
position of the first one). A decode token is a slice of length 1; a prefill chunk is longer.
"""
from __future__ import annotations

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
        """(T,) absolute position of every flat token."""
        return torch.cat([torch.arange(s.pos, s.pos + s.length) for s in self.seqs]).to(device)

    @staticmethod
    def decode(slots: list[int], positions: list[int]) -> "StepBatch":
        return StepBatch([SeqSlice(slot=s, start=i, length=1, pos=p)
                          for i, (s, p) in enumerate(zip(slots, positions))])


class MLALatentCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, latent_dim: int,
                 dtype: torch.dtype, device=None, dcp_rank: int = 0, dcp_size: int = 1):
        self.pool = torch.zeros(num_layers, num_blocks, block_size, latent_dim, dtype=dtype,
                                device=device)
        self.block_size, self.dcp_rank, self.dcp_size = block_size, dcp_rank, dcp_size
        self.block_tables: dict[int, list[int]] = {}   # slot -> block ids (set by the engine)

    def local_len(self, n_tokens: int) -> int:
        """How many of a sequence's first n_tokens positions this DCP rank stores."""
        d, r = self.dcp_size, self.dcp_rank
        return (n_tokens - r + d - 1) // d if n_tokens > r else 0

    def _index(self, slot: int, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        table = torch.tensor(self.block_tables[slot], dtype=torch.long, device=local.device)
        blk = local // self.block_size
        if blk.numel() and int(blk.max()) >= len(self.block_tables[slot]):
            raise RuntimeError(f"slot {slot}: position beyond its {len(table)} cache blocks")
        return table[blk], local % self.block_size

    def write(self, layer: int, slot: int, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """Store rows (n, latent_dim) at absolute positions (n,), keeping this rank's share."""
        mine = positions % self.dcp_size == self.dcp_rank
        if not bool(mine.any()):
            return
        b, o = self._index(slot, positions[mine] // self.dcp_size)
        self.pool[layer, b, o] = rows[mine].to(self.pool.dtype)

    def read(self, layer: int, slot: int, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows among the first n_tokens positions: (rows (m, latent_dim),
        absolute positions (m,)), in position order."""
        m = self.local_len(n_tokens)
        local = torch.arange(m, device=self.pool.device)
        b, o = self._index(slot, local)
        return self.pool[layer, b, o], local * self.dcp_size + self.dcp_rank


class KDAStateCache:
    def __init__(self, num_layers: int, num_slots: int, heads_local: int, head_dim: int,
                 conv_size: int, dtype: torch.dtype, device=None):
        inner = heads_local * head_dim
        # (layers, slots, 3·inner_local, conv_size-1): q, k, v pre-conv inputs, oldest first
        self.conv = torch.zeros(num_layers, num_slots, 3 * inner, conv_size - 1, dtype=dtype,
                                device=device)
        # (layers, slots, heads_local, dk, dv) fp32 recurrent state S
        self.rec = torch.zeros(num_layers, num_slots, heads_local, head_dim, head_dim,
                               dtype=torch.float32, device=device)

    def reset(self, slot: int) -> None:
        self.conv[:, slot].zero_()
        self.rec[:, slot].zero_()


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
