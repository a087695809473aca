"""The layer benchmark on CPU (every kernels/ op falls back to its PyTorch reference): its
graph-shaped specialized step and its stock step of the model's K3DecoderLayer against the
layer's plain stock forward, the folded residual, the byte accounting of the packed weights and
its flags. The same check runs with the real kernels in tests/gpu/test_layer_bench.py."""
from __future__ import annotations

import pytest
import torch

from raydecode.scripts.bench.layer_check import TOL, _clone, check_layer, small_config
from raydecode.scripts.bench.layer_step import LayerCopy

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


def _copy(kind: str, T: int, seed: int = 3, tp: int = 1) -> LayerCopy:
    cfg = small_config()
    idx = next(i for i in range(cfg.num_layers) if cfg.layer_kinds[i] == kind
               and cfg.is_moe_layer(i) and i % cfg.attn_res_block_size)
    return LayerCopy(cfg, idx, tp, T, 32, seed, "cpu")


@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_folded_residual_equals_the_explicit_add(kind):
    """Folding the previous layer's FFN output into the first AttnRes op gives the same layer
    as adding it to the prefix first and running the unfolded step."""
    T = 2
    a = _copy(kind, T)
    a.pending.normal_(0, 0.3)
    b = _clone(a)
    n = a.bank.shape[1] - 1
    ids = {}
    from raydecode.models import moe as moe_mod
    real = moe_mod.route_topk
    for name, c, fold in (("a", a, True), ("b", b, False)):
        if not fold:
            c.bank[:, n] += c.pending                # bf16 add, as the kernel rounds it
        moe_mod.route_topk = lambda *x, _n=name, **k: ids.setdefault(_n, real(*x, **k))
        try:
            with torch.inference_mode():
                c.step(T, "specialized", fold=fold)
        finally:
            moe_mod.route_topk = real
    assert torch.equal(a.output(), b.output())
    assert torch.equal(ids["a"][1], ids["b"][1])


@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_fused_weights_are_counted_once(kind):
    """The specialized step's weight bytes: its packed GEMV buffers (the model's derived
    weights) hold the parameters moved into them once, with zero K padding; at TP 1 the bytes
    are the stock ones up to that padding and the folded copies (W_q'', W_uv), and within 10 %
    of the traffic model's (models/params.py) at TP 1 and 2; at TP 2 the replicated weights
    count 1/TP."""
    from raydecode.scripts.bench.layer_report import predicted_bytes
    c = _copy(kind, 1)
    with torch.inference_mode():
        c.step(1, "specialized")
    moe = c.layer.block_sparse_moe
    w = c.cfg.moe
    h2, ffn = moe._derived.peek("h2_proj"), moe._derived.peek("ffn_out")
    assert h2.shape[0] == w.num_experts + w.latent_size + 2 * w.shared_intermediate
    k = w.latent_size + moe.shared_experts.down_proj.weight.shape[1]
    assert ffn.shape[1] >= k and ffn.shape[1] % 128 == 0
    assert torch.count_nonzero(ffn[:, k:]) == 0            # K padding is zeros
    assert moe.shared_experts.gate_proj.weight.data_ptr() == h2[w.num_experts +
                                                               w.latent_size].data_ptr()
    stock, spec = c.weight_bytes("stock"), c.weight_bytes("specialized")
    assert 0.9 * stock <= spec <= 1.1 * stock     # at TP 1 nothing is sharded: ± pad / folds
    for tp in (1, 2):
        ct = c if tp == 1 else _copy(kind, 1, tp=tp)
        with torch.inference_mode():
            ct.step(1, "specialized")
        for v in ("stock", "specialized"):
            pb = predicted_bytes(ct.cfg, tp, kind, 1, v, 32)
            want = pb["weights"] - pb["pieces"]["moe.experts_gate_up"] \
                - pb["pieces"]["moe.experts_down"]
            assert abs(ct.weight_bytes(v) - want) <= 0.1 * want, (tp, v, ct.weight_bytes(v), want)
        if tp == 2:
            assert ct.weight_bytes("specialized") < ct.weight_bytes("stock")


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
