"""`raydecode kernels-warmup`: compile a replica's decode kernels into the node's kernel cache
(run once per node before the ranks start: KubeRay init container / `ray up` setup command).

Exit 0 only when every planned kernel is in the cache afterwards; 1 when some could not be
compiled here (a missing nvidia-cutlass-dsl or Triton: `pip install raydecode[gpu]`), each named;
2 for bad input (an --arch no decode kernel targets, an unknown model, no cache directory)."""
from __future__ import annotations

import argparse
import os
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="k3", help="model: preset (tiny, k3), a config.json or a "
                   "checkpoint folder")
    p.add_argument("--tp", type=int, default=16, help="tensor-parallel size of the replica")
    p.add_argument("--batch-buckets", default="1,2", help="comma-separated decode batch (M) "
                   "buckets; GEMVs are compiled for the buckets `linear` sends to CuTe (M <= 2)")
    p.add_argument("--arch", default="sm_90a", help="target arch (CUTE_DSL_ARCH form): sm_90a "
                   "for H100/H200, sm_100a for B200, sm_103a for GB300")
    p.add_argument("--cache-dir", default=None, help="cache directory (default: "
                   "$RAYDECODE_KERNEL_CACHE)")
    p.add_argument("--no-triton", action="store_true", help="skip the Triton offline compiles")
    p.add_argument("--decode", action="append", default=[], metavar="FIELD=VALUE",
                   help="a decode option of the replica (deployment config decode.FIELD), "
                        "repeatable; default: the served options")
    p.add_argument("--sm-count", type=int, default=None, help="the GPU's SM count (the "
                   "resident MoE kernel's grid; default: this host's GPU, else it is left "
                   "unplanned)")
    p.add_argument("--dry-run", action="store_true", help="print the decode plan (the kernel "
                   "of every GEMV, the MoE kernel, the fusions, per bucket) and the compile "
                   "list; compile nothing")


# the GPU families the decode kernels are built for (Hopper and Blackwell: PDL, TMA); an arch
# string outside them is refused before anything is compiled
ARCH_FAMILIES = {90: "H100/H200", 100: "B200/GB200", 103: "B300/GB300", 110: "Thor",
                 120: "RTX Blackwell", 121: "DGX Spark"}


def check_target_arch(arch: str) -> str:
    """--arch as CUTE_DSL_ARCH takes it (sm_XY, sm_XYa, sm_XYf) for a known family."""
    from raydecode.kernels.aot import KernelCacheError, check_arch

    check_arch(arch)
    family = int(arch[3:].rstrip("af"))
    if family not in ARCH_FAMILIES:
        known = ", ".join(f"sm_{f}a ({n})" for f, n in ARCH_FAMILIES.items())
        raise KernelCacheError(f"--arch {arch}: no decode kernel targets sm_{family}; accepted: "
                               f"{known} (or the same with an 'f' suffix, or none)")
    return arch


def _buckets(text: str) -> tuple[int, ...]:
    from raydecode.kernels.aot import KernelCacheError, check_buckets

    try:
        return check_buckets(x for x in text.split(",") if x.strip())
    except ValueError as e:
        raise KernelCacheError(f"--batch-buckets {text!r}: expected comma-separated positive "
                               "integers such as 1,2") from e


def run(args: argparse.Namespace) -> int:
    from raydecode.kernels.aot import ENV, cache_dir, plan_kernels, warm
    from raydecode.kernels.settings import parse_option_pairs
    from raydecode.models.config import load_config
    from raydecode.models.decode_plan import ShardError, resolve_plan

    arch = check_target_arch(args.arch)
    cfg, buckets = load_config(args.config), _buckets(args.batch_buckets)
    options = parse_option_pairs(args.decode)
    try:
        decode = resolve_plan(cfg, args.tp, options, buckets, sm_count=args.sm_count)
    except ShardError:
        decode = None                # plan_kernels names the TP that does not shard
    plan = plan_kernels(cfg, args.tp, buckets, arch, sm_count=args.sm_count, options=options,
                        plan=decode)
    print(f"# {plan.model} TP{plan.tp} buckets {list(plan.buckets)} {arch}: {len(plan.gemvs)} "
          f"CuTe GEMVs, {len(plan.fused)} fused CuTe kernels, {len(plan.moe)} resident MoE, "
          f"{len(plan.triton) * (not args.no_triton)} Triton kernels, "
          f"{len(plan.skipped)} shapes left to cuBLAS / the skinny GEMM / unsupported")
    if args.dry_run:
        print("\n".join(decode.describe()))
        print("# compile list")
        print("\n".join(plan.describe()))
        return 0
    root = cache_dir(args.cache_dir)
    if root is None:
        print(f"error: no cache directory: pass --cache-dir or set {ENV}", file=sys.stderr)
        return 2
    os.environ[ENV] = str(root)                  # gemv._compiled stores into this cache
    prev = os.environ.setdefault("CUTE_DSL_ARCH", arch)   # before cutlass is imported
    if prev != arch:
        print(f"error: CUTE_DSL_ARCH={prev} in the environment but --arch {arch}",
              file=sys.stderr)
        return 2
    t0 = time.monotonic()
    events = warm(plan, root, triton=not args.no_triton,
                  log=lambda ev: print(f"{ev['action']:9s} {ev['seconds']:7.2f}s  "
                                       f"{ev['kind']:9s} {ev['name']}"
                                       + (f" M={ev['M']} N={ev['N']} K={ev['K']}"
                                          f" out={ev['out_dtype']}" if "M" in ev else ""),
                                       flush=True))
    skipped = [ev for ev in events if str(ev["action"]).startswith("skipped")]
    manifest = root / "manifest.json"
    where = f"cache {root} ({manifest.name})" if manifest.is_file() else \
        f"cache {root} (nothing written: no {manifest.name})"
    print(f"# done in {time.monotonic() - t0:.1f}s; {len(events) - len(skipped)} of "
          f"{len(events)} kernels in the {where}")
    if skipped:
        reasons = sorted({str(ev["action"])[len("skipped"):].strip(" ()") for ev in skipped})
        print(f"error: {len(skipped)} of {len(events)} kernels were not compiled "
              f"({'; '.join(reasons)}); run this on a host with raydecode[gpu] installed",
              file=sys.stderr)
        return 1
    return 0
