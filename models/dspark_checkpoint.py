"""DSpark checkpoints: the published tensor layout, a writer of random ones, and the loader.

Layout (as `Inferact/Kimi-K3-DSpark`, no name prefix): `model-0000k-of-0000n.safetensors` +
`model.safetensors.index.json` + `config.json` (`model_type: k3_dspark`). All tensors bf16:
  context_proj.weight (H, n_taps·H)   context_norm.weight (H,)   final_norm.weight (H,)
  layers.{i}.input_layernorm.weight, post_attention_layernorm.weight (H,)
  layers.{i}.self_attn.q_a_proj (q_lora, H), q_a_layernorm (q_lora,), q_b_proj (heads·qk, q_lora),
      kv_a_proj_with_mqa (kv_lora + rope, H), kv_a_layernorm (kv_lora,),
      kv_b_proj (heads·(nope + v), kv_lora), o_proj (H, heads·v)                      (.weight)
  layers.{i}.mlp.gate_proj, up_proj (I, H), down_proj (H, I)                             (.weight)
  markov_head.markov_w1.weight, markov_head.markov_w2.weight (V, r)
  embed_tokens.weight (V, H)          frozen copy of the target's: shipped, never read
  confidence_head.proj.weight (1, H + r), .bias (1,)   with enable_confidence_head: training-
                                                       time acceptance estimate, not read here
The published K3 drafter: 8 + 12·5 = 68 tensors, 3,562,312,961 parameters.

The loader reads each parameter's TP slice only (column/row-parallel as `models/dspark.py`
builds them), refuses unknown, missing or misshapen tensors by name, and binds the drafter to
the target model whose embedding and lm_head it shares.
"""
from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import torch

from .checkpoint import INDEX_FILE, CheckpointError, TensorSpec, plan_shards
from .config import ConfigError
from .dspark import DSPARK_PRESETS, DSparkConfig, DSparkDrafter, load_dspark_config
from .parallel import Comm, LocalComm, Parallel
from .weights import _file_source, _Source

# never read: the target's own embedding / lm_head are used; the confidence head is training-only
SKIPPED_PREFIXES = ("embed_tokens.", "lm_head.", "confidence_head.")
_SHARD_FMT = "model-{:05d}-of-{:05d}.safetensors"


def dspark_tensor_specs(dcfg: DSparkConfig) -> dict[str, TensorSpec]:
    """Every tensor a DSpark checkpoint of `dcfg` holds: name -> (shape, dtype), file order."""
    bf = getattr(torch, dcfg.dtype, None)
    if not isinstance(bf, torch.dtype) or not bf.is_floating_point:
        raise CheckpointError(f"DSpark torch_dtype = {dcfg.dtype!r}; expected a float dtype")
    H, I, V, r = dcfg.hidden_size, dcfg.intermediate_size, dcfg.vocab_size, dcfg.markov_rank
    specs: dict[str, TensorSpec] = {}

    def add(name: str, *shape: int) -> None:
        specs[name] = TensorSpec(tuple(shape), bf)

    if dcfg.enable_confidence_head:
        add("confidence_head.proj.bias", 1)
        add("confidence_head.proj.weight", 1, H + (r if dcfg.confidence_head_with_markov else 0))
    add("context_norm.weight", H)
    add("context_proj.weight", H, dcfg.context_width)
    add("embed_tokens.weight", V, H)
    add("final_norm.weight", H)
    for i in range(dcfg.num_layers):
        p = f"layers.{i}"
        add(f"{p}.input_layernorm.weight", H)
        add(f"{p}.post_attention_layernorm.weight", H)
        add(f"{p}.mlp.gate_proj.weight", I, H)
        add(f"{p}.mlp.up_proj.weight", I, H)
        add(f"{p}.mlp.down_proj.weight", H, I)
        a = f"{p}.self_attn"
        add(f"{a}.q_a_proj.weight", dcfg.q_lora_rank, H)
        add(f"{a}.q_a_layernorm.weight", dcfg.q_lora_rank)
        add(f"{a}.q_b_proj.weight", dcfg.num_heads * dcfg.qk_head_dim, dcfg.q_lora_rank)
        add(f"{a}.kv_a_proj_with_mqa.weight", dcfg.latent_dim, H)
        add(f"{a}.kv_a_layernorm.weight", dcfg.kv_lora_rank)
        add(f"{a}.kv_b_proj.weight", dcfg.num_heads * (dcfg.qk_nope_head_dim + dcfg.v_head_dim),
            dcfg.kv_lora_rank)
        add(f"{a}.o_proj.weight", H, dcfg.num_heads * dcfg.v_head_dim)
    add("markov_head.markov_w1.weight", V, r)
    add("markov_head.markov_w2.weight", V, r)
    return specs


