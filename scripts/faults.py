"""The fault matrix (issue 8, docs/RELIABILITY.md): one command, each row scripted and repeatable.

Each row starts requests against a live endpoint, injects one fault while they stream, and
checks the promise: every request completes with the text and token ids of an undisturbed run
of the same requests (greedy), or gets a clear retriable error (HTTP 503 + Retry-After, or an
SSE error event with code service_unavailable once the stream had started); none is silently
lost or answered twice; probes sent during the outage get the same treatment; and the replica
comes back (healthy again, the same requests complete again, the dead processes are gone).

    python -m raydecode.scripts.faults                      # every row
    python -m raydecode.scripts.faults --rows rank_kill,rank_hang --out faults.json

Rows on Ray Serve (one local Ray, the tiny model at TP=2, a stock-only raydecode replica on a
loopback port as the stock pool): rank_kill (SIGKILL a rank worker), rank_hang (SIGSTOP a rank
worker: no answer, no death), stock_pool_stop (the pool is down when a rank dies),
coordinator_kill (SIGKILL the coordinator actor), replica_kill (SIGKILL the Serve ingress
replica). On a `ray.cluster_utils.Cluster`: node_removal (the raylet of the ranks' node dies;
the coordinator serves over uvicorn in this process, a replacement node joins). Processes are
found among this process's descendants only, never another Ray instance's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field

from raydecode.scripts.load import Result, Spec, free_port, issue, server_processes

MODEL = "tiny-k3"
ROWS_SERVE = ("rank_kill", "rank_hang", "stock_pool_stop", "coordinator_kill", "replica_kill")
ROWS_CLUSTER = ("node_removal",)
ROWS = ROWS_SERVE + ROWS_CLUSTER


def replica_config(stock_url: str | None, tp: int = 2, step_timeout_s: float = 10.0,
                   max_model_len: int = 128, **extra) -> dict:
    cfg = {"model": "tiny", "served_model_name": MODEL, "tensor_parallel_size": tp,
           "max_model_len": max_model_len, "max_num_seqs": 8,
           "rank_step_timeout_s": step_timeout_s, "placement": {"profile": "development"},
           "serve": {"num_cpus": 0}, **extra}
    if stock_url is not None:
        cfg["stock_pool"] = {"base_url": stock_url + "/v1"}
    return cfg


def http_get(url: str, timeout: float = 60.0) -> tuple[int, dict | str, dict]:
    """(status, JSON body or text, headers) of a GET to loopback."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            status, raw, headers = r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        status, raw, headers = e.code, e.read(), dict(e.headers)
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        return 0, f"{type(e).__name__}: {e}", {}
    try:
        return status, json.loads(raw), headers
    except ValueError:
        return status, raw.decode(errors="replace"), headers


