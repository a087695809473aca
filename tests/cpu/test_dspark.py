"""The DSpark drafter: published config and tensor layout, YaRN RoPE, checkpoint round trip, the
absorbed non-causal block pass against a decompressed reference, and the target's hidden taps."""
import json
import math

import pytest
import torch

from raydecode.models.cache import SeqSlice, StepBatch
from raydecode.models.checkpoint import CheckpointError
from raydecode.models.config import ConfigError, load_config
from raydecode.models.dspark import (DSparkDrafter, apply_rope, check_against_target,
                                     check_num_drafts, load_dspark_config, parse_dspark_config,
                                     rope_cos_sin, rope_inv_freq, yarn_mscale)
from raydecode.models.dspark_checkpoint import (build_drafter, dspark_tensor_specs,
                                                load_drafter, write_dspark_checkpoint)
from raydecode.models.k3 import K3ForCausalLM, init_random_, make_caches
from raydecode.models.layers import rms_norm, shard_tensor
from raydecode.models.parallel import Parallel

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target():
    return init_random_(K3ForCausalLM(load_config("tiny")), 7)


@pytest.fixture(scope="module")
def drafter(target):
    return build_drafter(load_dspark_config("tiny"), target, seed=3)


# ---- config and layout ----------------------------------------------------------------------

def test_published_k3_drafter_layout_and_scale():
    c = load_dspark_config("k3")
    specs = dspark_tensor_specs(c)
    assert len(specs) == 68
    assert sum(math.prod(s.shape) for s in specs.values()) == 3_562_312_961
    assert specs["context_proj.weight"].shape == (7168, 35840)
    assert specs["markov_head.markov_w1.weight"].shape == (163840, 256)
    assert specs["markov_head.markov_w2.weight"].shape == (163840, 256)
    assert c.latent_dim == 576 and c.target_layer_ids == (2, 23, 47, 71, 89)
    # YaRN softmax temperature: (0.1 ln 32 + 1)² / sqrt(192)
    assert c.softmax_scale == pytest.approx(0.13086080, abs=1e-8)
    assert c.softmax_scale / 192 ** -0.5 == pytest.approx(1.8133, abs=1e-4)
    check_against_target(c, load_config("k3"))
    assert check_num_drafts(7, c) == 7
    with pytest.raises(ConfigError, match="blocks of 7: accepted 1..7"):
        check_num_drafts(8, c)


@pytest.mark.parametrize("change,match", [
    ({"target_layer_ids": [2, 47, 23, 71, 89]}, "ascending"),
    ({"target_layer_ids": [2, 2, 47, 71, 89]}, "distinct"),
    ({"target_layer_ids": [2, 23, 47, 71, 93]}, "out of range"),
    ({"target_layer_ids": [2, 23, 47]}, "context_proj expects"),
    ({"mask_token_id": 200000}, "outside the vocabulary"),
    ({"markov_rank": 0}, "markov_rank > 0"),
    ({"markov_head_type": "rnn"}, "markov_head_type"),
    ({"mla_use_nope": True}, "RoPE MLA"),
    ({"mla_use_output_gate": True}, "output gate"),
    ({"hiden_size": 3}, "unknown field"),
    ({"rope_parameters": {"rope_type": "longrope"}}, "rope_type"),
])
def test_bad_drafter_configs_name_the_field(change, match):
    d = load_dspark_config("k3").raw | change
    with pytest.raises(ConfigError, match=match):
        parse_dspark_config(d)


def test_drafter_must_fit_its_target():
    tiny = load_config("tiny")
    check_against_target(load_dspark_config("tiny"), tiny)
    with pytest.raises(ConfigError, match="hidden_size"):
        check_against_target(load_dspark_config("k3"), tiny)


# ---- RoPE ----------------------------------------------------------------------------------

