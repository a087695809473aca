"""Prefill at one rank's shapes: TTFT of long prompts chunked as the scheduler chunks them,
mixed steps (one prefill chunk + decoding sequences), the first-run check over random token
counts, and the stock decode step's kernels per layer.

    python -m raydecode.scripts.bench.prefill [--config k3] [--tps 16,8] [--layers 0]
        [--prompts 1024,8192,32768,131072] [--prefill-budget 256] [--mixed-decodes 63]
        [--context 1024] [--chunk-while-decoding 2048] [--random-counts 50]
        [--schedule-prompt 32768 [--schedule-chunks 128,256,512]
         [--schedule-modes split,mixed] [--schedule-pairs 64] [--schedule-pacer 2.0]]
        [--gc-modes frozen] [--max-seconds 60]
        [--graphed 1] [--stock-graphs 2048 [--tpot-chunks 1,256,512,1024,2048]]
        [--profile-first-run] [--profile-steps] [--module-loading lazy|eager]
        [--sweep-budgets 4096,8192]
        [--out bench/results/prefill-….json] [--png bench/results/prefill-….png] [--commit SHA]

The rank is scripts/bench/step.py's: one GPU plays rank 0 of TP `--tp` (`SoloRankComm`: the
all-reduces are skipped and counted, so no figure here holds their time), K3 from its published
config with its first `--layers` layers, random weights drawn on the device, and the runner a
served rank builds (engine/step_graph.py `GraphedRunner`: prefill and mixed steps run the stock
path eagerly — with --stock-graphs, up to that many tokens on the piecewise stock graphs —,
decode-only steps the specialized step as a captured graph). With N of the 93
layers, every whole-model figure (the `*_all_layers` fields: TTFT, tok/s, TPOT) is the
measured one scaled by 93/N; the MFU is the N-layer run's own (its FLOPs over its time).

Cases, per TP (the budget: `--prefill-budget`, the scheduler's max_num_batched_tokens):
  capture   with --stock-graphs N: GraphedRunner.warm_prefill at the budget captures every
            token bucket up to N (engine/piecewise.py), before everything below: seconds,
            buckets captured and failed (why), graphs per bucket; with --stock-single 1
            each bucket's single-sequence graph too (KDA cores inside), which the
            chunk-alone steps below then replay.
  graphs    with --stock-graphs: per `--tpot-chunks` size ≤ N, the chunk-alone, mixed and
            decode-only stock steps eager and replayed, interleaved (`--steps` rounds), and
            the split schedule's TPOT (chunk alone + graphed decode) both ways.
  warm-up   one step of every prefill bucket (the powers of two below the budget, and the
            budget), alone and mixed, a chunk at position 0, the decode-only steps (stock;
            with --graphed 1 the specialized one, which captures bucket 64's graph): the
            build's warm-up; their times are the buckets' first-run times.
  counts    `--random-counts` token counts uniform in [1, budget] (seeded), each run twice as a
            prefill step (one chunk at position --context), twice as a mixed step (+ the
            decoders) and twice as a new prompt's first chunk ("start": position 0, where the
            attention is plain causal SDPA), each time against the steady state of its
            bucket (the smallest bucket
            ≥ the count: median of `--repeats` runs after the warm-up). Acceptance: every
            first run ≤ 2× steady. The Triton JIT specializations compiled after the warm-up
            are counted (Triton's cache hook) where Triton has one. Per `--gc-modes` (live:
            the GC as the process left it; frozen: engine/runner.py `freeze_host_heap` first,
            as a served GPU rank after its build) a fresh draw of counts, each first run with
            the ms it spent in Python's GC and the caching allocator's new segments and
            retries (`StepProbe`); the top-level figures are the last mode's.
  mixed     `--mixed-decodes` sequences decoding at --context plus one chunk of
            `--chunk-while-decoding` tokens (at most the budget: what the deployment's
            max_prefill_tokens_while_decoding lets a step hold while streams run) at
            --context: the step time is the decoders' TPOT during mixed steps; against the
            decode-only step of the same sequences (stock; graphed, as served) and the split
            schedule (SchedulerConfig.split_mixed: a chunk-only step, then the graphed decode
            step). Medians of `--steps` interleaved rounds.
  schedule  with --schedule-prompt P: the acceptance's TPOT — the --mixed-decodes streams
            decoding while a P-token prompt prefills in --chunk-while-decoding chunks on the
            split schedule (each chunk-only stock step at its own position, then the streams'
            decode step, graphed where the rank has graphs, back to back): p50 / p99 / max of
            the pairs' times against the streams' decode-only TPOT of the same run; at most
            --schedule-pairs pairs, at evenly spaced positions over the prompt; with
            --schedule-chunks, once per chunk size. Each row also estimates the prompt's TTFT
            on that schedule (every chunk step plus the decode steps between them, at the
            sampled pairs' mean times): the trade-off a smaller chunk buys its TPOT with.
            --schedule-modes mixed: the same over mixed steps (the chunk and the streams'
            decode rows in one stock step, split_mixed off), each step one TPOT sample.
            --schedule-pacer L: also per mode, the whole prompt with each chunk the size the
            scheduler's pacer asks for (engine/pacer.py, decode_slowdown_limit L, at most
            --chunk-while-decoding), every step's time reported to it as the engine does;
            with --profile-steps the mixed mode's first one-token chunk step runs under the
            profiler (`one_token_step_profile`: the paced runs' slow step).
  prompts   each prompt (random ids of this rank's vocab rows) through the real Scheduler
            (engine/scheduler.py: at position p a chunk of min(budget, P − p) tokens per
            step); every chunk is what ModelRunner.execute runs (forward, the chunk's logits
            row, greedy sampling, the host sync); TTFT = the sum of the chunks' wall times
            (schedule + step; the last chunk's sample is the first token). Once a prompt has
            run `--max-seconds`, its chunks but the last are skipped (their block tables still
            applied) and their time extrapolated: seconds per token linear in the chunk's mean
            position, least squares over the chunks run ("extrapolated": true). With
            --grouped-pairs A,B: each prompt once per value of kernels/moe_mxfp4.py
            GROUPED_PAIRS, interleaved (each row its `grouped_pairs` and `shipped`), the
            grouped bf16 experts' same-run A/B; with --prefill-experts split,blocked the same
            for PREFILL_EXPERTS (each row its `prefill_experts`), with --final-mix rows,all
            for engine/runner.py ModelRunner.final_rows (the final AttnRes mix and norm on
            the sample rows alone, as shipped, or on every row of the chunk, the form
            before; each row its `final_mix`); the summary takes the shipped row.
  routing   with --router balanced: the random router's largest one-step prompt first, the
            streams' routing (one eager decode-only step of --mixed-decodes rows:
            `routing_decode_random_router`), then the bias balanced on a budget step
            (`router_balance`) and the streams' routing again (`routing_decode`); after the
            prompts, the routing of a budget step (`routing`).
  profile   with --profile-first-run: torch.profiler over the first and the second prefill
            step of an unmet count: wall ms, the device's kernel time (`device_busy_ms`: the
            kernels' own events; below the wall time, the step is host-bound), where the
            rest went (`kernel_timeline`: idle between the first and the last kernel,
            `device_gaps_ms`, and before and after them, `ends_idle_ms`) and the top
            kernels and host ops. With --profile-steps: after the prompts, one
            budget-sized prefill step at position 0 per expert-kernel variant, profiled the
            same way (`step_profiles`, each with its `wall`): the variants' steps kernel by
            kernel; on CUDA a second, stack-recording pass attributes the device time to
            host ops and their source lines, and the host's waits (memcpy, synchronize) to
            theirs (`by_site`); a third under CUDA's sync debug mode lists every
            synchronizing call by source line (`syncs`).
  sweep     with --sweep-budgets: the prompts again at each of those step budgets (one warm
            step of the budget's chunk first), with the mixed step's time at that chunk: the
            trade-off the deployment's default budget is set from.
  kernels   CUDA: the kernels one stock decode step at batch 1 launches (torch.profiler),
            counted eager ("graphed": false: a replay launches the same kernels): per layer,
            the launches inside the decoder layers / layers (the summary's figure), and every
            kernel of the step / layers (with the embedding, final mix and norm, lm_head).

FLOPs per rank (`flops_method`): 2 × the active parameters per token, counted on this rank's
parameters: every dense one (replicated ones whole, TP-split ones their slice, embedding
excluded: a row read) plus the routed experts × top_k / num_experts (MXFP4: two codes per
byte, scales not counted), plus 2 × the lm_head slice per sampled row (one per chunk); plus
attention: MLA 2·h·(qk + v)·c per query token that sees c positions (causal: a chunk of n at
p sums n·p + n(n+1)/2), KDA 7·h·dk·dv per token (the recurrent form: decay, Sᵀk, rank-1
update, Sᵀq); h: this rank's heads. MFU = FLOPs / TTFT / the dense bf16 rate measured in the
same run (torch.matmul of two 8192² bf16 operands timed with CUDA events; on the CPU 256²).

Summary (exactly three keys, from the TP16 run): mfu_8k_tp16 and ttft_s_8k_tp16 (all layers)
of the 8192-token prompt, stock_layer_kernels_tp16_b1 the batch-1 stock step's kernels per
layer (those launched inside the decoder layers / layers, `stock_kernels`; every kernel of the
step / layers where the launches counted miss a kernel); null where the run has no such case
(no TP16, no 8192 prompt, no CUDA: the tiny CPU run). Beside it, each run's
`stock_kernels_b1_cublas`: the same step with every stock GEMM on cuBLAS (models/layers.py
STOCK_SKINNY_MAX_M 0), the same-run baseline of the skinny GEMMs' count and device time.

Timing: host wall time between device syncs (torch.cuda.synchronize), time.perf_counter.
Off CUDA (`--device cpu --config tiny`, tests/cpu/test_bench_prefill.py) the same code runs
eagerly: no graphs, no kernel count.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import random
import statistics
import time

import torch

from raydecode.engine.cache import BlockAllocator, SlotAllocator
from raydecode.engine.pacer import ChunkPacer
from raydecode.engine.request import Request, SamplingParams
from raydecode.engine.runner import ModelRunner
from raydecode.engine.sampling import SamplingRows, sample_isolated
from raydecode.engine.scheduler import Scheduler, SchedulerConfig, StepPlan
from raydecode.engine.step_graph import (GraphedRunner, graph_cache_sizes, prefill_buckets,
                                         resolve_pad, unpadded_buckets)
from raydecode.kernels import moe_mxfp4
from raydecode.kernels.settings import is_token_bucket, parse_prefill_experts
from raydecode.models.cache import SeqSlice, StepBatch
from raydecode.models.config import load_config
from raydecode.models.k3 import K3ForCausalLM, make_caches
from raydecode.models.moe import MXFP4_PARAMS

from .report_io import git_commit, int_list, report_header, run_saver, write_report
from .step import BLOCK, build_model, device_sync, layer_config, rank_vocab_rows

SUMMARY_KEYS = ("mfu_8k_tp16", "ttft_s_8k_tp16", "stock_layer_kernels_tp16_b1")
FLOPS_METHOD = (
    "per rank and token: 2·(dense + routed·top_k/num_experts) over this rank's parameters "
    "(embedding excluded; MXFP4 routed experts 2 codes per byte, scales excluded) + 2·lm_head "
    "slice per sampled row (one per chunk) + MLA 2·h·(qk_dim + v_dim)·c per query token seeing "
    "c positions (chunk of n at p: n·p + n(n+1)/2) + KDA 7·h·dk·dv per token (decay, Sᵀk, "
    "rank-1 update, Sᵀq); h = heads on this rank")


# ---- FLOPs and the dense rate ------------------------------------------------------------------

# the deployment's default max_prefill_tokens_while_decoding (actors/config.py; the GPU host
# running this bench lacks pydantic, so it is not imported: tests/cpu/test_bench_prefill.py
# checks the two agree)
CHUNK_WHILE_DECODING = 512


def flop_model(model: K3ForCausalLM) -> dict:
    """This rank's FLOP constants (FLOPS_METHOD) from its parameters."""
    cfg, par = model.cfg, model.par
    dense = routed = head = 0
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        owner = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
        if owner == "embed_tokens":
            continue
        if owner == "lm_head":
            head += p.numel()
        elif leaf in MXFP4_PARAMS:
            routed += 2 * p.numel() if leaf.endswith("_packed") else 0
        elif owner == "experts":                 # bf16 routed experts, stacked (E, ·, ·)
            routed += p.numel()
        else:
            dense += p.numel()
    share = cfg.moe.top_k / cfg.moe.num_experts
    return {"dense_params": dense, "routed_params": routed, "routed_share": share,
            "active_params": dense + routed * share, "lm_head_params": head,
            "mla_layers": len(cfg.mla_layers), "mla_heads": par.shard(cfg.mla.num_heads),
            "mla_qk_dim": cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim,
            "mla_v_dim": cfg.mla.v_head_dim, "kda_layers": len(cfg.kda_layer_ids),
            "kda_heads": par.shard(cfg.kda.num_heads), "kda_dk": cfg.kda.head_dim,
            "kda_dv": cfg.kda.head_dim}


