"""KDA: chunked form == recurrent form, the layer's cached decode/chunked prefill == one prefill,
the conv / gate / A_log conventions."""
import pytest
import torch
import torch.nn.functional as F

from raydecode.models.cache import SeqSlice, StepBatch
from raydecode.models.config import load_config
from raydecode.models.k3 import K3ForCausalLM, init_random_, make_caches
from raydecode.models.kda import (HeadPrefixShard, causal_conv_silu, kda_chunked, kda_gate,
                                  kda_recurrent, l2_normalize)
from raydecode.models.parallel import Parallel

from _numerics import max_rel_err

torch.set_num_threads(1)


def random_inputs(T, h, dk, dv, gen, decay_scale=3.0):
    q = l2_normalize(torch.randn(T, h, dk, generator=gen))
    k = l2_normalize(torch.randn(T, h, dk, generator=gen))
    v = torch.randn(T, h, dv, generator=gen)
    g = -5.0 * torch.sigmoid(decay_scale * torch.randn(T, h, dk, generator=gen))
    beta = torch.sigmoid(torch.randn(T, h, generator=gen))
    S0 = torch.randn(h, dk, dv, generator=gen)
    return q, k, v, g, beta, S0


@pytest.mark.parametrize("T,chunk", [(150, 64), (37, 16), (5, 64)])
def test_chunked_equals_recurrent_including_final_state(T, chunk):
    gen = torch.Generator().manual_seed(100 + T)
    q, k, v, g, beta, S0 = random_inputs(T, 3, 16, 24, gen)    # dk != dv catches transposes
    S0_copy = S0.clone()
    o_r, S_r = kda_recurrent(q, k, v, g, beta, 0.25, S0)
    o_c, S_c = kda_chunked(q, k, v, g, beta, 0.25, S0, chunk_size=chunk)
    assert max_rel_err(o_c, o_r) < 1e-5
    assert max_rel_err(S_c, S_r) < 1e-5
    # and both against an fp64 run of the recurrence
    o64, S64 = kda_recurrent(*(x.double() for x in (q, k, v, g, beta)), 0.25, S0.double())
    assert o64.dtype == torch.float64
    assert max_rel_err(o_c, o64) < 1e-5 and max_rel_err(S_c, S64) < 1e-5
    assert torch.equal(S0, S0_copy)      # the initial state is an input, not updated in place


def test_chunked_survives_the_strongest_decay_over_a_long_chunk():
    """g = lower bound everywhere: cumulative log-decay reaches -5·64 inside a chunk; a form that
    splits e^{G} and e^{-G} would overflow to inf/nan here."""
    gen = torch.Generator().manual_seed(7)
    q, k, v, _, beta, S0 = random_inputs(128, 2, 16, 16, gen)
    g = torch.full((128, 2, 16), -5.0)
    o_r, S_r = kda_recurrent(q, k, v, g, beta, 0.25, S0)
    o_c, S_c = kda_chunked(q, k, v, g, beta, 0.25, S0, chunk_size=64)
    assert torch.isfinite(o_c).all() and torch.isfinite(S_c).all()
    assert max_rel_err(o_c, o_r) < 1e-5 and max_rel_err(S_c, S_r) < 1e-5


def test_delta_rule_recalls_the_written_value():
    """No decay, β = 1, empty state: writing (k, v) then reading with q = k returns scale·v, and
    a second write to the same key replaces (not adds to) the value."""
    gen = torch.Generator().manual_seed(3)
    k = l2_normalize(torch.randn(1, 1, 8, generator=gen)).expand(2, 1, 8)
    v = torch.randn(2, 1, 5, generator=gen)
    o, S = kda_recurrent(k, k, v, torch.zeros(2, 1, 8), torch.ones(2, 1), 0.5,
                         torch.zeros(1, 8, 5))
    torch.testing.assert_close(o[0], 0.5 * v[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(o[1], 0.5 * v[1], rtol=1e-5, atol=1e-6)


def test_causal_conv_matches_torch_conv1d():
    gen = torch.Generator().manual_seed(5)
    C, W, L = 12, 4, 9
    x = torch.randn(L, C, generator=gen)
    w = torch.randn(C, W, generator=gen)
    xs = torch.cat([torch.zeros(W - 1, C), x])
    ref = F.silu(F.conv1d(x.t().unsqueeze(0), w.unsqueeze(1), padding=W - 1, groups=C)
                 [0, :, :L].t())
    torch.testing.assert_close(causal_conv_silu(xs, w), ref, rtol=1e-5, atol=1e-6)


def test_gate_is_bounded_and_a_log_is_per_head():
    gen = torch.Generator().manual_seed(9)
    raw = torch.randn(6, 3, 4, generator=gen)
    a_log, dt = torch.randn(3, generator=gen), torch.randn(12, generator=gen)
    g = kda_gate(raw, a_log, dt, -5.0)
    assert ((g < 0) & (g > -5.0)).all()
    a2 = a_log.clone()
    a2[1] += 1.0
    g2 = kda_gate(raw, a2, dt, -5.0)
    changed = (g2 != g).any(dim=(0, 2))
    assert changed.tolist() == [False, True, False]


def test_a_log_shard_takes_the_heads_prefix_of_the_padded_vector():
    fn = HeadPrefixShard(4)
    full = torch.arange(16.0)                      # K3 layout: head_dim entries, tail unused
    assert fn(full, Parallel(1, 2)).tolist() == [2.0, 3.0]
    with pytest.raises(ValueError, match="num_heads"):
        fn(torch.arange(3.0), Parallel(0, 2))


def _layer(seed=0):
    cfg = load_config("tiny")
    model = init_random_(K3ForCausalLM(cfg), seed)
    return cfg, model.model.layers[1].self_attn   # layer 1: KDA


def test_layer_decode_and_chunked_prefill_match_one_prefill():
    cfg, attn = _layer()
    gen = torch.Generator().manual_seed(11)
    T = 11
    x = torch.randn(T, cfg.hidden_size, generator=gen)
    ref = attn(x, StepBatch([SeqSlice(0, 0, T, 0)]), None)
    # token by token through slot 1 (slot 0 holds garbage that must stay untouched)
    caches = make_caches(cfg, Parallel(), 2, 1, 4)
    caches.kda.rec[:, 0].normal_(generator=gen)
    before = caches.kda.rec[:, 0].clone()
    outs = [attn(x[t:t + 1], StepBatch.decode([1], [t]), caches) for t in range(T)]
    assert max_rel_err(torch.cat(outs), ref) < 1e-5
    assert torch.equal(caches.kda.rec[:, 0], before)
    state_decode = caches.kda.rec[caches.kda_index[1], 1].clone()
    # two prefill chunks (4 + 7) into slot 0, stale state ignored at pos 0
    a = attn(x[:4], StepBatch([SeqSlice(0, 0, 4, 0)]), caches)
    b = attn(x[4:], StepBatch([SeqSlice(0, 0, T - 4, 4)]), caches)
    assert max_rel_err(torch.cat([a, b]), ref) < 1e-5
    assert max_rel_err(caches.kda.rec[caches.kda_index[1], 0], state_decode) < 1e-5
    # the conv tail holds the last W-1 pre-conv q/k/v inputs
    assert caches.kda.conv[caches.kda_index[1], 0].abs().sum() > 0

