"""Ray node labels from facts and from Kubernetes node labels, checked with Ray's own parsers."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from ray._private.label_utils import (parse_node_labels_from_yaml_file,
                                      parse_node_labels_string, validate_node_label_syntax)

from raydecode.cli import main
from raydecode.cluster.labels import labels_from_facts, labels_from_k8s
from raydecode.cluster.topology import NodeFacts

DATA = Path(__file__).resolve().parents[1] / "data" / "cluster"
DOMAIN = "5f3c2a9e-8d41-4b7a-9c1e-2a6b0d8f4e13.32766"


def facts(stem: str) -> NodeFacts:
    return NodeFacts.from_dict(json.loads((DATA / f"{stem}.json").read_text()))


def test_healthy_tray_labels_parse_with_rays_parsers(tmp_path):
    nl = labels_from_facts(facts("gb300-tray-01"))
    want = {"ray.io/gpu-domain": DOMAIN, "ray.io/accelerator-type": "GB300"}
    assert nl.labels == want and nl.withheld == ()
    assert parse_node_labels_string(nl.ray_start_arg()) == want
    validate_node_label_syntax(want)                       # k8s label syntax, <= 63 chars
    f = tmp_path / "labels.yaml"
    f.write_text(nl.yaml())
    assert parse_node_labels_from_yaml_file(str(f)) == want


@pytest.mark.parametrize("stem", ["gb300-tray-other-clique", "gb300-tray-fabric-not-started",
                                  "gb300-tray-unhealthy", "gb300-tray-no-multicast",
                                  "gb300-tray-link-down", "hgx-h200-8gpu",
                                  "h200-1gpu-vm-recorded"])
def test_degraded_or_fabricless_nodes_get_no_domain_label(stem):
    nl = labels_from_facts(facts(stem))
    assert not nl.has_domain and nl.withheld
    assert nl.labels["ray.io/accelerator-type"] in ("GB300", "H200")


def test_node_labels_cli(capsys):
    assert main(["node-labels", "--facts", str(DATA / "gb300-tray-02.json")]) == 0
    assert capsys.readouterr().out.strip() == \
        f"ray.io/gpu-domain={DOMAIN},ray.io/accelerator-type=GB300"
    rc = main(["node-labels", "--format", "json",
               "--facts", str(DATA / "gb300-tray-link-down.json")])
    cap = capsys.readouterr()
    assert rc == 3 and json.loads(cap.out) == {"ray.io/accelerator-type": "GB300"}
    assert "gpu3: 1 of 18 NVLinks down" in cap.err


def test_labels_from_gpu_feature_discovery():
    gfd = {"nvidia.com/gpu.clique": DOMAIN, "nvidia.com/gpu.product": "NVIDIA-GB300",
           "kubernetes.io/hostname": "tray01"}
    nl = labels_from_k8s(gfd)
    assert nl.labels == {"ray.io/gpu-domain": DOMAIN, "ray.io/accelerator-type": "GB300"}
    nl = labels_from_k8s({"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"})
    assert nl.labels == {"ray.io/accelerator-type": "H100"} and "gpu.clique" in nl.withheld[0]
