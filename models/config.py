"""Kimi K3 (`kimi_linear` text model) configuration.

Frozen dataclasses inside; `parse_hf_config` is the edge that turns a published Hugging Face
`config.json` (the `kimi_k3` wrapper with a `kimi_linear` `text_config`, or a bare `kimi_linear`
dict) into them, with a clear `ConfigError` naming the field for anything missing, unknown or
inconsistent. Presets: `tiny` (CPU tests, < 5M parameters, every block kind) and `k3` (the real
dimensions, parsed from the published config that ships in `models/data/`).

Layer indices: the HF lists (`kda_layers`, `full_attn_layers`) are 1-indexed; everything in this
package is 0-indexed (`layer_kinds[i]` is checkpoint layer `i`).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

LayerKind = Literal["kda", "mla"]


class ConfigError(ValueError):
    """A model config that cannot be used; the message names the field and what is accepted."""


@dataclass(frozen=True)
class MLAConfig:
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    use_nope: bool = True          # K3: no rotary on the rope part either
    use_output_gate: bool = True   # sigmoid(g_proj(x)) gates the attention output per head dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached latent row: compressed kv (kv_lora_rank) + k_rope."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class KDAConfig:
    num_heads: int
    head_dim: int
    conv_size: int                  # short causal conv width on q, k, v
    gate_lower_bound: float         # per-channel log-decay is bounded below by this
    use_full_rank_gate: bool = True
    kda_layers: tuple[int, ...] = ()         # 1-indexed, as published
    full_attn_layers: tuple[int, ...] = ()   # 1-indexed, as published

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    num_shared_experts: int
    expert_intermediate: int        # moe_intermediate_size
    latent_size: int                # routed_expert_hidden_size (experts work in this width)
    latent_norm: bool               # latent_moe_use_norm: RMSNorm(latent) before up-proj
    renormalize: bool
    router_activation: str          # "sigmoid"
    routed_scaling_factor: float
    num_expert_group: int
    topk_group: int
    topk_method: str                # "noaux_tc": e_score_correction_bias for selection only
    first_k_dense_replace: int
    layer_freq: int

    @property
    def shared_intermediate(self) -> int:
        return self.num_shared_experts * self.expert_intermediate


MXFP4_FORMAT = "mxfp4-pack-quantized"
# Checkpoint linears a class target "Linear" names: the modules vLLM's K3 builds as quantizable
# linear layers (with the quant config). Not among them: the AttnRes `*_res_proj` (built
# without it), the router `gate` (a GateLinear), `lm_head` (ParallelLMHead), the embedding and
# the KDA short convs. Leaf names of the module path (…self_attn.q_b_proj → q_b_proj).
LINEAR_LEAVES = frozenset({
    "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "g_proj", "o_proj",  # MLA (+KDA)
    "q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj",
    "gate_proj", "up_proj", "down_proj",                                    # dense / shared MLP
    "routed_expert_down_proj", "routed_expert_up_proj", "w1", "w2", "w3"})  # latent MoE


@dataclass(frozen=True)
class QuantConfig:
    """Weight quantization read as compressed-tensors defines `quantization_config`: a module
    is quantized when no `ignore` entry names it and a config group's `targets` do (an exact
    module name, a `re:` regex matched from the start of the name, or the class name
    "Linear" for every linear layer of LINEAR_LEAVES). raydecode reads one scheme:
    `mxfp4-pack-quantized` weights (4-bit e2m1, groups of 32 along K with ue8m0 scales)."""
    format: str = MXFP4_FORMAT
    num_bits: int = 4
    group_size: int = 32
    ignore: tuple[str, ...] = ()
    targets: tuple[str, ...] = ("Linear",)

    @property
    def is_mxfp4(self) -> bool:
        return self.format == MXFP4_FORMAT

    def quantizes(self, module: str, aliases: tuple[str, ...] = ()) -> bool:
        """Whether checkpoint module `module` (full name, no `.weight`) is stored quantized.
        `aliases`: other names of the same module (another published layout's prefix); an
        ignore or target entry matching any of them counts."""
        names = (module, *aliases)
        if any(_matches(n, pat) for n in names for pat in self.ignore):
            return False
        for target in self.targets:
            if target == "Linear":
                if module.rsplit(".", 1)[-1] in LINEAR_LEAVES:
                    return True
            elif any(_matches(n, target) for n in names):
                return True
        return False


def _matches(name: str, pattern: str) -> bool:
    """compressed-tensors name matching: `re:` + a regex matched at the start, else equality."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern


@dataclass(frozen=True)
class K3Config:
    name: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    intermediate_size: int          # dense FFN of the first `first_k_dense_replace` layers
    rms_norm_eps: float
    max_position_embeddings: int
    attn_res_block_size: int        # layers per AttnRes block snapshot
    situ_beta: float
    situ_linear_beta: float
    mla: MLAConfig
    kda: KDAConfig
    moe: MoEConfig
    quant: QuantConfig | None
    tie_word_embeddings: bool = False
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    dtype: str = "bfloat16"
    raw: dict = field(default_factory=dict, compare=False, repr=False)  # the HF dict it came from

    # ---- derived -------------------------------------------------------------------------
    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        full = set(self.kda.full_attn_layers)
        return tuple("mla" if (i + 1) in full else "kda" for i in range(self.num_layers))

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "mla")

    @property
    def kda_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "kda")

    def is_moe_layer(self, layer: int) -> bool:
        """vLLM's rule: MoE from first_k_dense_replace on, at layers divisible by the freq."""
        m = self.moe
        return layer >= m.first_k_dense_replace and layer % m.layer_freq == 0

    @property
    def num_attn_res_blocks(self) -> int:
        """Completed block snapshots the deepest layer can see (93 layers / 12 → 8)."""
        return -(-self.num_layers // self.attn_res_block_size)

    @property
    def kv_bytes_per_token(self) -> int:
        """MLA latent cache bytes per token over all MLA layers (bf16, one replica copy)."""
        return len(self.mla_layers) * self.mla.latent_dim * 2

    @property
    def kda_state_bytes_per_seq(self) -> int:
        """KDA recurrent state (fp32) + conv state (bf16) per sequence over all KDA layers."""
        k = self.kda
        rec = k.num_heads * k.head_dim * k.head_dim * 4
        conv = 3 * k.inner_dim * (k.conv_size - 1) * 2
        return len(self.kda_layer_ids) * (rec + conv)

    def to_hf_dict(self) -> dict:
        """The `kimi_k3` wrapper dict this config round-trips through (`parse_hf_config`)."""
        m, k, e = self.mla, self.kda, self.moe
        text = {
            "model_type": "kimi_linear",
            "dtype": self.dtype,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "vocab_size": self.vocab_size,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "attn_res_block_size": self.attn_res_block_size,
            "hidden_act": "situ",
            "activation_situ_beta": self.situ_beta,
            "activation_situ_linear_beta": self.situ_linear_beta,
            "num_attention_heads": m.num_heads,
            "num_key_value_heads": m.num_heads,
            "q_lora_rank": m.q_lora_rank,
            "kv_lora_rank": m.kv_lora_rank,
            "qk_nope_head_dim": m.qk_nope_head_dim,
            "qk_rope_head_dim": m.qk_rope_head_dim,
            "v_head_dim": m.v_head_dim,
            "mla_use_nope": m.use_nope,
            "mla_use_output_gate": m.use_output_gate,
            "linear_attn_config": {
                "num_heads": k.num_heads,
                "head_dim": k.head_dim,
                "short_conv_kernel_size": k.conv_size,
                "gate_lower_bound": k.gate_lower_bound,
                "use_full_rank_gate": k.use_full_rank_gate,
                "kda_layers": list(k.kda_layers),
                "full_attn_layers": list(k.full_attn_layers),
            },
            "num_experts": e.num_experts,
            "num_experts_per_token": e.top_k,
            "num_shared_experts": e.num_shared_experts,
            "moe_intermediate_size": e.expert_intermediate,
            "routed_expert_hidden_size": e.latent_size,
            "latent_moe_use_norm": e.latent_norm,
            "moe_renormalize": e.renormalize,
            "moe_router_activation_func": e.router_activation,
            "routed_scaling_factor": e.routed_scaling_factor,
            "num_expert_group": e.num_expert_group,
            "topk_group": e.topk_group,
            "topk_method": e.topk_method,
            "use_grouped_topk": True,
            "first_k_dense_replace": e.first_k_dense_replace,
            "moe_layer_freq": e.layer_freq,
            "num_nextn_predict_layers": 0,
            "tie_word_embeddings": self.tie_word_embeddings,
            "eos_token_id": self.eos_token_id,
        }
        if self.quant is not None:
            q = self.quant
            text["quantization_config"] = {
                "quant_method": "compressed-tensors",
                "format": q.format,
                "ignore": list(q.ignore),
                "config_groups": {"group_0": {
                    "format": q.format, "targets": list(q.targets), "input_activations": None,
                    "weights": {"num_bits": q.num_bits, "group_size": q.group_size}}},
            }
        return {
            "architectures": ["KimiK3ForConditionalGeneration"],
            "model_type": "kimi_k3",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": text,
        }


# ---- parsing (the edge) -------------------------------------------------------------------

# Fields an inference engine reads from `text_config`; anything else is rejected so a typo or a
# config of another architecture does not silently load with defaults.
_TEXT_REQUIRED = (
    "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size", "rms_norm_eps",
    "max_position_embeddings", "attn_res_block_size", "activation_situ_beta",
    "activation_situ_linear_beta", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "linear_attn_config", "num_experts",
    "num_experts_per_token", "num_shared_experts", "moe_intermediate_size",
    "routed_expert_hidden_size", "first_k_dense_replace",
)
_TEXT_OPTIONAL = {
    "model_type": "kimi_linear", "dtype": "bfloat16", "torch_dtype": "bfloat16",
    # defaults as vLLM's KimiLinearConfig reads a config without the key
    "hidden_act": "silu", "num_key_value_heads": None, "mla_use_nope": False,
    "mla_use_output_gate": False, "latent_moe_use_norm": False, "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 1.0,
    "num_expert_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "use_grouped_topk": True,
    "moe_layer_freq": 1, "num_nextn_predict_layers": 0, "tie_word_embeddings": False,
    "eos_token_id": None, "bos_token_id": None, "pad_token_id": None,
    "quantization_config": None, "architectures": None, "rope_theta": None,
}
_LINEAR_REQUIRED = ("num_heads", "head_dim", "short_conv_kernel_size", "kda_layers",
                    "full_attn_layers")
_LINEAR_OPTIONAL = {"gate_lower_bound": -5.0, "use_full_rank_gate": False}
_WRAPPER_KEYS = {"architectures", "bos_token_id", "eos_token_id", "media_placeholder_token_id",
                 "model_type", "pad_token_id", "tie_word_embeddings", "text_config",
                 "vision_config", "dtype", "torch_dtype", "quantization_config"}


def check_keys(d: dict, required, optional, where: str, kind: str = "kimi_linear") -> None:
    """Missing or unknown fields of a config dict → ConfigError naming them and what is accepted."""
    missing = [k for k in required if k not in d]
    if missing:
        raise ConfigError(f"{where}: missing field(s) {missing}; a {kind} config needs "
                          f"{sorted(required)}")
    unknown = sorted(set(d) - set(required) - set(optional))
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {unknown}; accepted: "
                          f"{sorted(set(required) | set(optional))}")


