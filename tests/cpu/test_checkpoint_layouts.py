"""The published K3 checkpoint layouts and config keys (issue 30 §4; the facts are vLLM 0.33's K3
loader and configs): a tiny checkpoint rewritten into each accepted layout loads the same
parameters and generates the same greedy text; quantization_config read as compressed-tensors
defines it; the reference's config defaults and rules; the rounding points of the stock path."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from raydecode.engine.loader import build_local_engine
from raydecode.engine.request import SamplingParams
from raydecode.models.checkpoint import (INDEX_FILE, CheckpointError, checkpoint_tensor_specs,
                                         write_checkpoint)
from raydecode.models.config import ConfigError, load_config, parse_hf_config
from raydecode.models.mxfp4 import pack_mxfp4, unpack_mxfp4
from raydecode.models.weights import load_model

torch.set_num_threads(1)
PROMPTS = ["The capital of France", "def fib(n):"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
CANON, ALT = "language_model.model.layers.", "language_model.layers."
# every Linear MXFP4 but the shared experts (K3's own rule) and f_b_proj (K = head_dim = 16
# in the tiny model, not a whole group of 32)
ALL_LINEAR = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
              "ignore": ["re:.*shared_experts.*", "re:.*f_b_proj$"],
              "config_groups": {"group_0": {"format": "mxfp4-pack-quantized",
                                            "targets": ["Linear"], "input_activations": None,
                                            "weights": {"num_bits": 4, "group_size": 32,
                                                        "strategy": "group", "type": "float"}}}}


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    index = json.loads((d / INDEX_FILE).read_text())["weight_map"]
    out = {}
    for f in sorted(set(index.values())):
        with safe_open(str(d / f), framework="pt") as h:
            out.update({n: h.get_tensor(n) for n in h.keys()})
    return out


def _write(d: Path, tensors: dict[str, torch.Tensor], config: dict, tokenizer_from: Path) -> Path:
    """A one-shard checkpoint of `tensors` with `config` and the tokenizer of another one."""
    d.mkdir(parents=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(d / "model-00001-of-00001"
                                                                      ".safetensors"))
    (d / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": dict.fromkeys(
        tensors, "model-00001-of-00001.safetensors")}))
    (d / "config.json").write_text(json.dumps(config))
    for f in tokenizer_from.iterdir():
        if f.suffix not in (".safetensors", ".json") or f.name == "tokenizer_config.json":
            shutil.copy(f, d / f.name)
    return d


def _greedy(d: Path) -> list[tuple[str, list[int]]]:
    eng = build_local_engine(str(d), max_num_seqs=2, max_model_len=64)
    return [(r.output_text, list(r.output_ids)) for r in eng.generate(PROMPTS, GREEDY)]


def _params(d: Path) -> dict[str, torch.Tensor]:
    _, model = load_model(str(d), dtype=torch.float32)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The canonical tiny checkpoint, its tensors with the to-be-quantized linears already on
    the MXFP4 grid (so an MXFP4 rewrite holds the very same values), its text and parameters."""
    root = tmp_path_factory.mktemp("layouts")
    first = root / "written"
    cfg = write_checkpoint(load_config("tiny"), first, seed=5)
    hf = json.loads((first / "config.json").read_text())
    quantized = parse_hf_config({**hf, "text_config": {**hf["text_config"],
                                                       "quantization_config": ALL_LINEAR}})
    tensors = _tensors(first)
    q_specs = checkpoint_tensor_specs(quantized)
    for name in list(tensors):
        mod = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{mod}.weight_packed" in q_specs:
            packed, scales = pack_mxfp4(tensors[name].float())
            tensors[name] = unpack_mxfp4(packed, scales, torch.bfloat16)
    canon = _write(root / "canonical", tensors, hf, first)
    return {"root": root, "dir": canon, "hf": hf, "tensors": tensors, "cfg": cfg,
            "q_specs": q_specs, "text": _greedy(canon), "params": _params(canon)}


def _rename_layers(tensors):
    return {(ALT + n[len(CANON):] if n.startswith(CANON) else n): t for n, t in tensors.items()}


def _a_log(tensors, heads: int, shape: str):
    out = {}
    for n, t in tensors.items():
        if n.endswith(".A_log"):
            t = t[:heads].clone() if shape == "flat" else t[:heads].reshape(1, 1, heads, 1)
        out[n] = t
    return out


def _mxfp4_everywhere(tensors, q_specs):
    out = {}
    for n, t in tensors.items():
        mod = n.removesuffix(".weight")
        if n.endswith(".weight") and f"{mod}.weight_packed" in q_specs:
            out[f"{mod}.weight_packed"], out[f"{mod}.weight_scale"] = pack_mxfp4(t.float())
        else:
            out[n] = t
    return out


