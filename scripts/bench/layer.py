"""Per-layer decode benchmark: one KDA and one MLA layer of K3 (each with its latent MoE, AttnRes
and norms) at the per-rank shapes of TP8 and TP16, one GPU playing rank 0 (GPU only). The
layer is the model's own K3DecoderLayer (scripts/bench/layer_step.py), as the step benchmark
(scripts/bench/step.py) runs the whole model.

    RAYDECODE_COMMIT=$(git rev-parse HEAD) python -m raydecode.scripts.bench.layer \
        --out bench/results/layer-h200-DATE.json --png bench/results/layer-h200-DATE.png \
        [--profile] [--decode FIELD=VALUE ...]

Method:
- weights: random, rank 0's per-rank shapes (Parallel(tp_rank=0, tp_size=TP)); bf16, routed
  experts MXFP4 (uint8 codes + ue8m0 scales), balanced routing (zero correction bias);
- specialized: N distinct layer copies (weights, caches, state) run back to back inside ONE
  CUDA graph, graph-shaped as the served step (paging and KDA slots in device tensors), so no
  weight is served from the 60 MB L2 (N · bytes ≥ 4 × L2 for the smallest case); µs per layer
  = median replay time / N; kernels per layer: kernel nodes of that graph / N
  (cudaGraphGetNodes), memcpy/memset nodes reported beside;
- stock: the model's stock path (PyTorch / cuBLAS, the grouped MXFP4 MoE, Python loops with
  host syncs), which cannot be captured: timed eagerly over the same copies (wall time between
  two device syncs / N; `mode` = eager), kernels counted by the profiler;
- bytes: the dense weights the variant's step reads (LayerCopy.weight_bytes: the derived
  packed weights, no source twice, replicated weights 1/TP on the specialized path) + distinct
  touched experts × expert bytes (this run's routing); fraction_of_hbm = weight bytes / µs /
  HBM read bandwidth measured in the same run; `roofline_us` = weight bytes / HBM;
- collectives (no-ops on one GPU) are counted per layer with their byte sizes, never timed;
- before timing, the benchmark's steps are checked against the layer's plain stock forward
  (TP = 1, small config, scripts/bench/layer_check.py) on this GPU.
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
from raydecode.kernels import settings
from raydecode.models.config import load_config
from raydecode.models.params import decode_gemv_shapes

from .layer_report import markdown_table, plot, predicted_bytes
from .layer_step import LayerCopy
from .layer_timing import GraphTimer, hbm_read_bandwidth, profile_kernel_count
from .options import add_decode_args, options_from_args
from .report_io import write_report

L2_BYTES = 60 * 2**20
DEVICE = "cuda"

VARIANTS = {
    "stock": ("the model's K3DecoderLayer on the stock path: PyTorch/cuBLAS ops (F.linear), "
              "fused_qkv_a / router / latent down+up read whole (replicated), the grouped "
              "MXFP4 MoE (kernels/moe_mxfp4.py), separate norm / AttnRes / residual ops, KDA "
              "and MLA as Python loops over the sequences (host syncs): timed eagerly"),
    "specialized": ("the model's K3DecoderLayer on the specialized path under the run's "
                    "decode options (models/decode_plan.py lists its kernels per bucket): "
                    "replicated projections 1/TP, packed GEMVs through kernels/linear.py, the "
                    "fused AttnRes mix + norm, router top-k, KDA decode and MLA decode kernels, "
                    "the few-token MoE kernels; one CUDA graph over the layer copies"),
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
    env["triton_pdl"] = PDL_DEFAULT          # RAYDECODE_TRITON_PDL (kernels/settings.py)
    return env


def build_copies(cfg, kind: str, idx: int, tp: int, copies: int, max_batch: int, context: int,
                 seed: int, options) -> list[LayerCopy]:
    if cfg.layer_kinds[idx] != kind:
        raise ValueError(f"layer {idx} of {cfg.name} is {cfg.layer_kinds[idx]}, not {kind}")
    return [LayerCopy(cfg, idx, tp, max_batch, context, seed + 1000 * c, DEVICE, options)
            for c in range(copies)]


def auto_copies(cfg, tp: int, kind: str, context: int) -> int:
    """Copies so that the smallest per-layer read (specialized, batch 1) is ≥ 4 × L2."""
    b = predicted_bytes(cfg, tp, kind, 1, "specialized", context)
    return max(4, math.ceil(4 * L2_BYTES / (b["weights"] + b["state"])))


@dataclasses.dataclass
class EagerTimed:
    us_per_call: float
    us_min: float
    us_max: float
    replays: int
    nodes_per_call: dict | None = None


def eager_time(fns: list, replays: int, warm: int = 2) -> EagerTimed:
    """Wall time of the fns run back to back between two device syncs, per fn (median)."""
    for _ in range(warm):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        t0 = time.perf_counter()
        for fn in fns:
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6 / len(fns))
    return EagerTimed(statistics.median(times), min(times), max(times), replays)


def _touched(copies: list[LayerCopy], B: int) -> list[int]:
    """Distinct experts one step of each copy routes to (one more eager specialized step,
    recorded: the stock step routes the same experts up to near-ties)."""
    from raydecode.models import moe as moe_mod
    seen, real = [], moe_mod.route_topk

    def spy(*a, **k):
        w, ids = real(*a, **k)
        seen.append(int(torch.unique(ids).numel()))
        return w, ids

    moe_mod.route_topk = spy
    try:
        for c in copies:
            c.step(B, "specialized")
    finally:
        moe_mod.route_topk = real
    return seen


def collectives(c: LayerCopy, B: int, path: str) -> list[dict]:
    """The collectives one eager step issues on a TP > 1 group (none run here): op, shape,
    dtype bytes of the full reduced / gathered tensor."""
    ops, comm = [], c.comm
    real = {n: getattr(comm, n) for n in ("all_reduce", "all_gather", "dcp_all_gather")}

    def wrap(name):
        def f(x, *a, **k):
            out = real[name](x, *a, **k)
            ops.append({"op": name, "shape": list(out.shape),
                        "bytes": out.numel() * out.element_size()})
            return out
        return f

    for n in real:
        setattr(comm, n, wrap(n))
    try:
        c.step(B, path)
    finally:
        for n, f in real.items():
            setattr(comm, n, f)
    return ops


def bench_one(copies, kind, idx, tp, B, variant, timer, args, cfg) -> tuple[dict, list]:
    fns = [lambda c=c: c.step(B, variant) for c in copies]
    if variant == "specialized":
        t = timer.run(fns)
    else:
        t = eager_time(fns, args.replays)
    touched = _touched(copies, B)
    c0 = copies[0]
    dense = c0.weight_bytes(variant)
    ex = statistics.mean(touched) * c0.expert_bytes()
    wbytes = dense + ex
    sbytes = c0.state_bytes(B)
    us = t.us_per_call
    pb = predicted_bytes(cfg, tp, kind, B, variant, args.context)
    row = {
        "tp": tp, "kind": kind, "layer_idx": idx, "batch": B, "variant": variant,
        "mode": "graph" if variant == "specialized" else "eager",
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
        "gemv": "kernels.linear.linear" if variant == "specialized" else "F.linear",
        "prefetch_kernels": 0,
    }
    if (args.profile and B in (1, max(args.batches))) or row["kernels"] is None:
        row["profiled"] = profile_kernel_count(fns[0])
        if row["kernels"] is None:
            row["kernels"] = row["profiled"]["kernel"]
    row["chain_kernels"] = row["kernels"]
    return row, collectives(c0, B, variant)


def run(args) -> dict:
    t0 = time.time()
    cfg = load_config(args.config)
    opts = args.options
    report = {**_env(), "commit": args.commit,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "model": cfg.name, "context": args.context, "layer_idx": args.layer_idx,
              "variants": VARIANTS, "attnres_kernel": args.attnres,
              "moe_decode": args.moe_decode,
              "moe_resident_predecode": opts.moe_resident_predecode,
              "kda_splits": opts.kda_splits, "moe_max_pairs": opts.moe_max_pairs,
              "gemv_config": args.gemv_config,
              "gemv_l2_prefetch_mib": opts.gemv_l2_prefetch_mib,
              "decode_options": opts.as_dict(),
              "method": __doc__.split("Method:")[1].strip(), "results": [], "collectives": [],
              "shapes": {}}
    report["hbm_read_Bps"] = args.hbm = hbm_read_bandwidth()
    print(f"HBM read {args.hbm / 1e12:.3f} TB/s  cute={report['cute_available']} "
          f"(t={time.time() - t0:.0f}s)", flush=True)
    if args.check:
        from .layer_check import check_layer
        report["checks"] = []
        for kind in args.kinds:
            for b in (1, 4):
                r = check_layer(kind, batch=b, context=32, device=DEVICE)
                report["checks"].append(r)
                print(f"check {kind} B={b}: ok={r['ok']} flips={r['routing_flips']} "
                      f"{json.dumps(r['errors'])}", flush=True)
    if args.moe_sweep:          # the stock grouped kernel's tiles: reported, not applied
        from raydecode.scripts.explore.layer_moe_sweep import sweep
        report["moe_sweep"] = sweep(cfg.moe, tps=args.tps, batches=(1, max(args.batches)),
                                    log=lambda m: print(m, flush=True))
        report["moe_tuned"] = {str(k): dataclasses.asdict(v)
                               for k, v in moe_mxfp4.TUNED.items()}
        print(f"MoE sweep done (t={time.time() - t0:.0f}s)", flush=True)
    if args.moe_decode_sweep:   # the few-token kernel's tiles: batch-1 winners time the layers
        from raydecode.scripts.explore.layer_moe_decode_sweep import sweep as decode_sweep
        from raydecode.kernels.moe_mxfp4_decode import DecodeConfig
        rows = decode_sweep(cfg.moe, tps=args.tps, batches=args.moe_decode_sweep_batches,
                            log=lambda m: print(m, flush=True))
        report["moe_decode_sweep"] = rows
        m = cfg.moe
        won = tuple(((m.num_experts, m.expert_intermediate // r["tp"], m.latent_size),
                     DecodeConfig(**r["chosen"])) for r in rows
                    if "chosen" in r and r["batch"] == 1)
        # --decode-config entries first: the first match serves (moe_decode.decode_config_for)
        opts = args.options = opts.replace(moe_decode_configs=opts.moe_decode_configs + won)
        report["decode_options"] = opts.as_dict()
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
                                  args.seed, opts)
            report["shapes"][f"tp{tp}"][f"{kind}_tensors"] = {
                k: list(v.shape) for k, v in copies[0].layer.named_parameters()}
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
            del copies
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
    ap.add_argument("--no-check", dest="check", action="store_false")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one eager step at the smallest and largest batch")
    ap.add_argument("--moe-sweep", action="store_true",
                    help="sweep the stock grouped MoE kernel's tiles first (scripts/explore; "
                         "reported, the tuned table changes by hand)")
    ap.add_argument("--moe-decode-sweep", action="store_true",
                    help="sweep the few-token MoE kernel's tiles first (scripts/explore); its "
                         "batch-1 winners time the layers (as decode options), reported")
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
