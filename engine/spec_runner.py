"""Rank side of DSpark speculative decoding: draft, verify, accept and roll back in one step.

A `SpecStepPlan` (a StepPlan plus the speculating sequences) is identical on every rank. For each
speculating sequence (`SpecSeq`; its anchor = newest token, at position p = tokens cached):
  1. draft   the drafter runs [anchor, mask × (k-1)] at p … p+k-1 over its context rows (< p)
             and samples d_1 … d_k left to right with the Markov bias, under the request's
             sampling params (greedy: argmax) on the device, counter-based
             (engine/spec_sampling.py); q_j is the distribution d_j was drawn from;
  2. verify  ONE target step runs [anchor, d_1 … d_k] at p … p+k (a slice of length k+1)
             together with the step's other sequences (prefill chunks, plain decodes). The
             step's hidden taps write the drafter's context rows of every token; KDA layers
             hand their inputs to `KDARollback`;
  3. accept  greedy, probabilistic (speculative sampling) or synthetic (benchmarks) for every
             verifying sequence at once on the device (engine/spec_sampling.py)
             -> emitted e_1 … e_{a+1}: a accepted drafts + the correction or bonus token;
  4. commit  positions p … p+a (anchor + accepted drafts) are now validly cached: each KDA
             slot is recomputed from its pre-step state over exactly those a+1 tokens (nothing
             to do when all k+1 were accepted). MLA rows and draft context rows at p+a+1 … p+k
             are stale and are overwritten by later steps; the engine counts num_cached = p+a+1.
All ranks see the same all-gathered logits and hash the same seeds, so they agree on drafts
and emitted tokens; with TP > 1 rank 0's values are broadcast anyway (two small all-reduces),
so a divergence could never desynchronise the rollback.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from raydecode.kernels.settings import DecodeOptions
from raydecode.models.cache import KDAStateCache, SeqSlice, StepBatch
from raydecode.models.kda import kda_recurrent

from .request import SamplingParams
from .runner import ModelRunner
from . import spec_sampling
from .sampling import SamplingRows, StepResult, sample_isolated
from .scheduler import StepPlan
from .spec import SyntheticAcceptance

log = logging.getLogger("raydecode.spec")


@dataclass(frozen=True)
class SpecSeq:
    request_id: str
    slot: int
    start: int                 # flat offset of its k+1 verify tokens [anchor, d_1 … d_k]
    pos: int                   # anchor position = tokens already cached
    params: SamplingParams
    seed: int                  # its sampling seed (engine/spec_sampling.py streams)
    counter: int = 0           # output index of its first draft (= tokens generated so far)


@dataclass
class SpecStepPlan(StepPlan):
    """A StepPlan whose `spec` sequences verify k drafts each. Their slices in `batch` have
    length k+1 and their `tokens` hold the anchor then k placeholders the ranks fill with the
    drafts; `sample_rows` are the rows of the other (plain) sequences only."""
    spec: list[SpecSeq] = field(default_factory=list)
    num_drafts: int = 0
    synthetic_length: float | None = None      # benchmarks only: outputs are meaningless
    synthetic_seed: int = 0
    release_ids: list[str] = field(default_factory=list)   # finished: drop their generators

    @property
    def spec_k(self) -> int | None:
        """Drafts per verifying sequence (envelope input); None when nothing speculates."""
        return self.num_drafts if self.spec else None

    @property
    def verify_tokens(self) -> int:
        return len(self.spec) * (self.num_drafts + 1)

    @property
    def decode_only(self) -> bool:
        """Every sequence is a verify slice or a one-token decode (no prefill chunk)."""
        starts = {s.start for s in self.spec}
        return all(s.length == 1 or s.start in starts for s in self.batch.seqs)


@dataclass
class SpecStepResult:
    logits: torch.Tensor | None          # (len(sample_rows), V) fp32, plain rows (run only)
    emitted: list[list[int]]             # per plan.spec: accepted drafts + correction/bonus
    plain: StepResult | None = None      # execute: the plain rows sampled (no logits)


class KDARollback:
    """Keeps, per (KDA state row, slot) of the verifying slots, the step's conv input xs, the
    per-token (q, k, v, g, beta) and a copy of the pre-step state S0; `rollback(n)` makes the
    slot hold the state after only the first n tokens:
        conv = xs[n : n + W-1]ᵀ,   S = kda_recurrent(first n tokens, S0)."""

    def __init__(self, slots: set[int]):
        self.slots = slots
        self.records: dict[tuple[int, int], tuple] = {}

    def __call__(self, row: int, s: SeqSlice, xs: torch.Tensor, qkvgb: tuple,
                 state: torch.Tensor) -> None:
        if s.slot in self.slots:
            self.records[(row, s.slot)] = (xs, qkvgb, state.clone())

    def rollback(self, cache: KDAStateCache, slot: int, n: int) -> None:
        for (row, sl), (xs, (q, k, v, g, beta), S0) in self.records.items():
            L = q.shape[0]
            if sl != slot or n == L:      # all kept: the step already left the right state
                continue
            assert 1 <= n < L, (n, L)
            w1 = xs.shape[0] - L
            cache.conv[row, slot] = xs[n:n + w1].t().to(cache.conv.dtype)
            _, S = kda_recurrent(q[:n], k[:n], v[:n], g[:n], beta[:n], q.shape[-1] ** -0.5, S0)
            cache.rec[row, slot] = S


class SpecRunner:
    """`run(plan)`: a SpecStepPlan -> SpecStepResult; a plain StepPlan -> logits, as
    ModelRunner.run (both also write the drafter's context rows). Drop-in for the runner a
    RankWorker or LocalExecutor holds.

    `timings`: None (served: no stage timing, no extra sync) or a dict that each speculative
    `run` fills with its stages' seconds (`_stopwatch`; scripts/bench/spec.py)."""

    STAGES = ("prepare", "draft", "verify", "accept")

    def __init__(self, runner: ModelRunner, drafter, graphs=None):
        self.runner, self.drafter = runner, drafter
        self.model, self.caches, self.device = runner.model, runner.caches, runner.device
        self._synthetic: tuple[tuple, SyntheticAcceptance] | None = None
        self.timings: dict[str, float] | None = None
        # engine/spec_graph.py SpecGraphs: speculative steps it accepts (`why_not` None) run
        # graphed; None: every step eager
        self.graphs = graphs
        self.num_drafts: int | None = None   # the replica's k (spec graphs captured for it)
        self.counts = {"graphed": 0, "eager": 0}

    @property
    def spec_graphed(self) -> bool:
        """Speculative steps replay captured graphs (CUDA, captured at build)."""
        g = self.graphs
        return g is not None and bool(g.capture) and any(
            x.draft is not None and x.verify is not None for x in g.graphs.values())

    def release(self, slots: list[int]) -> None:
        self.runner.release(slots)

    @torch.inference_mode()
    def execute(self, plan: StepPlan, sample: bool = True):
        """As ModelRunner.execute: a plain StepPlan -> StepResult; a SpecStepPlan ->
        SpecStepResult(None, emitted, plain rows sampled). sample=False: None."""
        out = self.run(plan)
        if not sample:
            return None
        logits = out.logits if isinstance(out, SpecStepResult) else out
        rows = plan.sampling or SamplingRows.greedy(len(plan.sample_rows))
        plain = sample_isolated(logits, rows)
        return SpecStepResult(None, out.emitted, plain) if isinstance(out, SpecStepResult) \
            else plain

    def why_eager(self, plan: StepPlan) -> str | None:
        """None if `plan` (a SpecStepPlan) runs on the spec graphs, else why not."""
        if self.graphs is None:
            return "no spec graphs on this rank"
        if not isinstance(plan, SpecStepPlan):
            return "not a speculative step"
        return self.graphs.why_not(plan)

    @torch.inference_mode()
    def run(self, plan: StepPlan):
        spec = plan.spec if isinstance(plan, SpecStepPlan) else []
        if spec and self.why_eager(plan) is None:
            self.counts["graphed"] += 1
            return self._run_graphed(plan)
        if spec:
            self.counts["eager"] += 1
        lap = self._stopwatch(bool(spec))
        tokens = self.runner.prepare(plan)
        rollback = None
        if spec:
            lap("prepare")
            k = plan.num_drafts
            drafts, q = self._draft(plan, k)                                   # (B, k)
            at = torch.tensor([s.start + 1 + j for s in spec for j in range(k)],
                              device=tokens.device)
            tokens[at] = drafts.flatten().to(tokens.device)
            rollback = KDARollback({s.slot for s in spec})
            lap("draft")
        # the rows whose logits the step reads: the plain sample rows, then each speculative
        # sequence's k + 1 verify rows; the target's final mix and norm run on them alone
        # (ModelRunner.final_rows, as the plain runner's step)
        n = len(plan.sample_rows)
        need = torch.tensor(list(plan.sample_rows) + [s.start + j for s in spec
                                                      for j in range(plan.num_drafts + 1)],
                            dtype=torch.long, device=tokens.device)
        final_rows = self.runner.final_rows
        hidden = self._target(tokens, plan, rollback, need if final_rows else None)
        if not final_rows:
            hidden = hidden.index_select(0, need)                        # (len(need), H)
        logits = self.model.compute_logits(hidden[:n]).float()
        if not isinstance(plan, SpecStepPlan):
            return logits
        if not spec:
            return SpecStepResult(logits, [])
        vlogits = self.model.compute_logits(hidden[n:]).float()
        vlogits = vlogits.view(len(spec), k + 1, -1)
        lap("verify")
        emitted = self._agree(self._accept(plan, drafts, q, vlogits), k)
        if self.caches.kda is not None:
            for s, e in zip(spec, emitted):
                rollback.rollback(self.caches.kda, s.slot, len(e))
        lap("accept")
        return SpecStepResult(logits, emitted)

    def _run_graphed(self, plan: SpecStepPlan) -> SpecStepResult:
        """The speculative step on engine/spec_graph.py's graphs: statics, graph D (drafter
        and Markov samples), graph V, acceptance and the KDA commit on the device; one host
        sync."""
        lap = self._stopwatch(True)
        rows = self._rows(plan)
        greedy = plan.synthetic_length is not None or rows.all_greedy
        g, _ = self.graphs.prepare(plan, rows, greedy)
        lap("prepare")
        drafts, q = self.graphs.draft(g)                              # (n, k), (n, k, V)|None
        lap("draft")
        vlogits = self.graphs.verify_logits(g)                                   # (n, T, V)
        lap("verify")
        if plan.synthetic_length is None and greedy:
            emitted, lengths = spec_sampling.accept_greedy(drafts, vlogits)
        else:
            emitted, lengths = self._accept_device(plan, drafts, q, vlogits)
        # rank 0's acceptance on every rank (a no-op at TP 1) before the commit, so every
        # rank keeps the same KDA positions; then the step's one host sync
        res = self._from_rank0(torch.cat([lengths.view(-1, 1).to(emitted.dtype), emitted], 1))
        self.graphs.commit(g, res[:, 0])
        out = [row[1:1 + row[0]] for row in res.tolist()]
        lap("accept")
        return SpecStepResult(vlogits.new_empty(0, vlogits.shape[-1]), out)

    def _stopwatch(self, on: bool):
        """lap(stage): with `timings` a dict and `on`, synchronize the device and store the
        seconds since the previous lap (the first: since this call) under `stage`; otherwise
        a no-op, so a served step never syncs here (benchmarks only)."""
        if self.timings is None or not on:
            return lambda stage: None
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        last = [time.perf_counter()]

        def lap(stage: str) -> None:
            if cuda:
                torch.cuda.synchronize(self.device)
            now = time.perf_counter()
            self.timings[stage] = now - last[0]
            last[0] = now
        return lap

    # ---- the three stages -----------------------------------------------------------------
    def _target(self, tokens: torch.Tensor, plan: StepPlan, observer,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """The target step with the drafter's taps; writes the context rows of every token.
        -> the hidden state of `rows` (every row's with None)."""
        self.caches.kda_observer = observer
        try:
            hidden, tapped = self.model(tokens, plan.batch, self.caches, path=plan.path,
                                        taps=self.drafter.taps, rows=rows)
        finally:
            self.caches.kda_observer = None
        self.drafter.write_context(tapped, plan.batch, self.caches)
        return hidden

    def _draft(self, plan: SpecStepPlan, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One non-causal drafter pass, then left-to-right Markov sampling on the device.
        -> drafts (B, k) long, q (B, k, V) the distributions they were drawn from."""
        spec, dev = plan.spec, self.device
        B = len(spec)
        anchors = torch.tensor([plan.tokens[s.start] for s in spec], dtype=torch.long, device=dev)
        toks = torch.full((B, k), self.drafter.cfg.mask_token_id, dtype=torch.long, device=dev)
        toks[:, 0] = anchors
        batch = StepBatch([SeqSlice(s.slot, i * k, k, s.pos) for i, s in enumerate(spec)])
        base = self.drafter.base_logits(self.drafter(toks.flatten(), batch, self.caches))
        return self._markov(plan, base.view(B, k, -1), anchors)

    def _markov(self, plan: SpecStepPlan, base: torch.Tensor, anchors: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """base (B, k, V) -> drafts (B, k) (rank 0's), q (B, k, V): left to right, each draft
        sampled from base_j + the Markov bias of the previous token, on the device."""
        f, i = self._rows(plan).tensors(base.device)
        drafts, q = spec_sampling.sample_drafts(base, self.drafter.markov_bias, anchors, f, i)
        return self._from_rank0(drafts), q

    def _accept_device(self, plan: SpecStepPlan, drafts: torch.Tensor, q: torch.Tensor,
                       logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every verifying sequence at once on the device (engine/spec_sampling.py) ->
        (emitted (B, k+1), lengths (B,)) device tensors."""
        if plan.synthetic_length is not None:
            syn = self._synthetic_for(plan)
            a = torch.tensor([min(syn.accepted_drafts(), drafts.shape[1]) for _ in plan.spec],
                             device=drafts.device)
            return spec_sampling.synthetic(drafts, logits, a)
        return spec_sampling.verify(drafts, q, logits, self._rows(plan))

    def _accept(self, plan: SpecStepPlan, drafts: torch.Tensor, q: torch.Tensor,
                logits: torch.Tensor) -> list[list[int]]:
        """`_accept_device`; the emitted ids are the step's one host sync of the speculative
        part."""
        emitted, lengths = self._accept_device(plan, drafts, q, logits)
        return [e[:n] for e, n in zip(emitted.tolist(), lengths.tolist())]

    @staticmethod
    def _rows(plan: SpecStepPlan) -> SamplingRows:
        """The verifying sequences' sampling (synthetic mode: greedy drafts)."""
        greedy = plan.synthetic_length is not None
        return SamplingRows.build([SamplingParams(temperature=0.0) if greedy else s.params
                                   for s in plan.spec], [s.seed for s in plan.spec],
                                  [s.counter for s in plan.spec])

    def _synthetic_for(self, plan: SpecStepPlan) -> SyntheticAcceptance:
        key = (plan.synthetic_length, plan.num_drafts, plan.synthetic_seed)
        if self._synthetic is None or self._synthetic[0] != key:
            self._synthetic = (key, SyntheticAcceptance(*key))
        return self._synthetic[1]

    def _from_rank0(self, t: torch.Tensor) -> torch.Tensor:
        return rank0_value(self.model, t)

    def _agree(self, emitted: list[list[int]], k: int) -> list[list[int]]:
        if self.model.par.tp_size == 1 or not emitted:
            return emitted
        rows = [[len(e), *e] + [0] * (k + 1 - len(e)) for e in emitted]
        t = self._from_rank0(torch.tensor(rows, dtype=torch.long, device=self.device)).tolist()
        return [row[1:1 + row[0]] for row in t]


def rank0_value(model, t: torch.Tensor) -> torch.Tensor:
    """Rank 0's `t` on every rank of the model's TP group (an all-reduce of it and zeros;
    capturable); `t` itself at TP 1."""
    par, comm = model.par, model.comm
    if par.tp_size == 1:
        return t
    return comm.all_reduce(t if par.tp_rank == 0 else torch.zeros_like(t))


# ---- building one rank's runner ----------------------------------------------------------------

@dataclass(frozen=True)
class SpecShardSpec:
    """What every rank of a speculating replica loads (picklable)."""
    model: str
    draft: str | None = None             # None: resolve_drafter(model)
    dtype: str = "float32"
    num_slots: int = 16
    num_blocks: int = 256
    block_size: int = 16
    seed: int = 0                        # random weights of a preset drafter
    decode: DecodeOptions | None = None  # the target's decode options; None: served defaults
    # engine/spec_graph.py: speculative steps on CUDA graphs; None: auto (CUDA ranks whose
    # model the graphs support), True: always (eager statics off CUDA), False: never
    step_graphs: bool | None = None
    num_drafts: int | None = None        # the replica's k: its spec graphs captured at build


def resolve_drafter(draft: str | None, model: str) -> str:
    """The drafter spec: given, else `tiny` for the tiny target, else `<model>/dspark`."""
    from raydecode.models.config import ConfigError

    if draft is not None:
        return str(draft)
    if str(model) == "tiny":
        return "tiny"
    p = Path(str(model)) / "dspark"
    if (p / "config.json").is_file():
        return str(p)
    raise ConfigError(f"no drafter given and none ships with model {model!r} (looked for "
                      f"{p}/config.json); pass --draft PATH or 'tiny'")


def load_spec_runner(spec: SpecShardSpec, par, comm, device: str = "cpu") -> SpecRunner:
    """RunnerFactory for a speculating replica: target shard + drafter shard + caches whose MLA
    pool carries the drafter's layers as extra rows."""
    from raydecode.models.dspark_checkpoint import load_drafter
    from raydecode.models.k3 import make_caches
    from raydecode.models.weights import load_model

    from .loader import parse_dtype, resolve_checkpoint

    from .step_graph import graph_cache_sizes, resolve

    dt = parse_dtype(spec.dtype)
    cfg, model = load_model(resolve_checkpoint(spec.model), par, comm, dt, device,
                            options=spec.decode)
    drafter = load_drafter(resolve_drafter(spec.draft, spec.model), model, par, comm, dt, device,
                           seed=spec.seed)
    graphs = resolve(spec.step_graphs, device)
    ns, nb = (graph_cache_sizes(spec.num_slots, spec.num_blocks) if graphs
              else (spec.num_slots, spec.num_blocks))
    caches = make_caches(cfg, par, ns, nb, spec.block_size, dt, device,
                         extra_mla_layers=drafter.cfg.num_layers)
    if not graphs:
        return SpecRunner(ModelRunner(model, caches, device), drafter)
    runner = graphed_spec_runner(model, caches, drafter, device, spec.num_slots,
                                 spec.num_blocks, auto=spec.step_graphs is None)
    runner.num_drafts = spec.num_drafts      # captured by prepare_spec_graphs at the build
    return runner


def prepare_spec_graphs(runner) -> tuple[list | None, str | None]:
    """Before serving (actors/rank_worker.py `prepare_runner`, after the rank's comm is
    connected; collective at TP > 1): a SpecRunner with spec graphs captures every bucket at
    its k (`SpecGraphs.capture_all`), so no speculative step captures on the request path.
    -> (captured (bucket, k, greedy) keys, None) | (None, None) without spec graphs |
    ([], why) when the capture raised (each bucket then captures on its first step)."""
    g = getattr(runner, "graphs", None)
    k = getattr(runner, "num_drafts", None)
    if not isinstance(runner, SpecRunner) or g is None or not k:
        return None, None
    try:
        done = g.capture_all(k)
    except Exception as e:  # noqa: BLE001 — every bucket keeps its first-step capture
        log.warning("spec graphs not captured at build (%s: %s); each bucket captures on its "
                    "first speculative step", type(e).__name__, e)
        return [], f"{type(e).__name__}: {e}"
    failed = "; ".join(f"b{b} k{kk} {'greedy' if gr else 'sampled'}: {why}"
                       for (b, kk, gr), why in sorted(g.capture_failed.items()))
    return done, failed or None


def graphed_spec_runner(model, caches, drafter, device, num_slots: int, num_blocks: int,
                        auto: bool = True, capture: bool | None = None,
                        max_blocks: int | None = None) -> SpecRunner:
    """A SpecRunner whose speculative steps run on engine/spec_graph.py's graphs, on caches
    built with `graph_cache_sizes(num_slots, num_blocks)`. auto: where the model's fused step
    is unsupported, the eager SpecRunner instead (no graphs)."""
    from .spec_graph import SpecGraphs
    from .step_graph import GraphedRunner

    runner = GraphedRunner(model, caches, device, num_slots=num_slots, num_blocks=num_blocks,
                           max_blocks=max_blocks, capture=capture)
    if auto and not runner.support[0]:
        return SpecRunner(ModelRunner(model, caches, device), drafter)
    return SpecRunner(runner, drafter, SpecGraphs(runner, drafter))


__all__ = ["SpecSeq", "SpecStepPlan", "SpecStepResult", "KDARollback", "SpecRunner",
           "SpecShardSpec", "graphed_spec_runner", "load_spec_runner", "prepare_spec_graphs",
           "rank0_value", "resolve_drafter"]
