"""Fused MoE router for the specialized decode step: sigmoid + e_score_correction_bias + top-k of
E + renormalize in one op (noaux_tc with one expert group, as K3 routes), and the fp32 router
logits it consumes.

    s   = sigmoid(logits)                              (T, E) fp32
    ids = top-k over E of (s + bias)                    (T, k) int64, best first
    w   = s[ids] / Σ_k s[ids] · scaling                 (T, k) fp32 (bias never enters w)

Layers (STYLE §6): `route_topk_reference` / `router_logits_reference` are the PyTorch references
(the spec every kernel is tested against); `route_topk` / `router_logits` are the public ops and
the dispatch point. `route_topk` runs the Triton kernel of kernels/router_triton.py on CUDA
tensors (one program per token), else the reference (CPU, or no Triton). The fp32-output
logits GEMV has no kernel of its own: `router_logits` runs the reference (the served fused MoE
block computes the logits inside its packed GEMV, models/moe.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from raydecode.kernels import router_triton as _tri


def router_logits_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (T, H), w (E_r, H) any float dtype -> fp32 logits (T, E_r) = x·wᵀ, fp32 accumulation."""
    return F.linear(x.float(), w.float())


def route_topk_reference(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                         renormalize: bool = True, scaling: float = 1.0
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (T, E), bias (E,) or None -> (weights (T, k) fp32, ids (T, k) int64)."""
    s = torch.sigmoid(logits.float())
    sel = s if bias is None else s + bias.float()
    ids = sel.topk(top_k, dim=-1, sorted=True).indices
    w = s.gather(1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w * scaling, ids


def _check(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int) -> None:
    if logits.dim() != 2:
        raise ValueError(f"router logits of shape {tuple(logits.shape)}; expected (T, E)")
    E = logits.shape[1]
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k = {top_k}; expected 1 <= top_k <= E = {E}")
    if bias is not None and tuple(bias.shape) != (E,):
        raise ValueError(f"e_score_correction_bias of shape {tuple(bias.shape)}; expected ({E},)")


def router_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 router logits x·wᵀ (T, E_r); the rank's expert rows on the specialized path."""
    return router_logits_reference(x, w)


def route_topk(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int,
               renormalize: bool = True, scaling: float = 1.0, gather: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused router op (see module docstring); one expert group only. gather: the
    Triton kernel takes the k weights from registers (DecodeOptions.router_gather; False:
    re-loaded)."""
    _check(logits, bias, top_k)
    if logits.is_cuda and _tri.available(logits):
        return _tri.route_topk_triton(logits, bias, top_k, renormalize, scaling, gather=gather)
    return route_topk_reference(logits, bias, top_k, renormalize, scaling)


__all__ = ["route_topk", "route_topk_reference", "router_logits", "router_logits_reference"]
