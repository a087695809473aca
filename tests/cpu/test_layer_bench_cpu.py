"""The layer benchmark's steps on CPU (every kernels/ op falls back to its PyTorch reference):
the round-3 specialized step (fused GEMV weights, KDA / MLA decode ops, the folded residual)
against the model's K3DecoderLayer and the stock step, and the byte accounting of the fused
weights. The same check runs with the real kernels in tests/gpu/test_layer_bench.py."""
from __future__ import annotations

import pytest
import torch

from raydecode.models.parallel import Parallel
from raydecode.scripts.bench.layer_check import TOL, _model_layer, check_layer, small_config
from raydecode.scripts.bench.layer_step_spec import make_step
from raydecode.scripts.bench.layer_weights import LayerState, LayerWeights

torch.set_num_threads(1)


@pytest.mark.parametrize("kind", ["kda", "mla"])
@pytest.mark.parametrize("batch", [1, 3])
def test_specialized_step_matches_model_and_stock(kind, batch):
    r = check_layer(kind, batch=batch, context=32, seed=7 + batch, device="cpu")
    msg = f"{r['errors']} flips {r['routing_flips']}"
    for variant in ("stock", "specialized"):
        for what, err in r["errors"][variant].items():
            assert err <= TOL[what], f"{variant} {what}: {msg}"
    assert r["errors"]["specialized_vs_stock"] <= TOL["specialized_vs_stock"], msg
    assert r["ok"], msg


def _layer(kind: str, T: int, seed: int = 3):
    cfg = small_config()
    idx = next(i for i in range(cfg.num_layers) if cfg.layer_kinds[i] == kind
               and cfg.is_moe_layer(i) and i % cfg.attn_res_block_size)
    _, params, experts = _model_layer(cfg, idx, seed, "cpu")
    W = LayerWeights.build(cfg, idx, Parallel(), params, experts)
    return W, LayerState.random(W, idx, T, 32, seed + 1, "cpu")


def _clone(S: LayerState) -> LayerState:
    return LayerState(**{k: v.clone() if isinstance(v, torch.Tensor) else v
                         for k, v in S.__dict__.items()})


@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_folded_residual_equals_the_explicit_add(kind):
    """Folding the previous layer's FFN output into the first AttnRes op gives the same layer
    as adding it to the prefix first and running the unfolded step."""
    T = 2
    W, S = _layer(kind, T)
    S.ffn_prev.normal_(0, 0.3)
    a, b = _clone(S), _clone(S)
    n = S.bank_in.shape[1] - 1
    folded = make_step(W, a, "specialized", T)
    folded.step()
    folded.finish()
    b.bank_in[:, n] += b.ffn_prev                       # bf16 add, as the kernel rounds it
    make_step(W, b, "specialized", T, fold_residual=False).step()
    assert torch.equal(a.prefix_out, b.prefix_out)
    assert torch.equal(a.last_ids, b.last_ids)


def test_fused_weights_are_counted_once():
    for kind in ("kda", "mla"):
        W, _ = _layer(kind, 1)
        spec = W.read_by("specialized")
        assert not set(W.spec_drops) & set(spec), kind       # fused copies replace them
        h2 = W.spec["h2_proj_local"]
        assert h2.shape[0] == (W.widths["router_local"] + W.widths["latent_local"]
                               + W.t["shared_gate_up"].shape[0])
        ffn = W.spec["ffn_out_local"]
        k = W.widths["latent_local"] + W.t["shared_down"].shape[1]
        assert ffn.shape[1] == W.widths["ffn_k"] >= k and ffn.shape[1] % 128 == 0
        assert torch.count_nonzero(ffn[:, k:]) == 0            # K padding is zeros
        stock, sp = W.weight_bytes("stock"), W.weight_bytes("specialized")
        pad = ffn[:, k:].numel() * 2
        folded = 0
        if kind == "mla":   # the q_a norm weight and W_uk live in q_b_absorbed (the default
            # path r16): h·(c + rope) rows in place of q_b's h·(nope + rope), W_uk not read
            qn, wuk, qb = W.t["q_a_norm"], W.t["w_uk"], W.t["q_b"]
            m = W.cfg.mla
            assert "q_b_folded" not in W.spec
            assert W.spec["q_b_absorbed"].shape == (W.widths["heads"] * m.latent_dim,
                                                    qb.shape[1])
            folded = (qn.numel() * qn.element_size() + wuk.numel() * wuk.element_size()
                      + qb.numel() * 2 - W.spec["q_b_absorbed"].numel() * 2)
        # at TP = 1 sharding saves nothing: spec = stock + the ffn K padding exactly
        assert sp == stock + pad - folded, (kind, stock, sp, pad, folded)


@pytest.mark.parametrize("flag,arg,why", [
    ("--decode-config", "x", "not enough values"),
    ("--decode-config", '896,192={}', "2 numbers"),
    ("--decode-config", '896,192,3584={"nope": 1}', "nope"),
    ("--decode-config", '896,192,3584={"gate_up_bn": 7}', "gate_up BN 7"),
    ("--decode-config", '896,192,3584={"f16x2": true}', "f16x2 needs words=True")])
def test_bad_moe_config_is_refused_by_name(flag, arg, why, capsys):
    """--decode-config is validated at the edge (before any GPU work): the message names the
    argument and the reason; the TUNED table is left untouched."""
    from raydecode.kernels import moe_mxfp4_decode as MD
    from raydecode.scripts.bench import layer
    before = dict(MD.TUNED)
    with pytest.raises(SystemExit):
        layer.main(["--out", "unused.json", flag, arg])
    err = capsys.readouterr().err
    assert f"{flag} {arg!r}" in err and why in err
    assert MD.TUNED == before


