"""The coordinator of one replica: continuous batching over `LLMEngine`, the envelope decision
once per step, counters per path, and fail-over to the stock pool.

`CoordinatorCore` is plain asyncio (tested without Ray); `Coordinator` is the thin Ray actor
around it. The step loop runs `LLMEngine.step` in a worker thread under a timeout; requests and
aborts arriving meanwhile are queued and applied between steps, so the scheduler is never
mutated while a step runs. When a step raises or times out, the replica turns unhealthy: every
request in flight continues on the stock pool from its generated prefix (none lost, none
duplicated), the executor is rebuilt by the injected factory, and new requests are taken again.

With `speculative_config` the engine is a `SpecEngine` (DSpark draft → verify → accept run on
the ranks); each verification step is one envelope decision on k and batch·(k+1), and the
acceptance statistics live here, so they outlast executor rebuilds.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Protocol

import torch

from raydecode.engine.engine import EngineConfig, LLMEngine, LocalExecutor, StepOutput
from raydecode.engine.request import RequestError, SamplingParams
from raydecode.engine.sampling import StepResult
from raydecode.engine.scheduler import StepPlan
from raydecode.engine.spec import AcceptanceStats
from raydecode.engine.spec_engine import SpecEngine
from raydecode.kernels.settings import pad_prefill as pad_prefill_setting
from raydecode.kernels.settings import stock_graphs as stock_graphs_setting
from raydecode.kernels.settings import stock_mixed as stock_mixed_setting
from raydecode.kernels.settings import stock_single as stock_single_setting

from . import envelope
from .config import DeployConfig, check_speculative, parse_deploy_config
from .stock_pool import Continuation, StockPoolClient, StockPoolError, merge

log = logging.getLogger("raydecode.coordinator")

PATHS = ("specialized", "stock")
REBUILD_BACKOFF_S = (1.0, 5.0, 30.0)
WATCHDOG_MARGIN_S = 10.0      # a loop silent this long (at most) past the step deadline: stalled
MAX_AHEAD = 2                 # steps the step thread may run before the streams have their outputs


class Overloaded(RuntimeError):
    """No capacity for the request now (queue full, or replica unhealthy without a stock pool);
    the client should retry (HTTP 503 + Retry-After)."""


class StepFailed(RuntimeError):
    """A step raised or did not return in time; the message names the step."""


class RequestFailed(RuntimeError):
    """This request alone could not continue (its sampling raised on the device); the step and
    every other request in it went on."""


# ---- the executor interface ----------------------------------------------------------------
class ReplicaExecutor(Protocol):
    """What the coordinator drives. `execute` runs `plan` on `plan.path` (set by the
    coordinator) and returns a StepResult: the token sampled on the device for each sample row
    (plan.sampling says how), logprobs where asked, never logits; for a speculating replica the
    plan is a SpecStepPlan and the result a SpecStepResult (engine/spec_runner.py)."""
    tp_size: int
    dcp_size: int
    domain_verified: bool          # the TP group lies in one verified NVLink domain

    def specialized_ready(self, num_seqs: int) -> bool: ...   # kernels compiled, graph captured

    # optional: True when decode steps replay captured graphs (the stock path is then far
    # slower than a decode step, and mixed steps are split: `split_mixed_steps` auto)
    # decode_graphed: bool

    def execute(self, plan: StepPlan) -> StepResult: ...

    def close(self) -> None: ...


def _pacer_stats(p) -> dict:
    """The decode-slowdown pacer's state for /stats (engine/pacer.py): its limit and prompt
    stretch limit, the chunk steps where no size fits the limit (`infeasible`), those raised
    to the prompt's rate floor (`stretched`), its reprobes, and the step times it judges by
    (ms; decode_ms keyed by the decode batch's bucket, chunk_ms by the step's token bucket:
    the chunk's tokens on split steps, the chunk's and the decode rows' on mixed ones)."""
    return {"limit": p.limit, "mixed_steps": p.mixed, "stretch": p.stretch,
            "infeasible": p.infeasible, "stretched": p.stretched, "reprobes": p.reprobes,
            "decode_ms": {b: round(t * 1e3, 3) for b, t in sorted(p.decode_s.items())},
            "chunk_ms": {b: round(t * 1e3, 3) for b, t in sorted(p.chunk_s.items())}}


class LocalReplicaExecutor(LocalExecutor):
    """TP = 1 in this process: the runner a rank would build (`load_runner`), so on a CUDA
    device a GraphedRunner whose buckets were captured at build and whose decode steps replay
    them; specialized is ready for a step when its bucket is captured (always, eagerly, on
    CPU and for other runners)."""
    tp_size, dcp_size, domain_verified = 1, 1, False

    def specialized_ready(self, num_seqs: int) -> bool:
        from raydecode.engine.step_graph import GraphedRunner

        r = self.runner
        return r.ready(num_seqs) if isinstance(r, GraphedRunner) and r.capture else True

    @property
    def decode_graphed(self) -> bool:
        """Decode steps replay captured graphs: the step graphs, or a speculating runner's
        spec graphs (either way a decode riding a prefill step would run eagerly)."""
        from raydecode.engine.step_graph import GraphedRunner

        r = self.runner
        if getattr(r, "spec_graphed", False):
            return True
        return isinstance(r, GraphedRunner) and bool(r.capture) and bool(r.graphs)

    @property
    def kda_snapshot_slots(self) -> int:
        kda = self.runner.caches.kda
        return kda.snap_rec.shape[1] if kda is not None else 1 << 30

    def close(self) -> None:
        pass


def fit_prefix_cache(ecfg: EngineConfig, executor) -> EngineConfig:
    """The engine config `executor` can serve: prefix caching addresses the ranks' KDA
    snapshot slots, so it keeps at most the executor's `kda_snapshot_slots` (an executor that
    does not say has none: caching off)."""
    have = getattr(executor, "kda_snapshot_slots", 0)
    if ecfg.num_snapshots <= have:
        return ecfg
    if ecfg.enable_prefix_caching:
        log.warning("prefix caching with %d KDA snapshot slots asked; the executor holds %d",
                    ecfg.num_snapshots, have)
    return dataclasses.replace(ecfg, num_snapshots=have,
                               enable_prefix_caching=ecfg.enable_prefix_caching and have > 0)


def executor_supports(config: DeployConfig) -> bool:
    """Whether `build_executor` can build this config: any TP the model shards into (the
    envelope, not this, decides which steps run specialized)."""
    from raydecode.models.parallel import Parallel

    try:
        Parallel(0, config.tensor_parallel_size, config.decode_context_parallel_size)
    except ValueError:
        return False
    return True


def build_executor(config: DeployConfig) -> ReplicaExecutor:
    """The replica's executor. TP = 1 and DCP = 1: the model runs in this process. Otherwise a
    group of TP rank actors; on a cluster with GPUs the group is placed by the cluster layer
    (one NVLink domain in the production profile, one node in the development profile), on a
    CPU-only cluster the ranks are plain actors (gloo) and the replica says so in its stats.
    With speculative_config every runner is a SpecRunner (target shard + drafter shard, the
    drafter's latent rows in the target's MLA pool)."""
    mcfg = _model_config(config.model)
    ecfg = config.engine_config(mcfg.max_position_embeddings)
    tp, dcp = config.tensor_parallel_size, config.decode_context_parallel_size
    spec = _spec_shard(config, ecfg)
    if tp == 1 and dcp == 1:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            torch.set_num_threads(1)    # a busy intra-op pool stalls small decode steps
        if spec is not None:
            from raydecode.engine.spec_runner import load_spec_runner
            from raydecode.models.parallel import LocalComm, Parallel

            from .rank_worker import prepare_runner

            runner = load_spec_runner(spec, Parallel(), LocalComm(), device)
            prepare_runner(runner, Parallel(), device)   # kernels, then the spec graphs
            return LocalReplicaExecutor(runner)
        from raydecode.models.parallel import LocalComm, Parallel

        from .rank_worker import ShardSpec, load_runner, prepare_runner

        shard = ShardSpec(model=str(config.model), dtype=config.resolved_dtype(),
                          num_slots=ecfg.max_num_seqs, num_blocks=ecfg.blocks,
                          block_size=ecfg.block_size, max_model_len=ecfg.max_model_len,
                          step_graphs=_step_graphs(config), decode=config.decode_options(),
                          num_snapshots=ecfg.num_snapshots, pad_prefill=pad_prefill_setting(),
                          prefill_budget=ecfg.max_num_batched_tokens,
                          stock_graphs=stock_graphs_setting(),
                          stock_single=stock_single_setting(),
                          stock_mixed=stock_mixed_setting())
        runner = load_runner(shard, Parallel(), LocalComm(), device)
        prepare_runner(runner, Parallel(), device)       # kernels, then the step graphs
        return LocalReplicaExecutor(runner)

    import ray

    from .rank_group import make_rank_group_executor, spec_runner_factory

    placement, verified, rank_cpus = None, False, 1.0
    if ray.cluster_resources().get("GPU", 0) > 0:
        from raydecode.cluster.placement import plan_replica_placement

        placement = plan_replica_placement(tp, dcp, options=config.placement)
        verified = placement.profile == "production" and placement.domain is not None
        rank_cpus = config.placement.rank_cpus
    ex = make_rank_group_executor(
        config.model, tp, dcp, config.resolved_dtype(), num_slots=ecfg.max_num_seqs,
        num_blocks=ecfg.blocks, block_size=ecfg.block_size,
        step_timeout_s=config.rank_step_timeout_s, placement=placement,
        domain_verified=verified, num_cpus_per_rank=rank_cpus, max_model_len=ecfg.max_model_len,
        step_graphs=_step_graphs(config), decode=config.decode_options(),
        oneshot_allreduce=config.decode.oneshot_allreduce, num_snapshots=ecfg.num_snapshots,
        prefill_budget=ecfg.max_num_batched_tokens,
        # a speculating replica's SpecRunner stays eager: no step graphs (rank_group.py)
        runner_factory=None if spec is None else spec_runner_factory(spec))
    ex.kda_snapshot_slots = ecfg.num_snapshots        # what every rank allocated
    return ex


def _step_graphs(config: DeployConfig) -> bool | None:
    """decode.step_graphs of the deployment, else RAYDECODE_STEP_GRAPHS of this process (None:
    auto, on for CUDA ranks whose model the graphs support)."""
    from raydecode.engine.step_graph import setting

    s = config.decode.step_graphs
    return setting() if s is None else s


def _spec_shard(config: DeployConfig, ecfg):
    """What every rank of a speculating replica loads; None without speculative_config."""
    if config.speculative_config is None:
        return None
    from raydecode.engine.spec_runner import SpecShardSpec

    return SpecShardSpec(model=config.model, draft=config.drafter,
                         dtype=config.resolved_dtype(), num_slots=ecfg.max_num_seqs,
                         num_blocks=ecfg.blocks, block_size=ecfg.block_size,
                         decode=config.decode_options(), step_graphs=_step_graphs(config),
                         num_drafts=config.speculative_config.num_speculative_tokens)


def _model_config(spec: str):
    from raydecode.engine.loader import resolve_checkpoint
    from raydecode.models.config import load_config
    return load_config(resolve_checkpoint(spec))


# ---- the per-step envelope decision and its counters ---------------------------------------
class PathCounters:
    def __init__(self) -> None:
        self.steps = {p: 0 for p in PATHS}
        self.tokens = {p: 0 for p in PATHS}        # tokens run through the model
        self.seconds = {p: 0.0 for p in PATHS}     # time inside execute
        self.reasons = {r: 0 for r in envelope.REASONS}

    def record(self, d: envelope.Decision, tokens: int, seconds: float) -> None:
        self.steps[d.path] += 1
        self.tokens[d.path] += tokens
        self.seconds[d.path] += seconds
        for r in d.reasons:
            self.reasons[r] += 1

    def snapshot(self) -> dict:
        return {"paths": {p: {"steps": self.steps[p], "tokens": self.tokens[p],
                              "seconds": round(self.seconds[p], 6)} for p in PATHS},
                "fallback_reasons": dict(self.reasons)}


class EnvelopeExecutor:
    """Decides each step's path once (DESIGN §3), writes it into the plan every rank receives,
    runs it and counts it. `current` names the step in flight for timeout messages."""

    def __init__(self, inner: ReplicaExecutor, policy: envelope.EnvelopePolicy,
                 counters: PathCounters, tp_size: int):
        self.inner, self.policy, self.counters = inner, policy, counters
        # an executor that does not report these is taken as: the configured TP, no verified
        # domain, kernels ready (the PyTorch reference needs no compilation)
        self.tp_size = getattr(inner, "tp_size", tp_size)
        self.domain_verified = bool(getattr(inner, "domain_verified", False))
        self._ready = getattr(inner, "specialized_ready", lambda n: True)
        self.current = "no step yet"

    def execute(self, plan: StepPlan) -> StepResult:
        # a verification step (SpecStepPlan with drafts): k and batch·(k+1) decide, and its
        # k+1-token verify slices count as decode
        spec_k = getattr(plan, "spec_k", None)
        decode_only = plan.decode_only if spec_k is not None else plan.batch.is_decode_only
        shape = envelope.StepShape(num_seqs=plan.num_seqs, decode_only=decode_only,
                                   tp_size=self.tp_size, domain_verified=self.domain_verified,
                                   kernels_ready=bool(self._ready(plan.num_seqs)),
                                   spec_k=spec_k)
        d = envelope.decide(shape, self.policy)
        plan.path = d.path
        verify = f", verify k={spec_k}" if spec_k is not None else ""
        self.current = (f"step {plan.step_id} ({d.path}, {plan.num_seqs} seqs, "
                        f"{plan.batch.num_tokens} tokens{verify})")
        t0 = time.perf_counter()
        result = self.inner.execute(plan)
        self.counters.record(d, plan.batch.num_tokens, time.perf_counter() - t0)
        return result


# ---- request streams ------------------------------------------------------------------------
@dataclass
class _Stream:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    ids: list[int] = field(default_factory=list)     # output ids sent to the client
    text: str = ""                                   # output text sent to the client
    where: str = "pending"                           # pending | replica | stock
    done: bool = False
    task: asyncio.Task | None = None                 # its stock continuation
    index: int = 0                                   # n > 1: its sample (choice) index
    forks: list[str] = field(default_factory=list)   # index 0 of n > 1: the others' ids

    def send(self, out: StepOutput | BaseException) -> None:
        if self.done:
            return
        if isinstance(out, BaseException):
            self.done = True
        else:
            out.index = self.index
            self.ids += out.new_token_ids
            self.text += out.delta_text
            self.done = out.finished
        self.queue.put_nowait(out)


class CoordinatorCore:
    def __init__(self, config: DeployConfig,
                 executor_factory: Callable[[], ReplicaExecutor] | None = None):
        check_speculative(config)           # K <= the drafter's block size (DESIGN §6)
        from raydecode.engine.loader import load_tokenizer

        self.config = config
        # the step thread must get the GIL back quickly from a busy event loop (see config)
        sys.setswitchinterval(config.coordinator_switch_interval_ms / 1e3)
        self.factory = executor_factory or functools.partial(build_executor, config)
        mcfg = _model_config(config.model)
        self.engine_cfg = config.engine_config(mcfg.max_position_embeddings)
        self.vocab_size = mcfg.vocab_size
        self.tokenizer = load_tokenizer(config.model)
        self.eos_ids = tuple(sorted(set(self.tokenizer.eos_ids) | {mcfg.eos_token_id}))
        self.policy = config.envelope_policy()
        # never steps: continues requests on the stock pool with the engine's text rules
        self._text_engine = LLMEngine(None, self.tokenizer, self.engine_cfg, self.eos_ids)
        self.counters = PathCounters()
        self.spec = config.spec_config()
        self.acceptance = AcceptanceStats(self.spec.num_drafts) if self.spec else None
        sp = config.stock_pool
        self.stock = None if sp is None or not config.envelope.enabled else StockPoolClient(
            sp.base_url, sp.model or config.model_name, sp.timeout_s, sp.api_key_env)
        self.engine: LLMEngine | None = None
        self._path_exec: EnvelopeExecutor | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.healthy = False
        self._healthy_evt = asyncio.Event()
        self.last_failure: str | None = None
        self.streams: dict[str, _Stream] = {}
        self._pending: list[_Stream] = []
        self._aborts: set[str] = set()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._rebuild_task: asyncio.Task | None = None
        self._watchdog_task: asyncio.Task | None = None
        self._beat = time.monotonic()        # the step loop's last sign of life
        self._loop_busy = False              # it had unfinished requests at that beat
        self.loop_state = "ok"               # ok | "died: …" | "stalled: …" (never back to ok)
        self.counts = {"failover_events": 0, "failover_requests": 0, "routed_to_stock": 0,
                       "rebuilds": 0, "requests": 0}
        # the step loop's time by part (seconds, summed over steps): `engine_s` inside
        # engine.step (schedule, plan, the executor's step, outputs), `handoff_s` a step's end
        # to the next one's start (finished requests popped, outputs posted, and between
        # bursts the round trip through the event loop), `dispatch_s` handing outputs to the
        # streams (event loop), `cycle_s` step start to the next step's start while requests
        # run — what one decode token of a running stream costs
        self.loop_timing = {"steps": 0, "engine_s": 0.0, "handoff_s": 0.0, "dispatch_s": 0.0,
                            "cycle_s": 0.0}
        self._burst_gen = 0                  # bumped to retire a step thread's burst
        self._last_end: float | None = None  # the last step's end, while requests run
        self._last_start: float | None = None
        self._step_started: float | None = None   # monotonic start of the step in flight
        # backpressure: the step thread runs at most MAX_AHEAD steps ahead of the streams
        # (outputs posted to the event loop, not yet dispatched)
        self._ahead = threading.Semaphore(MAX_AHEAD)

    # ---- life cycle ---------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._build_engine)
        self._set_healthy(True)
        self._loop_task = asyncio.create_task(self._run(), name="coordinator-step-loop")
        self._loop_task.add_done_callback(self._loop_exited)
        self._watchdog_task = asyncio.create_task(self._watchdog(), name="coordinator-watchdog")
        if self.policy.note:
            log.warning("%s", self.policy.note)

    def _set_healthy(self, ok: bool) -> None:
        self.healthy = ok
        (self._healthy_evt.set if ok else self._healthy_evt.clear)()

    async def wait_healthy(self, timeout_s: float) -> bool:
        """True once the replica takes requests (at once if it does), False after timeout_s."""
        try:
            await asyncio.wait_for(self._healthy_evt.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        return self.healthy

    def _build_engine(self) -> None:
        inner = self.factory()
        self._path_exec = EnvelopeExecutor(inner, self.policy, self.counters,
                                           self.config.tensor_parallel_size)
        ecfg = dataclasses.replace(fit_prefix_cache(self.engine_cfg, inner),
                                   split_mixed=self._split_mixed(inner))
        if self.spec is None:
            self.engine = LLMEngine(self._path_exec, self.tokenizer, ecfg, self.eos_ids)
        else:
            self.engine = SpecEngine(self._path_exec, self.tokenizer, ecfg, self.eos_ids,
                                     self.spec)
            self.engine.acceptance = self.acceptance     # one series across rebuilds
        # one thread per engine generation: a hung step keeps its thread, not the next engine's
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="step")

    def _split_mixed(self, inner) -> bool:
        """The deployment's split_mixed_steps, or (auto) on when decode steps can take the
        specialized path and replay captured graphs: a decode token riding a prefill step
        would run it on the eager stock path (H200, K3 TP16: a 128-token stock step 1.7 s
        against a 22 ms graphed batch-16 decode step). Off again where the ranks capture
        mixed-step graphs (RAYDECODE_STOCK_MIXED=1): a mixed step then replays one graph,
        and beside 63 streams at 24 K3 layers on the H100 it cost them 1.55x their decode
        step (192-token chunks) where the split pair cost 2.46x (docs/perf-log/prefill.md)."""
        want = self.config.split_mixed_steps
        if want is not None:
            return bool(want)
        return bool(self.policy.enabled and getattr(inner, "decode_graphed", False)
                    and not stock_mixed_setting())

    async def close(self) -> None:
        self.loop_state = self.loop_state if self.loop_state != "ok" else "closed"
        self._burst_gen += 1                 # the step thread stops after its current step
        for t in (self._watchdog_task, self._loop_task, self._rebuild_task):
            if t is not None:
                t.cancel()
        for s in list(self.streams.values()):
            if s.task is not None:
                s.task.cancel()
        if self.stock is not None:
            await self.stock.close()
        if self._path_exec is not None:
            _close_quietly(self._path_exec.inner)
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    # ---- requests -----------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       n: int = 1) -> AsyncIterator[StepOutput]:
        """Admit (raising RequestError / Overloaded before anything is yielded), yield an empty
        'accepted' delta, then the request's deltas until one has finished=True. n > 1: the
        deltas of n samples sharing one prefill, each carrying its `index` (0..n-1), until
        all n have finished; sample i > 0 runs as request f"{request_id}#{i}" with its own
        seed (engine/request.py `sample_seed`)."""
        group = self._admit_group(request_id, list(prompt_ids), params, n)
        left = len(group)
        try:
            yield StepOutput(request_id, [], "", False, None)
            while left:
                out = await group[0].queue.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                left -= out.finished
        finally:
            for s in group:
                if not s.done:
                    self.abort(s.request_id)
                self.streams.pop(s.request_id, None)

    def _admit_group(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     n: int) -> list[_Stream]:
        """The n streams of a request (one queue): index 0 carries the others' ids and enters
        the engine with them as its forks; on the stock pool each continues alone."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise RequestError(f"n = {n!r}; expected an integer >= 1")
        cap = self.config.max_waiting_requests
        if n > 1 and 1 <= cap < n:      # never admissible: a client error, not "try later"
            raise RequestError(f"n = {n}; this deployment queues at most "
                               f"max_waiting_requests = {cap} sequences, so n must be ≤ {cap}")
        if n > 1 and self.num_waiting + n > cap:
            raise Overloaded(f"{self.num_waiting} requests already wait and this one adds {n} "
                             f"(max_waiting_requests = {cap})")
        ids = [request_id] + [f"{request_id}#{i}" for i in range(1, n)]
        taken = [i for i in ids[1:] if i in self.streams]
        if taken:
            raise RequestError(f"request_id {taken[0]!r} is already in use")
        head = self._admit(request_id, prompt_ids, params, ids[1:])
        group = [head]
        for i, rid in enumerate(ids[1:], start=1):
            s = _Stream(rid, prompt_ids, _sample_params(params, i), queue=head.queue,
                        where=head.where, index=i)
            self.streams[rid] = s
            group.append(s)
            if head.where == "stock":
                self._to_stock(s)
        return group

    def _admit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               forks: list[str] | None = None) -> _Stream:
        if not prompt_ids:
            raise RequestError("prompt is empty; expected at least one token")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                               f"[0, {self.vocab_size})")
        if len(prompt_ids) + 1 > self.engine_cfg.max_model_len:
            raise RequestError(f"prompt has {len(prompt_ids)} tokens; max_model_len is "
                               f"{self.engine_cfg.max_model_len} (prompt + at least one new token)")
        if request_id in self.streams:
            raise RequestError(f"request_id {request_id!r} is already in use")
        s = _Stream(request_id, prompt_ids, params, forks=list(forks or ()))
        if not self.healthy:
            if self.stock is None:
                why = "its step loop stopped" if self.loop_state != "ok" else "rebuilding"
                raise Overloaded(f"replica is unhealthy ({self.last_failure}) and {why}; no "
                                 "stock pool is configured")
            # bounded like the normal queue: what the replica itself would hold
            cap = self.engine_cfg.max_num_seqs + self.config.max_waiting_requests
            on_stock = sum(1 for x in self.streams.values() if x.where == "stock" and not x.done)
            if on_stock >= cap:
                raise Overloaded(f"{on_stock} requests already continue on the stock pool while "
                                 f"the replica is unhealthy (at most max_num_seqs + "
                                 f"max_waiting_requests = {cap})")
            self.streams[request_id] = s
            self.counts["routed_to_stock"] += 1
            self._to_stock(s)
        else:
            if self.num_waiting >= self.config.max_waiting_requests:
                raise Overloaded(f"{self.num_waiting} requests already wait "
                                 f"(max_waiting_requests = {self.config.max_waiting_requests})")
            self.streams[request_id] = s
            self._pending.append(s)
            self._wake.set()
        self.counts["requests"] += 1
        return s

    def abort(self, request_id: str) -> None:
        """End a request (with n > 1, the id of sample 0 ends every sample)."""
        s = self.streams.get(request_id)
        if s is None:
            return
        for rid in s.forks:
            self.abort(rid)
        s.send(StepOutput(request_id, [], "", True, "abort"))      # ends its generator
        if s.where == "pending" and s in self._pending:
            self._pending.remove(s)
        elif s.where == "replica":
            self._aborts.add(request_id)
            self._wake.set()
        elif s.task is not None:
            s.task.cancel()

    @property
    def num_waiting(self) -> int:
        return len(self._pending) + (len(self.engine.scheduler.waiting) if self.engine else 0)

    # ---- the step loop --------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            self._beat = time.monotonic()
            await self._wake.wait()
            self._wake.clear()
            self._last_end = self._last_start = None     # idle gaps are not step costs
            while self.healthy:
                self._beat = time.monotonic()
                self._apply_queued()
                self._loop_busy = self.engine.has_unfinished()
                if not self._loop_busy:
                    break
                try:
                    await self._burst()                                 # run
                except StepFailed as e:
                    self._fail_over(e)
                    break

    # ---- the watchdog: a dead or stalled step loop fails its requests at once -----------
    def _has_work(self) -> bool:
        # from what the loop saw at its beat (the engine is not read while a step runs)
        return bool(self._pending) or self._loop_busy

    async def _watchdog(self) -> None:
        """The loop beats before every step; each step has its deadline (rank_step_timeout_s,
        then StepFailed). So a loop with work that has not beaten for that deadline plus a
        margin is stuck outside a step (a lost wake-up, an await that never returns): its
        requests would wait on their queues forever while /health said ok."""
        t = self.config.rank_step_timeout_s
        limit = t + min(WATCHDOG_MARGIN_S, t)
        strikes = 0     # two checks in a row: work that arrived just now may not have woken it
        while self.loop_state == "ok":
            await asyncio.sleep(min(1.0, limit / 4))
            late = self.healthy and self._has_work() and time.monotonic() - self._beat > limit
            strikes = strikes + 1 if late else 0
            if strikes >= 2:
                self._loop_failed(f"stalled: no step for {time.monotonic() - self._beat:.0f} s "
                                  f"with requests waiting (limit {limit:g} s)")
                if self._loop_task is not None:
                    self._loop_task.cancel()

    def _loop_exited(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return                        # close(), or the watchdog after a stall
        e = task.exception()
        self._loop_failed(f"died: {type(e).__name__}: {e}" if e is not None else
                          "died: returned")

    def _loop_failed(self, why: str) -> None:
        """The step loop is gone for good (Serve's health check replaces the replica): every
        request on the replica continues on the stock pool, or gets 503 + Retry-After now."""
        if self.loop_state != "ok":
            return
        log.error("coordinator step loop %s; failing its requests", why)
        self.loop_state = why
        self._burst_gen += 1                 # no further steps from the step thread
        self._set_healthy(False)
        self.last_failure = f"step loop {why}"
        self.counts["failover_events"] += 1
        for s in list(self.streams.values()):
            if s.done or s.where == "stock":
                continue
            if self.stock is None:
                s.send(Overloaded(f"replica step loop {why.split(':')[0]}; retry"))
                continue
            self.counts["failover_requests"] += 1
            self._to_stock(s)
        self._pending.clear()
        self._aborts.clear()

    def _apply_queued(self) -> None:
        """Aborts and new requests enter the engine here, between steps only."""
        for rid in self._aborts:
            if rid in self.engine.requests:
                self.engine.abort(rid)
                self.engine.pop_finished(rid)
        self._aborts.clear()
        for s in self._pending:
            try:
                self.engine.add_request(s.prompt_ids, s.params, request_id=s.request_id,
                                        forks=s.forks)
                s.where = "replica"
                for rid in s.forks:
                    self.streams[rid].where = "replica"
            except RequestError as e:
                s.send(e)
        self._pending.clear()

    def _run_burst(self, loop: asyncio.AbstractEventLoop, gen: int) -> None:
        """On the step thread: steps back to back while requests run and nothing waits to
        enter the engine (new requests, aborts: the event loop applies those between bursts),
        so a step never waits on the event loop, which streams the outputs meanwhile. Each
        step's finished requests leave the engine here; the outputs go to the loop in order."""
        engine, tm, clock = self.engine, self.loop_timing, time.perf_counter
        while (self._burst_gen == gen and self.healthy and self.engine is engine
               and not self._pending and not self._aborts and engine.has_unfinished()):
            self._beat = self._step_started = time.monotonic()
            t0 = clock()
            if self._last_end is not None:
                tm["handoff_s"] += t0 - self._last_end
                tm["cycle_s"] += t0 - self._last_start
            self._last_start = t0
            try:
                outs = engine.step()
            finally:
                self._step_started = None
                t1 = self._last_end = clock()
                tm["engine_s"] += t1 - t0
                tm["steps"] += 1
            for out in outs:
                if out.finished:
                    engine.pop_finished(out.request_id)
            while not self._ahead.acquire(timeout=0.05):   # the event loop is behind
                if self._burst_gen != gen:
                    return                                 # retired meanwhile: drop them
            try:
                loop.call_soon_threadsafe(self._deliver, outs, gen)
            except RuntimeError:                           # the event loop closed
                self._ahead.release()
                return
        self._loop_busy = engine.has_unfinished()

    async def _burst(self) -> None:
        """Run a burst of steps on the step thread. A step that exceeds rank_step_timeout_s
        (or raises) is StepFailed: the thread's burst is retired (a hung step's thread is left
        behind, as the executor cannot interrupt it) and the replica fails over."""
        loop = asyncio.get_running_loop()
        gen = self._burst_gen
        self._step_started = None
        fut = loop.run_in_executor(self._pool, self._run_burst, loop, gen)
        timeout = self.config.rank_step_timeout_s
        try:
            while True:
                started = self._step_started          # None between two steps
                wait_s = min(0.25, timeout) if started is None else \
                    started + timeout - time.monotonic()
                done, _ = await asyncio.wait({fut}, timeout=max(0.005, wait_s))
                if done:
                    return fut.result()
                started = self._step_started
                if started is not None and time.monotonic() - started > timeout:
                    self._burst_gen += 1
                    raise StepFailed(f"{self._path_exec.current} did not finish within "
                                     f"{timeout} s")
        except StepFailed:
            raise
        except Exception as e:
            self._burst_gen += 1
            raise StepFailed(f"{self._path_exec.current} failed: {type(e).__name__}: {e}") from e

    def _deliver(self, outs: list[StepOutput], gen: int) -> None:
        """(event loop, posted by the step thread) A retired burst's outputs (a step that
        finished after its deadline failed the replica over) are dropped: its streams moved
        on. A dispatch that raises kills the step loop as an exception inside it would (the
        watchdog's "died"), instead of vanishing into the event loop's exception handler."""
        self._ahead.release()
        if gen != self._burst_gen:
            return
        t0 = time.perf_counter()
        try:
            self._dispatch(outs)
        except Exception as e:  # noqa: BLE001 — a coordinator bug: fail loudly, at once
            self._burst_gen += 1
            self._loop_failed(f"died: {type(e).__name__}: {e}")
            if self._loop_task is not None:
                self._loop_task.cancel()
        finally:
            self.loop_timing["dispatch_s"] += time.perf_counter() - t0

    def _dispatch(self, outs: list[StepOutput]) -> None:
        """The step's outputs to their streams; the step thread already took the finished
        requests out of the engine."""
        for out in outs:
            s = self.streams.get(out.request_id)
            if s is not None:
                s.send(RequestFailed(f"request {out.request_id}: {out.error}") if out.error
                       else out)

    # ---- fail-over ----------------------------------------------------------------------
    def _fail_over(self, err: StepFailed) -> None:
        log.error("replica unhealthy: %s; failing requests over and rebuilding", err)
        self._set_healthy(False)
        self.last_failure = str(err)
        self.counts["failover_events"] += 1
        for s in list(self.streams.values()):
            if s.done or s.where == "stock":
                continue
            if self.stock is None:
                s.send(Overloaded(f"replica failed ({err}); no stock pool is configured"))
                continue
            self.counts["failover_requests"] += 1
            self._to_stock(s)
        self._pending.clear()
        self._aborts.clear()
        self._rebuild_task = asyncio.create_task(self._rebuild(), name="coordinator-rebuild")

    async def _rebuild(self) -> None:
        old_exec, old_pool = self._path_exec, self._pool
        self.engine = self._path_exec = None
        old_pool.shutdown(wait=False)
        # closing may hang on the broken executor: do it on a thread nobody waits for
        threading.Thread(target=_close_quietly, args=(old_exec.inner,), daemon=True).start()
        for attempt in itertools.count():
            try:
                await asyncio.get_running_loop().run_in_executor(None, self._build_engine)
                break
            except Exception as e:  # noqa: BLE001 — any failure to rebuild is retried
                delay = REBUILD_BACKOFF_S[min(attempt, len(REBUILD_BACKOFF_S) - 1)]
                log.error("rebuild attempt %d failed (%s); next in %.0f s", attempt + 1, e, delay)
                self.last_failure = f"rebuild failed: {e}"
                await asyncio.sleep(delay)
        self.counts["rebuilds"] += 1
        self._set_healthy(True)
        self._wake.set()
        log.warning("replica rebuilt; taking requests again")

    def _to_stock(self, s: _Stream) -> None:
        s.where = "stock"
        s.task = asyncio.create_task(self._continue_on_stock(s))

    async def _continue_on_stock(self, s: _Stream) -> None:
        cont = Continuation(self._text_engine, s.request_id, s.prompt_ids, s.params, s.ids,
                            s.text)
        try:
            prefix = s.prompt_ids + s.ids
            left = min(s.params.max_tokens - len(s.ids),
                       self.engine_cfg.max_model_len - len(prefix))
            async for chunk in self.stock.stream(prefix, s.params, left):
                outs = []
                for tok in chunk.token_ids:
                    outs.append(cont.push(tok))
                    if cont.done:
                        break
                if chunk.finish_reason is not None and not cont.done:
                    outs.append(cont.finish(chunk.finish_reason))
                if outs:
                    s.send(merge(outs))
                if cont.done:
                    return
            s.send(StockPoolError(f"stock pool {self.stock.base_url} ended the stream of "
                                  f"{s.request_id} without a finish reason"))
        except StockPoolError as e:
            s.send(e)
        except Exception as e:  # noqa: BLE001 — a client error ends this request, not the loop
            s.send(StockPoolError(f"stock pool {self.stock.base_url}: {type(e).__name__}: {e}"))
        finally:
            cont.close()

    # ---- reports --------------------------------------------------------------------------
    def stats(self, detail: bool = False) -> dict:
        """The replica's state and counters. detail=True (the /metrics scrape) adds rank 0's
        step loop timing, one Ray call to the rank: health checks never pay it."""
        sched = self.engine.scheduler if self.engine else None
        return {
            "healthy": self.healthy,
            "step_loop": self.loop_state,
            "last_failure": self.last_failure,
            "stock_pool": self.stock is not None,
            "profile": self.policy.profile,
            "profile_note": self.policy.note,
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "decode_context_parallel_size": self.config.decode_context_parallel_size,
            **self.counters.snapshot(),
            **self.counts,
            "running": len(sched.running) if sched else 0,
            "waiting": self.num_waiting,
            "on_stock": sum(1 for s in self.streams.values() if s.where == "stock" and not s.done),
            "preemptions": sched.num_preemptions if sched else 0,
            "split_mixed_steps": bool(sched.cfg.split_mixed) if sched else None,
            "split_steps": sched.num_split_steps if sched else 0,
            "pacer": _pacer_stats(sched.pacer) if sched and sched.pacer else None,
            "cache": self.engine.cache_stats() if self.engine else None,
            "speculative": self._spec_stats(),
            "control_plane": self._control_plane(detail),
            "step_loop_timing": dict(self.loop_timing),
        }

    def _control_plane(self, detail: bool = False) -> dict | None:
        inner = self._path_exec.inner if self._path_exec is not None else None
        f = getattr(inner, "control_plane_stats", None)
        return f(rank_timing=detail) if f is not None else None

    def _spec_stats(self) -> dict | None:
        """Acceptance over every verified sequence-step: the length L ∈ [1, k+1] counts the
        bonus token; rate[i] = P(draft i+1 accepted); length_counts[j-1] = #steps with L = j,
        from #(L >= j) = steps for j = 1, accepted_at[j-2] for j >= 2."""
        if self.spec is None:
            return None
        a, k = self.acceptance, self.spec.num_drafts
        at_least = [a.steps, *a.accepted_at, 0]                   # #(L >= j), j = 1 .. k+2
        return {"method": self.config.speculative_config.method, "num_drafts": k,
                "drafter": self.config.drafter, "steps": a.steps, "emitted_tokens": a.emitted,
                "mean_acceptance_length": a.mean_length,
                "acceptance_rate_per_position": a.position_rates,
                "acceptance_length_counts": [at_least[j] - at_least[j + 1]
                                             for j in range(k + 1)],
                "synthetic": self.spec.synthetic_length is not None,
                "synthetic_acceptance_length": self.spec.synthetic_length,
                "warning": self.config.synthetic_warning}


def _sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index`'s params when it continues alone (the stock pool): a seeded request's
    samples keep distinct seeds there too (engine/request.py `sample_seed`)."""
    from raydecode.engine.request import sample_seed

    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=sample_seed(params.seed, index))


def _close_quietly(executor: ReplicaExecutor) -> None:
    try:
        (getattr(executor, "close", None) or executor.shutdown)()
    except Exception as e:  # noqa: BLE001
        log.warning("closing the failed executor raised %s: %s", type(e).__name__, e)


# ---- the Ray actor ----------------------------------------------------------------------------
class CoordinatorActor:
    """Thin Ray actor over CoordinatorCore; `generate` is a streaming generator method."""

    def __init__(self, config: dict, executor_factory: Callable[[], ReplicaExecutor] | None = None):
        self.core = CoordinatorCore(parse_deploy_config(config), executor_factory)

    async def start(self) -> bool:
        await self.core.start()
        return True

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       n: int = 1):
        async for out in self.core.generate(request_id, prompt_ids, params, n):
            yield out

    async def abort(self, request_id: str) -> None:
        self.core.abort(request_id)

    async def stats(self, detail: bool = False) -> dict:
        return self.core.stats(detail)

    async def wait_healthy(self, timeout_s: float) -> bool:
        return await self.core.wait_healthy(timeout_s)


def coordinator_actor_class():
    import ray
    return ray.remote(CoordinatorActor)
