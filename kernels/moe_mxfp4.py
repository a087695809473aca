"""Fused grouped MoE over MXFP4 routed-expert weights: the STOCK path's expert kernel (Triton).

This is how stock vLLM runs routed experts: the (token, expert) pairs are grouped by expert and
each expert GEMM is ONE launch over all pairs, dequantizing e2m1 + ue8m0 on the fly, so every
touched expert's weights stream from HBM once per step (not a Python loop over experts).

T tokens, top-k: P = T·k pairs, pair p = t·k + j (row-major flatten of the (T, k) routing).
    runs      pairs sorted by expert id; run r = the pairs of the r-th distinct expert e_r
    gate_up   a[p] = SiTU(W1_e z[t], W3_e z[t])            (P, I)  bf16 values   e = ids[p]
    down      y[p] = W2_e a[p]                             (P, L)  bf16
    out[t]    = Σ_j w[t·k + j] · y[t·k + j]                (T, L)  fp32
Rounding points follow models/moe.py `RoutedExperts`: W1 z and W3 z are rounded to bf16 before
SiTU, SiTU's output to bf16, W2 a to bf16 before the routing weight.

Weights (one rank's slice; I = this rank's expert intermediate, L = latent width):
    w13 (E, 2I, L/2) uint8 + s13 (E, 2I, L/32) uint8   rows [0, I) gate (w1), [I, 2I) up (w3)
    w2  (E, L, I/2)  uint8 + s2  (E, L, I/32)  uint8
in the models/mxfp4.py layout (low nibble = even k; w = e2m1 · 2**(s − 127)).

Launches per call (all capturable in a CUDA graph, no host sync): runs (1 program: sort by
expert, run boundaries, and CHUNKS of ≤ block_m pairs of one expert; 16 = BLOCK_M for decode
steps, 128 for prefill steps (`prefill_config`: the swapped-operand kernels, below); past
1,024 pairs `moe_runs_torch`'s library ops) → gate_up (grid: chunks × I/BN) → down (grid:
chunks × L/BN; bf16(W2 a) rows, bf16) →
the weighted Σ over k (grid: T/BT × L/BL; fp32, j in order). Keeping the down rows in bf16
(the value the reference rounds to anyway) halves the (P, L) buffer a prefill step writes and
reads again: at 8,192 tokens of K3 (P = 131,072, L = 3,584) 0.94 GB instead of 1.88.
Programs whose chunk index ≥ the number of chunks exit at once, so the grid is sized for the
worst case (min(P, E) + P / block_m chunks) and never depends on the routing; each program
has one loop, over K.

Decodes (`MoEConfig.decode`; all exact, chosen per shape by the sweep → `TUNED`):
  elementwise  each code's 3 magnitude bits at fp16 bits 11..9 (+ sign at bit 15) give exactly
               e2m1 · 2**-14 (code 1, e2m1's subnormal 0.5, lands on fp16's subnormal 2**-15);
               × 2**(s − 113) in fp32 (fp32 bits (s + 14) << 23), to bf16; bf16 dot
  pairs        the same bit placement on int32 words, two codes per integer op; fp16 dot per
               32-group, the group scale applied to the fp32 partial
  split        the 16 bytes of a group as two K=16 fp16 tiles (low / high nibbles, dotted with
               the even / odd activation columns), no interleave; scale on the partial
Scales up to s = 240 decode (`MAX_SCALE`; checked once by `MXFP4Experts.validate`). The
activations enter the fp16 dots as fp16 (exact for bf16 values of magnitude ≥ 2**-14).

`fused_moe_mxfp4` dispatches: Triton when it is importable and the tensors are on CUDA (or
TRITON_INTERPRET=1 on CPU tensors), else `moe_mxfp4_reference` (PyTorch, models/mxfp4.py
`unpack_mxfp4`, the math of models/moe.py with a host sync on the unique experts).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raydecode.kernels import settings as _settings
from raydecode.kernels._triton import LAUNCH_WARPS, tanh_f32
from raydecode.models.layers import situ
from raydecode.models.mxfp4 import GROUP_SIZE, SCALE_BIAS, MXFP4Error, unpack_mxfp4

try:  # CPU-only installs have no Triton: the reference serves them
    import triton
    import triton.language as tl
except Exception:  # ImportError, or a broken install
    triton = tl = None

MAX_SCALE = 240          # (s + 14) << 23 must stay a finite fp32 exponent
BLOCK_M = 16             # pair rows per dot (tl.dot's minimum M)
RUNS_MIN_BLOCK = 64
SUM_BLOCK = (16, 256)    # (tokens, latent columns) per program of the weighted sum over k
MAX_GRID_Y = 65535       # CUDA's grid y limit: past it a tile-major launch stays chunk-major


@dataclass(frozen=True)
class MXFP4Experts:
    """One layer's routed experts on one rank, MXFP4-packed (see the module docstring)."""
    w13: torch.Tensor
    s13: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor
    beta: float
    linear_beta: float | None

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def intermediate(self) -> int:     # I (this rank's slice)
        return self.w13.shape[1] // 2

    @property
    def latent(self) -> int:           # L
        return self.w2.shape[1]

    def expert_bytes(self) -> int:
        """HBM bytes of one expert's packed weights + scales (what a touched expert costs)."""
        per = [t[0].numel() * t.element_size() for t in (self.w13, self.s13, self.w2, self.s2)]
        return sum(per)

    def validate(self) -> "MXFP4Experts":
        """Shape/dtype checks and the scale range the kernel decodes (one host sync)."""
        E, I2, Lh = self.w13.shape
        L, I = Lh * 2, I2 // 2
        want = {"w13": (E, 2 * I, L // 2), "s13": (E, 2 * I, L // GROUP_SIZE),
                "w2": (E, L, I // 2), "s2": (E, L, I // GROUP_SIZE)}
        for name, shape in want.items():
            t = getattr(self, name)
            if t.dtype != torch.uint8 or tuple(t.shape) != shape:
                raise MXFP4Error(f"MXFP4Experts.{name}: {t.dtype} {tuple(t.shape)}; expected "
                                 f"uint8 {shape} for E={E}, I={I}, L={L}")
            if not t.is_contiguous():
                raise MXFP4Error(f"MXFP4Experts.{name} must be contiguous")
        if L % GROUP_SIZE or I % GROUP_SIZE or I2 % 2:
            raise MXFP4Error(f"latent {L} and intermediate {I} must be multiples of the "
                             f"MXFP4 group {GROUP_SIZE}")
        hi = max(int(self.s13.max()), int(self.s2.max()))
        if hi > MAX_SCALE:
            raise MXFP4Error(f"MXFP4 scale byte {hi} > {MAX_SCALE} (2**{hi - SCALE_BIAS}): "
                             f"the fused kernel decodes scales up to {MAX_SCALE}")
        return self

    def dequantized(self, dtype: torch.dtype = torch.bfloat16):
        """(w1 (E, I, L), w3 (E, I, L), w2 (E, L, I)) as models/moe.py `RoutedExperts` holds them."""
        w13 = unpack_mxfp4(self.w13, self.s13, dtype)
        return w13[:, :self.intermediate], w13[:, self.intermediate:], \
            unpack_mxfp4(self.w2, self.s2, dtype)

    @staticmethod
    def random(num_experts: int, latent: int, intermediate: int, beta: float,
               linear_beta: float | None, *, fan_in_13: int | None = None,
               fan_in_2: int | None = None, device=None, seed: int = 0) -> "MXFP4Experts":
        """Uniform random codes; per-group scales near 1/(rms(e2m1) · sqrt(fan_in)) so that the
        dequantized weights are ~N(0, 1/fan_in)-sized (fan-ins default to the local K)."""
        gen = torch.Generator(device=device).manual_seed(seed)
        E, L, I = num_experts, latent, intermediate
        rms_e2m1 = math.sqrt(sum(v * v for v in (0, .5, 1, 1.5, 2, 3, 4, 6)) / 8)

        def scales(shape, fan_in):
            base = SCALE_BIAS + round(math.log2(1.0 / (rms_e2m1 * math.sqrt(fan_in))))
            jitter = torch.randint(-1, 1, shape, generator=gen, device=device)
            return (base + jitter).to(torch.uint8)

        def codes(shape):
            return torch.randint(0, 256, shape, generator=gen, device=device,
                                 dtype=torch.uint8)

        return MXFP4Experts(
            w13=codes((E, 2 * I, L // 2)), s13=scales((E, 2 * I, L // GROUP_SIZE), fan_in_13 or L),
            w2=codes((E, L, I // 2)), s2=scales((E, L, I // GROUP_SIZE), fan_in_2 or I),
            beta=beta, linear_beta=linear_beta)


# ---- PyTorch reference ---------------------------------------------------------------------

def moe_mxfp4_reference(z: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        experts: MXFP4Experts) -> torch.Tensor:
    """z (T, L), topk_weights (T, k) fp32, topk_ids (T, k) -> Σ_k w·expert(z) (T, L) fp32.

    models/moe.py `RoutedExperts.forward` with each selected expert dequantized by
    `unpack_mxfp4` (same ops in the same order; host sync on the unique expert ids)."""
    I = experts.intermediate
    out = z.new_zeros(z.shape, dtype=torch.float32)
    for e in torch.unique(topk_ids).tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        w13 = unpack_mxfp4(experts.w13[e], experts.s13[e], z.dtype)       # (2I, L)
        w2 = unpack_mxfp4(experts.w2[e], experts.s2[e], z.dtype)          # (L, I)
        h = z[tok]
        a = situ(F.linear(h, w13[:I]), F.linear(h, w13[I:]), experts.beta, experts.linear_beta)
        y = F.linear(a, w2)
        out.index_add_(0, tok, y.float() * topk_weights[tok, slot].unsqueeze(-1))
    return out


# ---- Triton kernels ------------------------------------------------------------------------
#
# Work unit: a CHUNK = up to BLOCK_M consecutive pairs of one run (one expert). The runs kernel
# lists them; every GEMM program handles one chunk × one BN-wide slab of output columns and has
# a single loop, over K, which Triton software-pipelines. Chunks past `num_chunks` exit at once;
# the grid is sized for the worst case, min(P, E) + P // BLOCK_M chunks.

if triton is not None:

    @triton.jit
    def _max2(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _runs_kernel(ids_ptr, P, pairs_ptr, sorted_e_ptr, run_start_ptr, num_runs_ptr,
                     chunk_start_ptr, chunk_end_ptr, num_chunks_ptr,
                     BLOCK: tl.constexpr, BM: tl.constexpr):
        """One program: sort the P pairs by (expert, pair index), write the runs (run_start,
        runs + 1 entries, the last = P) and the chunks (≤ BM pairs of one run each)."""
        i = tl.arange(0, BLOCK)
        ok = i < P
        e = tl.load(ids_ptr + i, mask=ok, other=0).to(tl.int32)
        key = tl.where(ok, e * BLOCK + i, 2147483647)
        key = tl.sort(key, 0)
        se = key // BLOCK
        tl.store(pairs_ptr + i, key % BLOCK, mask=ok)
        tl.store(sorted_e_ptr + i, se, mask=ok)
        tl.debug_barrier()                       # sorted_e written by every thread of the CTA
        prev = tl.load(sorted_e_ptr + i - 1, mask=ok & (i > 0), other=-1)
        first = ok & (se != prev)
        rid = tl.cumsum(first.to(tl.int32), 0) - 1
        tl.store(run_start_ptr + rid, i, mask=first)
        n = tl.sum(first.to(tl.int32), 0)
        tl.store(run_start_ptr + n, P)
        tl.store(num_runs_ptr, n)
        tl.debug_barrier()                       # run_start complete
        s_i = tl.associative_scan(tl.where(first, i, 0), 0, _max2)   # start of i's run
        run_end = tl.load(run_start_ptr + rid + 1, mask=ok, other=0)
        cs = ok & ((i - s_i) % BM == 0)
        cid = tl.cumsum(cs.to(tl.int32), 0) - 1
        tl.store(chunk_start_ptr + cid, i, mask=cs)
        tl.store(chunk_end_ptr + cid, tl.minimum(i + BM, run_end), mask=cs)
        tl.store(num_chunks_ptr, tl.sum(cs.to(tl.int32), 0))

    @triton.jit
    def _chunk_rows(c, chunk_start_ptr, chunk_end_ptr, pairs_ptr, sorted_e_ptr,
                    BM: tl.constexpr):
        """(sorted positions (BM,), their pair ids, valid (BM,), expert) of chunk c."""
        start = tl.load(chunk_start_ptr + c)
        m = start + tl.arange(0, BM)
        m_ok = m < tl.load(chunk_end_ptr + c)
        pair = tl.load(pairs_ptr + m, mask=m_ok, other=0)
        e = tl.load(sorted_e_ptr + start).to(tl.int64)
        return m, pair, m_ok, e

    @triton.jit
    def _chunk(c, chunk_start_ptr, chunk_end_ptr, pairs_ptr, sorted_e_ptr, BM: tl.constexpr):
        """(pair ids (BM,), valid (BM,), expert) of chunk c."""
        _, pair, m_ok, e = _chunk_rows(c, chunk_start_ptr, chunk_end_ptr, pairs_ptr,
                                       sorted_e_ptr, BM)
        return pair, m_ok, e


    @triton.jit
    def _chunk_and_tile(TILE_MAJOR: tl.constexpr):
        """(chunk, output tile) of this program. Chunk-major: grid (chunks, tiles), consecutive
        programs take consecutive chunks of one tile column. Tile-major: grid (tiles, chunks),
        a chunk's tiles run back to back, so its gathered activation rows are read from HBM
        once and from L2 by its other tiles (`MoEConfig.tile_major`)."""
        if TILE_MAJOR:
            return tl.program_id(1), tl.program_id(0)
        return tl.program_id(0), tl.program_id(1)

    @triton.jit
    def _dot(a, b, acc, DOT_F32: tl.constexpr):
        """acc + a·b with fp32 accumulation. DOT_F32: fp32 operands, exact products (only under
        TRITON_INTERPRET, whose bf16 dot reads raw bits as values in Triton 3.9)."""
        if DOT_F32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    # ---- decode "elementwise": each code to fp32, times its scale, to bf16; bf16 dot -------

    @triton.jit
    def _load_scales(s_ptr, rows, row_ok, k0, K: tl.constexpr, BK: tl.constexpr):
        """The (BN, BK / 32) group-scale bytes of an MXFP4 (N, K) matrix's rows `rows`,
        groups of columns [k0, k0 + BK); 127 (2**0) where row_ok is False."""
        ks = k0 // 32 + tl.arange(0, BK // 32)
        return tl.load(s_ptr + rows[:, None] * (K // 32) + ks[None, :], mask=row_ok[:, None],
                       other=127)

    @triton.jit
    def _dequant_tile(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr):
        """(BN, BK) bf16 tile of an MXFP4 (N, K) matrix: rows `rows`, columns [k0, k0 + BK).
        fp16 bits ((c & 7) << 9 | (c & 8) << 12) are exactly e2m1 · 2**-14 (code 1, e2m1's
        subnormal 0.5, lands on fp16's subnormal 2**-15); the scale adds 2**(s − 113)."""
        p = _load_bytes(w_ptr, rows, row_ok, k0, K, BK)
        return _ew_decode(p, _load_scales(s_ptr, rows, row_ok, k0, K, BK), BN, BK)

    @triton.jit
    def _dequant_tile_s(w_ptr, s, rows, row_ok, k0, K: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr):
        """`_dequant_tile` with the tile's scale bytes s (`_load_scales`) already loaded."""
        return _ew_decode(_load_bytes(w_ptr, rows, row_ok, k0, K, BK), s, BN, BK)

    @triton.jit
    def _load_bytes(w_ptr, rows, row_ok, k0, K: tl.constexpr, BK: tl.constexpr):
        """The (BN, BK / 2) code bytes of rows `rows`, columns [k0, k0 + BK)."""
        kb = k0 // 2 + tl.arange(0, BK // 2)
        return tl.load(w_ptr + rows[:, None] * (K // 2) + kb[None, :], mask=row_ok[:, None],
                       other=0)

    @triton.jit
    def _ew_decode(p, s, BN: tl.constexpr, BK: tl.constexpr):
        """The elementwise decode of code bytes p with scale bytes s -> (BN, BK) bf16."""
        c = tl.join(p & 15, p >> 4).reshape(BN, BK).to(tl.int32)    # k order: lo, hi, lo, ...
        bits = ((c & 7) << 9) | ((c & 8) << 12)
        v = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        sc = ((s.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)   # 2**(s − 113)
        v = v.reshape(BN, BK // 32, 32) * sc[:, :, None]
        return v.reshape(BN, BK).to(tl.bfloat16)

    # ---- decode "x2" (swapped and blocked kernels): 8 codes per 32-bit word, bf16x2 ops ----
    #
    # The tile is loaded as int32 words: word w of a row holds codes k = 8w..8w+7 (nibble q =
    # code 8w + q), all of one 32-group. For q = 0..3 one shift-and-mask pair puts code q at
    # bf16 bits 15 / 8..6 and code q + 4 at bits 31 / 24..22 (sign; exponent low bits and
    # mantissa top bit), so each 32-bit op makes two values: e2m1 · 2**-126 exactly (e2m1's
    # subnormal 0.5 lands on bf16's subnormal 2**-127). Two bf16x2 fmas, by 2**126 and by
    # the word's group scale 2**(s − 127), give the exact bf16 weights (a scale byte 0,
    # 2**-127, decodes as 0, as bf16 (s << 7) reads it): ≈ 3.5 instructions per weight where
    # the elementwise decode spends ≈ 9 (widen, mask, fp16 → fp32, multiply, → bf16). One asm
    # instance per word (pack 1: each input element is a whole word whatever layout Triton
    # gives the tile; with pack 4 over bytes, the bytes one instance got followed the layout
    # the dot propagated back, not the words), eight bf16 outputs, code order.

    @triton.jit
    def _x2_pair(v, q: tl.constexpr):
        """int32 words v -> bf16 bits of codes q (low half) and q + 4 (high half), · 2**-126."""
        if q < 2:
            em = v << (6 - 4 * q)
        else:
            em = v >> (4 * q - 6)
        return (em & 0x01C001C0) | ((v << (12 - 4 * q)) & -2147450880)   # 0x80008000

    @triton.jit
    def _x2_value(t, at: tl.constexpr, sc):
        """bf16 of the value whose bf16 bits sit at bit `at` (0: low half, 16: high) of the
        pair bits t, × 2**126 × sc, computed from the bits' fields in fp32 (exact; no fp32
        subnormal: the interpreter flushes them)."""
        c = (t >> (at + 6)) & 7                         # exponent low bits and mantissa bit
        neg = ((t >> (at + 15)) & 1) != 0
        e = c >> 1
        big = (((e + 126) << 23).to(tl.float32, bitcast=True) * (1.0 + 0.5 * (c & 1)))
        v = tl.where(e == 0, 0.5 * (c & 1), big)
        return (tl.where(neg, -v, v) * sc).to(tl.bfloat16)

    @triton.jit
    def _x2_emulated(v, s):
        """What `_x2_asm` returns, in Triton ops (TRITON_INTERPRET, the CPU tests): v int32
        words, s int32 scale bytes of the same shape -> the 8 codes of each word, bf16."""
        sw = (s << 23).to(tl.float32, bitcast=True)     # 2**(s − 127); s = 0: 0
        t0, t1, t2, t3 = _x2_pair(v, 0), _x2_pair(v, 1), _x2_pair(v, 2), _x2_pair(v, 3)
        return (_x2_value(t0, 0, sw), _x2_value(t1, 0, sw), _x2_value(t2, 0, sw),
                _x2_value(t3, 0, sw), _x2_value(t0, 16, sw), _x2_value(t1, 16, sw),
                _x2_value(t2, 16, sw), _x2_value(t3, 16, sw))

    @triton.jit
    def _x2_asm(v, s):
        """v int32 words, s int32 scale bytes -> the 8 codes of each word, bf16 (one asm
        instance per word)."""
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t, u, sc, bias, z;
            mov.b32 bias, 0x7e807e80;
            mov.b32 z, 0x80008000;
            shl.b32 sc, $9, 7;
            shl.b32 u, $9, 23;
            or.b32 sc, sc, u;
            shl.b32 t, $8, 6;
            and.b32 t, t, 0x01C001C0;
            shl.b32 u, $8, 12;
            and.b32 u, u, 0x80008000;
            or.b32 t, t, u;
            fma.rn.bf16x2 t, t, bias, z;
            fma.rn.bf16x2 t, t, sc, z;
            mov.b32 {$0, $4}, t;
            shl.b32 t, $8, 2;
            and.b32 t, t, 0x01C001C0;
            shl.b32 u, $8, 8;
            and.b32 u, u, 0x80008000;
            or.b32 t, t, u;
            fma.rn.bf16x2 t, t, bias, z;
            fma.rn.bf16x2 t, t, sc, z;
            mov.b32 {$1, $5}, t;
            shr.b32 t, $8, 2;
            and.b32 t, t, 0x01C001C0;
            shl.b32 u, $8, 4;
            and.b32 u, u, 0x80008000;
            or.b32 t, t, u;
            fma.rn.bf16x2 t, t, bias, z;
            fma.rn.bf16x2 t, t, sc, z;
            mov.b32 {$2, $6}, t;
            shr.b32 t, $8, 6;
            and.b32 t, t, 0x01C001C0;
            and.b32 u, $8, 0x80008000;
            or.b32 t, t, u;
            fma.rn.bf16x2 t, t, bias, z;
            fma.rn.bf16x2 t, t, sc, z;
            mov.b32 {$3, $7}, t;
            }""",
            constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r", args=[v, s],
            dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)

    @triton.jit
    def _dequant_tile_x2(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr, ASM: tl.constexpr):
        """`_dequant_tile`'s (BN, BK) bf16 tile (the same values) by the x2 decode; ASM: the
        inline-asm form (CUDA), else its Triton-ops emulation."""
        v = _load_words(w_ptr, rows, row_ok, k0, K, BK)
        return _x2_decode(v, _load_scales(s_ptr, rows, row_ok, k0, K, BK), BN, BK, ASM)

    @triton.jit
    def _dequant_tile_x2s(w_ptr, s, rows, row_ok, k0, K: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr, ASM: tl.constexpr):
        """`_dequant_tile_x2` with the tile's scale bytes s (`_load_scales`) already loaded."""
        return _x2_decode(_load_words(w_ptr, rows, row_ok, k0, K, BK), s, BN, BK, ASM)

    @triton.jit
    def _load_words(w_ptr, rows, row_ok, k0, K: tl.constexpr, BK: tl.constexpr):
        """The (BN, BK / 8) int32 code words of rows `rows`, columns [k0, k0 + BK)."""
        kw = k0 // 8 + tl.arange(0, BK // 8)
        return tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * (K // 8)
                       + kw[None, :], mask=row_ok[:, None], other=0)

    @triton.jit
    def _x2_decode(v, s, BN: tl.constexpr, BK: tl.constexpr, ASM: tl.constexpr):
        """The x2 decode of code words v with scale bytes s -> (BN, BK) bf16, code order."""
        s = s.to(tl.int32)
        s = tl.broadcast_to(s[:, :, None], (BN, BK // 32, 4)).reshape(BN, BK // 8)
        if ASM:
            o0, o1, o2, o3, o4, o5, o6, o7 = _x2_asm(v, s)
        else:
            o0, o1, o2, o3, o4, o5, o6, o7 = _x2_emulated(v, s)
        # codes 8w + q in order: a join's new axis is the last, so pair q with q + 4, then
        # q with q + 2, then q with q + 1
        t = tl.join(tl.join(tl.join(o0, o4), tl.join(o2, o6)),
                    tl.join(tl.join(o1, o5), tl.join(o3, o7)))
        return t.reshape(BN, BK)

    @triton.jit
    def _dequant_w(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, X2: tl.constexpr):
        """The swapped / blocked kernels' weight tile: X2 0 the elementwise decode, 1 the x2
        decode emulated, 2 the x2 decode in inline asm (`MoEConfig.decode` "x2" on CUDA)."""
        if X2 == 0:
            return _dequant_tile(w_ptr, s_ptr, rows, row_ok, k0, K, BN, BK)
        return _dequant_tile_x2(w_ptr, s_ptr, rows, row_ok, k0, K, BN, BK, X2 == 2)

    @triton.jit
    def _dequant_ws(w_ptr, s, rows, row_ok, k0, K: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, X2: tl.constexpr):
        """`_dequant_w` with the tile's scale bytes s already loaded."""
        if X2 == 0:
            return _dequant_tile_s(w_ptr, s, rows, row_ok, k0, K, BN, BK)
        return _dequant_tile_x2s(w_ptr, s, rows, row_ok, k0, K, BN, BK, X2 == 2)

    # PF (`MoEConfig.prefetch_scales`): the loops below load k step i + 1's group scales in
    # step i (a loop-carried tile; the last step's load is masked off), so the decode does not
    # wait on a global load issued just before it. Triton pipelines the weight words and the
    # activations through cp.async but not the scales (a (BN, BK / 32) byte tile: 2-4 bytes
    # per row, too narrow for cp.async): without PF each k step's decode starts with that
    # load's latency (the TTGIR of the sm_90 compile: docs/perf-log/prefill.md).

    @triton.jit
    def _ew_acc(x_ptr, x_rows, x_ok, x_stride, w_ptr, s_ptr, rows, row_ok, k0,
                K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, acc, DOT_F32: tl.constexpr):
        x = tl.load(x_ptr + x_rows[:, None] * x_stride + k0 + tl.arange(0, BK)[None, :],
                    mask=x_ok[:, None], other=0.0)
        w = _dequant_tile(w_ptr, s_ptr, rows, row_ok, k0, K, BN, BK)
        return _dot(x, tl.trans(w), acc, DOT_F32)

    # ---- decode "pairs": two codes per 32-bit op, fp16 dot, scale on the accumulator -------

    @triton.jit
    def _e2m1_group(v, BN: tl.constexpr):
        """v (BN, 4) int32 = one MXFP4 group (32 codes) per row -> (BN, 32) fp16 holding
        e2m1 · 2**-14 exactly, columns in the order π(c) = c with its two lowest bits swapped.
        Code q of word v sits at bits 4q..4q+3; for i = 0..3 one shift-and-mask places code i
        in the low fp16 half and code i + 4 in the high half (2 codes per integer op)."""
        M1 = 0x0E000E00
        M2 = -2147450880                       # 0x80008000 as int32
        p0 = ((v << 9) & M1) | ((v << 12) & M2)
        p1 = ((v << 5) & M1) | ((v << 8) & M2)
        p2 = ((v << 1) & M1) | ((v << 4) & M2)
        p3 = ((v >> 3) & M1) | (v & M2)
        j0 = tl.join(p0.to(tl.int16), (p0 >> 16).to(tl.int16))   # (BN, 4, 2): 8w + 0 + 4p
        j1 = tl.join(p1.to(tl.int16), (p1 >> 16).to(tl.int16))   # 8w + 1 + 4p
        j2 = tl.join(p2.to(tl.int16), (p2 >> 16).to(tl.int16))
        j3 = tl.join(p3.to(tl.int16), (p3 >> 16).to(tl.int16))
        t = tl.join(tl.join(j0, j1), tl.join(j2, j3))            # [w, p, b, a]: 8w+4p+2a+b
        return t.reshape(BN, 32).to(tl.float16, bitcast=True)

    @triton.jit
    def _pairs_acc(x_ptr, x_rows, x_ok, x_stride, w_ptr, s_ptr, rows, row_ok, kk,
                   K: tl.constexpr, BN: tl.constexpr, acc, DOT_F32: tl.constexpr):
        """acc + (x[:, kk:kk+32] · W[rows, kk:kk+32]ᵀ) · 2**(s − 127), x fp16, W int32 words."""
        v = tl.load(w_ptr + rows[:, None] * (K // 8) + kk // 8 + tl.arange(0, 4)[None, :],
                    mask=row_ok[:, None], other=0)
        s = tl.load(s_ptr + rows * (K // 32) + kk // 32, mask=row_ok, other=127)
        c = tl.arange(0, 32)
        perm = (c & ~3) | ((c & 1) << 1) | ((c >> 1) & 1)
        x = tl.load(x_ptr + x_rows[:, None] * x_stride + kk + perm[None, :],
                    mask=x_ok[:, None], other=0.0)
        d = _dot(x, tl.trans(_e2m1_group(v, BN)), tl.zeros(acc.shape, dtype=tl.float32),
                 DOT_F32)
        sc = ((s.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)   # 2**(s − 113)
        return acc + d * sc[None, :]

    # ---- decode "split": low and high nibbles as two K=16 tiles, no interleave; fp16 dot ---

    @triton.jit
    def _split_acc(x_ptr, x_rows, x_ok, x_stride, w_ptr, s_ptr, rows, row_ok, kk,
                   K: tl.constexpr, BN: tl.constexpr, acc, DOT_F32: tl.constexpr):
        """acc + (x[:, kk:kk+32] · W[rows, kk:kk+32]ᵀ) · 2**(s − 127): the 16 bytes of a group
        give the even columns (low nibbles) and the odd ones (high nibbles) as two tiles, each
        dotted with the matching x columns."""
        j = tl.arange(0, 16)
        p = tl.load(w_ptr + rows[:, None] * (K // 2) + kk // 2 + j[None, :],
                    mask=row_ok[:, None], other=0).to(tl.int32)
        s = tl.load(s_ptr + rows * (K // 32) + kk // 32, mask=row_ok, other=127)
        lo = (((p & 7) << 9) | ((p & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True)
        hi = (((p & 0x70) << 5) | ((p & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
        xe = tl.load(x_ptr + x_rows[:, None] * x_stride + kk + 2 * j[None, :],
                     mask=x_ok[:, None], other=0.0)
        xo = tl.load(x_ptr + x_rows[:, None] * x_stride + kk + 1 + 2 * j[None, :],
                     mask=x_ok[:, None], other=0.0)
        d = _dot(xe, tl.trans(lo), tl.zeros(acc.shape, dtype=tl.float32), DOT_F32)
        d = _dot(xo, tl.trans(hi), d, DOT_F32)
        sc = ((s.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)   # 2**(s − 113)
        return acc + d * sc[None, :]

    @triton.jit
    def _acc_step(x_ptr, x_rows, x_ok, x_stride, w_ptr, s_ptr, rows, row_ok, k0,
                  K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, acc,
                  DECODE: tl.constexpr, DOT_F32: tl.constexpr):
        """acc + x[:, k0:k0+BK] · W[rows, k0:k0+BK]ᵀ with W MXFP4 (DECODE 0 elementwise,
        1 pairs (W as int32 words), 2 split)."""
        if DECODE == 0:
            acc = _ew_acc(x_ptr, x_rows, x_ok, x_stride, w_ptr, s_ptr, rows, row_ok, k0, K, BN,
                          BK, acc, DOT_F32)
        else:
            for g in tl.static_range(BK // 32):
                if DECODE == 1:
                    acc = _pairs_acc(x_ptr, x_rows, x_ok, x_stride, w_ptr, s_ptr, rows, row_ok,
                                     k0 + 32 * g, K, BN, acc, DOT_F32)
                else:
                    acc = _split_acc(x_ptr, x_rows, x_ok, x_stride, w_ptr, s_ptr, rows, row_ok,
                                     k0 + 32 * g, K, BN, acc, DOT_F32)
        return acc

    @triton.jit
    def _gate_up_kernel(z_ptr, w_ptr, s_ptr, pairs_ptr, sorted_e_ptr, chunk_start_ptr,
                        chunk_end_ptr, num_chunks_ptr, a_ptr, top_k, beta, lin_beta,
                        L: tl.constexpr, I: tl.constexpr, HAS_LIN: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        WPR: tl.constexpr, DECODE: tl.constexpr, DOT_F32: tl.constexpr,
                        TILE_MAJOR: tl.constexpr = False):
        """a[p, n] = SiTU(W1_e z[t], W3_e z[t])[n] for the pairs of chunk c.
        WPR: elements of w per row (L/2 bytes, or L/8 int32 words for the pairs decode)."""
        c, tile = _chunk_and_tile(TILE_MAJOR)
        if c >= tl.load(num_chunks_ptr):
            return
        pair, m_ok, e = _chunk(c, chunk_start_ptr, chunk_end_ptr, pairs_ptr, sorted_e_ptr, BM)
        tok = pair // top_k
        n = tile * BN + tl.arange(0, BN)
        n_ok = n < I
        w_e = w_ptr + e * (2 * I * WPR)
        s_e = s_ptr + e * (2 * I * (L // 32))
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, L, BK):
            acc_g = _acc_step(z_ptr, tok, m_ok, L, w_e, s_e, n, n_ok, k0, L, BN, BK, acc_g,
                              DECODE, DOT_F32)
            acc_u = _acc_step(z_ptr, tok, m_ok, L, w_e, s_e, n + I, n_ok, k0, L, BN, BK, acc_u,
                              DECODE, DOT_F32)
        g = acc_g.to(tl.bfloat16).to(tl.float32)
        u = acc_u.to(tl.bfloat16).to(tl.float32)
        act = beta * tanh_f32(g / beta) * tl.sigmoid(g)
        if HAS_LIN:
            u = lin_beta * tanh_f32(u / lin_beta)
        tl.store(a_ptr + pair[:, None] * I + n[None, :],
                 (act * u).to(tl.bfloat16).to(a_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _down_kernel(a_ptr, w_ptr, s_ptr, pairs_ptr, sorted_e_ptr, chunk_start_ptr,
                     chunk_end_ptr, num_chunks_ptr, y_ptr, L: tl.constexpr, I: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     WPR: tl.constexpr, DECODE: tl.constexpr, DOT_F32: tl.constexpr,
                     TILE_MAJOR: tl.constexpr = False):
        """y[p, n] = bf16(W2_e a[p])[n] (bf16) for the pairs of chunk c; the
        routing weight is applied by `_weighted_sum_kernel`."""
        c, tile = _chunk_and_tile(TILE_MAJOR)
        if c >= tl.load(num_chunks_ptr):
            return
        pair, m_ok, e = _chunk(c, chunk_start_ptr, chunk_end_ptr, pairs_ptr, sorted_e_ptr, BM)
        n = tile * BN + tl.arange(0, BN)
        n_ok = n < L
        w_e = w_ptr + e * (L * WPR)
        s_e = s_ptr + e * (L * (I // 32))
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, I, BK):
            acc = _acc_step(a_ptr, pair, m_ok, I, w_e, s_e, n, n_ok, k0, I, BN, BK, acc,
                            DECODE, DOT_F32)
        tl.store(y_ptr + pair[:, None] * L + n[None, :], acc.to(tl.bfloat16),
                 mask=m_ok[:, None] & n_ok[None, :])

    # ---- swapped operands (prefill): the dequantized weight tile is the dot's A operand ---
    #
    # accᵀ (BN, BM) = W[rows, k-block] (BN, BK) · xᵀ (BK, BM): the tile decoded in registers
    # feeds the tensor cores as the register operand (Hopper's wgmma takes A from registers,
    # B only from shared memory), the activations are the shared-memory operand, and a chunk
    # can hold 128-256 pairs of one expert, so each weight element is decoded once per that
    # many pairs. The gate/up output `a` is kept in the pairs' SORTED order (row m = position
    # in the expert-grouped list), so the down kernel reads each chunk's rows contiguously.

    @triton.jit
    def _swap_acc(x_ptr, rows, row_ok, K: tl.constexpr, w_e, s_e, n, n_ok, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, DOT_F32: tl.constexpr,
                  X2: tl.constexpr = 0, PF: tl.constexpr = False):
        """accᵀ (BN, BM) fp32 = W[n, :K] · x[rows, :K]ᵀ: the (BN, BK) tiles of one expert's
        MXFP4 matrix (rows n) decoded in registers as the dots' A operand, x's BM rows (K
        wide, bf16) the B operand; rows with row_ok False read zeros. PF: scales one k step
        ahead."""
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        if PF:
            s_nx = _load_scales(s_e, n, n_ok, 0, K, BK)
        for k0 in range(0, K, BK):
            x = tl.load(x_ptr + rows[:, None] * K + k0 + tl.arange(0, BK)[None, :],
                        mask=row_ok[:, None], other=0.0)
            if PF:
                s = s_nx
                s_nx = _load_scales(s_e, n, n_ok & (k0 + BK < K), k0 + BK, K, BK)
                w = _dequant_ws(w_e, s, n, n_ok, k0, K, BN, BK, X2)
            else:
                w = _dequant_w(w_e, s_e, n, n_ok, k0, K, BN, BK, X2)
            acc = _dot(w, tl.trans(x), acc, DOT_F32)
        return acc

    @triton.jit
    def _gate_up_swap_kernel(z_ptr, w_ptr, s_ptr, pairs_ptr, sorted_e_ptr, chunk_start_ptr,
                             chunk_end_ptr, num_chunks_ptr, a_ptr, top_k, beta, lin_beta,
                             L: tl.constexpr, I: tl.constexpr, HAS_LIN: tl.constexpr,
                             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                             DOT_F32: tl.constexpr,
                             TILE_MAJOR: tl.constexpr = False, X2: tl.constexpr = 0):
        """a_sorted[m, n] = SiTU(W1_e z[t], W3_e z[t])[n] for the sorted positions m of chunk
        c, computed transposed (n rows, pairs columns)."""
        c, tile = _chunk_and_tile(TILE_MAJOR)
        if c >= tl.load(num_chunks_ptr):
            return
        m, pair, m_ok, e = _chunk_rows(c, chunk_start_ptr, chunk_end_ptr, pairs_ptr,
                                       sorted_e_ptr, BM)
        tok = pair // top_k
        n = tile * BN + tl.arange(0, BN)
        n_ok = n < I
        w_e = w_ptr + e * (2 * I * (L // 2))
        s_e = s_ptr + e * (2 * I * (L // 32))
        acc_g = tl.zeros((BN, BM), dtype=tl.float32)
        acc_u = tl.zeros((BN, BM), dtype=tl.float32)
        for k0 in range(0, L, BK):
            x = tl.load(z_ptr + tok[:, None] * L + k0 + tl.arange(0, BK)[None, :],
                        mask=m_ok[:, None], other=0.0)
            xt = tl.trans(x)
            acc_g = _dot(_dequant_w(w_e, s_e, n, n_ok, k0, L, BN, BK, X2), xt, acc_g, DOT_F32)
            acc_u = _dot(_dequant_w(w_e, s_e, n + I, n_ok, k0, L, BN, BK, X2), xt, acc_u,
                         DOT_F32)
        g = acc_g.to(tl.bfloat16).to(tl.float32)
        u = acc_u.to(tl.bfloat16).to(tl.float32)
        act = beta * tanh_f32(g / beta) * tl.sigmoid(g)
        if HAS_LIN:
            u = lin_beta * tanh_f32(u / lin_beta)
        tl.store(a_ptr + m[None, :] * I + n[:, None], (act * u).to(tl.bfloat16),
                 mask=m_ok[None, :] & n_ok[:, None])

    @triton.jit
    def _gate_up_split_kernel(z_ptr, w_ptr, s_ptr, pairs_ptr, sorted_e_ptr, chunk_start_ptr,
                              chunk_end_ptr, num_chunks_ptr, gu_ptr, top_k,
                              L: tl.constexpr, I2: tl.constexpr, BM: tl.constexpr,
                              BN: tl.constexpr, BK: tl.constexpr, DOT_F32: tl.constexpr,
                              TILE_MAJOR: tl.constexpr = False, X2: tl.constexpr = 0,
                              PF: tl.constexpr = False):
        """gu_sorted[m, n] = bf16(W13_e z[t])[n] for one BN-row tile of the 2I gate ‖ up rows
        and the sorted positions m of chunk c (`MoEConfig.split_gate_up`): one (BN, BM) fp32
        accumulator per program where `_gate_up_swap_kernel` holds two, so a program needs
        about half the registers (that kernel: 255 per thread, 2 CTAs of 4 warps per SM on
        the H100); `_situ_rows_kernel` then makes `a` from gu. bf16 is the reference's
        rounding point of W1 z and W3 z, so the split is exact."""
        c, tile = _chunk_and_tile(TILE_MAJOR)
        if c >= tl.load(num_chunks_ptr):
            return
        m, pair, m_ok, e = _chunk_rows(c, chunk_start_ptr, chunk_end_ptr, pairs_ptr,
                                       sorted_e_ptr, BM)
        n = tile * BN + tl.arange(0, BN)
        n_ok = n < I2
        acc = _swap_acc(z_ptr, pair // top_k, m_ok, L, w_ptr + e * (I2 * (L // 2)),
                        s_ptr + e * (I2 * (L // 32)), n, n_ok, BM, BN, BK, DOT_F32, X2, PF)
        tl.store(gu_ptr + m[None, :] * I2 + n[:, None], acc.to(tl.bfloat16),
                 mask=m_ok[None, :] & n_ok[:, None])

    @triton.jit(do_not_specialize=["P"])
    def _situ_rows_kernel(gu_ptr, a_ptr, P, beta, lin_beta, I: tl.constexpr,
                          HAS_LIN: tl.constexpr, BT: tl.constexpr, BL: tl.constexpr):
        """a[m, j] = SiTU(gu[m, j], gu[m, I + j]) in bf16 for rows m < P (the gate/up
        kernel's epilogue on the split form's gu buffer, the same fp32 arithmetic)."""
        m = tl.program_id(0) * BT + tl.arange(0, BT)
        j = tl.program_id(1) * BL + tl.arange(0, BL)
        ok = (m < P)[:, None] & (j < I)[None, :]
        g = tl.load(gu_ptr + m[:, None] * (2 * I) + j[None, :], mask=ok, other=0.0)
        u = tl.load(gu_ptr + m[:, None] * (2 * I) + I + j[None, :], mask=ok, other=0.0)
        g, u = g.to(tl.float32), u.to(tl.float32)
        act = beta * tanh_f32(g / beta) * tl.sigmoid(g)
        if HAS_LIN:
            u = lin_beta * tanh_f32(u / lin_beta)
        tl.store(a_ptr + m[:, None] * I + j[None, :], (act * u).to(tl.bfloat16), mask=ok)

    @triton.jit
    def _down_swap_kernel(a_ptr, w_ptr, s_ptr, pairs_ptr, sorted_e_ptr, chunk_start_ptr,
                          chunk_end_ptr, num_chunks_ptr, y_ptr, L: tl.constexpr,
                          I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr, DOT_F32: tl.constexpr,
                          TILE_MAJOR: tl.constexpr = False, X2: tl.constexpr = 0,
                          PF: tl.constexpr = False):
        """y[p, n] = bf16(W2_e a[p])[n] for the pairs of chunk c, computed
        transposed; a in sorted order (`_gate_up_swap_kernel`), y in pair order."""
        c, tile = _chunk_and_tile(TILE_MAJOR)
        if c >= tl.load(num_chunks_ptr):
            return
        m, pair, m_ok, e = _chunk_rows(c, chunk_start_ptr, chunk_end_ptr, pairs_ptr,
                                       sorted_e_ptr, BM)
        n = tile * BN + tl.arange(0, BN)
        n_ok = n < L
        acc = _swap_acc(a_ptr, m, m_ok, I, w_ptr + e * (L * (I // 2)),
                        s_ptr + e * (L * (I // 32)), n, n_ok, BM, BN, BK, DOT_F32, X2, PF)
        tl.store(y_ptr + pair[None, :] * L + n[:, None], acc.to(tl.bfloat16),
                 mask=m_ok[None, :] & n_ok[:, None])

    # ---- blocked (prefill): one decode per weight tile for up to 4 × 64 pairs -------------
    #
    # A chunk of ≤ NBMAX·SUB pairs of one expert is cut into nb = ⌈len / SUB⌉ sub-blocks of
    # SUB = 64 pairs; each K step decodes the (BN, BK) weight tile ONCE and feeds it to nb
    # dots (one (BN, SUB) fp32 accumulator each), so an expert of 146 pairs costs one decode
    # and 3 × 64 dot columns, where 128-pair chunks cost two decodes and 2 × 128. One launch:
    # each program branches on its chunk's nb to a body compiled for that many sub-blocks
    # (uniform per program, so no dot is predicated and no program is spent on another
    # class's chunks).

    @triton.jit
    def _sub_rows(xrow_ptr, top_k, start, end, i: tl.constexpr, SUB: tl.constexpr,
                  GATHER: tl.constexpr):
        """(x rows, valid) of sub-block i: sorted positions start + SUB·i + [0, SUB) below
        end; GATHER: the row is the position's pair // top_k (z's token rows)."""
        m = start + i * SUB + tl.arange(0, SUB)
        ok = m < end
        if GATHER:
            m = tl.load(xrow_ptr + m, mask=ok, other=0) // top_k
        return m, ok

    @triton.jit
    def _sub_dot(w, x_ptr, rows, ok, K: tl.constexpr, k0, BK: tl.constexpr, acc,
                 DOT_F32: tl.constexpr):
        """acc + w · x[rows, k0:k0+BK]ᵀ (invalid rows read zeros)."""
        x = tl.load(x_ptr + rows[:, None] * K + k0 + tl.arange(0, BK)[None, :],
                    mask=ok[:, None], other=0.0)
        return _dot(w, tl.trans(x), acc, DOT_F32)

    @triton.jit
    def _blocked_accs(x_ptr, r0, ok0, r1, ok1, r2, ok2, r3, ok3, K: tl.constexpr, w_e, s_e, n,
                      n_ok, SUB: tl.constexpr, NB: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, DOT_F32: tl.constexpr, X2: tl.constexpr = 0,
                      PF: tl.constexpr = False):
        """NB accumulators (BN, SUB): acc_i = W[n, :K] · x[r_i, :K]ᵀ for sub-block i's x rows
        r_i (valid ok_i, `_sub_rows`); unused ones stay zero. PF: scales one k step ahead."""
        acc0 = tl.zeros((BN, SUB), dtype=tl.float32)
        acc1 = tl.zeros((BN, SUB), dtype=tl.float32)
        acc2 = tl.zeros((BN, SUB), dtype=tl.float32)
        acc3 = tl.zeros((BN, SUB), dtype=tl.float32)
        if PF:
            s_nx = _load_scales(s_e, n, n_ok, 0, K, BK)
        for k0 in range(0, K, BK):
            if PF:                                                   # decoded once, NB dots
                s = s_nx
                s_nx = _load_scales(s_e, n, n_ok & (k0 + BK < K), k0 + BK, K, BK)
                w = _dequant_ws(w_e, s, n, n_ok, k0, K, BN, BK, X2)
            else:
                w = _dequant_w(w_e, s_e, n, n_ok, k0, K, BN, BK, X2)
            acc0 = _sub_dot(w, x_ptr, r0, ok0, K, k0, BK, acc0, DOT_F32)
            if NB > 1:
                acc1 = _sub_dot(w, x_ptr, r1, ok1, K, k0, BK, acc1, DOT_F32)
            if NB > 2:
                acc2 = _sub_dot(w, x_ptr, r2, ok2, K, k0, BK, acc2, DOT_F32)
            if NB > 3:
                acc3 = _sub_dot(w, x_ptr, r3, ok3, K, k0, BK, acc3, DOT_F32)
        return acc0, acc1, acc2, acc3

    @triton.jit
    def _blocked_store(out_ptr, row_ptr, ROW: tl.constexpr, start, end, i: tl.constexpr, acc,
                       n, n_ok, N: tl.constexpr, SUB: tl.constexpr):
        """Sub-block i's accumulator (BN, SUB) as bf16 into out[row, n] (row = the sorted
        position, or with ROW the pair row_ptr[position])."""
        m = start + i * SUB + tl.arange(0, SUB)
        ok = m < end
        r = tl.load(row_ptr + m, mask=ok, other=0) if ROW else m
        tl.store(out_ptr + r[None, :] * N + n[:, None], acc.to(tl.bfloat16),
                 mask=n_ok[:, None] & ok[None, :])

    @triton.jit
    def _situ_store(a_ptr, start, end, i: tl.constexpr, acc, j, j_ok, I: tl.constexpr,
                    HALF: tl.constexpr, SUB: tl.constexpr, beta, lin_beta,
                    HAS_LIN: tl.constexpr):
        """SITU: sub-block i's accumulator (2·HALF, SUB), gate rows then the matching up rows
        (`_situ_rows`), as a[m, j] = SiTU(bf16 gate, bf16 up) in bf16 at the sorted positions
        m: `_situ_rows_kernel`'s arithmetic on the values the split form's gu buffer holds."""
        m = start + i * SUB + tl.arange(0, SUB)
        ok = m < end
        v = acc.to(tl.bfloat16).to(tl.float32)                # the gu buffer's rounding
        g, u = tl.split(tl.permute(tl.reshape(v, (2, HALF, SUB)), (1, 2, 0)))
        act = beta * tanh_f32(g / beta) * tl.sigmoid(g)
        if HAS_LIN:
            u = lin_beta * tanh_f32(u / lin_beta)
        tl.store(a_ptr + m[None, :] * I + j[:, None], (act * u).to(tl.bfloat16),
                 mask=j_ok[:, None] & ok[None, :])

    @triton.jit
    def _sub_store(out_ptr, row_ptr, ROW: tl.constexpr, start, end, i: tl.constexpr, acc, n,
                   n_ok, j, j_ok, N: tl.constexpr, SUB: tl.constexpr, BN: tl.constexpr,
                   SITU: tl.constexpr, beta, lin_beta, HAS_LIN: tl.constexpr):
        """Sub-block i's epilogue: SITU `_situ_store` into `a` (columns j), else
        `_blocked_store` (weight rows n)."""
        if SITU:
            _situ_store(out_ptr, start, end, i, acc, j, j_ok, N // 2, BN // 2, SUB, beta,
                        lin_beta, HAS_LIN)
        else:
            _blocked_store(out_ptr, row_ptr, ROW, start, end, i, acc, n, n_ok, N, SUB)

    @triton.jit
    def _situ_rows(tile, I: tl.constexpr, BN: tl.constexpr):
        """SITU's tile `tile`: weight rows (gate rows j, then up rows I + j, for its BN / 2
        columns j of `a`) -> (rows, rows ok, j, j ok)."""
        HALF: tl.constexpr = BN // 2
        r = tl.arange(0, BN)
        j_r = tile * HALF + r % HALF
        j = tile * HALF + tl.arange(0, HALF)
        return tl.where(r < HALF, j_r, I + j_r), j_r < I, j, j < I

    @triton.jit
    def _blocked_body(x_ptr, xrow_ptr, top_k, start, end, K: tl.constexpr, w_e, s_e, tile,
                      out_ptr, row_ptr, ROW: tl.constexpr, N: tl.constexpr, SUB: tl.constexpr,
                      NB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      TILES: tl.constexpr, GATHER: tl.constexpr, DOT_F32: tl.constexpr,
                      X2: tl.constexpr = 0, PF: tl.constexpr = False,
                      SITU: tl.constexpr = False, beta=1.0, lin_beta=1.0,
                      HAS_LIN: tl.constexpr = False):
        """Output tiles tile·TILES + [0, TILES) (BN weight rows each) of a chunk of NB
        sub-blocks: its x rows are found once, then each tile's K loop and stores. SITU (the
        gate/up GEMM, N = 2I): each tile is BN / 2 gate rows and their up rows, stored as
        SiTU(gate, up) into `a` (P, I) (`_situ_store`)."""
        r0, ok0 = _sub_rows(xrow_ptr, top_k, start, end, 0, SUB, GATHER)
        r1, ok1 = _sub_rows(xrow_ptr, top_k, start, end, 1, SUB, GATHER)
        r2, ok2 = _sub_rows(xrow_ptr, top_k, start, end, 2, SUB, GATHER)
        r3, ok3 = _sub_rows(xrow_ptr, top_k, start, end, 3, SUB, GATHER)
        for t in tl.static_range(TILES):
            if SITU:
                n, n_ok, j, j_ok = _situ_rows(tile * TILES + t, N // 2, BN)
            else:
                n = (tile * TILES + t) * BN + tl.arange(0, BN)
                n_ok = n < N
                j, j_ok = n, n_ok                                   # unused: no SiTU
            acc0, acc1, acc2, acc3 = _blocked_accs(x_ptr, r0, ok0, r1, ok1, r2, ok2, r3, ok3,
                                                   K, w_e, s_e, n, n_ok, SUB, NB, BN, BK,
                                                   DOT_F32, X2, PF)
            _sub_store(out_ptr, row_ptr, ROW, start, end, 0, acc0, n, n_ok, j, j_ok, N, SUB,
                       BN, SITU, beta, lin_beta, HAS_LIN)
            if NB > 1:
                _sub_store(out_ptr, row_ptr, ROW, start, end, 1, acc1, n, n_ok, j, j_ok, N,
                           SUB, BN, SITU, beta, lin_beta, HAS_LIN)
            if NB > 2:
                _sub_store(out_ptr, row_ptr, ROW, start, end, 2, acc2, n, n_ok, j, j_ok, N,
                           SUB, BN, SITU, beta, lin_beta, HAS_LIN)
            if NB > 3:
                _sub_store(out_ptr, row_ptr, ROW, start, end, 3, acc3, n, n_ok, j, j_ok, N,
                           SUB, BN, SITU, beta, lin_beta, HAS_LIN)

    @triton.jit
    def _blocked_dispatch(x_ptr, xrow_ptr, top_k, start, end, K: tl.constexpr, w_e, s_e, tile,
                          out_ptr, row_ptr, ROW: tl.constexpr, N: tl.constexpr,
                          SUB: tl.constexpr, NBMAX: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr, TILES: tl.constexpr, GATHER: tl.constexpr,
                          DOT_F32: tl.constexpr, X2: tl.constexpr = 0,
                          PF: tl.constexpr = False, SITU: tl.constexpr = False, beta=1.0,
                          lin_beta=1.0, HAS_LIN: tl.constexpr = False):
        """The body for this chunk's sub-block count nb = ⌈(end − start) / SUB⌉ ≤ NBMAX."""
        nb = (end - start + SUB - 1) // SUB
        if nb == 1:
            _blocked_body(x_ptr, xrow_ptr, top_k, start, end, K, w_e, s_e, tile, out_ptr,
                          row_ptr, ROW, N, SUB, 1, BN, BK, TILES, GATHER, DOT_F32, X2,
                          PF, SITU, beta, lin_beta, HAS_LIN)
        if NBMAX > 1:
            if nb == 2:
                _blocked_body(x_ptr, xrow_ptr, top_k, start, end, K, w_e, s_e, tile, out_ptr,
                              row_ptr, ROW, N, SUB, 2, BN, BK, TILES, GATHER, DOT_F32, X2,
                              PF, SITU, beta, lin_beta, HAS_LIN)
        if NBMAX > 2:
            if nb == 3:
                _blocked_body(x_ptr, xrow_ptr, top_k, start, end, K, w_e, s_e, tile, out_ptr,
                              row_ptr, ROW, N, SUB, 3, BN, BK, TILES, GATHER, DOT_F32, X2,
                              PF, SITU, beta, lin_beta, HAS_LIN)
        if NBMAX > 3:
            if nb == 4:
                _blocked_body(x_ptr, xrow_ptr, top_k, start, end, K, w_e, s_e, tile, out_ptr,
                              row_ptr, ROW, N, SUB, 4, BN, BK, TILES, GATHER, DOT_F32, X2,
                              PF, SITU, beta, lin_beta, HAS_LIN)

    @triton.jit
    def _blocked_gemm(x_ptr, w_ptr, s_ptr, pairs_ptr, sorted_e_ptr, chunk_start_ptr,
                      chunk_end_ptr, num_chunks_ptr, out_ptr, top_k, K: tl.constexpr,
                      N: tl.constexpr, SUB: tl.constexpr, NBMAX: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, TILES: tl.constexpr,
                      GATE_UP: tl.constexpr, ROW: tl.constexpr, DOT_F32: tl.constexpr,
                      X2: tl.constexpr = 0, PF: tl.constexpr = False,
                      SITU: tl.constexpr = False, beta=1.0, lin_beta=1.0,
                      HAS_LIN: tl.constexpr = False):
        """Program (tile, chunk c) of a blocked GEMM over one expert's (N, K) MXFP4 matrix:
        GATE_UP, x = z (token rows gathered), out = the sorted (P, 2I) gu buffer; else x =
        the sorted `a`, out = y in pair order (ROW: out rows by pair). Each program writes
        TILES output tiles of BN. Grid (N / (BN·TILES), worst-case chunks): tile-major."""
        tile, c = tl.program_id(0), tl.program_id(1)
        if c < tl.load(num_chunks_ptr):
            start = tl.load(chunk_start_ptr + c)
            end = tl.load(chunk_end_ptr + c)
            e = tl.load(sorted_e_ptr + start).to(tl.int64)
            _blocked_dispatch(x_ptr, pairs_ptr, top_k, start, end, K,
                              w_ptr + e * (N * (K // 2)), s_ptr + e * (N * (K // 32)), tile,
                              out_ptr, pairs_ptr, ROW, N, SUB, NBMAX, BN, BK, TILES, GATE_UP,
                              DOT_F32, X2, PF, SITU, beta, lin_beta, HAS_LIN)

    @triton.jit
    def _gate_up_blocked_kernel(z_ptr, w_ptr, s_ptr, pairs_ptr, sorted_e_ptr, chunk_start_ptr,
                                chunk_end_ptr, num_chunks_ptr, gu_ptr, top_k, beta, lin_beta,
                                L: tl.constexpr, I2: tl.constexpr, SUB: tl.constexpr,
                                NBMAX: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                                DOT_F32: tl.constexpr, X2: tl.constexpr = 0,
                                PF: tl.constexpr = False, SITU: tl.constexpr = False,
                                HAS_LIN: tl.constexpr = False):
        """gu_sorted[m, n] = bf16(W13_e z[t])[n] (the split form's buffer) for the sorted
        positions m of each chunk (its own kernel name: profiles tell the GEMMs apart); SITU:
        gu_ptr is `a` (P, I) and each program stores SiTU(gate, up) of its BN / 2 columns
        (`MoEConfig.fuse_situ`: no gu buffer, no SiTU pass)."""
        _blocked_gemm(z_ptr, w_ptr, s_ptr, pairs_ptr, sorted_e_ptr, chunk_start_ptr,
                      chunk_end_ptr, num_chunks_ptr, gu_ptr, top_k, L, I2, SUB, NBMAX, BN, BK,
                      1, True, False, DOT_F32, X2, PF, SITU, beta, lin_beta, HAS_LIN)

    @triton.jit
    def _down_blocked_kernel(a_ptr, w_ptr, s_ptr, pairs_ptr, sorted_e_ptr, chunk_start_ptr,
                             chunk_end_ptr, num_chunks_ptr, y_ptr, L: tl.constexpr,
                             I: tl.constexpr, SUB: tl.constexpr, NBMAX: tl.constexpr,
                             BN: tl.constexpr, BK: tl.constexpr, TILES: tl.constexpr,
                             DOT_F32: tl.constexpr, X2: tl.constexpr = 0,
                             PF: tl.constexpr = False):
        """y[p, n] = bf16(W2_e a[m])[n] (pair order), a in sorted order (the gate/up's);
        TILES output tiles per program (K = I is short: its rows found once, more work per
        program)."""
        _blocked_gemm(a_ptr, w_ptr, s_ptr, pairs_ptr, sorted_e_ptr, chunk_start_ptr,
                      chunk_end_ptr, num_chunks_ptr, y_ptr, 1, I, L, SUB, NBMAX, BN, BK,
                      TILES, False, True, DOT_F32, X2, PF)

    @triton.jit(do_not_specialize=["T"])
    def _weighted_sum_kernel(y_ptr, topw_ptr, out_ptr, T, out_stride, row_ptr,
                             K: tl.constexpr, L: tl.constexpr, BT: tl.constexpr,
                             BL: tl.constexpr, HAS_ROW: tl.constexpr = False):
        """out[t, n] = Σ_j w[t, j] · y[t·K + j, n] in fp32, j in order (y bf16 (T·K, L); out
        rows `out_stride` elements apart: a column block of a wider buffer). HAS_ROW: pair
        (t, j)'s row of y is row[t·K + j] (y in another order, kernels/moe_grouped.py's
        expert-sorted one)."""
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        n = tl.program_id(1) * BL + tl.arange(0, BL)
        ok = (t < T)[:, None] & (n < L)[None, :]
        acc = tl.zeros((BT, BL), dtype=tl.float32)
        for j in tl.static_range(K):
            wt = tl.load(topw_ptr + t * K + j, mask=t < T, other=0.0)
            if HAS_ROW:
                r = tl.load(row_ptr + t * K + j, mask=t < T, other=0).to(tl.int64)
            else:
                r = t * K + j
            y = tl.load(y_ptr + r[:, None] * L + n[None, :], mask=ok, other=0.0)
            acc += y.to(tl.float32) * wt[:, None]
        tl.store(out_ptr + t[:, None] * out_stride + n[None, :], acc, mask=ok)


# ---- launch configuration ------------------------------------------------------------------

@dataclass(frozen=True)
class MoEConfig:
    """Tile sizes of the two expert GEMMs (compile-time constants).

    decode "elementwise": `_dequant_tile` (each code to fp32, scaled, to bf16; bf16 dot);
    "pairs": `_e2m1_group` (two codes per integer op on int32 words, fp16 dot, the group scale
    on the accumulator); "split": `_split_acc` (low / high nibbles as two K=16 fp16 tiles, no
    interleave, scale on the accumulator). BK (a multiple of 32) must divide K (the latent for
    gate/up, I for down); pairs/split step BK / 32 groups per loop iteration. block_m (a power
    of two ≥ 16): the pairs of one expert one program multiplies; a prefill step's thousands of
    pairs per expert re-read each expert's weights once per block_m pairs. The swapped and
    blocked kernels take decode "elementwise" or "x2" (`_dequant_tile_x2`: eight codes per
    32-bit word, bf16x2 arithmetic; the same values). swap_ab: the `_gate_up_swap_kernel` /
    `_down_swap_kernel` pair, which compute the transposed products so the decoded tile is
    the register operand and block_m is the dots' N (up to wgmma's 256; two (BN, block_m)
    fp32 accumulators per program); BN is then the dots' M (64 rows per warpgroup). tile_major: the programs of one chunk (its I / BN
    gate/up tiles, its L / BN down tiles) are consecutive in the grid, so the chunk's gathered
    z rows (gate/up) and `a` rows (down) come from HBM once and from L2 for its other tiles;
    chunk-major (the default before) runs every chunk of tile 0 first and re-reads each
    chunk's rows per tile from HBM once they have left L2. split_gate_up (with swap_ab): the
    gate/up kernel takes one BN-row tile of the 2I gate ‖ up rows per program (one
    accumulator instead of two: about half the registers, more CTAs per SM; block_m 256 fits)
    and writes bf16 W13 z to a (P, 2I) buffer, then `_situ_rows_kernel` makes `a` (exact:
    bf16 is the reference's rounding point there). blocked (the split form's buffers): the
    `_gate_up_blocked_kernel` / `_down_blocked_kernel` pair, chunks of ≤ block_m (64-256)
    pairs cut into 64-pair sub-blocks that share each decoded weight tile, one launch per
    GEMM whose programs each run the body compiled for their chunk's sub-block count;
    down_tiles: the blocked down kernel's output tiles per program (its K = I is 3 k steps
    at TP16; 4 and 8 tiles were slower than 1 at 8,192 tokens on the H200, so 1 everywhere
    but the sweep: bench/results/moe-prefill-sweep-h200-2026-12-07-*.json); blocked_down
    False: the down kernel is
    the swapped one on 128-pair chunks of the same order. swap_ab, split_gate_up and
    tile_major do not apply (always tile-major). ogs ("strided" / "hopper"): the call runs
    on triton_kernels' matmul_ogs in that weight layout (kernels/moe_ogs.py); the tile
    fields then do not apply. prefetch_scales: the swapped kernels with split_gate_up and
    the blocked ones load each k step's group scales one step ahead (the kernels' `PF`; the
    fused swapped gate/up kernel does not take it); the same values. fuse_situ (blocked):
    each gate/up tile holds BN / 2 gate rows and the matching up rows and its epilogue
    stores SiTU(gate, up) into `a` (`_situ_store`), so the (P, 2I) gu buffer and the SiTU
    pass go; the same values (gate and up rounded to bf16 first, as the buffer rounds)."""
    gate_up_bn: int
    gate_up_bk: int
    down_bn: int
    down_bk: int
    num_warps: int = 4
    num_stages: int = 3
    decode: str = "elementwise"
    block_m: int = BLOCK_M      # pairs per chunk (the dots' M): 16 for decode, more for prefill
    swap_ab: bool = False       # prefill: weight tile as the dots' A (register) operand
    tile_major: bool = False    # grid (tiles, chunks): a chunk's output tiles run back to back
    split_gate_up: bool = False  # swap_ab: gate and up rows in separate tiles + a SiTU pass
    grouped_bf16: bool = False  # kernels/moe_grouped.py: dequantize, then bf16 grouped GEMMs
    down_warps: int = 0         # the down kernel's warps (0: num_warps, as the gate/up's)
    blocked: bool = False       # chunks of ≤ block_m pairs in 64-pair sub-blocks, one decode
    blocked_down: bool = True   # blocked: the down kernel blocked too (else swapped, 128)
    down_tiles: int = 1         # blocked down: output tiles of down_bn per program
    ogs: str = ""               # kernels/moe_ogs.py: matmul_ogs in this weight layout
    prefetch_scales: bool = False  # split / blocked kernels: scales one k step ahead (PF)
    fuse_situ: bool = False     # blocked: gate/up tiles of gate rows + their up rows, SiTU


# Measured best configs, keyed by (pairs ≤ SMALL_PAIRS, E, I, L): the winners of the
# scripts/explore/layer_moe_sweep.py run in bench/results/layer-h200-2026-11-29.json (H200, Triton
# 3.6; batch 1 for the small key, 64 for the large one). K3 per-rank experts at TP8 (I = 384)
# and TP16 (I = 192). Missing keys: the `default_config` rule.
SMALL_PAIRS = 64
# Prefill steps: from this many pairs (128 tokens at K3's top-16) `prefill_config` or its
# PREFILL_TUNED entry (keyed by (E, I, L)).
PREFILL_PAIRS = 2048
PREFILL_TUNED: dict[tuple[int, int, int], MoEConfig] = {}
TUNED: dict[tuple[bool, int, int, int], MoEConfig] = {
    (True, 896, 384, 3584): MoEConfig(16, 64, 128, 64, num_stages=4, decode="pairs"),
    (False, 896, 384, 3584): MoEConfig(64, 64, 128, 64, num_stages=4, decode="split"),
    (True, 896, 192, 3584): MoEConfig(16, 256, 128, 64, decode="elementwise"),
    (False, 896, 192, 3584): MoEConfig(64, 64, 128, 64, num_stages=4, decode="split"),
}


# From this many pairs an eager call with no explicit config takes the grouped bf16 path
# (kernels/moe_grouped.py: the touched experts decoded once into a bf16 scratch, then
# torch._grouped_mm) instead of `prefill_config`; 0: never. A call inside a CUDA graph capture
# never does (its scratch is allocated per call), nor one on a GPU below sm90. 0 as shipped:
# the grouped path measured slower on the H100 (K3 TP16, balanced routing: one 8,192-token
# call 5.91 ms against the split kernel's 4.43, 2,048 tokens 4.55 against 2.47; the 24-layer
# 8k prompt's MFU 0.265 against 0.327 in the same run: bench/results/moe-prefill-sweep-h100-
# 2026-12-07-grouped.json, prefill-h100-2026-12-07-grouped24.json). Kept as the prefill
# bench's same-run alternative (`--grouped-pairs`), not as a deployment setting.
GROUPED_PAIRS = 0


def grouped_wanted(pairs: int, device: torch.device, config: MoEConfig | None = None) -> bool:
    """Whether `fused_moe_mxfp4_triton` runs this call on the grouped bf16 path."""
    if config is not None:
        return config.grouped_bf16
    if not GROUPED_PAIRS or pairs < GROUPED_PAIRS or device.type != "cuda":
        return False
    return (torch.cuda.get_device_capability(device) >= (9, 0)
            and not torch.cuda.is_current_stream_capturing())


# The prefill steps' expert kernels: "auto" (per call: "hybrid" where the experts' mean
# load exceeds AUTO_BLOCKED_LOAD pairs, else "split"), "split" (the swapped split kernels on
# 128-pair chunks, below), "blocked" (`MoEConfig.blocked`: ≤ 256-pair chunks in 64-pair
# sub-blocks sharing each decoded tile, gate/up and down; the down kernel's tiles 128 rows:
# faster than 64 at 2,048-8,192 tokens in every run of the sweep) or "hybrid" (blocked
# gate/up, the swapped down kernel on 128-pair chunks with 128-row tiles: each chunk's `a`
# block is read from L2 by 28 programs, not 56 as at 64 rows; the 24-layer 8k step's down
# 25.7 → 23.0 ms, MFU 0.394 → 0.400 on the H200, same run:
# bench/results/prefill-h200-2026-12-07-situ24.json). The prefill bench's `--prefill-experts`
# runs them side by side in one process. Why auto, on the H200 (K3 TP16, balanced routing, one
# call; bench/results/moe-prefill-sweep-h200-2026-12-07-crossover.json): past 128 pairs per
# expert the split kernels take two chunks, so two decodes, per expert (8,192 tokens: 4.41
# ms) where the blocked ones decode once (down BN 128: 4.01 ms, 1.10×); at or below it one
# chunk each, and the split kernels' 128-wide dots win (5,120 tokens: 2.71 against 3.30,
# 7,168 = 128 per expert: 3.63 against 3.67). The outputs are bit-equal either way. The
# choice depends on the pair count alone, so the warm-up's budget-sized step compiles it.
# "ogs" / "ogs-hopper": Triton's triton_kernels matmul_ogs (kernels/moe_ogs.py) on the weights
# as they are / on a converted copy in its Hopper layouts (the 24-layer 8k prompt on the H100:
# MFU 0.426 against auto's 0.350 in one run; bench/results/prefill-h100-2026-12-07-ogs24b
# .json). The kind: RAYDECODE_PREFILL_EXPERTS (kernels/settings.py), "auto" unless set.
PREFILL_EXPERT_KINDS = _settings.PREFILL_EXPERT_KINDS
PREFILL_EXPERTS = _settings.prefill_experts()
_parse_kind = functools.lru_cache(maxsize=32)(_settings.parse_prefill_experts)
AUTO_BLOCKED_LOAD = 128
# our prefill kernels' weight decode (`MoEConfig.decode` of `prefill_config`'s configs)
PREFILL_DECODE = "x2"
# ogs / ogs-hopper run matmul_ogs from this many pairs per expert, "auto" below: its block_m
# is pinned at 128 rows, so a call of a few pairs per expert pays whole empty tiles (a
# 255-token mixed step, 4.6 pairs per expert at K3 TP16: the 32k schedule's step 36 ms
# against 21 on auto in the H100 runs; at 2,048 tokens, 36.6 per expert, its GEMMs took 1.39
# ms against our 1.75-1.78: docs/perf-log/prefill.md)
OGS_MIN_LOAD = 32


def prefill_config(latent: int, intermediate: int, pairs: int = 0,
                   num_experts: int = 0) -> MoEConfig:
    """Prefill steps (≥ PREFILL_PAIRS pairs, tens to hundreds per expert): the swapped kernels
    on 128-pair chunks, so an expert's tile is decoded once per 128 of its pairs (not per 16)
    and feeds the tensor cores from registers; 64 weight rows × 64 k per tile, 4 warps. In
    the 8,191-token step of 8 K3 layers the experts took 22.1 ms against 23.8 on the unswapped
    64-pair kernels; gate and up in one tile with 256-pair chunks (faster alone on uniform
    routing) and Triton's scaled dot (2.5× slower) lost: docs/perf-log/prefill.md. Tile-major
    grid: a chunk's 3 gate/up and 56 down tiles (K3 TP16) run back to back, so its gathered
    rows are read from HBM once, not once per tile. Split gate/up (one accumulator per
    program, BK 128, then the SiTU pass): the gate/up kernel held 255 registers per thread
    and 2 CTAs per SM with two; split, one 8,192-token call took 4.65 ms against 5.28 on
    the H100 (1.13×, balanced routing, bit-equal outputs:
    bench/results/moe-prefill-sweep-h100-2026-12-06-split.json). PREFILL_EXPERTS picks the
    form; "auto" needs the call's pairs and num_experts (without them: split). "ogs" /
    "ogs-hopper": Triton's triton_kernels matmul_ogs (kernels/moe_ogs.py, strided or Hopper
    weight layout) where it can run the call and the call has ≥ OGS_MIN_LOAD pairs per expert,
    else "auto". Our kernels decode the weights with PREFILL_DECODE ("x2": 8 codes per 32-bit
    word in bf16x2 arithmetic, the same values: one 8,192-token call 4.09 ms split / 4.04
    blocked against 4.73 / 4.36 elementwise on the H100), each k step's group scales loaded
    a step ahead (`MoEConfig.prefetch_scales`: bit-equal; in the 24-layer 8k step the experts'
    GEMMs 59.6 → 56.6 ms, MFU 0.363 → 0.368, H100, same run:
    bench/results/prefill-h100-2026-12-07-pf24.json); "auto-nopf" is auto without the
    look-ahead and "auto-ew" auto as it was before x2 (blocked past the threshold,
    elementwise decode), kept as same-run baselines. "KIND+FIELD=VALUE..." (settings.py
    `parse_prefill_experts`) sets those MoEConfig fields on what KIND picks: an option's
    same-run A/B before it ships (e.g. "auto+fuse_situ=1")."""
    kind, fields = _parse_kind(PREFILL_EXPERTS)
    if kind == "auto-ew":
        cfg = _prefill_config("auto", latent, intermediate, pairs, num_experts, "blocked")
    else:
        cfg = _prefill_config("auto" if kind == "auto-nopf" else kind, latent, intermediate,
                              pairs, num_experts)
        if cfg.ogs:
            return cfg
        cfg = dataclasses.replace(cfg, decode=PREFILL_DECODE,
                                  prefetch_scales=kind != "auto-nopf")
    if not cfg.blocked:                 # the blocked-only options leave the split form as is
        fields = tuple((n, v) for n, v in fields if n not in BLOCKED_ONLY_FIELDS)
    return dataclasses.replace(cfg, **dict(fields)) if fields else cfg


# MoEConfig fields a "+FIELD=VALUE" part sets only where the picked form is blocked ("auto"
# runs split below AUTO_BLOCKED_LOAD pairs per expert, which has no such option)
BLOCKED_ONLY_FIELDS = ("fuse_situ", "blocked_down", "down_tiles")


def _prefill_config(kind: str, latent: int, intermediate: int, pairs: int,
                    num_experts: int, auto_big: str = "hybrid") -> MoEConfig:
    """`prefill_config`'s form for `kind` with the elementwise decode; "auto" takes auto_big
    past AUTO_BLOCKED_LOAD pairs per expert, split below."""
    if kind.startswith("ogs"):
        from .moe_ogs import ogs_ready
        big = not num_experts or pairs >= OGS_MIN_LOAD * num_experts
        if big and ogs_ready(torch.device("cuda")):
            return MoEConfig(gate_up_bn=64, gate_up_bk=64, down_bn=64, down_bk=64,
                             ogs="hopper" if kind == "ogs-hopper" else "strided")
        kind = "auto"
    if kind == "auto":
        big = num_experts and pairs > AUTO_BLOCKED_LOAD * num_experts
        kind = auto_big if big else "split"
    if kind != "split":
        return MoEConfig(gate_up_bn=64, gate_up_bk=_largest_block(latent, 64),
                         down_bn=128,
                         down_bk=_largest_block(intermediate, 64), num_warps=4, num_stages=3,
                         decode="elementwise", block_m=4 * SUB_BLOCK, blocked=True,
                         blocked_down=kind != "hybrid")
    return MoEConfig(gate_up_bn=64, gate_up_bk=_largest_block(latent, 128), down_bn=64,
                     down_bk=_largest_block(intermediate, 64), num_warps=4, num_stages=3,
                     decode="elementwise", block_m=128, swap_ab=True, tile_major=True,
                     split_gate_up=True)


def _largest_block(k: int, cap: int) -> int:
    """Largest power of two ≤ cap dividing k, at least one MXFP4 group (32)."""
    b = cap
    while b > GROUP_SIZE and k % b:
        b //= 2
    return b


def default_config(pairs: int, num_experts: int, intermediate: int, latent: int,
                   sm_count: int = 132, tuned: bool = True) -> MoEConfig:
    """TUNED entry if any; else the elementwise decode with gate/up: the widest BN (≤ 64) that
    still gives ≥ 2 programs per SM at the worst-case run count min(P, E), BK ≤ 256; down:
    BN = 128 over the latent, BK ≤ 128."""
    if pairs >= PREFILL_PAIRS:
        hit = PREFILL_TUNED.get((num_experts, intermediate, latent)) if tuned else None
        return hit or prefill_config(latent, intermediate, pairs, num_experts)
    hit = TUNED.get((pairs <= SMALL_PAIRS, num_experts, intermediate, latent)) if tuned else None
    if hit is not None:
        return hit
    runs = min(pairs, num_experts)
    bn = 64
    while bn > 16 and runs * -(-intermediate // bn) < 2 * sm_count:
        bn //= 2
    return MoEConfig(gate_up_bn=bn, gate_up_bk=_largest_block(latent, 256),
                     down_bn=128 if latent >= 128 else 64,
                     down_bk=_largest_block(intermediate, 128), decode="elementwise")


RUNS_KERNEL_MAX = 1024      # pairs the one-program Triton sort takes; more: `moe_runs_torch`


def _runs_block(pairs: int) -> int:
    """Sort width of the runs kernel: three buckets, so it compiles at most 3 times. (Past 1024
    pairs its one-program bitonic sort took 15 s to compile at 4096 pairs and minutes at 32768,
    once per new power of two on the request path: those go to `moe_runs_torch`.)"""
    for b in (RUNS_MIN_BLOCK, 256, RUNS_KERNEL_MAX):
        if pairs <= b:
            return b
    raise ValueError(f"{pairs} pairs: the runs kernel sorts at most {RUNS_KERNEL_MAX}; use "
                     "moe_runs_torch")


def moe_runs_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
    """`moe_runs` for any number of pairs with library ops only (a stable sort, scans and
    scatters: nothing to compile per shape, no host sync, fixed output shapes): the same
    pairs / sorted_e / run_start / num_runs / chunk_start / chunk_end / num_chunks, entries
    past num_runs + 1 / num_chunks zero (the kernels never read them); chunks of ≤ block_m."""
    return _runs_torch(topk_ids, num_experts, (block_m,))[0]


def _runs_torch(topk_ids: torch.Tensor, num_experts: int, block_ms: tuple[int, ...]):
    """`moe_runs_torch` for each block_m in block_ms from ONE sort: [its 7-tuple, ...]."""
    ids = topk_ids.reshape(-1).to(torch.int64)
    P, dev = ids.numel(), ids.device
    R = min(P, num_experts)
    sorted_e, pairs = torch.sort(ids, stable=True)             # (expert, pair index) order
    i = torch.arange(P, device=dev)
    first = torch.ones(P, dtype=torch.bool, device=dev)
    first[1:] = sorted_e[1:] != sorted_e[:-1]
    rid = torch.cumsum(first, 0) - 1                            # run of pair i
    n_runs = first.sum().reshape(1)
    run_start = torch.full((R + 2,), P, dtype=torch.int64, device=dev)   # slot R + 1: discard
    run_start.scatter_(0, torch.where(first, rid, R + 1), i)
    run_start = run_start[:R + 1]
    start_i, end_i = run_start[rid], run_start[rid + 1]
    i32 = torch.int32
    runs = (pairs.to(i32), sorted_e.to(i32), run_start.to(i32), n_runs.to(i32))
    out = []
    for block_m in block_ms:
        C = max_chunks(P, num_experts, block_m)
        cs = (i - start_i) % block_m == 0                       # a chunk starts at i
        cid = torch.where(cs, torch.cumsum(cs, 0) - 1, C)
        c_start = torch.zeros(C + 1, dtype=torch.int64, device=dev)
        c_end = torch.zeros(C + 1, dtype=torch.int64, device=dev)
        c_start.scatter_(0, cid, i)
        c_end.scatter_(0, cid, torch.minimum(i + block_m, end_i))
        out.append(runs + (c_start[:C].to(i32), c_end[:C].to(i32),
                           cs.sum().reshape(1).to(i32)))
    return out


def _use_triton(*ts: torch.Tensor) -> bool:
    if triton is None:
        return False
    if all(t.is_cuda for t in ts):
        return True
    return os.environ.get("TRITON_INTERPRET") == "1" and not any(t.is_cuda for t in ts)


def moe_runs(topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
    """From topk_ids (T, k), int32 tensors: pairs (P,) grouped by expert, sorted_e (P,),
    run_start (min(P, E) + 1,), num_runs (1,), chunk_start / chunk_end (max_chunks,),
    num_chunks (1,) — the pairs grouped by expert and cut into ≤ block_m chunks (one program)."""
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    P = ids.numel()
    if P > RUNS_KERNEL_MAX:
        return moe_runs_torch(ids, num_experts, block_m)
    dev = ids.device
    i32 = dict(dtype=torch.int32, device=dev)
    out = (torch.empty(P, **i32), torch.empty(P, **i32),
           torch.empty(min(P, num_experts) + 1, **i32), torch.empty(1, **i32),
           torch.empty(max_chunks(P, num_experts, block_m), **i32),
           torch.empty(max_chunks(P, num_experts, block_m), **i32), torch.empty(1, **i32))
    _runs_kernel[(1,)](ids, P, *out, BLOCK=_runs_block(P), BM=block_m, num_warps=4)
    return out


def moe_runs_two(topk_ids: torch.Tensor, num_experts: int, block_m: int, block_m2: int):
    """(`moe_runs` at block_m, `moe_runs` at block_m2): the same sorted order cut into chunks
    of two sizes, from one sort where the pairs take the library path (`moe_runs_torch`:
    a prefill step's, where the hybrid form's gate/up and down kernels chunk the one order
    differently; its second sort was 1.7 ms of a 24-layer 8k step on the H100)."""
    if topk_ids.numel() > RUNS_KERNEL_MAX:
        return tuple(_runs_torch(topk_ids, num_experts, (block_m, block_m2)))
    return moe_runs(topk_ids, num_experts, block_m), moe_runs(topk_ids, num_experts, block_m2)


def max_chunks(pairs: int, num_experts: int, block_m: int = BLOCK_M) -> int:
    """Worst-case chunk count: one per run plus one per block_m pairs."""
    return min(pairs, num_experts) + pairs // block_m


SUB_BLOCK = 64       # pairs per sub-block of the blocked kernels (one dot's N)


def _check_inputs(z, topk_weights, topk_ids, experts: MXFP4Experts,
                  z_dtypes: tuple = (torch.bfloat16,)) -> None:
    T, L = z.shape if z.dim() == 2 else (None, None)
    if z.dim() != 2 or L != experts.latent or z.dtype not in z_dtypes:
        names = " or ".join({torch.bfloat16: "bf16", torch.float32: "fp32"}[d] for d in z_dtypes)
        raise ValueError(f"z must be {names} (T, {experts.latent}), got {z.dtype} "
                         f"{tuple(z.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be (T={T}, k)")
    if topk_weights.dtype != torch.float32 or topk_ids.is_floating_point():
        raise ValueError(f"topk_weights must be fp32 and topk_ids integer, got "
                         f"{topk_weights.dtype} / {topk_ids.dtype}")
    P = topk_ids.numel()
    if P * max(L, experts.intermediate) >= 1 << 31:
        raise ValueError(f"{P} (token, expert) pairs: the kernels index the (P, L) output with "
                         f"int32 offsets, so P · max(L={L}, I={experts.intermediate}) must stay "
                         "below 2**31; split the batch")


def situ_rows(gu: torch.Tensor, a: torch.Tensor, experts: MXFP4Experts) -> torch.Tensor:
    """a[m] = SiTU(gu[m, :I], gu[m, I:]) (bf16) for every row of the (P, 2I) bf16 gate ‖ up
    buffer (`_situ_rows_kernel`) -> a."""
    P, I, lin = gu.shape[0], experts.intermediate, experts.linear_beta
    bt, bl = SUM_BLOCK
    _situ_rows_kernel[(triton.cdiv(P, bt), triton.cdiv(I, bl))](
        gu, a, P, float(experts.beta), float(lin if lin is not None else 1.0), I=I,
        HAS_LIN=lin is not None, BT=bt, BL=bl, num_warps=4)
    return a


def weighted_sum(y: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor | None,
                 row: torch.Tensor | None = None) -> torch.Tensor:
    """out (T, L) fp32 (allocated when None) = Σ_j w[t, j] · y[pair row], j in order
    (`_weighted_sum_kernel`); row: pair (t, j)'s row of y where y is not in pair order."""
    T, k = topk_weights.shape
    L = y.shape[1]
    if out is None:
        out = torch.empty(T, L, dtype=torch.float32, device=y.device)
    bt, bl = SUM_BLOCK
    _weighted_sum_kernel[(triton.cdiv(T, bt), triton.cdiv(L, bl))](
        y, topk_weights.contiguous(), out, T, out.stride(0), y if row is None else row, K=k,
        L=L, BT=bt, BL=bl, HAS_ROW=row is not None, num_warps=4)
    return out


DECODES = {"elementwise": 0, "pairs": 1, "split": 2}
# the swapped and blocked kernels' decodes (`_dequant_w`)
SWAP_DECODES = ("elementwise", "x2")


def _x2(cfg: MoEConfig, z: torch.Tensor) -> int:
    """The kernels' X2 constexpr: 0 elementwise; x2: 2 (inline asm) on CUDA, 1 (its Triton
    emulation) under TRITON_INTERPRET."""
    return 0 if cfg.decode == "elementwise" else (2 if z.is_cuda else 1)


@dataclass(frozen=True)
class Launch:
    """One expert-GEMM launch of the prefill forms: the JIT kernel, its constexprs, warps and
    stages. `prefill_launches` is the one place they are set: the launches below and the
    sm_90 compile probe (scripts/explore/sm90_compile.py) both read it."""
    kernel: object
    consts: dict
    warps: int
    stages: int

    def __call__(self, grid, *args):
        self.kernel[grid](*args, **self.consts, num_warps=self.warps, num_stages=self.stages)


def prefill_launches(cfg: MoEConfig, L: int, I: int, *, x2: int, dot32: bool,
                     tile_major: bool = True, has_lin: bool = True) -> dict[str, Launch]:
    """name -> Launch of the expert GEMMs cfg runs in its blocked or swapped form (x2: the
    kernels' X2, `_x2`; dot32: fp32 dots, off CUDA; tile_major: the swapped kernels' grid
    order, where the chunks fit the grid's y). Blocked: gate_up_blocked and down_blocked or
    down_swap (128-pair chunks, 3 stages); swapped: gate_up_split (split_gate_up only) and
    down_swap. The fused swapped gate/up and the unswapped kernels are not covered. has_lin:
    the experts' SiTU has its linear clamp (K3's does; the gate/up's HAS_LIN under
    fuse_situ)."""
    pf = dict(PF=cfg.prefetch_scales)
    down_warps = cfg.down_warps or cfg.num_warps
    out: dict[str, Launch] = {}
    if cfg.blocked:
        nb = dict(SUB=SUB_BLOCK, NBMAX=cfg.block_m // SUB_BLOCK, DOT_F32=dot32, X2=x2, **pf)
        out["gate_up_blocked"] = Launch(_gate_up_blocked_kernel, dict(
            L=L, I2=2 * I, BN=cfg.gate_up_bn, BK=cfg.gate_up_bk, SITU=cfg.fuse_situ,
            HAS_LIN=has_lin, **nb), cfg.num_warps, cfg.num_stages)
        if cfg.blocked_down:
            out["down_blocked"] = Launch(_down_blocked_kernel, dict(
                L=L, I=I, BN=cfg.down_bn, BK=cfg.down_bk, TILES=cfg.down_tiles, **nb),
                down_warps, cfg.num_stages)
        else:
            out["down_swap"] = Launch(_down_swap_kernel, dict(
                L=L, I=I, BM=128, BN=cfg.down_bn, BK=cfg.down_bk, DOT_F32=dot32,
                TILE_MAJOR=tile_major, X2=x2, **pf), down_warps, 3)
        return out
    if not cfg.swap_ab:
        raise ValueError(f"{cfg}: prefill_launches covers the blocked and swapped forms")
    common = dict(BM=cfg.block_m, DOT_F32=dot32, TILE_MAJOR=tile_major, X2=x2, **pf)
    if cfg.split_gate_up:
        out["gate_up_split"] = Launch(_gate_up_split_kernel, dict(
            L=L, I2=2 * I, BN=cfg.gate_up_bn, BK=cfg.gate_up_bk, **common), cfg.num_warps,
            cfg.num_stages)
    out["down_swap"] = Launch(_down_swap_kernel, dict(
        L=L, I=I, BN=cfg.down_bn, BK=cfg.down_bk, **common), down_warps, cfg.num_stages)
    return out


def fused_moe_mxfp4_triton(z: torch.Tensor, topk_weights: torch.Tensor,
                           topk_ids: torch.Tensor, experts: MXFP4Experts,
                           config: MoEConfig | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """The fused path: runs → gate_up → down → Σ_k. -> (T, L) fp32. No host sync. out: an
    fp32 (T, L) tensor with unit column stride to write into (e.g. the column block of a
    buffer that other partial sums share; `check_out`)."""
    _check_inputs(z, topk_weights, topk_ids, experts)
    check_out(out, z.shape[0], experts.latent, z.device)
    T, L = z.shape
    k = topk_ids.shape[1]
    P, E, I = T * k, experts.num_experts, experts.intermediate
    if grouped_wanted(P, z.device, config):   # decode the weights once, then bf16 GEMMs
        from .moe_grouped import moe_mxfp4_grouped
        return moe_mxfp4_grouped(z, topk_weights, topk_ids, experts, out)
    cfg = config or default_config(P, E, I, L)
    if cfg.ogs:
        from .moe_ogs import moe_mxfp4_ogs
        return moe_mxfp4_ogs(z, topk_weights, topk_ids, experts, cfg.ogs, out)
    check_config(cfg, L, I)
    bm = cfg.block_m
    if cfg.blocked:
        return _blocked_moe(z, topk_weights, topk_ids, experts, cfg, out)
    pairs, sorted_e, _, _, c_start, c_end, n_chunks = moe_runs(topk_ids, E, bm)
    dec = 0 if cfg.swap_ab else DECODES[cfg.decode]
    x_dtype = torch.bfloat16 if dec == 0 else torch.float16       # dot operand type
    w13, w2 = ((experts.w13.view(torch.int32), experts.w2.view(torch.int32)) if dec == 1
               else (experts.w13, experts.w2))
    chunks = max_chunks(P, E, bm)
    tm = cfg.tile_major and chunks <= MAX_GRID_Y
    if cfg.swap_ab:     # the decoded tile as the dots' register operand; `a` in sorted order
        x2 = _x2(cfg, z)
        gate_up, extra13 = _gate_up_swap_kernel, dict(X2=x2)
        launch = prefill_launches(cfg, L, I, x2=x2, dot32=not z.is_cuda, tile_major=tm)
    else:
        gate_up, launch = _gate_up_kernel, None
        extra13, extra2 = dict(DECODE=dec, WPR=w13.shape[-1]), dict(DECODE=dec, WPR=w2.shape[-1])
    common = dict(BM=bm, DOT_F32=not z.is_cuda, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages, TILE_MAJOR=tm)

    def grid(tiles: int) -> tuple[int, int]:
        return (tiles, chunks) if tm else (chunks, tiles)

    a = torch.empty(P, I, dtype=x_dtype, device=z.device)
    lin = experts.linear_beta
    beta, lin_beta = float(experts.beta), float(lin if lin is not None else 1.0)
    if cfg.split_gate_up:
        gu = torch.empty(P, 2 * I, dtype=torch.bfloat16, device=z.device)
        launch["gate_up_split"](grid(triton.cdiv(2 * I, cfg.gate_up_bn)),
                                z.to(x_dtype).contiguous(), w13, experts.s13, pairs, sorted_e,
                                c_start, c_end, n_chunks, gu, k)
        situ_rows(gu, a, experts)
    else:
        gate_up[grid(triton.cdiv(I, cfg.gate_up_bn))](
            z.to(x_dtype).contiguous(), w13, experts.s13, pairs, sorted_e, c_start, c_end,
            n_chunks, a, k, beta, lin_beta, L=L, I=I, HAS_LIN=lin is not None,
            BN=cfg.gate_up_bn, BK=cfg.gate_up_bk, **extra13, **common)
    y = torch.empty(P, L, dtype=torch.bfloat16, device=z.device)
    down_args = (a, w2, experts.s2, pairs, sorted_e, c_start, c_end, n_chunks, y)
    if launch is not None:
        launch["down_swap"](grid(triton.cdiv(L, cfg.down_bn)), *down_args)
    else:
        if cfg.down_warps:
            common["num_warps"] = cfg.down_warps
        _down_kernel[grid(triton.cdiv(L, cfg.down_bn))](
            *down_args, L=L, I=I, BN=cfg.down_bn, BK=cfg.down_bk, **extra2, **common)
    return weighted_sum(y, topk_weights, out)


def check_config(cfg: MoEConfig, L: int, I: int) -> None:
    """ValueError, naming the field, where `fused_moe_mxfp4_triton` could not run cfg (not
    ogs) on experts of latent L and intermediate I; the shapes alone decide, so a deployment's
    setting is checked when the rank loads (`check_prefill_kind`), not at its first step."""
    swapped = cfg.swap_ab or cfg.blocked
    if cfg.decode not in (SWAP_DECODES if swapped else DECODES):
        raise ValueError(f"MoEConfig.decode {cfg.decode!r}: expected one of "
                         f"{list(SWAP_DECODES if swapped else DECODES)} for "
                         f"{'swapped / blocked' if swapped else 'these'} kernels")
    if L % cfg.gate_up_bk or I % cfg.down_bk or cfg.gate_up_bk % 32 or cfg.down_bk % 32:
        raise ValueError(f"{cfg}: BK must be a multiple of 32 dividing L={L} / I={I}")
    for name in ("gate_up_bk", "down_bk", "gate_up_bn", "down_bn"):
        v = getattr(cfg, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"MoEConfig.{name} {v}: expected a power of two ≥ 16")
    if cfg.num_warps not in LAUNCH_WARPS:
        raise ValueError(f"MoEConfig.num_warps {cfg.num_warps}: expected 1, 2, 4, 8 or 16")
    if cfg.down_warps not in (0, *LAUNCH_WARPS):
        raise ValueError(f"MoEConfig.down_warps {cfg.down_warps}: expected 1, 2, 4, 8 or 16 "
                         "(or 0: num_warps)")
    if cfg.num_stages < 1:
        raise ValueError(f"MoEConfig.num_stages {cfg.num_stages}: expected ≥ 1")
    bm = cfg.block_m
    if bm < BLOCK_M or bm & (bm - 1):
        raise ValueError(f"MoEConfig.block_m {bm}: expected a power of two ≥ {BLOCK_M}")
    if cfg.blocked:
        if bm not in (SUB_BLOCK, 2 * SUB_BLOCK, 4 * SUB_BLOCK):
            raise ValueError(f"MoEConfig.blocked needs block_m 64, 128 or 256 (≤ 4 "
                             f"sub-blocks of {SUB_BLOCK}), got {bm}")
        if cfg.down_tiles < 1:
            raise ValueError(f"MoEConfig.down_tiles must be ≥ 1, got {cfg.down_tiles}")
        if cfg.fuse_situ and (cfg.gate_up_bn < 32 or I % (cfg.gate_up_bn // 2)):
            raise ValueError(f"MoEConfig.fuse_situ: gate_up_bn {cfg.gate_up_bn} must be ≥ 32 "
                             f"with gate_up_bn / 2 dividing I = {I}")
        return
    if cfg.split_gate_up and not cfg.swap_ab:
        raise ValueError("MoEConfig.split_gate_up needs swap_ab (the swapped kernels' sorted "
                         "`a`)")
    if cfg.fuse_situ:
        raise ValueError("MoEConfig.fuse_situ needs the blocked kernels (blocked=True)")
    if cfg.prefetch_scales and not cfg.split_gate_up:
        raise ValueError("MoEConfig.prefetch_scales needs the blocked kernels or swap_ab with "
                         "split_gate_up (the fused swapped gate/up kernel does not take it)")


def check_prefill_kind(L: int, I: int, E: int) -> None:
    """ValueError naming RAYDECODE_PREFILL_EXPERTS where a config `prefill_config` would give
    prefill steps of these experts (either side of AUTO_BLOCKED_LOAD) could not run: its
    +FIELD=VALUE parts are checked against the model's shapes when the rank loads."""
    for pairs in (PREFILL_PAIRS, (AUTO_BLOCKED_LOAD + 1) * E):
        cfg = prefill_config(L, I, pairs, E)
        if cfg.ogs:
            continue
        try:
            check_config(cfg, L, I)
        except ValueError as e:
            raise ValueError(f"RAYDECODE_PREFILL_EXPERTS={PREFILL_EXPERTS!r} at L={L}, I={I}, "
                             f"{pairs} pairs: {e}") from None


def _blocked_moe(z, topk_weights, topk_ids, experts: MXFP4Experts, cfg: MoEConfig,
                 out: torch.Tensor | None) -> torch.Tensor:
    """`MoEConfig.blocked`: runs (chunks of ≤ block_m) → gate/up (bf16 W13 z into the sorted
    (P, 2I) buffer) → SiTU pass (with fuse_situ both in the gate/up kernel, straight into `a`)
    → down (`blocked_down`; else the swapped down kernel on its own 128-pair chunks) → Σ_k."""
    T, L = z.shape
    k = topk_ids.shape[1]
    P, E, I = T * k, experts.num_experts, experts.intermediate
    bm = cfg.block_m
    if cfg.blocked_down:
        runs, down_runs = moe_runs(topk_ids, E, bm), None
    else:           # the swapped down kernel's 128-pair chunks of the same sorted order
        runs, down_runs = moe_runs_two(topk_ids, E, bm, 128)
    pairs, sorted_e, _, _, c_start, c_end, n_chunks = runs
    chunks = max_chunks(P, E, bm)
    if chunks > MAX_GRID_Y:
        raise ValueError(f"{P} pairs: {chunks} chunks of ≤ {bm} exceed the grid's "
                         f"{MAX_GRID_Y}; split the batch")
    dc = max_chunks(P, E, 128)       # the swapped down kernel's chunks, where it runs
    tm = dc <= MAX_GRID_Y
    lin = experts.linear_beta
    launch = prefill_launches(cfg, L, I, x2=_x2(cfg, z), dot32=not z.is_cuda, tile_major=tm,
                              has_lin=lin is not None)
    a = torch.empty(P, I, dtype=torch.bfloat16, device=z.device)
    gu = a if cfg.fuse_situ else torch.empty(P, 2 * I, dtype=torch.bfloat16, device=z.device)
    launch["gate_up_blocked"]((triton.cdiv(2 * I, cfg.gate_up_bn), chunks),
                              z.to(torch.bfloat16).contiguous(), experts.w13, experts.s13,
                              pairs, sorted_e, c_start, c_end, n_chunks, gu, k,
                              float(experts.beta), float(lin if lin is not None else 1.0))
    if not cfg.fuse_situ:
        situ_rows(gu, a, experts)
    y = torch.empty(P, L, dtype=torch.bfloat16, device=z.device)
    if cfg.blocked_down:
        launch["down_blocked"]((triton.cdiv(L, cfg.down_bn * cfg.down_tiles), chunks),
                               a, experts.w2, experts.s2, pairs, sorted_e, c_start, c_end,
                               n_chunks, y)
    else:        # the swapped down kernel on 128-pair chunks of the same sorted order
        _, _, _, _, d_start, d_end, d_chunks = down_runs
        launch["down_swap"]((triton.cdiv(L, cfg.down_bn), dc) if tm
                            else (dc, triton.cdiv(L, cfg.down_bn)),
                            a, experts.w2, experts.s2, pairs, sorted_e, d_start, d_end,
                            d_chunks, y)
    return weighted_sum(y, topk_weights, out)


def check_out(out: torch.Tensor | None, T: int, L: int, device: torch.device) -> None:
    """An `out` for the routed experts' sum: fp32 (T, L) on the inputs' device, unit column
    stride, rows at least L apart (a contiguous tensor or a column block of a wider one)."""
    if out is None:
        return
    if (out.dtype != torch.float32 or tuple(out.shape) != (T, L) or out.device != device
            or (T > 1 and out.stride(1) != 1) or (T > 1 and out.stride(0) < L)):
        raise ValueError(f"routed experts out: {out.dtype} {tuple(out.shape)} strides "
                         f"{out.stride()} on {out.device}; expected float32 ({T}, {L}) on "
                         f"{device} with unit column stride and rows ≥ {L} apart")


def fused_moe_mxfp4(z: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    experts: MXFP4Experts, config: MoEConfig | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_k w·expert(z) (T, L) fp32: the fused Triton kernels when Triton can run on these
    tensors (CUDA, or CPU under TRITON_INTERPRET=1), else `moe_mxfp4_reference`; written
    into `out` when given (`check_out`)."""
    if _use_triton(z, experts.w13):
        return fused_moe_mxfp4_triton(z, topk_weights, topk_ids, experts, config, out)
    _check_inputs(z, topk_weights, topk_ids, experts)
    check_out(out, z.shape[0], experts.latent, z.device)
    ref = moe_mxfp4_reference(z, topk_weights, topk_ids, experts)
    return ref if out is None else out.copy_(ref)


def touched_expert_bytes(topk_ids: torch.Tensor, experts: MXFP4Experts) -> int:
    """HBM bytes the fused kernel streams for this routing: distinct experts × expert bytes
    (host sync; for reporting only)."""
    return int(torch.unique(topk_ids).numel()) * experts.expert_bytes()


__all__ = ["GROUPED_PAIRS", "MAX_SCALE", "MXFP4Experts", "MoEConfig", "TUNED", "check_out",
           "default_config", "fused_moe_mxfp4", "fused_moe_mxfp4_triton", "grouped_wanted",
           "moe_mxfp4_reference", "moe_runs", "touched_expert_bytes"]
