"""One K3 decoder layer's decode step (B sequences, one token each) for CUDA-graph capture.

No host sync, fixed shapes, state in preallocated buffers (scripts/bench/layer_weights.py):

    mix   = AttnRes(bank_in)                          h = RMSNorm(mix)
    attn  = KDA | MLA decode(h)                        [all-reduce]
    bank_mid[prefix] = bank_in[prefix] + attn
    mix2  = AttnRes(bank_mid)                          h2 = RMSNorm(mix2)
    ffn   = latent MoE(h2) + shared experts(h2)        [all-reduce(s)]
    prefix_out = bank_mid[prefix] + ffn

Numerics follow models/ (same rounding points; the AttnRes mix, SiTU, routing and the KDA gate
are the models/ functions themselves; the layer RMSNorms are torch's fused F.rms_norm in fp32
with fp32 weights instead of the reference's op chain; MLA q_lat/o use bf16 bmm with fp32
accumulation, the scores and the softmax fp32). Collectives are no-ops on one GPU, recorded by
`collectives()`; an all-gather of the specialized path is stood in for by one copy of rank 0's
slice into a receive buffer whose other slices hold fixed random values (`LayerState.gather_*`).

`DecodeStep` is the stock step: F.linear (cuBLAS) everywhere; replicated fused_qkv_a / router /
latent down+up read whole; the Triton fused grouped MoE over MXFP4; separate PyTorch ops for
norms, AttnRes, gates, KDA recurrence and MLA attention. The specialized step subclasses it
(layer_step_spec.py `SpecializedStep`; `make_step(W, S, variant, B)` picks one), keeping its
rounding points and `collectives()`.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

from raydecode.kernels.kda_decode import delta_rule_step, kda_gate_exp
from raydecode.kernels.moe_mxfp4 import fused_moe_mxfp4
from raydecode.models.attnres import attn_res_mix
from raydecode.models.kda import l2_normalize
from raydecode.models.layers import situ
from raydecode.models.moe import route

from .layer_weights import BF16, LayerState, LayerWeights

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@functools.lru_cache(maxsize=None)
def _has_out_dtype(device: str) -> bool:
    """Whether torch.mm/bmm take out_dtype=float32 for bf16 inputs here (CUDA, torch ≥ 2.8)."""
    try:
        a = torch.ones(2, 16, 16, dtype=BF16, device=device)
        torch.bmm(a, a, out_dtype=torch.float32)
        torch.mm(a[0], a[0], out_dtype=torch.float32)
        return True
    except Exception:
        return False


def mm_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (M, K) · w (N, K)ᵀ -> fp32 (M, N), bf16 products accumulated in fp32."""
    if _has_out_dtype(str(x.device)):
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    return F.linear(x.float(), w.float())


