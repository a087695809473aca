"""Analytic parameter / byte counts (models/params.py) against values worked out by hand from
K3's published dimensions (DESIGN §1): H 7168, vocab 163840, 93 layers (24 MLA, 69 KDA; layer 0
dense FFN 33792, 92 latent-MoE layers), MLA 96 heads q_lora 1536 kv_lora 512 nope 128 rope 64
v 128 with output gate, KDA 96×128 conv 4, 896 experts top-16 intermediate 3072 in a 3584
latent, 2 shared experts (6144), routed experts MXFP4 (0.5 B + 1/32 B per param)."""
import dataclasses
import random

import pytest

from raydecode.models import params as P
from raydecode.models.config import load_config

H, V, I_DENSE, LAT, IE, E, TOPK, SHARED_I = 7168, 163840, 33792, 3584, 3072, 896, 16, 6144
N_MLA, N_KDA, N_MOE, N_DENSE, N_LAYERS = 24, 69, 92, 1, 93
INNER = 96 * 128
MXFP4 = 0.5 + 1 / 32


@pytest.fixture(scope="module")
def k3():
    return load_config("k3")


# ---- per-layer parameter counts, written out ----
MLA_QKV_A = (1536 + 576) * H                     # q_a + kv_a_proj_with_mqa (replicated in stock)
MLA_SHARDED = 96 * 192 * 1536 + 96 * 256 * 512 + H * 96 * 128 + 96 * 128 * H  # q_b kv_b o g
MLA_NORMS = 1536 + 512
KDA_SHARDED = 4 * INNER * H + 96 * H + INNER * 128 + H * INNER + 3 * INNER * 4  # qkvg b f_b o conv
KDA_FP32 = 96 + INNER                            # A_log (heads), dt_bias (inner)
KDA_REP = 128 * H + 128                          # f_a_proj + o_norm
ROUTER, ROUTER_BIAS = E * H, E                   # bf16 weight, fp32 bias
LATENT, LATENT_NORM = 2 * LAT * H, LAT
SHARED = 3 * SHARED_I * H
EXPERT = 3 * IE * LAT
DENSE = 3 * I_DENSE * H
ATTN_RES = 6 * H                                 # 4 norms + 2 (1, H) projections per layer
FINAL = 3 * H                                    # norm, output_attn_res_norm, _proj


def hand_weights_per_gpu(tp: int) -> float:
    """Stock (resident) layout: qkv_a, router, latent pair whole on every rank."""
    b = 0.0
    b += 2 * V * H * 2 / tp                                        # embedding + lm_head
    b += N_MLA * (MLA_QKV_A * 2 + MLA_NORMS * 2 + MLA_SHARDED * 2 / tp)
    b += N_KDA * (KDA_SHARDED * 2 / tp + KDA_FP32 * 4 / tp + KDA_REP * 2)
    b += N_DENSE * DENSE * 2 / tp
    b += N_MOE * (ROUTER * 2 + ROUTER_BIAS * 4 + LATENT * 2 + LATENT_NORM * 2
                  + SHARED * 2 / tp + E * EXPERT * MXFP4 / tp)
    b += N_LAYERS * ATTN_RES * 2 + FINAL * 2
    return b


@pytest.mark.parametrize("tp", [8, 16])
def test_weights_per_gpu_match_hand_count(k3, tp):
    got = sum(P.weight_bytes_per_rank(k3, tp, "stock").values())
    assert got == pytest.approx(hand_weights_per_gpu(tp), rel=1e-12)


def test_weights_per_gpu_magnitudes(k3):
    # routed experts dominate: 92·896·33,030,144·17/32 B = 1.4465 TB in all, /TP
    w8 = P.weight_bytes_per_rank(k3, 8, "stock")
    w16 = P.weight_bytes_per_rank(k3, 16, "stock")
    assert w16["routed_experts"] == pytest.approx(92 * 896 * 33_030_144 * 17 / 32 / 16)
    assert 200e9 < sum(w8.values()) < 210e9 and 105e9 < sum(w16.values()) < 110e9
    # replicated pieces do not shrink with TP
    for k in P.REPLICATED_IN_STOCK:
        assert w8[k] == w16[k]


