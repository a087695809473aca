"""The per-step control plane alone: what a step costs on top of its GPU work, for 1-16 ranks.

    python -m raydecode.scripts.bench.control_plane [--ranks 1,4,8,16] [--steps 2000]
        [--batches 1,64] [--variants channel,channel_tcp,ray_call,compiled_graph]
        [--out bench/results/control-plane-….json]

Real rank actors (actors/rank_worker.py RankWorker, CPU, one gloo group) whose runner does no
model work: rank 0 answers each plan with one token id per sample row, the others with nothing.
So a step's wall time from the coordinator's decision (a StepPlan with its sampling rows, as the
engine builds it) until the next one can start (its StepResult decoded) is all control plane.
Variants, each measured in the same run on the same actors:
  channel         the served path: the packed plan frame to every rank's persistent loop over
                  Unix sockets, rank 0's result frame back (engine/step_channel.py)
  channel_tcp     the same over TCP loopback (the path of ranks on other hosts)
  ray_call        the old path: one Ray actor call per rank per step, the plan pickled
  compiled_graph  a Ray Compiled Graph over the same actors' `step` method (where it compiles)
  channel_gil_busy  the channel while a sibling thread of the coordinator holds the GIL in
                  4 ms bursts of Python work with 1 ms pauses (what a coordinator's event loop
                  does while it streams many outputs), once per --switch-intervals value
                  (sys.setswitchinterval; Python's default is 5 ms, the deployment's
                  coordinator_switch_interval_ms 0.2)
Per (ranks, batch, variant): p50 / p90 / p99 / mean of the per-step ms.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

from raydecode.engine.engine import sampling_rows
from raydecode.engine.request import Request, SamplingParams
from raydecode.engine.sampling import StepResult
from raydecode.engine.scheduler import StepPlan
from raydecode.models.cache import StepBatch

from .report_io import git_commit, report_header, write_report

VARIANTS = ("channel", "channel_tcp", "ray_call", "compiled_graph", "channel_gil_busy")


class GilBusy:
    """A thread holding the GIL in bursts of pure-Python work (`burst_s`) with short pauses."""

    def __init__(self, burst_s: float = 0.004, pause_s: float = 0.001):
        import threading
        self.burst_s, self.pause_s = burst_s, pause_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            t, d = time.perf_counter(), {}
            while time.perf_counter() - t < self.burst_s:
                for i in range(200):
                    d[i] = str(i) * 3
            time.sleep(self.pause_s)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


class NullModel:
    """No specialized step, no config: prepare_runner has nothing to compile or capture."""


class TrivialRunner:
    """A rank's runner that does no model work (picklable factory: `trivial_runner`)."""

    def __init__(self):
        self.model = NullModel()
        self.steps = 0

    def execute(self, plan: StepPlan, sample: bool = True):
        self.steps += 1
        return StepResult([t % 1000 for t in plan.tokens[:len(plan.sample_rows)]]) \
            if sample else None

    def release(self, slots) -> None:
        pass


def trivial_runner(par, comm, device) -> TrivialRunner:
    return TrivialRunner()


