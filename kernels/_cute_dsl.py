"""The CuTe DSL names the kernel modules trace with, or stand-ins on hosts without cutlass.

`from raydecode.kernels._cute_dsl import cutlass, cute, Float32, const_expr, _dsl, _Tensor,
_Stream`: with nvidia-cutlass-dsl these are the real modules/types (`_dsl` is `cute`, so a
kernel's decorators read `_dsl.jit` / `_dsl.kernel` as the DSL preprocessor expects); without it
`cutlass` / `cute` / `Float32` are None and the decorators are no-ops, so kernel classes still
define (and their pure-Python config logic is testable) on CPU-only machines. Unlike
kernels/_cute.py, importing this module imports cutlass when it is installed.
"""
from __future__ import annotations

try:  # CPU-only machines have no cutlass: kernel classes are defined but never compiled there.
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, const_expr

    _dsl = cute
    try:  # cp.async.bulk.prefetch.L2.global (sm_90+), for kernels that stream weights
        from cutlass.experimental.primitives.nvvm_wrapper import cp_async_bulk_prefetch
    except Exception:  # pragma: no cover - older DSL without the experimental wrapper
        cp_async_bulk_prefetch = None
    _Tensor = cute.Tensor
    try:
        from cuda.bindings.driver import CUstream as _Stream
    except Exception:  # pragma: no cover - cuda-python missing
        _Stream = object
except Exception:  # ImportError, or a broken native library
    cutlass = cute = Float32 = cp_async_bulk_prefetch = None

    class _dsl:  # stand-in decorators so the kernel class still defines without cutlass
        @staticmethod
        def jit(fn):
            return fn

        @staticmethod
        def kernel(fn):
            return fn

    _Tensor = _Stream = object

    def const_expr(v):  # noqa: D103 - stand-in, never traced
        return v


__all__ = ["cutlass", "cute", "Float32", "const_expr", "_dsl", "_Tensor", "_Stream",
           "cp_async_bulk_prefetch"]
