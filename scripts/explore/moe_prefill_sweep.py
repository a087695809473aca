"""The stock grouped MXFP4 MoE at prefill pair counts: tile / block_m / warps candidates on K3
per-rank expert shapes (GPU), to pick kernels/moe_mxfp4.py's PREFILL_TUNED entries.

    python3 -m raydecode.scripts.explore.moe_prefill_sweep --out X.json [--tp 16] \
        [--tokens 4096,8192] [--profile]
        [--candidates all|base|pairs|swap|shipped|order|split|grouped|tiles|blocked|ogs|x2|warps|
                      prefetch|down|situ]

At a prefill step's thousands of tokens every expert gets tens to hundreds of pairs (K3 top-16
of 896: 73 per expert at 4,096 tokens, 146 at 8,192) and each program of the gate/up kernel
dequantizes its expert's MXFP4 tile once per `block_m` pairs: with 64-pair chunks the
dequantization (integer ops per weight element) costs more than the bf16 dots it feeds. The
candidates trade that against padding (a chunk of 73 pairs in a 128-row tile) and registers
(block_m × BN fp32 accumulators, twice for gate and up). `--candidates swap`: the swapped
kernels (`MoEConfig.swap_ab`: the decoded weight tile as the dots' register operand, chunks
of 64-256 pairs) against the unswapped 64-pair kernels; `shipped`: `prefill_config` alone;
`order`: the grid order (`MoEConfig.tile_major`), chunk-major first as the baseline;
`split`: gate and up rows as separate one-accumulator tiles (`MoEConfig.split_gate_up`,
shipped since the 1.13× of moe-prefill-sweep-h100-2026-12-06-split.json) against the fused
form (first, the baseline); `tiles`: the split kernels' BN (64 or 128 weight rows: how
often a chunk's activation rows are re-read) against block_m (64-256 pairs: padding against
decodes per pair); `blocked`: chunks of ≤ 256 pairs in 64-pair sub-blocks that share each
decoded weight tile (`MoEConfig.blocked`: one decode per expert and 64-pair padding; with
blocked_down False the swapped down kernel; down_tiles 4 / 8: output tiles per down
program) against the shipped kernels; `grouped`: the weights decoded once per call to
bf16, then `torch._grouped_mm` (`MoEConfig.grouped_bf16`, kernels/moe_grouped.py) against
the shipped kernels (first, the baseline); `ogs`: Triton's triton_kernels `matmul_ogs`
(kernels/moe_ogs.py) on the same weights, zero-copy ("strided") and converted to its Hopper
layouts ("hopper"), against split and blocked (the two forms "auto" picks between);
`warps`: the form "auto" runs at 8,192 tokens (hybrid, x2 decode) against its warps (8 for
both kernels or the down alone), 4 stages, 128-row gate/up tiles and 128-pair chunks;
`prefetch`: hybrid and split, each without and with `prefetch_scales` (the group scales of
k step i + 1 loaded in step i); `down`: the 8k form (hybrid) with its swapped down kernel at
64 weight rows per program (the form before c96298f, the baseline) against 128, shipped (BN:
each 128-pair chunk's (128, I) `a` block is read from L2 once per output tile, L / BN times:
4.4 GB per 8,192-token call at BN 64), on 4 or 8 warps, BK 64 or 32; `situ`: the `down` rows
and the gate/up kernel storing SiTU(gate, up) itself (`MoEConfig.fuse_situ`), with the down
kernel at BN 64 and at 128.

Per (tokens, candidate): `fused_moe_mxfp4_triton` on balanced random routing (top-16 of
uniform scores), one call of all the tokens' pairs (`routed_moe` splits at MAX_FUSED_PAIRS;
the rows at 8,192 tokens say what one call of all pairs would give), CUDA-event median of
`--reps` calls after one warm call (the compile). Each candidate is checked against the
baseline's output (‖Δ‖ / ‖ref‖ < 1e-2; the baseline against `moe_mxfp4_reference` at the
smallest token count). TFLOP/s counts 2·P·(2·I·L + L·I) (gate, up, down of every pair).
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from raydecode.kernels import moe_mxfp4 as M
from raydecode.models.config import load_config
from raydecode.scripts.bench.report_io import report_header, write_report
from raydecode.scripts.explore.common import kernel_ms, median_cuda_ms, rel_err, unique


def _blocked_form(sh: M.MoEConfig, L: int) -> M.MoEConfig:
    """The blocked kernels as "auto" ran them past 128 pairs per expert before "hybrid"
    (≤ 256-pair chunks, 128-row down tiles), on sh's decode."""
    return dataclasses.replace(sh, blocked=True, block_m=256,
                               gate_up_bk=M._largest_block(L, 64), down_bn=128)


