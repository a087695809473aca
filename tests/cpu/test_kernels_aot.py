"""Kernel cache (kernels/aot*.py): plan, per-kernel lock, manifest, keys, corruption, and — where
nvidia-cutlass-dsl / Triton are installed — real CuTe GEMV export/load across processes and real
offline Triton compiles. Planning/lock/manifest tests need neither (CI venv); the others skip
cleanly: run them in a venv with nvidia-cutlass-dsl and in one with triton."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from raydecode.kernels import aot, aot_store
from raydecode.kernels.gemv import GemvConfig, config_for
from raydecode.models.config import load_config

HAVE_CUTE = importlib.util.find_spec("cutlass") is not None
HAVE_TRITON = importlib.util.find_spec("triton") is not None
REPO = Path(__file__).resolve().parents[2]


def _run(code: str, env: dict, *, wait: bool = True):
    full = {**os.environ, "PYTHONPATH": str(REPO), **env}
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=full,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return _finish(p) if wait else p


def _finish(p) -> dict:
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


# ---- plan (no cutlass) ---------------------------------------------------------------------

def test_plan_k3_tp16_lists_the_expected_gemvs():
    cfg = load_config("k3")
    plan = aot.plan_kernels(cfg, 16, (1, 2), "sm_90a")
    got = {(g.name, g.M, g.N, g.K) for g in plan.gemvs}
    m, H = cfg.mla, cfg.hidden_size
    # per-rank shapes from the published config: rows split over 16 ranks, K = the input width
    assert ("q_b", 1, m.num_heads * m.qk_head_dim // 16, m.q_lora_rank) in got     # (1152, 1536)
    assert ("q_b", 2, 1152, 1536) in got
    assert ("o_proj", 1, H, m.num_heads * m.v_head_dim // 16) in got               # (7168, 768)
    assert ("lm_head", 1, cfg.vocab_size // 16, H) in got                          # (10240, 7168)
    # M = 2 of a weight ≥ 16 MiB goes to cuBLAS (linear_uses_cute), so it is skipped, not built
    assert ("lm_head", 2, 10240, 7168, "cuBLAS (linear_uses_cute is False)") in plan.skipped
    assert all(g.M in (1, 2) and g.config == config_for(g.M, g.N, g.K) for g in plan.gemvs)
    # o_proj and kda_o_proj share (7168, 768): one kernel, not two
    assert not {("kda_o_proj", 1, 7168, 768)} & got
    assert len({g.kernel_key for g in plan.gemvs}) == len(plan.gemvs)
    assert {t.name for t in plan.triton} == {"route_topk", "latent_norm_situ"}


def test_plan_k3_tp16_packed_gemvs_with_their_out_dtypes():
    """The fused specialized decode's packed GEMVs (models/params.py docstring), each compiled
    with the output dtype the model launches it with."""
    plan = aot.plan_kernels(load_config("k3"), 16, (1, 2), "sm_90a")
    got = {(g.name, g.M, g.N, g.K, g.out_dtype) for g in plan.gemvs}
    bf, f32 = torch.bfloat16, torch.float32
    for M in (1, 2):
        assert ("qkv_a_g", M, 132 + 768, 7168, bf) in got          # 2112/16 + 12288/16 rows
        assert ("q_b_absorbed", M, 6 * 576, 1536, f32) in got      # W_q'': W_uk folded in
        assert ("q_b_folded", M, 1152, 1536, f32) in got           # q_b' (the A/B switch off)
        assert ("q_b", M, 1152, 1536, bf) in got                   # DCP > 1: q_b, bf16 out
        assert ("h2_proj", M, 56 + 224 + 768, 7168, f32) in got    # E, L, 2·I_sh over 16
        assert ("ffn_out", M, 7168, 640, bf) in got                # 224 + 384 → 640
        assert ("router", M, 56, 7168, f32) in got
        assert ("shared_gate", M, 384, 7168, bf) in got            # unfused block: gate, up
        assert ("latent_up_rows", M, 448, 3584, bf) in got         # unfused block: H/16 rows
    assert ("dense_gate", 1, 2112, 7168, bf) in got                # layer 0: 33792/16
    # one weight shape, two out dtypes: two kernels; bf16 out is the default
    assert sum((g.M, g.N, g.K) == (1, 1152, 1536) for g in plan.gemvs) == 2
    assert aot.GemvItem("x", 1, 8, 64, config_for(1, 8, 64)).out_dtype == bf
    assert any("h2_proj" in ln and "out=float32" in ln for ln in plan.describe())


def test_plan_rejects_bad_input_by_name():
    cfg = load_config("k3")
    with pytest.raises(aot.KernelCacheError, match="TP = 5"):
        aot.plan_kernels(cfg, 5)
    with pytest.raises(aot.KernelCacheError, match="'hopper'"):
        aot.plan_kernels(cfg, 16, arch="hopper")
    with pytest.raises(aot.KernelCacheError, match="buckets"):
        aot.plan_kernels(cfg, 16, buckets=(0,))


def test_cli_dry_run_prints_plan(capsys):
    from raydecode.cli import main

    assert main(["kernels-warmup", "--config", "k3", "--tp", "8", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "k3 TP8" in out and "q_b" in out and "N=2304 K=1536" in out   # 96·192/8 rows


def test_prepare_is_a_noop_without_cache_dir(monkeypatch):
    monkeypatch.delenv(aot.ENV, raising=False)
    from raydecode.models.parallel import Parallel

    assert aot.prepare_kernel_cache(load_config("tiny"), Parallel(0, 1)) is None


# ---- keys ---------------------------------------------------------------------------------

def test_key_changes_with_shape_dtype_config_arch_and_versions(monkeypatch):
    cfg = config_for(1, 1152, 1536)
    base = aot_store.digest(aot_store.gemv_key(torch.bfloat16, 1, 1152, 1536, cfg, "sm_90a"))
    variants = [
        aot_store.gemv_key(torch.bfloat16, 2, 1152, 1536, config_for(2, 1152, 1536), "sm_90a"),
        aot_store.gemv_key(torch.bfloat16, 1, 2304, 1536, cfg, "sm_90a"),
        aot_store.gemv_key(torch.float16, 1, 1152, 1536, cfg, "sm_90a"),
        aot_store.gemv_key(torch.bfloat16, 1, 1152, 1536, cfg, "sm_90a", torch.float32),
        aot_store.gemv_key(torch.bfloat16, 1, 1152, 1536, GemvConfig(32, 2, 1, 4, 1), "sm_90a"),
        aot_store.gemv_key(torch.bfloat16, 1, 1152, 1536, cfg, "sm_100a"),
    ]
    digests = {aot_store.digest(k) for k in variants}
    assert base not in digests and len(digests) == len(variants)
    real = aot_store.versions()
    monkeypatch.setattr(aot_store, "versions", lambda: {**real, "nvidia-cutlass-dsl": "99.0"})
    bumped = aot_store.digest(aot_store.gemv_key(torch.bfloat16, 1, 1152, 1536, cfg, "sm_90a"))
    assert bumped != base


def test_key_tracks_kernel_source(tmp_path):
    src = tmp_path / "gemv.py"
    src.write_text(aot_store._GEMV_SOURCE.read_text())
    a = aot_store.source_sha(src)
    src.write_text(src.read_text() + "\n# edit\n")
    assert aot_store.source_sha(src) != a


# ---- lock + manifest (a real build step writing bytes; no cutlass) -------------------------

_STORE_WORKER = """
    import json, os, sys, time
    from pathlib import Path
    from raydecode.kernels import aot_store
    root, log = Path(os.environ["ROOT"]), Path(os.environ["BUILD_LOG"])

    def build(path, symbol):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(0.5)   # widens the race window only; the lock, not timing, orders the builds
        path.write_bytes(b"object:" + symbol.encode())

    out = aot_store.KernelStore(root).get_or_build({"kind": "toy", "n": 1}, build,
                                                   lambda p, s: p.read_bytes().decode())
    print(json.dumps({"pid": os.getpid(), "out": out, **aot_store.STATS}))
