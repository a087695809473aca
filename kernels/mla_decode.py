"""Fused MLA absorbed decode (one token per sequence) over the PAGED latent cache.

The stock step (scripts/bench/layer_step.py `DecodeStep.mla`) between the GEMVs, per token t:

    q_n  = bf16(RMSNorm(qkv[:q_lora]; w_q))                              (q_lora,)
    row  = [bf16(RMSNorm(qkv[q_lora:q_lora+c]; w_kv)), qkv[q_lora+c:]]   (c + rope,) -> cache
    q    = q_b(q_n)                                                      (h, nope + rope)
    q_abs = [bf16(q_nope · W_uk), q_pe]                                  (h, c + rope)
    s_j  = q_abs · row_j · scale  (fp32),  j < seq_len                   (h, L)
    o_lat = softmax(s) · rows[:, :c],  lse = log Σ_j exp(s_j)            (h, c) fp32
    o    = bf16(bf16(o_lat) · W_uv)                                      (h, v)
    out  = bf16(o · sigmoid(gate))                                       (h·v,)

Ops (kernels in kernels/mla_decode_triton.py; counts are kernel launches):
  mla_prep       1   the two norms, q_n out, the row written into the paged cache
  mla_absorb     1   q_abs (alternative: `absorbed_q_weight` folds W_uk into q_b, 0 kernels)
  mla_attention  1–2 split-KV attention -> merged (o_lat, lse) for DCP (2 when S > 1)
  mla_output     1   merge of S partials + bf16 + W_uv + gate
  mla_decode     2   mla_attention's split kernel + mla_output's kernel on its partials
  mla_decode_absorbed  2   the served DCP-1 form: q from a q_b GEMV with W_uk and the q_a norm
                     weight folded in; the split kernel scales q and stores the new row
  mla_decode_fused     3   rms scale + absorb + row store; split; output (mla_absorbed_q off)

Paged cache (models/cache.py MLALatentCache, one layer's pool): cache (num_blocks, block_size,
c + rope) bf16; row p of token t's sequence at cache[block_table[t, p // bs], p % bs];
block_table (T, max_blocks) int32/int64. seq_lens (T,) must be ≤ max_blocks·bs (not checked:
that needs a host sync; the reference clamps to it, the kernel would read past the table).
Partials: o_part (T, S, h, c) fp32, lse_part (T, S, h) fp32, every element written by the split
kernel (empty splits: o 0, lse −inf), so workspaces need no zero-init.

Numerics: the kernel rounds p to bf16 before p·V relative to the running max (stock: after
normalising); everything else at the stock rounding points. The references compute p·V in fp32
(models/mla.py `mla_absorbed_attention` semantics).

Dispatch: the Triton kernels on CUDA tensors, the references elsewhere.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from raydecode.kernels import mla_decode_triton as _tri
from raydecode.kernels._triton import H200_SMS, sm_count

BF16 = torch.bfloat16


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and _tri.available(x)


def default_num_splits(batch: int, max_rows: int, sms: int = H200_SMS) -> int:
    """KV splits S per token: T·S ≈ #SMs (batch 1 fills the GPU at long context), but no more
    splits than ⌈max_rows / MIN_CHUNK⌉ (a split never covers fewer than MIN_CHUNK = 64 rows;
    the kernel sizes chunks from the real seq_len, so extra splits of a short sequence are
    empty and cost one tiny program each). max_rows = block_table columns · block_size, a
    host-side shape, so S is fixed under graph capture. Batch 1: 1024 rows -> 16, ≥ 8448 ->
    132; batch 64: 3."""
    return max(1, min(-(-sms // batch), -(-max_rows // _tri.MIN_CHUNK)))


# ---- validation ------------------------------------------------------------------------------

def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _shape(x: torch.Tensor) -> tuple:
    return tuple(x.shape)


def _check_paged(cache, block_table, T: int, width: int | None = None) -> None:
    _need(cache.dim() == 3 and cache.dtype == BF16 and cache.stride(2) == 1,
          f"cache of shape {_shape(cache)} dtype {cache.dtype} strides {cache.stride()}: "
          "expected bf16 (num_blocks, block_size, kv_lora + rope) with a contiguous last dim")
    if width is not None:
        _need(cache.shape[2] == width, f"cache row width {cache.shape[2]}; expected {width} "
                                       "(kv_lora + rope)")
    _need(block_table.dim() == 2 and block_table.shape[0] >= T
          and block_table.dtype in (torch.int32, torch.int64) and block_table.stride(1) == 1,
          f"block_table of shape {_shape(block_table)} dtype {block_table.dtype}: expected "
          f"int32/int64 (≥ {T}, max_blocks) with a contiguous last dim")


def _check_vec(x, T: int, name: str) -> None:
    _need(x.dim() == 1 and x.shape[0] >= T and x.dtype in (torch.int32, torch.int64),
          f"{name} of shape {_shape(x)} dtype {x.dtype}: expected int32/int64 ({T},)")


def _check_partials(o, lse) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, h, c) + (T, h) (one partial) or (T, S, h, c) + (T, S, h) -> the 4-d/3-d forms."""
    if o.dim() == 3 and lse.dim() == 2:
        o, lse = o.unsqueeze(1), lse.unsqueeze(1)
    _need(o.dim() == 4 and lse.dim() == 3 and _shape(o)[:3] == _shape(lse)
          and o.dtype == torch.float32 and lse.dtype == torch.float32 and o.stride(3) == 1,
          f"partials o {_shape(o)} {o.dtype}, lse {_shape(lse)} {lse.dtype}: expected fp32 "
          "o (T, S, h, c) with a contiguous last dim and lse (T, S, h) (or (T, h, c), (T, h))")
    return o, lse


