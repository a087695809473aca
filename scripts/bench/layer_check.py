"""The benchmark's decode step against the model's own `K3DecoderLayer` (TP = 1 semantics).

On a small config of the K3 architecture (`small_config`), on one device: build the model
layer in bf16 with random weights and MXFP4-representable experts, fill its caches and an
AttnRes bank with random values, run ONE decode step of B sequences through
`K3DecoderLayer.forward` (the Python reference, host syncs and all) and through the
benchmark's steps (`make_step`: stock and specialized) over the same parameters and the same state,
and compare:
  h        the attention input (AttnRes mix + input RMSNorm)
  attn     the attention sublayer output
  moe      the FFN half on the SAME input (the model's `block_sparse_moe(h2)` vs `moe(h2)`)
  layer    the layer's prefix update (prefix_out − prefix_in), tokens whose top-k routing
           differs between the two runs (bf16-level input differences near a score tie) left
           out and counted
  state    KDA recurrent state and conv tail, or the MLA row written to the cache
Errors are ‖a − b‖ / ‖b‖ (fp64). `check_layer` returns them with the tolerances it applied.
"""
from __future__ import annotations

import torch

from raydecode.models.attnres import AttnResStream
from raydecode.models.cache import KDAStateCache, MLALatentCache, ModelCaches, StepBatch
from raydecode.models.config import K3Config, load_config, parse_hf_config
from raydecode.models.k3 import K3DecoderLayer
from raydecode.models.moe import route
from raydecode.models.parallel import LocalComm, Parallel

from .layer_step_spec import make_step
from .layer_weights import BF16, LayerState, LayerWeights, ParamSpec, init_value, random_experts

TOL = {"h": 1e-2, "attn": 2e-2, "moe": 2e-2, "layer": 3e-2, "state": 1e-2,
       "specialized_vs_stock": 2e-2}
MAX_FLIP_FRACTION = 0.25


def small_config() -> K3Config:
    """The `tiny` preset widened so every kernel tiles it (MXFP4 groups, tl.dot ≥ 16):
    H 256, 32 experts top-4, latent 128, expert intermediate 128, KDA 4×32, MLA 4 heads."""
    d = load_config("tiny").to_hf_dict()
    t = d["text_config"]
    t.update(hidden_size=256, intermediate_size=256, q_lora_rank=64, kv_lora_rank=64,
             qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_experts=32,
             num_experts_per_token=4, moe_intermediate_size=128,
             routed_expert_hidden_size=128)
    t["linear_attn_config"].update(num_heads=4, head_dim=32)
    return parse_hf_config(d, name="bench-small")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _model_layer(cfg: K3Config, idx: int, seed: int, device):
    with torch.device(device):
        layer = K3DecoderLayer(cfg, idx, Parallel(), LocalComm(), BF16)
    gen = torch.Generator(device=device).manual_seed(seed)
    params = {}
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if ".experts." in name:
                continue
            p.copy_(init_value(name, ParamSpec(tuple(p.shape), p.full_shape, p.dtype), cfg,
                               gen, device))
            params[name] = p.detach()
        experts = random_experts(cfg, Parallel(), seed + 1, device).validate()
        layer.block_sparse_moe.experts.copy_experts_(experts)
    return layer, params, experts


def _model_caches(cfg: K3Config, idx: int, S: LayerState, T: int, context: int, block: int):
    kind = cfg.layer_kinds[idx]
    if kind == "kda":
        hl, d = S.kda_rec.shape[1], S.kda_rec.shape[2]
        kda = KDAStateCache(1, T, hl, d, cfg.kda.conv_size, BF16, S.kda_rec.device)
        kda.conv[0].copy_(S.kda_conv[:T])
        kda.rec[0].copy_(S.kda_rec[:T])
        return ModelCaches(mla=None, kda=kda, kda_index={idx: 0})
    nb = context // block
    mla = MLALatentCache(1, T * nb, block, cfg.mla.latent_dim, BF16, S.mla_cache.device)
    mla.pool[0].view(T, context, -1).copy_(S.mla_cache[:T])
    for s in range(T):
        mla.block_tables[s] = list(range(s * nb, (s + 1) * nb))
    return ModelCaches(mla=mla, kda=None, mla_index={idx: 0})


