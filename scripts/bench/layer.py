"""Per-layer decode benchmark: one KDA and one MLA layer of K3 (each with its latent MoE, AttnRes
and norms) at the per-rank shapes of TP8 and TP16, one H200 playing rank 0 (GPU only).

    RAYDECODE_COMMIT=$(git rev-parse HEAD) python -m raydecode.scripts.bench.layer \
        --out bench/results/layer-h200-DATE.json --png bench/results/layer-h200-DATE.png \
        --moe-sweep --profile          # (the committed run; ~85 s on one H200)

Method (docs/PERF.md "Per-layer decode"):
- weights: random, per-rank shapes from the model built with Parallel(tp_rank=0, tp_size=TP);
  bf16, routed experts MXFP4 (uint8 codes + ue8m0 scales on the GPU, read by the Triton MoE);
- N distinct layer copies (weights + state) are run back to back inside ONE CUDA graph, so no
  weight is served from the 60 MB L2 (N · bytes ≥ 4 × L2 for the smallest case); µs per layer
  = median replay time / N;
- kernels per layer: kernel nodes of that graph / N (cudaGraphGetNodes), memcpy/memset nodes
  reported beside;
- bytes: the dense tensors the variant's step reads + distinct touched experts × expert bytes
  (from this run's routing); fraction_of_hbm = weight bytes / µs / HBM read bandwidth measured
  in the same run (large read-only reduction); `roofline_us` = weight bytes / HBM;
- collectives (no-ops on one GPU) are listed per layer with their byte sizes, never timed;
- before timing, the decode step is checked against the model's K3DecoderLayer (TP = 1, small
  config, scripts/bench/layer_check.py) on this GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics
import subprocess
import sys
import time

import torch

from raydecode.kernels import moe_mxfp4, moe_mxfp4_decode
from raydecode.kernels.experimental import l2_prefetch
from raydecode.kernels import settings
from raydecode.models.config import load_config
from raydecode.models.parallel import Parallel
from raydecode.models.params import decode_gemv_shapes

from .layer_report import markdown_table, plot, predicted_bytes
from .layer_step import gemv_linear
from .layer_step_spec import FFN_PATH, L2PF, L2PF_START_MIB, MLA_PATH, make_step
from .layer_timing import GraphTimer, hbm_read_bandwidth, profile_kernel_count
from .layer_weights import LayerState, LayerWeights, random_experts, random_params
from .options import add_decode_args, options_from_args
from .report_io import write_report

L2_BYTES = 60 * 2**20
DEVICE = "cuda"

VARIANTS = {
    "stock": ("PyTorch/cuBLAS ops (F.linear), fused_qkv_a / router / latent down+up read whole "
              "(replicated), KDA in_proj q|k|v|g|b|f_a fused, shared gate|up fused, separate "
              "RMSNorm / AttnRes / residual / gate ops, KDA recurrence as bmm + in-place "
              "updates, MLA absorbed attention as fp32-accumulated bmm, routed experts by the "
              "Triton fused grouped MoE over MXFP4 (kernels/moe_mxfp4.py)"),
    "specialized": ("round 3 (scripts/bench/layer_step_spec.py): fused_qkv_a / router / "
                    "latent down read 1/TP rows and latent up 1/TP columns (all-gathers of "
                    "qkv_a, router logits and z as memcpy stand-ins); GEMVs sharing an input "
                    "fused ([router|latent down|shared gate-up] fp32 out; [latent up|shared "
                    "down] over a concatenated K; MLA [qkv_a|g_proj]); bf16 projections "
                    "through kernels.gemv.linear (CuTe GEMV) for batch <= gemv_max_batch; "
                    "fused kernels: AttnRes mix + RMSNorm x2, router top-k, KDA decode (f_b, "
                    "gate, conv, L2 norms, delta rule, gated RMSNorm: one kernel), MLA as "
                    "mla_path says (r16: W_uk and the q_a norm folded into q_b, split-KV "
                    "attention over the paged cache with the q norm scale and the cache-row "
                    "write, merge/W_uv/gate; r9: + a kernel for rms scale, absorption and the "
                    "row), few-token MXFP4 expert GEMV for T*k <= 64 (the stock grouped "
                    "kernel above), latent RMSNorm + shared SiTU (or the ffn_out GEMV's "
                    "prologue, ffn_path)"),
}


def _env() -> dict:
    drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    env = {"gpu": torch.cuda.get_device_name(), "driver": drv.split(",")[0].strip(),
           "driver_and_max_clocks": drv, "torch": torch.__version__,
           "sm_count": torch.cuda.get_device_properties(0).multi_processor_count}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    from raydecode.kernels._cute import cute_available
    env["cute_available"] = cute_available()
    from raydecode.kernels._triton import PDL_DEFAULT
    env["triton_pdl"] = PDL_DEFAULT          # RAYDECODE_TRITON_PDL (kernels/_triton.py)
    from raydecode.kernels import gemv
    env["gemv_l2_prefetch_mib"] = gemv.L2_PREFETCH_MIB   # RAYDECODE_GEMV_L2_PREFETCH_MIB
    return env


def state_bytes(W: LayerWeights, S: LayerState, T: int, context: int) -> int:
    """Cache/activation bytes an ideal step moves: bank read by both mixes, KDA state and conv
    read + written once, or the MLA latent rows read once + the new row written."""
    H = W.cfg.hidden_size
    n1 = S.bank_in.shape[1]
    b = 2 * T * n1 * H * 2
    if W.kind == "kda":
        b += 2 * S.kda_rec[:T].numel() * 4 + 2 * S.kda_conv[:T].numel() * 2
    else:
        lat = S.mla_cache.shape[-1]
        b += T * context * lat * 2 + T * lat * 2
    return b


def build_copies(cfg, kind: str, idx: int, tp: int, copies: int, max_batch: int, context: int,
                 seed: int):
    if cfg.layer_kinds[idx] != kind:
        raise ValueError(f"layer {idx} of {cfg.name} is {cfg.layer_kinds[idx]}, not {kind}")
    par = Parallel(tp_rank=0, tp_size=tp)
    out = []
    for c in range(copies):
        s = seed + 1000 * c
        p = random_params(cfg, idx, par, s, DEVICE)
        # Balanced routing, as a trained noaux_tc bias aims for: the model's random init
        # (0.1·N(0, 1) per expert) would favour a few experts and under-count expert bytes.
        p["block_sparse_moe.gate.e_score_correction_bias"].zero_()
        W = LayerWeights.build(cfg, idx, par, p, random_experts(cfg, par, s + 1, DEVICE))
        del p
        out.append((W, LayerState.random(W, idx, max_batch, context, s + 2, DEVICE)))
    return out


def auto_copies(cfg, tp: int, kind: str, context: int) -> int:
    """Copies so that the smallest per-layer read (specialized, batch 1) is ≥ 4 × L2."""
    b = predicted_bytes(cfg, tp, kind, 1, "specialized", context)
    return max(4, math.ceil(4 * L2_BYTES / (b["weights"] + b["state"])))


def bench_one(copies, kind, idx, tp, B, variant, timer, args, cfg) -> tuple[dict, list]:
    lin = gemv_linear() if (variant == "specialized" and B <= args.gemv_max_batch) else None
    steps = [make_step(W, S, variant, B, lin) for W, S in copies]
    for i, st in enumerate(steps):          # RAYDECODE_BENCH_L2PF=next: copy i+1 follows i
        if hasattr(st, "link_next"):
            st.link_next(steps[(i + 1) % len(steps)])
    t = timer.run(steps)
    touched = [int(torch.unique(S.last_ids).numel()) for _, S in copies]
    W0, S0 = copies[0]
    dense = W0.weight_bytes(variant)
    ex = statistics.mean(touched) * W0.experts.expert_bytes()
    wbytes = dense + ex
    sbytes = state_bytes(W0, S0, B, args.context)
    us = t.us_per_call
    pb = predicted_bytes(cfg, tp, kind, B, variant, args.context)
    row = {
        "tp": tp, "kind": kind, "layer_idx": idx, "batch": B, "variant": variant,
        "us": us, "us_min": t.us_min, "us_max": t.us_max, "replays": t.replays,
        "copies": len(copies),
        "kernels": t.nodes_per_call["kernel"] if t.nodes_per_call else None,
        "graph_nodes": t.nodes_per_call,
        "weight_bytes": wbytes, "dense_weight_bytes": dense, "expert_bytes": ex,
        "touched_experts": statistics.mean(touched), "state_bytes": sbytes,
        "bytes": wbytes + sbytes,
        "achieved_Bps": wbytes / (us * 1e-6),
        "achieved_incl_state_Bps": (wbytes + sbytes) / (us * 1e-6),
        "fraction_of_hbm": wbytes / (us * 1e-6) / args.hbm,
        "fraction_of_hbm_incl_state": (wbytes + sbytes) / (us * 1e-6) / args.hbm,
        "roofline_us": wbytes / args.hbm * 1e6,
        "predicted_weight_bytes": pb["weights"], "predicted_state_bytes": pb["state"],
        "gemv": ("kernels.gemv.linear" if lin else "F.linear"),
        # side-branch L2 prefetch launches (RAYDECODE_BENCH_L2PF), counted in `kernels`, off
        # the dependent chain: chain_kernels = kernels − prefetch_kernels
        "prefetch_kernels": getattr(steps[0], "prefetch_launches", 0),
    }
    if row["kernels"] is not None:
        row["chain_kernels"] = row["kernels"] - row["prefetch_kernels"]
    if (args.profile and B in (1, max(args.batches))) or t.nodes_per_call is None:
        row["profiled"] = profile_kernel_count(steps[0])
        if row["kernels"] is None:
            row["kernels"] = row["profiled"]["kernel"]
    return row, steps[0].collectives()


def decode_candidates(prior, sweep_rows: list, tp: int, top: int) -> list:
    """[prior (TUNED before the sweep; None: skipped)] + the `top` fastest decode configs the
    sweep timed at TP `tp`, batch 1 (rows with an error have no "us"), duplicates dropped."""
    from raydecode.kernels.moe_mxfp4_decode import DecodeConfig
    ranked = sorted((r for r in sweep_rows if r.get("kernel") == "decode" and r.get("tp") == tp
                     and r.get("batch") == 1 and "us" in r), key=lambda r: r["us"])
    out = []
    for c in [prior] + [DecodeConfig(**r["config"]) for r in ranked]:
        if c is not None and c not in out:
            out.append(c)
        if len(out) == top + (prior is not None):
            break
    return out


def confirm_decode_in_layer(copies, kind, idx, tp, timer, args, cfg, prior: dict,
                            sweep_rows: list, top: int = 2, rounds: int = 2) -> dict:
    """The decode sweep times MoE calls back to back; inside the layer the ranking can differ
    (round 11: at TP8 the f16x2 pair won the sweep by 6.4 µs and lost 1.5–2.5 µs in the
    layer). Times the specialized layer at batch 1 with the TUNED config from before the
    sweep and the sweep's `top` fastest, interleaved `rounds` times, and keeps the config of
    the lowest median in TUNED for the timing that follows."""
    from raydecode.kernels import moe_mxfp4_decode as D
    key = (cfg.moe.num_experts, cfg.moe.expert_intermediate // tp, cfg.moe.latent_size)
    cands = decode_candidates(prior.get(key), sweep_rows, tp, top)
    quiet = argparse.Namespace(**{**vars(args), "profile": False})
    us = [[] for _ in cands]
    for _ in range(rounds):
        for i, c in enumerate(cands):
            D.TUNED[key] = c
            us[i].append(bench_one(copies, kind, idx, tp, 1, "specialized", timer, quiet,
                                   cfg)[0]["us"])
    best = min(range(len(cands)), key=lambda i: statistics.median(us[i]))
    D.TUNED[key] = cands[best]
    for i, c in enumerate(cands):
        print(f"moe-decode in-layer TP{tp} {kind} B=1 {'*' if i == best else ' '} {c}: "
              f"{' '.join(f'{u:.1f}' for u in us[i])} us", flush=True)
    return {"tp": tp, "kind": kind, "candidates": [dataclasses.asdict(c) for c in cands],
            "us": us, "chosen": dataclasses.asdict(cands[best])}


def run(args) -> dict:
    t0 = time.time()
    cfg = load_config(args.config)
    report = {**_env(), "commit": args.commit,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "model": cfg.name, "context": args.context, "layer_idx": args.layer_idx,
              "gemv_max_batch": args.gemv_max_batch, "variants": VARIANTS,
              "attnres_kernel": args.attnres, "moe_decode": args.moe_decode,
              "moe_resident_predecode": args.moe_resident_predecode,
              "kda_splits": args.kda_splits,
              "moe_max_pairs": moe_mxfp4_decode.MAX_PAIRS,
              "mma_config": args.mma_config, "gemv_config": getattr(args, "gemv_config", []),
              "ffn_path": FFN_PATH, "mla_path": MLA_PATH, "l2_prefetch": L2PF,
              "l2_prefetch_start_mib": L2PF_START_MIB, "l2_prefetch_kind": l2_prefetch.KIND,
              "l2_prefetch_chunk": l2_prefetch.CHUNK_BYTES,
              "method": __doc__.split("Method")[1].strip(), "results": [], "collectives": [],
              "shapes": {}}
    report["hbm_read_Bps"] = args.hbm = hbm_read_bandwidth()
    print(f"HBM read {args.hbm / 1e12:.3f} TB/s  cute={report['cute_available']} "
          f"(t={time.time() - t0:.0f}s)", flush=True)
    if args.check:
        from .layer_check import check_layer
        report["checks"] = []
        for kind in args.kinds:
            for b in (1, 4):
                r = check_layer(kind, batch=b, context=32, device=DEVICE,
                                linear=gemv_linear())
                report["checks"].append(r)
                print(f"check {kind} B={b}: ok={r['ok']} flips={r['routing_flips']} "
                      f"{json.dumps(r['errors'])}", flush=True)
    if args.moe_sweep:
        from raydecode.scripts.explore.layer_moe_sweep import sweep
        report["moe_sweep"] = sweep(cfg.moe, tps=args.tps, batches=(1, max(args.batches)),
                                    log=lambda m: print(m, flush=True))
        report["moe_tuned"] = {str(k): dataclasses.asdict(v)
                               for k, v in moe_mxfp4.TUNED.items()}
        print(f"MoE sweep done (t={time.time() - t0:.0f}s)", flush=True)
    prior_decode = {}
    if args.moe_decode_sweep:
        from raydecode.scripts.explore.layer_moe_decode_sweep import sweep as decode_sweep
        prior_decode = dict(moe_mxfp4_decode.TUNED)
        report["moe_decode_sweep"] = decode_sweep(cfg.moe, tps=args.tps,
                                                  batches=args.moe_decode_sweep_batches,
                                                  log=lambda m: print(m, flush=True))
        report["moe_decode_tuned"] = {str(k): dataclasses.asdict(v)
                                      for k, v in moe_mxfp4_decode.TUNED.items()}
        print(f"MoE decode sweep done (t={time.time() - t0:.0f}s)", flush=True)
    timer = GraphTimer(replays=args.replays)
    for tp in args.tps:
        report["shapes"][f"tp{tp}"] = {p: decode_gemv_shapes(cfg, tp, p)
                                       for p in ("stock", "specialized")}
        for kind in args.kinds:
            if time.time() - t0 > args.budget_s:
                print(f"budget reached: skipping TP{tp} {kind}", flush=True)
                continue
            n = args.copies or auto_copies(cfg, tp, kind, args.context)
            idx = args.layer_idx[kind]
            copies = build_copies(cfg, kind, idx, tp, n, max(args.batches), args.context,
                                  args.seed)
            if args.moe_decode_sweep and kind == args.kinds[0] and 1 in args.batches:
                report.setdefault("moe_decode_in_layer", []).append(confirm_decode_in_layer(
                    copies, kind, idx, tp, timer, args, cfg, prior_decode,
                    report["moe_decode_sweep"]))
                report["moe_decode_tuned"] = {
                    str(k): dataclasses.asdict(v) for k, v in moe_mxfp4_decode.TUNED.items()}
            W0 = copies[0][0]
            report["shapes"][f"tp{tp}"][f"{kind}_tensors"] = {
                **{k: list(v.shape) for k, v in W0.read_by("stock").items()},
                **{k: list(v.shape) for k, v in W0.spec.items()},
                "experts.w13": list(W0.experts.w13.shape),
                "experts.w2": list(W0.experts.w2.shape)}
            for B in args.batches:
                for variant in ("stock", "specialized"):
                    try:
                        row, coll = bench_one(copies, kind, idx, tp, B, variant, timer, args,
                                              cfg)
                    except Exception as e:     # a failed config is recorded, not fatal
                        print(f"TP{tp} {kind} B={B} {variant}: {type(e).__name__}: {e}",
                              flush=True)
                        report["results"].append({"tp": tp, "kind": kind, "batch": B,
                                                  "variant": variant,
                                                  "error": f"{type(e).__name__}: {e}"[:500]})
                        continue
                    report["results"].append(row)
                    report["collectives"].append({
                        "tp": tp, "kind": kind, "batch": B, "variant": variant,
                        "count": len(coll), "bytes": sum(c["bytes"] for c in coll),
                        "ops": coll})
                    print(f"TP{tp:<2} {kind} B={B:<2} {variant:11s} {row['us']:8.1f} us  "
                          f"kernels {row['kernels']}  W {row['weight_bytes'] / 1e6:7.1f} MB  "
                          f"hbm-frac {row['fraction_of_hbm']:.2f}  "
                          f"(t={time.time() - t0:.0f}s)", flush=True)
                    write_report(report, args.out)
            del copies, W0
            torch.cuda.empty_cache()
    _ratios(report)
    report["wall_s"] = time.time() - t0
    return report


def _ratios(report: dict) -> None:
    ok = [r for r in report["results"] if "us" in r]
    by = {(r["tp"], r["kind"], r["batch"], r["variant"]): r for r in ok}
    for r in ok:
        s = by.get((r["tp"], r["kind"], r["batch"], "stock"))
        if r["variant"] == "specialized" and s:
            r["speedup_vs_stock"] = s["us"] / r["us"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--png", default="", help="plot of µs vs batch (PNG)")
    ap.add_argument("--md", default="", help="markdown table file")
    ap.add_argument("--commit", default=settings.commit(),
                    help="git commit of the benchmarked tree (default $RAYDECODE_COMMIT)")
    ap.add_argument("--config", default="k3", help="model preset or config.json")
    ap.add_argument("--layer-idx", default="kda=46,mla=47",
                    help="0-indexed layer timed per kind (inside an AttnRes block)")
    ap.add_argument("--tps", default="8,16")
    ap.add_argument("--kinds", default="kda,mla")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--context", type=int, default=1024, help="MLA cached tokens per sequence")
    ap.add_argument("--copies", type=int, default=0, help="layer copies per graph (0: auto)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--gemv-max-batch", type=int, default=64,
                    help="specialized uses kernels.gemv.linear up to this batch, as the served "
                         "step does at every batch (its own dispatch: CuTe GEMV for M ≤ 2, the "
                         "skinny GEMM to SKINNY_MAX_M, then cuBLAS); above it F.linear")
    ap.add_argument("--no-check", dest="check", action="store_false")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one eager step at the smallest and largest batch")
    ap.add_argument("--moe-sweep", action="store_true",
                    help="tune the MXFP4 MoE kernel (kernels.moe_mxfp4.TUNED) before timing")
    ap.add_argument("--moe-decode-sweep", action="store_true",
                    help="tune the specialized few-token MoE kernel (moe_mxfp4_decode.TUNED) "
                         "and time it beside the stock kernel at batch 1 and 4")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--moe-decode-sweep-batches", default="1,4",
                    help="batches the MoE decode tile sweep times (it tunes per expert shape)")
    ap.add_argument("--moe-decode", choices=("auto", "cuda-core", "resident"), default="auto",
                    help="few-token MoE kernel: CUDA cores, the resident CuTe kernel where it "
                         "fits (resident), or kernels/moe_decode.py RESIDENT per shape (auto): "
                         "DecodeOptions.moe_kernel")
    ap.add_argument("--moe-resident-predecode", type=int, default=None,
                    help="the resident MoE kernel's `predecode` (down rows per lane decoded "
                         "before the wait; DecodeOptions.moe_resident_predecode)")
    ap.add_argument("--kda-splits", type=int, default=None,
                    help="programs per head of the fused KDA decode (DecodeOptions.kda_splits: "
                         "1 = one program per head, N = the split form; default: automatic)")
    add_decode_args(ap)
    ap.add_argument("--attnres", choices=("cute", "triton"), default="cute",
                    help="AttnRes mix + norm kernel of the specialized step (cute: the CuTe DSL "
                         "kernel where it supports the layout, else Triton)")
    args = ap.parse_args(argv)
    fields = {"attnres_cute": args.attnres == "cute", "kda_splits": args.kda_splits,
              "moe_kernel": args.moe_decode.replace("-", "_")}
    if args.moe_resident_predecode is not None:
        fields["moe_resident_predecode"] = args.moe_resident_predecode
    try:
        settings.check_no_retired()
        args.options = options_from_args(args, **fields)
    except ValueError as e:
        ap.error(str(e))
    for name, conv in (("tps", int), ("kinds", str), ("batches", int),
                       ("moe_decode_sweep_batches", int)):
        vals = [conv(v) for v in getattr(args, name).split(",") if v]
        setattr(args, name, vals)
    args.layer_idx = {k: int(v) for k, v in (kv.split("=") for kv in args.layer_idx.split(","))}
    bad = [k for k in args.kinds if k not in args.layer_idx]
    if bad or any(b < 1 for b in args.batches) or any(t not in (1, 2, 4, 8, 16) for t in args.tps):
        ap.error(f"--kinds from {list(args.layer_idx)}, --tps from 1,2,4,8,16, --batches ≥ 1 "
                 f"(got {args.kinds}, {args.tps}, {args.batches})")
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("layer benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    report = run(args)
    write_report(report, args.out)
    if args.png:
        plot(report, args.png)
    table = markdown_table(report)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
