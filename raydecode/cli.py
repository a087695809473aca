"""`raydecode` command line. Each subcommand lives in `raydecode/commands/<name>.py` and exposes
`add_arguments(parser)` and `run(args) -> int`; modules load lazily so `--help` stays fast."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from raydecode.kernels import settings

DESCRIPTION = ("Serve Kimi K3 decode on Ray clusters of NVLink GPUs: the OpenAI endpoint, the "
               "capacity planner, NVLink-domain checks and the node kernel cache. "
               "`raydecode COMMAND --help` describes each command.")

# name -> (module under raydecode.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("demo", "run the tiny K3 model end to end and print a few answers"),
    "generate": ("generate", "generate text from a prompt with a preset or checkpoint"),
    "model-info": ("model_info", "layer kinds, parameter counts, KV/KDA state bytes"),
    "serve": ("serve", "serve the OpenAI-compatible endpoint from a deployment YAML"),
    "stock-pool-config": ("stock_pool_config", "write the Ray Serve LLM (vLLM) stock-pool app"),
    "topology": ("topology", "print this node's GPU / NVLink-fabric facts"),
    "verify-domain": ("verify_domain", "check that a TP group fits in one healthy NVLink domain"),
    "node-labels": ("node_labels", "print the Ray node labels for `ray start --labels`"),
    "plan": ("plan", "capacity planner: memory, speed, replicas and cost"),
    "kernels-warmup": ("kernels_warmup", "compile a replica's kernels into the node kernel cache"),
}


def _available() -> dict[str, tuple[str, str]]:
    out = {}
    for name, (mod, help_) in COMMANDS.items():
        if importlib.util.find_spec(f"raydecode.commands.{mod}") is not None:
            out[name] = (mod, help_)
    return out


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raydecode", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (mod, help_) in _available().items():
        p = sub.add_parser(name, help=help_, description=help_)
        if only is None or only == name:
            importlib.import_module(f"raydecode.commands.{mod}").add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cmd = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(only=cmd)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    mod = importlib.import_module(f"raydecode.commands.{_available()[args.command][0]}")
    try:
        return int(mod.run(args) or 0)
    except ValueError as e:
        # user input errors (ConfigError, RequestError, CheckpointError, ... are ValueErrors):
        # one clear line, no traceback, unless RAYDECODE_DEBUG asks for it
        if settings.debug():
            raise
        print(f"raydecode {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
