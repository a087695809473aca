"""AttnRes mix + RMSNorm CuTe DSL kernel on a CPU-only machine.

Without cutlass (the CI venv): the thread-mapping choice, its validation and the layout
checks that decide when the dispatcher may take the kernel. With nvidia-cutlass-dsl
(a venv with nvidia-cutlass-dsl, `CUTE_DSL_ARCH=sm_90a`, set below when unset): the kernel COMPILES for the K3
shape (H = 7168, n = 4 block snapshots + prefix) and a small one, and the SASS has the
properties the design rests on (16-byte loads, all issued before the first use, no local
memory). Running it needs the GPU: tests/gpu/test_attnres_cute.py.
"""
from __future__ import annotations

import os
import re

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")   # before cutlass is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from raydecode.kernels import attnres_norm as A  # noqa: E402
from raydecode.kernels import attnres_norm_cute as K  # noqa: E402

torch.set_num_threads(1)
BF = torch.bfloat16


def _bank(T=2, n=4, H=256):
    g = torch.Generator().manual_seed(0)
    bank = torch.randn(T, n + 1, H, generator=g).to(BF)
    ws = (1 + 0.1 * torch.randn(H, generator=g), torch.randn(1, H, generator=g),
          1 + 0.1 * torch.randn(H, generator=g))
    return bank, ws


# ---- mapping and validation (no cutlass) -----------------------------------------------------

def test_register_budget_matches_ptxas_quadrants():
    # 4 register quadrants of 16384: warps per quadrant decide the cap (measured: 448 -> 128)
    assert K.register_budget(896) == 72 and K.register_budget(448) == 128
    assert K.register_budget(224) == 255 and K.register_budget(32) == 255
    assert K.register_budget(1024) == 64


@pytest.mark.parametrize("n", range(0, 12))
def test_default_config_tiles_k3_rows(n):
    cfg = K.default_config(n, 7168)
    assert 7168 // 8 % cfg.threads == 0 and cfg.threads % 32 == 0
    cfg.validate(n, 7168)
    fitting = [t for t in (896, 448, 224, 128, 64, 32) if 896 // t <= K.REG_MAX_CHUNKS
               and K.estimated_registers(n, 7168, t) <= K.register_budget(t)]
    if fitting:                       # registers: the fewest threads whose estimate fits
        assert not cfg.smem_values and cfg.threads == min(fitting)
    else:                             # staged in shared memory on 448 threads
        assert cfg.smem_values and cfg.threads == K.SMEM_THREADS
    # the boundary ptxas showed with fp32 weights: n ≤ 4 spill-free in registers, n = 5 not
    assert cfg.smem_values == (n >= 5)
    assert cfg.pdl is K.PDL_DEFAULT


def test_shared_memory_capacity_bounds_n():
    cfg = K.default_config(13, 7168)              # 15 staged rows of 14 KB: fits 227 KB
    assert cfg.smem_values and cfg.smem_bytes(13, 7168) <= K.SMEM_PER_CTA
    with pytest.raises(ValueError, match="shared memory"):
        K.default_config(14, 7168)


def test_default_config_prefers_two_chunks_per_thread():
    assert K.default_config(4, 256).threads == 32          # 32 chunks of 8: C = 1
    assert K.default_config(2, 512).threads == 32          # C = 2
    assert K.default_config(1, 7168).chunks_per_thread(7168) == 2     # 448 threads


