"""Triton kernels of the fused MLA absorbed decode (kernels/mla_decode.py has the math, the
references and the public ops). Launchers here write into caller-allocated outputs, take
strided views as they come (last dim contiguous) and never synchronise with the host.

  _prep_kernel    grid (T,): q_out = bf16(RMSNorm(qkv[:q_lora]; w_q)); the latent row
                  [bf16(RMSNorm(qkv[q_lora:q_lora+c]; w_kv)), qkv[q_lora+c:]] stored at
                  cache[block_table[t, p // bs], p % bs], p = positions[t] (p < 0: no store)
  _absorb_kernel  grid (⌈T/16⌉, h, ⌈c/64⌉):
                  q_abs[:, h, cb] = bf16(q_nope[:, h] · w_uk[h][:, cb])
                  (tl.dot, fp32 accumulate); the cb = 0 programs copy q_pe into q_abs[..., c:]
  _split_kernel   grid (T, S): all heads of token t (padded to HP ≥ 16) against rows
                  [s·chunk, min(L, (s+1)·chunk)), L = seq_lens[t],
                  chunk = max(MIN_CHUNK, ⌈⌈L/S⌉/BN⌉·BN). Each BN-row tile is gathered once
                  through the block table and used as K ([c ‖ rope]) and V (c):
                      s  = (q_c·K_cᵀ + q_r·K_rᵀ) · scale·log2e          (HP, BN) fp32
                      m' = max(m, max s);  p = 2^(s − m');  α = 2^(m − m')
                      l  = α·l + Σ p;      acc = α·acc + bf16(p)·K_c     (HP, c) fp32
                  writes o_part = acc / l, lse_part = (m + log2 l)·ln2; an empty split writes
                  o 0, lse −inf (so every partial element is written: no zero-init needed)
  _split_rows_kernel  `_split_kernel` for `mla_decode_absorbed`: q is the raw absorbed q
                  (W_uk and the q_a norm weight folded into q_b, one GEMV), scaled by
                  rsqrt(mean(x²) + eps) and rounded here; the split whose rows hold
                  positions[t] stores the cache row (as _prep_kernel) before its tiles
                  (PRE_TILE: each split's first tile is loaded before the PDL wait, and the
                  new row, when it falls there, comes from registers)
  _output_token_kernel  grid (T, h, ⌈v/16⌉), T ≤ OUTPUT_TOKEN_MAX_T: the PROJECT merge below for
                  one token per program (all S partials in one tile load, M = 1 product)
  _merge_kernel   grid (⌈T/16⌉, h, ⌈v/BV⌉): over the S partials of (t, h)
                      w_s = exp(lse_s − max lse),  o_lat = Σ w_s o_s / Σ w_s
                  PROJECT: y = bf16(bf16(o_lat)·w_uv_t[h][:, vb]) (tl.dot, fp32 acc),
                           out = bf16(y · sigmoid(gate));  else: o_lat fp32 and
                           lse = max + log Σ w_s are stored (the standalone op 3 merge)
  _fused_kernel   1-D grid of tickets (`fused_grid`), `mla_decode_fused` at DCP 1, with q from
                  q_b' (the q_a norm weight folded in) applied to the raw latent x:
                  A  one program per 16 tokens stores the cache rows (as _prep_kernel); the
                     absorb programs scale q by rsqrt(mean(x²) + eps), round to bf16, absorb
                  B  the split programs; C  the output programs (token form or merge form)
                  ONLY_A: A alone, program id = ticket (the default path: then _split_kernel
                  and _output_token_kernel / _merge_kernel). Otherwise one launch: a ticket
                  from an atomic counter picks the phase, B waits until every A program has
                  released its count, C until every B has (acquire polls, gpu scope, loads of
                  data written in the kernel go through L2 (.cg)); each wait is on smaller
                  tickets, whose programs have started, so no co-residency is assumed; the
                  last program out zeroes the counters. Measured slower than the separate
                  launches on the H200 (docs/PERF.md §5), hence off by default.
The kernels are thin wrappers of @triton.jit parts (_absorb_part, _split_part, _merge_part,
_output_token_part, _row_store_part) that the fused kernel calls by ticket.
p is rounded to bf16 before p·V, as the stock path does (there after normalisation, here
relative to the running max: both are one bf16 rounding of each weight).
"""
from __future__ import annotations

import math

import torch

from raydecode.kernels._triton import available, pdl_enter, pdl_launch, tl, triton

if triton is not None:
    import triton.language.extra.cuda as _cuda

LOG2E = 1.0 / math.log(2.0)
MIN_CHUNK = 64            # never fewer rows per KV split (a split's fixed cost ≈ 64 rows)