"""


def test_two_concurrent_processes_build_once(tmp_path):
    env = {"ROOT": str(tmp_path / "cache"), "BUILD_LOG": str(tmp_path / "builds")}
    procs = [_run(_STORE_WORKER, env, wait=False) for _ in range(2)]
    res = [_finish(p) for p in procs]
    builders = (tmp_path / "builds").read_text().split()
    assert len(builders) == 1
    assert sorted(r["compiled"] for r in res) == [0, 1] and sorted(r["loaded"] for r in res) == [0, 1]
    assert res[0]["out"] == res[1]["out"] and res[0]["out"].startswith("object:rd_")
    (entry,) = json.loads((tmp_path / "cache" / "manifest.json").read_text())["entries"].values()
    assert entry["compiles"] == 1 and str(entry["pid"]) == builders[0]
    assert entry["key"] == {"kind": "toy", "n": 1}


def _toy_store(tmp_path):
    builds = []

    def build(path, symbol):
        builds.append(symbol)
        path.write_bytes(b"object:" + symbol.encode())

    return aot_store.KernelStore(tmp_path), build, builds


def test_corrupt_entry_is_detected_and_rebuilt(tmp_path):
    store, build, builds = _toy_store(tmp_path)
    key = {"kind": "toy", "n": 2}
    first = store.get_or_build(key, build, lambda p, s: p.read_bytes())
    (entry,) = store.manifest()["entries"].values()
    (tmp_path / entry["file"]).write_bytes(first[:-3] + b"XYZ")      # flipped bytes on disk
    with pytest.warns(UserWarning, match="corrupt"):
        again = store.get_or_build(key, build, lambda p, s: p.read_bytes())
    assert again == first and len(builds) == 2
    assert store.manifest()["entries"][aot_store.digest(key)]["compiles"] == 1   # re-recorded
    assert store.get_or_build(key, build, lambda p, s: p.read_bytes()) == first
    assert len(builds) == 2                                           # intact now: loaded


def test_entry_that_fails_to_load_is_rebuilt(tmp_path):
    store, build, builds = _toy_store(tmp_path)
    key, calls = {"kind": "toy", "n": 3}, []

    def flaky_load(p, s):   # e.g. an object the current loader cannot link: fails after the
        calls.append(1)     # build, then on the lock-free and the locked load of the next call
        if len(calls) <= 3:
            raise RuntimeError("cannot link")
        return p.read_bytes()

    with pytest.raises(RuntimeError):
        store.get_or_build(key, build, flaky_load)
    with pytest.warns(UserWarning, match="failed to load"):
        assert store.get_or_build(key, build, flaky_load).startswith(b"object:")
    assert len(builds) == 2


def test_corrupt_manifest_is_rebuilt(tmp_path):
    store, build, builds = _toy_store(tmp_path)
    store.get_or_build({"kind": "toy", "n": 4}, build, lambda p, s: p)
    store.manifest_path.write_text("{not json")
    with pytest.warns(UserWarning, match="manifest"):
        store.get_or_build({"kind": "toy", "n": 4}, build, lambda p, s: p)
    assert len(builds) == 2 and len(store.manifest()["entries"]) == 1


def test_bad_cache_dir_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(aot.KernelCacheError, match=str(blocker / "sub")):
        aot_store.cache_dir(blocker / "sub")


# ---- real CuTe DSL GEMV export/load (venv-cute) --------------------------------------------

_GEMV_WORKER = """
    import json, os, torch
    from raydecode.kernels import aot_store, gemv
    M, N, K = 1, 256, 512
    fn = gemv._compiled(torch.bfloat16, M, N, K, gemv.config_for(M, N, K))
    x, w, y = torch.randn(M, K).bfloat16(), torch.randn(N, K).bfloat16(), torch.empty(M, N).bfloat16()
    errors = []
    for args in ((x, w, y), (x, w)):     # the entry checks its ABI before any launch
        try:
            fn(*args)
            errors.append("launched")
        except Exception as e:
            errors.append(type(e).__name__ + ": " + str(e))
    print(json.dumps({"pid": os.getpid(), "type": type(fn).__name__, "errors": errors,
                      **aot_store.STATS}))
