"""Helpers the exploration scripts share: the relative error they check candidates with, a
CUDA-event median timing, and order-keeping de-duplication of candidate lists."""
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
