"""The ahead-of-time kernel plan (kernels/aot.py `plan_kernels`, fed by models/params.py
`decode_gemv_shapes`) against what the specialized step really launches.

A GEMV the plan lacks is JIT-compiled by the first step that launches it, on every rank of the
replica, before (or during) CUDA-graph capture. So the tiny model runs real specialized steps
at M = 1 on CPU (TP 1) while every call of the specialized path's GEMV dispatch
(models/specialized.py `_gemv_linear`, which `linear_for("specialized")` and `sharded_gemv`
return / call: kernels/gemv.py `linear`) is recorded as (M, N, K, out dtype), then passed on.
Each call `linear` would send to CuTe must be a planned kernel of the same out dtype.
The packers' TP > 1 sizes (rank-dependent row pieces) are checked module by module."""
from __future__ import annotations

import pytest
import torch

from raydecode.kernels import aot
from raydecode.kernels.gemv import config_for
from raydecode.kernels.linear import linear_uses_cute
from raydecode.kernels.settings import DecodeOptions
from raydecode.models import moe
from raydecode.models import specialized as spec
from raydecode.models.cache import SeqSlice, StepBatch
from raydecode.models.config import load_config
from raydecode.models.k3 import K3ForCausalLM, init_random_, make_caches
from raydecode.models.kda import KDAAttention
from raydecode.models.mla import MLAAttention
from raydecode.models.params import decode_gemv_shapes
from raydecode.models.parallel import Parallel

torch.set_num_threads(1)
BF = torch.bfloat16


def _record(monkeypatch) -> list[tuple[int, int, int, torch.dtype]]:
    calls, real = [], spec._gemv_linear

    def recording_linear(x, w, out_dtype=None, **kw):
        calls.append((x.numel() // x.shape[-1], w.shape[0], w.shape[1], out_dtype or x.dtype))
        return real(x, w, out_dtype, **kw)

    monkeypatch.setattr(spec, "_gemv_linear", recording_linear)
    return calls


@pytest.mark.parametrize("fused", [True, False], ids=["moe_fused", "moe_unfused"])
@pytest.mark.parametrize("first_token", [False, True], ids=["decode", "first_token"])
def test_plan_covers_every_cute_gemv_of_a_specialized_step(monkeypatch, fused, first_token):
    """decode: a sequence at position 3 (the fused MLA / KDA decode, as graph capture runs it);
    first_token: a one-token sequence at position 0 (KDA outside its fused decode)."""
    cfg = load_config("tiny")
    model = init_random_(K3ForCausalLM(cfg, dtype=BF, options=DecodeOptions(moe_fused=fused)),
                         seed=5)
    caches = make_caches(cfg, model.par, 2, 8, 4, BF)
    caches.mla.block_tables[0] = [3, 1]
    toks = torch.randint(0, cfg.vocab_size, (4,), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        if not first_token:      # prefill 3 tokens: M = 3 GEMVs, not recorded
            model(toks[:3], StepBatch([SeqSlice(0, 0, 3, 0)]), caches, "specialized")
        calls = _record(monkeypatch)
        pos = 0 if first_token else 3
        model(toks[pos:pos + 1], StepBatch.decode([0], [pos]), caches, "specialized")

    plan = aot.plan_kernels(cfg, 1, (1,), "sm_90a")
    planned = {(g.M, g.N, g.K, g.out_dtype) for g in plan.gemvs}
    unmapped = {(m, n, k) for _, m, n, k, why in plan.skipped if why.startswith("no GEMV")}
    cute = {c for c in calls if linear_uses_cute(*c[:3])}
    assert cute and all(c[0] == 1 for c in cute)
    missing = []
    for M, N, K, out in sorted(cute, key=str):
        try:
            config_for(M, N, K)
        except ValueError:       # `linear` sends it to F.linear: nothing to compile
            assert (M, N, K) in unmapped
            continue
        if (M, N, K, out) not in planned:
            missing.append(f"M={M} N={N} K={K} out={out}")
    assert not missing, f"CuTe GEMVs the step launches and the plan lacks: {missing}"
    # the fused MoE block's fp32-out GEMV ran (and is what the fp32 entries cover), and the
    # MLA layers ran their fused decode: W_q'' (the folded q_b' with mla_absorbed_q off) with
    # fp32 out
    blocks = [layer.block_sparse_moe for layer in model.model.layers if layer.is_moe]
    assert all(("h2_proj" in b._derived._memo) == fused for b in blocks)
    sh = decode_gemv_shapes(cfg, 1, "specialized")
    assert ((1, *sh["h2_proj"], torch.float32) in cute) == fused
    assert (1, *sh["q_b_absorbed" if model.options.mla_absorbed_q else "q_b_folded"],
            torch.float32) in cute


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_packed_shapes_match_the_packers_on_every_rank(tp):
    """qkv_a_g, h2_proj, ffn_out and kda_in_proj as the layers pack them on each rank (the rows
    of [q_a; kv_a] a rank owns straddle the two weights on some ranks)."""
    cfg = load_config("tiny")
    shapes = decode_gemv_shapes(cfg, tp, "specialized")
    mla_i = cfg.mla_layers[0]
    kda_i = cfg.kda_layer_ids[0]
    moe_i = next(i for i in range(cfg.num_layers) if cfg.is_moe_layer(i))
    straddles = 0
    for r in range(tp):
        par = Parallel(r, tp)
        with torch.no_grad():
            mla = MLAAttention(cfg, mla_i, par, dtype=BF)
            kda = KDAAttention(cfg, kda_i, par, dtype=BF)
            blk = moe.LatentMoE(cfg, par, dtype=BF, layer_idx=moe_i)
            for m in (mla, kda, blk):
                for p in m.parameters():
                    p.zero_()
            assert tuple(mla._qkv_a_g().shape) == shapes["qkv_a_g"], (tp, r)
            assert tuple(kda._in_proj().shape) == shapes["kda_in_proj"], (tp, r)
            assert tuple(blk._h2_proj().shape) == shapes["h2_proj"], (tp, r)
            assert tuple(blk._ffn_out().shape) == shapes["ffn_out"], (tp, r)
            # the fused ffn_out kernel is planned for the weight and the h2 width the block has
            for f in aot.plan_kernels(cfg, tp, (1,), "sm_90a").fused:
                assert (f.N, f.K, f.gu_stride) == (*blk._ffn_out().shape,
                                                   blk._h2_proj().shape[0]), (tp, r)
        sizes = (cfg.mla.q_lora_rank, cfg.mla.latent_dim)
        straddles += len(spec.row_pieces(sizes, r, tp)) > 1
    assert straddles > 0 or tp == 1      # (tiny: 32 + 40 rows; one rank straddles at TP 2, 4)
