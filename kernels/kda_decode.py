"""Fused KDA decode step (one token per sequence): everything between the in_proj and o_proj
GEMVs of a KDA layer, the f_b GEMV included (scripts/bench/layer_step.py `DecodeStep.kda`).

Per sequence t and head (h heads, d = head_dim, C = h·d, W conv taps):

    proj (T, P)  columns [q C | k C | v C | g_out C | b h | f_a d | pad]   model dtype (bf16)
    fb    = bf16(f_a · fb_wᵀ)  (fp32 accumulation, F.linear)              (T, h, d)
    g     = lower_bound · sigmoid(exp_a[h] · (fb + dt_bias))               (T, h, d) fp32
    β     = sigmoid(b)                                                      (T, h)    fp32
    xs    = [conv_state | q k v in]                                         (T, 3C, W)
    y     = bf16(SiLU(Σ_w xs · conv_w)) as fp32,  conv_state ← xs[..., 1:]  (in place)
    q, k  ← x · rsqrt(Σx² + 1e-6)                                           per head
    S'    = Diag(e^g) S;  u = β (v − kᵀS');  S ← S' + k uᵀ  (rec_state (T, h, d, d) fp32, in place)
    o     = d^-½ · qᵀS                                                      (T, h, d) fp32
    out   = bf16(RMSNorm(o; o_norm_w, eps) · sigmoid(g_out))                (T, C)

Layers (STYLE §6): `kda_decode_reference` is the PyTorch reference with the stock step's op
chain and rounding points (models/kda.py's stock step between its two GEMVs); `kda_decode` is
the public op and the dispatch point: the Triton kernel of kernels/kda_decode_triton.py on CUDA
tensors in bf16, else the reference (CPU, no Triton, or another model dtype). Any strides are accepted (proj is typically a column slice
of a wider GEMV output); `out` is allocated only when not given.

Slots: without `slots`, sequence t owns conv_state[t] and rec_state[t] (T rows each). With
`slots` (T,) int32/int64, conv_state (S, 3C, W−1) and rec_state (S, h, d, d) are a whole slot
pool and sequence t reads and writes row slots[t] (the model passes a layer's KDA cache,
models/cache.py, with no gather/scatter copy); rows not named are untouched. Slots must be
distinct and in [0, S): checked on CPU, a caller invariant on CUDA (a check would sync).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from raydecode.kernels import kda_decode_triton as _tri

L2_EPS = 1e-6            # models/kda.py `l2_normalize`
HEAD_DIMS = (16, 32, 64, 128)   # head_dim values the op accepts (the kernel's D)


def _use_triton(proj: torch.Tensor) -> bool:
    return (proj.is_cuda and proj.dtype == torch.bfloat16
            and _tri.available(proj))


def _l2(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + L2_EPS)


def kda_gate_exp(raw: torch.Tensor, exp_a: torch.Tensor, dt_bias: torch.Tensor,
                 lower_bound: float) -> torch.Tensor:
    """models/kda.py `kda_gate` with exp(A_log) precomputed: raw (T, h, d) -> (T, h, d) fp32."""
    h, d = raw.shape[-2:]
    return lower_bound * torch.sigmoid(exp_a.view(h, 1) * (raw.float() + dt_bias.view(h, d)))


def delta_rule_step(q, k, v, g, beta, S: torch.Tensor, scale: float) -> torch.Tensor:
    """One token of the gated delta rule for every (sequence, head), S updated in place.

    q, k, g, v (T, h, d), beta (T, h) fp32; S (T, h, d, d) fp32. With S' = Diag(e^g) S:
    u = β (v − kᵀS'),  S ← S' + k uᵀ,  o = scale · (qᵀS' + (q·k) u) = scale · qᵀS_new
    (models/kda.py `kda_recurrent`) -> o (T, h, d). Passes over S: one bmm read, one scale in
    place, one rank-1 update in place (the stock benchmark step runs exactly this)."""
    T, h, d = q.shape
    eg = g.exp()
    Sc = S if S.is_contiguous() else S.contiguous()         # strided state: work on a copy
    Sf = Sc.view(T * h, d, d)
    r = torch.bmm(torch.stack([k * eg, q * eg], 2).view(T * h, 2, d), Sf)     # (Th, 2, d)
    u = beta.reshape(T * h, 1) * (v.reshape(T * h, d) - r[:, 0])
    Sf.mul_(eg.reshape(T * h, d, 1))
    Sf.baddbmm_(k.reshape(T * h, d, 1), u.view(T * h, 1, d))
    o = scale * (r[:, 1] + (q * k).sum(-1).reshape(T * h, 1) * u)
    if Sc is not S:
        S.copy_(Sc)
    return o.view(T, h, d)


def _conv_delta_step(qkv, conv_state, conv_w, g, beta, rec_state, h: int, d: int,
                     scale: float) -> torch.Tensor:
    """One token per row t: the conv over conv_state[t]'s W−1 taps (in qkv's dtype) and
    qkv[t], SiLU, rounding to qkv's dtype, L2 norms of q and k, then `delta_rule_step` on
    rec_state[t]; both states updated in place. qkv (T, 3·h·d), conv_state (T, 3·h·d, W−1),
    g (T, h, d) and beta (T, h) fp32, rec_state (T, h, d, d) fp32 -> o (T, h, d) fp32."""
    xs = torch.cat([conv_state.to(qkv.dtype), qkv.unsqueeze(-1)], -1)       # (T, 3C, W)
    y = F.silu((xs.float() * conv_w.float()).sum(-1)).to(qkv.dtype).float()
    conv_state.copy_(xs[..., 1:])
    q, k, v = y.view(qkv.shape[0], 3, h, d).unbind(1)
    return delta_rule_step(_l2(q), _l2(k), v, g, beta, rec_state, scale)


def kda_decode_reference(proj, fb_w, conv_state, conv_w, exp_a, dt_bias, o_norm_w, rec_state,
                         *, heads: int, head_dim: int, lower_bound: float, eps: float,
                         out: torch.Tensor | None = None,
                         slots: torch.Tensor | None = None) -> torch.Tensor:
    """The op in PyTorch (see module docstring); conv_state and rec_state updated in place
    (rows slots[t] when `slots` is given). -> out (T, C) in proj's dtype."""
    if slots is not None:      # gather the named rows, step them, scatter them back
        idx = slots.long()
        cs, rs = conv_state.index_select(0, idx), rec_state.index_select(0, idx)
        res = kda_decode_reference(proj, fb_w, cs, conv_w, exp_a, dt_bias, o_norm_w, rs,
                                   heads=heads, head_dim=head_dim, lower_bound=lower_bound,
                                   eps=eps, out=out)
        conv_state.index_copy_(0, idx, cs)
        rec_state.index_copy_(0, idx, rs)
        return res
    T, h, d = proj.shape[0], heads, head_dim
    C = h * d
    qkv_in, g_out = proj[:, :3 * C], proj[:, 3 * C:4 * C]
    b = proj[:, 4 * C:4 * C + h]
    fa = proj[:, 4 * C + h:4 * C + h + d]
    fb = F.linear(fa, fb_w).view(T, h, d)
    g = kda_gate_exp(fb, exp_a, dt_bias, lower_bound)
    beta = torch.sigmoid(b.float())                                        # (T, h)
    o = _conv_delta_step(qkv_in, conv_state, conv_w, g, beta, rec_state, h, d,
                         d ** -0.5)                                          # (T, h, d) fp32
    gate = torch.sigmoid(g_out.float()).view(T, h, d)
    res = (F.rms_norm(o, (d,), o_norm_w, eps) * gate).to(proj.dtype).view(T, C)
    if out is None:
        return res
    out.copy_(res)
    return out


def _check(proj, fb_w, conv_state, conv_w, exp_a, dt_bias, o_norm_w, rec_state, heads,
           head_dim, out, slots=None) -> None:
    """Shapes, dtypes and devices of the op's inputs; ValueError naming the offending one."""
    if not isinstance(heads, int) or heads < 1:
        raise ValueError(f"heads={heads!r}: expected a positive int")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim!r}: expected a power of two in 16..128")
    if proj.dim() != 2:
        raise ValueError(f"proj of shape {tuple(proj.shape)}: expected (T, P)")
    if not proj.dtype.is_floating_point:
        raise ValueError(f"proj dtype {proj.dtype}: expected a floating model dtype")
    T, h, d = proj.shape[0], heads, head_dim
    C = h * d
    if proj.shape[1] < 4 * C + h + d:
        raise ValueError(f"proj of shape {tuple(proj.shape)}: heads={h}, head_dim={d} need at "
                         f"least 4·C + heads + head_dim = {4 * C + h + d} columns "
                         "[q | k | v | g | b | f_a]")
    if conv_w.dim() != 2 or conv_w.shape[0] != 3 * C or conv_w.shape[1] < 2:
        raise ValueError(f"conv_w of shape {tuple(conv_w.shape)}: expected (3·C, W) = "
                         f"({3 * C}, W) with W ≥ 2")
    W = conv_w.shape[1]
    S = T                                  # state rows: one per sequence, or the slot pool
    if slots is not None:
        if slots.dim() != 1 or slots.shape[0] != T or slots.dtype not in (torch.int32,
                                                                         torch.int64):
            raise ValueError(f"slots of shape {tuple(slots.shape)} dtype {slots.dtype}: "
                             f"expected ({T},) int32 or int64 (one state row per sequence)")
        if slots.device != proj.device:
            raise ValueError(f"slots on {slots.device}: expected proj's device {proj.device}")
        S = conv_state.shape[0] if conv_state.dim() == 3 else -1
    want = {"fb_w": (fb_w, (C, d), proj.dtype),
            "conv_state": (conv_state, (S, 3 * C, W - 1), proj.dtype),
            "conv_w": (conv_w, (3 * C, W), torch.float32),
            "exp_a": (exp_a, (h,), torch.float32),
            "dt_bias": (dt_bias, (C,), torch.float32),
            "o_norm_w": (o_norm_w, (d,), torch.float32),
            "rec_state": (rec_state, (S, h, d, d), torch.float32)}
    if out is not None:
        want["out"] = (out, (T, C), proj.dtype)
    for name, (x, shape, dtype) in want.items():
        if tuple(x.shape) != shape or x.dtype != dtype:
            what = "S state slots" if slots is not None else "state rows = T"
            raise ValueError(f"{name} of shape {tuple(x.shape)} dtype {x.dtype}: expected "
                             f"{shape} {dtype} (T={T}, heads={h}, head_dim={d}, W={W}, "
                             f"{what})")
        if x.device != proj.device:
            raise ValueError(f"{name} on {x.device}: expected proj's device {proj.device}")
    if slots is not None and not slots.is_cuda and T:     # host values: no sync to read them
        vals = slots.tolist()
        if min(vals) < 0 or max(vals) >= S or len(set(vals)) != T:
            raise ValueError(f"slots {vals}: expected distinct state rows in [0, {S})")


