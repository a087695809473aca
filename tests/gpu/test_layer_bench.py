"""The layer benchmark's decode step (stock and specialized) equals the model's K3DecoderLayer,
and specialized equals stock, within bf16 tolerance, on the GPU (needs CUDA + Triton).

scripts/bench/layer_check.py builds the model layer at TP = 1 on a small K3-architecture config,
runs one decode step through the Python reference and through both benchmark variants over the
same weights and state (fresh seed per run), and reports relative errors of the attention
input and output, the MoE on one input, the layer's prefix update and the updated caches.
"""
from __future__ import annotations


import pytest
import torch

from raydecode.kernels import moe_mxfp4

from _numerics import fresh_seed

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and moe_mxfp4.triton is not None),
                                reason="needs CUDA and Triton")


@pytest.mark.parametrize("kind", ["kda", "mla"])
@pytest.mark.parametrize("batch", [1, 5])
def test_step_matches_model_layer(kind, batch):
    from raydecode.scripts.bench.layer_check import TOL, check_layer

    seed = fresh_seed()
    r = check_layer(kind, batch=batch, context=48, seed=seed, device="cuda")
    msg = f"seed {seed}: {r['errors']} flips {r['routing_flips']}"
    for variant in ("stock", "specialized"):
        for what, err in r["errors"][variant].items():
            assert err <= TOL[what], f"{variant} {what}: {msg}"
    assert r["errors"]["specialized_vs_stock"] <= TOL["specialized_vs_stock"], msg
    assert r["ok"], msg
