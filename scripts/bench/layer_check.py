"""The layer benchmark's steps (scripts/bench/layer_step.py: the model's K3DecoderLayer driven
as the benchmark times it) against the same layer's plain stock forward, TP = 1.

On a small config of the K3 architecture (`small_config`), on one device: random bf16 weights
and MXFP4 experts, random caches and AttnRes bank; ONE decode step of B sequences through the
layer's stock forward (the Python reference, host syncs and all) and through the benchmark's
two variants on their own copies of the state: stock (the same path, through the benchmark's
driver) and specialized (graph-shaped: the paging and slots from device tensors, the fused
kernels of the decode plan). Compared:
  h        the attention input (AttnRes mix + input RMSNorm)
  attn     the attention sublayer output
  moe      the FFN half on the SAME input (the reference's h2) on the variant's path
  layer    the layer's prefix update (output − prefix in), tokens whose top-k routing
           differs between the two runs (bf16-level input differences near a score tie) left
           out and counted
  state    KDA recurrent state and conv tail, or the MLA row the step stored
Errors are ‖a − b‖ / ‖b‖ (fp64). `check_layer` returns them with the tolerances it applied.
"""
from __future__ import annotations

import torch

from raydecode.models.config import K3Config, load_config, parse_hf_config
from raydecode.models.moe import route

from .layer_step import LayerCopy

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


def _clone(c: LayerCopy) -> LayerCopy:
    """The same layer (weights shared) on a fresh copy of c's caches and state."""
    import copy
    d = copy.copy(c)
    d.bank, d.pending = c.bank.clone(), c.pending.clone()
    d.separate = None if c.separate is None else [b.clone() for b in c.separate]
    kda, mla = c.caches.kda, c.caches.mla
    caches = copy.copy(c.caches)
    if kda is not None:
        caches.kda = copy.copy(kda)
        caches.kda.conv, caches.kda.rec = kda.conv.clone(), kda.rec.clone()
    if mla is not None:
        caches.mla = copy.copy(mla)
        caches.mla.pool = mla.pool.clone()
    d.caches = caches
    return d


def _state(c: LayerCopy, T: int) -> list[torch.Tensor]:
    if c.kind == "kda":
        return [c.caches.kda.rec[0, :T], c.caches.kda.conv[0, :T]]
    pool = c.caches.mla.pool[0].view(c.B, c.pages * c.block, -1)
    return [pool[:T, c.context]]


def _traced_step(c: LayerCopy, T: int, path: str) -> dict:
    """c.step with the attention input / output and the FFN input recorded."""
    seen, layer = {}, c.layer
    ffn = layer.block_sparse_moe if layer.is_moe else layer.mlp
    hooks = [layer.self_attn.register_forward_pre_hook(lambda m, a: seen.__setitem__("h", a[0])),
             layer.self_attn.register_forward_hook(lambda m, a, o: seen.__setitem__("attn", o)),
             ffn.register_forward_pre_hook(lambda m, a: seen.__setitem__("h2", a[0]))]
    try:
        c.step(T, path, fold=False)
    finally:
        for hk in hooks:
            hk.remove()
    return seen


@torch.no_grad()
def check_layer(kind: str, batch: int = 4, context: int = 32, seed: int = 0, device="cuda",
                cfg: K3Config | None = None) -> dict:
    """Compare the benchmark's stock and specialized steps with the layer's plain stock forward
    on one decode step. -> {'errors': {...}, 'tol': TOL, 'routing_flips': n, 'ok': bool}"""
    cfg = cfg or small_config()
    idx = next(i for i in range(cfg.num_layers) if cfg.layer_kinds[i] == kind
               and cfg.is_moe_layer(i) and i % cfg.attn_res_block_size)
    T = batch
    base = LayerCopy(cfg, idx, 1, T, context, seed, device)
    n = base.bank.shape[1] - 1
    prefix_in = base.bank[:T, n].float()
    moe, mc = base.layer.block_sparse_moe, cfg.moe

    def routing(h2):
        return route(moe.gate(h2), moe.gate.e_score_correction_bias, mc.top_k,
                     mc.num_expert_group, mc.topk_group, mc.renormalize,
                     mc.routed_scaling_factor)[1]

    ref = _clone(base)
    seen_ref = _traced_step(ref, T, "stock")
    ids_ref = routing(seen_ref["h2"]).sort(-1).values
    delta_ref = ref.output().float() - prefix_in
    err, flips, deltas = {}, {}, {}
    for variant in ("stock", "specialized"):
        c = _clone(base)
        seen = _traced_step(c, T, variant)
        same = (routing(seen["h2"]).sort(-1).values == ids_ref).all(-1)           # (T,)
        flips[variant] = int((~same).sum())
        delta = c.output().float() - prefix_in
        deltas[variant] = (delta, same)
        e = {"h": _rel(seen["h"], seen_ref["h"]), "attn": _rel(seen["attn"], seen_ref["attn"]),
             "moe": _rel(moe(seen_ref["h2"], variant), moe(seen_ref["h2"], "stock")),
             "layer": _rel(delta[same], delta_ref[same]) if same.any() else float("inf"),
             "state": max(_rel(a, b) for a, b in zip(_state(c, T), _state(ref, T)))}
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
