"""API keys on the /v1 routes, through the official `openai` client and raw HTTP: no key and a
wrong key get 401 in the OpenAI error shape, every configured source's key gets 200; keys never
show in responses, metrics or config errors; /health and /metrics on their own local port; the
same under real Ray Serve with the keys riding in the bound config and the replica's
environment."""
import argparse
import asyncio
import json
import os
import sys
import urllib.error
import urllib.request

import openai
import pytest
import torch

from raydecode.actors.auth import ENV_API_KEY, APIKeyError, APIKeys
from raydecode.actors.config import DeployConfigError, parse_deploy_config
from raydecode.actors.serve import LocalServer, deployment_for
from raydecode.commands import serve as serve_cmd

from _net import free_port

torch.set_num_threads(1)
NAME = "tiny-k3"
CFG_KEY, FILE_KEY, ENV_KEY, WRONG = "sk-config-3f9a", "sk-file-77c1", "sk-env-b20e", "sk-wrong-0"


def cfg(tmp_path, **serve):
    keyfile = tmp_path / "keys.txt"
    keyfile.write_text(f"# operators' keys\n\n  {FILE_KEY}  \n")
    return parse_deploy_config({
        "model": "tiny", "served_model_name": NAME, "max_model_len": 128, "max_num_seqs": 4,
        "serve": {"api_keys": [CFG_KEY], "api_key_file": str(keyfile), **serve}})


def http(url, body: dict | None = None, key: str | None = None):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


ROUTES = [("/v1/models", None),
          ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2}),
          ("/v1/chat/completions", {"model": NAME, "max_tokens": 2,
                                    "messages": [{"role": "user", "content": "hi"}],
                                    "chat_template_kwargs": {"thinking": False}})]


