"""The node kernel cache's compile list for one replica, and the start-up hook that fills it.

    kernel_plan(decode_plan, arch) -> KernelPlan: exactly the CuTe kernels the replica's decode
        plan (models/decode_plan.py) lists — its CuTe GEMVs, each with its output dtype (an
        fp32-out GEMV is a kernel of its own), the fused ffn_out kernels and the resident MoE
        launches — with every other GEMV (cuBLAS, the skinny GEMM's Triton JIT, no mapping) in
        `skipped` with the reason.
    plan_kernels(cfg, tp, buckets, arch, options) -> the same for a plan resolved from the
        config, plus the Triton launches whose signature the config fixes
        (`aot_triton.triton_specs`).
    warm(plan, root)  -> compiles what the cache dir lacks (one process per kernel per node, the
        others wait on the kernel's flock and load), returns per-kernel events.
    prepare_kernel_cache(cfg, par, buckets, plan=...) -> the rank-worker hook: run before
        CUDA-graph capture so capture never meets a compile; a no-op returning None when
        RAYDECODE_KERNEL_CACHE is unset.

The store (objects, locks, manifest) is kernels/aot_store.py; the CuTe GEMV loads from it via
`kernels.gemv._compiled`, so a rank that warmed the cache (or found it warm) never JITs a GEMV.
"""
from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from raydecode.kernels.aot_store import (
    ENV, STATS, KernelCacheError, _dname, _store, cache_dir, check_arch, current_arch, digest,
    file_lock, load_or_compile_gemv, use_triton_cache, versions,
)
from raydecode.kernels.aot_triton import TritonSpec, compile_spec, triton_specs
from raydecode.kernels.settings import DEFAULT_OPTIONS, DecodeOptions

DEFAULT_BUCKETS = (1, 2)
OUT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}   # params.gemv_out_dtype -> torch


@dataclass(frozen=True)
class GemvItem:
    name: str                         # decode_gemv_shapes key, e.g. "q_b"
    M: int
    N: int
    K: int
    config: object                    # kernels.gemv.GemvConfig
    dtype: torch.dtype = torch.bfloat16
    out_dtype: torch.dtype = torch.bfloat16   # y's dtype: bf16, or fp32 (the accumulator)

    @property
    def kernel_key(self) -> tuple:
        """What makes a distinct compiled kernel (kernels/gemv.py `_compiled`)."""
        return (self.dtype, self.M, self.N, self.K, self.config, self.out_dtype)


@dataclass(frozen=True)
class NormSituItem:
    """The ffn_out GEMV with the latent norm + SiTU prologue (kernels/gemv_norm_situ.py), where
    the fused MoE block launches it (`gemv_norm_situ.shape_ok`)."""
    M: int
    N: int
    K: int
    D: int
    n_cols: int
    I: int
    gu_stride: int                    # the h2 GEMV's width: gate ‖ up is a column slice of it
    has_lin: bool
    config: object                    # kernels.gemv.GemvConfig
    name: str = "ffn_out_norm_situ"


@dataclass(frozen=True)
class ResidentMoEItem:
    """The resident MoE kernel (kernels/moe_resident_cute.py) where `moe_decode` serves the
    model's experts with it (moe_decode.RESIDENT): its whole launch plan, which
    includes the GPU's SM count."""
    plan: object                      # kernels.moe_resident_cute.ResidentMoEPlan
    name: str = "moe_resident"


@dataclass(frozen=True)
class KernelPlan:
    model: str
    tp: int
    buckets: tuple[int, ...]
    arch: str
    gemvs: tuple[GemvItem, ...]
    triton: tuple[TritonSpec, ...]
    skipped: tuple[tuple[str, int, int, int, str], ...]   # (name, M, N, K, why)
    fused: tuple[NormSituItem, ...] = ()
    moe: tuple[ResidentMoEItem, ...] = ()

    def describe(self) -> list[str]:
        lines = [f"{g.name:16s} gemv  M={g.M} N={g.N} K={g.K} out={_dname(g.out_dtype)} "
                 f"{g.config}" for g in self.gemvs]
        lines += [f"{f.name:16s} fused M={f.M} N={f.N} K={f.K} (norm D={f.D}, n={f.n_cols}, "
                  f"SiTU I={f.I}) {f.config}" for f in self.fused]
        lines += [f"{m.name:16s} cute  T={m.plan.tokens} top-{m.plan.top_k} E={m.plan.num_experts} "
                  f"I={m.plan.intermediate} L={m.plan.latent} on {m.plan.ctas} CTAs "
                  f"(predecode {m.plan.predecode})" for m in self.moe]
        lines += [f"{t.name:16s} triton {t.kernel}" for t in self.triton]
        lines += [f"{n:16s} skip  M={m} N={nn} K={k}: {why}" for n, m, nn, k, why in self.skipped]
        return lines


