"""Model-side pieces of the specialized decode step (DESIGN §4, levers 1 and 2).

The specialized step runs the same weights, caches, inputs and outputs as the stock step. It
differs in how it computes, never in what:
- the projections stock replicates on every rank — router gate (E × H), latent down (L × H) and
  up (H × L), MLA q_a + kv_a_proj_with_mqa (fused qkv_a, rows concatenated) — are computed 1/TP
  per rank from the rank's row slice of the full weight it already holds (a view, or a small
  copy packed with other rows into one GEMV weight: models/moe.py), and the TP ranks exchange
  the slices with one all-gather; the fused MoE block computes the latent up as 1/TP columns
  whose partial sums are all-reduced instead;
- GEMVs go through `kernels.linear.linear` (the GEMV dispatch, with the replica's
  DecodeOptions); the router and the AttnRes mix + norm through their fused ops in kernels/
  (CuTe DSL or Triton on supported GPUs, the PyTorch references elsewhere).

Row sharding of a concatenation [W_0; W_1; …] of N rows: rank r owns rows [r·N/TP, (r+1)·N/TP),
which may straddle two of the W_i (K3 TP16 qkv_a: 1536 + 576 = 2112 rows, 132 per rank; rank 11
takes q_a rows 1452-1535 and kv_a rows 0-47). The all-gather concatenates the ranks' outputs
in rank order, which is the row order of the concatenation.
"""
from __future__ import annotations

import functools

import torch

from raydecode.kernels.linear import linear as _gemv_linear
from raydecode.kernels.settings import DEFAULT_OPTIONS, DecodeOptions

from .config import K3Config
from .parallel import Comm, Parallel

PATHS = ("stock", "specialized")


def check_path(path: str) -> None:
    if path not in PATHS:
        raise ValueError(f"path = {path!r}; accepted: {', '.join(PATHS)}")


def linear_for(path: str, options: DecodeOptions = DEFAULT_OPTIONS):
    """y = x·Wᵀ for a path: the kernels/ GEMV dispatch under `options` on the specialized
    path (`lin(x, w, out_dtype=None)`), models/layers.py `stock_linear` on stock (F.linear:
    cuBLAS / the CPU BLAS, but for CUDA decode batches, the skinny GEMM)."""
    if path != "specialized":
        from .layers import stock_linear        # layers imports this module
        return stock_linear

    def lin(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None):
        return _gemv_linear(x, w, out_dtype, options=options)
    return lin


def sharded_row_sizes(cfg: K3Config) -> dict[str, int]:
    """Row counts the specialized step splits 1/TP, by what they are (only the kinds the model
    has: no MoE layer -> no router/latent entries)."""
    sizes = {}
    if cfg.mla_layers:
        sizes["q_lora_rank + kv_lora_rank + qk_rope_head_dim (fused qkv_a rows)"] = \
            cfg.mla.q_lora_rank + cfg.mla.latent_dim
    if any(cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        sizes["num_experts (router rows)"] = cfg.moe.num_experts
        sizes["routed_expert_hidden_size (latent down-projection rows)"] = cfg.moe.latent_size
        sizes["hidden_size (latent up-projection rows)"] = cfg.hidden_size
    return sizes


def specialized_supported(cfg: K3Config, par: Parallel) -> tuple[bool, str]:
    """Whether this model config at this TP can run the specialized step; the reason if not.

    The coordinator calls it once per replica and runs every step stock when it says no."""
    tp = par.tp_size
    bad = [f"{what} = {n} is not divisible by tensor_parallel_size = {tp}"
           for what, n in sharded_row_sizes(cfg).items() if n % tp]
    if any(cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        m = cfg.moe
        if m.num_expert_group != 1:
            bad.append(f"num_expert_group = {m.num_expert_group}: the fused router handles one "
                       "expert group (K3's)")
        if m.router_activation != "sigmoid":
            bad.append(f"moe_router_activation_func = {m.router_activation!r}: the fused "
                       "router is sigmoid only")
    if bad:
        return False, "specialized step unsupported: " + "; ".join(bad)
    return True, "ok"


@functools.lru_cache(maxsize=None)
def row_pieces(sizes: tuple[int, ...], tp_rank: int, tp_size: int
               ) -> tuple[tuple[int, int, int], ...]:
    """Rank tp_rank's 1/TP rows of the concatenation of matrices with `sizes` rows, as
    (matrix index, first row, row count) pieces in row order."""
    N = sum(sizes)
    assert N % tp_size == 0, (sizes, tp_size)     # callers check specialized_supported first
    lo, hi = tp_rank * N // tp_size, (tp_rank + 1) * N // tp_size
    pieces, base = [], 0
    for i, n in enumerate(sizes):
        a, b = max(lo, base), min(hi, base + n)
        if a < b:
            pieces.append((i, a - base, b - a))
        base += n
    return tuple(pieces)


def sharded_gemv(x: torch.Tensor, weights: list[torch.Tensor], par: Parallel, comm: Comm,
                 options: DecodeOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """y = x·[W_0; W_1; …]ᵀ (T, ΣN_i), each rank computing its 1/TP rows, then all-gathered.

    x (T, K) replicated on every rank; W_i (N_i, K) replicated. Each piece is a GEMV on a row
    view of W_i; the pieces of one rank are contiguous rows, concatenated before the exchange."""
    pieces = row_pieces(tuple(w.shape[0] for w in weights), par.tp_rank, par.tp_size)
    parts = [_gemv_linear(x, weights[i].narrow(0, start, n), options=options)
             for i, start, n in pieces]
    local = parts[0] if len(parts) == 1 else torch.cat(parts, -1)      # (T, ΣN_i / TP)
    return comm.all_gather(local, dim=-1)


def row_slice(w: torch.Tensor, par: Parallel) -> torch.Tensor:
    """This rank's 1/TP rows of a replicated weight (a view)."""
    n = w.shape[0] // par.tp_size
    return w.narrow(0, par.tp_rank * n, n)


__all__ = ["PATHS", "check_path", "linear_for", "specialized_supported", "sharded_gemv",
           "row_slice", "row_pieces", "sharded_row_sizes"]
