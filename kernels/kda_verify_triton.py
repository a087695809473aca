"""Triton kernel of the KDA verify step (kernels/kda_verify.py has the math and contract).

Grid (B, heads, NS): program js of (sequence b, head hh) owns value columns
[js·BV, (js+1)·BV) of the head's state, BV = D / NS (columns of S are independent given q, k, g
and β, as in kernels/kda_decode_triton.py's split form). It loads its (D, BV) state block once
and keeps it in registers over the T = k + 1 positions of the sequence; per position j (flat
row b·T + j of proj and out):

    f_b, g, β        as the decode kernel (the whole (D, D) f_b tile summed along its rows:
                     the split decode kernel's reduction, so both kernels round f_b alike)
    conv taps        tap w of position j is element j + w of [conv_state (W−1) | inputs 0..T−1]:
                     from the slot's conv state while j + w < W−1, else from proj row
                     b·T + j + w − (W−1): no register shifting, the slot is only read
    delta rule       S' = e^g ⊙_rows S;  u = β (v − kᵀS');  S ← S' + k uᵀ;  o = scale · qᵀS
    per position     S → pos_rec[b·T + j, hh, :, cols]; the conv window after position j
                     (taps 1..W−1) → pos_conv[b·T + j] (v: every program its columns; q, k:
                     program 0); o columns (fp32) → a scratch row (b, hh, j)

After the last position: a CTA barrier and one acq_rel arrival on the head's counter; the head's
last program reads the T × D o values back (.cg) and writes the gated RMSNorm outputs of the T
rows, then resets the counter (graph replays need no memset). The slot's conv and recurrent
state are never written: the accept step copies the accepted position's slot into it
(kernels/kda_verify.py `kda_verify_commit`).

Bytes per call (K3 TP16: heads 6, D 128, W 4), B sequences of T positions: state read B·6·64
KiB, per-position state written B·T·6·64 KiB, conv 13.5 KiB read + T·13.5 KiB written per
sequence, f_b weights 192 KiB (L2 across positions), proj/out ≈ 8 KiB per row. No host sync; no
allocation after a shape's first call (the scratch): capturable in a CUDA graph.
"""
from __future__ import annotations

import torch

from raydecode.kernels._triton import (H200_SMS, available, pdl_enter, pdl_launch, sm_count,
                                       tl, triton)
from raydecode.kernels.kda_decode_triton import split_count