def metrics(root: str) -> dict[str, float]:
    """The unlabelled raydecode_* series of /metrics."""
    status, text, _ = http_get(root + "/metrics")
    if status != 200 or not isinstance(text, str):
        return {}
    return {ln.split(" ")[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
            if ln.startswith("raydecode_") and "{" not in ln.split(" ")[0]}


def alive(pid: int) -> bool:
    """True while pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2:][:1] != b"Z"


def rank_pids(timeout_s: float = 30.0) -> list[int]:
    """pids of the live rank group, rank order (asked from the named rank actors)."""
    import ray

    groups: dict[str, dict[int, tuple[str, str]]] = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        name = a["name"]
        if name.startswith("raydecode-rank-"):
            replica, rank = name.removeprefix("raydecode-rank-").rsplit("-", 1)
            groups.setdefault(replica, {})[int(rank)] = (name, a["namespace"])
    for members in groups.values():
        try:
            handles = [ray.get_actor(*members[r]) for r in sorted(members)]
            stats = ray.get([h.stats.remote() for h in handles], timeout=timeout_s)
            return [s["pid"] for s in stats]
        except Exception:  # noqa: BLE001 — a group being torn down; try the next one
            continue
    raise RuntimeError("no live rank group found")


# ---- the stacks -------------------------------------------------------------------------------
class StockPool:
    """A stock-only raydecode replica (TP=1) on a fixed loopback port: stoppable, restartable."""

    def __init__(self, max_model_len: int = 128):
        from raydecode.actors.config import parse_deploy_config

        self.cfg = parse_deploy_config({"model": "tiny", "served_model_name": MODEL,
                                        "max_model_len": max_model_len, "max_num_seqs": 8,
                                        "envelope": {"enabled": False}})
        self.port, self.server = free_port(), None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        from raydecode.actors.serve import LocalServer

        self.server = LocalServer(self.cfg, port=self.port)
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


class ServeStack:
    """Local Ray + Serve: one replica (ingress → coordinator actor → TP rank actors) and its
    stock pool."""

    def __init__(self, tp: int = 2, step_timeout_s: float = 10.0, num_cpus: int = 4):
        self.tp, self.step_timeout_s, self.num_cpus = tp, step_timeout_s, num_cpus
        self.stock = StockPool()
        self.root = self.url = ""

    def start(self) -> "ServeStack":
        import ray
        from ray import serve

        from raydecode.actors.config import parse_deploy_config
        from raydecode.actors.serve import deployment_for

        from raydecode.actors import proxy_guard
        from raydecode.commands.serve import start_http

        os.environ.setdefault(proxy_guard.ENV_VAR, proxy_guard.IMPORT_PATH)
        ray.init(address="local", num_cpus=self.num_cpus, include_dashboard=False,
                 object_store_memory=150 * 2**20, log_to_driver=False)
        self.stock.start()
        port = free_port()
        port = start_http("127.0.0.1", port, retry_free=2)
        cfg = parse_deploy_config(replica_config(self.stock.url, self.tp, self.step_timeout_s))
        serve.run(deployment_for(cfg), name="raydecode", route_prefix="/")
        self.root, self.url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/v1"
        return self

    def close(self) -> None:
        import ray
        from ray import serve

        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        self.stock.stop()

    def role_pids(self, role: str) -> list[int]:
        return sorted(p for p, r in server_processes().items() if r == role)

    def rank_pids(self) -> list[int]:
        return rank_pids()


# ---- one row ------------------------------------------------------------------------------------
PROMPTS = ([101, 202, 303, 44, 55], [7, 77, 177, 277], [400, 12, 300, 9, 9, 31], [64, 128, 256])


def row_specs(n_stream: int, n_unary: int, max_tokens: int) -> list[Spec]:
    out = [Spec("completions", True, list(PROMPTS[i % 4]) + [i], max_tokens, 0.0)
           for i in range(n_stream)]
    out += [Spec("completions", False, list(PROMPTS[i % 4]) + [50 + i], max_tokens, 0.0)
            for i in range(n_unary)]
    return out


PROBE = Spec("completions", True, [33, 34, 35], 6, 0.0)


@dataclass
class RowResult:
    row: str
    checks: dict[str, bool] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)   # completed / retriable / ...
    requests: list[dict] = field(default_factory=list)
    probes: list[dict] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)  # /metrics deltas across the row
    seconds: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    command: str = ""

    def check(self, name: str, ok: bool) -> None:
        self.checks[name] = bool(ok)

    @property
    def holds(self) -> bool:
        return bool(self.checks) and all(self.checks.values())

    def as_dict(self) -> dict:
        return {"row": self.row, "holds": self.holds, **{k: v for k, v in asdict(self).items()
                                                          if k != "row"}}


def classify(r: Result, ref: Result | None) -> str:
    """completed (as undisturbed) | different (tokens lost or repeated) | lost (the server
    claimed success with a short or unfinished answer) | retriable (503 + Retry-After, or a
    service_unavailable event) | failed (any other visible error)."""
    if r.error is None:
        if ref is None or (r.text == ref.text and r.token_ids == ref.token_ids):
            return "completed"
        return "different"
    if r.silent:
        return "lost"
    return "retriable" if r.retriable else "failed"


def brief(r: Result, kind: str) -> dict:
    return {"kind": kind, "stream": r.stream, "status": r.status, "error": r.error,
            "retry_after": r.retry_after, "tokens": r.tokens, "latency_s": round(r.latency, 2),
            "message": r.message[:160]}


async def run_batch(url: str, specs: list[Spec], fault=None, after_tokens: int = 2,
                    timeout_s: float = 180.0) -> tuple[list[Result], dict]:
    """Run specs concurrently; `fault()` runs (blocking, briefly) once every stream has received
    `after_tokens` tokens. -> results, {"t": fault time (monotonic) or None if it never ran,
    "progress": stream index -> tokens received when it ran}."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=timeout_s)
    progress = {i: 0 for i, s in enumerate(specs) if s.stream}
    ready, fired = asyncio.Event(), {"t": None, "progress": {}}

    def seen(i: int, n: int) -> None:
        progress[i] = n
        if all(v >= after_tokens for v in progress.values()):
            ready.set()

    async def inject() -> None:
        await ready.wait()
        fired["t"], fired["progress"] = time.monotonic(), dict(progress)
        fault()                 # on the loop's thread: Ray's node start-up needs the main thread

    task = asyncio.create_task(inject()) if fault is not None else None
    try:
        results = await asyncio.gather(*[
            issue(client, MODEL, s, on_tokens=(lambda n, i=i: seen(i, n)) if s.stream else None)
            for i, s in enumerate(specs)])
    finally:
        if task is not None and not task.done():
            task.cancel()
        await client.close()
    if task is not None and task.done() and not task.cancelled() and task.exception():
        raise task.exception()
    return list(results), fired


async def probe_until(url: str, stop: asyncio.Event, max_probes: int,
                      period_s: float) -> list[Result]:
    """New requests during the outage, one every period_s until `stop` (at most max_probes)."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
    out: list[Result] = []
    try:
        while not stop.is_set() and len(out) < max_probes:
            out.append(await issue(client, MODEL, PROBE))
            try:
                await asyncio.wait_for(stop.wait(), period_s)
            except asyncio.TimeoutError:
                pass
    finally:
        await client.close()
    return out


def wait_healthy(root: str, timeout_s: float) -> float | None:
    """Seconds until GET /health answers 200 with status ok, or None after timeout_s."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        status, body, _ = http_get(root + "/health?wait_s=5", timeout=30)
        if status == 200 and isinstance(body, dict) and body.get("status") == "ok":
            return time.monotonic() - t0
        time.sleep(0.5)
    return None


async def play_row(res: RowResult, url: str, root: str, fault, *, n_stream: int = 4,
                   n_unary: int = 2, max_tokens: int = 32, expect_all_complete: bool,
                   recovery_timeout_s: float = 180.0, probes: bool = True,
                   max_probes: int = 40) -> dict[str, Result]:
    """Undisturbed run → the same requests with `fault` mid-stream (+ probes) → recovery →
    the same requests again. Fills res.checks; returns the undisturbed reference by prompt."""
    specs = row_specs(n_stream, n_unary, max_tokens) + [PROBE]
    ref, _ = await run_batch(url, specs)
    res.check("undisturbed run completes", all(r.error is None for r in ref))
    refs = {json.dumps(s.prompt): r for s, r in zip(specs, ref)}
    before = metrics(root)

    stop = asyncio.Event()
    probe_task = asyncio.create_task(probe_until(url, stop, max_probes, 1.0)) \
        if probes else None
    t0 = time.monotonic()
    results, fired = await run_batch(url, specs[:-1], fault)
    t_fault = fired["t"]
    res.check("fault injected mid-stream", t_fault is not None and
              all(0 < n < max_tokens for n in fired["progress"].values()))
    res.seconds["requests_after_fault"] = round(time.monotonic() - (t_fault or t0), 2)
    t1 = time.monotonic()
    took = await asyncio.to_thread(wait_healthy, root, recovery_timeout_s)
    res.seconds["healthy_after_requests"] = round(time.monotonic() - t1, 2)
    res.check("replica healthy again", took is not None)
    stop.set()                         # probes ran from the fault until healthy again
    probe_results = await probe_task if probe_task is not None else []

    kinds = [classify(r, refs[json.dumps(s.prompt)]) for s, r in zip(specs, results)]
    pkinds = [classify(p, refs[json.dumps(PROBE.prompt)]) for p in probe_results]
    for k in kinds + pkinds:
        res.outcomes[k] = res.outcomes.get(k, 0) + 1
    res.requests = [brief(r, k) for r, k in zip(results, kinds)]
    res.probes = [brief(p, k) for p, k in zip(probe_results, pkinds)]
    res.check("none silently lost", "lost" not in kinds + pkinds)
    res.check("none answered twice or cut (completed == undisturbed)",
              "different" not in kinds + pkinds)
    res.check("every failure is a clean retriable error", "failed" not in kinds + pkinds)
    if expect_all_complete:
        res.check("every in-flight request completed", kinds.count("completed") == len(kinds))

    after, _ = await run_batch(url, specs)
    res.check("same requests complete after recovery, as undisturbed",
              all(classify(r, refs[json.dumps(s.prompt)]) == "completed"
                  for s, r in zip(specs, after)))
    now = metrics(root)
    res.counters = {k.removeprefix("raydecode_"): now[k] - before.get(k, 0.0) for k in now
                    if k.endswith("_total") and now[k] != before.get(k, 0.0)}
    return refs


def check_failover_counts(res: RowResult, n: int) -> None:
    """The counters show the n requests in flight at the fault moved to the stock pool (probes
    may add to either counter: in flight at the fault, or sent while unhealthy)."""
    c, probes = res.counters, len(res.probes)
    moved, routed = c.get("failover_requests_total", 0), c.get("routed_to_stock_total", 0)
    res.check("fail-over counter shows every in-flight request",
              n <= moved and moved + routed <= n + probes)
    res.check("one fail-over event, one rebuild", c.get("failover_events_total") == 1 and
              c.get("rebuilds_total") == 1)


def wait_gone(pids: list[int], timeout_s: float = 60.0) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.25)
    return False