"""


@pytest.mark.skipif(not HAVE_CUTE, reason="nvidia-cutlass-dsl not installed (run in venv-cute)")
def test_cute_gemv_second_process_loads_without_compiling(tmp_path):
    env = {aot.ENV: str(tmp_path), "CUTE_DSL_ARCH": "sm_90a"}
    first = _run(_GEMV_WORKER, env)
    second = _run(_GEMV_WORKER, env)
    assert (first["compiled"], first["loaded"]) == (1, 0)
    assert (second["compiled"], second["loaded"]) == (0, 1)
    (entry,) = json.loads((tmp_path / "manifest.json").read_text())["entries"].values()
    assert entry["compiles"] == 1 and entry["pid"] == first["pid"] != second["pid"]
    assert entry["key"]["N"] == 256 and entry["key"]["arch"] == "sm_90a"
    # loaded entry has the compiled one's signature: same CUDA-device check, same arity check
    assert second["errors"] == first["errors"]
    assert "expected device_type=cuda" in first["errors"][0]
    assert second["type"] == "Function"      # a tvm_ffi.Function from the exported object


@pytest.mark.skipif(not HAVE_CUTE, reason="nvidia-cutlass-dsl not installed (run in venv-cute)")
def test_cute_gemv_concurrent_processes_compile_once_and_corruption_recovers(tmp_path):
    env = {aot.ENV: str(tmp_path), "CUTE_DSL_ARCH": "sm_90a"}
    res = [_finish(p) for p in [_run(_GEMV_WORKER, env, wait=False) for _ in range(2)]]
    assert sorted(r["compiled"] for r in res) == [0, 1]
    (entry,) = json.loads((tmp_path / "manifest.json").read_text())["entries"].values()
    assert entry["compiles"] == 1
    obj = tmp_path / entry["file"]
    obj.write_bytes(obj.read_bytes()[:100])                     # truncated object file
    third = _run("import warnings; warnings.simplefilter('always')\n" + textwrap.dedent(_GEMV_WORKER), env)
    assert (third["compiled"], third["recompiled_corrupt"]) == (1, 1)
    assert third["errors"] == res[0]["errors"]


_WARM_WORKER = """
    import json, os, torch
    from pathlib import Path
    from raydecode.kernels import aot, aot_store, gemv
    M, N, K = 1, 256, 512
    cfg = gemv.config_for(M, N, K)
    items = tuple(aot.GemvItem(f"g_{o}", M, N, K, cfg, out_dtype=getattr(torch, o))
                  for o in ("bfloat16", "float32"))
    plan = aot.KernelPlan("toy", 1, (1,), "sm_90a", items, (), ())
    events = {}
    for root in (os.environ[aot.ENV], os.environ["OTHER_ROOT"]):   # via _compiled / direct
        events[root] = [(e["out_dtype"], e["action"]) for e in aot.warm(plan, Path(root))]
    gemv._compiled(torch.bfloat16, M, N, K, cfg, torch.float32)   # gemv_into's fp32-out kernel
    print(json.dumps({"events": events, **aot_store.STATS}))
