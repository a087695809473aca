"""Latent MoE: noaux_tc routing (bias selects, never weighs), the block against a per-token
reference written out here, and the TP split of expert intermediates summing before the norm."""
import math
from dataclasses import replace

import torch

from raydecode.models.config import load_config
from raydecode.models.k3 import K3ForCausalLM, init_random_
from raydecode.models.layers import shard_tensor
from raydecode.models.moe import RoutedExperts, route
from raydecode.models.parallel import Parallel

torch.set_num_threads(1)


def test_bias_selects_but_weights_come_from_uncorrected_scores():
    gen = torch.Generator().manual_seed(0)
    T, E, k = 6, 16, 4
    logits = torch.randn(T, E, generator=gen)
    bias = torch.zeros(E)
    bias[[3, 11]] = 5.0                      # forces experts 3 and 11 into every selection
    w, ids = route(logits, bias, k)
    scores = torch.sigmoid(logits)
    want_ids = (scores + bias).topk(k, dim=-1).indices
    assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)
    assert all({3, 11} <= set(row) for row in ids.tolist())
    expect = scores.gather(1, ids)
    expect = expect / expect.sum(-1, keepdim=True)
    torch.testing.assert_close(w, expect, rtol=1e-6, atol=1e-7)
    leaked = (scores + bias).gather(1, ids)
    leaked = leaked / leaked.sum(-1, keepdim=True)
    assert (w - leaked).abs().max() > 1e-2       # a leak of the bias would be visible
    torch.testing.assert_close(w.sum(-1), torch.ones(T))
    w2, _ = route(logits, bias, k, scaling=2.5)
    torch.testing.assert_close(w2, 2.5 * w)


def test_group_limited_routing_keeps_the_best_group():
    gen = torch.Generator().manual_seed(1)
    T, E, G = 5, 12, 3
    logits = torch.randn(T, E, generator=gen)
    bias = 0.1 * torch.randn(E, generator=gen)
    _, ids = route(logits, bias, top_k=3, num_groups=G, topk_group=1)
    sel = (torch.sigmoid(logits) + bias).view(T, G, E // G)
    best = sel.topk(2, dim=-1).values.sum(-1).argmax(-1)           # (T,)
    assert torch.equal(ids // (E // G), best[:, None].expand(-1, 3))


def _moe_reference(moe, x, cfg):
    """Per token: route, run each chosen expert in the latent, weight, normalise, up-project,
    add the shared experts — written out with explicit formulas."""
    def situ(g, u):
        b, bl = cfg.situ_beta, cfg.situ_linear_beta
        return b * torch.tanh(g / b) * torch.sigmoid(g) * (bl * torch.tanh(u / bl))

    def rms(z, w):
        return z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w

    w1, w3, w2 = moe.experts.dense(x.dtype)      # MXFP4-resident experts: dequantized
    out = []
    for t in range(x.shape[0]):
        s = torch.sigmoid(moe.gate.weight @ x[t])
        chosen = (s + moe.gate.e_score_correction_bias).topk(cfg.moe.top_k).indices
        wts = s[chosen] / s[chosen].sum()
        z = moe.routed_expert_down_proj.weight @ x[t]
        lat = sum(wts[j] * (w2[i] @ situ(w1[i] @ z, w3[i] @ z))
                  for j, i in enumerate(chosen.tolist()))
        y = moe.routed_expert_up_proj.weight @ rms(lat, moe.routed_expert_norm.weight)
        sh = moe.shared_experts
        y = y + sh.down_proj.weight @ situ(sh.gate_proj.weight @ x[t], sh.up_proj.weight @ x[t])
        out.append(y)
    return torch.stack(out)


def _moe(seed=0, mxfp4=True):
    cfg = load_config("tiny")
    cfg = cfg if mxfp4 else replace(cfg, quant=None)     # model-dtype expert parameters
    model = init_random_(K3ForCausalLM(cfg), seed)
    layer = next(i for i in range(cfg.num_layers) if cfg.is_moe_layer(i))
    return cfg, model.model.layers[layer].block_sparse_moe


def test_latent_moe_matches_per_token_reference():
    cfg, moe = _moe()
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    got = moe(x)
    ref = _moe_reference(moe, x, cfg)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert got.abs().max() > 1e-2


def test_expert_intermediate_split_sums_before_the_latent_norm():
    """Two ranks' experts (I split in halves via shard_dim) give partial latents whose sum is the
    full latent; normalising each partial first would give something else."""
    cfg, moe = _moe(seed=3, mxfp4=False)
    m = cfg.moe
    gen = torch.Generator().manual_seed(4)
    z = torch.randn(9, m.latent_size, generator=gen)
    w, ids = route(torch.randn(9, m.num_experts, generator=gen), None, m.top_k)
    full = moe.experts(z, w, ids)
    parts = []
    for r in range(2):
        par = Parallel(r, 2)
        ex = RoutedExperts(m.num_experts, m.latent_size, m.expert_intermediate, cfg.situ_beta,
                           cfg.situ_linear_beta, par, torch.float32)
        assert ex.w1.shape == (m.num_experts, m.expert_intermediate // 2, m.latent_size)
        with torch.no_grad():
            for name in ("w1", "w2", "w3"):
                getattr(ex, name).copy_(shard_tensor(getattr(moe.experts, name),
                                                     getattr(ex, name), par))
        parts.append(ex(z, w, ids))
    torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-5, atol=1e-6)
    assert (parts[0] - full).abs().max() > 1e-3            # each part alone is partial
    nw = moe.routed_expert_norm.weight
    normed_sum = moe.routed_expert_norm(full)
    sum_normed = sum(p / torch.sqrt(p.pow(2).mean(-1, keepdim=True) + 1e-5) * nw for p in parts)
    assert (normed_sum - sum_normed).abs().max() > 1e-2
    assert math.isfinite(float(normed_sum.abs().max()))
