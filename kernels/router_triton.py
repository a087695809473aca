"""Triton kernel of the fused MoE router: sigmoid + correction bias + top-k of E + renormalize
(kernels/router.py has the math and the reference).

One program per token, the E scores in registers (BLOCK_E = next pow2 ≥ E):

    s   = sigmoid(logits)                     sel = s + bias (−inf past E)
    key = ord(sel) << 32 | (BLOCK_E − 1 − e)  int64; ord() maps fp32 to int32 monotonically
    k rounds: one max-reduction of key gives the best expert (lowest index among equal
              scores), its key set to int64 min
    w   = s[ids] / Σ s[ids] · scaling          s[ids] gathered from the scores in registers
                                               (`tl.gather`; GATHER=False: one load of the k
                                               logits after the selection, a dependent L2
                                               round trip); (T, k) fp32, ids (T, k) int64
The bias (a weight) is loaded before the PDL wait.
One block reduction per selected expert (k = 16 of E = 896 for K3, 4 warps: one warp for the
whole row measured 16.6 µs, its 32-deep per-lane compare chains cost more than the barriers).
`SORT` (the default): Triton's bitonic `tl.topk` over the same int64 keys instead of k
arg-max rounds (same ids, same tie order): 4.53 vs 5.16 µs at batch 1 and 4.57 vs 5.23 at
batch 4 (H200, CUDA graph of 16 calls, scripts/explore/probe_kernels.py).
"""
from __future__ import annotations

import torch

from raydecode.kernels._triton import (LAUNCH_WARPS, available, pdl_enter, pdl_launch, tl,
                                       triton)

SORT_DEFAULT = True       # bitonic top-k: 4.53 vs 5.16 µs (k arg-max rounds) at batch 1, H200
GATHER_DEFAULT = True     # the weights gathered from registers, not re-loaded

if triton is not None:

    @triton.jit
    def _route_topk_kernel(logits_ptr, l_st, bias_ptr, w_ptr, ids_ptr, E, scaling,
                           K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr,
                           HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, SORT: tl.constexpr,
                           GATHER: tl.constexpr, PDL: tl.constexpr):
        offs = tl.arange(0, BLOCK_E)
        m = offs < E
        if HAS_BIAS:    # a weight: requested before the PDL wait
            bias = tl.load(bias_ptr + offs, mask=m, other=0.0).to(tl.float32)
        pdl_enter(PDL)
        t = tl.program_id(0).to(tl.int64)
        x = tl.load(logits_ptr + t * l_st + offs, mask=m, other=0.0).to(tl.float32)
        s = tl.sigmoid(x)
        sel = s
        if HAS_BIAS:
            sel = s + bias
        bits = sel.to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)       # monotone in sel
        key = (ordered.to(tl.int64) << 32) | (BLOCK_E - 1 - offs).to(tl.int64)
        lowest = -9223372036854775807                               # below every valid key
        key = tl.where(m, key, lowest)
        kk = tl.arange(0, KP)
        if SORT:    # bitonic top-KP of the keys, descending: no per-expert block reduction
            ids = (BLOCK_E - 1) - (tl.topk(key, KP) & 0xFFFFFFFF)
        else:       # K rounds of one block-wide max each
            ids = tl.zeros((KP,), tl.int64)
            for j in tl.static_range(K):
                best = tl.max(key, 0)
                e = (BLOCK_E - 1) - (best & 0xFFFFFFFF)
                ids = tl.where(kk == j, e, ids)
                key = tl.where(offs == e, lowest, key)
        kok = kk < K
        if GATHER:  # the K weights from the scores already in registers
            w = tl.where(kok, tl.gather(s, ids.to(tl.int32), 0), 0.0)
        else:       # a second load of the K logits: one more dependent L2 round trip
            xe = tl.load(logits_ptr + t * l_st + ids, mask=kok, other=0.0).to(tl.float32)
            w = tl.where(kok, tl.sigmoid(xe), 0.0)
        if RENORM:
            w = w / tl.sum(w, 0)                                    # padding entries are 0
        tl.store(w_ptr + t * K + kk, w * scaling, mask=kok)
        tl.store(ids_ptr + t * K + kk, ids, mask=kok)


def route_topk_triton(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                      renormalize: bool = True, scaling: float = 1.0,
                      weights: torch.Tensor | None = None, ids: torch.Tensor | None = None,
                      sort: bool | None = None, gather: bool | None = None,
                      num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (T, E) (last dim contiguous), bias (E,) or None -> (weights (T, k) fp32,
    ids (T, k) int64), into `weights` / `ids` when given (contiguous). No host sync.
    sort: the bitonic `tl.topk` selection instead of k max rounds (None: `SORT_DEFAULT`);
    both give the same ids (ties to the lower expert index). gather: the k weights from the
    scores in registers (`tl.gather`) instead of a second load of the logits (None:
    `GATHER_DEFAULT`); both give the same weights within 1e-6 relative (not bit-equal: the
    sigmoid is compiled in different code, H200). num_warps: each token's program's warps
    (None: E / 256, at most 8 — one block-wide reduction per round over 4 warps at K3's 896
    experts; fewer warps reduce in shuffles alone, which a prefill step's thousands of
    programs may prefer: scripts/explore/probe_kernels.py --router-only times them); the
    same ids and weights at any count."""
    T, E = logits.shape
    if num_warps is not None and num_warps not in LAUNCH_WARPS:
        raise ValueError(f"route_topk_triton num_warps {num_warps}: expected 1, 2, 4, 8 or 16")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if weights is None:
        weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    if ids is None:
        ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    block_e = triton.next_power_of_2(E)
    _route_topk_kernel[(T,)](
        logits, logits.stride(0), bias if bias is not None else logits, weights, ids, E,
        float(scaling), K=top_k, KP=triton.next_power_of_2(top_k), BLOCK_E=block_e,
        HAS_BIAS=bias is not None, RENORM=bool(renormalize),
        SORT=SORT_DEFAULT if sort is None else bool(sort),
        GATHER=GATHER_DEFAULT if gather is None else bool(gather),
        num_warps=num_warps or max(1, min(8, block_e // 256)), **pdl_launch(logits))
    return weights, ids


__all__ = ["available", "route_topk_triton"]
