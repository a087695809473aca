"""The decode plan (models/decode_plan.py): one place that says which kernel serves each piece
of a specialized step per bucket; the step launches what the plan lists, the options change it
where they should, and the node cache compiles exactly its CuTe kernels."""
from __future__ import annotations

import pytest
import torch

from raydecode.engine import step_graph
from raydecode.kernels import aot
from raydecode.kernels import moe_decode as MD
from raydecode.kernels.settings import DEFAULT_OPTIONS, DecodeOptions
from raydecode.models import mla
from raydecode.models import specialized as spec
from raydecode.models.cache import SeqSlice, StepBatch
from raydecode.models.config import load_config
from raydecode.models.decode_plan import BUCKETS, resolve_plan
from raydecode.models.k3 import K3ForCausalLM, init_random_, make_caches

torch.set_num_threads(1)
BF = torch.bfloat16


def test_buckets_are_the_step_graph_buckets():
    assert BUCKETS == step_graph.BUCKETS


def test_k3_tp16_plan_lists_the_served_kernels():
    """The served choices per bucket at K3 TP16 on a 132-SM GPU (docs/PERF.md reference)."""
    plan = resolve_plan(load_config("k3"), 16, sm_count=132)
    assert plan.buckets == BUCKETS
    assert [plan.step(T).moe.kernel for T in BUCKETS] == \
        ["resident", "cuda_core", "cuda_core", "cuda_core", "cuda_core", "grouped", "grouped"]
    assert [plan.step(T).gemv("o_proj").kernel for T in BUCKETS] == \
        ["cute", "cute", "skinny", "skinny", "skinny", "cublas", "cublas"]
    assert plan.step(2).gemv("lm_head").kernel == "cublas"          # M = 2, 147 MB: cuBLAS
    assert plan.step(1).gemv("h2_proj").out_dtype == "fp32"
    f1, f2 = plan.step(1).fusions, plan.step(2).fusions
    assert f1.moe_block and f1.ffn_out_prologue and not f2.ffn_out_prologue
    assert f1.mla == "absorbed" and f1.attnres_bank and f1.attnres_kernel == "cute"
    assert plan.step(3) is plan.step(4)                              # padded to its bucket
    with pytest.raises(ValueError, match="65 tokens: above the plan's largest bucket 64"):
        plan.step(65)
    assert any("resident" in ln for ln in plan.describe())


def test_options_change_the_plan_where_they_should():
    cfg = load_config("k3")
    base = resolve_plan(cfg, 16, sm_count=132)
    off = resolve_plan(cfg, 16, DecodeOptions(moe_fused=False, skinny_max_m=0,
                                              mla_absorbed_q=False, moe_kernel="cuda_core",
                                              moe_max_pairs=512, attnres_bank=False),
                       sm_count=132)
    assert not off.step(1).fusions.moe_block and not off.step(1).fusions.ffn_out_prologue
    assert off.step(8).gemv("o_proj").kernel == "cublas" != base.step(8).gemv("o_proj").kernel
    assert off.step(1).fusions.mla == "folded"
    assert off.step(1).moe.kernel == "cuda_core" and off.step(32).moe.kernel == "cuda_core"
    assert not off.step(1).fusions.attnres_bank
    assert resolve_plan(cfg, 16, dcp=2).step(1).fusions.mla == "dcp"
    # no SM count: the resident kernel is wanted but unplanned, the CUDA-core kernel serves
    m = resolve_plan(cfg, 16).step(1).moe
    assert (m.kernel, m.wanted) == ("cuda_core", "resident") and "SM count" in m.why
    # the stock path launches no kernels/ GEMV and no fused block; its bf16 decode batches
    # the skinny GEMM (one launch: no cuBLAS split-K reduce), cuBLAS past STOCK_SKINNY_MAX_M
    stock = resolve_plan(cfg, 16, path="stock", sm_count=132)
    assert {g.kernel for g in stock.step(1).gemvs} == {"skinny"}
    assert {g.kernel for g in stock.step(16).gemvs} == {"skinny"}
    assert {g.kernel for g in stock.step(32).gemvs} == {"cublas"}
    assert {g.kernel for g in resolve_plan(cfg, 16, path="stock", dtype="float32"
                                           ).step(1).gemvs} == {"cublas"}
    assert stock.step(1).moe.kernel == "grouped" and not stock.step(1).fusions.moe_block