def _hybrid(L: int, I: int, pf: bool) -> M.MoEConfig:
    """The form "auto" runs past 128 pairs per expert (hybrid: blocked gate/up, swapped down)
    with the shipped decode; pf: the scales a k step ahead (auto's since f788504)."""
    return dataclasses.replace(M._prefill_config("hybrid", L, I, 0, 0),
                               decode=M.PREFILL_DECODE, prefetch_scales=pf)


def candidates(L: int, I: int, which: str = "all") -> list[M.MoEConfig]:
    rep = dataclasses.replace
    # the fused gate/up form (two accumulators per program; prefill_config before the split)
    fused = rep(M.prefill_config(L, I), split_gate_up=False, gate_up_bk=M._largest_block(L, 64))
    # the baseline: the unswapped kernels on 64-pair chunks (the prefill config before swap_ab)
    base = rep(fused, swap_ab=False, block_m=64, decode="elementwise")
    if which == "base":
        return [base]
    if which == "shipped":          # what a prefill step runs (e.g. one config under ncu)
        return [M.prefill_config(L, I)]
    if which == "split":            # gate and up as separate tiles: one accumulator per program
        sw = fused                  # the baseline: the fused form
        return unique([sw, rep(sw, split_gate_up=True),
                       rep(sw, split_gate_up=True, num_stages=4),
                       rep(sw, split_gate_up=True, block_m=256),
                       rep(sw, split_gate_up=True, block_m=256, num_stages=2),
                       rep(sw, split_gate_up=True, block_m=256, num_warps=8),
                       rep(sw, split_gate_up=True, gate_up_bk=M._largest_block(L, 128))])
    if which == "tiles":            # the split kernels' output tile (BN: weight rows, the
        sh = M.prefill_config(L, I)  # activation re-reads) against block_m (padding, decodes)
        return unique([sh, rep(sh, block_m=64), rep(sh, block_m=64, gate_up_bn=128),
                       rep(sh, block_m=64, gate_up_bn=128, down_bn=128),
                       rep(sh, gate_up_bn=128), rep(sh, down_bn=128),
                       rep(sh, block_m=256, gate_up_bk=M._largest_block(L, 64)),
                       rep(sh, block_m=64, num_stages=4),
                       rep(sh, gate_up_bn=128, num_warps=8, down_warps=4),
                       rep(sh, block_m=64, gate_up_bn=128, num_warps=8, down_warps=4),
                       rep(sh, block_m=256, gate_up_bk=M._largest_block(L, 64),
                           gate_up_bn=128, num_warps=8, down_warps=4)])
    if which == "blocked":          # 64-pair sub-blocks sharing one decode (`blocked`)
        sh = M.prefill_config(L, I)
        bl = rep(sh, blocked=True, block_m=256, gate_up_bk=M._largest_block(L, 64))
        return unique([sh, bl, rep(bl, blocked_down=False), rep(bl, down_tiles=4),
                       rep(bl, down_tiles=8), rep(bl, down_bn=128)])
    if which == "ogs":              # Triton's triton_kernels matmul_ogs (kernels/moe_ogs.py)
        sh = M.prefill_config(L, I)  # against split and blocked
        return [sh, _blocked_form(sh, L), rep(sh, ogs="strided"), rep(sh, ogs="hopper")]
    if which == "x2":               # the x2 decode (8 codes per word, bf16x2) in split and
        sh = rep(M.prefill_config(L, I), decode="elementwise")     # blocked against the
        bl = _blocked_form(sh, L)    # elementwise one (the baseline, first), and matmul_ogs's
        return [sh, bl, rep(sh, decode="x2"), rep(bl, decode="x2"), rep(sh, ogs="hopper")]
    if which == "warps":            # the shipped 8k form (hybrid, x2) against its warps,
        hy = _hybrid(L, I, pf=False)     # stages and tiles (swept before x2 made the decode
                                         # cheaper)
        return [hy, rep(hy, num_warps=8), rep(hy, down_warps=8), rep(hy, num_stages=4),
                rep(hy, num_warps=8, gate_up_bn=128, down_warps=4), rep(hy, block_m=128)]
    if which == "prefetch":         # the scales a k step ahead (`prefetch_scales`) in the
        hy = _hybrid(L, I, pf=False)     # two forms "auto" runs: hybrid (first: the baseline)
        sp = rep(M.prefill_config(L, I), prefetch_scales=False)       # and split
        return [hy, rep(hy, prefetch_scales=True), sp, rep(sp, prefetch_scales=True)]
    if which == "down":             # the swapped down kernel's weight rows per program: each
        hy = _hybrid(L, I, pf=True)      # chunk's `a` block is re-read from L2 L / BN times;
        b64 = rep(hy, down_bn=64)        # 64 (the form before c96298f) first, the baseline
        return [b64, hy, rep(hy, down_warps=8), rep(hy, down_bk=32)]
    if which == "situ":             # SiTU in the blocked gate/up's epilogue (`fuse_situ`: no
        hy = _hybrid(L, I, pf=True)      # gu buffer, no SiTU pass)
        return candidates(L, I, "down") + [rep(hy, fuse_situ=True, down_bn=64),
                                           rep(hy, fuse_situ=True)]
    if which == "grouped":          # decode once, bf16 grouped GEMMs: against the shipped
        return [M.prefill_config(L, I), rep(M.prefill_config(L, I), grouped_bf16=True)]
    if which == "order":            # the grid order: chunk-major (first, the baseline) or not
        sw = fused
        return unique([rep(sw, tile_major=False), rep(sw, tile_major=True),
                       rep(sw, tile_major=True, block_m=256, num_warps=8, num_stages=2),
                       rep(sw, tile_major=True, num_stages=2),
                       rep(base, tile_major=True)])
    out = [base,
           rep(base, num_warps=8),
           rep(base, gate_up_bk=M._largest_block(L, 128)),
           rep(base, down_bn=128, num_warps=8),
           rep(base, block_m=128, num_warps=8),
           rep(base, block_m=128, num_warps=8, down_bn=128),
           rep(base, block_m=128, num_warps=8, num_stages=4),
           rep(base, block_m=128, num_warps=8, gate_up_bk=M._largest_block(L, 128)),
           rep(base, block_m=128, num_warps=4, gate_up_bn=32),
           rep(base, decode="pairs"),
           rep(base, decode="pairs", num_stages=4),
           rep(base, decode="pairs", gate_up_bk=M._largest_block(L, 128)),
           rep(base, decode="pairs", block_m=128, num_warps=8)]
    if which == "pairs":
        return [base] + [c for c in out if c.decode == "pairs"]
    # swapped operands: BN is the dots' M (64 rows per warpgroup), block_m their N
    sw = fused
    swap = [sw,
            rep(sw, num_stages=4),
            rep(sw, num_stages=2),
            rep(sw, num_warps=8),
            rep(sw, gate_up_bk=M._largest_block(L, 128)),
            rep(sw, block_m=64),
            rep(sw, block_m=256, num_warps=8),
            rep(sw, block_m=256, num_warps=8, num_stages=2),
            rep(sw, gate_up_bn=128, down_bn=128, num_warps=8),
            rep(sw, down_bn=128, num_warps=8),
            rep(sw, down_bk=M._largest_block(I, 32))]
    if which == "swap":
        return [base] + unique(swap)
    return unique(out + swap)