def _clone_state(S: LayerState) -> LayerState:
    return LayerState(**{k: (v.clone() if isinstance(v, torch.Tensor) else v)
                         for k, v in S.__dict__.items()})


@torch.no_grad()
def check_layer(kind: str, batch: int = 4, context: int = 32, seed: int = 0, device="cuda",
                linear=None, cfg: K3Config | None = None) -> dict:
    """Compare the benchmark step (stock and specialized, `linear` for the latter) with the
    model's layer on one decode step. -> {'errors': {...}, 'tol': TOL, 'flips': n, 'ok': bool}"""
    cfg = cfg or small_config()
    idx = next(i for i in range(cfg.num_layers) if cfg.layer_kinds[i] == kind
               and cfg.is_moe_layer(i) and i % cfg.attn_res_block_size)
    T = batch
    layer, params, experts = _model_layer(cfg, idx, seed, device)
    W = LayerWeights.build(cfg, idx, Parallel(), params, experts)
    S0 = LayerState.random(W, idx, T, context, seed + 2, device)

    # ---- the model -------------------------------------------------------------------------
    caches = _model_caches(cfg, idx, S0, T, context, block=16 if context % 16 == 0 else 1)
    n = S0.bank_in.shape[1] - 1
    bank = AttnResStream(S0.bank_in[:, n].clone())
    bank.blocks = [S0.bank_in[:, j].clone() for j in range(n)]
    seen = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
                 lambda m, a: seen.__setitem__("h", a[0])),
             layer.self_attn.register_forward_hook(
                 lambda m, a, o: seen.__setitem__("attn", o)),
             layer.block_sparse_moe.register_forward_pre_hook(
                 lambda m, a: seen.__setitem__("h2", a[0]))]
    layer(bank, StepBatch.decode(list(range(T)), [context - 1] * T), caches)
    for hk in hooks:
        hk.remove()
    moe = layer.block_sparse_moe
    mc = cfg.moe
    _, ids_model = route(moe.gate(seen["h2"]), moe.gate.e_score_correction_bias, mc.top_k,
                         mc.num_expert_group, mc.topk_group, mc.renormalize,
                         mc.routed_scaling_factor)
    delta_model = bank.prefix.float() - S0.bank_in[:, n].float()

    # ---- the benchmark step -----------------------------------------------------------------
    err, flips, deltas = {}, {}, {}
    for variant in ("stock", "specialized"):
        S = _clone_state(S0)
        S.ffn_prev.zero_()      # the folded residual of a previous layer: none here
        step = make_step(W, S, variant, T, linear if variant == "specialized" else None)
        step.trace = {}
        step.step()
        if hasattr(step, "finish"):
            step.finish()
        tr = step.trace
        same = (S.last_ids.sort(-1).values == ids_model.sort(-1).values).all(-1)    # (T,)
        flips[variant] = int((~same).sum())
        delta = S.prefix_out[:T].float() - S0.bank_in[:, n].float()
        deltas[variant] = (delta, same)
        e = {"h": _rel(tr["h"], seen["h"]), "attn": _rel(tr["attn"], seen["attn"]),
             "moe": _rel(step.moe(tr["h2"]), moe(tr["h2"])),
             "layer": _rel(delta[same], delta_model[same]) if same.any() else float("inf")}
        if kind == "kda":
            e["state"] = max(_rel(S.kda_rec[:T], caches.kda.rec[0]),
                             _rel(S.kda_conv[:T], caches.kda.conv[0]))
        else:
            e["state"] = _rel(S.mla_cache[:T, -1],
                              caches.mla.pool[0].view(T, context, -1)[:, -1])
        err[variant] = e
    (ds, ss), (dp, sp) = deltas["stock"], deltas["specialized"]
    both = ss & sp
    err["specialized_vs_stock"] = _rel(dp[both], ds[both]) if both.any() else float("inf")
    ok = all(v <= TOL[k] for var in ("stock", "specialized") for k, v in err[var].items())
    ok = ok and err["specialized_vs_stock"] <= TOL["specialized_vs_stock"]
    ok = ok and max(flips.values()) <= MAX_FLIP_FRACTION * T
    return {"kind": kind, "layer_idx": idx, "config": cfg.name, "batch": T, "context": context,
            "errors": err, "tol": TOL, "routing_flips": flips, "ok": bool(ok)}


__all__ = ["check_layer", "small_config", "TOL"]
