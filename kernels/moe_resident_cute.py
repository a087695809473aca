"""The few-token MXFP4 MoE (gate_up, SiTU, down) as ONE resident CuTe kernel whose whole expert
stream is in flight at once.

Same contract, math and rounding points as kernels/moe_mxfp4_decode.py (pair p = t·k + j,
e = ids[p]):

    a[p]   = bf16 SiTU(bf16 W1_e z[t], bf16 W3_e z[t])                      (P, I)
    out[t] = Σ_j w[t·k + j] · bf16(W2_e a[t·k + j])                          (T, L) fp32

Why: the Triton pair (gate_up, then down) takes 16.6 µs at K3 TP16 batch 1 for 17.5 MB of
experts, 3.9 µs of HBM time. Its programs each hold a few KB in flight, the
down kernel starts only when gate_up has ended, and the down weights are requested only then.
Here every byte the call needs is requested at once, right after the router's ids are visible:

  * grid = one CTA per SM, all resident (the down phase waits on other CTAs); CTA b owns the
    row pairs (gate row n, up row n of pair p) U ∈ [b·P·I/G, (b+1)·P·I/G) of the flattened
    (P, I) and the output rows l ∈ [b·L/G, (b+1)·L/G) of every pair's down projection;
  * after `griddepcontrol.wait` lane p of every warp reads ids[p] and z's loads are issued;
    then copy c of the CTA's `cp.async.bulk` list (`plan_copies`) is issued by lane 0 of warp
    c mod W (a lane-divergent `UBLKCP` serializes: 2.8 µs for 48 copies on the first run):
    gate/up scales on mbarrier 0, each row pair's two code rows on its own mbarrier, every
    pair's down codes and the 16-byte aligned span around its down scales on the last;
    ≈ 91 KB + 46 KB per SM at TP16 batch 1, all in flight at once;
  * z[t] becomes x' = z · 2^sx in fp16 (sx per token puts max |x'| in [2^10, 2^11), so a word's
    four fp16x2 products and their sum stay finite), stored as the (j, j + 4) code pairs of each
    int32 code word;
  * gate_up: warp w takes row pair r·W + w in round r once its codes have landed; lanes 0–15
    the gate row, 16–31 the up row, lane h the MXFP4 groups h + 16i (16 bytes = 4 code words).
    A word's 8 codes are decoded by two `prmt` lookups of their fp16 high bytes (sign masked,
    ORed back per pair) and summed against x' in fp16x2 (`_decode_word`, `_dot_f16x2`: 4
    products per lane, as the Triton f16x2 mode, ≈ 24 SASS instructions per word); each
    group's fp32 sum takes its ue8m0 scale. Lane 0 applies SiTU and stores a[p, n] (fp32 of
    the bf16 value) to scratch; after the CTA's barrier one release add per pair counts its rows;
  * down: warp w takes pairs p ≡ w (mod W). It decodes the first `predecode` of its lanes' rows
    into registers, then lane 0 spins (acquire, 64 ns backoff, bounded) until all I row pairs
    of p are counted; the warp stages a'[p] = a · 2^sa in fp16 like x', and 8 lanes per row
    sum the CTA's rows of W2_e from shared memory. bf16(y) · w[p] goes to `red`; after a
    barrier each (t, l) is Σ_j in j order (deterministic, no atomics, `out` fully written);
  * the last CTA to finish resets the pair counters, so graph replays need no memset.

Shared memory at K3 TP16 batch 1 (G = 132): 24 row pairs × 3.8 KB + 16 pairs × 28 rows ×
(96 + 6) B + x', a', red ≈ 150 KB; the plan refuses shapes that do not fit (TP8, or more than one
token at TP16), which the Triton pair keeps serving. Bytes read per call: every touched expert
once (a duplicate expert of two pairs twice) + G · (T·L·2 + P·I·4) of z and a from L2.

Measured (H200, docs/PERF.md §1.3): 13.2 µs per call against the Triton pair's 15.1 in the MoE
bench (0.30 of the roofline); in the TP16 batch-1 layer, medians over 3 leases (6 processes
with the pair, 7 resident), KDA 68.4 → 64.0 µs and MLA 77.5 → 73.2 µs, one kernel fewer.
Served for that shape only (kernels/moe_decode.py `RESIDENT`, predecode 3: 64
registers a thread leave the SM room for the next kernel's PDL prologue; all 7 rows take 128).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from raydecode.kernels import _cute_ptx as PTX
from raydecode.kernels._cute import CompileCache, dummy_int64
from raydecode.kernels._cute_dsl import Float32, _dsl, _Stream, _Tensor, const_expr, cute, cutlass

WARP = 32
SPIN_MAX = 1 << 22         # polls of a pair's counter before the kernel gives up and sets the flag
SPIN_SLEEP_NS = 64         # nanosleep between polls
SMEM_MAX = 227 * 1024      # sm_90 opt-in shared memory per CTA
SYNC_WORDS = 2             # int32 at the head of scratch: done counter, spin-bound flag; then
                           # one arrival counter per pair
X_MAX_EXP = 10             # max |x'| ∈ [2^10, 2^11): 4 · 6 · 2^11 < 65504 (fp16 max)
TRACE_NAMES = ("entry", "pdl_wait", "copies_issued", "x_staged", "gate_up_summed", "released",
               "down_landed", "pair_ready", "a_staged", "down_summed", "red_barrier",
               "out_stored")       # int64 stamps per CTA; 6–9: warp 0, its first pair
TRACE_EVENTS = len(TRACE_NAMES)
# fp16 high bytes of the e2m1 magnitudes 0, .5, 1, 1.5 | 2, 3, 4, 6 (the low bytes are 0)
E2M1_F16_LO = 0x3E3C3800
E2M1_F16_HI = 0x46444240

if cutlass is not None:
    from cutlass.experimental.primitives.nvvm_wrapper import cp_async_bulk_shared_cluster_global


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ResidentMoEPlan:
    """Static shape of one resident MoE call: T tokens × top-k pairs over E experts of
    (I, L) (this rank's intermediate and the latent), G CTAs of W consumer warps."""
    tokens: int
    top_k: int
    num_experts: int
    intermediate: int
    latent: int
    ctas: int
    warps: int = 16
    beta: float = 1.0
    linear_beta: float | None = None
    z_fp32: bool = False       # z arrives as fp32 (the fused GEMV's output): rounded to bf16
    pdl: bool = True
    trace: bool = False        # %globaltimer stamps, TRACE_EVENTS per CTA (bench)
    predecode: int = 8         # of each lane's ⌈L/G/4⌉ down rows, how many are decoded into
                               # registers (fp16x2, 12 a row at K3 TP16) while waiting for a:
                               # after the wait only their products remain. All 7 at K3 TP16:
                               # 13.2 vs 15.1 µs per call, but 128 registers a thread leave no
                               # room on the SM for the next kernel's PDL prologue

    def __post_init__(self):
        for name in ("tokens", "top_k", "num_experts", "ctas"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ResidentMoEPlan: {name}={v!r}; need an int ≥ 1")
        if self.latent < self.ctas or self.units < self.ctas:
            raise ValueError(f"ResidentMoEPlan: latent={self.latent}, {self.units} row pairs, "
                             f"ctas={self.ctas}; every CTA needs at least one output row and "
                             "one row pair (its mbarriers count their copies)")
        if isinstance(self.predecode, bool) or not isinstance(self.predecode, int) \
                or not 0 <= self.predecode <= 64:
            raise ValueError(f"ResidentMoEPlan: predecode={self.predecode!r}; need an int in 0 … 64 "
                             "(down rows per lane decoded before the wait)")
        if self.pairs > WARP:
            raise ValueError(f"ResidentMoEPlan: {self.pairs} pairs (tokens × top_k); at most "
                             f"{WARP} (the ids are spread over one warp's lanes)")
        if not 1 <= self.warps <= 32:
            raise ValueError(f"ResidentMoEPlan: warps={self.warps}; need 1 … 32")
        if self.latent < 512 or self.latent % 512:
            raise ValueError(f"ResidentMoEPlan: latent={self.latent}; need a multiple of 512 "
                             "(16 lanes × 16-byte groups per row, 16-byte scale rows)")
        if self.intermediate < 64 or self.intermediate % 64:
            raise ValueError(f"ResidentMoEPlan: intermediate={self.intermediate}; need a "
                             "multiple of 64 (8 lanes per down row, whole code words each)")
        if not self.beta > 0 or (self.linear_beta is not None and not self.linear_beta > 0):
            raise ValueError(f"ResidentMoEPlan: beta={self.beta}, linear_beta="
                             f"{self.linear_beta}; need beta > 0 and linear_beta None or > 0")
        if self.num_experts * 2 * self.intermediate * self.latent // 2 >= 2 ** 31:
            raise ValueError(f"ResidentMoEPlan: {self.num_experts} experts of (I={self.intermediate}, "
                             f"L={self.latent}) exceed 2^31 code bytes (32-bit offsets)")
        if self.smem_bytes > SMEM_MAX:
            raise ValueError(
                f"ResidentMoEPlan: {self.smem_bytes} B of shared memory > {SMEM_MAX} for "
                f"{self.pairs} pairs of (I={self.intermediate}, L={self.latent}) on "
                f"{self.ctas} CTAs; the whole call must fit (fewer pairs or more CTAs)")

    # ---- derived sizes ------------------------------------------------------------------
    @property
    def pairs(self) -> int:
        return self.tokens * self.top_k

    @property
    def units(self) -> int:
        """Row pairs (gate row n, up row n) of all pairs: P · I."""
        return self.pairs * self.intermediate

    @property
    def max_units(self) -> int:
        return _cdiv(self.units, self.ctas)

    @property
    def rounds(self) -> int:
        return _cdiv(self.max_units, self.warps)

    @property
    def down_rows(self) -> int:
        return _cdiv(self.latent, self.ctas)

    @property
    def pairs_per_cta(self) -> int:
        """Most pairs one CTA's row-pair range can touch."""
        return min(self.pairs, (self.max_units - 1) // self.intermediate + 2)

    @property
    def groups(self) -> int:          # MXFP4 groups per gate_up row (16 bytes each)
        return self.latent // 32

    @property
    def down_scale_span(self) -> int:
        """Bytes reserved per pair for its down scales: the 16-byte aligned span around the
        CTA's rows (l1 − l0) · I/32 bytes, which start anywhere within 16 bytes."""
        return 16 * _cdiv(self.down_rows * (self.intermediate // 32) + 30, 16)

    @property
    def copies(self) -> int:
        """Bulk copies per CTA at most: gate/up scales 2 per touched pair, codes 2 per row
        pair, down codes and scales 2 per pair (`plan_copies`)."""
        return 2 * self.pairs_per_cta + 2 * self.max_units + 2 * self.pairs

    @property
    def barriers(self) -> int:
        """mbarriers: 0 the gate/up scales, 1 + u row pair u's codes, max_units + 1 the down."""
        return self.max_units + 2

    @property
    def smem_bytes(self) -> int:
        RG, L, I, P = self.max_units, self.latent, self.intermediate, self.pairs
        return (2 * RG * (L // 2 + L // 32)                       # gate/up codes + scales
                + P * self.down_rows * (I // 2) + P * self.down_scale_span
                + 2 * self.tokens * L + 2 * P * I                 # x', a' (fp16)
                + 4 * P * self.down_rows + 4 * self.tokens * self.warps
                + 8 * self.barriers + 256)

    @property
    def scratch_words(self) -> int:
        return SYNC_WORDS + self.pairs

    @property
    def trace_words(self) -> int:
        return self.ctas * TRACE_EVENTS if self.trace else 1

    @property
    def threads(self) -> int:
        return WARP * self.warps

    # ---- host mirrors of the kernel's split -----------------------------------------------
    def cta_units(self, b: int) -> tuple[int, int]:
        return b * self.units // self.ctas, (b + 1) * self.units // self.ctas

    def cta_rows(self, b: int) -> tuple[int, int]:
        return b * self.latent // self.ctas, (b + 1) * self.latent // self.ctas

    def weight_bytes(self) -> int:
        """HBM bytes of the experts a call reads: each pair's expert once (duplicates twice)."""
        L, I = self.latent, self.intermediate
        return self.pairs * (2 * I * (L // 2 + L // 32) + L * (I // 2 + I // 32))


def plan_copies(plan: ResidentMoEPlan, b: int, ids: list[int]) -> list[tuple[str, int, int, int, int]]:
    """CTA b's bulk copies as (tensor, src byte offset, dst byte offset in its region, bytes,
    mbarrier), in the kernel's order (`_issue`; tests check it covers every byte exactly once)."""
    I, L, RG = plan.intermediate, plan.latent, plan.max_units
    KB, KG, KB2, KG2 = L // 2, L // 32, I // 2, I // 32
    u0, u1 = plan.cta_units(b)
    l0, l1 = plan.cta_rows(b)
    out = []
    for q in range(plan.pairs_per_cta):                 # gate/up scales, one copy per half
        p = u0 // I + q
        lo, hi = max(u0, p * I), min(u1, (p + 1) * I)
        if p < plan.pairs and hi > lo:
            for half in range(2):
                row = ids[p] * 2 * I + half * I + lo - p * I
                out.append(("s13", row * KG, (half * RG + lo - u0) * KG, (hi - lo) * KG, 0))
    for u in range(u1 - u0):                            # codes, one copy per row (each half)
        p, n = divmod(u0 + u, I)
        for half in range(2):
            row = ids[p] * 2 * I + half * I + n
            out.append(("w13", row * KB, (half * RG + u) * KB, KB, 1 + u))
    for p in range(plan.pairs):                         # down codes and scale spans
        e = ids[p]
        out.append(("w2", (e * L + l0) * KB2, p * plan.down_rows * KB2, (l1 - l0) * KB2, RG + 1))
        a0 = (e * L + l0) * KG2 // 16 * 16
        a1 = _cdiv((e * L + l1) * KG2, 16) * 16
        out.append(("s2", a0, p * plan.down_scale_span, a1 - a0, RG + 1))
    return out


if cutlass is not None:
    def _decode_word(w, tl, th):
        """The 8 e2m1 codes of int32 word w as 4 fp16x2 (code j low, code j + 4 high), exact
        e2m1 values. tl / th: the E2M1_F16_LO / _HI tables in registers (hoisted by the
        caller). Magnitudes: two prmt lookups of their fp16 high bytes, spread per pair with
        zero low bytes (selector 8|j: the sign-replicate of a byte < 0x80); sign bits ORed in
        at bits 15 / 31."""
        body = ""
        for j in range(4):
            sel = ((4 + j) << 12) | ((8 | j) << 8) | (j << 4) | (8 | j)
            sgn = f"shl.b32 s, {{$r0}}, {12 - 4 * j};" if j < 3 else "mov.b32 s, {$r0};"
            body += (f" prmt.b32 h, b0, b1, {sel};  {sgn}"
                     f"  lop3.b32 {{$w{j}}}, h, s, 0x80008000, 0xF8;\n")
        return cute.arch.inline_ptx(
            "{ .reg .b32 m, q, b0, b1, h, s;\n"
            " and.b32 m, {$r0}, 0x77777777;  shr.u32 q, m, 16;\n"
            " prmt.b32 b0, {$r1}, {$r2}, m;  prmt.b32 b1, {$r1}, {$r2}, q;\n" + body + "}",
            write_only_types=[cutlass.Int32] * 4, read_only_args=[w, tl, th])

    def _dot_f16x2(h, x):
        """Σ of the fp16x2 products h[j] · x[j], j < 4 (fp16 sums), the two halves added in
        fp32 -> fp32."""
        return cute.arch.inline_ptx(
            "{ .reg .b32 acc; .reg .b16 l16, h16; .reg .f32 fl, fh;\n"
            " mul.rn.f16x2 acc, {$r0}, {$r4};  fma.rn.f16x2 acc, {$r1}, {$r5}, acc;\n"
            " fma.rn.f16x2 acc, {$r2}, {$r6}, acc;  fma.rn.f16x2 acc, {$r3}, {$r7}, acc;\n"
            " mov.b32 {l16, h16}, acc;  cvt.f32.f16 fl, l16;  cvt.f32.f16 fh, h16;\n"
            " add.f32 {$w0}, fl, fh; }",
            write_only_types=[Float32], read_only_args=[h[0], h[1], h[2], h[3],
                                                        x[0], x[1], x[2], x[3]])

    def _tables():
        return cutlass.Int32(E2M1_F16_LO), cutlass.Int32(E2M1_F16_HI)

    def _ue8m0(s):
        """2^(s − 127) as fp32 for a scale byte s (s = 0: the denormal 2^-127)."""
        return cute.arch.inline_ptx(
            "{ .reg .b32 a; .reg .pred z; shl.b32 a, {$r0}, 23; setp.eq.u32 z, {$r0}, 0;\n"
            " selp.b32 a, 0x00400000, a, z; mov.b32 {$w0}, a; }",
            write_only_types=[Float32], read_only_args=[cutlass.Int32(s)])

    def _pow2_for(m):
        """(2^e, 2^-e) for the power of two that puts a max |v| = m (≥ 0) in
        [2^X_MAX_EXP, 2^(X_MAX_EXP+1)); m = 0 or not finite: (1, 1)."""
        return cute.arch.inline_ptx(
            "{ .reg .b32 b, x, up, dn; .reg .pred ok;\n"
            " mov.b32 b, {$r0};  shr.u32 x, b, 23;  and.b32 x, x, 0xff;\n"
            " setp.ne.u32 ok, x, 0;  setp.ne.and.u32 ok, x, 255, ok;\n"
            f" sub.s32 x, {127 + X_MAX_EXP}, x;\n"                 # e = X_MAX_EXP − (exp − 127)
            " max.s32 x, x, -126;  min.s32 x, x, 127;\n"
            " add.s32 up, x, 127;  shl.b32 up, up, 23;\n"
            " sub.s32 dn, 127, x;  max.s32 dn, dn, 1;  shl.b32 dn, dn, 23;\n"
            " selp.b32 {$w0}, up, 0x3f800000, ok;  selp.b32 {$w1}, dn, 0x3f800000, ok; }",
            write_only_types=[Float32, Float32], read_only_args=[m])

    def _f16x2(lo, hi):
        """fp16x2 bits of (lo, hi), round to nearest."""
        return cute.arch.inline_ptx("cvt.rn.f16x2.f32 {$w0}, {$r1}, {$r0};",
                                    write_only_types=[cutlass.Int32], read_only_args=[lo, hi])

    def _bf16_round(v):
        return cute.arch.inline_ptx(
            "{ .reg .b16 h; cvt.rn.bf16.f32 h, {$r0}; cvt.f32.bf16 {$w0}, h; }",
            write_only_types=[Float32], read_only_args=[v])


class ResidentMoEKernel:
    """The compiled call for one static ResidentMoEPlan."""

    def __init__(self, plan: ResidentMoEPlan):
        self.plan = plan

    @_dsl.jit
    def __call__(self, mZ: _Tensor, mIds: _Tensor, mTopW: _Tensor, mW13: _Tensor, mS13: _Tensor,
                 mW2: _Tensor, mS2: _Tensor, mOut: _Tensor, mScratch: _Tensor, mA: _Tensor,
                 mTrace: _Tensor, stream: _Stream):
        plan = self.plan
        self.kernel(mZ, mIds, mTopW, mW13, mS13, mW2, mS2, mOut, mScratch, mA, mTrace).launch(
            grid=[plan.ctas, 1, 1], block=[plan.threads, 1, 1], stream=stream,
            use_pdl=plan.pdl)

    @_dsl.kernel
    def kernel(self, mZ: _Tensor, mIds: _Tensor, mTopW: _Tensor, mW13: _Tensor, mS13: _Tensor,
               mW2: _Tensor, mS2: _Tensor, mOut: _Tensor, mScratch: _Tensor, mA: _Tensor,
               mTrace: _Tensor):
        plan = self.plan
        I, L, W, T, P = plan.intermediate, plan.latent, plan.warps, plan.tokens, plan.pairs
        RG, LR, KG = plan.max_units, plan.down_rows, plan.groups
        tidx, _, _ = cute.arch.thread_idx()
        b, _, _ = cute.arch.block_idx()
        warp = tidx // WARP
        lane = tidx % WARP
        if const_expr(plan.trace):
            self._stamp(mTrace, b, 0)

        smem = cutlass.memory.SmemAllocator()
        # gate/up codes: 16-byte chunks (4 words) (half·RG + u)·KG + g; scales (half·RG + u)·KG + g
        c13 = smem.allocate_tensor(cutlass.Int32, cute.make_layout((4, 2 * RG * KG), stride=(1, 4)),
                                   byte_alignment=128)
        c2 = smem.allocate_tensor(cutlass.Int32, cute.make_layout((P * LR * I // 8,)),
                                  byte_alignment=128)              # down words (p·LR + l)·I/8 + w
        x16 = smem.allocate_tensor(cutlass.Int32, cute.make_layout((4, T * 4 * KG), stride=(1, 4)),
                                   byte_alignment=16)              # x' chunk (t·4 + j)·KG + g
        a16 = smem.allocate_tensor(cutlass.Int32, cute.make_layout((4, P * I // 8), stride=(1, 4)),
                                   byte_alignment=16)              # a' chunk p·I/8 + w
        red = smem.allocate_tensor(Float32, cute.make_layout((P, LR), stride=(LR, 1)),
                                   byte_alignment=16)
        tmax = smem.allocate_tensor(Float32, cute.make_layout((T, W), stride=(W, 1)),
                                    byte_alignment=16)
        s13 = smem.allocate_tensor(cutlass.Uint8, cute.make_layout((2 * RG * KG,)), byte_alignment=16)
        s2 = smem.allocate_tensor(cutlass.Uint8, cute.make_layout((P * plan.down_scale_span,)),
                                  byte_alignment=16)
        bars = smem.allocate_array(cutlass.Int64, plan.barriers, byte_alignment=8)
        u0 = b * plan.units // plan.ctas
        u1 = (b + 1) * plan.units // plan.ctas
        l0 = b * L // plan.ctas
        l1 = (b + 1) * L // plan.ctas
        if tidx == 0:        # arrivals = the copies each mbarrier will see (`_issue`)
            cute.arch.mbarrier_init(bars, 2 * ((u1 - 1) // I - u0 // I + 1))
            for u in cutlass.range(RG, unroll=1):
                cute.arch.mbarrier_init(bars + 1 + u, 2)
            cute.arch.mbarrier_init(bars + RG + 1, 2 * P)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if const_expr(plan.pdl):
            cute.arch.griddepcontrol_launch_dependents()
            cute.arch.griddepcontrol_wait()
        if const_expr(plan.trace):
            self._stamp(mTrace, b, 1)
        idv = PTX.ld_cg_u32(mIds.iterator + cutlass.min(lane, P - 1))   # lane p: ids[p] (low word)
        zv = self._load_z(mZ, tidx)                  # in flight while the copies are issued
        self._issue(mW13, mS13, mW2, mS2, c13, s13, c2, s2, bars, idv, u0, u1, l0, l1, warp, lane)
        if const_expr(plan.trace):
            if tidx == 0:
                self._stamp(mTrace, b, 2)
        xinv = self._stage_x(zv, x16, tmax, tidx, warp, lane)
        if const_expr(plan.trace):
            if tidx == 0:
                self._stamp(mTrace, b, 3)
        self._gate_up(mA, c13, s13, x16, bars, xinv, u0, u1, warp, lane)
        cute.arch.sync_threads()
        sync = mScratch.iterator
        if const_expr(plan.trace):
            if tidx == 0:
                self._stamp(mTrace, b, 4)
        if tidx < plan.pairs_per_cta:                # one release per touched pair: its rows here
            p = u0 // I + tidx
            n = cutlass.min(u1, (p + 1) * I) - cutlass.max(u0, p * I)
            if (p < P) & (n > 0):
                PTX.red_release_add(sync + (SYNC_WORDS + p), n)
        if const_expr(plan.trace):
            if tidx == 0:
                self._stamp(mTrace, b, 5)
        self._down(mTopW, mA, sync, c2, s2, a16, red, bars, idv, l0, l1, warp, lane, mTrace, b)
        cute.arch.sync_threads()
        if const_expr(plan.trace):
            if tidx == 0:
                self._stamp(mTrace, b, 10)
        nrows = l1 - l0
        for i in cutlass.range(tidx, T * nrows, plan.threads, unroll=1):
            t = i // nrows
            lr = i - t * nrows
            y = red[(t * plan.top_k, lr)]
            for j in cutlass.range_constexpr(1, plan.top_k):
                y = y + red[(t * plan.top_k + j, lr)]
            mOut[t * L + l0 + lr] = y
        if const_expr(plan.trace):
            if tidx == 0:
                self._stamp(mTrace, b, 11)
        if tidx == 0:                                # the last CTA resets the pair counters
            done = PTX.atom_add_acq_rel(sync)
            if done == plan.ctas - 1:
                for p in cutlass.range(P, unroll=1):
                    PTX.st_relaxed(sync + (SYNC_WORDS + p), 0)
                PTX.st_relaxed(sync, 0)

    @_dsl.jit
    def _issue(self, mW13, mS13, mW2, mS2, c13, s13, c2, s2, bars, idv, u0, u1, l0, l1, warp, lane):
        """Every bulk copy of the CTA in `plan_copies` order, copy c by warp c mod W (its lane 0;
        `UBLKCP` is a uniform instruction, so one lane per warp issues and the warps issue side
        by side). Each copy arrives on its mbarrier with its byte count."""
        plan = self.plan
        I, L, RG, NQ = plan.intermediate, plan.latent, plan.max_units, plan.pairs_per_cta
        KB, KG, KB2, KG2 = L // 2, L // 32, I // 2, I // 32
        for c in cutlass.range(warp, plan.copies, plan.warps, unroll=1):
            if c < 2 * NQ:                           # gate/up scales of touched pair q, half
                p = u0 // I + c // 2
                half = c % 2
                lo = cutlass.max(u0, p * I)
                hi = cutlass.min(u1, (p + 1) * I)
                e = cute.arch.shuffle_sync(idv, cutlass.min(p, plan.pairs - 1))
                if (p < plan.pairs) & (hi > lo) & (lane == 0):
                    row = e * (2 * I) + half * I + (lo - p * I)
                    self._copy(s13.iterator + (half * RG + lo - u0) * KG, mS13.iterator + row * KG,
                               bars, (hi - lo) * KG)
            elif c < 2 * NQ + 2 * RG:                # codes of row pair u, half
                u = (c - 2 * NQ) // 2
                half = (c - 2 * NQ) % 2
                p = (u0 + u) // I
                e = cute.arch.shuffle_sync(idv, cutlass.min(p, plan.pairs - 1))
                if (u < u1 - u0) & (lane == 0):
                    row = e * (2 * I) + half * I + (u0 + u - p * I)
                    self._copy(c13.iterator + (half * RG + u) * (KB // 4), mW13.iterator + row * KB,
                               bars + 1 + u, KB)
            else:                                    # down codes / scale span of pair p
                d = c - 2 * NQ - 2 * RG
                p = d // 2
                e = cute.arch.shuffle_sync(idv, p)
                if lane == 0:
                    if d % 2 == 0:
                        self._copy(c2.iterator + p * (plan.down_rows * KB2 // 4),
                                   mW2.iterator + (e * L + l0) * KB2, bars + RG + 1, (l1 - l0) * KB2)
                    else:
                        a0 = (e * L + l0) * KG2 // 16 * 16
                        a1 = ((e * L + l1) * KG2 + 15) // 16 * 16
                        self._copy(s2.iterator + p * plan.down_scale_span, mS2.iterator + a0,
                                   bars + RG + 1, a1 - a0)

    @_dsl.jit
    def _copy(self, dst, src, bar, nbytes):
        cute.arch.mbarrier_arrive_and_expect_tx(bar, nbytes)
        cp_async_bulk_shared_cluster_global(dst, src, bar, nbytes)

    @_dsl.jit
    def _load_z(self, mZ, tidx):
        """This thread's code words of z: [t][i] -> 8 fp32 (bf16 values) of word tidx + i·NT
        (the ragged last round repeats the last word; `_stage_x` does not store it)."""
        plan = self.plan
        NWD = plan.latent // 8
        return [[self._load_z8(mZ, t * plan.latent + cutlass.min(tidx + i * plan.threads, NWD - 1) * 8)
                 for i in range(_cdiv(NWD, plan.threads))] for t in range(plan.tokens)]

    @_dsl.jit
    def _stage_x(self, zv, x16, tmax, tidx, warp, lane):
        """x'[t] = bf16(z[t]) · 2^sx_t in fp16 code-pair order; returns [2^-sx_t] per token."""
        plan = self.plan
        W, T, NT, KG = plan.warps, plan.tokens, plan.threads, plan.groups
        NWD = plan.latent // 8                       # code words per row
        ITER = _cdiv(NWD, NT)
        for t in cutlass.range_constexpr(T):
            m = Float32(0.0)
            for i in cutlass.range_constexpr(ITER):
                for e in cutlass.range_constexpr(8):
                    m = cutlass.max(m, cute.math.absf(zv[t][i][e]))
            m = cute.arch.warp_reduction_max(m)
            if lane == 0:
                tmax[(t, warp)] = m
        cute.arch.sync_threads()
        inv = []
        for t in cutlass.range_constexpr(T):
            m = tmax[(t, 0)]
            for q in cutlass.range_constexpr(1, W):
                m = cutlass.max(m, tmax[(t, q)])
            up, dn = _pow2_for(m)
            inv.append(dn)
            for i in cutlass.range_constexpr(ITER):
                w = tidx + i * NT
                if w < NWD:
                    v = zv[t][i]
                    q = (t * 4 + w % 4) * KG + w // 4
                    for j in cutlass.range_constexpr(4):
                        x16[(j, q)] = _f16x2(v[j] * up, v[j + 4] * up)
        cute.arch.sync_threads()
        return inv

    @_dsl.jit
    def _load_z8(self, mZ, off):
        """z[off … off + 8) rounded to bf16, as fp32 (fp32 z: two 16-byte loads)."""
        if const_expr(self.plan.z_fp32):
            a = PTX.ld_cg_f32x4(mZ.iterator + off)
            c = PTX.ld_cg_f32x4(mZ.iterator + off + 4)
            return [_bf16_round(a[e]) for e in range(4)] + [_bf16_round(c[e]) for e in range(4)]
        v = PTX.ld_cg_bf16x8(mZ.iterator + off)
        return [v[e] for e in range(8)]

    @_dsl.jit
    def _gate_up(self, mA, c13, s13, x16, bars, xinv, u0, u1, warp, lane):
        """Round r, warp w: row pair u = r·W + w of the CTA, once its codes have landed;
        half-warp 0 the gate row, 1 the up row; lane h its groups h + 16i. Lane 0 stores
        a = bf16 SiTU(bf16 g, bf16 u) (as fp32)."""
        plan = self.plan
        I, W, RG, KG = plan.intermediate, plan.warps, plan.max_units, plan.groups
        half = lane // 16
        h = lane % 16
        tl, th = _tables()
        cute.arch.mbarrier_wait(bars, 0)             # the scales: a few small copies, first
        for r in cutlass.range_constexpr(plan.rounds):
            u = r * W + warp
            if u < u1 - u0:
                cute.arch.mbarrier_wait(bars + 1 + u, 0)
                U = u0 + u
                p = U // I
                n = U - p * I
                t = p // plan.top_k
                row = half * RG + u
                acc = Float32(0.0)
                for i in cutlass.range_constexpr(KG // 16):
                    g = h + 16 * i
                    cw = c13[(None, row * KG + g)].load()
                    gs = Float32(0.0)
                    for j in cutlass.range_constexpr(4):
                        xv = x16[(None, (t * 4 + j) * KG + g)].load()
                        gs = gs + _dot_f16x2(_decode_word(cw[j], tl, th), xv)
                    acc = acc + gs * _ue8m0(s13[row * KG + g])
                for d in cutlass.range_constexpr(4):
                    acc = acc + cute.arch.shuffle_sync_bfly(acc, 8 >> d)
                up = cute.arch.shuffle_sync(acc, 16)
                if lane == 0:
                    xi = Float32(0.0)
                    for tt in cutlass.range_constexpr(plan.tokens):
                        if t == tt:
                            xi = xinv[tt]
                    mA[p * I + n] = self._situ(acc * xi, up * xi)

    @_dsl.jit
    def _situ(self, g, u):
        """models/layers.py `situ` at its rounding points: bf16 inputs, bf16 output."""
        plan = self.plan
        g = _bf16_round(g)
        u = _bf16_round(u)
        beta = Float32(plan.beta)
        sig = Float32(1.0) / (Float32(1.0) + cute.math.exp(-g))
        a = beta * cute.math.tanh(g / beta) * sig
        if const_expr(plan.linear_beta is not None):
            lb = Float32(plan.linear_beta)
            u = lb * cute.math.tanh(u / lb)
        return _bf16_round(a * u)

    @_dsl.jit
    def _down(self, mTopW, mA, sync, c2, s2, a16, red, bars, idv, l0, l1, warp, lane, mTrace, b):
        """Warp w: pairs p ≡ w (mod W). Waits for p's I row pairs, stages a'[p], then 8 lanes per
        row (row slot lane // 8, words lane % 8 + 8i) sum the CTA's rows of W2_e from shared
        memory; red[p, l] = bf16(y) · w[p]. The first `predecode` rows of each lane are decoded
        before the wait."""
        plan = self.plan
        I, L, W, LR = plan.intermediate, plan.latent, plan.warps, plan.down_rows
        KG2, NWD = I // 32, I // 8                   # scale bytes, code words per down row
        WPL = I // 64                                # words per lane per row
        NJ = _cdiv(LR, 4)                            # rows per lane
        rs = lane // 8
        wl = lane % 8
        nrows = l1 - l0
        tl, th = _tables()
        cute.arch.mbarrier_wait(bars + plan.max_units + 1, 0)
        if const_expr(plan.trace):
            if (warp == 0) & (lane == 0):
                self._stamp(mTrace, b, 6)
        for p in cutlass.range(warp, plan.pairs, W, unroll=1):
            e = cute.arch.shuffle_sync(idv, p)
            wp = PTX.ld_cg_f32(mTopW.iterator + p)
            off = (e * L + l0) * KG2 % 16
            dec = []
            NPRE = min(plan.predecode, NJ)
            if const_expr(NPRE > 0):
                for jr in cutlass.range_constexpr(NPRE):
                    lc = cutlass.min(rs + 4 * jr, nrows - 1)   # past nrows: the last row, unstored
                    for i in cutlass.range_constexpr(WPL):
                        dec.append(_decode_word(c2[(p * LR + lc) * NWD + wl + 8 * i], tl, th))
            if lane == 0:
                n = cutlass.Int32(0)
                seen = PTX.ld_acquire(sync + (SYNC_WORDS + p))
                while (seen < I) & (n < SPIN_MAX):
                    # back off: 132 × W pollers on 16 counter lines delay the releases they wait for
                    cute.arch.inline_ptx(f"nanosleep.u32 {SPIN_SLEEP_NS};")
                    seen = PTX.ld_acquire(sync + (SYNC_WORDS + p))
                    n = n + 1
                if n >= SPIN_MAX:
                    PTX.st_relaxed(sync + 1, 1)
            cute.arch.sync_warp()
            first = (warp == 0) & (lane == 0) & (p == 0)
            if const_expr(plan.trace):
                if first:
                    self._stamp(mTrace, b, 7)
            # a'[p]: lane ℓ loads words ℓ + 32i (8 values each), max over the warp
            av = []
            m = Float32(0.0)
            for i in cutlass.range_constexpr(_cdiv(NWD, WARP)):
                w = cutlass.min(lane + WARP * i, NWD - 1)
                lo = PTX.ld_cg_f32x4(mA.iterator + p * I + w * 8)
                hi = PTX.ld_cg_f32x4(mA.iterator + p * I + w * 8 + 4)
                v = [lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]]
                for k in cutlass.range_constexpr(8):
                    m = cutlass.max(m, cute.math.absf(v[k]))
                av.append(v)
            m = cute.arch.warp_reduction_max(m)
            up, dn = _pow2_for(m)
            for i in cutlass.range_constexpr(_cdiv(NWD, WARP)):
                w = lane + WARP * i
                if w < NWD:
                    for j in cutlass.range_constexpr(4):
                        a16[(j, p * NWD + w)] = _f16x2(av[i][j] * up, av[i][j + 4] * up)
            cute.arch.sync_warp()
            if const_expr(plan.trace):
                if first:
                    self._stamp(mTrace, b, 8)
            xs = [a16[(None, p * NWD + wl + 8 * i)].load() for i in range(WPL)]
            for jr in cutlass.range_constexpr(NJ):
                lr = rs + 4 * jr
                lc = cutlass.min(lr, nrows - 1)
                acc = Float32(0.0)
                for i in cutlass.range_constexpr(WPL):
                    wi = wl + 8 * i
                    if const_expr(jr < NPRE):
                        hw = dec[jr * WPL + i]
                    else:
                        hw = _decode_word(c2[(p * LR + lc) * NWD + wi], tl, th)
                    sc = _ue8m0(s2[p * plan.down_scale_span + off + lc * KG2 + wi // 4])
                    acc = acc + _dot_f16x2(hw, xs[i]) * sc
                for d in cutlass.range_constexpr(3):
                    acc = acc + cute.arch.shuffle_sync_bfly(acc, 4 >> d)
                if (wl == 0) & (lr < nrows):
                    red[(p, lr)] = _bf16_round(acc * dn) * wp
            if const_expr(plan.trace):
                if first:
                    self._stamp(mTrace, b, 9)

    @_dsl.jit
    def _stamp(self, mTrace, b, k):
        mTrace[b * TRACE_EVENTS + k] = cute.arch.globaltimer()


_CACHE = CompileCache()


def compile_moe(plan: ResidentMoEPlan, extra_options: str = ""):
    """cute.compile one plan; returns `launch(z, ids, topw, w13, s13, w2, s2, out, scratch, a,
    trace)` on the current torch stream (graph-capturable); all flat 1-D tensors."""
    E, I, L, P = plan.num_experts, plan.intermediate, plan.latent, plan.pairs
    fake = cute.runtime.make_fake_compact_tensor
    args = [fake(Float32 if plan.z_fp32 else cutlass.BFloat16, (plan.tokens * L,), assumed_align=16),
            fake(cutlass.Int64, (P,), assumed_align=16),
            fake(Float32, (P,), assumed_align=16),
            fake(cutlass.Uint8, (E * 2 * I * L // 2,), assumed_align=16),
            fake(cutlass.Uint8, (E * 2 * I * L // 32,), assumed_align=16),
            fake(cutlass.Uint8, (E * L * I // 2,), assumed_align=16),
            fake(cutlass.Uint8, (E * L * I // 32,), assumed_align=16),
            fake(Float32, (plan.tokens * L,), assumed_align=16),
            fake(cutlass.Int32, (plan.scratch_words,), assumed_align=16),
            fake(Float32, (P * I,), assumed_align=16),
            fake(cutlass.Int64, (plan.trace_words,), assumed_align=16)]
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(ResidentMoEKernel(plan), *args, stream,
                        options=f"--enable-tvm-ffi {extra_options}".strip())


def cache_key(plan: ResidentMoEPlan, arch: str) -> dict:
    """The node kernel cache key (kernels/aot_store.py): the plan, arch, package versions and
    the sources (this file and the shared PTX helpers)."""
    from raydecode.kernels import aot_store as S
    here = Path(__file__).resolve().parent
    return {"kind": "cute_moe_resident", "plan": dataclasses.asdict(plan), "arch": arch,
            "ffi": True, "versions": {k: v for k, v in S.versions().items() if k != "triton"},
            "source": S.source_sha(here / "moe_resident_cute.py")
            + S.source_sha(here / "_cute_ptx.py")}


def compiled(plan: ResidentMoEPlan, root=None, arch: str | None = None):
    """The launch function: from this process's cache, else the node kernel cache
    ($RAYDECODE_KERNEL_CACHE: compiled once per node, loaded by the other ranks), else a JIT
    compile. root / arch: an explicit cache dir and target (kernels/aot.py `warm`)."""
    def build():
        from raydecode.kernels import aot_store as S
        where = S.cache_dir(root)
        if where is None:
            return compile_moe(plan)

        def export(path: Path, symbol: str) -> None:
            compile_moe(plan).export_to_c(str(path), function_name=symbol)
        return S._store(where).get_or_build(cache_key(plan, arch or S.current_arch()), export,
                                            S._load_gemv)

    if root is not None:        # warming another cache dir: not this process's launch cache
        return build()
    return _CACHE.get(plan, build)


def plan_for(z: torch.Tensor, topk_ids: torch.Tensor, experts, *, ctas: int | None = None,
             warps: int = 16, pdl: bool = True, trace: bool = False,
             predecode: int = 8) -> ResidentMoEPlan | None:
    """The plan of one call on z's device (one CTA per SM), or None where the call does not fit
    the kernel (shared memory, shapes): the Triton pair serves those."""
    if ctas is None:
        ctas = torch.cuda.get_device_properties(z.device).multi_processor_count
    lin = experts.linear_beta
    try:
        return ResidentMoEPlan(
            tokens=z.shape[0], top_k=topk_ids.shape[1], num_experts=experts.num_experts,
            intermediate=experts.intermediate, latent=experts.latent, ctas=ctas, warps=warps,
            beta=float(experts.beta), linear_beta=None if lin is None else float(lin),
            z_fp32=z.dtype == torch.float32, pdl=pdl, trace=trace, predecode=predecode)
    except ValueError:
        return None


_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _scratch(plan: ResidentMoEPlan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(counters int32, a fp32) of one plan on one device, zeroed once: the kernel leaves the
    counters at zero. One launch at a time per (plan, device): the layer's MoE never overlaps
    itself."""
    key = (plan, device)
    if key not in _SCRATCH:
        _SCRATCH[key] = (torch.zeros(plan.scratch_words, dtype=torch.int32, device=device),
                         torch.empty(plan.pairs * plan.intermediate, dtype=torch.float32,
                                     device=device))
    return _SCRATCH[key]


def resident_moe_into(plan: ResidentMoEPlan, z: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, experts, out: torch.Tensor,
                      trace: torch.Tensor | None = None) -> torch.Tensor:
    """out (T, L) fp32 = Σ_k w·expert(z) on the current stream (module docstring); every input
    is checked against the plan by name before the launch."""
    from raydecode.kernels.moe_mxfp4 import _check_inputs
    _check_inputs(z, topk_weights, topk_ids, experts, (torch.bfloat16, torch.float32))
    T, L = z.shape
    want = dict(tokens=T, top_k=topk_ids.shape[1], num_experts=experts.num_experts,
                intermediate=experts.intermediate, latent=L, z_fp32=z.dtype == torch.float32)
    bad = {k: (getattr(plan, k), v) for k, v in want.items() if getattr(plan, k) != v}
    if bad:
        raise ValueError("resident MoE: the call does not match the plan: " + ", ".join(
            f"{k} plan {p} vs call {c}" for k, (p, c) in bad.items()))
    for name, t, dt in (("z", z, z.dtype), ("topk_weights", topk_weights, torch.float32),
                        ("topk_ids", topk_ids, torch.int64), ("out", out, torch.float32),
                        ("w13", experts.w13, torch.uint8), ("s13", experts.s13, torch.uint8),
                        ("w2", experts.w2, torch.uint8), ("s2", experts.s2, torch.uint8)):
        if t.dtype != dt or not t.is_cuda or not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"resident MoE: {name} is {t.dtype} {tuple(t.shape)} on {t.device}"
                             f"; need a contiguous, 16-byte aligned CUDA {dt} tensor")
    if tuple(out.shape) != (T, L):
        raise ValueError(f"resident MoE: out is {tuple(out.shape)}; need ({T}, {L})")
    if plan.trace and (trace is None or trace.dtype != torch.int64
                       or trace.numel() != plan.trace_words or not trace.is_cuda):
        raise ValueError(f"resident MoE: plan.trace is set; pass an int64 CUDA trace of "
                         f"{plan.trace_words}")
    counters, a = _scratch(plan, z.device)
    if not plan.trace:
        trace = dummy_int64(z.device)
    launch = compiled(plan)
    launch(z.view(-1), topk_ids.view(-1), topk_weights.view(-1), experts.w13.view(-1),
           experts.s13.view(-1), experts.w2.view(-1), experts.s2.view(-1), out.view(-1),
           counters, a, trace)
    return out


def spin_flag(plan: ResidentMoEPlan, device: torch.device) -> int:
    """1 if a launch of this plan on this device ever hit the spin bound (a CTA not resident)."""
    return int(_scratch(plan, device)[0][1].item())


def moe_resident(z: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, experts,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_k w·expert(z) (T, L) fp32 through the resident kernel; ValueError where it does not
    fit (see `plan_for`)."""
    plan = plan_for(z, topk_ids, experts)
    if plan is None:
        raise ValueError(f"resident MoE: {z.shape[0]} token(s) × top-{topk_ids.shape[1]} of "
                         f"(I={experts.intermediate}, L={experts.latent}) does not fit one "
                         "resident launch on this GPU; use moe_mxfp4_decode")
    if out is None:
        out = torch.empty(z.shape[0], experts.latent, dtype=torch.float32, device=z.device)
    return resident_moe_into(plan, z, topk_weights, topk_ids, experts, out)


__all__ = ["ResidentMoEPlan", "cache_key", "compile_moe", "compiled", "moe_resident",
           "plan_copies", "plan_for", "resident_moe_into", "spin_flag"]
