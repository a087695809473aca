"""Random K3 checkpoints on disk: layout, TP slicing at load time, and strict errors."""
import json
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from raydecode.engine.tokenizer import Tokenizer
from raydecode.models.checkpoint import (INDEX_FILE, CheckpointError, checkpoint_tensor_specs,
                                         write_checkpoint)
from raydecode.models.config import load_config, parse_hf_config
from raydecode.models.k3 import K3ForCausalLM
from raydecode.models.mxfp4 import unpack_mxfp4
from raydecode.models.parallel import Parallel
from raydecode.models.weights import load_model, load_weights

torch.set_num_threads(1)
LAYER1 = "language_model.model.layers.1"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    cfg = write_checkpoint(load_config("tiny"), d, seed=7)
    return d, cfg


@pytest.fixture(scope="module")
def tp1(ckpt):
    d, cfg = ckpt
    m = K3ForCausalLM(cfg, dtype=torch.float32)
    load_weights(m, d, Parallel())
    return m


def _load(cfg, d, par=Parallel()):
    m = K3ForCausalLM(cfg, par=par, dtype=torch.float32)
    load_weights(m, d, par)
    return m


def test_layout_index_config_and_tokenizer(ckpt):
    d, cfg = ckpt
    index = json.loads((d / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3
    assert shards == [f"model-{k:05d}-of-{len(shards):05d}.safetensors"
                      for k in range(1, len(shards) + 1)]
    specs = checkpoint_tensor_specs(cfg)
    assert set(index["weight_map"]) == set(specs)
    total = 0
    for s in shards:
        for name, t in load_file(str(d / s)).items():
            assert index["weight_map"][name] == s
            assert (tuple(t.shape), t.dtype) == specs[name]
            total += t.numel() * t.element_size()
    assert index["metadata"]["total_size"] == total
    written = load_config(d)
    assert replace(written, name=cfg.name) == cfg
    tok = Tokenizer.from_dir(d)
    assert tok.vocab_size == cfg.vocab_size
    assert (tok.bos_id, tok.pad_id) == (cfg.bos_token_id, cfg.pad_token_id)
    assert cfg.eos_token_id in tok.eos_ids
    assert tok.special_tokens["<|end_of_msg|>"] == cfg.eos_token_id


def test_real_checkpoint_dtypes_and_a_log_padding(ckpt):
    d, cfg = ckpt
    specs = checkpoint_tensor_specs(cfg)
    attn = f"{LAYER1}.self_attn"
    fp32 = [f"{attn}.A_log", f"{attn}.dt_bias", f"{attn}.q_conv1d.weight",
            f"{attn}.o_norm.weight", f"{LAYER1}.block_sparse_moe.gate.e_score_correction_bias"]
    assert all(specs[n].dtype == torch.float32 for n in fp32)
    assert specs[f"{LAYER1}.block_sparse_moe.experts.0.w2.weight_packed"] == \
        ((cfg.moe.latent_size, cfg.moe.expert_intermediate // 2), torch.uint8)
    assert not any("shared_experts" in n and "packed" in n for n in specs)    # ignore list
    index = json.loads((d / INDEX_FILE).read_text())["weight_map"]
    with safe_open(str(d / index[f"{attn}.A_log"]), framework="pt") as f:
        a_log = f.get_tensor(f"{attn}.A_log")
    h = cfg.kda.num_heads
    assert a_log.shape == (cfg.kda.head_dim,) and (a_log[:h] != 0).all() and (a_log[h:] == 0).all()


def test_experts_dequantize_from_their_own_tensors(ckpt, tp1):
    d, cfg = ckpt
    index = json.loads((d / INDEX_FILE).read_text())["weight_map"]
    moe = tp1.model.layers[1].block_sparse_moe.experts
    for w, e in (("w1", 0), ("w2", 3), ("w3", cfg.moe.num_experts - 1)):
        base = f"{LAYER1}.block_sparse_moe.experts.{e}.{w}"
        parts = {}
        for suffix in ("weight_packed", "weight_scale"):
            with safe_open(str(d / index[f"{base}.{suffix}"]), framework="pt") as f:
                parts[suffix] = f.get_tensor(f"{base}.{suffix}")
        ref = unpack_mxfp4(parts["weight_packed"], parts["weight_scale"], torch.float32)
        assert torch.equal(dict(zip(("w1", "w3", "w2"), moe.dense(torch.float32)))[w][e], ref)


def _slices_concat_to(full: torch.nn.Parameter, a: torch.Tensor, b: torch.Tensor, name: str):
    if getattr(a, "shard_fn", None) is not None or a.shard_dim is not None:
        dim = 0 if getattr(a, "shard_fn", None) is not None else a.shard_dim
        assert a.shape != full.shape, name
        return torch.equal(torch.cat([a, b], dim), full)
    return torch.equal(a, full) and torch.equal(b, full)


def test_tp2_slices_concatenate_to_tp1(ckpt, tp1):
    d, cfg = ckpt
    ranks = [dict(_load(cfg, d, Parallel(r, 2)).named_parameters()) for r in range(2)]
    names = [n for n, _ in tp1.named_parameters()]
    assert any("experts.w2" in n for n in names) and any("A_log" in n for n in names)
    for n, full in tp1.named_parameters():
        assert _slices_concat_to(full, ranks[0][n], ranks[1][n], n), n


def test_preset_in_memory_equals_written_checkpoint(ckpt, tp1):
    d, cfg = ckpt
    cfg2, m = load_model("tiny", dtype=torch.float32, seed=7)
    assert (cfg2.bos_token_id, cfg2.eos_token_id, cfg2.pad_token_id) == \
        (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id)
    for (n, a), (_, b) in zip(tp1.named_parameters(), m.named_parameters()):
        assert torch.equal(a, b), n
    cfg3, m3 = load_model(d, dtype=torch.bfloat16)
    assert next(m3.parameters()).dtype == torch.bfloat16 and cfg3.vocab_size == cfg.vocab_size


def test_random_weights_keep_activations_order_one(tp1):
    with torch.no_grad():
        h = tp1(torch.tensor([5, 77, 300, 12, 9, 480]))
        logits = tp1.compute_logits(h)
    rms = h.pow(2).mean(-1).sqrt()
    assert torch.isfinite(logits).all()
    assert ((rms > 0.3) & (rms < 3)).all()
    assert 0.3 < logits.std() < 3


# ---- corrupted copies ----------------------------------------------------------------------

@pytest.fixture
def copy(ckpt, tmp_path):
    d, cfg = ckpt
    out = tmp_path / "ckpt"
    shutil.copytree(d, out)
    return out, cfg


def _rewrite(d, near: str, edit):
    """Apply `edit(tensors)` to the shard holding tensor `near`; keep the index in step."""
    idx_path = d / INDEX_FILE
    index = json.loads(idx_path.read_text())
    shard = index["weight_map"][near]
    tensors = load_file(str(d / shard))
    before = set(tensors)
    edit(tensors)
    for n in before - set(tensors):
        del index["weight_map"][n]
    for n in set(tensors) - before:
        index["weight_map"][n] = shard
    save_file(tensors, str(d / shard))
    idx_path.write_text(json.dumps(index))


def _expect(d, cfg, match, par=Parallel()):
    with pytest.raises(CheckpointError, match=match):
        _load(cfg, d, par)


def test_missing_shard_file(copy):
    d, cfg = copy
    victim = sorted(d.glob("model-*.safetensors"))[1]
    victim.unlink()
    _expect(d, cfg, f"shard file .*{victim.name} named in {INDEX_FILE} is missing")


def test_unknown_tensor(copy):
    d, cfg = copy
    near = f"{LAYER1}.self_attention_res_norm.weight"
    _rewrite(d, near, lambda t: t.__setitem__(f"{LAYER1}.self_attn.bogus.weight", torch.zeros(2)))
    _expect(d, cfg, r"unknown tensor\(s\) .*layers\.1\.self_attn\.bogus\.weight")


def test_vision_tower_tensors_are_skipped(copy, tp1):
    d, cfg = copy
    near = f"{LAYER1}.self_attention_res_norm.weight"
    _rewrite(d, near, lambda t: t.update({"vision_tower.patch_embed.proj.weight": torch.ones(3),
                                          "mm_projector.proj.0.weight": torch.ones(2)}))
    m = _load(cfg, d)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), tp1.parameters()))


def test_missing_tensor(copy):
    d, cfg = copy
    name = f"{LAYER1}.self_attention_res_norm.weight"
    _rewrite(d, name, lambda t: t.pop(name))
    _expect(d, cfg, r"lacks tensor\(s\) .*layers\.1\.self_attention_res_norm\.weight")


def test_model_param_without_tensor(ckpt):
    d, cfg = ckpt
    m = K3ForCausalLM(cfg, dtype=torch.float32)
    m.model.norm.bias = torch.nn.Parameter(torch.zeros(cfg.hidden_size))
    with pytest.raises(CheckpointError, match=r"parameter 'model\.norm\.bias' has no tensor"):
        load_weights(m, d, Parallel())


def test_shape_mismatch(copy):
    d, cfg = copy
    name = f"{LAYER1}.self_attention_res_norm.weight"
    _rewrite(d, name, lambda t: t.__setitem__(name, torch.ones(cfg.hidden_size - 1)))
    _expect(d, cfg, rf"{name}: shape \({cfg.hidden_size - 1},\) in the checkpoint, expected "
                    rf"\({cfg.hidden_size},\)")


def test_wrong_mxfp4_group_size(copy):
    d, cfg = copy
    name = f"{LAYER1}.block_sparse_moe.experts.2.w2.weight_scale"
    L, inter = cfg.moe.latent_size, cfg.moe.expert_intermediate

    _rewrite(d, name, lambda t: t.__setitem__(
        name, torch.full((L, inter // 16), 127, dtype=torch.uint8)))
    _expect(d, cfg, rf"{name}: MXFP4 scales have {inter // 16} columns .*group size 16")


def test_index_and_shard_disagree(copy):
    d, cfg = copy
    name = f"{LAYER1}.self_attention_res_norm.weight"
    index = json.loads((d / INDEX_FILE).read_text())
    other = next(f for f in sorted(set(index["weight_map"].values()))
                 if f != index["weight_map"][name])
    index["weight_map"][name] = other
    (d / INDEX_FILE).write_text(json.dumps(index))
    _expect(d, cfg, rf"holds tensor '{name}', which {INDEX_FILE} maps to {other}")


def test_malformed_index(copy):
    d, cfg = copy
    (d / INDEX_FILE).write_text('{"weight_map": {')
    _expect(d, cfg, "malformed JSON")
    (d / INDEX_FILE).write_text('{"metadata": {}}')
    _expect(d, cfg, "weight_map")


def test_k_split_must_keep_whole_mxfp4_groups(tmp_path):
    hf = load_config("tiny").to_hf_dict()
    hf["text_config"]["moe_intermediate_size"] = 64          # 64 / TP4 = 16 < one group
    cfg = write_checkpoint(parse_hf_config(hf, name="narrow"), tmp_path)
    with pytest.raises(ValueError,      # MXFP4-resident experts: refused when the model is built
                       match=r"experts\.w2: tensor_parallel_size 4 splits K = 64 into 16-wide"):
        _load(cfg, tmp_path, Parallel(0, 4))


def test_model_of_another_shape_is_refused_before_loading(ckpt):
    d, cfg = ckpt
    hf = cfg.to_hf_dict()
    hf["text_config"]["q_lora_rank"] = 48
    m = K3ForCausalLM(parse_hf_config(hf), dtype=torch.float32)
    mark = {p: -7.0 if p.is_floating_point() else 7 for p in m.parameters()}   # uint8 MXFP4
    for p in m.parameters():
        p.data.fill_(mark[p])
    with pytest.raises(CheckpointError, match=r"q_a_proj\.weight: the checkpoint gives .*full "
                                              r"shape \(32, 64\), .* expects \(48, 64\)"):
        load_weights(m, d, Parallel())
    assert all((p == mark[p]).all() for p in m.parameters())   # refused before writing any