def test_cluster_per_token_follows_the_batch():
    # small batches: 4 CTAs per token while 4·T ≤ 132 SMs
    assert K.cluster_for(1, 4, 7168) == 4 and K.cluster_for(33, 8, 7168) == 4
    # mid batches: 2 only where one CTA would stage its values in shared memory (n ≥ 5)
    assert K.cluster_for(64, 4, 7168) == 1 and K.cluster_for(64, 8, 7168) == 2
    assert K.cluster_for(67, 8, 7168) == 1 and K.cluster_for(300, 4, 7168) == 1
    assert K.cluster_for(1, 4, 256) == 1                   # 32 chunks: no 4·32 split
    cfg = K._auto_config(4, 7168, 1, torch.float32)
    assert (cfg.cluster, cfg.threads, cfg.smem_values) == (4, 224, False)
    assert cfg.chunks_per_cta(7168) == 224 and cfg.chunks_per_thread(7168) == 1
    cfg = K._auto_config(8, 7168, 64, torch.float32)
    assert (cfg.cluster, cfg.threads, cfg.smem_values) == (2, 224, False)
    with pytest.raises(ValueError, match="cluster=3"):
        K.MixNormConfig(224, cluster=3).validate(4, 7168)
    with pytest.raises(ValueError, match="112 chunks of 8 per CTA"):   # no multiple of 32 threads
        K.default_config(4, 7168, cluster=8)


@pytest.mark.parametrize("cfg,n,H,match", [
    (K.MixNormConfig(32), 4, 300, "H=300"),
    (K.MixNormConfig(100), 4, 7168, "threads=100"),
    (K.MixNormConfig(2048), 4, 7168, "threads=2048"),
    (K.MixNormConfig(256), 4, 7168, "over cluster=1 × threads=256"),
    (K.MixNormConfig(32), 17, 256, "n=17"),
    (K.MixNormConfig(32), -1, 256, "n=-1"),
])
def test_config_validation_names_the_value(cfg, n, H, match):
    with pytest.raises(ValueError, match=match):
        cfg.validate(n, H)


def test_default_config_rejects_untileable_h():
    with pytest.raises(ValueError, match="H=300"):
        K.default_config(4, 300)
    with pytest.raises(ValueError, match="H=8"):      # 1 chunk: no multiple of 32 threads
        K.default_config(4, 8)


def test_problem_accepts_bank_slots_and_names_each_bad_layout():
    bank, ws = _bank()
    T, H = 2, 256
    blocks, pre = bank[:, :4], bank[:, 4]
    out = torch.randn(T, H).to(BF)
    assert K.problem(blocks, pre, ws, out, torch.empty(T, H, dtype=BF)) is None
    assert K.problem(None, pre, ws) is None                              # n = 0
    assert "dtype torch.float16" in K.problem(blocks, pre.half(), ws)
    assert "out of shape (1, 256)" in K.problem(blocks, pre, ws, out[:1])
    wide = torch.zeros(T, H + 1, dtype=BF)
    assert "address" in K.problem(blocks, wide[:, 1:], ws)              # 2-byte offset rows
    assert "strides" in K.problem(blocks, pre, ws, h=torch.zeros(H, T, dtype=BF).t())
    assert "res_proj_w" in K.problem(blocks, pre, (ws[0], ws[1][:, :8], ws[2]))
    assert "out_norm_w dtype torch.float16" in K.problem(blocks, pre, (*ws[:2], ws[2].half()))
    assert "H=300" in K.problem(None, torch.zeros(2, 300, dtype=BF), ws)
    assert "bank of shape" in K.problem(bank[:1, :4], pre, ws)
    assert "n=17" in K.problem(torch.zeros(T, 17, H, dtype=BF), pre, ws)


def test_cute_path_declines_cpu_tensors_and_scattered_blocks():
    bank, (wr, wp, wo) = _bank()
    blocks = [bank[:, j] for j in range(4)]
    pre = bank[:, 4]
    # CPU tensors: not supported (None) so the dispatcher falls back; strict names the reason
    assert K.mix_norm_cute(blocks, pre, wr, wp, wo, 1e-6, 1e-5) is None
    with pytest.raises(ValueError, match="CUDA"):
        K.mix_norm_cute(blocks, pre, wr, wp, wo, 1e-6, 1e-5, strict=True)
    # blocks that are not uniform slots of one tensor: not one strided view
    scattered = [b.clone() for b in blocks]
    assert K.mix_norm_cute(scattered, pre, wr, wp, wo, 1e-6, 1e-5) is None
    with pytest.raises(ValueError, match="uniform slots"):
        K.mix_norm_cute(scattered, pre, wr, wp, wo, 1e-6, 1e-5, strict=True)