"""


@pytest.mark.skipif(not HAVE_CUTE, reason="nvidia-cutlass-dsl not installed (run in venv-cute)")
def test_warm_compiles_each_out_dtype_as_its_own_kernel(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    env = {aot.ENV: str(a), "OTHER_ROOT": str(b), "CUTE_DSL_ARCH": "sm_90a"}
    first, second = _run(_WARM_WORKER, env), _run(_WARM_WORKER, env)
    for root in (a, b):
        assert first["events"][str(root)] == [["bfloat16", "compiled"], ["float32", "compiled"]]
        assert second["events"][str(root)] == [["bfloat16", "loaded"], ["float32", "loaded"]]
        entries = json.loads((root / "manifest.json").read_text())["entries"].values()
        assert sorted(e["key"]["out_dtype"] for e in entries) == ["bfloat16", "float32"]
    # the warmed fp32-out kernel is the one gemv_into asks for: no compile in either process
    # beyond the 2 × 2 warm builds of the first
    assert (first["compiled"], first["loaded"]) == (4, 0)
    assert (second["compiled"], second["loaded"]) == (0, 4)


def test_plan_k3_lists_the_fused_ffn_out_kernel_where_the_block_launches_it():
    """The fused MoE block's ffn_out GEMV with the norm + SiTU prologue (gemv_norm_situ.shape_ok:
    one token, ≤ 640 columns): K3 TP16 at M = 1 only; TP8 (1216 columns) runs the pair."""
    cfg = load_config("k3")
    p16 = aot.plan_kernels(cfg, 16, (1, 2), "sm_90a")
    assert [(f.M, f.N, f.K, f.D, f.n_cols, f.I, f.gu_stride, f.has_lin) for f in p16.fused] == \
        [(1, 7168, 640, 3584, 224, 384, 1048, True)]
    assert p16.fused[0].config == config_for(1, 7168, 640)
    assert any("ffn_out_norm_situ" in line for line in p16.describe())
    assert aot.plan_kernels(cfg, 8, (1, 2), "sm_90a").fused == ()
    assert aot.plan_kernels(cfg, 16, (1,), "sm_90a", path="stock").fused == ()


_FUSED_WARM_WORKER = """
    import json, os, torch
    from pathlib import Path
    from raydecode.kernels import aot, aot_store, gemv, gemv_norm_situ as NS
    M, N, K, D, n, I, ys = 1, 256, 128, 512, 40, 48, 144
    item = aot.NormSituItem(M, N, K, D, n, I, ys, True, gemv.config_for(M, N, K))
    plan = aot.KernelPlan("toy", 1, (1,), "sm_90a", (), (), (), (item,))
    ev = [e["action"] for e in aot.warm(plan, Path(os.environ[aot.ENV]))]
    NS.compiled(M, N, K, D, n, I, ys, True, item.config)     # the launch path: no second build
    print(json.dumps({"events": ev, **aot_store.STATS}))
