"""`ray up` cluster configs: Ray's own cluster-config schema, plus what raydecode needs in them."""
from __future__ import annotations

import json
import os
from pathlib import Path

import jsonschema
import pytest
import yaml

import ray.autoscaler
from ray.autoscaler._private.util import prepare_config, validate_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "cluster" / "configs").glob("*.yaml"))
SCHEMA = json.loads((Path(os.path.dirname(ray.autoscaler.__file__)) / "ray-schema.json")
                    .read_text())


def test_there_is_an_onprem_and_a_cloud_config():
    kinds = {yaml.safe_load(p.read_text())["provider"]["type"] for p in CONFIGS}
    assert {"local", "aws"} <= kinds


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_passes_rays_schema_and_prepare(path):
    cfg = yaml.safe_load(path.read_text())
    jsonschema.validate(cfg, SCHEMA)
    validate_config(prepare_config(cfg))       # what `ray up` does before launching


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_labels_workers_and_wires_imex(path):
    cfg = yaml.safe_load(path.read_text())
    start = " ; ".join(cfg["worker_start_ray_commands"])
    assert 'LABELS="$(raydecode node-labels)"' in start and '--labels="$LABELS"' in start
    assert "raydecode verify-domain --tp 4" in start
    assert "--num-gpus=0" in " ".join(cfg["head_start_ray_commands"])
    dock = cfg["docker"]
    assert "--device=/dev/nvidia-caps-imex-channels/channel0" in dock["worker_run_options"]
    assert "--gpus all" in dock["worker_run_options"]
    setup = " ".join(cfg.get("setup_commands", []))
    assert "pip install" in setup and "/home/ray/raydecode" in setup
    assert cfg["file_mounts"]["/home/ray/raydecode"] == "./"


def test_onprem_config_is_one_nvl72_rack():
    cfg = yaml.safe_load((CONFIGS[0].parent / "gb300-nvl72-onprem.yaml").read_text())
    assert len(cfg["provider"]["worker_ips"]) == 18 == cfg["max_workers"]
    assert len(set(cfg["provider"]["worker_ips"]) | {cfg["provider"]["head_ip"]}) == 19


def test_schema_catches_an_unquoted_colon_and_a_typo():
    """The YAML pitfall these configs avoid: `echo "x: y"` unquoted parses as a mapping."""
    bad = yaml.safe_load('cluster_name: x\nprovider: {type: local, head_ip: a, worker_ips: []}\n'
                         'worker_start_ray_commands:\n  - echo "raydecode: joining"\n')
    with pytest.raises(jsonschema.ValidationError, match="is not of type 'string'"):
        jsonschema.validate(bad, SCHEMA)
    with pytest.raises(jsonschema.ValidationError, match="worker_start_commands"):
        jsonschema.validate({"cluster_name": "x", "provider": {"type": "local"},
                             "worker_start_commands": []}, SCHEMA)
