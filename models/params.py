"""Analytic parameter, byte and decode-traffic counts from a `K3Config` (no torch modules built).

`inventory(cfg)` lists every weight tensor of the text model as a `Tensor`: its full shape, how
many copies the model holds (layers × experts), its storage format and how TP splits it. The rest
is arithmetic over that list:

- `param_counts(cfg)`: total and per-token active parameters, by kind.
- `weight_bytes_per_rank(cfg, tp, path)`: bytes one rank holds (`stock` layout) or reads per step
  (`specialized`), by kind.
- `decode_gemv_shapes(cfg, tp, path)`: per-rank (N, K) of the decode GEMVs (DESIGN §1), their
  output dtypes `gemv_out_dtype(name, path)` (FP32_OUT_GEMVS).
- `decode_reads(...)`, `drafter_reads(...)`: bytes and FLOPs one rank moves per decode step,
  per sublayer kind; `kv_bytes_per_token`, `kda_state_bytes_per_seq`: cache sizes.

Storage: bf16 2 B/param, fp32 4 B/param, MXFP4 0.5 B/param (e2m1) + 1 B (ue8m0 scale) per
`group_size` params along K. Only routed experts are MXFP4 (DESIGN §1); the rest is bf16 except
the fp32 vectors A_log, dt_bias and e_score_correction_bias.

Sharding (`Tensor.shard`), with N = TP:
- `tp`: split 1/N along `dim` in both paths;
- `rep_stock`: whole on every rank in the stock path (fused qkv_a, router, latent down/up); split
  1/N along `dim` in the specialized path (DESIGN §4 lever 1). The rank still *holds* the whole
  tensor, because the stock step runs on the same ranks as the fallback (DESIGN §3); the
  specialized kernels read a contiguous 1/N slice of it;
- `rep`: whole on every rank (norms, AttnRes vectors, KDA f_a_proj).
Routed experts are TP-split along the expert intermediate (no expert parallelism).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from raydecode.models.config import K3Config

DecodePath = Literal["stock", "specialized"]
PATHS: tuple[DecodePath, ...] = ("stock", "specialized")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}

# Row alignment of the fused KDA in_proj GEMV (q,k,v,g,b sharded + f_a whole). DESIGN §1's TP8
# shape 6288 is the 6284 fused rows (4·1536 + 12 + 128) rounded up to a multiple of 16; the
# alignment is inferred from that shape.
FUSED_ROW_ALIGN = 16
# K alignment of the fused [latent up ‖ shared down] GEMV of the specialized MoE block: 16 lanes
# × 16-byte chunks tile each row
FFN_K_ALIGN = 128


class ShardError(ValueError):
    """A tensor dimension the requested TP degree does not divide."""


@dataclass(frozen=True)
class Tensor:
    name: str                  # HF-style suffix, e.g. "mla.q_b_proj"
    kind: str                  # accounting group (see KINDS)
    shape: tuple[int, ...]     # full, unsharded; linear weights are (out N, in K)
    copies: int                # occurrences in the model (layers, or layers × experts)
    fmt: str = "bf16"          # "bf16" | "fp32" | "mxfp4"
    shard: str = "tp"          # "tp" | "rep_stock" | "rep"
    dim: int = 0               # dimension TP splits (when split)
    sublayer: str = "global"   # "mla" | "kda" | "dense" | "moe" | "layer" | "global"
    group: int = 32            # MXFP4 scale group along K (the last dim)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def split(self, tp: int, path: DecodePath) -> int:
        """1 if this rank sees the whole tensor in `path`, else tp (after checking divisibility)."""
        if self.shard == "rep" or tp == 1 or (self.shard == "rep_stock" and path == "stock"):
            return 1
        n = self.shape[self.dim]
        if n % tp:
            raise ShardError(f"{self.name}: dimension {self.dim} = {n} is not divisible by "
                             f"TP = {tp}; choose a TP that divides {n}")
        if self.fmt == "mxfp4" and self.dim == len(self.shape) - 1 and (n // tp) % self.group:
            raise ShardError(f"{self.name}: K = {n}/{tp} = {n // tp} per rank is not a multiple "
                             f"of the MXFP4 group {self.group}; choose a smaller TP")
        return tp

    def bytes_per_param(self) -> float:
        if self.fmt == "mxfp4":
            return 0.5 + 1.0 / self.group
        return float(DTYPE_BYTES[self.fmt])

    def rank_numel(self, tp: int, path: DecodePath) -> int:
        """Parameters of one copy on one rank."""
        return self.numel // self.split(tp, path)

    def rank_bytes(self, tp: int, path: DecodePath) -> float:
        """Bytes of one copy on one rank."""
        return self.rank_numel(tp, path) * self.bytes_per_param()


KINDS = ("embedding", "lm_head", "mla", "mla_qkv_a", "kda", "dense_ffn", "router", "latent",
         "shared_experts", "routed_experts", "norms")
REPLICATED_IN_STOCK = ("mla_qkv_a", "router", "latent")


def layer_counts(cfg: K3Config) -> dict[str, int]:
    """How many layers have each sublayer kind: {'mla', 'kda', 'dense', 'moe'}."""
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    return {"mla": len(cfg.mla_layers), "kda": len(cfg.kda_layer_ids),
            "dense": cfg.num_layers - n_moe, "moe": n_moe}


def mla_tensors(prefix: str, hidden: int, heads: int, q_lora: int, kv_lora: int, nope: int,
                rope: int, v: int, gate: bool, copies: int, sublayer: str) -> list[Tensor]:
    """One MLA block (heads split by TP); q_a ‖ kv_a is the fused qkv_a GEMV."""
    T, p, s = Tensor, prefix, sublayer
    out = [
        T(f"{p}.q_a_proj", "mla_qkv_a", (q_lora, hidden), copies, shard="rep_stock", sublayer=s),
        T(f"{p}.kv_a_proj_with_mqa", "mla_qkv_a", (kv_lora + rope, hidden), copies,
          shard="rep_stock", sublayer=s),
        T(f"{p}.q_a_layernorm", "norms", (q_lora,), copies, shard="rep", sublayer=s),
        T(f"{p}.kv_a_layernorm", "norms", (kv_lora,), copies, shard="rep", sublayer=s),
        T(f"{p}.q_b_proj", "mla", (heads * (nope + rope), q_lora), copies, sublayer=s),
        T(f"{p}.kv_b_proj", "mla", (heads * (nope + v), kv_lora), copies, sublayer=s),
        T(f"{p}.o_proj", "mla", (hidden, heads * v), copies, dim=1, sublayer=s),
    ]
    if gate:
        out.append(T(f"{p}.g_proj", "mla", (heads * v, hidden), copies, sublayer=s))
    return out


@lru_cache(maxsize=16)
def inventory(cfg: K3Config) -> tuple[Tensor, ...]:
    """Every weight tensor of the text model. Names: `mla.*`, `kda.*`, `mlp.*` (dense or MoE),
    per-layer AttnRes vectors, and the global embedding / lm_head / final norms."""
    H, V, L = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
    m, k, e = cfg.mla, cfg.kda, cfg.moe
    n = layer_counts(cfg)
    T = Tensor
    ts = [T("embed_tokens", "embedding", (V, H), 1)]
    if not cfg.tie_word_embeddings:
        ts.append(T("lm_head", "lm_head", (V, H), 1))
    # final AttnRes mix + norm; per layer AttnRes: 4 RMSNorm weights + 2 single-query projections
    ts += [T("norm", "norms", (H,), 1, shard="rep"),
           T("output_attn_res_norm", "norms", (H,), 1, shard="rep"),
           T("output_attn_res_proj", "norms", (1, H), 1, shard="rep")]
    for nm in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm",
               "mlp_res_norm"):
        ts.append(T(nm, "norms", (H,), L, shard="rep", sublayer="layer"))
    for nm in ("self_attention_res_proj", "mlp_res_proj"):
        ts.append(T(nm, "norms", (1, H), L, shard="rep", sublayer="layer"))

    if n["mla"]:
        ts += mla_tensors("mla", H, m.num_heads, m.q_lora_rank, m.kv_lora_rank,
                          m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim,
                          m.use_output_gate, n["mla"], "mla")

    # KDA (heads split by TP; f_a is the shared low-rank input of the per-channel decay)
    nk, s, inner = n["kda"], "kda", k.inner_dim
    if nk:
        ts += [T(f"kda.{p}_proj", "kda", (inner, H), nk, sublayer=s) for p in "qkvg"]
        ts += [
            T("kda.b_proj", "kda", (k.num_heads, H), nk, sublayer=s),
            T("kda.f_a_proj", "kda", (k.head_dim, H), nk, shard="rep", sublayer=s),
            T("kda.f_b_proj", "kda", (inner, k.head_dim), nk, sublayer=s),
            T("kda.o_proj", "kda", (H, inner), nk, dim=1, sublayer=s),
            T("kda.o_norm", "norms", (k.head_dim,), nk, shard="rep", sublayer=s),
            T("kda.A_log", "kda", (k.num_heads,), nk, fmt="fp32", sublayer=s),
            T("kda.dt_bias", "kda", (inner,), nk, fmt="fp32", sublayer=s),
        ]
        ts += [T(f"kda.{p}_conv1d", "kda", (inner, 1, k.conv_size), nk, sublayer=s)
               for p in "qkv"]

    # dense FFN (first_k_dense_replace layers)
    if n["dense"]:
        ts += [T("mlp.gate_up_proj", "dense_ffn", (2 * cfg.intermediate_size, H), n["dense"],
                 sublayer="dense"),
               T("mlp.down_proj", "dense_ffn", (H, cfg.intermediate_size), n["dense"], dim=1,
                 sublayer="dense")]

    # latent MoE
    nmoe, s = n["moe"], "moe"
    if nmoe:
        lat, ie = e.latent_size, e.expert_intermediate
        xfmt = "mxfp4" if cfg.quant is not None and cfg.quant.is_mxfp4 else "bf16"
        grp = cfg.quant.group_size if cfg.quant is not None else 32
        ts += [
            T("mlp.gate", "router", (e.num_experts, H), nmoe, shard="rep_stock", sublayer=s),
            T("mlp.gate.e_score_correction_bias", "router", (e.num_experts,), nmoe, fmt="fp32",
              shard="rep", sublayer=s),
            T("mlp.latent_down_proj", "latent", (lat, H), nmoe, shard="rep_stock", sublayer=s),
            # specialized: K-split, so its partial sums join the shared expert's all-reduce
            T("mlp.latent_up_proj", "latent", (H, lat), nmoe, shard="rep_stock", dim=1,
              sublayer=s),
        ]
        if e.latent_norm:
            ts.append(T("mlp.latent_norm", "norms", (lat,), nmoe, shard="rep", sublayer=s))
        if e.num_shared_experts:
            si = e.shared_intermediate
            ts += [T("mlp.shared_experts.gate_up_proj", "shared_experts", (2 * si, H), nmoe,
                     sublayer=s),
                   T("mlp.shared_experts.down_proj", "shared_experts", (H, si), nmoe, dim=1,
                     sublayer=s)]
        ne = nmoe * e.num_experts
        ts += [T("mlp.experts.gate_up_proj", "routed_experts", (2 * ie, lat), ne, fmt=xfmt,
                 sublayer=s, group=grp),
               T("mlp.experts.down_proj", "routed_experts", (lat, ie), ne, fmt=xfmt, dim=1,
                 sublayer=s, group=grp)]
    return tuple(ts)


def expert_params(cfg: K3Config) -> int:
    """Parameters of one routed expert (gate, up, down)."""
    return 3 * cfg.moe.expert_intermediate * cfg.moe.latent_size


def param_counts(cfg: K3Config) -> dict:
    """Total and per-token active parameters.

    Active = every non-routed parameter + top_k routed experts per MoE layer. The embedding
    table counts whole in both (the common convention, e.g. Mixtral's 12.9B of 46.7B);
    `active_excl_embedding` drops it (a token reads one row)."""
    by_kind = {kk: 0 for kk in KINDS}
    for t in inventory(cfg):
        by_kind[t.kind] += t.numel * t.copies
    total = sum(by_kind.values())
    n_moe = layer_counts(cfg)["moe"]
    routed_active = n_moe * cfg.moe.top_k * expert_params(cfg)
    active = total - by_kind["routed_experts"] + routed_active
    return {"total": total, "active": active,
            "active_excl_embedding": active - by_kind["embedding"],
            "routed_active": routed_active, "by_kind": by_kind}


def weight_bytes_per_rank(cfg: K3Config, tp: int, path: DecodePath = "stock") -> dict[str, float]:
    """Bytes per rank by kind. `stock` = what a rank holds; `specialized` = what its kernels read
    of the non-routed weights (routed experts: all of the rank's slices, as held)."""
    out = {kk: 0.0 for kk in KINDS}
    for t in inventory(cfg):
        out[t.kind] += t.rank_bytes(tp, path) * t.copies
    return out


def _pad(n: int, a: int = FUSED_ROW_ALIGN) -> int:
    return -(-n // a) * a


# Decode GEMVs whose kernel writes the fp32 accumulator unrounded (`kernels.gemv.linear(...,
# out_dtype=torch.float32)`), by path; every other entry of `decode_gemv_shapes` writes bf16. An
# fp32-out GEMV is a different compiled kernel (kernels/aot.py plans it with that out dtype).
# - router: fp32 logits (the routing top-k reads them unrounded);
# - q_b_absorbed: MLA W_q'' at DCP 1 (kernels/mla_decode.py `absorbed_q_weight` with the q norm
#   weight: the q norm scale is applied to the fp32 output, which is rounded once after it);
# - q_b_folded: the same for the folded q_b' (`folded_q_b_weight`, mla_absorbed_q off);
# - h2_proj: the fused MoE block's [router ‖ latent down ‖ shared gate ‖ up] (each consumer
#   rounds its columns itself).
FP32_OUT_GEMVS: dict[DecodePath, frozenset[str]] = {
    "stock": frozenset({"router"}),
    "specialized": frozenset({"router", "q_b_absorbed", "q_b_folded", "h2_proj"}),
}


def gemv_out_dtype(name: str, path: DecodePath = "stock") -> str:
    """'fp32' or 'bf16': the output dtype of `decode_gemv_shapes` entry `name` on `path`."""
    return "fp32" if name in FP32_OUT_GEMVS[path] else "bf16"


def ffn_out_k(latent_cols: int, shared_cols: int) -> int:
    """K of the fused MoE block's [latent up columns ‖ shared down ‖ 0] weight: the columns
    padded to FFN_K_ALIGN (models/moe.py `_ffn_out`, the layer benchmark's `ffn_out_local`)."""
    return _pad(latent_cols + shared_cols, FFN_K_ALIGN)


def moe_block_fused(cfg: K3Config) -> bool:
    """Whether the specialized MoE block has the fused form's parts (models/moe.py
    `LatentMoE._fused_ok`, besides its bf16 / DecodeOptions.moe_fused conditions): shared
    experts and the latent norm."""
    return cfg.moe.num_shared_experts > 0 and cfg.moe.latent_norm


def decode_gemv_shapes(cfg: K3Config, tp: int,
                       path: DecodePath = "stock") -> dict[str, tuple[int, int]]:
    """Per-rank (N, K) of each decode GEMV, as a layer kernel sees it; output dtype
    `gemv_out_dtype(name, path)` (bf16 unless listed in FP32_OUT_GEMVS).

    Fused: `fused_qkv_a` = q_a ‖ kv_a; `kda_in_proj` = q ‖ k ‖ v ‖ g ‖ b (split) ‖ f_a
    (whole), rows padded to FUSED_ROW_ALIGN; `shared_gate_up`, `dense_gate_up` and
    `expert_gate_up` = gate ‖ up (layer-benchmark layouts; the model launches gate and up as
    the two GEMVs `*_gate`, `*_up`).

    Also listed, so that kernels/aot.py plans every CuTe GEMV a step launches:
    - both paths: `kda_qkvg` (each of the q, k, v, g projections), `kda_b`, `kda_f_a` (the KDA
      step outside the fused decode: a sequence's first token, speculative verify),
      `dense_gate`, `dense_up`, `shared_gate`, `shared_up` (GatedMLP);
    - specialized, the packed weights of the fused decode (models/mla.py `_qkv_a_g`,
      `_q_b_absorbed`, `_q_b_folded`; models/moe.py `_h2_proj`, `_ffn_out`):
        `qkv_a_g`    (ΣN/TP of [q_a; kv_a] + h·v/TP of g_proj, H)   with the output gate
        `q_b_absorbed` (h/TP·(kv_lora + rope), q_lora), fp32 out    with the output gate
        `q_b_folded` q_b's shape, fp32 out (mla_absorbed_q off)   "
        `h2_proj`    (E/TP + L/TP + 2·I_sh/TP, H), fp32 out         `moe_block_fused(cfg)`
        `ffn_out`    (H, L/TP + I_sh/TP padded to FFN_K_ALIGN)       `moe_block_fused(cfg)`
      and the unfused MoE block's (moe_fused off) latent up, computed as H/TP rows:
        `latent_up_rows` (H/TP, L).
    At TP 1 the packers move the replicated weights into the buffer instead of copying rows
    of them; the row counts are the same formulas at tp = 1."""
    by = {t.name: t for t in inventory(cfg)}
    specialized = path == "specialized"

    def rows(name: str) -> int:
        t = by[name]
        return t.shape[0] // (t.split(tp, path) if t.dim == 0 else 1)

    def cols(name: str) -> int:
        t = by[name]
        return t.shape[1] // (t.split(tp, path) if t.dim == 1 else 1)

    H, out = cfg.hidden_size, {}
    if cfg.mla_layers:
        out["fused_qkv_a"] = (rows("mla.q_a_proj") + rows("mla.kv_a_proj_with_mqa"), H)
        out["q_b"] = (rows("mla.q_b_proj"), cols("mla.q_b_proj"))
        out["kv_b"] = (rows("mla.kv_b_proj"), cols("mla.kv_b_proj"))
        out["o_proj"] = (H, cols("mla.o_proj"))
        if "mla.g_proj" in by:
            out["g_proj"] = (rows("mla.g_proj"), H)
            if specialized:     # row_pieces of [q_a; kv_a] sum to ΣN/TP on every rank
                out["qkv_a_g"] = (out["fused_qkv_a"][0] + out["g_proj"][0], H)
                out["q_b_absorbed"] = (out["q_b"][0] // cfg.mla.qk_head_dim
                                       * cfg.mla.latent_dim, out["q_b"][1])
                out["q_b_folded"] = out["q_b"]
    if cfg.kda_layer_ids:
        kda_rows = sum(rows(f"kda.{p}_proj") for p in "qkvgb") + rows("kda.f_a_proj")
        out["kda_in_proj"] = (_pad(kda_rows), H)
        out["kda_f_b"] = (rows("kda.f_b_proj"), cfg.kda.head_dim)
        out["kda_o_proj"] = (H, cols("kda.o_proj"))
        out["kda_qkvg"] = (rows("kda.q_proj"), H)
        out["kda_b"] = (rows("kda.b_proj"), H)
        out["kda_f_a"] = (rows("kda.f_a_proj"), H)
    if "mlp.gate" in by:
        out["router"] = (rows("mlp.gate"), H)
        out["latent_down"] = (rows("mlp.latent_down_proj"), H)
        out["latent_up"] = (H, cols("mlp.latent_up_proj"))
        if specialized:     # the unfused block's latent up: 1/TP of its H rows, K = L
            if H % tp:
                raise ShardError(f"mlp.latent_up_proj: hidden_size = {H} rows are not "
                                 f"divisible by TP = {tp}; choose a TP that divides {H}")
            out["latent_up_rows"] = (H // tp, cfg.moe.latent_size)
    if "mlp.shared_experts.gate_up_proj" in by:
        out["shared_gate_up"] = (rows("mlp.shared_experts.gate_up_proj"), H)
        out["shared_down"] = (H, cols("mlp.shared_experts.down_proj"))
        out["shared_gate"] = out["shared_up"] = (out["shared_gate_up"][0] // 2, H)
        if specialized and "mlp.gate" in by and moe_block_fused(cfg):
            out["h2_proj"] = (out["router"][0] + out["latent_down"][0]
                              + out["shared_gate_up"][0], H)
            out["ffn_out"] = (H, ffn_out_k(out["latent_up"][1], out["shared_down"][1]))
    if "mlp.experts.gate_up_proj" in by:   # one expert's slice (MXFP4 when quantized)
        out["expert_gate_up"] = (rows("mlp.experts.gate_up_proj"), cfg.moe.latent_size)
        out["expert_down"] = (cfg.moe.latent_size, cols("mlp.experts.down_proj"))
    if "mlp.gate_up_proj" in by:
        out["dense_gate_up"] = (rows("mlp.gate_up_proj"), H)
        out["dense_down"] = (H, cols("mlp.down_proj"))
        out["dense_gate"] = out["dense_up"] = (out["dense_gate_up"][0] // 2, H)
    lm = "lm_head" if "lm_head" in by else "embed_tokens"
    out["lm_head"] = (rows(lm), H)
    return out


def check_tp(cfg: K3Config, tp: int) -> None:
    """Raise ShardError naming the first tensor TP cannot split (both paths)."""
    if tp < 1:
        raise ShardError(f"TP = {tp}; expected a positive integer")
    for what, heads, present in (("MLA", cfg.mla.num_heads, cfg.mla_layers),
                                 ("KDA", cfg.kda.num_heads, cfg.kda_layer_ids)):
        if present and heads % tp:
            raise ShardError(f"TP = {tp} does not divide the {heads} {what} heads")
    for t in inventory(cfg):
        for p in PATHS:
            t.split(tp, p)


def valid_tps(cfg: K3Config, upto: int) -> list[int]:
    """TP degrees in 1..upto that split every tensor of this model."""
    out = []
    for t in range(1, upto + 1):
        try:
            check_tp(cfg, t)
        except ShardError:
            continue
        out.append(t)
    return out


# ---- caches --------------------------------------------------------------------------------

def kv_bytes_per_token(cfg: K3Config, dcp: int = 1, kv_dtype: str = "bf16",
                       extra_mla_layers: int = 0) -> float:
    """MLA latent bytes per token on one rank: layers × latent_dim × dtype / DCP (the latent is
    shared by all heads, so TP alone does not split it; DCP splits it by token position)."""
    layers = len(cfg.mla_layers) + extra_mla_layers
    return layers * cfg.mla.latent_dim * DTYPE_BYTES[kv_dtype] / dcp


def kda_state_bytes_per_seq(cfg: K3Config, tp: int, state_dtype: str = "fp32",
                            conv_dtype: str = "bf16") -> int:
    """KDA cache per sequence on one rank: per KDA layer the recurrent state
    (heads/TP, dk, dv) in `state_dtype` + the conv tails of q, k, v (3, inner/TP, conv-1)."""
    k = cfg.kda
    heads = k.num_heads // tp
    rec = heads * k.head_dim * k.head_dim * DTYPE_BYTES[state_dtype]
    conv = 3 * heads * k.head_dim * (k.conv_size - 1) * DTYPE_BYTES[conv_dtype]
    return len(cfg.kda_layer_ids) * (rec + conv)


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """E[# distinct experts touched by `tokens` tokens], each choosing top_k distinct experts
    uniformly and independently (the balanced routing noaux_tc aims for):
    E · (1 − (1 − k/E)^T). Skewed real routing touches fewer: this is the upper side."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


# ---- decode traffic ------------------------------------------------------------------------

@dataclass(frozen=True)
class Read:
    """What one kernel-sized piece of a decode step costs one rank."""
    bytes: float          # HBM bytes read + written
    flops: float = 0.0    # arithmetic (tensor-core work for GEMMs)
    fmt: str = "bf16"     # operand format of that work ("mxfp4" may use an FP4 tensor rate)


def attn_res_bank_rows(cfg: K3Config) -> float:
    """Mean rows a layer's AttnRes mix reads per token: completed block snapshots + prefix,
    averaged over layers (layer i sees i // block_size snapshots)."""
    b, L = cfg.attn_res_block_size, cfg.num_layers
    return sum(i // b + 1 for i in range(L)) / L


def _weights(by: dict[str, Tensor], names, tp: int, path: DecodePath, tokens: int) -> Read:
    """A GEMV/GEMM over `tokens` rows that streams each weight once (the tensors share one
    input): bytes = weights + bf16 activations in and out; FLOPs = 2 · params · tokens."""
    ts = [by[n] for n in names]
    b = sum(t.rank_bytes(tp, path) for t in ts)
    numel = sum(t.rank_numel(tp, path) for t in ts)
    t0 = ts[0]
    k_in = t0.shape[-1] // (t0.split(tp, path) if t0.dim == len(t0.shape) - 1 else 1)
    n_out = sum(t.shape[0] // (t.split(tp, path) if t.dim == 0 else 1) for t in ts)
    return Read(b + 2 * tokens * (k_in + n_out), 2.0 * numel * tokens, t0.fmt)


def _mla_reads(by, prefix: str, heads: int, kv_lora: int, latent: int, nope: int, v: int,
               tp: int, path: DecodePath, seqs: int, tokens: int, context: int, dcp: int,
               kv_b: int, gate: bool) -> dict[str, Read]:
    """Absorbed MLA decode: q_nope·W_UK and out·W_UV use the two halves of kv_b; scores and
    outputs run over the latent rows of this rank's DCP slice (one row serves every head)."""
    p, hl = prefix, heads // tp
    kvb = by[f"{p}.kv_b_proj"].rank_bytes(tp, path)
    ctx_local = -(-context // dcp)
    r = {
        "qkv_a": _weights(by, (f"{p}.q_a_proj", f"{p}.kv_a_proj_with_mqa"), tp, path, tokens),
        "q_b": _weights(by, (f"{p}.q_b_proj",), tp, path, tokens),
        "w_uk": Read(kvb * nope / (nope + v), 2.0 * tokens * hl * nope * kv_lora),
        "kv_cache": Read(seqs * ctx_local * latent * kv_b + tokens * latent * kv_b / dcp,
                         2.0 * tokens * hl * context * (latent + kv_lora)),
        "w_uv": Read(kvb * v / (nope + v), 2.0 * tokens * hl * v * kv_lora),
        "o_proj": _weights(by, (f"{p}.o_proj",), tp, path, tokens),
    }
    if gate:
        r["g_proj"] = _weights(by, (f"{p}.g_proj",), tp, path, tokens)
    if path == "specialized" and dcp == 1 and gate:
        # W_uk folded into q_b (models/mla.py `_q_b_absorbed`, the served fast path): one GEMV
        # of h·(kv_lora + rope) rows instead of h·(nope + rope), and no W_uk read
        rope = latent - kv_lora
        grow = latent / (nope + rope)
        w = by[f"{p}.q_b_proj"].rank_bytes(tp, path)
        q = r["q_b"]
        r["q_b"] = Read(w * grow + (q.bytes - w) + 2.0 * tokens * hl * (kv_lora - nope),
                        q.flops * grow, q.fmt)
        r["w_uk"] = Read(0.0, 0.0)
    return r


def decode_reads(cfg: K3Config, tp: int, path: DecodePath, seqs: int, tokens_per_seq: int = 1,
                 context: int = 0, dcp: int = 1, kv_dtype: str = "bf16",
                 state_dtype: str = "fp32") -> dict[str, dict[str, Read]]:
    """Bytes and FLOPs one rank moves in one decode step, per sublayer kind
    ('kda', 'mla', 'dense', 'moe', 'head'; per occurrence) and per piece.

    A step carries T = seqs · tokens_per_seq tokens (tokens_per_seq = k+1 for a speculative
    verify). Weights stream once per step whatever T is; routed experts are read for the
    expected number of distinct experts T tokens touch. Caches: each sequence reads its MLA
    latent rows once (context/DCP of them on this rank) and its KDA state once; a verify step
    writes a KDA state per position (kept for rollback), a plain step one."""
    by = {t.name: t for t in inventory(cfg)}
    H, T = cfg.hidden_size, seqs * tokens_per_seq
    n = layer_counts(cfg)
    bank = Read(T * (attn_res_bank_rows(cfg) + 1) * H * 2)   # mix rows in, mixed row out (bf16)
    out: dict[str, dict[str, Read]] = {}
    if n["kda"]:
        k = cfg.kda
        hl = k.num_heads // tp
        inner_l = hl * k.head_dim
        conv = 3 * inner_l * (k.conv_size - 1) * 2
        state = hl * k.head_dim * k.head_dim * DTYPE_BYTES[state_dtype]
        out["kda"] = {
            "attn_res": bank,
            "in_proj": _weights(by, tuple(f"kda.{p}_proj" for p in "qkvgb") + ("kda.f_a_proj",),
                                tp, path, T),
            "f_b": _weights(by, ("kda.f_b_proj",), tp, path, T),
            "conv": Read(2 * seqs * conv + T * 3 * inner_l * 2 * 2),
            "gates": Read(T * inner_l * 2 * 4),          # decay, beta, o_norm, output gate
            "state": Read(seqs * state + T * state, 6.0 * T * hl * k.head_dim * k.head_dim),
            "o_proj": _weights(by, ("kda.o_proj",), tp, path, T),
        }
    if n["mla"]:
        m = cfg.mla
        out["mla"] = {"attn_res": bank, **_mla_reads(
            by, "mla", m.num_heads, m.kv_lora_rank, m.latent_dim, m.qk_nope_head_dim,
            m.v_head_dim, tp, path, seqs, T, context, dcp, DTYPE_BYTES[kv_dtype],
            m.use_output_gate)}
    if n["dense"]:
        out["dense"] = {"attn_res": bank,
                        "gate_up": _weights(by, ("mlp.gate_up_proj",), tp, path, T),
                        "down": _weights(by, ("mlp.down_proj",), tp, path, T)}
    if n["moe"]:
        e = cfg.moe
        touched = expected_distinct_experts(e.num_experts, e.top_k, T)
        gu, dn = by["mlp.experts.gate_up_proj"], by["mlp.experts.down_proj"]
        routed = T * e.top_k      # (token, expert) pairs
        moe = {
            "attn_res": bank,
            "router": _weights(by, ("mlp.gate",), tp, path, T),
            "topk": Read(T * e.num_experts * 4 * 2 + e.num_experts * 4),
            "latent_down": _weights(by, ("mlp.latent_down_proj",), tp, path, T),
            "experts_gate_up": Read(touched * gu.rank_bytes(tp, path),
                                    2.0 * routed * gu.rank_numel(tp, path), gu.fmt),
            "experts_down": Read(touched * dn.rank_bytes(tp, path),
                                 2.0 * routed * dn.rank_numel(tp, path), dn.fmt),
            "latent_up": _weights(by, ("mlp.latent_up_proj",), tp, path, T),
        }
        if "mlp.shared_experts.gate_up_proj" in by:
            moe["shared_gate_up"] = _weights(by, ("mlp.shared_experts.gate_up_proj",), tp,
                                             path, T)
            moe["shared_down"] = _weights(by, ("mlp.shared_experts.down_proj",), tp, path, T)
        out["moe"] = moe
    lm = "lm_head" if "lm_head" in by else "embed_tokens"
    out["head"] = {
        "embedding": Read(T * H * 2 * 2),
        "final_attn_res": bank,
        "lm_head": _weights(by, (lm,), tp, path, T),
        "sampling": Read(T * (cfg.vocab_size // tp) * 4 * 2),   # fp32 logits written + read
    }
    return out


# ---- DSpark drafter ------------------------------------------------------------------------

@dataclass(frozen=True)
class DrafterSpec:
    """DSpark drafter dimensions (DESIGN §1). Published: 5 layers, MLA with 64 heads and
    rotary, dense MLP of intermediate 14336, context_proj 7168×35840 over 5 tapped layers,
    rank-256 Markov tables 163840×256, ≈3.56B parameters; embedding and lm_head shared with the
    target. Assumed where unpublished: the MLA ranks/head dims equal the target's, no output
    gate, two Markov tables. Check: these give 2.388B own + 1.174B shared embedding = 3.562B."""
    num_layers: int = 5
    num_heads: int = 64
    intermediate: int = 14336
    num_taps: int = 5
    markov_rank: int = 256
    markov_tables: int = 2
    block_size: int = 7        # drafts per pass; more requested drafts collapse acceptance


def drafter_inventory(cfg: K3Config, d: DrafterSpec = DrafterSpec()) -> tuple[Tensor, ...]:
    """The drafter's own tensors (the shared embedding / lm_head are not repeated)."""
    H, m, L, T = cfg.hidden_size, cfg.mla, d.num_layers, Tensor
    ts = [T("draft.context_proj", "drafter", (H, d.num_taps * H), 1),
          T("draft.markov", "drafter", (cfg.vocab_size, d.markov_rank), d.markov_tables),
          T("draft.norm", "drafter", (H,), 1, shard="rep")]
    ts += [T(f"draft.{nm}", "drafter", (H,), L, shard="rep", sublayer="draft_layer")
           for nm in ("input_layernorm", "post_attention_layernorm")]
    mla = mla_tensors("draft.mla", H, d.num_heads, m.q_lora_rank, m.kv_lora_rank,
                      m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, False, L,
                      "draft_mla")
    ts += [T(t.name, "drafter", t.shape, t.copies, t.fmt, t.shard, t.dim, t.sublayer)
           for t in mla]
    ts += [T("draft.mlp.gate_up_proj", "drafter", (2 * d.intermediate, H), L,
             sublayer="draft_mlp"),
           T("draft.mlp.down_proj", "drafter", (H, d.intermediate), L, dim=1,
             sublayer="draft_mlp")]
    return tuple(ts)


def drafter_params(cfg: K3Config, d: DrafterSpec = DrafterSpec()) -> dict[str, int]:
    own = sum(t.numel * t.copies for t in drafter_inventory(cfg, d))
    shared = cfg.vocab_size * cfg.hidden_size
    return {"own": own, "with_shared_embedding": own + shared}


def drafter_bytes_per_rank(cfg: K3Config, tp: int, path: DecodePath = "stock",
                           d: DrafterSpec = DrafterSpec()) -> float:
    return sum(t.rank_bytes(tp, path) * t.copies for t in drafter_inventory(cfg, d))


def drafter_reads(cfg: K3Config, tp: int, path: DecodePath, seqs: int, k: int, context: int,
                  dcp: int = 1, kv_dtype: str = "bf16",
                  d: DrafterSpec = DrafterSpec()) -> dict[str, dict[str, Read]]:
    """One draft pass: the drafter layers run once over seqs·k block positions (non-causal),
    the shared lm_head scores all positions at once; then k sequential Markov-biased samples,
    each streaming one Markov table slice ('markov_step', per position)."""
    by = {t.name: t for t in drafter_inventory(cfg, d)}
    by.update({t.name: t for t in inventory(cfg) if t.name in ("lm_head", "embed_tokens")})
    m, H, T = cfg.mla, cfg.hidden_size, seqs * k
    if d.num_heads % tp:
        raise ShardError(f"TP = {tp} does not divide the drafter's {d.num_heads} heads")
    lm = "lm_head" if "lm_head" in by else "embed_tokens"
    mk = by["draft.markov"]
    return {
        "draft_in": {"context_proj": _weights(by, ("draft.context_proj",), tp, path, seqs),
                     "embedding": Read(T * H * 2 * 2)},
        "draft_mla": _mla_reads(by, "draft.mla", d.num_heads, m.kv_lora_rank, m.latent_dim,
                                m.qk_nope_head_dim, m.v_head_dim, tp, path, seqs, T, context,
                                dcp, DTYPE_BYTES[kv_dtype], False),
        "draft_mlp": {"gate_up": _weights(by, ("draft.mlp.gate_up_proj",), tp, path, T),
                      "down": _weights(by, ("draft.mlp.down_proj",), tp, path, T)},
        "draft_head": {"lm_head": _weights(by, (lm,), tp, path, T),
                       "logits": Read(T * (cfg.vocab_size // tp) * 4 * 2)},
        "markov_step": {"markov": Read(mk.rank_bytes(tp, path) + seqs * cfg.vocab_size // tp * 8,
                                       2.0 * seqs * mk.rank_numel(tp, path))},
    }
