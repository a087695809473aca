"""Triton kernels of the KDA verify step (kernels/kda_verify.py has the math and contract).

Two launches, so that the T = k + 1 positions' state-independent work runs in parallel and
only the recurrence is sequential:

`_kda_verify_prep_kernel`, grid (B·T, heads): program (n = b·T + j, hh) computes what position
j of sequence b needs besides the state, exactly as the decode kernel computes it for one
token:

    f_b, g, β        the whole (D, D) f_b tile summed along its rows (the split decode
                     kernel's reduction and warp count, so both round f_b alike); e^g
    conv taps        tap w of position j is element j + w of [conv_state (W−1) | inputs 0..T−1]:
                     from the slot's conv state while j + w < W−1, else from proj row
                     b·T + j + w − (W−1); the slot is only read
    q, k, v          SiLU conv outputs (bf16-rounded), q and k L2-normalized
    per position     the conv window after position j (taps 1..W−1) → pos_conv[n] (all 3·D
                     channels of head hh); [e^g | q | k | v] fp32 → a scratch row (n, hh), β
                     → a scratch scalar

`_kda_verify_chain_kernel`, grid (B, heads, NS): program js of (b, hh) owns value columns
[js·BV, (js+1)·BV) of the head's state, BV = D / NS (columns of S are independent given q, k,
g and β). It loads its (D, BV) state block once, keeps it in registers over the T positions,
and per position reads the scratch row and applies

    delta rule       S' = e^g ⊙_rows S;  u = β (v − kᵀS');  S ← S' + k uᵀ;  o = scale · qᵀS
    per position     S → pos_rec[n, hh, :, cols]; o columns (fp32) → an o scratch row (b, hh, j)

After the last position: a CTA barrier and one acq_rel arrival on the head's counter; the head's
last program reads the T × D o values back (.cg) and writes the gated RMSNorm outputs of the T
rows, then resets the counter (graph replays need no memset). The chain has no (D, D) tile and
two reductions over D per position, so small state blocks run on one warp: every reduction a
warp shuffle, no CTA barrier inside the chain (`chain_config`).

PDL: each kernel requests what the kernel launched just before it cannot be writing before
its wait — the prep kernel its f_b weights, conv weights and gate constants (the in_proj GEMV
before it writes only proj), the chain kernel its state block (the prep kernel writes only the
scratch and pos_conv). The slot's conv and recurrent state are never written: the accept step
copies the accepted position's slot into it (kernels/kda_verify.py `kda_verify_commit`).

Bytes per call (K3 TP16: heads 6, D 128, W 4), B sequences of T positions: state read B·6·64
KiB, per-position state written B·T·6·64 KiB, conv 13.5 KiB read + T·13.5 KiB written per
sequence, f_b weights 192 KiB (L2 across programs), proj/out ≈ 8 KiB per row, scratch 12 KiB
per row written once and read by the NS programs of each head (L2). No host sync; no
allocation after a shape's first call (the scratch): capturable in a CUDA graph.
"""
from __future__ import annotations

import torch

