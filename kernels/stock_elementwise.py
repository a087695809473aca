"""Fused elementwise ops of the stock KDA layer (Triton), each replacing a chain of PyTorch
kernels over all of a stock step's T rows (prefill chunks, mixed and stock decode steps):

    kda_gate_beta    raw (T, h·d) = f_b(f_a(x)) (model dtype), b (T, h) (model dtype)
                     -> g (T, h, d) = lb · sigmoid(exp(A_log)[h] · (raw + dt_bias)) fp32,
                        β (T, h) = sigmoid(b) fp32          (models/kda.py `kda_gate`, sigmoid)
    gated_rms_norm   o (T, h, d) fp32, w (d,), gate (T, h·d) (model dtype)
                     -> bf16(RMSNorm(o; w) · sigmoid(gate)) (T, h·d), one rounding
                        (the KDA output norm, models/kda.py forward)
    situ_pair        gate (T, I), up (T, I) (two GEMM outputs) -> SiTU(gate, up) (T, I) in
                     gate's dtype (models/layers.py `situ`: the dense FFN and shared experts)
    add_rounded      a (T, N) (model dtype, contiguous), b (T, N) (fp32, a column view)
                     -> a + b rounded to a's dtype, into a: the MoE block's latent-up output
                     plus its shared experts' fp32 sum (models/moe.py: bf16(a + bf16(b)))

The `*_reference` functions are the PyTorch chains they replace, kept as the CPU path and the
tests' ground truth; the public functions run the kernels on CUDA tensors with Triton (the
interpreter on CPU under TRITON_INTERPRET=1), else the references. Inputs may be column views
(unit stride along the last dim); outputs are new contiguous tensors. Ordinary launches (no
PDL): stream order as any PyTorch op, capturable in a CUDA graph.
"""
from __future__ import annotations

import torch

from raydecode.kernels._triton import available, tanh_f32, tl, triton

