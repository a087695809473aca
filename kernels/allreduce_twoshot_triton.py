"""Triton kernel: two-shot all-reduce over peer buffers + residual add + RMSNorm (issue 32).
The op, its reference and the buffers are in kernels/allreduce_oneshot.py (`PeerBuffers`); the
one-shot form, its memory-ordering argument and its latency model in
kernels/allreduce_oneshot_triton.py, which this kernel shares its epochs and partial slots with.

Rank r of N owns the column slice C_r = [r·HS, (r+1)·HS) of the hidden size H (HS = H / N).
Memory of rank r, mapped into every peer by CUDA IPC (`PeerBuffers`):

    buf_r    (2, MT, H) bf16   the one-shot's partial slots: slot s = epoch & 1
    flags_r  (N, MT)   int64   phase-1 flags, the one-shot's: flags_r[q, t] = last epoch whose
                               partial row t rank q has published
    gat_r    (2, MT, H) bf16   slot s: the reduced row t, slice C_q written by rank q
    ext_r    int64             [flags2 (N, MT): last epoch whose reduced slice of row t rank q
                               has pushed | aux (2, MT, NP): slot s, row t, lane q = the fp32
                               bits of Σ_{c ∈ C_q} new_res[t, c]² pushed by rank q]
    state_r  (4,)      int64   shared with the one-shot: [epoch, arrivals, timed-out epoch, −]

Program t of rank r, call with epoch e = state_r[0] + 1, s = e & 1:

    (a) COPY: buf_r[s, t] ← partial[t]  (or the producer wrote it there)
    (b) barrier 1, the one-shot's: push flags_q[r, t] ← e, poll flags_r[:, t] ≥ e
    (c) reduce-scatter of the own slice: acc = Σ_{q=0..N−1} buf_q[s, t, C_r] in fp32, rank
        order (P2P loads: (N−1)·HS inbound, not (N−1)·H); + residual[t, C_r];
        nr = bf16(acc); ss = Σ fp32(nr)² over C_r; for every q (self included):
        gat_q[s, t, C_r] ← nr, aux_q[s, t, r] ← bits(ss)          (P2P stores: pushed)
    (d) barrier 2: bar.sync, push flags2_q[r, t] ← e (release, sys) ∀q, poll flags2_r[:, t] ≥ e
        (acquire, sys), bar.sync
    (e) all-gather is done: new_res[t] = gat_r[s, t] (local loads); NORM:
        inv = rsqrt(Σ_{q=0..N−1} aux_r[s, t, q] / H + eps) in rank order; out = bf16(x·inv·w)

Every element of new_res is the one-shot's (the same rank-order fp32 sum of the same values,
one rounding), so the two forms are interchangeable bit for bit in new_res; the norm's sum of
squares is summed per slice then over slices in rank order (identical on every rank; it may
differ from the one-shot's whole-row sum in the last fp32 bits, so out within 1 bf16 ulp).

Memory ordering: (c)'s P2P stores precede the CTA barrier that precedes the release RMW on
flags2_q[r, t], so by release cumulativity a thread of q that acquires e there, and every
thread of q's program after the following bar.sync, sees them (the one-shot's argument for its
partials). Slot reuse: peers write gat_r[s] at call e only after barrier 1 of call e, i.e. after
rank r published e, which it does after its call e−1 completed; r last read gat_r[s] in call
e−2 (any call with the same parity), which completed before that. buf_r[s] as the one-shot.
Epochs only grow (int64), so neither flag array is ever reset; a one-shot call between two
two-shot calls uses the same epochs and leaves flags2 alone, which stays correct because every
wait compares against the current epoch.

Bounded waits: both polls give up after `max_spins`, record e in state_r[2] and finish with
wrong data; `PeerBuffers.check_timeouts()` (a host sync) names the rank and epoch.

Traffic per row and rank: (N−1)/N · H loaded (c) and (N−1)/N · H stored to peers (c), against
(N−1) · H loaded by the one-shot: the two-shot moves 2/N of the one-shot's bytes for one more
barrier (~1–2 µs), so it wins where the one-shot is bandwidth-bound (kernels/
allreduce_oneshot_triton.py: T ≳ 16–32 at TP8, H = 7168). `TWO_SHOT_MIN_TOKENS` is that model's
crossover until a multi-GPU run measures it (scripts/bench/allreduce.py `--forms`).
No multicast object, NVLS or multimem instruction: plain P2P loads, stores and atomics on
memory opened with legacy CUDA IPC.
"""
from __future__ import annotations

import torch

from raydecode.kernels._triton import available, pdl_enter, pdl_launch, tl, triton
from raydecode.kernels.allreduce_oneshot_triton import DEFAULT_MAX_SPINS

TWO_SHOT_MIN_TOKENS = 32     # rows from which `PeerBuffers` picks this form (the model's)

