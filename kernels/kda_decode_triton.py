"""Triton kernel of the fused KDA decode step (kernels/kda_decode.py has the math and contract).

Grid (T, heads): one program per (sequence t, head hh), head_dim D (constexpr, power of two
16..128). Everything between the in_proj and o_proj GEMVs:

    f_b     fb[c] = Σ_k fb_w[hh·D + c, k] · f_a[k]        (D,)  fp32 acc over KB-wide k chunks
            rounded to bf16 (F.linear's output)
    gate    g = lb · sigmoid(exp_a[hh] · (fb + dt_bias)),  β = sigmoid(b[hh])
    conv    per part p ∈ {q, k, v}, channels p·C + hh·D + c:
            xs (D, WP) = [conv_state (W−1 taps, oldest first) | proj current]   WP = pow2 ≥ W
            y = bf16(SiLU(Σ_w xs·conv_w)) as fp32;  q, k ← y · rsqrt(Σy² + 1e-6)
    delta   loop over NV = D / BV column blocks of S (columns are independent given q, k, g, β):
            S (D, BV) fp32 loaded; v (BV,) from its conv channels;
            S' = e^g ⊙_rows S;  u = β (v − kᵀS');  S_new = S' + k uᵀ;  o_blk = scale · qᵀS_new
            barrier, S_new stored in place (each element read once, written once), v conv taps
            shifted in place; o_blk kept in a (NV, BV) register tile
    out     bf16(RMSNorm(o; o_norm_w, eps) · sigmoid(g_out))    written to out[t, hh·D:(hh+1)·D]
    state   barrier, then q/k xs[:, 1:W] → conv_state (in place)

State row: r = slots[t] when HAS_SLOTS (conv_state / rec_state are a slot pool, e.g. one
layer's KDA cache), else r = t. proj and out are always row t.

Split form (`_kda_decode_split_kernel`, grid (T, heads, NS), `split_count` picks NS ≥ 4 when
batch·heads·4 fits one wave of SMs): program js of a head owns value columns [js·BV, (js+1)·BV),
BV = D/NS (columns of S are independent given q, k, g, β; each program recomputes f_b, g and
the q/k convs of its head). It requests the f_b weights, its state block, conv taps and
weights before the PDL wait, so a caller must not let the kernel launched just before it write
those (the model's in_proj GEMV writes only proj). After the delta rule on its block it stores
its o columns (fp32) to a scratch row and adds 1 to the head's counter (one atom.acq_rel.gpu
after a CTA barrier); the head's last program reads the D columns back (.cg), writes the gated
RMSNorm output and the q/k conv taps (every other program read them before its release) and
resets the counter to 0 (graph replays need no memset). Measured: docs/PERF.md §1.3.

`launch_config` picks, for the one-program form, BV = D (one step, D/16 warps) for small
grids and BV = 32 with 4 warps once batch·heads ≥ 128 (more programs resident per SM). H200,
L2-cold (inputs rotated over 200 MB), CUDA graph of 50 calls, µs per call, D = 128 (the
one-program form) — a development sweep whose raw output was not committed (no JSON under
bench/results/): indicative only; the committed in-layer
figure is the layer benchmark's profile (bench/results/layer-h200-2026-11-29-r3.json, 7.9 µs):
    T × heads     1×6   4×6  16×6  64×6   1×12  16×12  64×12
    BV128 w8      7.7   9.1  10.9  30.9   9.0   19.8   56.8
    BV32  w4      9.6  11.5  12.8  21.8  11.3   16.0   40.4
    torch chain  80.7              141.8  92.9         217.4   (kda_decode_reference)
64×12 moves 106 MB: 2.6 TB/s. At batch 1 only `heads` SMs work; the floor of an empty-ish
launch in a graph here is ~2.9 µs (4 × 32 heads).

The barrier (`tl.debug_barrier`, one bar.sync) orders every thread's loads of the in-place
buffers before any thread's stores: a (D,)-vector or small tile can be replicated across
threads, and without it a fast warp could overwrite a conv tap another warp has not read yet.

bf16 rounding points are done by hand (round to nearest even on the fp32 bits, `_rne_bf16`)
so the interpreter (which truncates on .to(bf16)) and the GPU round identically; the value is
then exactly representable and the final cast is exact. Hence the kernel supports bf16 model
dtype only (the dispatcher sends other dtypes to the reference).

Bytes per call (K3, TP16: heads 6, D 128, W 4), batch T: state 2·T·6·64 KiB, fb_w 192 KiB
(once; L2 across t), conv state 2·T·13.5 KiB, conv_w 36 KiB, proj/out ≈ 8 KiB per token
(T = 1: 1.06 MB).
No host sync; no allocation after the first call of a shape (the split form's scratch, made
outside any capture by the eager warm-up): capturable in a CUDA graph.
"""
from __future__ import annotations

