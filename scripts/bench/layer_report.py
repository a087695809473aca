"""Predictions, plot and markdown table of the layer benchmark (no GPU needed).

Prediction (written before a run, models/params.py bytes): per layer and path,
    bytes_w   weights one rank reads: the attention block's projections + the MoE's router,
              latent down/up, shared experts and the expected distinct experts
              (`decode_reads`; balanced routing)
    bytes_s   caches and activations (AttnRes bank, KDA state and conv, MLA latent rows)
    µs        bytes_w / (e_w · HBM) + bytes_s / HBM + kernels · t_k
with e_w the read efficiency of the weight stream (cuBLAS GEMVs on these shapes and the Triton
MXFP4 MoE) and t_k the cost of one small dependent kernel inside a graph.
"""
from __future__ import annotations

from raydecode.models.config import K3Config
from raydecode.models.params import decode_reads

STATE_PIECES = ("attn_res", "conv", "gates", "state", "kv_cache", "topk")


def predicted_bytes(cfg: K3Config, tp: int, kind: str, batch: int, path: str,
                    context: int) -> dict:
    r = decode_reads(cfg, tp, path, seqs=batch, context=context)
    pieces = {**{f"{kind}.{k}": v.bytes for k, v in r[kind].items()},
              **{f"moe.{k}": v.bytes for k, v in r["moe"].items()}}
    w = sum(v for k, v in pieces.items() if k.split(".")[1] not in STATE_PIECES)
    s = sum(v for k, v in pieces.items() if k.split(".")[1] in STATE_PIECES)
    return {"weights": w, "state": s, "pieces": pieces}


def predicted_us(pb: dict, hbm: float, eff_w: float, kernels: int, t_kernel_us: float
                 ) -> float:
    return (pb["weights"] / (eff_w * hbm) + pb["state"] / hbm) * 1e6 + kernels * t_kernel_us


def plot(report: dict, path: str) -> None:
    """µs per layer vs batch: one panel per (TP, layer kind), stock and specialized, with the
    weight roofline of each (weight bytes / measured HBM read bandwidth) dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    rows = [r for r in rows if "us" in r]
    panels = sorted({(r["tp"], r["kind"]) for r in rows})
    if not panels:
        return
    ncol = min(2, len(panels))
    nrow = -(-len(panels) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(5.2 * ncol, 3.9 * nrow), squeeze=False)
    colors = {"stock": "tab:red", "specialized": "tab:blue"}
    for ax, (tp, kind) in zip(axes.flat, panels):
        for var in ("stock", "specialized"):
            pts = sorted((r["batch"], r["us"], r["roofline_us"]) for r in rows
                         if r["tp"] == tp and r["kind"] == kind and r["variant"] == var)
            if not pts:
                continue
            b = [p[0] for p in pts]
            ax.plot(b, [p[1] for p in pts], "o-", color=colors[var], label=f"{var}")
            ax.plot(b, [p[2] for p in pts], "--", color=colors[var], alpha=0.6,
                    label=f"{var} roofline")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (sequences, 1 token each)")
        ax.set_ylabel("µs per layer")
        ax.set_title(f"TP{tp} per-rank, {kind.upper()} layer + latent MoE")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"K3 decode layer on one {report.get('gpu', 'GPU')} "
                 f"(commit {str(report.get('commit', '?'))[:10]}, {report.get('date', '')[:10]})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown_table(report: dict) -> str:
    """One row per (TP, kind, batch): stock and specialized µs, their ratio, kernels, weight
    MB and fraction of the measured HBM read bandwidth."""
    rows = [r for r in report["results"] if "us" in r]
    by = {(r["tp"], r["kind"], r["batch"], r["variant"]): r for r in rows}
    keys = sorted({(r["tp"], r["kind"], r["batch"]) for r in rows})
    out = ["| TP | layer | batch | stock µs | spec µs | stock/spec | kernels st/sp | "
           "weight MB st/sp | HBM frac st/sp |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for tp, kind, b in keys:
        s, p = by.get((tp, kind, b, "stock")), by.get((tp, kind, b, "specialized"))
        if not s or not p:
            continue

        def k(r):
            return f"{r['kernels']:.0f}" if r.get("kernels") is not None else "?"
        out.append(f"| {tp} | {kind} | {b} | {s['us']:.1f} | {p['us']:.1f} | "
                   f"{s['us'] / p['us']:.2f}× | {k(s)}/{k(p)} | "
                   f"{s['weight_bytes'] / 1e6:.0f}/{p['weight_bytes'] / 1e6:.0f} | "
                   f"{s['fraction_of_hbm']:.2f}/{p['fraction_of_hbm']:.2f} |")
    return "\n".join(out)


# ---- the written-down prediction (docs/PERF.md) --------------------------------------------

T_KERNEL_US = 1.5          # one small dependent kernel inside a graph (DESIGN §4: ~1.2 µs)
MOE_EFF = 0.5              # Triton MXFP4 MoE: e2m1 decode is ALU work on Hopper (no FP4 cvt)
GEMV_FLOOR_US = 5.2        # cuBLAS M ≤ 64 on a small matrix (gemv-h200 run 1: q_b 5.2–5.7 µs)
OTHER_KERNELS = {"kda": 80, "mla": 75}   # non-GEMM kernels per layer (CPU op count of the step)


def _gemm_list(cfg: K3Config, tp: int, kind: str, path: str) -> list[tuple[int, int]]:
    """(N, K) of the step's bf16 GEMMs for one rank and path (models/params.py shapes)."""
    from raydecode.models.params import decode_gemv_shapes
    s = decode_gemv_shapes(cfg, tp, path)
    names = (["kda_in_proj", "kda_f_b", "kda_o_proj"] if kind == "kda"
             else ["fused_qkv_a", "q_b", "g_proj", "o_proj"])
    names += ["router", "latent_down", "latent_up", "shared_gate_up", "shared_down"]
    return [s[n] for n in names]