from raydecode.kernels._triton import available, pdl_enter, pdl_launch, tl, triton
from raydecode.kernels.kda_decode_triton import SPLIT_WARPS

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
    def _kda_verify_prep_kernel(
            proj_ptr, p_st, p_sc, fbw_ptr, fbw_sr, fbw_sc,
            conv_ptr, c_st, c_sc, c_sw, cw_ptr, cw_sc, cw_sw,
            expa_ptr, expa_s, dtb_ptr, dtb_s, slot_ptr,
            pc_ptr, pc_st, pc_sc, pc_sw, x_ptr, beta_ptr,
            NH, lower_bound,
            T: tl.constexpr, D: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
            PDL: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        hh = tl.program_id(1)
        b = n // T
        j = n % T
        C = NH * D
        i = tl.arange(0, D)
        ch = hh * D + i
        wt = tl.load(fbw_ptr + ch[:, None] * fbw_sr + i[None, :] * fbw_sc)     # (D, D)
        dtb = tl.load(dtb_ptr + ch * dtb_s)
        ea = tl.load(expa_ptr + hh * expa_s)
        r = tl.load(slot_ptr + b).to(tl.int64)
        pdl_enter(PDL)
        cbase = conv_ptr + r * c_st
        prow0 = proj_ptr + b * T * p_st
        prow = prow0 + j * p_st
        fa = tl.load(prow + (4 * C + NH + i) * p_sc).to(tl.float32)
        fb = _rne_bf16(tl.sum(wt.to(tl.float32) * fa[None, :], 1))
        g = lower_bound * tl.sigmoid(ea * (fb + dtb))
        beta = tl.sigmoid(tl.load(prow + (4 * C + hh) * p_sc).to(tl.float32))
        q, xq = _window(prow0, p_st, p_sc, cbase, c_sc, c_sw, cw_ptr, cw_sc, cw_sw, ch,
                        j, W, WP)
        k, xk = _window(prow0, p_st, p_sc, cbase, c_sc, c_sw, cw_ptr, cw_sc, cw_sw, ch + C,
                        j, W, WP)
        v, xv = _window(prow0, p_st, p_sc, cbase, c_sc, c_sw, cw_ptr, cw_sc, cw_sw,
                        ch + 2 * C, j, W, WP)
        taps = tl.arange(0, WP)[None, :]
        keep = (taps >= 1) & (taps < W)                       # window taps 1..W−1 -> 0..W−2
        pcb = pc_ptr + n * pc_st
        tl.store(pcb + ch[:, None] * pc_sc + (taps - 1) * pc_sw, xq, mask=keep)
        tl.store(pcb + (ch + C)[:, None] * pc_sc + (taps - 1) * pc_sw, xk, mask=keep)
        tl.store(pcb + (ch + 2 * C)[:, None] * pc_sc + (taps - 1) * pc_sw, xv, mask=keep)
        xrow = x_ptr + (n * NH + hh) * 4 * D
        tl.store(xrow + i, tl.exp(g))
        tl.store(xrow + D + i, _l2(q))
        tl.store(xrow + 2 * D + i, _l2(k))
        tl.store(xrow + 3 * D + i, v)
        tl.store(beta_ptr + n * NH + hh, beta)

    @triton.jit
    def _kda_verify_chain_kernel(
            proj_ptr, p_st, p_sc, onw_ptr, onw_s,
            rec_ptr, r_st, r_sh, r_sk, r_sv, out_ptr, o_st, o_sc, slot_ptr,
            pr_ptr, pr_st, pr_sh, pr_sk, pr_sv, x_ptr, beta_ptr, ob_ptr, cnt_ptr,
            NH, eps, scale,
            T: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, NS: tl.constexpr,
            PDL: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        hh = tl.program_id(1)
        js = tl.program_id(2)
        i = tl.arange(0, D)
        jj = js * BV + tl.arange(0, BV)
        r = tl.load(slot_ptr + b).to(tl.int64)
        S = tl.load(rec_ptr + r * r_st + hh * r_sh + i[:, None] * r_sk + jj[None, :] * r_sv)
        pdl_enter(PDL)
        row = b * NH + hh
        for j in tl.static_range(T):
            n = b * T + j                                     # flat row of this position
            xrow = x_ptr + (n * NH + hh) * 4 * D
            eg = tl.load(xrow + i)
            q = tl.load(xrow + D + i)
            k = tl.load(xrow + 2 * D + i)
            v = tl.load(xrow + 3 * D + jj)
            beta = tl.load(beta_ptr + n * NH + hh)
            Sp = S * eg[:, None]                              # Diag(e^g) S
            u = beta * (v - tl.sum(k[:, None] * Sp, 0))       # (BV,)
            S = Sp + k[:, None] * u[None, :]
            ob = scale * tl.sum(q[:, None] * S, 0)            # (BV,) o columns, fp32
            tl.store(pr_ptr + n * pr_st + hh * pr_sh + i[:, None] * pr_sk + jj[None, :] * pr_sv,
                     S)
            tl.store(ob_ptr + (row * T + j) * D + jj, ob)
        tl.debug_barrier()                                    # every thread's stores, then
        done = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu")   # one release
        if done == NS - 1:
            # last program of the head: every o column of every position is stored
            tl.store(cnt_ptr + row, 0)                        # ready for the next launch
            onw = tl.load(onw_ptr + i * onw_s)
            C = NH * D
            ch = hh * D + i
            for j in tl.static_range(T):
                prow = proj_ptr + (b * T + j) * p_st
                o = tl.load(ob_ptr + (row * T + j) * D + i, cache_modifier=".cg")
                rn = tl.rsqrt(tl.sum(o * o, 0) / D + eps)
                gate = tl.sigmoid(tl.load(prow + (3 * C + ch) * p_sc).to(tl.float32))
                y = _rne_bf16(o * rn * onw * gate)
                tl.store(out_ptr + (b * T + j) * o_st + ch * o_sc,
                         y.to(out_ptr.dtype.element_ty))


_SCRATCH: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _scratch(device: torch.device, seqs: int, T: int, heads: int, head_dim: int
             ) -> tuple[torch.Tensor, ...]:
    """(per-position rows [e^g | q | k | v] (B·T·heads, 4·D) fp32, β (B·T·heads,) fp32, o values
    (B·heads·T, D) fp32, arrival counters (B·heads,) int32 zeroed once); made at a shape's
    first (eager) call, outside any capture; the chain kernel leaves the counters at zero. One
    launch at a time per (device, shape): a step runs its KDA layers in order on one stream."""
    key = (device, seqs, T, heads, head_dim)
    if key not in _SCRATCH:
        rows = seqs * T * heads
        f32 = dict(dtype=torch.float32, device=device)
        _SCRATCH[key] = (torch.empty(rows, 4 * head_dim, **f32), torch.empty(rows, **f32),
                         torch.empty(rows, head_dim, **f32),
                         torch.zeros(seqs * heads, dtype=torch.int32, device=device))
    return _SCRATCH[key]


def chain_config(head_dim: int, seqs: int, heads: int) -> tuple[int, int]:
    """(splits, warps) of the chain kernel for B·heads = seqs·heads (sequence, head) pairs:
    8 value columns per program (splits = D / 8) on one warp up to 12 pairs, then 16 columns
    on two warps up to 24 and on one warp above: the fastest variant at every K3 shape of the
    H200 sweep (bench/results/kda-verify-h200-2026-12-03.json: heads 6 and 12, B 1..8, T 8).
    One warp holds a (128, 8) block as 32 values per thread, every reduction a warp shuffle;
    wider blocks or more warps add CTA barriers to the chain."""
    pairs = seqs * heads
    cols = min(head_dim, 8 if pairs <= 12 else 16)
    return head_dim // cols, (2 if 12 < pairs <= 24 else 1)


def kda_verify_triton(proj, fb_w, conv_state, conv_w, exp_a, dt_bias, o_norm_w, rec_state,
                      out, pos_conv, pos_rec, slots, *, positions: int, heads: int,
                      head_dim: int, lower_bound: float, eps: float,
                      splits: int | None = None, warps: int | None = None) -> torch.Tensor:
    """Launch on validated inputs (kda_verify.py `_check`): writes out, pos_conv and pos_rec
    rows [0, B·T); the slots' state is read only. `splits` / `warps` override the chain
    kernel's `chain_config` (sweeps)."""
    B, T, D, W = slots.shape[0], positions, head_dim, conv_w.shape[1]
    if B == 0:
        return out
    ns, nw = chain_config(D, B, heads)
    ns, nw = splits or ns, warps or nw
    if D % ns:
        raise ValueError(f"splits = {ns}: expected a divisor of head_dim = {D}, or None")
    xs, beta, ob, cnt = _scratch(proj.device, B, T, heads, D)
    pdl = pdl_launch(out)
    _kda_verify_prep_kernel[(B * T, heads)](
        proj, proj.stride(0), proj.stride(1), fb_w, fb_w.stride(0), fb_w.stride(1),
        conv_state, *conv_state.stride(), conv_w, conv_w.stride(0), conv_w.stride(1),
        exp_a, exp_a.stride(0), dt_bias, dt_bias.stride(0), slots,
        pos_conv, *pos_conv.stride(), xs, beta, heads, float(lower_bound),
        T=T, D=D, W=W, WP=triton.next_power_of_2(W), num_warps=SPLIT_WARPS, **pdl)
    _kda_verify_chain_kernel[(B, heads, ns)](
        proj, proj.stride(0), proj.stride(1), o_norm_w, o_norm_w.stride(0),
        rec_state, *rec_state.stride(), out, out.stride(0), out.stride(1), slots,
        pos_rec, *pos_rec.stride(), xs, beta, ob, cnt, heads, float(eps), float(D) ** -0.5,
        T=T, D=D, BV=D // ns, NS=ns, num_warps=nw, **pdl)
    return out


__all__ = ["available", "chain_config", "kda_verify_triton"]