def kda_decode(proj, fb_w, conv_state, conv_w, exp_a, dt_bias, o_norm_w, rec_state, *,
               heads: int, head_dim: int, lower_bound: float, eps: float,
               out: torch.Tensor | None = None,
               slots: torch.Tensor | None = None,
               splits: int | None = None) -> torch.Tensor:
    """The fused op (module docstring) -> out (T, heads·head_dim) in proj's dtype; conv_state
    and rec_state updated in place (rows slots[t] when `slots` is given, else row t). On CUDA
    bf16: one kernel, no host sync, no allocation when `out` is given after a shape's first
    call (CUDA-graph capturable after an eager warm-up). The kernel launched just before this
    one must not write the state, slots or weights (the split form reads them before its PDL
    wait, kernels/kda_decode_triton.py). splits: programs per head of the kernel
    (DecodeOptions.kda_splits; None: automatic, kda_decode_triton `split_count`)."""
    _check(proj, fb_w, conv_state, conv_w, exp_a, dt_bias, o_norm_w, rec_state, heads,
           head_dim, out, slots)
    kw = dict(heads=heads, head_dim=head_dim, lower_bound=lower_bound, eps=eps, slots=slots)
    if _use_triton(proj):
        if out is None:
            out = proj.new_empty(proj.shape[0], heads * head_dim)
        return _tri.kda_decode_triton(proj, fb_w, conv_state, conv_w, exp_a, dt_bias,
                                      o_norm_w, rec_state, out, splits=splits, **kw)
    return kda_decode_reference(proj, fb_w, conv_state, conv_w, exp_a, dt_bias, o_norm_w,
                                rec_state, out=out, **kw)


