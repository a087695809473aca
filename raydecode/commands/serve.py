"""`raydecode serve CONFIG.yaml [--host H] [--port N] [--api-key KEY ...] [--api-key-file F]
[--metrics-port N]`: deploy the OpenAI-compatible endpoint on Ray Serve (a local Ray instance,
or the cluster at $RAY_ADDRESS), print its URL, block until Ctrl-C.

API keys (actors/auth.py): --api-key and $RAYDECODE_API_KEY here join serve.api_keys and travel
with the deployment to every replica (never printed); --api-key-file is read by each replica.

The endpoint listens on 127.0.0.1 unless --host (or the config's serve.host) says otherwise.
Before a local Ray starts, the model is looked up (a preset, or a folder with config.json and its
weights) and the CPUs the deployment reserves are counted against this machine's, so a
deployment that cannot start says why at once instead of waiting on ranks Ray cannot place."""
from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
from pathlib import Path


SIGNAL_POLL_S = 0.5


def install_stop_handlers() -> None:
    """SIGTERM (systemd, kill) and SIGINT (Ctrl-C) raise KeyboardInterrupt in the main thread,
    which shuts Serve and Ray down. SIGINT's handler is installed even where the process
    inherited SIGINT ignored (a background job of a non-interactive shell, whose SIG_IGN
    Python keeps): `kill -INT` then still stops the server."""
    import signal

    def _stop(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def wait_for_signal(poll_s: float = SIGNAL_POLL_S) -> None:
    """Block until a signal handler raises (`install_stop_handlers`). The kernel may hand a
    process-directed signal to any thread that does not block it (one of Ray's or gRPC's
    here); CPython then runs the Python handler in the main thread only when that thread
    next executes bytecode, which an untimed `Event().wait()` never does (its lock wait is not
    interrupted by a signal another thread took). Waking every `poll_s` runs a pending
    handler within that time."""
    stop = threading.Event()
    while not stop.wait(poll_s):
        pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="deployment YAML (model, tensor_parallel_size, …)")
    p.add_argument("--host", default=None, help="HTTP listen address (overrides serve.host, "
                   "default 127.0.0.1); 0.0.0.0 serves other machines")
    p.add_argument("--port", type=int, default=None, help="HTTP port (overrides serve.port)")
    p.add_argument("--api-key", nargs="+", action="extend", default=[], metavar="KEY",
                   help="require one of these bearer keys on every /v1 route (adds to "
                        "serve.api_keys; $RAYDECODE_API_KEY, comma separated, adds too). A key "
                        "on the command line is visible to other local users: prefer the "
                        "variable or --api-key-file")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="file of API keys, one per line (overrides serve.api_key_file)")
    p.add_argument("--metrics-port", type=int, default=None, metavar="N",
                   help="serve /metrics and /health on this port of 127.0.0.1 instead of the "
                        "public one (overrides serve.metrics_port)")


def with_overrides(cfg, host: str | None = None, port: int | None = None,
                   api_keys: list[str] = (), api_key_file: str | None = None,
                   metrics_port: int | None = None):
    """The config with CLI overrides applied (validated like the file)."""
    from raydecode.actors.config import parse_deploy_config

    data = cfg.model_dump()
    for key, value in (("host", host), ("port", port), ("api_key_file", api_key_file),
                       ("metrics_port", metrics_port)):
        if value is not None:
            data["serve"][key] = value
    data["serve"]["api_keys"] = [*data["serve"]["api_keys"], *api_keys]
    return parse_deploy_config(data, "command line")


def check_servable(cfg, local: bool = True) -> str | None:
    """Why this build cannot serve the config, or None. A speculating config's drafter is read
    here (num_speculative_tokens <= its block size): always for a local Ray (local=True), else
    when its files are on this machine (a remote cluster's replicas check it at start)."""
    from raydecode.actors.config import DeployConfigError, check_speculative
    from raydecode.actors.coordinator import executor_supports

    try:
        check_speculative(cfg, "", require_drafter=local)
    except DeployConfigError as e:
        return str(e)
    if not executor_supports(cfg):
        return (f"tensor_parallel_size = {cfg.tensor_parallel_size} with "
                f"decode_context_parallel_size = {cfg.decode_context_parallel_size} cannot shard "
                f"{cfg.model!r}: TP must divide the model's head counts, vocabulary and widths, "
                "and DCP must divide TP")
    return None


def check_model(cfg) -> str | None:
    """Why this machine cannot load `cfg.model`, or None: a preset, or a checkpoint folder with a
    config.json and its weights index (read before Ray starts, so a wrong path is one line)."""
    from raydecode.models.config import PRESETS, load_config
    from raydecode.models.weights import read_index

    spec = cfg.model
    if spec == "tiny":
        return None
    if spec in PRESETS:
        return (f"model = {spec!r} is an architecture preset without weights; serve 'tiny' or "
                "a checkpoint folder")
    path = Path(spec)
    if not path.is_dir():
        return (f"model = {spec!r}: no such checkpoint folder on this machine (a folder with "
                "config.json and model-*.safetensors)")
    try:
        load_config(path)
        read_index(path)
    except ValueError as e:          # ConfigError / CheckpointError name the file
        return f"model = {spec!r}: {e}"
    return None


def cpus_needed(cfg, gpus: bool = False) -> dict[str, float]:
    """CPUs the deployment reserves, by part: the Serve ingress and the coordinator actor of each
    replica (serve.num_cpus each) and, at TP > 1, its rank actors (1 CPU each on a CPU-only
    Ray, placement.rank_cpus on GPUs: actors/coordinator.py build_executor)."""
    n, tp = cfg.serve.num_replicas, cfg.tensor_parallel_size
    per_rank = cfg.placement.rank_cpus if gpus else 1.0
    ranks = 0 if tp == 1 and cfg.decode_context_parallel_size == 1 else tp
    return {"ingress": n * cfg.serve.num_cpus, "coordinator": n * cfg.serve.num_cpus,
            "ranks": n * ranks * per_rank}


