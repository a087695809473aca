"""MXFP4 MoE tile/decode sweep on K3 per-rank expert shapes (GPU), feeding
`kernels.moe_mxfp4.TUNED` before the layer benchmark times the stock MoE.

Per (TP, batch): one expert bank (E = 896, L = 3584, I = 3072 / TP, random codes and scales),
`calls` back-to-back MoE calls in one CUDA graph, each with its own balanced random routing
(top-16 of uniform scores), so the distinct experts the graph touches exceed 4 × L2 even at
batch 1. Every candidate is first checked against `moe_mxfp4_reference` on call 0
(‖out − ref‖ / ‖ref‖ < 1e-2); a candidate that fails to compile, run or match is recorded and
skipped. Bytes = distinct experts per call × bytes per expert.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from raydecode.kernels import moe_mxfp4 as M

from raydecode.scripts.bench.layer_timing import GraphTimer
from raydecode.scripts.explore.common import rel_err, unique


def candidates(P: int, E: int, I: int, L: int) -> list[M.MoEConfig]:
    d = M.default_config(P, E, I, L, tuned=False)
    rep = dataclasses.replace
    out = [d,
           rep(d, gate_up_bk=M._largest_block(L, 512)),
           rep(d, num_warps=8),
           rep(d, decode="pairs", gate_up_bk=M._largest_block(L, 64),
               down_bk=M._largest_block(I, 64), num_stages=4),
           rep(d, decode="split", gate_up_bk=M._largest_block(L, 64),
               down_bk=M._largest_block(I, 64), num_stages=4),
           rep(d, decode="split", gate_up_bk=M._largest_block(L, 128),
               down_bk=M._largest_block(I, 64))]
    return unique(out)


def expert_bank(cfg_moe, tp: int, seed: int, device="cuda") -> M.MXFP4Experts:
    """Random MXFP4 experts at rank 0's TP shapes (I = expert_intermediate / TP)."""
    return M.MXFP4Experts.random(cfg_moe.num_experts, cfg_moe.latent_size,
                                 cfg_moe.expert_intermediate // tp, 4.0, 25.0,
                                 fan_in_13=cfg_moe.latent_size,
                                 fan_in_2=cfg_moe.expert_intermediate, device=device,
                                 seed=seed + tp)


def random_calls(bank: M.MXFP4Experts, B: int, k: int, calls: int, gen: torch.Generator):
    """z (B, L) bf16 and `calls` balanced random routings (top-k of uniform scores,
    renormalised) -> (z, routes, distinct experts per call, expert bytes per call, the
    reference output of call 0)."""
    E, L, dev = bank.num_experts, bank.latent, gen.device
    z = torch.randn(B, L, generator=gen, device=dev).to(torch.bfloat16)
    routes = []
    for _ in range(calls):
        w, ids = torch.rand(B, E, generator=gen, device=dev).topk(k, dim=-1)
        routes.append(((w / w.sum(-1, keepdim=True)).float(), ids))
    touched = statistics.mean(int(torch.unique(r[1]).numel()) for r in routes)
    ref = M.moe_mxfp4_reference(z, *routes[0], bank)
    return z, routes, touched, touched * bank.expert_bytes(), ref


def check_and_time(fn, routes, ref, nbytes: float, row: dict) -> float | None:
    """Call 0 against the reference (‖out − ref‖ / ‖ref‖ < 1e-2), then every call back to back
    in one CUDA graph; fills `row` (first_call_s, rel_err, us, Bps or error) and returns µs per
    call, or None when the candidate failed to compile, run or match (recorded, skipped)."""
    try:
        t0 = time.time()
        err = rel_err(fn(routes[0]), ref)
        row.update(first_call_s=time.time() - t0, rel_err=err)
        if not err < 1e-2:
            raise AssertionError(f"rel err {err:.3g} vs the reference")
        t = GraphTimer(replays=10, warm=2).run([lambda r=r: fn(r) for r in routes],
                                               count_nodes=False)
        row.update(us=t.us_per_call, Bps=nbytes / (t.us_per_call * 1e-6))
        return t.us_per_call
    except Exception as e:      # compile/run/accuracy failure: recorded, skipped
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        return None


def sweep(cfg_moe, tps=(16, 8), batches=(1, 64), calls: int = 32, seed: int = 0,
          log=print) -> list[dict]:
    E, L, k = cfg_moe.num_experts, cfg_moe.latent_size, cfg_moe.top_k
    rows = []
    for tp in tps:
        I = cfg_moe.expert_intermediate // tp
        bank = expert_bank(cfg_moe, tp, seed)
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for B in batches:
            P = B * k
            z, routes, touched, nbytes, ref = random_calls(bank, B, k, calls, gen)
            best = None
            for c in candidates(P, E, I, L):
                row = {"tp": tp, "batch": B, "config": dataclasses.asdict(c),
                       "touched_experts": touched, "bytes_per_call": nbytes}
                us = check_and_time(lambda r, c=c: M.fused_moe_mxfp4_triton(z, *r, bank, c),
                                    routes, ref, nbytes, row)
                if us is not None and (best is None or us < best[0]):
                    best = (us, c)
                rows.append(row)
                log(f"moe sweep TP{tp} B={B} {c.decode:11s} gu{c.gate_up_bn}x{c.gate_up_bk} "
                    f"dn{c.down_bn}x{c.down_bk} w{c.num_warps} s{c.num_stages}: "
                    + (f"{row['us']:7.1f} us {row['Bps'] / 1e12:5.2f} TB/s" if "us" in row
                       else row["error"]))
            if best is not None:        # reported; the tuned table changes by hand
                rows.append({"tp": tp, "batch": B, "chosen": dataclasses.asdict(best[1]),
                             "us": best[0]})
        bank = None
        torch.cuda.empty_cache()
    return rows
