"""Prefix caching and n > 1 forks on one CUDA GPU: the tiny K3 model in bf16 behind a
GraphedRunner whose decode buckets are captured (the plan's KDA state and latent block copies
run in `update_caches` before each replay). A follow-up that resumes at the first turn's
prompt end (same chunks with and without caching: budget = the first prompt's length) must
give the logprobs of the recomputed run, and the forks of an n = 2 request its parent's. Not
run in CI; the CPU twin is tests/cpu/test_prefix_cache.py (bit for bit there).

Tolerances, not bit equality, as tests/gpu/test_step_graph_gpu.py: the MoE decode kernels sum
with fp32 atomics, whose order varies run to run, so only the first generated token's top-20
logprobs are compared (later greedy tokens may part on near-ties of random weights)."""
from __future__ import annotations

import random

import pytest
import torch

from raydecode.engine.engine import EngineConfig, LLMEngine, LocalExecutor
from raydecode.engine.loader import load_tokenizer
from raydecode.engine.request import SamplingParams
from raydecode.engine.step_graph import GraphedRunner, graph_cache_sizes
from raydecode.models.config import load_config
from raydecode.models.k3 import K3ForCausalLM, init_random_, make_caches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BF = torch.bfloat16
TOL = 3e-2
BUCKETS = (1, 2, 4)


@pytest.fixture(scope="module")
def model():
    with torch.device("cuda"):
        return init_random_(K3ForCausalLM(load_config("tiny"), dtype=BF), seed=5)


class Specialized:
    def __init__(self, inner):
        self.inner = inner

    def execute(self, plan):
        if plan.batch.is_decode_only and all(s.pos > 0 for s in plan.batch.seqs):
            plan.path = "specialized"
        return self.inner.execute(plan)


def engine(model, caching: bool, budget: int) -> tuple[LLMEngine, GraphedRunner]:
    ecfg = EngineConfig(max_num_seqs=4, max_model_len=512, block_size=16,
                        max_num_batched_tokens=budget, enable_prefix_caching=caching,
                        num_snapshots=4 if caching else 0)
    ns, nb = graph_cache_sizes(4, ecfg.blocks, BUCKETS)
    caches = make_caches(model.cfg, model.par, ns, nb, 16, BF, device="cuda",
                         num_snapshots=ecfg.num_snapshots)
    runner = GraphedRunner(model, caches, "cuda", num_slots=4, num_blocks=ecfg.blocks,
                           buckets=BUCKETS)
    assert runner.support[0], runner.support[1]
    runner.capture_all()
    return LLMEngine(Specialized(LocalExecutor(runner)), load_tokenizer("tiny"), ecfg,
                     eos_ids=()), runner


def first_logprobs(out) -> torch.Tensor:
    lp, tops = out.logprobs[0]
    return torch.tensor([v for _, v in tops])


def run(eng, prompts, params, forks=()):
    reqs = [eng.add_request(p, params, forks=f) for p, f in zip(prompts, forks or [()] * 9)]
    first = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = o
    return reqs, first


def test_restored_turn_and_forks_match_recompute(model):
    rng = random.Random(29)
    turn1 = [rng.randrange(3, 490) for _ in range(160)]
    follow = [rng.randrange(3, 490) for _ in range(24)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=20)
    got = {}
    for caching in (True, False):
        eng, runner = engine(model, caching, budget=len(turn1))
        run(eng, [turn1], params)
        (r2,), first = run(eng, [turn1 + follow], params)
        got[caching] = first[r2.request_id]
        assert r2.cached_prompt_tokens == (len(turn1) if caching else 0)
        assert runner.counts["graphed"] > 0
    a, b = got[True], got[False]
    assert a.new_token_ids == b.new_token_ids
    rel = float((first_logprobs(a) - first_logprobs(b)).abs().max())
    assert rel < TOL, rel
    # n = 2 on the graphed engine: both samples' first tokens come from the parent's row
    eng, runner = engine(model, True, budget=64)
    (parent,), first = run(eng, [turn1], params, forks=[["p#1"]])
    assert eng.cache_stats()["forks"] == 1
    assert first[parent.request_id].new_token_ids == first["p#1"].new_token_ids
    assert torch.equal(first_logprobs(first[parent.request_id]), first_logprobs(first["p#1"]))
    assert len(eng.requests["p#1"].output_ids) == 8 and runner.counts["graphed"] > 0
