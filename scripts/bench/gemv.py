"""Decode GEMV benchmark: CuTe kernel vs cuBLAS (F.linear) on K3 per-rank matrices (GPU only).

    python -m raydecode.scripts.bench.gemv --out OUT.json --commit SHA [--sweep] [--ms 1,2,8,32,64]

Method (docs/PERF.md): every variant runs inside a CUDA graph of back-to-back GEMVs that rotate
over enough distinct weight copies (> 3× the 60 MB L2 together) that no weight is served from L2;
per-GEMV time = median over graph replays / GEMVs per graph. The HBM read bandwidth is measured
in the same run with a large read-only reduction, and each GEMV's weight bytes/s is reported as a
fraction of it. Each CuTe result is checked against the fp64 reference before it is timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from raydecode.kernels import gemv as G
from raydecode.kernels import linear as LN

from .report_io import report_header, write_report

L2_BYTES = 60 * 2**20
ROTATE_BYTES = 3 * L2_BYTES + 16 * 2**20  # > 3× L2 across the rotating copies

# (name, N, K, tp): K3 per-rank matrices (N×K bf16); tp "16/8" when replicated.
SHAPES = [
    ("q_b", 1152, 1536, "16"),
    ("q_b", 2304, 1536, "8"),
    ("fused_qkv_a", 2112, 7168, "16/8"),
    ("kda_in_proj", 3216, 7168, "16"),
    ("kda_in_proj", 6288, 7168, "8"),
    ("o_proj", 7168, 768, "16"),
    ("o_proj", 7168, 1536, "8"),
    ("latent_down", 3584, 7168, "16/8"),
    ("latent_up", 7168, 3584, "16/8"),
    ("router", 896, 7168, "16/8"),
    ("shared_gate_up", 768, 7168, "16"),
    ("shared_gate_up", 1536, 7168, "8"),
    ("shared_down", 7168, 384, "16"),
    ("shared_down", 7168, 768, "8"),
    ("lm_head", 10240, 7168, "16"),
    ("lm_head", 20480, 7168, "8"),
    ("big", 16384, 7168, "-"),
    # the packed GEMVs of the specialized step (models/moe.py _h2_proj, _ffn_out; models/mla.py _qkv_a_g)
    ("h2_proj", 1048, 7168, "16"),
    ("h2_proj", 2096, 7168, "8"),
    ("ffn_out", 7168, 640, "16"),
    ("ffn_out", 7168, 1280, "8"),
    ("qkv_a_g", 900, 7168, "16"),
    ("qkv_a_g", 1800, 7168, "8"),
]


def graph_time_us(fn_list, replays: int = 15, warm: int = 3) -> float:
    """Median µs per call of fn_list (one graph holding every call, replayed `replays` times)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture (compiles, cuBLAS handles, workspaces)
        for fn in fn_list[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fn_list:
            fn()
    for _ in range(warm):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(fn_list))
    del g
    return statistics.median(times)


