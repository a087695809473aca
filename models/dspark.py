"""DSpark: the block drafter for K3 speculative decoding (config, RoPE, module).

Layout and procedure follow the published `Inferact/Kimi-K3-DSpark` draft (`model_type`
`k3_dspark`, 68 tensors) and vLLM's `K3DSparkModel` / `DSparkSpeculator`:

  context  c_t = context_norm(context_proj([h_t^(l) for l in target_layer_ids]))   per target token
           h_t^(l) is the output of target layer l (0-indexed; K3 has AttnRes, so it is the running
           prefix after layer l, vLLM's `prefix_sum + hidden_states`), concatenated in ascending l.
           Every draft layer i caches row_t^i = [kv_a_layernorm_i(c_kv), RoPE(k_pe, t)], where
           [c_kv, k_pe] = kv_a_proj_with_mqa_i(c_t): context is injected as latent KV only, it never
           runs through the layers. The rows live in the target's MLA pool: extra pool rows under
           the virtual layer keys target_num_layers + i (`draft_layer_key`,
           `make_caches(extra_mla_layers=...)`), addressed by the target's block tables.
  block    for a sequence whose newest token (the anchor) sits at position p, the k query tokens
           [anchor, mask × (k-1)] at positions p … p+k-1 run through the layers (pre-norm MLA with
           RoPE + dense SiLU MLP, final_norm) in ONE non-causal pass: each query attends to the
           cached context rows at positions < p and to all k block rows (computed on the fly,
           never cached). Query j's output predicts the token at p+j+1 ("sample from anchor").
  logits   base_j = lm_head(final hidden_j) with the target's lm_head; then left to right
           l_j = base_j + markov_w2 · markov_w1[prev_j],  prev_0 = anchor, prev_j = draft_{j}
           (vanilla rank-r Markov head, both tables (vocab, r), replicated).

MLA here differs from the target's: RoPE on the 64-wide rope part (interleaved pairs, DeepSeek
YaRN frequencies), no output gate, and a softmax scale of qk_head_dim^-½ · mscale² with
mscale = 0.1 · mscale_all_dim · ln(factor) + 1 (YaRN's temperature; 1.8133 at factor 32).

Parallelism as the target: heads split (q_b, kv_b column-, o_proj row-parallel), MLP
intermediate split; context_proj, the kv_a / q_a projections, norms and the Markov head are
replicated. Context rows are DCP-sharded like the target's (token t on DCP rank t mod D); the
block's own rows are replicated, so the block partial is merged in once per rank.

Choices where the public sources are silent or where this port differs (documented, tested):
- the block's rows are not written into the pool (vLLM writes them at p … p+k-1 and lets later
  context overwrite them); they enter as a second attention partial merged by log-sum-exp —
  the same math, and the pool only ever holds committed context;
- `block_size` (drafts per block, 7 = the published training spec_length) is not in the
  published config.json; it defaults to 7 and bounds num_speculative_tokens (DESIGN §6);
- the published confidence head is read past: every block is verified in full (static);
- the MLP activation is SiLU (the draft config has no `hidden_act`; K3's own FFNs use SiTU).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from raydecode.kernels.mla_decode import mla_attention, mla_attention_reference

from .cache import ModelCaches, StepBatch
from .config import ConfigError, K3Config, check_keys, load_from_spec
from .layers import (DerivedWeights, Linear, RMSNorm, column_linear, replicated_linear,
                     row_linear)
from .mla import merge_attn_partials, mla_absorbed_attention
from .parallel import Comm, LocalComm, Parallel


# ---- config --------------------------------------------------------------------------------

@dataclass(frozen=True)
class RopeConfig:
    theta: float
    kind: str = "default"               # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0         # absent: no softmax rescale (vLLM's default, False)

    @property
    def is_yarn(self) -> bool:
        return self.kind == "yarn" and self.factor > 1.0


@dataclass(frozen=True)
class DSparkConfig:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    target_num_layers: int
    target_layer_ids: tuple[int, ...]   # 0-indexed, ascending: taps after these target layers
    mask_token_id: int
    markov_rank: int
    block_size: int = 7                 # drafts per block the drafter was trained for
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    dtype: str = "bfloat16"
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def context_width(self) -> int:
        return self.hidden_size * len(self.target_layer_ids)

    @property
    def softmax_scale(self) -> float:
        s = self.qk_head_dim ** -0.5
        if self.rope.is_yarn:
            s *= yarn_mscale(self.rope.factor, self.rope.mscale_all_dim) ** 2
        return s

    def to_hf_dict(self) -> dict:
        r = self.rope
        rope: dict[str, Any] = {"rope_type": r.kind, "rope_theta": r.theta}
        if r.kind == "yarn":
            rope.update(factor=r.factor,
                        original_max_position_embeddings=r.original_max_position_embeddings,
                        beta_fast=r.beta_fast, beta_slow=r.beta_slow, mscale=r.mscale,
                        mscale_all_dim=r.mscale_all_dim)
        return {
            "architectures": ["K3DSparkModel"], "model_type": "k3_dspark",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_heads, "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank, "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim,
            "mla_use_nope": False, "mla_use_output_gate": False,
            "vocab_size": self.vocab_size, "draft_vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": r.theta, "rope_parameters": rope,
            "num_target_layers": len(self.target_layer_ids),
            "target_hidden_size": self.hidden_size,
            "target_num_hidden_layers": self.target_num_layers,
            "target_layer_ids": list(self.target_layer_ids),
            "mask_token_id": self.mask_token_id, "markov_rank": self.markov_rank,
            "markov_head_type": "vanilla", "block_size": self.block_size,
            "enable_confidence_head": self.enable_confidence_head,
            "confidence_head_with_markov": self.confidence_head_with_markov,
            "tie_word_embeddings": False, "torch_dtype": self.dtype,
        }


_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
             "vocab_size", "target_layer_ids", "mask_token_id", "markov_rank")
_OPTIONAL = {
    "architectures": None, "model_type": "k3_dspark", "num_key_value_heads": None,
    "mla_use_nope": False, "mla_use_output_gate": False, "draft_vocab_size": None,
    # defaults as vLLM's K3DSparkConfig reads a config without the key
    "rms_norm_eps": 1e-5, "max_position_embeddings": 1048576, "rope_theta": 50000.0,
    "rope_parameters": None, "rope_scaling": None, "num_target_layers": None,
    "target_hidden_size": None, "target_num_hidden_layers": None, "bos_token_id": None,
    "eos_token_id": None, "pad_token_id": None, "markov_head_type": "vanilla",
    "enable_confidence_head": False, "confidence_head_with_markov": False,
    "tie_word_embeddings": False, "_torchspec_version": None, "torch_dtype": None,
    "dtype": None, "block_size": 7, "hidden_act": "silu",
    "mla_use_qk_norm": False, "dspark_bonus_anchor": False, "sample_from_anchor": True,
}
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings",
              "beta_fast", "beta_slow", "mscale", "mscale_all_dim"}


def _parse_rope(d: dict, theta: float) -> RopeConfig:
    rp = d.get("rope_parameters") or d.get("rope_scaling")
    if rp is None:
        return RopeConfig(theta=theta)
    if not isinstance(rp, dict) or set(rp) - _ROPE_KEYS:
        raise ConfigError(f"rope_parameters = {rp!r}; expected an object with keys among "
                          f"{sorted(_ROPE_KEYS)}")
    kind = rp.get("rope_type", rp.get("type", "default"))
    theta = float(rp.get("rope_theta", theta))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind != "yarn":
        raise ConfigError(f"rope_parameters.rope_type = {kind!r}; accepted: 'yarn', 'default'")
    for k in ("factor", "original_max_position_embeddings"):
        if k not in rp:
            raise ConfigError(f"rope_parameters: yarn needs {k!r}")
    return RopeConfig(theta=theta, kind="yarn", factor=float(rp["factor"]),
                      original_max_position_embeddings=int(rp["original_max_position_embeddings"]),
                      beta_fast=float(rp.get("beta_fast", 32)),
                      beta_slow=float(rp.get("beta_slow", 1)),
                      mscale=float(rp.get("mscale", 1.0)),
                      mscale_all_dim=float(rp.get("mscale_all_dim", 0.0)))


def parse_dspark_config(d: dict, name: str = "custom") -> DSparkConfig:
    """A DSpark `config.json` dict (the published `k3_dspark` layout) -> DSparkConfig."""
    if not isinstance(d, dict):
        raise ConfigError(f"DSpark config must be a JSON object, got {type(d).__name__}")
    check_keys(d, _REQUIRED, _OPTIONAL, "DSpark config", "k3_dspark")
    o = {**_OPTIONAL, **d}
    if o["model_type"] != "k3_dspark":
        raise ConfigError(f"model_type = {o['model_type']!r}; expected 'k3_dspark'")
    ints = {}
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim", "vocab_size", "markov_rank", "block_size", "max_position_embeddings"):
        v = o[k]
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"DSpark config {k} = {v!r}; expected a positive integer"
                              + (" (the Markov head is the core of DSpark: markov_rank > 0)"
                                 if k == "markov_rank" else ""))
        ints[k] = v
    if o["qk_rope_head_dim"] % 2:
        raise ConfigError(f"qk_rope_head_dim = {o['qk_rope_head_dim']}; RoPE needs an even width")
    if o["mla_use_nope"]:
        raise ConfigError("mla_use_nope = true; the DSpark draft is RoPE MLA (only the K3 target "
                          "is NoPE)")
    if o["mla_use_output_gate"]:
        raise ConfigError("mla_use_output_gate = true; the DSpark draft has no output gate")
    # keys of the published draft configs, honoured at the values this drafter implements and
    # refused otherwise (vLLM's MLA DSpark refuses the same two)
    if o["mla_use_qk_norm"] is not False:
        raise ConfigError(f"mla_use_qk_norm = {o['mla_use_qk_norm']!r}: a per-head q/k norm in "
                          "the draft's MLA is not implemented (false: none)")
    if o["dspark_bonus_anchor"] is not False:
        raise ConfigError(f"dspark_bonus_anchor = {o['dspark_bonus_anchor']!r}: the bonus-token "
                          "anchor layout is not implemented (false: the newest token anchors)")
    if o["sample_from_anchor"] is not True:
        raise ConfigError(f"sample_from_anchor = {o['sample_from_anchor']!r}: only the "
                          "anchor-as-first block is implemented (true: k queries from the "
                          "anchor, query j predicts position p+j+1), not the 1+k fill-in block")
    if o["num_key_value_heads"] not in (None, ints["num_attention_heads"]):
        raise ConfigError(f"num_key_value_heads = {o['num_key_value_heads']}; MLA needs it equal "
                          f"to num_attention_heads ({ints['num_attention_heads']})")
    if o["markov_head_type"] != "vanilla":
        raise ConfigError(f"markov_head_type = {o['markov_head_type']!r}; supported: 'vanilla'")
    if o["hidden_act"] != "silu":
        raise ConfigError(f"hidden_act = {o['hidden_act']!r}; the DSpark MLP is 'silu'")
    if o["draft_vocab_size"] not in (None, ints["vocab_size"]):
        raise ConfigError(f"draft_vocab_size = {o['draft_vocab_size']} != vocab_size = "
                          f"{ints['vocab_size']}; reduced-vocabulary drafts are not supported")
    if o["target_hidden_size"] not in (None, ints["hidden_size"]):
        raise ConfigError(f"target_hidden_size = {o['target_hidden_size']} != hidden_size = "
                          f"{ints['hidden_size']}; the draft shares the target's embedding and "
                          "lm_head, so both widths must match")
    taps = o["target_layer_ids"]
    if not isinstance(taps, list) or not taps or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in taps):
        raise ConfigError(f"target_layer_ids = {taps!r}; expected a non-empty list of 0-indexed "
                          "target layer numbers")
    if len(set(taps)) != len(taps):
        raise ConfigError(f"target_layer_ids = {taps}; taps must be distinct")
    if list(taps) != sorted(taps):
        raise ConfigError(f"target_layer_ids = {taps}; taps must be ascending (context_proj "
                          "reads them concatenated in that order)")
    if o["num_target_layers"] not in (None, len(taps)):
        raise ConfigError(f"num_target_layers = {o['num_target_layers']} but target_layer_ids has "
                          f"{len(taps)} entries; context_proj expects one hidden state per tap")
    n_target = o["target_num_hidden_layers"]
    if n_target is not None and max(taps) >= n_target:
        raise ConfigError(f"target_layer_ids = {taps} out of range for a {n_target}-layer target "
                          f"(0-indexed, < {n_target})")
    mask = o["mask_token_id"]
    if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < ints["vocab_size"]:
        raise ConfigError(f"mask_token_id = {mask!r} is outside the vocabulary [0, "
                          f"{ints['vocab_size']})")
    eps = o["rms_norm_eps"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise ConfigError(f"rms_norm_eps = {eps!r}; expected a positive number")
    return DSparkConfig(
        name=name, hidden_size=ints["hidden_size"], intermediate_size=ints["intermediate_size"],
        num_layers=ints["num_hidden_layers"], num_heads=ints["num_attention_heads"],
        q_lora_rank=ints["q_lora_rank"], kv_lora_rank=ints["kv_lora_rank"],
        qk_nope_head_dim=ints["qk_nope_head_dim"], qk_rope_head_dim=ints["qk_rope_head_dim"],
        v_head_dim=ints["v_head_dim"], vocab_size=ints["vocab_size"], rms_norm_eps=float(eps),
        max_position_embeddings=ints["max_position_embeddings"],
        rope=_parse_rope(o, float(o["rope_theta"])),
        target_num_layers=int(n_target) if n_target is not None else max(taps) + 1,
        target_layer_ids=tuple(taps), mask_token_id=mask, markov_rank=ints["markov_rank"],
        block_size=ints["block_size"], enable_confidence_head=bool(o["enable_confidence_head"]),
        confidence_head_with_markov=bool(o["confidence_head_with_markov"]),
        dtype=str(o["torch_dtype"] or o["dtype"] or "bfloat16"), raw=d)


def _k3_dspark() -> DSparkConfig:
    """The published Inferact/Kimi-K3-DSpark config (3.56B parameters, 68 tensors)."""
    return parse_dspark_config({
        "architectures": ["K3DSparkModel"], "model_type": "k3_dspark", "hidden_size": 7168,
        "intermediate_size": 14336, "num_hidden_layers": 5, "num_attention_heads": 64,
        "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "mla_use_nope": False, "mla_use_output_gate": False, "vocab_size": 163840,
        "draft_vocab_size": 163840, "rms_norm_eps": 1e-5, "max_position_embeddings": 1048576,
        "rope_theta": 50000.0, "num_target_layers": 5, "target_hidden_size": 7168,
        "target_num_hidden_layers": 93, "target_layer_ids": [2, 23, 47, 71, 89],
        "mask_token_id": 163837, "bos_token_id": 163584, "eos_token_id": 163586,
        "pad_token_id": 163839, "markov_rank": 256, "markov_head_type": "vanilla",
        "enable_confidence_head": True, "confidence_head_with_markov": True,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "rope_parameters": {"rope_type": "yarn", "factor": 32.0,
                            "original_max_position_embeddings": 32768, "rope_theta": 50000.0,
                            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                            "mscale_all_dim": 1.0},
    }, name="k3")


def _tiny_dspark() -> DSparkConfig:
    """For the `tiny` target (6 layers, hidden 64, vocab 512): taps after layers 0, 2, 4, two
    layers, block 7, YaRN factor 4 (so the YaRN path runs on CPU). The mask token is the tiny
    tokenizer's [UNK] (id 510; K3 uses a reserved special, 163837)."""
    return parse_dspark_config({
        "model_type": "k3_dspark", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "q_lora_rank": 32,
        "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "vocab_size": 512, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
        "rope_theta": 10000.0, "target_num_hidden_layers": 6, "target_layer_ids": [0, 2, 4],
        "mask_token_id": 510, "markov_rank": 16, "block_size": 7,
        "enable_confidence_head": True, "confidence_head_with_markov": True,
        "torch_dtype": "bfloat16",
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                            "original_max_position_embeddings": 1024, "rope_theta": 10000.0,
                            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                            "mscale_all_dim": 1.0},
    }, name="tiny")