if triton is not None:
    from raydecode.kernels.allreduce_oneshot_triton import _barrier, _copy_and_arrive

    @triton.jit
    def _twoshot_kernel(buf_addrs, flag_addrs, gat_addrs, ext_addrs, state_ptr, src_ptr,
                        src_st, res_ptr, res_st, w_ptr, newres_ptr, newres_st, out_ptr, out_st,
                        H, HS, MT, rank, eps, max_spins, N: tl.constexpr, NP: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, COPY: tl.constexpr,
                        HAS_RES: tl.constexpr, NORM: tl.constexpr, ALIGNED: tl.constexpr,
                        PDL: tl.constexpr):
        pdl_enter(PDL)
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_H)
        m = offs < H
        ep = tl.load(state_ptr) + 1                            # this call's epoch (int64)
        s = ep & 1
        row = (s * MT + t) * H                                 # row t of slot s
        if ALIGNED:                 # HS % 8 == 0 and 16-byte-aligned bases
            row = tl.multiple_of(row, 8)
        _copy_and_arrive(buf_addrs, rank, row, offs, m, src_ptr, t, src_st, state_ptr, ep,
                         COPY, ALIGNED)
        # (b) barrier 1: every rank's partial row t is published
        _barrier(flag_addrs, 0, rank, t, MT, ep, max_spins, state_ptr, N, NP)
        tl.debug_barrier()
        # (c) this rank's slice, summed in rank order, pushed to every rank
        so = tl.arange(0, BLOCK_S)
        sm = so < HS
        cols = rank * HS + so
        acc = tl.zeros((BLOCK_S,), tl.float32)
        for q in tl.static_range(N):
            peer = tl.load(buf_addrs + q).to(tl.pointer_type(tl.bfloat16))
            acc += tl.load(peer + row + cols, mask=sm, other=0.0).to(tl.float32)
        if HAS_RES:
            acc += tl.load(res_ptr + t * res_st + cols, mask=sm, other=0.0).to(tl.float32)
        nr = acc.to(tl.bfloat16)
        x = tl.where(sm, nr.to(tl.float32), 0.0)
        ss = tl.sum(x * x, 0).to(tl.int32, bitcast=True).to(tl.int64)
        aux = N * MT + (s * MT + t) * NP + rank               # ext: [flags2 | aux]
        for q in tl.static_range(N):
            gq = tl.load(gat_addrs + q).to(tl.pointer_type(tl.bfloat16))
            tl.store(gq + row + cols, nr, mask=sm)
            eq = tl.load(ext_addrs + q).to(tl.pointer_type(tl.int64))
            tl.store(eq + aux, ss)
        tl.debug_barrier()          # every thread's pushes before the release of barrier 2
        # (d) barrier 2: every rank's slice of row t is in this rank's gather row
        _barrier(ext_addrs, 0, rank, t, MT, ep, max_spins, state_ptr, N, NP)
        tl.debug_barrier()
        # (e) the whole reduced row, local
        mine = tl.load(gat_addrs + rank).to(tl.pointer_type(tl.bfloat16))
        full = tl.load(mine + row + offs, mask=m, other=0.0, cache_modifier=".cg")
        tl.store(newres_ptr + t * newres_st + offs, full.to(newres_ptr.dtype.element_ty),
                 mask=m)
        if NORM:
            ext = tl.load(ext_addrs + rank).to(tl.pointer_type(tl.int64))
            tot = 0.0
            for q in tl.static_range(N):
                bits = tl.load(ext + N * MT + (s * MT + t) * NP + q, cache_modifier=".cg")
                tot += bits.to(tl.int32).to(tl.float32, bitcast=True)
            inv = tl.rsqrt(tot / H + eps)
            w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
            tl.store(out_ptr + t * out_st + offs,
                     (full.to(tl.float32) * inv * w).to(out_ptr.dtype.element_ty), mask=m)


def ext_words(world: int, max_tokens: int) -> int:
    """int64 words of a rank's ext buffer: flags2 (N, MT) + aux (2, MT, NP)."""
    return world * max_tokens + 2 * max_tokens * max(2, _next_pow2(world))


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def twoshot_triton(buf_addrs: torch.Tensor, flag_addrs: torch.Tensor, gat_addrs: torch.Tensor,
                   ext_addrs: torch.Tensor, state: torch.Tensor, rank: int, max_tokens: int,
                   partial: torch.Tensor | None, residual: torch.Tensor | None,
                   w: torch.Tensor | None, eps: float, new_residual: torch.Tensor,
                   out: torch.Tensor | None, max_spins: int = DEFAULT_MAX_SPINS) -> None:
    """Launch one two-shot call (module docstring) for this rank; arguments as
    allreduce_oneshot_triton.oneshot_triton plus gat_addrs / ext_addrs, every rank's gather
    buffer and ext words. H must be a multiple of N. No host sync; capturable."""
    assert residual is not None or w is None, "the RMSNorm applies to residual + Σ partials"
    T, H = new_residual.shape
    n = buf_addrs.numel()
    assert H % n == 0, f"hidden {H} is not a multiple of the {n} ranks"
    hs = H // n
    block_h = triton.next_power_of_2(H)
    res = residual if residual is not None else new_residual     # unread when HAS_RES=False
    src = partial if partial is not None else res
    o = out if out is not None else new_residual
    _twoshot_kernel[(T,)](
        buf_addrs, flag_addrs, gat_addrs, ext_addrs, state, src, src.stride(0), res,
        res.stride(0), w if w is not None else res, new_residual, new_residual.stride(0), o,
        o.stride(0), H, hs, max_tokens, rank, float(eps), max_spins, N=n,
        NP=max(2, triton.next_power_of_2(n)), BLOCK_H=block_h,
        BLOCK_S=triton.next_power_of_2(hs), COPY=partial is not None,
        HAS_RES=residual is not None, NORM=w is not None, ALIGNED=hs % 8 == 0,
        num_warps=max(1, min(16, block_h // 512)), **pdl_launch(new_residual))


__all__ = ["TWO_SHOT_MIN_TOKENS", "available", "ext_words", "twoshot_triton"]