if triton is not None:

    @triton.jit
    def _mm(a, b, DOT_F32: tl.constexpr):
        """a·b, fp32 accumulation. DOT_F32 (CPU interpreter only: its Triton 3.9 bf16 dot reads
        raw bits as values): fp32 operands, ieee, exact bf16 products as on the GPU. The
        operands' dtypes must match either way (the GPU compiler refuses fp32 · bf16)."""
        tl.static_assert(a.dtype == b.dtype, "_mm: operand dtypes differ")
        if DOT_F32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b)

    # ---- the parts: one program's work of each op, shared by the per-op kernels and the
    # ---- fused kernel (`_fused_kernel`, which picks the part by its ticket)

    @triton.jit
    def _rms_scale(x_ptr, x_st, tt, mt, XL, eps, BT: tl.constexpr, BX: tl.constexpr):
        """(BT,) fp32 rsqrt(mean(x[t, :XL]²) + eps) of the rows tt (masked rows: any value)."""
        acc = tl.zeros((BT, BX), tl.float32)
        for k0 in range(0, XL, BX):
            ok = k0 + tl.arange(0, BX)
            x = tl.load(x_ptr + tt[:, None] * x_st + ok[None, :],
                        mask=mt[:, None] & (ok < XL)[None, :], other=0.0).to(tl.float32)
            acc += x * x
        return tl.rsqrt(tl.sum(acc, 1) / XL + eps)

    @triton.jit
    def _row_store_part(x_ptr, x_st, XL, KL, R, wkv_ptr, c_ptr, c_sb, c_sr, bt_ptr, bt_st,
                        pos_ptr, BS, eps, tt, mt, BC: tl.constexpr, BR: tl.constexpr):
        """The cache-row store of the rows tt (BT,): [bf16(RMSNorm(x[t, XL:XL+KL]; w_kv)),
        x[t, XL+KL:]] -> cache row positions[t] (< 0: not written). `_prep_kernel`: one
        token, tt = [t]; `_fused_kernel` phase A: 16 tokens."""
        pos = tl.load(pos_ptr + tt, mask=mt, other=-1).to(tl.int64)
        ok = mt & (pos >= 0)
        p = tl.where(ok, pos, 0)
        blk = tl.load(bt_ptr + tt * bt_st + p // BS, mask=ok, other=0).to(tl.int64)
        dst = c_ptr + blk * c_sb + (p % BS) * c_sr                              # (BT,)
        oc = tl.arange(0, BC)
        m2 = ok[:, None] & (oc < KL)[None, :]
        xc = tl.load(x_ptr + tt[:, None] * x_st + XL + oc[None, :], mask=m2,
                     other=0.0).to(tl.float32)
        wc = tl.load(wkv_ptr + oc, mask=oc < KL, other=0.0).to(tl.float32)
        yc = xc * tl.rsqrt(tl.sum(xc * xc, 1) / KL + eps)[:, None] * wc[None, :]
        tl.store(dst[:, None] + oc[None, :], yc.to(c_ptr.dtype.element_ty), mask=m2)
        orr = tl.arange(0, BR)
        mr = ok[:, None] & (orr < R)[None, :]
        pe = tl.load(x_ptr + tt[:, None] * x_st + XL + KL + orr[None, :], mask=mr, other=0.0)
        tl.store(dst[:, None] + KL + orr[None, :], pe.to(c_ptr.dtype.element_ty), mask=mr)

    @triton.jit
    def _absorb_part(q_ptr, q_st, q_sh, w_ptr, w_sh, w_sn, o_ptr, o_st, o_sh, T, NOPE, KL, R,
                     tb, hd, cb, x_ptr, x_st, XL, eps,
                     BT: tl.constexpr, BNP: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr,
                     BX: tl.constexpr, NORM_Q: tl.constexpr, DOT_F32: tl.constexpr):
        """q_abs[tt, hd, cb-block] = bf16(q_nope · w_uk[hd][:, cb-block]); cb = 0 also copies
        q_pe. NORM_Q (prep folded into q_b, see `mla_decode_fused`): q here is q_b' applied
        to the raw latent x, and q_nope, q_pe are first rescaled to bf16(rms_scale(x) · q)."""
        hd = hd.to(tl.int64)
        tt = (tb * BT + tl.arange(0, BT)).to(tl.int64)
        mt = tt < T
        on = tl.arange(0, BNP)
        mn = on < NOPE
        qb = q_ptr + tt[:, None] * q_st + hd * q_sh
        qn = tl.load(qb + on[None, :], mask=mt[:, None] & mn[None, :], other=0.0)
        oc = cb * BC + tl.arange(0, BC)
        mc = oc < KL
        w = tl.load(w_ptr + hd * w_sh + on[:, None] * w_sn + oc[None, :],
                    mask=mn[:, None] & mc[None, :], other=0.0)
        if NORM_Q:                  # after the q / w_uk loads are issued: their latency overlaps
            rs = _rms_scale(x_ptr, x_st, tt, mt, XL, eps, BT, BX)    # q fp32 or bf16: one
            qn = (qn.to(tl.float32) * rs[:, None]).to(w.dtype)      # bf16 rounding of q here
        y = _mm(qn, w, DOT_F32)                                         # (BT, BC) fp32
        ob = o_ptr + tt[:, None] * o_st + hd * o_sh
        tl.store(ob + oc[None, :], y.to(o_ptr.dtype.element_ty), mask=mt[:, None] & mc[None, :])
        if cb == 0:
            orr = tl.arange(0, BR)
            m2 = mt[:, None] & (orr < R)[None, :]
            pe = tl.load(qb + NOPE + orr[None, :], mask=m2, other=0.0)
            if NORM_Q:
                pe = (pe.to(tl.float32) * rs[:, None]).to(o_ptr.dtype.element_ty)
            tl.store(ob + KL + orr[None, :], pe.to(o_ptr.dtype.element_ty), mask=m2)

    @triton.jit
    def _tile_rows(c_ptr, c_sb, c_sr, bt_ptr, bt_st, t, n0, end, BS, KL, R, oc, orr,
                   BN: tl.constexpr):
        """The BN cache rows n0 … n0+BN−1 (< end) of token t through its block table, loaded
        .cg -> (rows, valid mask, K_c (BN, BC), K_r (BN, BR))."""
        rows = n0 + tl.arange(0, BN)
        mn = rows < end
        blk = tl.load(bt_ptr + t * bt_st + rows // BS, mask=mn, other=0).to(tl.int64)
        base = c_ptr + blk * c_sb + (rows % BS).to(tl.int64) * c_sr                # (BN,)
        kc = tl.load(base[:, None] + oc[None, :], mask=mn[:, None] & (oc < KL)[None, :],
                     other=0.0, cache_modifier=".cg")                               # (BN, BC)
        kr = tl.load(base[:, None] + KL + orr[None, :], mask=mn[:, None] & (orr < R)[None, :],
                     other=0.0, cache_modifier=".cg")                               # (BN, BR)
        return rows, mn, kc, kr

    @triton.jit
    def _attend_tile(qc, qr, kc, kr, mn, m_i, l_i, acc, qk_scale, DOT_F32: tl.constexpr):
        """One online-softmax step of the heads' rows against a tile with ≥ 1 valid row."""
        sc = _mm(qc, tl.trans(kc), DOT_F32) + _mm(qr, tl.trans(kr), DOT_F32)       # (HP, BN)
        sc = sc * qk_scale
        sc = tl.where(mn[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))              # finite: the tile has a valid row
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _mm(p.to(kc.dtype), kc, DOT_F32)
        return m_new, l_i, acc

    @triton.jit
    def _split_part(q_ptr, q_st, q_sh, c_ptr, c_sb, c_sr, bt_ptr, bt_st, len_ptr,
                    o_ptr, o_st, o_ss, o_sh, l_ptr, l_st, l_ss, l_sh,
                    H, KL, R, BS, qk_scale, NS, MINC, t, s,
                    x_ptr, x_st, XL, wkv_ptr, pos_ptr, eps,
                    HP: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
                    BX: tl.constexpr, ROWS: tl.constexpr, DOT_F32: tl.constexpr,
                    PRE: tl.constexpr = False, PDL: tl.constexpr = False):
        """Split s of token t (module docstring, `_split_kernel`). q_abs and the cache rows
        are loaded .cg (L2): in the fused kernel other programs wrote them moments ago.
        ROWS (`_split_rows_kernel`): q_ptr holds the raw absorbed q = x·W_q''ᵀ (x = x_ptr[t,
        :XL], the q_a norm weight and W_uk folded into W_q''), scaled here by rms_scale(x)
        and rounded to the cache dtype; the split whose rows hold positions[t] stores token
        t's cache row [bf16(RMSNorm(x[XL:XL+KL]; w_kv)), x[XL+KL:]] first (its loads issued
        with x's and q's), then one CTA barrier before the tiles. BX ≥ XL.
        PRE (with ROWS): the split's first tile is requested first, and with PDL (the caller
        has not waited) before `griddepcontrol.wait`. Its rows are earlier steps' (no kernel
        just before writes them); the one row this step adds, positions[t], is stored by
        this split when it falls in its range, so the tile takes it from registers (rowc,
        rowr) there."""
        t = t.to(tl.int64)
        L = tl.load(len_ptr + t).to(tl.int32)
        chunk = tl.maximum(tl.cdiv(tl.cdiv(L, NS), BN) * BN, MINC)
        start = s * chunk
        end = tl.minimum(L, start + chunk)
        hh = tl.arange(0, HP)
        mh = hh < H
        oc = tl.arange(0, BC)
        mc = oc < KL
        orr = tl.arange(0, BR)
        mr = orr < R
        if PRE:
            rows0, mn0, kc0, kr0 = _tile_rows(c_ptr, c_sb, c_sr, bt_ptr, bt_st, t, start, end,
                                              BS, KL, R, oc, orr, BN)
            if PDL:
                pdl_enter(PDL)
        qb = q_ptr + t * q_st + hh[:, None] * q_sh
        qc = tl.load(qb + oc[None, :], mask=mh[:, None] & mc[None, :], other=0.0,
                     cache_modifier=".cg")                                          # (HP, BC)
        qr = tl.load(qb + KL + orr[None, :], mask=mh[:, None] & mr[None, :], other=0.0,
                     cache_modifier=".cg")
        if ROWS:    # the q_a norm's scalar and this step's cache row; every load issued at once
            ox = tl.arange(0, BX)                                      # BX ≥ XL: x in one load
            xq = tl.load(x_ptr + t * x_st + ox, mask=ox < XL, other=0.0).to(tl.float32)
            xc = tl.load(x_ptr + t * x_st + XL + oc, mask=mc, other=0.0).to(tl.float32)
            xr = tl.load(x_ptr + t * x_st + XL + KL + orr, mask=mr, other=0.0)
            wc = tl.load(wkv_ptr + oc, mask=mc, other=0.0).to(tl.float32)
            pos = tl.load(pos_ptr + t).to(tl.int32)
            rs = tl.rsqrt(tl.sum(xq * xq, 0) / XL + eps)
            qc = (qc.to(tl.float32) * rs).to(c_ptr.dtype.element_ty)
            qr = (qr.to(tl.float32) * rs).to(c_ptr.dtype.element_ty)
            rowc = (xc * tl.rsqrt(tl.sum(xc * xc, 0) / KL + eps) * wc).to(c_ptr.dtype.element_ty)
            rowr = xr.to(c_ptr.dtype.element_ty)
            if (pos >= 0) & (tl.minimum(pos // chunk, NS - 1) == s):   # one split stores it
                prow = pos.to(tl.int64)
                blk = tl.load(bt_ptr + t * bt_st + prow // BS).to(tl.int64)
                dst = c_ptr + blk * c_sb + (prow % BS) * c_sr
                tl.store(dst + oc, rowc, mask=mc)
                tl.store(dst + KL + orr, rowr, mask=mr)
            if PRE:     # the first tile was read before the store: the new row from registers
                new = (rows0 == pos)[:, None]
                kc0 = tl.where(new, rowc[None, :], kc0)
                kr0 = tl.where(new, rowr[None, :], kr0)
            tl.debug_barrier()      # the row's stores before this CTA's later tile loads; the
            # tile loop stays the plain split's (masking the row out of the tiles and attending
            # it from registers cost +22 µs at batch 64)
        if not PRE:
            rows0, mn0, kc0, kr0 = _tile_rows(c_ptr, c_sb, c_sr, bt_ptr, bt_st, t, start, end,
                                              BS, KL, R, oc, orr, BN)
        m_i = tl.full((HP,), float("-inf"), tl.float32)
        l_i = tl.zeros((HP,), tl.float32)
        acc = tl.zeros((HP, BC), tl.float32)
        if start < end:
            m_i, l_i, acc = _attend_tile(qc, qr, kc0, kr0, mn0, m_i, l_i, acc, qk_scale,
                                         DOT_F32)
        for n0 in range(start + BN, end, BN):
            rows, mn, kc, kr = _tile_rows(c_ptr, c_sb, c_sr, bt_ptr, bt_st, t, n0, end, BS, KL,
                                          R, oc, orr, BN)
            m_i, l_i, acc = _attend_tile(qc, qr, kc, kr, mn, m_i, l_i, acc, qk_scale, DOT_F32)
        has = l_i > 0.0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) / 1.4426950408889634,
                       float("-inf"))
        tl.store(o_ptr + t * o_st + s * o_ss + hh[:, None] * o_sh + oc[None, :], o,
                 mask=mh[:, None] & mc[None, :])
        tl.store(l_ptr + t * l_st + s * l_ss + hh * l_sh, lse, mask=mh)

    @triton.jit
    def _merge_part(o_ptr, o_st, o_ss, o_sh, l_ptr, l_st, l_ss, l_sh,
                    w_ptr, w_sh, w_sc, g_ptr, g_st, y_ptr, y_st,
                    ol_ptr, ol_st, ol_sh, lo_ptr, lo_st, lo_sh, T, NS, KL, V, tb, hd, vb,
                    BT: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr,
                    PROJECT: tl.constexpr, DOT_F32: tl.constexpr):
        """Merge of the S partials of tokens tb-block, head hd (module docstring)."""
        hd = hd.to(tl.int64)
        tt = (tb * BT + tl.arange(0, BT)).to(tl.int64)
        mt = tt < T
        oc = tl.arange(0, BC)
        mc = oc < KL
        lb = l_ptr + tt * l_st + hd * l_sh
        mx = tl.full((BT,), float("-inf"), tl.float32)
        for s in range(NS):
            mx = tl.maximum(mx, tl.load(lb + s * l_ss, mask=mt, other=float("-inf"),
                                        cache_modifier=".cg"))
        safe = tl.where(mx == float("-inf"), 0.0, mx)
        den = tl.zeros((BT,), tl.float32)
        acc = tl.zeros((BT, BC), tl.float32)
        ob = o_ptr + tt[:, None] * o_st + hd * o_sh + oc[None, :]
        for s in range(NS):
            w = tl.exp(tl.load(lb + s * l_ss, mask=mt, other=float("-inf"),
                               cache_modifier=".cg") - safe)                   # −inf → 0
            den += w
            o = tl.load(ob + s * o_ss, mask=mt[:, None] & mc[None, :], other=0.0,
                        cache_modifier=".cg")
            acc += w[:, None] * o
        o_lat = acc / tl.where(den > 0.0, den, 1.0)[:, None]       # (BT, BC); no rows: 0
        if PROJECT:
            vv = vb * BV + tl.arange(0, BV)
            mv = vv < V
            wv = tl.load(w_ptr + hd * w_sh + oc[:, None] * w_sc + vv[None, :],
                         mask=mc[:, None] & mv[None, :], other=0.0)      # (BC, BV)
            y = _mm(o_lat.to(wv.dtype), wv, DOT_F32)                           # (BT, BV) fp32
            y = y.to(y_ptr.dtype.element_ty).to(tl.float32)
            mo = mt[:, None] & mv[None, :]
            g = tl.load(g_ptr + tt[:, None] * g_st + hd * V + vv[None, :], mask=mo, other=0.0)
            y = y * tl.sigmoid(g.to(tl.float32))
            tl.store(y_ptr + tt[:, None] * y_st + hd * V + vv[None, :],
                     y.to(y_ptr.dtype.element_ty), mask=mo)
        else:
            tl.store(ol_ptr + tt[:, None] * ol_st + hd * ol_sh + oc[None, :], o_lat,
                     mask=mt[:, None] & mc[None, :])
            lse = tl.where(den > 0.0, safe + tl.log(tl.where(den > 0.0, den, 1.0)),
                           float("-inf"))
            tl.store(lo_ptr + tt * lo_st + hd * lo_sh, lse, mask=mt)

    @triton.jit
    def _output_token_weights(w_ptr, w_sh, w_sc, KL, V, hd, vb, BC: tl.constexpr,
                              BV: tl.constexpr):
        """w_uv_t[hd][:, vb-block] (BC, BV): loaded first (the fused kernel: before its wait)."""
        oc = tl.arange(0, BC)
        vv = vb * BV + tl.arange(0, BV)
        return tl.load(w_ptr + hd.to(tl.int64) * w_sh + oc[:, None] * w_sc + vv[None, :],
                       mask=(oc < KL)[:, None] & (vv < V)[None, :], other=0.0)

    @triton.jit
    def _output_token_part(o_ptr, o_st, o_ss, o_sh, l_ptr, l_st, l_ss, l_sh,
                           wv, g_ptr, g_st, y_ptr, y_st, NS, KL, V, t, hd, vb,
                           SP: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr):
        """Small-batch form of the PROJECT merge: one token per program, all S partials of
        (t, h) loaded as one (SP, BC) tile (no loop over splits, no 16-token padding), the
        w_uv product (wv: `_output_token_weights`) as a broadcast-multiply + sum (M = 1)."""
        t, hd = t.to(tl.int64), hd.to(tl.int64)
        ss = tl.arange(0, SP)
        ms = ss < NS
        oc = tl.arange(0, BC)
        mc = oc < KL
        vv = vb * BV + tl.arange(0, BV)
        mv = vv < V
        lse = tl.load(l_ptr + t * l_st + ss * l_ss + hd * l_sh, mask=ms, other=float("-inf"),
                      cache_modifier=".cg")
        o = tl.load(o_ptr + t * o_st + ss[:, None] * o_ss + hd * o_sh + oc[None, :],
                    mask=ms[:, None] & mc[None, :], other=0.0,
                    cache_modifier=".cg")                                    # (SP, BC) fp32
        mx = tl.max(lse, 0)
        w = tl.exp(lse - tl.where(mx == float("-inf"), 0.0, mx))             # −inf → 0
        den = tl.sum(w, 0)
        o_lat = tl.sum(w[:, None] * o, 0) / tl.where(den > 0.0, den, 1.0)    # (BC,)
        o_lat = o_lat.to(wv.dtype).to(tl.float32)                            # stock's bf16
        y = tl.sum(o_lat[:, None] * wv.to(tl.float32), 0)                     # (BV,) fp32
        y = y.to(y_ptr.dtype.element_ty).to(tl.float32)
        g = tl.load(g_ptr + t * g_st + hd * V + vv, mask=mv, other=0.0)
        y = y * tl.sigmoid(g.to(tl.float32))
        tl.store(y_ptr + t * y_st + hd * V + vv, y.to(y_ptr.dtype.element_ty), mask=mv)

    # ---- one kernel per op ---------------------------------------------------------------

    @triton.jit
    def _prep_kernel(qkv_ptr, qkv_st, wq_ptr, wkv_ptr, q_ptr, q_st, c_ptr, c_sb, c_sr,
                     bt_ptr, bt_st, pos_ptr, QL, KL, R, BS, eps,
                     BQ: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        t = tl.program_id(0).to(tl.int64)
        oq = tl.arange(0, BQ)
        mq = oq < QL
        x = tl.load(qkv_ptr + t * qkv_st + oq, mask=mq, other=0.0).to(tl.float32)
        w = tl.load(wq_ptr + oq, mask=mq, other=0.0).to(tl.float32)
        y = x * tl.rsqrt(tl.sum(x * x, 0) / QL + eps) * w
        tl.store(q_ptr + t * q_st + oq, y.to(q_ptr.dtype.element_ty), mask=mq)
        tt = t + tl.arange(0, 1)                                  # (1,): token t as a tile
        _row_store_part(qkv_ptr, qkv_st, QL, KL, R, wkv_ptr, c_ptr, c_sb, c_sr, bt_ptr, bt_st,
                        pos_ptr, BS, eps, tt, tt == t, BC, BR)

    @triton.jit
    def _absorb_kernel(q_ptr, q_st, q_sh, w_ptr, w_sh, w_sn, o_ptr, o_st, o_sh, T, NOPE, KL, R,
                       BT: tl.constexpr, BNP: tl.constexpr, BC: tl.constexpr,
                       BR: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        _absorb_part(q_ptr, q_st, q_sh, w_ptr, w_sh, w_sn, o_ptr, o_st, o_sh, T, NOPE, KL, R,
                     tl.program_id(0), tl.program_id(1), tl.program_id(2), q_ptr, 0, 1, 0.0,
                     BT, BNP, BC, BR, 16, False, DOT_F32)

    @triton.jit
    def _split_kernel(q_ptr, q_st, q_sh, c_ptr, c_sb, c_sr, bt_ptr, bt_st, len_ptr,
                      o_ptr, o_st, o_ss, o_sh, l_ptr, l_st, l_ss, l_sh,
                      H, KL, R, BS, qk_scale, NS, MINC,
                      HP: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
                      DOT_F32: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        _split_part(q_ptr, q_st, q_sh, c_ptr, c_sb, c_sr, bt_ptr, bt_st, len_ptr,
                    o_ptr, o_st, o_ss, o_sh, l_ptr, l_st, l_ss, l_sh, H, KL, R, BS, qk_scale,
                    NS, MINC, tl.program_id(0), tl.program_id(1), q_ptr, 0, 0, q_ptr, len_ptr,
                    0.0, HP, BC, BR, BN, 16, False, DOT_F32)

    @triton.jit
    def _split_rows_kernel(q_ptr, q_st, q_sh, c_ptr, c_sb, c_sr, bt_ptr, bt_st, len_ptr,
                           o_ptr, o_st, o_ss, o_sh, l_ptr, l_st, l_ss, l_sh,
                           H, KL, R, BS, qk_scale, NS, MINC, x_ptr, x_st, XL, wkv_ptr,
                           pos_ptr, eps, HP: tl.constexpr, BC: tl.constexpr,
                           BR: tl.constexpr, BN: tl.constexpr, BX: tl.constexpr,
                           DOT_F32: tl.constexpr, PDL: tl.constexpr, PRE_TILE: tl.constexpr):
        """PRE_TILE: the first tile's loads first, and the PDL wait after them (inside
        `_split_part`); otherwise the wait first, as every other kernel here."""
        if not PRE_TILE:
            pdl_enter(PDL)
        _split_part(q_ptr, q_st, q_sh, c_ptr, c_sb, c_sr, bt_ptr, bt_st, len_ptr,
                    o_ptr, o_st, o_ss, o_sh, l_ptr, l_st, l_ss, l_sh, H, KL, R, BS, qk_scale,
                    NS, MINC, tl.program_id(0), tl.program_id(1), x_ptr, x_st, XL, wkv_ptr,
                    pos_ptr, eps, HP, BC, BR, BN, BX, True, DOT_F32, PRE_TILE, PDL)

    @triton.jit
    def _merge_kernel(o_ptr, o_st, o_ss, o_sh, l_ptr, l_st, l_ss, l_sh,
                      w_ptr, w_sh, w_sc, g_ptr, g_st, y_ptr, y_st,
                      ol_ptr, ol_st, ol_sh, lo_ptr, lo_st, lo_sh, T, NS, KL, V,
                      BT: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr,
                      PROJECT: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        _merge_part(o_ptr, o_st, o_ss, o_sh, l_ptr, l_st, l_ss, l_sh, w_ptr, w_sh, w_sc,
                    g_ptr, g_st, y_ptr, y_st, ol_ptr, ol_st, ol_sh, lo_ptr, lo_st, lo_sh,
                    T, NS, KL, V, tl.program_id(0), tl.program_id(1), tl.program_id(2),
                    BT, BC, BV, PROJECT, DOT_F32)

    @triton.jit
    def _output_token_kernel(o_ptr, o_st, o_ss, o_sh, l_ptr, l_st, l_ss, l_sh,
                             w_ptr, w_sh, w_sc, g_ptr, g_st, y_ptr, y_st, NS, KL, V,
                             SP: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr,
                             PDL: tl.constexpr):
        pdl_enter(PDL)
        hd, vb = tl.program_id(1), tl.program_id(2)
        wv = _output_token_weights(w_ptr, w_sh, w_sc, KL, V, hd, vb, BC, BV)
        _output_token_part(o_ptr, o_st, o_ss, o_sh, l_ptr, l_st, l_ss, l_sh, wv, g_ptr, g_st,
                           y_ptr, y_st, NS, KL, V, tl.program_id(0), hd, vb, SP, BC, BV)

    # ---- the fused kernel: absorb (+ prep's row store and q norm), split, output -----------

    @triton.jit
    def _wait_count(ptr, n, max_spins, err_ptr):
        """Spin (acquire, gpu scope) until *ptr ≥ n or max_spins polls (then *err_ptr = 1);
        the barrier orders every thread's later loads after the acquiring poll."""
        seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
        spins = max_spins * 0
        while (seen < n) & (spins < max_spins):
            seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
            spins += 1
        tl.atomic_max(err_ptr, 1, mask=seen < n, sem="relaxed", scope="gpu")
        tl.debug_barrier()

    @triton.jit
    def _fused_kernel(sync_ptr, max_spins, x_ptr, x_st, wkv_ptr, q_ptr, q_st, q_sh,
                      wuk_ptr, wuk_sh, wuk_sn, qa_ptr, qa_st, qa_sh,
                      c_ptr, c_sb, c_sr, bt_ptr, bt_st, pos_ptr, len_ptr,
                      o_ptr, o_st, o_ss, o_sh, l_ptr, l_st, l_ss, l_sh,
                      wuv_ptr, wuv_sh, wuv_sc, g_ptr, g_st, y_ptr, y_st,
                      T, H, XL, NOPE, KL, R, V, BS, NS, MINC, eps, qk_scale, NCB, NVB,
                      BT: tl.constexpr, BNP: tl.constexpr, BCA: tl.constexpr,
                      BX: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr, HP: tl.constexpr,
                      BN: tl.constexpr, SP: tl.constexpr, BV: tl.constexpr,
                      TOKEN_OUT: tl.constexpr, ONLY_A: tl.constexpr, DOT_F32: tl.constexpr,
                      PDL: tl.constexpr, trace_ptr=None, TRACE: tl.constexpr = False):
        pdl_enter(PDL)
        n_tb = tl.cdiv(T, BT)
        n_r = n_tb                                 # A: row-store programs, one per token block
        n_a = n_r + n_tb * H * NCB                 #    + q_abs blocks
        n_b = T * NS
        if TOKEN_OUT:
            n_c = T * H * NVB
        else:
            n_c = n_tb * H * NVB
        if ONLY_A:      # A alone (larger batches: split and output run as their own kernels)
            tk = tl.program_id(0)
        else:           # ticket = dynamic program id: every smaller ticket's program has
                        # started, so waiting on smaller tickets always makes progress
            tk = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
        if TRACE:       # (probe only: inline PTX) per ticket: SM, start, work start, work end
            t_start = _cuda.globaltimer()
        if tk < n_r:                               # A: cache rows of token block tk
            tt = (tk * BT + tl.arange(0, BT)).to(tl.int64)
            _row_store_part(x_ptr, x_st, XL, KL, R, wkv_ptr, c_ptr, c_sb, c_sr, bt_ptr,
                            bt_st, pos_ptr, BS, eps, tt, tt < T, BC, BR)
        elif tk < n_a:                             # A: q_abs block (rms scale, absorb)
            k = tk - n_r
            _absorb_part(q_ptr, q_st, q_sh, wuk_ptr, wuk_sh, wuk_sn, qa_ptr, qa_st, qa_sh, T,
                         NOPE, KL, R, k // (H * NCB), (k // NCB) % H, k % NCB, x_ptr, x_st,
                         XL, eps, BT, BNP, BCA, BR, BX, True, DOT_F32)
        if not ONLY_A:
            if tk < n_a:
                tl.debug_barrier()                 # the CTA's stores before the release
                tl.atomic_add(sync_ptr + 1, 1, sem="release", scope="gpu")
                if TRACE:
                    t_work = t_start
            elif tk < n_a + n_b:                   # B: split s of token t, after all of A
                _wait_count(sync_ptr + 1, n_a, max_spins, sync_ptr + 4)
                if TRACE:
                    t_work = _cuda.globaltimer()
                k = tk - n_a
                _split_part(qa_ptr, qa_st, qa_sh, c_ptr, c_sb, c_sr, bt_ptr, bt_st, len_ptr,
                            o_ptr, o_st, o_ss, o_sh, l_ptr, l_st, l_ss, l_sh, H, KL, R, BS,
                            qk_scale, NS, MINC, k // NS, k % NS, x_ptr, x_st, XL, wkv_ptr,
                            pos_ptr, eps, HP, BC, BR, BN, BX, False, DOT_F32)
                tl.debug_barrier()
                tl.atomic_add(sync_ptr + 2, 1, sem="release", scope="gpu")
            else:                                  # C: merge + W_uv + gate, after all of B
                k = tk - n_a - n_b
                if TOKEN_OUT:
                    t = k // (H * NVB)
                    hd = (k // NVB) % H
                    vb = k % NVB
                    wv = _output_token_weights(wuv_ptr, wuv_sh, wuv_sc, KL, V, hd, vb, BC,
                                               BV)          # weights: in flight during the wait
                    _wait_count(sync_ptr + 2, n_b, max_spins, sync_ptr + 4)
                    if TRACE:
                        t_work = _cuda.globaltimer()
                    _output_token_part(o_ptr, o_st, o_ss, o_sh, l_ptr, l_st, l_ss, l_sh, wv,
                                       g_ptr, g_st, y_ptr, y_st, NS, KL, V, t, hd, vb, SP, BC,
                                       BV)
                else:
                    _wait_count(sync_ptr + 2, n_b, max_spins, sync_ptr + 4)
                    if TRACE:
                        t_work = _cuda.globaltimer()
                    _merge_part(o_ptr, o_st, o_ss, o_sh, l_ptr, l_st, l_ss, l_sh, wuv_ptr,
                                wuv_sh, wuv_sc, g_ptr, g_st, y_ptr, y_st, o_ptr, 0, 0, l_ptr,
                                0, 0, T, NS, KL, V, k // (H * NVB), (k // NVB) % H, k % NVB,
                                BT, BC, BV, True, DOT_F32)
            if TRACE:
                row = trace_ptr + tk.to(tl.int64) * 4
                tl.store(row, _cuda.smid().to(tl.int64))
                tl.store(row + 1, t_start)
                tl.store(row + 2, t_work)
                tl.store(row + 3, _cuda.globaltimer())
            # the last program out resets the counters for the next call (graph replays too)
            done = tl.atomic_add(sync_ptr + 3, 1, sem="acq_rel", scope="gpu")
            last = done == n_a + n_b + n_c - 1
            for i in tl.static_range(4):
                tl.atomic_xchg(sync_ptr + i, 0, mask=last, sem="relaxed", scope="gpu")


# token-per-program output kernel up to this batch (above it the 16-token tl.dot form reuses
# each w_uv tile across tokens)
OUTPUT_TOKEN_MAX_T = 8


def _p2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


# ---- launchers (caller-allocated outputs; inputs validated by kernels/mla_decode.py) --------

def prep_triton(qkv, q_norm_w, kv_norm_w, cache, block_table, positions, q_lora: int,
                kv_lora: int, eps: float, q_out: torch.Tensor) -> torch.Tensor:
    T = qkv.shape[0]
    R = qkv.shape[1] - q_lora - kv_lora
    _prep_kernel[(T,)](qkv, qkv.stride(0), q_norm_w, kv_norm_w, q_out, q_out.stride(0),
                       cache, cache.stride(0), cache.stride(1), block_table,
                       block_table.stride(0), positions, q_lora, kv_lora, R, cache.shape[1],
                       float(eps), BQ=_p2(q_lora), BC=_p2(kv_lora), BR=_p2(R),
                       num_warps=4 if q_lora <= 2048 else 8, **pdl_launch(q_out))
    return q_out


def absorb_triton(q, w_uk, nope: int, out: torch.Tensor) -> torch.Tensor:
    T, h, d = q.shape
    kl, R = w_uk.shape[2], d - nope
    BC = 64
    grid = (triton.cdiv(T, 16), h, triton.cdiv(kl, BC))
    _absorb_kernel[grid](q, q.stride(0), q.stride(1), w_uk, w_uk.stride(0), w_uk.stride(1),
                         out, out.stride(0), out.stride(1), T, nope, kl, R,
                         BT=16, BNP=_p2(nope), BC=BC, BR=_p2(R), DOT_F32=not q.is_cuda,
                         num_warps=4, **pdl_launch(out))
    return out


def split_triton(q_abs, cache, block_table, seq_lens, kv_lora: int, scale: float,
                 o_part: torch.Tensor, lse_part: torch.Tensor) -> None:
    """o_part (T, S, h, c) fp32, lse_part (T, S, h) fp32: every element written."""
    T, h, d = q_abs.shape
    S = o_part.shape[1]
    R = d - kv_lora
    BN = 32 if kv_lora >= 256 else 64
    _split_kernel[(T, S)](q_abs, q_abs.stride(0), q_abs.stride(1), cache, cache.stride(0),
                          cache.stride(1), block_table, block_table.stride(0), seq_lens,
                          o_part, o_part.stride(0), o_part.stride(1), o_part.stride(2),
                          lse_part, lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
                          h, kv_lora, R, cache.shape[1], float(scale) * LOG2E, S, MIN_CHUNK,
                          HP=_p2(h), BC=_p2(kv_lora), BR=_p2(R), BN=BN,
                          DOT_F32=not q_abs.is_cuda, num_warps=4 if kv_lora <= 256 else 8,
                          num_stages=2, **pdl_launch(o_part))


def split_rows_triton(q, qkv, kv_norm_w, cache, block_table, positions, seq_lens,
                      q_lora: int, kv_lora: int, eps: float, scale: float,
                      o_part: torch.Tensor, lse_part: torch.Tensor,
                      pre_tile: bool = True) -> None:
    """`split_triton` on the raw absorbed q (T, h, c + R) fp32 or bf16, x·W_q''ᵀ with x =
    qkv[:, :q_lora]: scaled by rms_scale(x) and rounded to the cache dtype per program; the
    split holding positions[t] stores token t's row (qkv's kv part) before reading its tiles.
    Every token its own sequence: no other token reads that row here. pre_tile: each split
    requests its first KV tile before its PDL wait (the new row patched in from registers);
    False: the wait first."""
    T, h, d = q.shape
    S = o_part.shape[1]
    R = d - kv_lora
    _split_rows_kernel[(T, S)](
        q, q.stride(0), q.stride(1), cache, cache.stride(0), cache.stride(1), block_table,
        block_table.stride(0), seq_lens, o_part, o_part.stride(0), o_part.stride(1),
        o_part.stride(2), lse_part, lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
        h, kv_lora, R, cache.shape[1], float(scale) * LOG2E, S, MIN_CHUNK, qkv, qkv.stride(0),
        q_lora, kv_norm_w, positions, float(eps), HP=_p2(h), BC=_p2(kv_lora), BR=_p2(R),
        BN=32 if kv_lora >= 256 else 64, BX=_p2(q_lora), DOT_F32=not q.is_cuda,
        num_warps=4 if kv_lora <= 256 else 8, num_stages=2,
        PRE_TILE=bool(pre_tile), **pdl_launch(o_part))


def merge_triton(o_part, lse_part, o_lat: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge (T, S, h, c) / (T, S, h) partials into o_lat (T, h, c), lse (T, h) fp32."""
    T, S, h, kl = o_part.shape
    _merge_kernel[(triton.cdiv(T, 16), h, 1)](
        o_part, o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part, lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
        o_part, 0, 0, o_part, 0, o_part, 0,
        o_lat, o_lat.stride(0), o_lat.stride(1), lse, lse.stride(0), lse.stride(1),
        T, S, kl, 1, BT=16, BC=_p2(kl), BV=16, PROJECT=False, DOT_F32=not o_part.is_cuda,
        num_warps=4, **pdl_launch(o_lat))


def output_triton(o_part, lse_part, w_uv_t, gate, out: torch.Tensor) -> torch.Tensor:
    """Merge + bf16 + w_uv + sigmoid gate: out (T, h·v)."""
    T, S, h, kl = o_part.shape
    V = w_uv_t.shape[2]
    if T <= OUTPUT_TOKEN_MAX_T and _p2(S, 2) * _p2(kl) <= 16384:   # tile fits registers
        BV = 16
        _output_token_kernel[(T, h, triton.cdiv(V, BV))](
            o_part, o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse_part, lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
            w_uv_t, w_uv_t.stride(0), w_uv_t.stride(1), gate, gate.stride(0), out,
            out.stride(0), S, kl, V, SP=_p2(S, 2), BC=_p2(kl), BV=BV,
            num_warps=4 if _p2(S, 2) * _p2(kl) <= 8192 else 8, **pdl_launch(out))
        return out
    BV = 32 if V >= 32 else 16
    _merge_kernel[(triton.cdiv(T, 16), h, triton.cdiv(V, BV))](
        o_part, o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part, lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
        w_uv_t, w_uv_t.stride(0), w_uv_t.stride(1), gate, gate.stride(0), out, out.stride(0),
        o_part, 0, 0, lse_part, 0, 0, T, S, kl, V,
        BT=16, BC=_p2(kl), BV=BV, PROJECT=True, DOT_F32=not o_part.is_cuda,
        num_warps=4 if kl <= 256 else 8, **pdl_launch(out))
    return out


FUSED_BCA = 64                  # latent columns per phase-A (absorb) program
FUSED_MAX_SPINS = 1 << 22       # polls before a phase wait gives up (sync[4] = 1): a bug, not a
                                # load condition (each wait is on programs that already started)


def fused_grid(T: int, h: int, S: int, kv_lora: int, V: int) -> dict:
    """`_fused_kernel`'s programs per phase (tickets [0, A), [A, A + B), [A + B, total); A =
    one row-store program per 16 tokens + the absorb blocks), the output form (token per
    program up to OUTPUT_TOKEN_MAX_T, as `output_triton`) and its BV."""
    token_out = T <= OUTPUT_TOKEN_MAX_T and _p2(S, 2) * _p2(kv_lora) <= 16384
    bv = 16 if token_out else (32 if V >= 32 else 16)
    n_tb = triton.cdiv(T, 16)
    n = {"A": n_tb + n_tb * h * triton.cdiv(kv_lora, FUSED_BCA), "B": T * S,
         "C": (T if token_out else n_tb) * h * triton.cdiv(V, bv)}
    return {**n, "total": n["A"] + n["B"] + n["C"], "token_out": token_out, "bv": bv}


def fused_triton(qkv, q, kv_norm_w, w_uk, cache, block_table, positions, seq_lens, w_uv_t,
                 gate, q_lora: int, kv_lora: int, eps: float, scale: float,
                 q_abs: torch.Tensor, o_part: torch.Tensor, lse_part: torch.Tensor,
                 sync: torch.Tensor, out: torch.Tensor | None, only_a: bool = False,
                 num_warps: int | None = None, max_spins: int = FUSED_MAX_SPINS,
                 trace: torch.Tensor | None = None) -> torch.Tensor:
    """One launch: phase A = the cache rows + absorb with the q norm folded in, B = split,
    C = merge + W_uv + gate (the module docstring's parts). Workspaces: q_abs (T, h, c + R)
    bf16, o_part (T, S, h, c) / lse_part (T, S, h) fp32, sync (≥ 5,) int32 zeros (left zero
    after the call; sync[4] = 1 if a wait gave up). only_a: phase A alone (no counters; out
    unused: the caller runs split_triton + output_triton on q_abs). trace (probe only, CUDA):
    (grid, 4) int64 rows [SM, start ns, work start ns, end ns] per ticket (A: work = start)."""
    T, h, d = q.shape
    R = qkv.shape[1] - q_lora - kv_lora
    S, V = o_part.shape[1], w_uv_t.shape[2]
    g = fused_grid(T, h, S, kv_lora, V)
    out = q_abs if out is None else out
    if num_warps is None:
        num_warps = 4 if kv_lora <= 256 else 8
    _fused_kernel[(g["A"] if only_a else g["total"],)](
        sync, max_spins, qkv, qkv.stride(0), kv_norm_w, q, q.stride(0), q.stride(1),
        w_uk, w_uk.stride(0), w_uk.stride(1), q_abs, q_abs.stride(0), q_abs.stride(1),
        cache, cache.stride(0), cache.stride(1), block_table, block_table.stride(0),
        positions, seq_lens, o_part, o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part, lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
        w_uv_t, w_uv_t.stride(0), w_uv_t.stride(1), gate, gate.stride(0), out, out.stride(0),
        T, h, q_lora, d - R, kv_lora, R, V, cache.shape[1], S, MIN_CHUNK, float(eps),
        float(scale) * LOG2E, triton.cdiv(kv_lora, FUSED_BCA), triton.cdiv(V, g["bv"]),
        BT=16, BNP=_p2(d - R), BCA=FUSED_BCA, BX=min(512, _p2(q_lora)), BC=_p2(kv_lora),
        BR=_p2(R), HP=_p2(h), BN=32 if kv_lora >= 256 else 64, SP=_p2(S, 2), BV=g["bv"],
        TOKEN_OUT=g["token_out"], ONLY_A=only_a, DOT_F32=not q.is_cuda, num_warps=num_warps,
        num_stages=2, trace_ptr=trace, TRACE=trace is not None, **pdl_launch(q_abs))
    return q_abs if only_a else out


__all__ = ["available", "prep_triton", "absorb_triton", "split_triton", "split_rows_triton",
           "merge_triton", "output_triton", "fused_triton", "fused_grid", "FUSED_MAX_SPINS",
           "MIN_CHUNK"]