if triton is not None:
    from raydecode.kernels.kda_decode_triton import _l2, _rne_bf16

    @triton.jit
    def _window(prow0, p_st, p_sc, cbase, c_sc, c_sw, cw_ptr, cw_sc, cw_sw, ch, j,
                W: tl.constexpr, WP: tl.constexpr):
        """Channels ch at position j: xs (D, WP) = taps j … j+W−1 of [conv state | inputs],
        0 past W; y = bf16(SiLU(Σ_w xs·w)) in fp32."""
        taps = tl.arange(0, WP)[None, :]
        c = j + taps                                          # element of [state | inputs]
        old = tl.load(cbase + ch[:, None] * c_sc + c * c_sw,
                      mask=(taps < W) & (c < W - 1), other=0.0)
        new = tl.load(prow0 + (c - (W - 1)) * p_st + ch[:, None] * p_sc,
                      mask=(taps < W) & (c >= W - 1), other=0.0)
        xs = tl.where(c < W - 1, old, new)
        w = tl.load(cw_ptr + ch[:, None] * cw_sc + taps * cw_sw, mask=taps < W, other=0.0)
        y = tl.sum(xs.to(tl.float32) * w, 1)
        return _rne_bf16(y * tl.sigmoid(y)), xs

    @triton.jit
    def _kda_verify_kernel(
            proj_ptr, p_st, p_sc, fbw_ptr, fbw_sr, fbw_sc,
            conv_ptr, c_st, c_sc, c_sw, cw_ptr, cw_sc, cw_sw,
            expa_ptr, expa_s, dtb_ptr, dtb_s, onw_ptr, onw_s,
            rec_ptr, r_st, r_sh, r_sk, r_sv, out_ptr, o_st, o_sc, slot_ptr,
            pc_ptr, pc_st, pc_sc, pc_sw, pr_ptr, pr_st, pr_sh, pr_sk, pr_sv,
            ob_ptr, cnt_ptr,
            NH, lower_bound, eps, scale,
            T: tl.constexpr, D: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
            BV: tl.constexpr, NS: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        b = tl.program_id(0).to(tl.int64)
        hh = tl.program_id(1)
        js = tl.program_id(2)
        r = tl.load(slot_ptr + b).to(tl.int64)
        C = NH * D
        i = tl.arange(0, D)
        jj = js * BV + tl.arange(0, BV)
        ch = hh * D + i
        chv = 2 * C + hh * D + jj
        cbase = conv_ptr + r * c_st
        S = tl.load(rec_ptr + r * r_st + hh * r_sh + i[:, None] * r_sk + jj[None, :] * r_sv)
        wt = tl.load(fbw_ptr + ch[:, None] * fbw_sr + i[None, :] * fbw_sc)     # (D, D)
        dtb = tl.load(dtb_ptr + ch * dtb_s)
        ea = tl.load(expa_ptr + hh * expa_s)
        taps = tl.arange(0, WP)[None, :]
        keep = (taps >= 1) & (taps < W)                       # window taps 1..W−1 -> 0..W−2
        prow0 = proj_ptr + b * T * p_st
        row = b * NH + hh
        for j in tl.static_range(T):
            prow = prow0 + j * p_st
            fa = tl.load(prow + (4 * C + NH + i) * p_sc).to(tl.float32)
            fb = _rne_bf16(tl.sum(wt.to(tl.float32) * fa[None, :], 1))
            g = lower_bound * tl.sigmoid(ea * (fb + dtb))
            beta = tl.sigmoid(tl.load(prow + (4 * C + hh) * p_sc).to(tl.float32))
            q, xq = _window(prow0, p_st, p_sc, cbase, c_sc, c_sw, cw_ptr, cw_sc, cw_sw, ch,
                            j, W, WP)
            k, xk = _window(prow0, p_st, p_sc, cbase, c_sc, c_sw, cw_ptr, cw_sc, cw_sw,
                            ch + C, j, W, WP)
            v, xv = _window(prow0, p_st, p_sc, cbase, c_sc, c_sw, cw_ptr, cw_sc, cw_sw, chv,
                            j, W, WP)
            q = _l2(q)
            k = _l2(k)
            Sp = S * tl.exp(g)[:, None]                       # Diag(e^g) S
            u = beta * (v - tl.sum(k[:, None] * Sp, 0))       # (BV,)
            S = Sp + k[:, None] * u[None, :]
            ob = scale * tl.sum(q[:, None] * S, 0)            # (BV,) o columns, fp32
            n = b * T + j                                     # flat row of this position
            tl.store(pr_ptr + n * pr_st + hh * pr_sh + i[:, None] * pr_sk + jj[None, :] * pr_sv,
                     S)
            pcb = pc_ptr + n * pc_st
            tl.store(pcb + chv[:, None] * pc_sc + (taps - 1) * pc_sw, xv, mask=keep)
            if js == 0:
                tl.store(pcb + ch[:, None] * pc_sc + (taps - 1) * pc_sw, xq, mask=keep)
                tl.store(pcb + (ch + C)[:, None] * pc_sc + (taps - 1) * pc_sw, xk, mask=keep)
            tl.store(ob_ptr + (row * T + j) * D + jj, ob)
        tl.debug_barrier()                                    # every thread's stores, then
        done = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu")   # one release
        if done == NS - 1:
            # last program of the head: every o column of every position is stored
            tl.store(cnt_ptr + row, 0)                        # ready for the next launch
            onw = tl.load(onw_ptr + i * onw_s)
            for j in tl.static_range(T):
                prow = prow0 + j * p_st
                o = tl.load(ob_ptr + (row * T + j) * D + i, cache_modifier=".cg")
                rn = tl.rsqrt(tl.sum(o * o, 0) / D + eps)
                gate = tl.sigmoid(tl.load(prow + (3 * C + ch) * p_sc).to(tl.float32))
                y = _rne_bf16(o * rn * onw * gate)
                tl.store(out_ptr + (b * T + j) * o_st + ch * o_sc,
                         y.to(out_ptr.dtype.element_ty))


VERIFY_WARPS = 4
_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _scratch(device: torch.device, rows: int, T: int, head_dim: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(o values (rows·T, D) fp32, arrival counters (rows,) int32 zeroed once) for rows =
    B·heads; made at a shape's first (eager) call, outside any capture; the kernel leaves the
    counters at zero. One launch at a time per (device, shape)."""
    key = (device, rows, T, head_dim)
    if key not in _SCRATCH:
        _SCRATCH[key] = (torch.empty(rows * T, head_dim, dtype=torch.float32, device=device),
                         torch.zeros(rows, dtype=torch.int32, device=device))
    return _SCRATCH[key]


def verify_splits(head_dim: int, seqs: int, heads: int, sms: int = H200_SMS) -> int:
    """Programs per head: the decode kernel's `split_count` for B·heads programs; where that
    is 1 (many sequences), 2 for head_dim ≥ 64, so a program's state block stays (D, ≤ 64)
    next to the (D, D) f_b tile in registers."""
    ns = split_count(head_dim, seqs * heads, sms)
    return 2 if ns == 1 and head_dim >= 64 else ns


def verify_warps(head_dim: int, splits: int) -> int:
    """4 warps for (D, ≤ 32) state blocks, 8 above (64 fp32 state values per thread at D·BV
    = 128·64)."""
    return VERIFY_WARPS if head_dim // splits <= 32 else 2 * VERIFY_WARPS


def kda_verify_triton(proj, fb_w, conv_state, conv_w, exp_a, dt_bias, o_norm_w, rec_state,
                      out, pos_conv, pos_rec, slots, *, positions: int, heads: int,
                      head_dim: int, lower_bound: float, eps: float,
                      splits: int | None = None) -> torch.Tensor:
    """Launch on validated inputs (kda_verify.py `_check`): writes out, pos_conv and pos_rec
    rows [0, B·T); the slots' state is read only."""
    B, T, D, W = slots.shape[0], positions, head_dim, conv_w.shape[1]
    if B == 0:
        return out
    ns = splits or verify_splits(D, B, heads, sm_count(str(proj.device)))
    if D % ns:
        raise ValueError(f"splits = {ns}: expected a divisor of head_dim = {D}, or None")
    ob, cnt = _scratch(proj.device, B * heads, T, D)
    _kda_verify_kernel[(B, heads, ns)](
        proj, proj.stride(0), proj.stride(1), fb_w, fb_w.stride(0), fb_w.stride(1),
        conv_state, *conv_state.stride(), conv_w, conv_w.stride(0), conv_w.stride(1),
        exp_a, exp_a.stride(0), dt_bias, dt_bias.stride(0), o_norm_w, o_norm_w.stride(0),
        rec_state, *rec_state.stride(), out, out.stride(0), out.stride(1), slots,
        pos_conv, *pos_conv.stride(), pos_rec, *pos_rec.stride(), ob, cnt,
        heads, float(lower_bound), float(eps), float(D) ** -0.5,
        T=T, D=D, W=W, WP=triton.next_power_of_2(W), BV=D // ns, NS=ns,
        num_warps=verify_warps(D, ns), **pdl_launch(out))
    return out


__all__ = ["VERIFY_WARPS", "available", "kda_verify_triton", "verify_splits", "verify_warps"]
