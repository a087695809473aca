"""Triton import, the device predicate, and programmatic dependent launch (PDL) for the decode
kernels.

PDL (sm_90+): a kernel launched with `launch_pdl=True` may be scheduled while the kernel before
it in the stream is still running; it must not touch memory the previous kernel writes or reads
until `gdc_wait()` returns (that kernel has completed and its writes are visible). Every decode
kernel taking the `PDL` constexpr therefore calls `pdl_enter(PDL)` as its first statement:

    gdc_wait()                  nothing before it: no load, no store
    gdc_launch_dependents()     the next PDL launch may start its own prologue now

so a chain of such kernels overlaps each launch and prologue with the previous kernel's tail,
and a kernel's completion still implies its predecessors' (each waited for the one before).
Ordinary launches (PyTorch ops, the stock path) keep full stream ordering. In a CUDA graph the
attribute becomes a programmatic edge. `pdl_launch(t)` returns the launch keywords: PDL only
for CUDA tensors on sm_90+ with `PDL_DEFAULT` on; never under the CPU interpreter.
"""
from __future__ import annotations

import functools
import os

import torch

from raydecode.kernels import settings

try:  # CPU-only installs have no Triton: the references serve them
    import triton
    import triton.language as tl
except Exception:  # ImportError, or a broken install
    triton = tl = None

# the warps per program a Triton launch takes (configs and launch options are checked
# against it before they reach a launch)
LAUNCH_WARPS = (1, 2, 4, 8, 16)

# RAYDECODE_TRITON_PDL=0 turns it off (A/B timing; a profile without the overlap)
PDL_DEFAULT = settings.triton_pdl()
pdl_enter = tanh_f32 = None    # the @triton.jit helpers below, when Triton imports


def available(*ts: torch.Tensor) -> bool:
    """Triton can run on these tensors: all CUDA, or all CPU under TRITON_INTERPRET=1."""
    if triton is None:
        return False
    if all(t.is_cuda for t in ts):
        return True
    return os.environ.get("TRITON_INTERPRET") == "1" and not any(t.is_cuda for t in ts)


H200_SMS = 132            # SM count assumed off the GPU (CPU interpreter, sizing on the host)


@functools.lru_cache(maxsize=None)
def sm_count(device: str) -> int:
    """SMs of `device` (str(torch.device)); H200_SMS for a CPU device or without CUDA. Grid
    heuristics that fill one wave (MLA KV splits, the KDA split form) read it."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    return H200_SMS


@functools.lru_cache(maxsize=None)
def _sm_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def pdl_launch(t: torch.Tensor, enable: bool | None = None) -> dict:
    """Launch keywords for a kernel with a `PDL` constexpr (see module docstring)."""
    on = PDL_DEFAULT if enable is None else enable
    if on and t.is_cuda and _sm_major(t.device.index if t.device.index is not None
                                      else torch.cuda.current_device()) >= 9:
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def tanh_f32(x):
        """tanh in fp32: 2σ(2x) − 1, and x − x³/3 + 2x⁵/15 below |x| = 1/16, where 2σ(2x) − 1
        cancels (relative error ≈ 6e-8/|x|; the series' first dropped term is 17x⁷/315 ≈
        5e-9·|x| there). The SiTU of a tiny gate must not round to zero."""
        x2 = x * x
        small = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0)))
        return tl.where(tl.abs(x) < 0.0625, small, 2.0 * tl.sigmoid(2.0 * x) - 1.0)

    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        """First statement of a PDL-launched kernel (module docstring)."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()


__all__ = ["H200_SMS", "LAUNCH_WARPS", "PDL_DEFAULT", "available", "pdl_enter", "pdl_launch",
           "sm_count", "tanh_f32", "tl", "triton"]