# ---- random weights ------------------------------------------------------------------------

def make_dspark_tensor(dcfg: DSparkConfig, name: str, seed: int = 0,
                       specs: dict[str, TensorSpec] | None = None) -> torch.Tensor:
    """The random tensor `write_dspark_checkpoint(dcfg, seed=seed)` stores under `name`; each
    tensor has its own generator seeded from (seed, name). Norms ≈ 1, projections N(0, 1/fan_in),
    Markov embedding N(0, 1) and projection N(0, 1/r) (bias O(1))."""
    specs = specs if specs is not None else dspark_tensor_specs(dcfg)
    if name not in specs:
        raise CheckpointError(f"{name!r} is not a tensor of a {dcfg.name} DSpark checkpoint")
    shape, dtype = specs[name]
    g = torch.Generator().manual_seed((seed * 0x9E3779B1 + zlib.crc32(b"dspark:" + name.encode()))
                                      % (1 << 63))
    return dspark_init_scale(name, torch.randn(shape, generator=g), shape[-1]).to(dtype)


def dspark_init_scale(name: str, x: torch.Tensor, fan_in: int) -> torch.Tensor:
    """A standard-normal draw `x` for the drafter tensor `name` at the checkpoint's scales:
    norms 1 + 0.02·x, biases 0, the embedding and the Markov embedding x, every other weight
    x / sqrt(fan_in) (fan_in: the full tensor's last dimension, not a TP slice's)."""
    owner = name.rsplit(".", 2)[-2] if name.count(".") else ""
    if owner.endswith("norm"):
        return 1.0 + 0.02 * x
    if name.endswith("bias"):
        return torch.zeros_like(x)
    if name in ("embed_tokens.weight", "markov_head.markov_w1.weight"):
        return x
    return x / math.sqrt(fan_in)