def test_specialized_reads_shard_the_replicated(k3):
    stock = P.weight_bytes_per_rank(k3, 16, "stock")
    spec = P.weight_bytes_per_rank(k3, 16, "specialized")
    # latent pair: DESIGN §4 says ~103 MB per rank per layer replicated at TP16
    assert stock["latent"] / N_MOE == LATENT * 2           # (the latent norm counts as a norm)
    assert 100e6 < LATENT * 2 < 105e6
    assert spec["latent"] == pytest.approx(N_MOE * LATENT * 2 / 16)
    assert spec["router"] == pytest.approx(N_MOE * (ROUTER * 2 / 16 + ROUTER_BIAS * 4))
    assert spec["mla_qkv_a"] == pytest.approx(N_MLA * MLA_QKV_A * 2 / 16)
    for k in ("routed_experts", "kda", "mla", "shared_experts"):
        assert spec[k] == stock[k]


def test_design_shapes_tp8_stock(k3):
    s = P.decode_gemv_shapes(k3, 8, "stock")
    expect = {"fused_qkv_a": (2112, 7168), "q_b": (2304, 1536), "kda_in_proj": (6288, 7168),
              "o_proj": (7168, 1536), "latent_down": (3584, 7168), "latent_up": (7168, 3584),
              "router": (896, 7168), "shared_gate_up": (1536, 7168),
              "shared_down": (7168, 768), "lm_head": (20480, 7168)}
    for name, shape in expect.items():
        assert s[name] == shape, name


