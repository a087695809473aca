"""kernels/moe_ogs.py on the GPU: triton_kernels' matmul_ogs on this project's MXFP4 experts
(zero-copy strided weights and the converted Hopper layouts) against `moe_mxfp4_reference`
and the project's prefill kernels, fresh random inputs, skewed and uniform routing, into a
column block of a wider buffer. Skipped where the library cannot run (`ogs_unavailable`)."""
from __future__ import annotations

import pytest
import torch

from raydecode.kernels import moe_mxfp4 as M
from raydecode.kernels import moe_ogs as O

from _numerics import fresh_seed, rel_err

pytestmark = pytest.mark.skipif(O.ogs_unavailable() is not None,
                                reason=f"matmul_ogs: {O.ogs_unavailable()}")


def _case(E, L, I, k, T, seed, skew=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ex = M.MXFP4Experts.random(E, L, I, 4.0, 25.0, device="cuda", seed=seed)
    z = torch.randn(T, L, generator=gen, device="cuda").to(torch.bfloat16)
    scores = torch.rand(T, E, generator=gen, device="cuda")
    if skew:
        scores[:, 2] = 2.0
        scores[:, E // 2:] = -1.0
    w, ids = scores.topk(k, dim=-1)
    return ex, z, (w / w.sum(-1, keepdim=True)).float(), ids


@pytest.mark.parametrize("layout", O.OGS_LAYOUTS)
@pytest.mark.parametrize("E,L,I,k,T,skew", [(16, 256, 128, 4, 300, False),
                                             (16, 256, 128, 4, 77, True),
                                             (896, 3584, 192, 16, 512, False)])
def test_ogs_matches_the_reference_and_the_prefill_kernels(layout, E, L, I, k, T, skew):
    seed = fresh_seed()
    ex, z, w, ids = _case(E, L, I, k, T, seed, skew)
    buf = torch.full((T, L + 8), 7.0, device="cuda")
    O.moe_mxfp4_ogs(z, w, ids, ex, layout, out=buf[:, :L])
    out = buf[:, :L]
    ref = M.moe_mxfp4_reference(z, w, ids, ex)
    ours = M.fused_moe_mxfp4_triton(z, w, ids, ex, M.prefill_config(L, I))
    assert torch.isfinite(out).all()
    assert (buf[:, L:] == 7.0).all()
    assert rel_err(out, ref) < 1e-2, f"seed {seed}: rel err {rel_err(out, ref):.2e}"
    assert rel_err(out, ours) < 1e-2, f"seed {seed}: vs prefill kernels {rel_err(out, ours):.2e}"
    O.forget_weights()


def test_ogs_kind_runs_prefill_calls_and_not_under_capture():
    was = M.PREFILL_EXPERTS
    try:
        M.PREFILL_EXPERTS = "ogs"
        assert M.prefill_config(3584, 192, 131072, 896).ogs == "strided"
        M.PREFILL_EXPERTS = "ogs-hopper"
        assert M.prefill_config(3584, 192, 131072, 896).ogs == "hopper"
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            cfg = M.prefill_config(3584, 192, 131072, 896)
        assert cfg.ogs == "" and cfg.blocked
    finally:
        M.PREFILL_EXPERTS = was


def test_load_converts_every_layer_once_and_the_step_uses_those_copies():
    """engine/loader.py `prepare_prefill_experts` with ogs-hopper: every MoE layer converted
    at load (the bytes it reports), and a prefill call afterwards finds its layer's copy in
    the cache (no second conversion: the count of cached forms does not grow)."""
    from torch import nn

    from raydecode.engine import loader
    from raydecode.models.moe import RoutedExperts
    from raydecode.models.parallel import Parallel

    O.forget_weights()
    layers = nn.ModuleList(RoutedExperts(16, 256, 128, 4.0, 25.0, Parallel(), torch.bfloat16,
                                         mxfp4=True) for _ in range(3)).cuda()
    for m in layers:                       # valid weights (the parameters start empty)
        m.copy_experts_(M.MXFP4Experts.random(16, 256, 128, 4.0, 25.0, device="cuda",
                                              seed=fresh_seed()))
    need = loader.prepare_prefill_experts(layers, "cuda", "ogs-hopper")
    assert need == 3 * 16 * layers[0].packed().expert_bytes()
    assert len(O._WEIGHTS) == 3
    z = torch.randn(300, 256, device="cuda").to(torch.bfloat16)
    w, ids = torch.rand(300, 16, device="cuda").topk(4, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).float()
    out = O.moe_mxfp4_ogs(z, w, ids, layers[1].packed(), "hopper")
    assert len(O._WEIGHTS) == 3
    ref = M.moe_mxfp4_reference(z, w, ids, layers[1].packed())
    assert rel_err(out, ref) < 1e-2
    O.forget_weights()
