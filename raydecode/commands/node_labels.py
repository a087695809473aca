"""`raydecode node-labels`: Ray labels for `ray start --labels` from this node's verified fabric.

Exit 0: labels include `ray.io/gpu-domain`. Exit 3: the domain label was withheld (reasons on
stderr; the accelerator label, if any, is still printed so the node can join Ray for development).
"""
from __future__ import annotations

import argparse
import json
import sys

EXIT_DOMAIN_WITHHELD = 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", choices=("nvml", "k8s"), default="nvml",
                   help="nvml: verify this node's GPUs live (or --facts). k8s: read GPU feature "
                   "discovery's node labels (nvidia.com/gpu.clique, gpu.product) through the API, "
                   "for init containers that see no GPU")
    p.add_argument("--facts", default=None, metavar="FILE",
                   help="judge this `topology --json` output instead of live NVML")
    p.add_argument("--node", default=None, help="node name (default: $NODE_NAME or hostname)")
    p.add_argument("--format", choices=("ray-start", "yaml", "json"), default="ray-start",
                   help="ray-start: k=v,k=v for --labels; yaml: for --labels-file")


def run(args: argparse.Namespace) -> int:
    from raydecode.cluster.labels import labels_from_facts, labels_from_k8s
    from raydecode.cluster.topology import NodeFacts, collect_node_facts

    if args.source == "k8s":
        import os
        import socket

        from raydecode.cluster import kube
        node = args.node or os.environ.get("NODE_NAME") or socket.gethostname()
        raw, why = kube.node_labels(node)
        if raw is None:
            print(f"raydecode node-labels: {why}", file=sys.stderr)
            return 1
        result = labels_from_k8s(raw)
    elif args.facts:
        with open(args.facts) as f:
            result = labels_from_facts(NodeFacts.from_dict(json.load(f), where=args.facts))
    else:
        result = labels_from_facts(collect_node_facts(args.node))
    if args.format == "json":
        print(json.dumps(result.labels))
    elif args.format == "yaml":
        print(result.yaml(), end="")
    else:
        print(result.ray_start_arg())
    if not result.has_domain:
        print("raydecode node-labels: no ray.io/gpu-domain label (no production TP group will be "
              "placed on this node):", file=sys.stderr)
        for why in result.withheld:
            print(f"  - {why}", file=sys.stderr)
        return EXIT_DOMAIN_WITHHELD
    for why in result.withheld:   # e.g. mixed accelerator types
        print(f"raydecode node-labels: note: {why}", file=sys.stderr)
    return 0