def check_routes(url: str, good_keys: list[str]) -> list[str]:
    """Every /v1 route: 401 without a key, with a wrong key and with a non-bearer header; 200
    with each good key. Returns the error bodies seen."""
    bodies = []
    for path, body in ROUTES:
        for key in (None, WRONG, ""):
            status, headers, text = http(url + path, body, key)
            assert status == 401, (path, key, status, text)
            err = json.loads(text)["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["code"] == "invalid_api_key" and headers["www-authenticate"] == "Bearer"
            bodies.append(text)
        for key in good_keys:
            status, _, text = http(url + path, body, key)
            assert status == 200, (path, status, text)
    return bodies


@pytest.fixture
def local(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_API_KEY, f"{ENV_KEY}, sk-env-second")
    srv = LocalServer(cfg(tmp_path, metrics_port=0))
    srv.start()
    yield srv
    srv.stop()


def test_every_v1_route_needs_a_key_from_any_source(local):
    bodies = check_routes(local.url, [CFG_KEY, FILE_KEY, ENV_KEY, "sk-env-second"])
    assert not any(WRONG in b for b in bodies)                 # never repeated back

    async def run():
        ok = await openai.AsyncOpenAI(base_url=local.url + "/v1", api_key=FILE_KEY,
                                      max_retries=0).completions.create(model=NAME, prompt="hi",
                                                                        max_tokens=2)
        with pytest.raises(openai.AuthenticationError) as e:
            await openai.AsyncOpenAI(base_url=local.url + "/v1", api_key=WRONG,
                                     max_retries=0).models.list()
        return ok, e.value

    ok, err = asyncio.run(run())
    assert ok.choices[0].finish_reason in ("stop", "length")
    assert err.status_code == 401 and WRONG not in str(err)


def test_health_and_metrics_live_on_the_local_port_without_keys(local):
    ops = local.ops.url
    assert ops.startswith("http://127.0.0.1:") and ops != local.url
    check_routes(local.url, [CFG_KEY])
    status, _, health = http(ops + "/health")
    assert status == 200 and json.loads(health)["status"] == "ok"
    status, _, metrics = http(ops + "/metrics")
    assert status == 200
    assert 'raydecode_requests_total{endpoint="chat",status="401"} 3.0' in metrics
    assert not any(k in metrics for k in (CFG_KEY, FILE_KEY, ENV_KEY, WRONG))
    for path in ("/health", "/metrics"):                        # not on the public port
        assert http(local.url + path, key=CFG_KEY)[0] == 404


def test_keys_never_show_in_errors_or_reprs(tmp_path, monkeypatch):
    with pytest.raises(DeployConfigError) as e:
        parse_deploy_config({"model": "tiny", "serve": {"api_keys": [12345678]}})
    assert "12345678" not in str(e.value) and "api_keys" in str(e.value)
    with pytest.raises(DeployConfigError, match="without whitespace") as e:
        parse_deploy_config({"model": "tiny", "serve": {"api_keys": ["sk-has space"]}})
    assert "sk-has" not in str(e.value)
    c = cfg(tmp_path)
    assert CFG_KEY not in repr(c) and CFG_KEY not in str(c.model_dump())
    assert CFG_KEY not in repr(APIKeys([CFG_KEY]))
    bad = parse_deploy_config({"model": "tiny", "serve": {
        "api_key_file": str(tmp_path / "missing.txt")}})
    with pytest.raises(APIKeyError, match="missing.txt"):
        LocalServer(bad)
    monkeypatch.setenv(ENV_API_KEY, "sk-ok,sk bad")
    with pytest.raises(APIKeyError, match=ENV_API_KEY) as e:
        LocalServer(parse_deploy_config({"model": "tiny"}))
    assert "sk bad" not in str(e.value)


def test_no_key_configured_leaves_the_routes_open(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_API_KEY, raising=False)
    srv = LocalServer(parse_deploy_config({"model": "tiny", "served_model_name": NAME,
                                           "max_model_len": 128}))
    srv.start()
    try:
        assert http(srv.url + "/v1/models")[0] == 200
        assert http(srv.url + "/health")[0] == 200 and http(srv.url + "/metrics")[0] == 200
    finally:
        srv.stop()


def test_the_serve_command_takes_keys_from_flags(tmp_path):
    p = argparse.ArgumentParser()
    serve_cmd.add_arguments(p)
    a = p.parse_args(["deploy.yaml", "--api-key", "sk-a", "sk-b", "--api-key", "sk-c",
                      "--api-key-file", "/run/keys", "--metrics-port", "9301"])
    c = serve_cmd.with_overrides(cfg(tmp_path), api_keys=a.api_key, api_key_file=a.api_key_file,
                                 metrics_port=a.metrics_port)
    assert [k.get_secret_value() for k in c.serve.api_keys] == [CFG_KEY, "sk-a", "sk-b", "sk-c"]
    assert (c.serve.api_key_file, c.serve.metrics_port) == ("/run/keys", 9301)


# ---- under Ray Serve -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_server(tmp_path_factory):
    import ray
    from ray import serve

    tmp = tmp_path_factory.mktemp("keys")
    old = os.environ.get(ENV_API_KEY)
    os.environ[ENV_API_KEY] = ENV_KEY          # the replica process inherits it from the raylet
    ray.init(address="local", num_cpus=2, include_dashboard=False,
             object_store_memory=80 * 2**20, log_to_driver=False)
    port, ops_port = free_port(), free_port()
    port = serve_cmd.start_http("127.0.0.1", port, retry_free=2)
    c = cfg(tmp, num_cpus=0, metrics_port=ops_port)
    serve.run(deployment_for(c), name="keys", route_prefix="/")
    yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{ops_port}"
    serve.shutdown()
    ray.shutdown()
    if old is None:
        os.environ.pop(ENV_API_KEY, None)
    else:
        os.environ[ENV_API_KEY] = old


def test_keys_and_the_ops_port_under_ray_serve(ray_server):
    url, ops = ray_server
    check_routes(url, [CFG_KEY, FILE_KEY, ENV_KEY])
    status, _, metrics = http(ops + "/metrics")
    assert status == 200 and 'endpoint="models",status="401"' in metrics
    assert not any(k in metrics for k in (CFG_KEY, FILE_KEY, ENV_KEY, WRONG))
    assert http(ops + "/health")[0] == 200 and http(url + "/health", key=CFG_KEY)[0] == 404
