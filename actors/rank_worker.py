"""RankWorker: one Ray actor per GPU (per CPU process in tests) holding one TP shard of a replica.

The actor is thin: it joins the replica's torch.distributed group, builds its `ModelRunner`
through an injected factory (this rank's checkpoint slice + its caches: MLA latent rows of its
DCP share, KDA state of its heads), and runs the StepPlan it is told to run on `plan.path`.
Rendezvous comes from Ray, never a fixed port: rank 0 opens a TCPStore on an OS-chosen port and
the executor passes (host, port) to the others; keys carry the replica id, so several replicas
(and several test runs) never collide.

With step graphs on (`ShardSpec.step_graphs`, from RAYDECODE_STEP_GRAPHS on the driver; unset:
auto, on for CUDA ranks whose model the graphs support) the runner is a `GraphedRunner`
(engine/step_graph.py): caches with the scratch rows, and every bucket up to the one of
num_slots captured at build, before any step (`capture_all`, collective at TP > 1).
"""
from __future__ import annotations

import datetime
import os
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

from raydecode.engine.plan_codec import decode_plan, encode_result, error_frame
from raydecode.engine.runner import ModelRunner, freeze_host_heap
from raydecode.kernels.settings import DEFAULT_OPTIONS, DecodeOptions
from raydecode.engine.scheduler import StepPlan
from raydecode.engine.step_channel import ChannelAddress, ChannelClient, ChannelClosed
from raydecode.engine.step_graph import (BUCKETS, GraphedRunner, bucket_for, graph_cache_sizes,
                                         resolve)
from raydecode.kernels import settings
from raydecode.models.parallel import Comm, Parallel, TorchComm
from raydecode.models.specialized import PATHS

# (par, comm, device) -> runner; must be picklable (a top-level function or a partial of one)
RunnerFactory = Callable[[Parallel, Comm, str], ModelRunner]

# Rows the one-shot all-reduce buffers hold (2 · 64 · H bf16 per rank: 1.8 MB at H = 7168). Above
# ~64 rows a two-stage kernel is the right one (DESIGN §4.3); larger steps go to NCCL.
ONESHOT_MAX_TOKENS = 64


