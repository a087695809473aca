"""Placement of one replica on Ray: a placement group with one {"GPU": 1} bundle per TP rank plus a
coordinator bundle, wholly inside one NVLink domain, and the node-major rank → bundle map.

Production profile: every bundle carries the accelerator label selector, and the group uses Ray's
topology strategy {"ray.io/gpu-domain": "STRICT_PACK"} (Ray >= 2.56), so Ray packs all bundles
into nodes that share one `ray.io/gpu-domain` label (written by `raydecode node-labels` at
`ray start`). Before asking Ray, the live node labels and free GPUs are read; when no single domain
has enough free GPUs the call fails at once with the per-domain counts — it never spans domains.
On a Ray without `topology_strategy` the same guarantee comes from a per-bundle label selector on
the best-fitting domain, chosen here from the live labels. After placement the bundles' nodes are
checked to share one domain label, whatever Ray did.

Development profile: nodes without an NVLink fabric (e.g. one HGX H200). The group is STRICT_PACK
on one node, nothing about NVLink domains is verified, and every description says so.

Rank bundles hold {"GPU": 1} (plus `rank_cpus` CPUs if set): rank actors ask for num_gpus=1 and
num_cpus <= rank_cpus, and must be scheduled with `rank_strategy(rank)` — bundle index != rank in
general, because ranks are renumbered node-major after Ray places the bundles.
"""
from __future__ import annotations

import inspect
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from raydecode.cluster.labels import ACCELERATOR_LABEL, DOMAIN_LABEL
from raydecode.cluster.layout import RankLayout, rank_layout, validate_parallel

NODE_ID_LABEL = "ray.io/node-id"


class PlacementError(RuntimeError):
    """The replica cannot be placed as asked; the message has the per-domain / per-node counts."""


