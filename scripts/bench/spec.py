"""DSpark speculative decoding at one rank's shapes: the drafter's k steps, the target's verify
of the k+1 positions, the acceptance with its KDA rollback and the whole step, against the
non-speculative graphed step of the same batch in the same run.

    python -m raydecode.scripts.bench.spec [--config k3] [--tps 16,8] [--layers 0]
        [--ks 3,5,7] [--accepts 1..k] [--batches 1,2,4,8] [--context 1024] [--steps 10]
        [--warmup 2] [--out bench/results/spec-….json] [--png bench/results/spec-….png]
        [--commit SHA]

The rank is scripts/bench/step.py's (`layer_config`, `build_model`): one GPU plays rank 0 of
TP `--tp` (`SoloRankComm`: the all-reduces are skipped and counted, so no figure here holds
their time), K3 from its published config with its first `--layers` layers, random weights
drawn on the device. The drafter is DSpark at its published shape (models/dspark.py preset
`k3`: 5 layers, 64 heads, Markov rank 256, taps after layers 2, 23, 47, 71, 89; `tiny` for
the tiny target), this rank's TP shard with random weights drawn on the device at
models/dspark_checkpoint.py's scales, its context rows extra rows of the target's MLA pool
(as `load_spec_runner` builds them). With N < 93 layers its taps move to the same fractions
of the N layers (⌊t·N/93⌋): every shape stays the published one.

The step is the served one: engine/spec_runner.py `SpecRunner.run` as `load_spec_runner`
builds it (`--runners`: graphed = with engine/spec_graph.py's graphs, what a CUDA rank gets;
eager = over an eager ModelRunner, the former served form), fed a SpecStepPlan built
as `SpecEngine._speculate` builds it: B sequences, each a verify slice [anchor, k
placeholders] at its position p with blocks for p … p+k, the path the envelope picks
(specialized when k ∈ [3, 7] and B·(k+1) ≤ 64, else stock; `--verify-path` overrides).
Acceptance is SYNTHETIC (`synthetic_length` = L + 1, benchmarks only): every step accepts
exactly the first L drafts, then the target's token; the emitted tokens are meaningless. Each
sequence then advances by L + 1 positions and its last emitted token is its next anchor.
Runner graphed: graph D (the drafter's pass and base logits) and graph V (the verify step)
per (batch bucket, k), captured on a configuration's first step (a warm-up step); eager
between them only the k Markov samples and, after V, the acceptance and the KDA commit.

Timing: host wall time (time.perf_counter) between device syncs. The timed steps alternate:
a plain step (no sync inside it: `step_ms`, the figure every ratio uses) and a staged step with
`SpecRunner.timings` on, which syncs between its stages (`stage_ms`):
  prepare  block tables, KDA resets, the token upload;
  draft    the drafter's one non-causal pass over the k block positions, its base logits and
           the k left-to-right Markov samples (greedy in synthetic mode), drafts into the tokens;
  verify   the target forward over the B·(k+1) tokens with the drafter's taps and the drafter
           context rows of every token, then the lm_head of the verify rows;
  accept   synthetic acceptance on the device, the emitted ids to the host (the step's sync),
           every KDA layer's state of every sequence set to the accepted prefix (graphed: the
           per-position slot of the last kept position copied in; eager: recomputed over
           L + 1 tokens, nothing to do when L = k).
Medians over `--steps` steps of each kind after `--warmup` of each.

Per configuration: effective tok/s = B·(L+1) / step_ms; the baseline is the decode step of the
same B sequences at --context (step.py's `Bench` / `run_batch`: variant graphed, the bucket's
captured graph; on the CPU the eager specialized ModelRunner): tok/s = B / its step;
spec_over_nonspec = effective / baseline tok/s. Batches with B·(k+1) > 64 are skipped (the
envelope of the specialized verify step) and listed under `skipped`.

Solo rank: SoloRankComm embeds every id outside this rank's vocab rows as zeros, and a verify
row of such a draft would carry a token-independent hidden state (routing included). So the
drafter's Markov head is tilted to keep its greedy drafts on this rank's rows:
markov_w1[:, 0] = 1, markov_w2[:, 0] = 0 on the rank's rows and −1e4 elsewhere (the same shapes
and work). The target's own tokens (argmax of rank 0's tiled logits) are on its rows anyway.

Summary (exactly two keys): spec_over_nonspec_k7_L6_b1_tp16 and spec_over_nonspec_k7_L6_b1_tp8,
null when that configuration did not run; measured at the run's layer count: with fewer than
all layers the drafter's fixed cost weighs more, so the ratio is about a lower bound of the
all-layer one. Off CUDA (`--device cpu --config tiny`, tests/cpu/test_bench_spec.py) every
step runs eagerly.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass

import torch

from raydecode.engine.cache import BlockAllocator, SlotAllocator
from raydecode.engine.request import SamplingParams
from raydecode.engine.runner import ModelRunner
from raydecode.engine.spec_engine import MAX_VERIFY_TOKENS, verify_in_envelope
from raydecode.engine.spec_runner import SpecRunner, SpecSeq, SpecStepPlan, graphed_spec_runner
from raydecode.engine.step_graph import graph_cache_sizes
from raydecode.models.cache import SeqSlice, StepBatch
from raydecode.models.config import ConfigError, K3Config, load_config
from raydecode.models.dspark import (DSPARK_PRESETS, DSparkConfig, DSparkDrafter,
                                     check_num_drafts, load_dspark_config)
from raydecode.models.dspark_checkpoint import dspark_init_scale
from raydecode.models.k3 import K3ForCausalLM, make_caches

from .report_io import git_commit, int_list, report_header, run_saver
from .step import (BLOCK, Bench, build_model, device_sync, layer_config, rank_vocab_rows,
                   run_batch)

SUMMARY_KEYS = ("spec_over_nonspec_k7_L6_b1_tp16", "spec_over_nonspec_k7_L6_b1_tp8")
STAGES = SpecRunner.STAGES
OFF_RANK = -1e4          # Markov bias of the ids this rank does not embed
GREEDY = SamplingParams(temperature=0.0)
RUNNERS = ("graphed", "eager")
VERIFY_NOTE = ("runner 'graphed': engine/spec_graph.py (graph D: the drafter and its base "
               "logits; graph V: the verify step through the decode kernels with per-position "
               "KDA slots; Markov samples, acceptance and the KDA commit on the device, eager "
               "between the two replays; on the CPU the same statics path eagerly); runner "
               "'eager': SpecRunner over an eager ModelRunner (KDA rollback by recompute); "
               "the baseline is the graphed decode step")
ACCEPTANCE_NOTE = ("synthetic acceptance (benchmarks only): every step accepts exactly the "
                   "first L drafts (SpecStepPlan.synthetic_length = L + 1); emitted tokens "
                   "are meaningless")


# ---- the drafter -------------------------------------------------------------------------------

def drafter_config(name: str, cfg: K3Config) -> DSparkConfig:
    """The drafter preset `name` for the target `cfg` (possibly cut to its first N layers):
    the taps t moved to ⌊t·N/T⌋ of a T-layer original; ValueError when they would collide."""
    if name not in DSPARK_PRESETS:
        raise ValueError(f"--draft {name!r}: expected one of {', '.join(DSPARK_PRESETS)}")
    dcfg = load_dspark_config(name)
    T, N = dcfg.target_num_layers, cfg.num_layers
    if N == T:
        return dcfg
    taps = tuple(t * N // T for t in dcfg.target_layer_ids)
    if len(set(taps)) != len(taps) or N > T:
        raise ValueError(f"--layers {N}: the {name} drafter's {len(taps)} taps of a {T}-layer "
                         f"target need {len(taps)}..{T} layers")
    return dataclasses.replace(dcfg, target_num_layers=N, target_layer_ids=taps)


@torch.no_grad()
def build_drafter(dcfg: DSparkConfig, target: K3ForCausalLM, seed: int) -> DSparkDrafter:
    """The drafter shard of `target`'s rank (its Parallel, comm and dtype), random weights
    drawn on its device at models/dspark_checkpoint.py's scales (`dspark_init_scale`); bound
    to the target."""
    dev = next(target.parameters()).device
    with torch.device(dev):
        drafter = DSparkDrafter(dcfg, target.par, target.comm, target.dtype)
    gen = torch.Generator(device=dev).manual_seed(seed)
    for name, p in drafter.named_parameters():
        x = torch.randn(p.shape, generator=gen, device=dev, dtype=torch.float32)
        p.copy_(dspark_init_scale(name, x, p.full_shape[-1]))
    return drafter.bind_target(target).eval()


@torch.no_grad()
def keep_drafts_on_rank_(drafter: DSparkDrafter, rows: range) -> None:
    """Tilt the Markov head so greedy drafts are ids in `rows` (module docstring): bias(prev)
    = markov_w2 · markov_w1[prev] gains OFF_RANK on every other id, whatever prev is."""
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
    if rows.start == 0 and rows.stop >= w2.shape[0]:
        return                                     # this rank embeds every id
    w1[:, 0] = 1.0
    w2[:, 0] = OFF_RANK
    w2[rows.start:rows.stop, 0] = 0.0


# ---- the rank ----------------------------------------------------------------------------------

@dataclass
class _Seq:
    pos: int              # anchor position = tokens cached
    anchor: int           # newest token, not yet cached
    generated: int = 0    # output index of the next draft (SpecSeq.counter)


class SpecRank:
    """A speculating rank's SpecRunner (runner 'graphed': on engine/spec_graph.py's graphs, as
    load_spec_runner builds a CUDA rank; 'eager': over an eager ModelRunner) on caches holding
    the drafter's rows; B sequences from `context`, each advanced by what its steps emit."""

    def __init__(self, model: K3ForCausalLM, drafter: DSparkDrafter, device, num_slots: int,
                 context: int, max_advance: int, seed: int = 0, runner: str = "eager"):
        self.device, self.context = torch.device(device), context
        per_seq = -(-(context + max_advance) // BLOCK)
        num_blocks = num_slots * per_seq
        ns, nb = (graph_cache_sizes(num_slots, num_blocks) if runner == "graphed"
                  else (num_slots, num_blocks))
        caches = make_caches(model.cfg, model.par, ns, nb, BLOCK, model.dtype,
                             device=device, extra_mla_layers=drafter.cfg.num_layers)
        if runner == "graphed":      # the served build (load_spec_runner) with step graphs
            self.runner = graphed_spec_runner(model, caches, drafter, device, num_slots,
                                              num_blocks, auto=False)
        else:
            self.runner = SpecRunner(ModelRunner(model, caches, device), drafter)
        self.kind = runner
        self.slots, self.blocks = SlotAllocator(num_slots), BlockAllocator(num_blocks, BLOCK)
        self.vocab = rank_vocab_rows(model)
        self.rng = random.Random(seed)
        self.seqs: dict[int, _Seq] = {}
        self._reset: list[int] = []
        self.step_id = 0

    def start(self, B: int) -> None:
        """B fresh sequences at `context` (KDA state reset on their first step)."""
        for s in self.seqs:
            self.slots.release(s)
            self.blocks.release(s)
        slots = [self.slots.allocate() for _ in range(B)]
        self.seqs = {s: _Seq(self.context, self.rng.randrange(self.vocab.start, self.vocab.stop))
                     for s in slots}
        self._reset = list(slots)

    def plan(self, k: int, L: int, path: str) -> SpecStepPlan:
        """Every sequence a verify slice of k+1 tokens (SpecEngine._speculate's layout)."""
        seqs, tokens, spec, tables = [], [], [], {}
        for slot, q in self.seqs.items():
            if self.blocks.ensure(slot, q.pos + k + 1):          # positions p … p+k
                tables[slot] = list(self.blocks.tables[slot])
            start = len(tokens)
            seqs.append(SeqSlice(slot, start, k + 1, q.pos))
            tokens += [q.anchor] + [0] * k                        # drafts: filled on the rank
            spec.append(SpecSeq(f"seq-{slot}", slot, start, q.pos, GREEDY, seed=slot,
                                counter=q.generated))
        reset, self._reset = self._reset, []
        self.step_id += 1
        return SpecStepPlan(self.step_id, StepBatch(seqs), tokens, [], tables, reset, path,
                            spec=spec, num_drafts=k, synthetic_length=float(L + 1))

    def step(self, k: int, L: int, path: str, staged: bool
             ) -> tuple[float, list[list[int]], dict | None]:
        """One speculative step -> (wall seconds, emitted per sequence, stage seconds when
        `staged`: SpecRunner.timings, syncs between its stages)."""
        plan = self.plan(k, L, path)
        self.runner.timings = {} if staged else None
        device_sync(self.device)
        t0 = time.perf_counter()
        res = self.runner.run(plan)
        device_sync(self.device)
        sec = time.perf_counter() - t0
        stages, self.runner.timings = self.runner.timings, None
        for q, e in zip(self.seqs.values(), res.emitted):
            q.pos, q.anchor, q.generated = q.pos + len(e), e[-1], q.generated + len(e)
        return sec, res.emitted, stages


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 4)


