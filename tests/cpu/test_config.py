import copy
import json
from pathlib import Path

import pytest

from raydecode.models.config import ConfigError, load_config, parse_hf_config

K3_JSON = Path(__file__).parent.parent / "data" / "kimi-k3-config.json"


@pytest.fixture
def k3_dict():
    return json.loads(K3_JSON.read_text())


def test_published_k3_config_parses_with_design_values(k3_dict):
    c = parse_hf_config(k3_dict)
    assert (c.hidden_size, c.num_layers, c.vocab_size, c.intermediate_size) == (7168, 93, 163840, 33792)
    assert c.layer_kinds.count("mla") == 24 and c.layer_kinds.count("kda") == 69
    # 1-indexed lists in the file, 0-indexed here: layers 4, 8, ..., 92, 93 → 3, 7, ..., 91, 92
    assert c.mla_layers[:3] == (3, 7, 11) and c.mla_layers[-2:] == (91, 92)
    assert not c.is_moe_layer(0) and all(c.is_moe_layer(i) for i in range(1, 93))
    m, k, e = c.mla, c.kda, c.moe
    assert (m.num_heads, m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim,
            m.v_head_dim, m.latent_dim) == (96, 1536, 512, 128, 64, 128, 576)
    assert m.use_nope and m.use_output_gate
    assert (k.num_heads, k.head_dim, k.conv_size, k.gate_lower_bound) == (96, 128, 4, -5.0)
    assert (e.num_experts, e.top_k, e.expert_intermediate, e.latent_size, e.shared_intermediate) == \
        (896, 16, 3072, 3584, 6144)
    assert e.router_activation == "sigmoid" and e.topk_method == "noaux_tc" and e.renormalize
    assert (c.situ_beta, c.situ_linear_beta, c.attn_res_block_size, c.num_attn_res_blocks) == (4.0, 25.0, 12, 8)
    assert c.quant.is_mxfp4 and c.quant.group_size == 32
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (163584, 163586, 163839)
    assert c.kv_bytes_per_token == 24 * 576 * 2


def test_presets_and_round_trip():
    k3 = load_config("k3")
    again = parse_hf_config(k3.to_hf_dict(), name="k3")
    assert again == k3
    tiny = load_config("tiny")
    assert parse_hf_config(tiny.to_hf_dict(), name="tiny") == tiny
    # tiny holds every block kind: dense first layer, KDA and MLA, >= 2 AttnRes blocks, latent MoE
    assert not tiny.is_moe_layer(0) and tiny.is_moe_layer(1)
    assert {"kda", "mla"} == set(tiny.layer_kinds)
    assert tiny.num_attn_res_blocks >= 2
    assert tiny.moe.latent_size < tiny.hidden_size and tiny.moe.num_shared_experts > 0


def test_config_file_and_folder_load(tmp_path, k3_dict):
    (tmp_path / "config.json").write_text(json.dumps(k3_dict))
    assert load_config(tmp_path).num_layers == 93
    assert load_config(tmp_path / "config.json").hidden_size == 7168
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="malformed JSON"):
        load_config(tmp_path / "bad")
    with pytest.raises(ConfigError, match="not a preset"):
        load_config(tmp_path / "nowhere")


def _mut(d, path, value=None, delete=False):
    d = copy.deepcopy(d)
    cur = d
    for p in path[:-1]:
        cur = cur[p]
    if delete:
        del cur[path[-1]]
    else:
        cur[path[-1]] = value
    return d


@pytest.mark.parametrize("path,value,delete,needle", [
    (("text_config", "hidden_size"), None, True, "missing field.*hidden_size"),
    (("text_config", "hiden_size"), 7168, False, "unknown field.*hiden_size"),
    (("text_config", "hidden_size"), -1, False, "hidden_size = -1"),
    (("text_config", "num_experts_per_token"), 1000, False, "exceeds num_experts"),
    (("text_config", "linear_attn_config", "kda_layers"), [1, 2, 3], False, "in neither"),
    (("text_config", "linear_attn_config", "full_attn_layers"), [4, 94], False, r"\[1, 93\]"),
    (("text_config", "linear_attn_config", "kda_layers"), [1, 2, 3, 4], False, None),
    (("text_config", "routed_expert_hidden_size"), 8000, False, "exceeds hidden_size"),
    (("text_config", "quantization_config", "config_groups", "group_0", "weights", "group_size"),
     16, False, "group_size = 16"),
    (("text_config", "moe_router_activation_func"), "softmax", False, "sigmoid"),
    (("text_config", "num_key_value_heads"), 8, False, "num_key_value_heads"),
    (("text_config", "hidden_act"), "silu", False, "situ"),
    (("model_type",), "deepseek_v3", False, "kimi_k3"),
    (("surprise",), 1, False, "unknown top-level"),
])
def test_malformed_configs_name_the_field(k3_dict, path, value, delete, needle):
    bad = _mut(k3_dict, path, value, delete)
    if needle is None:   # a layer listed as both kinds
        needle = "both kda_layers and full_attn_layers"
    with pytest.raises(ConfigError, match=needle):
        parse_hf_config(bad)
