"""MXFP4 weights: e2m1 values, two per byte, one ue8m0 power-of-two scale per group of 32.

Layout (compressed-tensors `mxfp4-pack-quantized`, as K3's routed experts store it):
  weight_packed  uint8 (N, K/2)   byte j of a row holds elements 2j (low nibble) and 2j+1 (high)
  weight_scale   uint8 (N, K/32)  ue8m0: scale = 2**(s - 127); s = 255 is NaN and refused
  w[n, k] = e2m1(code[n, k]) · 2**(scale[n, k // 32] - 127)

e2m1 code = sign (bit 3) | magnitude index (bits 0-2) into [0, 0.5, 1, 1.5, 2, 3, 4, 6].

Checked against public code (facts only):
  - compressed-tensors `compressors/.../nvfp4_quantized.py` `pack_fp4_to_uint8`: magnitude index
    from FLOAT_TO_E2M1 = [0, .5, 1, 1.5, 2, 3, 4, 6], sign in bit 3, and
    `packed = idx[:, 0] | (idx[:, 1] << 4)` (the even element is the low nibble); its
    `unpack_fp4_from_uint8` stacks (low, high) in that order.
  - vLLM `mxfp4_utils.py`: MXFP4_BLOCK_SIZE = 32, MXFP4_SCALE_BIAS = 127 (e8m0, 127 == 2**0),
    FP4_LUT = [0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, ..., -6], low -> high nibble order.
"""
from __future__ import annotations

import torch

GROUP_SIZE = 32
SCALE_BIAS = 127
E2M1_MAX = 6.0
# magnitude index -> value; code c decodes to (-1)**(c >> 3) * E2M1_VALUES[c & 7]
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# |q| strictly above MIDPOINTS[i] rounds to index >= i + 1; ties go to the even code
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_UP = (0.75, 1.75, 3.5)   # midpoints whose upper neighbour has the even code


class MXFP4Error(ValueError):
    """Packed MXFP4 data whose shapes or dtypes do not fit the format."""


def _lut(device) -> torch.Tensor:
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])  # (16,) code -> value


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (packed uint8 (N, K/2), scales uint8 (N, K/32)).

    Per group the scale is the smallest power of two 2**e with max|w| / 2**e <= 6 (so nothing
    clips), then each w / 2**e rounds to the nearest e2m1 value (ties to the even code).
    Error bound per element: |w - deq| <= half the e2m1 gap at |w| / 2**e, times 2**e.
    """
    if w.dim() != 2:
        raise MXFP4Error(f"pack_mxfp4 takes a 2-D (N, K) weight, got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise MXFP4Error(f"pack_mxfp4 takes a floating-point weight, got {w.dtype}")
    n, k = w.shape
    if k % GROUP_SIZE:
        raise MXFP4Error(f"K = {k} is not a multiple of the MXFP4 group size {GROUP_SIZE}")
    g = w.detach().float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    if not torch.isfinite(g).all():
        raise MXFP4Error("pack_mxfp4: weight has inf or NaN entries")
    amax = g.abs().amax(dim=-1)                                   # (N, G)
    # e = ceil(log2(amax / 6)) via frexp (amax/6 = m·2**x, m in [0.5, 1)), then fix rounding
    mant, ex = torch.frexp(amax / E2M1_MAX)
    e = torch.where(mant == 0.5, ex - 1, ex).to(torch.int32)
    e = torch.where(torch.ldexp(amax, -e) > E2M1_MAX, e + 1, e)
    e = torch.where(amax == 0, torch.zeros_like(e), e).clamp(-SCALE_BIAS, SCALE_BIAS)
    q = torch.ldexp(g, -e.unsqueeze(-1))                          # (N, G, 32), |q| <= 6
    a = q.abs().clamp(max=E2M1_MAX)
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=w.device)
    idx = (a.unsqueeze(-1) > mids).sum(-1)                        # ties round down here
    idx = idx + torch.isin(a, torch.tensor(_TIES_UP, device=w.device)).long()
    code = (idx | ((q < 0) & (idx > 0)).long() << 3).to(torch.uint8).reshape(n, k)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    scales = (e + SCALE_BIAS).to(torch.uint8)
    return packed.contiguous(), scales.contiguous()


def unpack_mxfp4(packed: torch.Tensor, scales: torch.Tensor,
                 dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(..., N, K/2) uint8 + (..., N, K/32) uint8 -> (..., N, K) in `dtype` (exact in fp32)."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise MXFP4Error(f"MXFP4 packed and scales must be uint8, got {packed.dtype} and "
                         f"{scales.dtype}")
    if packed.dim() < 2 or packed.shape[:-1] != scales.shape[:-1]:
        raise MXFP4Error(f"MXFP4 packed {tuple(packed.shape)} and scales "
                         f"{tuple(scales.shape)} must agree on every dim but the last")
    k = packed.shape[-1] * 2
    if k % GROUP_SIZE:
        raise MXFP4Error(f"MXFP4 packed width {packed.shape[-1]} gives K = {k}, not a "
                         f"multiple of the group size {GROUP_SIZE}")
    groups = scales.shape[-1]
    if groups != k // GROUP_SIZE:
        got = f"{k / groups:g}" if groups else "undefined"
        raise MXFP4Error(f"MXFP4 scales have {groups} columns for K = {k} (group size {got});"
                         f" group size {GROUP_SIZE} needs K/32 = {k // GROUP_SIZE} columns")
    if (scales == 255).any():
        raise MXFP4Error("MXFP4 scales contain 255 (NaN in ue8m0)")
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)   # (..., N, K)
    vals = _lut(packed.device)[codes.long()]
    scale = torch.ldexp(torch.ones_like(scales, dtype=torch.float32),
                        scales.to(torch.int32) - SCALE_BIAS)             # (..., N, K/32)
    out = vals.unflatten(-1, (groups, GROUP_SIZE)) * scale.unsqueeze(-1)
    return out.flatten(-2).to(dtype)
