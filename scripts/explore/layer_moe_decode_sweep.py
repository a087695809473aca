"""Tile sweep of the specialized few-token MXFP4 expert kernel (kernels/moe_mxfp4_decode.py) on
K3 per-rank expert shapes (GPU), feeding `moe_mxfp4_decode.TUNED` before the layer timing, with
the stock grouped kernel (kernels/moe_mxfp4.py, its TUNED config) timed the same way beside it.

Per (TP, batch): one expert bank (E = 896, L = 3584, I = 3072 / TP), `calls` back-to-back MoE
calls in one CUDA graph, each with its own random top-16 routing, so the distinct experts the
graph touches exceed 2 × L2 even at batch 1. Each candidate is checked against
`moe_mxfp4_reference` on call 0 (‖out − ref‖ / ‖ref‖ < 1e-2) before it is timed; failures are
recorded and skipped. Bytes = distinct experts per call × bytes per expert.
"""
from __future__ import annotations

import dataclasses

import torch

from raydecode.kernels import moe_mxfp4 as M
from raydecode.kernels import moe_mxfp4_decode as D

from .layer_moe_sweep import check_and_time, expert_bank, random_calls


def candidates(E: int, I: int, L: int) -> list[D.DecodeConfig]:
    d = D.default_decode_config(E, I, L, tuned=False)
    rep = dataclasses.replace
    gb_dn = D._pow2_divisor(I // 32, 4)
    out = [d,
           rep(d, gate_up_bn=8),
           rep(d, gate_up_bn=32, gate_up_gb=8, gate_up_warps=8, down_bn=128, down_warps=8),
           rep(d, down_bn=32, down_gb=gb_dn)]
    # round 3: around the current pick, one kernel's tile at a time (the other kept)
    b = D.default_decode_config(E, I, L)
    out += [rep(b, gate_up_bn=bn, gate_up_warps=w) for bn, w in ((4, 2), (4, 4), (8, 2), (8, 8), (16, 4))]
    out += [rep(b, down_bn=bn, down_warps=w) for bn, w in ((32, 2), (32, 4), (64, 2), (128, 4), (128, 8))]
    # round 4: gate_up split-K, one GB = 16 step per program (KS = L/32/16: 7 at L = 3584),
    # looped (ks = 1) beside it; then the down K loop unrolled (all I/32/GB steps in flight)
    # at the mappings that keep every program resident, and a 2-step slice (KS = 7 at GB 8)
    ks1 = (L // 32) // 16
    out += [rep(b, gate_up_gb=16, gate_up_ks=ks, gate_up_bn=bn, gate_up_warps=w)
            for ks in (1, ks1) for bn in (4, 8, 16) for w in (2, 4)]
    s = rep(b, gate_up_gb=16, gate_up_ks=ks1)
    out += [rep(s, down_unroll=True, down_bn=bn, down_warps=w)
            for bn, w in ((64, 4), (64, 2), (128, 4), (32, 2))]
    out += [rep(s, gate_up_gb=8, gate_up_bn=8, gate_up_warps=2),
            rep(s, gate_up_gb=8, gate_up_ks=2 * ks1, gate_up_bn=8, gate_up_warps=2)]
    return D.unique_valid(out, I, L)


def focused_candidates(E: int, I: int, L: int) -> list[D.DecodeConfig]:
    """Round 7: the TUNED config with the byte and the int32-word code reads (`words`), and
    the words variant at a wider gate_up tile, 4 down warps and the other down loop form.
    Round 11: the packed-fp16 decode (`f16x2`) on the TUNED tiles and on tiles that give a
    thread several rows of one group (its packed activations reused: ≈ 8 instead of ≈ 16
    SASS instructions per weight byte for 16 rows × 8 groups on one warp), crossed with
    three down tiles."""
    b = D.default_decode_config(E, I, L)
    rep = dataclasses.replace
    w = rep(b, words=True, f16x2=False)
    out = [b, rep(b, words=False, f16x2=False), w, rep(w, gate_up_bn=2 * b.gate_up_bn),
           rep(w, down_warps=4), rep(w, down_unroll=not b.down_unroll)]
    h = rep(w, f16x2=True)
    gate_up = [(h.gate_up_bn, h.gate_up_gb, h.gate_up_ks, h.gate_up_warps),
               (16, 8, L // 32 // 8, 1), (32, 4, L // 32 // 4, 1), (16, 16, L // 32 // 16, 2)]
    down = [(h.down_bn, h.down_warps), (64, 1), (128, 2)]
    out += [rep(h, gate_up_bn=bn, gate_up_gb=gb, gate_up_ks=ks, gate_up_warps=gw,
                down_bn=dbn, down_warps=dw, down_unroll=True)
            for bn, gb, ks, gw in gate_up for dbn, dw in down]
    return D.unique_valid(out, I, L)


def sweep(cfg_moe, tps=(16, 8), batches=(1,), calls: int = 12, seed: int = 0,
          log=print, focused: bool = True) -> list[dict]:
    E, L, k = cfg_moe.num_experts, cfg_moe.latent_size, cfg_moe.top_k
    rows = []
    for tp in tps:
        I = cfg_moe.expert_intermediate // tp
        bank = expert_bank(cfg_moe, tp, seed)
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for B in batches:
            if B * k > D.MAX_PAIRS:
                continue
            z, routes, touched, nbytes, ref = random_calls(bank, B, k, calls, gen)
            best = None
            stock = M.default_config(B * k, E, I, L)
            pick = focused_candidates if focused else candidates
            runs = [("stock", stock)] + [("decode", c) for c in pick(E, I, L)]
            for kind, c in runs:
                fn = ((lambda r, c=c: M.fused_moe_mxfp4_triton(z, *r, bank, c)) if kind == "stock"
                      else (lambda r, c=c: D.moe_mxfp4_decode(z, *r, bank, c)))
                row = {"tp": tp, "batch": B, "kernel": kind, "config": dataclasses.asdict(c),
                       "touched_experts": touched, "bytes_per_call": nbytes}
                us = check_and_time(fn, routes, ref, nbytes, row)
                if kind == "decode" and us is not None and (best is None or us < best[0]):
                    best = (us, c)
                rows.append(row)
                log(f"moe-decode sweep TP{tp} B={B} {kind:6s} {c}: "
                    + (f"{row['us']:7.1f} us {row['Bps'] / 1e12:5.2f} TB/s" if "us" in row
                       else row["error"]))
            if best is not None:        # reported; the tuned table changes by hand
                rows.append({"tp": tp, "batch": B, "chosen": dataclasses.asdict(best[1]),
                             "us": best[0]})
        bank = None
        torch.cuda.empty_cache()
    return rows