# ---- the cases ---------------------------------------------------------------------------------

def run_config(rank: SpecRank, B: int, k: int, L: int, path: str, steps: int,
               warmup: int) -> dict:
    """warmup + steps rounds of (plain step, staged step) at (B, k, L)."""
    rank.start(B)
    counts0 = dict(rank.runner.counts)
    plain, staged, stages = [], [], {s: [] for s in STAGES}
    accepted = Counter()
    for i in range(warmup + steps):
        for is_staged in (False, True):
            sec, emitted, st = rank.step(k, L, path, is_staged)
            accepted.update(len(e) - 1 for e in emitted)
            if i < warmup:
                continue
            if is_staged:
                staged.append(sec)
                for s in STAGES:
                    stages[s].append(st[s])
            else:
                plain.append(sec)
    step = statistics.median(plain)
    stage_ms = {s: _ms(statistics.median(v)) for s, v in stages.items()}
    counts = {key: rank.runner.counts[key] - counts0.get(key, 0) for key in rank.runner.counts}
    graphs = rank.runner.graphs
    return {"runner": rank.kind, "batch": B, "k": k, "accepted": L, "synthetic": True,
            "synthetic_length": L + 1, "path": path, "runner_counts": counts,
            "graph_counts": dict(graphs.counts) if graphs is not None else None,
            "capture_failed": dict((f"b{b} k{kk}", why) for (b, kk), why in
                                   graphs.capture_failed.items()) if graphs is not None else None, "verify_tokens": B * (k + 1), "steps": steps, "warmup": warmup,
            "step_ms": _ms(step), "step_ms_min": _ms(min(plain)), "stage_ms": stage_ms,
            "stage_sum_ms": round(sum(stage_ms.values()), 4),
            "staged_step_ms": _ms(statistics.median(staged)),
            "accepted_per_sequence_step": {str(a): n for a, n in sorted(accepted.items())},
            "accepted_as_asked": set(accepted) == {L},
            "tokens_per_step": B * (L + 1), "effective_tok_s": B * (L + 1) / step}


