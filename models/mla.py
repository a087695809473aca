"""Multi-head latent attention (MLA) as K3 uses it: NoPE (no rotary on any part), a sigmoid
output gate, and a 576-wide latent cache row per token.

Per token x (H):
    q   = q_b(RMSNorm(q_a(x)))                       (heads, nope + rope)
    kv  = kv_a_proj_with_mqa(x) = [c_raw (kv_lora), k_pe (rope)]
    row = [RMSNorm(c_raw), k_pe]                     (kv_lora + rope) — what the cache stores
    kv_b(c) = per head [k_nope (nope), v (v)]        kv_b weight (heads·(nope+v), kv_lora)
    score = (q_nope·k_nope + q_pe·k_pe) · (nope + rope)^-½
    o   = softmax(score) v;  o ← o ⊙ sigmoid(g_proj(x));  out = o_proj(o)

Naive form (prefill without a cache): decompress k/v through kv_b. Absorbed form (over the
cache): q_lat = W_ukᵀ q_nope per head, attention directly on the rows with q_abs = [q_lat, q_pe],
o_lat = Σ p·c, then o = W_uv o_lat. The absorbed kernel returns the log-sum-exp per (token, head)
so partials over disjoint row sets merge exactly (`merge_attn_partials`). Prefill chunks over
the cache at D = 1 in bf16 on CUDA decompress the sequence's rows instead and run fused SDPA
(kernels/mla_prefill.py; `MLAAttention.prefill_impl`); decode rows stay absorbed.

DCP (dcp_size D > 1): token t's row lives on DCP rank t mod D. Each rank all-gathers q_abs of the
D ranks' heads of its DCP group, attends over its own rows for all of them, all-gathers
(o_lat, lse) and merges the D partials of its own heads. D = 1 runs none of this.

TP: heads split (q_b, kv_b, g_proj column-parallel; o_proj row-parallel + all-reduce); q_a,
kv_a and their norms are replicated, so every rank computes the full latent row. The specialized
step computes [q_a; kv_a] (q_lora + kv_lora + rope rows) 1/TP per rank and all-gathers it.

Specialized decode (path "specialized", caches given, every sequence one token, bf16 model and
pool, output gate present): the fused ops of kernels/mla_decode.py replace the per-sequence
PyTorch code — at D = 1 the q_b GEMV with W_uk and the q_a norm weight folded in
(`_q_b_absorbed`: the absorbed q straight out of the GEMV) then mla_decode_absorbed (attention
with the q norm scale and the row store in the split kernel; W_uv + gate: 2 kernels; with
DecodeOptions.mla_absorbed_q off, the `_q_b_folded` GEMV + mla_decode_fused, 3 kernels); at D > 1
mla_prep (norms + row store), q_b, mla_absorb, the q exchange, mla_attention over this rank's
rows + the DCP exchange + mla_output. Per-token paging (`decode_meta`): block table rows (T, max_blocks) int32, store index
(T,) = p // D on the rank owning p (else −1: not stored), seq_lens (T,) = rows of positions
≤ p on this rank = ⌊(p + D − r) / D⌋. Anything else runs the PyTorch code below.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn

from raydecode.kernels.mla_decode import (absorbed_q_weight, folded_q_b_weight, mla_absorb,
                                          mla_attention, mla_decode_absorbed,
                                          mla_decode_fused, mla_output, mla_prep)
from raydecode.kernels.mla_prefill import mla_prefill_into, resolve_impl
from raydecode.kernels.settings import DEFAULT_OPTIONS, DecodeOptions

from .cache import (MLALatentCache, ModelCaches, SeqSlice, StepBatch, batch_decode_rows,
                    device_index, host_to_device)
from .config import K3Config
from .layers import (DerivedWeights, RMSNorm, column_linear, pack_rows_, replicated_linear,
                     row_linear, stock_fused)
from .parallel import Comm, LocalComm, Parallel
from .pieces import attention_core
from .specialized import linear_for, row_pieces, sharded_gemv

BF16 = torch.bfloat16


# ---- attention math (fp32) -----------------------------------------------------------------

def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """q (T, h, d), k (m, h, d), v (m, h, dv); key j is visible to query t iff
    k_pos[j] <= q_pos[t]. -> (T, h, dv) fp32."""
    s = torch.einsum("thd,mhd->thm", q.float(), k.float()) * scale
    s = s.masked_fill((k_pos[None, :] > q_pos[:, None])[:, None, :], float("-inf"))
    return torch.einsum("thm,mhv->thv", s.softmax(-1), v.float())


def mla_absorbed_attention(q_abs: torch.Tensor, rows: torch.Tensor, row_pos: torch.Tensor,
                           q_pos: torch.Tensor, kv_lora_rank: int, scale: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of absorbed queries over latent rows.

    q_abs (T, h, kv_lora + rope) = [W_ukᵀ q_nope, q_pe]; rows (m, kv_lora + rope);
    row_pos (m,), q_pos (T,) absolute positions (row j visible to query t iff row_pos[j] <=
    q_pos[t]). Returns o_lat (T, h, kv_lora) = Σ_j p_j c_j and lse (T, h) = log Σ_j exp(s_j),
    both fp32; a (token, head) that sees no row gets o_lat = 0, lse = -inf.
    """
    r = rows.float()
    s = torch.einsum("thd,md->thm", q_abs.float(), r) * scale
    s = s.masked_fill((row_pos[None, :] > q_pos[:, None])[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                   # (T, h)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
    return torch.einsum("thm,mc->thc", p, r[:, :kv_lora_rank]), lse


SINGLES_ROWS = 1 << 17     # cached rows one batched gather of decode rows holds (fp32: 302 MB
                           # at K3's 576-wide latent)


def singles_groups(seqs: list[SeqSlice], max_rows: int = SINGLES_ROWS) -> list[list[SeqSlice]]:
    """One-token sequences split, in order, into groups whose padded gather (count × the
    longest position + 1) stays within max_rows (a sequence longer than that alone)."""
    groups, cur, longest = [], [], 0
    for s in seqs:
        n = max(longest, s.pos + 1)
        if cur and n * (len(cur) + 1) > max_rows:
            groups.append(cur)
            cur, n = [], s.pos + 1
        cur.append(s)
        longest = n
    return groups + [cur] if cur else groups


def merge_attn_partials(outs: torch.Tensor, lses: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of P attention partials over disjoint key sets.

    outs (P, T, h, c) each normalised over its own keys, lses (P, T, h):
    lse = log Σ_p exp(lse_p);  out = Σ_p exp(lse_p − lse) · out_p.
    """
    lse = torch.logsumexp(lses, dim=0)                                 # (T, h)
    w = torch.exp(lses - torch.where(torch.isfinite(lse), lse, 0.0))   # (P, T, h); -inf -> 0
    return (w.unsqueeze(-1) * outs.float()).sum(0), lse


# ---- paging of a decode step for the fused ops -----------------------------------------------

_META_MEMO: list = [None]    # (batch weakref, key, tensors): one step's, shared by its layers
# (cache id, slot) -> (the table list, its length then, its int32 row): a slot's table as a
# tensor across steps, so a step's paging copies rows instead of rebuilding T × max_blocks
# Python ints (64 rows, one of a 32k-token sequence: 8.74 → 0.27 ms of host time per step,
# CPU, bench/results/host-step-inputs-cpu-2026-12-07.json). The list
# is held, so its id stays its own; the engine replaces a table that changes (the statics'
# rule too: engine/step_graph.py `StepStatics._write`), and a changed length rebuilds it.
_TABLE_ROWS: dict = {}


def _table_row(cache: MLALatentCache, slot: int, table: list[int]) -> torch.Tensor:
    """`table` (slot's block ids) as an int32 tensor: the last step's where it is the same
    list at the same length, else built from it."""
    key = (id(cache), slot)
    held = _TABLE_ROWS.get(key)
    if held is not None and held[0] is table and held[1] == len(table):
        return held[2]
    row = torch.tensor(table, dtype=torch.int32)
    _TABLE_ROWS[key] = (table, len(table), row)
    return row


def decode_meta(batch: StepBatch, cache: MLALatentCache, device
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Paging of a decode-only step on this DCP rank (r of D), token t at position p_t:
    block_table (T, max_blocks) int32 (row t: t's sequence's blocks, 0-padded),
    store (T,) int32 = p_t // D if p_t mod D == r else −1 (mla_prep: not stored here),
    seq_lens (T,) int32 = #{p ≤ p_t : p mod D == r} = ⌊(p_t + D − r) / D⌋.

    Built from the host-side tables once per step (one host-to-device copy) and reused by every
    MLA layer of the step: memo keyed by the batch object, the cache, the device and each
    sequence's (slot, start, pos, table object, table length) — the engine replaces or extends a
    table between steps, never edits one in place during a step. A position beyond its
    sequence's blocks raises RuntimeError, as cache.write does."""
    seqs = batch.seqs
    key = (id(cache), str(device), tuple((s.slot, s.start, s.pos, id(cache.block_tables[s.slot]),
                                          len(cache.block_tables[s.slot])) for s in seqs))
    memo = _META_MEMO[0]
    if memo is not None and memo[0]() is batch and memo[1] == key:
        return memo[2]
    D, r, bs = cache.dcp_size, cache.dcp_rank, cache.block_size
    order = sorted(seqs, key=lambda s: s.start)
    assert [s.start for s in order] == list(range(len(order))), "decode step: one token each"
    tables = [cache.block_tables[s.slot] for s in order]
    lens = [(s.pos + D - r) // D for s in order]
    for s, t, n in zip(order, tables, lens):
        if -(-n // bs) > len(t):
            raise RuntimeError(f"slot {s.slot}: position {s.pos} beyond its {len(t)} cache "
                               "blocks")
    T, width = len(order), max(1, max(len(t) for t in tables))
    host = torch.zeros(T * width + 2 * T, dtype=torch.int32)  # [table | store | seq_lens]
    rows = host[:T * width].view(T, width)
    for i, (s, t) in enumerate(zip(order, tables)):
        if t:
            rows[i, :len(t)] = _table_row(cache, s.slot, t)
    host[T * width:] = torch.tensor([s.pos // D if s.pos % D == r else -1 for s in order]
                                    + lens, dtype=torch.int32)
    dev = host_to_device(host, device)                         # no host sync on CUDA
    out = (dev[:T * width].view(T, width), dev[T * width:T * width + T], dev[T * width + T:])
    _META_MEMO[0] = (weakref.ref(batch), key, out)
    return out


_ROWS_MEMO: list = [None]      # (weakref to a step's batch, its decode rows' key, their batch)


def _rows_batch(batch: StepBatch, dec: list[SeqSlice]) -> StepBatch:
    """The step's one-token sequences `dec` as a decode-only batch (starts 0..D−1 in dec's
    order), one object per step, so `decode_meta` builds its paging once for all MLA layers."""
    key = tuple(dec)
    memo = _ROWS_MEMO[0]
    if memo is not None and memo[0]() is batch and memo[1] == key:
        return memo[2]
    sub = StepBatch([s._replace(start=i) for i, s in enumerate(dec)])
    _ROWS_MEMO[0] = (weakref.ref(batch), key, sub)
    return sub


# ---- the layer ---------------------------------------------------------------------------

class MLAAttention(nn.Module):
    # the stock path's prefill chunks (`_absorbed`): kernels/mla_prefill.py `IMPLS` ("auto":
    # SDPA for bf16 / fp16 on CUDA, the absorbed reference elsewhere); tests set it per instance
    prefill_impl: str = "auto"

    def __init__(self, cfg: K3Config, layer_idx: int, par: Parallel = Parallel(),
                 comm: Comm = LocalComm(), dtype: torch.dtype = torch.float32,
                 options: DecodeOptions = DEFAULT_OPTIONS):
        super().__init__()
        m, H, eps = cfg.mla, cfg.hidden_size, cfg.rms_norm_eps
        self.layer_idx, self.par, self.comm, self.options = layer_idx, par, comm, options
        self.heads = par.shard(m.num_heads, "num_attention_heads")       # local heads
        self.nope, self.rope, self.vdim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.q_lora, self.kv_lora = m.q_lora_rank, m.kv_lora_rank
        self.scale = m.qk_head_dim ** -0.5
        self.q_a_proj = replicated_linear(H, m.q_lora_rank, dtype)
        self.q_a_layernorm = RMSNorm(m.q_lora_rank, eps, dtype)
        self.q_b_proj = column_linear(m.q_lora_rank, m.num_heads * m.qk_head_dim, par, dtype,
                                      "MLA heads · qk_head_dim")
        self.kv_a_proj_with_mqa = replicated_linear(H, m.latent_dim, dtype)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, eps, dtype)
        self.kv_b_proj = column_linear(m.kv_lora_rank, m.num_heads * (self.nope + self.vdim),
                                       par, dtype, "MLA heads · (nope + v)")
        self.g_proj = (column_linear(H, m.num_heads * self.vdim, par, dtype, "MLA heads · v")
                       if m.use_output_gate else None)
        self.o_proj = row_linear(m.num_heads * self.vdim, H, par, dtype, "MLA heads · v")
        self._derived = DerivedWeights()           # W_uv (h, kv_lora, v) for the fused decode

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_uk (h, nope, kv_lora), W_uv (h, v, kv_lora)) views of this rank's kv_b rows."""
        w = self.kv_b_proj.weight.view(self.heads, self.nope + self.vdim, self.kv_lora)
        return w[:, :self.nope], w[:, self.nope:]

    def forward(self, x: torch.Tensor, batch: StepBatch, caches: ModelCaches | None,
                path: str = "stock") -> torch.Tensor:
        T = x.shape[0]
        lin = linear_for(path, self.options)
        if path == "specialized":   # fused qkv_a: 1/TP of [q_a; kv_a] rows per rank + gather
            gate = None
            if self.g_proj is not None:     # and the gate rows in the same GEMV
                y = lin(x, self._qkv_a_g())
                n = y.shape[1] - self.g_proj.weight.shape[0]
                qkv, gate = self.comm.all_gather(y[:, :n], dim=-1), y[:, n:]
                if self.par.tp_size == 1:   # a column view of y: the ops want dense rows
                    qkv = qkv.contiguous()
            else:
                qkv = sharded_gemv(x, [self.q_a_proj.weight, self.kv_a_proj_with_mqa.weight],
                                   self.par, self.comm, self.options)
            if self._fused_decode_ok(qkv, batch, caches):
                o = self._fused_decode(x, qkv, batch, caches, lin, gate)   # (T, h·v) gated
                return self.comm.all_reduce(lin(o, self.o_proj.weight))
            q_a, kv = qkv.split([self.q_lora, qkv.shape[1] - self.q_lora], dim=-1)
        else:
            q_a, kv = lin(x, self.q_a_proj.weight), lin(x, self.kv_a_proj_with_mqa.weight)
        if caches is not None and caches.statics is not None:
            raise RuntimeError(f"MLA layer {self.layer_idx}: a graph-shaped step (caches."
                               "statics set) needs the fused decode (specialized path, bf16 "
                               "model and pool, output gate, decode-only batch)")
        q = lin(self.q_a_layernorm.stock(q_a), self.q_b_proj.weight)
        q = q.view(T, self.heads, self.nope + self.rope)
        rows = torch.cat([self.kv_a_layernorm.stock(kv[:, :self.kv_lora]),
                          kv[:, self.kv_lora:]], -1)
        if caches is None:
            o = self._naive(q, rows, batch).to(x.dtype)
        else:
            o = attention_core(caches, self._core, batch, q, rows)          # (T, h, v)
        o = o.reshape(T, self.heads * self.vdim)
        if self.g_proj is not None:
            o = (o.float() * torch.sigmoid(lin(x, self.g_proj.weight).float())).to(x.dtype)
        return self.comm.all_reduce(lin(o, self.o_proj.weight))

    # ---- specialized decode through kernels/mla_decode.py ------------------------------------

    def _fused_decode_ok(self, qkv: torch.Tensor, batch: StepBatch,
                         caches: ModelCaches | None) -> bool:
        """The fused ops' envelope; outside it the PyTorch code below runs (same math)."""
        return (caches is not None and caches.mla is not None and self.g_proj is not None
                and batch.is_decode_only and qkv.dtype == BF16
                and caches.mla.pool.dtype == BF16 and qkv.stride(-1) == 1)

    def _qkv_a_g(self) -> torch.Tensor:
        """(ΣN/TP + h·v, H): this rank's rows of [q_a; kv_a] (copies of row slices of the
        replicated weights, models/specialized.py `row_pieces`; at TP 1 the weights themselves)
        over g_proj, whose storage moves into the buffer (`pack_rows_`): one GEMV."""
        rep = [self.q_a_proj.weight, self.kv_a_proj_with_mqa.weight]
        own = [self.g_proj.weight]
        if self.par.tp_size == 1:
            own, rep = rep + own, []

        def build():
            pieces = row_pieces(tuple(w.shape[0] for w in rep), self.par.tp_rank,
                                self.par.tp_size) if rep else ()
            return pack_rows_(own, copies=[rep[i].narrow(0, a, n) for i, a, n in pieces],
                              old=self._derived.peek("qkv_a_g"))

        return self._derived.get("qkv_a_g", rep + own, build)

    def _fused_decode(self, x, qkv, batch: StepBatch, caches: ModelCaches, lin,
                      gate: torch.Tensor | None = None) -> torch.Tensor:
        """One token per sequence: store this step's rows, attend, W_uv, gate.
        x (T, H), qkv (T, q_lora + kv_lora + rope) bf16, gate (T, h·v) or None (computed
        here) -> o (T, h·v) bf16, before o_proj."""
        assert self.q_a_layernorm.eps == self.kv_a_layernorm.eps     # mla_prep takes one eps
        T, h, c = x.shape[0], self.heads, self.kv_lora
        pool = caches.mla.pool[caches.mla_index[self.layer_idx]]      # (blocks, bs, c + rope)
        st = caches.statics        # graph-shaped step: the preallocated paging (B rows)
        table, store, seq_lens = ((st.table, st.store, st.seq_lens) if st is not None
                                  else decode_meta(batch, caches.mla, x.device))
        if gate is None:
            gate = lin(x, self.g_proj.weight)                               # (T, h·v)
        D = self.par.dcp_size
        if D == 1 and getattr(st, "verify", None):
            # a verify step (engine/spec_graph.py VerifyStatics): a sequence's T rows attend
            # causally to each other, so every row is stored first (mla_prep; its q_n output
            # unused), then the split kernel stores none (no_store) and reads them all from
            # the pool; no pre-PDL tile read (the stores are the kernel just before)
            mla_prep(qkv, self.q_a_layernorm.weight, self.kv_a_layernorm.weight, pool, table,
                     store, q_lora=self.q_lora, kv_lora=c, eps=self.q_a_layernorm.eps)
            q = lin(qkv[:, :self.q_lora], self._q_b_absorbed(), torch.float32)
            return mla_decode_absorbed(qkv, q.view(T, h, c + self.rope),
                                       self.kv_a_layernorm.weight, pool, table, st.no_store,
                                       seq_lens, self._w_uv_t(), gate, q_lora=self.q_lora,
                                       kv_lora=c, eps=self.q_a_layernorm.eps,
                                       scale=self.scale, pre_tile=False)
        if D == 1 and self.options.mla_absorbed_q:   # q_abs from one GEMV; split, output
            q = lin(qkv[:, :self.q_lora], self._q_b_absorbed(), torch.float32)  # rounded once,
            q = q.view(T, h, c + self.rope)                                    # after the scale
            return mla_decode_absorbed(qkv, q, self.kv_a_layernorm.weight, pool, table, store,
                                       seq_lens, self._w_uv_t(), gate, q_lora=self.q_lora,
                                       kv_lora=c, eps=self.q_a_layernorm.eps,
                                       scale=self.scale, pre_tile=self.options.mla_pre_tile)
        if D == 1:      # after the q_b GEMV: q norm scale + absorb + row, attention, output
            q = lin(qkv[:, :self.q_lora], self._q_b_folded(), torch.float32)    # rounded once,
            q = q.view(T, h, self.nope + self.rope)                            # after the scale
            return mla_decode_fused(qkv, q, self.kv_a_layernorm.weight,
                                    self.absorbed_weights()[0], pool, table, store, seq_lens,
                                    self._w_uv_t(), gate, q_lora=self.q_lora, kv_lora=c,
                                    eps=self.q_a_layernorm.eps, scale=self.scale)
        q_n = mla_prep(qkv, self.q_a_layernorm.weight, self.kv_a_layernorm.weight, pool, table,
                       store, q_lora=self.q_lora, kv_lora=c, eps=self.q_a_layernorm.eps)
        q = lin(q_n, self.q_b_proj.weight).view(T, h, self.nope + self.rope)
        q_abs = mla_absorb(q, self.absorbed_weights()[0], nope=self.nope)   # (T, h, c + rope)
        q_all = self.comm.dcp_all_gather(q_abs, dim=1)                      # (T, D·h, c + rope)
        o_lat, lse = mla_attention(q_all, pool, table, seq_lens, kv_lora=c, scale=self.scale)
        part = torch.cat([o_lat, lse.unsqueeze(-1)], -1).unsqueeze(0)      # (1, T, D·h, c + 1)
        parts = self.comm.dcp_all_gather(part, dim=0)                       # (D, T, D·h, c + 1)
        r = self.par.dcp_rank
        mine = parts[:, :, r * h:(r + 1) * h].transpose(0, 1)               # (T, D, h, c + 1)
        return mla_output(mine[..., :c], mine[..., c], self._w_uv_t(), gate)

    def _q_b_folded(self) -> torch.Tensor:
        """q_b with the q_a norm weight folded into its columns (`folded_q_b_weight`), the
        weight mla_decode_fused's q comes from; rebuilt when either weight changes."""
        return self._derived.get("q_b_folded", [self.q_b_proj.weight, self.q_a_layernorm.weight],
                                 lambda: folded_q_b_weight(self.q_b_proj.weight.detach(),
                                                           self.q_a_layernorm.weight.detach()))

    def _q_b_absorbed(self) -> torch.Tensor:
        """q_b with W_uk and the q_a norm weight folded in (`absorbed_q_weight`), (h·(kv_lora +
        rope), q_lora): the weight of mla_decode_absorbed's q; rebuilt when a source changes."""
        return self._derived.get(
            "q_b_absorbed", [self.q_b_proj.weight, self.kv_b_proj.weight,
                             self.q_a_layernorm.weight],
            lambda: absorbed_q_weight(self.q_b_proj.weight.detach(),
                                      self.absorbed_weights()[0].detach(), self.heads,
                                      self.nope, self.rope,
                                      q_norm_w=self.q_a_layernorm.weight.detach()))

    def _w_uv_t(self) -> torch.Tensor:
        """W_uv as mla_output wants it, (h, kv_lora, v) contiguous (the kv_b view is
        (h, v, kv_lora)): a copy, rebuilt when the kv_b weight's storage or version changes."""
        return self._derived.get("w_uv_t", [self.kv_b_proj.weight],
                                 lambda: self.absorbed_weights()[1].detach()
                                 .transpose(1, 2).contiguous())

    def _naive(self, q, rows, batch: StepBatch) -> torch.Tensor:
        """Prefill from position 0 of every sequence, keys/values decompressed. -> (T, h, v)"""
        T = q.shape[0]
        kvb = self.kv_b_proj(rows[:, :self.kv_lora]).view(T, self.heads, self.nope + self.vdim)
        k_pe = rows[:, None, self.kv_lora:].expand(T, self.heads, self.rope)
        k = torch.cat([kvb[..., :self.nope], k_pe], -1)                 # (T, h, nope + rope)
        v = kvb[..., self.nope:]
        out = q.new_empty(T, self.heads, self.vdim, dtype=torch.float32)
        for s in batch.seqs:
            sl = slice(s.start, s.end)
            pos = torch.arange(s.length, device=q.device)
            out[sl] = naive_attention(q[sl], k[sl], v[sl], self.scale, pos, pos)
        return out

    def _core(self, batch: StepBatch, caches: ModelCaches, q: torch.Tensor,
              rows: torch.Tensor) -> torch.Tensor:
        """The layer's attention core (models/pieces.py): `_absorbed`, rounded to the model
        dtype (what the gate reads). q (T, h, nope + rope), rows (T, kv_lora + rope) -> (T, h,
        v) in q's dtype."""
        return self._absorbed(q, rows, batch, caches).to(q.dtype)

    def _absorbed(self, q, rows, batch: StepBatch, caches: ModelCaches) -> torch.Tensor:
        """Write this step's rows, then attend over each sequence's cached rows. -> (T, h, v)

        Prefill chunks (length > 1) at DCP 1 where `prefill_impl` resolves to SDPA (bf16 on
        CUDA by default, kernels/mla_prefill.py `resolve_impl`): K/V decompressed from the
        rows + fused attention, in q's dtype. Decode rows (length 1) at DCP 1 on CUDA bf16
        with the stock path's fused kernels on: the paged decode kernels (`_rows_paged`).
        Other decode rows, every row at DCP > 1 (the partials need the all-gathers) and the
        reference (the CPU and fp32 by default: as before, bit for bit) keep the absorbed
        fp32 math of `_latent_attention`."""
        cache, layer = caches.mla, caches.mla_index[self.layer_idx]
        seqs = [s for s in batch.seqs if s.slot != caches.pad_slot]   # a pad sequence: zeros
        cache.write_seqs(layer, seqs, rows)
        dec = [s for s in seqs if s.length == 1]              # one-token sequences
        # their paged decode kernels (CUDA bf16, DCP 1, RAYDECODE_STOCK_FUSED: `_rows_paged`)
        paged = bool(dec) and (self.par.dcp_size == 1 and stock_fused(q)
                               and cache.pool.dtype == BF16)
        if paged and len(dec) == len(batch.seqs) \
                and [s.start for s in dec] == list(range(len(dec))):    # a stock decode step
            return self._rows_paged(q, dec, batch, cache, layer)
        sdpa = self.par.dcp_size == 1 and resolve_impl(self.prefill_impl, q) == "sdpa"
        if not (paged or (sdpa and any(s.length > 1 for s in seqs))):
            return self._latent_attention(q, seqs, batch.positions(q.device), cache, layer)
        positions = batch.positions(q.device) if dec or not sdpa else None
        out = q.new_empty(q.shape[0], self.heads, self.vdim)                 # (T, h, v)
        if len(seqs) < len(batch.seqs):
            for s in batch.seqs:
                if s.slot == caches.pad_slot:
                    out[s.start:s.end].zero_()
        for s in seqs:
            sl = slice(s.start, s.end)
            if s.length > 1 and sdpa:
                r, _ = cache.read(layer, s.slot, s.pos + s.length)       # positions 0 .. end−1
                mla_prefill_into(out[sl], q[sl], r, s.pos, self.kv_b_proj.weight,
                                 nope=self.nope, vdim=self.vdim, kv_lora=self.kv_lora,
                                 scale=self.scale)
            elif s.length > 1:                       # (paged decode rows beside it)
                out[sl] = self._latent_attention(q[sl], [s._replace(start=0)], positions[sl],
                                                 cache, layer).to(out.dtype)
        if paged:                                   # the decode rows' paged kernels
            at = device_index(tuple(s.start for s in dec), q.device)
            out.index_copy_(0, at, self._rows_paged(q.index_select(0, at), dec, batch, cache,
                                                    layer))
        elif len(dec) > 1 and batch_decode_rows(q):  # the decode rows' absorbed math, together
            at = device_index(tuple(s.start for s in dec), q.device)
            res = self._latent_attention(q.index_select(0, at),
                                         [s._replace(start=i) for i, s in enumerate(dec)],
                                         positions.index_select(0, at), cache, layer)
            out.index_copy_(0, at, res.to(out.dtype))
        else:                                              # or one by one
            for s in dec:
                sl = slice(s.start, s.end)
                out[sl] = self._latent_attention(q[sl], [s._replace(start=0)], positions[sl],
                                                 cache, layer)
        return out

    def _rows_paged(self, q: torch.Tensor, dec: list[SeqSlice], batch: StepBatch,
                    cache: MLALatentCache, layer: int) -> torch.Tensor:
        """One-token sequences `dec` (rows already written; q (D, h, nope + rope) bf16, their
        rows in dec's order) through the specialized step's paged kernels (kernels/
        mla_decode.py): the W_uk absorb, the split-KV attention over each sequence's pool
        rows 0 .. pos, then bf16(o_lat)·W_uv. -> (D, h, v) bf16. The same roundings as the
        fused decode (q_abs and o_lat to bf16, p·V from bf16 p) where `_latent_attention`
        keeps fp32: ≈ 6 kernels instead of ≈ 37 (the absorbed fp32 math)."""
        sub = _rows_batch(batch, dec)                 # one per step: decode_meta's memo hits
        table, _, seq_lens = decode_meta(sub, cache, q.device)
        w_uk, _ = self.absorbed_weights()
        q_abs = mla_absorb(q, w_uk, nope=self.nope)                       # (D, h, c + rope)
        o_lat, _ = mla_attention(q_abs, cache.pool[layer], table, seq_lens,
                                 kv_lora=self.kv_lora, scale=self.scale)   # (D, h, c) fp32
        o = torch.bmm(o_lat.to(BF16).transpose(0, 1), self._w_uv_t())      # (h, D, v)
        return o.transpose(0, 1)

    def _attend_singles(self, q_abs, seqs: list[SeqSlice], cache: MLALatentCache, layer: int,
                        o_lat: torch.Tensor, lse: torch.Tensor) -> None:
        """`mla_absorbed_attention` of one-token sequences (each query at its position sees
        the sequence's rows 0 .. pos) as one padded batch: their rows of o_lat and lse
        written."""
        at = device_index(tuple(s.start for s in seqs), q_abs.device)
        rows, lens = cache.gather_singles(layer, seqs)                   # (D, L, c + rope)
        r = rows.float()
        s = torch.einsum("bhd,bld->bhl", q_abs.index_select(0, at).float(), r) * self.scale
        valid = torch.arange(r.shape[1], device=r.device)[None, :] < lens[:, None]
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        m = torch.logsumexp(s, dim=-1)                                  # (D, h)
        p = torch.exp(s - torch.where(torch.isfinite(m), m, 0.0).unsqueeze(-1))
        o_lat.index_copy_(0, at, torch.einsum("bhl,blc->bhc", p, r[..., :self.kv_lora]))
        lse.index_copy_(0, at, m)

    def _latent_attention(self, q, seqs: list[SeqSlice], positions, cache: MLALatentCache,
                          layer: int) -> torch.Tensor:
        """The absorbed fp32 math over the cached rows (rows already written): q (T, h,
        nope + rope) of seqs, back to back from 0 -> (T, h, v) fp32."""
        w_uk, w_uv = self.absorbed_weights()
        q_lat = torch.einsum("thn,hnc->thc", q[..., :self.nope].float(), w_uk.float())
        q_abs = torch.cat([q_lat, q[..., self.nope:].float()], -1)   # (T, h, kv_lora + rope)
        D = self.par.dcp_size
        if D > 1:   # queries of all D·h heads of the DCP group
            q_abs = self.comm.dcp_all_gather(q_abs, dim=1)
        o_lat = q_abs.new_zeros(q_abs.shape[0], q_abs.shape[1], self.kv_lora)
        lse = q_abs.new_full(q_abs.shape[:2], float("-inf"))
        # DCP 1: the one-token sequences batched (`_attend_singles`), the others one by one
        singles = ([s for s in seqs if s.length == 1]
                   if D == 1 and len(seqs) > 1 and batch_decode_rows(q_abs) else [])
        for s in seqs:
            if s.length == 1 and singles:
                continue
            sl = slice(s.start, s.end)
            r, r_pos = cache.read(layer, s.slot, s.pos + s.length)
            o_lat[sl], lse[sl] = mla_absorbed_attention(q_abs[sl], r, r_pos, positions[sl],
                                                        self.kv_lora, self.scale)
        for group in singles_groups(singles):
            self._attend_singles(q_abs, group, cache, layer, o_lat, lse)
        if D > 1:   # every rank's partial for the group's heads -> merge those of my heads
            part = torch.cat([o_lat, lse.unsqueeze(-1)], -1).unsqueeze(0)  # (1, T, D·h, c+1)
            parts = self.comm.dcp_all_gather(part, dim=0)                 # (D, T, D·h, c+1)
            mine = parts[:, :, self.par.dcp_rank * self.heads:(self.par.dcp_rank + 1) * self.heads]
            o_lat, lse = merge_attn_partials(mine[..., :-1], mine[..., -1])
        return torch.einsum("thc,hvc->thv", o_lat, w_uv.float())
