"""Judgement over topology facts: can a TP-N group be placed inside one healthy NVLink domain?

A GPU is usable when its fabric registration is COMPLETED with status SUCCESS and a non-zero cluster
UUID, fabric health is HEALTHY, switch multicast is supported and every NVLink it has is up. A group
needs N usable GPUs with one domain id `<cluster_uuid>.<clique_id>`; a group spanning trays also
needs fabric memory handles (IMEX) on each GPU. Pure functions over `NodeFacts`: no NVML here.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from raydecode.cluster.topology import ZERO_UUID, FactsError, GpuFacts, NodeFacts

_STATE_REASON = {
    "NOT_SUPPORTED": "no multi-node NVLink fabric (fabric state NOT_SUPPORTED)",
    "NOT_STARTED": "fabric registration NOT_STARTED (fabric manager / NVLink switch tray not up?)",
    "IN_PROGRESS": "fabric registration still IN_PROGRESS (retry once the fabric settles)",
}


@dataclass(frozen=True)
class GpuRef:
    node: str
    index: int
    uuid: str

    def __str__(self) -> str:
        return f"{self.node}/gpu{self.index}"


@dataclass(frozen=True)
class GpuFailure:
    gpu: GpuRef
    reasons: tuple[str, ...]

    def __str__(self) -> str:
        more = f" (also: {'; '.join(self.reasons[1:])})" if len(self.reasons) > 1 else ""
        return f"{self.gpu}: {self.reasons[0]}{more}"


@dataclass(frozen=True)
class Verdict:
    ok: bool
    tp: int
    domain: str | None                 # chosen (ok) or closest (not ok) domain id
    chosen: tuple[GpuRef, ...]         # node-major, len == tp when ok, else ()
    failures: tuple[GpuFailure, ...]   # GPUs not usable for this group, one entry each
    summary: str

    def to_dict(self) -> dict:
        return {"ok": self.ok, "tp": self.tp, "domain": self.domain, "summary": self.summary,
                "chosen": [{"node": g.node, "index": g.index, "uuid": g.uuid}
                           for g in self.chosen],
                "failures": [{"node": f.gpu.node, "index": f.gpu.index, "uuid": f.gpu.uuid,
                              "reasons": list(f.reasons)} for f in self.failures]}


def gpu_problems(g: GpuFacts, allow_unknown_health: bool = False) -> list[str]:
    """Why this GPU cannot be in any production TP group, most fundamental first ([] = usable).
    Fabric-handle support is judged separately: only groups spanning nodes need it."""
    out = []
    f = g.fabric
    if f.state != "COMPLETED":
        out.append(_STATE_REASON.get(f.state, f"fabric state {f.state} (needs COMPLETED)"))
    elif f.status != "SUCCESS":
        out.append(f"fabric registration failed with status {f.status}")
    elif f.cluster_uuid == ZERO_UUID:
        out.append("fabric COMPLETED but cluster UUID is all zero: NVLink-capable, not in a "
                   "multi-node NVLink domain")
    if f.health != "HEALTHY" and f.state != "NOT_SUPPORTED" and not (
            allow_unknown_health and f.health == "UNKNOWN"):
        out.append(f"fabric health {f.health} (needs HEALTHY)")
    if not g.multicast_supported:
        out.append("NVLink multicast not supported (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 0)")
    if g.nvlinks_total == 0:
        out.append("no NVLinks reported by NVML")
    elif g.nvlinks_up < g.nvlinks_total:
        down = g.nvlinks_total - g.nvlinks_up
        out.append(f"{down} of {g.nvlinks_total} NVLinks down")
    return out


_NO_FABRIC_HANDLE = ("no fabric memory handles (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED "
                     "= 0; IMEX channel missing?), needed for a group spanning nodes")


def node_problems(node: NodeFacts) -> list[str]:
    """Node-level disagreement: the GPUs of one tray report several NVLink domains."""
    domains = sorted({g.fabric.domain for g in node.gpus if g.fabric.attached})
    if len(domains) > 1:
        return [f"GPUs of node {node.node} report {len(domains)} NVLink domains: "
                + ", ".join(domains)]
    return []


def k8s_label_problem(node: NodeFacts, g: GpuFacts) -> str | None:
    """A Kubernetes clique label that is not the domain NVML reports for this GPU (stale label
    or a misconfigured partition: pod affinity would then group the wrong trays)."""
    if node.k8s_clique is not None and g.fabric.attached and g.fabric.domain != node.k8s_clique:
        return (f"Kubernetes label nvidia.com/gpu.clique={node.k8s_clique} disagrees with this "
                f"GPU's NVML domain {g.fabric.domain}")
    return None


def _check_unique(nodes: Sequence[NodeFacts]) -> None:
    names = [n.node for n in nodes]
    dup = sorted({x for x in names if names.count(x) > 1})
    if dup:
        raise FactsError(f"facts list node(s) {dup} more than once; pass each node's facts once")


def _pick(usable: list[tuple[NodeFacts, GpuFacts]], tp: int) -> list[tuple[NodeFacts, GpuFacts]]:
    """Node-major choice: fullest nodes first (fewest nodes), GPUs by index inside a node."""
    per_node: dict[str, list] = defaultdict(list)
    for n, g in usable:
        per_node[n.node].append((n, g))
    order = sorted(per_node, key=lambda k: (-len(per_node[k]), k))
    flat = [x for k in order for x in sorted(per_node[k], key=lambda p: p[1].index)]
    return flat[:tp]


def verify_domain(nodes: Sequence[NodeFacts], tp: int,
                  allow_unknown_health: bool = False) -> Verdict:
    """Choose `tp` usable GPUs inside one NVLink domain, or say per GPU why not."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"--tp must be a positive integer, got {tp!r}")
    _check_unique(nodes)
    all_gpus = [(n, g) for n in nodes for g in n.gpus]
    if not all_gpus:
        return Verdict(False, tp, None, (), (), "no GPUs in the given facts")
    ref = {id(g): GpuRef(n.node, g.index, g.uuid) for n, g in all_gpus}
    intrinsic = {id(g): gpu_problems(g, allow_unknown_health) for _, g in all_gpus}
    label = {id(g): k8s_label_problem(n, g) for n, g in all_gpus}
    by_domain: dict[str, list] = defaultdict(list)
    for n, g in all_gpus:
        if not intrinsic[id(g)] and not label[id(g)]:
            by_domain[g.fabric.domain].append((n, g))

    # a group on one node needs no fabric handles; across nodes every GPU needs them
    def usable_in(dom: str) -> tuple[list, dict[int, str]]:
        cands = by_domain.get(dom, [])
        if any(sum(1 for m, _ in cands if m.node == n.node) >= tp for n, _ in cands):
            return cands, {}
        extra = {id(g): _NO_FABRIC_HANDLE for _, g in cands if not g.fabric_handle_supported}
        return [(n, g) for n, g in cands if id(g) not in extra], extra

    scored = sorted(by_domain, key=lambda d: (-len(usable_in(d)[0]), d))
    target = scored[0] if scored else _majority_domain(all_gpus)
    usable, extra = usable_in(target) if target else ([], {})
    ok = len(usable) >= tp
    failures = []
    for n, g in all_gpus:
        reasons = list(intrinsic[id(g)])
        if not reasons and id(g) in extra:
            reasons = [extra[id(g)]]
        if not reasons and target is not None and g.fabric.domain != target:
            reasons = [_other_domain_reason(g.fabric.domain, target)]
        if label[id(g)]:
            reasons.append(label[id(g)])
        if reasons:
            failures.append(GpuFailure(ref[id(g)], tuple(reasons)))
    if ok:
        chosen = tuple(ref[id(g)] for _, g in _pick(usable, tp))
        nodes_used = sorted({c.node for c in chosen})
        summary = (f"TP-{tp} fits in NVLink domain {target}: {len(nodes_used)} node(s) "
                   f"{', '.join(nodes_used)}; {len(usable)} usable GPU(s) in that domain")
        if failures:
            summary += f"; {len(failures)} GPU(s) excluded"
        return Verdict(True, tp, target, chosen, tuple(failures), summary)
    summary = (f"TP-{tp} does not fit in one NVLink domain: best domain {target} has "
               f"{len(usable)} usable GPU(s), needs {tp}" if target else
               f"TP-{tp} does not fit: no GPU is in a healthy multi-node NVLink domain (a host "
               "without one can only run the single-node development profile)")
    return Verdict(False, tp, target, (), tuple(failures), summary)


def _majority_domain(all_gpus) -> str | None:
    counts: dict[str, int] = defaultdict(int)
    for _, g in all_gpus:
        if g.fabric.attached:
            counts[g.fabric.domain] += 1
    return min(counts, key=lambda d: (-counts[d], d)) if counts else None


def _other_domain_reason(dom: str, target: str) -> str:
    (cu, cl), (tu, tl) = dom.rsplit(".", 1), target.rsplit(".", 1)
    what = f"another clique ({cl}, group's clique is {tl})" if cu == tu else \
        f"another NVLink cluster (cluster UUID {cu}, group's is {tu})"
    return f"in {what}: domain {dom}, not the group's domain {target}"