# ---- references (PyTorch; the stock rounding points) -----------------------------------------

def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32 (F.rms_norm) with an fp32 weight, rounded to bf16."""
    return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(BF16)


def paged_rows(cache, block_table, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All max_blocks·bs row slots of each token's sequence: rows (T, R, d), index (R,)."""
    bs = cache.shape[1]
    idx = torch.arange(block_table.shape[1] * bs, device=cache.device)
    blk = block_table[:T].long()[:, idx // bs]                              # (T, R)
    return cache[blk, idx % bs], idx


def _store_rows(qkv, kv_norm_w, cache, block_table, positions, q_lora, kv_lora, eps) -> None:
    """Row [bf16(RMSNorm(qkv[t, q_lora:q_lora+c]; w_kv)), qkv[t, q_lora+c:]] at cache position
    positions[t] (< 0: not stored)."""
    T = qkv.shape[0]
    row = torch.cat([_rms(qkv[:, q_lora:q_lora + kv_lora], kv_norm_w, eps),
                     qkv[:, q_lora + kv_lora:].to(BF16)], -1)
    pos = positions[:T].long()
    keep = pos >= 0
    p = pos.clamp_min(0)
    blk = block_table[:T].long().gather(1, (p // cache.shape[1])[:, None])[:, 0]
    cache[blk[keep], (p % cache.shape[1])[keep]] = row[keep]


def mla_prep_reference(qkv, q_norm_w, kv_norm_w, cache, block_table, positions, *, q_lora,
                       kv_lora, eps, q_out=None):
    q = _rms(qkv[:, :q_lora], q_norm_w, eps)
    _store_rows(qkv, kv_norm_w, cache, block_table, positions, q_lora, kv_lora, eps)
    if q_out is None:
        return q
    q_out.copy_(q)
    return q_out


def mla_absorb_reference(q, w_uk, *, nope, out=None):
    q_lat = torch.bmm(q[..., :nope].transpose(0, 1), w_uk).transpose(0, 1)   # (T, h, c) bf16
    r = torch.cat([q_lat, q[..., nope:]], -1)
    if out is None:
        return r
    out.copy_(r)
    return out


def mla_attention_reference(q_abs, cache, block_table, seq_lens, *, kv_lora, scale):
    """fp32 math: s = q_abs·rowsᵀ·scale over rows j < seq_lens[t] -> (o_lat, lse) fp32."""
    T = q_abs.shape[0]
    rows, idx = paged_rows(cache, block_table, T)                          # (T, R, d)
    r = rows.float()
    s = torch.bmm(q_abs.float(), r.transpose(1, 2)) * scale                  # (T, h, R)
    s = s.masked_fill((idx[None, :] >= seq_lens[:T, None].long())[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)                                             # (T, h)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
    return torch.bmm(p, r[..., :kv_lora]), lse


def mla_output_reference(o_lat_partials, lse_partials, w_uv_t, gate, *, out=None):
    o, lse = _check_partials(o_lat_partials, lse_partials)
    tot = torch.logsumexp(lse, 1, keepdim=True)                              # (T, 1, h)
    w = torch.exp(lse - torch.where(torch.isfinite(tot), tot, 0.0))           # −inf -> 0
    o_lat = (w.unsqueeze(-1) * o).sum(1).to(BF16)                             # (T, h, c)
    T, h = o_lat.shape[:2]
    y = torch.bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1).reshape(T, -1)   # bf16
    r = (y.float() * torch.sigmoid(gate.float())).to(BF16)
    if out is None:
        return r
    out.copy_(r)
    return out


def absorbed_q_weight(q_b_w, w_uk, heads: int, nope: int, rope: int,
                      q_norm_w: torch.Tensor | None = None) -> torch.Tensor:
    """q_b weight (h·(nope + rope), q_lora) with W_uk (h, nope, c) folded in ->
    (h·(c + rope), q_lora) bf16: per head [W_ukᵀ · W_q_nope (c, q_lora) (fp32); W_q_pe].
    q_norm_w (q_lora,): the q_a RMSNorm weight folded into the columns too (in fp32, one bf16
    rounding at the end), the weight `mla_decode_absorbed` consumes: W_q'' with
    q_abs = rms_scale(x) · x·W_q''ᵀ."""
    _need(q_b_w.dim() == 2 and q_b_w.shape[0] == heads * (nope + rope),
          f"q_b weight of shape {_shape(q_b_w)}; expected ({heads * (nope + rope)}, q_lora)")
    _need(w_uk.dim() == 3 and _shape(w_uk)[:2] == (heads, nope),
          f"w_uk of shape {_shape(w_uk)}; expected ({heads}, {nope}, kv_lora)")
    wq = q_b_w.float()
    if q_norm_w is not None:
        _need(_shape(q_norm_w) == (q_b_w.shape[1],),
              f"q norm weight of shape {_shape(q_norm_w)}; expected ({q_b_w.shape[1]},)")
        wq = wq * q_norm_w.float()[None, :]
    wq = wq.view(heads, nope + rope, -1)
    lat = torch.bmm(w_uk.float().transpose(1, 2), wq[:, :nope])            # (h, c, q_lora)
    return torch.cat([lat, wq[:, nope:]], 1).reshape(-1, q_b_w.shape[1]).to(BF16)


def folded_q_b_weight(q_b_w, q_norm_w) -> torch.Tensor:
    """q_b weight (h·(nope + rope), q_lora) with the q_a RMSNorm weight folded into its columns,
    bf16(W · diag(w_q)): q_b(RMSNorm(x; w_q)) = rms_scale(x) · q_b'(x) (linear in x), the form
    `mla_decode_fused` consumes, so no kernel runs the norm before the q_b GEMV."""
    _need(q_b_w.dim() == 2 and _shape(q_norm_w) == (q_b_w.shape[1],),
          f"q_b weight {_shape(q_b_w)} and q norm weight {_shape(q_norm_w)}: expected "
          "(rows, q_lora) and (q_lora,)")
    return (q_b_w.float() * q_norm_w.float()[None, :]).to(BF16)


def _rms_scaled_q(qkv, q, q_lora: int, eps: float) -> torch.Tensor:
    """bf16(rms_scale(x) · q), x = qkv[:, :q_lora]: the q_a norm applied after a q_b GEMV whose
    weight holds the norm weight (`folded_q_b_weight`, `absorbed_q_weight(q_norm_w=)`)."""
    x = qkv[:, :q_lora].float()
    rs = torch.rsqrt(x.pow(2).mean(-1) + eps)                                # (T,)
    return (q.float() * rs[:, None, None]).to(BF16)


def mla_decode_fused_reference(qkv, q, kv_norm_w, w_uk, cache, block_table, positions,
                               seq_lens, w_uv_t, gate, *, q_lora, kv_lora, eps, scale,
                               out=None):
    """`mla_decode_fused`'s math at its rounding points: q_n = bf16(rms_scale(x) · q) with
    x = qkv[:, :q_lora], then the row store, absorb, attention and output references."""
    qn = _rms_scaled_q(qkv, q, q_lora, eps)
    _store_rows(qkv, kv_norm_w, cache, block_table, positions, q_lora, kv_lora, eps)
    q_abs = mla_absorb_reference(qn, w_uk, nope=q.shape[2] - (qkv.shape[1] - q_lora - kv_lora))
    o_lat, lse = mla_attention_reference(q_abs, cache, block_table, seq_lens, kv_lora=kv_lora,
                                         scale=scale)
    return mla_output_reference(o_lat, lse, w_uv_t, gate, out=out)


def mla_decode_absorbed_reference(qkv, q, kv_norm_w, cache, block_table, positions, seq_lens,
                                  w_uv_t, gate, *, q_lora, kv_lora, eps, scale, out=None):
    """`mla_decode_absorbed`'s math at its rounding points: q_abs = bf16(rms_scale(x) · q)
    with x = qkv[:, :q_lora], the row store, then the attention and output references."""
    q_abs = _rms_scaled_q(qkv, q, q_lora, eps)
    _store_rows(qkv, kv_norm_w, cache, block_table, positions, q_lora, kv_lora, eps)
    o_lat, lse = mla_attention_reference(q_abs, cache, block_table, seq_lens, kv_lora=kv_lora,
                                         scale=scale)
    return mla_output_reference(o_lat, lse, w_uv_t, gate, out=out)


# ---- public ops --------------------------------------------------------------------------------

def mla_prep(qkv, q_norm_w, kv_norm_w, cache, block_table, positions, *, q_lora: int,
             kv_lora: int, eps: float, q_out=None) -> torch.Tensor:
    """qkv (T, q_lora + kv_lora + rope) bf16 (row stride ok) -> q_out (T, q_lora) bf16; the
    normalised latent row written at cache position positions[t] (< 0: not written)."""
    T, _ = _check_qkv(qkv, q_lora, kv_lora)
    _need(_shape(q_norm_w) == (q_lora,) and _shape(kv_norm_w) == (kv_lora,),
          f"norm weights of shapes {_shape(q_norm_w)}, {_shape(kv_norm_w)}; expected "
          f"({q_lora},), ({kv_lora},)")
    _check_paged(cache, block_table, T, qkv.shape[1] - q_lora)
    _check_vec(positions, T, "positions")
    if q_out is not None:
        _need(_shape(q_out) == (T, q_lora) and q_out.dtype == BF16 and q_out.stride(1) == 1,
              f"q_out of shape {_shape(q_out)} dtype {q_out.dtype}; expected bf16 ({T}, "
              f"{q_lora})")
    if not _use_triton(qkv):
        return mla_prep_reference(qkv, q_norm_w, kv_norm_w, cache, block_table, positions,
                                  q_lora=q_lora, kv_lora=kv_lora, eps=eps, q_out=q_out)
    q_out = q_out if q_out is not None else qkv.new_empty(T, q_lora)
    return _tri.prep_triton(qkv, q_norm_w, kv_norm_w, cache, block_table, positions, q_lora,
                            kv_lora, eps, q_out)


def mla_absorb(q, w_uk, *, nope: int, out=None) -> torch.Tensor:
    """q (T, h, nope + rope) bf16, w_uk (h, nope, c) -> q_abs (T, h, c + rope) bf16."""
    _need(q.dim() == 3 and q.dtype == BF16 and q.stride(2) == 1 and q.shape[2] > nope,
          f"q of shape {_shape(q)} dtype {q.dtype}: expected bf16 (T, h, {nope} + rope)")
    T, h, d = q.shape
    _need(w_uk.dim() == 3 and _shape(w_uk)[:2] == (h, nope) and w_uk.dtype == BF16
          and w_uk.stride(2) == 1,
          f"w_uk of shape {_shape(w_uk)} dtype {w_uk.dtype}; expected bf16 ({h}, {nope}, c)")
    shape = (T, h, w_uk.shape[2] + d - nope)
    if out is not None:
        _need(_shape(out) == shape and out.dtype == BF16 and out.stride(2) == 1,
              f"out of shape {_shape(out)} dtype {out.dtype}; expected bf16 {shape}")
    if not _use_triton(q):
        return mla_absorb_reference(q, w_uk, nope=nope, out=out)
    out = out if out is not None else q.new_empty(shape)
    return _tri.absorb_triton(q, w_uk, nope, out)


def _check_output_args(w_uv_t, gate, out, T: int, h: int, c: int) -> int:
    """w_uv_t (h, c, v) bf16, gate (T, h·v), out None or bf16 (T, h·v) -> h·v."""
    _need(w_uv_t.dim() == 3 and _shape(w_uv_t)[:2] == (h, c) and w_uv_t.dtype == BF16
          and w_uv_t.stride(2) == 1,
          f"w_uv_t of shape {_shape(w_uv_t)} dtype {w_uv_t.dtype}; expected bf16 ({h}, {c}, v)")
    hv = h * w_uv_t.shape[2]
    _need(gate.dim() == 2 and _shape(gate) == (T, hv) and gate.stride(1) == 1,
          f"gate of shape {_shape(gate)}; expected ({T}, {hv}) with a contiguous last dim")
    if out is not None:
        _need(_shape(out) == (T, hv) and out.dtype == BF16 and out.stride(1) == 1,
              f"out of shape {_shape(out)} dtype {out.dtype}; expected bf16 ({T}, {hv})")
    return hv


def _check_qkv(qkv, q_lora: int, kv_lora: int) -> tuple[int, int]:
    """The fused decode ops' qkv: bf16 (T, q_lora + kv_lora + rope) -> (T, rope)."""
    _need(qkv.dim() == 2 and qkv.dtype == BF16 and qkv.stride(1) == 1
          and qkv.shape[1] > q_lora + kv_lora,
          f"qkv of shape {_shape(qkv)} dtype {qkv.dtype}: expected bf16 (T, q_lora + kv_lora "
          f"+ rope) = (T, {q_lora} + {kv_lora} + rope) with a contiguous last dim")
    return qkv.shape[0], qkv.shape[1] - q_lora - kv_lora


def _check_step_io(kv_norm_w, cache, block_table, positions, seq_lens, w_uv_t, gate, out,
                   T: int, h: int, kv_lora: int, rope: int) -> int:
    """The fused decode ops' kv norm weight, paged cache, positions, seq_lens and output
    arguments -> h·v."""
    _need(_shape(kv_norm_w) == (kv_lora,),
          f"kv norm weight of shape {_shape(kv_norm_w)}; expected ({kv_lora},)")
    _check_paged(cache, block_table, T, kv_lora + rope)
    _check_vec(positions, T, "positions")
    _check_vec(seq_lens, T, "seq_lens")
    return _check_output_args(w_uv_t, gate, out, T, h, kv_lora)


def _check_attention(q_abs, cache, block_table, seq_lens, kv_lora) -> None:
    _need(q_abs.dim() == 3 and q_abs.dtype == BF16 and q_abs.stride(2) == 1
          and q_abs.shape[2] > kv_lora,
          f"q_abs of shape {_shape(q_abs)} dtype {q_abs.dtype}: expected bf16 (T, h, "
          f"{kv_lora} + rope) with a contiguous last dim")
    _check_paged(cache, block_table, q_abs.shape[0], q_abs.shape[2])
    _check_vec(seq_lens, q_abs.shape[0], "seq_lens")


def _num_splits(q_abs, cache, block_table, num_splits) -> int:
    """num_splits, or the heuristic on this device's SM count when None (q_abs: any (T, …)
    tensor on the device)."""
    if num_splits is None:
        return default_num_splits(q_abs.shape[0], block_table.shape[1] * cache.shape[1],
                                  sm_count(str(q_abs.device)))
    _need(isinstance(num_splits, int) and num_splits >= 1,
          f"num_splits = {num_splits!r}; expected an int ≥ 1 or None (heuristic)")
    return num_splits


def attention_partials(q_abs, cache, block_table, seq_lens, *, kv_lora: int, scale: float,
                       num_splits: int | None = None, o_part=None, lse_part=None):
    """The split kernel alone (Triton: CUDA, or CPU under TRITON_INTERPRET=1) -> (o_part
    (T, S, h, c), lse_part (T, S, h)) fp32, into the given workspaces (S = their dim 1)."""
    _check_attention(q_abs, cache, block_table, seq_lens, kv_lora)
    T, h = q_abs.shape[:2]
    if o_part is None or lse_part is None:
        S = _num_splits(q_abs, cache, block_table, num_splits)
        o_part = q_abs.new_empty(T, S, h, kv_lora, dtype=torch.float32)
        lse_part = q_abs.new_empty(T, S, h, dtype=torch.float32)
    o_part, lse_part = _check_partials(o_part, lse_part)
    S = o_part.shape[1]
    _need(_shape(o_part) == (T, S, h, kv_lora),
          f"o_part of shape {_shape(o_part)}; expected {(T, S, h, kv_lora)}")
    _tri.split_triton(q_abs, cache, block_table, seq_lens, kv_lora, scale, o_part, lse_part)
    return o_part, lse_part


def mla_attention(q_abs, cache, block_table, seq_lens, *, kv_lora: int, scale: float,
                  num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV absorbed attention -> (o_lat (T, h, kv_lora) fp32 normalised, lse (T, h) fp32);
    a sequence with no rows: o_lat 0, lse −inf. One kernel when S = 1, else split + merge."""
    _check_attention(q_abs, cache, block_table, seq_lens, kv_lora)
    S = _num_splits(q_abs, cache, block_table, num_splits)
    if not _use_triton(q_abs):
        return mla_attention_reference(q_abs, cache, block_table, seq_lens, kv_lora=kv_lora,
                                       scale=scale)
    T, h = q_abs.shape[:2]
    o_lat = q_abs.new_empty(T, h, kv_lora, dtype=torch.float32)
    lse = q_abs.new_empty(T, h, dtype=torch.float32)
    if S == 1:      # the split kernel writes the final result
        attention_partials(q_abs, cache, block_table, seq_lens, kv_lora=kv_lora, scale=scale,
                           num_splits=1, o_part=o_lat.unsqueeze(1), lse_part=lse.unsqueeze(1))
        return o_lat, lse
    o_part, lse_part = attention_partials(q_abs, cache, block_table, seq_lens,
                                          kv_lora=kv_lora, scale=scale, num_splits=S)
    _tri.merge_triton(o_part, lse_part, o_lat, lse)
    return o_lat, lse


def mla_output(o_lat_partials, lse_partials, w_uv_t, gate, *, out=None) -> torch.Tensor:
    """Merge partials (T, S, h, c)/(T, S, h) (or merged (T, h, c)/(T, h); any strides with a
    contiguous last dim, e.g. DCP's gathered (D, T, h, c) permuted), bf16(o_lat)·W_uv, gate
    -> out (T, h·v) bf16. w_uv_t (h, c, v) bf16; gate (T, h·v) bf16 (row stride ok)."""
    o, lse = _check_partials(o_lat_partials, lse_partials)
    T, S, h, c = o.shape
    hv = _check_output_args(w_uv_t, gate, out, T, h, c)
    if not _use_triton(o):
        return mla_output_reference(o, lse, w_uv_t, gate, out=out)
    out = out if out is not None else gate.new_empty(T, hv, dtype=BF16)
    return _tri.output_triton(o, lse, w_uv_t, gate, out)


def mla_decode(q_abs, cache, block_table, seq_lens, w_uv_t, gate, *, kv_lora: int,
               scale: float, out=None, num_splits: int | None = None) -> torch.Tensor:
    """mla_attention + mla_output in 2 kernels (split, merge+output) -> (T, h·v) bf16."""
    if not _use_triton(q_abs):
        _check_attention(q_abs, cache, block_table, seq_lens, kv_lora)
        o_lat, lse = mla_attention_reference(q_abs, cache, block_table, seq_lens,
                                             kv_lora=kv_lora, scale=scale)
        return mla_output(o_lat, lse, w_uv_t, gate, out=out)
    o_part, lse_part = attention_partials(q_abs, cache, block_table, seq_lens, kv_lora=kv_lora,
                                          scale=scale, num_splits=num_splits)
    return mla_output(o_part, lse_part, w_uv_t, gate, out=out)

# batches up to which mla_decode_fused is ONE launch (phases A, B, C of `_fused_kernel`);
# above it phase A alone + the split + output kernels. 0: never one launch. Measured on the
# H200 (scripts/explore/probe_kernels.py --mla-fused): the one-launch form is slower at
# every batch (TP16 batch 1: 18.7 µs vs 13.8 for the three kernels): one num_warps for all
# phases (the output phase runs 1.5 µs slower at 8 warps, the split 0.9 µs slower at 4) and
# the phases' latencies add up where separate PDL launches overlap. Re-measure on sm_100.
FUSED_ONE_LAUNCH_MAX_T = 0
_SYNC: dict[str, torch.Tensor] = {}


def fused_sync(device: torch.device | str) -> torch.Tensor:
    """The default phase counters of `mla_decode_fused` on `device`: (8,) int32 zeros, shared
    by every call on it (each call leaves them zero; calls on one stream are serial). Pass an
    own `sync` to calls that may run concurrently on other streams."""
    key = str(torch.device(device))
    if key not in _SYNC:
        _SYNC[key] = torch.zeros(8, dtype=torch.int32, device=device)
    return _SYNC[key]


def check_fused_sync(sync: torch.Tensor) -> None:
    """Host sync: raise if a phase wait of a fused call on these counters gave up."""
    if int(sync[4]):
        raise RuntimeError("mla_decode_fused: a phase wait gave up (sync[4] = 1): the counters "
                           f"{sync.tolist()} were not zero at a launch, or a program died")


def mla_decode_fused(qkv, q, kv_norm_w, w_uk, cache, block_table, positions, seq_lens, w_uv_t,
                     gate, *, q_lora: int, kv_lora: int, eps: float, scale: float, out=None,
                     num_splits: int | None = None, sync: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """mla_prep's row store and q norm + mla_absorb + mla_decode (DCP = 1) in three kernels
    (rows + q norm + absorb, split, output), or in ONE for T ≤ FUSED_ONE_LAUNCH_MAX_T.

    qkv (T, q_lora + kv_lora + rope) bf16: the gathered q_a ‖ kv_a latents; q (T, h, nope +
    rope) = x · q_b'ᵀ with x = qkv[:, :q_lora] and q_b' = `folded_q_b_weight` (the q_a norm
    weight folded in, so q is q_b(RMSNorm(x)) up to the scalar rms_scale(x) that this op
    applies), best fp32 (the GEMV's accumulator: then q is rounded to bf16 once, after the
    scale, as stock rounds q once after its GEMV; bf16 works, with one more rounding). Writes the normalised kv row at positions[t] like mla_prep, then
    -> (T, h·v) bf16 as mla_decode. Phases wait on counters in `sync` (default `fused_sync`)."""
    T, rope = _check_qkv(qkv, q_lora, kv_lora)
    _need(q.dim() == 3 and q.dtype in (BF16, torch.float32) and q.shape[0] == T
          and q.shape[2] > rope and q.stride(2) == 1,
          f"q of shape {_shape(q)} dtype {q.dtype}: expected fp32 or bf16 ({T}, h, nope + "
          f"{rope}) with a contiguous last dim")
    h, nope = q.shape[1], q.shape[2] - rope
    _need(w_uk.dim() == 3 and _shape(w_uk) == (h, nope, kv_lora) and w_uk.dtype == BF16
          and w_uk.stride(2) == 1,
          f"w_uk of shape {_shape(w_uk)} dtype {w_uk.dtype}; expected bf16 ({h}, {nope}, "
          f"{kv_lora})")
    hv = _check_step_io(kv_norm_w, cache, block_table, positions, seq_lens, w_uv_t, gate, out,
                        T, h, kv_lora, rope)
    if not _use_triton(q):
        return mla_decode_fused_reference(qkv, q, kv_norm_w, w_uk, cache, block_table,
                                          positions, seq_lens, w_uv_t, gate, q_lora=q_lora,
                                          kv_lora=kv_lora, eps=eps, scale=scale, out=out)
    S = _num_splits(q, cache, block_table, num_splits)
    sync = fused_sync(q.device) if sync is None else sync
    _need(sync.dim() == 1 and sync.numel() >= 5 and sync.dtype == torch.int32
          and sync.device == q.device,
          f"sync of shape {_shape(sync)} dtype {sync.dtype} on {sync.device}: expected int32 "
          f"(≥ 5,) zeros on {q.device}")
    out = out if out is not None else gate.new_empty(T, hv, dtype=BF16)
    q_abs = q.new_empty(T, h, kv_lora + rope, dtype=cache.dtype)     # the split's dot operand
    o_part = q.new_empty(T, S, h, kv_lora, dtype=torch.float32)
    lse_part = q.new_empty(T, S, h, dtype=torch.float32)
    one = T <= FUSED_ONE_LAUNCH_MAX_T
    _tri.fused_triton(qkv, q, kv_norm_w, w_uk, cache, block_table, positions, seq_lens, w_uv_t,
                      gate, q_lora, kv_lora, eps, scale, q_abs, o_part, lse_part, sync, out,
                      only_a=not one)
    if not one:     # larger batches: phase A alone, then the split and output kernels
        _tri.split_triton(q_abs, cache, block_table, seq_lens, kv_lora, scale, o_part,
                          lse_part)
        _tri.output_triton(o_part, lse_part, w_uv_t, gate, out)
    return out


def mla_decode_absorbed(qkv, q, kv_norm_w, cache, block_table, positions, seq_lens, w_uv_t,
                        gate, *, q_lora: int, kv_lora: int, eps: float, scale: float, out=None,
                        num_splits: int | None = None, pre_tile: bool = True) -> torch.Tensor:
    """mla_prep's row store and q norm + attention + output (DCP = 1) in TWO kernels: the
    split kernel scales q and the split holding the new row stores it first
    (`split_rows_triton`), then the output kernel. Replaces `mla_decode_fused`'s phase A:
    W_uk is folded into the q_b GEMV's weight instead (`absorbed_q_weight` with the q norm
    weight: h·(c + rope) rows instead of h·(nope + rope)).

    qkv (T, q_lora + kv_lora + rope) bf16: the gathered q_a ‖ kv_a latents; q (T, h, kv_lora +
    rope) = x · W_q''ᵀ with x = qkv[:, :q_lora], best fp32 (rounded once, after the scale).
    Every token must be its own sequence (a decode step, no two tokens sharing a block written
    in this call): a stored row is read by its own token's split only. -> (T, h·v) bf16.
    pre_tile: each split requests its first KV tile before its PDL wait
    (DecodeOptions.mla_pre_tile; False: the wait first)."""
    T, rope = _check_qkv(qkv, q_lora, kv_lora)
    _need(q.dim() == 3 and q.dtype in (BF16, torch.float32) and q.shape[0] == T
          and q.shape[2] == kv_lora + rope and q.stride(2) == 1,
          f"q of shape {_shape(q)} dtype {q.dtype}: expected fp32 or bf16 ({T}, h, {kv_lora} "
          f"+ {rope}) with a contiguous last dim (the absorbed q)")
    h = q.shape[1]
    hv = _check_step_io(kv_norm_w, cache, block_table, positions, seq_lens, w_uv_t, gate, out,
                        T, h, kv_lora, rope)
    if not _use_triton(q):
        return mla_decode_absorbed_reference(qkv, q, kv_norm_w, cache, block_table, positions,
                                             seq_lens, w_uv_t, gate, q_lora=q_lora,
                                             kv_lora=kv_lora, eps=eps, scale=scale, out=out)
    S = _num_splits(q, cache, block_table, num_splits)
    out = out if out is not None else gate.new_empty(T, hv, dtype=BF16)
    o_part = q.new_empty(T, S, h, kv_lora, dtype=torch.float32)
    lse_part = q.new_empty(T, S, h, dtype=torch.float32)
    _tri.split_rows_triton(q, qkv, kv_norm_w, cache, block_table, positions, seq_lens, q_lora,
                           kv_lora, eps, scale, o_part, lse_part, pre_tile=pre_tile)
    return _tri.output_triton(o_part, lse_part, w_uv_t, gate, out)


__all__ = ["mla_prep", "mla_absorb", "mla_attention", "mla_output", "mla_decode",
           "attention_partials", "absorbed_q_weight", "default_num_splits", "paged_rows",
           "mla_prep_reference", "mla_absorb_reference", "mla_attention_reference",
           "mla_output_reference", "mla_decode_fused", "mla_decode_fused_reference",
           "folded_q_b_weight", "fused_sync", "check_fused_sync", "FUSED_ONE_LAUNCH_MAX_T",
           "mla_decode_absorbed", "mla_decode_absorbed_reference"]