def bmm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if _has_out_dtype(str(a.device)):
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def rms(x: torch.Tensor, w32: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in fp32, returned in x's dtype (models/layers.py rms_norm)."""
    return F.rms_norm(x.float(), (x.shape[-1],), w32, eps).to(x.dtype)


def gemv_linear() -> Linear:
    """kernels.gemv.linear (the CuTe GEMV with its own F.linear fallback), contiguous inputs."""
    from raydecode.kernels import linear as gemv

    def lin(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None
            ) -> torch.Tensor:
        return gemv.linear(x if x.is_contiguous() else x.contiguous(), w, out_dtype)
    return lin


class DecodeStep:
    """`step()` runs one decode step of `batch` sequences on (W, S); `moe(h2)` the FFN half."""

    def __init__(self, W: LayerWeights, S: LayerState, variant: str, batch: int,
                 linear: Linear | None = None):
        if variant not in ("stock", "specialized"):
            raise ValueError(f"variant {variant!r}: expected 'stock' or 'specialized'")
        self.W, self.S, self.variant, self.T = W, S, variant, batch
        self.spec = variant == "specialized"
        self.lin: Linear = linear or F.linear
        self.eps = W.cfg.rms_norm_eps
        self.n = S.bank_in.shape[1] - 1                 # prefix slot of the bank
        self.trace: dict | None = None                  # set to a dict to keep intermediates

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> None:
        W, S, T, n, eps = self.W, self.S, self.T, self.n, self.eps
        t = W.t
        mix = attn_res_mix(S.bank_in[:T], t["self_attention_res_norm"],
                           t["self_attention_res_proj"][None], eps)
        h = rms(mix, t["input_layernorm"], eps)
        attn = self.kda(h) if W.kind == "kda" else self.mla(h)
        mid = S.bank_mid[:T]
        torch.add(S.bank_in[:T, n], attn, out=mid[:, n])
        mix2 = attn_res_mix(mid, t["mlp_res_norm"], t["mlp_res_proj"][None], eps)
        h2 = rms(mix2, t["post_attention_layernorm"], eps)
        ffn = self.moe(h2)
        torch.add(mid[:, n], ffn, out=S.prefix_out[:T])
        if self.trace is not None:
            self.trace.update(h=h, attn=attn, h2=h2, ffn=ffn)

    __call__ = step

    # ---- KDA -----------------------------------------------------------------------------
    def kda(self, h: torch.Tensor) -> torch.Tensor:
        W, S, T = self.W, self.S, self.T
        t, w, c = W.t, W.widths, W.cfg.kda
        hl, d, C = w["heads"], w["head_dim"], w["inner"]
        proj = self.lin(h, t["kda_in_proj"])                    # (T, [q k v g b f_a pad])
        qkv_in, g_out = proj[:, :3 * C], proj[:, 3 * C:4 * C]
        b = proj[:, 4 * C:4 * C + hl]
        fa = proj[:, 4 * C + hl:4 * C + hl + w["f_a"]]
        fb = self.lin(fa, t["kda_f_b"]).view(T, hl, d)
        g = kda_gate_exp(fb, t["kda_exp_A"], t["kda_dt_bias"], c.gate_lower_bound)
        beta = torch.sigmoid(b.float())                          # (T, h)
        conv = S.kda_conv[:T]                                    # (T, 3C, W−1) oldest first
        xs = torch.cat([conv, qkv_in.unsqueeze(-1)], -1)         # (T, 3C, W)
        y = F.silu((xs.float() * t["kda_conv"]).sum(-1)).to(h.dtype).float()
        conv.copy_(xs[..., 1:])
        q, k, v = y.view(T, 3, hl, d).unbind(1)
        q, k = l2_normalize(q), l2_normalize(k)
        o = delta_rule_step(q, k, v, g, beta, S.kda_rec[:T], d ** -0.5)   # (T, h, d) fp32
        gate = torch.sigmoid(g_out.float()).view(T, hl, d)
        o = (F.rms_norm(o, (d,), t["kda_o_norm"], self.eps) * gate).to(h.dtype)
        return self.lin(o.view(T, C), t["kda_o_proj"])          # [all-reduce]

    # ---- MLA (absorbed, over this batch's dense latent cache) -----------------------------
    def mla(self, h: torch.Tensor) -> torch.Tensor:
        W, S, T = self.W, self.S, self.T
        t, m, w = W.t, W.cfg.mla, W.widths
        hl, ql, c = w["heads"], m.q_lora_rank, m.kv_lora_rank
        qkv = self.lin(h, W.stock["fused_qkv_a"])              # (T, q_lora + latent)
        q = self.lin(rms(qkv[:, :ql], t["q_a_norm"], self.eps), t["q_b"])
        q = q.view(T, hl, m.qk_head_dim)
        row = torch.cat([rms(qkv[:, ql:ql + c], t["kv_a_norm"], self.eps), qkv[:, ql + c:]], -1)
        cache = S.mla_cache[:T]                                  # (T, ctx, c + rope)
        cache[:, -1].copy_(row)
        q_lat = torch.bmm(q[..., :m.qk_nope_head_dim].transpose(0, 1), t["w_uk"])   # (h, T, c)
        q_abs = torch.cat([q_lat.transpose(0, 1), q[..., m.qk_nope_head_dim:]], -1)  # (T, h, ·)
        s = bmm_f32(q_abs, cache.transpose(1, 2)) * m.qk_head_dim ** -0.5          # (T, h, ctx)
        p = s.softmax(-1).to(BF16)
        o_lat = bmm_f32(p, cache[:, :, :c]).to(BF16)                               # (T, h, c)
        o = torch.bmm(o_lat.transpose(0, 1), t["w_uv_t"]).transpose(0, 1)         # (T, h, v)
        o = o.reshape(T, hl * m.v_head_dim)
        o = (o.float() * torch.sigmoid(self.lin(h, t["g_proj"]).float())).to(h.dtype)
        return self.lin(o, t["o_proj"])                          # [all-reduce]

    # ---- latent MoE + shared experts --------------------------------------------------------
    def moe(self, h2: torch.Tensor) -> torch.Tensor:
        W, S, mc = self.W, self.S, self.W.cfg.moe
        t, w = W.t, W.widths
        logits = mm_f32(h2, W.stock["router"])
        z = self.lin(h2, W.stock["latent_down"])
        weights, ids = route(logits, t["router_bias"], mc.top_k, mc.num_expert_group,
                             mc.topk_group, mc.renormalize, mc.routed_scaling_factor)
        S.last_ids = ids
        lat = fused_moe_mxfp4(z, weights, ids, W.experts)       # (T, L) fp32 [all-reduce]
        sh = self.lin(h2, t["shared_gate_up"])
        si = w["shared"]
        lat = rms(lat.to(h2.dtype), t["latent_norm"], self.eps)
        a = situ(sh[:, :si], sh[:, si:], W.cfg.situ_beta, W.cfg.situ_linear_beta)
        sd = self.lin(a, t["shared_down"])
        up = self.lin(lat, W.stock["latent_up"])
        return up + sd                                           # sd [all-reduce]

    # ---- accounting -------------------------------------------------------------------------
    def collectives(self) -> list[dict]:
        """The collectives one step of this variant issues on a TP > 1 group (none run here):
        op, what, message shape/dtype and bytes (the full reduced / gathered tensor)."""
        W, T, cfg = self.W, self.T, self.W.cfg
        H, L, E = cfg.hidden_size, cfg.moe.latent_size, cfg.moe.num_experts
        out = []

        def add(op, what, shape, dt_bytes):
            size = 1
            for s in shape:
                size *= s
            out.append({"op": op, "what": what, "shape": list(shape),
                        "bytes": size * dt_bytes})

        if W.kind == "mla" and self.spec:
            add("all_gather", "fused_qkv_a rows", (T, W.widths["qkv_a"]), 2)
        add("all_reduce", "attention o_proj", (T, H), 2)
        if self.spec:
            add("all_gather", "router logits (fp32)", (T, E), 4)
            add("all_gather", "latent down (z, fp32 from the fused GEMV)", (T, L), 4)
        add("all_reduce", "routed latent sum (fp32, before the latent norm)", (T, L), 4)
        add("all_reduce", "latent up partial + shared experts" if self.spec else
            "shared experts down", (T, H), 2)
        return out


__all__ = ["DecodeStep", "mm_f32", "bmm_f32", "rms", "gemv_linear"]