def kda_decode_rows_reference(qkv, g, beta, conv_state, conv_w, rec_state, o, rows, slots, *,
                              heads: int, head_dim: int, scale: float,
                              count: torch.Tensor | None = None) -> torch.Tensor:
    """The stock step's one-token continuations (models/kda.py `_decode_rows`), in PyTorch:
    row rows[n] of qkv (T, 3C) with slot slots[n]'s W−1 conv taps -> conv, SiLU, model-dtype
    rounding, L2 norms of q and k; S' = Diag(e^g) S, S ← S' + β k (v − kᵀS')ᵀ; o's row ←
    scale · qᵀS (fp32, before the gated norm); the slot's taps and state stored. `count`
    (1,) on the device: only the first count[0] entries are rows; the others are computed
    and their writes put back what was there (no host read: capturable). Such entries must
    name a row and a slot no counted entry names."""
    cs, rs = conv_state.index_select(0, slots), rec_state.index_select(0, slots)   # copies
    if count is not None:
        cs0, rs0 = cs.clone(), rs.clone()
    out = _conv_delta_step(qkv.index_select(0, rows), cs, conv_w,
                           g.index_select(0, rows).float(), beta.index_select(0, rows).float(),
                           rs, heads, head_dim, scale)
    if count is not None:
        live = torch.arange(rows.shape[0], device=rows.device) < count       # (n,)
        out = torch.where(live[:, None, None], out, o.index_select(0, rows))
        cs = torch.where(live[:, None, None], cs, cs0)
        rs = torch.where(live[:, None, None, None], rs, rs0)
    o.index_copy_(0, rows, out)
    conv_state.index_copy_(0, slots, cs)
    rec_state.index_copy_(0, slots, rs)
    return o