import torch

from raydecode.kernels._triton import (H200_SMS, available, pdl_enter, pdl_launch, sm_count,
                                       tl, triton)

if triton is not None:

    @triton.jit
    def _rne_bf16(x):
        """fp32 -> the nearest bf16 value (ties to even), kept in fp32 (finite x)."""
        b = x.to(tl.uint32, bitcast=True)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        return b.to(tl.float32, bitcast=True)

    @triton.jit
    def _conv_taps(cbase, c_sc, c_sw, cw_ptr, cw_sc, cw_sw, ch,
                   W: tl.constexpr, WP: tl.constexpr):
        """Channels ch: the W−1 state taps (oldest first, 0 pad to WP) and the conv weights
        (D, WP); nothing the step's projection writes."""
        taps = tl.arange(0, WP)[None, :]
        old = tl.load(cbase + ch[:, None] * c_sc + taps * c_sw, mask=taps < W - 1, other=0.0)
        w = tl.load(cw_ptr + ch[:, None] * cw_sc + taps * cw_sw, mask=taps < W, other=0.0)
        return old, w

    @triton.jit
    def _conv_out(old, w, cur, W: tl.constexpr, WP: tl.constexpr):
        """xs (D, WP) = [state taps | current input | 0 pad] and y = bf16(SiLU(Σ_w xs·w)) in
        fp32."""
        taps = tl.arange(0, WP)[None, :]
        xs = tl.where(taps == W - 1, cur[:, None], old)
        y = tl.sum(xs.to(tl.float32) * w, 1)
        return _rne_bf16(y * tl.sigmoid(y)), xs

    @triton.jit
    def _conv_part(prow, p_sc, cbase, c_sc, c_sw, cw_ptr, cw_sc, cw_sw, ch,
                   W: tl.constexpr, WP: tl.constexpr):
        """`_conv_out` of channels ch with their taps and current input loaded here."""
        old, w = _conv_taps(cbase, c_sc, c_sw, cw_ptr, cw_sc, cw_sw, ch, W, WP)
        return _conv_out(old, w, tl.load(prow + ch * p_sc), W, WP)

    @triton.jit
    def _state_row(slot_ptr, t, HAS_SLOTS: tl.constexpr):
        """State row of sequence t: slots[t] in a slot pool (HAS_SLOTS), else t."""
        if HAS_SLOTS:
            return tl.load(slot_ptr + t).to(tl.int64)
        return t

    @triton.jit
    def _l2(x):
        return x * tl.rsqrt(tl.sum(x * x, 0) + 1e-6)

    @triton.jit
    def _qk_conv_l2(prow, p_sc, cbase, c_sc, c_sw, cw_ptr, cw_sc, cw_sw, ch, C,
                    W: tl.constexpr, WP: tl.constexpr):
        """q and k of head channels ch (k at ch + C) through the conv, SiLU and bf16 rounding,
        then their L2 norms -> (q, xs of q, k, xs of k)."""
        q, xq = _conv_part(prow, p_sc, cbase, c_sc, c_sw, cw_ptr, cw_sc, cw_sw, ch, W, WP)
        k, xk = _conv_part(prow, p_sc, cbase, c_sc, c_sw, cw_ptr, cw_sc, cw_sw, ch + C, W, WP)
        return _l2(q), xq, _l2(k), xk

    @triton.jit
    def _delta_block(srow, r_sk, r_sv, i, jj, prow, p_sc, cbase, c_sc, c_sw, cw_ptr, cw_sc,
                     cw_sw, chv, q, k, eg, beta, scale, W: tl.constexpr, WP: tl.constexpr):
        """One (D, BV) column block jj of the gated delta rule (columns are independent): the
        block's v channels chv through the conv, S' = Diag(e^g) S, S ← S' + k (β (v − kᵀS'))ᵀ
        and its conv taps stored in place once every thread has loaded them. -> the block of
        o = scale · qᵀS (BV,)."""
        taps = tl.arange(0, WP)[None, :]
        keep = (taps >= 1) & (taps < W)                      # xs[:, 1:W] -> taps 0..W−2
        s_ptrs = srow + i[:, None] * r_sk + jj[None, :] * r_sv
        S = tl.load(s_ptrs)                                  # (D, BV) fp32
        v, xv = _conv_part(prow, p_sc, cbase, c_sc, c_sw, cw_ptr, cw_sc, cw_sw, chv, W, WP)
        Sp = S * eg[:, None]                                 # Diag(e^g) S
        u = beta * (v - tl.sum(k[:, None] * Sp, 0))          # (BV,)
        Sn = Sp + k[:, None] * u[None, :]
        o = scale * tl.sum(q[:, None] * Sn, 0)
        tl.debug_barrier()                                   # loads of S, v taps before stores
        tl.store(s_ptrs, Sn)
        tl.store(cbase + chv[:, None] * c_sc + (taps - 1) * c_sw, xv, mask=keep)
        return o

    @triton.jit
    def _kda_decode_kernel(
            proj_ptr, p_st, p_sc, fbw_ptr, fbw_sr, fbw_sc,
            conv_ptr, c_st, c_sc, c_sw, cw_ptr, cw_sc, cw_sw,
            expa_ptr, expa_s, dtb_ptr, dtb_s, onw_ptr, onw_s,
            rec_ptr, r_st, r_sh, r_sk, r_sv, out_ptr, o_st, o_sc, slot_ptr,
            NH, lower_bound, eps, scale,
            D: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, KB: tl.constexpr,
            BV: tl.constexpr, NV: tl.constexpr, HAS_SLOTS: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        t = tl.program_id(0).to(tl.int64)
        hh = tl.program_id(1)
        r = _state_row(slot_ptr, t, HAS_SLOTS)
        C = NH * D
        i = tl.arange(0, D)                                  # dk / channel index
        srow = rec_ptr + r * r_st + hh * r_sh
        prow = proj_ptr + t * p_st

        # f_b GEMV slice + gate: fb (D,) = fb_w[hh·D + i, :] · f_a, bf16-rounded
        acc = tl.zeros((D,), tl.float32)
        for k0 in tl.static_range(0, D, KB):
            kk = k0 + tl.arange(0, KB)
            fa = tl.load(prow + (4 * C + NH + kk) * p_sc).to(tl.float32)
            wt = tl.load(fbw_ptr + (hh * D + i)[:, None] * fbw_sr + kk[None, :] * fbw_sc)
            acc += tl.sum(wt.to(tl.float32) * fa[None, :], 1)
        fb = _rne_bf16(acc)
        ea = tl.load(expa_ptr + hh * expa_s)
        g = lower_bound * tl.sigmoid(ea * (fb + tl.load(dtb_ptr + (hh * D + i) * dtb_s)))
        beta = tl.sigmoid(tl.load(prow + (4 * C + hh) * p_sc).to(tl.float32))

        # short conv + SiLU + L2 norms (q, k whole; v per dv block below)
        cbase = conv_ptr + r * c_st
        ch = hh * D + i
        q, xq, k, xk = _qk_conv_l2(prow, p_sc, cbase, c_sc, c_sw, cw_ptr, cw_sc, cw_sw, ch, C,
                                   W, WP)
        eg = tl.exp(g)

        # gated delta rule, one (D, BV) column block of S per iteration (columns independent)
        taps = tl.arange(0, WP)[None, :]
        keep = (taps >= 1) & (taps < W)                      # xs[:, 1:W] -> taps 0..W−2
        nb = tl.arange(0, NV)[:, None]                       # o kept as (NV, BV) blocks
        o2 = tl.zeros((NV, BV), tl.float32)
        for jb in tl.range(0, NV):
            jj = jb * BV + tl.arange(0, BV)
            ob = _delta_block(srow, r_sk, r_sv, i, jj, prow, p_sc, cbase, c_sc, c_sw, cw_ptr,
                              cw_sc, cw_sw, 2 * C + hh * D + jj, q, k, eg, beta, scale, W, WP)
            o2 = tl.where(nb == jb, ob[None, :], o2)

        # gated RMSNorm over dv, rounded once
        jo = nb * BV + tl.arange(0, BV)[None, :]             # (NV, BV) column index
        r = tl.rsqrt(tl.sum(tl.sum(o2 * o2, 1), 0) / D + eps)
        gate = tl.sigmoid(tl.load(prow + (3 * C + hh * D + jo) * p_sc).to(tl.float32))
        y = _rne_bf16(o2 * r * tl.load(onw_ptr + jo * onw_s) * gate)
        tl.store(out_ptr + t * o_st + (hh * D + jo) * o_sc, y.to(out_ptr.dtype.element_ty))

        # q, k conv state in place, after every thread's loads
        tl.debug_barrier()
        tl.store(cbase + ch[:, None] * c_sc + (taps - 1) * c_sw, xq, mask=keep)
        tl.store(cbase + (ch + C)[:, None] * c_sc + (taps - 1) * c_sw, xk, mask=keep)

    @triton.jit
    def _kda_decode_split_kernel(
            proj_ptr, p_st, p_sc, fbw_ptr, fbw_sr, fbw_sc,
            conv_ptr, c_st, c_sc, c_sw, cw_ptr, cw_sc, cw_sw,
            expa_ptr, expa_s, dtb_ptr, dtb_s, onw_ptr, onw_s,
            rec_ptr, r_st, r_sh, r_sk, r_sv, out_ptr, o_st, o_sc, slot_ptr,
            ob_ptr, cnt_ptr,
            NH, lower_bound, eps, scale,
            D: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
            BV: tl.constexpr, NS: tl.constexpr, HAS_SLOTS: tl.constexpr, PDL: tl.constexpr):
        """Grid (T, heads, NS): program js owns value columns [js·BV, (js+1)·BV) of one head
        (the split form, module docstring); the head's last program to finish does the norm."""
        t = tl.program_id(0).to(tl.int64)
        hh = tl.program_id(1)
        js = tl.program_id(2)
        r = _state_row(slot_ptr, t, HAS_SLOTS)
        C = NH * D
        i = tl.arange(0, D)                                  # dk / channel index
        jj = js * BV + tl.arange(0, BV)                      # this program's dv columns
        ch = hh * D + i
        chv = 2 * C + hh * D + jj
        cbase = conv_ptr + r * c_st
        s_ptrs = rec_ptr + r * r_st + hh * r_sh + i[:, None] * r_sk + jj[None, :] * r_sv

        # prologue before the PDL wait: weights, state and slots (the previous kernel, the
        # in_proj GEMV, writes only proj)
        wt = tl.load(fbw_ptr + ch[:, None] * fbw_sr + i[None, :] * fbw_sc)     # (D, D)
        S = tl.load(s_ptrs)                                                     # (D, BV) fp32
        oq, wq = _conv_taps(cbase, c_sc, c_sw, cw_ptr, cw_sc, cw_sw, ch, W, WP)
        ok, wk = _conv_taps(cbase, c_sc, c_sw, cw_ptr, cw_sc, cw_sw, ch + C, W, WP)
        ov, wv = _conv_taps(cbase, c_sc, c_sw, cw_ptr, cw_sc, cw_sw, chv, W, WP)
        dtb = tl.load(dtb_ptr + ch * dtb_s)
        ea = tl.load(expa_ptr + hh * expa_s)
        pdl_enter(PDL)

        prow = proj_ptr + t * p_st
        fa = tl.load(prow + (4 * C + NH + i) * p_sc).to(tl.float32)
        fb = _rne_bf16(tl.sum(wt.to(tl.float32) * fa[None, :], 1))
        g = lower_bound * tl.sigmoid(ea * (fb + dtb))
        beta = tl.sigmoid(tl.load(prow + (4 * C + hh) * p_sc).to(tl.float32))
        q, xq = _conv_out(oq, wq, tl.load(prow + ch * p_sc), W, WP)
        k, xk = _conv_out(ok, wk, tl.load(prow + (ch + C) * p_sc), W, WP)
        v, xv = _conv_out(ov, wv, tl.load(prow + chv * p_sc), W, WP)
        q = _l2(q)
        k = _l2(k)

        Sp = S * tl.exp(g)[:, None]                          # Diag(e^g) S
        u = beta * (v - tl.sum(k[:, None] * Sp, 0))          # (BV,)
        Sn = Sp + k[:, None] * u[None, :]
        ob = scale * tl.sum(q[:, None] * Sn, 0)              # (BV,) o columns, fp32
        taps = tl.arange(0, WP)[None, :]
        keep = (taps >= 1) & (taps < W)                      # xs[:, 1:W] -> taps 0..W−2
        row = t * NH + hh
        tl.debug_barrier()                                   # loads of S, v taps before stores
        tl.store(s_ptrs, Sn)
        tl.store(cbase + chv[:, None] * c_sc + (taps - 1) * c_sw, xv, mask=keep)
        tl.store(ob_ptr + row * D + jj, ob)
        tl.debug_barrier()                                   # every thread's stores, then
        done = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu")   # one release
        if done == NS - 1:
            # last program of the head: every other one has stored its o columns and read
            # the q/k conv taps (its loads precede its release); norm, output, q/k taps
            tl.store(cnt_ptr + row, 0)                       # ready for the next launch
            o = tl.load(ob_ptr + row * D + i, cache_modifier=".cg")
            rn = tl.rsqrt(tl.sum(o * o, 0) / D + eps)
            gate = tl.sigmoid(tl.load(prow + (3 * C + ch) * p_sc).to(tl.float32))
            y = _rne_bf16(o * rn * tl.load(onw_ptr + i * onw_s) * gate)
            tl.store(out_ptr + t * o_st + ch * o_sc, y.to(out_ptr.dtype.element_ty))
            tl.store(cbase + ch[:, None] * c_sc + (taps - 1) * c_sw, xq, mask=keep)
            tl.store(cbase + (ch + C)[:, None] * c_sc + (taps - 1) * c_sw, xk, mask=keep)


if triton is not None:

    @triton.jit
    def _kda_rows_kernel(
            qkv_ptr, x_st, x_sc, g_ptr, g_st, g_sh, g_sd, b_ptr, b_st, b_sh,
            conv_ptr, c_st, c_sc, c_sw, cw_ptr, cw_sc, cw_sw,
            rec_ptr, r_st, r_sh, r_sk, r_sv, o_ptr, o_st, o_sh, o_sd, row_ptr, slot_ptr,
            count_ptr, NH, scale, D: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
            BV: tl.constexpr, NV: tl.constexpr, HAS_COUNT: tl.constexpr):
        """The stock step's one-token continuations (models/kda.py `_decode_rows`): program
        (n, head) takes token row rows[n] of qkv (its q, k, v inputs), its g and β (computed
        by the step over every row), the state and conv taps of slot slots[n]; writes o's row
        (fp32, before the gated norm) and the slot's state and taps in place. HAS_COUNT: only
        the first count[0] entries are rows (a graph's fixed-length lists); the others exit."""
        n = tl.program_id(0)
        hh = tl.program_id(1)
        if HAS_COUNT:
            if n >= tl.load(count_ptr):
                return
        t = tl.load(row_ptr + n).to(tl.int64)
        r = tl.load(slot_ptr + n).to(tl.int64)
        C = NH * D
        i = tl.arange(0, D)
        srow = rec_ptr + r * r_st + hh * r_sh
        prow = qkv_ptr + t * x_st
        g = tl.load(g_ptr + t * g_st + hh * g_sh + i * g_sd)
        beta = tl.load(b_ptr + t * b_st + hh * b_sh)
        cbase = conv_ptr + r * c_st
        ch = hh * D + i
        q, xq, k, xk = _qk_conv_l2(prow, x_sc, cbase, c_sc, c_sw, cw_ptr, cw_sc, cw_sw, ch, C,
                                   W, WP)
        eg = tl.exp(g)
        taps = tl.arange(0, WP)[None, :]
        keep = (taps >= 1) & (taps < W)
        orow = o_ptr + t * o_st + hh * o_sh
        for jb in tl.range(0, NV):
            jj = jb * BV + tl.arange(0, BV)
            ob = _delta_block(srow, r_sk, r_sv, i, jj, prow, x_sc, cbase, c_sc, c_sw, cw_ptr,
                              cw_sc, cw_sw, 2 * C + hh * D + jj, q, k, eg, beta, scale, W, WP)
            tl.store(orow + jj * o_sd, ob)
        tl.debug_barrier()
        tl.store(cbase + ch[:, None] * c_sc + (taps - 1) * c_sw, xq, mask=keep)
        tl.store(cbase + (ch + C)[:, None] * c_sc + (taps - 1) * c_sw, xk, mask=keep)


def kda_rows_triton(qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    conv_state: torch.Tensor, conv_w: torch.Tensor, rec_state: torch.Tensor,
                    o: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, heads: int,
                    head_dim: int, scale: float,
                    count: torch.Tensor | None = None) -> torch.Tensor:
    """Launch `_kda_rows_kernel` over len(rows) rows × heads on validated inputs (kda_decode.py
    `kda_decode_rows`); any strides with unit channel stride in qkv; `count` (1,) on the
    device: only the first count[0] entries are rows. No host sync."""
    n, D, W = rows.shape[0], head_dim, conv_w.shape[1]
    if n == 0:
        return o
    bv, nw = launch_config(D, n * heads)
    _kda_rows_kernel[(n, heads)](
        qkv, qkv.stride(0), qkv.stride(1), g, *g.stride(), beta, *beta.stride(),
        conv_state, *conv_state.stride(), conv_w, conv_w.stride(0), conv_w.stride(1),
        rec_state, *rec_state.stride(), o, *o.stride(), rows, slots,
        rows if count is None else count, heads, float(scale), D=D, W=W,
        WP=triton.next_power_of_2(W), BV=bv, NV=D // bv, HAS_COUNT=count is not None,
        num_warps=nw)
    return o


def launch_config(head_dim: int, programs: int) -> tuple[int, int]:
    """(block_v, num_warps). Fewer programs (batch·heads) than ~one per SM: the whole (D, D)
    tile in one step, D/16 warps (8 at D = 128: 64 state values per thread, 255 registers, no
    spills). More: (D, 32) column blocks, 4 warps, several programs per SM. H200 sweep in the
    module docstring."""
    if programs < 128 or head_dim <= 32:
        return head_dim, max(1, head_dim // 16)
    return 32, 4


MIN_SPLIT_COLUMNS = 8    # value columns per program in the split form
SPLIT_WARPS = 4           # warps per split program
MIN_SPLITS = 4            # fewer programs per head than this: the one-program form


def split_count(head_dim: int, programs: int, sms: int = H200_SMS) -> int:
    """Programs per head in the split form for `programs` = T·heads: the most (a power of two,
    ≥ MIN_SPLIT_COLUMNS value columns each) that keep the grid within one wave of `sms` SMs,
    when that is at least MIN_SPLITS; else 1 (the one-program form). Two programs per head
    won in the KDA microbench but lost in the whole step (K3 TP16 batch 8: +0.10 ms in 6 of 6
    pairs), so the split starts at 4."""
    ns = 1
    while (head_dim % (2 * ns) == 0 and head_dim // (2 * ns) >= MIN_SPLIT_COLUMNS
           and programs * 2 * ns <= sms):
        ns *= 2
    return ns if ns >= MIN_SPLITS else 1


_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _scratch(device: torch.device, rows: int, head_dim: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(o columns (rows, D) fp32, arrival counters (rows,) int32 zeroed once) of the split form
    for rows = T·heads on one device: the kernel leaves the counters at zero, so graph replays
    need no memset. Allocated at the first (eager, warm-up) call of a shape, outside any
    capture. One launch at a time per (device, shape): a step runs its KDA layers in order on
    one stream."""
    key = (device, rows, head_dim)
    if key not in _SCRATCH:
        _SCRATCH[key] = (torch.empty(rows, head_dim, dtype=torch.float32, device=device),
                         torch.zeros(rows, dtype=torch.int32, device=device))
    return _SCRATCH[key]


def kda_decode_triton(proj: torch.Tensor, fb_w: torch.Tensor, conv_state: torch.Tensor,
                      conv_w: torch.Tensor, exp_a: torch.Tensor, dt_bias: torch.Tensor,
                      o_norm_w: torch.Tensor, rec_state: torch.Tensor, out: torch.Tensor,
                      heads: int, head_dim: int, lower_bound: float, eps: float,
                      slots: torch.Tensor | None = None,
                      block_v: int | None = None, num_warps: int | None = None,
                      splits: int | None = None) -> torch.Tensor:
    """Launch on validated inputs (kda_decode.py `_check`); any strides; writes `out`,
    rec_state and conv_state (rows slots[t] when given, else row t). No host sync; no
    allocation after a shape's first call. `splits`: programs per head (None: `split_count`;
    1: the one-program form, whose block_v / num_warps override `launch_config`; N ≥ 2: the
    split form, N dividing head_dim; num_warps overrides SPLIT_WARPS). Sweeps pass them."""
    T, D, W = proj.shape[0], head_dim, conv_w.shape[1]
    if T == 0:
        return out
    if splits is None:
        splits = split_count(D, T * heads, sm_count(str(proj.device)))
    if splits < 1 or D % splits:
        raise ValueError(f"splits = {splits}: expected a divisor of head_dim = {D}, or None")
    common = (proj, proj.stride(0), proj.stride(1), fb_w, fb_w.stride(0), fb_w.stride(1),
              conv_state, *conv_state.stride(), conv_w, conv_w.stride(0), conv_w.stride(1),
              exp_a, exp_a.stride(0), dt_bias, dt_bias.stride(0), o_norm_w, o_norm_w.stride(0),
              rec_state, *rec_state.stride(), out, out.stride(0), out.stride(1),
              slots if slots is not None else out)           # unread without slots
    scalars = (heads, float(lower_bound), float(eps), float(D) ** -0.5)
    if splits > 1:
        ob, cnt = _scratch(proj.device, T * heads, D)
        _kda_decode_split_kernel[(T, heads, splits)](
            *common, ob, cnt, *scalars, D=D, W=W, WP=triton.next_power_of_2(W),
            BV=D // splits, NS=splits, HAS_SLOTS=slots is not None,
            num_warps=num_warps or SPLIT_WARPS, **pdl_launch(out))
        return out
    bv, nw = launch_config(D, T * heads)
    bv, nw = block_v or bv, num_warps or nw
    _kda_decode_kernel[(T, heads)](
        *common, *scalars,
        D=D, W=W, WP=triton.next_power_of_2(W), KB=min(D, 64), BV=bv, NV=D // bv,
        HAS_SLOTS=slots is not None, num_warps=nw, **pdl_launch(out))
    return out


__all__ = ["MIN_SPLITS", "MIN_SPLIT_COLUMNS", "SPLIT_WARPS", "available", "kda_decode_triton",
           "kda_rows_triton",
           "launch_config", "split_count"]
