"""The benchmarks' decode-option flags: what the served step runs, set per run
(kernels/settings.py `DecodeOptions`) and recorded in every report.

    --decode FIELD=VALUE       any scalar DecodeOptions field (repeatable), e.g. moe_fused=0
    --gemv-config N,K={json}   an M = 1 CuTe GEMV mapping over the tuned table (repeatable)
    --decode-config E,I,L={json}   a CUDA-core MoE decode config over its tuned table
    --moe-max-pairs N          DecodeOptions.moe_max_pairs
(step.py also keeps its older per-field flags: --kda-splits, --router-gather, --attnres-bank,
--mla-pre-tile.) Bad values exit with the flag, the value and what is accepted.
"""
from __future__ import annotations

import argparse
import json

from raydecode.kernels.settings import DEFAULT_OPTIONS, DecodeOptions, parse_option_pairs

GEMV_FIELDS = {"lanes_per_row", "k_warps", "rows_per_group", "row_warps", "batch"}


def gemv_mapping(spec: str):
    """'N,K={"lanes_per_row": …, "k_warps": …, "rows_per_group": …, "row_warps": …}' ->
    ((N, K), GemvConfig) for DecodeOptions.gemv_configs (validated for (1, N, K); PDL and the
    prefetch budget are the options' own)."""
    from raydecode.kernels import gemv
    key, js = spec.split("=", 1)
    N, K = (int(x) for x in key.split(","))
    fields = json.loads(js)
    if not isinstance(fields, dict) or set(fields) - GEMV_FIELDS:
        raise ValueError(f"fields {fields!r}; accepted keys {sorted(GEMV_FIELDS)}")
    cfg = gemv.GemvConfig(m_tile=1, **fields)
    cfg.validate(1, N, K)
    return (N, K), cfg


def gemv_mappings(specs: list[str]) -> tuple:
    """`gemv_mapping` of each --gemv-config value; a bad one raises ValueError naming it and
    the expected form."""
    out = []
    for c in specs:
        try:
            out.append(gemv_mapping(c))
        except (ValueError, TypeError) as e:
            raise ValueError(f"--gemv-config {c!r}: expected N,K={{GemvConfig mapping fields "
                             f"as JSON}} that tile (1, N, K) ({e})") from e
    return tuple(out)


def decode_configs(values: list[str]) -> tuple:
    """--decode-config values 'E,I,L={DecodeConfig fields as JSON}' -> ((E, I, L), config)
    pairs for DecodeOptions.moe_decode_configs; a bad one raises ValueError naming it."""
    from raydecode.kernels.moe_mxfp4_decode import DecodeConfig
    out = []
    for c in values:
        try:
            key, js = c.split("=", 1)
            shape = tuple(int(x) for x in key.split(","))
            if len(shape) != 3:
                raise ValueError(f"{len(shape)} numbers before '='")
            conf = DecodeConfig(**json.loads(js))
            conf.validate(shape[1], shape[2])
        except (ValueError, TypeError) as e:     # JSONDecodeError is a ValueError
            raise ValueError(f"--decode-config {c!r}: expected E,I,L={{DecodeConfig fields as "
                             f"JSON}} that fit I and L ({e})") from e
        out.append((shape, conf))
    return tuple(out)


def add_decode_args(ap: argparse.ArgumentParser) -> None:
    """The flags every step / layer benchmark takes (module docstring)."""
    ap.add_argument("--decode", action="append", default=[], metavar="FIELD=VALUE",
                    help="a decode option for this run (kernels/settings.py DecodeOptions), "
                         "repeatable: e.g. moe_fused=0, skinny_max_m=0, moe_kernel=cuda_core")
    ap.add_argument("--gemv-config", action="append", default=[],
                    help="M=1 GEMV mapping override, repeatable: N,K={json of GemvConfig mapping "
                         "fields: lanes_per_row, k_warps, rows_per_group, row_warps[, batch]} "
                         "(over kernels.gemv.TUNED; A/B runs of scripts/explore/gemv_tune.py)")
    ap.add_argument("--decode-config", action="append", default=[],
                    help="E,I,L={DecodeConfig JSON}: the CUDA-core MoE decode config for that "
                         "shape (same-lease A/B, e.g. words vs f16x2)")
    ap.add_argument("--moe-max-pairs", type=int, default=None,
                    help="T·k up to which the specialized MoE runs the few-token kernels "
                         f"(DecodeOptions.moe_max_pairs, default {DEFAULT_OPTIONS.moe_max_pairs})")


def options_from_args(args: argparse.Namespace, **fields) -> DecodeOptions:
    """DecodeOptions of a benchmark run: `fields` (a bench's own flags), then --decode pairs,
    --moe-max-pairs and the config tables. Raises ValueError naming the bad flag."""
    base = DEFAULT_OPTIONS.replace(**fields)
    opts = parse_option_pairs(args.decode, base)
    if args.moe_max_pairs is not None:
        if args.moe_max_pairs < 1:
            raise ValueError(f"--moe-max-pairs {args.moe_max_pairs}: expected ≥ 1")
        opts = opts.replace(moe_max_pairs=args.moe_max_pairs)
    return opts.replace(gemv_configs=gemv_mappings(args.gemv_config),
                        moe_decode_configs=decode_configs(args.decode_config))


__all__ = ["add_decode_args", "decode_configs", "gemv_mapping", "gemv_mappings",
           "options_from_args"]