DSPARK_PRESETS = {"tiny": _tiny_dspark, "k3": _k3_dspark}


def load_dspark_config(spec: str | Path) -> DSparkConfig:
    """`tiny`, `k3`, a DSpark `config.json`, or a folder holding one."""
    return load_from_spec(spec, DSPARK_PRESETS, parse_dspark_config, "drafter")


def check_against_target(dcfg: DSparkConfig, tcfg: K3Config) -> None:
    """The drafter must read this target's hidden states and share its vocabulary."""
    if dcfg.hidden_size != tcfg.hidden_size:
        raise ConfigError(f"drafter hidden_size {dcfg.hidden_size} != target hidden_size "
                          f"{tcfg.hidden_size}")
    if dcfg.vocab_size != tcfg.vocab_size:
        raise ConfigError(f"drafter vocab_size {dcfg.vocab_size} != target vocab_size "
                          f"{tcfg.vocab_size}; the draft samples through the target's lm_head")
    if dcfg.latent_dim != tcfg.mla.latent_dim:
        raise ConfigError(f"drafter latent row width {dcfg.latent_dim} (kv_lora_rank + "
                          f"qk_rope_head_dim) != target's {tcfg.mla.latent_dim}; the draft's "
                          "rows live in the target's MLA pool")
    if dcfg.target_num_layers != tcfg.num_layers or max(dcfg.target_layer_ids) >= tcfg.num_layers:
        raise ConfigError(f"drafter taps {list(dcfg.target_layer_ids)} of a "
                          f"{dcfg.target_num_layers}-layer target; this target has "
                          f"{tcfg.num_layers} layers")