# ---- the rows -----------------------------------------------------------------------------------
def rank_kill(stack: ServeStack, n_stream: int = 4, n_unary: int = 2,
              probes: bool = True) -> RowResult:
    res = RowResult("rank_kill", notes=["SIGKILL of rank 1 of the TP=2 group mid-stream"])
    old = stack.rank_pids()
    asyncio.run(play_row(res, stack.url, stack.root, lambda: os.kill(old[1], signal.SIGKILL),
                         n_stream=n_stream, n_unary=n_unary, expect_all_complete=True,
                         probes=probes))
    check_failover_counts(res, n_stream + n_unary)
    res.check("old rank processes gone", wait_gone(old))
    res.check("a new rank group serves", set(stack.rank_pids()).isdisjoint(old))
    return res


def rank_hang(stack: ServeStack, n_stream: int = 4, n_unary: int = 2,
              probes: bool = True) -> RowResult:
    res = RowResult("rank_hang", notes=[f"SIGSTOP of rank 1 mid-stream; rank_step_timeout_s = "
                                        f"{stack.step_timeout_s}"])
    old = stack.rank_pids()
    try:
        asyncio.run(play_row(res, stack.url, stack.root,
                             lambda: os.kill(old[1], signal.SIGSTOP), n_stream=n_stream,
                             n_unary=n_unary, expect_all_complete=True, probes=probes))
    finally:
        gone = wait_gone(old, 60.0)
        for p in old:              # never leave a stopped process of ours behind
            if alive(p):
                os.kill(p, signal.SIGKILL)
    check_failover_counts(res, n_stream + n_unary)
    status, body, _ = http_get(stack.root + "/health")
    res.check("the failure names the missed step deadline",
              isinstance(body, dict) and "did not finish" in str(body.get("last_failure")))
    res.check("old rank processes gone (the stopped one too)", gone)
    return res


