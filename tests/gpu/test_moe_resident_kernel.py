"""The resident CuTe MoE kernel (kernels/moe_resident_cute.py) against `moe_mxfp4_reference` on
the GPU (needs CUDA + nvidia-cutlass-dsl, sm_90+).

Fresh random inputs per case (seed from os.urandom, in every failure message); `out` is NaN
before each launch (the kernel must write all of it) and the a scratch is NaN-filled, so a row
pair the down phase reads before it is written fails. Tolerance: ‖out − ref‖ / ‖ref‖ ≤ 1e-2, the
MoE row of tests/gpu/test_fused_triton.py (three bf16 rounding points + fp16 partial sums).
"""
from __future__ import annotations

import os

import pytest
import torch

from raydecode.kernels import moe_mxfp4 as M
from raydecode.kernels import moe_resident_cute as R
from raydecode.kernels._cute import cute_available

from _numerics import TOL as NUM_TOL
from _numerics import fresh_seed, rel_err

pytestmark = pytest.mark.skipif(not cute_available(), reason="needs CUDA and nvidia-cutlass-dsl")
DEV = "cuda"
BF = torch.bfloat16
TOL = NUM_TOL["bf16_3round"]     # gate_up, SiTU, down each round to bf16


def _case(E, L, I, k, T, seed, lin=25.0, last_expert=False):
    g = torch.Generator(device=DEV).manual_seed(seed)
    ex = M.MXFP4Experts.random(E, L, I, 4.0, lin, device=DEV, seed=seed)
    z = torch.randn(T, L, generator=g, device=DEV).to(BF)
    w, ids = torch.rand(T, E, generator=g, device=DEV).topk(k, dim=-1)
    if last_expert:              # the last expert's down scales end at the tensor's end
        ids[0, 0] = E - 1
        ids[0, -1] = 0
    return ex, z, (w / w.sum(-1, keepdim=True)).float(), ids


def _run(plan, z, w, ids, ex):
    counters, a = R._scratch(plan, z.device)
    a.fill_(float("nan"))
    out = torch.full((z.shape[0], ex.latent), float("nan"), device=DEV)
    R.resident_moe_into(plan, z, w, ids, ex, out)
    torch.cuda.synchronize()
    assert int(counters[1]) == 0, "a spin hit its bound"
    assert (counters[R.SYNC_WORDS:] == 0).all() and int(counters[0]) == 0, \
        f"counters not reset: {counters.tolist()}"
    return out


# (E, L, I, k, T, ctas, warps): K3 TP16 batch 1 on every SM; small shapes on few CTAs, where a
# CTA spans several pairs and several rounds, units / CTAs is ragged, and 2–4 tokens.
CASES = [(896, 3584, 192, 16, 1, None, 16), (896, 3584, 192, 16, 1, None, 8),
         (64, 512, 64, 4, 1, 8, 4), (64, 512, 64, 4, 3, 7, 8), (64, 1024, 128, 8, 2, 24, 16),
         (32, 512, 64, 2, 4, 12, 4)]


@pytest.mark.parametrize("E,L,I,k,T,ctas,warps", CASES)
@pytest.mark.parametrize("lin", [None, 25.0])
def test_matches_reference(E, L, I, k, T, ctas, warps, lin):
    seed = fresh_seed()
    ex, z, w, ids = _case(E, L, I, k, T, seed, lin, last_expert=True)
    plan = R.plan_for(z, ids, ex, ctas=ctas, warps=warps)
    assert plan is not None, f"{(E, L, I, k, T, ctas)} should fit"
    ref = M.moe_mxfp4_reference(z, w, ids, ex)
    out = _run(plan, z, w, ids, ex)
    assert not out.isnan().any(), f"seed {seed}"
    assert rel_err(out, ref) <= TOL, f"seed {seed}: {rel_err(out, ref)}"


def test_deterministic_and_fp32_z_rounds_like_bf16():
    """No atomics in the sums: two launches are bit-identical, and fp32 z equals its bf16
    rounding exactly (the kernel rounds z to bf16 on load)."""
    seed = fresh_seed()
    ex, z, w, ids = _case(896, 3584, 192, 16, 1, seed)
    # within a quarter bf16 ulp (2^-9 relative): rounds back to z
    z32 = z.float() * (1 + (torch.rand(z.shape, device=DEV) - 0.5) * 2.0 ** -9)
    assert torch.equal(z32.to(BF), z)
    p16, p32 = R.plan_for(z, ids, ex), R.plan_for(z32, ids, ex)
    a, b, c = _run(p16, z, w, ids, ex), _run(p16, z, w, ids, ex), _run(p32, z32, w, ids, ex)
    assert torch.equal(a, b), f"seed {seed}"
    assert torch.equal(a, c), f"seed {seed}: {(a - c).abs().max()}"


