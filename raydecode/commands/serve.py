"""`raydecode serve CONFIG.yaml [--host H] [--port N] [--api-key KEY ...] [--api-key-file F]
[--metrics-port N]`: deploy the OpenAI-compatible endpoint on Ray Serve (a local Ray instance,
or the cluster at $RAY_ADDRESS), print its URL, block until Ctrl-C.

API keys (actors/auth.py): --api-key and $RAYDECODE_API_KEY here join serve.api_keys and travel
with the deployment to every replica (never printed); --api-key-file is read by each replica."""
from __future__ import annotations

import argparse
import os
import sys
import threading


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="deployment YAML (model, tensor_parallel_size, …)")
    p.add_argument("--host", default=None, help="HTTP listen address (overrides serve.host)")
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


def start_serving(cfg, executor_factory=None, app_name: str = "raydecode",
                  **ray_init) -> str:
    """Start (or join) Ray and Serve, deploy the replica app; returns the OpenAI base URL."""
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
    serve.start(http_options={"host": s.host, "port": s.port})
    serve.run(deployment_for(cfg, executor_factory), name=app_name, route_prefix=s.route_prefix)
    host = "127.0.0.1" if s.host in ("0.0.0.0", "::") else s.host
    return f"http://{host}:{s.port}{s.route_prefix.rstrip('/')}/v1"


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
    why = check_servable(cfg, local=not os.environ.get("RAY_ADDRESS"))
    if why:
        print(f"error: {args.config}: {why}", file=sys.stderr)
        return 2
    import ray
    from ray import serve

    try:
        url = start_serving(cfg)
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
        threading.Event().wait()
    except KeyboardInterrupt:
        print("raydecode: stopping", file=sys.stderr)
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
    return 0
