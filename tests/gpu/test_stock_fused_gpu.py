"""The stock path's fused parts on CUDA (issue 28) against the PyTorch they replace:
- the router's fp32-out GEMM (models/moe.py `linear_fp32_out`: one bf16 tensor-core GEMM with
  fp32 output instead of upcasting both operands) equals the fp32 product of the same values
  to fp32 summation order, and this torch build runs it (no silent fallback);
- the stock step's AttnRes through the fused residual-add + mix + norm op (K3Model
  `stock_fused_attnres`, kernels/attnres_norm.py Triton) gives the logits the PyTorch mix gives,
  over a chunked prefill and decode steps with caches (fp32: to summation order; bf16: within
  the rounding of one bf16 ulp per sublayer)."""
from __future__ import annotations

import pytest
import torch

from raydecode.models import moe as moe_mod
from raydecode.models.attnres import attnres_fusable
from raydecode.models.k3 import K3Model

from _prefill_forced import rel, run_forced, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("T", [1, 37, 2048])
def test_router_fp32_out_gemm_is_the_fp32_product(T):
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, 7168, device="cuda", generator=g).bfloat16()
    w = (torch.randn(896, 7168, device="cuda", generator=g) / 85).bfloat16()
    got = moe_mod.linear_fp32_out(x, w)
    assert moe_mod._MM_OUT_DTYPE[0], "torch.mm(..., out_dtype=float32) is not in this build"
    want = x.double() @ w.double().t()
    assert got.dtype == torch.float32 and got.shape == (T, 896)
    assert rel(got, want) < 1e-5
    ref = torch.nn.functional.linear(x.float(), w.float())         # the upcast it replaces
    assert rel(got, ref) < 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_stock_fused_attnres_gives_the_pytorch_mix_logits(dtype, tol, monkeypatch):
    model, prompts = tiny_model("cuda", dtype)
    assert attnres_fusable(model.lm_head.weight), "no Triton: the stock mix would stay PyTorch"
    fused = run_forced(model, prompts[0], 8)
    monkeypatch.setattr(K3Model, "stock_fused_attnres", False)
    plain = run_forced(model, prompts[0], 8, forced=fused.tokens)
    errs = [rel(a, b) for a, b in zip(fused.rows, plain.rows)]
    assert max(errs) <= tol, errs
