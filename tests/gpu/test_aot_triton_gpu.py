"""The Triton half of the kernel plan on a GPU: after `aot.warm` compiled the plan's Triton specs
offline into a fresh cache, the real launches of the served K3 TP16 step (the router top-k and
the fused MoE block's latent norm + SiTU, at rank 0's shapes and strides) find their kernels
there: a second process launching them writes no kernel (cubin) to the Triton cache, as a JIT
compile would, and the results match the references. Needs CUDA + Triton."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _numerics import fresh_seed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

LAUNCH = r"""
import json, sys, torch
from raydecode.kernels.decode_elementwise_triton import latent_norm_situ, latent_norm_situ_reference
from raydecode.kernels.router import route_topk, route_topk_reference
from raydecode.models.params import decode_gemv_shapes
from raydecode.scripts.bench.step import load_config
cfg = load_config("k3")
sh = decode_gemv_shapes(cfg, 16, "specialized")
g = torch.Generator(device="cuda").manual_seed(int(sys.argv[1]))
E, D = cfg.moe.num_experts, cfg.moe.latent_size
logits = torch.randn(1, E, device="cuda", generator=g)
bias = torch.randn(E, device="cuda", generator=g) * 0.1
w, ids = route_topk(logits, bias, cfg.moe.top_k, True, 1.0)
rw, rids = route_topk_reference(logits, bias, cfg.moe.top_k, True, 1.0)
nz, I = sh["latent_down"][0], sh["shared_gate"][0]
y = torch.randn(1, sh["h2_proj"][0], device="cuda", generator=g)     # the h2 GEMV's fp32 out
lat = torch.randn(1, D, device="cuda", generator=g)
nw = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(torch.bfloat16)
gu = y[:, sh["router"][0] + nz:]
out = torch.full((1, sh["ffn_out"][1]), float("nan"), device="cuda", dtype=torch.bfloat16)
latent_norm_situ(lat, nw, cfg.rms_norm_eps, 0, nz, gu, cfg.situ_beta, cfg.situ_linear_beta, out)
ref = latent_norm_situ_reference(lat, nw, cfg.rms_norm_eps, 0, nz, gu, cfg.situ_beta,
                                 cfg.situ_linear_beta, out.shape[1])
torch.cuda.synchronize()
print("RESULT " + json.dumps({
    "ids_equal": bool(torch.equal(ids.sort(-1).values, rids.sort(-1).values)),
    "w_err": (w.sort(-1).values - rw.sort(-1).values).abs().max().item(),
    "over_1ulp": int(((out.float() - ref.float()).abs()
                      > ref.float().abs() * 2 ** -7 + 1e-30).sum()),
    "finite": bool(torch.isfinite(out).all())}))
"""


def _entries(root: Path) -> set[str]:
    return {p.name for p in root.iterdir()} if root.exists() else set()


def test_warmed_specs_serve_the_launches_without_a_jit_compile(tmp_path):
    from raydecode.kernels import aot
    from raydecode.scripts.bench.step import load_config

    plan = aot.plan_kernels(load_config("k3"), 16, (1,), aot.current_arch())
    assert {t.name for t in plan.triton} == {"route_topk", "latent_norm_situ"}
    triton_only = aot.KernelPlan(plan.model, 16, (1,), plan.arch, (), plan.triton, ())
    aot.warm(triton_only, tmp_path)
    tdir = tmp_path / "triton"
    before = _entries(tdir)
    assert len(before) >= 2
    seed = fresh_seed()
    env = {**os.environ, "TRITON_CACHE_DIR": str(tdir)}
    r = subprocess.run([sys.executable, "-c", LAUNCH, str(seed)], env=env, capture_output=True,
                       text=True, timeout=300)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stderr[-3000:]
    res = json.loads(line[0][len("RESULT "):])
    # a JIT compile writes the kernel's cubin; Triton's launcher stubs (.so, first use per
    # process and signature) may land in the cache dir too and are not kernels
    new = {p.name for e in _entries(tdir) - before for p in (tdir / e).iterdir()}
    assert not [f for f in new if f.endswith(".cubin")], f"launches JIT-compiled: {sorted(new)}"
    assert res["ids_equal"] and res["w_err"] < 1e-5, (seed, res)
    assert res["finite"] and res["over_1ulp"] == 0, (seed, res)      # ≤ 1 bf16 ulp each
