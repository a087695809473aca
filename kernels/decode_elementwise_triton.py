"""Two small fused elementwise ops of the specialized decode step's FFN half (Triton, round 2 of
issue 6), each replacing a chain of PyTorch kernels:

    situ_mul      gu (T, 2I) [gate ‖ up] -> a (T, I) = SiTU(gate, up) rounded to gu's dtype
                  (models/layers.py `situ`: β·tanh(g/β)·sigmoid(g) · β_l·tanh(u/β_l) in fp32)
    rms_norm_cast x (T, D) fp32 -> RMSNorm(bf16(x); w) rounded to bf16 (the routed latent's
                  norm after the latent all-reduce: layer_step `rms(lat.to(bf16), w, eps)`)

tanh(x) is computed as 2·sigmoid(2x) − 1 (as the MoE kernels do). `*_reference` are the
PyTorch references; the public functions dispatch to the kernels on CUDA tensors with Triton.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from raydecode.kernels.attnres_norm_triton import available, tl, triton
from raydecode.models.layers import situ

if triton is not None:

    @triton.jit
    def _tanh(x):
        return 2.0 * tl.sigmoid(2.0 * x) - 1.0

    @triton.jit
    def _situ_kernel(gu_ptr, gu_st, a_ptr, a_st, I, beta, lin_beta, HAS_LIN: tl.constexpr,
                     BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = n < I
        g = tl.load(gu_ptr + t * gu_st + n, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + t * gu_st + I + n, mask=m, other=0.0).to(tl.float32)
        act = beta * _tanh(g / beta) * tl.sigmoid(g)
        if HAS_LIN:
            u = lin_beta * _tanh(u / lin_beta)
        tl.store(a_ptr + t * a_st + n, (act * u).to(a_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _rms_cast_kernel(x_ptr, x_st, w_ptr, y_ptr, y_st, D, eps, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        m = offs < D
        x = tl.load(x_ptr + t * x_st + offs, mask=m, other=0.0)
        x = x.to(y_ptr.dtype.element_ty).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + t * y_st + offs, (x * r * w).to(y_ptr.dtype.element_ty), mask=m)


def _kernel_ok(*ts: torch.Tensor) -> bool:
    """The kernels serve CUDA tensors when Triton imports; everything else the references."""
    return all(t.is_cuda for t in ts) and available(*ts)


def situ_mul_reference(gu: torch.Tensor, beta: float, linear_beta: float | None
                       ) -> torch.Tensor:
    I = gu.shape[-1] // 2
    return situ(gu[:, :I], gu[:, I:], beta, linear_beta)


def rms_norm_cast_reference(x: torch.Tensor, w: torch.Tensor, eps: float,
                            dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return F.rms_norm(x.to(dtype).float(), (x.shape[-1],), w.float(), eps).to(dtype)


def situ_mul(gu: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """gu (T, 2I) gate ‖ up -> SiTU (T, I) in gu's dtype."""
    if gu.dim() != 2 or gu.shape[1] % 2:
        raise ValueError(f"gate|up of shape {tuple(gu.shape)}; expected (T, 2I)")
    if not _kernel_ok(gu):
        return situ_mul_reference(gu, beta, linear_beta)
    if gu.stride(1) != 1:
        gu = gu.contiguous()
    T, I = gu.shape[0], gu.shape[1] // 2
    a = torch.empty(T, I, dtype=gu.dtype, device=gu.device)
    block = min(1024, triton.next_power_of_2(I))
    _situ_kernel[(T, triton.cdiv(I, block))](
        gu, gu.stride(0), a, a.stride(0), I, float(beta),
        float(linear_beta if linear_beta is not None else 1.0),
        HAS_LIN=linear_beta is not None, BLOCK=block, num_warps=4)
    return a


def rms_norm_cast(x: torch.Tensor, w: torch.Tensor, eps: float,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x (T, D) (fp32) -> RMSNorm(x rounded to `dtype`; w) in `dtype`."""
    if x.dim() != 2 or tuple(w.shape) != (x.shape[1],):
        raise ValueError(f"rms_norm_cast: x {tuple(x.shape)} and w {tuple(w.shape)}; expected "
                         "(T, D) and (D,)")
    if not _kernel_ok(x, w):
        return rms_norm_cast_reference(x, w, eps, dtype)
    if x.stride(1) != 1:
        x = x.contiguous()
    T, D = x.shape
    y = torch.empty(T, D, dtype=dtype, device=x.device)
    block = triton.next_power_of_2(D)
    _rms_cast_kernel[(T,)](x, x.stride(0), w, y, y.stride(0), D, float(eps), BLOCK=block,
                           num_warps=max(1, min(16, block // 512)))
    return y


__all__ = ["situ_mul", "situ_mul_reference", "rms_norm_cast", "rms_norm_cast_reference"]