def chunk_flops(fm: dict, pos: int, n: int) -> float:
    """FLOPs of one sequence's n tokens at position pos on this rank (one sampled row)."""
    seen = n * pos + n * (n + 1) / 2                     # Σ visible positions of its queries
    mla = fm["mla_layers"] * 2 * fm["mla_heads"] * (fm["mla_qk_dim"] + fm["mla_v_dim"]) * seen
    kda = fm["kda_layers"] * 7 * fm["kda_heads"] * fm["kda_dk"] * fm["kda_dv"] * n
    return 2 * fm["active_params"] * n + 2 * fm["lm_head_params"] + mla + kda


def dense_bf16_rate(device) -> dict:
    """FLOP/s of a square bf16 torch.matmul (8192 on CUDA, CUDA events; 256 elsewhere)."""
    dev = torch.device(device)
    n, reps = (8192, 50) if dev.type == "cuda" else (256, 5)
    a, b = (torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty_like(a)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    device_sync(dev)
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            torch.matmul(a, b, out=c)
        end.record()
        end.synchronize()
        sec = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b, out=c)
        sec = time.perf_counter() - t0
    return {"n": n, "reps": reps, "flops_per_s": 2 * n ** 3 * reps / sec}


@contextlib.contextmanager
def jit_compiles():
    """Yields a one-item list: the Triton JIT specializations compiled (or loaded from the
    disk cache) inside the block, counted by Triton's cache hook (`knobs.runtime.
    jit_cache_hook`; older Triton: `JITFunction.cache_hook`); [None] without either."""
    count, holder = [None], None
    try:
        import triton
        knobs = getattr(triton, "knobs", None)
        if knobs is not None and hasattr(knobs.runtime, "jit_cache_hook"):
            holder, attr = knobs.runtime, "jit_cache_hook"
        else:
            from triton.runtime.jit import JITFunction
            holder, attr = JITFunction, "cache_hook"
        prev = getattr(holder, attr)
    except Exception:       # no Triton (CPU installs) or no hook in this release
        holder = None
    if holder is None:
        yield count
        return

    def hook(*a, **kw):
        count[0] += 1
        return prev(*a, **kw) if prev else False       # False: compile as usual

    count[0] = 0
    setattr(holder, attr, hook)
    try:
        yield count
    finally:
        setattr(holder, attr, prev)


# ---- the rank ----------------------------------------------------------------------------------

class PrefillRank:
    """The runner and caches of one rank: slot 0 is the prompt's (blocks [0, prompt_blocks):
    the range a prompt's Scheduler allocates from), slots 1..D the decoders at `context`
    (they stay there: each step rewrites the same row; the timing does not read values)."""

    def __init__(self, model: K3ForCausalLM, device, max_prompt: int, budget: int,
                 decodes: int, context: int, seed: int = 0, graphed: bool = True,
                 pad: bool = False, stock_graphs: int = 0, stock_single: bool = False,
                 stock_mixed: bool = False):
        self.model, self.device = model, torch.device(device)
        self.budget, self.context = budget, context
        self.prompt_blocks = -(-max(max_prompt, context + budget) // BLOCK)
        per_decoder = -(-(context + 1) // BLOCK)
        num_slots, num_blocks = decodes + 1, self.prompt_blocks + decodes * per_decoder
        ns, nb = graph_cache_sizes(num_slots, num_blocks)
        caches = make_caches(model.cfg, model.par, ns, nb, BLOCK, model.dtype, device=device)
        self.runner = GraphedRunner(model, caches, device, num_slots=num_slots,
                                    num_blocks=num_blocks, max_blocks=per_decoder,
                                    pad_prefill=pad, stock_graphs=stock_graphs,
                                    stock_single=stock_single, stock_mixed=stock_mixed)
        slots, blocks = SlotAllocator(num_slots), BlockAllocator(num_blocks, BLOCK)
        self.slot = slots.allocate()
        blocks.ensure(self.slot, self.prompt_blocks * BLOCK)
        self.decoders = [slots.allocate() for _ in range(decodes)]
        for s in self.decoders:
            blocks.ensure(s, context + 1)
        self.tables = {s: list(t) for s, t in blocks.tables.items()}
        self.pending = dict(self.tables)             # shipped with the next plan
        self.vocab = rank_vocab_rows(model)
        self.rng = random.Random(seed)
        self.step_id = 0
        self.last_device_s: float | None = None      # step(): the last step's device time
        # whether the cases run the decode-only specialized step (graph-shaped) at all
        self.graphs = graphed and self.runner.support[0]
        self.why_no_graphs = None if self.graphs else \
            ("--graphed 0" if not graphed else self.runner.support[1])

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab.start, self.vocab.stop) for _ in range(n)]

    def plan(self, chunk: int, decodes: int, path: str = "stock", pos: int | None = None
             ) -> StepPlan:
        """The first `decodes` decoders (first, as the scheduler orders them), then a chunk of
        `chunk` tokens of slot 0 at `pos` (default: context); every sequence samples."""
        seqs, toks = [], []
        for s in self.decoders[:decodes]:
            seqs.append(SeqSlice(s, len(toks), 1, self.context))
            toks += self.ids(1)
        if chunk:
            seqs.append(SeqSlice(self.slot, len(toks), chunk,
                                 self.context if pos is None else pos))
            toks += self.ids(chunk)
        tables, self.pending = self.pending, {}
        self.step_id += 1
        return StepPlan(self.step_id, StepBatch(seqs), toks, [s.end - 1 for s in seqs],
                        tables, [], path)

    def step(self, chunk: int, decodes: int, path: str = "stock", pos: int | None = None
             ) -> float:
        """Wall seconds of one served step (ModelRunner.execute: forward, sampling, sync).
        `last_device_s`: the same step's seconds between CUDA events recorded on the stream
        before and after it (None off CUDA), so a slow step says whether the GPU was slow or
        the host."""
        plan = self.plan(chunk, decodes, path, pos)
        device_sync(self.device)
        cuda = self.device.type == "cuda"
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        t0 = time.perf_counter()
        self.runner.execute(plan)
        if cuda:
            e1.record()
        device_sync(self.device)
        wall = time.perf_counter() - t0
        self.last_device_s = e0.elapsed_time(e1) / 1e3 if cuda else None
        return wall

    def prompt(self, ids: list[int], max_seconds: float = math.inf
               ) -> tuple[list[tuple[int, int, float | None]], torch.Tensor, int]:
        """Prefill `ids` on slot 0 chunked by a Scheduler at the budget -> ((pos, n, seconds
        or None: skipped) per chunk, the first token's logits (1, V), the first token)."""
        sch = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=self.budget,
                                        num_blocks=self.prompt_blocks, block_size=BLOCK))
        req = Request(list(ids), SamplingParams(max_tokens=1, temperature=0.0))
        sch.add(req)
        chunks, spent = [], 0.0
        while req.num_cached < len(ids):
            device_sync(self.device)
            t0 = time.perf_counter()
            plan = sch.schedule()                                  # one sequence: one chunk
            s = plan.batch.seqs[0]
            if spent > max_seconds and s.pos + s.length < len(ids):
                self.runner.update_caches(plan)      # its tables and resets, no forward
                chunks.append((s.pos, s.length, None))
            else:           # ModelRunner.execute, keeping the logits
                with torch.inference_mode():
                    logits = self.runner.logits(plan)
                    res = sample_isolated(logits, SamplingRows.greedy(len(plan.sample_rows)))
                device_sync(self.device)
                sec = time.perf_counter() - t0
                chunks.append((s.pos, s.length, sec))
                spent += sec
            req.num_cached += s.length
        self.pending[self.slot] = self.tables[self.slot]
        return chunks, logits, res.token_ids[0]


def ttft_of(chunks: list[tuple[int, int, float | None]]) -> tuple[float, dict | None]:
    """(TTFT, the fit or None): the chunks run summed, the skipped ones from a least-squares
    line of seconds per token against the chunk's mean position over the chunks run."""
    total = sum(t for _, _, t in chunks if t is not None)
    skipped = [(p, n) for p, n, t in chunks if t is None]
    if not skipped:
        return total, None
    xs, ys = zip(*[(p + n / 2, t / n) for p, n, t in chunks if t is not None])
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 0.0
    at0 = my - slope * mx
    est = sum(n * max(at0 + slope * (p + n / 2), 0.0) for p, n in skipped)
    return total + est, {"s_per_token_at_0": at0, "s_per_token_per_position": slope,
                         "skipped_s": est}


def buckets_for(budget: int, pad: bool = False) -> list[int]:
    """Prefill step buckets: the powers of two below the budget, and the budget; with `pad`
    the token buckets the runner pads its stock steps to (engine/step_graph.py
    `prefill_buckets`)."""
    if pad:
        return prefill_buckets(budget)
    return unpadded_buckets(budget)


# ---- the cases ---------------------------------------------------------------------------------

def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def warm_up(rank: PrefillRank, buckets: list[int], decodes: int) -> dict:
    """The build's warm-up: -> first-run ms of each step it runs."""
    first = {"prefill": {b: _ms(rank.step(b, 0)) for b in buckets},
             "mixed": {b: _ms(rank.step(b, decodes)) for b in buckets},
             "chunk_at_position_0": _ms(rank.step(rank.budget, 0, pos=0)),
             "decode_stock": _ms(rank.step(0, decodes)),
             "decode_stock_batch1": _ms(rank.step(0, 1))}
    if rank.graphs:
        first["decode_graphed"] = _ms(rank.step(0, decodes, "specialized"))
    return first


