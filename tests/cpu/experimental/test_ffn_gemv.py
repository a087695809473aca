"""kernels/experimental/ffn_gemv_triton.py on a CPU-only machine (no Triton in this venv; the module must
import without it): `norm_situ_gemv` falls back to the reference composition bit for bit, bad
inputs are named, and the column pieces the kernel tiles cover x. The kernel itself is tested
in tests/gpu/test_ffn_gemv.py (GPU, or the Triton interpreter for small shapes)."""
from __future__ import annotations

import os

import pytest
import torch

from raydecode.kernels import decode_elementwise_triton as X
from raydecode.kernels.experimental import ffn_gemv_triton as FG

torch.set_num_threads(1)
BF = torch.bfloat16


def _case(T, D=96, n=24, I=40, K=72, N=56, gu_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    lat = 3 * torch.randn(T, D, generator=g)
    w = 1 + 0.1 * torch.randn(D, generator=g)
    wide = 4 * torch.randn(T, 10 + 2 * I, generator=g).to(gu_dtype)
    gu = wide[:, 10:]                                  # strided column slice, as in the step
    W = torch.randn(N, K, generator=g).to(BF)
    return lat, w, gu, W


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="runs the kernel instead")
@pytest.mark.parametrize("T,c0,lin,gu_dtype", [(1, 0, 25.0, torch.float32),
                                               (3, 40, None, torch.float32),
                                               (2, 72, 25.0, BF),
                                               (9, 8, 25.0, torch.float32)])   # T > MAX_T
def test_fallback_is_the_reference_composition(T, c0, lin, gu_dtype):
    lat, w, gu, W = _case(T, gu_dtype=gu_dtype, seed=T + c0)
    assert gu.stride(0) == gu.shape[1] + 10             # rows of the wider buffer
    assert not FG.uses_kernel(lat, 24, gu, W)
    ref = FG.norm_situ_gemv_reference(lat, w, 1e-6, c0, 24, gu, 4.0, lin, W)
    x = X.latent_norm_situ_reference(lat, w, 1e-6, c0, 24, gu, 4.0, lin, 72)
    assert torch.equal(ref, torch.nn.functional.linear(x, W))
    y = FG.norm_situ_gemv(lat, w, 1e-6, c0, 24, gu, 4.0, lin, W)
    assert y.dtype == BF and y.shape == (T, 56) and torch.equal(y, ref)
    out = torch.full((T, 56), float("nan")).to(BF)
    assert FG.norm_situ_gemv(lat, w, 1e-6, c0, 24, gu, 4.0, lin, W, out=out) is out
    assert torch.equal(out, ref)


def test_bad_inputs_are_named():
    lat, w, gu, W = _case(2)
    call = FG.norm_situ_gemv
    with pytest.raises(ValueError, match=r"lat \(96,\)"):
        call(lat[0], w, 1e-6, 0, 24, gu, 4.0, None, W)
    with pytest.raises(ValueError, match=r"w_norm \(95,\)"):
        call(lat, w[:95], 1e-6, 0, 24, gu, 4.0, None, W)
    with pytest.raises(ValueError, match=r"gu \(2, 79\)"):
        call(lat, w, 1e-6, 0, 24, gu[:, :79], 4.0, None, W)
    with pytest.raises(ValueError, match=r"gu \(1, 80\)"):
        call(lat, w, 1e-6, 0, 24, gu[:1], 4.0, None, W)
    with pytest.raises(ValueError, match=r"torch.int32"):
        call(lat.to(torch.int32), w, 1e-6, 0, 24, gu, 4.0, None, W)
    with pytest.raises(ValueError, match=r"columns \[80, 104\) of lat with D=96"):
        call(lat, w, 1e-6, 80, 24, gu, 4.0, None, W)
    with pytest.raises(ValueError, match=r"columns \[-8, 16\)"):
        call(lat, w, 1e-6, -8, 24, gu, 4.0, None, W)
    with pytest.raises(ValueError, match=r"beta=0.0"):
        call(lat, w, 1e-6, 0, 24, gu, 0.0, None, W)
    with pytest.raises(ValueError, match=r"linear_beta=-1.0"):
        call(lat, w, 1e-6, 0, 24, gu, 4.0, -1.0, W)
    with pytest.raises(ValueError, match=r"weight \(56, 72\) torch.float32"):
        call(lat, w, 1e-6, 0, 24, gu, 4.0, None, W.float())
    with pytest.raises(ValueError, match=r"K ≥ n_cols \+ I = 64"):
        call(lat, w, 1e-6, 0, 24, gu, 4.0, None, W[:, :60])
    with pytest.raises(ValueError, match=r"out \(2, 55\)"):
        call(lat, w, 1e-6, 0, 24, gu, 4.0, None, W, out=torch.empty(2, 55, dtype=BF))
    with pytest.raises(ValueError, match=r"out \(2, 56\) torch.float32"):
        call(lat, w, 1e-6, 0, 24, gu, 4.0, None, W, out=torch.empty(2, 56))


@pytest.mark.parametrize("n_cols,I", [(224, 384), (448, 768), (0, 16), (5, 17), (100, 40),
                                      (16, 64), (300, 1000)])
def test_pieces_cover_the_nonzero_columns(n_cols, I):
    nc, ia, ib = FG.pieces(n_cols, I)
    for width in (nc, ia) + ((ib,) if ib else ()):
        assert width >= 16 and width & (width - 1) == 0       # tl.arange / tl.dot K minimum
    assert nc >= n_cols and nc < max(32, 2 * n_cols)
    assert (ia < I <= ia + ib) if ib else ia == I                # no second piece: IA is all
    assert ib < max(32, 2 * (I - ia))


def test_k3_tiles_fit_and_config_rms_step():
    for n_cols, I, N, K in ((224, 384, 7168, 640), (448, 768, 7168, 1280)):
        assert sum(FG.pieces(n_cols, I)) <= FG.MAX_TILE_COLS
        assert FG.read_bytes(N, n_cols, I) < 2 * N * K       # the zero pad is not read
    for T in (1, 2, 3, 8):
        cfg = FG.config_for(T, 3584)
        bt = 1 << (T - 1).bit_length()
        assert cfg.block_d * bt <= 4096 and cfg.block_d >= 512   # ≤ 32 lat values a thread
