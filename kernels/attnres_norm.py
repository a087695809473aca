"""Fused AttnRes mix + RMSNorm for the specialized decode step, plain and residual-add forms.

Before every sublayer K3 mixes its residual bank over depth and normalises the result
(models/attnres.py):

    V   = [b_0, …, b_{n-1}, p]                       (T, n+1, H)   blocks + running prefix
    s_j = RMSNorm(V_j; w_res) · w_proj                (T, n+1)      fp32
    mix = Σ_j softmax(s)_j · V_j                      (T, H)        fp32 (the reference and
                                                                    Triton; the CuTe kernel
                                                                    still rounds it to V's dtype)
    h   = RMSNorm(mix; w_out)                         (T, H)        the sublayer's input, in fp32,
                                                                    rounded once (vLLM's K3)

Residual-add form: the previous sublayer's output o joins the prefix first,
p ← (p + o) rounded to p's dtype, and the op returns (p, h). One kernel reads the bank once per
token and writes p and h; on the stock path these are 1 add + 1 stack + 2 norms + a softmax and
two small matmuls.

Layers (STYLE §6): `*_reference` are the PyTorch references and round where the stock path
rounds (so in fp32 the specialized step reproduces stock to the last bits of the reduction
order); `attnres_mix_norm` / `attnres_add_mix_norm` are the public ops and the dispatch point:
the CuTe DSL kernel of kernels/attnres_norm_cute.py where it supports the layout (`cute`:
DecodeOptions.attnres_cute; False skips it), else the Triton kernel of
kernels/attnres_norm_triton.py on CUDA tensors, else the reference (CPU, or no Triton).
"""
from __future__ import annotations

from typing import Sequence

import torch

from raydecode.kernels import attnres_norm_cute as _cu
from raydecode.kernels import attnres_norm_triton as _tri
from raydecode.kernels._cute import cute_available


def triton_serves(prefix: torch.Tensor) -> bool:
    """Whether the Triton kernel runs for a stream on `prefix`'s device (CUDA + Triton); the
    ops' fallback after the CuTe kernel, and the stock path's test for fusing (models/
    attnres.py `attnres_fusable`)."""
    return prefix.is_cuda and _tri.available(prefix)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 x / sqrt(mean(x²) + eps) · w over the last dim."""
    xf = x.float()
    return xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * w.float()


def attnres_mix_norm_reference(blocks: Sequence[torch.Tensor], prefix: torch.Tensor,
                               res_norm_w: torch.Tensor, res_proj_w: torch.Tensor,
                               out_norm_w: torch.Tensor, res_eps: float, out_eps: float
                               ) -> torch.Tensor:
    """blocks n × (T, H), prefix (T, H), res_norm_w (H,), res_proj_w (1, H), out_norm_w (H,)
    -> h (T, H) in prefix's dtype."""
    values = torch.stack(list(blocks) + [prefix], dim=1)                  # (T, n+1, H)
    probs = (_rms(values, res_norm_w, res_eps) @ res_proj_w[0].float()).softmax(-1)
    mix = (probs.unsqueeze(1) @ values.float()).squeeze(1)                 # fp32, kept
    return _rms(mix, out_norm_w, out_eps).to(prefix.dtype)