def profile_step(rank: SpecRank, B: int, k: int, L: int, warmup: int, steps: int = 3) -> dict:
    """torch.profiler over `steps` plain speculative steps at (B, k, L) after `warmup`: the
    ops by device time (CUDA) or host time, as a table (where a stage's time goes), and by
    their own host time (`host_table`: what the host spends between the graph replays)."""
    from torch.profiler import ProfilerActivity, profile

    path = "specialized" if verify_in_envelope(B, k) else "stock"
    rank.start(B)
    for _ in range(warmup + 1):
        rank.step(k, L, path, False)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if rank.device.type == "cuda"
                                     else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            rank.step(k, L, path, False)
    key = "cuda_time_total" if rank.device.type == "cuda" else "cpu_time_total"
    avg = prof.key_averages()
    return {"runner": rank.kind, "batch": B, "k": k, "accepted": L, "steps": steps,
            "sort": key, "table": avg.table(sort_by=key, row_limit=40),
            "host_table": avg.table(sort_by="self_cpu_time_total", row_limit=40)}


def baseline(bench: Bench, B: int, steps: int, warmup: int) -> dict:
    """The non-speculative decode step of B sequences (step.py run_batch; its first step
    captures the graph, so one more warm-up step)."""
    row, _ = run_batch(bench, B, steps, warm=warmup + 1)
    (variant, runner), = bench.runners.items()
    ms = row["ms"][variant]
    out = {"variant": variant, "ms": ms, "ms_min": row["ms_min"][variant],
           "tok_s": B / (ms * 1e-3), "logits_finite": row["logits_finite"]}
    if "graph_counts" in row:
        out.update(graph_counts=row["graph_counts"], capture_failed=row["capture_failed"],
                   graph_support=runner.support[1])
    return out


