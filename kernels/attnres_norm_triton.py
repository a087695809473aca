"""Triton kernel of the fused AttnRes mix + RMSNorm (kernels/attnres_norm.py has the math).

One program per token t, the whole hidden row in registers (BLOCK_H = next pow2 ≥ H):

    pass 1  for each block j (static loop) and the prefix: ss_j = Σ v², d_j = Σ v·w_res·w_proj
            s_j = d_j · rsqrt(ss_j / H + eps_res)            (= RMSNorm(v_j; w_res) · w_proj)
            residual form: p ← bf16(p + o), written to `new_prefix`, used as the last value
    softmax over the n+1 scores (a (NP,) vector, NP = next pow2 ≥ n+1, padding at −inf)
    pass 2  mix = Σ_j prob_j · v_j in fp32 (block rows re-read: L1/L2 hits); h =
            RMSNorm(mix; w_out) from the fp32 mix, rounded once (the optional mix output rounded)
Reads the bank once from HBM (n+1 rows of H per token), writes mix (optional), h and p.

The Triton form; `attnres_norm.attnres_*_mix_norm` dispatch here on CUDA when the CuTe DSL
kernel (kernels/attnres_norm_cute.py) does not serve the layout or is switched off.
"""
from __future__ import annotations

import torch

from raydecode.kernels._triton import available, pdl_enter, pdl_launch, tl, triton

