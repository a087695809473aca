"""The executor that runs a replica's steps on its TP rank actors.

Ray places, starts, inspects and kills the rank actors; the steps themselves never go through a
Ray call. After the group is built each rank runs a persistent step loop on the coordinator's
step channel (engine/step_channel.py): per step one packed plan frame to every rank
(engine/plan_codec.py) and one result frame back from rank 0 — the token ids sampled on its GPU
(and logprobs where a request asked), never logits.

Every step has a deadline that names the step and the ranks that missed it (DESIGN §6: a hang in
the first decode step must become an error, never a stuck request). A rank that dies is seen at
once (its channel reaches EOF) while its peers may still block in a collective waiting for it; a
rank that raises sends an error frame; silence past the deadline is named from the ranks'
progress. Any failure marks the group unhealthy; the coordinator fails its requests over, calls
`close()` (which kills every rank actor, blocked or not) and builds a new group.

`RankGroupExecutor` satisfies the coordinator's `ReplicaExecutor` protocol (tp_size, dcp_size,
domain_verified, specialized_ready, execute, close); `make_rank_group_executor` builds one from
the deployment's values. With step graphs on (RAYDECODE_STEP_GRAPHS, read here on the driver:
unset is auto, on for CUDA ranks whose model they support; '1' forces, '0' turns them off) a step
of n sequences is specialized-ready only when every rank captured n's bucket.
"""
from __future__ import annotations

import functools
import time
import uuid
from dataclasses import dataclass

import ray
import torch

from raydecode.engine.plan_codec import decode_result, encode_plan, stop_frame
from raydecode.engine.scheduler import StepPlan
from raydecode.engine.step_channel import ChannelClosed, ChannelServer, RankRaised, RankSilent
from raydecode.engine.step_graph import bucket_for, setting as step_graphs_setting
from raydecode.kernels.settings import DEFAULT_OPTIONS, DecodeOptions
from raydecode.kernels.settings import pad_prefill as pad_prefill_setting
from raydecode.kernels.settings import stock_graphs as stock_graphs_setting
from raydecode.kernels.settings import stock_mixed as stock_mixed_setting
from raydecode.kernels.settings import stock_single as stock_single_setting
from raydecode.models.specialized import check_path

from .rank_worker import RankWorker, RunnerFactory, ShardSpec, load_runner


class RankFailure(RuntimeError):
    """A rank died, raised, or did not answer in time; the message names the rank(s) and the
    step. `ranks` and `what` carry the same for callers."""

    def __init__(self, message: str, ranks: list[int] | None = None, what: str = ""):
        super().__init__(message)
        self.ranks, self.what = list(ranks or []), what


@dataclass(frozen=True)
class GroupOptions:
    tp_size: int
    dcp_size: int = 1
    step_timeout_s: float = 60.0
    init_timeout_s: float = 180.0
    num_gpus_per_rank: float = 0.0     # 1 on GPU hosts
    num_cpus_per_rank: float = 1.0
    placement: object | None = None    # cluster.placement.ReplicaPlacement: rank_strategy(r)
    domain_verified: bool = False      # the group lies in one verified NVLink domain
    oneshot_allreduce: bool = True     # decode.oneshot_allreduce of the deployment

    def __post_init__(self) -> None:
        for name in ("step_timeout_s", "init_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} = {getattr(self, name)!r}; expected a positive number "
                                 "of seconds")


@dataclass(frozen=True)
class GroupReadiness:
    """What the ranks reported at build: the model's specialized step for this config and TP
    (ok, why) and, with step graphs on, the buckets every rank captured (None: graphs off)."""
    support: tuple[bool, str] = (False, "group not started")
    graph_buckets: frozenset[int] | None = None
    graph_failed: str | None = None          # why a rank lacks buckets ("rank r: ...")
    spec_graphed: bool = False               # every rank replays captured spec graphs

    @classmethod
    def from_infos(cls, infos: list[dict]) -> "GroupReadiness":
        """infos: RankWorker.init_group / set_dcp answers, in rank order."""
        # every rank built the same model for the same TP: they agree; keep rank 0's answer
        support = tuple(infos[0]["specialized"])
        spec = all(i.get("spec_graphed") for i in infos)
        got = [i.get("graph_buckets") for i in infos]
        if all(g is None for g in got):
            why = "; ".join(f"rank {i['rank']}: {i['graph_failed']}" for i in infos
                            if i.get("graph_failed"))
            return cls(support, None, why or None, spec)
        # a bucket counts only where every rank replays it (a rank reporting None has none)
        common = frozenset.intersection(*(frozenset(g or ()) for g in got))
        why = "; ".join(f"rank {i['rank']}: {i['graph_failed']}" for i in infos
                        if i.get("graph_failed"))
        return cls(support, common, why or None, spec)

    def specialized_ready(self, num_seqs: int) -> bool:
        """Graphs off: the specialized step exists. On: also num_seqs' bucket is captured."""
        if not self.support[0]:
            return False
        return self.graph_buckets is None or bucket_for(num_seqs) in self.graph_buckets


