"""Placement on a real multi-node Ray cluster on one machine: fake GPUs, NVLink-domain labels.

Cluster (one per module, 7 nodes): domain A = 4 nodes × 4 GPUs (16), domain B = 2 nodes × 4 GPUs
(8), and a head with 2 GPUs and no domain label (an "HGX" host for the development profile). Each
node has 1 CPU for a coordinator bundle.
"""
from __future__ import annotations

import math
import time

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import placement_group_table  # noqa: E402

from raydecode.cluster.placement import (PlacementError, PlacementOptions,  # noqa: E402
                                         live_inventory, plan_replica_placement)

DOM_A = "0a0a0a0a-0000-4000-8000-00000000000a.1"
DOM_B = "0b0b0b0b-0000-4000-8000-00000000000b.7"
OBJ = 80 * 1024 * 1024


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=1, num_gpus=2, include_dashboard=False, object_store_memory=OBJ,
        labels={"ray.io/accelerator-type": "H200"}))
    for dom, n in ((DOM_A, 4), (DOM_B, 2)):
        for _ in range(n):
            c.add_node(wait=False, num_cpus=1, num_gpus=4, object_store_memory=OBJ, labels={
                "ray.io/gpu-domain": dom, "ray.io/accelerator-type": "GB300"})
    c.wait_for_nodes()   # the six workers start in parallel
    c.connect()
    yield c
    ray.shutdown()
    c.shutdown()


