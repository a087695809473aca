"""Topology facts: JSON shape, recorded fixtures, accelerator names, live collection here."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from raydecode.cli import main
from raydecode.cluster import nvml_read
from raydecode.cluster.topology import (FactsError, NodeFacts, accelerator_type,
                                        format_cluster_uuid)

DATA = Path(__file__).resolve().parents[1] / "data" / "cluster"
FIXTURES = sorted(DATA.glob("*.json"))


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_fixtures_parse_and_round_trip(path):
    raw = json.loads(path.read_text())
    facts = NodeFacts.from_dict(raw, where=path.name)
    assert facts.node == raw["node"] and len(facts.gpus) == len(raw["gpus"])
    assert NodeFacts.from_dict(json.loads(json.dumps(facts.to_dict()))) == facts
    for g, r in zip(facts.gpus, raw["gpus"]):
        assert g.fabric.domain == f"{r['fabric']['cluster_uuid']}.{r['fabric']['clique_id']}"


def _tray():
    return json.loads((DATA / "gb300-tray-01.json").read_text())


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.pop("node"), "missing field 'node'"),
    (lambda d: d["gpus"][1]["fabric"].pop("clique_id"), r"gpus\[1\].fabric: missing field"),
    (lambda d: d["gpus"][0]["fabric"].update(state="DONE"), "state 'DONE' is not one of"),
    (lambda d: d["gpus"][0]["fabric"].update(health="OK"), "health 'OK' is not one of"),
    (lambda d: d["gpus"][2].update(nvlinks_up=19), r"nvlinks_up \(19\) <= nvlinks_total"),
    (lambda d: d["gpus"][0].update(index=True), "field 'index' must be int"),
    (lambda d: d["gpus"][0].update(multicast_supported="yes"), "multicast_supported' must be"),
    (lambda d: d["gpus"][3].update(index=0), "duplicate GPU indices"),
])
def test_malformed_facts_name_the_field(edit, match):
    d = _tray()
    edit(d)
    with pytest.raises(FactsError, match=match):
        NodeFacts.from_dict(d, where="tray.json")


def test_accelerator_type_agrees_with_rays_own_label():
    from ray._private.accelerators.nvidia_gpu import NvidiaGPUAcceleratorManager as M

    names = ["NVIDIA GB300", "NVIDIA GB200", "NVIDIA H200", "NVIDIA H100 80GB HBM3",
             "NVIDIA H200 NVL", "NVIDIA B200", "Tesla V100-SXM2-16GB", "NVIDIA A100-SXM4-80GB",
             "NVIDIA RTX PRO 6000 Blackwell Server Edition", "NVIDIA GeForce RTX 5090",
             "NVIDIA L4", "NVIDIA A10G"]
    ours = [accelerator_type(n) for n in names]
    assert ours == [M._gpu_name_to_accelerator_type(n) for n in names]
    assert ours[:3] == ["GB300", "GB200", "H200"]


def test_cluster_uuid_and_nvml_helpers():
    import pynvml

    raw = bytes(range(16))
    assert format_cluster_uuid(raw) == "00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert nvml_read.nvml_return_name(pynvml, 0) == "SUCCESS"
    assert nvml_read.nvml_return_name(pynvml, pynvml.NVML_ERROR_NOT_READY) == "NVML_ERROR_NOT_READY"

    def mask(route=0, config=0, degraded=0):
        return (route << pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_UNHEALTHY
                | config << pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_INCORRECT_CONFIGURATION
                | degraded << pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW)
    h = nvml_read._health_from_mask
    assert h(pynvml, mask()) == "UNKNOWN"
    assert h(pynvml, mask(route=2, config=1, degraded=2)) == "HEALTHY"
    assert h(pynvml, mask(route=1, config=1, degraded=2)) == "UNHEALTHY"
    assert h(pynvml, mask(route=2, config=5, degraded=2)) == "UNHEALTHY"   # insufficient NVLinks
    assert h(pynvml, mask(route=2, config=1, degraded=1)) == "LIMITED_CAPACITY"


def test_live_topology_cli_degrades_cleanly(capsys):
    rc = main(["topology", "--json", "--no-k8s"])
    out = capsys.readouterr().out
    assert rc == 0
    facts = NodeFacts.from_dict(json.loads(out))
    if not facts.gpus:     # CI and this machine: no NVIDIA driver
        assert any("NVML" in n or "pynvml" in n for n in facts.notes)
    assert main(["topology", "--no-k8s"]) == 0
    assert f"node {facts.node}" in capsys.readouterr().out


def test_recorded_h200_vm_has_no_fabric():
    """Recorded with `raydecode topology --json` on a one-GPU H200 VM (see README.md here)."""
    facts = NodeFacts.from_dict(json.loads((DATA / "h200-1gpu-vm-recorded.json").read_text()))
    (g,) = facts.gpus
    assert g.name == "NVIDIA H200" and g.fabric.state == "NOT_SUPPORTED"
    assert not g.fabric.attached and g.nvlinks_total == 0