@pytest.mark.parametrize("scale", [2.0 ** -20, 1.0, 3.0e4])
def test_activation_range(scale):
    """x' and a' are scaled by a power of two per token / pair: tiny and large activations and
    one outlier 2^12 above the rest still match; all-zero z gives exact zeros."""
    seed = fresh_seed()
    ex, z, w, ids = _case(64, 1024, 128, 8, 1, seed, None)
    z = z.float() * scale
    z[0, 5] *= 4096.0
    z = z.to(BF)
    plan = R.plan_for(z, ids, ex, ctas=16)
    out = _run(plan, z, w, ids, ex)
    assert out.isfinite().all(), f"seed {seed}"
    assert rel_err(out, M.moe_mxfp4_reference(z, w, ids, ex)) <= TOL, f"seed {seed}"
    assert (_run(plan, torch.zeros_like(z), w, ids, ex) == 0).all(), f"seed {seed}"


def test_duplicate_experts_across_tokens():
    """Two tokens routed to the same experts: each pair reads its expert itself."""
    seed = fresh_seed()
    ex, z, w, ids = _case(64, 512, 64, 4, 2, seed)
    ids[1] = ids[0]
    plan = R.plan_for(z, ids, ex, ctas=8)
    out = _run(plan, z, w, ids, ex)
    assert rel_err(out, M.moe_mxfp4_reference(z, w, ids, ex)) <= TOL, f"seed {seed}"


def test_graph_replays_new_routing_and_inputs():
    """Captured once, replayed with new ids, weights and z: the counters reset themselves."""
    seed = fresh_seed()
    g = torch.Generator(device=DEV).manual_seed(seed)
    ex, z, w, ids = _case(896, 3584, 192, 16, 1, seed)
    plan = R.plan_for(z, ids, ex)
    out = torch.empty(1, 3584, device=DEV)
    R.resident_moe_into(plan, z, w, ids, ex, out)
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        R.resident_moe_into(plan, z, w, ids, ex, out)
    for _ in range(3):
        w2, i2 = torch.rand(1, 896, generator=g, device=DEV).topk(16, dim=-1)
        w.copy_(w2 / w2.sum(-1, keepdim=True))
        ids.copy_(i2)
        z.copy_(torch.randn(1, 3584, generator=g, device=DEV).to(BF))
        out.fill_(float("nan"))
        gr.replay()
        torch.cuda.synchronize()
        assert not out.isnan().any(), f"seed {seed}"
        assert rel_err(out, M.moe_mxfp4_reference(z, w, ids, ex)) <= TOL, f"seed {seed}"
    assert R.spin_flag(plan, z.device) == 0


@pytest.mark.parametrize("predecode", [1, 3, 8])
def test_predecode_matches(predecode):
    """Some or all down rows decoded into registers before the wait: the same sums as none,
    bit for bit."""
    seed = fresh_seed()
    ex, z, w, ids = _case(896, 3584, 192, 16, 1, seed)
    base = _run(R.plan_for(z, ids, ex, predecode=0), z, w, ids, ex)
    out = _run(R.plan_for(z, ids, ex, predecode=predecode), z, w, ids, ex)
    assert torch.equal(out, base), f"seed {seed}"


def test_trace_order():
    """Per CTA: PDL wait ≤ copies issued ≤ x staged ≤ gate_up summed ≤ released ≤ red barrier ≤
    out stored; warp 0: down landed ≤ pair ready ≤ a' staged ≤ its rows summed."""
    ex, z, w, ids = _case(896, 3584, 192, 16, 1, fresh_seed())
    plan = R.plan_for(z, ids, ex, trace=True)
    tr = torch.zeros(plan.trace_words, dtype=torch.int64, device=DEV)
    out = torch.empty(1, 3584, device=DEV)
    R.resident_moe_into(plan, z, w, ids, ex, out, tr)
    torch.cuda.synchronize()
    t = tr.view(plan.ctas, -1)
    assert (t[:, 0] > 0).all()
    for a, b in ((0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 10), (10, 11), (6, 7), (7, 8),
                 (8, 9), (9, 10)):
        assert (t[:, b] >= t[:, a]).all(), f"{R.TRACE_NAMES[b]} before {R.TRACE_NAMES[a]}"


def test_bad_inputs_named():
    ex, z, w, ids = _case(64, 512, 64, 4, 1, 0)
    plan = R.plan_for(z, ids, ex, ctas=8)
    out = torch.empty(1, 512, device=DEV)
    with pytest.raises(ValueError, match="topk_ids is torch.int32"):
        R.resident_moe_into(plan, z, w, ids.int(), ex, out)
    with pytest.raises(ValueError, match="tokens plan 1 vs call 2"):
        R.resident_moe_into(plan, z.repeat(2, 1), w.repeat(2, 1), ids.repeat(2, 1), ex,
                            torch.empty(2, 512, device=DEV))
    with pytest.raises(ValueError, match=r"out is \(1, 256\)"):
        R.resident_moe_into(plan, z, w, ids, ex, torch.empty(1, 256, device=DEV))
    big = M.MXFP4Experts.random(8, 3584, 384, 4.0, None, device=DEV)      # TP8 batch 1
    with pytest.raises(ValueError, match="does not fit"):
        R.moe_resident(torch.zeros(1, 3584, dtype=BF, device=DEV), w.new_ones(1, 16) / 16,
                       torch.zeros(1, 16, dtype=torch.int64, device=DEV), big)
