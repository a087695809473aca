"""Cache bookkeeping on the coordinator side: which slot and which latent-cache blocks each
sequence owns. The tensors themselves live on the ranks (models/cache.py); the plan of each step
carries the block tables that changed, so every rank addresses the same blocks.

With DCP size D a rank stores ⌈n/D⌉ of a sequence's n positions, so a sequence needs
⌈⌈n/D⌉ / block_size⌉ blocks on every rank; the same block ids are used on all ranks. Block b of a
table holds the global positions [b·span, (b+1)·span), span = block_size·D (each rank its
t mod D share), so a block is *full* — its rows final on every rank — once a sequence has
(b+1)·span tokens cached.

Blocks are refcounted: a block belongs to every table that lists it and to every prefix-cache
snapshot that holds it (engine/prefix_cache.py); it returns to the free list when the last
holder lets go. A full block may be registered under the hash of the token prefix it ends
(`register`), so the prefix cache keeps one copy of a shared prefix's blocks.
"""
from __future__ import annotations


class CacheFullError(RuntimeError):
    """No free slot or block; the scheduler preempts or waits."""


class SlotAllocator:
    def __init__(self, num_slots: int):
        self.free = list(range(num_slots - 1, -1, -1))

    def allocate(self) -> int:
        if not self.free:
            raise CacheFullError("no free sequence slot")
        return self.free.pop()

    def release(self, slot: int) -> None:
        self.free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self.free)


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, dcp_size: int = 1):
        self.block_size, self.dcp_size, self.num_blocks = block_size, dcp_size, num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[int, list[int]] = {}
        self.refs = [0] * num_blocks                 # holders of each block (tables, snapshots)
        self.by_hash: dict[bytes, int] = {}          # prefix hash -> the full block it ends
        self.hash_of: dict[int, bytes] = {}

    @property
    def span(self) -> int:
        """Tokens of one full block over all DCP ranks."""
        return self.block_size * self.dcp_size

    def blocks_for(self, n_tokens: int) -> int:
        local = -(-n_tokens // self.dcp_size)
        return -(-local // self.block_size)

    def extra_needed(self, slot: int, n_tokens: int) -> int:
        return max(0, self.blocks_for(n_tokens) - len(self.tables.get(slot, ())))

    # ---- single blocks -------------------------------------------------------------------------
    def allocate(self) -> int:
        """A free block with one holder (the caller)."""
        if not self.free:
            raise CacheFullError("no free cache block")
        b = self.free.pop()
        self.refs[b] = 1
        return b

    def hold(self, block: int) -> None:
        assert self.refs[block] > 0, f"block {block} is free"
        self.refs[block] += 1

    def drop(self, block: int) -> None:
        """One holder lets go; the last one frees the block (and forgets its hash)."""
        assert self.refs[block] > 0, f"block {block} is already free"
        self.refs[block] -= 1
        if self.refs[block] == 0:
            h = self.hash_of.pop(block, None)
            if h is not None:
                del self.by_hash[h]
            self.free.append(block)

    def register(self, block: int, prefix_hash: bytes) -> int:
        """The block holding the full block that ends the prefix with this hash: an already
        registered one if there is one, else `block`, registered now."""
        have = self.by_hash.get(prefix_hash)
        if have is not None:
            return have
        if block in self.hash_of:          # a block ends exactly one prefix
            return block
        self.by_hash[prefix_hash] = block
        self.hash_of[block] = prefix_hash
        return block

    # ---- tables --------------------------------------------------------------------------------
    def ensure(self, slot: int, n_tokens: int) -> bool:
        """Grow the slot's table to hold n_tokens; True if the table changed."""
        need = self.extra_needed(slot, n_tokens)
        if need > len(self.free):
            raise CacheFullError(f"need {need} blocks, {len(self.free)} free")
        table = self.tables.setdefault(slot, [])
        for _ in range(need):
            table.append(self.allocate())
        return need > 0

    def share(self, slot: int, blocks: list[int]) -> list[int]:
        """Start the slot's table with blocks other holders keep too (a cache hit, a fork)."""
        assert not self.tables.get(slot), f"slot {slot} already has a table"
        for b in blocks:
            self.hold(b)
        self.tables[slot] = list(blocks)
        return self.tables[slot]

    def release(self, slot: int) -> None:
        for b in reversed(self.tables.pop(slot, [])):
            self.drop(b)

    @property
    def num_free(self) -> int:
        return len(self.free)
