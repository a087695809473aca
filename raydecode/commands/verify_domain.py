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


def _read_facts(path: str):
    """One `raydecode topology --json` file -> NodeFacts; FactsError naming the file."""
    from raydecode.cluster.topology import FactsError, NodeFacts

    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise FactsError(f"{path}: not valid JSON ({e}); expected the output of "
                             "`raydecode topology --json`") from None
    return NodeFacts.from_dict(data, where=path)


def run(args: argparse.Namespace) -> int:
    from raydecode.cluster.topology import FactsError, collect_node_facts
    from raydecode.cluster.verify import verify_domain

    if args.tp < 1:
        print(f"raydecode verify-domain: --tp must be >= 1, got {args.tp}", file=sys.stderr)
        return 2
    try:
        if args.facts:
            nodes = [_read_facts(path) for path in args.facts]
        else:
            nodes = [collect_node_facts()]
            if not nodes[0].gpus:
                # no facts were given: say what this node lacks, not "the given facts"
                why = "; ".join(nodes[0].notes) or "NVML lists no GPU"
                print(f"FAIL: no NVIDIA GPUs visible on this node ({nodes[0].node}): {why}. "
                      "Run it on a GPU node, or pass --facts with `raydecode topology --json` "
                      "outputs of other nodes.")
                return 1
        verdict = verify_domain(nodes, args.tp, allow_unknown_health=args.allow_unknown_health)
    except (OSError, FactsError) as e:
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