def check_buckets(buckets) -> tuple[int, ...]:
    b = tuple(int(x) for x in buckets)
    if not b or any(x < 1 for x in b):
        raise KernelCacheError(f"batch buckets {buckets!r}: expected positive integers, e.g. 1,2")
    return tuple(sorted(set(b)))


def kernel_plan(plan, arch: str = "sm_90a", triton: tuple = ()) -> KernelPlan:
    """The kernels a decode plan (models/decode_plan.py `DecodePlan`) needs compiled on
    `arch`: its CuTe GEMVs (one kernel per (dtype, M, N, K, config, out dtype)), the fused
    ffn_out kernels and the resident MoE launches it lists; every other GEMV in `skipped`
    with the reason (cuBLAS, the skinny GEMM's Triton JIT, no mapping), and a resident MoE
    the plan could not size (no SM count) too. `triton`: the TritonSpecs to compile offline."""
    from raydecode.kernels import gemv as G

    arch = check_arch(arch)
    gemvs, skipped, fused, moe, seen = [], [], [], [], set()
    for step in plan.steps:
        for g in step.gemvs:
            if g.kernel != "cute":
                skipped.append((g.name, g.M, g.N, g.K, g.why))
                continue
            item = GemvItem(g.name, g.M, g.N, g.K, g.config, out_dtype=OUT_DTYPES[g.out_dtype])
            if item.kernel_key not in seen:     # two weights of one shape share a kernel
                seen.add(item.kernel_key)
                gemvs.append(item)
        if step.ffn_out is not None:
            M, N, K, D, n, I, ys, lin = step.ffn_out
            fused.append(NormSituItem(M, N, K, D, n, I, ys, lin, G.config_for(
                M, N, K, plan.options.gemv_l2_prefetch_mib, plan.options.gemv_configs)))
        m = step.moe
        if m is not None and m.kernel == "resident":
            moe.append(ResidentMoEItem(m.config))
        elif m is not None and m.wanted == "resident":
            E, I, L = m.experts
            skipped.append(("moe_resident", m.tokens, L, I, m.why))
    return KernelPlan(plan.model, plan.tp, plan.buckets, arch, tuple(gemvs), tuple(triton),
                      tuple(skipped), tuple(fused), tuple(moe))


def plan_kernels(cfg, tp: int, buckets=DEFAULT_BUCKETS, arch: str = "sm_90a",
                 path: str = "specialized", sm_count: int | None = None,
                 options: DecodeOptions = DEFAULT_OPTIONS, plan=None) -> KernelPlan:
    """What one rank of a (cfg, TP) replica compiles for decode at these M buckets on `arch`:
    `kernel_plan` of the replica's decode plan (`plan`, or resolved here from cfg, TP and
    options) plus the Triton launches whose signature the config fixes. sm_count: the GPU's
    SMs, which the resident MoE kernel's grid is (None: this process's GPU; without one that
    kernel is listed in `skipped`)."""
    from raydecode.models.decode_plan import ShardError, resolve_plan

    buckets, arch = check_buckets(buckets), check_arch(arch)
    if plan is None:
        if sm_count is None and torch.cuda.is_available():
            sm_count = torch.cuda.get_device_properties(
                torch.cuda.current_device()).multi_processor_count
        try:
            plan = resolve_plan(cfg, tp, options, buckets, sm_count=sm_count, path=path)
        except ShardError as e:
            raise KernelCacheError(f"TP = {tp} does not shard model {cfg.name!r}: {e}") from e
    specs = triton_specs(cfg, tp, plan.options) if plan.path == "specialized" else ()
    return kernel_plan(plan, arch, tuple(specs))


def _arch_or_none() -> str | None:
    try:
        return current_arch()
    except KernelCacheError:
        return None


def _triton_key(spec: TritonSpec, arch: str) -> dict:
    return {**spec.key(), "arch": arch, "triton": versions()["triton"]}


def _warm_cute(store, build) -> str:
    """Run one CuTe kernel's `build` (its `compiled`, through the store) -> the store's action
    (compiled | loaded), "in-process" when this process already held it, or "skipped (…)"
    where CuTe or TVM-FFI export is missing."""
    from raydecode.kernels import gemv

    if not gemv.FFI_DEFAULT or gemv.cute is None:
        return "skipped (nvidia-cutlass-dsl missing or RAYDECODE_CUTE_TVM_FFI=0)"
    n0 = len(store.events)
    build()
    return store.events[n0]["action"] if len(store.events) > n0 else "in-process"


