"""`linear`: the GEMV dispatch of the specialized decode step (moved from kernels/gemv.py)."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from raydecode.kernels import gemm_skinny_triton as _skinny
from raydecode.kernels._cute import cute_available
from raydecode.kernels.gemv import gemv, supports, weight_bytes

# `linear` takes the CuTe kernel where it measured faster than cuBLAS (run2): every M = 1 shape,
# M = 2 below this many weight bytes; M > 2 is FMA-bound on CUDA cores (docs/PERF.md).
LINEAR_M2_MAX_BYTES = 16 * 2**20
# 2 < M ≤ this goes to the tensor-core skinny GEMM (kernels/gemm_skinny_triton.py) instead of
# cuBLAS, on CUDA (PERF round 30, H200: 1.1–1.8× cuBLAS on the TP16 GEMVs at M = 4–16, TP16
# step −0.2 to −0.65 ms at batches 4–16; at M = 32–64 it loses on the widest matrices);
# 0 = off. RAYDECODE_SKINNY_MAX_M overrides it for A/B runs.
SKINNY_MAX_M = int(os.environ.get("RAYDECODE_SKINNY_MAX_M", "16"))



def linear_uses_cute(M: int, N: int, K: int) -> bool:
    """Shapes where `linear` prefers the CuTe GEMV over cuBLAS (measured, docs/PERF.md)."""
    return M == 1 or (M == 2 and weight_bytes(N, K) < LINEAR_M2_MAX_BYTES)


def linear_f32_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x · Wᵀ with bf16 products accumulated in fp32 and returned unrounded (fp32).

    Off CUDA the sums run in fp64, then round to fp32 once: the CPU BLAS blocks an fp32 GEMM
    by its row count, so row t of an M-row call could differ by an ulp from the same row in
    an M+1-row call (a padded graph bucket, tests/cpu/test_step_graph.py); fp64 sums round to
    the same fp32 whatever M is."""
    if x.is_cuda:
        try:
            return torch.mm(x, w.t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError):  # torch without out_dtype for bf16 mm
            pass
        return F.linear(x.float(), w.float())
    return F.linear(x.double(), w.double()).float()


def linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x (..., K) · Wᵀ: the CuTe GEMV where it beats cuBLAS (`linear_uses_cute`), the skinny
    tensor-core GEMM for 2 < M ≤ SKINNY_MAX_M on CUDA, else F.linear.

    out_dtype=torch.float32 returns the fp32 accumulator unrounded (router logits: a GEMV whose
    rows also feed bf16 consumers rounds per consumer, which equals F.linear's single rounding)."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    f32 = out_dtype == torch.float32
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"linear: out_dtype={out_dtype}; accepted: None, {x.dtype}, torch.float32")
    if cute_available() and supports(x2, w, max_m=2) and linear_uses_cute(x2.shape[0], w.shape[0], w.shape[1]):
        return gemv(x2, w, out_dtype=out_dtype).reshape(*x.shape[:-1], w.shape[0])
    if 2 < x2.shape[0] <= SKINNY_MAX_M and x2.is_cuda and _skinny.supports(x2, w):
        return _skinny.skinny_gemm(x2, w, out_dtype=out_dtype).reshape(*x.shape[:-1], w.shape[0])
    if f32:
        return linear_f32_reference(x2, w).reshape(*x.shape[:-1], w.shape[0])
    return F.linear(x, w)


__all__ = ["LINEAR_M2_MAX_BYTES", "SKINNY_MAX_M", "linear", "linear_f32_reference",
           "linear_uses_cute"]