def attnres_add_mix_norm_reference(blocks: Sequence[torch.Tensor], prefix: torch.Tensor,
                                   out: torch.Tensor, res_norm_w: torch.Tensor,
                                   res_proj_w: torch.Tensor, out_norm_w: torch.Tensor,
                                   res_eps: float, out_eps: float
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """p ← p + out (rounded to p's dtype), then the mix-norm. -> (new prefix, h)."""
    new_prefix = (prefix.float() + out.float()).to(prefix.dtype)
    return new_prefix, attnres_mix_norm_reference(blocks, new_prefix, res_norm_w, res_proj_w,
                                                  out_norm_w, res_eps, out_eps)


def _check(blocks: Sequence[torch.Tensor], prefix: torch.Tensor, res_proj_w: torch.Tensor):
    if prefix.dim() != 2:
        raise ValueError(f"prefix of shape {tuple(prefix.shape)}; expected (T, H)")
    bad = [tuple(b.shape) for b in blocks if b.shape != prefix.shape]
    if bad:
        raise ValueError(f"AttnRes block snapshots of shapes {bad}; expected each "
                         f"{tuple(prefix.shape)} like the prefix")
    if tuple(res_proj_w.shape) != (1, prefix.shape[1]):
        raise ValueError(f"AttnRes projection of shape {tuple(res_proj_w.shape)}; expected "
                         f"(1, {prefix.shape[1]})")


def attnres_mix_norm(blocks, prefix, res_norm_w, res_proj_w, out_norm_w, res_eps, out_eps,
                     cute: bool = True):
    """The fused op (see module docstring) -> h (T, H)."""
    _check(blocks, prefix, res_proj_w)
    if cute and prefix.is_cuda and cute_available():
        h = _cu.mix_norm_cute(blocks, prefix, res_norm_w, res_proj_w, out_norm_w, res_eps,
                              out_eps)
        if h is not None:
            return h
    if triton_serves(prefix):
        return _tri.mix_norm_triton(blocks, prefix, res_norm_w, res_proj_w, out_norm_w,
                                    res_eps, out_eps)
    return attnres_mix_norm_reference(blocks, prefix, res_norm_w, res_proj_w, out_norm_w,
                                      res_eps, out_eps)


def attnres_add_mix_norm(blocks, prefix, out, res_norm_w, res_proj_w, out_norm_w, res_eps,
                         out_eps, new_prefix: torch.Tensor | None = None, cute: bool = True):
    """The fused residual-add form -> (new prefix, h). new_prefix: where bf16(p + out) goes
    (T, H) like prefix, e.g. the next slot of the caller's block bank; allocated when None. It
    must not overlap the blocks, prefix or out."""
    _check(blocks, prefix, res_proj_w)
    if out.shape != prefix.shape:
        raise ValueError(f"sublayer output of shape {tuple(out.shape)}; expected "
                         f"{tuple(prefix.shape)} like the prefix")
    if new_prefix is not None and (new_prefix.shape != prefix.shape
                                   or new_prefix.dtype != prefix.dtype
                                   or new_prefix.device != prefix.device):
        raise ValueError(f"new_prefix {tuple(new_prefix.shape)} {new_prefix.dtype} on "
                         f"{new_prefix.device}; expected {tuple(prefix.shape)} {prefix.dtype} on "
                         f"{prefix.device} like the prefix")
    if cute and prefix.is_cuda and cute_available():
        np_ = new_prefix if new_prefix is not None else torch.empty(
            prefix.shape, dtype=prefix.dtype, device=prefix.device)
        h = _cu.mix_norm_cute(blocks, prefix, res_norm_w, res_proj_w, out_norm_w, res_eps,
                              out_eps, out=out, new_prefix=np_)
        if h is not None:
            return np_, h
    if triton_serves(prefix):
        np_ = new_prefix if new_prefix is not None else torch.empty_like(prefix)
        h = _tri.mix_norm_triton(blocks, prefix, res_norm_w, res_proj_w, out_norm_w, res_eps,
                                 out_eps, out=out, new_prefix=np_)
        return np_, h
    p, h = attnres_add_mix_norm_reference(blocks, prefix, out, res_norm_w, res_proj_w,
                                          out_norm_w, res_eps, out_eps)
    return _into(p, new_prefix), h


def _into(p: torch.Tensor, dst: torch.Tensor | None) -> torch.Tensor:
    """p, or p copied into dst when the caller named where it goes."""
    if dst is None:
        return p
    dst.copy_(p)
    return dst


__all__ = ["attnres_mix_norm", "attnres_add_mix_norm", "attnres_mix_norm_reference",
           "attnres_add_mix_norm_reference", "triton_serves"]
