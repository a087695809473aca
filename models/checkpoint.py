"""K3 checkpoints on disk: the tensor list a config implies, and a writer of random ones.

Layout (as the published K3 `kimi_k3` checkpoint, prefix `language_model.`):
  model-0000k-of-0000n.safetensors + model.safetensors.index.json
  {"metadata": {"total_size": bytes}, "weight_map": {name: shard file}}, config.json, and the
  tokenizer (`tiktoken.model`, `tokenizer_config.json`).
Every tensor is bf16 (the config dtype) except, as in the real checkpoint: KDA `A_log`
(max(head_dim, num_heads),) fp32 with entries past num_heads zero (K3: (128,) for 96 heads), `dt_bias`, `q/k/v_conv1d.weight`
(inner, 1, conv) and `o_norm.weight` fp32; the router's `e_score_correction_bias` fp32; and every
linear the quantization_config names (compressed-tensors matching, `QuantConfig.quantizes`:
K3's names every Linear but the shared experts; the tiny preset's only the routed experts),
MXFP4 under `mxfp4-pack-quantized`: a linear (N, K) is stored as
  {module}.weight_packed uint8 (N, K/2) (two e2m1 codes a byte), .weight_scale uint8 (N, K/32)
e.g. experts.{e}.w1/w3 (I, L/2) / (I, L/32) and w2 (L, I/2) / (L, I/32) (I =
moe_intermediate_size, L = routed_expert_hidden_size); a linear it does not name is `.weight`.

The loader (models/weights.py) also reads the other published layouts: layers under
`language_model.layers.*` (LAYER_PREFIXES) and KDA `A_log` as (num_heads,) or
(1, 1, num_heads, 1).

Random weights keep a forward pass O(1): norms ≈ 1, projections N(0, 1/fan_in), embedding
N(0, 1); each tensor has its own generator seeded from (seed, name), so a tensor's values do not
depend on which other tensors exist or on the shard layout.
"""
from __future__ import annotations

import json
import math
import re
import zlib
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import torch

from .bpe import tokenizer_ids_for_vocab, write_test_tokenizer
from .config import K3Config
from .mxfp4 import GROUP_SIZE, pack_mxfp4

