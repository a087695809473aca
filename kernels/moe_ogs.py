"""The routed experts of a prefill step on `triton_kernels.matmul_ogs`, Triton's own grouped
MoE GEMM library (the `ogs` extra pins it; Hopper and newer): the same MXFP4 weights, the
same gate ‖ up → SiTU → down → Σ_k as kernels/moe_mxfp4.py, as a same-run alternative to
this project's prefill kernels (`PREFILL_EXPERTS` "ogs" / "ogs-hopper").

    gu  = matmul_ogs(z, W13, gather)                 bf16 (P, 2I), rows in expert order
    a   = SiTU(gu[:, :I], gu[:, I:])                 bf16 (P, I): `situ_rows` (ours)
    y   = matmul_ogs(a, W2)                          bf16 (P, L), rows in expert order
    out = Σ_k w · y[inverse[t·k + j]]                fp32: `weighted_sum` (ours)

The library's own top-k sum (its down GEMM scattering with the weights as gammas, then its
`_reduce` kernel) took 1.90 ms of an 8,192-token call on the H100 where `weighted_sum` takes
0.36 (bench/results/moe-prefill-sweep-h100-2026-12-07-ogs.json), so the sum is ours, which
also keeps the reference's rounding points: gu and each pair's y bf16, the weighted sum fp32.

Weights. matmul_ogs takes w logically (E, K, N), MXFP4 values packed two per byte along K
(low nibble the even k) with one e8m0 scale per 32 k: this project's (E, N, K/2) / (E, N,
K/32) buffers seen through `.mT` are exactly that, so the "strided" form wraps them without
a copy (on sm_90 its kernel emulates `tl.dot_scaled`: upcast, then a bf16 MMA). "hopper"
converts them once per layer into the library's Hopper layouts (values swizzled for its
bit-trick fp4 → bf16 upcast, scales for its warps): a second copy of the layer's expert
weights (+2-7 % padding) that this module caches per layer's weights; the decode kernels
keep the original. That doubles the routed experts' memory (≈ 99 GB per K3 TP16 rank), so it
is the operator's choice (RAYDECODE_PREFILL_EXPERTS=ogs-hopper, converted at load by
engine/loader.py `prepare_prefill_experts`; the planner's `--prefill-experts`), not the
default.

Token counts and compiles: the library picks its block_m from the pairs per expert (16-128),
so a new count can compile a new kernel; `EXPECTED_TOKENS_PER_EXPERT` pins it (one config for
every prefill call). Not under CUDA-graph capture (the stock graphs keep the Triton kernels:
`ogs_ready`)."""
from __future__ import annotations

import torch

from .moe_mxfp4 import MXFP4Experts, check_out, situ_rows, weighted_sum

try:                                 # the ogs extra; absent on the CPU test path
    from triton_kernels.matmul_ogs import GatherIndx, PrecisionConfig, RoutingData, matmul_ogs
    from triton_kernels.tensor import (FP4, convert_layout, make_ragged_tensor_metadata,
                                       wrap_torch_tensor)
    from triton_kernels.tensor_details.layout import HopperMXScaleLayout, HopperMXValueLayout
    _IMPORT_ERROR: Exception | None = None
except Exception as e:               # ImportError, or a Triton it does not match
    _IMPORT_ERROR = e

OGS_LAYOUTS = ("strided", "hopper")
# pairs per expert the library's tile choice assumes (block_m 128 from 128 on): one compiled
# config for every prefill call of a budget-sized step; 0: the library's per-call choice
EXPECTED_TOKENS_PER_EXPERT = 128
HOPPER_SCALE_WARPS = 8


def ogs_unavailable(device: torch.device | None = None) -> str | None:
    """Why matmul_ogs cannot run the experts here (None: it can)."""
    if _IMPORT_ERROR is not None:
        return f"triton_kernels not importable ({type(_IMPORT_ERROR).__name__}: {_IMPORT_ERROR})"
    if not torch.cuda.is_available():
        return "no CUDA device"
    dev = device if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        return f"the tensors are on {dev}, not a CUDA device"
    if torch.cuda.get_device_capability(dev)[0] < 9:
        return "below sm90 (matmul_ogs takes MXFP4 weights with bf16 activations from Hopper on)"
    return None


def ogs_ready(device: torch.device) -> bool:
    """matmul_ogs can run this call: available, and not inside a CUDA-graph capture."""
    return (device.type == "cuda" and ogs_unavailable(device) is None
            and not torch.cuda.is_current_stream_capturing())


# (w13 data_ptr, w2 data_ptr, shapes) -> (w13, w2, {layout: (w13, pc13, w2, pc2)}): keyed by
# the weights' memory, since each call's MXFP4Experts holds new views of the same parameters
# (models/moe.py `RoutedExperts.packed`); the entry holds the tensors, so that memory cannot
# be freed and reused by other weights while it is cached
_WEIGHTS: dict[tuple, tuple[torch.Tensor, torch.Tensor, dict]] = {}