def warm(plan: KernelPlan, root: Path, triton: bool = True, log=None) -> list[dict]:
    """Compile every kernel of `plan` the cache at `root` lacks; returns one event per kernel
    ({"name", "kind", "action": compiled|loaded, "seconds"}). Needs CUTE_DSL_ARCH = plan.arch on
    a GPU-less host (the caller sets it before cutlass is imported)."""
    from raydecode.kernels import gemv

    store, events = _store(root), []
    # through gemv._compiled when it would pick the same cache and arch, so this process's
    # in-memory cache holds the loaded kernels too (no second load at the first launch)
    via_compiled = gemv.FFI_DEFAULT and cache_dir() == store.root and _arch_or_none() == plan.arch
    for g in plan.gemvs:
        n0, t0 = len(store.events), time.monotonic()
        if not gemv.FFI_DEFAULT or gemv.cute is None:
            why = "nvidia-cutlass-dsl missing" if gemv.cute is None else \
                "RAYDECODE_CUTE_TVM_FFI=0: export needs TVM-FFI"
            ev = {"name": g.name, "kind": "cute_gemv", "M": g.M, "N": g.N, "K": g.K,
                  "out_dtype": _dname(g.out_dtype), "action": f"skipped ({why})",
                  "seconds": 0.0}
        else:
            if via_compiled:
                gemv._compiled(g.dtype, g.M, g.N, g.K, g.config, g.out_dtype)
            else:
                load_or_compile_gemv(g.dtype, g.M, g.N, g.K, g.config, gemv.compile_gemv, root,
                                     plan.arch, out_dtype=g.out_dtype)
            action = store.events[n0]["action"] if len(store.events) > n0 else "in-process"
            ev = {"name": g.name, "kind": "cute_gemv", "M": g.M, "N": g.N, "K": g.K,
                  "out_dtype": _dname(g.out_dtype), "action": action,
                  "seconds": time.monotonic() - t0}
        events.append(ev)
        if log:
            log(ev)
    cute_root = None if via_compiled else root
    for f in plan.fused:
        from raydecode.kernels import gemv_norm_situ as NS
        t0 = time.monotonic()
        action = _warm_cute(store, lambda f=f: NS.compiled(
            f.M, f.N, f.K, f.D, f.n_cols, f.I, f.gu_stride, f.has_lin, f.config, root=cute_root,
            arch=plan.arch))
        ev = {"name": f.name, "kind": "cute_fused", "M": f.M, "N": f.N, "K": f.K,
              "out_dtype": "bfloat16", "action": action, "seconds": time.monotonic() - t0}
        events.append(ev)
        if log:
            log(ev)
    for item in plan.moe:
        from raydecode.kernels import moe_resident_cute as R
        t0 = time.monotonic()
        action = _warm_cute(store, lambda item=item: R.compiled(item.plan, root=cute_root,
                                                                 arch=plan.arch))
        ev = {"name": item.name, "kind": "cute_moe", "tokens": item.plan.tokens,
              "ctas": item.plan.ctas, "action": action, "seconds": time.monotonic() - t0}
        events.append(ev)
        if log:
            log(ev)
    if triton and plan.triton and importlib.util.find_spec("triton") is None:
        events += [{"name": t.name, "kind": "triton", "action": "skipped (triton missing)",
                    "seconds": 0.0} for t in plan.triton]
    elif triton and plan.triton:
        tdir = use_triton_cache(root)
        for spec in plan.triton:
            key = _triton_key(spec, plan.arch)
            dg, t0 = digest(key), time.monotonic()
            with file_lock(root / "locks" / f"{dg}.lock"):
                known = dg in store.manifest()["entries"]
                h = compile_spec(spec, plan.arch, tdir)   # a Triton disk-cache hit when known
                if not known:
                    store.record(dg, {"key": key, "file": None, "triton_hash": h,
                                      "triton_cache": str(tdir), "pid": os.getpid(),
                                      "host": os.uname().nodename, "time": time.time(),
                                      "compile_s": round(time.monotonic() - t0, 3)})
            STATS["loaded" if known else "compiled"] += 1
            ev = {"name": spec.name, "kind": "triton", "action": "loaded" if known else "compiled",
                  "seconds": time.monotonic() - t0}
            events.append(ev)
            if log:
                log(ev)
    return events


def prepare_kernel_cache(cfg, par, buckets=DEFAULT_BUCKETS, root=None,
                         plan=None) -> list[dict] | None:
    """Rank start-up hook (compile before capture): warm the node cache for this replica's
    kernels, so the GEMVs load from it and Triton's JIT hits its shared disk cache. plan: the
    model's decode plan (K3ForCausalLM.decode_plan, resolved at build with the replica's
    options; None: resolved here with the served defaults). None when no cache is configured
    ($RAYDECODE_KERNEL_CACHE unset) — the kernels then JIT as before."""
    root = cache_dir(root)
    if root is None:
        return None
    use_triton_cache(root)
    kp = plan_kernels(cfg, par.tp_size, buckets, current_arch(), plan=plan)
    return warm(kp, root)


__all__ = ["DEFAULT_BUCKETS", "ENV", "GemvItem", "KernelPlan", "NormSituItem", "ResidentMoEItem",
           "check_buckets", "kernel_plan", "plan_kernels", "prepare_kernel_cache", "warm"]