class RankGroupExecutor:
    def __init__(self, factory: RunnerFactory, opts: GroupOptions):
        self.opts = opts
        self.tp_size, self.dcp_size = opts.tp_size, opts.dcp_size
        self.domain_verified = opts.domain_verified
        self.replica_id = uuid.uuid4().hex[:12]
        self.healthy = False
        self.readiness = GroupReadiness()
        self.channel = None
        # control plane counters: steps, bytes of plan frames sent (each to every rank) and of
        # result frames received (token ids, logprobs when asked: never logits)
        self.cp = {"steps": 0, "plan_bytes": 0, "result_bytes": 0, "max_result_bytes": 0,
                   "result_rows": 0}
        remote = ray.remote(RankWorker)
        self.workers = []
        try:
            for rank in range(opts.tp_size):
                o = {"num_cpus": opts.num_cpus_per_rank, "num_gpus": opts.num_gpus_per_rank,
                     "max_restarts": 0, "max_task_retries": 0,
                     "name": f"raydecode-rank-{self.replica_id}-{rank}"}
                if opts.placement is not None:
                    o["scheduling_strategy"] = _rank_strategy(opts.placement, rank)
                self.workers.append(remote.options(**o).remote(
                    rank, opts.tp_size, opts.dcp_size, factory, self.replica_id,
                    oneshot_allreduce=opts.oneshot_allreduce))
            t = opts.init_timeout_s
            host, port = self._wait([self.workers[0].open_store.remote(t)],
                                    "open the rendezvous", t)[0]
            infos = self._wait([w.init_group.remote(host, port, t, opts.step_timeout_s)
                                for w in self.workers], "join the group and load the shard", t)
            self._open_channel()
        except BaseException:
            self.close()
            raise
        self.readiness = GroupReadiness.from_infos(infos)
        self.healthy = True

    def _open_channel(self, local: bool = True) -> None:
        """Every rank's step loop connected to a fresh channel of this executor (local False:
        over TCP even on this host, for benchmarks)."""
        self._stop_loops()
        t = self.opts.init_timeout_s
        self.channel = ChannelServer(self.tp_size, ray.util.get_node_ip_address(), local)
        refs = [w.start_loop.remote(self.channel.address, t) for w in self.workers]
        try:
            self.channel.accept(t)
        except TimeoutError as e:
            self._wait(refs, "connect to the step channel", 1.0)      # a rank's own error
            raise RankFailure(f"replica {self.replica_id}: {e}", [], "connect") from None
        self.transports = self._wait(refs, "connect to the step channel", t)

    def reconnect(self, local: bool = True) -> list[str]:
        """Stop the ranks' step loops and connect them to a new channel; local False puts every
        rank on TCP (the path of ranks on other hosts). -> each rank's transport."""
        if not self.healthy:
            raise RankFailure(f"replica {self.replica_id} is unhealthy; cannot reconnect", [],
                              "reconnect")
        self._open_channel(local)
        return list(self.transports)

    def _stop_loops(self) -> None:
        if self.channel is not None:
            try:
                self.channel.publish(stop_frame())
            except ChannelClosed:
                pass
            self.channel.close()
            self.channel = None

    @property
    def specialized_support(self) -> tuple[bool, str]:
        return self.readiness.support

    # ---- the ReplicaExecutor protocol ----------------------------------------------------------
    @property
    def decode_graphed(self) -> bool:
        """Every rank captured step graphs for at least one decode bucket, or (a speculating
        replica) its spec graphs."""
        r = self.readiness
        return bool(r.support[0] and (r.graph_buckets or r.spec_graphed))

    def specialized_ready(self, num_seqs: int) -> bool:
        """The model's specialized step exists for this config and TP (the kernels were
        compiled at build), and with step graphs on every rank captured num_seqs' bucket."""
        return self.healthy and self.readiness.specialized_ready(num_seqs)

    def execute(self, plan: StepPlan, timeout_s: float | None = None):
        """Run `plan` on every rank (on plan.path) within timeout_s (default: the group's
        step_timeout_s); -> rank 0's StepResult (token ids sampled on the device), or for a
        SpecStepPlan its SpecStepResult."""
        if not self.healthy:
            raise RankFailure(f"replica {self.replica_id} is unhealthy; step {plan.step_id} "
                              "not run", [], f"run step {plan.step_id}")
        check_path(plan.path)             # a bad path fails here, not on every rank
        if plan.path == "specialized" and not self.specialized_support[0]:
            raise ValueError(f"step {plan.step_id}: {self.specialized_support[1]}; the "
                             "coordinator must choose 'stock' for this replica")
        timeout = self.opts.step_timeout_s if timeout_s is None else timeout_s
        frame = encode_plan(plan)                                      # prepare
        t_wall = time.time()
        try:
            self.channel.publish(frame)                                # run
            kind, payload = self.channel.wait_result(plan.step_id, timeout)
        except (ChannelClosed, RankRaised, RankSilent) as e:
            self._step_failed(plan, e, timeout, t_wall + timeout)
        cp = self.cp
        cp["steps"] += 1
        cp["plan_bytes"] += len(frame) * self.tp_size
        cp["result_bytes"] += len(payload)
        cp["max_result_bytes"] = max(cp["max_result_bytes"], len(payload))
        cp["result_rows"] += len(plan.sample_rows)
        return decode_result(kind, payload)                            # post-process

    def control_plane_stats(self, rank_timing: bool = False) -> dict:
        """Counters of the step channel: steps, plan bytes sent, result bytes received (their
        max per step), sample rows answered; plus each rank's transport and, with
        rank_timing (one Ray call to rank 0), rank 0's step loop time by part (`rank0_timing`:
        wait / decode / step / send seconds; None without it, or when rank 0 does not answer
        within a second — the stats never wait on a stuck rank)."""
        return {**self.cp, "transports": list(getattr(self, "transports", [])),
                "rank0_timing": self._rank0_timing() if rank_timing else None}

    def _rank0_timing(self) -> dict | None:
        if not self.workers or not self.healthy:
            return None
        try:
            return ray.get(self.workers[0].progress.remote(), timeout=1.0).get("timing")
        except Exception:  # noqa: BLE001 — a dead or stuck rank: the step path reports it
            return None

    def _step_failed(self, plan: StepPlan, e: Exception, timeout: float, deadline_wall: float):
        """Name the ranks behind a failed step and raise RankFailure (the group is unhealthy).
        A death is named first: peers blocked in a collective with the dead rank raise too."""
        self.healthy = False
        what = f"finish step {plan.step_id} ({plan.path})"
        if isinstance(e, RankSilent):
            late = self._late_ranks(plan.step_id, deadline_wall)
            raise RankFailure(f"replica {self.replica_id}: rank(s) {late} did not {what} "
                              f"within {timeout:g} s", late, what) from None
        died = [e.rank] if isinstance(e, ChannelClosed) and e.rank is not None else []
        errors = {e.rank: e.text} if isinstance(e, RankRaised) else {}
        if errors:       # give a dead peer a moment to be seen, so the root cause comes first
            more_dead, more_errors = self.channel.poll_failures(FAILURE_GRACE_S)
            died += more_dead
            errors.update({r: t for r, t in more_errors.items() if r not in errors})
        ranks = sorted(set(died)) + sorted(r for r in errors if r not in died)
        parts = [f"rank {r} died (its step channel closed: the process exited)" if r in died
                 else f"rank {r} raised ({errors[r][:300]})" for r in ranks]
        raise RankFailure(f"replica {self.replica_id}: could not {what}: " + "; ".join(parts),
                          ranks, what) from None

    def _late_ranks(self, step_id: int, deadline_wall: float) -> list[int]:
        """Ranks that had not finished step_id by the deadline: by their progress report, or
        every rank that does not answer it (stopped, hung in the kernel, dead)."""
        refs = [w.progress.remote() for w in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PROGRESS_TIMEOUT_S)
        late = []
        for r, ref in enumerate(refs):
            try:
                p = ray.get(ref) if ref in ready else None
            except ray.exceptions.RayError:
                p = None
            if p is None or p["done"] < step_id or p["done_at"] > deadline_wall:
                late.append(r)
        return late

    def close(self, wait_s: float | None = None) -> None:
        """Kill every rank actor (also those blocked in a collective); idempotent. Returns once
        every actor answers as dead, or after wait_s (ray.kill is asynchronous, and a rank's
        main thread stays free to answer calls while its step loop runs); None: CLOSE_WAIT_S."""
        self.healthy = False
        if getattr(self, "channel", None) is not None:
            self.channel.close()
            self.channel = None
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:     # already dead
                pass
        deadline = time.monotonic() + (CLOSE_WAIT_S if wait_s is None else wait_s)
        for w in self.workers:
            while time.monotonic() < deadline:
                try:
                    ray.get(w.ping.remote(), timeout=max(0.01, deadline - time.monotonic()))
                except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                    break           # dead (or too slow to matter)
                time.sleep(0.02)
        if hasattr(self.opts.placement, "remove"):        # a ReplicaPlacement we own
            try:
                self.opts.placement.remove()
            except Exception:
                pass

    shutdown = close

    def set_dcp(self, dcp_size: int) -> None:
        """Re-lay the live group out for another DCP size (same ranks, same TP group; every
        rank rebuilds its shard and caches, cache contents are dropped). For changing the
        layout without respawning rank processes, e.g. between test configurations."""
        from raydecode.models.parallel import Parallel

        Parallel(0, self.tp_size, dcp_size)     # dcp must divide tp: a clear ValueError
        if not self.healthy:
            raise RankFailure(f"replica {self.replica_id} is unhealthy; cannot re-lay it out",
                              [], "set_dcp")
        self._stop_loops()
        infos = self._wait([w.set_dcp.remote(dcp_size) for w in self.workers],
                           f"re-lay out for decode_context_parallel_size {dcp_size}",
                           self.opts.init_timeout_s)
        self.readiness = GroupReadiness.from_infos(infos)     # graphs were recaptured
        self.dcp_size = dcp_size
        self._open_channel()

    # ---- inspection ----------------------------------------------------------------------------
    def stats(self) -> list[dict]:
        """Per rank: {"rank", "pid", "steps": {path: count}, "placement_group": id or None}."""
        return self._wait([w.stats.remote() for w in self.workers], "report stats",
                          self.opts.step_timeout_s)

    def gpu_ids(self) -> list:
        return self._wait([w.gpu_ids.remote() for w in self.workers], "report GPU ids",
                          self.opts.step_timeout_s)

    # ---- waiting with a deadline -----------------------------------------------------------------
    def _wait(self, refs: list, what: str, timeout: float) -> list:
        """ray.get(refs) within `timeout` s, failing at the first rank that errors or dies."""
        index = {r: i for i, r in enumerate(refs)}
        pending, deadline = list(refs), time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            errors = _errors(ready, index)
            if errors and pending and not _died(errors):
                # a rank that dies takes its peers' collectives down with it ("connection
                # closed by peer"); give the dead one a moment to be reported, so the root
                # cause is named first
                grace = max(0.0, min(FAILURE_GRACE_S, deadline - time.monotonic()))
                more, pending = ray.wait(pending, num_returns=len(pending), timeout=grace)
                errors.update(_errors(more, index))
            if errors:
                self._fail(errors, what)
        if pending:
            self.healthy = False
            late = sorted(index[r] for r in pending)
            raise RankFailure(f"replica {self.replica_id}: rank(s) {late} did not {what} "
                              f"within {timeout:g} s", late, what)
        return ray.get(refs)

    def _fail(self, errors: dict[int, Exception], what: str):
        self.healthy = False
        died = _died(errors)
        ranks = died + sorted(i for i in errors if i not in died)
        parts = [f"rank {i} {'died' if i in died else 'raised'} ({_summary(errors[i])})"
                 for i in ranks]
        raise RankFailure(f"replica {self.replica_id}: could not {what}: " + "; ".join(parts),
                          ranks, what) from errors[ranks[0]]


