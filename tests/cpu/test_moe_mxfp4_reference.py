"""The MXFP4 MoE reference against the model's routed-experts math on the tiny config, the CPU
dispatch, the expert container's checks and the launch configuration (no GPU, no Triton)."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from raydecode.kernels import moe_mxfp4 as M
from raydecode.models.config import load_config
from raydecode.models.moe import LatentMoE, route
from raydecode.models.mxfp4 import MXFP4Error, unpack_mxfp4
from raydecode.models.parallel import Parallel

torch.set_num_threads(1)


def _tiny_moe(dtype, seed, tp=1):
    """The tiny config's LatentMoE (rank 0 of `tp`) with experts set from random MXFP4."""
    cfg = load_config("tiny")
    m = cfg.moe
    par = Parallel(tp_rank=0, tp_size=tp)
    moe = LatentMoE(replace(cfg, quant=None), par, dtype=dtype)    # model-dtype experts
    ex = M.MXFP4Experts.random(m.num_experts, m.latent_size, m.expert_intermediate // tp,
                               cfg.situ_beta, cfg.situ_linear_beta, seed=seed).validate()
    w1, w3, w2 = ex.dequantized(dtype)
    with torch.no_grad():
        moe.experts.w1.copy_(w1), moe.experts.w3.copy_(w3), moe.experts.w2.copy_(w2)
    return cfg, moe, ex


def _routing(cfg, T, gen):
    m = cfg.moe
    logits = torch.randn(T, m.num_experts, generator=gen)
    return route(logits, 0.1 * torch.randn(m.num_experts, generator=gen), m.top_k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 7])
def test_reference_equals_model_experts(dtype, T):
    gen = torch.Generator().manual_seed(T)
    cfg, moe, ex = _tiny_moe(dtype, seed=T)
    z = torch.randn(T, cfg.moe.latent_size, generator=gen).to(dtype)
    w, ids = _routing(cfg, T, gen)
    want = moe.experts(z, w, ids)
    got = M.moe_mxfp4_reference(z, w, ids, ex)
    assert got.dtype == torch.float32 and got.shape == (T, cfg.moe.latent_size)
    assert torch.equal(got, want)
    assert got.abs().sum() > 0


def test_reference_is_the_tp_slice_of_the_model():
    """A TP=2 rank's reference over its slice of the experts = the TP=2 model rank's experts."""
    gen = torch.Generator().manual_seed(3)
    cfg, moe, ex = _tiny_moe(torch.float32, seed=5, tp=2)
    assert ex.intermediate == cfg.moe.expert_intermediate // 2
    z = torch.randn(4, cfg.moe.latent_size, generator=gen)
    w, ids = _routing(cfg, 4, gen)
    assert torch.equal(M.moe_mxfp4_reference(z, w, ids, ex), moe.experts(z, w, ids))


def test_dispatch_on_cpu_is_the_reference():
    gen = torch.Generator().manual_seed(11)
    cfg, _, ex = _tiny_moe(torch.bfloat16, seed=11)
    z = torch.randn(5, cfg.moe.latent_size, generator=gen).bfloat16()
    w, ids = _routing(cfg, 5, gen)
    assert torch.equal(M.fused_moe_mxfp4(z, w, ids, ex), M.moe_mxfp4_reference(z, w, ids, ex))


def test_dequantized_layout_is_gate_then_up():
    ex = M.MXFP4Experts.random(3, 64, 32, 4.0, None, seed=2)
    w1, w3, w2 = ex.dequantized(torch.float32)
    full = unpack_mxfp4(ex.w13, ex.s13, torch.float32)
    assert torch.equal(w1, full[:, :32]) and torch.equal(w3, full[:, 32:])
    assert w2.shape == (3, 64, 32) and torch.equal(w2, unpack_mxfp4(ex.w2, ex.s2, torch.float32))
    assert ex.expert_bytes() == 64 * 32 * 2 // 2 + 64 * 2 + 64 * 16 + 64    # per expert, bytes


def test_random_experts_have_fan_in_scale():
    """Dequantized weights ~ 1/sqrt(fan_in) in RMS (what keeps benchmark activations O(1))."""
    ex = M.MXFP4Experts.random(4, 1024, 256, 4.0, 25.0, fan_in_2=3072, seed=0)
    w1, _, w2 = ex.dequantized(torch.float32)
    r13 = w1.square().mean().sqrt().item() * math.sqrt(1024)
    r2 = w2.square().mean().sqrt().item() * math.sqrt(3072)
    assert 0.5 < r13 < 2.0 and 0.5 < r2 < 2.0, (r13, r2)


def test_validate_names_the_bad_field():
    ex = M.MXFP4Experts.random(2, 64, 32, 4.0, None, seed=0)
    with pytest.raises(MXFP4Error, match="s13"):
        M.MXFP4Experts(ex.w13, ex.s13[:, :, :1].contiguous(), ex.w2, ex.s2, 4.0, None).validate()
    big = ex.s2.clone()
    big[0, 0, 0] = M.MAX_SCALE + 1
    with pytest.raises(MXFP4Error, match="scale byte 241"):
        M.MXFP4Experts(ex.w13, ex.s13, ex.w2, big, 4.0, None).validate()
    with pytest.raises(MXFP4Error, match="w2"):
        M.MXFP4Experts(ex.w13, ex.s13, ex.w2.float(), ex.s2, 4.0, None).validate()


def test_inputs_are_checked():
    ex = M.MXFP4Experts.random(4, 64, 32, 4.0, None, seed=0)
    z = torch.randn(3, 64).bfloat16()
    w, ids = torch.rand(3, 2), torch.randint(0, 4, (3, 2))
    with pytest.raises(ValueError, match="z must be bf16"):
        M.fused_moe_mxfp4(z.float(), w, ids, ex)
    with pytest.raises(ValueError, match="must both be"):
        M.fused_moe_mxfp4(z, w[:2], ids, ex)
    with pytest.raises(ValueError, match="fp32"):
        M.fused_moe_mxfp4(z, w.double(), ids, ex)


@pytest.mark.parametrize("T", [1, 2, 4, 8, 64])
@pytest.mark.parametrize("I", [192, 384])
def test_default_config_tiles_k3_per_rank_shapes(T, I):
    """BK divides K and is ≥ one MXFP4 group; gate/up BN gives ≥ 2 programs per SM where any
    BN can (else the smallest, 16)."""
    L, E, k = 3584, 896, 16
    c = M.default_config(T * k, E, I, L, tuned=False)
    assert L % c.gate_up_bk == 0 and c.gate_up_bk >= 32
    assert I % c.down_bk == 0 and c.down_bk >= 32
    runs = min(T * k, E)
    progs = runs * -(-I // c.gate_up_bn)
    assert progs >= 2 * 132 or c.gate_up_bn == 16
    if c.gate_up_bn < 64:   # a wider tile would have dropped under 2 programs per SM
        assert runs * -(-I // (2 * c.gate_up_bn)) < 2 * 132


def test_tuned_configs_tile_their_shapes():
    """Every measured entry is a valid launch for its key (BK | K, known decode), and the
    dispatch returns it for batches on its side of SMALL_PAIRS."""
    assert M.TUNED
    for (small, E, I, L), c in M.TUNED.items():
        assert c.decode in M.DECODES
        assert L % c.gate_up_bk == 0 and I % c.down_bk == 0
        assert c.gate_up_bk % 32 == 0 and c.down_bk % 32 == 0
        P = 16 if small else 1024
        assert (P <= M.SMALL_PAIRS) == small
        assert M.default_config(P, E, I, L) == c
