"""The node kernel cache on a GPU (needs CUDA + nvidia-cutlass-dsl): a GEMV compiled and stored
by one process is loaded by a second one WITHOUT compiling, launches, matches the fp64
reference, and replays inside a CUDA graph; the fused norm + SiTU ffn_out kernel is stored,
reloaded and checked the same way (docs/KERNEL_CACHE.md; the CPU half of these checks is
tests/cpu/test_kernels_aot.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from raydecode.kernels._cute import cute_available

from _numerics import fresh_seed

pytestmark = pytest.mark.skipif(not cute_available(), reason="needs CUDA and nvidia-cutlass-dsl")

CHILD = r"""
import json, os, sys, torch
from raydecode.kernels import gemv as G
from raydecode.kernels.aot_store import STATS
seed = int(sys.argv[1])
g = torch.Generator(device="cuda").manual_seed(seed)
out = {}
for (M, N, K) in [(1, 1152, 1536), (2, 896, 7168)]:
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(torch.bfloat16)
    y = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    G.gemv(x, w, out=y)
    ref = x.double() @ w.double().t()
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        G.gemv(x, w, out=y)
    x.copy_(torch.randn(M, K, device="cuda", generator=g))
    y.fill_(float("nan"))
    gr.replay()
    torch.cuda.synchronize()
    ref2 = x.double() @ w.double().t()
    rel2 = ((y.double() - ref2).norm() / ref2.norm()).item()
    out[f"{M}x{N}x{K}"] = [rel, rel2]
# the fused norm + SiTU ffn_out kernel (K3 TP16 shapes) through the same cache
from raydecode.kernels import gemv_norm_situ as NS
D, n, I, N, K, lead = 3584, 224, 384, 7168, 640, 280
lat = 3 * torch.randn(1, D, device="cuda", generator=g)
nw = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(torch.bfloat16)
y = 4 * torch.randn(1, lead + 2 * I, device="cuda", generator=g)
W = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(torch.bfloat16)
o = torch.full((1, N), float("nan"), device="cuda", dtype=torch.bfloat16)
assert NS.supports(lat, nw, n, y[:, lead:], W, o)
NS.norm_situ_gemv_cute(lat, nw, 1e-5, 0, n, y[:, lead:], 4.0, 25.0, W, o)
ref = NS.norm_situ_gemv_reference(lat, nw, 1e-5, 0, n, y[:, lead:], 4.0, 25.0, W)
out["fused"] = [((o.double() - ref.double()).norm() / ref.double().norm()).item()] * 2
print("RESULT " + json.dumps({"rel": out, "stats": STATS}))
"""


def _child(cache: str, seed: int) -> dict:
    env = {**os.environ, "RAYDECODE_KERNEL_CACHE": cache}
    r = subprocess.run([sys.executable, "-c", CHILD, str(seed)], env=env, capture_output=True,
                       text=True, timeout=300)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stderr[-3000:]
    return json.loads(line[0][len("RESULT "):])


def test_second_process_loads_and_runs_without_compiling(tmp_path):
    seed = fresh_seed()
    first = _child(str(tmp_path), seed)
    second = _child(str(tmp_path), seed + 1)
    assert first["stats"]["compiled"] == 3 and first["stats"]["loaded"] == 0, first
    assert second["stats"]["compiled"] == 0 and second["stats"]["loaded"] == 3, second
    for run in (first, second):
        for shape, (rel, rel_graph) in run["rel"].items():
            assert rel < 4e-3 and rel_graph < 4e-3, f"seed {seed} {shape}: {run}"