class StepProbe:
    """What a step paid besides its kernels: milliseconds in Python's cyclic GC (gc.callbacks)
    and, on CUDA, the caching allocator's new segments (cudaMalloc) and alloc retries (a
    retry frees the cache: a device sync and fresh mallocs) during the block."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.gc_s, self._t = 0.0, None
        gc.callbacks.append(self._cb)

    def _cb(self, phase, info) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            self.gc_s += time.perf_counter() - self._t
            self._t = None

    def _alloc(self) -> tuple[int, int, int, float]:
        """(device segments, alloc retries, pinned host blocks created, µs spent creating
        them: a cudaHostAlloc can take milliseconds, e.g. a host-built index crossing a
        power-of-two size)."""
        if not self.cuda:
            return 0, 0, 0, 0.0
        st = torch.cuda.memory_stats()
        try:
            hs = torch.cuda.host_memory_stats()
        except (AttributeError, RuntimeError):      # a torch without the pinned stats
            hs = {}
        return (st.get("segment.all.allocated", 0), st.get("num_alloc_retries", 0),
                hs.get("num_host_alloc", 0), hs.get("host_alloc_time.total", 0.0))

    @contextlib.contextmanager
    def measure(self, into: dict):
        g0, (s0, r0, h0, t0) = self.gc_s, self._alloc()
        yield
        s1, r1, h1, t1 = self._alloc()
        into.update(gc_ms=_ms(self.gc_s - g0), new_segments=s1 - s0, alloc_retries=r1 - r0,
                    new_pinned=h1 - h0, pinned_alloc_ms=round((t1 - t0) / 1e3, 3))

    def close(self) -> None:
        gc.callbacks.remove(self._cb)


GC_MODES = ("live", "frozen")


def random_counts(rank: PrefillRank, buckets: list[int], decodes: int, count: int,
                  repeats: int, seed: int, max_seconds: float,
                  gc_modes: tuple[str, ...] = ("frozen",)) -> dict:
    """Steady state per bucket, then per GC mode `count` random token counts (seeded; a new
    draw per mode, so each mode's first runs are first runs) run twice per kind. Mode "live":
    the GC as the process left it; "frozen": engine/runner.py `freeze_host_heap` first (what a
    served rank does after its build). Each first run records its GC time and allocator
    growth (StepProbe). The acceptance figures (max_first_over_steady, within_2x) are the last
    mode's; every mode's are under `modes`."""
    from raydecode.engine.runner import freeze_host_heap
    # (kind, decode rows, chunk position: None = the rank's context); "start": the first
    # chunk of a new prompt (position 0), whose attention is plain causal SDPA
    kinds = (("prefill", 0, None), ("mixed", decodes, None), ("start", 0, 0))
    probe = StepProbe(rank.device)
    modes = {}
    try:
        with jit_compiles() as compiled:
            steady = {k: {b: statistics.median(rank.step(b, d, pos=p) for _ in range(repeats))
                          for b in buckets} for k, d, p in kinds}
            for m_i, mode in enumerate(gc_modes):
                if mode not in GC_MODES:
                    raise ValueError(f"GC mode {mode!r}: expected one of {GC_MODES}")
                if mode == "frozen":
                    freeze_host_heap()
                rng = random.Random(seed + m_i)
                counts = [rng.randint(1, rank.budget) for _ in range(count)]
                rows, t0 = [], time.perf_counter()
                for n in counts:                 # --max-seconds bounds each mode (truncated)
                    if time.perf_counter() - t0 > max_seconds:
                        break
                    b = next(x for x in buckets if x >= n)
                    row = {"tokens": n, "bucket": b}
                    for k, d, p in kinds:
                        cell = {}
                        with probe.measure(cell):
                            first = rank.step(n, d, pos=p)
                        later = rank.step(n, d, pos=p)
                        cell.update(first_ms=_ms(first), later_ms=_ms(later),
                                    first_over_steady=round(first / steady[k][b], 3),
                                    later_over_steady=round(later / steady[k][b], 3))
                        row[k] = cell
                    rows.append(row)
                worst = {k: max((r[k]["first_over_steady"] for r in rows), default=None)
                         for k, *_ in kinds}
                over = [r for r in rows
                        if any(r[k]["first_over_steady"] > 2.0 for k, *_ in kinds)]
                modes[mode] = {
                    "counts_run": len(rows), "counts_asked": count,
                    "truncated": len(rows) < count, "max_first_over_steady": worst,
                    "within_2x": all(w <= 2.0 for w in worst.values()) if rows else None,
                    "over_2x": len(over),
                    "over_2x_gc_ms": [max(r[k]["gc_ms"] for k, *_ in kinds) for r in over],
                    "over_2x_new_segments": [sum(r[k]["new_segments"] for k, *_ in kinds)
                                             for r in over],
                    "gc_ms_total": round(sum(r[k]["gc_ms"] for r in rows
                                             for k, *_ in kinds), 3),
                    "rows": rows}
    finally:
        probe.close()
    last = modes[gc_modes[-1]]
    return {"counts_run": last["counts_run"], "counts_asked": count,
            "truncated": last["truncated"], "gc_modes": list(gc_modes),
            "steady_ms": {k: {b: _ms(t) for b, t in v.items()}
                          for k, v in steady.items()},
            "max_first_over_steady": last["max_first_over_steady"],
            "within_2x": last["within_2x"],
            "jit_compiles_after_warmup": compiled[0], "modes": modes}


def kernel_timeline(kernels: list[tuple[float, float]], wall_us: float) -> dict:
    """Where a profiled step's device time goes on its timeline, from its kernels' (start, end)
    µs: `device_span_ms` from the first kernel's start to the last one's end, `device_gaps_ms`
    the idle inside that span (the span less the union of the kernels' intervals: host-bound
    stretches between kernels), `ends_idle_ms` the wall time outside it (the host's work
    before the first kernel and after the last: planning, inputs, the sampled ids' copy);
    None without kernels (off CUDA)."""
    if not kernels:
        return {"device_span_ms": None, "device_gaps_ms": None, "ends_idle_ms": None}
    busy, end = 0.0, -math.inf
    for a, b in sorted(kernels):            # the union of the intervals (streams may overlap)
        if b > end:
            busy += b - max(a, end)
            end = b
    span = max(b for _, b in kernels) - min(a for a, _ in kernels)
    return {"device_span_ms": round(span / 1e3, 3),
            "device_gaps_ms": round((span - busy) / 1e3, 3),
            "ends_idle_ms": round(max(wall_us - span, 0.0) / 1e3, 3)}


def _profiled(rank: PrefillRank, run, top: int) -> dict:
    """torch.profiler (host + device) over `run()` (-> its wall seconds): its wall ms, the
    device's kernel time and the top kernels and host ops by self time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if rank.device.type == "cuda"
                                     else [])
    with profile(activities=acts) as prof:
        t = run()
    avg = prof.key_averages()
    ev = sorted(avg, key=lambda e: -e.self_cpu_time_total)[:top]
    # the kernels themselves (an op's own entry also carries its kernels' device time)
    cuda = torch.autograd.DeviceType.CUDA
    dev = [e for e in avg if getattr(e, "device_type", None) == cuda
           and (getattr(e, "self_device_time_total", 0) or 0) > 0]
    dev_us = sum(e.self_device_time_total for e in dev)
    top_dev = sorted(dev, key=lambda e: -e.self_device_time_total)[:top]
    kernels = [(e.time_range.start, e.time_range.end) for e in prof.events()
               if getattr(e, "device_type", None) == cuda]
    return {"ms": _ms(t), "device_busy_ms": round(dev_us / 1e3, 3),
            **kernel_timeline(kernels, t * 1e6),
            "device_top_ops": [
                {"op": e.key[:90], "device_ms": round(e.self_device_time_total / 1e3, 3),
                 "calls": e.count} for e in top_dev],
            "host_top_ops": [
                {"op": e.key, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3),
                 "calls": e.count} for e in ev]}


_PROJECT_DIRS = ("models/", "engine/", "kernels/", "actors/", "scripts/")
_SYNC_CALLS = ("cudaMemcpyAsync", "cudaMemcpy", "cudaStreamSynchronize",
               "cudaDeviceSynchronize", "cudaEventSynchronize")


def _site(ev, frames: int = 2) -> str:
    """The first `frames` of this project's Python frames above a profiler event (its
    ancestors in the profiler's call tree: a stack-recording profile has a python_function
    event per frame, named 'path(line): function')."""
    out, p = [], ev.cpu_parent
    while p is not None and len(out) < frames:
        name = p.name
        if "(" in name and any(d in name for d in _PROJECT_DIRS) and "site-packages" not in name:
            out.append("/".join(name.rsplit("/", 2)[-2:]))       # folder/file.py(line): fn
        p = p.cpu_parent
    return " < ".join(out)