def _wait_all_free(timeout=20.0):
    """Placement-group removal is asynchronous: wait until every fake GPU is free again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        inv = live_inventory()
        if sum(math.floor(n.free_gpus) for n in inv) == 26:
            return
        time.sleep(0.1)
    raise AssertionError("GPUs not released after placement-group removal")


@pytest.fixture
def fresh(cluster):
    _wait_all_free()
    made = []
    yield made
    for p in made:
        p.remove()


def _node_labels():
    return {n["NodeID"]: n["Labels"] for n in ray.nodes() if n["Alive"]}


@ray.remote(num_cpus=0, num_gpus=1)
class Rank:
    def where(self):
        return ray.get_runtime_context().get_node_id(), tuple(ray.get_gpu_ids())


def test_tp16_lands_in_one_domain_across_four_nodes(fresh):
    opts = PlacementOptions(accelerator_type="GB300")
    p = plan_replica_placement(16, 1, options=opts)
    fresh.append(p)
    labels = _node_labels()
    assert p.domain == DOM_A      # B has 8 GPUs: only A can hold 16
    assert {labels[n]["ray.io/gpu-domain"] for n in p.rank_nodes} == {DOM_A}
    assert len(set(p.rank_nodes)) == 4 and p.layout.ranks_per_node == (4, 4, 4, 4)
    node_of = placement_group_table(p.placement_group)["bundles_to_node_id"]
    assert labels[node_of[p.coordinator_bundle]]["ray.io/gpu-domain"] == DOM_A

    actors = [Rank.options(scheduling_strategy=p.rank_strategy(r)).remote() for r in range(16)]
    seen = ray.get([a.where.remote() for a in actors], timeout=60)
    for a in actors:
        ray.kill(a)
    assert [node for node, _ in seen] == list(p.rank_nodes)   # each rank on its planned node
    assert all(len(ids) == 1 for _, ids in seen)
    pairs = {(node, ids[0]) for node, ids in seen}
    assert len(pairs) == 16                                   # distinct GPUs
    for node in set(p.rank_nodes):                            # 4 distinct GPU ids per node
        assert sorted(str(i) for n, ids in seen if n == node for i in ids) == ["0", "1", "2", "3"]
    # node-major: ranks on one node are consecutive
    firsts = [p.rank_nodes.index(n) for n in dict.fromkeys(p.rank_nodes)]
    assert firsts == [0, 4, 8, 12]


def test_tp8_and_tp16_dcp_layouts(fresh):
    p8 = plan_replica_placement(8, 1, options=PlacementOptions(accelerator_type="GB300"))
    fresh.append(p8)
    assert p8.layout.ranks_per_node == (4, 4)
    assert p8.rank_nodes[:4] == (p8.rank_nodes[0],) * 4 and p8.rank_nodes[4] != p8.rank_nodes[0]
    assert len(set(p8.rank_nodes)) == 2 and p8.domain in (DOM_A, DOM_B)
    assert sorted(p8.rank_bundles) == list(range(8)) and p8.coordinator_bundle == 8
    p8.remove()
    fresh.remove(p8)
    _wait_all_free()

    p = plan_replica_placement(16, 4, options=PlacementOptions(accelerator_type="GB300"))
    fresh.append(p)
    assert p.layout.dcp_groups == tuple(tuple(range(g * 4, g * 4 + 4)) for g in range(4))
    assert p.layout.dcp_groups_node_local
    for grp in p.layout.dcp_groups:   # each DCP group's ranks on one node, one group per node
        assert len({p.rank_nodes[r] for r in grp}) == 1
    assert len({p.rank_nodes[grp[0]] for grp in p.layout.dcp_groups}) == 4
    assert [s.dcp_rank for s in p.layout.slots] == [r % 4 for r in range(16)]
    assert "DCP 4" in p.description and DOM_A in p.description


def test_tp16_without_a_domain_of_16_free_fails_fast_and_clearly(fresh):
    small = plan_replica_placement(4, 1, options=PlacementOptions(domain=DOM_A))
    fresh.append(small)
    free = {d: sum(math.floor(n.free_gpus) for n in live_inventory()
                   if n.labels.get("ray.io/gpu-domain") == d) for d in (DOM_A, DOM_B)}
    assert free == {DOM_A: 12, DOM_B: 8}   # 20 free GPUs in total, but no domain has 16
    t0 = time.monotonic()
    with pytest.raises(PlacementError) as e:
        plan_replica_placement(16, 1, options=PlacementOptions(accelerator_type="GB300"))
    assert time.monotonic() - t0 < 30
    msg = str(e.value)
    assert "ONE NVLink domain" in msg and "never spans" in msg
    assert f"{DOM_A}: 12 free GPU(s)" in msg and f"{DOM_B}: 8 free GPU(s)" in msg


def test_pinned_domain_uses_label_selector_and_stays_inside(fresh):
    p = plan_replica_placement(8, 2, options=PlacementOptions(
        domain=DOM_B, accelerator_type="GB300", rank_cpus=0.25, coordinator_cpus=0))
    fresh.append(p)
    labels = _node_labels()
    assert p.domain == DOM_B and p.coordinator_bundle is None
    table = placement_group_table(p.placement_group)
    assert list(table["bundles"].values()) == [{"GPU": 1.0, "CPU": 0.25}] * 8
    assert {labels[n]["ray.io/gpu-domain"] for n in p.rank_nodes} == {DOM_B}
    with pytest.raises(PlacementError, match=f"{DOM_B}: 0 free GPU"):
        plan_replica_placement(16, 1, options=PlacementOptions(domain=DOM_B))


def test_unknown_accelerator_and_bad_sizes_are_clear(fresh):
    with pytest.raises(PlacementError, match="accelerator-type=B300"):
        plan_replica_placement(8, 1, options=PlacementOptions(accelerator_type="B300"))
    with pytest.raises(ValueError, match="must divide"):
        plan_replica_placement(8, 3)


def test_development_profile_is_single_node_and_says_so(fresh):
    p = plan_replica_placement(2, 1, profile="development",
                               options=PlacementOptions(accelerator_type="H200"))
    fresh.append(p)
    assert p.profile == "development" and p.domain is None
    assert len(set(p.rank_nodes)) == 1
    assert _node_labels()[p.rank_nodes[0]]["ray.io/accelerator-type"] == "H200"
    assert "NOT verified" in p.description
    with pytest.raises(PlacementError, match="one node with 8 free GPUs"):
        plan_replica_placement(8, 1, profile="development", timeout_s=5)