if triton is not None:

    @triton.jit
    def _gate_beta_kernel(raw_ptr, raw_st, b_ptr, b_st, expa_ptr, dtb_ptr, g_ptr, beta_ptr,
                          NH, D, lower_bound, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        hh = tl.program_id(1)
        i = tl.arange(0, BLOCK)
        m = i < D
        c = hh * D + i
        raw = tl.load(raw_ptr + t * raw_st + c, mask=m, other=0.0).to(tl.float32)
        z = raw + tl.load(dtb_ptr + c, mask=m, other=0.0).to(tl.float32)
        ea = tl.load(expa_ptr + hh).to(tl.float32)
        tl.store(g_ptr + t * (NH * D) + c, lower_bound * tl.sigmoid(ea * z), mask=m)
        b = tl.load(b_ptr + t * b_st + hh).to(tl.float32)
        tl.store(beta_ptr + t * NH + hh, tl.sigmoid(b))

    @triton.jit
    def _gated_norm_kernel(o_ptr, o_st, o_sh, w_ptr, gate_ptr, gate_st, y_ptr, y_st, D, eps,
                           BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        hh = tl.program_id(1)
        i = tl.arange(0, BLOCK)
        m = i < D
        o = tl.load(o_ptr + t * o_st + hh * o_sh + i, mask=m, other=0.0)
        r = tl.rsqrt(tl.sum(o * o, 0) / D + eps)
        w = tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32)
        gt = tl.load(gate_ptr + t * gate_st + hh * D + i, mask=m, other=0.0).to(tl.float32)
        y = o * r * w * tl.sigmoid(gt)
        tl.store(y_ptr + t * y_st + hh * D + i, y.to(y_ptr.dtype.element_ty), mask=m)


    @triton.jit
    def _situ_pair_kernel(g_ptr, g_st, u_ptr, u_st, a_ptr, a_st, I, beta, lin_beta,
                          HAS_LIN: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = n < I
        g = tl.load(g_ptr + t * g_st + n, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + t * u_st + n, mask=m, other=0.0).to(tl.float32)
        act = beta * tanh_f32(g / beta) * tl.sigmoid(g)
        if HAS_LIN:
            u = lin_beta * tanh_f32(u / lin_beta)
        tl.store(a_ptr + t * a_st + n, (act * u).to(a_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _add_rounded_kernel(a_ptr, a_st, b_ptr, b_st, N, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = n < N
        dt = a_ptr.dtype.element_ty
        a = tl.load(a_ptr + t * a_st + n, mask=m, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + t * b_st + n, mask=m, other=0.0)
        b = b.to(dt, fp_downcast_rounding="rtne").to(tl.float32)     # as torch rounds
        tl.store(a_ptr + t * a_st + n, (a + b).to(dt, fp_downcast_rounding="rtne"), mask=m)


def kda_gate_beta_reference(raw: torch.Tensor, b: torch.Tensor, exp_a: torch.Tensor,
                            dt_bias: torch.Tensor, lower_bound: float, heads: int
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    from raydecode.kernels.kda_decode import kda_gate_exp     # the decode op's gate
    g = kda_gate_exp(raw.view(raw.shape[0], heads, -1), exp_a.float(), dt_bias.float(),
                     lower_bound)
    return g, torch.sigmoid(b.float())


def gated_rms_norm_reference(o: torch.Tensor, w: torch.Tensor, eps: float, gate: torch.Tensor,
                             dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    from raydecode.models.layers import rms_norm        # the model's definition (no cycle)
    T, h, d = o.shape
    y = rms_norm(o.float(), w, eps) * torch.sigmoid(gate.float()).view(T, h, d)
    return y.to(dtype).reshape(T, h * d)


def _serves(*ts: torch.Tensor) -> bool:
    return all(t.is_cuda for t in ts) and available(*ts) and all(t.stride(-1) == 1 for t in ts)


def kda_gate_beta(raw: torch.Tensor, b: torch.Tensor, exp_a: torch.Tensor,
                  dt_bias: torch.Tensor, lower_bound: float, heads: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """raw (T, h·d), b (T, h) (column views allowed), exp_a (h,) = exp(A_log), dt_bias (h·d,)
    -> (g (T, h, d), β (T, h)), both fp32 (module docstring)."""
    T, C = raw.shape if raw.dim() == 2 else (None, None)
    if (raw.dim() != 2 or C % heads or tuple(b.shape) != (T, heads)
            or tuple(exp_a.shape) != (heads,) or dt_bias.numel() != C):
        raise ValueError(f"kda_gate_beta: raw {tuple(raw.shape)}, b {tuple(b.shape)}, exp_a "
                         f"{tuple(exp_a.shape)}, dt_bias {tuple(dt_bias.shape)}; expected "
                         f"(T, {heads}·d), (T, {heads}), ({heads},), ({heads}·d,)")
    if not _serves(raw, b, exp_a, dt_bias):
        return kda_gate_beta_reference(raw, b, exp_a, dt_bias, lower_bound, heads)
    d = C // heads
    g = torch.empty(T, heads, d, dtype=torch.float32, device=raw.device)
    beta = torch.empty(T, heads, dtype=torch.float32, device=raw.device)
    if T:
        block = triton.next_power_of_2(d)
        _gate_beta_kernel[(T, heads)](raw, raw.stride(0), b, b.stride(0), exp_a,
                                      dt_bias.contiguous(), g, beta, heads, d,
                                      float(lower_bound), BLOCK=block,
                                      num_warps=max(1, min(4, block // 32)))
    return g, beta


def gated_rms_norm(o: torch.Tensor, w: torch.Tensor, eps: float, gate: torch.Tensor,
                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """o (T, h, d) fp32 (rows contiguous in d), w (d,), gate (T, h·d) (a column view allowed)
    -> (T, h·d) in `dtype` (module docstring)."""
    T, h, d = o.shape if o.dim() == 3 else (None, None, None)
    if o.dim() != 3 or tuple(w.shape) != (d,) or tuple(gate.shape) != (T, h * d):
        raise ValueError(f"gated_rms_norm: o {tuple(o.shape)}, w {tuple(w.shape)}, gate "
                         f"{tuple(gate.shape)}; expected (T, h, d), (d,), (T, h·d)")
    if not (_serves(o, w, gate) and o.dtype == torch.float32):
        return gated_rms_norm_reference(o, w, eps, gate, dtype)
    y = torch.empty(T, h * d, dtype=dtype, device=o.device)
    if T:
        block = triton.next_power_of_2(d)
        _gated_norm_kernel[(T, h)](o, o.stride(0), o.stride(1), w, gate, gate.stride(0), y,
                                   y.stride(0), d, float(eps), BLOCK=block,
                                   num_warps=max(1, min(4, block // 32)))
    return y


def situ_pair_reference(gate: torch.Tensor, up: torch.Tensor, beta: float,
                        linear_beta: float | None) -> torch.Tensor:
    from raydecode.models.layers import situ          # the model's definition (no cycle)
    return situ(gate, up, beta, linear_beta)


def situ_pair(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None
              ) -> torch.Tensor:
    """gate, up (T, I) -> SiTU(gate, up) (T, I) in gate's dtype; tanh as 2·sigmoid(2x) − 1
    in the kernel (as the MoE kernels and kernels/decode_elementwise_triton.py `situ_mul`)."""
    if gate.dim() != 2 or gate.shape != up.shape:
        raise ValueError(f"situ_pair: gate {tuple(gate.shape)} and up {tuple(up.shape)}; "
                         "expected two (T, I)")
    if not _serves(gate, up):
        return situ_pair_reference(gate, up, beta, linear_beta)
    T, I = gate.shape
    a = torch.empty(T, I, dtype=gate.dtype, device=gate.device)
    if T:
        block = min(1024, triton.next_power_of_2(I))
        _situ_pair_kernel[(T, triton.cdiv(I, block))](
            gate, gate.stride(0), up, up.stride(0), a, a.stride(0), I, float(beta),
            float(linear_beta if linear_beta is not None else 1.0),
            HAS_LIN=linear_beta is not None, BLOCK=block, num_warps=4)
    return a


def add_rounded_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b.to(a.dtype)


def add_rounded(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b.to(a.dtype) (module docstring): written into a (and returned) by the kernel; the
    reference returns a new tensor. a (T, N) contiguous rows, b (T, N) with unit column
    stride."""
    if a.dim() != 2 or a.shape != b.shape:
        raise ValueError(f"add_rounded: a {tuple(a.shape)} and b {tuple(b.shape)}; expected "
                         "two (T, N)")
    if not (_serves(a, b) and a.dtype == torch.bfloat16):
        return add_rounded_reference(a, b)
    T, N = a.shape
    if T:
        block = min(2048, triton.next_power_of_2(N))
        _add_rounded_kernel[(T, triton.cdiv(N, block))](a, a.stride(0), b, b.stride(0), N,
                                                         BLOCK=block, num_warps=4)
    return a


__all__ = ["add_rounded", "add_rounded_reference", "gated_rms_norm", "gated_rms_norm_reference",
           "kda_gate_beta", "kda_gate_beta_reference", "situ_pair", "situ_pair_reference"]
