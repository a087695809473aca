"""Tensor and decode-context parallel layout, and the communication a model shard needs.

A model shard never branches on its rank: it is built for a `Parallel` (which slice it holds) and
calls a `Comm` for the few collectives of a step. `LocalComm` is the TP=1 identity; `TorchComm`
wraps a torch.distributed process group (gloo on CPU, NCCL on GPU).

DCP (decode context parallelism) splits the MLA latent cache by token position inside a TP group:
token t lives on DCP rank t mod D. Rank r of a TP group of size N has dcp_rank = r mod D, and its
DCP group is the D consecutive ranks {D·⌊r/D⌋, …, D·⌊r/D⌋ + D − 1}.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Parallel:
    tp_rank: int = 0
    tp_size: int = 1
    dcp_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank} tp_size={self.tp_size}: need "
                             "0 <= tp_rank < tp_size")
        if self.dcp_size < 1 or self.tp_size % self.dcp_size:
            raise ValueError(f"decode_context_parallel_size={self.dcp_size} must divide "
                             f"tensor_parallel_size={self.tp_size}")

    @property
    def dcp_rank(self) -> int:
        return self.tp_rank % self.dcp_size

    @property
    def dcp_group_ranks(self) -> tuple[int, ...]:
        base = self.tp_rank - self.dcp_rank
        return tuple(range(base, base + self.dcp_size))

    def shard(self, n: int, what: str = "dimension") -> int:
        """Size of this rank's 1/TP slice of `n`; refuses sizes TP does not divide."""
        if n % self.tp_size:
            raise ValueError(f"{what} = {n} is not divisible by tensor_parallel_size = "
                             f"{self.tp_size}")
        return n // self.tp_size


class Comm:
    """Collectives over the TP group (and its DCP subgroups). Identity for one rank."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:  # sum over TP ranks
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:  # concat over TP
        return x

    def dcp_all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:  # concat over DCP
        return x


class LocalComm(Comm):
    pass


class TorchComm(Comm):
    """torch.distributed over an initialised TP group; DCP subgroups created collectively."""

    def __init__(self, par: Parallel, group=None):
        import torch.distributed as dist

        self.dist, self.par, self.group = dist, par, group
        self.dcp_group = None
        if par.dcp_size > 1:
            # every rank must create every subgroup, in the same order
            base_ranks = dist.get_process_group_ranks(group) if group is not None else \
                list(range(par.tp_size))
            for start in range(0, par.tp_size, par.dcp_size):
                ranks = base_ranks[start:start + par.dcp_size]
                g = dist.new_group(ranks)
                if start == par.tp_rank - par.dcp_rank:
                    self.dcp_group = g

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.par.tp_size == 1:
            return x
        x = x.contiguous()
        self.dist.all_reduce(x, group=self.group)
        return x

    def _gather(self, x: torch.Tensor, dim: int, n: int, group) -> torch.Tensor:
        if n == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(n)]
        self.dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=dim)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return self._gather(x, dim, self.par.tp_size, self.group)

    def dcp_all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return self._gather(x, dim, self.par.dcp_size, self.dcp_group)