def _device_sites(run, top: int, device: bool = True) -> dict:
    """torch.profiler with Python stacks over `run()` (a separate pass: recording stacks costs
    host time, so the timed profile runs without), two tables keyed by (op, the two innermost
    project frames above it): `device`, the kernels' device time per host op that launched
    them, and `host_syncs`, the host time in calls that can wait on the device (memcpy,
    synchronize) — where a kernel comes from (a cast, a copy, an add) in source lines, and
    which lines make the host wait while the device drains. device=False (a CPU test): the
    ops' own host time in the first table."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device else [])
    with profile(activities=acts, with_stack=True) as prof:
        run()
    cuda = torch.autograd.DeviceType.CUDA
    dev: dict = {}
    syncs: dict = {}
    for e in prof.events():
        if getattr(e, "device_type", None) == cuda:
            continue
        if e.name in _SYNC_CALLS:
            key = (e.name, _site(e))
            ms, n = syncs.get(key, (0.0, 0))
            syncs[key] = (ms + e.cpu_time_total / 1e3, n + 1)
            continue
        if not e.name.startswith("aten::") and "launch" not in e.name.lower():
            continue
        us = (e.self_device_time_total if device else e.self_cpu_time_total) or 0
        if us > 0:
            key = (e.name, _site(e))
            ms, n = dev.get(key, (0.0, 0))
            dev[key] = (ms + us / 1e3, n + 1)

    def rows(table):
        return [{"op": k[0][:60], "site": k[1][:200], "ms": round(v[0], 3), "calls": v[1]}
                for k, v in sorted(table.items(), key=lambda kv: -kv[1][0])[:top]]
    return {"device": rows(dev), "host_syncs": rows(syncs)}


def _sync_sites(run, top: int, arm=None) -> list:
    """`run()` under CUDA's sync debug mode ("warn": each synchronizing call — a device-to-host
    copy, `.item()`, a stream synchronize — warns): per (message, the two innermost frames
    outside torch and the standard library) how many times. The calls that make the host
    wait while the device drains, by source line. arm: the mode setter (a CPU test's
    stand-in)."""
    import traceback
    import warnings

    arm = arm or torch.cuda.set_sync_debug_mode
    seen: dict = {}

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "site-packages" not in f.filename and "/torch/" not in f.filename
                  and "/lib/python" not in f.filename and f.name != "record"]
        site = " < ".join(f"{'/'.join(f.filename.rsplit('/', 2)[-2:])}({f.lineno}): {f.name}"
                          for f in reversed(frames[-2:]))
        key = (str(message).split("\n")[0][:100], site)
        seen[key] = seen.get(key, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        arm("warn")
        try:
            run()
        finally:
            arm(0)
    return [{"message": k[0], "site": k[1][:240], "calls": n}
            for k, n in sorted(seen.items(), key=lambda kv: -kv[1])[:top]]


def first_run_profile(rank: PrefillRank, tokens: int, top: int = 30) -> dict:
    """torch.profiler (host + device) over the first and the second prefill step of a token
    count the rank has not met: their wall ms and the host's top ops by self time, so what
    only a first run pays (allocator growth, cuDNN plans, cuBLAS heuristics) shows as the
    difference."""
    out = {"tokens": tokens}
    for name in ("first", "second"):
        out[name] = _profiled(rank, lambda: rank.step(tokens, 0), top)
    return out


def step_profiles(rank: PrefillRank, tokens: int, variants: list, top: int = 40) -> list:
    """One `tokens`-token prefill step at position 0 under each variant ((grouped_pairs,
    prefill_experts, final_mix), compiled before: the prompts ran them), profiled after
    an unprofiled step of the same: where one variant's step time goes against another's,
    kernel by kernel (the experts' kernels and everything around them), with the wall
    interval (epoch seconds) to line up with the round's clock log."""
    out = []
    for v in variants:
        with variant_kernels(v):
            rank.step(tokens, 0, pos=0)
            t0 = time.time()
            row = _profiled(rank, lambda: rank.step(tokens, 0, pos=0), top)
            if rank.device.type == "cuda":
                row["by_site"] = _device_sites(lambda: rank.step(tokens, 0, pos=0), top)
                row["syncs"] = _sync_sites(lambda: rank.step(tokens, 0, pos=0), top)
        row.update(tokens=tokens, grouped_pairs=v[0], prefill_experts=v[1], final_mix=v[2],
                   wall=[round(t0, 3), round(time.time(), 3)])
        out.append(row)
    return out


def mixed_case(rank: PrefillRank, decodes: int, steps: int, scale: float, chunk: int) -> dict:
    """Mixed step (`chunk` prompt tokens + the decoders) vs decode-only (stock, graphed) vs
    the split schedule, interleaved."""
    t = {"mixed": [], "decode_stock": [], "chunk_alone": []}
    if rank.graphs:
        t["decode_graphed"] = []
    for _ in range(steps):
        t["mixed"].append(rank.step(chunk, decodes))
        t["decode_stock"].append(rank.step(0, decodes))
        t["chunk_alone"].append(rank.step(chunk, 0))
        if rank.graphs:
            t["decode_graphed"].append(rank.step(0, decodes, "specialized"))
    ms = {k: statistics.median(v) * 1e3 for k, v in t.items()}
    out = {"decodes": decodes, "chunk_tokens": chunk, "context": rank.context,
           "steps": steps, "ms": {k: round(v, 3) for k, v in ms.items()},
           "tpot_ms_mixed": round(ms["mixed"], 3),
           "tpot_ms_decode_only_stock": round(ms["decode_stock"], 3),
           "mixed_over_decode_stock": round(ms["mixed"] / ms["decode_stock"], 3),
           "tpot_ms_mixed_all_layers": round(ms["mixed"] * scale, 3)}
    if rank.graphs:
        split = ms["chunk_alone"] + ms["decode_graphed"]
        out.update(tpot_ms_decode_only_graphed=round(ms["decode_graphed"], 3),
                   mixed_over_decode_graphed=round(ms["mixed"] / ms["decode_graphed"], 3),
                   tpot_ms_split=round(split, 3),
                   split_over_decode_graphed=round(split / ms["decode_graphed"], 3))
        out["graph_counts"] = dict(rank.runner.counts)
        out["capture_failed"] = {str(b): why for b, why in rank.runner.capture_failed.items()}
    else:
        out["decode_graphed_not_run"] = rank.why_no_graphs
    return out


def paced_schedule_case(rank: PrefillRank, decodes: int, prompt: int, cap: int, limit: float,
                        baseline_steps: int, scale: float, mode: str = "split",
                        profile_one_token: bool = False) -> dict:
    """The schedule case with the chunks sized by the scheduler's pacer (engine/pacer.py,
    `decode_slowdown_limit` = `limit`, at most `cap` tokens): the decode-only baseline steps
    are its first samples (the streams decoded before the prompt came), then the whole prompt
    runs, every step timed and reported to the pacer as the engine does, each chunk the size
    it asks for. -> as `schedule_case`, plus the chunks chosen; the TTFT is the measured sum.
    profile_one_token (mixed mode): the first step whose chunk is one token runs under
    torch.profiler (`_profiled`: its host ops, kernels and where the rest went), in place —
    that step is the paced runs' slow one (57-82 ms against ≈ 20, docs/PERF.md) and may be
    slow only the first time; its sample says `profiled` (the profiler's overhead is in it)."""
    path = "specialized" if rank.graphs else "stock"
    pacer = ChunkPacer(limit, mixed=mode == "mixed")
    base = []
    for _ in range(baseline_steps):
        base.append(rank.step(0, decodes, path))
        pacer.observe(0, decodes, base[-1])
    samples, pos, total, one = [], 0, 0.0, None
    probe = StepProbe(rank.device)
    while pos < prompt:
        n = min(pacer.chunk_cap(cap, decodes), prompt - pos)
        if mode == "mixed":
            host: dict = {}
            profiled = profile_one_token and n == 1 and one is None
            with probe.measure(host):
                if profiled:
                    one = _profiled(rank, lambda: rank.step(n, decodes, "stock", pos=pos), 25)
                    one.update(pos=pos, decodes=decodes)
                    tm = one["ms"] / 1e3
                else:
                    tm = rank.step(n, decodes, "stock", pos=pos)
            pacer.observe(n, decodes, tm)
            samples.append({"pos": pos, "chunk_tokens": n, "mixed_ms": _ms(tm),
                            "tpot_ms": _ms(tm), **_device_ms(rank.last_device_s), **host,
                            **({"profiled": True} if profiled else {})})
            total += tm
        else:
            tc = rank.step(n, 0, "stock", pos=pos)
            dc = rank.last_device_s
            pacer.observe(n, 0, tc)
            td = rank.step(0, decodes, path) if pos + n < prompt else 0.0
            if td:
                pacer.observe(0, decodes, td)
                samples.append({"pos": pos, "chunk_tokens": n, "chunk_ms": _ms(tc),
                                "decode_ms": _ms(td), "tpot_ms": _ms(tc + td),
                                **_device_ms(dc, rank.last_device_s)})
            total += tc + td
        pos += n
    probe.close()
    chosen: dict[int, int] = {}
    for x in samples:
        chosen[x["chunk_tokens"]] = chosen.get(x["chunk_tokens"], 0) + 1
    return {"mode": mode, "pacer_limit": limit, "decodes": decodes, "prompt_tokens": prompt,
            "chunk_cap": cap, "decode_path": path, "pairs_run": len(samples),
            "chunks_chosen": dict(sorted(chosen.items())),
            **_tpot_stats(samples, base, scale),
            "prompt_ttft_s": round(total, 3), "prompt_ttft_s_all_layers": round(total * scale, 3),
            "pacer": {"decode_ms": {k: _ms(v) for k, v in pacer.decode_s.items()},
                      "chunk_ms": {k: _ms(v) for k, v in sorted(pacer.chunk_s.items())},
                      "infeasible": pacer.infeasible, "reprobes": pacer.reprobes,
                      "stretch": pacer.stretch, "stretched": pacer.stretched},
            "one_token_step_profile": one, "samples": samples}


def _device_ms(*steps: float | None) -> dict:
    """A schedule sample's device time (the CUDA-event seconds of its steps, summed), or
    nothing where a step has none (off CUDA)."""
    if not steps or any(x is None for x in steps):
        return {}
    return {"device_ms": _ms(sum(steps))}


def _stall_note(sc: dict) -> str:
    """The schedule line's device p99 and its slow samples (`SLOW_KEYS`: pos, wall ms, device
    ms, and on mixed steps GC ms, new segments, alloc retries, new pinned blocks, their ms)."""
    if "device_ms_p99" not in sc:
        return ""
    slow = [tuple(x.values()) for x in sc["slow_samples"]]
    return (f"; device p50 {sc['device_ms_p50']} p99 {sc['device_ms_p99']} ms, "
            f"{len(slow)} slow: {slow[:8]}")


def _pct(sorted_ms: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted values."""
    return sorted_ms[min(len(sorted_ms) - 1, max(0, math.ceil(q * len(sorted_ms)) - 1))]


# what a slow schedule sample keeps: where, wall and device time, and (mixed steps) what the
# host paid besides the kernels (StepProbe: GC ms, new allocator segments, alloc retries,
# new pinned host blocks and the ms creating them)
SLOW_KEYS = ("pos", "tpot_ms", "device_ms", "gc_ms", "new_segments", "alloc_retries",
             "new_pinned", "pinned_alloc_ms")


def _tpot_stats(samples: list[dict], base: list[float], scale: float) -> dict:
    """The schedule cases' TPOT figures: p50 / p99 / max (nearest rank) of the samples'
    tpot_ms (wall: what a stream waits) against the median decode-only step of `base`
    (seconds); with device times, the same of the samples' device_ms, and the samples whose
    wall time is over 1.5× the median with their device share (a stall of the GPU or of the
    host: the acceptance counts both)."""
    tp = sorted(x["tpot_ms"] for x in samples)
    b = statistics.median(base) * 1e3
    p50, p99 = _pct(tp, 0.5), _pct(tp, 0.99)
    out = {"tpot_ms_decode_only": round(b, 3), "tpot_ms_p50": p50, "tpot_ms_p99": p99,
           "tpot_ms_max": tp[-1], "p99_over_decode_only": round(p99 / b, 3),
           "tpot_ms_p99_all_layers": round(p99 * scale, 3)}
    if samples and all("device_ms" in x for x in samples):
        dv = sorted(x["device_ms"] for x in samples)
        out.update(device_ms_p50=_pct(dv, 0.5), device_ms_p99=_pct(dv, 0.99),
                   device_ms_max=dv[-1],
                   slow_samples=[{k: x[k] for k in SLOW_KEYS if k in x} for x in samples
                                 if x["tpot_ms"] > 1.5 * p50])
    return out


def schedule_case(rank: PrefillRank, decodes: int, prompt: int, chunk: int, pairs: int,
                  baseline_steps: int, scale: float, mode: str = "split") -> dict:
    """The acceptance's TPOT: `decodes` streams decoding while one `prompt`-token prompt
    prefills in `chunk`-token chunks on the split schedule (SchedulerConfig.split_mixed): each
    chunk-only stock step at its own position, then the streams' decode step (graphed where
    the rank has graphs), back to back; a stream's TPOT sample is the pair's time. Against the
    streams' decode-only TPOT, measured in the same run (median of `baseline_steps`). A later
    chunk attends over more context, so when there are more chunks than `pairs` an evenly
    spaced subset of chunk positions runs (first and last included): the samples still span
    the prompt. `mode` "mixed" (SchedulerConfig.split_mixed off): each step is one stock step
    of the streams' decode rows and the chunk together, which is the TPOT sample.
    -> p50 / p99 / max of the TPOT samples and their ratio to the baseline."""
    path = "specialized" if rank.graphs else "stock"
    base = sorted(rank.step(0, decodes, path) for _ in range(baseline_steps))
    starts = list(range(0, prompt, chunk))
    if len(starts) > pairs:
        starts = sorted({starts[round(i * (len(starts) - 1) / (pairs - 1))]
                         for i in range(pairs)}) if pairs > 1 else [starts[-1]]
    samples = []
    probe = StepProbe(rank.device)
    for pos in starts:
        if mode == "mixed":
            host: dict = {}
            with probe.measure(host):
                tm = rank.step(min(chunk, prompt - pos), decodes, "stock", pos=pos)
            samples.append({"pos": pos, "mixed_ms": _ms(tm), "tpot_ms": _ms(tm),
                            **_device_ms(rank.last_device_s), **host})
            continue
        tc = rank.step(min(chunk, prompt - pos), 0, "stock", pos=pos)
        dc = rank.last_device_s
        td = rank.step(0, decodes, path)
        samples.append({"pos": pos, "chunk_ms": _ms(tc), "decode_ms": _ms(td),
                        "tpot_ms": _ms(tc + td), **_device_ms(dc, rank.last_device_s)})
    probe.close()
    # the prompt's TTFT on this schedule: every chunk step and the decode step between two
    # (pairs_total − 1 of them), at the sampled pairs' mean times (positions spread evenly)
    n = len(range(0, prompt, chunk))
    if mode == "mixed":          # every step carries a chunk: n of them
        ttft = n * statistics.fmean(x["mixed_ms"] for x in samples) / 1e3
    else:
        ttft = (n * statistics.fmean(x["chunk_ms"] for x in samples)
                + (n - 1) * statistics.fmean(x["decode_ms"] for x in samples)) / 1e3
    out = {"mode": mode, "decodes": decodes, "prompt_tokens": prompt, "chunk_tokens": chunk,
           "decode_path": path, "pairs_run": len(samples),
           "pairs_total": len(range(0, prompt, chunk)),
           **_tpot_stats(samples, base, scale),
           "prompt_ttft_s_est": round(ttft, 3), "prompt_ttft_s_est_all_layers":
           round(ttft * scale, 3), "samples": samples}
    return out


@contextlib.contextmanager
def stock_graphs_off(runner: GraphedRunner, off: bool = True):
    """The runner's stock steps eager (`stock_graph_tokens` 0) inside the block, if `off`."""
    cap = runner.stock_graph_tokens
    if off:
        runner.stock_graph_tokens = 0
    try:
        yield
    finally:
        runner.stock_graph_tokens = cap


def stock_graphs_ab(rank: PrefillRank, decodes: int, chunks: list[int], repeats: int,
                    scale: float) -> list[dict]:
    """Per chunk size: the chunk-alone step (at --context), the mixed step (+ the decoders)
    and the decode-only stock step, eager and replayed on the stock graphs, medians of
    `repeats` interleaved rounds; with the graphed decode step, the split schedule's TPOT
    (chunk alone + graphed decode) both ways: the TPOT of streams decoding beside a prompt."""
    rows = []
    for c in chunks:
        t: dict[str, list[float]] = {}
        for _ in range(repeats):
            for mode in ("eager", "graphed"):
                with stock_graphs_off(rank.runner, mode == "eager"):
                    for case, (n, d) in {"chunk": (c, 0), "mixed": (c, decodes),
                                         "decode_stock": (0, decodes)}.items():
                        t.setdefault(f"{case}_{mode}", []).append(rank.step(n, d))
            if rank.graphs:
                t.setdefault("decode_graphed", []).append(rank.step(0, decodes, "specialized"))
        ms = {k: round(statistics.median(v) * 1e3, 3) for k, v in t.items()}
        row = {"chunk": c, "ms": ms,
               "speedup": {case: round(ms[f"{case}_eager"] / ms[f"{case}_graphed"], 3)
                           for case in ("chunk", "mixed", "decode_stock")}}
        if rank.graphs:
            g = ms["decode_graphed"]
            split = {m: round(ms[f"chunk_{m}"] + g, 3) for m in ("eager", "graphed")}
            row.update(tpot_ms_split=split,
                       split_over_decode_graphed={m: round(v / g, 3) for m, v in split.items()},
                       tpot_ms_split_all_layers={m: round(v * scale, 3)
                                                 for m, v in split.items()})
        rows.append(row)
    return rows


def prompt_case(rank: PrefillRank, tokens: int, fm: dict, rate: float, max_seconds: float,
                scale: float) -> dict:
    chunks, _, first = rank.prompt(rank.ids(tokens), max_seconds)
    ttft, fit = ttft_of(chunks)
    flops = sum(chunk_flops(fm, p, n) for p, n, _ in chunks)
    return {"prompt_tokens": tokens, "chunk_tokens": rank.budget, "chunks_total": len(chunks),
            "chunks_run": sum(t is not None for *_, t in chunks),
            "extrapolated": fit is not None, "fit": fit, "ttft_s": ttft,
            "prefill_tok_s": tokens / ttft, "flops": flops, "tflop_s": flops / ttft / 1e12,
            "mfu": flops / ttft / rate, "ttft_s_all_layers": ttft * scale,
            "prefill_tok_s_all_layers": tokens / ttft / scale, "first_token": first,
            "chunk_ms": [None if t is None else round(t * 1e3, 3) for *_, t in chunks]}


def routing_balance(rank: PrefillRank, tokens: int, block_m: int = 128,
                    decodes: int = 0) -> dict:
    """How the bench's router (random weights) spreads one step's (token, expert) pairs over
    the experts, per MoE layer of one eager chunk step of `tokens` tokens at position 0 (the
    routes recorded through models/moe.py `route` / `route_topk`; a step its stock graph
    replays records nothing). The grouped expert kernels' work follows it: each expert's
    pairs run in ⌈n / block_m⌉ chunks, each decoding the expert's tile once, so a skewed
    routing (few experts, long runs) is cheaper than a trained router's balanced one (K3 is
    trained with aux-free balancing). -> per layer and averaged: experts touched, max / mean
    pairs per touched expert, the chunks at block_m against a balanced routing's. With
    `decodes`: one eager stock decode-only step of that many one-token rows instead (the
    streams' routing, which sets what their decode step's experts read)."""
    from raydecode.models import moe as moe_mod
    real, seen = (moe_mod.route, moe_mod.route_topk), []

    def recording(fn):
        def wrapped(*a, **kw):
            w, ids = fn(*a, **kw)
            seen.append(ids.detach().reshape(-1).to("cpu", torch.int64))
            return w, ids
        return wrapped

    moe_mod.route, moe_mod.route_topk = recording(real[0]), recording(real[1])
    runner = getattr(rank, "runner", None)
    try:
        with (stock_graphs_off(runner) if hasattr(runner, "stock_graph_tokens")
              else contextlib.nullcontext()):           # eager, so the routes are recorded
            if decodes:
                rank.step(0, decodes)
            else:
                rank.step(tokens, 0, pos=0)
    finally:
        moe_mod.route, moe_mod.route_topk = real
    E = rank.model.cfg.moe.num_experts
    layers = []
    for ids in seen:
        c = torch.bincount(ids, minlength=E).double()
        touched = c[c > 0]
        P = int(ids.numel())
        layers.append({"pairs": P, "experts_touched": int(touched.numel()),
                       "max_over_mean": round(float(touched.max() / touched.mean()), 3),
                       "chunks": int(torch.ceil(touched / block_m).sum()),
                       "chunks_balanced": min(P, E) * math.ceil(P / min(P, E) / block_m)})
    if not layers:
        return {"tokens": tokens, "decodes": decodes, "layers": [],
                "why": "no route recorded (a graphed step)"}
    mean = {k: round(statistics.mean(x[k] for x in layers), 3)
            for k in ("experts_touched", "max_over_mean", "chunks", "chunks_balanced")}
    return {"tokens": tokens, "decodes": decodes, "experts": E, "block_m": block_m,
            "mean": mean,
            "chunks_over_balanced": round(mean["chunks"] / mean["chunks_balanced"], 3),
            "layers": layers}


def balance_router(rank: PrefillRank, tokens: int, passes: int = 3, iters: int = 64) -> dict:
    """Set every MoE layer's noaux_tc selection bias (`e_score_correction_bias`, fp32, used
    for the top-k choice only, never in the weights) so that a `tokens`-token step's pairs
    spread evenly over the experts, as K3's training balances them (the aux-loss-free rule:
    raise an under-loaded expert's bias, lower an over-loaded one's). The bench's router has
    random weights, which routes unevenly (H100 runs: 562 of 896 experts touched, max / mean
    pairs 10.5, 0.77× a balanced routing's 128-pair chunks), so its grouped expert kernels
    ran less work than a served K3's would. Per pass: one eager chunk step at position 0
    records each layer's router logits and bias tensor (models/moe.py `route` /
    `route_topk`); per layer `iters` sign steps on those logits, from half the scores'
    standard deviation down to 1 % of it, on the bias in place (graphs captured before read
    the same tensor); passes repeat because a layer's input follows the routing before it.
    -> the routing record (`routing_balance`) before and after, and per pass the mean
    max / mean load over the layers before its update."""
    from raydecode.models import moe as moe_mod
    real, seen = (moe_mod.route, moe_mod.route_topk), []

    def recording(fn):
        def wrapped(logits, bias, top_k, *a, **kw):
            seen.append((logits.detach().float().clone(), bias, top_k))
            return fn(logits, bias, top_k, *a, **kw)
        return wrapped

    before = routing_balance(rank, tokens)
    history = []
    for _ in range(passes):
        seen.clear()
        moe_mod.route, moe_mod.route_topk = recording(real[0]), recording(real[1])
        try:
            rank.step(tokens, 0, pos=0)
        finally:
            moe_mod.route, moe_mod.route_topk = real
        if not seen or any(b is None for _, b, _ in seen):
            return {"why_not": "no route with a correction bias recorded", "before": before}
        skew = []
        with torch.inference_mode():
            for logits, bias, k in seen:
                s = torch.sigmoid(logits)
                E = s.shape[1]
                target = s.shape[0] * k / E
                step = 0.5 * float(s.std())
                for i in range(iters):
                    ids = (s + bias.float()).topk(k, dim=-1).indices
                    load = torch.bincount(ids.reshape(-1), minlength=E).float()
                    if i == 0:
                        skew.append(float(load.max() / load.mean()))
                    bias.add_((torch.sign(target - load) * step).to(bias.dtype))
                    step *= 0.01 ** (1 / max(iters - 1, 1))
        history.append(round(statistics.fmean(skew), 3))
    after = routing_balance(rank, tokens)
    return {"tokens": tokens, "passes": passes, "iters": iters,
            "max_over_mean_per_pass": history, "before": before, "after": after}


def budget_sweep(rank: PrefillRank, args, fm: dict, rate: float, scale: float, tag: str
                 ) -> list[dict]:
    """The prompts again at each `--sweep-budgets` step budget (the scheduler's
    max_num_batched_tokens), after one warm step of that budget's chunk alone and mixed; per
    budget and prompt the TTFT and MFU, and the mixed step's time at that chunk (what 63
    decoders would wait per step if a prompt took the whole budget while they decode)."""
    rows, base = [], rank.budget
    try:
        for B in args.sweep_budgets:
            rank.budget = B
            rank.step(B, 0, pos=0)
            rank.step(B, args.mixed_decodes)
            mixed = _ms(statistics.median(rank.step(B, args.mixed_decodes)
                                          for _ in range(args.repeats)))
            for P in args.prompts:
                row = prompt_case(rank, P, fm, rate, args.max_seconds, scale)
                rows.append({"budget": B, "prompt_tokens": P, "ttft_s": row["ttft_s"],
                             "ttft_s_all_layers": row["ttft_s_all_layers"], "mfu": row["mfu"],
                             "chunks_total": row["chunks_total"],
                             "extrapolated": row["extrapolated"], "chunk_ms": row["chunk_ms"],
                             "mixed_step_ms": mixed})
                print(f"[prefill] {tag} budget {B} prompt {P}: TTFT {row['ttft_s']:.3f} s MFU "
                      f"{row['mfu']:.3f}; mixed step ({args.mixed_decodes} decodes + {B}) "
                      f"{mixed:.1f} ms", flush=True)
    finally:
        rank.budget = base
    return rows


def capture_stock(rank: PrefillRank, budget: int) -> dict:
    """The build's stock-graph capture (GraphedRunner.warm_prefill at the budget): seconds,
    buckets captured and failed, graphs per bucket, the shared core buffers' bytes and (CUDA)
    the memory the caching allocator reserved meanwhile (the graphs' pool, the buffers, the
    eager warm-ups' blocks: what an operator budgets for the setting)."""
    r, cuda = rank.runner, rank.device.type == "cuda"
    device_sync(rank.device)
    reserved = torch.cuda.memory_reserved(rank.device) if cuda else 0
    t0 = time.perf_counter()
    r.warm_prefill(budget)
    device_sync(rank.device)
    per = {len(g.graphs) for g in r.stock_graphs.values()}
    return {"cap": r.stock_graph_tokens, "capture_s": round(time.perf_counter() - t0, 2),
            "reserved_bytes_added": (torch.cuda.memory_reserved(rank.device) - reserved)
            if cuda else None,
            "captured": sorted(r.stock_graphs), "why_off": None if r.stock_support[0]
            else r.stock_support[1],
            "failed": {str(b): why for b, why in sorted(r.stock_failed.items())},
            "single": r.stock_single, "single_captured": sorted(r.stock_single_graphs),
            "single_failed": {str(b): why for b, why in sorted(r.stock_single_failed.items())},
            "single_graphs_per_bucket": sorted({len(g.graphs)
                                                for g in r.stock_single_graphs.values()}),
            "mixed": r.stock_mixed, "mixed_captured": sorted(r.stock_mixed_graphs),
            "mixed_failed": {str(b): why for b, why in sorted(r.stock_mixed_failed.items())},
            "graphs_per_bucket": sorted(per), "core_buffer_bytes": r._stock_buffers.nbytes}


LAUNCH_APIS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
               "cudaLaunchCooperativeKernel")     # host calls that each launch one kernel