def test_node_cache_compiles_exactly_the_plans_cute_kernels():
    cfg = load_config("k3")
    plan = resolve_plan(cfg, 16, buckets=(1, 2), sm_count=132)
    kp = aot.kernel_plan(plan, "sm_90a")
    want = {(g.M, g.N, g.K, g.out_dtype) for s in plan.steps for g in s.gemvs
            if g.kernel == "cute"}
    assert {(g.M, g.N, g.K, {torch.bfloat16: "bf16", torch.float32: "fp32"}[g.out_dtype])
            for g in kp.gemvs} == want
    assert [m.plan for m in kp.moe] == [plan.step(1).moe.config]
    assert [(f.M, f.N, f.K) for f in kp.fused] == [plan.step(1).ffn_out[:3]]
    assert aot.plan_kernels(cfg, 16, (1, 2), sm_count=132).gemvs == kp.gemvs
    # the options a replica runs reach the compile list
    off = aot.plan_kernels(cfg, 16, (1, 2), sm_count=132,
                           options=DecodeOptions(moe_fused=False, moe_kernel="cuda_core"))
    assert off.fused == () and off.moe == ()
    assert "latent_norm_situ" not in {t.name for t in off.triton}


def _record(monkeypatch):
    gemvs, moes = [], []
    real_lin, real_moe = spec._gemv_linear, MD.routed_moe

    def linear(x, w, out_dtype=None, **kw):
        gemvs.append((x.numel() // x.shape[-1], w.shape[0], w.shape[1],
                      "fp32" if (out_dtype or x.dtype) == torch.float32 else "bf16"))
        return real_lin(x, w, out_dtype, **kw)

    def routed(z, weights, ids, experts, path="stock", options=DEFAULT_OPTIONS, out=None):
        moes.append((z.shape[0], ids.shape[1], path, options))
        return real_moe(z, weights, ids, experts, path, options, out=out)

    from raydecode.models import moe as moe_mod
    monkeypatch.setattr(spec, "_gemv_linear", linear)
    monkeypatch.setattr(moe_mod, "routed_moe", routed)
    return gemvs, moes


@pytest.mark.parametrize("options", [DEFAULT_OPTIONS,
                                     DecodeOptions(moe_fused=False, mla_absorbed_q=False,
                                                   attnres_bank=False)],
                         ids=["served", "unfused"])
def test_a_specialized_step_launches_what_its_bucket_plan_lists(monkeypatch, options):
    """Tiny model, TP 1, a decode step of 2 sequences on CPU: every kernels/ GEMV it calls is
    a plan entry of its bucket with the same out dtype and a kernel the plan names; its MoE
    calls carry the options the plan was resolved with; the fused block and the MLA form
    ran as the bucket's fusions say."""
    cfg = load_config("tiny")
    model = init_random_(K3ForCausalLM(cfg, dtype=BF, options=options), seed=5)
    plan = model.decode_plan
    assert plan.options is options and plan.buckets == BUCKETS
    caches = make_caches(cfg, model.par, 3, 8, 4, BF)
    caches.mla.block_tables.update({0: [3, 1], 1: [5]})
    toks = torch.randint(0, cfg.vocab_size, (6,), generator=torch.Generator().manual_seed(5))
    ran = {"mla_decode_absorbed": 0, "mla_decode_fused": 0}
    for name in ran:
        real = getattr(mla, name)
        monkeypatch.setattr(mla, name, lambda *a, _n=name, _r=real, **k:
                            ran.__setitem__(_n, ran[_n] + 1) or _r(*a, **k))
    with torch.inference_mode():
        model(toks[:4], StepBatch([SeqSlice(0, 0, 3, 0), SeqSlice(1, 3, 1, 0)]), caches,
              "specialized")
        gemvs, moes = _record(monkeypatch)
        model(toks[4:], StepBatch.decode([0, 1], [3, 1]), caches, "specialized")
    step = plan.step(2)
    planned = {(g.M, g.N, g.K, g.out_dtype) for g in step.gemvs}
    assert gemvs and not set(gemvs) - planned, set(gemvs) - planned
    assert moes and all(m == (2, cfg.moe.top_k, "specialized", options) for m in moes)
    blocks = [layer.block_sparse_moe for layer in model.model.layers if layer.is_moe]
    assert all(("h2_proj" in b._derived._memo) == step.fusions.moe_block for b in blocks)
    want = {"absorbed": "mla_decode_absorbed", "folded": "mla_decode_fused"}[step.fusions.mla]
    assert ran[want] == len(cfg.mla_layers) and sum(ran.values()) == ran[want]
