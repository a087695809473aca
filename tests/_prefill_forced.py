"""Shared by tests/gpu/test_prefill_greedy_gpu.py and tests/cpu/test_prefill_greedy_harness.py:
one prompt prefilled by a Scheduler at a small step budget (several chunks), then N greedy
decode steps, on a ModelRunner of its own; optionally teacher-forced (every emitted token is
the given one, whatever the step's argmax), every position's argmax and top-2 logit gap
recorded."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from raydecode.engine.request import Request, SamplingParams
from raydecode.engine.runner import ModelRunner
from raydecode.engine.scheduler import Scheduler, SchedulerConfig
from raydecode.models.config import load_config
from raydecode.models.k3 import K3ForCausalLM, init_random_, make_caches

BUDGET = 96          # tokens per step: the prompts below take 2–3 chunks
BLOCK = 16
TIE = 0.15           # top-2 logit gap below which the prefill kernels' rounding may flip it
TOL = 3e-2           # first-token logits, ‖Δ‖ / ‖ref‖ (bf16 prefill kernels vs fp32 einsums)
PROMPT_LENS = (200, 131, 97)


@dataclass
class Forced:
    tokens: list[int] = field(default_factory=list)     # what was emitted (forced or argmax)
    argmax: list[int] = field(default_factory=list)     # what each step's logits picked
    gaps: list[float] = field(default_factory=list)     # top-2 logit gap of each step
    first_logits: torch.Tensor | None = None            # the prefill's last row


def run_forced(model: K3ForCausalLM, prompt: list[int], n: int,
               forced: list[int] | None = None, budget: int = BUDGET) -> Forced:
    """The prompt through `budget`-token chunks, then n decode steps (stock path both)."""
    dev = next(model.parameters()).device
    blocks = -(-(len(prompt) + n + 1) // BLOCK)
    caches = make_caches(model.cfg, model.par, 1, blocks, BLOCK, model.dtype, device=dev)
    runner = ModelRunner(model, caches, dev)
    sch = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=budget,
                                    num_blocks=blocks, block_size=BLOCK))
    req = Request(list(prompt), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    sch.add(req)
    out = Forced()
    with torch.inference_mode():
        while len(req.output_ids) < n:
            plan = sch.schedule()
            logits = runner.logits(plan)
            req.num_cached += plan.batch.seqs[0].length
            if req.num_cached < req.num_tokens:          # an inner prefill chunk: no token
                continue
            row = logits[-1].float()
            top = row.topk(2)
            a = int(top.indices[0])
            if out.first_logits is None:
                out.first_logits = row.cpu()
            tok = a if forced is None else forced[len(req.output_ids)]
            out.argmax.append(a)
            out.gaps.append(float(top.values[0] - top.values[1]))
            out.tokens.append(tok)
            req.output_ids.append(tok)
    sch.finish(req)
    return out


def _prompts(ids: range, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(ids.start, ids.stop) for _ in range(n)] for n in PROMPT_LENS]


def tiny_model(device: str) -> tuple[K3ForCausalLM, list[list[int]]]:
    """The tiny K3 config in bf16, random weights (seed 5), and three random prompts."""
    with torch.device(device):
        model = init_random_(K3ForCausalLM(load_config("tiny"), dtype=torch.bfloat16), seed=5)
    return model, _prompts(range(model.cfg.vocab_size), 11)


def k3_slice(device: str, layers: int = 4) -> tuple[K3ForCausalLM, list[list[int]]]:
    """K3's first `layers` layers at rank 0's TP16 shapes (solo rank, random weights) and three
    prompts on the rank's vocab rows (any other id embeds as zeros on a solo rank)."""
    from raydecode.scripts.bench.step import build_model, layer_config, rank_vocab_rows

    model, _ = build_model(layer_config("k3", layers), 16, device, seed=3)
    return model, _prompts(rank_vocab_rows(model), 12)