def _wrap(values: torch.Tensor, scales: torch.Tensor, layout: str):
    """(E, N, K/2) values + (E, N, K/32) scales -> (w, PrecisionConfig) in `layout`."""
    w = wrap_torch_tensor(values.mT, dtype=FP4)          # (E, K, N), no copy
    s = wrap_torch_tensor(scales.mT)
    if layout == "hopper":
        w = convert_layout(w, HopperMXValueLayout, mx_axis=1)
        s = convert_layout(s, HopperMXScaleLayout, mx_axis=1, num_warps=HOPPER_SCALE_WARPS)
    return w, PrecisionConfig(weight_scale=s, out_dtype=torch.bfloat16)


def ogs_weights(experts: MXFP4Experts, layout: str):
    """The layer's experts in matmul_ogs's form (cached per weights and layout)."""
    if layout not in OGS_LAYOUTS:
        raise ValueError(f"matmul_ogs layout {layout!r}: expected one of {list(OGS_LAYOUTS)}")
    w13, w2 = experts.w13, experts.w2
    key = (w13.data_ptr(), w2.data_ptr(), tuple(w13.shape), tuple(w2.shape), w13.stride(),
           w2.stride())
    hit = _WEIGHTS.get(key)
    if hit is None:
        hit = _WEIGHTS[key] = (w13, w2, {})
    forms = hit[2]
    if layout not in forms:
        forms[layout] = (*_wrap(experts.w13, experts.s13, layout),
                         *_wrap(experts.w2, experts.s2, layout))
    return forms[layout]


def forget_weights() -> None:
    """Drop every cached matmul_ogs form (the converted copies' memory)."""
    _WEIGHTS.clear()


def ogs_indices(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int):
    """matmul_ogs's routing indices from this project's top-k (library ops only, no host
    sync): pairs (t, j) flattened as t·k + j and sorted stably by expert (token order inside
    an expert) -> order (sorted position -> pair), inverse (pair -> sorted position), hist
    (int32 pairs per expert), gammas (the weights in sorted order). matmul_ogs gathers row
    order[s] // k of x for sorted row s; `weighted_sum` reads pair (t, j)'s row of the
    sorted output at inverse[t·k + j]."""
    flat = topk_ids.reshape(-1).to(torch.int32)
    order = torch.argsort(flat, stable=True).to(torch.int32)
    inverse = torch.argsort(order, stable=True).to(torch.int32)
    hist = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    hist.scatter_add_(0, flat.long(), torch.ones_like(flat))
    gammas = topk_weights.reshape(-1).float()[order.long()]
    return order, inverse, hist, gammas


def ogs_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int):
    """(RoutingData, GatherIndx) for matmul_ogs (`ogs_indices`, then the library's ragged
    metadata kernel); the gather's dst_indx is the inverse permutation."""
    T, k = topk_ids.shape
    order, inverse, hist, gammas = ogs_indices(topk_ids, topk_weights, num_experts)
    rd = RoutingData(gammas, hist, num_experts, k, make_ragged_tensor_metadata(hist, T * k),
                     expected_tokens_per_expt=EXPECTED_TOKENS_PER_EXPERT or None)
    return rd, GatherIndx(order, inverse)


def moe_mxfp4_ogs(z: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  experts: MXFP4Experts, layout: str = "strided",
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_k w·expert(z) -> (T, L) fp32 (into `out` when given: `check_out`) on matmul_ogs."""
    why = ogs_unavailable(z.device)
    if why is not None:
        raise RuntimeError(f"matmul_ogs experts: {why}")
    T, L = z.shape
    check_out(out, T, L, z.device)
    w13, pc13, w2, pc2 = ogs_weights(experts, layout)
    rd, gather = ogs_routing(topk_ids, topk_weights, experts.num_experts)
    inverse = gather.dst_indx
    gu = matmul_ogs(z.to(torch.bfloat16).contiguous(), w13, None, rd, gather_indx=gather,
                    precision_config=pc13).view(-1, 2 * experts.intermediate)  # sorted
    a = situ_rows(gu, torch.empty(gu.shape[0], experts.intermediate, dtype=torch.bfloat16,
                                  device=z.device), experts)
    y = matmul_ogs(a, w2, None, rd, precision_config=pc2).view(-1, L)   # (P, L) sorted
    return weighted_sum(y, topk_weights, out, row=inverse)


__all__ = ["EXPECTED_TOKENS_PER_EXPERT", "OGS_LAYOUTS", "forget_weights", "moe_mxfp4_ogs",
           "ogs_indices", "ogs_ready", "ogs_routing", "ogs_unavailable", "ogs_weights"]
