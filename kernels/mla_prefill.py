"""MLA prefill attention of one sequence's chunk over its cached latent rows: K/V decompressed
by one kv_b GEMM, then a fused scaled_dot_product_attention (flash / memory-efficient).

A chunk of n queries q (n, h, nope + rope) at positions ctx .. ctx + n − 1; the sequence's rows
(m = ctx + n, kv_lora + rope) = [c, k_pe] at positions 0 .. m − 1, the chunk's own already
written (DCP 1: every row on this rank, in position order, models/cache.py `read`):

    [k_nope | v]_j = W_kv_b c_j           one GEMM            (m, h, nope + v)
    k_j = [k_nope_j, k_pe_j]              k_pe shared by the heads   (m, h, nope + rope)
    o_t = Σ_{j ≤ ctx + t} softmax_j(q_t · k_j · scale) v_j            (n, h, v)

The reference (`mla_prefill_reference`) is the stock absorbed math in fp32 (models/mla.py
`_absorbed` / `mla_absorbed_attention`): q_abs = [W_ukᵀ q_nope, q_pe] over the latent rows,
o = W_uv Σ_j p_j c_j; equal in exact arithmetic (W_uk, W_uv linear), rounded differently.

Mask: query t sees keys 0 .. ctx + t, the causal mask aligned to the lower right corner of the
(n, m) scores. SDPA's is_causal is aligned to the upper left (right only for n = m: ctx = 0),
so the chunk passes `torch.nn.attention.bias.causal_lower_right(n, m)` as attn_mask: torch
sends it to flash attention (whose causal flag means lower right for n ≠ m) or to
memory-efficient attention (custom mask type CausalFromBottomRight); neither builds the mask.
Only where neither can run does torch materialise the (n, m) bool mask (route "other"; on the
CPU, route "cpu", always). n = m goes to plain is_causal SDPA, which the call restricts to
its route's backend (flash or memory-efficient): torch may rank cuDNN first on sm90, whose
attention builds a graph per shape on its first call (a first-run stall on the request path
for every new prompt length).

Backend: flash needs one head dim for q, k and v (here 192 vs v 128); memory-efficient takes
Ev ≠ E; cuDNN takes 192/128 on sm90 but never the lower-right bias. V is padded to E for
flash without a copy: the decompressed buffer holds per head [v | k_nope | k_pe]
(v + nope + rope wide), K is its last E = nope + rope columns and the padded V its first E,
[v, k_nope[:E − v]]; the E − v extra output columns are discarded, and each output column
depends on its own V column only, so the padding's values (finite) change nothing. The route
(`sdpa_route`): "flash" where torch's `can_use_flash_attention` accepts the padded V (bf16 /
fp16 on sm80+; what serves K3 on the H200), else "efficient" with the v-wide V, else "other"
(the v-wide V; whatever torch picks: cuDNN for a chunk at 0, else a materialised mask).

Memory: the buffer (m, h, v + nope + rope) and the GEMM output (m, h, nope + v) in the compute
dtype, no score tensor: K3 at TP16 (h = 6), m = 131072: 0.50 + 0.40 GB in bf16. Flops per
chunk ≈ 2·m·h·(kv_lora·(nope + v) + n·(E + Ev)), Ev = V's width (the decompression is paid
per chunk), against the absorbed form's 2·m·h·n·(2·kv_lora + rope): for K3 fewer from
n ≈ 170 (Ev = v) or 190 (Ev = E) queries on.

Dispatch (`impl`): "auto" SDPA for bf16 / fp16 CUDA tensors (the served dtypes, flash), the
reference elsewhere (the CPU; fp32 models on CUDA, test-only, keep their numbers); "sdpa" /
"reference" force one (tests; the CPU SDPA runs the "cpu" route, mask materialised).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

IMPLS = ("auto", "sdpa", "reference")
# the SDPA backend each route runs on, alone (mla_prefill_into)
_ONLY = {"flash": [SDPBackend.FLASH_ATTENTION], "efficient": [SDPBackend.EFFICIENT_ATTENTION]}
ROUTES = ("flash", "efficient", "other", "cpu")


def resolve_impl(impl: str, x: torch.Tensor) -> str:
    """'sdpa' or 'reference' for x ('auto': SDPA for a bf16 / fp16 CUDA tensor)."""
    if impl not in IMPLS:
        raise ValueError(f"mla_prefill impl = {impl!r}; accepted: {', '.join(IMPLS)}")
    if impl == "auto":
        half = x.dtype in (torch.bfloat16, torch.float16)
        return "sdpa" if x.is_cuda and half else "reference"
    return impl


# ---- validation ------------------------------------------------------------------------------

def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check(q, rows, ctx, kv_b_weight, nope: int, vdim: int, kv_lora: int, out=None) -> None:
    _need(q.dim() == 3 and q.shape[0] >= 1 and q.shape[2] > nope,
          f"q of shape {tuple(q.shape)}: expected (n ≥ 1, heads, nope + rope) with nope = {nope}")
    n, h, e = q.shape
    rope = e - nope
    _need(isinstance(ctx, int) and ctx >= 0, f"ctx = {ctx!r}: expected an int ≥ 0 (the "
                                             "chunk's first position)")
    _need(rows.dim() == 2 and tuple(rows.shape) == (ctx + n, kv_lora + rope),
          f"rows of shape {tuple(rows.shape)}: expected (ctx + n, kv_lora + rope) = "
          f"({ctx + n}, {kv_lora + rope}): the sequence's rows at positions 0 .. ctx + n − 1")
    _need(tuple(kv_b_weight.shape) == (h * (nope + vdim), kv_lora),
          f"kv_b weight of shape {tuple(kv_b_weight.shape)}: expected (heads · (nope + v), "
          f"kv_lora) = ({h * (nope + vdim)}, {kv_lora})")
    _need(q.device == rows.device == kv_b_weight.device,
          f"q on {q.device}, rows on {rows.device}, kv_b weight on {kv_b_weight.device}: "
          "expected one device")
    if out is not None:
        _need(tuple(out.shape) == (n, h, vdim) and out.device == q.device,
              f"out of shape {tuple(out.shape)} on {out.device}: expected ({n}, {h}, {vdim}) "
              f"on {q.device}")


# ---- reference (the stock absorbed math, fp32) -----------------------------------------------

def mla_prefill_reference(q, rows, ctx: int, kv_b_weight, *, nope: int, vdim: int,
                          kv_lora: int, scale: float) -> torch.Tensor:
    """fp32 over the latent rows: s = [W_ukᵀ q_nope, q_pe] · rowsᵀ · scale, row j visible to
    query t iff j ≤ ctx + t, o = W_uv Σ_j softmax(s)_j c_j -> (n, h, v) fp32. Materialises the
    (n, h, m) scores: ground truth for tests, not for long contexts."""
    _check(q, rows, ctx, kv_b_weight, nope, vdim, kv_lora)
    n, h, _ = q.shape
    w = kv_b_weight.float().view(h, nope + vdim, kv_lora)
    q_lat = torch.einsum("thn,hnc->thc", q[..., :nope].float(), w[:, :nope])
    q_abs = torch.cat([q_lat, q[..., nope:].float()], -1)              # (n, h, kv_lora + rope)
    r = rows.float()
    s = torch.einsum("thd,md->thm", q_abs, r) * scale
    row_pos = torch.arange(rows.shape[0], device=q.device)
    q_pos = torch.arange(ctx, ctx + n, device=q.device)
    s = s.masked_fill((row_pos[None, :] > q_pos[:, None])[:, None, :], float("-inf"))
    o_lat = torch.einsum("thm,mc->thc", s.softmax(-1), r[:, :kv_lora])
    return torch.einsum("thc,hvc->thv", o_lat, w[:, nope:])


# ---- the SDPA formulation --------------------------------------------------------------------

def decompress(rows, kv_b_weight, heads: int, *, nope: int, vdim: int, kv_lora: int,
               dtype: torch.dtype) -> torch.Tensor:
    """rows (m, kv_lora + rope) -> (m, h, v + nope + rope) in dtype, per head [v | k_nope |
    k_pe]: one GEMM c · W_kv_bᵀ (m, h·(nope + v)), then one concatenation."""
    m, rope = rows.shape[0], rows.shape[1] - kv_lora
    kv = F.linear(rows[:, :kv_lora].to(dtype), kv_b_weight.to(dtype))
    kv = kv.view(m, heads, nope + vdim)
    k_pe = rows[:, None, kv_lora:].to(dtype).expand(m, heads, rope)
    return torch.cat([kv[..., nope:], kv[..., :nope], k_pe], -1)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """(L, h, d) -> the (1, h, L, d) view SDPA takes (no copy)."""
    return x.unsqueeze(0).transpose(1, 2)


def sdpa_route(q4, k4, buf, vdim: int, pad_v: bool | None = None
               ) -> tuple[str, torch.Tensor]:
    """The route of one chunk and its V, (1, h, m, E) or (1, h, m, v) views of buf.
    pad_v None: flash where torch accepts the padded V, else efficient, else other (CUDA;
    "cpu" off CUDA, v-wide V); True / False: the padded / v-wide V whatever runs (A/B)."""
    e = q4.shape[-1]
    v_pad, v = _heads_first(buf[..., :e]), _heads_first(buf[..., :vdim])
    if vdim > e:                       # padding would cut V: the v-wide V only
        pad_v = False
    if not q4.is_cuda:
        return "cpu", v_pad if pad_v else v
    flash = can_use_flash_attention(SDPAParams(q4, k4, v_pad, None, 0.0, False, False))
    if pad_v is None:
        pad_v = flash
    v = v_pad if pad_v else v
    if pad_v and flash:
        return "flash", v
    eff = can_use_efficient_attention(SDPAParams(q4, k4, v, None, 0.0, False, False))
    return ("efficient" if eff else "other"), v


def mla_prefill_into(out, q, rows, ctx: int, kv_b_weight, *, nope: int, vdim: int,
                     kv_lora: int, scale: float, pad_v: bool | None = None) -> str:
    """The SDPA formulation into out (n, h, v) (any float dtype; every element written).
    Computes in q's dtype (bf16 on the GPU: flash accumulates in fp32). Returns the route
    taken (`ROUTES`)."""
    _check(q, rows, ctx, kv_b_weight, nope, vdim, kv_lora, out)
    n, h, e = q.shape
    buf = decompress(rows, kv_b_weight, h, nope=nope, vdim=vdim, kv_lora=kv_lora,
                     dtype=q.dtype)                                    # (m, h, v + e)
    q4, k4 = _heads_first(q), _heads_first(buf[..., vdim:])           # (1, h, n|m, e)
    route, v4 = sdpa_route(q4, k4, buf, vdim, pad_v)
    # the route's backend alone: at ctx = 0 the chunk is plain is_causal SDPA, which torch may
    # hand to cuDNN on sm90, whose attention builds a graph per shape on its first call: on
    # the request path for every new prompt length (a 448-token chunk at position 0 took 78
    # ms once on the H100; held to flash, new prompts' first chunks ran within 1.21x of
    # steady, docs/perf-log/prefill.md); flash and memory-efficient take any length without
    # a build
    only = _ONLY.get(route)
    with sdpa_kernel(only) if only else contextlib.nullcontext():
        o = F.scaled_dot_product_attention(q4, k4, v4,
                                           attn_mask=causal_lower_right(n, ctx + n),
                                           scale=scale)                # (1, h, n, e|v)
    out.copy_(o[0].transpose(0, 1)[..., :vdim])
    return route


def mla_prefill_attention(q, rows, ctx: int, kv_b_weight, *, nope: int, vdim: int,
                          kv_lora: int, scale: float, impl: str = "auto",
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of a chunk's queries q (n, h, nope + rope) at positions ctx .. ctx + n − 1
    over the sequence's rows (ctx + n, kv_lora + rope) -> (n, h, v): q's dtype on the SDPA
    path, fp32 from the reference (`impl`, module doc); written into out when given."""
    if resolve_impl(impl, q) == "reference":
        _check(q, rows, ctx, kv_b_weight, nope, vdim, kv_lora, out)
        o = mla_prefill_reference(q, rows, ctx, kv_b_weight, nope=nope, vdim=vdim,
                                  kv_lora=kv_lora, scale=scale)
        return o if out is None else out.copy_(o)
    if out is None:
        out = q.new_empty(q.shape[0], q.shape[1], vdim)
    mla_prefill_into(out, q, rows, ctx, kv_b_weight, nope=nope, vdim=vdim, kv_lora=kv_lora,
                     scale=scale)
    return out


__all__ = ["IMPLS", "ROUTES", "decompress", "mla_prefill_attention", "mla_prefill_into",
           "mla_prefill_reference", "resolve_impl", "sdpa_route"]
