"""MXFP4-resident routed experts: a tiny MXFP4 checkpoint loaded packed (TP 1 and both TP=2
ranks) gives the MoE output of the old dequantized path (unpack_mxfp4 + the per-expert loop,
written out here), at ~17/64 of the bf16 expert bytes; bad expert data and slices are refused
naming the tensor; the stock and specialized paths agree."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from raydecode.models import weights as W
from raydecode.models.checkpoint import INDEX_FILE, CheckpointError, write_checkpoint
from raydecode.models.config import load_config
from raydecode.models.k3 import K3ForCausalLM, init_random_
from raydecode.models.layers import situ
from raydecode.models.moe import MXFP4_PARAMS, RoutedExperts, route
from raydecode.models.mxfp4 import unpack_mxfp4
from raydecode.models.parallel import Parallel

torch.set_num_threads(1)
F32 = torch.float32
LAYER = 1                                           # the tiny preset's first MoE layer
MOE = f"language_model.model.layers.{LAYER}.block_sparse_moe.experts"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-mxfp4")
    return d, write_checkpoint(load_config("tiny"), d, seed=5, tokenizer=False)


def _load(cfg, d, par=Parallel(), dtype=F32):
    m = K3ForCausalLM(cfg, par=par, dtype=dtype)
    W.load_weights(m, d, par)
    return m


def _experts(model) -> RoutedExperts:
    return model.model.layers[LAYER].block_sparse_moe.experts


def _ckpt_dense(d, cfg):
    """The checkpoint's experts of layer LAYER unpacked: w1, w3 (E, I, L), w2 (E, L, I) fp32."""
    wm = json.loads((d / INDEX_FILE).read_text())["weight_map"]

    def get(name):
        with safe_open(str(d / wm[name]), framework="pt") as f:
            return f.get_tensor(name)

    out = []
    for w in ("w1", "w3", "w2"):
        out.append(torch.stack([
            unpack_mxfp4(get(f"{MOE}.{e}.{w}.weight_packed"), get(f"{MOE}.{e}.{w}.weight_scale"),
                         F32) for e in range(cfg.moe.num_experts)]))
    return out


def _old_loop(z, w, ids, w1, w3, w2, cfg):
    """The pre-resident RoutedExperts.forward: Σ_k w·W2_e SiTU(W1_e z, W3_e z), fp32."""
    out = torch.zeros(z.shape, dtype=F32)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        a = situ(F.linear(z[tok], w1[e]), F.linear(z[tok], w3[e]), cfg.situ_beta,
                 cfg.situ_linear_beta)
        out.index_add_(0, tok, F.linear(a, w2[e]).float() * w[tok, slot].unsqueeze(-1))
    return out


def _routing(cfg, T, seed):
    gen = torch.Generator().manual_seed(seed)
    m = cfg.moe
    w, ids = route(torch.randn(T, m.num_experts, generator=gen),
                   0.1 * torch.randn(m.num_experts, generator=gen), m.top_k)
    return torch.randn(T, m.latent_size, generator=gen), w, ids


def _expert_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if ".experts." in n)


# ---- (a) packed == the old dequantized path ------------------------------------------------

def test_tp1_packed_experts_equal_the_dequantized_loop(ckpt):
    d, cfg = ckpt
    ex = _experts(_load(cfg, d))
    assert ex.mxfp4 and all(p.dtype == torch.uint8 for p in ex.parameters())
    assert {n for n, _ in ex.named_parameters()} == set(MXFP4_PARAMS)
    w1, w3, w2 = _ckpt_dense(d, cfg)
    z, w, ids = _routing(cfg, 9, seed=1)
    got = ex(z, w, ids)
    want = _old_loop(z, w, ids, w1, w3, w2, cfg)
    assert got.dtype == F32 and got.shape == z.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert want.abs().max() > 1e-2
    for a, b in zip(ex.dense(F32), (w1, w3, w2)):          # gate rows, then up rows
        assert torch.equal(a, b)


