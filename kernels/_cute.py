"""Shared CuTe DSL plumbing: availability check and a compile cache.

Importing this module never imports cutlass; `cute_available()` does, once, and remembers the
answer, so CPU-only machines without `nvidia-cutlass-dsl` import every kernel module cleanly.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Hashable

import torch


@functools.lru_cache(maxsize=1)
def cute_available() -> bool:
    """True when `cutlass.cute` imports (nvidia-cutlass-dsl installed) and CUDA is present."""
    if not torch.cuda.is_available():
        return False
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception:  # ImportError, or a broken native library on a non-GPU host
        return False
    return True


@functools.lru_cache(maxsize=None)
def device_sm(device_index: int) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device."""
    return torch.cuda.get_device_capability(device_index)


class CompileCache:
    """Process-wide cache of compiled kernels keyed by a hashable tuple.

    Compiles happen under one lock: two threads asking for the same key compile it once.
    """

    def __init__(self) -> None:
        self._entries: dict[Hashable, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        hit = self._entries.get(key)
        if hit is not None:
            return hit
        with self._lock:
            hit = self._entries.get(key)
            if hit is None:
                hit = build()
                self._entries[key] = hit
            return hit

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


_DUMMY_I64: dict[torch.device, torch.Tensor] = {}


def dummy_int64(device: torch.device) -> torch.Tensor:
    """A one-word int64 CUDA tensor, one per device: the trace buffer untraced launches of the
    resident kernels pass (never written)."""
    if device not in _DUMMY_I64:
        _DUMMY_I64[device] = torch.zeros(1, device=device, dtype=torch.int64)
    return _DUMMY_I64[device]
