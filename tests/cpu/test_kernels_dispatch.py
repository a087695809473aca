"""GEMV dispatch, reference and thread mapping on a CPU-only machine (no cutlass, no CUDA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raydecode.kernels import gemv as G
from raydecode.kernels import linear as LN
from raydecode.kernels._cute import CompileCache, cute_available

torch.set_num_threads(1)

K3_SHAPES = [
    (1152, 1536), (2304, 1536), (2112, 7168), (3216, 7168), (6288, 7168), (7168, 768),
    (7168, 1536), (3584, 7168), (7168, 3584), (896, 7168), (768, 7168), (1536, 7168),
    (7168, 384), (10240, 7168), (20480, 7168), (16384, 7168),
    (1048, 7168), (7168, 640), (900, 7168), (2096, 7168), (7168, 1280), (1800, 7168),
]


def test_cute_unavailable_without_cuda():
    assert not torch.cuda.is_available()
    assert cute_available() is False


@pytest.mark.parametrize("shape", [(1, 64), (2, 96), (3, 5, 40)])
def test_linear_falls_back_to_torch(shape):
    x = torch.randn(*shape, dtype=torch.bfloat16)
    w = torch.randn(24, shape[-1], dtype=torch.bfloat16)
    assert torch.equal(LN.linear(x, w), F.linear(x, w))
    assert G.supports(x.reshape(-1, shape[-1]), w) is False  # CPU tensors never take the kernel


def test_gemv_without_cute_names_the_fallback():
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    w = torch.randn(8, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="linear"):
        G.gemv(x, w)


@pytest.mark.parametrize("M,N,K", [(1, 40, 128), (2, 17, 64), (8, 33, 256)])
def test_reference_matches_fp64(M, N, K):
    x = torch.randn(M, K, dtype=torch.bfloat16)
    w = torch.randn(N, K, dtype=torch.bfloat16)
    ref = x.double() @ w.double().t()
    out = G.gemv_reference(x, w)
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < 4e-3
    # fp32 accumulation: the only error is the final rounding to bf16 (≤ half an ulp)
    assert torch.all((out.double() - ref).abs() <= 2.0**-8 * ref.abs() + 1e-6)


@pytest.mark.parametrize("N,K", K3_SHAPES)
@pytest.mark.parametrize("M", [1, 2, 4, 8, 16, 64])
def test_default_mapping_tiles_every_k3_shape(M, N, K):
    cfg = G.default_config(M, N, K)
    cfg.validate(M, N, K)
    assert cfg.chunks_per_lane(K) * cfg.lanes_per_row * cfg.k_warps * G.VEC == K
    assert M % cfg.m_tile == 0 and cfg.m_tile <= G.MAX_M_TILE
    assert cfg.threads <= 1024


def _covers_exactly_once(cfg: G.GemvConfig, N: int, K: int) -> None:
    """Enumerate the kernel's index maps: every (row, 16-byte chunk) of W is read by one lane."""
    J = cfg.chunks_per_lane(K)
    chunks = sorted(
        G.chunk_index(cfg, j, kw, kl)
        for j in range(J) for kw in range(cfg.k_warps) for kl in range(cfg.lanes_per_row)
    )
    assert chunks == list(range(K // G.VEC))
    rows = sorted(
        G.row_index(cfg, nb, wr, grp, r)
        for nb in range(N // cfg.rows_per_cta) for wr in range(cfg.row_warps)
        for grp in range(cfg.groups_per_warp) for r in range(cfg.rows_per_group)
    )
    assert rows == list(range(N))


@pytest.mark.parametrize(
    "cfg,N,K",
    [
        (G.GemvConfig(32, 1, 2, 4, 1), 1152, 1536),
        (G.GemvConfig(32, 4, 1, 2, 1), 896, 7168),
        (G.GemvConfig(32, 7, 1, 1, 2), 896, 7168),
        (G.GemvConfig(16, 1, 2, 4, 1), 7168, 384),
        (G.GemvConfig(8, 2, 1, 2, 8), 64, 128),
    ],
)
def test_index_maps_cover_w_once(cfg, N, K):
    cfg.validate(cfg.m_tile, N, K)
    _covers_exactly_once(cfg, N, K)


def test_default_mappings_cover_w_once():
    for N, K in [(1152, 1536), (896, 7168), (7168, 384), (2112, 7168)]:
        _covers_exactly_once(G.default_config(1, N, K), N, K)


@pytest.mark.parametrize(
    "cfg,match",
    [
        (G.GemvConfig(24, 1, 1, 4, 1), "power of two"),
        (G.GemvConfig(32, 5, 1, 1, 1), "16-byte chunks"),
        (G.GemvConfig(32, 1, 1, 4, 3), "m_tile=3"),
        (G.GemvConfig(32, 8, 1, 8, 1), "threads per CTA"),
        (G.GemvConfig(32, 1, 4, 4, 1, -1), "batch"),
        (G.GemvConfig(32, 1, 1, 4, 1, l2_prefetch_mib=-1), "l2_prefetch_mib=-1"),
    ],
)
def test_bad_mapping_is_rejected_with_reason(cfg, match):
    with pytest.raises(ValueError, match=match):
        cfg.validate(4, 1024, 7168)


def test_unsupported_k_is_rejected():
    with pytest.raises(ValueError, match="K=100"):
        G.default_config(1, 64, 100)


def test_l2_prefetch_takes_whole_rows_under_the_budget_and_leading_bytes_past_it():
    assert G.GemvConfig(32, 1, 2, 4, 1).prefetch_row_bytes(7168, 768) == 0          # off
    on = G.GemvConfig(32, 1, 2, 4, 1, l2_prefetch_mib=32)
    assert on.prefetch_row_bytes(7168, 768) == 2 * 768                              # 11 MB: whole
    lead = on.prefetch_row_bytes(10240, 7168)                                       # lm_head TP16
    assert lead % 16 == 0 and 0 < lead < 2 * 7168
    assert 10240 * lead <= 32 * 2**20 < 10240 * (lead + 16)                          # fills the budget
    # the budget is part of the config, so the compile caches key prefetching kernels apart
    assert on != G.GemvConfig(32, 1, 2, 4, 1) and on != G.GemvConfig(32, 1, 2, 4, 1, l2_prefetch_mib=16)


def test_batch_auto_and_explicit():
    cfg = G.GemvConfig(32, 1, 2, 4, 1)
    assert cfg.batch_for(7168) == 4  # 12 // (MT + R)
    assert G.GemvConfig(32, 1, 2, 4, 1, 64).batch_for(7168) == 28  # clamped to J
    assert G.predicted_us(7168, 7168) == pytest.approx(7168 * 7168 * 2 / 4.3e12 * 1e6)


def test_compile_cache_builds_once():
    cache, calls = CompileCache(), []
    for _ in range(3):
        assert cache.get(("k", 1), lambda: calls.append(1) or "compiled") == "compiled"
    assert calls == [1] and len(cache) == 1


def test_tuned_mappings_tile_their_shapes():
    assert G.TUNED, "the measured table is empty"
    for (M, N, K), cfg in G.TUNED.items():
        cfg.validate(M, N, K)
        _covers_exactly_once(cfg, N, K)
        assert G.config_for(M, N, K).pdl == G.PDL_DEFAULT


def test_linear_dispatch_rule():
    assert LN.linear_uses_cute(1, 20480, 7168)  # M = 1: always the GEMV
    assert LN.linear_uses_cute(2, 1152, 1536)  # M = 2, 3.5 MB: GEMV
    assert not LN.linear_uses_cute(2, 2112, 7168)  # M = 2, 30 MB: cuBLAS measured faster
    assert not LN.linear_uses_cute(8, 1152, 1536)  # M > 2: FMA-bound on CUDA cores


def test_linear_fp32_out_is_the_unrounded_product():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(48, 64, generator=g).to(torch.bfloat16)
    y = LN.linear(x, w, torch.float32)
    assert y.dtype == torch.float32
    # off CUDA: the sums in fp64, rounded once to fp32 (no fp32 summation-order noise) ...
    assert torch.equal(y, F.linear(x.double(), w.double()).float())
    torch.testing.assert_close(y, F.linear(x.float(), w.float()), rtol=1e-6, atol=1e-6)
    # ... so a row does not depend on how many rows share the call (padded graph buckets)
    assert torch.equal(LN.linear(x[:1], w, torch.float32), y[:1])
    assert torch.equal(y.to(torch.bfloat16), F.linear(x, w))      # one rounding = F.linear's
    assert torch.equal(LN.linear(x, w, torch.bfloat16), F.linear(x, w))
    with pytest.raises(ValueError, match="out_dtype"):
        LN.linear(x, w, torch.float16)


@pytest.mark.parametrize("N,K", [(1048, 7168), (2096, 7168), (7168, 640), (7168, 1280)])
def test_round3_fused_gemv_shapes_tile(N, K):
    for M in (1, 2):
        cfg = G.config_for(M, N, K)
        cfg.validate(M, N, K)