def run_tp(args, cfg: K3Config, tp: int, save) -> dict:
    """Every configuration at one TP size; `save(run)` after each."""
    try:
        model, build_s = build_model(cfg, tp, args.device, args.seed, dtype=args.dtype)
        dcfg = drafter_config(args.draft, cfg)
        t0 = time.perf_counter()
        drafter = build_drafter(dcfg, model, args.seed + 1)
    except (ValueError, ConfigError) as e:       # a TP the config does not divide, taps
        raise SystemExit(f"--tp {tp}: {e}")
    keep_drafts_on_rank_(drafter, rank_vocab_rows(model))
    run = {"tp": tp, "build_s": round(build_s, 1),
           "drafter_build_s": round(time.perf_counter() - t0, 1),
           "drafter": {"name": dcfg.name, "layers": dcfg.num_layers, "heads": dcfg.num_heads,
                       "heads_on_rank": drafter.layers[0].self_attn.heads,
                       "taps": list(dcfg.target_layer_ids),
                       "taps_published": list(load_dspark_config(args.draft).target_layer_ids),
                       "block_size": dcfg.block_size,
                       "markov_rank": dcfg.markov_rank,
                       "rank_params": sum(p.numel() for p in drafter.parameters())},
           "baseline": {}, "rows": [], "skipped": []}
    tag = f"TP{tp} {cfg.num_layers} layers"
    todo = [B for B in args.batches if any(B * (k + 1) <= MAX_VERIFY_TOKENS for k in args.ks)]
    kmax = max(args.ks)
    ranks = {name: SpecRank(model, drafter, args.device, max(todo, default=1), args.context,
                            2 * (args.warmup + args.steps + 1) * (kmax + 1), args.seed, name)
             for name in args.runners}
    variant = "graphed" if args.device == "cuda" else "specialized"
    bench = Bench(model, args.device, max(todo, default=1), args.context, (variant,))
    for B in args.batches:
        if B not in todo:
            print(f"[spec] {tag} b{B}: skipped, batch·(k+1) > {MAX_VERIFY_TOKENS} for every k",
                  flush=True)
        else:
            base = run["baseline"][str(B)] = baseline(bench, B, args.steps, args.warmup)
            print(f"[spec] {tag} b{B} non-speculative {variant}: {base['ms']:.3f} ms "
                  f"{base['tok_s']:.1f} tok/s", flush=True)
            save(run)
        for k in args.ks:
            if B * (k + 1) > MAX_VERIFY_TOKENS:
                run["skipped"].append({"batch": B, "k": k, "verify_tokens": B * (k + 1),
                                       "why": f"batch·(k+1) > {MAX_VERIFY_TOKENS}"})
                print(f"[spec] {tag} b{B} k={k}: skipped, batch·(k+1) = {B * (k + 1)} > "
                      f"{MAX_VERIFY_TOKENS}", flush=True)
                continue
            path = args.verify_path
            if path == "envelope":
                path = "specialized" if verify_in_envelope(B, k) else "stock"
            accepts = [a for a in args.accepts if a <= k] if args.accepts else range(1, k + 1)
            if not accepts:
                print(f"[spec] {tag} b{B} k={k}: skipped, no L <= k in --accepts", flush=True)
            for name, L in ((n, a) for n in args.runners for a in accepts):
                row = run_config(ranks[name], B, k, L, path, args.steps, args.warmup)
                base = run["baseline"][str(B)]
                row.update(nonspec_ms=base["ms"], nonspec_tok_s=base["tok_s"],
                           spec_over_nonspec=row["effective_tok_s"] / base["tok_s"])
                run["rows"].append(row)
                st = row["stage_ms"]
                print(f"[spec] {tag} b{B} k={k} L={L} {name} (synthetic, {path}): draft "
                      f"{st['draft']:.2f} verify {st['verify']:.2f} accept {st['accept']:.2f} "
                      f"ms, step {row['step_ms']:.2f} ms, {row['effective_tok_s']:.1f} tok/s vs "
                      f"{variant} {base['ms']:.2f} ms {base['tok_s']:.1f} tok/s: "
                      f"{row['spec_over_nonspec']:.3f}x"
                      + ("" if row["accepted_as_asked"] else
                         f" ACCEPTED {row['accepted_per_sequence_step']}"), flush=True)
                save(run)
    if args.profile and todo:
        run["profile"] = profile_step(ranks[args.runners[0]], min(todo), kmax,
                                      min(kmax, max(args.accepts or [kmax])), args.warmup)
        print(run["profile"]["table"], flush=True)
        save(run)
    del ranks, bench, drafter, model
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return run