def check_num_drafts(k: int, dcfg: DSparkConfig) -> int:
    """DESIGN §6: more drafts than the drafter's block collapses acceptance; refuse them."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= dcfg.block_size:
        raise ConfigError(f"num_speculative_tokens = {k!r}; the {dcfg.name} drafter drafts "
                          f"blocks of {dcfg.block_size}: accepted 1..{dcfg.block_size}")
    return k


# ---- RoPE (DeepSeek YaRN, interleaved pairs) -------------------------------------------------

def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def rope_inv_freq(dim: int, r: RopeConfig) -> torch.Tensor:
    """(dim/2,) fp32 inverse frequencies, computed in fp32 as vLLM's rotary tables are (so the
    angles round as theirs). YaRN blends interpolated (÷factor) and original frequencies with a
    linear ramp between the correction dims of beta_fast and beta_slow."""
    pos = r.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)   # (dim/2,) fp32
    extra = 1.0 / pos
    if not r.is_yarn:
        return extra

    def corr(rot: float) -> float:   # dim index where the wavelength makes `rot` turns
        return dim * math.log(r.original_max_position_embeddings / (rot * 2 * math.pi)) \
            / (2 * math.log(r.theta))

    lo = max(math.floor(corr(r.beta_fast)), 0)
    hi = min(math.ceil(corr(r.beta_slow)), dim - 1)
    span = (hi - lo) or 0.001
    keep = 1.0 - ((torch.arange(dim // 2, dtype=torch.float32) - lo) / span).clamp(0, 1)
    return (1.0 / (r.factor * pos)) * (1 - keep) + extra * keep


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, r: RopeConfig
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(T,) positions -> cos, sin (T, dim/2) fp32, amplitude mscale/mscale_all_dim (YaRN).
    All in fp32 (angle = fp32(t) · fp32 inv_freq, one rounding; cos/sin of it; × amplitude),
    the table vLLM's rotary embedding builds, so a position's rotation matches theirs."""
    amp = yarn_mscale(r.factor, r.mscale) / yarn_mscale(r.factor, r.mscale_all_dim) \
        if r.is_yarn else 1.0
    ang = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device,
                                                              torch.float32)[None, :]
    return ang.cos() * amp, ang.sin() * amp


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) by the angle of frequency i (GPT-J / DeepSeek
    layout, not NeoX halves). x (T, ..., dim), cos/sin (T, dim/2) -> fp32, same shape."""
    xf = x.float().unflatten(-1, (-1, 2))
    c = cos.view(cos.shape[0], *([1] * (x.dim() - 2)), cos.shape[1])
    s = sin.view_as(c)
    a, b = xf[..., 0], xf[..., 1]
    return torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2)


# ---- the module ----------------------------------------------------------------------------

def draft_layer_key(dcfg: DSparkConfig, i: int) -> int:
    """Draft layer i's key in `caches.mla_index`: a virtual layer number after the target's."""
    return dcfg.target_num_layers + i


class DSparkAttention(nn.Module):
    def __init__(self, dcfg: DSparkConfig, layer_idx: int, par: Parallel, comm: Comm,
                 dtype: torch.dtype):
        super().__init__()
        H, eps = dcfg.hidden_size, dcfg.rms_norm_eps
        self.par, self.comm, self.rope_cfg = par, comm, dcfg.rope
        self.key = draft_layer_key(dcfg, layer_idx)
        self.heads = par.shard(dcfg.num_heads, "DSpark num_attention_heads")
        self.nope, self.rope = dcfg.qk_nope_head_dim, dcfg.qk_rope_head_dim
        self.vdim = dcfg.v_head_dim
        self.kv_lora, self.scale = dcfg.kv_lora_rank, dcfg.softmax_scale
        self.q_a_proj = replicated_linear(H, dcfg.q_lora_rank, dtype)
        self.q_a_layernorm = RMSNorm(dcfg.q_lora_rank, eps, dtype)
        self.q_b_proj = column_linear(dcfg.q_lora_rank, dcfg.num_heads * dcfg.qk_head_dim, par,
                                      dtype, "DSpark heads · qk_head_dim")
        self.kv_a_proj_with_mqa = replicated_linear(H, dcfg.latent_dim, dtype)
        self.kv_a_layernorm = RMSNorm(dcfg.kv_lora_rank, eps, dtype)
        self.kv_b_proj = column_linear(dcfg.kv_lora_rank, dcfg.num_heads * (self.nope + self.vdim),
                                       par, dtype, "DSpark heads · (nope + v)")
        self.o_proj = row_linear(dcfg.num_heads * self.vdim, H, par, dtype, "DSpark heads · v")
        self.register_buffer("inv_freq", rope_inv_freq(self.rope, dcfg.rope), persistent=False)

    def _rot(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_cfg)
        return apply_rope(x, cos, sin)

    def latent_rows(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (T, H) -> rows (T, kv_lora + rope) = [RMSNorm(c_kv), RoPE(k_pe, position)]."""
        kv = self.kv_a_proj_with_mqa(x)
        return torch.cat([self.kv_a_layernorm(kv[:, :self.kv_lora]),
                          self._rot(kv[:, self.kv_lora:], positions).to(kv.dtype)], -1)

    def forward(self, x: torch.Tensor, batch: StepBatch, caches: ModelCaches) -> torch.Tensor:
        """x (T, H): the query blocks of `batch` (each seq: k tokens from its anchor position).
        -> (T, H). Context rows are read from the pool, block rows are used in place."""
        T = x.shape[0]
        positions = batch.positions(x.device)
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(T, self.heads, -1)
        w = self.kv_b_proj.weight.view(self.heads, self.nope + self.vdim, self.kv_lora)
        w_uk, w_uv = w[:, :self.nope], w[:, self.nope:]
        q_lat = torch.einsum("thn,hnc->thc", q[..., :self.nope].float(), w_uk.float())
        q_abs = torch.cat([q_lat, self._rot(q[..., self.nope:], positions)], -1)  # (T, h, c+r)
        block_rows = self.latent_rows(x, positions)
        ctx = self._context_partial(q_abs, batch, caches)
        blk_o = q_abs.new_zeros(T, self.heads, self.kv_lora)
        blk_lse = q_abs.new_full((T, self.heads), float("-inf"))
        for s in batch.seqs:   # non-causal: every query of the block sees the whole block
            sl = slice(s.start, s.end)
            vis = positions.new_full((s.length,), s.pos + s.length)
            blk_o[sl], blk_lse[sl] = mla_absorbed_attention(
                q_abs[sl], block_rows[sl], positions[sl], vis, self.kv_lora, self.scale)
        o_lat, _ = merge_attn_partials(torch.stack([ctx[0], blk_o]), torch.stack([ctx[1], blk_lse]))
        o = torch.einsum("thc,hvc->thv", o_lat, w_uv.float()).to(x.dtype)
        return self.comm.all_reduce(self.o_proj(o.reshape(T, self.heads * self.vdim)))

    def forward_static(self, x: torch.Tensor, st, caches: ModelCaches) -> torch.Tensor:
        """`forward` of a graph-shaped draft (engine/spec_graph.py VerifyStatics `st`: B
        sequences of k block rows, x (B·k, H)) with no host value: positions, context tables
        and lengths from `st`, the context attention through the paged split kernel
        (kernels/mla_decode.py `mla_attention`; its reference off CUDA / bf16), the block
        attention as one dense (B, k, h, k) softmax. The same math as `forward`."""
        T, B, k = x.shape[0], st.seqs, st.verify - 1
        positions = st.draft_positions
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(T, self.heads, -1)
        w = self.kv_b_proj.weight.view(self.heads, self.nope + self.vdim, self.kv_lora)
        w_uk, w_uv = w[:, :self.nope], w[:, self.nope:]
        q_lat = torch.einsum("thn,hnc->thc", q[..., :self.nope].float(), w_uk.float())
        q_abs = torch.cat([q_lat, self._rot(q[..., self.nope:], positions)], -1)  # (T, h, c+r)
        block_rows = self.latent_rows(x, positions).float().view(B, k, -1)        # (B, k, c+r)
        cache, row = caches.mla, caches.mla_index[self.key]
        pool = cache.pool[row]
        D = self.par.dcp_size
        qa = self.comm.dcp_all_gather(q_abs, dim=1) if D > 1 else q_abs
        if qa.is_cuda and pool.dtype == torch.bfloat16:
            ctx = mla_attention(qa.to(torch.bfloat16).contiguous(), pool, st.draft_table,
                                st.draft_ctx_lens, kv_lora=self.kv_lora, scale=self.scale)
        else:
            ctx = mla_attention_reference(qa, pool, st.draft_table, st.draft_ctx_lens,
                                          kv_lora=self.kv_lora, scale=self.scale)
        if D > 1:
            outs = self.comm.dcp_all_gather(ctx[0].unsqueeze(0), dim=0)
            lses = self.comm.dcp_all_gather(ctx[1].unsqueeze(0), dim=0)
            mine = slice(self.par.dcp_rank * self.heads, (self.par.dcp_rank + 1) * self.heads)
            ctx = merge_attn_partials(outs[:, :, mine], lses[:, :, mine])
        s = torch.einsum("bqhd,bmd->bqhm", q_abs.view(B, k, self.heads, -1),
                         block_rows) * self.scale                           # non-causal block
        blk_lse = torch.logsumexp(s, -1)                                    # (B, k, h)
        blk_o = torch.einsum("bqhm,bmc->bqhc", torch.exp(s - blk_lse.unsqueeze(-1)),
                             block_rows[..., :self.kv_lora])
        o_lat, _ = merge_attn_partials(
            torch.stack([ctx[0], blk_o.reshape(T, self.heads, self.kv_lora)]),
            torch.stack([ctx[1], blk_lse.reshape(T, self.heads)]))
        o = torch.einsum("thc,hvc->thv", o_lat, w_uv.float()).to(x.dtype)
        return self.comm.all_reduce(self.o_proj(o.reshape(T, self.heads * self.vdim)))

    def _context_partial(self, q_abs: torch.Tensor, batch: StepBatch, caches: ModelCaches
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of this rank's heads over each sequence's cached context (positions < pos),
        merged over the DCP group as the target's MLA does. -> (o_lat (T, h, c), lse (T, h))."""
        cache, row = caches.mla, caches.mla_index[self.key]
        D = self.par.dcp_size
        qa = self.comm.dcp_all_gather(q_abs, dim=1) if D > 1 else q_abs
        o_lat = qa.new_zeros(qa.shape[0], qa.shape[1], self.kv_lora)
        lse = qa.new_full(qa.shape[:2], float("-inf"))
        for s in batch.seqs:
            sl = slice(s.start, s.end)
            rows, r_pos = cache.read(row, s.slot, s.pos)
            vis = r_pos.new_full((s.length,), s.pos)
            o_lat[sl], lse[sl] = mla_absorbed_attention(qa[sl], rows, r_pos, vis, self.kv_lora,
                                                        self.scale)
        if D > 1:
            outs = self.comm.dcp_all_gather(o_lat.unsqueeze(0), dim=0)
            lses = self.comm.dcp_all_gather(lse.unsqueeze(0), dim=0)
            mine = slice(self.par.dcp_rank * self.heads, (self.par.dcp_rank + 1) * self.heads)
            o_lat, lse = merge_attn_partials(outs[:, :, mine], lses[:, :, mine])
        return o_lat, lse


class DSparkMLP(nn.Module):
    """down(SiLU(gate(x)) · up(x)); gate/up column-, down row-parallel + all-reduce."""

    def __init__(self, dcfg: DSparkConfig, par: Parallel, comm: Comm, dtype: torch.dtype):
        super().__init__()
        H, I, what = dcfg.hidden_size, dcfg.intermediate_size, "DSpark intermediate_size"
        self.comm = comm
        self.gate_proj = column_linear(H, I, par, dtype, what)
        self.up_proj = column_linear(H, I, par, dtype, what)
        self.down_proj = row_linear(I, H, par, dtype, what)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = (F.silu(self.gate_proj(x).float()) * self.up_proj(x).float()).to(x.dtype)
        return self.comm.all_reduce(self.down_proj(a))


class DSparkLayer(nn.Module):
    def __init__(self, dcfg: DSparkConfig, i: int, par: Parallel, comm: Comm, dtype: torch.dtype):
        super().__init__()
        H, eps = dcfg.hidden_size, dcfg.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps, dtype)
        self.self_attn = DSparkAttention(dcfg, i, par, comm, dtype)
        self.post_attention_layernorm = RMSNorm(H, eps, dtype)
        self.mlp = DSparkMLP(dcfg, par, comm, dtype)

    def forward(self, x: torch.Tensor, batch: StepBatch | None, caches: ModelCaches,
                st=None) -> torch.Tensor:
        h = self.input_layernorm(x)
        a = self.self_attn(h, batch, caches) if st is None else \
            self.self_attn.forward_static(h, st, caches)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """bias(prev) = markov_w2 · markov_w1[prev]: (B,) token ids -> (B, V) fp32. Both tables are
    (vocab, rank) and replicated (the head runs once per draft position, sequentially)."""

    def __init__(self, vocab: int, rank: int, dtype: torch.dtype):
        super().__init__()
        self.markov_w1 = Linear(rank, vocab, Parallel(), None, dtype)   # used as an embedding
        self.markov_w2 = Linear(rank, vocab, Parallel(), None, dtype)
        self._derived = DerivedWeights()     # w2 in fp32, built once (not per draft position)

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        e = F.embedding(prev, self.markov_w1.weight)                     # (B, r)
        w2 = self.markov_w2.weight
        return F.linear(e.float(), self._derived.get("w2_f32", [w2], lambda: w2.float()))


