"""MLA prefill attention on the GPU (kernels/mla_prefill.py): bf16 K3 per-rank shapes at TP16
against the fp32 absorbed reference on the same bf16 inputs, which SDPA backend serves them,
the model's stock prefill on the SDPA path against its reference path. On the H200:

    python -m pytest tests/gpu/test_mla_prefill_gpu.py -q -x -s

Fresh random inputs per case (seed from os.urandom, in every failure message); outputs are
preallocated NaN, so an element never written fails. Tolerance `TOL["bf16_3round"]`
(‖out − ref‖ / ‖ref‖, fp64): the SDPA path rounds K/V (the kv_b GEMM), p (flash: before
p·V) and the output to bf16; the reference stays fp32 from the bf16 inputs (CPU bf16 runs of the
same formulation: 2.1–2.6e-3). The CPU twin (fp32, tight): tests/cpu/test_mla_prefill.py.
"""
from __future__ import annotations

import time

import pytest
import torch
from torch.backends.cuda import SDPAParams, can_use_cudnn_attention
from torch.nn.attention import SDPBackend, sdpa_kernel

from raydecode.kernels.mla_prefill import (decompress, mla_prefill_attention, mla_prefill_into,
                                           mla_prefill_reference)
from raydecode.models.cache import SeqSlice, StepBatch
from raydecode.models.config import load_config
from raydecode.models.k3 import K3ForCausalLM, init_random_, make_caches
from raydecode.models.parallel import Parallel

from _numerics import TOL, fresh_seed, max_rel_err, rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BF = torch.bfloat16
TP = 16
_M = load_config("k3").mla
H, C, R, NOPE, V = _M.num_heads // TP, _M.kv_lora_rank, _M.qk_rope_head_dim, \
    _M.qk_nope_head_dim, _M.v_head_dim                                 # 6, 512, 64, 128, 128
SCALE = _M.qk_head_dim ** -0.5
KW = dict(nope=NOPE, vdim=V, kv_lora=C, scale=SCALE)
FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


