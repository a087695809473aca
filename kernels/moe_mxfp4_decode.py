"""MXFP4 routed experts for FEW tokens (decode, T·k ≤ `MAX_PAIRS`): the SPECIALIZED variant.

Same math, weights and rounding points as kernels/moe_mxfp4.py (the stock grouped kernel, kept
unchanged as the baseline; its docstring has the layout). Pair p = t·k + j, e = ids[p]:

    gate_up  a[p] = bf16 SiTU(bf16 W1_e z[t], bf16 W3_e z[t])           (P, I) bf16
    down     out[t] += w[p] · bf16(W2_e a[p])                            (T, L) fp32 (atomics)

Why a second kernel: at batch 1 the stock kernel streams the 16 touched experts at ~0.2 TB/s.
It pads every pair to a 16-row tl.dot, needs a sort/run kernel first, and its few programs
(≤ 17 chunks × I/BN) keep too few bytes in flight. Here each pair is its own work item (no sort:
the grid is P × N-tiles; a duplicate expert of two tokens is read twice, so this is for small
P only) and the math runs on CUDA cores as a GEMV:

    a program = one pair × BN output rows; its K loop reads (BN, GB, 16) bytes of packed codes
    per step (GB MXFP4 groups of 16 bytes per row, 16-byte contiguous runs) + (BN, GB) scales;
    each byte gives its low code (even k) and high code (odd k) as fp16 bit patterns
    ((c & 7) << 9 | (c & 8) << 12 = e2m1 · 2**-14 exactly); Σ over the 16 bytes of
    lo·x[2i] + hi·x[2i+1] in fp32, × 2**(s − 113) per group, Σ over groups.

`DecodeConfig.words` (the TUNED default at K3 shapes): the codes are read as int32 words
and one int32 op chain decodes the nibble pair (j, j + 4) of a word into two fp16 patterns; the
products accumulate elementwise (FMAs) before one 4-wide sum (`_group_dot_words`). ≈ 16 instead
of ≈ 21.5 thread-instructions per weight byte; measured TP16 batch 1 17.8 vs 20.9 µs for the pair.

`DecodeConfig.f16x2` (TUNED at TP16): the int32 words are decoded and multiplied in
packed fp16 by one inline-PTX block per word (`_F16X2_WORD_DOT`), each group's activations
scaled by a power of two into fp16's range (`_x_f16x2`). It pays only on tiles that give a
thread several rows of one group (the packed activations reused): TP16 pair 15.3 µs in the
sweep (words 17.5), −0.7 to −1.0 µs inside the layer; rel err 2.2e-3 (fp16 partial sums).

No runs kernel and no Σ_k kernel: gate_up zeroes `out` (each program a slice; the down kernel
starts after it) and the down programs add their pair's rows with fp32 atomics. 2 launches
per call, no host sync, capturable. Triton; a CuTe DSL form is the follow-up (the resident
kernel, kernels/moe_resident_cute.py, serves K3 TP16 batch 1).

Split-K gate_up (`DecodeConfig.gate_up_ks` = KS > 1; the K3 default, KS = 7 at L = 3584):
the looped gate_up program walks L/32/GB = 7 steps with one step's loads in flight, so at
batch 1 the whole grid has ≈ 11.7 MB / 7 in flight and runs latency-bound (20.1 µs, 0.55
TB/s on the H200). Split, program (p, nb, ks) does ONE step (groups [16·ks, 16·ks + 16)) with
all its loads issued at once and writes fp32 partials, each element exactly once:

    part[p, ks, n] = Σ_{k ∈ slice ks} W1_e[n, k] z[t, k]; [p, ks, I + n] with W3    (P, KS, 2I)
    down input a[p, k] = bf16 SiTU(bf16 Σ_ks part[p, ks, k], bf16 Σ_ks part[p, ks, I + k])

built by every down program from L2 (Σ in ks order: deterministic; same rounding points as
KS = 1). Cost: P·KS·2I·4 bytes written (172 KB at TP16 batch 1) and each down program reads
its pair's KS·2I·4 bytes (10.75 KB; × L/BN = 56 programs per pair at BN 64: 9.6 MB of L2
reads at batch 1, half at BN 128). `down_unroll` issues all of the down kernel's I/32/GB
K steps at once: with every program resident the bytes in flight are (total bytes) / (steps),
whatever BN and the warps are, so at TP16 (3 steps of GB 2) only the unroll, not a new
BN/warps mapping, can lift the down kernel; it is a sweep candidate, not the default.

Prediction (H200, K3, unmeasured; HBM bytes = P × expert bytes, a duplicate expert read twice):
    TP16 batch 1  gate_up 11.7 MB  20.1 µs → 5–6 µs;  down 5.9 MB  7.9 → 8–9 µs (≈ 5 unrolled)
                  both ≈ 14 µs (28 µs today; 26.8 µs in the sweep's out-of-L2 timing)
    TP16 batch 4  gate_up 47 MB → 12–14 µs;  down 23 MB → 7–9 µs;  both ≈ 21 µs (65.7 today)
    TP8  batch 1  gate_up 23 MB → 7–8 µs;  down 12 MB → 6–8 µs;  both ≈ 15 µs (37.7 today)
at 3.5–4 TB/s for the streamed weights plus ≈ 2 µs of launch and tail per kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from raydecode.kernels._triton import available, pdl_enter, pdl_launch, tanh_f32, tl, triton
from raydecode.kernels.moe_mxfp4 import MXFP4Experts, _check_inputs

# T·k up to which the specialized step uses the few-token kernels by default (the stock grouped
# kernel past it; DecodeOptions.moe_max_pairs). 256 = batch 16 at k = 16: there the per-pair
# kernels beat the grouped one with routing spread over ≈ 120–230 experts (layer bench: 1.57×
# at batch 8, 1.48× at 16) and with every token on the same 16 experts (step 1.50× at 8, 1.16×
# at 16). A pair decodes its expert by itself, at a cost that does not fall when experts
# repeat, so at batch 64 the whole step ran 0.74× of the grouped kernel's speed (layer bench,
# uniform routing: 1.05×). docs/PERF.md, MoE.
MAX_PAIRS = 256


def _f16x2_pair(j: int) -> str:
    """PTX: the codes of nibbles j and j + 4 of word $1 as an fp16 pair e2m1·2**-14 in h
    (magnitude bits 4j..4j+2 -> 9..11, sign bit 4j+3 -> 15; the same for the high half)."""
    em = f"shl.b32 a, $1, {9 - 4 * j};" if j < 3 else "shr.b32 a, $1, 3;"
    sg = f"shl.b32 b, $1, {12 - 4 * j};" if j < 3 else "mov.b32 b, $1;"
    return (f"{em} {sg} and.b32 a, a, 0x0E000E00; and.b32 b, b, 0x80008000; "
            "or.b32 h, a, b; ")


# Σ_q code_q · x'_q over the 8 codes of one int32 word $1; $2..$5: the packed x' pairs of
# nibbles (j, j + 4); fp16x2 products and sums, the two lanes added in fp32 into $0.
_F16X2_WORD_DOT_PTX = (
    "{ .reg .b32 a, b, h, acc; .reg .b16 lo, hi; .reg .f32 flo, fhi; "
    + _f16x2_pair(0) + "mul.rn.f16x2 acc, h, $2; "
    + _f16x2_pair(1) + "fma.rn.f16x2 acc, h, $3, acc; "
    + _f16x2_pair(2) + "fma.rn.f16x2 acc, h, $4, acc; "
    + _f16x2_pair(3) + "fma.rn.f16x2 acc, h, $5, acc; "
    + "mov.b32 {lo, hi}, acc; cvt.f32.f16 flo, lo; cvt.f32.f16 fhi, hi; "
    + "add.f32 $0, flo, fhi; }")


if triton is not None:
    _F16X2_WORD_DOT = tl.constexpr(_F16X2_WORD_DOT_PTX)


    @triton.jit
    def _group_dot(w_ptr, s_ptr, rows, byte, grp, xe, xo, KB: tl.constexpr, KG: tl.constexpr):
        """Σ_k W[rows, k] x[k] over the GB groups `grp` of one K step -> (BN,) fp32.
        w_ptr: (N, KB) packed bytes; s_ptr: (N, KG) scales; byte (GB, 16) byte columns;
        xe / xo (GB, 16) fp32 activations at the even / odd k of those bytes."""
        pb = tl.load(w_ptr + rows[:, None, None] * KB + byte[None, :, :]).to(tl.int32)
        lo = (((pb & 7) << 9) | ((pb & 8) << 12)).to(tl.int16)
        hi = (((pb & 0x70) << 5) | ((pb & 0x80) << 8)).to(tl.int16)
        lo = lo.to(tl.float16, bitcast=True).to(tl.float32)
        hi = hi.to(tl.float16, bitcast=True).to(tl.float32)
        part = tl.sum(lo * xe[None, :, :] + hi * xo[None, :, :], 2)          # (BN, GB)
        return _scaled_sum(part, s_ptr, rows, grp, KG)

    @triton.jit
    def _scaled_sum(part, s_ptr, rows, grp, KG: tl.constexpr):
        """Σ over the groups of part (BN, GB) × 2**(s − 113): the ue8m0 scale of each (row,
        group) times 2**14, undoing the fp16 patterns' e2m1 · 2**-14 -> (BN,) fp32."""
        s = tl.load(s_ptr + rows[:, None] * KG + grp[None, :]).to(tl.int32)
        sc = ((s + 14) << 23).to(tl.float32, bitcast=True)
        return tl.sum(part * sc, 1)

    @triton.jit
    def _x_words(x32):
        """x32 (GB, 32) fp32, k = 32·g + i -> the eight (GB, 4) tensors x_q[g, w] = x[32g + 8w
        + q], q = 0..7 (the code of nibble q of word w; low nibble = even k)."""
        GB: tl.constexpr = x32.shape[0]
        ev, od = tl.split(tl.reshape(x32, (GB, 4, 4, 2)))          # q even / odd
        e0, e1 = tl.split(tl.reshape(ev, (GB, 4, 2, 2)))            # q ∈ {0, 4} / {2, 6}
        o0, o1 = tl.split(tl.reshape(od, (GB, 4, 2, 2)))            # q ∈ {1, 5} / {3, 7}
        x0, x4 = tl.split(e0)
        x2, x6 = tl.split(e1)
        x1, x5 = tl.split(o0)
        x3, x7 = tl.split(o1)
        return x0, x1, x2, x3, x4, x5, x6, x7

    @triton.jit
    def _f16_lanes(v):
        """int32 holding an fp16 pair -> (low, high) fp16."""
        return (v.to(tl.int16).to(tl.float16, bitcast=True),
                (v >> 16).to(tl.int16).to(tl.float16, bitcast=True))

    @triton.jit
    def _nibble_pair_f16(w, j: tl.constexpr):
        """Codes of nibbles j and j + 4 of int32 words (bits 4j.. and 16 + 4j..), both decoded
        by one int32 op chain into an fp16 pair (e2m1 · 2**-14 each), -> two fp16 tensors."""
        v = w >> (4 * j)
        return _f16_lanes(((v & 0x00070007) << 9) | ((v & 0x00080008) << 12))

    @triton.jit
    def _nibble_pair(w, j: tl.constexpr):
        """`_nibble_pair_f16` as two fp32 tensors."""
        lo, hi = _nibble_pair_f16(w, j)
        return lo.to(tl.float32), hi.to(tl.float32)

    @triton.jit
    def _load_words(w_ptr, rows, grp, KB: tl.constexpr):
        """The codes of rows × groups `grp` as int32 words (4 per 16-byte group row): w_ptr the
        (N, KB) packed bytes -> (BN, GB, 4) int32."""
        wi = tl.arange(0, 4)
        w32 = w_ptr.to(tl.pointer_type(tl.int32))
        return tl.load(w32 + rows[:, None, None] * (KB // 4) + grp[None, :, None] * 4
                       + wi[None, None, :])

    @triton.jit
    def _group_dot_words(w_ptr, s_ptr, rows, grp, x32, KB: tl.constexpr, KG: tl.constexpr):
        """`_group_dot` reading the codes as int32 words (4 per 16-byte group row): two codes
        per int32 op, and the products accumulate elementwise (fused multiply-adds) before one
        4-wide sum. x32 (GB, 32) fp32 activations of the groups -> (BN,) fp32."""
        x0, x1, x2, x3, x4, x5, x6, x7 = _x_words(x32)
        w = _load_words(w_ptr, rows, grp, KB)                                  # (BN, GB, 4)
        lo, hi = _nibble_pair(w, 0)
        acc = lo * x0[None, :, :] + hi * x4[None, :, :]
        lo, hi = _nibble_pair(w, 1)
        acc += lo * x1[None, :, :] + hi * x5[None, :, :]
        lo, hi = _nibble_pair(w, 2)
        acc += lo * x2[None, :, :] + hi * x6[None, :, :]
        lo, hi = _nibble_pair(w, 3)
        acc += lo * x3[None, :, :] + hi * x7[None, :, :]
        return _scaled_sum(tl.sum(acc, 2), s_ptr, rows, grp, KG)

    @triton.jit
    def _pack_f16x2(lo, hi, c, ASM: tl.constexpr):
        """Two fp32 tensors × c as fp16, packed into one int32 (lo: bits 0..15); one
        cvt.rn.f16x2.f32 on the GPU."""
        if ASM:
            return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f",
                                             [lo * c, hi * c], dtype=tl.int32, is_pure=True,
                                             pack=1)
        a = (lo * c).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        b = (hi * c).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16
        return a | b

    @triton.jit
    def _x_f16x2(x32, ASM: tl.constexpr):
        """x32 (GB, 32) fp32 -> (xp0, xp1, xp2, xp3, inv): xp_j (GB, 4) int32 holds the fp16 pair
        (x'[32g + 8w + j], x'[32g + 8w + j + 4]) (the codes of nibbles j and j + 4 of word w),
        x' = c_g·x with, per group g, c_g = 2**(14 − e_g), e_g = ⌊log2 max_g|x|⌋ + 1, so
        max_g|x'| ∈ [2**13, 2**14): a product of an fp16 pattern (e2m1·2**-14) and x' is
        e2m1·x'·2**-14 ≤ 6, normal (full fp16 precision) while e2m1·|x'| ≥ 1, i.e. down to
        |x| ≈ 2**-13·max_g|x|. `_scaled_sum` restores the 2**-14; inv (GB,) = 2**(e_g − 14) =
        1/c_g. e_g is clamped to [-90, 128] (c and inv stay normal fp32; an all-zero group gives
        e = -90). Per group, not per step: no reduction across threads."""
        x0, x1, x2, x3, x4, x5, x6, x7 = _x_words(x32)
        m = tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)),
                                  tl.maximum(tl.abs(x2), tl.abs(x3))),
                       tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)),
                                  tl.maximum(tl.abs(x6), tl.abs(x7))))
        amax = tl.max(m, 1)                                                   # (GB,)
        e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126
        e = tl.minimum(tl.maximum(e, -90), 128)
        c = ((141 - e) << 23).to(tl.float32, bitcast=True)[:, None]
        inv = ((e + 113) << 23).to(tl.float32, bitcast=True)
        return (_pack_f16x2(x0, x4, c, ASM), _pack_f16x2(x1, x5, c, ASM),
                _pack_f16x2(x2, x6, c, ASM), _pack_f16x2(x3, x7, c, ASM), inv)

    @triton.jit
    def _word_dot_f16x2_emulated(w, x0, x1, x2, x3):
        """`_F16X2_WORD_DOT` in Triton ops (the interpreter has no inline PTX): the same fp16
        patterns and fp16 products and sums (a separate multiply and add where the PTX fuses
        them), the two lanes added in fp32."""
        l0, h0 = _pair_products_f16(w, x0, 0)
        l1, h1 = _pair_products_f16(w, x1, 1)
        l2, h2 = _pair_products_f16(w, x2, 2)
        l3, h3 = _pair_products_f16(w, x3, 3)
        return ((((l0 + l1) + l2) + l3).to(tl.float32)
                + (((h0 + h1) + h2) + h3).to(tl.float32))

    @triton.jit
    def _pair_products_f16(w, xp, j: tl.constexpr):
        """fp16 products of nibbles j, j + 4 of the words w with the packed pairs xp."""
        hl, hh = _nibble_pair_f16(w, j)
        xl, xh = _f16_lanes(xp)
        return hl * xl, hh * xh

    @triton.jit
    def _group_dot_f16x2(w_ptr, s_ptr, rows, grp, xp0, xp1, xp2, xp3, inv, KB: tl.constexpr,
                         KG: tl.constexpr, ASM: tl.constexpr):
        """`_group_dot_words` on packed fp16 math: per int32 word of 8 codes, 4 fp16x2 decodes
        and 4 fp16x2 multiply-adds (`_F16X2_WORD_DOT`: 28 PTX instructions per 4-byte word;
        whole kernels 7.7–8.6 SASS instructions per weight byte on row-reuse tiles against
        ≈ 11 for words, scripts/explore/moe_decode_sass.py), the two fp16 lanes summed in fp32
        per word. xp_j, inv from
        `_x_f16x2`; the group scale 2**(s − 113) × inv -> (BN,) fp32."""
        w = _load_words(w_ptr, rows, grp, KB)                                  # (BN, GB, 4)
        x0 = tl.broadcast_to(xp0[None, :, :], w.shape)
        x1 = tl.broadcast_to(xp1[None, :, :], w.shape)
        x2 = tl.broadcast_to(xp2[None, :, :], w.shape)
        x3 = tl.broadcast_to(xp3[None, :, :], w.shape)
        if ASM:
            d = tl.inline_asm_elementwise(_F16X2_WORD_DOT, "=f,r,r,r,r,r", [w, x0, x1, x2, x3],
                                          dtype=tl.float32, is_pure=True, pack=1)
        else:
            d = _word_dot_f16x2_emulated(w, x0, x1, x2, x3)
        # `_scaled_sum`'s scale, with inv folded in, written out: calling a helper for it
        # reorders the compiled kernel (SASS differs from the one measured)
        s = tl.load(s_ptr + rows[:, None] * KG + grp[None, :]).to(tl.int32)
        sc = ((s + 14) << 23).to(tl.float32, bitcast=True)
        return tl.sum(tl.sum(d, 2) * (sc * inv[None, :]), 1)

    @triton.jit
    def _situ_bf16(acc_g, acc_u, beta, lin_beta, HAS_LIN: tl.constexpr):
        """bf16 SiTU(bf16 g, bf16 u) from fp32 sums: models/layers.py `situ` rounding points."""
        g = acc_g.to(tl.bfloat16).to(tl.float32)
        u = acc_u.to(tl.bfloat16).to(tl.float32)
        act = beta * tanh_f32(g / beta) * tl.sigmoid(g)
        if HAS_LIN:
            u = lin_beta * tanh_f32(u / lin_beta)
        return (act * u).to(tl.bfloat16)

    @triton.jit
    def _split_input(part_ptr, k, beta, lin_beta, I: tl.constexpr, KS: tl.constexpr,
                     HAS_LIN: tl.constexpr):
        """a[k] = bf16 SiTU(bf16 Σ_ks part[ks, k], bf16 Σ_ks part[ks, I + k]) as fp32, for
        an index tensor k; part_ptr at (p, 0, 0) of the (P, KS, 2I) partials (read from L2).
        Σ over ks in ks order: deterministic."""
        sg = tl.load(part_ptr + k)
        su = tl.load(part_ptr + I + k)
        for s in tl.static_range(1, KS):
            sg += tl.load(part_ptr + s * (2 * I) + k)
            su += tl.load(part_ptr + s * (2 * I) + I + k)
        return _situ_bf16(sg, su, beta, lin_beta, HAS_LIN).to(tl.float32)

    @triton.jit
    def _pair_prologue(ids_ptr, y_ptr, n_zero, prog, p, top_k, w_ptr, s_ptr, I: tl.constexpr,
                       KB: tl.constexpr, KG: tl.constexpr, ZB: tl.constexpr):
        """Zero slice `prog` of out (the down kernel adds into it after this kernel), then
        pair p's token and its expert's W13 / scale bases -> (t, w_e, s_e)."""
        zo = prog * ZB + tl.arange(0, ZB)
        tl.store(y_ptr + zo, tl.zeros((ZB,), tl.float32), mask=zo < n_zero)
        e = tl.load(ids_ptr + p).to(tl.int64)
        return p // top_k, w_ptr + e * (2 * I * KB), s_ptr + e * (2 * I * KG)

    @triton.jit
    def _down_prologue(ids_ptr, p, top_k, w_ptr, s_ptr, L: tl.constexpr, KB: tl.constexpr,
                       KG: tl.constexpr):
        """Pair p's token and its expert's W2 / scale bases -> (t, w_e, s_e)."""
        e = tl.load(ids_ptr + p).to(tl.int64)
        return p // top_k, w_ptr + e * (L * KB), s_ptr + e * (L * KG)

    @triton.jit
    def _gate_up_step(z_ptr, t, w_e, s_e, n, grp, L: tl.constexpr, I: tl.constexpr,
                      KB: tl.constexpr, KG: tl.constexpr, WORDS: tl.constexpr,
                      F16X2: tl.constexpr, ASM: tl.constexpr):
        """One K step (the GB groups `grp`) of the gate rows n and up rows I + n -> two (BN,)
        fp32 partial sums; z bf16, or fp32 rounded to bf16 here (a bf16 GEMV output)."""
        if WORDS:
            kk = grp[:, None] * 32 + tl.arange(0, 32)[None, :]             # (GB, 32)
            x32 = tl.load(z_ptr + t * L + kk).to(tl.bfloat16).to(tl.float32)
            if F16X2:
                xp0, xp1, xp2, xp3, inv = _x_f16x2(x32, ASM)
                return (_group_dot_f16x2(w_e, s_e, n, grp, xp0, xp1, xp2, xp3, inv, KB, KG,
                                         ASM),
                        _group_dot_f16x2(w_e, s_e, n + I, grp, xp0, xp1, xp2, xp3, inv, KB,
                                         KG, ASM))
            return (_group_dot_words(w_e, s_e, n, grp, x32, KB, KG),
                    _group_dot_words(w_e, s_e, n + I, grp, x32, KB, KG))
        byte = grp[:, None] * 16 + tl.arange(0, 16)[None, :]               # (GB, 16)
        xe = tl.load(z_ptr + t * L + 2 * byte).to(tl.bfloat16).to(tl.float32)
        xo = tl.load(z_ptr + t * L + 2 * byte + 1).to(tl.bfloat16).to(tl.float32)
        return (_group_dot(w_e, s_e, n, byte, grp, xe, xo, KB, KG),
                _group_dot(w_e, s_e, n + I, byte, grp, xe, xo, KB, KG))

    @triton.jit
    def _gate_up_kernel(z_ptr, ids_ptr, w_ptr, s_ptr, a_ptr, y_ptr, n_zero, top_k, beta,
                        lin_beta, L: tl.constexpr, I: tl.constexpr, KB: tl.constexpr,
                        KG: tl.constexpr, HAS_LIN: tl.constexpr, BN: tl.constexpr,
                        GB: tl.constexpr, ZB: tl.constexpr, WORDS: tl.constexpr,
                        F16X2: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):
        """KB = L/2 bytes and KG = L/32 groups per row of W13 (passed: constexpr arithmetic
        inside the kernel differs between the compiler and the interpreter)."""
        pdl_enter(PDL)
        p = tl.program_id(0)
        nb = tl.program_id(1)
        t, w_e, s_e = _pair_prologue(ids_ptr, y_ptr, n_zero, p * tl.num_programs(1) + nb, p,
                                     top_k, w_ptr, s_ptr, I, KB, KG, ZB)
        n = nb * BN + tl.arange(0, BN)
        acc_g = tl.zeros((BN,), tl.float32)
        acc_u = tl.zeros((BN,), tl.float32)
        for g0 in range(0, KG, GB):
            dg, du = _gate_up_step(z_ptr, t, w_e, s_e, n, g0 + tl.arange(0, GB), L, I, KB, KG,
                                   WORDS, F16X2, ASM)
            acc_g += dg
            acc_u += du
        tl.store(a_ptr + p * I + n, _situ_bf16(acc_g, acc_u, beta, lin_beta, HAS_LIN))

    @triton.jit
    def _gate_up_split_kernel(z_ptr, ids_ptr, w_ptr, s_ptr, part_ptr, y_ptr, n_zero, top_k,
                              L: tl.constexpr, I: tl.constexpr, KB: tl.constexpr,
                              KG: tl.constexpr, KS: tl.constexpr, KGS: tl.constexpr,
                              BN: tl.constexpr, GB: tl.constexpr, ZB: tl.constexpr,
                              WORDS: tl.constexpr, F16X2: tl.constexpr, ASM: tl.constexpr,
                              PDL: tl.constexpr):
        """Split-K gate_up: program (p, nb, ks) sums the KGS = KG/KS groups [ks·KGS, (ks+1)·KGS)
        of BN gate and BN up rows (KGS/GB steps, unrolled: every load issued up front) and
        writes them unrounded to part (P, KS, 2I) fp32: part[p, ks, n] gate, [.., I + n] up.
        Each part element is written by exactly one program (no zeroing, deterministic)."""
        pdl_enter(PDL)
        p = tl.program_id(0)
        nb = tl.program_id(1)
        ks = tl.program_id(2)
        t, w_e, s_e = _pair_prologue(ids_ptr, y_ptr, n_zero, (p * tl.num_programs(1) + nb) * KS
                                     + ks, p, top_k, w_ptr, s_ptr, I, KB, KG, ZB)
        n = nb * BN + tl.arange(0, BN)
        acc_g = tl.zeros((BN,), tl.float32)
        acc_u = tl.zeros((BN,), tl.float32)
        for st in tl.static_range(0, KGS, GB):
            dg, du = _gate_up_step(z_ptr, t, w_e, s_e, n, ks * KGS + st + tl.arange(0, GB),
                                   L, I, KB, KG, WORDS, F16X2, ASM)
            acc_g += dg
            acc_u += du
        row = part_ptr + (p * KS + ks) * (2 * I)
        tl.store(row + n, acc_g)
        tl.store(row + I + n, acc_u)

    @triton.jit
    def _down_step(a_ptr, w_e, s_e, p, n, grp, j, beta, lin_beta, I: tl.constexpr,
                   KB: tl.constexpr, KG: tl.constexpr, KS: tl.constexpr,
                   HAS_LIN: tl.constexpr, GB: tl.constexpr, WORDS: tl.constexpr,
                   F16X2: tl.constexpr, ASM: tl.constexpr):
        """Σ over the groups `grp` of W2[n, k] a[p, k] -> (BN,) fp32."""
        if WORDS:   # the (GB, 32) input as loaded or built, codes read as int32 words
            kk = grp[:, None] * 32 + tl.arange(0, 32)[None, :]                 # (GB, 32)
            if KS == 1:
                x32 = tl.load(a_ptr + p * I + kk).to(tl.float32)
            else:
                x32 = _split_input(a_ptr + p * (KS * 2 * I), kk, beta, lin_beta, I, KS,
                                   HAS_LIN)
            if F16X2:
                xp0, xp1, xp2, xp3, inv = _x_f16x2(x32, ASM)
                return _group_dot_f16x2(w_e, s_e, n, grp, xp0, xp1, xp2, xp3, inv, KB, KG, ASM)
            return _group_dot_words(w_e, s_e, n, grp, x32, KB, KG)
        byte = grp[:, None] * 16 + j[None, :]                              # (GB, 16)
        if KS == 1:
            xe = tl.load(a_ptr + p * I + 2 * byte).to(tl.float32)
            xo = tl.load(a_ptr + p * I + 2 * byte + 1).to(tl.float32)
        else:       # k = 32·grp + [0, 32) contiguous (vector loads), then even/odd k apart
            kk = grp[:, None] * 32 + tl.arange(0, 32)[None, :]                 # (GB, 32)
            x = _split_input(a_ptr + p * (KS * 2 * I), kk, beta, lin_beta, I, KS, HAS_LIN)
            xe, xo = tl.split(tl.reshape(x, (GB, 16, 2)))
        return _group_dot(w_e, s_e, n, byte, grp, xe, xo, KB, KG)

    @triton.jit
    def _down_kernel(a_ptr, ids_ptr, topw_ptr, w_ptr, s_ptr, y_ptr, top_k, beta, lin_beta,
                     L: tl.constexpr, I: tl.constexpr, KB: tl.constexpr, KG: tl.constexpr,
                     KS: tl.constexpr, HAS_LIN: tl.constexpr, BN: tl.constexpr,
                     GB: tl.constexpr, UNROLL: tl.constexpr, WORDS: tl.constexpr,
                     F16X2: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):
        """KB = I/2 bytes and KG = I/32 groups per row of W2. KS == 1: a_ptr is a (P, I) bf16;
        KS > 1: a_ptr is the gate_up partials (P, KS, 2I) fp32 and this program builds its
        K input from them (`_split_input`). UNROLL: the K loop unrolled (all steps' loads
        issued together) instead of a runtime loop; same sums in the same order."""
        pdl_enter(PDL)
        p = tl.program_id(0)
        t, w_e, s_e = _down_prologue(ids_ptr, p, top_k, w_ptr, s_ptr, L, KB, KG)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        gi = tl.arange(0, GB)
        j = tl.arange(0, 16)
        acc = tl.zeros((BN,), tl.float32)
        if UNROLL:
            for g0 in tl.static_range(0, KG, GB):
                acc += _down_step(a_ptr, w_e, s_e, p, n, g0 + gi, j, beta, lin_beta,
                                  I, KB, KG, KS, HAS_LIN, GB, WORDS, F16X2, ASM)
        else:
            for g0 in range(0, KG, GB):
                acc += _down_step(a_ptr, w_e, s_e, p, n, g0 + gi, j, beta, lin_beta,
                                  I, KB, KG, KS, HAS_LIN, GB, WORDS, F16X2, ASM)
        y = acc.to(tl.bfloat16).to(tl.float32) * tl.load(topw_ptr + p)
        tl.atomic_add(y_ptr + t * L + n, y, sem="relaxed")