def run(tp: int, tokens: list[int], which: str, reps: int, seed: int, log=print,
        profile: bool = False) -> list[dict]:
    m = load_config("k3").moe
    E, L, I, k = m.num_experts, m.latent_size, m.expert_intermediate // tp, m.top_k
    bank = M.MXFP4Experts.random(E, L, I, 4.0, 25.0, fan_in_13=L, fan_in_2=m.expert_intermediate,
                                 device="cuda", seed=seed + tp)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = []
    for T in tokens:
        z = torch.randn(T, L, generator=gen, device="cuda").to(torch.bfloat16)
        w, ids = torch.rand(T, E, generator=gen, device="cuda").topk(k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).float()
        P = T * k
        flops = 2.0 * P * (3 * I * L)
        ref = None
        for c in candidates(L, I, which):
            row = {"tp": tp, "tokens": T, "pairs": P, "config": dataclasses.asdict(c)}
            try:
                t0 = time.time()
                out = M.fused_moe_mxfp4_triton(z, w, ids, bank, c)
                torch.cuda.synchronize()
                row["first_call_s"] = round(time.time() - t0, 2)
                if ref is None:            # the baseline: against the PyTorch reference once
                    if T == min(tokens):
                        row["rel_err_vs_reference"] = rel_err(
                            out, M.moe_mxfp4_reference(z, w, ids, bank))
                        if not row["rel_err_vs_reference"] < 1e-2:
                            raise AssertionError(f"baseline rel err "
                                                 f"{row['rel_err_vs_reference']:.3g}")
                    ref = out
                else:
                    row["rel_err_vs_baseline"] = rel_err(out, ref)
                    if not row["rel_err_vs_baseline"] < 1e-2:
                        raise AssertionError(f"rel err {row['rel_err_vs_baseline']:.3g}")
                ms = median_cuda_ms(lambda c=c: M.fused_moe_mxfp4_triton(z, w, ids, bank, c), reps,
                                    warm=False)
                row.update(ms=ms, tflop_s=flops / (ms * 1e-3) / 1e12)
                if profile:            # where the call's time goes, kernel by kernel
                    row["kernel_ms"] = kernel_ms(
                        lambda c=c: M.fused_moe_mxfp4_triton(z, w, ids, bank, c))
                    log(f"  kernels: {row['kernel_ms']}")
            except Exception as e:       # compile / run / accuracy failure: recorded, skipped
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            log(f"moe prefill TP{tp} T={T} {'grouped-bf16 ' if c.grouped_bf16 else ''}"
                f"{f'matmul_ogs-{c.ogs} ' if c.ogs else ''}"
                f"{('blocked ' if c.blocked_down else 'blocked-gu ') if c.blocked else ''}"
                f"bm{c.block_m}{'s' if c.swap_ab else ''}{'t' if c.tile_major else ''}"
                f"{'g' if c.split_gate_up else ''} "
                f"{c.decode:11s} gu{c.gate_up_bn}x"
                f"{c.gate_up_bk} dn{c.down_bn}x{c.down_bk}"
                f"{f'x{c.down_tiles}t' if c.down_tiles > 1 else ''} w{c.num_warps}"
                f"{f'/{c.down_warps}' if c.down_warps else ''} s{c.num_stages}: "
                + (f"{row['ms']:7.3f} ms {row['tflop_s']:6.1f} TFLOP/s" if "ms" in row
                   else row["error"]))
        ok = [r for r in rows if r["tokens"] == T and "ms" in r]
        if ok:
            best = min(ok, key=lambda r: r["ms"])
            rows.append({"tp": tp, "tokens": T, "chosen": best["config"], "ms": best["ms"],
                         "baseline_ms": ok[0]["ms"], "speedup": ok[0]["ms"] / best["ms"]})
            log(f"moe prefill TP{tp} T={T}: best {best['ms']:.3f} ms vs baseline "
                f"{ok[0]['ms']:.3f} ms ({ok[0]['ms'] / best['ms']:.2f}x)")
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--tp", type=int, default=16)
    ap.add_argument("--tokens", default="4096,8192")
    ap.add_argument("--candidates", default="all",
                    choices=["all", "base", "pairs", "swap", "shipped", "order",
                             "split", "grouped", "tiles", "blocked", "ogs", "x2", "warps", "prefetch",
                             "down", "situ"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true",
                    help="also each candidate's device ms per kernel (torch.profiler)")
    a = ap.parse_args(argv)
    t0 = time.time()
    report = report_header(a.commit, tp=a.tp, method=__doc__, rows=[])
    report["rows"] = run(a.tp, [int(x) for x in a.tokens.split(",")], a.candidates, a.reps,
                         a.seed, profile=a.profile)
    write_report(report, a.out, t0)


if __name__ == "__main__":
    main()