def _case(n: int, ctx: int, seed: int):
    """bf16 rows (ctx + n, kv_lora + rope), kv_b weight, queries (n, h, nope + rope); q × 2 so
    the softmax is not flat (scores of std ≈ 2)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = torch.randn(ctx + n, C + R, generator=gen, device="cuda").to(BF)
    w = (torch.randn(H * (NOPE + V), C, generator=gen, device="cuda") / C ** 0.5).to(BF)
    q = (2 * torch.randn(n, H, NOPE + R, generator=gen, device="cuda")).to(BF)
    return q, rows, w


def _nan(n: int) -> torch.Tensor:
    return torch.full((n, H, V), float("nan"), dtype=BF, device="cuda")


@pytest.mark.parametrize("ctx", [0, 3000])
@pytest.mark.parametrize("n", [1, 63, 512, 2048])
def test_k3_tp16_chunks_match_the_fp32_reference_on_flash(n, ctx):
    q, rows, w = _case(n, ctx, seed := fresh_seed())
    ref = mla_prefill_reference(q, rows, ctx, w, **KW)
    out = _nan(n)
    route = mla_prefill_into(out, q, rows, ctx, w, **KW)
    assert route == "flash", (route, seed)     # flash takes the padded V (module doc)
    assert torch.isfinite(out).all(), seed
    err = rel_err(out, ref)
    assert err < TOL["bf16_3round"], (err, seed)
    auto = mla_prefill_attention(q, rows, ctx, w, **KW)                  # "auto" on CUDA: SDPA
    assert auto.dtype == BF and torch.equal(auto, out), seed


@pytest.mark.parametrize("ctx", [0, 3000])
@pytest.mark.parametrize("n", [1, 63, 512, 2048])
def test_which_sdpa_backend_serves_the_chunks(n, ctx):
    """Restricted to the fused backends (no math) the call must not raise; flash alone serves
    every case (padded V), memory-efficient alone too (the v-wide V: its own route)."""
    q, rows, w = _case(n, ctx, seed := fresh_seed())
    ref = mla_prefill_reference(q, rows, ctx, w, **KW)
    for backends, want in ((FUSED, "flash"), ([SDPBackend.FLASH_ATTENTION], "flash"),
                           ([SDPBackend.EFFICIENT_ATTENTION], "efficient")):
        out = _nan(n)
        with sdpa_kernel(backends):
            route = mla_prefill_into(out, q, rows, ctx, w, **KW)
        assert route == want, (backends, route, seed)
        err = rel_err(out, ref)
        assert err < TOL["bf16_3round"], (backends, err, seed)


@pytest.mark.parametrize("n", [63, 512, 2048])
def test_cudnn_takes_the_position_0_chunk_unpadded(n):
    """cuDNN never takes the lower-right bias, but at ctx = 0 the chunk is plain is_causal
    SDPA: with the v-wide V (192 / 128) cuDNN ≥ 9.11 on sm90 may serve it (the A/B of
    scripts/explore/mla_prefill_sdpa.py). n = 1 is left out: cuDNN refuses one key."""
    q, rows, w = _case(n, 0, seed := fresh_seed())
    buf = decompress(rows, w, H, nope=NOPE, vdim=V, kv_lora=C, dtype=BF)
    q4, k4, v4 = (x.unsqueeze(0).transpose(1, 2) for x in (q, buf[..., V:], buf[..., :V]))
    params = SDPAParams(q4, k4, v4, None, 0.0, True, False)
    if not can_use_cudnn_attention(params):
        pytest.skip(f"cuDNN {torch.backends.cudnn.version()} does not take 192/128 here")
    out = _nan(n)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        route = mla_prefill_into(out, q, rows, 0, w, pad_v=False, **KW)
    assert route == "other", route            # neither flash nor efficient: torch's pick
    err = rel_err(out, mla_prefill_reference(q, rows, 0, w, **KW))
    assert err < TOL["bf16_3round"], (err, seed)


@pytest.mark.parametrize("ctx", [0, 3000])
def test_fused_kernel_runs_not_the_math_path(ctx):
    """The profiler's op and kernel names: the flash kernel ran (at ctx = 0 too, where
    plain is_causal SDPA could go to cuDNN: the call restricts it to its route's backend,
    so no cuDNN graph is built per prompt length), no softmax or math op."""
    q, rows, w = _case(512, ctx, fresh_seed())
    out = _nan(512)
    mla_prefill_into(out, q, rows, ctx, w, **KW)                     # warm
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        mla_prefill_into(out, q, rows, ctx, w, **KW)
        torch.cuda.synchronize()
    names = sorted({e.name for e in prof.events()})
    low = [s.lower() for s in names]
    assert any("flash" in s for s in low), names
    assert not any("cudnn" in s for s in low), names
    assert not any("softmax" in s or "attention_math" in s for s in low), names


def test_long_context_chunk_keeps_to_the_decompressed_buffers():
    """A 4096-query chunk after 126976 rows (K3's 128k at TP16): the peak allocation stays
    near the K/V buffers (≈ 1 GB), far under the (n, h, m) fp32 scores (12.9 GB); the first
    and last 64 queries against the reference (each a 64-query chunk of its own there)."""
    n, ctx = 4096, 131072 - 4096
    q, rows, w = _case(n, ctx, seed := fresh_seed())
    out = _nan(n)
    mla_prefill_into(out, q, rows, ctx, w, **KW)                     # warm
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    route = mla_prefill_into(out, q, rows, ctx, w, **KW)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    peak = torch.cuda.max_memory_allocated() - base
    print(f"\nK3 TP16 chunk n={n} ctx={ctx}: route {route}, {ms:.1f} ms, "
          f"peak +{peak / 2**30:.2f} GiB")
    assert peak < 2.5 * 2**30, (peak, seed)
    assert torch.isfinite(out).all(), seed
    for a in (0, n - 64):
        ref = mla_prefill_reference(q[a:a + 64], rows[:ctx + a + 64], ctx + a, w, **KW)
        err = rel_err(out[a:a + 64], ref)
        assert err < TOL["bf16_3round"], (a, err, seed)


def test_model_stock_prefill_sdpa_vs_reference_path():
    """The tiny model's MLA layer in bf16 on CUDA: chunked prefill (6 at 0, then a decode row
    of another sequence + 5 at 6) through the SDPA path ("auto" on CUDA) and the absorbed
    reference path, from equal caches: outputs within the bf16 path tolerance."""
    cfg = load_config("tiny")
    with torch.device("cuda"):
        model = init_random_(K3ForCausalLM(cfg, dtype=BF), seed := fresh_seed())
    attn = model.model.layers[cfg.mla_layers[0]].self_attn
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(11, cfg.hidden_size, generator=gen, device="cuda").to(BF)
    xb = torch.randn(3, cfg.hidden_size, generator=gen, device="cuda").to(BF)
    outs = {}
    for impl in ("auto", "reference"):
        attn.prefill_impl = impl
        caches = make_caches(cfg, Parallel(), num_slots=2, num_blocks=8, block_size=4,
                             dtype=BF, device="cuda")
        caches.mla.block_tables[0], caches.mla.block_tables[1] = [5, 2, 7], [0, 1]
        a = attn(x[:6], StepBatch([SeqSlice(0, 0, 6, 0)]), caches)
        attn(xb[:2], StepBatch([SeqSlice(1, 0, 2, 0)]), caches)
        b = attn(torch.cat([xb[2:], x[6:]]),
                 StepBatch([SeqSlice(1, 0, 1, 2), SeqSlice(0, 1, 5, 6)]), caches)
        outs[impl] = torch.cat([a, b])
    assert torch.isfinite(outs["auto"]).all(), seed
    err = max_rel_err(outs["auto"], outs["reference"])
    assert err < TOL["bf16_path"], (err, seed)