PREFIX = "language_model."
INDEX_FILE = "model.safetensors.index.json"
# the decoder layers' prefix in the published layouts: this writer's, and the one vLLM's K3
# loader maps onto it (hf_to_vllm_mapper); the other tensors keep `language_model.model.` / `lm_head`
LAYER_PREFIXES = (f"{PREFIX}model.layers.", f"{PREFIX}layers.")
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model or config; the message names the tensor/file."""


class TensorSpec(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype


def model_dtype(cfg: K3Config) -> torch.dtype:
    dt = getattr(torch, cfg.dtype, None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise CheckpointError(f"config dtype = {cfg.dtype!r}; expected a float dtype name such "
                              "as 'bfloat16'")
    return dt


def layer_aliases(module: str) -> tuple[str, ...]:
    """The other published names of a module: `language_model.model.layers.N.…` is also
    `language_model.layers.N.…` (an ignore list or target may use either)."""
    canon, alt = LAYER_PREFIXES
    if module.startswith(canon):
        return (alt + module[len(canon):],)
    if module.startswith(alt):
        return (canon + module[len(alt):],)
    return ()


def module_is_mxfp4(cfg: K3Config, module: str) -> bool:
    """Whether linear `module` (checkpoint name without `.weight`) is stored MXFP4: the
    quantization_config names it (QuantConfig.quantizes: ignore list first, then the targets)."""
    q = cfg.quant
    return q is not None and q.is_mxfp4 and q.quantizes(module, layer_aliases(module))


expert_is_mxfp4 = module_is_mxfp4        # routed experts: the same rule (models/moe.py)


def checkpoint_tensor_specs(cfg: K3Config) -> dict[str, TensorSpec]:
    """Every tensor a checkpoint of `cfg` holds: full name -> (full shape, dtype), in file order."""
    bf, f32, u8 = model_dtype(cfg), torch.float32, torch.uint8
    H, m, k, e = cfg.hidden_size, cfg.mla, cfg.kda, cfg.moe
    specs: dict[str, TensorSpec] = {}

    def add(name: str, shape, dtype=bf) -> None:
        specs[name] = TensorSpec(tuple(shape), dtype)

    def linear(name: str, out_f: int, in_f: int) -> None:
        if not module_is_mxfp4(cfg, name):
            add(f"{name}.weight", (out_f, in_f))
            return
        if in_f % GROUP_SIZE:
            raise CheckpointError(f"quantization_config makes {name} MXFP4, but its K = {in_f} "
                                  f"is not a multiple of the group size {GROUP_SIZE}; add it to "
                                  "the ignore list")
        add(f"{name}.weight_packed", (out_f, in_f // 2), u8)
        add(f"{name}.weight_scale", (out_f, in_f // GROUP_SIZE), u8)

    def mlp(p: str, inter: int) -> None:
        linear(f"{p}.gate_proj", inter, H)
        linear(f"{p}.up_proj", inter, H)
        linear(f"{p}.down_proj", H, inter)

    top = f"{PREFIX}model"
    add(f"{top}.embed_tokens.weight", (cfg.vocab_size, H))
    for i, kind in enumerate(cfg.layer_kinds):
        p = f"{top}.layers.{i}"
        for n in ("self_attention_res_norm", "input_layernorm", "mlp_res_norm",
                  "post_attention_layernorm"):
            add(f"{p}.{n}.weight", (H,))
        for n in ("self_attention_res_proj", "mlp_res_proj"):
            linear(f"{p}.{n}", 1, H)
        a = f"{p}.self_attn"
        if kind == "kda":
            inner, hd = k.inner_dim, k.head_dim
            for n in ("q", "k", "v"):
                linear(f"{a}.{n}_proj", inner, H)
                add(f"{a}.{n}_conv1d.weight", (inner, 1, k.conv_size), f32)
            linear(f"{a}.f_a_proj", hd, H)
            linear(f"{a}.f_b_proj", inner, hd)
            add(f"{a}.A_log", (max(hd, k.num_heads),), f32)
            add(f"{a}.dt_bias", (inner,), f32)
            linear(f"{a}.b_proj", k.num_heads, H)
            if k.use_full_rank_gate:
                linear(f"{a}.g_proj", inner, H)
            else:
                linear(f"{a}.g_a_proj", hd, H)
                linear(f"{a}.g_b_proj", inner, hd)
            add(f"{a}.o_norm.weight", (hd,), f32)
            linear(f"{a}.o_proj", H, inner)
        else:
            linear(f"{a}.q_a_proj", m.q_lora_rank, H)
            add(f"{a}.q_a_layernorm.weight", (m.q_lora_rank,))
            linear(f"{a}.q_b_proj", m.num_heads * m.qk_head_dim, m.q_lora_rank)
            linear(f"{a}.kv_a_proj_with_mqa", m.latent_dim, H)
            add(f"{a}.kv_a_layernorm.weight", (m.kv_lora_rank,))
            linear(f"{a}.kv_b_proj", m.num_heads * (m.qk_nope_head_dim + m.v_head_dim),
                   m.kv_lora_rank)
            if m.use_output_gate:
                linear(f"{a}.g_proj", m.num_heads * m.v_head_dim, H)
            linear(f"{a}.o_proj", H, m.num_heads * m.v_head_dim)
        if not cfg.is_moe_layer(i):
            mlp(f"{p}.mlp", cfg.intermediate_size)
            continue
        b = f"{p}.block_sparse_moe"
        linear(f"{b}.gate", e.num_experts, H)
        add(f"{b}.gate.e_score_correction_bias", (e.num_experts,), f32)
        L, inter = e.latent_size, e.expert_intermediate
        linear(f"{b}.routed_expert_down_proj", L, H)
        if e.latent_norm:
            add(f"{b}.routed_expert_norm.weight", (L,))
        linear(f"{b}.routed_expert_up_proj", H, L)
        if e.num_shared_experts:
            mlp(f"{b}.shared_experts", e.shared_intermediate)
        for x in range(e.num_experts):
            for w, (n_out, n_in) in (("w1", (inter, L)), ("w2", (L, inter)), ("w3", (inter, L))):
                linear(f"{b}.experts.{x}.{w}", n_out, n_in)
    add(f"{top}.norm.weight", (H,))
    add(f"{top}.output_attn_res_norm.weight", (H,))
    linear(f"{top}.output_attn_res_proj", 1, H)
    if not cfg.tie_word_embeddings:
        linear(f"{PREFIX}lm_head", cfg.vocab_size, H)
    return specs


# ---- random weights ------------------------------------------------------------------------

def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode()))
                                         % (1 << 63))


def _random_float(cfg: K3Config, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """fp32 values for tensor `name` (the dense form for MXFP4 experts)."""
    g = _generator(seed, name)
    randn = lambda *s: torch.randn(*s, generator=g)                       # noqa: E731
    leaf = name.rsplit(".", 2)
    if name.endswith("A_log"):                  # A = exp(A_log) in [1, 16] for the live heads
        out = torch.zeros(shape)
        h = cfg.kda.num_heads
        out[:h] = torch.empty(h).uniform_(0.0, math.log(16.0), generator=g)
        return out
    if name.endswith("dt_bias"):                # softplus(dt_bias) = dt, log-uniform in [1e-3, 0.1]
        dt = torch.exp(torch.empty(shape).uniform_(math.log(1e-3), math.log(0.1), generator=g))
        return dt + torch.log(-torch.expm1(-dt))
    if name.endswith("e_score_correction_bias"):
        return 0.01 * randn(*shape)
    if leaf[-2].endswith("norm"):               # every *norm*.weight / *layernorm.weight
        return 1.0 + 0.02 * randn(*shape)
    if name.endswith("embed_tokens.weight"):
        return randn(*shape)
    if name.endswith("conv1d.weight"):          # (C, 1, W)
        return randn(*shape) / math.sqrt(shape[-1])
    return randn(*shape) / math.sqrt(shape[-1])  # linear (out, in): N(0, 1/in)


def make_tensor(cfg: K3Config, name: str, seed: int = 0,
                specs: dict[str, TensorSpec] | None = None) -> torch.Tensor:
    """The random tensor `write_checkpoint(cfg, seed=seed)` stores under `name`."""
    specs = specs if specs is not None else checkpoint_tensor_specs(cfg)
    if name not in specs:
        raise CheckpointError(f"{name!r} is not a tensor of a {cfg.name} checkpoint")
    shape, dtype = specs[name]
    for part in ("weight_packed", "weight_scale"):
        if name.endswith(part):
            mod = name[: -len(part) - 1]
            n_out, n_in = specs[f"{mod}.weight_scale"].shape
            dense = _random_float(cfg, f"{mod}.weight", (n_out, n_in * GROUP_SIZE), seed)
            packed, scales = pack_mxfp4(dense)
            return packed if part == "weight_packed" else scales
    return _random_float(cfg, name, shape, seed).to(dtype)


# ---- writer --------------------------------------------------------------------------------

def _nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * (torch.finfo(spec.dtype).bits // 8
                                    if spec.dtype.is_floating_point else
                                    torch.iinfo(spec.dtype).bits // 8)


def plan_shards(specs: dict[str, TensorSpec], shard_max_bytes: int) -> list[list[str]]:
    """Greedy, in order: a new shard starts when the next tensor would pass the limit."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, spec in specs.items():
        nb = _nbytes(spec)
        if shards[-1] and size + nb > shard_max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nb
    return shards


