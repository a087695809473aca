"""The deployment config (YAML → pydantic), the Serve import path, the `serve` command's checks,
and the stock-pool Serve YAML checked against Ray Serve's own schemas."""
import ast
import importlib.util
import json
import textwrap
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from raydecode.actors.config import DeployConfig, DeployConfigError, load_deploy_config
from raydecode.cli import main as cli
from raydecode.models.dspark import load_dspark_config

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


def write(tmp_path, text: str, name: str = "deploy.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_minimal_file_is_valid_with_vllm_key_names(tmp_path):
    cfg = load_deploy_config(write(tmp_path, """
        model: tiny
        tensor_parallel_size: 2
        decode_context_parallel_size: 2
    """))
    assert (cfg.tensor_parallel_size, cfg.decode_context_parallel_size) == (2, 2)
    assert cfg.model_name == "tiny" and cfg.profile == "production"
    assert cfg.speculative_config is None and cfg.stock_pool is None
    ecfg = cfg.engine_config(model_max_positions=1_048_576)
    assert ecfg.max_model_len == 4096 and ecfg.dcp_size == 2 and ecfg.max_num_seqs == 64
    assert cfg.envelope_policy().max_batch == 64


def _all_fields(model: type[BaseModel], prefix=""):
    for name, f in model.model_fields.items():
        yield f"{prefix}{name}", f
        ann = f.annotation
        for t in getattr(ann, "__args__", (ann,)):
            if isinstance(t, type) and issubclass(t, BaseModel):
                yield from _all_fields(t, f"{prefix}{name}.")


def test_every_field_has_a_description():
    missing = [n for n, f in _all_fields(DeployConfig) if not f.description]
    assert missing == []
    assert len(list(_all_fields(DeployConfig))) > 25


@pytest.mark.parametrize("text, needle", [
    ("model: tiny\ntensor_parallel_size: 3\n", "tensor_parallel_size: tensor_parallel_size = 3; "
                                               "accepted: (1, 2, 4, 8, 16)"),
    ("model: tiny\ntensor_parallel_size: 'two'\n", "tensor_parallel_size: Input should be a "
                                                  "valid integer"),
    ("model: tiny\ntensor_parallel_size: 2\ndecode_context_parallel_size: 4\n",
     "decode_context_parallel_size = 4 must divide tensor_parallel_size = 2"),
    ("model: tiny\nmax_num_sequences: 8\n", "max_num_sequences: unknown key"),
    ("model: tiny\nserve: {prot: 80}\n", "serve.prot: unknown key"),
    ("model: tiny\nspeculative_config: {method: eagle, num_speculative_tokens: 3}\n",
     "method = 'eagle'; accepted: dspark"),
    ("model: tiny\nspeculative_config: {method: dspark, num_speculative_tokens: 8}\n",
     "num_speculative_tokens = 8; accepted: 3..7"),
    ("model: tiny\nstock_pool: {base_url: 'stock:8000/v1'}\n", "expected an http:// or https://"),
    ("model: tiny\nenvelope: {max_batch: 65}\n", "envelope.max_batch"),
    ("model: tiny\nplacement: {profile: fast}\n", "placement.profile"),
    ("model: tiny\nenable_prefix_caching: true\n"
     "speculative_config: {method: dspark, num_speculative_tokens: 3}\n",
     "enable_prefix_caching = true with speculative_config: not supported together yet"),
    ("model: tiny\nenable_prefix_caching: true\nkda_snapshot_slots: 0\n",
     "needs kda_snapshot_slots >= 1"),
    ("model: tiny\nkda_snapshot_slots: -1\n", "kda_snapshot_slots: Input should be greater"),
    ("tensor_parallel_size: 2\n", "model: Field required"),
    ("- model: tiny\n", "expected a mapping"),
    ("model: [tiny\n", "not valid YAML"),
])
def test_bad_configs_name_the_field_and_what_is_accepted(tmp_path, text, needle):
    p = write(tmp_path, text)
    with pytest.raises(DeployConfigError) as e:
        load_deploy_config(p)
    assert needle in str(e.value) and str(p) in str(e.value)


def test_prefix_caching_defaults_on_except_with_speculation():
    on = DeployConfig(model="tiny").engine_config(4096)
    assert on.enable_prefix_caching and on.num_snapshots == 32
    spec = DeployConfig(model="tiny", speculative_config={"method": "dspark",
                                                          "num_speculative_tokens": 3})
    assert not spec.prefix_caching and spec.engine_config(4096).num_snapshots == 0
    off = DeployConfig(model="tiny", enable_prefix_caching=False).engine_config(4096)
    assert not off.enable_prefix_caching and off.num_snapshots == 0      # no memory for it
    assert not DeployConfig(model="tiny", kda_snapshot_slots=0).prefix_caching


def test_missing_file_and_example_files():
    with pytest.raises(DeployConfigError, match="no such file"):
        load_deploy_config("/nonexistent/deploy.yaml")
    examples = sorted(EXAMPLES.glob("deploy-*.yaml"))
    assert len(examples) >= 2
    for p in examples:
        load_deploy_config(p)


def test_build_app_import_path_and_serve_time_rejections(tmp_path):
    from ray.serve import Application

    from raydecode.actors.serve import build_app

    p = write(tmp_path, "model: tiny\nserve: {num_replicas: 2, num_cpus: 0}\n")
    assert isinstance(build_app({"config": str(p)}), Application)
    assert isinstance(build_app({"model": "tiny"}), Application)
    assert isinstance(build_app({"config": {"model": "tiny"}}), Application)
    with pytest.raises(ValueError, match="either 'config'"):
        build_app({"config": str(p), "model": "tiny"})
    with pytest.raises(DeployConfigError, match="tensr_parallel_size: unknown key"):
        build_app({"model": "tiny", "tensr_parallel_size": 2})
    spec = {"model": "tiny", "speculative_config": {"method": "dspark",
                                                    "num_speculative_tokens": 7}}
    assert isinstance(build_app(spec), Application)


def test_serve_command_refuses_what_this_build_cannot_serve(tmp_path, capsys):
    from raydecode.commands.serve import check_servable, with_overrides

    drafter = tmp_path / "dspark-block4"        # a drafter whose blocks hold 4 tokens
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps(load_dspark_config("tiny").raw
                                                    | {"block_size": 4}))
    spec = write(tmp_path, f"""
        model: tiny
        speculative_config: {{method: dspark, num_speculative_tokens: 5, model: {drafter}}}
    """, "spec.yaml")
    assert cli(["serve", str(spec)]) == 2
    assert "num_speculative_tokens = 5 exceeds the block size 4" in capsys.readouterr().err
    assert cli(["serve", str(tmp_path / "missing.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert cli(["serve", str(write(tmp_path, "model: tiny\n")), "--port", "0"]) == 2
    assert "serve.port" in capsys.readouterr().err

    cfg = with_overrides(load_deploy_config(write(tmp_path, "model: tiny\n")), "127.0.0.1", 9123)
    assert (cfg.serve.host, cfg.serve.port) == ("127.0.0.1", 9123)
    assert check_servable(cfg) is None
    tp2 = with_overrides(load_deploy_config(write(tmp_path, "model: tiny\n"
                                                  "tensor_parallel_size: 2\n")))
    why = check_servable(tp2)
    assert why is None or "tensor_parallel_size = 2" in why


# ---- the stock pool's Ray Serve LLM app --------------------------------------------------------
def _ray_model_fields(relpath: str, cls: str) -> set[str]:
    """Field names of a pydantic class in the installed Ray source, read without importing it
    (ray.serve.llm needs pyarrow/transformers/vllm, which a CPU test machine lacks)."""
    root = Path(importlib.util.find_spec("ray").submodule_search_locations[0])
    tree = ast.parse((root / relpath).read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    return {s.target.id for s in node.body if isinstance(s, ast.AnnAssign)
            and isinstance(s.target, ast.Name) and not s.target.id.startswith("_")}


K3_YAML = """
    model: /models/Kimi-K3
    served_model_name: kimi-k3
    tensor_parallel_size: 16
    decode_context_parallel_size: 4
    max_num_seqs: 64
    max_model_len: 262144
    dtype: bfloat16
    stock_pool: {base_url: "http://stock.svc:8100/pool/v1", model: kimi-k3-stock}
"""


def test_stock_pool_config_is_a_valid_ray_serve_llm_app(tmp_path, capsys):
    from ray.serve.schema import ServeDeploySchema

    out = tmp_path / "stock.yaml"
    assert cli(["stock-pool-config", str(write(tmp_path, K3_YAML)), "-o", str(out),
                "--max-replicas", "3"]) == 0
    doc = yaml.safe_load(out.read_text())
    ServeDeploySchema.model_validate(doc)                      # Ray Serve's config schema
    assert doc["http_options"]["port"] == 8100
    (app,) = doc["applications"]
    assert app["import_path"] == "ray.serve.llm:build_openai_app"
    assert app["route_prefix"] == "/pool"

    llm_dir = "llm/_internal/serve/core"
    assert set(app["args"]) <= _ray_model_fields(f"{llm_dir}/ingress/builder.py",
                                                 "LLMServingArgs")
    (llm,) = app["args"]["llm_configs"]
    assert set(llm) <= _ray_model_fields(f"{llm_dir}/configs/llm_config.py", "LLMConfig")
    assert set(llm["model_loading_config"]) <= _ray_model_fields(
        f"{llm_dir}/configs/llm_config.py", "ModelLoadingConfig")
    assert llm["model_loading_config"] == {"model_id": "kimi-k3-stock",
                                           "model_source": "/models/Kimi-K3"}
    ek = llm["engine_kwargs"]
    assert (ek["tensor_parallel_size"], ek["decode_context_parallel_size"]) == (16, 4)
    assert (ek["max_model_len"], ek["max_num_seqs"], ek["dtype"]) == (262144, 64, "bfloat16")
    assert llm["deployment_config"]["autoscaling_config"] == {"min_replicas": 1,
                                                              "max_replicas": 3}

    assert cli(["stock-pool-config", str(write(tmp_path, "model: tiny\n", "t.yaml"))]) == 2
    assert "preset without published weights" in capsys.readouterr().err