@dataclass(frozen=True)
class ShardSpec:
    """What every rank of a replica loads (picklable, sent to the actors)."""
    model: str
    dtype: str = "float32"
    num_slots: int = 16                # what the scheduler allocates from (real slots/blocks)
    num_blocks: int = 256
    block_size: int = 16
    max_model_len: int | None = None   # bounds a graph's block-table width; None: num_blocks
    step_graphs: bool | None = None    # GraphedRunner + capture at build; None: auto (resolve)
    decode: DecodeOptions = DEFAULT_OPTIONS   # the deployment's `decode:` section
    num_snapshots: int = 0             # KDA snapshot slots (prefix caching)
    pad_prefill: bool | None = None    # stock steps padded to their bucket (None: CUDA ranks)
    prefill_budget: int | None = None  # the step token budget: the padded buckets warmed at build
    stock_graphs: int = 0              # stock steps of ≤ this many tokens piecewise-graphed
    stock_single: bool = False         # and single-sequence graphs (KDA cores inside)
    stock_mixed: bool = False          # and mixed-step graphs (every KDA core inside)

    @property
    def graph_buckets(self) -> tuple[int, ...]:
        """BUCKETS up to the one holding num_slots: no step has more sequences, and capturing
        bucket B needs B idle slots (num_slots real + max_padding scratch covers exactly
        these; all of BUCKETS would need num_slots ≥ 33)."""
        top = bucket_for(self.num_slots)
        return BUCKETS if top is None else tuple(b for b in BUCKETS if b <= top)

    def max_blocks(self, dcp_size: int) -> int:
        """Blocks of one sequence per rank: ⌈⌈max_model_len / DCP⌉ / block_size⌉, at most
        num_blocks (a table never holds more)."""
        if self.max_model_len is None:
            return self.num_blocks
        per_rank = -(-self.max_model_len // dcp_size)
        return min(self.num_blocks, -(-per_rank // self.block_size))


def load_runner(spec: ShardSpec, par: Parallel, comm: Comm, device: str) -> ModelRunner:
    """The default factory: checkpoint slice for this rank → model shard + caches → runner
    (spec.step_graphs: a GraphedRunner on caches holding the scratch rows as well)."""
    from raydecode.engine.loader import load_shard

    ns, nb = spec.num_slots, spec.num_blocks
    graphs = resolve(spec.step_graphs, device)
    if graphs:
        ns, nb = graph_cache_sizes(spec.num_slots, spec.num_blocks, spec.graph_buckets)
    shard = load_shard(spec.model, par, comm, dtype=spec.dtype, device=device,
                       num_slots=ns, num_blocks=nb, block_size=spec.block_size,
                       options=spec.decode, num_snapshots=spec.num_snapshots)
    if not graphs:
        return ModelRunner(shard.model, shard.caches, device)
    runner = GraphedRunner(shard.model, shard.caches, device, num_slots=spec.num_slots,
                           num_blocks=spec.num_blocks, max_blocks=spec.max_blocks(par.dcp_size),
                           buckets=spec.graph_buckets, pad_prefill=spec.pad_prefill,
                           prefill_budget=spec.prefill_budget,
                           stock_graphs=spec.stock_graphs, stock_single=spec.stock_single,
                           stock_mixed=spec.stock_mixed)
    if spec.step_graphs is None and not runner.support[0]:
        # auto: a model the graphs do not support runs the eager specialized step (with '1'
        # it captures nothing and runs stock, DESIGN §3); the scratch rows stay unused
        return ModelRunner(shard.model, shard.caches, device)
    return runner


def prepare_runner(runner: ModelRunner, par: Parallel, device) -> tuple:
    """Before the first step of a rank (or of a TP 1 replica in its coordinator): compile or
    load the kernels from the node's $RAYDECODE_KERNEL_CACHE (docs/KERNEL_CACHE.md), then with a
    GraphedRunner capture every bucket (collective at TP > 1: every rank's runner is graphed or
    none is, one ShardSpec). -> (specialized support (ok, why), kernel cache counts or None,
    captured buckets or None (graphs off), why some or all buckets are not, or None). A
    speculating runner (engine/spec_runner.py) captures its spec graphs here instead
    (`prepare_spec_graphs`: after the one-shot comm is connected). A model
    the graphs do not support captures nothing (the same check everywhere, before any
    collective); any other error propagates and fails the build."""
    support = getattr(runner.model, "specialized_support", (False, "model has no specialized "
                                                             "step"))
    kernels = None
    if support[0] and str(device).startswith("cuda"):
        from raydecode.kernels.aot import prepare_kernel_cache
        # the shard's own layout (a solo-rank benchmark model plays rank 0 of a larger TP)
        events = prepare_kernel_cache(runner.model.cfg, getattr(runner.model, "par", par),
                                      plan=getattr(runner.model, "decode_plan", None))
        kernels = None if events is None else {
            "compiled": sum(e.get("action") == "compiled" for e in events),
            "loaded": sum(e.get("action") == "loaded" for e in events)}
    try:
        if not isinstance(runner, GraphedRunner):
            from raydecode.engine.spec_runner import prepare_spec_graphs

            _, why = prepare_spec_graphs(runner)         # a speculating rank's spec graphs
            return support, kernels, None, why
        ready = sorted(runner.capture_all()) if runner.support[0] else []
        # every stock step's token bucket once (CUDA: its kernels' first runs; CPU ranks only
        # where padding needs it), graphs or not: the stock path serves prefill either way
        if runner.prefill_budget and (runner.pad_prefill or str(device).startswith("cuda")):
            runner.warm_prefill(runner.prefill_budget)
        if not runner.support[0]:
            return support, kernels, [], f"step graphs unsupported: {runner.support[1]}"
        failed = "; ".join([f"bucket {b}: {why}"
                            for b, why in sorted(runner.capture_failed.items())]
                           + [f"stock bucket {b}: {why}"
                              for b, why in sorted(runner.stock_failed.items())]
                           + [f"stock single-sequence bucket {b}: {why}"
                              for b, why in sorted(runner.stock_single_failed.items())]
                           + [f"stock mixed-step bucket {b}: {why}"
                              for b, why in sorted(runner.stock_mixed_failed.items())]
                           + ([f"stock graphs off: {runner.stock_support[1]}"]
                              if runner.stock_graphs_asked and not runner.stock_support[0]
                              else []))
        return support, kernels, ready, failed or None
    finally:     # a GPU rank's built heap out of every later GC pass (engine/runner.py);
        if str(device).startswith("cuda"):    # CPU ranks (tests, in-process) keep the GC whole
            freeze_host_heap()


def _granted_gpu() -> bool:
    """Whether this process may use a GPU: inside a Ray actor only when Ray granted it one (an
    actor asked for num_gpus=0 on a GPU host still sees every GPU, and CPU ranks sharing cuda:0
    would put NCCL on one device for the whole group); outside Ray, whenever CUDA is there."""
    try:
        import ray
        if ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE:
            return len(ray.get_gpu_ids()) > 0
    except Exception:                  # noqa: BLE001 - no Ray: a plain process
        pass
    return True


class RankWorker:
    """Plain class; wrapped with ray.remote by the executor (num_gpus=1 on GPU hosts)."""

    def __init__(self, rank: int, tp_size: int, dcp_size: int, factory: RunnerFactory,
                 replica_id: str, backend: str | None = None, oneshot_allreduce: bool = True):
        self.par = Parallel(tp_rank=rank, tp_size=tp_size, dcp_size=dcp_size)
        self.factory, self.replica_id = factory, replica_id
        self.oneshot_allreduce = oneshot_allreduce       # the deployment's decode section
        self.device = "cuda" if torch.cuda.is_available() and _granted_gpu() else "cpu"
        self.backend = backend or ("nccl" if self.device == "cuda" else "gloo")
        self.runner: ModelRunner | None = None
        self.comm: Comm | None = None
        self.steps = {p: 0 for p in PATHS}
        self._store = None
        self._loop: threading.Thread | None = None
        # the step loop's progress: last step started, last finished and when (wall clock)
        self._started, self._done, self._done_at = -1, -1, 0.0
        # the step loop's time by part (seconds, summed): waiting for a plan, decoding it,
        # the step (runner.execute: inputs, replay, sampling, the one host sync), the result's
        # send; read with progress() (served-path breakdown, scripts/bench/serve.py)
        self.timing = {"steps": 0, "wait_s": 0.0, "decode_s": 0.0, "step_s": 0.0,
                       "send_s": 0.0}
        # one intra-op thread: ranks share the host's cores, and spinning OpenMP pools of
        # several processes on the same cores cost 10-20x on a loaded CPU
        torch.set_num_threads(settings.rank_threads())

    def open_store(self, timeout_s: float = 120.0) -> tuple[str, int]:
        """Rank 0 only: a TCPStore on an OS-chosen port; returns (host, port) for the others."""
        import ray
        import torch.distributed as dist

        host = ray.util.get_node_ip_address()
        # wait_for_workers=False: the others connect only after this returns its port
        self._store = dist.TCPStore(host, 0, self.par.tp_size, is_master=True,
                                    timeout=datetime.timedelta(seconds=timeout_s),
                                    wait_for_workers=False)
        return host, self._store.port

    def init_group(self, host: str, port: int, timeout_s: float = 120.0,
                   op_timeout_s: float | None = None) -> dict:
        """Join the group (rendezvous within timeout_s; each collective then times out after
        op_timeout_s), load this rank's shard (step graphs on: capture them). -> {"rank",
        "dcp_rank", "device", "specialized": (ok, why), "kernel_cache", "graph_buckets": the
        captured buckets or None (graphs off), "graph_failed": why not all, or None}"""
        import torch.distributed as dist

        store = self._store or dist.TCPStore(host, port, self.par.tp_size, is_master=False,
                                             timeout=datetime.timedelta(seconds=timeout_s))
        prefixed = dist.PrefixStore(f"raydecode/{self.replica_id}", store)
        if self.device == "cuda":
            torch.cuda.set_device(0)          # Ray exposes exactly this actor's GPU as device 0
        dist.init_process_group(self.backend, store=prefixed, rank=self.par.tp_rank,
                                world_size=self.par.tp_size,
                                timeout=datetime.timedelta(seconds=op_timeout_s or timeout_s))
        return self._build()

    # ---- the persistent step loop (engine/step_channel.py) ------------------------------------
    def start_loop(self, address: ChannelAddress, timeout_s: float = 60.0) -> str:
        """Connect to the coordinator's step channel and serve its steps on a thread until a
        STOP frame or the channel closes. -> the transport ('uds' or 'tcp')."""
        self._join_loop()
        client = ChannelClient(address, self.par.tp_rank, timeout_s)
        self._loop = threading.Thread(target=self._serve, args=(client,), daemon=True,
                                      name=f"raydecode-step-loop-{self.par.tp_rank}")
        self._loop.start()
        return client.transport

    def _serve(self, client: ChannelClient) -> None:
        """recv plan → step → (rank 0) send result; a step that raises sends an error frame
        and ends the loop (the coordinator then rebuilds the group)."""
        if self.device == "cuda":
            torch.cuda.set_device(0)          # per thread: the actor's one GPU
        try:
            tm, clock = self.timing, time.perf_counter
            while True:
                t0 = clock()
                kind, step_id, payload = client.recv_plan()
                t1 = clock()
                plan = decode_plan(kind, step_id, payload)
                if plan is None:
                    return
                self._started = step_id
                t2 = clock()
                try:
                    out = self.step(plan)
                except Exception as e:  # noqa: BLE001 — reported to the coordinator, loop ends
                    line = traceback.format_exception_only(type(e), e)[-1].strip()
                    client.send(error_frame(step_id, line[:400]))
                    return
                self._done, self._done_at = step_id, time.time()
                t3 = clock()
                if out is not None:
                    client.send(encode_result(step_id, out))
                tm["steps"] += 1
                tm["wait_s"] += t1 - t0
                tm["decode_s"] += t2 - t1
                tm["step_s"] += t3 - t2
                tm["send_s"] += clock() - t3
        except (ChannelClosed, OSError):
            return                            # the coordinator went away: nothing to serve
        finally:
            client.close()

    def _join_loop(self, timeout_s: float = 60.0) -> None:
        if self._loop is not None:
            self._loop.join(timeout_s)
            if self._loop.is_alive():
                raise RuntimeError(f"rank {self.par.tp_rank}: the step loop did not stop "
                                   f"within {timeout_s:g} s")
            self._loop = None

    def progress(self) -> dict:
        """{"rank", "started", "done", "done_at", "timing", "loop"}: the loop's last started /
        finished step id, the wall-clock time it finished, its time by part (`timing`) and
        whether it runs (answered while a step runs)."""
        return {"rank": self.par.tp_rank, "started": self._started, "done": self._done,
                "done_at": self._done_at, "timing": dict(self.timing),
                "loop": self._loop is not None
                and self._loop.is_alive()}

    def set_dcp(self, dcp_size: int) -> dict:
        """Re-lay this rank out for another DCP size inside the same TP group (collective:
        every rank of the group calls it): new DCP subgroups, the shard rebuilt with caches of
        the new layout (step graphs recaptured). Cache contents are dropped. The step loop
        must have been stopped (a STOP frame). -> as init_group"""
        self._join_loop()
        old = self.comm
        self.par = Parallel(self.par.tp_rank, self.par.tp_size, dcp_size)
        self.runner = None               # and its graphs (they hold the old comm's buffers)
        if hasattr(old, "close"):
            old.close()                   # collective: the one-shot buffers of the old comm
        info = self._build()
        if getattr(old, "dcp_group", None) is not None:
            import torch.distributed as dist
            dist.destroy_process_group(old.dcp_group)
        return info

    def _build(self) -> dict:
        self.comm = TorchComm(self.par) if self.par.tp_size > 1 else Comm()
        oneshot = self.par.tp_size > 1 and str(self.device).startswith("cuda")
        if oneshot:
            from raydecode.kernels.allreduce_oneshot import OneShotComm
            self.comm = OneShotComm.wrap(self.comm)     # all to NCCL until connected below
        self.runner = self.factory(self.par, self.comm, self.device)
        if oneshot:
            self._connect_oneshot()
        support, kernels, buckets, failed = prepare_runner(self.runner, self.par, self.device)
        return {"rank": self.par.tp_rank, "dcp_rank": self.par.dcp_rank, "device": self.device,
                "specialized": support, "kernel_cache": kernels,
                "graph_buckets": buckets, "graph_failed": failed,
                "spec_graphed": bool(getattr(self.runner, "spec_graphed", False))}

    def _connect_oneshot(self) -> None:
        """Collective over the TP group: the model's bf16 (T, hidden) all-reduces with
        T ≤ min(ONESHOT_MAX_TOKENS, SMs) take the one-shot kernel (kernels/allreduce_oneshot.py);
        the rest stay on NCCL. Off on every rank when any rank has
        RAYDECODE_ONESHOT_ALLREDUCE=0, lacks P2P to a peer, or the model is not bf16."""
        model = self.runner.model
        dev = torch.device("cuda", torch.cuda.current_device())
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self.comm.connect(min(ONESHOT_MAX_TOKENS, sms), model.cfg.hidden_size, dev,
                          dtype=getattr(model, "dtype", torch.float32),
                          enable=self.oneshot_allreduce and settings.oneshot_allreduce())

    def step(self, plan: StepPlan):
        """Run the plan on this shard (on plan.path); rank 0 samples on the device and returns
        the StepResult (token ids; logprobs where asked), the others None."""
        self.steps[plan.path] += 1      # counted as it starts: rank 0's result implies every
        out = self.runner.execute(plan, sample=self.par.tp_rank == 0)   # rank began the step
        if out is not None and hasattr(self.comm, "check_timeouts"):
            self.comm.check_timeouts()         # did a one-shot all-reduce wait give up?
        return out

    def stats(self) -> dict:
        import ray

        options = getattr(getattr(self.runner, "model", None), "options", None)
        return {"rank": self.par.tp_rank, "pid": os.getpid(), "steps": dict(self.steps),
                "decode_options": None if options is None else repr(options),
                "oneshot_allreduce": self.oneshot_allreduce,
                "placement_group": ray.get_runtime_context().get_placement_group_id()}

    def gpu_ids(self) -> list:
        import ray

        return ray.get_gpu_ids()

    def ping(self) -> int:
        return self.par.tp_rank

    def shutdown(self) -> None:
        """Collective when the comm holds one-shot buffers (every rank calls it); after the
        step loop stopped."""
        import torch.distributed as dist

        self._join_loop()
        self.runner = None       # first: its CUDA graphs hold the one-shot kernel's buffers
        if hasattr(self.comm, "close"):
            self.comm.close()
        if dist.is_initialized():
            dist.destroy_process_group()
