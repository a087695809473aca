"""Helpers the exploration scripts share: the relative error they check candidates with, a
CUDA-event median timing, a per-kernel device-time breakdown and order-keeping de-duplication
of candidate lists."""
from __future__ import annotations

import argparse
import statistics

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in fp64 (b the reference)."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def median_cuda_ms(fn, reps: int = 10, warm: bool = True) -> float:
    """Median of `reps` CUDA-event timings of fn() (ms), after one untimed call if warm."""
    if warm:
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def kernel_ms(fn, calls: int = 3, top: int = 12) -> dict[str, float]:
    """Device ms per call of each kernel fn() launches (torch.profiler over `calls` calls,
    averaged), the `top` slowest by name (first 60 characters), plus "total"."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    per: dict[str, float] = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0) or 0
        if getattr(e, "device_type", None) == cuda and us > 0:
            name = e.key[:60]
            per[name] = per.get(name, 0.0) + us / 1e3 / calls
    out = dict(sorted(per.items(), key=lambda kv: -kv[1])[:top])
    out = {k: round(v, 4) for k, v in out.items()}
    out["total"] = round(sum(per.values()), 4)
    return out


def unique(items) -> list:
    """items without repeats, first occurrences in order (candidate lists)."""
    out = []
    for x in items:
        if x not in out:
            out.append(x)
    return out


def rank_parser(doc: str, layers: int = 8) -> argparse.ArgumentParser:
    """The arguments of the scripts that build the prefill bench's solo rank (K3 at one TP
    rank's shapes, the first `--layers` layers): --out, --commit, --tp, --layers, --seed,
    --device; the script adds its own."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--tp", type=int, default=16)
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    return ap