def _rows_kernel_ok(qkv, g, beta, conv_state, rec_state, o, rows, slots, head_dim, W) -> bool:
    return (_use_triton(qkv) and qkv.stride(1) == 1 and conv_state.dtype == qkv.dtype
            and head_dim in HEAD_DIMS and W >= 2
            and all(t.dtype == torch.float32 and t.is_cuda for t in (g, beta, rec_state, o))
            and all(t.is_cuda and t.dtype in (torch.int32, torch.int64) and t.dim() == 1
                    for t in (rows, slots)))


def kda_decode_rows(qkv, g, beta, conv_state, conv_w, rec_state, o, rows, slots, *,
                    heads: int, head_dim: int, scale: float,
                    count: torch.Tensor | None = None) -> torch.Tensor:
    """`kda_decode_rows_reference` as one kernel (kernels/kda_decode_triton.py
    `_kda_rows_kernel`) on CUDA bf16 with Triton, the conv state in the model dtype and a
    head_dim in HEAD_DIMS; else the reference. qkv (T, 3C) (unit channel stride; a column view
    of the in_proj output is fine), g (T, h, d) and beta (T, h) fp32, conv_state (S, 3C, W−1),
    conv_w (3C, W), rec_state (S, h, d, d) fp32, o (T, h, d) fp32 written at rows; rows and
    slots (n,) device indices, slots distinct (a caller invariant: a check would sync);
    count (1,) on the device: only the first count[0] entries are rows (a graph's
    fixed-length lists; the reference's contract for the others). -> o."""
    C3, W = conv_w.shape
    if qkv.dim() != 2 or qkv.shape[1] != C3 or C3 != 3 * heads * head_dim:
        raise ValueError(f"kda_decode_rows: qkv {tuple(qkv.shape)}, conv_w {tuple(conv_w.shape)};"
                         f" expected (T, 3·{heads}·{head_dim}) and (3·{heads}·{head_dim}, W)")
    if rows.shape != slots.shape:
        raise ValueError(f"kda_decode_rows: rows {tuple(rows.shape)} and slots "
                         f"{tuple(slots.shape)}; expected one slot per row")
    kw = dict(heads=heads, head_dim=head_dim, scale=scale, count=count)
    if _rows_kernel_ok(qkv, g, beta, conv_state, rec_state, o, rows, slots, head_dim, W):
        return _tri.kda_rows_triton(qkv, g, beta, conv_state, conv_w, rec_state, o, rows,
                                    slots, **kw)
    return kda_decode_rows_reference(qkv, g, beta, conv_state, conv_w, rec_state, o, rows,
                                     slots, **kw)


__all__ = ["kda_decode", "kda_decode_reference", "kda_decode_rows", "kda_decode_rows_reference",
           "delta_rule_step", "kda_gate_exp", "HEAD_DIMS"]