def test_decode_config_sets_the_shape_before_the_run(monkeypatch):
    """A valid --decode-config lands in the run's decode options before `run` (here
    replaced: the benchmark itself needs a GPU), so the timing uses it."""
    import dataclasses
    import json

    from raydecode.kernels import moe_mxfp4_decode as MD
    from raydecode.scripts.bench import layer
    want = MD.DecodeConfig(8, 16, 4, 64, 2, 2, gate_up_ks=7, down_unroll=True, words=True)
    seen = {}

    class Stop(Exception):
        pass

    def fake_run(args):
        seen["cfg"] = dict(args.options.moe_decode_configs)[(896, 192, 3584)]
        raise Stop

    monkeypatch.setattr(layer, "DEVICE", "cpu")
    monkeypatch.setattr(layer, "run", fake_run)
    with pytest.raises(Stop):
        layer.main(["--out", "unused.json", "--decode-config",
                    "896,192,3584=" + json.dumps(dataclasses.asdict(want))])
    assert seen["cfg"] == want


def test_decode_candidates_prior_first_then_fastest_distinct():
    """The in-layer confirmation's candidates: the TUNED config from before the sweep, then
    the sweep's fastest decode configs at this TP and batch 1; error rows, other TPs / batches
    and the stock kernel are skipped, a config the prior already is counts once."""
    import dataclasses

    from raydecode.kernels.moe_mxfp4_decode import DecodeConfig
    from raydecode.scripts.bench.layer import decode_candidates

    prior = DecodeConfig(8, 16, 4, 64, 2, 2, gate_up_ks=7, words=True)
    fast = dataclasses.replace(prior, f16x2=True, gate_up_bn=16, gate_up_gb=8, gate_up_ks=14)
    mid = dataclasses.replace(prior, down_warps=4)

    def row(c, us, **kw):
        return {"tp": 16, "batch": 1, "kernel": "decode", "config": dataclasses.asdict(c),
                "us": us, **kw}

    rows = [row(mid, 16.0), row(prior, 17.5), {"tp": 16, "batch": 1, "kernel": "decode",
            "config": dataclasses.asdict(mid), "error": "x"}, row(fast, 15.3),
            {**row(fast, 1.0), "tp": 8}, {**row(mid, 1.0), "batch": 4},
            {"tp": 16, "batch": 1, "kernel": "stock", "config": {}, "us": 0.5}]
    assert decode_candidates(prior, rows, 16, 2) == [prior, fast, mid]
    assert decode_candidates(prior, rows, 16, 1) == [prior, fast]
    assert decode_candidates(None, rows, 16, 2) == [fast, mid]
    assert decode_candidates(fast, rows, 16, 2) == [fast, mid, prior]


@pytest.mark.parametrize("kind", ["kda", "mla"])
@pytest.mark.parametrize("mode", ["mid", "all", "next"])
def test_l2_prefetch_plan_covers_the_next_gemvs_and_changes_nothing(kind, mode, monkeypatch):
    """RAYDECODE_BENCH_L2PF: each fork point's table requests exactly the weights of the GEMVs
    that follow it (the first GEMVs within the start budget), and the step's results equal the
    step without prefetch (on CPU the launches are no-ops; on the GPU they are cache hints)."""
    from raydecode.kernels.experimental.l2_prefetch import prefetch_ranges, table_bytes
    from raydecode.scripts.bench import layer_step_spec as LS

    T = 1
    W, S = _layer(kind, T)
    a, b = _clone(S), _clone(S)
    monkeypatch.setattr(LS, "MLA_PATH", "r16")
    plain = make_step(W, a, "specialized", T)
    plain.step()
    monkeypatch.setattr(LS, "L2PF", mode)
    t, sp = W.t, W.spec
    attn = ([t["kda_o_proj"], sp["h2_proj_local"]] if kind == "kda"
            else [t["o_proj"], sp["h2_proj_local"]])
    first = [t["kda_in_proj"]] if kind == "kda" else [sp["qkv_a_g_local"], sp["q_b_absorbed"]]

    def nbytes(ts):
        return sum(hi - lo for lo, hi in prefetch_ranges(ts))

    monkeypatch.setattr(LS, "L2PF_START_MIB", 0)           # the budget caps the first GEMVs
    assert table_bytes(make_step(W, _clone(S), "specialized", T).first_table) == 0
    monkeypatch.setattr(LS, "L2PF_START_MIB", 1)           # the tiny model's GEMVs < 1 MiB
    step, nxt = make_step(W, b, "specialized", T), make_step(W, _clone(S), "specialized", T)
    assert table_bytes(step.pf["attn"]) == nbytes(attn)
    assert table_bytes(step.first_table) == nbytes(first)
    assert ("start" in step.pf) == (mode == "all")
    step.link_next(nxt)
    want_moe = nbytes([sp["ffn_out_local"]]) + (nbytes(first) if mode == "next" else 0)
    assert table_bytes(step.pf["moe"]) == want_moe
    step.step()
    assert plain.out is not None and step.out is not None
    for x, y in zip(plain.out, step.out):
        assert torch.equal(x, y)
    assert torch.equal(a.last_ids, b.last_ids)
