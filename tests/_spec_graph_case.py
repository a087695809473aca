"""Shared by tests/cpu/test_spec_graph.py and tests/gpu/test_spec_graph_gpu.py: the tiny K3
model in bf16, a non-speculative engine on a GraphedRunner against a speculating engine on
engine/spec_graph.py's graphs (specialized path for every decode-only step, as the envelope
picks it), the drafter a bigram table of the first prompt's greedy continuation (high
acceptance there, partial rejections elsewhere)."""
from __future__ import annotations

import torch

from raydecode.engine.engine import EngineConfig, LLMEngine, LocalExecutor
from raydecode.engine.loader import load_tokenizer
from raydecode.engine.request import SamplingParams
from raydecode.engine.spec_engine import SpecConfig, SpecEngine
from raydecode.engine.spec_runner import graphed_spec_runner
from raydecode.engine.step_graph import GraphedRunner, graph_cache_sizes
from raydecode.models.config import load_config
from raydecode.models.dspark import load_dspark_config, parse_dspark_config
from raydecode.models.dspark_checkpoint import build_drafter
from raydecode.models.k3 import K3ForCausalLM, init_random_, make_caches

from _matched_drafter import matched_tensors

BF = torch.bfloat16
PROMPTS = ["The river ran past the old mill", "def f(x):", "one two three"]


class SpecializedDecode(LocalExecutor):
    """Decode-only and verify steps on the specialized path (the envelope's choice)."""

    def execute(self, plan):
        spec = getattr(plan, "spec_k", None) is not None
        if plan.decode_only if spec else plan.batch.is_decode_only:
            plan.path = "specialized"
        return super().execute(plan)


def plain_greedy(target, tok, ecfg, prompts, params, device="cpu", capture=None):
    """Greedy ids of `prompts` through a non-speculative GraphedRunner (specialized decode)."""
    ns, nb = graph_cache_sizes(ecfg.max_num_seqs, ecfg.blocks)
    plain = GraphedRunner(target, make_caches(target.cfg, target.par, ns, nb, ecfg.block_size,
                                              BF, device=device), device,
                          num_slots=ecfg.max_num_seqs, num_blocks=ecfg.blocks, capture=capture)
    return [o.output_ids for o in LLMEngine(SpecializedDecode(plain), tok, ecfg,
                                            (target.cfg.eos_token_id,)).generate(prompts, params)]


def spec_engine_on_graphs(target, drafter, tok, ecfg, k, device="cpu", capture=None,
                          at_build=False):
    """-> (SpecEngine, its SpecRunner on engine/spec_graph.py's graphs). at_build: the spec
    graphs of every bucket at k captured (CUDA; on the CPU warmed) before the first request,
    as the rank build does (`runner.built`: the keys captured)."""
    ns, nb = graph_cache_sizes(ecfg.max_num_seqs, ecfg.blocks)
    caches = make_caches(target.cfg, target.par, ns, nb, ecfg.block_size, BF, device=device,
                         extra_mla_layers=drafter.cfg.num_layers)
    runner = graphed_spec_runner(target, caches, drafter, device, ecfg.max_num_seqs,
                                 ecfg.blocks, auto=False, capture=capture)
    if at_build:
        runner.built = runner.graphs.capture_all(k)
    return SpecEngine(SpecializedDecode(runner), tok, ecfg, (target.cfg.eos_token_id,),
                      SpecConfig(k, None)), runner


def run_case(device: str, k: int = 4, max_tokens: int = 40, capture: bool | None = None,
             at_build: bool = False):
    """-> (non-speculative ids, speculative ids, spec runner, engine); at_build as
    `spec_engine_on_graphs`."""
    with torch.device(device):
        target = init_random_(K3ForCausalLM(load_config("tiny"), dtype=BF), seed=5)
    tok = load_tokenizer("tiny")
    ecfg = EngineConfig(max_num_seqs=4, max_model_len=256, block_size=8)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ref = plain_greedy(target, tok, ecfg, PROMPTS, params, device, capture)
    dcfg = parse_dspark_config(load_dspark_config("tiny").raw
                               | {"markov_rank": target.cfg.vocab_size}, name="tiny-markov")
    drafter = build_drafter(dcfg, target, tensors=matched_tensors(dcfg, ref[0]), dtype=BF,
                            device=device)
    engine, runner = spec_engine_on_graphs(target, drafter, tok, ecfg, k, device, capture,
                                           at_build)
    got = [o.output_ids for o in engine.generate(PROMPTS, params)]
    return ref, got, runner, engine
