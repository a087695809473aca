"""A chain of dependent decode GEMVs in one resident CuTe kernel whose weight stream runs ahead
of the chain through a shared-memory ring (issue #6's 80 %-of-roofline question, PERF round 18).

    x_{p+1} (N_p,) = bf16( W_p (N_p, K_p) · x_p (K_p,) ),  p = 0 … P−1,  fp32 sums, M = 1

Why: a dependency between two GEMVs costs ≈ 3.2 µs on H200 whether it is a PDL launch or a
grid barrier (round 17): the last CTAs' tail, then the first weight loads' latency after the
wait. The weights never depend on the chain, so here they do not wait for it:

  * grid = one CTA per SM (all resident: a grid barrier needs that); CTA b owns rows
    [b·N/G, (b+1)·N/G) of every phase, contiguous in the row-major W;
  * warp 0, lane 0 is the producer: it walks every phase's rows in stages of R = ⌊S / 2K⌋ rows
    (one `cp.async.bulk` of ≤ S bytes each, global → a slot of an NS-slot shared ring,
    completing a `full` mbarrier) and only ever waits for a free slot (`empty` mbarrier) or for
    an earlier copy to land (at most `inflight` in flight: round 18 measured every queued byte
    delaying the CTA's sync traffic), never for the chain: while the consumers wait for x, the
    ring fills with the next phases' rows;
  * warps 1 … C·GR consume, in GR groups of C warps: group g takes the stages s ≡ g (mod GR)
    of a phase (the groups' latency chains run side by side), warp c of a group a K slice of
    each row. After the grid barrier that publishes x_p, each lane holds its columns of x_p in
    registers (J = K / (8·32·C) 16-byte chunks, loaded `.cg`: x_p was written by other SMs),
    then per stage sums all R rows over its chunks (warp c takes chunks (c·J + j)·32 + lane;
    the rows unrolled so their loads and shuffles interleave), reduces across lanes and parks
    the partial in `red`; a slot is released once the group's C warps have read it; after the
    last stage the C partials of each row are summed and stored;
  * between phases (`publish`): the CTAs' y rows are x_{p+1} for everyone. "counter"
    (default): a grid barrier, consumer thread 0 does a release add and spins (acquire) until
    the count reaches p·G. Its release fence waits for the CTA's bulk copies in flight (3–5 µs
    with 12 in flight, PERF round 18), hence `inflight`. "tagged" needs no fence: each y is
    also stored as one 32-bit word bf16 | tag << 16 (tag from the launch epoch and the phase),
    thread 0 adds a relaxed arrival and polls the count (relaxed), then every lane reads its
    words and re-reads any whose tag is not yet this phase's. Spins are bounded by SPIN_MAX
    (then `flag` is set and the kernel goes on); the last CTA to finish resets the counters
    and advances the epoch, so replays need no memset.

Shared memory: NS · S bytes of ring + 2·NS mbarriers + the row partials. Bytes read per launch:
Σ 2·N_p·K_p (each weight once) + G · Σ 2·K_p (x_p, through L2; 4·K_p when tagged).
`chain_reference` is the PyTorch reference; `compile_chain` returns `launch(xs, ws, scratch, trace)` on the
current torch stream (graph-capturable). GPU only (sm_90+: bulk copies and mbarriers); the plan
logic runs anywhere. Exploration beside `scripts/explore/persistent_chain.py`, not on the served
path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from raydecode.kernels import _cute_ptx as P
from raydecode.kernels._cute import CompileCache, dummy_int64
from raydecode.kernels._cute_dsl import Float32, _dsl, _Stream, _Tensor, const_expr, cute, cutlass

WARP = 32
VEC = 8                    # bf16 per 16-byte chunk
SPIN_MAX = 1 << 22         # grid-barrier polls before the kernel gives up and sets the flag
SMEM_MAX = 227 * 1024      # sm_90 opt-in shared memory per CTA
SYNC_WORDS = 4             # int32 at the head of scratch: arrival counter, done counter,
                           # spin-bound flag, launch epoch
PROBES = ("none", "stream", "nobarrier")
PUBLISH = ("tagged", "counter")
TAG_MOD = 65535            # tags 1 … 65535: 0 (a zeroed scratch) is never a valid tag
TRACE_EVENTS = 8           # int64 per (CTA, phase): 0 start (counter: barrier passed),
                           # 1 x_p loaded (tagged: lane 0's tags seen), 2 stages summed,
                           # 3 y stored (+ arrived), 4 first stage issued, 5 last issued

if cutlass is not None:
    from cutlass.experimental.primitives.nvvm_wrapper import cp_async_bulk_shared_cluster_global


@dataclass(frozen=True)
class ChainPlan:
    """Static shape of one resident chain: phases ((N, K), …) with K_{p+1} = N_p, G CTAs,
    `groups` groups of C = `consumer_warps` consumer warps, an NS-slot ring of S-byte stages."""
    shapes: tuple[tuple[int, int], ...]
    ctas: int
    consumer_warps: int = 4
    stages: int = 12
    stage_bytes: int = 16384
    groups: int = 2
    inflight: int = 2          # bulk copies issued but not landed, at most (the ring may hold
                               # more landed stages): every byte queued at the SM delays its
                               # sync traffic, ≈ bytes in flight / the SM's HBM share
    publish: str = "counter"   # how x_p reaches the other CTAs (PERF round 18): "counter": a
                               # grid barrier (release add + acquire spin) before plain x_p, or
                               # "tagged": words bf16 | tag << 16 (relaxed stores), a relaxed
                               # arrival count says when to read them and each word's tag that
                               # it is this phase's (no fence; measured slower: twice the x
                               # bytes, read through hot L2 lines)
    probe: str = "none"        # bench diagnostics: "stream" (no math, no barriers: the ring's
                               # streaming rate), "nobarrier" (math without grid barriers);
                               # both leave garbage in x_1 … x_P
    trace: bool = False        # write %globaltimer stamps (TRACE_EVENTS per CTA and phase)
    op_ns: int = 0             # bench: a stand-in latency-bound op (a %globaltimer wait of
                               # op_ns) on the critical path after each phase's sums, before
                               # its y is stored: how much of it the ring's streaming hides

    def __post_init__(self):
        if not self.shapes:
            raise ValueError("ChainPlan: shapes is empty; give at least one (N, K) phase")
        if isinstance(self.op_ns, bool) or not isinstance(self.op_ns, int) or self.op_ns < 0:
            raise ValueError(f"ChainPlan: op_ns={self.op_ns!r}; need an int ≥ 0 (nanoseconds)")
        if self.ctas < 1:
            raise ValueError(f"ChainPlan: ctas={self.ctas}; need ≥ 1 (one CTA per SM)")
        if self.stage_bytes % 16 or self.stage_bytes < 16:
            raise ValueError(f"ChainPlan: stage_bytes={self.stage_bytes}; need a positive multiple of 16")
        if self.publish not in PUBLISH:
            raise ValueError(f"ChainPlan: publish={self.publish!r}; accepted {', '.join(PUBLISH)}")
        if self.probe not in PROBES:
            raise ValueError(f"ChainPlan: probe={self.probe!r}; accepted {', '.join(PROBES)}")
        if self.groups < 1 or self.stages % self.groups:
            # group g consumes stages s ≡ g (mod groups); with stages % groups == 0 the slot's
            # previous stage (t − stages) is the same group's, already consumed, so a `full`
            # parity wait can never alias a fill still in flight two phases back
            raise ValueError(f"ChainPlan: groups={self.groups}, stages={self.stages}; need "
                             "groups ≥ 1 dividing stages")
        if not 1 <= self.inflight <= self.stages:
            raise ValueError(f"ChainPlan: inflight={self.inflight}; need 1 … stages={self.stages}")
        if self.consumer_threads + WARP > 1024:
            raise ValueError(f"ChainPlan: groups={self.groups} × consumer_warps={self.consumer_warps}; "
                             "need groups ≥ 1 and ≤ 31 consumer warps in all")
        if self.stages < 2:
            raise ValueError(f"ChainPlan: stages={self.stages}; need ≥ 2 ring slots")
        for p, (N, K) in enumerate(self.shapes):
            if N < 1 or K % (VEC * WARP * self.consumer_warps):
                raise ValueError(
                    f"ChainPlan: phase {p} (N={N}, K={K}); K must be a multiple of "
                    f"{VEC * WARP * self.consumer_warps} (8 · 32 · consumer_warps) and N ≥ 1")
            if 2 * K > self.stage_bytes:
                raise ValueError(f"ChainPlan: phase {p} row of K={K} is {2 * K} B > stage_bytes="
                                 f"{self.stage_bytes}; a stage holds whole rows")
            if p and K != self.shapes[p - 1][0]:
                raise ValueError(f"ChainPlan: phase {p} K={K} != phase {p - 1} N="
                                 f"{self.shapes[p - 1][0]}; each output feeds the next phase")
        if self.smem_bytes > SMEM_MAX:
            raise ValueError(f"ChainPlan: {self.smem_bytes} B of shared memory > {SMEM_MAX}; "
                             "lower stages or stage_bytes")

    @property
    def consumer_threads(self) -> int:
        return WARP * self.consumer_warps * self.groups

    @property
    def phases(self) -> int:
        return len(self.shapes)

    def rows_per_stage(self, p: int) -> int:
        N, K = self.shapes[p]
        return self.stage_bytes // (2 * K)

    def chunks_per_lane(self, p: int) -> int:
        return self.shapes[p][1] // (VEC * WARP * self.consumer_warps)

    def cta_rows(self, p: int, b: int) -> tuple[int, int]:
        """Rows [r0, r1) of phase p that CTA b computes (host mirror of the kernel's split)."""
        N = self.shapes[p][0]
        return b * N // self.ctas, (b + 1) * N // self.ctas

    @property
    def red_rows(self) -> int:
        """Partial-sum rows: the most rows a CTA holds in one phase, rounded up to whole stages."""
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        return max(cdiv(cdiv(N, self.ctas), self.rows_per_stage(p)) * self.rows_per_stage(p)
                   for p, (N, _) in enumerate(self.shapes))

    @property
    def smem_bytes(self) -> int:
        """Ring + full/empty mbarriers + fp32 row partials + alignment slack."""
        return (self.stages * self.stage_bytes + 2 * 8 * self.stages
                + 4 * self.red_rows * self.consumer_warps + 256)

    @property
    def x_offsets(self) -> tuple[int, ...]:
        """Element offset of x_0 … x_P in the flat activation buffer."""
        widths = [self.shapes[0][1]] + [N for N, _ in self.shapes]
        return tuple(sum(widths[:i]) for i in range(len(widths) + 1))

    @property
    def w_offsets(self) -> tuple[int, ...]:
        """Element offset of W_0 … W_{P-1} (and the end) in the flat weight buffer."""
        sizes = [N * K for N, K in self.shapes]
        return tuple(sum(sizes[:i]) for i in range(len(sizes) + 1))

    def tag_offset(self, p: int) -> int:
        """Word offset in scratch of the tagged copy of x_p, 1 ≤ p < P (16-byte aligned: N_{p-1}
        is a multiple of 256)."""
        return SYNC_WORDS + sum(N for N, _ in self.shapes[:p - 1])

    @property
    def scratch_words(self) -> int:
        return SYNC_WORDS + sum(N for N, _ in self.shapes[:-1])

    @property
    def weight_bytes(self) -> int:
        return 2 * self.w_offsets[-1]


def chain_reference(x0: torch.Tensor, ws: list[torch.Tensor]) -> list[torch.Tensor]:
    """x_1 … x_P with fp32 sums and bf16 between phases."""
    out, x = [], x0
    for w in ws:
        x = (w.float() @ x.float()).to(x0.dtype)
        out.append(x)
    return out


def flat_views(plan: ChainPlan, xs: torch.Tensor, ws: torch.Tensor):
    """The per-phase views of the flat buffers: [x_0 … x_P], [W_0 … W_{P-1}]."""
    xo, wo = plan.x_offsets, plan.w_offsets
    x = [xs[xo[i]:xo[i + 1]] for i in range(plan.phases + 1)]
    w = [ws[wo[i]:wo[i + 1]].view(N, K) for i, (N, K) in enumerate(plan.shapes)]
    return x, w


if cutlass is not None:
    def _ld_tagged4(ptr, tag):
        """4 tagged words (bf16 | tag << 16) at a global address (16-byte aligned): their values
        as fp32, and 1 if all four carry `tag` (relaxed loads: polled across SMs)."""
        return cute.arch.inline_ptx(
            "{ .reg .b32 a, b, c, d, ta, tb, tc, td; .reg .pred pa, pb, pc, pd;\n"
            " ld.relaxed.gpu.global.v4.b32 {a, b, c, d}, [{$r0}];\n"
            " shl.b32 {$w0}, a, 16;  shl.b32 {$w1}, b, 16;\n"
            " shl.b32 {$w2}, c, 16;  shl.b32 {$w3}, d, 16;\n"
            " shr.u32 ta, a, 16;  shr.u32 tb, b, 16;  shr.u32 tc, c, 16;  shr.u32 td, d, 16;\n"
            " setp.eq.u32 pa, ta, {$r1};  setp.eq.and.u32 pb, tb, {$r1}, pa;\n"
            " setp.eq.and.u32 pc, tc, {$r1}, pb;  setp.eq.and.u32 pd, td, {$r1}, pc;\n"
            " selp.u32 {$w4}, 1, 0, pd; }",
            write_only_types=[Float32] * 4 + [cutlass.Int32], read_only_args=[ptr, tag])

    def _st_tagged(ptr, y, tag):
        """One tagged word: bf16(y) in the low half, tag in the high half (a single 32-bit store,
        so a reader that sees the tag sees the value)."""
        cute.arch.inline_ptx(
            "{ .reg .b16 h, t; .reg .b32 w;\n"
            " cvt.rn.bf16.f32 h, {$r0};  cvt.u16.u32 t, {$r1};  mov.b32 w, {h, t};\n"
            " st.relaxed.gpu.global.b32 [{$r2}], w; }",
            read_only_args=[y, tag, ptr])


class ResidentChainKernel:
    """The compiled chain for one static ChainPlan (bf16 weights and activations)."""

    def __init__(self, plan: ChainPlan):
        self.plan = plan

    @_dsl.jit
    def __call__(self, mX: _Tensor, mW: _Tensor, mScratch: _Tensor, mTrace: _Tensor, stream: _Stream):
        plan = self.plan
        self.kernel(mX, mW, mScratch, mTrace).launch(
            grid=[plan.ctas, 1, 1], block=[WARP + plan.consumer_threads, 1, 1], stream=stream)

    @_dsl.kernel
    def kernel(self, mX: _Tensor, mW: _Tensor, mScratch: _Tensor, mTrace: _Tensor):
        plan = self.plan
        C, NS = plan.consumer_warps, plan.stages
        SC = plan.stage_bytes // 16                    # 16-byte chunks per slot
        tidx, _, _ = cute.arch.thread_idx()
        b, _, _ = cute.arch.block_idx()
        warp = tidx // WARP
        lane = tidx % WARP

        smem = cutlass.memory.SmemAllocator()
        ring = smem.allocate_tensor(mW.element_type, cute.make_layout((VEC, NS * SC), stride=(1, VEC)),
                                    byte_alignment=128)
        full = smem.allocate_array(cutlass.Int64, NS, byte_alignment=8)
        empty = smem.allocate_array(cutlass.Int64, NS, byte_alignment=8)
        red = smem.allocate_tensor(Float32, cute.make_layout((plan.red_rows, C), stride=(C, 1)),
                                   byte_alignment=16)
        if tidx == 0:
            for s in cutlass.range_constexpr(NS):
                cute.arch.mbarrier_init(full + s, 1)
                cute.arch.mbarrier_init(empty + s, C)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if warp == 0:
            if lane == 0:
                self._produce(mW, ring, full, empty, b, mTrace)
        else:
            cw = warp - 1
            self._consume(mX, mScratch, ring, full, empty, red, b, cw % plan.consumer_warps,
                          cw // plan.consumer_warps, lane, tidx - WARP, mTrace)

    @_dsl.jit
    def _cta_stages(self, b, p):
        """CTA b's rows [r0, r1) of phase p and their stage count (device twin of `cta_rows`;
        producer and consumers must agree on it exactly)."""
        N, G, R = self.plan.shapes[p][0], self.plan.ctas, self.plan.rows_per_stage(p)
        r0 = b * N // G
        r1 = (b + 1) * N // G
        return r0, r1, (r1 - r0 + R - 1) // R

    @_dsl.jit
    def _produce(self, mW, ring, full, empty, b, mTrace):
        """Lane 0 of warp 0: every phase's rows of this CTA, stage by stage, into the ring."""
        plan = self.plan
        NS, SC = plan.stages, plan.stage_bytes // 16
        t = cutlass.Int32(0)                             # stages issued so far (all phases)
        for p in cutlass.range_constexpr(plan.phases):
            K = plan.shapes[p][1]
            R = plan.rows_per_stage(p)
            r0, r1, ns = self._cta_stages(b, p)
            for s in cutlass.range(ns, unroll=1):
                slot = t % NS
                if t >= plan.inflight:                   # at most `inflight` copies in flight
                    d = t - plan.inflight
                    cute.arch.mbarrier_wait(full + d % NS, (d // NS) % 2)
                cute.arch.mbarrier_wait(empty + slot, ((t // NS) % 2) ^ 1)
                row = r0 + s * R
                nbytes = cutlass.min(R, r1 - row) * (2 * K)
                cute.arch.mbarrier_arrive_and_expect_tx(full + slot, nbytes)
                cp_async_bulk_shared_cluster_global(
                    ring.iterator + slot * (SC * VEC), mW.iterator + (plan.w_offsets[p] + row * K),
                    full + slot, nbytes)
                if const_expr(plan.trace):
                    if s == 0:
                        self._stamp(mTrace, b, p, 4)
                    self._stamp(mTrace, b, p, 5)
                t = t + 1

    @_dsl.jit
    def _consume(self, mX, mScratch, ring, full, empty, red, b, c, grp, lane, ct, mTrace):
        """Consumer warp c of group grp (thread ct of all consumers): each phase's rows from the
        ring; group grp takes the stages s ≡ grp (mod groups) of a phase, warp c its K slice."""
        plan = self.plan
        C, NS, G, GR = plan.consumer_warps, plan.stages, plan.ctas, plan.groups
        SC = plan.stage_bytes // 16
        sync = mScratch.iterator
        tagged = plan.publish == "tagged" and plan.probe == "none"
        epoch = P.ld_relaxed(sync + 3) % TAG_MOD          # stable until every CTA has finished
        base = cutlass.Int32(0)                          # stages of the earlier phases (all CTAs' order)
        for p in cutlass.range_constexpr(plan.phases):
            K = plan.shapes[p][1]
            R = plan.rows_per_stage(p)
            J = plan.chunks_per_lane(p)
            if const_expr(p > 0 and plan.probe == "none"):
                self._grid_wait(sync, p * G, ct, tagged)
            if const_expr(plan.trace):
                if ct == 0:
                    self._stamp(mTrace, b, p, 0)
            # this lane's columns of x_p: chunk (c·J + j)·32 + lane, 8 values each
            rx = cute.make_rmem_tensor(cute.make_layout((J, VEC), stride=(VEC, 1)), Float32)
            if const_expr(p > 0 and tagged):
                self._load_tagged(rx, sync, sync + plan.tag_offset(p), 1 + (epoch * plan.phases + p) % TAG_MOD,
                                  J, c, lane)
            else:
                for j in cutlass.range_constexpr(J):
                    v = P.ld_cg_bf16x8(mX.iterator + (plan.x_offsets[p] + ((c * J + j) * WARP + lane) * VEC))
                    for e in cutlass.range_constexpr(VEC):
                        rx[(j, e)] = v[e]
            if const_expr(plan.trace):
                if ct == 0:
                    self._stamp(mTrace, b, p, 1, rx[(0, 0)])
            r0, r1, ns = self._cta_stages(b, p)
            for s in cutlass.range(grp, ns, GR, unroll=1):
                t = base + s
                slot = t % NS
                cute.arch.mbarrier_wait(full + slot, (t // NS) % 2)
                nrows = cutlass.min(R, r1 - r0 - s * R)
                # all R rows unconditionally (a short stage's extra rows read stale shared memory
                # and are not stored), so the rows' loads and shuffles interleave
                accs = [cute.full((VEC,), 0.0, Float32) for _ in range(R)]
                for j in cutlass.range_constexpr(J if plan.probe != "stream" else 0):
                    xv = rx[(j, None)].load()
                    for r in cutlass.range_constexpr(R):
                        q = slot * SC + r * (K // VEC) + (c * J + j) * WARP + lane
                        accs[r] = accs[r] + ring[(None, q)].load().to(Float32) * xv
                for r in cutlass.range_constexpr(R):
                    tot = accs[r].reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    tot = cute.arch.warp_reduction_sum(tot, threads_in_group=WARP)
                    if (lane == 0) & (r < nrows):
                        red[(s * R + r, c)] = tot
                cute.arch.sync_warp()
                if lane == 0:
                    cute.arch.mbarrier_arrive(empty + slot)
            base = base + ns
            cute.arch.barrier(barrier_id=1, number_of_threads=plan.consumer_threads)
            if const_expr(plan.trace):
                if ct == 0:
                    self._stamp(mTrace, b, p, 2)
            if const_expr(plan.op_ns > 0):
                t0 = cute.arch.globaltimer()
                now = t0
                while now - t0 < plan.op_ns:
                    now = cute.arch.globaltimer()
            for i in cutlass.range(ct, r1 - r0, plan.consumer_threads, unroll=1):
                y = red[(i, 0)]
                for q in cutlass.range_constexpr(1, C):
                    y = y + red[(i, q)]
                mX[plan.x_offsets[p + 1] + r0 + i] = y.to(mX.element_type)
                if const_expr(tagged and p + 1 < plan.phases):
                    _st_tagged(sync + (plan.tag_offset(p + 1) + r0 + i), y,
                               1 + (epoch * plan.phases + p + 1) % TAG_MOD)
            cute.arch.barrier(barrier_id=1, number_of_threads=plan.consumer_threads)
            if ct == 0:
                if const_expr(p + 1 < plan.phases):
                    if const_expr(plan.probe == "none"):
                        if const_expr(tagged):           # no fence: the words carry their tags
                            P.red_relaxed_add(sync)
                        else:                            # the bar.sync above + release: cumulative
                            P.red_release_add(sync)
                else:                                    # last phase: the last CTA resets
                    done = P.atom_add_acq_rel(sync + 1)
                    if done == G - 1:
                        P.st_relaxed(sync, 0)
                        P.st_relaxed(sync + 1, 0)
                        P.st_relaxed(sync + 3, (epoch + 1) % TAG_MOD)
                if const_expr(plan.trace):
                    self._stamp(mTrace, b, p, 3)

    @_dsl.jit
    def _stamp(self, mTrace, b, p, k, after=None):
        """trace[b, p, k] = %globaltimer (ns); `after`: a loaded value the stamp waits for (the
        asm reads its register, so the load must have landed)."""
        if const_expr(after is not None):
            cute.arch.inline_ptx("{ .reg .b32 d; mov.b32 d, {$r0}; }", read_only_args=[after])
        mTrace[(b * self.plan.phases + p) * TRACE_EVENTS + k] = cute.arch.globaltimer()

    @_dsl.jit
    def _load_tagged(self, rx, sync, tags, tag, J, c, lane):
        """rx (J, 8) = this lane's chunks of x_p from its tagged copy, polling each 16-byte
        group of 4 words until all carry `tag` (bounded: past SPIN_MAX rounds the flag is set)."""
        ok = cute.make_rmem_tensor(cute.make_layout((2 * J,)), cutlass.Int32)
        for h in cutlass.range_constexpr(2 * J):
            ok[h] = 0
        missing = cutlass.Int32(2 * J)
        n = cutlass.Int32(0)
        while (missing > 0) & (n < SPIN_MAX):
            missing = 0
            for j in cutlass.range_constexpr(J):
                for h in cutlass.range_constexpr(2):
                    if ok[2 * j + h] == 0:
                        v = _ld_tagged4(tags + (((c * J + j) * WARP + lane) * VEC + 4 * h), tag)
                        for e in cutlass.range_constexpr(4):
                            rx[(j, 4 * h + e)] = v[e]
                        ok[2 * j + h] = v[4]
                        missing = missing + 1 - v[4]
            n = n + 1
        if n >= SPIN_MAX:
            P.st_relaxed(sync + 2, 1)

    @_dsl.jit
    def _grid_wait(self, sync, target, ct, relaxed):
        """Consumers of this CTA wait until `target` arrivals are counted (bounded spin).
        relaxed: relaxed polls (the tagged words, not this count, order the data)."""
        if ct == 0:
            n = cutlass.Int32(0)
            seen = P.ld_relaxed(sync) if const_expr(relaxed) else P.ld_acquire(sync)
            while (seen < target) & (n < SPIN_MAX):
                seen = P.ld_relaxed(sync) if const_expr(relaxed) else P.ld_acquire(sync)
                n = n + 1
            if n >= SPIN_MAX:
                P.st_relaxed(sync + 2, 1)
        cute.arch.barrier(barrier_id=1, number_of_threads=self.plan.consumer_threads)


_CACHE = CompileCache()


def trace_words(plan: ChainPlan) -> int:
    """Length of the int64 trace buffer a launch takes (1, unused, unless plan.trace)."""
    return plan.ctas * plan.phases * TRACE_EVENTS if plan.trace else 1


def compile_chain(plan: ChainPlan, extra_options: str = ""):
    """cute.compile one chain; returns `launch(xs, ws, scratch, trace)`: xs bf16 flat (x_0 … x_P,
    x_0 read, the rest written), ws bf16 flat (W_0 … W_{P-1}), scratch int32
    (`plan.scratch_words`: SYNC_WORDS of counters, then the tagged copies of x_1 … x_{P-1};
    zero before the first launch, then owned by the kernel; scratch[2] = 1 if a spin bound was
    hit), trace int64 (`trace_words`)."""
    fake = cute.runtime.make_fake_compact_tensor
    mx = fake(cutlass.BFloat16, (plan.x_offsets[-1],), assumed_align=16)
    mw = fake(cutlass.BFloat16, (plan.w_offsets[-1],), assumed_align=16)
    ms = fake(cutlass.Int32, (plan.scratch_words,), assumed_align=16)
    mt = fake(cutlass.Int64, (trace_words(plan),), assumed_align=16)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(ResidentChainKernel(plan), mx, mw, ms, mt, stream,
                       options=f"--enable-tvm-ffi {extra_options}".strip())


def resident_chain_into(plan: ChainPlan, xs: torch.Tensor, ws: torch.Tensor, scratch: torch.Tensor,
                        trace: torch.Tensor | None = None) -> None:
    """Run the chain on the current stream: xs[x_offsets[p+1]:…] = x_{p+1} for every phase.
    trace: int64 (`trace_words(plan)`), required when plan.trace, else ignored."""
    if not plan.trace:
        trace = dummy_int64(scratch.device) if scratch.is_cuda else scratch
    elif trace is None:
        raise ValueError("resident_chain: plan.trace is set; pass an int64 trace buffer of "
                         f"{trace_words(plan)}")
    for name, t, n, dt in (("xs", xs, plan.x_offsets[-1], torch.bfloat16),
                           ("ws", ws, plan.w_offsets[-1], torch.bfloat16),
                           ("scratch", scratch, plan.scratch_words, torch.int32),
                           ("trace", trace, trace_words(plan), torch.int64)):
        if t.dtype != dt or t.dim() != 1 or t.numel() != n or not t.is_cuda or t.data_ptr() % 16:
            raise ValueError(f"resident_chain: {name} is {tuple(t.shape)} {t.dtype} on {t.device}; "
                             f"need a 16-byte aligned CUDA {dt} vector of {n}")
    launch = _CACHE.get(plan, lambda: compile_chain(plan))
    launch(xs, ws, scratch, trace)

