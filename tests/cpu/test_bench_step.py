"""scripts/bench/step.py on the CPU (tiny config, eager: no graphs here): the three variants
agree, the byte model counts what each path reads, the one-rank comm keeps the real shapes,
and the on-device init draws MXFP4 experts at the fan-in scale of the model's own init."""
from __future__ import annotations

import json
import math

import pytest
import torch

from raydecode.models.config import load_config
from raydecode.models.k3 import K3ForCausalLM
from raydecode.models.moe import E2M1_VALUES, SCALE_BIAS
from raydecode.models.parallel import Parallel
from raydecode.scripts.bench import step

torch.set_num_threads(1)


def test_bench_runs_and_variants_agree(tmp_path):
    out = tmp_path / "step.json"
    assert step.main(["--config", "tiny", "--tp", "2", "--device", "cpu", "--batches", "1,3",
                      "--steps", "2", "--context", "21", "--host-profile",
                      "--routing-probe", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert [r["batch"] for r in rep["rows"]] == [1, 3] and rep["tp"] == 2
    for r in rep["rows"]:
        assert r["logits_finite"] and min(r["last_logits_std"].values()) > 0
        assert set(r["ms"]) == set(step.VARIANTS)
        # CPU: the graphed runner runs the same statics path eagerly on rows padded to the
        # bucket; the padded GEMMs block differently and bf16 flips carry through 6 layers
        # (seen up to 3.3e-2); a stale table or state row moves logits by 0.5..1
        assert r["graphed_vs_specialized_max_rel"] < 6e-2
        assert not r["capture_failed"] and r["graph_counts"]["plain"] == 0
        # both gather the vocab-parallel logits; the specialized step also the 1/TP slices
        coll = r["collectives_per_step"]
        assert coll["stock"]["all_gather"] == 1 and coll["stock"]["all_reduce"] > 0
        assert coll["specialized"]["all_gather"] > 1 and coll["specialized"]["all_reduce"] > 0
        assert r["host_profile_specialized"][0]["own_ms"] > 0
        cfg, T = load_config("tiny"), r["batch"]
        E, k, rt = cfg.moe.num_experts, cfg.moe.top_k, r["routing"]
        assert rt["calls"] > 0 and k <= rt["distinct_min"] <= rt["distinct_max"] <= min(E, T * k)
        assert rt["uniform_expected"] == round(E * (1 - (1 - k / E) ** T), 1)
        b = r["bytes"]
        assert b["specialized"]["dense"] < b["stock"]["dense"]       # row-sharded reads
        assert b["specialized"]["experts"] == b["stock"]["experts"] > 0
    # every step ran graph-shaped (counts are cumulative): 3 warm + 2 timed, + 1 host-profiled
    # (+ 1 routing-probed step per batch)
    assert [r["graph_counts"]["eager_statics"] for r in rep["rows"]] == [5, 12]
    with pytest.raises(SystemExit, match="--routing-probe records the eager specialized"):
        step.main(["--config", "tiny", "--device", "cpu", "--variants", "graphed",
                   "--routing-probe"])


def test_byte_model_counts_distinct_experts_and_kv():
    cfg = load_config("tiny")
    with torch.device("meta"):
        m = K3ForCausalLM(cfg, Parallel(0, 2), step.SoloRankComm(Parallel(0, 2)),
                          torch.bfloat16)
    E, k = cfg.moe.num_experts, cfg.moe.top_k
    b1, b64 = (step.step_bytes(m, T, 100, "specialized") for T in (1, 64))
    assert b1["distinct_experts"] == pytest.approx(k, rel=1e-6)
    assert k < b64["distinct_experts"] <= E
    assert b64["experts"] / b1["experts"] == pytest.approx(b64["distinct_experts"] / k, rel=1e-3)
    assert b64["kv"] == 64 * b1["kv"] == 64 * len(cfg.mla_layers) * 101 * cfg.mla.latent_dim * 2
    assert b64["dense"] == b1["dense"] and b64["embedding"] == 64 * b1["embedding"]


def test_solo_rank_comm_keeps_gather_shapes():
    c = step.SoloRankComm(Parallel(0, 4, dcp_size=2))
    x = torch.arange(6.0).reshape(2, 3)
    assert c.all_reduce(x) is x
    g = c.all_gather(x, dim=-1)
    assert g.shape == (2, 12) and torch.equal(g[:, 9:], x)
    assert c.dcp_all_gather(x, dim=0).shape == (4, 3)
    assert dict(c.counts) == {"all_reduce": 1, "all_gather": 1, "dcp_all_gather": 1}


@pytest.mark.parametrize("tp", [1, 4])
def test_bench_tokens_embed_on_the_solo_rank(tp):
    """SoloRankComm's all-reduce is the identity: the bench draws its tokens from rank 0's
    vocab rows, so each token's embedding is its real row, not zeros (with zeros every hidden
    state was token-independent and every token routed to the same experts)."""
    cfg = load_config("tiny")
    par = Parallel(0, tp)
    model = step.init_on_device_(K3ForCausalLM(cfg, par, step.SoloRankComm(par),
                                               torch.float32), 0)
    bench = step.Bench(model, "cpu", 16, 8, ("specialized",))
    slots = bench.start(16)
    toks = bench.plan(slots, "specialized").tokens
    assert max(toks) < cfg.vocab_size // tp and len(set(toks)) > 1
    emb = model.model.embed_tokens(torch.tensor(toks))
    assert bool((emb.abs().sum(-1) > 0).all())
    # rows of distinct tokens differ: the hidden states are token-dependent from the start
    assert float((emb - emb[:1]).abs().sum(-1).max()) > 0


def test_init_on_device_scales():
    cfg = load_config("tiny")
    par = Parallel(1, 2)
    m = step.init_on_device_(K3ForCausalLM(cfg, par, step.SoloRankComm(par), torch.bfloat16),
                             seed=3)
    rms = math.sqrt(sum(v * v for v in E2M1_VALUES) / len(E2M1_VALUES))
    checked = 0
    for name, p in m.named_parameters():
        if name.endswith("w2_scale"):
            # fan-in is the FULL K (32 · full groups), not this rank's slice
            want = SCALE_BIAS + round(math.log2(1 / (rms * math.sqrt(32 * p.full_shape[-1]))))
            vals = set(p.unique().tolist())
            assert vals <= {want - 1, want} and len(vals) == 2, (name, vals, want)
            checked += 1
        elif p.dtype == torch.bfloat16 and p.dim() == 2 and "embed" not in name:
            assert 0.3 < float(p.float().std()) * math.sqrt(p.full_shape[-1]) < 3, name
    assert checked == sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