"""


def _warm_twice(worker: str, root: Path) -> dict:
    """Two processes warm one CuTe kernel into the cache at root: the first compiles it, the
    second loads it, neither builds it again at its launch path -> the one manifest entry."""
    env = {aot.ENV: str(root), "CUTE_DSL_ARCH": "sm_90a"}
    first, second = _run(worker, env), _run(worker, env)
    assert first["events"] == ["compiled"] and second["events"] == ["loaded"]
    assert (first["compiled"], second["compiled"], second["loaded"]) == (1, 0, 1)
    (entry,) = json.loads((root / "manifest.json").read_text())["entries"].values()
    return entry


@pytest.mark.skipif(not HAVE_CUTE, reason="nvidia-cutlass-dsl not installed (run in venv-cute)")
def test_warm_stores_the_fused_kernel_once_per_node(tmp_path):
    entry = _warm_twice(_FUSED_WARM_WORKER, tmp_path)
    assert entry["key"]["kind"] == "cute_gemv_norm_situ" and entry["key"]["gu_stride"] == 144


# ---- real offline Triton compile (venv-triton) ---------------------------------------------

@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed (run in venv-triton)")
def test_triton_offline_compile_fills_shared_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    plan = aot.plan_kernels(load_config("tiny"), 1, (1,), "sm_90a")
    plan = aot.KernelPlan(plan.model, 1, (1,), "sm_90a", (), plan.triton, ())
    first = aot.warm(plan, tmp_path)
    entries = sorted(p.name for p in (tmp_path / "triton").iterdir())
    second = aot.warm(plan, tmp_path)
    assert [e["action"] for e in first] == ["compiled"] * 2
    assert [e["action"] for e in second] == ["loaded"] * 2
    assert len(entries) == 2 and sorted(p.name for p in (tmp_path / "triton").iterdir()) == entries
    cubins = list((tmp_path / "triton").rglob("*.cubin"))
    assert len(cubins) == 2 and all(c.stat().st_size > 0 for c in cubins)
    meta = json.loads(next((tmp_path / "triton").rglob("_route_topk_kernel.json")).read_text())
    assert meta["target"]["arch"] == 90


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed (run in venv-triton)")
def test_offline_compile_sets_the_knobs_this_tritons_launch_sets():
    """compile_kernel mirrors JITFunction.run's knob kwargs as read off this Triton's source
    (3.6 on the H200 host lacks a knob 3.9 has; reading it unconditionally raised there)."""
    from triton import knobs

    from raydecode.kernels.aot_triton import _run_compilation_knobs

    pairs = _run_compilation_knobs()
    assert ("instrumentation_mode", "instrumentation_mode") in pairs
    assert all(hasattr(knobs.compilation, knob) for _, knob in pairs)


def test_plan_k3_tp16_lists_the_resident_moe_the_dispatch_builds():
    """The resident MoE kernel where `moe_decode` serves the experts with it (K3 TP16, M = 1):
    the same plan `moe_decode.resident_plan` builds on a 132-SM GPU (fp32 z from
    the fused block, the config's SiTU betas, the served predecode), so the launch hits the
    warmed entry; nothing at TP8, on the stock path, or without an SM count and a GPU."""
    from types import SimpleNamespace

    from raydecode.kernels import moe_resident_cute as R
    from raydecode.kernels.settings import DEFAULT_OPTIONS

    cfg = load_config("k3")
    (item,) = aot.plan_kernels(cfg, 16, (1, 2), "sm_90a", sm_count=132).moe
    experts = SimpleNamespace(num_experts=896, intermediate=192, latent=3584,
                              beta=cfg.situ_beta, linear_beta=cfg.situ_linear_beta)
    assert item.plan == R.plan_for(torch.zeros(1, 3584), torch.zeros(1, 16), experts, ctas=132,
                                   predecode=DEFAULT_OPTIONS.moe_resident_predecode)
    assert aot.plan_kernels(cfg, 8, (1, 2), "sm_90a", sm_count=132).moe == ()
    assert aot.plan_kernels(cfg, 16, (1,), "sm_90a", path="stock", sm_count=132).moe == ()
    if not torch.cuda.is_available():
        plan = aot.plan_kernels(cfg, 16, (1,), "sm_90a")
        assert plan.moe == () and [s[0] for s in plan.skipped if "SM count" in s[4]] == \
            ["moe_resident"]


_MOE_WARM_WORKER = """
    import json, os
    from pathlib import Path
    from raydecode.kernels import aot, aot_store, moe_resident_cute as R
    plan = R.ResidentMoEPlan(tokens=1, top_k=4, num_experts=8, intermediate=64, latent=512,
                             ctas=4, warps=4, beta=4.0, linear_beta=25.0)
    kp = aot.KernelPlan("toy", 1, (1,), "sm_90a", (), (), (), (), (aot.ResidentMoEItem(plan),))
    ev = [e["action"] for e in aot.warm(kp, Path(os.environ[aot.ENV]))]
    R.compiled(plan)                                      # the launch path: no second build
    print(json.dumps({"events": ev, **aot_store.STATS}))
"""


@pytest.mark.skipif(not HAVE_CUTE, reason="nvidia-cutlass-dsl not installed (run in venv-cute)")
def test_warm_stores_the_resident_moe_once_per_node(tmp_path):
    entry = _warm_twice(_MOE_WARM_WORKER, tmp_path)
    assert entry["key"]["kind"] == "cute_moe_resident" and entry["key"]["plan"]["ctas"] == 4
