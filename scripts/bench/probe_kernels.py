"""A small driver for Nsight Compute (GPU): launches the few-token MXFP4 expert kernels and the
router top-k at K3 per-rank shapes, each config a few times, outside any CUDA graph, so
`ncu -k regex:...` sees named launches. Also prints each config's time in a CUDA graph over
rotating routings (the same timing as the layer benchmark's MoE sweep), so a profile and a time
come from one process.

    ncu --clock-control none --set full -k regex:"_gate_up|_down_kernel|_route" \
        python3 -m raydecode.scripts.bench.probe_kernels --tp 16 --batch 1

Configs: the TUNED one, then the `--config` JSON dicts of `DecodeConfig` fields (optional).
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from raydecode.kernels import moe_mxfp4_decode as D
from raydecode.kernels.router import route_topk
from raydecode.models.config import load_config

from .layer_moe_sweep import check_and_time, expert_bank, random_calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--launches", type=int, default=2, help="eager launches per config")
    ap.add_argument("--config", action="append", default=[],
                    help="extra DecodeConfig fields as JSON (repeatable)")
    ap.add_argument("--out", default=None, help="JSON of the graph timings")
    ap.add_argument("--no-time", action="store_true", help="eager launches only (under ncu)")
    a = ap.parse_args(argv)
    cfg = load_config("k3").moe
    bank = expert_bank(cfg, a.tp, seed=0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    z, routes, touched, nbytes, ref = random_calls(bank, a.batch, cfg.top_k, 12, gen)
    I, L = bank.intermediate, bank.latent
    base = D.default_decode_config(bank.num_experts, I, L)
    configs = [base] + [dataclasses.replace(base, **json.loads(c)) for c in a.config]
    rows = []
    for c in configs:
        row = {"tp": a.tp, "batch": a.batch, "config": dataclasses.asdict(c),
               "bytes_per_call": nbytes, "touched_experts": touched}
        for _ in range(a.launches):
            D.moe_mxfp4_decode(z, *routes[0], bank, c)
        if not a.no_time:
            check_and_time(lambda r, c=c: D.moe_mxfp4_decode(z, *r, bank, c), routes, ref,
                           nbytes, row)
        rows.append(row)
        print(json.dumps(row), flush=True)
    logits = torch.randn(a.batch, bank.num_experts, device="cuda")
    bias = torch.randn(bank.num_experts, device="cuda") * 0.1
    for _ in range(a.launches):
        route_topk(logits, bias, cfg.top_k)
    torch.cuda.synchronize()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