class DSparkDrafter(nn.Module):
    """Parameter names are the checkpoint's (no prefix). The target's embedding and lm_head are
    bound with `bind_target` (held by reference, not registered as parameters)."""

    def __init__(self, dcfg: DSparkConfig, par: Parallel = Parallel(), comm: Comm = LocalComm(),
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg, self.par, self.comm, self.dtype = dcfg, par, comm, dtype
        H, eps = dcfg.hidden_size, dcfg.rms_norm_eps
        self.context_proj = replicated_linear(dcfg.context_width, H, dtype)
        self.context_norm = RMSNorm(H, eps, dtype)
        self.layers = nn.ModuleList(DSparkLayer(dcfg, i, par, comm, dtype)
                                    for i in range(dcfg.num_layers))
        self.final_norm = RMSNorm(H, eps, dtype)
        self.markov_head = MarkovHead(dcfg.vocab_size, dcfg.markov_rank, dtype)
        self._target: tuple = ()

    def bind_target(self, target: nn.Module) -> "DSparkDrafter":
        check_against_target(self.cfg, target.cfg)
        self._target = (target,)
        return self

    @property
    def target(self) -> nn.Module:
        if not self._target:
            raise RuntimeError("DSpark drafter used before bind_target(target model)")
        return self._target[0]

    @property
    def taps(self) -> tuple[int, ...]:
        return self.cfg.target_layer_ids

    def write_context(self, tapped: torch.Tensor, batch: StepBatch, caches: ModelCaches) -> None:
        """tapped (T, n_taps · H) of the target step `batch` -> latent rows of every draft layer
        at the step's positions (this rank's DCP share)."""
        ctx = self.context_norm(self.context_proj(tapped.to(self.dtype)))
        positions = batch.positions(ctx.device)
        for layer in self.layers:
            attn = layer.self_attn
            rows = attn.latent_rows(ctx, positions)
            row = caches.mla_index[attn.key]
            for s in batch.seqs:
                caches.mla.write(row, s.slot, s.pos, rows[s.start:s.end])

    def write_context_static(self, tapped: torch.Tensor, st, caches: ModelCaches) -> None:
        """`write_context` of a graph-shaped verify step (VerifyStatics `st`: its rows'
        positions, tables and local stores, −1 = another DCP rank's row, sent to the scratch
        block): index_put on device indices, no host value."""
        ctx = self.context_norm(self.context_proj(tapped.to(self.dtype)))
        bs = caches.mla.block_size
        local = st.store.long()
        blk = st.table.long().gather(1, (local.clamp_min(0) // bs).unsqueeze(1)).squeeze(1)
        blk = torch.where(local >= 0, blk, torch.full_like(blk, st.scratch.block))
        off = local.clamp_min(0) % bs
        for layer in self.layers:
            attn = layer.self_attn
            rows = attn.latent_rows(ctx, st.positions)
            caches.mla.pool[caches.mla_index[attn.key]].index_put_((blk, off), rows.to(
                caches.mla.pool.dtype))

    def forward(self, tokens: torch.Tensor, batch: StepBatch | None, caches: ModelCaches,
                st=None) -> torch.Tensor:
        """tokens (T,) = per sequence [anchor, mask × (k-1)], batch slices at the anchor positions
        -> final hidden (T, H). st: a graph-shaped draft's statics (engine/spec_graph.py;
        batch unused): every layer's `forward_static`."""
        x = self.target.model.embed_tokens(tokens).to(self.dtype)
        for layer in self.layers:
            x = layer(x, batch, caches, st)
        return self.final_norm(x)

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(T, H) -> (T, V) fp32 through the target's (vocab-parallel, gathered) lm_head."""
        return self.target.compute_logits(hidden.to(self.target.dtype))

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_head(prev)


__all__ = ["DSparkConfig", "RopeConfig", "DSparkDrafter", "parse_dspark_config",
           "load_dspark_config", "check_against_target", "check_num_drafts", "DSPARK_PRESETS",
           "rope_inv_freq", "rope_cos_sin", "apply_rope", "yarn_mscale", "draft_layer_key"]