def test_tp2_rank_partials_are_the_slices_and_sum_to_tp1(ckpt):
    d, cfg = ckpt
    w1, w3, w2 = _ckpt_dense(d, cfg)
    z, w, ids = _routing(cfg, 6, seed=2)
    il = cfg.moe.expert_intermediate // 2
    parts = []
    for r in range(2):
        ex = _experts(_load(cfg, d, Parallel(r, 2)))
        assert ex.w2_scale.shape == (cfg.moe.num_experts, cfg.moe.latent_size, il // 32)
        rows = slice(r * il, (r + 1) * il)
        part = ex(z, w, ids)
        torch.testing.assert_close(part, _old_loop(z, w, ids, w1[:, rows], w3[:, rows],
                                                   w2[:, :, rows], cfg), rtol=1e-5, atol=1e-6)
        parts.append(part)
    full = _old_loop(z, w, ids, w1, w3, w2, cfg)
    torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-5, atol=1e-5)
    assert (parts[0] - full).abs().max() > 1e-3             # each rank's output is partial


def test_model_logits_equal_the_dequantized_model(ckpt):
    """The whole model: resident experts vs the same checkpoint dequantized into model-dtype
    expert parameters (a quantization-free config: the loader's unpack path)."""
    d, cfg = ckpt
    packed = _load(cfg, d)
    dense = K3ForCausalLM(replace(cfg, quant=None), dtype=F32)
    W._load(dense, cfg, W._file_source(d), Parallel())
    assert not _experts(dense).mxfp4
    toks = torch.tensor([3, 141, 59, 265, 35, 89, 7])
    with torch.no_grad():
        a, b = packed.compute_logits(packed(toks)), dense.compute_logits(dense(toks))
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert b.std() > 0.1


# ---- (b) memory ----------------------------------------------------------------------------

def test_resident_experts_are_about_a_quarter_of_bf16(ckpt):
    d, cfg = ckpt
    m = cfg.moe
    layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    n = layers * m.num_experts * 3 * m.expert_intermediate * m.latent_size
    packed = _load(cfg, d, dtype=torch.bfloat16)
    bf16 = K3ForCausalLM(replace(cfg, quant=None), dtype=torch.bfloat16)
    assert _expert_bytes(bf16) == 2 * n
    assert _expert_bytes(packed) == n // 2 + n // 32          # codes + one scale per 32
    assert 3.7 < _expert_bytes(bf16) / _expert_bytes(packed) < 3.8
    assert not any(p.is_floating_point() for p in _experts(packed).parameters())
    half = K3ForCausalLM(cfg, par=Parallel(0, 2), dtype=torch.bfloat16)
    assert 2 * _expert_bytes(half) == _expert_bytes(packed)


# ---- (c) bad data and slices ---------------------------------------------------------------

@pytest.mark.parametrize("byte, what", [(255, "NaN in ue8m0"), (241, r"2\*\*114")])
def test_out_of_range_scale_names_the_tensor(ckpt, tmp_path, byte, what):
    d, cfg = ckpt
    bad = tmp_path / "ckpt"
    shutil.copytree(d, bad)
    name = f"{MOE}.3.w2.weight_scale"
    shard = bad / json.loads((bad / INDEX_FILE).read_text())["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name][5, 3] = byte                  # K group 3: rank 1 of 2 reads it
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError, match=rf"{name}: MXFP4 scale byte {byte} \({what}\)"):
        _load(cfg, bad, Parallel(1, 2))


