"""The stock path's fused parts on CUDA (issue 28) against the PyTorch they replace:
- the router's fp32-out GEMM (models/moe.py `linear_fp32_out`: one bf16 tensor-core GEMM with
  fp32 output instead of upcasting both operands) equals the fp32 product of the same values
  to fp32 summation order, and this torch build runs it (no silent fallback);
- the stock path's fused kernels on CUDA bf16 (models/layers.py `STOCK_FUSED`: the KDA decode
  rows, gate and gated norm, the MLA decode rows through the paged decode kernels, the RMSNorm
  modules, the router's top-k, the SiTU) against the
  same model with them off, both held to the bf16 noise check against the fp32 ground truth,
  on the tiny model and a K3 slice (head_dim 128), with the kernels counted as they run;
- the stock step's AttnRes through the fused residual-add + mix + norm op (K3Model
  `stock_fused_attnres`, kernels/attnres_norm.py Triton) gives the logits the PyTorch mix gives,
  over a chunked prefill and decode steps with caches: fp32 within TOL_FP32 and the same
  greedy picks wherever the top-2 gap is ≥ TIE_FP32 σ (the KDA prefill runs its fp32
  reference here, out of fla's TF32); bf16 is held to the bf16 noise check against the fp32
  ground truth (tests/_prefill_forced.py)."""
from __future__ import annotations

import pytest
import torch

from raydecode.kernels import kda_decode_triton, kda_prefill, stock_elementwise
from raydecode.models import layers as layers_mod
from raydecode.models import moe as moe_mod
from raydecode.models.attnres import attnres_fusable
from raydecode.models.k3 import K3Model
from raydecode.models.mla import MLAAttention

from _numerics import rel_err
from _prefill_forced import (TIE_FP32, TOL_FP32, k3_slice, run_forced, tiny_model, upcast_,
                             within_bf16_noise)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
N = 8


@pytest.mark.parametrize("T", [1, 37, 2048])
def test_router_fp32_out_gemm_is_the_fp32_product(T):
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, 7168, device="cuda", generator=g).bfloat16()
    w = (torch.randn(896, 7168, device="cuda", generator=g) / 85).bfloat16()
    got = moe_mod.linear_fp32_out(x, w)
    assert moe_mod._MM_OUT_DTYPE[0], "torch.mm(..., out_dtype=float32) is not in this build"
    want = x.double() @ w.double().t()
    assert got.dtype == torch.float32 and got.shape == (T, 896)
    assert rel_err(got, want) < 1e-5
    ref = torch.nn.functional.linear(x.float(), w.float())         # the upcast it replaces
    assert rel_err(got, ref) < 1e-5


def _both(model, prompt, monkeypatch, forced=None):
    """(fused, plain) forced runs of the stock path: AttnRes fused, then the PyTorch mix."""
    fused = run_forced(model, prompt, N, forced=forced)
    with monkeypatch.context() as m:
        m.setattr(K3Model, "stock_fused_attnres", False)
        plain = run_forced(model, prompt, N, forced=fused.tokens)
    return fused, plain


def test_stock_fused_attnres_gives_the_pytorch_mix_logits_fp32(monkeypatch):
    monkeypatch.setattr(kda_prefill, "available", lambda *ts: False)   # no TF32 in the loop
    model, prompts = tiny_model("cuda", torch.float32)
    assert attnres_fusable(model.lm_head.weight), "no Triton: the stock mix would stay PyTorch"
    fused, plain = _both(model, prompts[0], monkeypatch)
    errs = [rel_err(a, b) for a, b in zip(fused.rows, plain.rows)]
    # not 1e-4: with the KDA reference in the loop the two mixes still came out 0.1–0.6 %
    # apart on the H200 (source not isolated; the MoE's fp32 dots run IEEE, not TF32), the
    # same spread as two correct fp32 orders with fla in the loop; a wrong mix moves them O(1)
    assert max(errs) <= TOL_FP32, errs
    flips = [j for j, (a, b, gap) in enumerate(zip(fused.argmax, plain.argmax, plain.gaps))
             if a != b and gap >= TIE_FP32]
    assert not flips, f"positions {flips} pick other tokens at top-2 gaps ≥ {TIE_FP32} σ"


