"""Kimi Delta Attention (KDA): gated delta rule with per-channel decay, K3 flavour.

Per token x (H), per head (dk = dv = head_dim):
    q, k, v = SiLU(causal depthwise conv_W(q_proj(x) | k_proj(x) | v_proj(x)))   (no conv bias)
    q, k    ← q / ‖q‖, k / ‖k‖  (‖·‖ = sqrt(Σx² + 1e-6))
    β       = sigmoid(b_proj(x))                                         one per head
    g       = lb · sigmoid(exp(A_log[h]) · (f_b(f_a(x)) + dt_bias))      (dk,) log-decay, lb = −5
    S_t     = (I − β k kᵀ) Diag(exp g) S_{t−1} + β k vᵀ                   S (dk, dv) fp32
    o_t     = scale · S_tᵀ q,  scale = dk^-½
    out     = o_proj(RMSNorm(o; o_norm) ⊙ sigmoid(g_proj(x)))           (low-rank g_a→g_b when
                                                                          use_full_rank_gate is off)

A_log is one value per head (fla's gate views it as (heads, 1)); K3's checkpoint stores it as a flat
vector of head_dim = 128 entries of which the first num_heads = 96 are used (tail padding, as
vLLM's K3 loader reads it; a per-channel reading of the 128 values, which one public port
assumes, contradicts both). The parameter holds this rank's heads; its `shard_fn` takes the
logical prefix and cuts the rank's contiguous head range.

Chunked form (exact; used for any step of more than one token). Within a chunk with cumulative
log-decay G_t = Σ_{i≤t} g_i and initial state S₀, the pseudo-values u_t (S_t = Diag(e^{g_t}) S_{t−1}
+ k_t u_tᵀ) solve the unit lower-triangular system
    u_t + Σ_{i<t} A_ti u_i = β_t (v_t − (k_t ⊙ e^{G_t})ᵀ S₀),
    A_ti = β_t Σ_c k_tc k_ic e^{G_tc − G_ic},
and then  o_t = scale [(q_t ⊙ e^{G_t})ᵀ S₀ + Σ_{i≤t} (Σ_c q_tc k_ic e^{G_tc − G_ic}) u_i],
          S_C = e^{G_C} ⊙ S₀ + Σ_i (k_i ⊙ e^{G_C − G_i}) u_iᵀ.
Decays enter only as e^{G_t − G_i} with i ≤ t (≤ 1), so nothing overflows at any chunk size.
On CUDA with fla-core installed the step's multi-token sequences run this form as one varlen
call of fla's chunked kernel instead (kernels/kda_prefill.py; `kda_chunked` stays its reference),
their short convolutions, SiLU and L2 norms as one kernel per sequence (kernels/kda_conv.py).
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from raydecode.kernels import kda_conv as kda_conv_op
from raydecode.kernels import kda_decode as kda_decode_op
from raydecode.kernels import kda_prefill as kda_prefill_op
from raydecode.kernels import kda_verify as kda_verify_op
from raydecode.kernels import stock_elementwise as stock_ew
from raydecode.kernels.settings import DEFAULT_OPTIONS, DecodeOptions

from .cache import ModelCaches, StepBatch, batch_decode_rows, device_index
from .config import K3Config
from .layers import (DerivedWeights, RMSNorm, column_linear, new_param, pack_rows_,
                     replicated_linear, rms_norm, row_linear, stock_fused)
from .parallel import Comm, LocalComm, Parallel
from .params import FUSED_ROW_ALIGN
from .pieces import attention_core
from .specialized import linear_for

L2_EPS = 1e-6


# ---- math (fp32) -------------------------------------------------------------------------

def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + L2_EPS)


def kda_gate(raw: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
             lower_bound: float) -> torch.Tensor:
    """raw (T, h, dk) = f_b(f_a(x)), a_log (h,), dt_bias (h·dk,) -> log-decay (T, h, dk) fp32
    in (lower_bound, 0): lb · sigmoid(exp(A_log) · (raw + dt_bias))."""
    h, dk = raw.shape[-2:]
    z = raw.float() + dt_bias.float().view(h, dk)
    return lower_bound * torch.sigmoid(a_log.float().exp().view(h, 1) * z)


def kda_recurrent(q, k, v, g, beta, scale: float, state: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule. q, k, g (T, h, dk); v (T, h, dv); beta (T, h);
    state (h, dk, dv) fp32 (not modified). -> (o (T, h, dv), final state), fp32 (fp64 if the
    inputs are fp64)."""
    dt = torch.promote_types(v.dtype, torch.float32)
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    S = state.to(dt)
    o = v.new_empty(v.shape)
    for t in range(q.shape[0]):
        S = S * g[t].exp().unsqueeze(-1)                                   # Diag(e^g) S
        pred = torch.einsum("hc,hcv->hv", k[t], S)                         # kᵀS
        S = S + torch.einsum("hc,hv->hcv", beta[t].unsqueeze(-1) * k[t], v[t] - pred)
        o[t] = scale * torch.einsum("hc,hcv->hv", q[t], S)
    return o, S