def _pos_int(d: dict, key: str, where: str) -> int:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"{where}.{key} = {v!r}; expected a positive integer")
    return v


def _num(d: dict, key: str, where: str) -> float:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{where}.{key} = {v!r}; expected a number")
    return float(v)


_QUANT_KEYS = {"quant_method", "format", "ignore", "config_groups", "kv_cache_scheme",
               "quantization_status", "global_compression_ratio", "sparsity_config",
               "transform_config", "version"}
_GROUP_KEYS = {"targets", "weights", "input_activations", "output_activations", "format"}
_WEIGHT_KEYS = {"num_bits", "type", "strategy", "group_size", "symmetric", "dynamic",
                "actorder", "observer", "observer_kwargs", "block_structure", "scale_dtype",
                "zp_dtype"}


def _parse_quant(q: dict | None) -> QuantConfig | None:
    """`quantization_config` as compressed-tensors defines it; anything raydecode cannot load
    exactly (another method or format, activation quantization, another group strategy, two
    groups with different schemes) is refused, naming it."""
    if q is None:
        return None
    where = "quantization_config"
    if not isinstance(q, dict):
        raise ConfigError(f"{where} must be an object, got {type(q).__name__}")
    method = q.get("quant_method", "compressed-tensors")
    if method != "compressed-tensors":
        raise ConfigError(f"{where}.quant_method = {method!r}; raydecode reads "
                          "'compressed-tensors' checkpoints (format 'mxfp4-pack-quantized') or "
                          "unquantized ones (no quantization_config)")
    unknown = sorted(set(q) - _QUANT_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {unknown}; accepted: {sorted(_QUANT_KEYS)}")
    if q.get("kv_cache_scheme") is not None:
        raise ConfigError(f"{where}.kv_cache_scheme = {q['kv_cache_scheme']!r}: a quantized KV "
                          "cache is not supported (null: the model dtype)")
    top_fmt = q.get("format")
    groups = q.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{where}.config_groups is empty; expected one group with weights")
    targets: list[str] = []
    scheme = None
    for gname, g in groups.items():
        gw = f"{where}.config_groups.{gname}"
        if not isinstance(g, dict):
            raise ConfigError(f"{gw} must be an object")
        bad = sorted(set(g) - _GROUP_KEYS)
        if bad:
            raise ConfigError(f"{gw}: unknown field(s) {bad}; accepted: {sorted(_GROUP_KEYS)}")
        fmt = g.get("format") or top_fmt
        if fmt != MXFP4_FORMAT:
            raise ConfigError(f"{gw}.format = {fmt!r}; raydecode reads {MXFP4_FORMAT!r} only "
                              "(or no quantization_config for bf16)")
        for act in ("input_activations", "output_activations"):
            if g.get(act) is not None:
                raise ConfigError(f"{gw}.{act} = {g[act]!r}: activation quantization is not "
                                  "supported (weight-only MXFP4: null)")
        w = g.get("weights") or {}
        if not isinstance(w, dict) or set(w) - _WEIGHT_KEYS:
            raise ConfigError(f"{gw}.weights = {w!r}; expected an object with keys among "
                              f"{sorted(_WEIGHT_KEYS)}")
        bits, gs = w.get("num_bits"), w.get("group_size")
        strategy, kind = w.get("strategy", "group"), w.get("type", "float")
        if bits != 4:
            raise ConfigError(f"{gw}.weights.num_bits = {bits!r}; MXFP4 needs 4")
        if strategy != "group":
            raise ConfigError(f"{gw}.weights.strategy = {strategy!r}; MXFP4 scales groups of 32 "
                              "along K: 'group'")
        if gs != 32:
            raise ConfigError(f"{gw}.weights.group_size = {gs!r}; MXFP4 (e2m1 + ue8m0) needs 32")
        if kind != "float":
            raise ConfigError(f"{gw}.weights.type = {kind!r}; MXFP4 values are 'float' (e2m1)")
        if w.get("symmetric", True) is not True or w.get("dynamic", False) is not False:
            raise ConfigError(f"{gw}.weights: MXFP4 is symmetric and static (symmetric: true, "
                              "dynamic: false)")
        tg = g.get("targets")
        if not isinstance(tg, list) or not tg or not all(isinstance(x, str) for x in tg):
            raise ConfigError(f"{gw}.targets = {tg!r}; expected a non-empty list of module "
                              "names, 're:' regexes or 'Linear'")
        for x in tg:
            if not x.startswith("re:") and x != "Linear" and "." not in x:
                raise ConfigError(f"{gw}.targets has {x!r}: a module class raydecode does not "
                                  "know; accepted: 'Linear', module names, 're:' regexes")
            if x.startswith("re:"):
                try:
                    re.compile(x[3:])
                except re.error as e:
                    raise ConfigError(f"{gw}.targets: {x!r} is not a valid regex ({e})") from None
        targets += tg
        scheme = (fmt, bits, gs)
    ignore = q.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        raise ConfigError(f"{where}.ignore = {ignore!r}; expected a list of module names / "
                          "'re:' regexes")
    fmt, bits, gs = scheme
    return QuantConfig(format=fmt, num_bits=bits, group_size=gs, ignore=tuple(ignore),
                       targets=tuple(targets))


def parse_hf_config(d: dict[str, Any], name: str = "custom") -> K3Config:
    """Parse a published K3 `config.json` dict (wrapper or bare `text_config`)."""
    if not isinstance(d, dict):
        raise ConfigError(f"config must be a JSON object, got {type(d).__name__}")
    if "text_config" in d:
        if d.get("model_type") not in (None, "kimi_k3"):
            raise ConfigError(f"model_type = {d.get('model_type')!r}; expected 'kimi_k3' "
                              "for a wrapper with text_config")
        unknown = sorted(set(d) - _WRAPPER_KEYS)
        if unknown:
            raise ConfigError(f"config.json: unknown top-level field(s) {unknown}; accepted: "
                              f"{sorted(_WRAPPER_KEYS)}")
        text = d["text_config"]
        if not isinstance(text, dict):
            raise ConfigError("text_config must be an object")
        wrapper = d
    else:
        text, wrapper = d, {}
    where = "text_config"
    check_keys(text, _TEXT_REQUIRED, _TEXT_OPTIONAL, where)
    if text.get("model_type", "kimi_linear") != "kimi_linear":
        raise ConfigError(f"{where}.model_type = {text['model_type']!r}; expected 'kimi_linear'")
    if text.get("hidden_act", _TEXT_OPTIONAL["hidden_act"]) != "situ":
        raise ConfigError(f"{where}.hidden_act = {text.get('hidden_act', 'silu (the default)')!r}"
                          "; K3's FFNs are 'situ'")
    if not text.get("mla_use_nope", _TEXT_OPTIONAL["mla_use_nope"]):
        raise ConfigError(f"{where}.mla_use_nope = {text.get('mla_use_nope', False)!r}"
                          f"{'' if 'mla_use_nope' in text else ' (the default)'}; K3's MLA is "
                          "NoPE-only (no rotary on any part of q/k), as vLLM's K3 requires")
    lin = text["linear_attn_config"]
    if not isinstance(lin, dict):
        raise ConfigError(f"{where}.linear_attn_config must be an object")
    check_keys(lin, _LINEAR_REQUIRED, _LINEAR_OPTIONAL, f"{where}.linear_attn_config")
    opt = {**_TEXT_OPTIONAL, **text}
    lopt = {**_LINEAR_OPTIONAL, **lin}

    ints = {k: _pos_int(text, k, where) for k in (
        "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size",
        "max_position_embeddings", "attn_res_block_size", "num_attention_heads", "q_lora_rank",
        "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_experts",
        "num_experts_per_token", "moe_intermediate_size", "routed_expert_hidden_size")}
    n_layers = ints["num_hidden_layers"]
    kda_l = tuple(lin["kda_layers"])
    full_l = tuple(lin["full_attn_layers"])
    for nm, lst in (("kda_layers", kda_l), ("full_attn_layers", full_l)):
        bad = [i for i in lst if isinstance(i, bool) or not isinstance(i, int)
               or not 1 <= i <= n_layers]
        if bad:
            raise ConfigError(f"{where}.linear_attn_config.{nm} has {bad}; entries are "
                              f"1-indexed layer numbers in [1, {n_layers}]")
    overlap = sorted(set(kda_l) & set(full_l))
    if overlap:
        raise ConfigError(f"layers {overlap} are listed in both kda_layers and full_attn_layers")
    uncovered = sorted(set(range(1, n_layers + 1)) - set(kda_l) - set(full_l))
    if uncovered:
        raise ConfigError(f"layers {uncovered} (1-indexed) are in neither kda_layers nor "
                          f"full_attn_layers; every one of the {n_layers} layers needs a kind")

    kv_heads = opt["num_key_value_heads"]
    if kv_heads not in (None, ints["num_attention_heads"]):
        raise ConfigError(f"{where}.num_key_value_heads = {kv_heads}; MLA needs it equal to "
                          f"num_attention_heads ({ints['num_attention_heads']})")
    top_k = ints["num_experts_per_token"]
    if top_k > ints["num_experts"]:
        raise ConfigError(f"num_experts_per_token = {top_k} exceeds num_experts = "
                          f"{ints['num_experts']}")
    if ints["routed_expert_hidden_size"] > ints["hidden_size"]:
        raise ConfigError(f"routed_expert_hidden_size = {ints['routed_expert_hidden_size']} "
                          f"exceeds hidden_size = {ints['hidden_size']}; the latent is a "
                          "down-projection")
    if opt["moe_router_activation_func"] != "sigmoid":
        raise ConfigError(f"moe_router_activation_func = {opt['moe_router_activation_func']!r};"
                          " K3 routing is 'sigmoid'")
    if opt["topk_method"] != "noaux_tc":
        raise ConfigError(f"topk_method = {opt['topk_method']!r}; supported: 'noaux_tc'")
    n_group, topk_group = int(opt["num_expert_group"]), int(opt["topk_group"])
    if n_group < 1 or ints["num_experts"] % n_group or not 1 <= topk_group <= n_group:
        raise ConfigError(f"num_expert_group = {n_group}, topk_group = {topk_group}: groups must"
                          f" divide num_experts ({ints['num_experts']}) and 1 <= topk_group <= "
                          "num_expert_group")
    freq = opt["moe_layer_freq"]
    if isinstance(freq, bool) or not isinstance(freq, int) or freq < 1:
        raise ConfigError(f"moe_layer_freq = {freq!r}; expected a positive integer (layer i is "
                          "MoE when i >= first_k_dense_replace and i % moe_layer_freq == 0)")
    first_dense = int(text["first_k_dense_replace"])
    if not 0 <= first_dense <= n_layers:
        raise ConfigError(f"first_k_dense_replace = {first_dense}; expected 0..{n_layers}")
    shared = text["num_shared_experts"]
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise ConfigError(f"num_shared_experts = {shared!r}; expected an integer >= 0")

    quant = _parse_quant(opt["quantization_config"] or wrapper.get("quantization_config"))
    if quant is not None:
        gs = quant.group_size
        for nm in ("moe_intermediate_size", "routed_expert_hidden_size"):
            if ints[nm] % gs:
                raise ConfigError(f"{nm} = {ints[nm]} is not a multiple of the MXFP4 group size"
                                  f" {gs}")

    def tok(key: str, default: int) -> int:
        v = wrapper.get(key, opt.get(key))
        return default if v is None else int(v)

    return K3Config(
        name=name,
        hidden_size=ints["hidden_size"],
        num_layers=n_layers,
        vocab_size=ints["vocab_size"],
        intermediate_size=ints["intermediate_size"],
        rms_norm_eps=_num(text, "rms_norm_eps", where),
        max_position_embeddings=ints["max_position_embeddings"],
        attn_res_block_size=ints["attn_res_block_size"],
        situ_beta=_num(text, "activation_situ_beta", where),
        situ_linear_beta=_num(text, "activation_situ_linear_beta", where),
        mla=MLAConfig(
            num_heads=ints["num_attention_heads"], q_lora_rank=ints["q_lora_rank"],
            kv_lora_rank=ints["kv_lora_rank"], qk_nope_head_dim=ints["qk_nope_head_dim"],
            qk_rope_head_dim=ints["qk_rope_head_dim"], v_head_dim=ints["v_head_dim"],
            use_nope=bool(opt["mla_use_nope"]), use_output_gate=bool(opt["mla_use_output_gate"]),
        ),
        kda=KDAConfig(
            num_heads=_pos_int(lin, "num_heads", "linear_attn_config"),
            head_dim=_pos_int(lin, "head_dim", "linear_attn_config"),
            conv_size=_pos_int(lin, "short_conv_kernel_size", "linear_attn_config"),
            gate_lower_bound=float(lopt["gate_lower_bound"]),
            use_full_rank_gate=bool(lopt["use_full_rank_gate"]),
            kda_layers=kda_l, full_attn_layers=full_l,
        ),
        moe=MoEConfig(
            num_experts=ints["num_experts"], top_k=top_k, num_shared_experts=shared,
            expert_intermediate=ints["moe_intermediate_size"],
            latent_size=ints["routed_expert_hidden_size"],
            latent_norm=bool(opt["latent_moe_use_norm"]), renormalize=bool(opt["moe_renormalize"]),
            router_activation=opt["moe_router_activation_func"],
            routed_scaling_factor=float(opt["routed_scaling_factor"]),
            num_expert_group=n_group, topk_group=topk_group, topk_method=opt["topk_method"],
            first_k_dense_replace=first_dense, layer_freq=int(opt["moe_layer_freq"]),
        ),
        quant=quant,
        tie_word_embeddings=bool(wrapper.get("tie_word_embeddings",
                                             opt["tie_word_embeddings"])),
        bos_token_id=tok("bos_token_id", 0),
        eos_token_id=tok("eos_token_id", 1),
        pad_token_id=tok("pad_token_id", 2),
        dtype=str(opt.get("dtype") or "bfloat16"),
        raw=d,
    )


# ---- presets -----------------------------------------------------------------------------

def _k3() -> K3Config:
    text = resources.files("raydecode.models").joinpath("data/kimi-k3-config.json").read_text()
    return parse_hf_config(json.loads(text), name="k3")


def _tiny() -> K3Config:
    """Every K3 block kind at CPU size: layer 0 dense, KDA and MLA layers, 3 AttnRes blocks,
    latent MoE with shared experts and MXFP4 experts. Head counts and widths divide by 4 so
    TP ∈ {1, 2, 4} shard it (expert intermediate 128 / 4 = 32 = one MXFP4 group)."""
    hf = {
        "model_type": "kimi_k3",
        "bos_token_id": 495, "eos_token_id": 497, "pad_token_id": 511,   # [BOS], <|im_end|>, [PAD] of the tiny BPE
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "kimi_linear", "dtype": "bfloat16",
            "hidden_size": 64, "num_hidden_layers": 6, "vocab_size": 512,
            "intermediate_size": 128, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
            "attn_res_block_size": 2, "hidden_act": "situ",
            "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
            "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32,
            "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
            "v_head_dim": 16, "mla_use_nope": True, "mla_use_output_gate": True,
            "linear_attn_config": {
                "num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4,
                "gate_lower_bound": -5.0, "use_full_rank_gate": True,
                "kda_layers": [1, 2, 4, 5], "full_attn_layers": [3, 6],
            },
            "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 2,
            "moe_intermediate_size": 128, "routed_expert_hidden_size": 32,
            "latent_moe_use_norm": True, "moe_renormalize": True,
            "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 1.0,
            "num_expert_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
            "first_k_dense_replace": 1, "moe_layer_freq": 1,
            # the routed experts only (named by regex): K3's config names every Linear but
            # the shared experts, which at these widths would need K = 16 groups (f_b_proj)
            "quantization_config": {
                "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                "ignore": [],
                "config_groups": {"group_0": {
                    "format": "mxfp4-pack-quantized",
                    "targets": [r"re:.*block_sparse_moe\.experts\..*"],
                    "input_activations": None, "weights": {"num_bits": 4, "group_size": 32}}},
            },
        },
    }
    return parse_hf_config(hf, name="tiny")


PRESETS = {"tiny": _tiny, "k3": _k3}


def load_from_spec(spec: str | Path, presets: dict, parse, what: str):
    """A preset name, a `config.json` path, or a folder holding one → `parse(dict, name=...)`.
    Shared by the target (`load_config`) and the drafter (`models.dspark`) configs."""
    s = str(spec)
    if s in presets:
        return presets[s]()
    p = Path(s)
    # a folder names the model (a checkpoint folder); a file is named by its path as given
    name = p.resolve().name if p.is_dir() else s
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"{what} {s!r}: not a preset ({', '.join(presets)}) and no config.json "
                          f"at {p}")
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: malformed JSON ({e})") from None
    return parse(d, name=name or "custom")


def load_config(spec: str | Path) -> K3Config:
    """`tiny`, `k3`, a `config.json` path, or a checkpoint folder holding one."""
    return load_from_spec(spec, PRESETS, parse_hf_config, "model")
