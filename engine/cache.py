"""Cache bookkeeping on the coordinator side: which slot and which latent-cache blocks each
sequence owns. The tensors themselves live on the ranks (models/cache.py); the plan of each step
carries the block tables that changed, so every rank addresses the same blocks.

With DCP size D a rank stores ⌈n/D⌉ of a sequence's n positions, so a sequence needs
⌈⌈n/D⌉ / block_size⌉ blocks on every rank; the same block ids are used on all ranks.
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

    def blocks_for(self, n_tokens: int) -> int:
        local = -(-n_tokens // self.dcp_size)
        return -(-local // self.block_size)

    def extra_needed(self, slot: int, n_tokens: int) -> int:
        return max(0, self.blocks_for(n_tokens) - len(self.tables.get(slot, ())))

    def ensure(self, slot: int, n_tokens: int) -> bool:
        """Grow the slot's table to hold n_tokens; True if the table changed."""
        need = self.extra_needed(slot, n_tokens)
        if need > len(self.free):
            raise CacheFullError(f"need {need} blocks, {len(self.free)} free")
        table = self.tables.setdefault(slot, [])
        for _ in range(need):
            table.append(self.free.pop())
        return need > 0

    def release(self, slot: int) -> None:
        self.free.extend(reversed(self.tables.pop(slot, [])))

    @property
    def num_free(self) -> int:
        return len(self.free)
