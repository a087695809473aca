"""Offline (GPU-less) Triton compiles that land in the cache a later JIT launch reads.

Triton's JIT keys its on-disk cache (TRITON_CACHE_DIR) by (kernel source, signature
specialization, constexprs, options, target, backend/ptxas version, cache-invalidating env).
Running the JIT's own binder on meta tensors for an explicit `GPUTarget("cuda", 90, 32)` produces
the same specialization a CUDA launch produces when

  * every pointer argument is 16-byte aligned at launch (the caching allocator gives 512 B),
  * every integer argument has the value it will have at launch (value % 16 and == 1 specialize),
  * constexprs and launch options (num_warps, ...) are the launch's,

so `triton.compile` with that source writes the very entry the launch then finds. Version-coupled
to Triton's binder (`create_function_from_signature`, `JITFunction._pack_args`); a mismatch only
costs a JIT compile at the first launch (Triton re-derives the key), never a wrong kernel.
"""
from __future__ import annotations

import importlib
import inspect
import os
import re
from dataclasses import dataclass

import torch

from raydecode.kernels.router_triton import SORT_DEFAULT
from raydecode.kernels.settings import DEFAULT_OPTIONS, DecodeOptions

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8}


@dataclass(frozen=True)
class TritonSpec:
    """One Triton launch signature. args: ("ptr", dtype name) | ("int", value) | ("float", value);
    kwargs: constexprs and launch options, as passed at the launch site."""
    name: str
    kernel: str                      # "module:attribute" of the @triton.jit function
    args: tuple[tuple[str, object], ...]
    kwargs: tuple[tuple[str, object], ...]

    def key(self) -> dict:
        return {"kind": "triton", "name": self.name, "kernel": self.kernel,
                "args": [list(a) for a in self.args], "kwargs": dict(self.kwargs)}


# what `kernels._triton.pdl_launch` adds on sm_90+ (compile_spec drops it for older targets)
PDL_KW = (("PDL", True), ("launch_pdl", True))


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def triton_specs(cfg, tp: int = 1, options: DecodeOptions = DEFAULT_OPTIONS) -> list[TritonSpec]:
    """The decode-path Triton launches whose signature follows from the model config and TP:
    the fused router top-k, and the fused MoE block's latent norm + SiTU (models/moe.py
    `_forward_fused` → `latent_norm_situ`; its widths are 1/TP, from `decode_gemv_shapes`).
    Kernels with data-dependent specializations (AttnRes bank count per layer, MoE runs) are
    left to the JIT, which shares TRITON_CACHE_DIR across the node's ranks.

    The norm + SiTU spec takes rank 0's latent offset c0 = 0; another rank's c0 = r·L/TP
    specializes the same way while L/TP is a multiple of 16 (K3: 224 at TP16, 448 at TP8),
    else that rank JITs it once."""
    from raydecode.models.params import decode_gemv_shapes, moe_block_fused

    out = []
    if cfg.moe is not None and any(cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        E, k = cfg.moe.num_experts, cfg.moe.top_k
        be = _next_pow2(E)
        out.append(TritonSpec(   # kernels/router_triton.py route_topk_triton, fp32 logits + bias
            "route_topk", "raydecode.kernels.router_triton:_route_topk_kernel",
            (("ptr", "float32"), ("int", E), ("ptr", "float32"), ("ptr", "float32"),
             ("ptr", "int64"), ("int", E), ("float", 1.0)),
            (("K", k), ("KP", _next_pow2(k)), ("BLOCK_E", be), ("HAS_BIAS", True),
             ("RENORM", True), ("SORT", SORT_DEFAULT), ("GATHER", options.router_gather),
             ("num_warps", max(1, min(8, be // 256)))) + PDL_KW))
        if options.moe_fused and moe_block_fused(cfg) and cfg.dtype == "bfloat16":
            sh = decode_gemv_shapes(cfg, tp, "specialized")
            D, n_cols, I = cfg.moe.latent_size, sh["latent_down"][0], sh["shared_gate"][0]
            y_cols, k_out = sh["h2_proj"][0], sh["ffn_out"][1]
            lin = cfg.situ_linear_beta
            out.append(TritonSpec(   # kernels/decode_elementwise_triton.py latent_norm_situ
                "latent_norm_situ", "raydecode.kernels.decode_elementwise_triton:_norm_situ_kernel",
                (("ptr", "float32"), ("int", D), ("ptr", "bfloat16"), ("int", D),
                 ("float", cfg.rms_norm_eps), ("int", 0), ("int", n_cols),
                 ("ptr", "float32"), ("int", y_cols), ("int", I), ("float", cfg.situ_beta),
                 ("float", lin if lin is not None else 1.0), ("ptr", "bfloat16"),
                 ("int", k_out), ("int", k_out)),
                (("HAS_LIN", lin is not None), ("BLOCK_D", _next_pow2(D)),
                 ("BLOCK", min(1024, _next_pow2(k_out - n_cols))), ("num_warps", 8))
                + PDL_KW))
    return out


def _arg(a):
    kind, v = a
    if kind == "ptr":
        return torch.empty(1, dtype=_DTYPES[v], device="meta")   # data_ptr 0: 16-byte aligned
    return int(v) if kind == "int" else float(v)


def _run_compilation_knobs() -> list[tuple[str, str]]:
    """(kwarg, knob) pairs `JITFunction.run` sets from `knobs.compilation` in this Triton:
    3.9 sets instrumentation_mode and fpsan_homomorphic_casts; 3.6 (the H200 host's) lacks the
    latter knob, and reading it there raised AttributeError."""
    from triton.runtime.jit import JITFunction

    src = inspect.getsource(JITFunction.run)
    return re.findall(r'kwargs\["(\w+)"\]\s*=\s*knobs\.compilation\.(\w+)', src)


def compile_spec(spec: TritonSpec, arch: str, cache: str | os.PathLike) -> str:
    """triton.compile `spec` for `arch` into Triton cache dir `cache`; returns the kernel hash.
    Needs no GPU (ptxas ships with Triton)."""
    return compile_kernel(spec, arch, cache).hash


def compile_kernel(spec: TritonSpec, arch: str, cache: str | os.PathLike):
    """`compile_spec`, returning Triton's CompiledKernel (its .asm holds ptx / cubin)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    mod, attr = spec.kernel.split(":")
    fn = getattr(importlib.import_module(mod), attr)
    cc = int(arch[3:].rstrip("af"))
    target = GPUTarget("cuda", cc, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kw = dict(spec.kwargs)
    if cc < 90 and "PDL" in kw:        # pdl_launch: no programmatic launch before sm_90
        kw.pop("launch_pdl", None)
        kw["PDL"] = False
    # the keyword options JITFunction.run adds before binding (same knobs → same cache key);
    # which compilation knobs it adds varies by Triton release, so read them off its source
    kw["debug"] = kw.get("debug", fn.debug) or knobs.runtime.debug
    for name, knob in _run_compilation_knobs():
        kw[name] = getattr(knobs.compilation, knob)
    bound, special, options = binder(*(_arg(a) for a in spec.args), **kw)
    options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, special, options)
    old = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = os.fspath(cache)
    try:
        k = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                           options=options.__dict__)
    finally:
        if old is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = old
    return k


__all__ = ["TritonSpec", "compile_kernel", "compile_spec", "triton_specs"]
