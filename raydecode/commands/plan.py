"""`raydecode plan`: capacity planner (memory, speed, replicas, cost). See docs/PLANNER.md."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from raydecode.kernels.settings import PREFILL_EXPERT_KINDS, parse_prefill_experts

DEFAULT_CONTEXT = 8192


def _prefill_experts(raw: str) -> str:
    """argparse type of --prefill-experts: a RAYDECODE_PREFILL_EXPERTS value (the setting's
    parser: kinds and +FIELD=VALUE parts)."""
    try:
        parse_prefill_experts(raw)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return raw


def _default_bench_dir() -> Path:
    import raydecode.scripts as s
    return Path(s.__file__).resolve().parent.parent / "bench" / "results"


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only when there is one worth showing."""

    def _get_help_string(self, action):
        if action.default in (None, False, []) or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = _Help
    m = p.add_argument_group("model and hardware")
    m.add_argument("--model", default="k3",
                   help="model: 'k3', 'tiny', or a path to a kimi_k3 config.json (or its folder)")
    m.add_argument("--gpu", default="GB300",
                   help="GPU kind from the hardware catalog (GB300, GB200, B300, H200, H100, or "
                        "one added with --hardware); case-insensitive")
    m.add_argument("--hardware", action="append", default=[], metavar="YAML",
                   help="extra hardware catalog file(s), same fields as "
                        "scripts/data/hardware.yaml; entries add to or replace the shipped ones")
    d = p.add_argument_group("deployment (one replica = one TP group in one NVLink domain)")
    d.add_argument("--tp", type=int, default=16,
                   help="tensor-parallel GPUs per replica; must divide the 96 MLA and KDA heads")
    d.add_argument("--dcp", type=int, default=1,
                   help="decode-context-parallel size: splits the MLA latent cache by token "
                        "position over this many ranks; must divide --tp")
    d.add_argument("--path", choices=("specialized", "stock"), default="specialized",
                   help="decode path used for sizing and cost; steps outside the specialized "
                        "envelope (batch > 64, or batch·(k+1) > 64) run stock anyway")
    d.add_argument("--batch", type=int, default=1,
                   help="concurrent sequences per replica for the speed figures")
    d.add_argument("--context", type=int, default=None,
                   help=f"tokens each sequence may reach; memory is reserved for it and steps "
                        f"are timed at it (default: input+output length with a workload, else "
                        f"{DEFAULT_CONTEXT} or the model's maximum if smaller)")
    d.add_argument("--dspark-k", type=int, default=0,
                   help="DSpark drafts per step (0 = no speculative decoding; at most the "
                        "drafter's block size 7)")
    d.add_argument("--acceptance-length", type=float, default=None,
                   help="mean tokens accepted per verify step including the bonus token, in "
                        "[1, k+1]; required with --dspark-k")
    d.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16",
                   help="MLA latent KV cache dtype")
    d.add_argument("--state-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="KDA recurrent state dtype (K3 keeps it in fp32)")
    d.add_argument("--gpu-memory-utilization", type=float, default=0.90,
                   help="fraction of HBM the engine may use (the rest: CUDA context, NCCL, "
                        "graphs); same meaning as vLLM's")
    d.add_argument("--prefill-chunk", type=int, default=8192,
                   help="tokens per prefill chunk; sizes the activation workspace")
    d.add_argument("--kda-snapshots", type=int, default=32,
                   help="KDA state snapshots per rank kept for prefix caching (the "
                        "deployment's kda_snapshot_slots, default 32; 0 with prefix caching "
                        "off): each is one sequence's KDA state, taken from the cache budget")
    d.add_argument("--prefill-experts", default="auto", type=_prefill_experts,
                   metavar="{" + ",".join(PREFILL_EXPERT_KINDS) + "}[+FIELD=VALUE...]",
                   help="the deployment's RAYDECODE_PREFILL_EXPERTS: ogs-hopper holds a "
                        "second copy of every layer's routed experts (matmul_ogs's Hopper "
                        "layouts) for faster prefill; the others hold none")
    w = p.add_argument_group("workload (give --requests-per-s or --concurrent-users to size a "
                             "fleet)")
    w.add_argument("--requests-per-s", type=float, default=None,
                   help="arrival rate of requests over the whole fleet")
    w.add_argument("--concurrent-users", type=int, default=None,
                   help="sequences decoding at once over the whole fleet")
    w.add_argument("--input-len", type=int, default=2048, help="prompt tokens per request")
    w.add_argument("--output-len", type=int, default=512, help="generated tokens per request")
    w.add_argument("--target-tps-user", type=float, default=None,
                   help="required decode tok/s per user; caps the batch per replica")
    w.add_argument("--ttft-target", type=float, default=None, metavar="SECONDS",
                   help="time-to-first-token target; warns when the prefill alone exceeds it")
    o = p.add_argument_group("cost, efficiency and output")
    o.add_argument("--price", type=float, default=None,
                   help="$ per GPU-hour (default: the catalog's, which is an estimate)")
    o.add_argument("--bench-dir", default=None,
                   help="folder of benchmark JSON (gemv-*.json, comm-*.json) whose measured "
                        "efficiencies replace the documented defaults (default: the repo's "
                        "bench/results when present)")
    o.add_argument("--json", action="store_true", help="print the full result as JSON only")
    o.add_argument("--plot", metavar="DIR", default=None,
                   help="write tok_s_user_vs_batch.png and memory_breakdown.png into DIR")
    o.add_argument("--anchors", action="store_true",
                   help="also compare with the public K3 GB300 TP16 anchors (always on for "
                        "--model k3 --gpu GB300 --tp 16)")


def run(args: argparse.Namespace) -> int:
    from raydecode.models.config import ConfigError, load_config
    from raydecode.scripts import planner as PL
    from raydecode.scripts.planner_hw import PlanError, find_gpu, load_catalog
    from raydecode.scripts.planner_perf import load_efficiency

    try:
        cfg = load_config(args.model)
        catalog = load_catalog(args.hardware)
        gpu = find_gpu(catalog, args.gpu)
        wl = PL.Workload(args.requests_per_s, args.concurrent_users, args.input_len,
                         args.output_len, args.target_tps_user, args.ttft_target)
        context = args.context if args.context is not None else (
            args.input_len + args.output_len if wl.given
            else min(DEFAULT_CONTEXT, cfg.max_position_embeddings))
        dep = PL.Deployment(tp=args.tp, dcp=args.dcp, path=args.path, batch=args.batch,
                            context=context, dspark_k=args.dspark_k,
                            acceptance=args.acceptance_length, kv_dtype=args.kv_dtype,
                            state_dtype=args.state_dtype,
                            gpu_memory_utilization=args.gpu_memory_utilization,
                            prefill_chunk=args.prefill_chunk,
                            kda_snapshots=args.kda_snapshots,
                            prefill_experts=args.prefill_experts)
        if args.price is not None and args.price <= 0:
            raise PlanError(f"--price {args.price}: expected > 0")
        bench = args.bench_dir if args.bench_dir is not None else _default_bench_dir()
        if args.bench_dir is not None and not Path(bench).is_dir():
            raise PlanError(f"--bench-dir {bench}: no such folder")
        eff, notes = load_efficiency(bench, catalog, prefill_experts=args.prefill_experts)
        want_anchors = args.anchors or (cfg.name == "k3" and gpu.name == "GB300"
                                        and args.tp == 16)
        a_gpu = a_cfg = None
        if want_anchors:
            a_gpu = find_gpu(catalog, "GB300")
            a_cfg = cfg if cfg.name == "k3" else load_config("k3")
        result = PL.plan(cfg, gpu, dep, wl, eff, args.price, a_gpu, a_cfg,
                         sweep=bool(args.plot) or args.json, bench_notes=notes)
    except (PlanError, ConfigError) as e:
        print(f"raydecode plan: error: {e}", file=sys.stderr)
        return 2
    if args.plot:
        from raydecode.scripts.planner_report import plot
        result["plots"] = plot(result, args.plot)
    if args.json:
        print(json.dumps(result, indent=1, sort_keys=False))
    else:
        from raydecode.scripts.planner_report import render
        print(render(result))
        for f in result.get("plots", []):
            print(f"wrote {f}")
    return 0