@pytest.mark.parametrize("layout", ["layers_prefix", "a_log_heads", "a_log_4d", "mxfp4_linears",
                                    "all_at_once"])
def test_each_published_layout_loads_the_same_model_and_text(base, layout):
    hf, t, heads = base["hf"], base["tensors"], base["cfg"].kda.num_heads
    config = hf
    if layout == "layers_prefix":
        t = _rename_layers(t)
    elif layout == "a_log_heads":
        t = _a_log(t, heads, "flat")
    elif layout == "a_log_4d":
        t = _a_log(t, heads, "4d")
    else:
        config = {**hf, "text_config": {**hf["text_config"], "quantization_config": ALL_LINEAR}}
        t = _mxfp4_everywhere(t, base["q_specs"])
        if layout == "all_at_once":
            t = _rename_layers(_a_log(t, heads, "4d"))
    d = _write(base["root"] / layout, t, config, base["dir"])
    if layout.startswith(("mxfp4", "all")):     # the attention / dense linears are packed
        names = set(_tensors(d))
        assert any(n.endswith("self_attn.q_b_proj.weight_packed") for n in names)
        assert any(n.endswith("mlp.down_proj.weight_packed") for n in names)
        assert not any("shared_experts" in n and "packed" in n for n in names)
    got = _params(d)
    assert got.keys() == base["params"].keys()
    for n, p in got.items():
        assert torch.equal(p, base["params"][n]), n
    assert _greedy(d) == base["text"]


def test_both_layer_prefixes_for_one_tensor_are_refused(base):
    t = dict(base["tensors"])
    n = next(x for x in t if x.startswith(CANON))
    t[ALT + n[len(CANON):]] = t[n].clone()
    d = _write(base["root"] / "both", t, base["hf"], base["dir"])
    with pytest.raises(CheckpointError, match="both layer prefixes"):
        load_model(str(d))


def test_an_mxfp4_module_slices_by_whole_groups_at_tp2(base):
    """Row-parallel MXFP4 linears split along K in whole groups; each rank decodes its slice."""
    from raydecode.models.parallel import Parallel

    config = {**base["hf"], "text_config": {**base["hf"]["text_config"],
                                            "quantization_config": ALL_LINEAR}}
    d = _write(base["root"] / "tp2", _mxfp4_everywhere(base["tensors"], base["q_specs"]), config,
               base["dir"])
    for rank in (0, 1):
        _, m = load_model(str(d), Parallel(rank, 2), dtype=torch.float32)
        w = dict(m.named_parameters())["model.layers.2.self_attn.o_proj.weight"]
        full = base["params"]["model.layers.2.self_attn.o_proj.weight"]
        k = full.shape[1] // 2
        assert torch.equal(w, full[:, rank * k:(rank + 1) * k])


# ---- quantization_config as compressed-tensors defines it ----------------------------------------

def _with_quant(q):
    hf = load_config("k3").to_hf_dict()
    hf["text_config"]["quantization_config"] = q
    return hf


def test_k3_config_names_every_linear_but_the_shared_experts_mxfp4():
    specs = checkpoint_tensor_specs(load_config("k3"))
    L = "language_model.model.layers"
    for mod in (f"{L}.3.self_attn.q_b_proj", f"{L}.3.self_attn.o_proj", f"{L}.0.mlp.down_proj",
                f"{L}.1.self_attn.q_proj", f"{L}.1.self_attn.f_b_proj",
                f"{L}.1.block_sparse_moe.routed_expert_down_proj",
                f"{L}.1.block_sparse_moe.experts.7.w2"):
        assert f"{mod}.weight_packed" in specs and f"{mod}.weight" not in specs, mod
    for mod in (f"{L}.1.block_sparse_moe.shared_experts.gate_proj",     # ignored
                f"{L}.1.block_sparse_moe.gate", f"{L}.1.self_attention_res_proj",  # not Linear
                "language_model.lm_head"):
        assert f"{mod}.weight" in specs and f"{mod}.weight_packed" not in specs, mod


