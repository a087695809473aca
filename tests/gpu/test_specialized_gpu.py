"""The specialized step on one CUDA GPU (TP = 1): the kernels/ dispatch (CuTe GEMV where
nvidia-cutlass-dsl is installed, the references elsewhere) gives the stock step's logits and
cache contents. Not run in CI; needs a CUDA device."""
import dataclasses

import pytest
import torch

from raydecode.kernels._cute import cute_available
from raydecode.models import moe
from raydecode.models.cache import SeqSlice, StepBatch
from raydecode.models.config import load_config
from raydecode.models.k3 import K3ForCausalLM, init_random_, make_caches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_specialized_step_equals_stock_on_cuda(dtype, tol, monkeypatch):
    # the unfused MoE block: the fused one re-associates a sum, and is compared with an fp32
    # twin instead (tests/cpu/test_moe_fused.py, which runs on CUDA on a GPU host)
    monkeypatch.setattr(moe, "FUSED_SPECIALIZED", False)
    # top_k = num_experts: with top-2 the packed KDA in_proj GEMV (another cuBLAS summation
    # order) flipped a near-tie routing choice: fp32 1.0e-3, bf16 3.9e-2 (H200, 32b7531)
    cfg = load_config("tiny")
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, top_k=cfg.moe.num_experts))
    with torch.device("cuda"):
        model = init_random_(K3ForCausalLM(cfg, dtype=dtype), seed=5)
    toks = torch.randint(0, cfg.vocab_size, (12,), device="cuda")
    logits, caches = {}, {}
    with torch.inference_mode():
        for path in ("stock", "specialized"):
            c = caches[path] = make_caches(cfg, model.par, 2, 8, 4, dtype, device="cuda")
            c.mla.block_tables[0] = [5, 1, 7, 3]
            outs = [model(toks[:7], StepBatch([SeqSlice(0, 0, 7, 0)]), c, path)]
            outs += [model(toks[t:t + 1], StepBatch.decode([0], [t]), c, path)
                     for t in range(7, 12)]
            logits[path] = model.compute_logits(torch.cat(outs))
    rel = float((logits["specialized"] - logits["stock"]).abs().max()
                / logits["stock"].abs().max())
    assert rel < tol, (rel, "cute" if cute_available() else "reference")
    s, p = caches["stock"].kda.rec, caches["specialized"].kda.rec
    assert float((p - s).abs().max() / s.abs().max()) < tol
