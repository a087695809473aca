"""Triton kernel: one-shot all-reduce over peer buffers + residual add + RMSNorm (issue #6).
The op, its reference and the buffer setup are in kernels/allreduce_oneshot.py.

Memory of rank r (allocated once by `PeerBuffers`, mapped into every peer by CUDA IPC):

    buf_r    (2, MT, H) bf16   slot s = epoch & 1 holds rank r's partial of the call with that epoch
    flags_r  (N, MT)   int64   flags_r[q, t] = last epoch whose row t rank q has published
    state_r  (4,)      int64   [epoch of the last completed call, arrivals, epoch of the last
                               timed-out wait (0: none), unused]; local only

Grid: one program per token row t < T (T ≤ MT ≤ #SMs, so every program is resident at once).
Program t of rank r, call with epoch e = state_r[0] + 1 (read on device: a CUDA graph replays it):

    (a) COPY: buf_r[e&1, t] ← partial[t]   (COPY=False: the producer already wrote it there)
    (b) bar.sync; arrival counter: the last program of the grid sets state_r[0] = e;
        for every q: flags_q[r, t] ← e          atomic exchange, release, scope sys (pushed)
        spin until flags_r[q, t] ≥ e ∀q          atomic add 0, acquire, scope sys (local polls)
        bar.sync
    (c) acc = Σ_{q=0..N−1} buf_q[e&1, t] in fp32, in rank order (P2P loads over NVLink)
        new_res[t] = bf16(acc + residual[t]);  out[t] = bf16(RMSNorm(fp32(new_res[t])) · w)
        (HAS_RES=False, the plain all-reduce: new_res[t] = bf16(acc), no norm)

Memory ordering. The stores of (a) (or of the producing kernel, ordered before this one by the
stream / PDL's griddepcontrol.wait) precede a CTA barrier that precedes the release RMW on
flags_q[r, t] in program order, so by PTX release cumulativity they are visible at system scope
to any thread whose acquire RMW reads that value. Rank q's polling thread acquires it, the
following bar.sync orders every thread of q's program after that acquire (causality order is
transitive), so their loads of buf_r[e&1, t] return the epoch-e data. A row needs only the same
row of every peer, so a per-(rank, row) flag is the whole barrier: no second barrier, no
cross-program wait inside a rank. Flags only grow (epochs are int64: no wrap-around), so they are
never reset and a stale flag (< e) can never pass the test.

Why two slots. Rank r writes slot e&1 at call e. The previous user of that slot was call e−2.
Rank r's call e starts after its call e−1 completed; every program of that call saw every peer
publish epoch e−1, and a peer publishes e−1 only after its call e−2 kernel completed (stream
order), i.e. after it finished reading buf_r[(e−2)&1]. So no peer still reads the slot being
overwritten. One slot would need a second, "done reading", barrier per call. The parity is taken
from the device epoch, not from a host counter, so it stays right across graph replays of any
length; a producer writing straight into the buffer (COPY=False) reads the same state_r[0].

No multicast. Every access is a plain P2P load or a P2P atomic on memory opened with legacy
CUDA IPC (cudaIpcOpenMemHandle); no multicast object (cuMulticastCreate), NVLS or multimem
instruction exists anywhere on this path.

Hang bound. A wait gives up after `max_spins` polls, records e in state_r[2] and lets the call
finish with wrong data; `PeerBuffers.check_timeouts()` (a host sync) turns that into an error
naming the rank and epoch (DESIGN §6: no collective without a timeout).

Latency prediction (TP8, H = 7168, bf16, H200 NVLink ~450 GB/s per direction, in a CUDA graph;
to be checked by scripts/bench/allreduce.py): barrier ≈ one NVLink write of the flag + a local
poll (~1 µs). T=1: ONE program pulls 7 remote rows = 100 KB; with all 16 loads per thread in
flight that is latency (~1 µs) + per-SM transfer (~1–2 µs at 50–100 GB/s per SM) → ≈ 3–4 µs of
kernel, ≈ 4–5 µs with the graph's launch slot, against ≈ 8–15 µs for NCCL's ring all-reduce
(2(N−1) latency-bound steps) plus the separate add and RMSNorm kernels (~2 µs each).
T=8: 0.8 MB inbound over 8 SMs, still latency-bound → ≈ 5 µs.
T=64: 64 × 100 KB = 6.4 MB inbound per GPU / 450 GB/s ≈ 14 µs + ~2 µs → ≈ 16–18 µs, no better
than a ring (which moves 2(N−1)/N · 0.92 MB = 1.6 MB per GPU): the one-shot's (N−1)-fold inbound
traffic makes a two-stage (reduce-scatter + all-gather) kernel the right one above T ≈ 16–32
(DESIGN §4.3). At TP16 on NVLink 5 (~900 GB/s) the inbound bytes double and the bandwidth
doubles: the same T=64 estimate, a slightly longer barrier.
"""
from __future__ import annotations