@pytest.mark.parametrize("edit,match", [
    (lambda q: {**q, "quant_method": "fp8"}, r"quant_method = 'fp8'"),
    (lambda q: {**q, "format": "nvfp4-pack-quantized", "config_groups": {"g": {
        **q["config_groups"]["group_0"], "format": None}}}, r"'nvfp4-pack-quantized'"),
    (lambda q: {**q, "config_groups": {"g": {**q["config_groups"]["group_0"],
                                             "format": "float-quantized"}}},
     r"format = 'float-quantized'"),
    (lambda q: {**q, "config_groups": {"g": {**q["config_groups"]["group_0"], "weights": {
        "num_bits": 4, "group_size": 32, "strategy": "tensor"}}}}, r"strategy = 'tensor'"),
    (lambda q: {**q, "config_groups": {"g": {**q["config_groups"]["group_0"],
                                             "input_activations": {"num_bits": 8}}}},
     r"input_activations"),
    (lambda q: {**q, "config_groups": {"g": {**q["config_groups"]["group_0"],
                                             "targets": ["Embedding"]}}}, r"'Embedding'"),
])
def test_what_cannot_load_exactly_is_refused_by_name(edit, match):
    q = load_config("k3").to_hf_dict()["text_config"]["quantization_config"]
    with pytest.raises(ConfigError, match=match):
        parse_hf_config(_with_quant(edit(q)))


def test_a_named_module_off_the_group_grid_is_named():
    hf = load_config("tiny").to_hf_dict()
    hf["text_config"]["quantization_config"] = {**ALL_LINEAR, "ignore": []}
    with pytest.raises(CheckpointError, match=r"f_b_proj MXFP4, but its K = 16"):
        checkpoint_tensor_specs(parse_hf_config(hf))


def test_ignore_and_targets_match_either_layer_prefix():
    q = parse_hf_config(_with_quant({**ALL_LINEAR, "ignore": [
        "language_model.layers.3.self_attn.q_b_proj"]})).quant
    assert not q.quantizes("language_model.model.layers.3.self_attn.q_b_proj",
                           ("language_model.layers.3.self_attn.q_b_proj",))
    q = parse_hf_config(_with_quant({**ALL_LINEAR, "ignore": [], "config_groups": {"g": {
        **ALL_LINEAR["config_groups"]["group_0"], "targets": ["re:.*experts\\.\\d+\\.w1$"]}}})).quant
    assert q.quantizes("language_model.model.layers.1.block_sparse_moe.experts.3.w1")
    assert not q.quantizes("language_model.model.layers.1.block_sparse_moe.experts.3.w2")


# ---- the reference's config defaults and rules ---------------------------------------------------

def _text(**edit):
    hf = load_config("tiny").to_hf_dict()
    t = hf["text_config"]
    for k, v in edit.items():
        if v is None:
            t.pop(k, None)
        else:
            t[k] = v
    return hf


def test_mla_use_nope_is_enforced_and_defaults_false():
    with pytest.raises(ConfigError, match=r"mla_use_nope = False \(the default\).*NoPE-only"):
        parse_hf_config(_text(mla_use_nope=None))
    with pytest.raises(ConfigError, match=r"mla_use_nope = False;"):
        parse_hf_config(_text(mla_use_nope=False))


def test_optional_keys_default_as_the_reference():
    c = parse_hf_config(_text(mla_use_output_gate=None, latent_moe_use_norm=None))
    assert c.mla.use_output_gate is False and c.moe.latent_norm is False
    hf = _text()
    hf["text_config"]["linear_attn_config"].pop("use_full_rank_gate")
    assert parse_hf_config(hf).kda.use_full_rank_gate is False
    with pytest.raises(ConfigError, match="hidden_act.*silu"):
        parse_hf_config(_text(hidden_act=None))


def test_moe_layer_freq_rule_is_the_references():
    """MoE at layer i iff i >= first_k_dense_replace and i % moe_layer_freq == 0 (vLLM)."""
    c = parse_hf_config(_text(first_k_dense_replace=1, moe_layer_freq=2))
    assert [i for i in range(c.num_layers) if c.is_moe_layer(i)] == [2, 4]
    with pytest.raises(ConfigError, match="moe_layer_freq = 0"):
        parse_hf_config(_text(moe_layer_freq=0))


# ---- DSpark config keys and defaults --------------------------------------------------------------

def _dspark(**edit):
    from raydecode.models.dspark import load_dspark_config
    d = dict(load_dspark_config("tiny").raw)
    for k, v in edit.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return d


def test_dspark_keys_are_honoured_or_refused_with_the_reason():
    from raydecode.models.dspark import parse_dspark_config

    ok = parse_dspark_config(_dspark(mla_use_qk_norm=False, dspark_bonus_anchor=False,
                                     sample_from_anchor=True))
    assert ok.block_size == 7
    for key, bad, why in (("mla_use_qk_norm", True, "q/k norm"),
                          ("dspark_bonus_anchor", True, "bonus-token anchor"),
                          ("sample_from_anchor", False, "anchor-as-first")):
        with pytest.raises(ConfigError, match=why):
            parse_dspark_config(_dspark(**{key: bad}))


