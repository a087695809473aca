"""`raydecode verify-domain --tp N`: can a TP-N group be placed in one healthy NVLink domain?

Exit 0 and the chosen GPUs when it can; exit 1 and one reason per failing GPU when not.
`--probe-multicast` (opt-in; operators only, never in tests or benchmarks) then really allocates
fabric memory and a multicast object on this node's chosen GPUs, since the attributes can claim
support while IMEX is broken.
"""
from __future__ import annotations

import argparse
import json
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel group size")
    p.add_argument("--facts", nargs="+", metavar="FILE", default=None,
                   help="outputs of `raydecode topology --json` from one or more nodes "
                   "(default: this node, live NVML)")
    p.add_argument("--json", action="store_true", help="print the verdict as JSON")
    p.add_argument("--allow-unknown-health", action="store_true",
                   help="accept fabric health UNKNOWN (drivers that report no health summary)")
    p.add_argument("--probe-multicast", action="store_true",
                   help="OPT-IN: after a passing verdict, allocate fabric memory and bind a "
                   "multicast object on this node's chosen GPUs (never run in tests)")


def run(args: argparse.Namespace) -> int:
    from raydecode.cluster.topology import FactsError, NodeFacts, collect_node_facts
    from raydecode.cluster.verify import verify_domain

    if args.tp < 1:
        print(f"raydecode verify-domain: --tp must be >= 1, got {args.tp}", file=sys.stderr)
        return 2
    try:
        if args.facts:
            nodes = []
            for path in args.facts:
                with open(path) as f:
                    nodes.append(NodeFacts.from_dict(json.load(f), where=path))
        else:
            nodes = [collect_node_facts()]
        verdict = verify_domain(nodes, args.tp, allow_unknown_health=args.allow_unknown_health)
    except (OSError, json.JSONDecodeError, FactsError) as e:
        print(f"raydecode verify-domain: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(verdict.to_dict(), indent=2))
    else:
        print(("OK: " if verdict.ok else "FAIL: ") + verdict.summary)
        for g in verdict.chosen:
            print(f"  use {g} {g.uuid}")
        for f in verdict.failures:
            print(f"  {'excluded' if verdict.ok else 'fails'} {f}")
    if not verdict.ok:
        return 1
    if args.probe_multicast:
        from raydecode.cluster.probe import probe_chosen_on_this_node
        report = probe_chosen_on_this_node(verdict, nodes)
        print(report.text())
        return 0 if report.ok else 4
    return 0
