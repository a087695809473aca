"""Ray node labels for `ray start --labels`: `ray.io/gpu-domain=<cluster_uuid>.<clique_id>` and
`ray.io/accelerator-type=<GB300|H200|...>`.

The domain label is the promise placement relies on, so it is written only for a node whose GPUs
all pass `verify.gpu_problems`, agree on one domain and support fabric memory handles; otherwise it
is withheld with the reasons (the node still joins Ray, but no production TP group is placed on it).
"""
from __future__ import annotations

from dataclasses import dataclass

from raydecode.cluster.topology import K8S_CLIQUE_LABEL, NodeFacts, accelerator_type
from raydecode.cluster.verify import gpu_problems, k8s_label_problem, node_problems

DOMAIN_LABEL = "ray.io/gpu-domain"
ACCELERATOR_LABEL = "ray.io/accelerator-type"
K8S_PRODUCT_LABEL = "nvidia.com/gpu.product"


@dataclass(frozen=True)
class NodeLabels:
    labels: dict[str, str]
    withheld: tuple[str, ...] = ()   # why the domain label is missing (empty when present)

    @property
    def has_domain(self) -> bool:
        return DOMAIN_LABEL in self.labels

    def ray_start_arg(self) -> str:
        """`k=v,k=v`, the form `ray start --labels` parses."""
        return ",".join(f"{k}={v}" for k, v in self.labels.items())

    def yaml(self) -> str:
        """The form `ray start --labels-file` reads (one `key: "value"` per line)."""
        return "".join(f'{k}: "{v}"\n' for k, v in self.labels.items())


def labels_from_facts(facts: NodeFacts) -> NodeLabels:
    labels: dict[str, str] = {}
    withheld: list[str] = []
    types = sorted({t for t in (accelerator_type(g.name) for g in facts.gpus) if t})
    if len(types) == 1:
        labels[ACCELERATOR_LABEL] = types[0]
    elif types:
        withheld.append(f"mixed GPU types {types}: no {ACCELERATOR_LABEL} label")
    if not facts.gpus:
        return NodeLabels(labels, (f"no GPUs on node {facts.node}",))
    for g in facts.gpus:
        probs = gpu_problems(g)
        if probs:
            withheld.append(f"gpu{g.index}: {probs[0]}")
        elif not g.fabric_handle_supported:
            withheld.append(f"gpu{g.index}: no fabric memory handles (IMEX channel missing?)")
        elif k8s_label_problem(facts, g):
            withheld.append(f"gpu{g.index}: {k8s_label_problem(facts, g)}")
    withheld += node_problems(facts)
    if not withheld:
        labels = {DOMAIN_LABEL: facts.gpus[0].fabric.domain, **labels}
    return NodeLabels(labels, tuple(withheld))


def labels_from_k8s(node_labels: dict[str, str]) -> NodeLabels:
    """From GPU feature discovery's node labels alone (init container without GPUs): the clique
    label exists only on nodes whose fabric registration completed; health is not in it."""
    labels: dict[str, str] = {}
    product = node_labels.get(K8S_PRODUCT_LABEL)
    if product:
        acc = accelerator_type(product.replace("-", " "))
        if acc:
            labels[ACCELERATOR_LABEL] = acc
    clique = node_labels.get(K8S_CLIQUE_LABEL)
    if not clique:
        return NodeLabels(labels, (f"node has no {K8S_CLIQUE_LABEL} label (GPU feature discovery "
                                   "not running, or no multi-node NVLink fabric)",))
    return NodeLabels({DOMAIN_LABEL: clique, **labels})