def summarize(runs: list[dict]) -> dict:
    """SUMMARY_KEYS: spec_over_nonspec of (b1, k7, L6) at TP16 / TP8; None where not run."""
    def ratio(tp: int):
        rows = [r for run in runs if run["tp"] == tp for r in run["rows"]
                if (r["batch"], r["k"], r["accepted"]) == (1, 7, 6)]
        rows.sort(key=lambda r: RUNNERS.index(r.get("runner", "eager")))   # graphed first
        return rows[0]["spec_over_nonspec"] if rows else None
    return {"spec_over_nonspec_k7_L6_b1_tp16": ratio(16),
            "spec_over_nonspec_k7_L6_b1_tp8": ratio(8)}


def plot(runs: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    runs = [r for r in runs if r["rows"]]
    if not runs:
        return
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), squeeze=False)
    styles = ("-", "--", ":", "-.")
    for ax, run in zip(axes[0], runs):
        batches = sorted({r["batch"] for r in run["rows"]})
        for k in sorted({r["k"] for r in run["rows"]}):
            color = None
            for i, B in enumerate(batches):
                rows = [r for r in run["rows"] if (r["k"], r["batch"]) == (k, B)]
                if rows:
                    line, = ax.plot([r["accepted"] for r in rows],
                                    [r["effective_tok_s"] for r in rows], "o",
                                    ls=styles[i % 4], color=color, label=f"k={k} b{B}")
                    color = line.get_color()
        for i, B in enumerate(batches):
            ax.axhline(run["baseline"][str(B)]["tok_s"], color="gray", ls=styles[i % 4], lw=1,
                       label=f"non-speculative b{B}")
        ax.set_xlabel("accepted drafts per step L (synthetic)")
        ax.set_ylabel("effective tok/s = B·(L+1) / step")
        ax.set_title(f"TP{run['tp']}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="k3", help="model config: k3 (default), tiny or a path")
    ap.add_argument("--draft", default=None, help="drafter preset (default: the --config name: "
                    f"{', '.join(DSPARK_PRESETS)})")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--tp", type=int, default=16, help="tensor-parallel size one device plays")
    ap.add_argument("--tps", default=None, help="comma-separated TP sizes run one after the "
                    "other (overrides --tp), e.g. 16,8")
    ap.add_argument("--layers", type=int, default=0, help="first N layers (0: all)")
    ap.add_argument("--ks", default="3,5,7", help="drafts per step k (1..the drafter's block)")
    ap.add_argument("--accepts", default=None, help="accepted drafts per step L (synthetic; "
                    "default: 1..k for each k; values above a k are skipped for it)")
    ap.add_argument("--batches", default="1,2,4,8", help="sequences per step (batch·(k+1) > "
                    f"{MAX_VERIFY_TOKENS} skipped)")
    ap.add_argument("--context", type=int, default=1024, help="tokens cached per sequence at "
                    "the start of each configuration")
    ap.add_argument("--steps", type=int, default=10, help="timed steps of each kind")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds per configuration")
    ap.add_argument("--verify-path", default="envelope",
                    choices=("envelope", "specialized", "stock"),
                    help="the verify step's path: the envelope's choice (default) or forced")
    ap.add_argument("--runners", default="graphed", help="comma-separated speculative "
                    f"runners: {', '.join(RUNNERS)} (the summary takes graphed where it ran)")
    ap.add_argument("--profile", action="store_true", help="after each TP's rows: a "
                    "torch.profiler table of three steps at the smallest batch, largest k")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON path (default: print only)")
    ap.add_argument("--png", default=None, help="effective tok/s against L per k (matplotlib)")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args(argv)
    tps = int_list("--tps" if args.tps else "--tp", args.tps or str(args.tp), 1)
    args.ks = int_list("--ks", args.ks, 1)
    args.batches = int_list("--batches", args.batches, 1)
    args.accepts = int_list("--accepts", args.accepts, 0) if args.accepts else None
    args.runners = [r.strip() for r in args.runners.split(",") if r.strip()]
    if not args.runners or any(r not in RUNNERS for r in args.runners):
        raise SystemExit(f"--runners {','.join(args.runners)}: expected a comma-separated "
                         f"subset of {', '.join(RUNNERS)}")
    if args.context < 1 or args.steps < 1 or args.warmup < 0:
        raise SystemExit(f"--context {args.context} --steps {args.steps} --warmup "
                         f"{args.warmup}: expected context, steps >= 1 and warmup >= 0")
    args.dtype = getattr(torch, args.dtype)
    try:
        cfg = layer_config(args.config, args.layers)
        args.draft = args.draft or str(args.config)
        dcfg = drafter_config(args.draft, cfg)
    except (ValueError, ConfigError) as e:
        raise SystemExit(str(e))
    try:
        for k in args.ks:
            check_num_drafts(k, dcfg)          # k <= the drafter's block (DESIGN §6)
    except ConfigError as e:
        raise SystemExit(f"--ks {','.join(map(str, args.ks))}: {e}")
    total = load_config(args.config).num_layers
    t0 = time.time()
    report = report_header(
        args.commit or git_commit(), bench="spec", config=cfg.name, device=args.device,
        dtype=str(args.dtype).removeprefix("torch."), layers=cfg.num_layers,
        layers_total=total, context=args.context, ks=args.ks, accepts=args.accepts,
        batches=args.batches, steps=args.steps, warmup=args.warmup, seed=args.seed,
        verify_path=args.verify_path, drafter=args.draft, acceptance=ACCEPTANCE_NOTE,
        synthetic=True, outputs_meaningless=True, runners=args.runners,
        verify_graphed="graphed" in args.runners,
        verify_note=VERIFY_NOTE, stages=list(STAGES),
        summary_method="spec_over_nonspec of batch 1, k = 7, L = 6 at TP16 / TP8 (effective "
                       "tok/s 7 / step_ms over the graphed step's 1 / ms), at the run's layer "
                       "count, the graphed runner's where it ran; null where not run",
        method=__doc__.split("\n\n", 2)[2])
    if args.device == "cuda":
        from .layer import _env
        report["env"] = _env()
    save = run_saver(report, summarize, args.out, t0)

    for tp in tps:
        save(run_tp(args, cfg, tp, save))
    print("[spec] summary", report["summary"], flush=True)
    if args.png:
        plot(report["runs"], args.png, f"{cfg.name} rank 0, DSpark {args.draft}, "
             f"{cfg.num_layers} of {total} layers, context {args.context}, synthetic acceptance")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