def stock_pool_stop(stack: ServeStack) -> RowResult:
    res = RowResult("stock_pool_stop", notes=["stock pool stopped, then SIGKILL of rank 1 "
                                              "mid-stream: nowhere to continue"])
    old = stack.rank_pids()
    stack.stock.stop()
    try:
        asyncio.run(play_row(res, stack.url, stack.root, lambda: os.kill(old[1], signal.SIGKILL),
                             expect_all_complete=False))
    finally:
        stack.stock.start()
    res.check("fail-over event counted", res.counters.get("failover_events_total") == 1)
    res.check("old rank processes gone", wait_gone(old))
    return res


def coordinator_kill(stack: ServeStack) -> RowResult:
    res = RowResult("coordinator_kill", notes=["SIGKILL of the coordinator actor mid-stream; "
                                               "Serve's health check replaces the replica"])
    old = stack.role_pids("coordinator")
    old_ranks = stack.rank_pids()
    res.check("one coordinator found", len(old) == 1)
    asyncio.run(play_row(res, stack.url, stack.root, lambda: os.kill(old[0], signal.SIGKILL),
                         expect_all_complete=False))
    new = stack.role_pids("coordinator")
    res.check("a new coordinator serves", len(new) == 1 and new[0] not in old)
    res.check("the old group's ranks are gone", wait_gone(old_ranks))
    return res


