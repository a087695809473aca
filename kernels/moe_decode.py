"""The specialized few-token MoE dispatch: `moe_decode`.

Moved verbatim out of kernels/moe_mxfp4_decode_mma.py (the tensor-core variant's module)."""
from __future__ import annotations

import torch

from raydecode.kernels import moe_mxfp4_decode as _cuda_core
from raydecode.kernels.moe_mxfp4 import MXFP4Experts

# (E, I, L, T) calls served by the resident CuTe kernel (kernels/moe_resident_cute.py) where it
# fits; `USE_RESIDENT` True / False forces it on / off for A/B timing, None = this set decides.
# K3 TP16 batch 1 (PERF round 19, H200, same-lease layer A/B, medians over 3 leases): KDA
# layer 68.4 → 64.0 µs, MLA 77.5 → 73.2. kernels/aot.py plans the same kernel for these shapes.
RESIDENT: set[tuple[int, int, int, int]] = {(896, 192, 3584, 1)}
USE_RESIDENT: bool | None = None
# the plan's `predecode` (down rows per lane decoded before the wait; None: the plan default):
# 3 keeps the kernel at 64 registers, room on each SM for the next kernel's PDL prologue
RESIDENT_PREDECODE: int | None = 3
_RESIDENT_PLANS: dict[tuple, object] = {}


def _resident_plan(z: torch.Tensor, topk_ids: torch.Tensor, experts: MXFP4Experts):
    """The resident kernel's plan for this call, or None (no CuTe, or it does not fit);
    memoized per (shape, dtype, device, betas)."""
    from raydecode.kernels import moe_resident_cute as resident
    from raydecode.kernels._cute import cute_available
    key = (tuple(z.shape), topk_ids.shape[1], z.dtype, z.device, experts.num_experts,
           experts.intermediate, experts.beta, experts.linear_beta, RESIDENT_PREDECODE)
    if key not in _RESIDENT_PLANS:
        kw = {} if RESIDENT_PREDECODE is None else {"predecode": RESIDENT_PREDECODE}
        _RESIDENT_PLANS[key] = (resident.plan_for(z, topk_ids, experts, **kw)
                                if z.is_cuda and cute_available() else None)
    return _RESIDENT_PLANS[key]


def moe_decode(z: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               experts: MXFP4Experts, out: torch.Tensor | None = None) -> torch.Tensor:
    """The specialized few-token MoE (T·k ≤ MAX_PAIRS): the resident CuTe kernel where chosen
    (RESIDENT / USE_RESIDENT) and it fits, the tensor-core kernel where chosen (TUNED /
    USE_MMA), else `moe_mxfp4_decode`. Same contract as all three."""
    key = (experts.num_experts, experts.intermediate, experts.latent)
    if USE_RESIDENT or (USE_RESIDENT is None and key + (z.shape[0],) in RESIDENT):
        plan = _resident_plan(z, topk_ids, experts)
        if plan is not None:
            from raydecode.kernels.moe_resident_cute import resident_moe_into
            if out is None:
                out = torch.empty(z.shape[0], experts.latent, dtype=torch.float32,
                                  device=z.device)
            return resident_moe_into(plan, z, topk_weights, topk_ids, experts, out)
    from raydecode.kernels import moe_mxfp4_decode_mma as _mma
    cfg = _mma.TUNED.get(key)
    if _mma.USE_MMA or (_mma.USE_MMA is None and cfg is not None):
        return _mma.moe_mxfp4_decode_mma(z, topk_weights, topk_ids, experts, cfg, out)
    return _cuda_core.moe_mxfp4_decode(z, topk_weights, topk_ids, experts, out=out)


__all__ = ["RESIDENT", "USE_RESIDENT", "RESIDENT_PREDECODE", "moe_decode"]
