"""The attention cores of a stock step: where a piecewise-graphed step leaves its graphs.

A stock step (prefill chunks, mixed steps, stock decode) does two kinds of work per layer:
- per-token work — projections, the AttnRes mixes and norms, the router, the routed and shared
  experts, the output gate — whose kernels and shapes depend only on the step's token count T;
- the attention core — the KDA short convs and delta rule over each sequence's slot, the MLA
  row writes and the attention over each sequence's cached rows — which reads the batch's
  layout on the host (slots, positions, block tables, chunk boundaries) and the caches.

Every attention layer of the stock path calls its core through `attention_core`. With no
`caches.pieces` set (every eager step) that is a plain call. While a piecewise-graphed step is
warmed, captured or replayed (engine/piecewise.py), `caches.pieces` takes the call: the per-token
work between two cores becomes one CUDA graph per token bucket, and the cores run eagerly
between the graphs' replays with the step's real batch.

A core's contract: `fn(batch, caches, *tensors) -> out`, tensors (T, ...) made by the per-token
work before it, `out` (T, ...) read by the per-token work after it; it reads nothing else that
the per-token work made and returns the same shape and dtype for every batch of T tokens.
"""
from __future__ import annotations

from typing import Callable

import torch

Core = Callable[..., torch.Tensor]


def attention_core(caches, fn: Core, batch, *tensors: torch.Tensor,
                   inline: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """fn(batch, caches, *tensors), or what `caches.pieces` makes of it (module docstring).

    `inline(caches, single, *tensors)`: the same core for a step of ONE real sequence padded to
    its bucket, reading the sequence's slot, start and length from the device tensors of
    `single` (engine/piecewise.py `SingleSeq`) instead of the batch: nothing it does depends on
    the host, so a single-sequence stock graph keeps it inside the graph (`pieces.single`
    set) instead of running it eagerly between two graphs."""
    pieces = getattr(caches, "pieces", None)
    if pieces is None:
        return fn(batch, caches, *tensors)
    if inline is not None and getattr(pieces, "single", None) is not None:
        return inline(caches, pieces.single, *tensors)
    return pieces.core(fn, batch, caches, *tensors)


__all__ = ["Core", "attention_core"]
