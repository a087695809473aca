"""`raydecode topology`: this node's GPU / NVLink-fabric facts (NVML, CUDA attributes, k8s
label)."""
from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the facts as JSON (the format "
                   "`verify-domain --facts` reads)")
    p.add_argument("--node", default=None, help="node name to report (default: $NODE_NAME or the "
                   "hostname; also the Kubernetes node whose clique label is read)")
    p.add_argument("--no-k8s", action="store_true", help="do not read Kubernetes node labels")


def run(args: argparse.Namespace) -> int:
    from raydecode.cluster.topology import collect_node_facts

    facts = collect_node_facts(args.node, k8s=not args.no_k8s)
    if args.json:
        print(json.dumps(facts.to_dict(), indent=2))
        return 0
    print(f"node {facts.node}" + (f"  (k8s clique label {facts.k8s_clique})"
                                  if facts.k8s_clique else ""))
    for g in facts.gpus:
        f = g.fabric
        print(f"  gpu{g.index} {g.name} {g.uuid}\n"
              f"    fabric {f.state}/{f.status} health {f.health} domain {f.domain}\n"
              f"    multicast {g.multicast_supported} fabric-handle {g.fabric_handle_supported} "
              f"nvlinks {g.nvlinks_up}/{g.nvlinks_total}")
        for n in g.notes:
            print(f"    note: {n}")
    if not facts.gpus:
        print("  no GPUs")
    for n in facts.notes:
        print(f"  note: {n}")
    return 0