def replica_kill(stack: ServeStack) -> RowResult:
    res = RowResult("replica_kill", notes=["SIGKILL of the Serve ingress replica mid-stream; "
                                           "the Serve controller starts a new one"])
    old = stack.role_pids("ingress")
    res.check("one ingress replica found", len(old) == 1)
    asyncio.run(play_row(res, stack.url, stack.root, lambda: os.kill(old[0], signal.SIGKILL),
                         expect_all_complete=False))
    new = stack.role_pids("ingress")
    res.check("a new ingress replica serves", len(new) == 1 and new[0] not in old)
    return res


def node_removal(step_timeout_s: float = 20.0) -> RowResult:
    """A two-node Cluster: the head (no CPUs for ranks) runs Ray's services; the ranks need a
    CPU, so they land on the worker node. The coordinator and the HTTP front run here
    (uvicorn); the worker node's raylet is killed mid-stream and a replacement node joins."""
    import ray
    from ray.cluster_utils import Cluster

    from raydecode.actors.config import parse_deploy_config
    from raydecode.actors.serve import LocalServer

    res = RowResult("node_removal", notes=["raylet of the ranks' node killed mid-stream "
                                           "(Cluster.remove_node), replacement node added"])
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "object_store_memory": 100 * 2**20,
        "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3,
                           "health_check_initial_delay_ms": 1000}})
    stock, server = StockPool(), None
    try:
        node = cluster.add_node(num_cpus=2, object_store_memory=100 * 2**20)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        stock.start()
        cfg = parse_deploy_config(replica_config(stock.url, 2, step_timeout_s))
        server = LocalServer(cfg, port=free_port())
        root = server.start()
        res.check("replica up", wait_healthy(root, 300) is not None)
        old = rank_pids()
        spare: dict = {}

        def fault() -> None:
            cluster.remove_node(node, allow_graceful=False)
            spare["node"] = cluster.add_node(num_cpus=2, object_store_memory=100 * 2**20)

        asyncio.run(play_row(res, root + "/v1", root, fault, expect_all_complete=True))
        check_failover_counts(res, 6)
        alive_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        new = rank_pids()
        # the head has no CPU for a rank: a live group can only be on the replacement node
        res.check("the removed node is dead, a new group runs on the replacement",
                  node.node_id not in alive_nodes and spare["node"].node_id in alive_nodes
                  and len(new) == 2 and set(new).isdisjoint(old) and wait_gone(old))
    finally:
        if server is not None:
            server.stop()
        stock.stop()
        ray.shutdown()
        cluster.shutdown()
    return res


ROW_FUNCS = {"rank_kill": rank_kill, "rank_hang": rank_hang, "stock_pool_stop": stock_pool_stop,
             "coordinator_kill": coordinator_kill, "replica_kill": replica_kill}


def run_rows(rows: list[str], step_timeout_s: float = 10.0, log=print) -> list[RowResult]:
    out: list[RowResult] = []
    serve_rows = [r for r in rows if r in ROWS_SERVE]
    if serve_rows:
        stack = ServeStack(step_timeout_s=step_timeout_s).start()
        try:
            for name in serve_rows:
                t0 = time.monotonic()
                res = ROW_FUNCS[name](stack)
                out.append(_finish(res, t0, step_timeout_s, log))
        finally:
            stack.close()
    if "node_removal" in rows:
        t0 = time.monotonic()
        out.append(_finish(node_removal(), t0, step_timeout_s, log))
    return out


def _finish(res: RowResult, t0: float, step_timeout_s: float, log) -> RowResult:
    res.seconds["row"] = round(time.monotonic() - t0, 1)
    res.command = (f"python -m raydecode.scripts.faults --rows {res.row} --step-timeout "
                   f"{step_timeout_s:g}")
    log(f"{res.row:<18} {'HOLDS' if res.holds else 'FAILS'}  {res.outcomes}  "
        f"{ {k: v for k, v in res.checks.items() if not v} or ''}")
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated; of {', '.join(ROWS)}")
    p.add_argument("--step-timeout", type=float, default=10.0,
                   help="rank_step_timeout_s of the Serve replica (the hang row waits this long)")
    p.add_argument("--out", help="write the JSON results here")
    a = p.parse_args(argv)
    rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        p.error(f"--rows {unknown}: unknown; accepted: {', '.join(ROWS)}")
    results = run_rows(rows, a.step_timeout, log=lambda s: print(s, flush=True))
    if a.out:
        with open(a.out, "w") as f:
            json.dump([r.as_dict() for r in results], f, indent=1)
    return 0 if all(r.holds for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
