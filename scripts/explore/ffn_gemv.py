"""FFN-out GEMV with the latent norm + SiTU prologue: the fused kernel vs the pair it replaces,
at K3 per-rank shapes (GPU only).

    python3 -m raydecode.scripts.explore.ffn_gemv --out X.json --commit SHA [--ts 1,2,4,8]

Variants per (TP, T), each timed in a CUDA graph of back-to-back calls that rotate over enough
distinct W copies (> 3× the H200's 50 MB L2 together) that no weight is served from L2;
µs per call = median replay / calls (layer_timing.GraphTimer, which also counts the graph's
kernel nodes per call):
  (a) pair:  latent_norm_situ → x (T, K), then kernels/gemv.linear(x, W) (the specialized
             step today: the CuTe GEMV where `linear_uses_cute`, else cuBLAS; F.linear when
             the CuTe DSL is not installed — the JSON says which)
  (b) fused: kernels/ffn_gemv_triton.norm_situ_gemv (one launch): the CuTe form
             (kernels/gemv_norm_situ.py) where it serves (`supports`; `fused_form` says which), else
             the Triton kernel (W's zero-pad columns unread)
  (c) gemv:  the GEMV of (a) alone on a ready x (how much of (a) is the norm kernel)
  (d) fused_triton: the Triton kernel alone (an explicit config), beside (b)
(b) is checked against latent_norm_situ_reference + F.linear (NaN-poisoned output, rel err
≤ 4e-3) before it is timed. Bytes/s are W bytes each variant reads / time; `frac_hbm` divides
by 4.8e12 (H200 nominal). `--sweep` also times other (BN, warps) configs of (b).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from raydecode.kernels.experimental import ffn_gemv_triton as FG
from raydecode.kernels import gemv as G
from raydecode.kernels import linear as LN
from raydecode.kernels import gemv_norm_situ as NS
from raydecode.kernels._cute import cute_available
from raydecode.kernels.decode_elementwise_triton import latent_norm_situ
from raydecode.models.config import load_config
from raydecode.models.params import ffn_out_k

from raydecode.scripts.bench.layer_timing import GraphTimer
from raydecode.scripts.bench.report_io import report_header, write_report

L2_BYTES = 50 * 2**20                  # H200
ROTATE_BYTES = 3 * L2_BYTES + 16 * 2**20
HBM_NOMINAL = FG.HBM_BYTES_PER_S       # 4.8e12
TOL = 4e-3
SWEEP = [(16, 4), (32, 8), (64, 4), (64, 8)]   # (block_n, num_warps) besides the default


def k3_shape(tp: int) -> dict:
    """Per-rank shapes of the ffn_out GEMV (models/moe.py `_ffn_out` builds its W)."""
    cfg = load_config("k3")
    m = cfg.moe
    n, I = m.latent_size // tp, m.shared_intermediate // tp
    return {"tp": tp, "D": m.latent_size, "n_cols": n, "I": I, "N": cfg.hidden_size,
            "K": ffn_out_k(n, I), "lead": m.num_experts // tp + n,
            "beta": cfg.situ_beta, "linear_beta": cfg.situ_linear_beta}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def bench_case(s: dict, T: int, timer: GraphTimer, sweep: bool, device: str = "cuda") -> dict:
    D, n, I, K, N = s["D"], s["n_cols"], s["I"], s["K"], s["N"]
    beta, lb, eps = s["beta"], s["linear_beta"], 1e-6
    g = torch.Generator(device=device).manual_seed(1000 * s["tp"] + T)
    lat = 3 * torch.randn(T, D, generator=g, device=device)
    w = 1 + 0.1 * torch.randn(D, generator=g, device=device)
    y2 = 4 * torch.randn(T, s["lead"] + 2 * I, generator=g, device=device)  # h2 GEMV out
    gu = y2[:, s["lead"]:]
    wbytes = 2 * N * K
    copies = max(2, math.ceil(ROTATE_BYTES / wbytes))
    calls = max(copies, 32)
    Ws = []
    for _ in range(copies):
        W = (torch.randn(N, K, generator=g, device=device) / K ** 0.5).to(torch.bfloat16)
        W[:, n + I:] = 0                                   # the zero pad, as models/moe.py _ffn_out
        Ws.append(W)
    x = torch.empty(T, K, dtype=torch.bfloat16, device=device)
    out = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device=device)
    row = {**s, "T": T, "weight_bytes": wbytes, "fused_read_bytes": FG.read_bytes(N, n, I),
           "copies": copies, "calls_per_graph": calls,
           "a_gemv": ("cute" if cute_available() and LN.linear_uses_cute(T, N, K)
                      else "cublas (F.linear)") + ("" if cute_available()
                                                   else ": CuTe DSL not installed"),
           "fused_uses_kernel": FG.uses_kernel(lat, n, gu, Ws[0], w),
           "fused_form": "cute" if FG.USE_CUTE and NS.supports(lat, w, n, gu, Ws[0], out)
           else "triton",
           "fused_config": FG.config_for(T, D).__dict__,
           "predicted_fused_us": FG.predicted_us(N, n + I)}
    # check (b) first
    FG.norm_situ_gemv(lat, w, eps, 0, n, gu, beta, lb, Ws[1], out=out)
    ref = FG.norm_situ_gemv_reference(lat, w, eps, 0, n, gu, beta, lb, Ws[1])
    row["fused_rel_err"] = _rel(out, ref)
    row["fused_all_finite"] = bool(torch.isfinite(out).all())
    if not row["fused_all_finite"] or row["fused_rel_err"] > TOL:
        row["error"] = "fused result wrong: not timed"
        return row

    def pair(i):
        LN.linear(latent_norm_situ(lat, w, eps, 0, n, gu, beta, lb, x), Ws[i % copies])

    def fused(i, cfg=None):
        FG.norm_situ_gemv(lat, w, eps, 0, n, gu, beta, lb, Ws[i % copies], out=out, config=cfg)

    latent_norm_situ(lat, w, eps, 0, n, gu, beta, lb, x)
    variants = {"a_pair": pair, "b_fused": fused,
                "c_gemv": lambda i: LN.linear(x, Ws[i % copies]),
                "d_fused_triton": lambda i: fused(i, FG.config_for(T, D))}
    for name, fn in variants.items():
        t = timer.run([lambda i=i, fn=fn: fn(i) for i in range(calls)])
        row[f"{name}_us"] = t.us_per_call
        row[f"{name}_us_min_max"] = [t.us_min, t.us_max]
        row[f"{name}_kernels_per_call"] = (t.nodes_per_call or {}).get("kernel")
    fused_bytes = wbytes if row["fused_form"] == "cute" else row["fused_read_bytes"]
    for v, nbytes in (("a_pair", wbytes), ("b_fused", fused_bytes),
                      ("c_gemv", wbytes), ("d_fused_triton", row["fused_read_bytes"])):
        row[f"{v}_bytes_per_s"] = nbytes / (row[f"{v}_us"] * 1e-6)
        row[f"{v}_frac_hbm"] = row[f"{v}_bytes_per_s"] / HBM_NOMINAL
    row["saving_us"] = row["a_pair_us"] - row["b_fused_us"]
    row["b_fused_repeat_us"] = timer.run([lambda i=i: fused(i) for i in range(calls)]).us_per_call
    if sweep:
        row["sweep"] = []
        for bn, nw in SWEEP:
            cfg = FG.FusedGemvConfig(bn, nw, FG.config_for(T, D).block_d)
            ent = {"block_n": bn, "num_warps": nw}
            try:
                out.fill_(float("nan"))
                fused(1, cfg)
                ent["rel_err"] = _rel(out, ref)
                if ent["rel_err"] <= TOL:
                    ent["us"] = timer.run([lambda i=i: fused(i, cfg) for i in range(calls)]
                                          ).us_per_call
            except Exception as e:          # a config that fails to compile is recorded
                ent["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            row["sweep"].append(ent)
    Ws.clear()                                   # free the copies before the next case
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--commit", default="unknown", help="git commit of the benchmarked tree")
    ap.add_argument("--tps", default="16,8", help="tensor-parallel degrees (per-rank shapes)")
    ap.add_argument("--ts", default="1,2,4,8", help="tokens per call")
    ap.add_argument("--sweep", action="store_true", help="also time other (BN, warps) configs")
    ap.add_argument("--budget-s", type=float, default=45.0,
                    help="skip the remaining cases after this many seconds")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or FG.triton is None:
        print("ffn_gemv: needs a CUDA GPU and Triton", file=sys.stderr)
        return 2
    t0 = time.time()
    report = report_header(
        args.commit, sm_count=torch.cuda.get_device_properties(0).multi_processor_count,
        cute_dsl=cute_available(),
        method="CUDA graph of back-to-back calls over rotating W copies (>3x the 50 MB L2), "
               "median of replays / calls (layer_timing.GraphTimer)",
        hbm_nominal_bytes_per_s=HBM_NOMINAL, results=[])
    timer = GraphTimer(replays=15, warm=3)
    for tp in (int(v) for v in args.tps.split(",")):
        s = k3_shape(tp)
        for T in (int(v) for v in args.ts.split(",")):
            if time.time() - t0 > args.budget_s:
                report["results"].append({"tp": tp, "T": T, "skipped": "time budget"})
                continue
            row = bench_case(s, T, timer, args.sweep)
            report["results"].append(row)
            print(json.dumps({k: row.get(k) for k in (
                "tp", "T", "a_gemv", "fused_form", "a_pair_us", "b_fused_us", "c_gemv_us",
                "d_fused_triton_us", "saving_us",
                "b_fused_frac_hbm", "predicted_fused_us", "fused_rel_err",
                "a_pair_kernels_per_call", "b_fused_kernels_per_call", "error")}), flush=True)
            write_report(report, args.out)         # partial results survive a cut-short run
    write_report(report, args.out, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