def test_stock_fused_attnres_bf16_is_within_the_bf16_noise(monkeypatch):
    monkeypatch.setattr(kda_prefill, "available", lambda *ts: False)
    model, prompts = tiny_model("cuda", torch.bfloat16)
    fused, plain = _both(model, prompts[0], monkeypatch)
    with monkeypatch.context() as m:
        m.setattr(K3Model, "stock_fused_attnres", False)
        truth = run_forced(upcast_(model), prompts[0], N, forced=fused.tokens)
    e_fused = [rel_err(a, b) for a, b in zip(fused.rows, truth.rows)]
    e_plain = [rel_err(a, b) for a, b in zip(plain.rows, truth.rows)]
    assert within_bf16_noise(e_fused, e_plain), (e_fused, e_plain)


@pytest.mark.parametrize("which", ["tiny", "k3"])
def test_stock_fused_ops_bf16_are_within_the_bf16_noise(which, monkeypatch):
    monkeypatch.setattr(kda_prefill, "available", lambda *ts: False)   # fp32 KDA prefill
    model, prompts = (tiny_model if which == "tiny" else k3_slice)("cuda")
    calls = {"rows": 0, "gate": 0, "norm": 0, "mla_rows": 0}

    def counted(name, fn):
        def run(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return run
    monkeypatch.setattr(kda_decode_triton, "kda_rows_triton",
                        counted("rows", kda_decode_triton.kda_rows_triton))
    monkeypatch.setattr(MLAAttention, "_rows_paged",
                        counted("mla_rows", MLAAttention._rows_paged))
    monkeypatch.setattr(stock_elementwise, "_gate_beta_kernel",
                        _Counted(stock_elementwise._gate_beta_kernel, calls, "gate"))
    monkeypatch.setattr(stock_elementwise, "_gated_norm_kernel",
                        _Counted(stock_elementwise._gated_norm_kernel, calls, "norm"))
    assert layers_mod.STOCK_FUSED, "RAYDECODE_STOCK_FUSED is off in this environment"
    with torch.no_grad():            # the shared gate ‖ up packed, as a served rank has them
        for layer in model.model.layers:
            moe = getattr(layer, "block_sparse_moe", None)
            if moe is not None and moe.shared_experts is not None:
                moe._h2_proj()
    packed = []
    adj = layers_mod.adjacent_rows
    monkeypatch.setattr(layers_mod, "adjacent_rows",
                        lambda a, b: (lambda v: (packed.append(v is not None), v)[1])(adj(a, b)))
    fused = run_forced(model, prompts[0], N)
    assert any(packed), "no shared gate ‖ up ran as one GEMM"
    assert all(calls[k] > 0 for k in calls), calls          # the kernels served the run
    with monkeypatch.context() as m:
        m.setattr(layers_mod, "STOCK_FUSED", False)
        before = dict(calls)
        plain = run_forced(model, prompts[0], N, forced=fused.tokens)
        assert calls == before, "a fused kernel ran with the setting off"
        truth = run_forced(upcast_(model), prompts[0], N, forced=fused.tokens)
    e_fused = [rel_err(a, b) for a, b in zip(fused.rows, truth.rows)]
    e_plain = [rel_err(a, b) for a, b in zip(plain.rows, truth.rows)]
    assert within_bf16_noise(e_fused, e_plain), (e_fused, e_plain)


class _Counted:
    """A Triton kernel handle whose launches (`kernel[grid](...)`) are counted."""

    def __init__(self, kernel, calls: dict, name: str):
        self.kernel, self.calls, self.name = kernel, calls, name

    def __getitem__(self, grid):
        self.calls[self.name] += 1
        return self.kernel[grid]