def _cublas_us(table: dict, N: int, K: int, M: int, hbm: float) -> float:
    """cuBLAS µs for (N, K) at batch M from a gemv benchmark run (nearest measured M ≥ M),
    else max(floor, bytes / (0.6 · HBM) + 2 µs)."""
    ms = sorted(m for (n, k, m) in table if (n, k) == (N, K))
    if ms:
        m = next((x for x in ms if x >= M), ms[-1])
        return table[(N, K, m)]
    return max(GEMV_FLOOR_US, 2 * N * K / (0.6 * hbm) * 1e6 + 2.0)


def predict(cfg: K3Config, tp: int, kind: str, batch: int, path: str, context: int,
            hbm: float, cublas: dict) -> dict:
    """Predicted µs per layer: Σ cuBLAS GEMMs (measured table) + MoE experts at MOE_EFF of
    HBM + caches at HBM + OTHER_KERNELS · T_KERNEL_US."""
    pb = predicted_bytes(cfg, tp, kind, batch, path, context)
    gemm = sum(_cublas_us(cublas, N, K, batch, hbm) for N, K in _gemm_list(cfg, tp, kind, path))
    ex = pb["pieces"]["moe.experts_gate_up"] + pb["pieces"]["moe.experts_down"]
    moe = ex / (MOE_EFF * hbm) * 1e6 + 3 * T_KERNEL_US
    other = pb["state"] / hbm * 1e6 + OTHER_KERNELS[kind] * T_KERNEL_US
    return {"us": gemm + moe + other, "gemm_us": gemm, "moe_us": moe, "other_us": other,
            "weights": pb["weights"], "roofline_us": pb["weights"] / hbm * 1e6}


def load_cublas_table(path: str) -> dict:
    """{(N, K, M): cuBLAS µs} from a scripts/bench/gemv.py result file."""
    import json
    d = json.load(open(path))
    return {(r["N"], r["K"], r["M"]): r["cublas_us"] for r in d["results"] if "cublas_us" in r}


def prediction_table(cfg: K3Config, cublas: dict, hbm: float, context: int,
                     batches=(1, 8, 64)) -> str:
    out = ["| TP | layer | batch | weight MB st/sp | roofline µs st/sp | predicted µs st/sp | "
           "predicted stock/spec |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for tp in (8, 16):
        for kind in ("kda", "mla"):
            for b in batches:
                s, p = (predict(cfg, tp, kind, b, v, context, hbm, cublas)
                        for v in ("stock", "specialized"))
                out.append(f"| {tp} | {kind} | {b} | {s['weights'] / 1e6:.0f}/"
                           f"{p['weights'] / 1e6:.0f} | {s['roofline_us']:.0f}/"
                           f"{p['roofline_us']:.0f} | {s['us']:.0f}/{p['us']:.0f} | "
                           f"{s['us'] / p['us']:.2f}× |")
    return "\n".join(out)
