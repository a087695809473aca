"""`linear`: the GEMV dispatch of the specialized decode step.

    y (..., N) = x (..., K) · Wᵀ,  W (N, K) bf16 row-major,  M = rows of x

Which kernel serves an (M, N, K) is a shape rule (`gemv_kernel`), the same one the decode plan
lists per batch bucket (models/decode_plan.py) and the node cache compiles (kernels/aot.py):
    cute    M = 1, or M = 2 under LINEAR_M2_MAX_BYTES of weights: the CuTe GEMV
            (kernels/gemv.py; CUDA cores, memory-bound; FMA-bound from M ≈ 4)
    skinny  2 < M ≤ DecodeOptions.skinny_max_m (16): the tensor-core skinny GEMM
            (kernels/gemm_skinny_triton.py)
    cublas  everything else (torch.nn.functional.linear)
`linear` applies the rule to real tensors and falls back to F.linear where the chosen kernel
cannot run them (CPU, no CuTe DSL / Triton, a layout or alignment the kernel refuses, a first
split-K skinny call under graph capture). Measurements behind the thresholds: docs/PERF.md
("GEMV" and "skinny GEMM" rows).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from raydecode.kernels import gemm_skinny_triton as _skinny
from raydecode.kernels._cute import cute_available
from raydecode.kernels.gemv import config_for, gemv, supports, weight_bytes
from raydecode.kernels.settings import DEFAULT_OPTIONS, DecodeOptions

# The CuTe GEMV serves every M = 1 shape and M = 2 below this many weight bytes (measured
# faster than cuBLAS there); M > 2 is FMA-bound on CUDA cores.
LINEAR_M2_MAX_BYTES = 16 * 2**20
KERNELS = ("cute", "skinny", "cublas")


def linear_uses_cute(M: int, N: int, K: int) -> bool:
    """Shapes where `linear` prefers the CuTe GEMV over cuBLAS (measured, docs/PERF.md)."""
    return M == 1 or (M == 2 and weight_bytes(N, K) < LINEAR_M2_MAX_BYTES)


def gemv_choice(M: int, N: int, K: int, options: DecodeOptions = DEFAULT_OPTIONS
                ) -> tuple[str, object, str]:
    """(kernel, config, why) for a bf16 (M, N, K) GEMV on a CUDA rank (module docstring):
    'cute' with its GemvConfig, 'skinny' with its SkinnyConfig, or 'cublas' with None; `why`
    says what decided it."""
    if linear_uses_cute(M, N, K):
        try:
            cfg = config_for(M, N, K, options.gemv_l2_prefetch_mib, options.gemv_configs)
        except ValueError as e:
            return "cublas", None, f"no GEMV mapping: {e}"
        return "cute", cfg, "CuTe GEMV (M = 1, or M = 2 under 16 MiB)"
    if 2 < M <= options.skinny_max_m and _skinny.shape_ok(M, N, K):
        return "skinny", _skinny.config_for(M, N, K), f"skinny GEMM (M ≤ {options.skinny_max_m})"
    return "cublas", None, "cuBLAS (linear_uses_cute is False)"


def gemv_kernel(M: int, N: int, K: int, options: DecodeOptions = DEFAULT_OPTIONS) -> str:
    """The kernel `linear` sends a bf16 (M, N, K) GEMV to on a CUDA rank: 'cute' (only where
    a GEMV mapping tiles the shape), 'skinny' or 'cublas' (`gemv_choice`)."""
    return gemv_choice(M, N, K, options)[0]


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


def linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
           options: DecodeOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """x (..., K) · Wᵀ on the kernel `gemv_kernel` picks, where it runs these tensors; else
    F.linear.

    out_dtype=torch.float32 returns the fp32 accumulator unrounded (router logits: a GEMV whose
    rows also feed bf16 consumers rounds per consumer, which equals F.linear's single rounding)."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    f32 = out_dtype == torch.float32
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"linear: out_dtype={out_dtype}; accepted: None, {x.dtype}, torch.float32")
    M, N, K = x2.shape[0], w.shape[0], w.shape[1]
    l2, over = options.gemv_l2_prefetch_mib, options.gemv_configs
    if cute_available() and supports(x2, w, 2, l2, over) and linear_uses_cute(M, N, K):
        return gemv(x2, w, out_dtype=out_dtype, config=config_for(M, N, K, l2, over)
                    ).reshape(*x.shape[:-1], N)
    if 2 < M <= options.skinny_max_m and x2.is_cuda and _skinny.supports(x2, w):
        return _skinny.skinny_gemm(x2, w, out_dtype=out_dtype).reshape(*x.shape[:-1], N)
    if f32:
        return linear_f32_reference(x2, w).reshape(*x.shape[:-1], N)
    return F.linear(x, w)


__all__ = ["KERNELS", "LINEAR_M2_MAX_BYTES", "gemv_choice", "gemv_kernel", "linear",
           "linear_f32_reference",
           "linear_uses_cute"]