def kda_chunked(q, k, v, g, beta, scale: float, state: torch.Tensor, chunk_size: int = 64
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `kda_recurrent`, parallel within chunks of `chunk_size` tokens."""
    T, h, dk = q.shape
    dt = torch.promote_types(v.dtype, torch.float32)
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    S = state.to(dt)
    o = v.new_empty(v.shape)
    for c0 in range(0, T, chunk_size):
        sl = slice(c0, min(c0 + chunk_size, T))
        qc, kc, vc, gc = (x[sl].transpose(0, 1) for x in (q, k, v, g))          # (h, L, ·)
        bc = beta[sl].transpose(0, 1)                                             # (h, L)
        L = qc.shape[1]
        G = gc.cumsum(1)                                                          # (h, L, dk)
        causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()      # i <= t
        diff = G.unsqueeze(2) - G.unsqueeze(1)                                    # (h, t, i, dk)
        decay = torch.where(causal[..., None], diff, float("-inf")).exp()         # e^{G_t−G_i}
        kk = torch.einsum("htc,hic,htic->hti", kc, kc, decay)
        A = (bc.unsqueeze(-1) * kk).tril(-1)                                      # strictly lower
        eG = G.exp()
        rhs = bc.unsqueeze(-1) * (vc - torch.einsum("htc,hcv->htv", kc * eG, S))
        eye = torch.eye(L, dtype=A.dtype, device=A.device)
        U = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        qk = torch.einsum("htc,hic,htic->hti", qc, kc, decay)                     # inclusive
        oc = torch.einsum("htc,hcv->htv", qc * eG, S) + qk @ U
        o[sl] = (scale * oc).transpose(0, 1)
        GL = G[:, -1:]                                                            # (h, 1, dk)
        S = eG[:, -1].unsqueeze(-1) * S + torch.einsum("hic,hiv->hcv", kc * (GL - G).exp(), U)
    return o, S


def causal_conv_silu(xs: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """xs (W−1+L, C) = [previous W−1 inputs, L new inputs]; w (C, W), w[:, W−1] multiplies the
    current input. -> SiLU(conv) (L, C) fp32."""
    W = w.shape[1]
    windows = xs.float().unfold(0, W, 1)                                          # (L, C, W)
    return F.silu((windows * w.float()).sum(-1))


class HeadPrefixShard:
    """shard_fn for A_log: the checkpoint's flat vector holds one value per head in its first
    num_heads entries (tail padding after); rank r takes heads [r·h_l, (r+1)·h_l)."""

    def __init__(self, num_heads: int):
        self.num_heads = num_heads

    def __call__(self, full: torch.Tensor, par: Parallel) -> torch.Tensor:
        if full.dim() != 1 or full.numel() < self.num_heads:
            raise ValueError(f"A_log of shape {tuple(full.shape)}: expected a flat vector with "
                             f"at least num_heads = {self.num_heads} entries")
        hl = par.shard(self.num_heads, "KDA num_heads")
        return full.narrow(0, par.tp_rank * hl, hl)


slot_index = device_index   # (T,) KDA state rows of a batch composition (models/cache.py)


class ShortConv(nn.Module):
    """Holds a depthwise causal conv weight (channels_local, 1, W), fp32 as in the checkpoint."""

    def __init__(self, channels: int, width: int, par: Parallel):
        super().__init__()
        self.weight = new_param((channels, 1, width), par, 0, torch.float32,
                                what="KDA inner dim")


# ---- the layer ---------------------------------------------------------------------------

class KDAAttention(nn.Module):
    def __init__(self, cfg: K3Config, layer_idx: int, par: Parallel = Parallel(),
                 comm: Comm = LocalComm(), dtype: torch.dtype = torch.float32,
                 chunk_size: int = 64, options: DecodeOptions = DEFAULT_OPTIONS):
        super().__init__()
        c, H = cfg.kda, cfg.hidden_size
        self.layer_idx, self.par, self.comm, self.chunk_size = layer_idx, par, comm, chunk_size
        self.options = options
        self.heads = par.shard(c.num_heads, "KDA num_heads")
        self.dim, self.width, self.lower_bound = c.head_dim, c.conv_size, c.gate_lower_bound
        self.scale = c.head_dim ** -0.5
        inner, what = c.inner_dim, "KDA inner dim"
        self.q_proj = column_linear(H, inner, par, dtype, what)
        self.k_proj = column_linear(H, inner, par, dtype, what)
        self.v_proj = column_linear(H, inner, par, dtype, what)
        self.q_conv1d = ShortConv(inner, c.conv_size, par)
        self.k_conv1d = ShortConv(inner, c.conv_size, par)
        self.v_conv1d = ShortConv(inner, c.conv_size, par)
        self.b_proj = column_linear(H, c.num_heads, par, dtype, "KDA num_heads")
        self.f_a_proj = replicated_linear(H, c.head_dim, dtype)
        self.f_b_proj = column_linear(c.head_dim, inner, par, dtype, what)
        self.dt_bias = new_param((inner,), par, 0, torch.float32, what=what)
        self.A_log = new_param((max(c.num_heads, c.head_dim),), par, 0, torch.float32,
                               shard_fn=HeadPrefixShard(c.num_heads), local_shape=(self.heads,))
        if c.use_full_rank_gate:
            self.g_proj = column_linear(H, inner, par, dtype, what)
        else:
            self.g_a_proj = replicated_linear(H, c.head_dim, dtype)
            self.g_b_proj = column_linear(c.head_dim, inner, par, dtype, what)
        self.o_norm = RMSNorm(c.head_dim, cfg.rms_norm_eps, torch.float32)
        self.o_proj = row_linear(inner, H, par, dtype, what)
        self._derived = DerivedWeights()    # conv taps (3·h·d, W) and exp(A_log) for the kernel

    def _out_gate(self, x: torch.Tensor, lin) -> torch.Tensor:
        if hasattr(self, "g_proj"):
            return lin(x, self.g_proj.weight)
        return lin(lin(x, self.g_a_proj.weight), self.g_b_proj.weight)

    def _in_proj(self) -> torch.Tensor:
        """(4C + h + d padded to FUSED_ROW_ALIGN, H): q, k, v, g, b, f_a as one weight. The six
        parameters' storage moves into it (`pack_rows_`): no second copy of their bytes."""
        ps = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight, self.g_proj.weight,
              self.b_proj.weight, self.f_a_proj.weight]
        return self._derived.get("in_proj", ps, lambda: pack_rows_(
            ps, old=self._derived.peek("in_proj"), align=FUSED_ROW_ALIGN))

    def _fused_decode_ok(self, x: torch.Tensor, batch: StepBatch, caches: ModelCaches | None,
                         path: str) -> bool:
        """Whether this step runs `kda_decode` (kernels/kda_decode.py) over the slot pool:
        specialized path, a cache, every sequence one token at pos > 0 (a sequence at pos 0
        must ignore its slot's stale contents: the loop zeroes them), distinct slots, no speculative observer (it needs the per-token
        conv input and q, k, v, g, β that the fused op never materializes), and shapes and
        dtypes the op takes (cache conv state in the model dtype)."""
        if path != "specialized" or caches is None or caches.kda is None:
            return False
        if caches.kda_observer is not None or not batch.seqs:
            return False
        if any(s.length != 1 or s.pos == 0 for s in batch.seqs):
            return False
        T = x.shape[0]       # one sequence per token row, distinct slots
        if ({s.start for s in batch.seqs} != set(range(T)) or len(batch.seqs) != T
                or len({s.slot for s in batch.seqs}) != T):
            return False
        return (self.dim in kda_decode_op.HEAD_DIMS and self.width >= 2
                and x.dtype.is_floating_point and caches.kda.conv.dtype == x.dtype)

    def _fused_decode(self, x: torch.Tensor, batch: StepBatch, caches: ModelCaches,
                      lin) -> torch.Tensor:
        """One token per sequence through the fused op; the layer's cache rows are updated in
        place at the sequences' slots. -> o (T, h·d) in the model dtype (before o_proj)."""
        cache, row = caches.kda, caches.kda_index[self.layer_idx]
        proj, conv_w, exp_a = self._fused_inputs(x, lin)
        if caches.statics is not None:     # graph-shaped step: the preallocated slots
            slots = caches.statics.slots                                           # (B,)
        else:
            by_row = [0] * x.shape[0]
            for s in batch.seqs:
                by_row[s.start] = s.slot
            slots = slot_index(tuple(by_row), x.device)                            # (T,)
        return kda_decode_op.kda_decode(
            proj, self.f_b_proj.weight, cache.conv[row], conv_w, exp_a,
            self.dt_bias, self.o_norm.weight, cache.rec[row], heads=self.heads,
            head_dim=self.dim, lower_bound=self.lower_bound, eps=self.o_norm.eps, slots=slots,
            splits=self.options.kda_splits)

    def _verify(self, x: torch.Tensor, caches: ModelCaches, lin) -> torch.Tensor:
        """A graph-shaped verify step (engine/spec_graph.py VerifyStatics: B sequences of T
        rows, x (B·T, H)): kernels/kda_verify.py over the sequences' slots, the state after
        each position into the statics' per-position rows of this layer; the slots are only
        read (the accept step commits). -> o (B·T, h·d) before o_proj."""
        st, cache, row = caches.statics, caches.kda, caches.kda_index[self.layer_idx]
        proj, conv_w, exp_a = self._fused_inputs(x, lin)
        return kda_verify_op.kda_verify(
            proj, self.f_b_proj.weight, cache.conv[row], conv_w, exp_a, self.dt_bias,
            self.o_norm.weight, cache.rec[row], st.pos_conv[row], st.pos_rec[row],
            st.seq_slots, positions=st.verify, heads=self.heads, head_dim=self.dim,
            lower_bound=self.lower_bound, eps=self.o_norm.eps)

    def _conv_w(self) -> torch.Tensor:
        """The q, k, v conv taps as one (3·h·d, W) weight (rebuilt when a tap changes)."""
        convs = [self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]
        return self._derived.get("conv_w", convs, lambda: torch.cat(convs).squeeze(1))

    def _fused_inputs(self, x: torch.Tensor, lin):
        """(proj, conv_w, exp_a) of the fused decode / verify ops."""
        # proj (T, [q C | k C | v C | g C | b h | f_a d | pad]): the op's input layout
        if hasattr(self, "g_proj"):     # one GEMV over the packed in_proj
            proj = lin(x, self._in_proj())
        else:                           # low-rank gate: six GEMVs and a cat
            proj = torch.cat([lin(x, self.q_proj.weight), lin(x, self.k_proj.weight),
                              lin(x, self.v_proj.weight), self._out_gate(x, lin),
                              lin(x, self.b_proj.weight), lin(x, self.f_a_proj.weight)], -1)
        return proj, self._conv_w(), self._exp_a()

    def _exp_a(self) -> torch.Tensor:
        """exp(A_log) fp32 (h,), the gate's decay rates (rebuilt when A_log changes)."""
        return self._derived.get("exp_a", [self.A_log], lambda: self.A_log.float().exp())

    def _store(self, cache, row: int, s, xs: torch.Tensor, S: torch.Tensor) -> None:
        """A sequence's slot after its tokens: the last W−1 conv inputs and the final state."""
        cache.conv[row, s.slot] = xs[xs.shape[0] - (self.width - 1):].t().to(cache.conv.dtype)
        cache.rec[row, s.slot] = S

    def _prefill_packed(self, packed: list, g: torch.Tensor, beta: torch.Tensor,
                        o: torch.Tensor, cache, row: int | None) -> None:
        """The step's multi-token sequences (seq, xs, q, k, v, S0) as one kernels/kda_prefill
        call (fla's chunked kernel, packed along T): their rows of o (T, h, d) written, and
        each slot stored as the per-sequence loop does."""
        seqs = [p[0] for p in packed]
        bounds = [0, *itertools.accumulate(s.length for s in seqs)]
        if len(packed) == 1:    # one prompt chunk (the common step): views, no copies
            (s, _, q, k, v, S0), = packed
            gp, bp, S0 = g[s.start:s.end], beta[s.start:s.end], S0.unsqueeze(0)
        else:
            q, k, v = (torch.cat([p[i] for p in packed]) for i in (2, 3, 4))  # (ΣL, h, d)
            gp = torch.cat([g[s.start:s.end] for s in seqs])                  # (ΣL, h, d)
            bp = torch.cat([beta[s.start:s.end] for s in seqs])               # (ΣL, h)
            S0 = torch.stack([p[5] for p in packed])                          # (N, h, d, d)
        op, S = kda_prefill_op.kda_prefill(q, k, v, gp, bp, self.scale, S0,
                                           torch.tensor(bounds, dtype=torch.int64))
        for i, s in enumerate(seqs):
            o[s.start:s.end] = op[bounds[i]:bounds[i + 1]]
            if cache is not None:
                self._store(cache, row, s, packed[i][1], S[i])

    def _decode_rows(self, seqs: list, qkv_in: torch.Tensor, conv_w: torch.Tensor,
                     g: torch.Tensor, beta: torch.Tensor, o: torch.Tensor, cache,
                     row: int) -> None:
        """The step's one-token continuations (pos > 0) as one batched update, the per-sequence
        loop's math on a (D, ...) batch: the conv over each slot's last W−1 inputs and the new
        one, the L2 norms, one `kda_recurrent` step per sequence, their rows of o (T, h, d)
        written and each slot stored (kernels/kda_decode.py `kda_decode_rows`: one kernel on
        CUDA bf16, ~34 PyTorch kernels otherwise, whatever D)."""
        dev = qkv_in.device
        slots = slot_index(tuple(s.slot for s in seqs), dev)                      # (D,)
        rows = device_index(tuple(s.start for s in seqs), dev)                    # (D,)
        # one kernel on CUDA bf16 (kernels/kda_decode.py), else the same chain in PyTorch
        op = (kda_decode_op.kda_decode_rows if stock_fused(qkv_in)
              else kda_decode_op.kda_decode_rows_reference)
        op(qkv_in, g, beta, cache.conv[row], conv_w, cache.rec[row], o, rows, slots,
           heads=self.heads, head_dim=self.dim, scale=self.scale)

    def _core(self, batch: StepBatch, caches: ModelCaches | None, qkv_in: torch.Tensor,
              g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """The layer's attention core (models/pieces.py): each sequence's short convs, L2 norms
        and delta rule from its slot (a start from zero), the slot stored. qkv_in (T, 3·h·d)
        model dtype, g (T, h, d), beta (T, h) fp32 -> o (T, h, d) fp32, before the gated norm."""
        T, h, d, W = qkv_in.shape[0], self.heads, self.dim, self.width
        conv_w = self._conv_w()
        cache = caches.kda if caches is not None else None
        row = caches.kda_index[self.layer_idx] if caches is not None else None
        observer = caches.kda_observer if cache is not None else None
        # where fla's kernel runs on these tensors the step's multi-token sequences go through
        # one varlen kernels/kda_prefill call; with a speculative observer every sequence
        # keeps this loop (the observer reads each one's S0 view and q, k, v, g, β in turn)
        varlen = observer is None and kda_prefill_op.available(qkv_in)
        packed = []                              # (seq, xs, q, k, v, S0) for the varlen call
        singles = []                             # one-token continuations: `_decode_rows`
        batched = cache is not None and batch_decode_rows(qkv_in)
        pad = caches.pad_slot if caches is not None else None
        o = qkv_in.new_empty(T, h, d, dtype=torch.float32)
        for s in batch.seqs:
            sl = slice(s.start, s.end)
            if s.slot == pad:                   # a padded step's scratch sequence: zero rows
                o[sl].zero_()
                continue
            if s.length == 1 and s.pos > 0 and batched and observer is None:
                singles.append(s)
                continue
            if cache is None or s.pos == 0:   # a sequence start ignores stale slot contents
                tail = qkv_in.new_zeros(W - 1, qkv_in.shape[1])
                S0 = qkv_in.new_zeros(h, d, d, dtype=torch.float32)
            else:
                tail = cache.conv[row, s.slot].t().to(qkv_in.dtype)   # (W−1, 3·h·d) oldest first
                S0 = cache.rec[row, s.slot]
            xs = torch.cat([tail, qkv_in[sl]], 0)
            if varlen and s.length > 1:   # conv, SiLU, rounding, L2 norms: one kernel
                q, k, v = kda_conv_op.conv_silu_l2(xs, conv_w, h, d, qkv_in.dtype)
                packed.append((s, xs, q, k, v, S0))
                continue
            y = causal_conv_silu(xs, conv_w).to(qkv_in.dtype).float()   # model-dtype rounding
            q, k, v = (t.reshape(s.length, h, d) for t in y.split(h * d, dim=-1))
            q, k = l2_normalize(q), l2_normalize(k)
            if s.length == 1:
                o[sl], S = kda_recurrent(q, k, v, g[sl], beta[sl], self.scale, S0)
            else:
                o[sl], S = kda_chunked(q, k, v, g[sl], beta[sl], self.scale, S0,
                                       self.chunk_size)
            if observer is not None:                                    # speculative rollback
                observer(row, s, xs, (q, k, v, g[sl], beta[sl]), S0)
            if cache is not None:
                self._store(cache, row, s, xs, S)
        if packed:
            self._prefill_packed(packed, g, beta, o, cache, row)
        if singles:
            self._decode_rows(singles, qkv_in, conv_w, g, beta, o, cache, row)
        return o

    def _core_single(self, caches: ModelCaches, single, qkv_in: torch.Tensor,
                     g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """`_core` for a step whose only real sequence fills rows [0, n) of the T-row bucket
        (the scratch pad after it), with the slot, whether it continues (pos > 0) and n read
        from `single`'s device tensors (engine/piecewise.py `SingleSeq`): capturable, so a
        single-sequence stock graph runs it inside the graph. The whole bucket goes through
        the conv and the chunked delta rule as one sequence, with β = 0 and g = 0 on the pad
        rows: each such row leaves the state as it was (no decay, no update), so the final
        state is the state after row n − 1, and rows < n never read later ones (causal). The
        slot stores that state and the last W − 1 real conv inputs; pad rows of o are zeros
        (as `_core` leaves a skipped pad). A `MixedSeq` (engine/piecewise.py): the prompt
        chunk's rows [start, start + n) gathered to the front first (a device rotation: the
        rows after them, masked, follow), its rows of o scattered back, then the step's
        one-token continuations through the decode-row kernel on its fixed-length lists
        (`_decode_rows`' math, `count` live entries). -> o (T, h, d) fp32."""
        if getattr(single, "mixed", False):
            return self._core_mixed(caches, single, qkv_in, g, beta)
        return self._core_chunk(caches, single, qkv_in, g, beta)

    def _core_chunk(self, caches: ModelCaches, single, qkv_in: torch.Tensor,
                    g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """`_core_single` for one sequence in rows [0, n) (its docstring)."""
        T, h, d, W = qkv_in.shape[0], self.heads, self.dim, self.width
        cache, row = caches.kda, caches.kda_index[self.layer_idx]
        conv_w = self._conv_w()
        dev = qkv_in.device
        tail = cache.conv[row].index_select(0, single.slot)[0].t().to(qkv_in.dtype)  # (W−1, C)
        tail = torch.where(single.cont, tail, torch.zeros_like(tail))   # a start: zero tail
        xs = torch.cat([tail, qkv_in], 0)                                # (W − 1 + T, 3·h·d)
        real = torch.arange(T, device=dev) < single.n                    # (T,)
        gm = torch.where(real[:, None, None], g, torch.zeros_like(g))
        bm = torch.where(real[:, None], beta, torch.zeros_like(beta))
        S0 = cache.rec[row].index_select(0, single.slot)                 # (1, h, d, d)
        S0 = torch.where(single.cont, S0, torch.zeros_like(S0))
        # both ops fall back to their PyTorch references where their kernels cannot run
        q, k, v = kda_conv_op.conv_silu_l2(xs, conv_w, h, d, qkv_in.dtype)
        o, S = kda_prefill_op.kda_prefill(q, k, v, gm, bm, self.scale, S0,
                                          torch.tensor([0, T], dtype=torch.int64),
                                          index=single.index(T))            # S (1, h, d, d)
        o = torch.where(real[:, None, None], o, torch.zeros_like(o))
        last = single.n + torch.arange(W - 1, device=dev)                # xs rows of the last
        cache.conv[row].index_copy_(0, single.slot,                      # W − 1 real inputs
                                    xs.index_select(0, last).t().unsqueeze(0)
                                    .to(cache.conv.dtype))
        cache.rec[row].index_copy_(0, single.slot, S.to(cache.rec.dtype))
        return o

    def _core_mixed(self, caches: ModelCaches, mixed, qkv_in: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor) -> torch.Tensor:
        """`_core_single`'s mixed-step form (its docstring): capturable, nothing read on the
        host."""
        T = qkv_in.shape[0]
        idx = (torch.arange(T, device=qkv_in.device) + mixed.start) % T      # a rotation
        o_front = self._core_chunk(caches, mixed, qkv_in.index_select(0, idx),
                                   g.index_select(0, idx), beta.index_select(0, idx))
        o = torch.empty_like(o_front).index_copy_(0, idx, o_front)   # every row: a permutation
        cache, row = caches.kda, caches.kda_index[self.layer_idx]
        op = (kda_decode_op.kda_decode_rows if stock_fused(qkv_in)
              else kda_decode_op.kda_decode_rows_reference)
        op(qkv_in, g, beta, cache.conv[row], self._conv_w(), cache.rec[row], o, mixed.dec_rows,
           mixed.dec_slots, heads=self.heads, head_dim=self.dim, scale=self.scale,
           count=mixed.dec_count)
        return o

    def forward(self, x: torch.Tensor, batch: StepBatch, caches: ModelCaches | None,
                path: str = "stock") -> torch.Tensor:
        T, h, d = x.shape[0], self.heads, self.dim
        lin = linear_for(path, self.options)   # specialized: the same math on kernels/ GEMVs
        if caches is not None and getattr(caches.statics, "verify", None):
            o = self._verify(x, caches, lin)                                       # (B·T, h·d)
            return self.comm.all_reduce(lin(o, self.o_proj.weight))
        if self._fused_decode_ok(x, batch, caches, path):
            o = self._fused_decode(x, batch, caches, lin)                          # (T, h·d)
            return self.comm.all_reduce(lin(o, self.o_proj.weight))
        if caches is not None and caches.statics is not None:
            raise RuntimeError(f"KDA layer {self.layer_idx}: a graph-shaped step (caches."
                               "statics set) needs the fused decode (specialized path, one "
                               "token per sequence at pos > 0, distinct slots, no observer)")
        C = h * d
        if hasattr(self, "g_proj"):     # q, k, v, g, b, f_a: one GEMM over the packed in_proj
            proj = lin(x, self._in_proj())
            qkv_in, gate_in = proj[:, :3 * C], proj[:, 3 * C:4 * C]        # column views
            b_in, f_a = proj[:, 4 * C:4 * C + h], proj[:, 4 * C + h:4 * C + h + d]
        else:                           # low-rank gate
            qkv_in = torch.cat([lin(x, self.q_proj.weight), lin(x, self.k_proj.weight),
                                lin(x, self.v_proj.weight)], -1)                  # (T, 3·h·d)
            b_in, f_a, gate_in = (lin(x, self.b_proj.weight), lin(x, self.f_a_proj.weight),
                                  None)
        fused = stock_fused(x)            # one kernel each for the gates and the output norm
        raw = lin(f_a, self.f_b_proj.weight)                                       # (T, h·d)
        if fused:
            g, beta = stock_ew.kda_gate_beta(raw, b_in, self._exp_a(), self.dt_bias,
                                             self.lower_bound, h)           # (T, h, d), (T, h)
        else:
            beta = torch.sigmoid(b_in.float())                                     # (T, h)
            g = kda_gate(raw.view(T, h, d), self.A_log, self.dt_bias,
                         self.lower_bound)                                         # (T, h, d)
        o = attention_core(caches, self._core, batch, qkv_in, g, beta,
                           inline=self._core_single)                              # (T, h, d)
        gate_in = self._out_gate(x, lin) if gate_in is None else gate_in
        if fused:
            o = stock_ew.gated_rms_norm(o, self.o_norm.weight, self.o_norm.eps, gate_in, x.dtype)
        else:
            gate = torch.sigmoid(gate_in.float()).view(T, h, d)
            o = (rms_norm(o, self.o_norm.weight, self.o_norm.eps) * gate).to(x.dtype)
        return self.comm.all_reduce(lin(o.reshape(T, h * d), self.o_proj.weight))


__all__ = ["KDAAttention", "kda_gate", "kda_recurrent", "kda_chunked", "causal_conv_silu",
           "l2_normalize", "HeadPrefixShard"]
