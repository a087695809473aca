"""Prefix caching for the hybrid cache (coordinator side; the tensors stay on the ranks).

A KDA layer's state cannot be rewound, so a cached prefix is only usable at a length h where a
*snapshot* of every KDA layer's state exists. A `Snapshot` of a token prefix t[0:h] is:

    KDA    the recurrent (fp32) + conv state of every KDA layer after t[0:h], in one of the
           rank's snapshot slots (`KDAStateCache.snap_*`, `num_snapshots` per rank);
    MLA    the full latent blocks of positions [0, ⌊h/span⌋·span), held by refcount and
           registered under the prefix hash of the tokens they end (span = block_size · DCP:
           one block per rank holds each rank's t mod DCP share), plus a private copy of the
           partial block [⌊h/span⌋·span, h) when h is not block-aligned (`tail_block`).

Prefix hashes chain per full block: H_0 = b"", H_{j+1} = blake2b(H_j ‖ t[j·span:(j+1)·span]),
so H_j names the prefix t[0:j·span] and equal prefixes share their blocks. A lookup for a
prompt p takes the longest snapshot with t[0:h] = p[0:h] and h ≤ limit (the caller leaves at
least one token to compute, whose logits it samples): a match on H_j beats any on H_{j-1}.

Snapshots are made where conversations resume (the scheduler decides: the end of a prompt's
prefill, the end of a finished request, and the block-aligned end of a long prompt's last
chunk before its end, where a repeated prompt resumes) and evicted least recently used when
their slot or a block is needed; a conversation's newest snapshot demotes its earlier ones
(the one it was restored from, its own prompt end) to the front of that order, so an agent's
turns keep one live snapshot each. The copies a snapshot needs run on the ranks as ordered
plan ops (StepPlan.state_copies / block_copies); a snapshot turns `ready` once the plan
carrying its save ops is built, so no restore can be shipped before its save.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from .cache import BlockAllocator, CacheFullError


def snapshot_ref(index: int) -> int:
    """A snapshot slot in StepPlan.state_copies (slots are ≥ 0, snapshot i is -1 - i)."""
    return -1 - index


def prefix_hashes(tokens, span: int, n_blocks: int) -> list[bytes]:
    """[H_0, …, H_n]: H_j the chained hash of tokens[0 : j·span]."""
    out = [b""]
    arr = np.asarray(tokens[:n_blocks * span], dtype="<i4")
    for j in range(n_blocks):
        out.append(hashlib.blake2b(out[-1] + arr[j * span:(j + 1) * span].tobytes(),
                                   digest_size=16).digest())
    return out


@dataclass(eq=False)
class Snapshot:
    index: int                  # snapshot slot on every rank
    length: int                 # h: tokens the state covers
    key: bytes                  # H_j of its j = ⌊h/span⌋ full blocks
    tail: tuple[int, ...]       # tokens[j·span : h]
    blocks: list[int]           # the j full blocks (one hold each)
    tail_block: int | None      # its own copy of the partial block (None: h block-aligned)
    ready: bool = False


@dataclass
class PrefixStats:
    queries: int = 0            # admissions that looked the cache up
    hits: int = 0
    hit_tokens: int = 0         # tokens restored by those hits
    saves: int = 0              # snapshots made
    evictions: int = 0
    skipped: int = 0            # saves given up: no snapshot slot or block to spare

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class PrefixCache:
    blocks: BlockAllocator
    num_snapshots: int
    free: list[int] = field(init=False)
    by_key: dict[bytes, list[Snapshot]] = field(default_factory=dict, init=False)
    lru: "OrderedDict[int, Snapshot]" = field(default_factory=OrderedDict, init=False)
    stats: PrefixStats = field(default_factory=PrefixStats, init=False)

    def __post_init__(self) -> None:
        self.free = list(range(self.num_snapshots - 1, -1, -1))

    @property
    def span(self) -> int:
        return self.blocks.span

    @property
    def num_cached(self) -> int:
        return len(self.lru)

    # ---- lookup -------------------------------------------------------------------------------
    def lookup(self, tokens: list[int], limit: int) -> Snapshot | None:
        """The ready snapshot of the longest prefix tokens[0:h] with h ≤ limit, or None (the
        caller `record`s what it used)."""
        if not self.lru or limit < 1:
            return None
        span = self.span
        keys = prefix_hashes(tokens, span, limit // span)
        for j in range(len(keys) - 1, -1, -1):
            best = None
            for s in self.by_key.get(keys[j], ()):
                if s.ready and s.length <= limit and \
                        (best is None or s.length > best.length) and \
                        tuple(tokens[j * span:s.length]) == s.tail:
                    best = s
            if best is not None:
                return best
        return None

    def record(self, hit: Snapshot | None) -> None:
        """An admission looked the cache up and used `hit` (None: a miss)."""
        self.stats.queries += 1
        if hit is not None:
            self.lru.move_to_end(hit.index)
            self.stats.hits += 1
            self.stats.hit_tokens += hit.length

    # ---- save ---------------------------------------------------------------------------------
    def save(self, tokens: list[int], table: list[int]) -> Snapshot | None:
        """A snapshot of the prefix `tokens` (h = len(tokens)) whose MLA rows are in `table`
        (the owner's block table, covering h): the full blocks registered and held, the
        partial one to be copied into a block of the snapshot. None when the prefix is
        shorter than one block, already cached (it is touched instead), or nothing can be
        spared. The caller ships the copies (`save_ops`)."""
        h, span = len(tokens), self.span
        if h < span or self.num_snapshots == 0:
            return None
        j = h // span
        keys = prefix_hashes(tokens, span, j)
        tail = tuple(tokens[j * span:])
        for s in self.by_key.get(keys[j], ()):
            if s.length == h and s.tail == tail:
                self.lru.move_to_end(s.index)
                return None
        index = self._take_index()
        if index is None:
            self.stats.skipped += 1
            return None
        tail_block = None
        if tail:
            tail_block = self._take_block()
            if tail_block is None:
                self.free.append(index)
                self.stats.skipped += 1
                return None
        full = []
        for i in range(j):
            b = self.blocks.register(table[i], keys[i + 1])
            self.blocks.hold(b)
            full.append(b)
        snap = Snapshot(index, h, keys[j], tail, full, tail_block)
        self.by_key.setdefault(snap.key, []).append(snap)
        self.lru[index] = snap
        self.stats.saves += 1
        return snap

    def save_ops(self, snap: Snapshot, slot: int, table: list[int]
                 ) -> tuple[tuple[int, int], tuple[int, int] | None]:
        """(KDA copy slot -> snapshot, MLA copy of the partial block or None)."""
        j = snap.length // self.span
        blk = (table[j], snap.tail_block) if snap.tail_block is not None else None
        return (slot, snapshot_ref(snap.index)), blk

    # ---- eviction -----------------------------------------------------------------------------
    def demote(self, snap: Snapshot) -> None:
        """Make `snap` the next to evict (a longer snapshot of its conversation supersedes it;
        a later hit promotes it again)."""
        if self.lru.get(snap.index) is snap:
            self.lru.move_to_end(snap.index, last=False)

    def evict_one(self, keep: Snapshot | None = None) -> bool:
        """Drop the least recently used snapshot other than `keep`; False if there is none."""
        for index, s in self.lru.items():
            if s is not keep:
                break
        else:
            return False
        del self.lru[index]
        group = self.by_key[s.key]
        group.remove(s)
        if not group:
            del self.by_key[s.key]
        for b in s.blocks:
            self.blocks.drop(b)
        if s.tail_block is not None:
            self.blocks.drop(s.tail_block)
        self.free.append(index)
        self.stats.evictions += 1
        return True

    def _take_index(self) -> int | None:
        if not self.free and not self.evict_one():
            return None
        return self.free.pop()

    def _take_block(self) -> int | None:
        while True:
            try:
                return self.blocks.allocate()
            except CacheFullError:
                if not self.evict_one():
                    return None


__all__ = ["PrefixCache", "PrefixStats", "Snapshot", "prefix_hashes", "snapshot_ref"]