def decode_plan(step_id: int, batch: int, context: int = 1024) -> StepPlan:
    """A decode step of `batch` sequences at `context` with sampling rows as the engine sets
    them (temperature 0.8, seeded), one block table growing per 16 steps."""
    params = SamplingParams(max_tokens=64, temperature=0.8, seed=7)
    reqs = [Request(prompt_ids=[1] * context, params=params) for _ in range(batch)]
    plan = StepPlan(step_id, StepBatch.decode(list(range(batch)), [context] * batch),
                    list(range(100, 100 + batch)), list(range(batch)),
                    {0: list(range(context // 16 + 1))} if step_id % 16 == 0 else {}, [],
                    "stock")           # the trivial runner has no specialized step
    plan.sampling = sampling_rows(reqs, [True] * batch)
    return plan


def time_steps(run, batch: int, steps: int, warm: int) -> dict:
    ts = []
    for i in range(warm + steps):
        plan = decode_plan(i + 1, batch)
        t0 = time.perf_counter()
        out = run(plan)
        dt = time.perf_counter() - t0
        if len(out.token_ids) != batch:
            raise RuntimeError(f"step {i}: {len(out.token_ids)} ids for {batch} rows")
        if i >= warm:
            ts.append(dt * 1e3)
    ts.sort()
    q = lambda f: round(ts[min(len(ts) - 1, int(f * len(ts)))], 4)     # noqa: E731
    return {"steps": steps, "p50_ms": q(0.5), "p90_ms": q(0.9), "p99_ms": q(0.99),
            "mean_ms": round(statistics.fmean(ts), 4), "min_ms": round(ts[0], 4)}


def bench_group(n: int, batches: list[int], variants: list[str], steps: int, warm: int,
                cpus_per_rank: float, switch_intervals_ms: tuple = (5.0, 0.2)) -> dict:
    import ray

    from raydecode.actors.rank_group import make_rank_group_executor

    ex = make_rank_group_executor("tiny", n, 1, "float32", 64, 64, 16, 60.0,
                                  num_cpus_per_rank=cpus_per_rank, num_gpus_per_rank=0,
                                  runner_factory=trivial_runner)
    out = {"ranks": n, "rows": []}
    try:
        for v in variants:
            run, note = None, None
            if v == "channel":
                out["transports"] = ex.reconnect(local=True)
                run = ex.execute
            elif v == "channel_tcp":
                ex.reconnect(local=False)
                run = ex.execute
            elif v == "ray_call":
                def run(plan, ws=ex.workers):
                    return ray.get([w.step.remote(plan) for w in ws])[0]
            elif v == "compiled_graph":
                try:
                    run, teardown = _compiled(ex.workers)
                except Exception as e:  # noqa: BLE001 — reported, not fatal
                    note = f"did not compile: {type(e).__name__}: {str(e)[:300]}"
            if v == "channel_gil_busy":
                ex.reconnect(local=True)
                prev = sys.getswitchinterval()
                try:
                    for si in switch_intervals_ms:
                        sys.setswitchinterval(si / 1e3)
                        for b in batches:
                            with GilBusy():
                                row = {"variant": v, "batch": b, "switch_interval_ms": si,
                                       **time_steps(ex.execute, b, steps, warm)}
                            out["rows"].append(row)
                            print(f"[control-plane] ranks={n} batch={b} {v} switch {si} ms: "
                                  f"p50 {row['p50_ms']} mean {row['mean_ms']}", flush=True)
                finally:
                    sys.setswitchinterval(prev)
                continue
            for b in batches:
                row = {"variant": v, "batch": b}
                if run is None:
                    row["error"] = note
                else:
                    try:
                        row.update(time_steps(run, b, steps if v != "ray_call" else
                                              max(200, steps // 5), warm))
                    except Exception as e:  # noqa: BLE001
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                out["rows"].append(row)
                print(f"[control-plane] ranks={n} batch={b} {v}: "
                      f"{row.get('p50_ms', row.get('error'))}", flush=True)
            if v == "compiled_graph" and run is not None:
                teardown()
        ex.reconnect(local=True)
    finally:
        ex.close()
    return out


def _compiled(workers):
    import ray
    from ray.dag import InputNode, MultiOutputNode

    with InputNode() as inp:
        dag = MultiOutputNode([w.step.bind(inp) for w in workers])
    cdag = dag.experimental_compile()

    def run(plan):
        return ray.get(cdag.execute(plan))[0]

    return run, cdag.teardown


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1,4,8,16")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--warm", type=int, default=100)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--cpus-per-rank", type=float, default=0.5,
                    help="Ray CPUs a rank actor reserves (logical: the host has what it has)")
    ap.add_argument("--switch-intervals", default="5,0.2",
                    help="ms, for channel_gil_busy")
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None)
    args = ap.parse_args(argv)
    ranks = [int(x) for x in args.ranks.split(",")]
    intervals = tuple(float(x) for x in args.switch_intervals.split(","))
    batches = [int(x) for x in args.batches.split(",")]
    variants = args.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad or any(n < 1 for n in ranks) or any(b < 1 for b in batches):
        raise SystemExit(f"--variants {bad} / --ranks / --batches: accepted variants "
                         f"{', '.join(VARIANTS)}, ranks and batches >= 1")
    import ray

    t0 = time.time()
    need = max(ranks) * args.cpus_per_rank + 1
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, int(need) + 1),
             include_dashboard=False, log_to_driver=False)
    report = report_header(args.commit or git_commit(), bench="control_plane",
                           host_cpus=os.cpu_count(), python=sys.version.split()[0],
                           method=__doc__.split("\n\n", 2)[2], groups=[])
    try:
        for n in ranks:
            report["groups"].append(bench_group(n, batches, variants, args.steps, args.warm,
                                                args.cpus_per_rank, intervals))
            if args.out:
                write_report(report, args.out, t0)
    finally:
        ray.shutdown()
    report["summary"] = summary(report)
    print("[control-plane] summary", report["summary"], flush=True)
    if args.out:
        write_report(report, args.out, t0)
    return 0


def summary(report: dict) -> dict:
    """The issue's keys: the served path's (channel) p50 at batch 1 for 16 and 4 ranks."""
    def p50(n):
        for g in report["groups"]:
            if g["ranks"] == n:
                for r in g["rows"]:
                    if r["variant"] == "channel" and r["batch"] == 1 and "p50_ms" in r:
                        return r["p50_ms"]
        return None
    return {"overhead_ms_p50_16_ranks": p50(16), "overhead_ms_p50_4_ranks": p50(4)}


if __name__ == "__main__":
    raise SystemExit(main())
