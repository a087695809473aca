"""NVLink-domain verification over recorded facts, and the verify-domain / node-labels CLIs."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from raydecode.cli import main
from raydecode.cluster.topology import FactsError, NodeFacts
from raydecode.cluster.verify import verify_domain

DATA = Path(__file__).resolve().parents[1] / "data" / "cluster"
HEALTHY = [DATA / f"gb300-tray-{i:02d}.json" for i in range(1, 5)]


def load(*paths) -> list[NodeFacts]:
    return [NodeFacts.from_dict(json.loads(Path(p).read_text()), where=str(p)) for p in paths]


def test_healthy_rack_slice_fits_tp4_tp8_tp16_node_major():
    nodes = load(*HEALTHY)
    for tp, n_nodes in ((4, 1), (8, 2), (16, 4)):
        v = verify_domain(nodes, tp)
        assert v.ok and len(v.chosen) == tp and not v.failures, v.summary
        assert v.domain == nodes[0].gpus[0].fabric.domain
        used = list(dict.fromkeys(g.node for g in v.chosen))
        assert len(used) == n_nodes
        assert [g.node for g in v.chosen] == [n for n in used for _ in range(4)]   # node-major
        assert [g.index for g in v.chosen] == [0, 1, 2, 3] * n_nodes
    assert not verify_domain(nodes, 17).ok


DEGRADED = {   # fixture -> (failing GPU, the message that GPU gets)
    "gb300-tray-other-clique": (3, "in another clique (32767, group's clique is 32766)"),
    "gb300-tray-fabric-not-started": (1, "fabric registration NOT_STARTED"),
    "gb300-tray-unhealthy": (2, "fabric health UNHEALTHY (needs HEALTHY)"),
    "gb300-tray-no-multicast": (0, "NVLink multicast not supported"),
    "gb300-tray-link-down": (3, "1 of 18 NVLinks down"),
}


@pytest.mark.parametrize("stem", sorted(DEGRADED))
def test_each_degradation_fails_with_its_own_message(stem):
    (node,) = load(DATA / f"{stem}.json")
    v = verify_domain([node], 4)
    assert not v.ok and v.chosen == ()
    assert "has 3 usable GPU(s), needs 4" in v.summary
    (f,) = v.failures                                   # exactly the one bad GPU
    gpu, msg = DEGRADED[stem]
    assert (f.gpu.node, f.gpu.index) == (node.node, gpu)
    assert f.reasons[0].startswith(msg) or msg in f.reasons[0]
    others = [m for s, (_, m) in DEGRADED.items() if s != stem]
    assert not any(m in f.reasons[0] for m in others)   # its own message, not another's
    assert verify_domain([node], 3).ok                   # the other three GPUs are fine


def test_bad_gpu_is_excluded_when_enough_others_remain():
    nodes = load(*HEALTHY, DATA / "gb300-tray-link-down.json")
    v = verify_domain(nodes, 16)
    assert v.ok and "tray09" not in {g.node for g in v.chosen}    # fullest trays first
    assert [str(f.gpu) for f in v.failures] == ["gb300-rack1-tray09/gpu3"]
    v = verify_domain(nodes, 20)
    assert not v.ok and "has 19 usable GPU(s), needs 20" in v.summary


def test_hgx_h200_without_multi_node_fabric_fails_every_gpu():
    v = verify_domain(load(DATA / "hgx-h200-8gpu.json"), 8)
    assert not v.ok and v.domain is None and len(v.failures) == 8
    assert all("cluster UUID is all zero" in f.reasons[0] for f in v.failures)


def _edited(path, fn) -> NodeFacts:
    d = json.loads(Path(path).read_text())
    fn(d)
    return NodeFacts.from_dict(d)


def test_fabric_handles_needed_only_across_nodes():
    def no_fh(d):
        d["gpus"][2]["fabric_handle_supported"] = False
    tray = _edited(HEALTHY[0], no_fh)
    assert verify_domain([tray], 4).ok                       # one node: POSIX handles suffice
    v = verify_domain([tray, *load(*HEALTHY[1:])], 16)
    assert not v.ok
    (f,) = v.failures
    assert f.gpu.index == 2 and "IMEX" in f.reasons[0]


def test_k8s_clique_label_must_match_nvml():
    def stale(d):
        d["k8s_clique"] = "5f3c2a9e-8d41-4b7a-9c1e-2a6b0d8f4e13.1"
    v = verify_domain([_edited(HEALTHY[0], stale)], 4)
    assert not v.ok and len(v.failures) == 4
    assert "disagrees with this GPU's NVML domain" in v.failures[0].reasons[0]


def test_unknown_health_is_refused_unless_allowed():
    def unknown(d):
        for g in d["gpus"]:
            g["fabric"]["health"] = "UNKNOWN"
    tray = _edited(HEALTHY[0], unknown)
    assert not verify_domain([tray], 4).ok
    assert verify_domain([tray], 4, allow_unknown_health=True).ok


def test_bad_inputs_are_clear():
    with pytest.raises(FactsError, match="more than once"):
        verify_domain(load(HEALTHY[0], HEALTHY[0]), 4)
    with pytest.raises(ValueError, match="positive integer"):
        verify_domain(load(HEALTHY[0]), 0)


def test_verify_domain_cli_exit_codes_and_json(capsys, tmp_path):
    facts = [str(p) for p in HEALTHY]
    assert main(["verify-domain", "--tp", "16", "--json", "--facts", *facts]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and len(out["chosen"]) == 16
    bad = str(DATA / "gb300-tray-unhealthy.json")
    assert main(["verify-domain", "--tp", "4", "--facts", bad]) == 1
    text = capsys.readouterr().out
    assert text.startswith("FAIL: ") and "gb300-rack1-tray07/gpu2: fabric health UNHEALTHY" in text
    broken = tmp_path / "broken.json"
    broken.write_text('{"node": "x"}')
    assert main(["verify-domain", "--tp", "4", "--facts", str(broken)]) == 2
    assert "missing field 'gpus'" in capsys.readouterr().err
    # the multicast probe is opt-in: a verification never loads it
    assert "raydecode.cluster.probe" not in sys.modules
