"""The CuTe norm + SiTU + ffn_out GEMV (kernels/gemv_norm_situ.py) without a GPU: its dispatch
declines what it cannot serve, bad shapes are named, and (where nvidia-cutlass-dsl imports:
a venv with nvidia-cutlass-dsl, `CUTE_DSL_ARCH=sm_90a`) the K3 kernels compile to the intended code. The
numerics run on the GPU host: tests/gpu/test_ffn_gemv.py (every case once per form) and
tests/cpu/test_moe_fused.py on CUDA (the fused MoE block)."""
from __future__ import annotations

import os
import re

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")        # before cutlass is imported

from raydecode.kernels import gemv as G  # noqa: E402
from raydecode.kernels import gemv_norm_situ as NS  # noqa: E402

K3_TP16 = dict(M=1, N=7168, K=640, D=3584, n_cols=224, I=384, gu_stride=1048)


def test_dispatch_declines_cpu_tensors():
    lat, gu = torch.randn(1, 256), torch.randn(1, 1000)[:, 904:]
    w, W = torch.ones(256, dtype=torch.bfloat16), torch.zeros(72, 96, dtype=torch.bfloat16)
    assert NS.supports(lat, w, 36, gu, W) is False


@pytest.mark.parametrize("D,n,I,K,what", [(254, 36, 48, 96, "D=254"), (256, 60, 48, 96, "n=60"),
                                          (256, 300, 0, 512, "n=300")])
def test_bad_shapes_are_named(D, n, I, K, what):
    with pytest.raises(ValueError, match=what):
        NS.NormSituGemvKernel(1, 72, K, G.config_for(1, 72, K), D, n, I, True)


def _sass(M, w_dtype, tmp_path):
    if G.cute is None:
        pytest.skip("nvidia-cutlass-dsl not importable (CI venv): compile checks need nvidia-cutlass-dsl")
    s = dict(K3_TP16, M=M)
    cfg = G.config_for(M, s["N"], s["K"])
    c = NS.compile_norm_situ_gemv(s["M"], s["N"], s["K"], s["D"], s["n_cols"], s["I"],
                                  s["gu_stride"], True, cfg, w_dtype,
                                  extra_options=f"--keep-sass --dump-dir={tmp_path}")
    return [ln for ln in (c.__sass__ or "").splitlines() if re.match(r"\s*/\*[0-9a-f]{4}\*/", ln)]


@pytest.mark.parametrize("M,w_dtype", [(1, torch.bfloat16), (2, torch.float32)])
def test_k3_kernel_streams_w_before_the_wait_and_reads_x_from_shared_memory(M, w_dtype, tmp_path):
    ins = _sass(M, w_dtype, tmp_path)
    wait = next(i for i, ln in enumerate(ins) if "ACQBULK" in ln)        # griddepcontrol.wait
    first_w = next(i for i, ln in enumerate(ins) if "LDG.E.128" in ln)
    assert first_w < wait                    # W's first batch in flight before the PDL wait
    assert not any(re.search(r"\b(LDL|STL)\b", ln) for ln in ins)      # no local memory
    assert sum("LDS.128" in ln for ln in ins) >= 1                     # x from shared memory
    assert sum("BAR.SYNC" in ln for ln in ins) >= 2                    # Σ exchange, a written
