"""The routed experts of a large prefill step as dequantize-then-grouped-GEMM (an alternative
to kernels/moe_mxfp4.py `prefill_config`: `MoEConfig.grouped_bf16`, or every eager call from
`GROUPED_PAIRS` pairs, 0 as shipped). Measured slower on the H100 (K3 TP16, balanced routing,
one call: 5.91 ms against the split kernel's 4.43 at 8,192 tokens, 4.55 against 2.47 at
2,048; bench/results/moe-prefill-sweep-h100-2026-12-07-grouped.json), so it is the prefill
bench's same-run A/B (`--grouped-pairs`), not the shipped path.

Why: at thousands of tokens every expert gets a hundred or more pairs, and the fused MXFP4
kernels decode each weight tile once per 128 pairs inside the GEMM's loop, which keeps them
latency-bound at ≈ 116 TFLOP/s on the H100 (the split gate/up kernel, 8,192 tokens, K3
TP16: bench/results/moe-prefill-sweep-h100-2026-12-06-split.json) against ≈ 750 for dense
bf16. Here the weights are decoded once per call into a bf16 scratch (one streaming pass:
0.93 GB of codes and scales in, 3.7 GB of bf16 out at K3 TP16, the w13 and w2 halves one
after the other so the peak is the larger, 2.5 GB), then the pairs, sorted by expert, go
through `torch._grouped_mm` (cuBLAS / CUTLASS grouped GEMM on sm90+; a loop on the CPU):

    order = pairs sorted by expert (stable)       offs = cumulative pairs per expert
    x     = z[token of pair]                      (P, L) bf16
    gu    = grouped_mm(x, W13ᵀ, offs)             (P, 2I) bf16     [gate ‖ up]
    a     = SiTU(gu[:, :I], gu[:, I:])            (P, I)  bf16
    y     = grouped_mm(a, W2ᵀ, offs)              (P, L)  bf16
    out[t] = Σ_j w[t, j] · y[row of pair (t, j)]  (T, L)  fp32

The same rounding points as `moe_mxfp4_reference` (bf16 gate and up, bf16 a, bf16 y, an
fp32 weighted sum); the GEMMs' accumulation order differs, so outputs agree within the bf16
tolerance, not bitwise. Experts no pair selects are not decoded (their scratch rows are
left as they are: no GEMM reads them). Not capturable in a CUDA graph as written (the
scratch is allocated per call), so it is for the eager steps above the stock-graph cap.
"""
from __future__ import annotations

import torch

from raydecode.models.layers import situ
from raydecode.models.mxfp4 import unpack_mxfp4

from .moe_mxfp4 import (MXFP4Experts, _largest_block, _use_triton, check_out, situ_rows,
                         weighted_sum)

try:  # CPU-only installs have no Triton: the PyTorch path serves them
    import triton
    import triton.language as tl

    from .moe_mxfp4 import _dequant_tile
except Exception:  # ImportError, or a broken install
    triton = tl = None

DEQUANT_BLOCK = (64, 128)     # (rows, K columns at most) per program of the dequantization


if triton is not None:

    @triton.jit
    def _dequant_rows_kernel(w_ptr, s_ptr, counts_ptr, out_ptr, N: tl.constexpr,
                             K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
        """out[e, r, :] = MXFP4 rows of expert e in bf16 (grid: experts, N / BR, K / BK);
        an expert with no pair (counts[e] == 0) is skipped."""
        e = tl.program_id(0)
        if tl.load(counts_ptr + e) == 0:
            return
        r = tl.program_id(1) * BR + tl.arange(0, BR)
        ok = r < N
        k0 = tl.program_id(2) * BK
        rows = e * N + r
        v = _dequant_tile(w_ptr, s_ptr, rows, ok, k0, K, BR, BK)
        cols = k0 + tl.arange(0, BK)
        tl.store(out_ptr + rows[:, None] * K + cols[None, :], v, mask=ok[:, None])


def dequant_experts(packed: torch.Tensor, scales: torch.Tensor,
                    counts: torch.Tensor | None = None) -> torch.Tensor:
    """(E, N, K/2) + (E, N, K/32) uint8 -> (E, N, K) bf16; with `counts` (E,) the experts at
    0 are skipped on the Triton path (their rows unwritten). Triton where it runs on these
    tensors, else `unpack_mxfp4` (every expert)."""
    if not _use_triton(packed):
        return unpack_mxfp4(packed, scales, torch.bfloat16)
    E, N, Kh = packed.shape
    K = 2 * Kh
    br, bk = DEQUANT_BLOCK
    bk = _largest_block(K, bk)            # a power of two ≥ 32 dividing K (K % 32 == 0)
    if counts is None:
        counts = torch.ones(E, dtype=torch.int64, device=packed.device)
    out = torch.empty(E, N, K, dtype=torch.bfloat16, device=packed.device)
    _dequant_rows_kernel[(E, triton.cdiv(N, br), K // bk)](
        packed, scales, counts, out, N=N, K=K, BR=br, BK=bk, num_warps=4)
    return out


def moe_mxfp4_grouped(z: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      experts: MXFP4Experts, out: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_k w·expert(z) (T, L) fp32 (written into `out` when given), as the module docstring
    says. z (T, L) bf16, topk_weights (T, k) fp32, topk_ids (T, k) integer."""
    T, k = topk_ids.shape
    E, I, L = experts.num_experts, experts.intermediate, experts.latent
    if z.dtype != torch.bfloat16 or tuple(z.shape) != (T, L):
        raise ValueError(f"grouped experts: z {z.dtype} {tuple(z.shape)}; expected bf16 "
                         f"({T}, {L})")
    cap = torch.cuda.get_device_capability(z.device) if z.is_cuda else None
    if cap is not None and cap < (9, 0):
        raise ValueError("MoEConfig.grouped_bf16 needs torch._grouped_mm's sm90+ kernels; "
                         f"this GPU is sm{cap[0]}{cap[1]}")
    check_out(out, T, L, z.device)
    ids = topk_ids.reshape(-1).long()
    order = torch.argsort(ids, stable=True)                 # pair indices, expert-sorted
    counts = torch.bincount(ids, minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    x = z.index_select(0, order // k)
    w13 = dequant_experts(experts.w13, experts.s13, counts)            # (E, 2I, L)
    gu = torch._grouped_mm(x, w13.transpose(1, 2), offs=offs)          # (P, 2I)
    del w13, x
    tri = _use_triton(z)
    if tri:
        a = situ_rows(gu, torch.empty(gu.shape[0], I, dtype=torch.bfloat16, device=z.device),
                      experts)
    else:
        a = situ(gu[:, :I], gu[:, I:], experts.beta, experts.linear_beta)
    del gu
    w2 = dequant_experts(experts.w2, experts.s2, counts)               # (E, L, I)
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)            # (P, L), sorted
    del w2, a
    if tri:
        row = torch.empty_like(order)
        row[order] = torch.arange(order.numel(), device=z.device)
        return weighted_sum(y, topk_weights, out, row)
    if out is None:
        out = torch.empty(T, L, dtype=torch.float32, device=z.device)
    w = topk_weights.reshape(-1)[order].float().unsqueeze(-1)
    out.zero_()
    out.index_add_(0, order // k, y.float() * w)
    return out


__all__ = ["DEQUANT_BLOCK", "dequant_experts", "moe_mxfp4_grouped"]