def test_rope_rotates_interleaved_pairs():
    r = load_dspark_config("tiny").rope
    f = rope_inv_freq(8, r)
    x = torch.randn(5, 3, 8, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([0, 1, 7, 100, 3000])
    cos, sin = rope_cos_sin(pos, f, r)
    got = apply_rope(x, cos, sin)
    z = torch.view_as_complex(x.double().unflatten(-1, (4, 2)).contiguous())   # pairs (2i, 2i+1)
    ang = pos.double()[:, None, None] * f[None, None, :]
    want = torch.view_as_real(z * torch.polar(torch.ones_like(ang), ang)).flatten(-2)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    halves = torch.cat([x[..., :4], x[..., 4:]], -1)   # NeoX pairs (i, i + d/2) give another result
    zn = torch.complex(halves[..., :4].double(), halves[..., 4:].double()) * torch.polar(
        torch.ones_like(ang), ang)
    assert not torch.allclose(got.double(), torch.cat([zn.real, zn.imag], -1), atol=1e-3)


def test_yarn_keeps_fast_dims_and_interpolates_slow_ones():
    r = load_dspark_config("k3").rope
    f = rope_inv_freq(64, r)
    base = 1.0 / 50000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    assert f.dtype == torch.float32                              # the reference's fp32 table
    assert torch.allclose(f[:8].double(), base[:8])              # many turns in 32k: unchanged
    assert torch.allclose(f[-4:].double(), base[-4:] / 32.0)     # < 1 turn: divided by factor
    assert yarn_mscale(32.0) == pytest.approx(0.1 * math.log(32) + 1)
    assert yarn_mscale(1.0) == 1.0


# ---- checkpoint ----------------------------------------------------------------------------

def test_checkpoint_round_trip_and_tp_slices(tmp_path, target, drafter):
    dcfg = drafter.cfg
    out = write_dspark_checkpoint(dcfg, tmp_path / "d", seed=3,
                                  target_embed=target.model.embed_tokens.weight)
    assert json.loads((out / "config.json").read_text())["model_type"] == "k3_dspark"
    loaded = load_drafter(out, target)
    want = dict(drafter.named_parameters())
    for n, p in loaded.named_parameters():
        assert torch.equal(p, want[n].to(p.dtype)), n
    for rank in (0, 1):
        par = Parallel(rank, 2)
        shard = DSparkDrafter(dcfg, par)
        from raydecode.models.dspark_checkpoint import _load
        from raydecode.models.weights import _file_source
        _load(shard, _file_source(out), par)
        for n, p in shard.named_parameters():
            assert torch.equal(p, shard_tensor(want[n], p, par).to(p.dtype)), n


def test_checkpoint_errors_name_the_tensor(tmp_path, target):
    from safetensors.torch import load_file, save_file

    dcfg = load_dspark_config("tiny")
    out = write_dspark_checkpoint(dcfg, tmp_path / "d", seed=1, shard_max_bytes=1 << 40)
    f = next(out.glob("model-*.safetensors"))
    tensors = load_file(f)
    name = "layers.0.self_attn.q_b_proj.weight"
    tensors[name] = tensors[name][:-1]
    save_file(tensors, f)
    with pytest.raises(CheckpointError, match="q_b_proj.weight: shape"):
        load_drafter(out, target)
    del tensors["layers.0.self_attn.q_b_proj.weight"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    del index["weight_map"]["layers.0.self_attn.q_b_proj.weight"]
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file(tensors, f)
    with pytest.raises(CheckpointError, match="lacks tensor.*q_b_proj"):
        load_drafter(out, target)
    tensors["layers.0.self_attn.q_b_proj.weight"] = torch.zeros(48, 32)
    tensors["layers.9.mlp.gate_proj.weight"] = torch.zeros(1)
    index["weight_map"].update(dict.fromkeys(["layers.0.self_attn.q_b_proj.weight",
                                              "layers.9.mlp.gate_proj.weight"], f.name))
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file(tensors, f)
    with pytest.raises(CheckpointError, match="unknown tensor.*layers.9"):
        load_drafter(out, target)
    with pytest.raises(ConfigError, match="not a DSpark checkpoint folder"):
        load_drafter(tmp_path / "nothing-here", target)


# ---- the block pass --------------------------------------------------------------------------

def _rope_ref(x, pos, f, amp):
    """Independent RoPE: interleaved pairs as complex numbers times e^{i·pos·f}."""
    z = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    ang = pos.double().view(-1, *([1] * (z.dim() - 2)), 1) * f
    return torch.view_as_real(z * torch.polar(torch.full_like(ang, amp), ang)).flatten(-2).float()


def naive_block(d: DSparkDrafter, taps: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Reference drafter pass with decompressed K/V: context = positions 0..p-1 from `taps`,
    block = `tokens` at p..p+k-1, every query sees all context and all block keys."""
    c = d.cfg
    p, k = taps.shape[0], tokens.shape[0]
    nope, rope, L = c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
    f = rope_inv_freq(rope, c.rope)
    amp = yarn_mscale(c.rope.factor, c.rope.mscale) / yarn_mscale(c.rope.factor,
                                                                  c.rope.mscale_all_dim)
    ctx_pos, blk_pos = torch.arange(p), torch.arange(p, p + k)
    ctx = rms_norm(taps @ d.context_proj.weight.T, d.context_norm.weight, c.rms_norm_eps)
    x = d.target.model.embed_tokens(tokens)
    for layer in d.layers:
        a = layer.self_attn
        h = rms_norm(x, layer.input_layernorm.weight, c.rms_norm_eps)
        q = (rms_norm(h @ a.q_a_proj.weight.T, a.q_a_layernorm.weight, c.rms_norm_eps)
             @ a.q_b_proj.weight.T).view(k, c.num_heads, -1)
        q = torch.cat([q[..., :nope], _rope_ref(q[..., nope:], blk_pos, f, 1.0)], -1)
        src = torch.cat([ctx, h])
        kv = src @ a.kv_a_proj_with_mqa.weight.T
        lat = rms_norm(kv[:, :L], a.kv_a_layernorm.weight, c.rms_norm_eps)
        k_pe = _rope_ref(kv[:, L:], torch.cat([ctx_pos, blk_pos]), f, amp)
        kvb = (lat @ a.kv_b_proj.weight.T).view(p + k, c.num_heads, -1)
        key = torch.cat([kvb[..., :nope], k_pe[:, None].expand(-1, c.num_heads, -1)], -1)
        s = torch.einsum("qhd,khd->hqk", q, key) * c.softmax_scale
        o = torch.einsum("hqk,khv->qhv", s.softmax(-1), kvb[..., nope:]).reshape(k, -1)
        x = x + o @ a.o_proj.weight.T
        h = rms_norm(x, layer.post_attention_layernorm.weight, c.rms_norm_eps)
        m = layer.mlp
        x = x + (torch.nn.functional.silu(h @ m.gate_proj.weight.T) * (h @ m.up_proj.weight.T)) \
            @ m.down_proj.weight.T
    return rms_norm(x, d.final_norm.weight, c.rms_norm_eps)


def _caches(target, d, slots=2):
    caches = make_caches(target.cfg, target.par, num_slots=slots, num_blocks=8, block_size=4,
                         extra_mla_layers=d.cfg.num_layers)
    for s in range(slots):
        caches.mla.block_tables[s] = [4 * s, 4 * s + 1, 4 * s + 2, 4 * s + 3]
    return caches


@torch.no_grad()
def test_block_pass_matches_decompressed_reference(target, drafter):
    g = torch.Generator().manual_seed(11)
    p, k = 6, 5
    taps = torch.randn(p, drafter.cfg.context_width, generator=g)
    tokens = torch.tensor([17] + [drafter.cfg.mask_token_id] * (k - 1))
    caches = _caches(target, drafter)
    drafter.write_context(taps, StepBatch([SeqSlice(1, 0, p, 0)]), caches)
    # stale rows past the anchor (rejected positions of an earlier step) must be ignored
    drafter.write_context(torch.randn(3, drafter.cfg.context_width, generator=g),
                          StepBatch([SeqSlice(1, 0, 3, p)]), caches)
    got = drafter(tokens, StepBatch([SeqSlice(1, 0, k, p)]), caches)
    want = naive_block(drafter, taps, tokens)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    # non-causal: the first query's output depends on the last block token
    other = tokens.clone()
    other[-1] = 3
    got2 = drafter(other, StepBatch([SeqSlice(1, 0, k, p)]), caches)
    assert not torch.allclose(got2[0], got[0], atol=1e-6)


@torch.no_grad()
def test_markov_bias_is_the_low_rank_table(drafter):
    prev = torch.tensor([5, 400])
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
    torch.testing.assert_close(drafter.markov_bias(prev), w1[prev] @ w2.T)
    assert drafter.markov_bias(prev).shape == (2, drafter.cfg.vocab_size)


@torch.no_grad()
def test_target_taps_are_layer_outputs(target):
    """Tap i is the running AttnRes prefix after layer i; the tiny model's layer 0 opens a
    block, so tap 0 = attention(0) + mlp(0) outputs, and taps leave the hidden unchanged."""
    toks = torch.tensor([1, 50, 300, 7, 99])
    seen = {}
    hooks = [target.model.layers[0].self_attn.register_forward_hook(
                 lambda m, i, o: seen.__setitem__("attn", o)),
             target.model.layers[0].mlp.register_forward_hook(
                 lambda m, i, o: seen.__setitem__("mlp", o))]
    try:
        hidden, tapped = target(toks, taps=(0, 2, 4))
    finally:
        for h in hooks:
            h.remove()
    assert tapped.shape == (5, 3 * target.cfg.hidden_size)
    torch.testing.assert_close(tapped[:, :64], seen["attn"] + seen["mlp"])
    torch.testing.assert_close(hidden, target(toks))