def test_bank_of_list_and_tensor_agree():
    bank, _ = _bank()
    v = K._as_bank([bank[:, j] for j in range(4)], bank[:, 4])
    assert v.data_ptr() == bank.data_ptr() and v.stride() == (5 * 256, 256, 1)
    assert K._as_bank(bank[:, :4], bank[:, 4]) is not None
    assert K._as_bank([], bank[:, 4]) is None and K._as_bank(bank[:, :0], bank[:, 4]) is None


def test_dispatch_on_cpu_still_returns_the_reference():
    bank, (wr, wp, wo) = _bank()
    blocks, pre = [bank[:, j] for j in range(4)], bank[:, 4]
    from raydecode.kernels.settings import DEFAULT_OPTIONS
    assert DEFAULT_OPTIONS.attnres_cute is True   # default: the CuTe kernel first where it runs
    assert torch.equal(A.attnres_mix_norm(blocks, pre, wr, wp, wo, 1e-6, 1e-5),
                       A.attnres_mix_norm_reference(blocks, pre, wr, wp, wo, 1e-6, 1e-5))


def test_prediction_model_is_monotone():
    assert K.predicted_us(1, 4, 7168) < K.predicted_us(1, 8, 7168)
    assert K.predicted_us(1, 4, 7168) < K.predicted_us(64, 4, 7168) < 1.5 * K.predicted_us(1, 4, 7168)
    assert K.predicted_us(264, 4, 7168) > K.predicted_us(64, 4, 7168)


# ---- compiles (needs nvidia-cutlass-dsl; skipped where cutlass does not import) -----------------

def _sass_facts(compiled) -> dict:
    sass = compiled.__sass__ or ""
    ins = [ln for ln in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4}\*/", ln)]
    ldg = [i for i, ln in enumerate(ins) if re.search(r"\bLDG\.", ln)]          # not LDGSTS
    return {"ins": ins, "ldg": ldg, "ldg128": sum("LDG.E.128" in ln for ln in ins),
            "ldgsts": [i for i, ln in enumerate(ins) if "LDGSTS" in ln],
            "stg128": sum("STG.E.128" in ln for ln in ins), "stg": sum("STG" in ln for ln in ins),
            "local": sum(bool(re.search(r"\b(LDL|STL)\b", ln)) for ln in ins),
            "wait": [i for i, ln in enumerate(ins) if "ACQBULK" in ln]}


@pytest.fixture(scope="module")
def keep_sass(tmp_path_factory) -> str:
    """cute.compile flags that keep the PTX and SASS (read back as `__ptx__`, `__sass__`), dumped
    under a tmp dir."""
    return f"--keep-ptx --keep-sass --dump-dir={tmp_path_factory.mktemp('cute_sass')}"


def _compile(keep_sass, n, H, add, write_mix, wdt=torch.float32, pdl=True, cfg=None):
    if K.cute is None:
        pytest.skip("nvidia-cutlass-dsl not importable (CI venv): compile checks need "
                    "nvidia-cutlass-dsl")
    cfg = cfg or K.default_config(n, H, pdl=pdl)
    return cfg, K.compile_mix_norm(n, H, (wdt, wdt, wdt), add, write_mix, cfg,
                                   extra_options=keep_sass)


