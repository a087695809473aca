"""DSpark speculative decoding on a CUDA device (not run in CI): the rank-side runner keeps its
tensors on the GPU (drafts, rollback, taps) and host-side sampling works across devices."""
from __future__ import annotations

import pytest
import torch

from raydecode.engine.engine import EngineConfig, LLMEngine, LocalExecutor
from raydecode.engine.loader import load_shard, load_tokenizer
from raydecode.engine.request import SamplingParams
from raydecode.engine.runner import ModelRunner
from raydecode.engine.spec_engine import SpecConfig, SpecEngine
from raydecode.engine.spec_runner import SpecShardSpec, load_spec_runner
from raydecode.models.parallel import LocalComm, Parallel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PROMPTS = ["The river ran past the old mill", "hello"]


def _engines(dtype: str):
    ecfg = EngineConfig(max_num_seqs=4, max_model_len=256, block_size=16)
    tok = load_tokenizer("tiny")
    shard = load_shard("tiny", dtype=dtype, device="cuda", num_slots=4, num_blocks=ecfg.blocks,
                       block_size=16)
    eos = (shard.cfg.eos_token_id,)
    stock = LLMEngine(LocalExecutor(ModelRunner(shard.model, shard.caches, "cuda")), tok, ecfg,
                      eos)
    runner = load_spec_runner(SpecShardSpec("tiny", "tiny", dtype, 4, ecfg.blocks, 16),
                              Parallel(), LocalComm(), "cuda")
    return stock, SpecEngine(LocalExecutor(runner), tok, ecfg, eos, SpecConfig(5))


def test_greedy_speculative_equals_stock_on_cuda():
    stock, spec = _engines("float32")
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    ref = [r.output_ids for r in stock.generate(PROMPTS, params)]
    assert [r.output_ids for r in spec.generate(PROMPTS, params)] == ref
    assert spec.executor.runner.caches.kda.rec.is_cuda
    assert 1.0 <= spec.metrics()["mean_acceptance_length"] <= 6.0


def test_sampled_speculative_decoding_runs_on_cuda_bf16():
    _, spec = _engines("bfloat16")
    reqs = spec.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9,
                                                 seed=1, ignore_eos=True))
    assert [len(r.output_ids) for r in reqs] == [24, 24]
    assert spec.acceptance.steps > 0
