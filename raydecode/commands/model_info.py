"""`raydecode model-info`: what a config describes — layer kinds, parameters, cache bytes."""
from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="preset (tiny, k3), a config.json, or a checkpoint folder")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _runs(kinds: tuple[str, ...]) -> str:
    """'kda×3 mla×1 ...' run-length summary of the layer kinds."""
    out, prev, n = [], None, 0
    for k in kinds + (None,):
        if k == prev:
            n += 1
            continue
        if prev is not None:
            out.append(f"{prev}×{n}" if n > 1 else prev)
        prev, n = k, 1
    return " ".join(out)


def info(cfg) -> dict:
    from raydecode.models.params import param_counts

    pc = param_counts(cfg)
    kinds = cfg.layer_kinds
    return {
        "name": cfg.name,
        "num_layers": cfg.num_layers,
        "layer_kinds": list(kinds),
        "mla_layers": len(cfg.mla_layers),
        "kda_layers": len(cfg.kda_layer_ids),
        "dense_ffn_layers": sum(not cfg.is_moe_layer(i) for i in range(cfg.num_layers)),
        "moe_layers": sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers)),
        "attn_res_blocks": cfg.num_attn_res_blocks,
        "total_params": pc["total"],
        "active_params": pc["active"],
        "active_params_excl_embedding": pc["active_excl_embedding"],
        "params_by_kind": pc["by_kind"],
        "kv_bytes_per_token": cfg.kv_bytes_per_token,
        "kda_state_bytes_per_seq": cfg.kda_state_bytes_per_seq,
        "experts_format": cfg.quant.format if cfg.quant else "bf16",
    }


def _fmt(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.3f}{unit}"
    return str(n)


def run(args: argparse.Namespace) -> int:
    from raydecode.models.config import load_config

    cfg = load_config(args.model)
    d = info(cfg)
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    print(f"model {d['name']}: {d['num_layers']} layers ({d['kda_layers']} KDA, "
          f"{d['mla_layers']} MLA; {d['dense_ffn_layers']} dense FFN, {d['moe_layers']} latent MoE)")
    print(f"  layer kinds        {_runs(tuple(d['layer_kinds']))}")
    print(f"  AttnRes blocks     {d['attn_res_blocks']} (block size {cfg.attn_res_block_size})")
    print(f"  parameters         {_fmt(d['total_params'])} total, {_fmt(d['active_params'])} active "
          f"per token ({_fmt(d['active_params_excl_embedding'])} without the embedding)")
    print(f"  routed experts     {cfg.moe.num_experts} × top-{cfg.moe.top_k}, {d['experts_format']}")
    print(f"  MLA KV cache       {d['kv_bytes_per_token']:,} B per token (bf16 latent rows of "
          f"{cfg.mla.latent_dim})")
    print(f"  KDA state          {d['kda_state_bytes_per_seq']:,} B per sequence (fp32 recurrent "
          "+ conv tail)")
    return 0
