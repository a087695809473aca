"""The routed-experts dispatch of the latent MoE (MXFP4-resident experts): which kernel computes

    out (T, L) fp32 = Σ_k w[t, k] · expert_{ids[t, k]}(z[t])       (partial over this rank's I)

    reference   off CUDA or without Triton: `moe_mxfp4_reference` (PyTorch; host sync on the
                unique ids)
    resident    specialized path, T·k ≤ moe_max_pairs, the shape listed in RESIDENT (or
                moe_kernel 'resident') and the plan fits one launch on this GPU: the resident
                CuTe kernel (kernels/moe_resident_cute.py; gate_up + SiTU + down in one launch)
    cuda_core   specialized path, T·k ≤ moe_max_pairs otherwise: the few-token CUDA-core
                kernels (kernels/moe_mxfp4_decode.py; 2 launches, config from its TUNED table
                or DecodeOptions.moe_decode_configs)
    grouped     the stock grouped kernel (kernels/moe_mxfp4.py `fused_moe_mxfp4`), in launch
                groups of ≤ MAX_FUSED_PAIRS pairs
All CUDA kernels keep the ids on the device (no host sync, capturable). `moe_kernel` is the
shape rule the decode plan lists per bucket (models/decode_plan.py); `routed_moe` applies it
to tensors. Measurements behind RESIDENT and moe_max_pairs: docs/PERF.md (MoE rows).
"""
from __future__ import annotations

import torch

from raydecode.kernels import moe_mxfp4_decode as _cuda_core
from raydecode.kernels._triton import triton as _triton
from raydecode.kernels.moe_mxfp4 import (MXFP4Experts, check_out, fused_moe_mxfp4,
                                         moe_mxfp4_reference)
from raydecode.kernels.settings import DEFAULT_OPTIONS, DecodeOptions

KERNELS = ("reference", "resident", "cuda_core", "grouped")
# (E, I, L, T) calls served by the resident CuTe kernel where it fits (DecodeOptions.moe_kernel
# 'auto'). K3 TP16 batch 1 (H200, same-lease layer A/B, medians over 3 leases): KDA layer
# 68.4 → 64.0 µs, MLA 77.5 → 73.2. The decode plan, and so the node cache, list the same.
RESIDENT: frozenset[tuple[int, int, int, int]] = frozenset({(896, 192, 3584, 1)})
# Pairs per grouped-kernel call: a step's tokens beyond this go in several calls. 8,192 tokens
# at K3's top-16 (the deployment's step budget) fit one call: each expert's ~146 pairs then
# share its dequantized tiles, where two calls of 73 each dequantize them twice (H200, TP16:
# 5.1 ms for one 8,192-token call vs 2 × 3.3 ms, scripts/explore/moe_prefill_sweep.py). The
# call holds a (P, L) bf16 buffer: 0.94 GB at K3's latent 3,584.
MAX_FUSED_PAIRS = 1 << 17
_RESIDENT_PLANS: dict[tuple, object] = {}


def few_token_kernel(tokens: int, num_experts: int, intermediate: int, latent: int,
                     options: DecodeOptions = DEFAULT_OPTIONS) -> str:
    """'resident' or 'cuda_core': the few-token kernel the options choose for T tokens of an
    (E, I, L) expert shape (the resident kernel still needs its plan to fit: `routed_moe`)."""
    if options.moe_kernel == "resident" or (
            options.moe_kernel == "auto"
            and (num_experts, intermediate, latent, tokens) in RESIDENT):
        return "resident"
    return "cuda_core"


def moe_kernel(tokens: int, top_k: int, num_experts: int, intermediate: int, latent: int,
               path: str, options: DecodeOptions = DEFAULT_OPTIONS) -> str:
    """The kernel `routed_moe` runs on a CUDA rank with Triton (module docstring; the
    resident kernel's fit is not checked here: it needs the GPU's SM count)."""
    if path != "specialized" or tokens * top_k > options.moe_max_pairs:
        return "grouped"
    return few_token_kernel(tokens, num_experts, intermediate, latent, options)


def decode_config_for(num_experts: int, intermediate: int, latent: int,
                      options: DecodeOptions = DEFAULT_OPTIONS) -> _cuda_core.DecodeConfig:
    """The CUDA-core kernel's config for an (E, I, L) expert shape: an options override,
    else its TUNED entry, else its default rule."""
    key = (num_experts, intermediate, latent)
    mine = next((c for k, c in options.moe_decode_configs if tuple(k) == key), None)
    return mine or _cuda_core.default_decode_config(*key)


