"""Skinny tensor-core GEMM (kernels/gemm_skinny_triton.py) vs cuBLAS at decode batches 3–64 on
K3 per-rank matrices (GPU only; docs/PERF.md §1.3).

    python -m raydecode.scripts.bench.skinny --out OUT.json --commit SHA [--ms 4,8,16,32,64]

Method: scripts/bench/gemv.py's. Each variant runs in a CUDA graph of back-to-back calls over
rotating weight copies (> 3× L2), µs per call = median over replays / calls; the HBM read
bandwidth is measured in the same run. Variants per (shape, M): cublas (F.linear, what
`gemv.linear` served for M > 2), skinny (`default_config`) and the `--candidates` configs
around it; each skinny config is checked against the fp64 product on a NaN-poisoned output
before it is timed. `cute_m1` is the CuTe GEMV at M = 1 on the same matrix: the floor a weight
stream of this matrix reaches in this harness.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time

import torch
import torch.nn.functional as F

from raydecode.kernels import gemm_skinny_triton as S
from raydecode.kernels import gemv as G

from .gemv import ROTATE_BYTES, SHAPES, graph_time_us, hbm_read_bandwidth, rel_err
from .report_io import report_header, write_report


def candidates(M: int, N: int, K: int) -> list[S.SkinnyConfig]:
    """The default, then BN 16 and BK 256 (each with its own K slices), twice the K slices,
    2 and 8 warps, a deeper pipeline, BN 64 (the wgmma tile)."""
    d = S.default_config(M, N, K)
    rep = dataclasses.replace
    out = [d, S.default_config(M, N, K, bn=16)]
    if K % 256 == 0:
        out.append(S.default_config(M, N, K, bk=256))
    out += [rep(d, ks=2 * d.ks), rep(d, warps=2), rep(d, warps=8), rep(d, stages=d.stages + 2),
           rep(d, bn=64)]
    seen, uniq = set(), []
    for c in out:
        try:
            c.validate(M, N, K)
        except ValueError:
            continue
        if c not in seen:
            seen.add(c)
            uniq.append(c)
    return uniq


def bench_shape(N: int, K: int, M: int, n_cands: int) -> dict:
    wbytes = G.weight_bytes(N, K)
    copies = max(2, math.ceil(ROTATE_BYTES / wbytes))
    calls = max(copies, 32)
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    x1 = x[:1].contiguous()
    y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    row = {"N": N, "K": K, "M": M, "weight_bytes": wbytes, "copies": copies, "calls": calls}
    row["cublas_us"] = graph_time_us([lambda i=i: F.linear(x, ws[i % copies])
                                      for i in range(calls)])
    if G.supports(x1, ws[0]):
        y1 = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
        cfg1 = G.config_for(1, N, K)
        row["cute_m1_us"] = graph_time_us([lambda i=i: G.gemv_into(x1, ws[i % copies], y1, cfg1)
                                           for i in range(calls)])
    ref = x.double() @ ws[1].double().t()
    row["skinny"] = []
    for cfg in candidates(M, N, K)[:n_cands]:
        entry = {"config": dataclasses.asdict(cfg)}
        try:
            t0 = time.time()
            S.skinny_gemm(x, ws[0], config=cfg, out=y)
            torch.cuda.synchronize()
            entry["compile_s"] = time.time() - t0
            y.fill_(float("nan"))
            S.skinny_gemm(x, ws[1], config=cfg, out=y)
            S.skinny_gemm(x, ws[1], config=cfg, out=y)      # twice: the counters reset
            torch.cuda.synchronize()
            entry["rel_err"] = rel_err(y, ref)
            if not bool(torch.isfinite(y).all()) or entry["rel_err"] > 1e-2:
                entry["error"] = "wrong result: not timed"
            else:
                entry["us"] = graph_time_us([lambda i=i: S.skinny_gemm(x, ws[i % copies],
                                                                       config=cfg, out=y)
                                             for i in range(calls)])
                entry["vs_cublas"] = row["cublas_us"] / entry["us"]
        except Exception as e:          # a config that fails to build or run: recorded
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        row["skinny"].append(entry)
    timed = [e for e in row["skinny"] if "us" in e]
    if timed:
        best = min(timed, key=lambda e: e["us"])
        row["best"] = best
        row["default_vs_cublas"] = row["skinny"][0].get("vs_cublas")
    del ws
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--ms", default="4,8,16,32,64")
    ap.add_argument("--tps", default="16", help="SHAPES rows whose tp column contains these")
    ap.add_argument("--names", default="kda_in_proj,o_proj,h2_proj,qkv_a_g,q_b,ffn_out",
                    help="SHAPES names to run (default: the served step's GEMVs)")
    ap.add_argument("--candidates", type=int, default=6, help="skinny configs per (shape, M)")
    ap.add_argument("--budget-s", type=float, default=400.0)
    args = ap.parse_args(argv)
    try:
        ms = [int(m) for m in args.ms.split(",")]
    except ValueError:
        ap.error(f"--ms {args.ms!r}: need comma-separated integers")
    bad = [m for m in ms if not S.MIN_M <= m <= S.MAX_M]
    if bad:
        ap.error(f"--ms {bad}: the skinny GEMM serves {S.MIN_M} ≤ M ≤ {S.MAX_M}")
    if not torch.cuda.is_available():
        print("skinny: needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    tps, names = args.tps.split(","), set(args.names.split(","))
    report = report_header(args.commit, method=__doc__.split("\n\n")[2].strip(), results=[])
    report["hbm"] = hbm = hbm_read_bandwidth()
    bw = hbm["read_reduction_bytes_per_s"]
    for name, N, K, tp in SHAPES:
        if not any(t in tp.split("/") for t in tps) or name not in names:
            continue
        for M in ms:
            if time.time() - t0 > args.budget_s:
                report["stopped"] = "budget"
                break
            row = bench_shape(N, K, M, args.candidates) | {"name": name, "tp": tp}
            row["floor_us"] = row["weight_bytes"] / bw * 1e6
            report["results"].append(row)
            write_report(report, args.out, t0)
            b, nan = row.get("best", {}), float("nan")
            print(f"[skinny] {name:15s} {N}x{K} M={M:<2} cublas {row['cublas_us']:6.2f}  "
                  f"cute_m1 {row.get('cute_m1_us', nan):6.2f}  default "
                  f"{row['skinny'][0].get('us', nan):6.2f}  best {b.get('us', nan):6.2f} "
                  f"{b.get('config', '')}  floor {row['floor_us']:.2f}", flush=True)
    write_report(report, args.out, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