def stock_kernels(rank: PrefillRank) -> dict:
    """CUDA kernels one stock decode step at batch 1 launches (eager), per layer: the step's
    kernels / layers (what earlier runs reported: it includes the embedding, the final mix and
    norm, the lm_head and sampling), and the kernels launched inside the decoder layers / layers
    (each layer's forward in a `record_function` range; the host's kernel-launch calls inside
    those ranges counted, which does not rely on the profiler linking a launch to its kernel)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from raydecode.models import layers as layers_mod

    from .layer_timing import kernel_summary

    L = rank.model.cfg.num_layers
    rank.step(0, 1)
    plan = rank.plan(0, 1)
    why = rank.runner.why_not(plan)
    mods = list(rank.model.model.layers)

    def ranged(fwd):
        def run(*a, **kw):
            with record_function("rd:layer"):
                return fwd(*a, **kw)
        return run
    for m in mods:
        m.forward = ranged(m.forward)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            ModelRunner.logits(rank.runner, plan)                # eager, whatever the runner
            torch.cuda.synchronize()
    finally:
        for m in mods:
            del m.forward                                       # the class's forward again
    events = prof.events()
    # the layer ranges also appear on the GPU timeline (user annotations): not kernels
    k = kernel_summary([e for e in events if e.name != "rd:layer"], top_n=12)
    cpu = torch.autograd.DeviceType.CPU
    windows = [(e.time_range.start, e.time_range.end) for e in events
               if e.name == "rd:layer" and e.device_type == cpu]
    launches = [e.time_range.start for e in events
                if e.device_type == cpu and e.name in LAUNCH_APIS]
    inside = sum(1 for t in launches if any(a <= t <= b for a, b in windows))
    return {"kernels": k["kernel"], "memcpy": k["memcpy"], "memset": k["memset"], "layers": L,
            "kernel_us": round(k["kernel_us"], 1), "stock_fused": layers_mod.STOCK_FUSED,
            "stock_skinny_max_m": layers_mod.STOCK_SKINNY_MAX_M,
            "kernels_per_layer": round(k["kernel"] / L, 2),
            "launches": len(launches), "launches_in_layers": inside,
            "layer_ranges": len(windows),
            "in_layer_kernels_per_layer": round(inside / L, 2) if len(windows) == L else None,
            "graphed": why is None, "why_not_graphed": why, "top_kernels": k["names"],
            "note": "the eager step counted (torch.profiler; a graph replays the same kernels). "
                    "kernels_per_layer: every kernel of the step / layers, the step's kernels "
                    "outside the layers (embedding, final mix and norm, lm_head, sampling) "
                    "included; in_layer_kernels_per_layer: kernel launches inside the decoder "
                    "layers' forward / layers (the summary's figure); kernel_us: the step's "
                    "kernels' device time under the profiler. GraphedRunner graphs "
                    "decode-only specialized steps only"}


@contextlib.contextmanager
def stock_gemms(max_m: int):
    """models/layers.py STOCK_SKINNY_MAX_M = max_m inside (0: cuBLAS for every stock GEMM, the
    stock count's same-run baseline), restored after."""
    from raydecode.models import layers as layers_mod
    was = layers_mod.STOCK_SKINNY_MAX_M
    layers_mod.STOCK_SKINNY_MAX_M = max_m
    try:
        yield
    finally:
        layers_mod.STOCK_SKINNY_MAX_M = was


def run_tp(args, cfg, tp: int, rate: float, scale: float, save) -> dict:
    """Every case at one TP size; `save(run)` after each."""
    try:
        model, build_s = build_model(cfg, tp, args.device, args.seed)
    except ValueError as e:              # a TP the config does not divide
        raise SystemExit(f"--tp {tp}: {e}")
    run = {"tp": tp, "build_s": round(build_s, 1), "flops_model": flop_model(model)}
    tag = f"TP{tp} L={cfg.num_layers}"
    room = max([*args.prompts, *(args.context + b for b in args.sweep_budgets),
                args.schedule_prompt])
    rank = PrefillRank(model, args.device, room, args.prefill_budget,
                       args.mixed_decodes, args.context, args.seed, bool(args.graphed),
                       bool(args.pad_prefill), args.stock_graphs, bool(args.stock_single),
                       bool(args.stock_mixed))
    buckets = buckets_for(args.prefill_budget, bool(args.pad_prefill))
    if args.stock_graphs:
        run["stock_graphs"] = sg = capture_stock(rank, args.prefill_budget)
        print(f"[prefill] {tag} stock graphs ≤ {sg['cap']} tokens: {len(sg['captured'])} "
              f"buckets captured in {sg['capture_s']} s ({sg['graphs_per_bucket']} graphs "
              f"each), failed {sg['failed']}", flush=True)
        save(run)
    run["warmup_first_ms"] = warm_up(rank, buckets, args.mixed_decodes)
    save(run)
    if args.router == "balanced":
        # the random router's largest one-step prompt first (this run's baseline), then the
        # bias balanced: every later case routes like a trained K3
        one = [P for P in args.prompts if P <= args.prefill_budget]
        if one:
            run["prompt_random_router"] = row = prompt_case(
                rank, max(one), run["flops_model"], rate, args.max_seconds, scale)
            print(f"[prefill] {tag} prompt {max(one)} on the random router: TTFT "
                  f"{row['ttft_s']:.3f} s MFU {row['mfu']:.3f}", flush=True)
        run["routing_decode_random_router"] = routing_balance(
            rank, 0, decodes=args.mixed_decodes)
        tokens = min(max(args.prompts or [args.prefill_budget]), args.prefill_budget)
        run["router_balance"] = rb = balance_router(rank, tokens)
        run["routing_decode"] = routing_balance(rank, 0, decodes=args.mixed_decodes)
        print(f"[prefill] {tag} routing of {args.mixed_decodes} decode rows: random router "
              f"{run['routing_decode_random_router'].get('mean')}, balanced "
              f"{run['routing_decode'].get('mean')}", flush=True)
        print(f"[prefill] {tag} router balanced on a {tokens}-token step: max / mean load per "
              f"pass {rb.get('max_over_mean_per_pass')}, chunks / balanced "
              f"{rb['before'].get('chunks_over_balanced')} -> "
              f"{rb.get('after', {}).get('chunks_over_balanced')}{rb.get('why_not', '')}",
              flush=True)
        save(run)
    rc = random_counts(rank, buckets, args.mixed_decodes, args.random_counts, args.repeats,
                       args.seed, args.max_seconds, tuple(args.gc_modes.split(",")))
    run["random_counts"] = rc
    for mode, m in rc["modes"].items():
        print(f"[prefill] {tag} counts (GC {mode}) {m['counts_run']}/{m['counts_asked']}: max "
              f"first/steady {m['max_first_over_steady']} within 2x {m['within_2x']} "
              f"over 2x {m['over_2x']} (their GC ms {m['over_2x_gc_ms']}, new segments "
              f"{m['over_2x_new_segments']}) GC ms total {m['gc_ms_total']}", flush=True)
    print(f"[prefill] {tag} jit compiles after warm-up {rc['jit_compiles_after_warmup']}",
          flush=True)
    save(run)
    if args.profile_first_run:
        met = {r["tokens"] for m in rc["modes"].values() for r in m["rows"]} | set(buckets)
        n = next(x for x in range(args.prefill_budget - 1, 0, -7) if x not in met)
        run["first_run_profile"] = fp = first_run_profile(rank, n)
        print(f"[prefill] {tag} first-run profile at {n} tokens: first {fp['first']['ms']} ms, "
              f"second {fp['second']['ms']} ms (device busy {fp['second']['device_busy_ms']} "
              f"ms; top: {[(o['op'][:40], o['device_ms']) for o in fp['second']['device_top_ops']]}"
              f"); first's top host ops "
              f"{[(o['op'], o['self_cpu_ms']) for o in fp['first']['host_top_ops'][:6]]}",
              flush=True)
        save(run)
    if args.stock_graphs and rank.runner.stock_graphs:
        chunks = [c for c in args.tpot_chunks if c <= rank.runner.stock_graph_tokens]
        run["stock_graphs_ab"] = ab = stock_graphs_ab(rank, args.mixed_decodes, chunks,
                                                      args.steps, scale)
        for row in ab:
            print(f"[prefill] {tag} chunk {row['chunk']}: eager/graphed {row['speedup']}, "
                  f"split TPOT {row.get('tpot_ms_split')} ms "
                  f"(/ decode {row.get('split_over_decode_graphed')})", flush=True)
        save(run)
    chunk = min(args.chunk_while_decoding, args.prefill_budget)
    mx = mixed_case(rank, args.mixed_decodes, args.steps, scale, chunk)
    run["mixed"] = mx
    print(f"[prefill] {tag} mixed {args.mixed_decodes} decodes + {chunk}: "
          f"TPOT {mx['tpot_ms_mixed']:.2f} ms vs decode-only stock "
          f"{mx['tpot_ms_decode_only_stock']:.2f} ms, graphed "
          f"{mx.get('tpot_ms_decode_only_graphed')} ms, split {mx.get('tpot_ms_split')} ms",
          flush=True)
    save(run)
    if args.schedule_prompt:
        run["schedule"] = []
        for mode, c in [(m, c) for m in args.schedule_modes
                        for c in args.schedule_chunks or [chunk]]:
            sc = schedule_case(rank, args.mixed_decodes, args.schedule_prompt,
                               min(c, args.prefill_budget), args.schedule_pairs, args.steps,
                               scale, mode)
            run["schedule"].append(sc)
            print(f"[prefill] {tag} schedule ({mode}): {args.mixed_decodes} streams beside a "
                  f"{args.schedule_prompt}-token prompt in {sc['chunk_tokens']}-token chunks "
                  f"({sc['pairs_run']} of {sc['pairs_total']} pairs): TPOT p50 "
                  f"{sc['tpot_ms_p50']} p99 {sc['tpot_ms_p99']} max {sc['tpot_ms_max']} ms vs "
                  f"{sc['tpot_ms_decode_only']} ms decode-only ({sc['decode_path']}): p99 "
                  f"{sc['p99_over_decode_only']}x; the prompt's TTFT ≈ "
                  f"{sc['prompt_ttft_s_est']} s (all layers {sc['prompt_ttft_s_est_all_layers']})"
                  f"{_stall_note(sc)}", flush=True)
            save(run)
    if args.schedule_prompt and args.schedule_pacer:
        for mode in args.schedule_modes:
            sc = paced_schedule_case(rank, args.mixed_decodes, args.schedule_prompt, chunk,
                                     args.schedule_pacer, args.steps, scale, mode,
                                     bool(args.profile_steps))
            run["schedule"].append(sc)
            print(f"[prefill] {tag} schedule ({mode}, paced to {args.schedule_pacer}x, cap "
                  f"{chunk}): chunks {sc['chunks_chosen']}; TPOT p50 {sc['tpot_ms_p50']} p99 "
                  f"{sc['tpot_ms_p99']} max {sc['tpot_ms_max']} ms vs "
                  f"{sc['tpot_ms_decode_only']} ms decode-only: p99 "
                  f"{sc['p99_over_decode_only']}x; the prompt's TTFT {sc['prompt_ttft_s']} s "
                  f"(all layers {sc['prompt_ttft_s_all_layers']}){_stall_note(sc)}", flush=True)
            if sc["one_token_step_profile"]:
                one = sc["one_token_step_profile"]
                print(f"[prefill] {tag} paced one-token step profiled: {one['ms']} ms, device "
                      f"busy {one['device_busy_ms']} (idle: {one['device_gaps_ms']} between "
                      f"kernels, {one['ends_idle_ms']} at the ends); host top: "
                      f"{[(o['op'][:40], o['self_cpu_ms']) for o in one['host_top_ops'][:10]]}",
                      flush=True)
            save(run)
    run["prompts"] = []
    shipped = (moe_mxfp4.GROUPED_PAIRS, moe_mxfp4.PREFILL_EXPERTS, final_mix_shipped())
    variants = [(g, *shipped[1:]) for g in args.grouped_pairs] + [
        (shipped[0], x, shipped[2]) for x in args.prefill_experts if x != shipped[1]] + [
        (*shipped[:2], f) for f in args.final_mix if f != shipped[2]]
    for v in variants:                    # each alternative's kernels compiled before timing
        if v != shipped:
            with variant_kernels(v):
                rank.step(args.prefill_budget, 0, pos=0)
    for P in args.prompts:
        for v in variants:                # interleaved per prompt: same-run alternatives
            t0 = time.time()
            with variant_kernels(v):
                row = prompt_case(rank, P, run["flops_model"], rate, args.max_seconds, scale)
            # epoch seconds: lines the row up with a clock / power log of the same run
            # (run_served_round.sh's gpu-clocks.csv)
            row.update(grouped_pairs=v[0], prefill_experts=v[1], final_mix=v[2],
                       shipped=v == shipped,
                       wall=[round(t0, 3), round(time.time(), 3)])
            run["prompts"].append(row)
            print(f"[prefill] {tag} prompt {P} ({v[1]} experts, grouped from {v[0] or 'never'} "
                  f"pairs, final mix: {v[2]}{', as shipped' if v == shipped else ''}): TTFT {row['ttft_s']:.3f} s (all "
                  f"layers {row['ttft_s_all_layers']:.3f} s) {row['prefill_tok_s']:.0f} tok/s "
                  f"{row['tflop_s']:.1f} TFLOP/s MFU {row['mfu']:.3f} chunks "
                  f"{row['chunks_run']}/{row['chunks_total']}"
                  + (" extrapolated" if row["extrapolated"] else ""), flush=True)
            save(run)
    if args.prompts:        # what the measured MFU's routing was (--router)
        run["routing"] = routing_balance(rank, min(max(args.prompts), args.prefill_budget))
        print(f"[prefill] {tag} routing of a {run['routing']['tokens']}-token step: "
              f"{run['routing'].get('mean')} (chunks / balanced "
              f"{run['routing'].get('chunks_over_balanced')})", flush=True)
        save(run)
    if args.profile_steps and args.prompts:
        n = min(max(args.prompts), args.prefill_budget)
        run["step_profiles"] = sp = step_profiles(rank, n, variants)
        for row in sp:
            print(f"[prefill] {tag} {n}-token step ({row['prefill_experts']} experts, final "
                  f"mix: {row['final_mix']}) profiled: "
                  f"{row['ms']} ms, device busy {row['device_busy_ms']} ms (idle: "
                  f"{row['device_gaps_ms']} between kernels, {row['ends_idle_ms']} at the "
                  f"ends); top: "
                  f"{[(o['op'][:40], o['device_ms']) for o in row['device_top_ops'][:12]]}",
                  flush=True)
        save(run)
    if args.sweep_budgets:
        run["budget_sweep"] = budget_sweep(rank, args, run["flops_model"], rate, scale, tag)
        save(run)
    if rank.device.type == "cuda":
        run["stock_kernels_b1"] = stock_kernels(rank)
        sk = run["stock_kernels_b1"]
        print(f"[prefill] {tag} stock decode batch 1: {_per_layer(sk)} kernels per layer "
              f"inside the layers ({sk['launches_in_layers']} of {sk['launches']} launches; "
              f"every kernel of the step / layers {sk['kernels_per_layer']}, {sk['kernels']} "
              f"kernels; eager; {sk['kernel_us']} us of kernels)", flush=True)
        if sk["stock_skinny_max_m"]:        # the same step with every stock GEMM on cuBLAS
            with stock_gemms(0):
                run["stock_kernels_b1_cublas"] = sc = stock_kernels(rank)
            print(f"[prefill] {tag} the same on cuBLAS GEMMs (STOCK_SKINNY_MAX_M 0): "
                  f"{_per_layer(sc)} kernels per layer inside the layers, {sc['kernel_us']} "
                  f"us of kernels", flush=True)
        save(run)
    del rank, model
    gc.unfreeze()           # a "frozen" random-counts mode froze this rank's heap
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return run


def _per_layer(kern: dict) -> float:
    """The summary's stock kernels per layer: the launches inside the decoder layers / layers
    where the launches counted cover every kernel of the step, else every kernel / layers (an
    upper bound: it includes the step's kernels outside the layers)."""
    inside = kern.get("in_layer_kernels_per_layer")
    if inside is not None and kern.get("launches") == kern["kernels"]:
        return inside
    return kern["kernels_per_layer"]


def summarize(runs: list[dict]) -> dict:
    """SUMMARY_KEYS from the TP16 run's 8192-token prompt (on the experts as shipped, not a
    --grouped-pairs alternative) and batch-1 kernel count; None where this run has no such
    case (another TP, prompts, or no CUDA)."""
    tp16 = next((r for r in runs if r["tp"] == 16), {})
    p8k = next((p for p in tp16.get("prompts", ())
                if p["prompt_tokens"] == 8192 and p.get("shipped", True)), None)
    kern = tp16.get("stock_kernels_b1")
    return {"mfu_8k_tp16": p8k["mfu"] if p8k else None,
            "ttft_s_8k_tp16": p8k["ttft_s_all_layers"] if p8k else None,
            "stock_layer_kernels_tp16_b1": _per_layer(kern) if kern else None}


def plot(runs: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for run in runs:
        rows = run.get("prompts", [])
        if not rows:
            continue
        line, = ax.plot([r["prompt_tokens"] for r in rows],
                        [r["ttft_s_all_layers"] for r in rows], "o-", label=f"TP{run['tp']}")
        ext = [r for r in rows if r["extrapolated"]]
        if ext:
            ax.plot([r["prompt_tokens"] for r in ext], [r["ttft_s_all_layers"] for r in ext],
                    "o", mfc="white", color=line.get_color(),
                    label=f"TP{run['tp']} (extrapolated)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT, all layers (s)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


KERNEL_SETS = {
    "prefill": "fla-core chunk_kda (varlen), MLA decompress + flash SDPA, MoE 64-pair chunks",
    "reference": "kda_chunked loop, MLA absorbed fp32 einsums, MoE 16-pair chunks",
}


@contextlib.contextmanager
def expert_kernels(pairs: int, prefill: str):
    """kernels/moe_mxfp4.py GROUPED_PAIRS = pairs (the pair count from which an eager expert
    call takes the grouped bf16 path; 0: never) and PREFILL_EXPERTS = prefill (the prefill
    steps' kernels: split, blocked or hybrid) inside, restored after."""
    was = moe_mxfp4.GROUPED_PAIRS, moe_mxfp4.PREFILL_EXPERTS
    moe_mxfp4.GROUPED_PAIRS, moe_mxfp4.PREFILL_EXPERTS = pairs, prefill
    try:
        yield
    finally:
        moe_mxfp4.GROUPED_PAIRS, moe_mxfp4.PREFILL_EXPERTS = was


def final_mix_shipped() -> str:
    """--final-mix's name of engine/runner.py ModelRunner.final_rows as shipped."""
    return "rows" if ModelRunner.final_rows else "all"


@contextlib.contextmanager
def variant_kernels(v: tuple):
    """A prompt variant (grouped_pairs, prefill_experts, final_mix) inside: `expert_kernels`
    and ModelRunner.final_rows (final_mix "rows": the final AttnRes mix and norm on the
    sample rows alone; "all": on every row, then the sample rows), restored after."""
    was = ModelRunner.final_rows
    ModelRunner.final_rows = v[2] == "rows"
    try:
        with expert_kernels(v[0], v[1]):
            yield
    finally:
        ModelRunner.final_rows = was


def use_kernels(name: str) -> None:
    """Select the stock path's prefill kernels for this process (`KERNEL_SETS`): the switches
    the model reads at each step (the KDA varlen predicate, the MLA prefill impl, the MoE
    prefill threshold)."""
    from raydecode.kernels import kda_prefill
    from raydecode.models.mla import MLAAttention
    if name not in KERNEL_SETS:
        raise SystemExit(f"--kernels {name!r}: expected one of {', '.join(KERNEL_SETS)}")
    if name == "reference":          # "prefill": the defaults, nothing to switch
        kda_prefill.available = lambda *ts: False
        MLAAttention.prefill_impl = "reference"
        moe_mxfp4.PREFILL_PAIRS = 1 << 62
        moe_mxfp4.GROUPED_PAIRS = 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="k3", help="model config: k3 (default), tiny or a path")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tp", type=int, default=16, help="tensor-parallel size one device plays")
    ap.add_argument("--tps", default=None, help="comma-separated TP sizes run one after the "
                    "other (overrides --tp), e.g. 16,8")
    ap.add_argument("--layers", type=int, default=0, help="first N layers (0: all); whole-model "
                    "figures are scaled by (all layers)/N")
    ap.add_argument("--prompts", default="1024,8192,32768,131072", help="prompt lengths")
    ap.add_argument("--prefill-budget", type=int, default=SchedulerConfig().max_num_batched_tokens,
                    help="tokens per step (the scheduler's max_num_batched_tokens)")
    ap.add_argument("--mixed-decodes", type=int, default=63,
                    help="decoding sequences of the mixed steps (1..64)")
    ap.add_argument("--chunk-while-decoding", type=int, default=CHUNK_WHILE_DECODING,
                    help="prompt tokens of the mixed case's step (the deployment's "
                         "max_prefill_tokens_while_decoding; at most the budget)")
    ap.add_argument("--schedule-prompt", type=int, default=0,
                    help="tokens of the prompt the schedule case prefills beside "
                         "--mixed-decodes streams in --chunk-while-decoding chunks (split "
                         "schedule; 0: the case is off), e.g. 32768: the acceptance's TPOT p99")
    ap.add_argument("--schedule-chunks", default="",
                    help="comma-separated chunk sizes the schedule case runs at, one after "
                         "the other (default: --chunk-while-decoding): the TPOT / TTFT "
                         "trade-off the deployment's max_prefill_tokens_while_decoding is "
                         "set from")
    ap.add_argument("--schedule-modes", default="split",
                    help="comma-separated schedules the schedule case runs: split (a chunk "
                         "step, then the streams' decode step) and/or mixed (the chunk and the "
                         "decode rows in one stock step)")
    ap.add_argument("--schedule-pacer", type=float, default=0.0,
                    help="also run the schedule case with the chunks sized by the scheduler's "
                         "pacer at this decode_slowdown_limit (> 1; engine/pacer.py), at most "
                         "--chunk-while-decoding tokens, over the whole prompt; 0: off")
    ap.add_argument("--schedule-pairs", type=int, default=64,
                    help="at most this many (chunk, decode) pairs of the schedule case, at "
                         "evenly spaced chunk positions over the prompt")
    ap.add_argument("--context", type=int, default=1024,
                    help="position of the decoders and of the counts' / mixed steps' chunk")
    ap.add_argument("--sweep-budgets", default="", help="comma-separated step budgets the "
                    "prompts run again at, after the main cases (e.g. 4096,8192): TTFT, MFU and "
                    "the mixed step's time per budget")
    ap.add_argument("--random-counts", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3, help="runs per bucket's steady state")
    ap.add_argument("--gc-modes", default="frozen", help="comma-separated GC modes the random "
                    "counts run in, in order: live (as the process left it), frozen "
                    "(engine/runner.py freeze_host_heap first, as a served rank)")
    ap.add_argument("--pad-prefill", type=int, choices=(0, 1), default=None,
                    help="1: the runner pads every stock step to its token bucket "
                         "(engine/step_graph.py prefill_bucket; the buckets of the counts' "
                         "steady state become those); 0: steps run at their own token count; "
                         "default: as a served rank (RAYDECODE_PAD_PREFILL unset: on CUDA), "
                         "off with --sweep-budgets")
    ap.add_argument("--module-loading", default=None, choices=("lazy", "eager"),
                    help="CUDA_MODULE_LOADING for this process (set before CUDA starts; "
                         "default: the environment's, LAZY in CUDA 12+): with lazy loading a "
                         "kernel variant's module loads on its first launch, e.g. the cuBLAS "
                         "kernel a new GEMM shape picks — a first-run cost per new variant")
    ap.add_argument("--profile-first-run", action="store_true", help="after the random counts: "
                    "profile the first and second prefill step of an unmet token count")
    ap.add_argument("--profile-steps", action="store_true", help="after the prompts: "
                    "profile one budget-sized prefill step under each --prefill-experts / "
                    "--grouped-pairs variant (kernel by kernel, `step_profiles`); with "
                    "--schedule-pacer also the paced mixed schedule's first one-token step")
    ap.add_argument("--steps", type=int, default=5, help="interleaved rounds of the mixed case")
    ap.add_argument("--max-seconds", type=float, default=60.0,
                    help="per prompt (then its chunks but the last are skipped and "
                         "extrapolated) and for the random counts")
    ap.add_argument("--stock-single", type=int, default=0, choices=(0, 1),
                    help="with --stock-graphs: 1 also captures each bucket's single-sequence "
                         "graph (KDA cores inside; RAYDECODE_STOCK_SINGLE): the chunk-alone "
                         "steps replay it")
    ap.add_argument("--stock-mixed", type=int, default=0, choices=(0, 1),
                    help="with --stock-graphs: 1 also captures each bucket's mixed-step graph "
                         "(every KDA core inside; RAYDECODE_STOCK_MIXED): mixed steps of one "
                         "chunk beside decode rows replay it")
    ap.add_argument("--stock-graphs", type=int, default=0,
                    help="stock steps of up to this many tokens replay piecewise CUDA graphs "
                         "(engine/piecewise.py; 0: eager, the default; else a token bucket), "
                         "captured before the warm-up; adds the eager-vs-graphed case "
                         "(--tpot-chunks)")
    ap.add_argument("--tpot-chunks", default="1,256,512,1024,2048",
                    help="with --stock-graphs: the chunk sizes (≤ the cap) whose chunk, "
                         "mixed and split-schedule steps run eager and graphed in one lease")
    ap.add_argument("--graphed", type=int, choices=(0, 1), default=1,
                    help="1: also the decode-only specialized (graphed) step, the served "
                         "TPOT without prefill (captures bucket 64: its kernels compile "
                         "unless the node kernel cache has them); 0: stock only")
    ap.add_argument("--kernels", default="prefill", choices=tuple(KERNEL_SETS),
                    help="prefill: the stock path's prefill kernels (fla-core's chunked KDA, "
                         "MLA flash SDPA, 64-pair MoE chunks); reference: the PyTorch "
                         "references and 16-pair MoE chunks (the stock path before them, the "
                         "baseline)")
    ap.add_argument("--router", default="balanced", choices=("balanced", "random"),
                    help="balanced (default): after the warm-up, each MoE layer's selection "
                         "bias is set so a budget step's pairs spread evenly over the experts "
                         "(as K3's training balances them), the random router's largest "
                         "one-step prompt measured first as the baseline; random: the random "
                         "weights' own, uneven routing (cheaper expert kernels: flatters MFU)")
    ap.add_argument("--grouped-pairs", default=None,
                    help="comma-separated values of kernels/moe_mxfp4.py GROUPED_PAIRS (the "
                         "pairs from which an eager expert call decodes the weights once and "
                         "runs bf16 grouped GEMMs; 0: never) each prompt runs under, "
                         "interleaved (default: the shipped value alone); the summary takes "
                         "the shipped value's row")
    ap.add_argument("--prefill-experts", default=None,
                    help="comma-separated kernels/moe_mxfp4.py PREFILL_EXPERTS values (auto, "
                         "split, blocked, hybrid, ...: the prefill steps' expert kernels; "
                         "KIND+FIELD=VALUE... sets MoEConfig fields, e.g. auto+fuse_situ=1) "
                         "each prompt also runs "
                         "under, interleaved with the --grouped-pairs values (default: the "
                         "shipped one alone); the summary takes the shipped row")
    ap.add_argument("--final-mix", default=None,
                    help="comma-separated rows, all: engine/runner.py ModelRunner.final_rows "
                         "each prompt also runs under (rows: the final AttnRes mix and norm on "
                         "the sample rows alone, as shipped; all: on every row of the chunk, "
                         "the form before), interleaved with the other variants (default: the "
                         "shipped one alone); the summary takes the shipped row")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON path (default: print only)")
    ap.add_argument("--png", default=None, help="TTFT against prompt length (matplotlib)")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args(argv)
    args.prompts = int_list("--prompts", args.prompts, 1)
    args.tpot_chunks = int_list("--tpot-chunks", args.tpot_chunks, 1)
    args.schedule_chunks = int_list("--schedule-chunks", args.schedule_chunks, 1) \
        if args.schedule_chunks else []
    if args.schedule_pacer and not args.schedule_pacer > 1:
        raise SystemExit(f"--schedule-pacer {args.schedule_pacer}: expected 0 (off) or a "
                         "limit > 1")
    args.grouped_pairs = (int_list("--grouped-pairs", args.grouped_pairs, 0)
                          if args.grouped_pairs else [moe_mxfp4.GROUPED_PAIRS])
    args.prefill_experts = (args.prefill_experts.split(",") if args.prefill_experts
                            else [moe_mxfp4.PREFILL_EXPERTS])
    for x in args.prefill_experts:
        try:
            parse_prefill_experts(x)
        except ValueError as e:
            raise SystemExit(f"--prefill-experts {','.join(args.prefill_experts)}: {e}; "
                             "expected a comma-separated list of such values") from None
    args.final_mix = (args.final_mix.split(",") if args.final_mix
                      else [final_mix_shipped()])
    if not args.final_mix or set(args.final_mix) - {"rows", "all"}:
        raise SystemExit(f"--final-mix {','.join(args.final_mix)}: expected a comma-separated "
                         "list of rows, all")
    args.schedule_modes = args.schedule_modes.split(",")
    if not args.schedule_modes or set(args.schedule_modes) - {"split", "mixed"}:
        raise SystemExit(f"--schedule-modes {','.join(args.schedule_modes)}: expected a "
                         "comma-separated list of split, mixed")
    if args.stock_graphs and not is_token_bucket(args.stock_graphs):
        raise SystemExit(f"--stock-graphs {args.stock_graphs}: expected 0 or a token bucket "
                         "(a power of two up to 256, or a multiple of 256 up to 8192)")
    args.sweep_budgets = int_list("--sweep-budgets", args.sweep_budgets, 1) \
        if args.sweep_budgets else []
    if args.pad_prefill is None:
        args.pad_prefill = int(not args.sweep_budgets and resolve_pad(None, args.device))
    if args.sweep_budgets and args.pad_prefill:
        raise SystemExit(f"--sweep-budgets {args.sweep_budgets} with --pad-prefill 1: the "
                         "padded runner's buckets end at --prefill-budget; sweep unpadded")
    tps = int_list("--tps" if args.tps else "--tp", args.tps or str(args.tp), 1)
    if args.schedule_prompt < 0 or args.schedule_pairs < 1:
        raise SystemExit(f"--schedule-prompt {args.schedule_prompt} --schedule-pairs "
                         f"{args.schedule_pairs}: expected a prompt >= 0 (0: off) and pairs "
                         ">= 1")
    if args.prefill_budget < 1 or args.context < 1 or args.random_counts < 0 \
            or args.chunk_while_decoding < 1 \
            or args.repeats < 1 or args.steps < 1 or args.max_seconds < 0:
        raise SystemExit(f"--prefill-budget {args.prefill_budget} --context {args.context} "
                         f"--chunk-while-decoding {args.chunk_while_decoding} "
                         f"--random-counts {args.random_counts} --repeats {args.repeats} "
                         f"--steps {args.steps} --max-seconds {args.max_seconds}: expected "
                         "budget, context, chunk, repeats, steps >= 1 and counts, seconds >= 0")
    bad = [m for m in args.gc_modes.split(",") if m not in GC_MODES]
    if bad or not args.gc_modes:
        raise SystemExit(f"--gc-modes {args.gc_modes!r}: expected a comma-separated list of "
                         f"{', '.join(GC_MODES)}")
    if not 1 <= args.mixed_decodes <= 64:
        raise SystemExit(f"--mixed-decodes {args.mixed_decodes}: expected 1..64 (the largest "
                         "graph bucket)")
    use_kernels(args.kernels)
    if args.module_loading:
        if torch.cuda.is_initialized():
            raise SystemExit("--module-loading: CUDA is already initialized in this process")
        os.environ["CUDA_MODULE_LOADING"] = args.module_loading.upper()
    try:
        cfg = layer_config(args.config, args.layers)
    except ValueError as e:
        raise SystemExit(str(e))
    total = load_config(args.config).num_layers
    scale = total / cfg.num_layers
    t0 = time.time()
    report = report_header(
        args.commit or git_commit(), bench="prefill", config=cfg.name, device=args.device,
        layers=cfg.num_layers, layers_total=total, all_layers_scale=scale,
        scaling=(f"{cfg.num_layers} of {total} layers run; *_all_layers figures are the "
                 f"measured ones × {scale:.4g}; MFU is the run's own" if scale != 1 else
                 "all layers run"),
        kernels=args.kernels, prefill_budget=args.prefill_budget, context=args.context,
        cuda_module_loading=os.environ.get("CUDA_MODULE_LOADING", "default (LAZY)"),
        pad_prefill=bool(args.pad_prefill), stock_graphs=args.stock_graphs,
        stock_single=bool(args.stock_single), stock_mixed=bool(args.stock_mixed),
        mixed_decodes=args.mixed_decodes, random_counts=args.random_counts,
        max_seconds=args.max_seconds, seed=args.seed, router=args.router,
        flops_method=FLOPS_METHOD,
        summary_method="from the TP16 run: the 8192-token prompt's MFU and TTFT (all layers), "
                       "the stock batch-1 decode step's kernels / layers; null where not run "
                       "(another TP, other prompts, or no CUDA for the kernel count)",
        method=__doc__.split("\n\n", 2)[2])
    if args.device == "cuda":
        from .layer import _env
        report["env"] = _env()
    rate = dense_bf16_rate(args.device)
    report["dense_bf16"] = rate
    print(f"[prefill] dense bf16 {rate['n']}^3: {rate['flops_per_s'] / 1e12:.1f} TFLOP/s",
          flush=True)
    save = run_saver(report, summarize, args.out, t0)

    for tp in tps:
        run_tp(args, cfg, tp, rate["flops_per_s"], scale, save)
    report["summary"] = summarize(report["runs"])
    print("[prefill] summary", report["summary"], flush=True)
    if args.out:
        write_report(report, args.out, t0)
    if args.png:
        plot(report["runs"], args.png, f"{cfg.name} rank 0 prefill, {cfg.num_layers} of {total} "
             f"layers (TTFT × {scale:.3g}), budget {args.prefill_budget}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