@pytest.mark.parametrize("n,H,add,write_mix,wdt", [
    (4, 7168, True, False, torch.float32),     # K3: the benchmark's bank, residual form
    (4, 7168, False, True, torch.bfloat16),    # K3 plain form with the mix output, bf16 weights
    (2, 256, True, False, torch.float32),      # small rows: one warp, no shared-memory pass
])
def test_kernel_compiles_with_one_round_of_16_byte_loads(keep_sass, n, H, add, write_mix, wdt):
    cfg, compiled = _compile(keep_sass, n, H, add, write_mix, wdt)
    assert not cfg.smem_values
    f = _sass_facts(compiled)
    C = cfg.chunks_per_thread(H)
    wloads = 3 * C * (2 if wdt == torch.float32 else 1)
    vloads = (n + 1 + add) * C
    assert f["ldg128"] == len(f["ldg"]) == wloads + vloads, f
    assert f["stg128"] == f["stg"] == C * (1 + add + write_mix)
    assert f["local"] == 0, "register spills (local memory) in the SASS"
    # PDL: one griddepcontrol.wait; weights before it, every value load after it and before
    # the first shuffle (= nothing is reduced before every load was issued)
    assert len(f["wait"]) == 1
    after = [i for i in f["ldg"] if i > f["wait"][0]]
    assert len(after) == vloads
    first_shfl = next(i for i, ln in enumerate(f["ins"]) if "SHFL" in ln)
    assert max(after) < first_shfl


def test_kernel_without_pdl_has_no_grid_dependency_wait(keep_sass):
    _, compiled = _compile(keep_sass, 4, 7168, False, False, pdl=False)
    f = _sass_facts(compiled)
    assert not f["wait"] and f["local"] == 0 and f["ldg128"] == len(f["ldg"])


def test_many_blocks_stage_values_in_shared_memory(keep_sass):
    """n = 8 (K3's final mix): the values go global -> shared by cp.async (LDGSTS), one per
    16-byte chunk, all issued before the first reduction; weights still LDG.E.128."""
    cfg, compiled = _compile(keep_sass, 8, 7168, True, False)
    assert cfg.smem_values and cfg.threads == K.SMEM_THREADS
    f = _sass_facts(compiled)
    assert len(f["ldgsts"]) == (8 + 2) * cfg.chunks_per_thread(7168), len(f["ldgsts"])
    C = cfg.chunks_per_thread(7168)
    assert f["ldg128"] == len(f["ldg"]) == 3 * 2 * C
    assert f["local"] == 0 and f["stg128"] == f["stg"] == 2 * C
    first_shfl = next(i for i, ln in enumerate(f["ins"]) if "SHFL" in ln)
    assert f["wait"][0] < min(f["ldgsts"]) and max(f["ldgsts"]) < first_shfl


def test_shared_memory_staging_with_seven_chunks_per_thread(keep_sass):
    """128 threads, C = 7 chunks per row each: the sV indexing compiles to one LDGSTS per chunk."""
    cfg = K.MixNormConfig(128, True, True)
    _, compiled = _compile(keep_sass, 4, 7168, False, False, cfg=cfg)
    f = _sass_facts(compiled)
    assert len(f["ldgsts"]) == 5 * 7 and f["ldg128"] == len(f["ldg"]) == 3 * 7 * 2
    assert f["local"] == 0 and f["stg128"] == f["stg"] == 7


def test_cluster_kernel_reduces_through_dsmem(keep_sass):
    """k = 4 CTAs per token: three cluster barriers (two sums + the exit guard), 2(n+1) + 1 sums
    × 4 ranks read through DSMEM, still one round of 16-byte loads and no local memory."""
    cfg = K._auto_config(4, 7168, 1, torch.float32)
    _, compiled = _compile(keep_sass, 4, 7168, True, False, cfg=cfg)
    f = _sass_facts(compiled)
    ptx = compiled.__ptx__ or ""
    assert ptx.count("barrier.cluster.arrive") == 3 and ptx.count("barrier.cluster.wait") == 3
    assert ptx.count("ld.shared::cluster.f32") == (2 * 5 + 1) * 4
    assert f["ldg128"] == len(f["ldg"]) == 3 * 2 + 6 and f["local"] == 0
    first_shfl = next(i for i, ln in enumerate(f["ins"]) if "SHFL" in ln)
    assert max(f["ldg"]) < first_shfl