def check_resources(cfg, available_cpus: float, gpus: bool = False) -> str | None:
    """Why a local Ray of `available_cpus` CPUs can never place this deployment, or None."""
    need = cpus_needed(cfg, gpus)
    total = sum(need.values())
    if total <= available_cpus:
        return None
    n, tp = cfg.serve.num_replicas, cfg.tensor_parallel_size
    parts = (f"ingress {need['ingress']:g} + coordinator {need['coordinator']:g} "
             f"(serve.num_cpus = {cfg.serve.num_cpus:g} each, {n} replica(s))")
    if need["ranks"]:
        parts += f" + {need['ranks']:g} for {n} × {tp} rank actors"
    return (f"this deployment needs {total:g} CPUs ({parts}); this machine has "
            f"{available_cpus:g}. Lower serve.num_cpus (0 reserves none for the ingress and the "
            "coordinator), tensor_parallel_size or serve.num_replicas, or run on a larger machine "
            "or cluster ($RAY_ADDRESS)")


def local_cpus() -> float:
    """The CPUs a local `ray.init()` counts on this machine: the CPUs this process may run on,
    capped by a cgroup v2 CPU quota (a container's limit), as Ray counts them."""
    n = float(len(os.sched_getaffinity(0)))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1.0, float(-(-int(quota) // int(period)))))
    except (OSError, ValueError):
        pass
    return n


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's choice; nothing holds it after)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_http(host: str, port: int, retry_free: int = 0) -> int:
    """serve.start with its HTTP proxy on host:port -> the port it bound. With retry_free > 0
    the caller picked the port free (`free_loopback_port`) and any free one will do: a port
    picked before Ray's own processes started can be taken by one of them (CI: the proxy's
    "Failed to bind to address"), so on that failure Serve is shut down and started again on
    a fresh free port, up to retry_free times. A port an operator chose is never replaced."""
    from ray import serve

    for attempt in range(retry_free + 1):
        try:
            serve.start(http_options={"host": host, "port": port})
            return port
        except Exception as e:       # RayTaskError(RuntimeError) from the proxy actor
            if attempt == retry_free or "Failed to bind" not in str(e):
                raise
            serve.shutdown()
            port = free_loopback_port()
    raise AssertionError("unreachable")


def start_serving(cfg, executor_factory=None, app_name: str = "raydecode",
                  retry_free_port: int = 0, **ray_init) -> str:
    """Start (or join) Ray and Serve, deploy the replica app; returns the OpenAI base URL.
    retry_free_port: `start_http`'s retry_free (cfg.serve.port was picked free by the
    caller, e.g. the demo)."""
    import ray
    from ray import serve

    from raydecode.actors.serve import deployment_for

    if not ray.is_initialized():
        from raydecode.actors import proxy_guard

        # the Serve proxy answers requests whose replica died with 503 / an SSE error event
        # (set before ray.init: a local Ray's workers inherit this environment)
        os.environ.setdefault(proxy_guard.ENV_VAR, proxy_guard.IMPORT_PATH)
        ray.init(address=os.environ.get("RAY_ADDRESS") or "local", **ray_init)
    s = cfg.serve
    port = start_http(s.host, s.port, retry_free_port)
    serve.run(deployment_for(cfg, executor_factory), name=app_name, route_prefix=s.route_prefix)
    host = "127.0.0.1" if s.host in ("0.0.0.0", "::") else s.host
    return f"http://{host}:{port}{s.route_prefix.rstrip('/')}/v1"


def run(args: argparse.Namespace) -> int:
    from raydecode.actors.auth import env_api_keys
    from raydecode.actors.config import DeployConfigError, load_deploy_config

    try:
        cfg = with_overrides(load_deploy_config(args.config), args.host, args.port,
                             [*args.api_key, *env_api_keys()], args.api_key_file,
                             args.metrics_port)
    except DeployConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    local = not os.environ.get("RAY_ADDRESS")
    why = check_servable(cfg, local=local)
    if why is None and local:
        why = check_model(cfg)
    if why is None and local:
        import torch
        why = check_resources(cfg, local_cpus(), gpus=torch.cuda.is_available())
    if why:
        print(f"error: {args.config}: {why}", file=sys.stderr)
        return 2

    import ray
    from ray import serve

    try:
        url = start_serving(cfg)
        install_stop_handlers()                 # after ray.init, which installs its own
        print(f"raydecode: serving {cfg.model_name!r} at {url} (Ctrl-C stops)", flush=True)
        if cfg.serve.api_keys or cfg.serve.api_key_file:
            print("raydecode: /v1 routes require an API key (Authorization: Bearer …)",
                  flush=True)
        if cfg.serve.metrics_port is not None:
            print(f"raydecode: /health and /metrics on {cfg.serve.metrics_host}:"
                  f"{cfg.serve.metrics_port}", flush=True)
        if cfg.profile == "development":
            from raydecode.actors.envelope import DEVELOPMENT_NOTE
            print(f"raydecode: {DEVELOPMENT_NOTE}", flush=True)
        if cfg.synthetic_warning:
            print(f"raydecode: WARNING: {cfg.synthetic_warning}", file=sys.stderr, flush=True)
        wait_for_signal()
    except KeyboardInterrupt:
        print("raydecode: stopping", file=sys.stderr)
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
    return 0
