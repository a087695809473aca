"""Rank layout of one replica: TP ranks over nodes, node-major, with DCP groups inside TP.

Node-major: ranks 0..k0-1 on node slot 0, the next k1 on node slot 1, … so NVLink-local ranks are
adjacent. DCP splits the TP group, it adds no GPUs: rank r has dcp_rank = r mod D and DCP group
⌊r/D⌋ = ranks {D·⌊r/D⌋, …, D·⌊r/D⌋ + D − 1} (as in `raydecode.models.parallel`), so with D
dividing every node's rank count each DCP group sits on one node.
Pure functions: no Ray here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class RankSlot:
    rank: int
    node_slot: int     # index into the group's node list
    local_rank: int    # position among this node's ranks; the planned local GPU slot
    dcp_rank: int
    dcp_group: int


@dataclass(frozen=True)
class RankLayout:
    tp: int
    dcp: int
    ranks_per_node: tuple[int, ...]
    slots: tuple[RankSlot, ...]

    @property
    def num_nodes(self) -> int:
        return len(self.ranks_per_node)

    def ranks_on(self, node_slot: int) -> tuple[int, ...]:
        return tuple(s.rank for s in self.slots if s.node_slot == node_slot)

    @property
    def dcp_groups(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(range(g * self.dcp, (g + 1) * self.dcp))
                     for g in range(self.tp // self.dcp))

    @property
    def dcp_groups_node_local(self) -> bool:
        """Every DCP group on one node (its all-gathers stay on the fastest links)."""
        return all(len({self.slots[r].node_slot for r in grp}) == 1 for grp in self.dcp_groups)

    def describe(self) -> str:
        parts = [f"node{i}: ranks {rs[0]}-{rs[-1]}" for i in range(self.num_nodes)
                 for rs in [self.ranks_on(i)]]
        dcp = f", DCP {self.dcp} ({self.tp // self.dcp} groups" + \
              (", node-local)" if self.dcp_groups_node_local else ", spanning nodes)") \
            if self.dcp > 1 else ""
        return f"TP {self.tp}{dcp} over {self.num_nodes} node(s): " + "; ".join(parts)


def validate_parallel(tp: int, dcp: int) -> None:
    for name, v in (("tensor_parallel_size", tp), ("decode_context_parallel_size", dcp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if tp % dcp:
        raise ValueError(f"decode_context_parallel_size={dcp} must divide "
                         f"tensor_parallel_size={tp}")


def rank_layout(tp: int, dcp: int, ranks_per_node: Sequence[int]) -> RankLayout:
    """Layout for a group whose node slot i holds ranks_per_node[i] ranks."""
    validate_parallel(tp, dcp)
    per = tuple(int(k) for k in ranks_per_node)
    if any(k < 1 for k in per) or sum(per) != tp:
        raise ValueError(f"ranks per node {list(per)} must be positive and sum to TP={tp}")
    slots, r = [], 0
    for node_slot, k in enumerate(per):
        for local in range(k):
            slots.append(RankSlot(r, node_slot, local, r % dcp, r // dcp))
            r += 1
    return RankLayout(tp, dcp, per, tuple(slots))


def uniform_layout(tp: int, dcp: int, gpus_per_node: int) -> RankLayout:
    """Whole nodes of `gpus_per_node` GPUs first, the remainder on one last node."""
    if not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be a positive integer, got {gpus_per_node!r}")
    validate_parallel(tp, dcp)
    full, rest = divmod(tp, gpus_per_node)
    return rank_layout(tp, dcp, [gpus_per_node] * full + ([rest] if rest else []))
