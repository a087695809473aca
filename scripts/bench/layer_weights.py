"""Per-rank weights and decode state of one K3 layer for the layer benchmark (GPU-side).

Names, local shapes and full shapes come from the model itself: a `K3DecoderLayer` built on the
meta device for `Parallel(tp_rank=0, tp_size=TP)` (no memory). Random values follow the model's
init rules (models/k3.py `_random_full`: linear weights ~N(0, 1/fan_in) with fan-in the FULL
last dim, norms ~1, AttnRes logits ~N(0, 1), ...), drawn directly at local shape on the device.
Routed experts are MXFP4 (`kernels.moe_mxfp4.MXFP4Experts`), never dequantized at K3 size.

`LayerWeights` holds what the two benchmark variants read:
  both         norms (fp32 copies), AttnRes vectors, KDA/MLA head-sharded weights, shared
               experts (gate ‖ up fused), the MXFP4 experts, routing bias, latent norm;
               KDA in_proj = q ‖ k ‖ v ‖ g ‖ b ‖ f_a (+ zero rows to a multiple of 16), as
               models/params.py `decode_gemv_shapes` counts it
  stock        fused_qkv_a (q_a ‖ kv_a), router, latent down and up: WHOLE (replicated)
  specialized  the same four: rank 0's contiguous 1/TP slice (rows; latent up: columns, copied
               contiguous), DESIGN §4 lever 1; and (round 3) GEMVs that share an input fused
               into one weight: h2_proj = [router 1/TP ‖ latent down 1/TP ‖ shared gate|up]
               rows (one fp32-out GEMV of h2), ffn_out = [latent up 1/TP ‖ shared down ‖ 0]
               columns (one GEMV, the two partial sums accumulated together), MLA qkv_a_g =
               [fused_qkv_a 1/TP ‖ g_proj] rows; (round 16, the default MLA path) MLA
               q_b_absorbed = q_b with W_uk and the q_a norm weight folded in (models/mla.py
               `_q_b_absorbed`; w_uk is then not read), or (round 9, RAYDECODE_BENCH_MLA=r9)
               q_b_folded = q_b with the q_a norm weight folded into its columns.
               `spec_drops` names the shared tensors the specialized step reads only inside
               those (not counted twice).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from raydecode.kernels.mla_decode import absorbed_q_weight, folded_q_b_weight
from raydecode.kernels.moe_mxfp4 import MXFP4Experts
from raydecode.models.config import K3Config
from raydecode.models.k3 import K3DecoderLayer
from raydecode.models.parallel import LocalComm, Parallel
from raydecode.models.params import FUSED_ROW_ALIGN, ffn_out_k

from .random_init import ParamSpec, init_value


def env_choice(env: str, choices: tuple[str, ...], default: str) -> str:
    """One of `choices` from the environment (this hand-kept bench copy only; it goes when
    the layer bench drives the model's layer)."""
    import os
    v = os.environ.get(env, default)
    if v not in choices:
        raise ValueError(f"{env}={v!r}; accepted: {', '.join(choices)}")
    return v

BF16 = torch.bfloat16
# RAYDECODE_BENCH_MLA: the specialized MLA block as
#   r16 (default): the model's served form (q_b with W_uk folded in, mla_decode_absorbed);
#   r9: round 9's (q_b', mla_decode_fused: rms scale + absorb + row store as a kernel);
#   r8: round 8's (prep, q_b on q_n, absorb, split, output; the weights counted are r9's).
# Same-lease A/B runs only; the weights built (and counted) follow it.
MLA_PATHS = ("r16", "r9", "r8")
MLA_PATH = env_choice("RAYDECODE_BENCH_MLA", MLA_PATHS, "r16")


def random_params(cfg: K3Config, layer_idx: int, par: Parallel, seed: int, device,
                  skip_experts: bool = True) -> dict[str, torch.Tensor]:
    """All parameters of the layer at local shape (routed experts left out by default)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, spec in layer_param_specs(cfg, layer_idx, par).items():
        if skip_experts and ".experts." in name:
            continue
        out[name] = init_value(name, spec, cfg, gen, device)
    return out


def random_experts(cfg: K3Config, par: Parallel, seed: int, device) -> MXFP4Experts:
    m = cfg.moe
    I = par.shard(m.expert_intermediate, "moe_intermediate_size")
    return MXFP4Experts.random(m.num_experts, m.latent_size, I, cfg.situ_beta,
                               cfg.situ_linear_beta, fan_in_13=m.latent_size,
                               fan_in_2=m.expert_intermediate, device=device, seed=seed)


def _pad_rows(w: torch.Tensor, align: int = FUSED_ROW_ALIGN) -> torch.Tensor:
    n = w.shape[0]
    pad = -(-n // align) * align - n
    return torch.cat([w, w.new_zeros(pad, w.shape[1])]) if pad else w


@dataclass
class LayerWeights:
    """Everything one layer copy's decode step reads (see the module docstring)."""
    kind: str
    cfg: K3Config
    par: Parallel
    t: dict[str, torch.Tensor] = field(default_factory=dict)     # read by both variants
    stock: dict[str, torch.Tensor] = field(default_factory=dict)
    spec: dict[str, torch.Tensor] = field(default_factory=dict)
    experts: MXFP4Experts | None = None
    widths: dict[str, int] = field(default_factory=dict)        # split points, local sizes
    spec_drops: set[str] = field(default_factory=set)           # t keys fused into spec ones

    def read_by(self, variant: str) -> dict[str, torch.Tensor]:
        if variant == "stock":
            return {**self.t, **self.stock}
        return {**{k: v for k, v in self.t.items() if k not in self.spec_drops}, **self.spec}

    def weight_bytes(self, variant: str) -> int:
        """Bytes of the dense tensors one step of `variant` reads (experts excluded)."""
        return sum(v.numel() * v.element_size() for v in self.read_by(variant).values())

    @staticmethod
    def build(cfg: K3Config, layer_idx: int, par: Parallel, p: dict[str, torch.Tensor],
              experts: MXFP4Experts) -> "LayerWeights":
        kind = cfg.layer_kinds[layer_idx]
        tp = par.tp_size
        W = LayerWeights(kind, cfg, par, experts=experts)
        f32 = lambda x: x.float().contiguous()      # noqa: E731
        t = W.t
        for nm in ("self_attention_res_norm", "mlp_res_norm", "input_layernorm",
                   "post_attention_layernorm"):
            t[nm] = f32(p[f"{nm}.weight"])
        for nm in ("self_attention_res_proj", "mlp_res_proj"):
            t[nm] = f32(p[f"{nm}.weight"][0])
        a = "self_attn"
        if kind == "kda":
            hl, d = p[f"{a}.A_log"].shape[0], cfg.kda.head_dim
            parts = [p[f"{a}.{x}_proj.weight"] for x in ("q", "k", "v", "g", "b", "f_a")]
            t["kda_in_proj"] = _pad_rows(torch.cat(parts)).contiguous()
            t["kda_f_b"] = p[f"{a}.f_b_proj.weight"].contiguous()
            t["kda_conv"] = torch.cat([p[f"{a}.{x}_conv1d.weight"] for x in "qkv"]
                                      ).squeeze(1).float().contiguous()        # (3C, W)
            t["kda_exp_A"] = p[f"{a}.A_log"].float().exp().contiguous()       # (hl,)
            t["kda_dt_bias"] = f32(p[f"{a}.dt_bias"])
            t["kda_o_norm"] = f32(p[f"{a}.o_norm.weight"])
            t["kda_o_proj"] = p[f"{a}.o_proj.weight"].contiguous()
            W.widths.update(heads=hl, head_dim=d, inner=hl * d, b=hl, f_a=d)
        else:
            m = cfg.mla
            hl = par.shard(m.num_heads)
            qkv_a = torch.cat([p[f"{a}.q_a_proj.weight"], p[f"{a}.kv_a_proj_with_mqa.weight"]])
            W.stock["fused_qkv_a"] = qkv_a.contiguous()
            W.spec["fused_qkv_a_local"] = qkv_a[:par.shard(qkv_a.shape[0])].contiguous()
            t["q_a_norm"] = f32(p[f"{a}.q_a_layernorm.weight"])
            t["kv_a_norm"] = f32(p[f"{a}.kv_a_layernorm.weight"])
            t["q_b"] = p[f"{a}.q_b_proj.weight"].contiguous()
            kvb = p[f"{a}.kv_b_proj.weight"].view(hl, m.qk_nope_head_dim + m.v_head_dim,
                                                   m.kv_lora_rank)
            t["w_uk"] = kvb[:, :m.qk_nope_head_dim].contiguous()                  # (h, n, c)
            t["w_uv_t"] = kvb[:, m.qk_nope_head_dim:].transpose(1, 2).contiguous()  # (h, c, v)
            t["g_proj"] = p[f"{a}.g_proj.weight"].contiguous()
            t["o_proj"] = p[f"{a}.o_proj.weight"].contiguous()
            W.spec["qkv_a_g_local"] = torch.cat([W.spec.pop("fused_qkv_a_local"), t["g_proj"]])
            W.spec_drops |= {"g_proj", "q_b", "q_a_norm"}
            if MLA_PATH == "r16":   # W_uk and the q_a norm weight folded into q_b (the split
                # kernel applies the rms scale; no kernel between the q_b GEMV and attention)
                W.spec["q_b_absorbed"] = absorbed_q_weight(
                    t["q_b"], t["w_uk"], hl, m.qk_nope_head_dim, m.qk_rope_head_dim,
                    q_norm_w=t["q_a_norm"]).contiguous()
                W.spec_drops.add("w_uk")
            else:   # round 9: q_a norm weight folded into q_b's columns (mla_decode_fused
                # applies the rms scale; no prep kernel before the q_b GEMV)
                W.spec["q_b_folded"] = folded_q_b_weight(t["q_b"], t["q_a_norm"]).contiguous()
            W.widths.update(heads=hl, qkv_a=qkv_a.shape[0], q_lora=m.q_lora_rank,
                            qkv_a_local=par.shard(qkv_a.shape[0]))
        mo = "block_sparse_moe"
        e, lat = cfg.moe.num_experts, cfg.moe.latent_size
        W.stock["router"] = p[f"{mo}.gate.weight"].contiguous()
        W.spec["router_local"] = p[f"{mo}.gate.weight"][:par.shard(e)].contiguous()
        t["router_bias"] = f32(p[f"{mo}.gate.e_score_correction_bias"])
        W.stock["latent_down"] = p[f"{mo}.routed_expert_down_proj.weight"].contiguous()
        W.spec["latent_down_local"] = W.stock["latent_down"][:par.shard(lat)].contiguous()
        W.stock["latent_up"] = p[f"{mo}.routed_expert_up_proj.weight"].contiguous()
        W.spec["latent_up_local"] = W.stock["latent_up"][:, :par.shard(lat)].contiguous()
        t["latent_norm"] = f32(p[f"{mo}.routed_expert_norm.weight"])
        sh = f"{mo}.shared_experts"
        t["shared_gate_up"] = torch.cat([p[f"{sh}.gate_proj.weight"],
                                         p[f"{sh}.up_proj.weight"]]).contiguous()
        t["shared_down"] = p[f"{sh}.down_proj.weight"].contiguous()
        W.widths.update(experts=e, latent=lat, tp=tp,
                        shared=p[f"{sh}.gate_proj.weight"].shape[0])
        # round 3: GEMVs sharing an input, fused (one launch each, same bytes + K padding)
        W.spec["h2_proj_local"] = torch.cat([W.spec.pop("router_local"),
                                             W.spec.pop("latent_down_local"),
                                             t["shared_gate_up"]]).contiguous()
        up = W.spec.pop("latent_up_local")
        k = up.shape[1] + t["shared_down"].shape[1]
        k_pad = ffn_out_k(up.shape[1], t["shared_down"].shape[1])
        W.spec["ffn_out_local"] = torch.cat([up, t["shared_down"],
                                             up.new_zeros(up.shape[0], k_pad - k)], 1).contiguous()
        W.spec_drops |= {"shared_gate_up", "shared_down"}
        W.widths.update(router_local=par.shard(e), latent_local=par.shard(lat), ffn_k=k_pad)
        return W


@dataclass
class LayerState:
    """Decode state of one layer copy for up to `max_batch` sequences (one token each).

    bank_in (B, n+1, H) AttnRes values [snapshots…, prefix] (read only); bank_mid the same
    with the prefix slot rewritten by each step (prefix + attention output); prefix_out (B, H)
    the layer's output prefix. KDA: conv (B, 3C, W−1) model dtype, rec (B, h, dk, dv) fp32,
    updated in place. MLA: cache (B, ctx, latent) with the step's row written at ctx − 1.
    gather_* hold the other ranks' slices of the specialized path's all-gathers (fixed random
    values), so one GPU playing rank 0 routes and attends like a real rank."""
    bank_in: torch.Tensor
    bank_mid: torch.Tensor
    prefix_out: torch.Tensor
    kda_conv: torch.Tensor | None = None
    kda_rec: torch.Tensor | None = None
    mla_cache: torch.Tensor | None = None
    gather_logits: torch.Tensor | None = None
    gather_z: torch.Tensor | None = None
    gather_qkv_a: torch.Tensor | None = None
    ffn_in: torch.Tensor | None = None         # (B, ffn_k) [latent norm ‖ SiTU ‖ 0] (spec)
    ffn_prev: torch.Tensor | None = None       # (B, H) the previous layer's FFN output (spec)
    mla_block_table: torch.Tensor | None = None  # (B, ctx / block) int32: the cache as pages
    mla_block: int = 0                         # rows per page of that view
    mla_positions: torch.Tensor | None = None  # (B,) int32 = ctx − 1 (the step's row)
    mla_seq_lens: torch.Tensor | None = None   # (B,) int32 = ctx
    last_ids: torch.Tensor | None = None       # (B, k) routing of the last step (checks)

    def mla_pages(self) -> torch.Tensor:
        """The dense (B, ctx, latent) cache viewed as (B·ctx/block, block, latent) pages; the
        block table maps sequence t to its own ctx/block pages in order (same rows)."""
        B, ctx, lat = self.mla_cache.shape
        return self.mla_cache.view(B * ctx // self.mla_block, self.mla_block, lat)

    @staticmethod
    def random(W: LayerWeights, layer_idx: int, max_batch: int, context: int, seed: int,
               device) -> "LayerState":
        cfg = W.cfg
        H = cfg.hidden_size
        gen = torch.Generator(device=device).manual_seed(seed)
        rnd = lambda *s, dt=BF16, sc=1.0: (sc * torch.randn(      # noqa: E731
            s, generator=gen, device=device)).to(dt)
        n_blocks = -(-layer_idx // cfg.attn_res_block_size)      # snapshots before layer i
        if layer_idx % cfg.attn_res_block_size == 0:
            raise ValueError(f"layer {layer_idx} starts an AttnRes block; the benchmark times "
                             "layers inside a block")
        bank_in = rnd(max_batch, n_blocks + 1, H)
        st = LayerState(bank_in=bank_in, bank_mid=bank_in.clone(),
                        prefix_out=torch.empty(max_batch, H, dtype=BF16, device=device))
        w = W.widths
        if W.kind == "kda":
            C, d = w["inner"], w["head_dim"]
            st.kda_conv = rnd(max_batch, 3 * C, cfg.kda.conv_size - 1)
            st.kda_rec = rnd(max_batch, w["heads"], d, d, dt=torch.float32, sc=0.05)
        else:
            st.mla_cache = rnd(max_batch, context, cfg.mla.latent_dim)
            st.gather_qkv_a = rnd(max_batch, w["qkv_a"])
            st.mla_block = next(b for b in (64, 32, 16, 8, 4, 2, 1) if context % b == 0)
            pages = context // st.mla_block
            st.mla_block_table = torch.arange(max_batch * pages, dtype=torch.int32,
                                              device=device).view(max_batch, pages)
            st.mla_positions = torch.full((max_batch,), context - 1, dtype=torch.int32,
                                          device=device)
            st.mla_seq_lens = st.mla_positions + 1
        st.gather_logits = rnd(max_batch, w["experts"], dt=torch.float32)
        st.gather_z = rnd(max_batch, w["latent"]).float()   # fp32: the fused GEMV's output
        st.ffn_in = torch.zeros(max_batch, w["ffn_k"], dtype=BF16, device=device)
        st.ffn_prev = rnd(max_batch, H, sc=0.1)
        return st

    def nbytes(self) -> dict[str, int]:
        return {k: v.numel() * v.element_size() for k, v in self.__dict__.items()
                if isinstance(v, torch.Tensor)}