def test_k_slice_of_partial_groups_is_refused(ckpt):
    """TP 8 would cut the down projection's K = 128 into 16-wide slices: half groups."""
    d, cfg = ckpt
    src = W._file_source(d)
    m = cfg.moe
    names = [f"{MOE}.{e}.w2.weight_scale" for e in range(m.num_experts)]
    p = torch.nn.Parameter(torch.empty(m.num_experts, m.latent_size, 1, dtype=torch.uint8),
                           requires_grad=False)
    p.shard_dim = 2
    full = (m.num_experts, m.latent_size, m.expert_intermediate // 32)
    with pytest.raises(CheckpointError, match=r"w2_scale: tensor_parallel_size 8 splits K = "
                                              r"128 into 16-wide slices.*whole groups of 32"):
        W._load_resident(f"{MOE[15:]}.w2_scale", p, names, full, src, Parallel(3, 8))
    with pytest.raises(ValueError, match=r"experts\.w2: tensor_parallel_size 8 splits K = 128 "
                                         r"into 16-wide slices.*whole groups of 32"):
        RoutedExperts(m.num_experts, m.latent_size, m.expert_intermediate, 4.0, None,
                      Parallel(0, 8), torch.bfloat16, mxfp4=True)


def test_model_of_another_tp_is_refused_naming_the_experts(ckpt):
    d, cfg = ckpt
    src = W._file_source(d)
    model = K3ForCausalLM(cfg, par=Parallel(0, 2), dtype=F32)
    plan = {n: (p, names, full) for n, p, names, full
            in W._plan(model, W.checkpoint_tensor_specs(cfg), cfg)}
    pname = f"model.layers.{LAYER}.block_sparse_moe.experts.w13_packed"
    p, names, full = plan[pname]
    assert full == (cfg.moe.num_experts, 2, cfg.moe.expert_intermediate, cfg.moe.latent_size // 2)
    with pytest.raises(CheckpointError, match=rf"{pname}: rank 0/4 slice of the experts is "
                                              r"\(8, 2, 32, 16\), the parameter has "
                                              r"\(8, 2, 64, 16\)"):
        W._load_resident(pname, p, names, full, src, Parallel(0, 4))


# ---- (d) paths and random construction ----------------------------------------------------

def test_stock_and_specialized_paths_agree(ckpt):
    d, cfg = ckpt
    moe = _load(cfg, d).model.layers[LAYER].block_sparse_moe
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        stock, spec = moe(x, "stock"), moe(x, "specialized")
    torch.testing.assert_close(spec, stock, rtol=1e-5, atol=1e-5)
    z, w, ids = _routing(cfg, 4, seed=4)
    assert torch.equal(moe.experts(z, w, ids, "specialized"), moe.experts(z, w, ids, "stock"))


def test_random_models_hold_valid_packed_experts():
    """init_random_ draws codes and in-range scales; a TP=2 rank holds the TP=1 slices and the
    experts are ~N(0, 1/fan_in)-sized."""
    cfg = load_config("tiny")
    full = init_random_(K3ForCausalLM(cfg), 9)
    ex = _experts(full)
    for name in ("w13_scale", "w2_scale"):
        s = getattr(ex, name)
        assert 100 < int(s.min()) <= int(s.max()) < 127, name
    w1, _, w2 = ex.dense(F32)
    assert 0.5 < float(w1.std()) * cfg.moe.latent_size ** 0.5 < 2
    assert 0.5 < float(w2.std()) * cfg.moe.expert_intermediate ** 0.5 < 2
    rank1 = _experts(init_random_(K3ForCausalLM(cfg, Parallel(1, 2)), 9))
    il = cfg.moe.expert_intermediate // 2
    assert torch.equal(rank1.w13_packed, ex.w13_packed[:, :, il:])
    assert torch.equal(rank1.w2_scale, ex.w2_scale[:, :, il // 32:])
    with torch.no_grad():
        logits = full.compute_logits(full(torch.tensor([1, 2, 3])))
    assert torch.isfinite(logits).all() and logits.std() > 0.1


def test_random_mxfp4_draws_on_the_generator_device_under_a_device_context():
    """init_random_ under `with torch.device("cuda")` passes a host generator (the GPU test
    failed with 'Expected a cuda device type for generator'): the draw must stay on the
    generator's device and give the same bytes as without the context. `meta` stands in for
    cuda on this CPU-only host."""
    from raydecode.models.moe import random_mxfp4
    plain = [random_mxfp4((3, 4, 5), s, torch.Generator().manual_seed(7)) for s in (False, True)]
    with torch.device("meta"):
        ctx = [random_mxfp4((3, 4, 5), s, torch.Generator().manual_seed(7)) for s in (False, True)]
    for a, b in zip(plain, ctx):
        assert b.device.type == "cpu" and torch.equal(a, b)