class PlacementOptions(BaseModel):
    """Where a replica's ranks may run (the `placement` block of the deployment config)."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    profile: Literal["production", "development"] = Field(
        "production", description="production: all ranks in one verified NVLink domain (nodes "
        "labelled by `raydecode node-labels`). development: one node, no NVLink-domain check "
        "(hosts without a multi-node fabric); reports say so.")
    accelerator_type: str | None = Field(
        None, description="Required `ray.io/accelerator-type` label of every bundle's node, e.g. "
        "GB300 or H200; None accepts any.")
    domain: str | None = Field(
        None, description="Pin the replica to this `ray.io/gpu-domain` value "
        "(<cluster_uuid>.<clique_id>); None lets the scheduler pick a domain that fits.")
    domain_label: str = Field(
        DOMAIN_LABEL, description="Ray node label that names a node's NVLink domain.")
    rank_cpus: float = Field(
        0.0, ge=0.0, description="CPUs added to each rank's {\"GPU\": 1} bundle; rank actors "
        "must ask for no more CPUs than this (0: rank actors use num_cpus=0).")
    coordinator_cpus: float = Field(
        1.0, ge=0.0, description="CPUs of the coordinator bundle, placed in the same domain; 0 "
        "leaves the coordinator out of the placement group.")
    timeout_s: float = Field(
        30.0, gt=0.0, description="Seconds to wait for Ray to place the group before failing.")


@dataclass(frozen=True)
class NodeInventory:
    node_id: str
    labels: dict[str, str]
    total_gpus: float
    free_gpus: float
    free_cpus: float


@dataclass(frozen=True)
class ReplicaPlacement:
    placement_group: Any               # ray.util.placement_group.PlacementGroup
    rank_bundles: tuple[int, ...]      # rank r runs in bundle rank_bundles[r]
    rank_nodes: tuple[str, ...]        # Ray node id of rank r
    coordinator_bundle: int | None
    layout: RankLayout
    domain: str | None                 # None in the development profile
    profile: str
    description: str

    def rank_strategy(self, rank: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        return PlacementGroupSchedulingStrategy(
            self.placement_group, placement_group_bundle_index=self.rank_bundles[rank])

    def coordinator_strategy(self):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        if self.coordinator_bundle is None:
            raise PlacementError("this placement has no coordinator bundle (coordinator_cpus=0)")
        return PlacementGroupSchedulingStrategy(
            self.placement_group, placement_group_bundle_index=self.coordinator_bundle)

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group
        remove_placement_group(self.placement_group)


def live_inventory() -> list[NodeInventory]:
    """Alive Ray nodes with their labels and free GPUs/CPUs now (the driver must be connected)."""
    import ray
    from ray._private.state import available_resources_per_node  # no public per-node view
    free = available_resources_per_node()
    out = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        avail = free.get(n["NodeID"], {})
        out.append(NodeInventory(n["NodeID"], dict(n.get("Labels") or {}),
                                 float(n["Resources"].get("GPU", 0.0)),
                                 float(avail.get("GPU", 0.0)), float(avail.get("CPU", 0.0))))
    return out


def plan_replica_placement(tp: int, dcp: int = 1, profile: str | None = None,
                           timeout_s: float | None = None, *,
                           options: PlacementOptions | None = None) -> ReplicaPlacement:
    """Reserve GPUs for one replica and lay its ranks out node-major. `profile` / `timeout_s`
    override the same fields of `options`. Raises PlacementError (fast, with counts) when it
    cannot be placed, ValueError for bad sizes."""
    validate_parallel(tp, dcp)
    opts = options or PlacementOptions()
    update = {k: v for k, v in (("profile", profile), ("timeout_s", timeout_s)) if v is not None}
    if update:
        opts = PlacementOptions(**{**opts.model_dump(), **update})
    deadline = time.monotonic() + opts.timeout_s
    inventory = live_inventory()
    if opts.profile == "development":
        return _place(tp, dcp, opts, deadline, inventory, _precheck_dev(tp, opts, inventory))
    return _place(tp, dcp, opts, deadline, inventory, _precheck_domains(tp, opts, inventory))


def _matches(n: NodeInventory, opts: PlacementOptions) -> bool:
    return opts.accelerator_type is None or n.labels.get(ACCELERATOR_LABEL) == opts.accelerator_type


def domain_free_gpus(inventory: list[NodeInventory], opts: PlacementOptions) -> dict[str, list]:
    """domain -> its matching nodes."""
    doms: dict[str, list] = defaultdict(list)
    for n in inventory:
        d = n.labels.get(opts.domain_label)
        if d and _matches(n, opts) and (opts.domain is None or d == opts.domain):
            doms[d].append(n)
    return doms


def _fits(nodes: list[NodeInventory], tp: int, cpus: float) -> bool:
    gpus = sum(math.floor(n.free_gpus) for n in nodes)
    return gpus >= tp and (cpus == 0 or any(n.free_cpus >= cpus for n in nodes))


def _precheck_domains(tp: int, opts: PlacementOptions, inventory: list[NodeInventory]) -> str:
    """The domain to pin when Ray lacks topology_strategy (best fit); raises when none fits."""
    doms = domain_free_gpus(inventory, opts)
    want = f" with {ACCELERATOR_LABEL}={opts.accelerator_type}" if opts.accelerator_type else ""
    if not doms:
        pinned = f" {opts.domain_label}={opts.domain}" if opts.domain else ""
        raise PlacementError(
            f"no alive Ray node carries the label {opts.domain_label}{pinned}{want}: start GPU "
            "workers with `ray start --labels=$(raydecode node-labels)` (see docs/DEPLOY.md), or "
            "use the development profile on a host without a multi-node NVLink fabric")
    fitting = [d for d, ns in doms.items() if _fits(ns, tp, opts.coordinator_cpus)]
    if not fitting:
        raise PlacementError(
            f"TP-{tp} needs {tp} free GPUs in ONE NVLink domain{want}"
            + (f" plus {opts.coordinator_cpus:g} CPU for the coordinator" if
               opts.coordinator_cpus else "")
            + f"; none has them ({_domain_table(doms)}; "
            f"{sum(math.floor(n.free_gpus) for ns in doms.values() for n in ns)} free in total). "
            "raydecode never spans NVLink domains: free GPUs in one domain, add capacity, or use "
            "a smaller tensor_parallel_size")
    return min(fitting, key=lambda d: (sum(n.free_gpus for n in doms[d]), d))


def _domain_table(doms: dict[str, list]) -> str:
    return "; ".join(f"{d}: {sum(math.floor(n.free_gpus) for n in ns)} free GPU(s) on "
                     f"{len(ns)} node(s)" for d, ns in sorted(doms.items()))


def _precheck_dev(tp: int, opts: PlacementOptions, inventory: list[NodeInventory]) -> None:
    nodes = [n for n in inventory if _matches(n, opts)]
    if not any(math.floor(n.free_gpus) >= tp and n.free_cpus >= opts.coordinator_cpus
               for n in nodes):
        best = max((math.floor(n.free_gpus) for n in nodes), default=0)
        raise PlacementError(
            f"development profile: TP-{tp} needs one node with {tp} free GPUs"
            + (f" and {opts.coordinator_cpus:g} free CPU" if opts.coordinator_cpus else "")
            + f"; the most free GPUs on one matching node is {best}")
    return None


def _place(tp: int, dcp: int, opts: PlacementOptions, deadline: float,
           inventory: list[NodeInventory], pin: str | None) -> ReplicaPlacement:
    from ray.util.placement_group import (placement_group, placement_group_table,
                                          remove_placement_group)

    rank_bundle = {"GPU": 1.0, **({"CPU": opts.rank_cpus} if opts.rank_cpus else {})}
    bundles: list[dict[str, float]] = [dict(rank_bundle) for _ in range(tp)]
    if opts.coordinator_cpus:
        bundles.append({"CPU": opts.coordinator_cpus})
    selector: dict[str, str] = {}
    if opts.accelerator_type:
        selector[ACCELERATOR_LABEL] = opts.accelerator_type
    kwargs: dict[str, Any] = {}
    production = opts.profile == "production"
    if not production:
        kwargs["strategy"] = "STRICT_PACK"
    elif opts.domain is None and _has_topology_strategy():
        kwargs["topology_strategy"] = {opts.domain_label: "STRICT_PACK", NODE_ID_LABEL: "PACK"}
    else:   # pinned by the user, or by us on a Ray without topology_strategy
        selector[opts.domain_label] = opts.domain or pin
        kwargs["strategy"] = "PACK"
    if selector:
        kwargs["bundle_label_selector"] = [dict(selector) for _ in bundles]
    pg = placement_group(bundles, **kwargs)
    if not pg.wait(max(0.1, deadline - time.monotonic())):
        remove_placement_group(pg)
        where = _domain_table(domain_free_gpus(live_inventory(), opts)) if production else \
            "development profile, one node"
        raise PlacementError(f"Ray did not place TP-{tp} within {opts.timeout_s:g} s ({where}); "
                             "other pending placement groups may hold the GPUs")
    node_of = placement_group_table(pg)["bundles_to_node_id"]
    labels = {n.node_id: n.labels for n in inventory}
    domains = {labels.get(node_of[b], {}).get(opts.domain_label) for b in range(len(bundles))}
    if production and (len(domains) != 1 or None in domains):
        remove_placement_group(pg)
        raise PlacementError(f"Ray placed TP-{tp} across NVLink domains {sorted(map(str, domains))}"
                             "; removed it — refusing to span domains")
    rank_bundles, per_node, nodes = _node_major(node_of, tp)
    layout = rank_layout(tp, dcp, per_node)
    domain = next(iter(domains)) if production else None
    where = f"NVLink domain {domain}" if production else \
        "development profile: one node, NVLink domain NOT verified (not a production placement)"
    desc = f"{layout.describe()}; {where}; nodes " + ", ".join(n[:8] for n in nodes)
    return ReplicaPlacement(pg, rank_bundles, tuple(node_of[b] for b in rank_bundles),
                            tp if opts.coordinator_cpus else None, layout, domain,
                            opts.profile, desc)


def _node_major(node_of: dict[int, str], tp: int):
    """Rank bundles grouped by node (most ranks first, then first bundle index); ranks assigned
    in that order so ranks on one node are consecutive."""
    by_node: dict[str, list[int]] = defaultdict(list)
    for b in range(tp):
        by_node[node_of[b]].append(b)
    nodes = sorted(by_node, key=lambda n: (-len(by_node[n]), by_node[n][0]))
    rank_bundles = tuple(b for n in nodes for b in by_node[n])
    return rank_bundles, [len(by_node[n]) for n in nodes], nodes


def _has_topology_strategy() -> bool:
    from ray.util.placement_group import placement_group
    return "topology_strategy" in inspect.signature(placement_group).parameters