if triton is not None:

    @triton.jit
    def _score(v, wrp, H, eps):
        """RMSNorm(v; w_res) · w_proj for one fp32 row v (masked tail = 0)."""
        return tl.sum(v * wrp, 0) * tl.rsqrt(tl.sum(v * v, 0) / H + eps)

    @triton.jit
    def _mix_norm_kernel(blk_ptr, blk_st, blk_sj, pre_ptr, pre_st, out_ptr, out_st,
                         newp_ptr, newp_st, wres_ptr, wproj_ptr, wout_ptr, mix_ptr, mix_st,
                         h_ptr, h_st, H, res_eps, out_eps,
                         NB: tl.constexpr, NP: tl.constexpr, BLOCK_H: tl.constexpr,
                         ADD: tl.constexpr, WRITE_MIX: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_H)
        m = offs < H
        wrp = (tl.load(wres_ptr + offs, mask=m, other=0.0).to(tl.float32)
               * tl.load(wproj_ptr + offs, mask=m, other=0.0).to(tl.float32))
        jj = tl.arange(0, NP)
        s = tl.full((NP,), float("-inf"), tl.float32)
        for j in tl.static_range(NB):
            v = tl.load(blk_ptr + t * blk_st + j * blk_sj + offs, mask=m, other=0.0)
            s = tl.where(jj == j, _score(v.to(tl.float32), wrp, H, res_eps), s)
        p = tl.load(pre_ptr + t * pre_st + offs, mask=m, other=0.0).to(tl.float32)
        if ADD:   # p ← p + o, rounded to the prefix dtype (models/attnres.py `add`)
            o = tl.load(out_ptr + t * out_st + offs, mask=m, other=0.0).to(tl.float32)
            pr = (p + o).to(newp_ptr.dtype.element_ty)
            tl.store(newp_ptr + t * newp_st + offs, pr, mask=m)
            p = pr.to(tl.float32)
        s = tl.where(jj == NB, _score(p, wrp, H, res_eps), s)
        e = tl.exp(s - tl.max(s, 0))                       # padding: exp(−inf) = 0
        prob = e / tl.sum(e, 0)
        mix = tl.sum(tl.where(jj == NB, prob, 0.0), 0) * p
        for j in tl.static_range(NB):
            v = tl.load(blk_ptr + t * blk_st + j * blk_sj + offs, mask=m, other=0.0)
            mix += tl.sum(tl.where(jj == j, prob, 0.0), 0) * v.to(tl.float32)
        mixr = mix.to(h_ptr.dtype.element_ty)
        if WRITE_MIX:
            tl.store(mix_ptr + t * mix_st + offs, mixr.to(mix_ptr.dtype.element_ty), mask=m)
        x = mix                          # the fp32 mix into the norm (kernels/attnres_norm.py)
        r = tl.rsqrt(tl.sum(x * x, 0) / H + out_eps)
        wo = tl.load(wout_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(h_ptr + t * h_st + offs, (x * r * wo).to(h_ptr.dtype.element_ty), mask=m)


def _row_ok(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.stride(1) == 1


def bank_view(blocks, prefix: torch.Tensor) -> torch.Tensor | None:
    """blocks n × (T, H) as ONE strided (T, n, H) view when they sit in one storage at a
    uniform element distance (e.g. bank[:, j] of a (T, n+1, H) bank), else None."""
    if not blocks:
        return None
    b0 = blocks[0]
    if not _row_ok(b0):
        return None
    es = b0.element_size()
    d = (blocks[1].data_ptr() - b0.data_ptr()) // es if len(blocks) > 1 else b0.shape[1]
    for j, b in enumerate(blocks):
        if (not _row_ok(b) or b.stride() != b0.stride() or b.dtype != b0.dtype
                or b.untyped_storage().data_ptr() != b0.untyped_storage().data_ptr()
                or b.data_ptr() != b0.data_ptr() + j * d * es):
            return None
    T, H = prefix.shape
    return torch.as_strided(b0, (T, len(blocks), H), (b0.stride(0), d, 1))


def mix_norm_triton(blocks, prefix: torch.Tensor, res_norm_w: torch.Tensor,
                    res_proj_w: torch.Tensor, out_norm_w: torch.Tensor, res_eps: float,
                    out_eps: float, out: torch.Tensor | None = None,
                    new_prefix: torch.Tensor | None = None, h: torch.Tensor | None = None,
                    mix: torch.Tensor | None = None) -> torch.Tensor:
    """The fused op. blocks: a list of n (T, H) tensors or a (T, n, H) view (last dim
    contiguous); `out` given: residual form, p + out is written to `new_prefix` (allocated
    like prefix when None; may alias a bank slot). Returns h (T, H) (and fills `mix` if given).
    No host sync; capturable."""
    T, H = prefix.shape
    if isinstance(blocks, torch.Tensor):
        bank = blocks
    else:
        blocks = list(blocks)
        bank = bank_view(blocks, prefix)
        if bank is None and blocks:
            bank = torch.stack(blocks, 1)                      # one copy kernel
    nb = 0 if bank is None else bank.shape[1]
    if bank is not None and (bank.dim() != 3 or bank.stride(2) != 1):
        raise ValueError(f"AttnRes bank view of shape {tuple(bank.shape)} strides "
                         f"{bank.stride()}: expected (T, n, H) with a contiguous last dim")
    if not _row_ok(prefix):
        prefix = prefix.contiguous()
    if h is None:
        h = torch.empty_like(prefix, memory_format=torch.contiguous_format)
    if out is not None:
        if not _row_ok(out):
            out = out.contiguous()
        if new_prefix is None:
            new_prefix = torch.empty_like(h)
    blk = bank if bank is not None else prefix
    bst, bsj = (bank.stride(0), bank.stride(1)) if bank is not None else (0, 0)
    o, np_ = (out, new_prefix) if out is not None else (prefix, prefix)
    mx = mix if mix is not None else h
    block_h = triton.next_power_of_2(H)
    _mix_norm_kernel[(T,)](
        blk, bst, bsj, prefix, prefix.stride(0), o, o.stride(0), np_, np_.stride(0),
        res_norm_w, res_proj_w.reshape(-1), out_norm_w, mx, mx.stride(0), h, h.stride(0),
        H, float(res_eps), float(out_eps), NB=nb, NP=max(2, triton.next_power_of_2(nb + 1)),
        BLOCK_H=block_h, ADD=out is not None, WRITE_MIX=mix is not None,
        num_warps=max(1, min(16, block_h // 512)), **pdl_launch(h))
    return h


__all__ = ["available", "bank_view", "mix_norm_triton"]