import torch

from raydecode.kernels._triton import available, pdl_enter, pdl_launch, tl, triton

# polls before a wait gives up. 2**27 (8× the first bound): a peer that is still JIT-compiling a
# kernel of its first step (seconds per kernel, and ranks can skew by several) must not read as a
# dead peer; a truly dead one is reported at the next step sync either way
DEFAULT_MAX_SPINS = 1 << 27

if triton is not None:

    @triton.jit
    def _published(flag_row, pp, pm, ep):
        """Number of lanes whose flag has reached ep (masked lanes count as published)."""
        seen = tl.atomic_add(flag_row, tl.zeros_like(pp).to(tl.int64), mask=pm,
                             sem="acquire", scope="sys")
        return tl.sum(((seen >= ep) | ~pm).to(tl.int32), 0)

    @triton.jit
    def _barrier(flag_addrs, off, rank, t, MT, ep, max_spins, state_ptr, N: tl.constexpr,
                 NP: tl.constexpr):
        """Push flags_q[off + rank·MT + t] ← ep to every q (release, sys), then poll the local
        flags[off + q·MT + t] until all reach ep (acquire, sys), at most max_spins polls; a
        timeout records ep in state[2]."""
        pp = tl.arange(0, NP)
        pm = pp < N
        peer = tl.load(flag_addrs + pp, mask=pm, other=0).to(tl.pointer_type(tl.int64))
        tl.atomic_xchg(peer + off + rank * MT + t, tl.zeros_like(pp).to(tl.int64) + ep,
                       mask=pm, sem="release", scope="sys")
        mine = tl.load(flag_addrs + rank).to(tl.pointer_type(tl.int64)) + off + pp * MT + t
        ready = _published(mine, pp, pm, ep)
        spins = max_spins * 0
        while (ready < NP) & (spins < max_spins):
            ready = _published(mine, pp, pm, ep)
            spins += 1
        tl.atomic_max(state_ptr + 2, ep, mask=ready < NP, sem="relaxed", scope="gpu")

    @triton.jit
    def _copy_and_arrive(buf_addrs, rank, row, offs, m, src_ptr, t, src_st, state_ptr, ep,
                         COPY: tl.constexpr, ALIGNED: tl.constexpr):
        """(a) of a call: COPY puts partial row t into this rank's slot row `row`; then a CTA
        barrier (every store and state load before any release) and the arrival count: the
        last program of the grid publishes ep as the epoch of the last call (every program has
        read the old one)."""
        if COPY:
            own = tl.load(buf_addrs + rank).to(tl.pointer_type(tl.bfloat16))
            if ALIGNED:
                own = tl.multiple_of(own, 16)
            tl.store(own + row + offs, tl.load(src_ptr + t * src_st + offs, mask=m), mask=m)
        tl.debug_barrier()
        arrived = tl.atomic_add(state_ptr + 1, 1, sem="acq_rel", scope="gpu")
        last = arrived == tl.num_programs(0) - 1
        tl.atomic_xchg(state_ptr + 1, 0, mask=last, sem="relaxed", scope="gpu")
        tl.atomic_xchg(state_ptr, ep, mask=last, sem="relaxed", scope="gpu")

    @triton.jit
    def _oneshot_kernel(buf_addrs, flag_addrs, state_ptr, src_ptr, src_st, res_ptr, res_st,
                        w_ptr, newres_ptr, newres_st, out_ptr, out_st, H, MT, rank, eps,
                        max_spins, N: tl.constexpr, NP: tl.constexpr, BLOCK_H: tl.constexpr,
                        COPY: tl.constexpr, HAS_RES: tl.constexpr, NORM: tl.constexpr,
                        ALIGNED: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_H)
        m = offs < H
        ep = tl.load(state_ptr) + 1                            # this call's epoch (int64)
        row = ((ep & 1) * MT + t) * H                          # row t of slot ep & 1
        if ALIGNED:                 # H % 8 == 0 and 16-byte-aligned bases: 16-byte accesses
            row = tl.multiple_of(row, 8)
        _copy_and_arrive(buf_addrs, rank, row, offs, m, src_ptr, t, src_st, state_ptr, ep,
                         COPY, ALIGNED)
        # (b) push flags_q[rank, t] = ep to every q, then poll the local flags_rank[:, t]
        _barrier(flag_addrs, 0, rank, t, MT, ep, max_spins, state_ptr, N, NP)
        tl.debug_barrier()          # every thread's peer loads after the acquiring thread
        # (c) fp32 sum in rank order, identical on every rank
        acc = tl.zeros((BLOCK_H,), tl.float32)
        for q in tl.static_range(N):
            peer = tl.load(buf_addrs + q).to(tl.pointer_type(tl.bfloat16))
            if ALIGNED:
                peer = tl.multiple_of(peer, 16)
            acc += tl.load(peer + row + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_RES:
            acc += tl.load(res_ptr + t * res_st + offs, mask=m, other=0.0).to(tl.float32)
        nr = acc.to(newres_ptr.dtype.element_ty)
        tl.store(newres_ptr + t * newres_st + offs, nr, mask=m)
        if NORM:
            x = nr.to(tl.float32)
            inv = tl.rsqrt(tl.sum(x * x, 0) / H + eps)
            w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
            tl.store(out_ptr + t * out_st + offs, (x * inv * w).to(out_ptr.dtype.element_ty),
                     mask=m)


def oneshot_triton(buf_addrs: torch.Tensor, flag_addrs: torch.Tensor, state: torch.Tensor,
                   rank: int, max_tokens: int, partial: torch.Tensor | None,
                   residual: torch.Tensor | None, w: torch.Tensor | None, eps: float,
                   new_residual: torch.Tensor, out: torch.Tensor | None,
                   max_spins: int = DEFAULT_MAX_SPINS) -> None:
    """Launch one call of the protocol (module docstring) for this rank. buf_addrs / flag_addrs:
    (N,) int64 base addresses of every rank's (2, MT, H) bf16 buffer and (N, MT) int64 flags,
    this rank's included; state: this rank's (4,) int64. partial None: the caller already wrote
    its (T, H) rows into slot (state[0] + 1) & 1 of its own buffer. residual None: the plain
    all-reduce, new_residual ← bf16(Σ_q partial_q) (w must be None). w None: no RMSNorm, only
    new_residual. Rows of partial/residual/new_residual/out must be contiguous (stride 1).
    No host sync; capturable in a CUDA graph (the epoch lives in `state`)."""
    assert residual is not None or w is None, "the RMSNorm applies to residual + Σ partials"
    T, H = new_residual.shape
    n = buf_addrs.numel()
    block_h = triton.next_power_of_2(H)
    res = residual if residual is not None else new_residual     # unread when HAS_RES=False
    src = partial if partial is not None else res
    o = out if out is not None else new_residual
    _oneshot_kernel[(T,)](
        buf_addrs, flag_addrs, state, src, src.stride(0), res, res.stride(0),
        w if w is not None else res, new_residual, new_residual.stride(0), o, o.stride(0),
        H, max_tokens, rank, float(eps), max_spins, N=n, NP=max(2, triton.next_power_of_2(n)),
        BLOCK_H=block_h, COPY=partial is not None, HAS_RES=residual is not None,
        NORM=w is not None, ALIGNED=H % 8 == 0, num_warps=max(1, min(16, block_h // 512)),
        **pdl_launch(new_residual))


__all__ = ["DEFAULT_MAX_SPINS", "available", "oneshot_triton"]