def decode_config(experts: MXFP4Experts, options: DecodeOptions = DEFAULT_OPTIONS
                  ) -> _cuda_core.DecodeConfig:
    """`decode_config_for` these experts."""
    return decode_config_for(experts.num_experts, experts.intermediate, experts.latent, options)


def resident_plan(z: torch.Tensor, topk_ids: torch.Tensor, experts: MXFP4Experts,
                  predecode: int = DEFAULT_OPTIONS.moe_resident_predecode):
    """The resident kernel's plan for this call, or None (no CuTe, or it does not fit);
    memoized per (shape, dtype, device, betas, predecode). predecode: down rows per lane
    decoded before the wait (3 keeps the kernel at 64 registers: room on each SM for the next
    kernel's PDL prologue)."""
    from raydecode.kernels import moe_resident_cute as resident
    from raydecode.kernels._cute import cute_available
    key = (tuple(z.shape), topk_ids.shape[1], z.dtype, z.device, experts.num_experts,
           experts.intermediate, experts.beta, experts.linear_beta, predecode)
    if key not in _RESIDENT_PLANS:
        _RESIDENT_PLANS[key] = (resident.plan_for(z, topk_ids, experts, predecode=predecode)
                                if z.is_cuda and cute_available() else None)
    return _RESIDENT_PLANS[key]


def moe_decode(z: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               experts: MXFP4Experts, out: torch.Tensor | None = None,
               options: DecodeOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """The specialized few-token MoE (T·k ≤ moe_max_pairs): the resident CuTe kernel where
    `few_token_kernel` picks it and its plan fits, else `moe_mxfp4_decode`. Same contract as
    both; z bf16, or fp32 rounded to bf16 as it loads."""
    T = z.shape[0]
    if few_token_kernel(T, experts.num_experts, experts.intermediate, experts.latent,
                        options) == "resident":
        plan = resident_plan(z, topk_ids, experts, options.moe_resident_predecode)
        if plan is not None:
            from raydecode.kernels.moe_resident_cute import resident_moe_into
            if out is None:
                out = torch.empty(T, experts.latent, dtype=torch.float32, device=z.device)
            return resident_moe_into(plan, z, topk_weights, topk_ids, experts, out)
    return _cuda_core.moe_mxfp4_decode(z, topk_weights, topk_ids, experts,
                                       decode_config(experts, options), out=out)


def routed_moe(z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
               experts: MXFP4Experts, path: str = "stock",
               options: DecodeOptions = DEFAULT_OPTIONS,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """z (T, L), weights (T, k), ids (T, k) -> Σ_k w·expert(z) (T, L) fp32 on the kernel the
    module docstring's rule picks for these tensors. out: fp32 (T, L), unit column stride
    (kernels/moe_mxfp4.py `check_out`): the stock kernels' weighted sum writes into it (a
    column block of a buffer shared with other partials, no copy); elsewhere a copy."""
    weights = weights.float()
    if not (z.is_cuda and _triton is not None):
        return _into(moe_mxfp4_reference(z, weights, ids, experts), out)   # host sync (CPU)
    if (path == "specialized"
            and _cuda_core.use_decode_kernel(z, ids, experts, options.moe_max_pairs)):
        return _into(moe_decode(z, weights, ids, experts, options=options), out)
    zb = z.to(torch.bfloat16)                                       # the stock kernel's input
    step = max(1, MAX_FUSED_PAIRS // ids.shape[1])                 # tokens per launch group
    if z.shape[0] <= step:
        return fused_moe_mxfp4(zb, weights, ids, experts, out=out)
    if out is None:
        out = torch.empty(z.shape[0], experts.latent, dtype=torch.float32, device=z.device)
    for i in range(0, z.shape[0], step):
        fused_moe_mxfp4(zb[i:i + step], weights[i:i + step], ids[i:i + step], experts,
                        out=out[i:i + step])
    return out


def _into(r: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return r
    check_out(out, r.shape[0], r.shape[1], r.device)
    return out.copy_(r)


__all__ = ["KERNELS", "MAX_FUSED_PAIRS", "RESIDENT", "decode_config", "decode_config_for",
           "few_token_kernel",
           "moe_decode", "moe_kernel", "resident_plan", "routed_moe"]