FAILURE_GRACE_S = 5.0
CLOSE_WAIT_S = 10.0           # close() waits at most this long for the killed actors to be gone
PROGRESS_TIMEOUT_S = 2.0      # a rank that cannot report its progress by then counts as late


def _errors(refs: list, index: dict) -> dict[int, Exception]:
    """rank -> the Ray error of each finished ref that failed."""
    out = {}
    for r in refs:
        try:
            ray.get(r)
        except ray.exceptions.RayError as e:
            out[index[r]] = e
    return out


def _died(errors: dict[int, Exception]) -> list[int]:
    return sorted(i for i, e in errors.items() if isinstance(e, ray.exceptions.RayActorError))


def _summary(e: Exception) -> str:
    """One line: the actor error's headline, or the remote exception's last line."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    line = (lines[0] if isinstance(e, ray.exceptions.RayActorError) else lines[-1]) \
        if lines else ""
    return f"{type(e).__name__}: {line[:300]}"


def _rank_strategy(placement, rank: int):
    """A ReplicaPlacement lays ranks out node-major after Ray placed the bundles, so rank r runs
    in the bundle it was assigned; a bare placement group means bundle r hosts rank r."""
    if hasattr(placement, "rank_strategy"):
        return placement.rank_strategy(rank)
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    return PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=rank)


def make_rank_group_executor(model: str, tp: int, dcp: int, dtype: str, num_slots: int,
                             num_blocks: int, block_size: int, step_timeout_s: float,
                             placement=None, *, init_timeout_s: float = 180.0,
                             domain_verified: bool = False, num_cpus_per_rank: float = 1.0,
                             num_gpus_per_rank: float | None = None,
                             runner_factory: RunnerFactory | None = None,
                             max_model_len: int | None = None,
                             step_graphs: bool | None = None,
                             decode: DecodeOptions = DEFAULT_OPTIONS,
                             oneshot_allreduce: bool = True,
                             num_snapshots: int = 0,
                             prefill_budget: int | None = None) -> RankGroupExecutor:
    """A started TP group of `tp` rank actors for `model` (preset or checkpoint folder).

    Each rank loads only its shard and owns caches for num_slots sequences and num_blocks
    latent blocks of block_size rows (its DCP share: use the engine's block count for the same
    dcp). num_gpus_per_rank None: 1 when the Ray cluster has GPUs, else 0 (CPU ranks, gloo).
    placement: a cluster.placement.ReplicaPlacement (rank r in its assigned bundle). Raises RankFailure when the group does not come up
    within init_timeout_s, ValueError for sizes that cannot shard. runner_factory: what each
    rank builds (default: load_runner of this model; a speculating replica passes
    spec_runner_factory(...)). step_graphs (None: RAYDECODE_STEP_GRAPHS on this driver, and
    unset there: auto, `step_graph.resolve`): the default factory builds GraphedRunners, each
    capturing every bucket at build; max_model_len
    bounds their block-table width. A runner_factory ignores both (SpecRunner stays eager).
    decode / oneshot_allreduce: the deployment's `decode:` section (every rank's model is built
    with these options; the one-shot all-reduce on or off). num_snapshots: KDA snapshot slots
    per rank, for the coordinator's prefix cache. prefill_budget: the step token budget; with
    RAYDECODE_PAD_PREFILL=1 on this driver each rank pads its stock steps to their token bucket
    and warms every bucket up to it at build."""
    from raydecode.models.parallel import Parallel

    Parallel(0, tp, dcp)          # validates tp >= 1 and dcp | tp with a clear message
    if num_gpus_per_rank is None:
        num_gpus_per_rank = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    spec = ShardSpec(model=str(model), dtype=dtype, num_slots=num_slots, num_blocks=num_blocks,
                     block_size=block_size, max_model_len=max_model_len,
                     step_graphs=step_graphs_setting() if step_graphs is None else step_graphs,
                     decode=decode, num_snapshots=num_snapshots,
                     pad_prefill=pad_prefill_setting(), prefill_budget=prefill_budget,
                     stock_graphs=stock_graphs_setting(),
                     stock_single=stock_single_setting(),
                     stock_mixed=stock_mixed_setting())
    opts = GroupOptions(tp_size=tp, dcp_size=dcp, step_timeout_s=step_timeout_s,
                        init_timeout_s=init_timeout_s, num_gpus_per_rank=num_gpus_per_rank,
                        num_cpus_per_rank=num_cpus_per_rank, placement=placement,
                        domain_verified=domain_verified, oneshot_allreduce=oneshot_allreduce)
    return RankGroupExecutor(runner_factory or functools.partial(load_runner, spec), opts)


def spec_runner_factory(spec) -> RunnerFactory:
    """RunnerFactory of a speculating replica: each rank loads its target shard, its drafter
    shard and caches with the drafter's MLA rows (engine.spec_runner.load_spec_runner).
    spec: an engine.spec_runner.SpecShardSpec (picklable); its step_graphs decides whether
    the speculative steps run on engine/spec_graph.py's graphs (None: on CUDA ranks whose
    model the graphs support)."""
    from raydecode.engine.spec_runner import load_spec_runner

    return functools.partial(load_spec_runner, spec)


__all__ = ["RankFailure", "GroupOptions", "GroupReadiness", "RankGroupExecutor",
           "make_rank_group_executor", "spec_runner_factory"]
