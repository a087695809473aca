"""Rank layout (pure) and the user-facing PlacementOptions."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from raydecode.cluster.layout import rank_layout, uniform_layout
from raydecode.cluster.placement import PlacementOptions
from raydecode.models.parallel import Parallel


@pytest.mark.parametrize("tp, dcp, per_node", [(8, 1, 4), (16, 1, 4), (16, 4, 4), (16, 2, 4),
                                               (16, 8, 4), (8, 2, 8), (6, 3, 4)])
def test_layout_is_node_major_and_dcp_matches_the_model(tp, dcp, per_node):
    lay = uniform_layout(tp, dcp, per_node)
    assert [s.rank for s in lay.slots] == list(range(tp))
    nodes = [s.node_slot for s in lay.slots]
    assert nodes == sorted(nodes)                          # node-major
    assert sum(lay.ranks_per_node) == tp and lay.num_nodes == -(-tp // per_node)
    for s in lay.slots:                                    # same DCP convention as the model
        par = Parallel(tp_rank=s.rank, tp_size=tp, dcp_size=dcp)
        assert s.dcp_rank == par.dcp_rank
        assert lay.dcp_groups[s.dcp_group] == par.dcp_group_ranks
    local = all(k % dcp == 0 for k in lay.ranks_per_node)
    assert lay.dcp_groups_node_local == local


def test_tp16_dcp4_on_gb300_trays():
    lay = uniform_layout(16, 4, 4)
    assert lay.ranks_per_node == (4, 4, 4, 4)
    assert [lay.ranks_on(i) for i in range(4)] == list(lay.dcp_groups)
    assert lay.describe() == ("TP 16, DCP 4 (4 groups, node-local) over 4 node(s): node0: ranks "
                              "0-3; node1: ranks 4-7; node2: ranks 8-11; node3: ranks 12-15")
    assert not uniform_layout(16, 8, 4).dcp_groups_node_local


@pytest.mark.parametrize("args, match", [
    ((8, 3, [8]), "must divide"), ((0, 1, []), "positive"), ((8, 1, [4, 3]), "sum to TP=8"),
    ((8, 1, [8, 0]), "positive")])
def test_bad_layouts_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        rank_layout(*args)


def test_placement_options_reject_unknown_keys_and_document_fields():
    assert PlacementOptions(profile="development").profile == "development"
    with pytest.raises(ValidationError, match="accelerator"):
        PlacementOptions(accelerator="GB300")
    with pytest.raises(ValidationError, match="profile"):
        PlacementOptions(profile="prod")
    with pytest.raises(ValidationError, match="timeout_s"):
        PlacementOptions(timeout_s=0)
    for name, f in PlacementOptions.model_fields.items():
        assert f.description, name


def test_domain_precheck_picks_best_fit_and_never_sums_across_domains():
    from raydecode.cluster.placement import NodeInventory, PlacementError, _precheck_domains

    def node(i, dom, free, acc="GB300"):
        labels = {"ray.io/accelerator-type": acc, **({"ray.io/gpu-domain": dom} if dom else {})}
        return NodeInventory(f"n{i}", labels, 4.0, float(free), 1.0)
    inv = [node(0, "A", 4), node(1, "A", 4), node(2, "A", 4), node(3, "A", 4),   # 16 free
           node(4, "B", 4), node(5, "B", 4), node(6, "B", 2),                     # 10 free
           node(7, None, 4), node(8, "C", 4, acc="H200")]
    opts = PlacementOptions(accelerator_type="GB300")
    assert _precheck_domains(8, opts, inv) == "B"         # best fit keeps A whole for TP16
    assert _precheck_domains(16, opts, inv) == "A"
    with pytest.raises(PlacementError, match="A: 16 free GPU.*B: 10 free GPU.*26 free in total"):
        _precheck_domains(17, opts, inv)
    with pytest.raises(PlacementError, match="no alive Ray node carries"):
        _precheck_domains(4, PlacementOptions(accelerator_type="B300"), inv)
    assert _precheck_domains(4, PlacementOptions(), inv) == "C"   # any accelerator: 4 fit in C
