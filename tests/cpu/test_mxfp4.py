"""MXFP4 pack/unpack against an independent scalar dequantization and the e2m1 error bound."""
import pytest
import torch

from raydecode.models.mxfp4 import MXFP4Error, pack_mxfp4, unpack_mxfp4


def _ref_dequant(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Scalar OCP MX decoding: code = [s | e1 e0 | m]; e == 0: m/2, else 2**(e-1)·(1 + m/2)."""
    n, half = packed.shape
    out = torch.empty(n, half * 2, dtype=torch.float64)
    for r in range(n):
        for k in range(half * 2):
            byte = int(packed[r, k // 2])
            code = byte & 0xF if k % 2 == 0 else byte >> 4
            sign, exp, man = code >> 3, (code >> 1) & 3, code & 1
            mag = man / 2 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2)
            out[r, k] = (-1) ** sign * mag * 2.0 ** (int(scales[r, k // 32]) - 127)
    return out


def test_unpack_matches_scalar_reference():
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (5, 48), dtype=torch.uint8, generator=g)   # K = 96
    scales = torch.randint(100, 150, (5, 3), dtype=torch.uint8, generator=g)
    ref = _ref_dequant(packed, scales)
    assert torch.equal(unpack_mxfp4(packed, scales, torch.float32).double(), ref)
    assert torch.equal(unpack_mxfp4(packed, scales, torch.bfloat16), ref.to(torch.bfloat16))
    # leading batch dims decode each matrix the same way
    stacked = unpack_mxfp4(torch.stack([packed, packed.flip(0)]),
                           torch.stack([scales, scales.flip(0)]), torch.float32)
    assert torch.equal(stacked[1].double(), _ref_dequant(packed.flip(0), scales.flip(0)))


def _half_gap(q: torch.Tensor) -> torch.Tensor:
    """Half the distance between neighbouring e2m1 magnitudes around |q| (|q| <= 6)."""
    a = q.abs()
    return torch.where(a <= 2, 0.25, torch.where(a <= 4, 0.5, 1.0))


def test_round_trip_within_e2m1_bound():
    g = torch.Generator().manual_seed(2)
    row_scale = torch.tensor([1e-3, 0.02, 1.0, 7.0, 300.0, 1e4])[:, None]
    w = torch.randn(6, 128, generator=g) * row_scale
    w[2, 32:64] = 0                                     # an all-zero group
    packed, scales = pack_mxfp4(w)
    assert packed.shape == (6, 64) and scales.shape == (6, 4)
    deq = unpack_mxfp4(packed, scales, torch.float32)
    step = (2.0 ** (scales.double() - 127)).repeat_interleave(32, dim=1)      # (6, 128)
    q = w.double() / step
    assert (q.abs() <= 6).all()                         # the group max fits: nothing clipped
    amax = w.double().abs().reshape(6, 4, 32).amax(-1)
    nonzero = amax > 0
    # and the scale is the smallest such power of two
    assert (amax[nonzero] / (2.0 ** (scales.double()[nonzero] - 128)) > 6).all()
    err = (deq.double() - w.double()).abs()
    assert (err <= _half_gap(q) * step + 1e-12).all()
    assert torch.equal(deq[2, 32:64], torch.zeros(32))


def test_representable_values_round_trip_exactly():
    g = torch.Generator().manual_seed(3)
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    vals = mags[torch.randint(0, 8, (4, 64), generator=g)]
    vals = vals * torch.where(torch.rand(4, 64, generator=g) < 0.5, -1.0, 1.0)
    vals[:, ::32] = 6.0                                 # pin each group's scale exponent
    w = vals * (2.0 ** torch.tensor([-3.0, 0.0, 2.0, 9.0]))[:, None]
    packed, scales = pack_mxfp4(w)
    assert torch.equal(unpack_mxfp4(packed, scales, torch.float32), w)
    assert scales.tolist() == [[124, 124], [127, 127], [129, 129], [136, 136]]


def test_ties_round_to_even_code():
    x = torch.zeros(1, 32)
    x[0, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])  # scale 2**0
    deq = unpack_mxfp4(*pack_mxfp4(x), torch.float32)[0, :8]
    # the even code of each neighbouring pair (code bit 0 = mantissa bit is 0)
    assert deq.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]


def test_errors_name_the_problem():
    w = torch.randn(4, 48)
    with pytest.raises(MXFP4Error, match="not a multiple of the MXFP4 group size 32"):
        pack_mxfp4(w)
    packed, scales = pack_mxfp4(torch.randn(4, 64))
    wide = torch.full((4, 4), 127, dtype=torch.uint8)               # K/16: group size 16
    with pytest.raises(MXFP4Error, match="group size 16"):
        unpack_mxfp4(packed, wide)
    with pytest.raises(MXFP4Error, match="must agree"):
        unpack_mxfp4(packed, scales[:3])
    with pytest.raises(MXFP4Error, match="uint8"):
        unpack_mxfp4(packed.int(), scales)
    bad = scales.clone()
    bad[0, 0] = 255
    with pytest.raises(MXFP4Error, match="NaN"):
        unpack_mxfp4(packed, bad)