def write_dspark_checkpoint(dcfg: DSparkConfig, out_dir: str | Path, seed: int = 0,
                            target_embed: torch.Tensor | None = None,
                            shard_max_bytes: int | None = None) -> Path:
    """Write a random DSpark checkpoint of `dcfg` (its config.json included) to `out_dir`.
    `target_embed` (V, H), when given, is stored as the frozen embed_tokens copy."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specs = dspark_tensor_specs(dcfg)
    nbytes = {n: math.prod(s.shape) * s.dtype.itemsize for n, s in specs.items()}
    total = sum(nbytes.values())
    shards = plan_shards(specs, shard_max_bytes or max(1, min(-(-total // 3), 4 << 30)))
    weight_map: dict[str, str] = {}
    for k, names in enumerate(shards, start=1):
        fname = _SHARD_FMT.format(k, len(shards))
        tensors = {}
        for n in names:
            if n == "embed_tokens.weight" and target_embed is not None:
                if tuple(target_embed.shape) != specs[n].shape:
                    raise CheckpointError(f"target_embed of shape {tuple(target_embed.shape)}; "
                                          f"embed_tokens.weight is {specs[n].shape}")
                tensors[n] = target_embed.detach().to(specs[n].dtype).contiguous()
            else:
                tensors[n] = make_dspark_tensor(dcfg, n, seed, specs).contiguous()
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, fname))
    (out / INDEX_FILE).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(dcfg.to_hf_dict(), indent=2) + "\n")
    return out


# ---- loading -------------------------------------------------------------------------------

def _check_headers(src: _Source, specs: dict[str, TensorSpec], dcfg: DSparkConfig) -> None:
    unknown = [n for n in src.headers if n not in specs and not n.startswith(SKIPPED_PREFIXES)]
    if unknown:
        raise CheckpointError(f"unknown tensor(s) in the DSpark checkpoint: {unknown[:5]} "
                              f"({len(unknown)} in all); its config ({dcfg.num_layers} layers) "
                              "implies no such tensor")
    missing = [n for n in specs if n not in src.headers and not n.startswith(SKIPPED_PREFIXES)]
    if missing:
        raise CheckpointError(f"the DSpark checkpoint lacks tensor(s) {missing[:5]} "
                              f"({len(missing)} in all) that its config implies")
    for n, spec in specs.items():
        if n not in src.headers:
            continue
        shape, dtype = src.headers[n]
        if tuple(shape) != spec.shape:
            raise CheckpointError(f"{n}: shape {tuple(shape)} in the checkpoint, expected "
                                  f"{spec.shape}")
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise CheckpointError(f"{n}: dtype {dtype}, expected a float tensor")


@torch.no_grad()
def _load(drafter: DSparkDrafter, src: _Source, par: Parallel) -> None:
    specs = dspark_tensor_specs(drafter.cfg)
    _check_headers(src, specs, drafter.cfg)
    for pname, p in drafter.named_parameters():
        if pname not in specs:
            raise CheckpointError(f"drafter parameter {pname!r} has no tensor in the layout")
        full = specs[pname].shape
        if tuple(p.full_shape) != full:
            raise CheckpointError(f"{pname}: checkpoint full shape {full}, parameter expects "
                                  f"{tuple(p.full_shape)}")
        dim = p.shard_dim
        if dim is None or par.tp_size == 1:
            t = src.read(pname)
        else:
            size = par.shard(full[dim], f"{pname} dim {dim}")
            t = src.read(pname, dim, par.tp_rank * size, size)
        if tuple(t.shape) != tuple(p.shape):
            raise CheckpointError(f"{pname}: rank {par.tp_rank}/{par.tp_size} slice "
                                  f"{tuple(t.shape)}, parameter {tuple(p.shape)}")
        p.copy_(t)


def build_drafter(dcfg: DSparkConfig, target: torch.nn.Module, par: Parallel = Parallel(),
                  comm: Comm = LocalComm(), dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu", seed: int = 0,
                  tensors: dict[str, torch.Tensor] | None = None) -> DSparkDrafter:
    """A drafter shard of any `dcfg` with the random weights of `seed`, any of them replaced by
    the full tensors in `tensors` (checkpoint name -> tensor); each rank takes its slice."""
    specs = dspark_tensor_specs(dcfg)
    tensors = dict(tensors or {})
    unknown = sorted(set(tensors) - set(specs))
    if unknown:
        raise CheckpointError(f"tensor(s) {unknown} are not in a {dcfg.name} DSpark checkpoint")
    for n, t in tensors.items():
        if tuple(t.shape) != specs[n].shape:
            raise CheckpointError(f"{n}: shape {tuple(t.shape)}, expected {specs[n].shape}")

    def read(n, idx):
        full = tensors[n] if n in tensors else make_dspark_tensor(dcfg, n, seed, specs)
        return full[idx]

    with torch.device(device):
        drafter = DSparkDrafter(dcfg, par, comm, dtype)
    _load(drafter, _Source({n: (s.shape, s.dtype) for n, s in specs.items()}, read), par)
    return drafter.bind_target(target).eval()


def load_drafter(spec: str | Path, target: torch.nn.Module, par: Parallel = Parallel(),
                 comm: Comm = LocalComm(), dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", seed: int = 0) -> DSparkDrafter:
    """The drafter shard for `par` from a DSpark checkpoint folder, or for a preset name with the
    random weights `write_dspark_checkpoint(preset, seed=seed)` would write; bound to `target`."""
    s = str(spec)
    if Path(s).is_dir():
        dcfg = load_dspark_config(s)
        src = _file_source(Path(s))
    elif s in DSPARK_PRESETS:
        return build_drafter(load_dspark_config(s), target, par, comm, dtype, device, seed)
    else:
        raise ConfigError(f"drafter {s!r}: not a DSpark checkpoint folder and not a preset "
                          f"({', '.join(DSPARK_PRESETS)})")
    with torch.device(device):
        drafter = DSparkDrafter(dcfg, par, comm, dtype)
    _load(drafter, src, par)
    return drafter.bind_target(target).eval()


__all__ = ["dspark_tensor_specs", "dspark_init_scale", "make_dspark_tensor",
           "write_dspark_checkpoint",
           "build_drafter", "load_drafter", "SKIPPED_PREFIXES"]