def hbm_read_bandwidth() -> dict:
    """Read-only reduction over 2 × 2 GiB fp32 buffers in a graph: bytes read / s."""
    n = 2**29  # 2 GiB of fp32 each
    bufs = [torch.randn(n, device="cuda") for _ in range(2)]
    outs = [torch.empty((), device="cuda") for _ in range(2)]
    calls = [lambda i=i: torch.sum(bufs[i % 2], dim=0, out=outs[i % 2]) for i in range(8)]
    us = graph_time_us(calls, replays=7)
    read = n * 4 / (us * 1e-6)
    src, dst = bufs[0], torch.empty_like(bufs[0])
    copy_us = graph_time_us([lambda: dst.copy_(src)] * 4, replays=7)
    del bufs, dst
    torch.cuda.empty_cache()
    return {"read_reduction_bytes_per_s": read, "copy_read_plus_write_bytes_per_s": 2 * n * 4 / (copy_us * 1e-6)}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def bench_shape(N: int, K: int, M: int, configs, check: bool = True) -> dict:
    """Time cuBLAS and the CuTe kernel (each given config) on one shape; returns µs per GEMV."""
    wbytes = G.weight_bytes(N, K)
    copies = max(2, math.ceil(ROTATE_BYTES / wbytes))
    calls_per_graph = max(copies, 32)
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    res = {"N": N, "K": K, "M": M, "weight_bytes": wbytes, "copies": copies, "calls_per_graph": calls_per_graph}
    res["cublas_us"] = graph_time_us([lambda i=i: F.linear(x, ws[i % copies]) for i in range(calls_per_graph)])
    ref = x.double() @ ws[0].double().t()
    res["cublas_rel_err"] = rel_err(F.linear(x, ws[0]), ref)
    res["cute"] = []
    for cfg in configs:
        entry = {"config": cfg.__dict__ | {"batch_eff": cfg.batch_for(K)}}
        try:
            t0 = time.time()
            G.gemv_into(x, ws[0], y, cfg)  # compiles on first use
            torch.cuda.synchronize()
            entry["compile_s"] = time.time() - t0
            if check:
                y.fill_(float("nan"))
                G.gemv_into(x, ws[1], y, cfg)
                torch.cuda.synchronize()
                entry["rel_err"] = rel_err(y, x.double() @ ws[1].double().t())
                entry["all_finite"] = bool(torch.isfinite(y).all())
                if not entry["all_finite"] or entry["rel_err"] > 1e-2:
                    entry["error"] = "wrong result: not timed"
                    res["cute"].append(entry)
                    continue
            entry["us"] = graph_time_us([lambda i=i: G.gemv_into(x, ws[i % copies], y, cfg) for i in range(calls_per_graph)])
        except Exception as e:  # a config that fails to compile/run is recorded, not fatal
            entry["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        res["cute"].append(entry)
    if res["cute"] and "us" in res["cute"][0]:  # same version timed twice: the run-to-run spread
        cfg = configs[0]
        res["cute_repeat_us"] = graph_time_us([lambda i=i: G.gemv_into(x, ws[i % copies], y, cfg) for i in range(calls_per_graph)])
    del ws
    torch.cuda.empty_cache()
    return res


def sweep_configs(M: int, N: int, K: int, limit: int) -> list:
    """The production mapping (`config_for`) first, then up to limit-1 others: one per (split-K
    warps, rows per group), ranked by how close their warp count is to half the H200's 132 × 64
    warp slots. Each mapping is returned with PDL off and on."""
    base = dataclasses.replace(G.config_for(M, N, K), pdl=False, l2_prefetch_mib=0)
    L = base.lanes_per_row
    per_lane = K // G.VEC // L
    out = []
    for KW in [d for d in range(1, 17) if per_lane % d == 0]:
        for R in (1, 2, 4):
            if base.m_tile * R > 8:
                continue
            for WR in (4, 2, 1):
                c = G.GemvConfig(L, KW, R, WR, base.m_tile)
                if KW * WR > 16 or c == base:
                    continue
                try:
                    c.validate(M, N, K)
                except ValueError:
                    continue
                out.append(c)
                break

    def warps(c):
        return (N // (c.groups_per_warp * c.rows_per_group)) * c.k_warps

    out.sort(key=lambda c: abs(math.log(max(1, warps(c)) / 4224)))
    picked = [base] + out[: max(0, limit - 1)]
    return [dataclasses.replace(c, pdl=p) for c in picked for p in (False, True)]


def _formatter(r: dict):
    def fmt(key, spec):
        v = r.get(key)
        return format(v, spec) if v is not None else "n/a"

    return fmt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--commit", default="unknown", help="git commit of the benchmarked tree")
    ap.add_argument("--ms", default="1,2,8,32,64", help="comma-separated M values")
    ap.add_argument("--cute-max-m", type=int, default=8, help="largest M timed on the CuTe kernel for every shape")
    ap.add_argument("--cute-big-m-shapes", default="7168x1536,3584x7168,16384x7168",
                    help="NxK shapes also timed on the CuTe kernel above --cute-max-m")
    ap.add_argument("--sweep", type=int, default=0, help="configs to try per shape at M ≤ 2 (0: default only)")
    ap.add_argument("--sweep-ms", default="1", help="M values swept")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop sweeping after this many seconds")
    ap.add_argument("--no-ffi", action="store_true", help="launch through DLPack + explicit stream")
    ap.add_argument("--shapes", default="", help="comma-separated NxK subset")
    ap.add_argument("--l2-prefetch-mibs", default="",
                    help="comma-separated entry-prefetch budgets (MiB): each PDL config is also timed "
                         "with each (GemvConfig.l2_prefetch_mib), reported under the `_pf` keys")
    args = ap.parse_args(argv)
    if args.no_ffi:
        G.FFI_DEFAULT = False
    t_start = time.time()
    import cutlass

    drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    report = report_header(
        args.commit, sm_count=torch.cuda.get_device_properties(0).multi_processor_count,
        driver_and_max_clocks=drv, cutlass_dsl=getattr(cutlass, "__version__", "?"),
        method="CUDA graph of back-to-back GEMVs over rotating weight copies (>3x L2), median "
               "of replays",
        ffi=G.FFI_DEFAULT)
    report["hbm"] = hbm_read_bandwidth()
    hbm = report["hbm"]["read_reduction_bytes_per_s"]
    print(f"HBM read (reduction) {hbm / 1e12:.2f} TB/s; copy r+w {report['hbm']['copy_read_plus_write_bytes_per_s'] / 1e12:.2f} TB/s", flush=True)
    ms = [int(m) for m in args.ms.split(",")]
    sweep_ms = {int(m) for m in args.sweep_ms.split(",") if m}
    big_m_shapes = {tuple(int(v) for v in s.split("x")) for s in args.cute_big_m_shapes.split(",") if s}
    subset = {tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s}
    pf_mibs = [int(m) for m in args.l2_prefetch_mibs.split(",") if m]
    rows = []
    done = set()
    for name, N, K, tp in SHAPES:
        if subset and (N, K) not in subset:
            continue
        for M in ms:
            key = (N, K, M)
            if key in done:
                rows.append({"name": name, "tp": tp, "same_as": f"{N}x{K} M={M}"})
                continue
            done.add(key)
            if M <= args.cute_max_m or (N, K) in big_m_shapes:
                over = time.time() - t_start > args.budget_s
                n_cfg = args.sweep if (M in sweep_ms and not over) else 1
                configs = sweep_configs(M, N, K, n_cfg)
                configs += [dataclasses.replace(c, l2_prefetch_mib=mib) for mib in pf_mibs
                            for c in configs if c.pdl]
            else:
                configs = []
            r = bench_shape(N, K, M, configs)
            r.update(name=name, tp=tp)
            r["linear_uses_cute"] = LN.linear_uses_cute(M, N, K)
            r["cublas_bytes_per_s"] = r["weight_bytes"] / (r["cublas_us"] * 1e-6)
            r["cublas_frac_hbm"] = r["cublas_bytes_per_s"] / hbm
            for tag, pdl, pf in (("", False, False), ("_pdl", True, False), ("_pf", True, True)):
                timed = [c for c in r["cute"] if "us" in c and c["config"]["pdl"] == pdl
                         and (c["config"]["l2_prefetch_mib"] > 0) == pf]
                best = min(timed, key=lambda c: c["us"]) if timed else None
                r[f"cute{tag}_us"] = best["us"] if best else None
                r[f"cute{tag}_best_config"] = best["config"] if best else None
                if best:
                    r[f"cute{tag}_bytes_per_s"] = r["weight_bytes"] / (best["us"] * 1e-6)
                    r[f"cute{tag}_frac_hbm"] = r[f"cute{tag}_bytes_per_s"] / hbm
                    r[f"speedup{tag}_vs_cublas"] = r["cublas_us"] / best["us"]
                    r[f"ratio{tag}_cute_over_cublas_time"] = best["us"] / r["cublas_us"]
            prod = [c for c in r["cute"] if c["config"] == dataclasses.asdict(G.config_for(M, N, K)) | {"batch_eff": c["config"].get("batch_eff")}]
            r["cute_production_us"] = prod[0].get("us") if prod else None
            r["predicted_floor_us_at_4p3"] = G.predicted_us(N, K)
            rows.append(r)
            fmt = _formatter(r)
            print(f"{name:14s} {N:5d}x{K:<4d} M={M:<2d} {r['weight_bytes'] / 1e6:6.1f}MB cublas {r['cublas_us']:7.2f} "
                  f"cute {fmt('cute_us', '7.2f')} ({fmt('cute_frac_hbm', '.2f')}, {fmt('speedup_vs_cublas', '.2f')}x) "
                  f"pdl {fmt('cute_pdl_us', '7.2f')} ({fmt('cute_pdl_frac_hbm', '.2f')}, {fmt('speedup_pdl_vs_cublas', '.2f')}x) "
                  f"pf {fmt('cute_pf_us', '7.2f')} ({fmt('cute_pf_frac_hbm', '.2f')}) "
                  f"t={time.time() - t_start:.0f}s", flush=True)
            write_report(report | {"results": rows}, args.out)  # partial, if cut short
    report["results"] = rows
    write_report(report, args.out, t_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