def test_dspark_rope_defaults_are_the_references():
    from raydecode.models.dspark import parse_dspark_config

    c = parse_dspark_config(_dspark(rope_theta=None, rope_parameters=None))
    assert c.rope.theta == 50000.0 and not c.rope.is_yarn
    rp = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    c = parse_dspark_config(_dspark(rope_parameters=rp))
    assert c.rope.mscale_all_dim == 0.0
    assert c.softmax_scale == pytest.approx(c.qk_head_dim ** -0.5)    # no YaRN rescale


def test_dspark_rope_table_is_the_fp32_table():
    """cos/sin as vLLM's rotary embedding builds them: fp32 inverse frequencies, fp32 positions,
    one fp32 product, cos/sin in fp32 — bit for bit at long positions."""
    from raydecode.models.dspark import RopeConfig, rope_cos_sin, rope_inv_freq

    r = RopeConfig(theta=50000.0)
    dim, pos = 64, torch.tensor([0, 1, 4095, 100_000, 1_000_000])
    inv = 1.0 / (50000.0 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    freqs = torch.einsum("i,j -> ij", pos.to(torch.float32), inv)
    cos, sin = rope_cos_sin(pos, rope_inv_freq(dim, r), r)
    assert cos.dtype == torch.float32
    assert torch.equal(cos, freqs.cos()) and torch.equal(sin, freqs.sin())


# ---- rounding points of the stock path ----------------------------------------------------------

def test_sublayer_mix_enters_its_norm_in_fp32_and_rounds_once():
    from raydecode.models.attnres import AttnResStream
    from raydecode.models.layers import RMSNorm

    g = torch.Generator().manual_seed(0)
    T, H, bf = 3, 64, torch.bfloat16
    blocks = [torch.randn(T, H, generator=g).to(bf) for _ in range(2)]
    prefix = torch.randn(T, H, generator=g).to(bf)
    res_norm, out_norm = RMSNorm(H, 1e-5, bf), RMSNorm(H, 1e-5, bf)
    res_norm.weight.data = (1 + 0.1 * torch.randn(H, generator=g)).to(bf)
    out_norm.weight.data = (1 + 0.1 * torch.randn(H, generator=g)).to(bf)
    proj = (torch.randn(1, H, generator=g) / 8).to(bf)
    bank = AttnResStream(prefix)
    bank.blocks = list(blocks)
    h = bank.mix_then_norm(res_norm, proj, out_norm)
    # vLLM's attn_res kernel: logits = rsqrt(mean v²+eps)·Σ v·(w_norm·w_proj), fp32 mix, fp32
    # output norm, one rounding
    v = torch.stack(blocks + [prefix], 1).float()
    logit = (v * (res_norm.weight.float() * proj[0].float())).sum(-1) \
        * torch.rsqrt(v.square().mean(-1) + 1e-5)
    mix = (logit.softmax(-1)[..., None] * v).sum(1)
    want = (mix * torch.rsqrt(mix.square().mean(-1, keepdim=True) + 1e-5)
            * out_norm.weight.float()).to(bf)
    assert h.dtype == bf
    torch.testing.assert_close(h.float(), want.float(), rtol=0, atol=2 ** -7 * want.float()
                               .abs().max().item())
    rounded_first = (mix.to(bf).float() * torch.rsqrt(mix.to(bf).float().square().mean(
        -1, keepdim=True) + 1e-5) * out_norm.weight.float()).to(bf)
    assert not torch.equal(h, rounded_first)      # a bf16 mix before the norm: other bits


def test_final_norm_rounds_as_the_rmsnorm_op():
    from raydecode.models.k3 import K3ForCausalLM
    from raydecode.models.layers import rms_norm

    m = K3ForCausalLM(load_config("tiny"), dtype=torch.bfloat16)
    assert m.model.norm.op_rounding and not m.model.layers[0].input_layernorm.op_rounding
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 64, generator=g).to(torch.bfloat16)
    w = (1 + 0.3 * torch.randn(64, generator=g)).to(torch.bfloat16)
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert torch.equal(rms_norm(x, w, 1e-5, op_rounding=True), normed * w)   # vLLM's op
    once = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-5) * w.float()).to(
        torch.bfloat16)
    assert torch.equal(rms_norm(x, w, 1e-5), once)                          # fused kernels
    assert not torch.equal(once, normed * w)          # the two roundings differ on this input
