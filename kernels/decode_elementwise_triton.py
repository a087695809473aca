"""Two small fused elementwise ops of the specialized decode step's FFN half (Triton), each
replacing a chain of PyTorch kernels:

    situ_mul      gu (T, 2I) [gate ‖ up] -> a (T, I) = SiTU(gate, up) rounded to gu's dtype
                  (models/layers.py `situ`: β·tanh(g/β)·sigmoid(g) · β_l·tanh(u/β_l) in fp32)
    rms_norm_cast x (T, D) fp32 -> RMSNorm(bf16(x); w) rounded to bf16 (the routed latent's
                  norm after the latent all-reduce, models/moe.py: RMSNorm(bf16(lat)))
    latent_norm_situ  both of the above in ONE kernel, written side by side into the input of
                  the fused [latent up ‖ shared down] GEMV:
                  out (T, Kc) = [RMSNorm(bf16(lat))[:, c0:c0+n] ‖ SiTU(bf16(gu)) ‖ 0 pad]

tanh(x) is computed as 2·sigmoid(2x) − 1 (as the MoE kernels do). `*_reference` are the
PyTorch references; the public functions dispatch to the kernels on CUDA tensors with Triton.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from raydecode.kernels._triton import available, pdl_enter, pdl_launch, tanh_f32, tl, triton
from raydecode.models.layers import situ

if triton is not None:


    @triton.jit
    def _situ_kernel(gu_ptr, gu_st, a_ptr, a_st, I, beta, lin_beta, HAS_LIN: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        t = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = n < I
        g = tl.load(gu_ptr + t * gu_st + n, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + t * gu_st + I + n, mask=m, other=0.0).to(tl.float32)
        act = beta * tanh_f32(g / beta) * tl.sigmoid(g)
        if HAS_LIN:
            u = lin_beta * tanh_f32(u / lin_beta)
        tl.store(a_ptr + t * a_st + n, (act * u).to(a_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _rms_cast_kernel(x_ptr, x_st, w_ptr, y_ptr, y_st, D, eps, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
        pdl_enter(PDL)
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        m = offs < D
        x = tl.load(x_ptr + t * x_st + offs, mask=m, other=0.0)
        x = x.to(y_ptr.dtype.element_ty).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + t * y_st + offs, (x * r * w).to(y_ptr.dtype.element_ty), mask=m)


    @triton.jit
    def _norm_situ_kernel(lat_ptr, lat_st, w_ptr, D, eps, c0, n_cols, gu_ptr, gu_st, I,
                          beta, lin_beta, out_ptr, out_st, K_out, HAS_LIN: tl.constexpr,
                          BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        # program (t, 0): the latent norm slice; (t, j ≥ 1): SiTU columns and the zero pad
        pdl_enter(PDL)
        t = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1)
        dt = out_ptr.dtype.element_ty
        if j == 0:
            offs = tl.arange(0, BLOCK_D)
            in_d = offs < D
            x = tl.load(lat_ptr + t * lat_st + offs, mask=in_d, other=0.0).to(dt).to(tl.float32)
            r = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
            w = tl.load(w_ptr + offs, mask=in_d, other=0.0).to(tl.float32)
            keep = in_d & (offs >= c0) & (offs < c0 + n_cols)
            tl.store(out_ptr + t * out_st + (offs - c0), (x * r * w).to(dt), mask=keep)
        else:
            n = (j - 1) * BLOCK + tl.arange(0, BLOCK)
            in_i = n < I
            g = tl.load(gu_ptr + t * gu_st + n, mask=in_i, other=0.0).to(dt).to(tl.float32)
            u = tl.load(gu_ptr + t * gu_st + I + n, mask=in_i, other=0.0).to(dt).to(tl.float32)
            act = beta * tanh_f32(g / beta) * tl.sigmoid(g)
            if HAS_LIN:
                u = lin_beta * tanh_f32(u / lin_beta)
            a = tl.where(in_i, act * u, 0.0)
            col = n_cols + n                      # SiTU columns, then zeros up to K_out
            tl.store(out_ptr + t * out_st + col, a.to(dt), mask=col < K_out)


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
        HAS_LIN=linear_beta is not None, BLOCK=block, num_warps=4, **pdl_launch(a))
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
                           num_warps=max(1, min(16, block // 512)), **pdl_launch(y))
    return y


def latent_norm_situ_reference(lat: torch.Tensor, w: torch.Tensor, eps: float, c0: int,
                               n_cols: int, gu: torch.Tensor, beta: float,
                               linear_beta: float | None, k_out: int) -> torch.Tensor:
    dt = torch.bfloat16
    ln = rms_norm_cast_reference(lat, w, eps, dt)[:, c0:c0 + n_cols]
    a = situ_mul_reference(gu.to(dt), beta, linear_beta)
    pad = ln.new_zeros(lat.shape[0], k_out - n_cols - a.shape[1])
    return torch.cat([ln, a, pad], 1)


def latent_norm_situ(lat: torch.Tensor, w: torch.Tensor, eps: float, c0: int, n_cols: int,
                     gu: torch.Tensor, beta: float, linear_beta: float | None,
                     out: torch.Tensor) -> torch.Tensor:
    """out (T, K) bf16 ← [RMSNorm(bf16(lat); w)[:, c0:c0+n_cols] ‖ SiTU(bf16(gu)) ‖ zeros].

    lat (T, D) fp32 (the all-reduced routed latent), w (D,), gu (T, 2I) shared gate ‖ up (any
    float dtype, rounded to bf16 first as F.linear's output would be; may be a strided column
    slice), K ≥ n_cols + I. One kernel: the input of the fused [latent up ‖ shared down] GEMV."""
    T, D = lat.shape if lat.dim() == 2 else (None, None)
    if (lat.dim() != 2 or tuple(w.shape) != (D,) or gu.dim() != 2 or gu.shape[0] != T
            or gu.shape[1] % 2):
        raise ValueError(f"latent_norm_situ: lat {tuple(lat.shape)}, w {tuple(w.shape)}, gu "
                         f"{tuple(gu.shape)}; expected (T, D), (D,), (T, 2I)")
    I = gu.shape[1] // 2
    if not (0 <= c0 and c0 + n_cols <= D) or out.shape != (T, out.shape[1]) \
            or out.shape[1] < n_cols + I or out.dtype != torch.bfloat16:
        raise ValueError(f"latent_norm_situ: columns [{c0}, {c0 + n_cols}) of D={D} into out "
                         f"{tuple(out.shape)} {out.dtype}; need a bf16 (T, ≥ {n_cols + I}) out")
    if not _kernel_ok(lat, w, gu, out) or out.stride(1) != 1:
        out.copy_(latent_norm_situ_reference(lat, w, eps, c0, n_cols, gu, beta, linear_beta,
                                             out.shape[1]))
        return out
    if lat.stride(1) != 1:
        lat = lat.contiguous()
    if gu.stride(1) != 1:
        gu = gu.contiguous()
    block = min(1024, triton.next_power_of_2(out.shape[1] - n_cols))
    grid = (T, 1 + triton.cdiv(out.shape[1] - n_cols, block))
    _norm_situ_kernel[grid](
        lat, lat.stride(0), w, D, float(eps), c0, n_cols, gu, gu.stride(0), I, float(beta),
        float(linear_beta if linear_beta is not None else 1.0), out, out.stride(0),
        out.shape[1], HAS_LIN=linear_beta is not None, BLOCK_D=triton.next_power_of_2(D),
        BLOCK=block, num_warps=8, **pdl_launch(gu))
    return out


__all__ = ["situ_mul", "situ_mul_reference", "rms_norm_cast", "rms_norm_cast_reference",
           "latent_norm_situ", "latent_norm_situ_reference"]
