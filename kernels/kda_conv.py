"""KDA's short convolutions for a prefill chunk in one kernel: causal depthwise conv, SiLU, the
model-dtype rounding and the L2 norms of q and k, written as the dense fp32 q, k, v that
fla's chunked forward (kernels/kda_prefill.py) reads.

One sequence's window xs (W−1+L, 3C) = [its last W−1 conv inputs, its L new ones], channels
[q C | k C | v C], C = h·d; conv weight w (3C, W) fp32, w[:, W−1] on the current input:

    y[t, c] = SiLU(Σ_j xs[t + j, c] · w[c, j])                     fp32, j = 0 .. W−1
    y       ← fp32(round_to(dtype, y))                             the model dtype's rounding
    q, k    ← q / sqrt(Σ q² + 1e-6), k likewise                    per head, over d
-> (q, k, v), each (L, h, d) fp32 contiguous (views of one (3, L, h, d) buffer).

The reference is models/kda.py's own chain (`causal_conv_silu`, `.to(dtype).float()`,
`l2_normalize`), which the stock layer runs off CUDA; it unfolds the window into an (L, C, W)
product tensor and makes six more passes, ≈ 1.5 ms of each K3 KDA layer's 8,192-token step at
TP16 on an H200 (the elementwise share of the step's profile). The kernel reads xs once and
writes the three outputs once: grid (⌈L / BT⌉, 3h), one program per BT tokens of one head of
q, k or v, the W taps accumulated in fp32 (fused multiply-adds, so the last bits may differ
from the reference's products-then-sum before the rounding).

L is not a compile key (`do_not_specialize`): one compile per (dtype, h, d, W) covers every
chunk length, and the build's warm-up of the stock buckets makes it.
"""
from __future__ import annotations

import torch

from raydecode.kernels._triton import available as _triton_on, tl, triton

L2_EPS = 1e-6               # models/kda.py L2_EPS
BLOCK_T = 32                # tokens per program
_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def conv_silu_l2_reference(xs: torch.Tensor, w: torch.Tensor, heads: int, dim: int,
                           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op in PyTorch: models/kda.py's chain (module docstring). -> (q, k, v) (L, h, d)."""
    from raydecode.models.kda import causal_conv_silu, l2_normalize   # models/ imports us
    L = xs.shape[0] - (w.shape[1] - 1)
    y = causal_conv_silu(xs, w).to(dtype).float()
    q, k, v = (t.reshape(L, heads, dim) for t in y.split(heads * dim, dim=-1))
    return l2_normalize(q), l2_normalize(k), v


def _check(xs: torch.Tensor, w: torch.Tensor, heads: int, dim: int, dtype) -> None:
    C3 = 3 * heads * dim
    if xs.dim() != 2 or xs.shape[1] != C3:
        raise ValueError(f"xs of shape {tuple(xs.shape)}: expected (W−1+L, 3·h·d = {C3})")
    if w.dim() != 2 or w.shape[0] != C3 or w.shape[1] < 1:
        raise ValueError(f"conv weight of shape {tuple(w.shape)}: expected (3·h·d = {C3}, W)")
    if xs.shape[0] < w.shape[1]:
        raise ValueError(f"xs has {xs.shape[0]} rows: expected W−1+L ≥ W = {w.shape[1]} "
                         "(the W−1 previous inputs and at least one new token)")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"rounding dtype {dtype}: expected a floating dtype (the model's)")


def _use_kernel(xs: torch.Tensor, w: torch.Tensor, dim: int, dtype: torch.dtype) -> bool:
    return (triton is not None and xs.is_cuda and _triton_on(xs, w)
            and dim & (dim - 1) == 0 and xs.stride(1) == 1
            and dtype in _ROUND and xs.dtype in _ROUND)


def conv_silu_l2(xs: torch.Tensor, w: torch.Tensor, heads: int, dim: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) (L, h, d) fp32 of one sequence's window (module docstring): the Triton
    kernel on CUDA (d a power of two, xs rows dense in channels, fp32 / bf16 / fp16), else the
    reference (e.g. a float64 model: the layer's chain, fp32 like the kernel, no fp16 cast)."""
    _check(xs, w, heads, dim, dtype)
    if not _use_kernel(xs, w, dim, dtype):
        return conv_silu_l2_reference(xs, w, heads, dim, dtype)
    W = w.shape[1]
    L = xs.shape[0] - (W - 1)
    out = torch.empty(3, L, heads, dim, dtype=torch.float32, device=xs.device)
    wf = w if (w.dtype == torch.float32 and w.is_contiguous()) else w.float().contiguous()
    with torch.cuda.device(xs.device):
        _conv_silu_l2_kernel[(triton.cdiv(L, BLOCK_T), 3 * heads)](
            xs, xs.stride(0), wf, out, L, L2_EPS, H=heads, D=dim, W=W, BT=BLOCK_T,
            ROUND=_ROUND[dtype], num_warps=4)
    return out[0], out[1], out[2]


if triton is not None:

    @triton.jit(do_not_specialize=["L"])
    def _conv_silu_l2_kernel(xs_ptr, xs_stride, w_ptr, out_ptr, L, eps, H: tl.constexpr,
                             D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr,
                             ROUND: tl.constexpr):
        """Tokens [pid0·BT, +BT) of head program_id(1) % H of part program_id(1) // H
        (0 q, 1 k, 2 v): channels part·C + head·D .. +D of xs, i.e. program_id(1)·D."""
        ph = tl.program_id(1)
        part = ph // H
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        t_ok = t < L
        c = ph * D + tl.arange(0, D)
        acc = tl.zeros((BT, D), dtype=tl.float32)
        for j in tl.static_range(W):
            x = tl.load(xs_ptr + (t[:, None] + j) * xs_stride + c[None, :],
                        mask=t_ok[:, None], other=0.0).to(tl.float32)
            acc += x * tl.load(w_ptr + c * W + j)[None, :]
        y = acc * tl.sigmoid(acc)
        if ROUND == 1:
            y = y.to(tl.bfloat16).to(tl.float32)
        elif ROUND == 2:
            y = y.to(tl.float16).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(y * y, axis=1) + eps)
        y = y * tl.where(part < 2, inv, 1.0)[:, None]
        col = (ph - part * H) * D + tl.arange(0, D)                # within the part's C
        tl.store(out_ptr + part * L * (H * D) + t[:, None] * (H * D) + col[None, :], y,
                 mask=t_ok[:, None])


__all__ = ["conv_silu_l2", "conv_silu_l2_reference", "L2_EPS"]
