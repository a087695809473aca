"""Numerics shared by the CPU and GPU suites: the two error measures, fresh seeds and the bf16
tolerance table (imported as `from _numerics import ...`: tests/ is on sys.path through its
conftest.py).

    rel_err(a, b)      ‖a − b‖ / ‖b‖           fp64, Frobenius norm over all elements
    max_rel_err(a, b)  max |a − b| / max |b|   fp64, the worst element against the largest
Both clamp the denominator at 1e-30 (an all-zero reference gives a huge error, never NaN).
"""
from __future__ import annotations

import os

import torch

BF16_ULP = 2 ** -8             # one bf16 rounding, relative (8 significant bits)

# Tolerances by what the compared computation does differently from its reference.
TOL = {
    "bf16_round": 4e-3,        # one bf16 rounding of the output (≈ 1 ulp; ‖·‖ relative)
    "bf16_3round": 1e-2,       # three bf16 rounding points (the MoE's gate_up, SiTU, down)
    "bf16_path": 3e-2,         # a bf16 specialized path against stock (max-abs relative)
    "interpreter": 2.5e-2,     # a kernel under TRITON_INTERPRET=1 (fp32 → bf16 truncates)
    "fp32_path": 1e-4,         # an fp32 specialized path against stock
    "tf32_dots": 2e-3,         # fp32 matmuls run as TF32 (10-bit mantissa; fla's chunked KDA
                               # ≈ 4e-4 under the interpreter with TF32 rounding emulated)
    "kda_state": 1e-4,         # the KDA prefill's final state with more than TF32's bits in
                               # its dots (RAYDECODE_KDA_PRECISION bf16x3 / tf32x3 / ieee)
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in fp64 (b the reference)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b| in fp64 (b the reference)."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def fresh_seed() -> int:
    """A new random seed per call (os.urandom), for a test to put in its failure message."""
    return int.from_bytes(os.urandom(4), "little") % (1 << 31)


__all__ = ["BF16_ULP", "TOL", "fresh_seed", "max_rel_err", "rel_err"]


def random_kda_params_(layer, seed: int):
    """A KDAAttention's parameters drawn in place (host generator, seeded) at models/k3.py
    init_random_ scales: A_log in [0, 1.386), dt_bias around −1, conv weights × 0.5, norms
    around 1, projections 1/sqrt(fan-in). -> the layer."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name == "A_log":
                r = torch.rand(p.shape, generator=g) * 1.386
            elif name == "dt_bias":
                r = 0.5 * r - 1.0
            elif "conv1d" in name:
                r = 0.5 * r
            elif "norm" in name:
                r = 1.0 + 0.1 * r
            else:
                r = r / p.shape[-1] ** 0.5
            p.copy_(r)
    return layer