def write_checkpoint(cfg: K3Config, out_dir: str | Path, seed: int = 0,
                     shard_max_bytes: int | None = None, tokenizer: bool = True) -> K3Config:
    """Write a random checkpoint of `cfg` to `out_dir`; returns the config written.

    With `tokenizer`, a byte-level BPE tokenizer filling `cfg.vocab_size` is trained and written,
    and the returned (and written) config carries its bos/eos/pad ids. `shard_max_bytes`
    defaults to a quarter of the total (at most 4 GiB), so small models get
    several shards.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer:
        cfg = replace(cfg, **write_test_tokenizer(out, cfg.vocab_size))
    specs = checkpoint_tensor_specs(cfg)
    total = sum(_nbytes(s) for s in specs.values())
    if shard_max_bytes is None:
        shard_max_bytes = min(-(-total // 4), 4 << 30)
    if shard_max_bytes <= 0:
        raise CheckpointError(f"shard_max_bytes = {shard_max_bytes}; expected > 0")
    shards = plan_shards(specs, shard_max_bytes)
    for old in out.iterdir():                      # stale shards of an earlier write
        if _SHARD_RE.fullmatch(old.name):
            old.unlink()
    weight_map: dict[str, str] = {}
    for k, names in enumerate(shards, start=1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: make_tensor(cfg, n, seed, specs).contiguous() for n in names}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    return cfg


def with_test_tokenizer_ids(cfg: K3Config) -> K3Config:
    """`cfg` with the bos/eos/pad ids of the test tokenizer `write_checkpoint` writes for it."""
    return replace(cfg, **tokenizer_ids_for_vocab(cfg.vocab_size))