def test_design_shapes_tp16_and_specialized(k3):
    s16 = P.decode_gemv_shapes(k3, 16, "stock")
    s8 = P.decode_gemv_shapes(k3, 8, "stock")
    for name in ("q_b", "o_proj", "shared_gate_up", "shared_down", "lm_head"):   # sharded halve
        n8, k8 = s8[name]
        assert s16[name] in ((n8 // 2, k8), (n8, k8 // 2))
    for name in ("fused_qkv_a", "router", "latent_down", "latent_up"):          # replicated
        assert s16[name] == s8[name]
    # KDA in_proj: 4·768 (qkvg) + 6 (b) + 128 (f_a whole) = 3206 → padded to 16 → 3216
    assert s16["kda_in_proj"] == (3216, 7168)
    sp = P.decode_gemv_shapes(k3, 16, "specialized")
    assert sp["fused_qkv_a"] == (132, 7168) and sp["router"] == (56, 7168)
    assert sp["latent_down"] == (224, 7168) and sp["latent_up"] == (7168, 224)


@pytest.mark.parametrize("tp", [16, 8])
def test_specialized_packed_gemvs(k3, tp):
    """The fused specialized decode's packed GEMVs (models/mla.py `_qkv_a_g`, models/moe.py
    `_h2_proj`, `_ffn_out`) and the unfused block's / GatedMLP's separate launches."""
    sp = P.decode_gemv_shapes(k3, tp, "specialized")
    # qkv_a_g: [q_a; kv_a] rows (1536 + 576)/TP ‖ g_proj rows 96·128/TP
    # h2_proj: router 896/TP ‖ latent down 3584/TP ‖ shared gate ‖ up 2·6144/TP
    # ffn_out: K = latent up cols 3584/TP ‖ shared down cols 6144/TP, padded to 128
    expect = {16: {"qkv_a_g": (900, H),        # 132 + 768
                   "h2_proj": (1048, H),       # 56 + 224 + 768
                   "ffn_out": (H, 640)},       # 224 + 384 = 608 → 640
              8: {"qkv_a_g": (1800, H),        # 264 + 1536
                  "h2_proj": (2096, H),        # 112 + 448 + 1536
                  "ffn_out": (H, 1280)}}[tp]   # 448 + 768 = 1216 → 1280
    for name, shape in expect.items():
        assert sp[name] == shape, name
    assert sp["q_b_folded"] == sp["q_b"] == (96 * 192 // tp, 1536)
    assert sp["q_b_absorbed"] == (96 * 576 // tp, 1536)            # W_uk folded: c + rope
    assert sp["dense_gate"] == sp["dense_up"] == (I_DENSE // tp, H)
    assert sp["shared_gate"] == sp["shared_up"] == (SHARED_I // tp, H)
    assert sp["latent_up_rows"] == (H // tp, LAT)
    assert sp["kda_qkvg"] == (INNER // tp, H) and sp["kda_b"] == (96 // tp, H)
    assert sp["kda_f_a"] == (128, H)                               # replicated
    fp32 = {n for n in sp if P.gemv_out_dtype(n, "specialized") == "fp32"}
    assert fp32 == {"router", "q_b_absorbed", "q_b_folded", "h2_proj"}
    # the packed weights exist only on the specialized path; stock keeps every other key
    st = P.decode_gemv_shapes(k3, tp, "stock")
    assert set(sp) - set(st) == {"qkv_a_g", "q_b_absorbed", "q_b_folded", "h2_proj", "ffn_out",
                                 "latent_up_rows"}
    assert P.gemv_out_dtype("router", "stock") == "fp32"
    assert P.gemv_out_dtype("q_b", "stock") == P.gemv_out_dtype("q_b", "specialized") == "bf16"


def test_fused_moe_shapes_need_the_fused_blocks_parts(k3):
    """No shared experts or no latent norm: the unfused block runs, no h2_proj / ffn_out;
    no MLA output gate: no qkv_a_g / q_b_folded (the fused MLA decode needs the gate)."""
    for moe in (dataclasses.replace(k3.moe, num_shared_experts=0),
                dataclasses.replace(k3.moe, latent_norm=False)):
        sp = P.decode_gemv_shapes(dataclasses.replace(k3, moe=moe), 16, "specialized")
        assert "h2_proj" not in sp and "ffn_out" not in sp and sp["router"] == (56, H)
    no_gate = dataclasses.replace(k3, mla=dataclasses.replace(k3.mla, use_output_gate=False))
    sp = P.decode_gemv_shapes(no_gate, 16, "specialized")
    assert "qkv_a_g" not in sp and "q_b_folded" not in sp and sp["fused_qkv_a"] == (132, H)


def test_total_and_active_params(k3):
    pc = P.param_counts(k3)
    hand_total = (2 * V * H + N_MLA * (MLA_QKV_A + MLA_SHARDED + MLA_NORMS)
                  + N_KDA * (KDA_SHARDED + KDA_FP32 + KDA_REP) + N_DENSE * DENSE
                  + N_MOE * (ROUTER + ROUTER_BIAS + LATENT + LATENT_NORM + SHARED + E * EXPERT)
                  + N_LAYERS * ATTN_RES + FINAL)
    assert pc["total"] == hand_total
    assert abs(pc["total"] / 2.8e12 - 1) < 0.02            # published 2.8T
    assert pc["active"] == hand_total - N_MOE * (E - TOPK) * EXPERT
    assert abs(pc["active"] / 104e9 - 1) < 0.05             # published 104B active
    assert pc["active_excl_embedding"] == pc["active"] - V * H


def test_kv_bytes_per_token(k3):
    assert P.kv_bytes_per_token(k3) == 24 * 576 * 2 == 27_648
    assert P.kv_bytes_per_token(k3, dcp=4) == 27_648 / 4
    assert P.kv_bytes_per_token(k3, kv_dtype="fp8") == 24 * 576
    assert P.kv_bytes_per_token(k3, extra_mla_layers=5) == 29 * 576 * 2   # + DSpark rows


def test_kda_state_per_sequence(k3):
    # 69 layers × (heads_local·128·128·4 B + 3 convs · inner_local · 3 taps · 2 B)
    assert P.kda_state_bytes_per_seq(k3, 8) == 69 * (12 * 128 * 128 * 4 + 3 * 1536 * 3 * 2)
    assert P.kda_state_bytes_per_seq(k3, 16) == 69 * (6 * 128 * 128 * 4 + 3 * 768 * 3 * 2)
    assert P.kda_state_bytes_per_seq(k3, 16) == 28_085_760
    assert P.kda_state_bytes_per_seq(k3, 1) == k3.kda_state_bytes_per_seq


def test_expected_distinct_experts_formula_and_simulation():
    assert P.expected_distinct_experts(896, 16, 1) == pytest.approx(16)
    assert P.expected_distinct_experts(896, 16, 0) == 0
    assert P.expected_distinct_experts(896, 16, 10_000) == pytest.approx(896, rel=1e-6)
    rng = random.Random(7)
    E_, k, T, trials = 12, 3, 5, 20_000
    sim = sum(len(set().union(*(rng.sample(range(E_), k) for _ in range(T))))
              for _ in range(trials)) / trials
    assert sim == pytest.approx(P.expected_distinct_experts(E_, k, T), abs=0.05)


def test_decode_reads_routed_bytes(k3):
    # batch 1 at TP16: 16 experts, each rank reads its (384×3584 + 3584×192) MXFP4 slice
    r = P.decode_reads(k3, 16, "specialized", seqs=1)["moe"]
    per_expert = (2 * IE // 16 * LAT + LAT * IE // 16) * MXFP4
    assert r["experts_gate_up"].bytes + r["experts_down"].bytes == pytest.approx(16 * per_expert)
    r64 = P.decode_reads(k3, 16, "specialized", seqs=64)["moe"]
    touched = 896 * (1 - (1 - 16 / 896) ** 64)
    assert r64["experts_gate_up"].bytes + r64["experts_down"].bytes == \
        pytest.approx(touched * per_expert)


def test_specialized_mla_reads_fold_w_uk_into_q_b(k3):
    """At DCP 1 the specialized MLA reads W_q'' (h·(512 + 64) rows) and no W_uk; DCP 2 keeps
    the q_b + absorb reads (models/mla.py runs the unfolded ops there)."""
    st = P.decode_reads(k3, 16, "stock", 1, context=1024)["mla"]
    sp = P.decode_reads(k3, 16, "specialized", 1, context=1024)["mla"]
    wq = 96 * 192 * 1536 * 2 / 16
    assert sp["q_b"].bytes - st["q_b"].bytes == pytest.approx(wq * (576 / 192 - 1)
                                                              + 2 * 6 * (576 - 192))
    assert st["w_uk"].bytes == 6 * 128 * 512 * 2 and sp["w_uk"].bytes == 0
    d2 = P.decode_reads(k3, 16, "specialized", 1, context=1024, dcp=2)["mla"]
    assert d2["q_b"].bytes == st["q_b"].bytes and d2["w_uk"].bytes == st["w_uk"].bytes


def test_decode_reads_caches(k3):
    r = P.decode_reads(k3, 16, "stock", seqs=4, context=1000, dcp=2)
    # each sequence reads its 500 latent rows of 576 bf16 on this DCP rank, + writes 4 rows / 2
    assert r["mla"]["kv_cache"].bytes == 4 * 500 * 576 * 2 + 4 * 576 * 2 / 2
    state = 6 * 128 * 128 * 4
    assert r["kda"]["state"].bytes == 4 * state + 4 * state          # read + write
    v = P.decode_reads(k3, 16, "stock", seqs=4, tokens_per_seq=8, context=1000)
    assert v["kda"]["state"].bytes == 4 * state + 32 * state         # a state per position


def test_drafter_matches_published_size(k3):
    d = P.drafter_params(k3)
    assert abs(d["with_shared_embedding"] / 3.56e9 - 1) < 0.01
    assert d["own"] == d["with_shared_embedding"] - V * H


def test_bad_tp_is_named(k3):
    with pytest.raises(P.ShardError, match="96 MLA heads"):
        P.check_tp(k3, 5)
    with pytest.raises(P.ShardError, match="163840"):           # divides heads, not the vocab
        P.check_tp(k3, 12)
    assert P.valid_tps(k3, 72) == [1, 2, 4, 8, 16, 32]


def test_tiny_config_counts():
    t = load_config("tiny")
    pc = P.param_counts(t)
    assert 0 < pc["active"] < pc["total"] < 5_000_000
    assert P.valid_tps(t, 8) == [1, 2, 4]
    assert P.decode_gemv_shapes(t, 4, "stock")["q_b"] == (4 * 24 // 4, 32)
