"""Shared by tests/gpu/test_prefill_greedy_gpu.py and tests/cpu/test_prefill_greedy_harness.py:
one prompt prefilled by a Scheduler at a small step budget (several chunks), then N greedy
decode steps, on a ModelRunner of its own; optionally teacher-forced (every emitted token is
the given one, whatever the step's argmax), every position's argmax and top-2 logit gap
recorded."""
from __future__ import annotations

import copy
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
# fp32 bounds. fla's chunked KDA runs its dots in TF32 (inputs rounded to 11 significant bits),
# so in an fp32 model any 1e-7 input difference can move a TF32 operand by 5e-4 and the logits
# by up to ~1e-2 after a few layers: on an H200 two correct fp32 stock paths that differ only in
# the AttnRes summation order were 0.4–0.9 % apart on the logits with fla in the loop (3e-6 on
# the CPU, no TF32). A lost state hand-over moves them by ≥ 0.1 (tests/cpu/
# test_prefill_greedy_harness.py).
# Gaps are in units of the logit row's standard deviation (the tiny model's rows: σ ≈ 1.0 on
# the CPU), since the paths' noise is relative to the logits' scale.
TIE_FP32 = 0.1       # top-2 gap (in σ of the row) below which an fp32 argmax may flip
TOL_FP32 = 2e-2      # first-token logits ‖Δ‖ / ‖ref‖, fp32 kernel path vs fp32 reference
PROMPT_LENS = (200, 131, 97)


@dataclass
class Forced:
    tokens: list[int] = field(default_factory=list)     # what was emitted (forced or argmax)
    argmax: list[int] = field(default_factory=list)     # what each step's logits picked
    gaps: list[float] = field(default_factory=list)     # top-2 gap / row std, per step
    first_logits: torch.Tensor | None = None            # the prefill's last row
    rows: list[torch.Tensor] = field(default_factory=list)   # every position's logits (CPU)


def run_forced(model: K3ForCausalLM, prompt: list[int], n: int,
               forced: list[int] | None = None, budget: int = BUDGET) -> Forced:
    """The prompt through `budget`-token chunks, then n decode steps (stock path both)."""
    dev = next(model.parameters()).device
    tp = model.par.tp_size
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
            if tp > 1:      # a solo rank's all-gather repeats its vocab shard tp times
                row = row[: row.numel() // tp]
            top = row.topk(2)
            a = int(top.indices[0])
            if out.first_logits is None:
                out.first_logits = row.cpu()
            out.rows.append(row.cpu())
            tok = a if forced is None else forced[len(req.output_ids)]
            out.argmax.append(a)
            out.gaps.append(float((top.values[0] - top.values[1]) / row.std()))
            out.tokens.append(tok)
            req.output_ids.append(tok)
    sch.finish(req)
    return out


def _prompts(ids: range, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(ids.start, ids.stop) for _ in range(n)] for n in PROMPT_LENS]


@torch.no_grad()
def pin_routing_(model: K3ForCausalLM, seed: int = 0) -> K3ForCausalLM:
    """Make every MoE layer's expert selection independent of the token: the selection-only
    correction bias becomes a random permutation of 0, 2, 4, … (gaps of 2 ≫ the sigmoid
    scores' range (0, 1)), so top-k always picks the same k experts while the routing weights
    (the uncorrected scores) stay the model's. Without it a random-weight model's logits are
    discontinuous in its inputs: a summation-order difference of 1e-6 flips a near-tie
    selection somewhere among prompt × layers × top-k choices and moves that token's output by
    O(1) (measured: fp32 paths 1–20 % apart on the logits). Pinned, two numerically different
    but correct paths agree to their rounding, and a real bug still shows as O(1)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            ramp = 2.0 * torch.randperm(p.numel(), generator=gen).float()
            p.copy_(ramp.to(p.device, p.dtype))
    return model


def tiny_model(device: str, dtype: torch.dtype = torch.bfloat16
               ) -> tuple[K3ForCausalLM, list[list[int]]]:
    """The tiny K3 config in `dtype`, random weights (seed 5), routing pinned
    (`pin_routing_`), and three random prompts."""
    with torch.device(device):
        model = init_random_(K3ForCausalLM(load_config("tiny"), dtype=dtype), seed=5)
    return pin_routing_(model), _prompts(range(model.cfg.vocab_size), 11)


def k3_slice(device: str, layers: int = 4, dtype: torch.dtype = torch.bfloat16
             ) -> tuple[K3ForCausalLM, list[list[int]]]:
    """K3's first `layers` layers at rank 0's TP16 shapes (solo rank, random weights, routing
    pinned: `pin_routing_`) and three prompts on the rank's vocab rows (any other id embeds
    as zeros on a solo rank)."""
    from raydecode.scripts.bench.step import build_model, layer_config, rank_vocab_rows

    model, _ = build_model(layer_config("k3", layers), 16, device, seed=3, dtype=dtype)
    return pin_routing_(model), _prompts(rank_vocab_rows(model), 12)


@torch.no_grad()
def upcast_(model: K3ForCausalLM) -> K3ForCausalLM:
    """The model's bf16 / fp16 parameters to fp32 in place (same values; the MXFP4 experts'
    uint8 codes and scales stay), for an fp32 ground truth of the same weights."""
    for p in model.parameters():
        if p.dtype in (torch.bfloat16, torch.float16):
            p.data = p.data.float()
    model.dtype = torch.float32
    return model


def within_bf16_noise(e_got: list[float], e_ref: list[float]) -> bool:
    """The bf16 check: per-position relative logit errors against the fp32 ground truth of the
    path under test (e_got) within 2× the bf16 reference path's (e_ref) + 2e-3, for the first
    token and on average."""
    return (e_got[0] <= 2 * e_ref[0] + 2e-3
            and sum(e_got) <= 2 * sum(e_ref) + 2e-3 * len(e_got))


def clone_caches(c):
    """An independent copy of a model's caches (KDA conv + recurrent state, MLA pool and block
    tables; the MLA index memo starts empty), so one step can run twice from the same state."""
    out = copy.copy(c)
    out.kda = copy.copy(c.kda)
    out.kda.conv, out.kda.rec = c.kda.conv.clone(), c.kda.rec.clone()
    out.mla = copy.copy(c.mla)
    out.mla.pool = c.mla.pool.clone()
    out.mla.block_tables = {k: list(v) for k, v in c.mla.block_tables.items()}
    out.mla._index_memo, out.mla._memo_elems = {}, 0
    return out