@dataclass(frozen=True)
class DecodeConfig:
    """Tiles: BN output rows per program, GB MXFP4 groups (16 bytes per row each) per K step,
    warps per program; GB must divide K/32 (L/32 for gate_up, I/32 for down), BN the N.
    gate_up_ks: K slices of gate_up (1: one program loops over all of L, writes a (P, I) bf16;
    KS > 1: split-K into (P, KS, 2I) fp32 partials, the down kernel applies SiTU); KS must
    divide L/32/GB. down_unroll: the down K loop unrolled (all I/32/GB steps in flight).
    words: both kernels read the codes as int32 words and decode two codes per int32 op
    (`_group_dot_words`; same sums up to fp32 summation order). f16x2 (needs words): the
    products and the per-word sums in packed fp16 (`_group_dot_f16x2`: inline PTX on the GPU,
    the same steps in Triton ops under the interpreter); the activations are scaled by a power
    of two per K step so they fill fp16's range, and the per-word sums are added in fp32."""
    gate_up_bn: int = 16
    gate_up_gb: int = 16
    gate_up_warps: int = 4
    down_bn: int = 64
    down_gb: int = 2
    down_warps: int = 4
    gate_up_ks: int = 1
    down_unroll: bool = False
    words: bool = False
    f16x2: bool = False

    def validate(self, I: int, L: int) -> "DecodeConfig":
        bad = []
        if I % self.gate_up_bn or (L // 32) % self.gate_up_gb:
            bad.append(f"gate_up BN {self.gate_up_bn} | I={I}, GB {self.gate_up_gb} | L/32")
        elif self.gate_up_ks < 1 or (L // 32 // self.gate_up_gb) % self.gate_up_ks:
            bad.append(f"gate_up KS {self.gate_up_ks}: need KS ≥ 1 dividing "
                       f"L/32/GB = {L // 32 // self.gate_up_gb}")
        if L % self.down_bn or (I // 32) % self.down_gb:
            bad.append(f"down BN {self.down_bn} | L={L}, GB {self.down_gb} | I/32")
        if self.f16x2 and not self.words:
            bad.append("f16x2 needs words=True (it decodes int32 words)")
        if bad:
            raise ValueError(f"DecodeConfig {self}: " + "; ".join(bad))
        return self


# Best of the MoE decode sweep's candidates (scripts/explore/layer_moe_decode_sweep.py) per
# (E, I, L), batch 1, H200, 12 calls per graph over > 2 × L2 of experts: the split-K gate_up
# (KS = 7 or 14) with an unrolled down kernel; the int32-word decode (TP16 17.8 µs against 20.9
# for the byte decode, TP8 28.2 against 35.7, bench/results/layer-h200-2026-11-29-r7.json); the
# packed-fp16 decode where it won inside the layer, TP16 only (17.3 → 16.6 µs; at TP8 27.6 →
# 30.1, bench/results/moe-decode-sweep-h200-2026-11-29-r11.json and
# layer-h200-2026-11-29-r11.json). rel err vs the fp64 reference 2.2e-3 (words 3.1e-4: fp16
# partial sums). Missing keys: the default rule; DecodeOptions.moe_decode_configs overrides an
# entry for one replica (A/B runs).
TUNED: dict[tuple[int, int, int], DecodeConfig] = {
    (896, 192, 3584): DecodeConfig(16, 8, 1, 128, 2, 2, gate_up_ks=14, down_unroll=True,
                                   words=True, f16x2=True),
    (896, 384, 3584): DecodeConfig(8, 8, 2, 64, 4, 4, gate_up_ks=7, down_unroll=True,
                                   words=True),
}


def unique_valid(configs, I: int, L: int) -> list:
    """The configs (DecodeConfig or any with `validate(I, L)`) that fit (I, L), first
    occurrence of each kept in order: the sweeps' candidate lists."""
    out = []
    for c in configs:
        try:
            c.validate(I, L)
        except ValueError:
            continue
        if c not in out:
            out.append(c)
    return out


def _pow2_divisor(n: int, cap: int) -> int:
    b = cap
    while b > 1 and n % b:
        b //= 2
    return b


def default_decode_config(num_experts: int, intermediate: int, latent: int,
                          tuned: bool = True) -> DecodeConfig:
    """TUNED entry if any (and `tuned`); else BN 16 / 64, the widest K steps dividing K, and
    gate_up split into L/32/GB slices (one K step per program)."""
    hit = TUNED.get((num_experts, intermediate, latent)) if tuned else None
    if hit is not None:
        return hit
    gb = _pow2_divisor(latent // 32, 16)
    return DecodeConfig(gate_up_bn=_pow2_divisor(intermediate, 16), gate_up_gb=gb,
                        down_bn=_pow2_divisor(latent, 64),
                        down_gb=_pow2_divisor(intermediate // 32, 4),
                        gate_up_ks=latent // 32 // gb)


def moe_mxfp4_decode(z: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     experts: MXFP4Experts, config: DecodeConfig | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_k w·expert(z) (T, L) fp32 for few tokens (2 launches, see module docstring).

    z may also be fp32 (the specialized step's fused GEMV output): it is rounded to bf16 on
    load, so the result equals the call with z.to(bf16)."""
    _check_inputs(z, topk_weights, topk_ids, experts, (torch.bfloat16, torch.float32))
    T, L = z.shape
    k = topk_ids.shape[1]
    P, I = T * k, experts.intermediate
    cfg = (config or default_decode_config(experts.num_experts, I, L)).validate(I, L)
    ks = cfg.gate_up_ks
    ids = topk_ids.reshape(-1)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    if out is None:
        out = torch.empty(T, L, dtype=torch.float32, device=z.device)
    grid = (P, I // cfg.gate_up_bn, ks)
    zb = triton.next_power_of_2(-(-(T * L) // (grid[0] * grid[1] * ks)))
    lin = experts.linear_beta
    beta, lin_beta = float(experts.beta), float(lin if lin is not None else 1.0)
    pdl = pdl_launch(out)
    dec = dict(WORDS=cfg.words, F16X2=cfg.f16x2, ASM=z.is_cuda)
    if ks == 1:     # a (P, I) bf16
        a = torch.empty(P, I, dtype=torch.bfloat16, device=z.device)
        _gate_up_kernel[grid[:2]](
            z.contiguous(), ids, experts.w13, experts.s13, a, out, T * L, k, beta, lin_beta,
            L=L, I=I, KB=L // 2, KG=L // 32, HAS_LIN=lin is not None, BN=cfg.gate_up_bn,
            GB=cfg.gate_up_gb, ZB=zb, num_warps=cfg.gate_up_warps, **dec, **pdl)
    else:           # partials (P, KS, 2I) fp32, every element written once
        a = torch.empty(P, ks, 2 * I, dtype=torch.float32, device=z.device)
        _gate_up_split_kernel[grid](
            z.contiguous(), ids, experts.w13, experts.s13, a, out, T * L, k, L=L, I=I,
            KB=L // 2, KG=L // 32, KS=ks, KGS=L // 32 // ks, BN=cfg.gate_up_bn,
            GB=cfg.gate_up_gb, ZB=zb, num_warps=cfg.gate_up_warps, **dec, **pdl)
    _down_kernel[(P, L // cfg.down_bn)](
        a, ids, topk_weights.contiguous(), experts.w2, experts.s2, out, k, beta, lin_beta,
        L=L, I=I, KB=I // 2, KG=I // 32, KS=ks, HAS_LIN=lin is not None, BN=cfg.down_bn,
        GB=cfg.down_gb, UNROLL=cfg.down_unroll, num_warps=cfg.down_warps, **dec, **pdl)
    return out


def use_decode_kernel(z: torch.Tensor, topk_ids: torch.Tensor, experts: MXFP4Experts,
                      max_pairs: int = MAX_PAIRS) -> bool:
    """Whether the few-token kernels serve this call (≤ max_pairs pairs, Triton on these
    tensors; max_pairs: DecodeOptions.moe_max_pairs)."""
    return topk_ids.numel() <= max_pairs and available(z, experts.w13)


__all__ = ["DecodeConfig", "MAX_PAIRS", "TUNED", "default_decode_config", "moe_mxfp4_decode",
           "unique_valid", "use_decode_kernel"]
