"""kernels/kda_conv.py off CUDA: the op's contract (what the Triton kernel must match, tested
on the GPU in tests/gpu/test_kda_prefill_gpu.py) checked against a token-by-token loop, and
its input errors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raydecode.kernels import kda_conv as KC

from _numerics import fresh_seed, rel_err


def _loop(xs, w, h, d, dtype):
    """Per token t: SiLU(Σ_j xs[t + j] · w[:, j]), rounded to dtype, q/k rows L2-normalised."""
    W = w.shape[1]
    rows = []
    for t in range(xs.shape[0] - (W - 1)):
        acc = sum(xs[t + j].double() * w[:, j].double() for j in range(W))
        rows.append(F.silu(acc).to(dtype).double())
    y = torch.stack(rows).view(-1, 3, h, d)
    q, k, v = y[:, 0], y[:, 1], y[:, 2]
    norm = lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + KC.L2_EPS)  # noqa: E731
    return norm(q), norm(k), v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("L", [1, 5, 70])
def test_reference_is_the_token_loop(dtype, L):
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    h, d, W = 3, 16, 4
    xs = torch.randn(W - 1 + L, 3 * h * d, generator=g).to(dtype)
    w = 0.5 * torch.randn(3 * h * d, W, generator=g)
    got = KC.conv_silu_l2(xs, w, h, d, dtype)
    want = _loop(xs, w, h, d, dtype)
    tol = 1e-6 if dtype == torch.float32 else 8e-3     # bf16: a rounding flip now and then
    for name, a, b in zip("qkv", got, want):
        assert a.shape == (L, h, d) and a.dtype == torch.float32, name
        assert rel_err(a, b) < tol, f"seed {seed}: {name} rel {rel_err(a, b):.2e}"
    assert torch.allclose(got[0].norm(dim=-1), torch.ones(L, h), atol=1e-3)


def test_bad_inputs_name_the_value():
    xs, w = torch.zeros(10, 96), torch.zeros(96, 4)
    with pytest.raises(ValueError, match=r"xs of shape \(10, 95\)"):
        KC.conv_silu_l2(torch.zeros(10, 95), w, 2, 16, torch.float32)
    with pytest.raises(ValueError, match=r"conv weight of shape \(90, 4\)"):
        KC.conv_silu_l2(xs, torch.zeros(90, 4), 2, 16, torch.float32)
    with pytest.raises(ValueError, match="xs has 3 rows"):
        KC.conv_silu_l2(torch.zeros(3, 96), w, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="rounding dtype torch.int32"):
        KC.conv_silu_l2(xs, w, 2, 16, torch.int32)


def test_fp64_takes_the_reference():
    """A float64 model's window goes to the layer's chain (fp32 math, like every model dtype;
    the kernel takes fp32 / bf16 / fp16 only) instead of a ValueError."""
    g = torch.Generator().manual_seed(fresh_seed())
    xs, w = torch.randn(8, 96, generator=g, dtype=torch.float64), torch.randn(96, 4, generator=g)
    q, k, v = KC.conv_silu_l2(xs, w, 2, 16, torch.float64)
    assert not KC._use_kernel(xs, w, 16, torch.float64)
    want = _loop(xs, w, 2, 16, torch.float64)
    assert q.dtype == torch.float32
    assert rel_err(v, want[2]) < 1e-6 and rel_err(q, want[0]) < 1e-6
