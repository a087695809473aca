"""Ray token authentication in the shipped `ray up` configs (CVE-2023-48022, "ShadowRay": an
unauthenticated dashboard Jobs API runs anyone's code on the cluster).

The static checks read every config's start commands; the live check starts a real
`ray start --head` with the authentication environment those commands export (the token file
swapped for a temporary one), on OS-chosen ports, and asks its Jobs API with no token, a wrong
token and the right one."""
from __future__ import annotations

import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from _net import free_port

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "cluster" / "configs").glob("*.yaml"))


def exported_env(command: str) -> dict[str, str]:
    """VAR=VALUE pairs of every `export` in a shell command line."""
    env: dict[str, str] = {}
    for stmt in re.split(r"[;&|]+", command):
        words = shlex.split(stmt.strip()) if stmt.strip() else []
        if words[:1] == ["export"]:
            env.update(w.split("=", 1) for w in words[1:] if "=" in w)
    return env


def ray_start_env(commands: list[str]) -> dict[str, str]:
    (cmd,) = [c for c in commands if "ray start" in c]
    return exported_env(cmd.split("ray start", 1)[0])


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_ray_start_uses_token_auth_with_a_synced_token(path):
    cfg = yaml.safe_load(path.read_text())
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        env = ray_start_env(cfg[key])
        assert env.get("RAY_AUTH_MODE") == "token", f"{path.name} {key}: {env}"
        token_path = env.get("RAY_AUTH_TOKEN_PATH")
        assert token_path, f"{path.name} {key}: no RAY_AUTH_TOKEN_PATH"
        # the token reaches every node: a file mount from the operator's machine
        assert token_path in cfg["file_mounts"], f"{path.name}: {token_path} is not synced"
    # every process in the container (serve deploy, ray job …) is a token client too
    run = cfg["docker"]["run_options"]
    assert "--env=RAY_AUTH_MODE=token" in run
    assert any(o.startswith("--env=RAY_AUTH_TOKEN_PATH=") for o in run)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_dashboard_is_not_bound_to_every_interface(path):
    head = " ".join(yaml.safe_load(path.read_text())["head_start_ray_commands"])
    assert "--dashboard-host=0.0.0.0" not in head and "--dashboard-host=::" not in head
    assert "--dashboard-host=127.0.0.1" in head


def _get(url: str, token: str | None) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token
                                 else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_jobs_api_refuses_requests_without_the_token(tmp_path):
    """The head's environment from the on-prem config, on a real local `ray start --head`."""
    cfg = yaml.safe_load((CONFIGS[0].parent / "gb300-nvl72-onprem.yaml").read_text())
    env = ray_start_env(cfg["head_start_ray_commands"])
    assert env.get("RAY_AUTH_MODE") == "token"
    token = secrets.token_hex(16)
    token_file = tmp_path / "auth_token"
    token_file.write_text(token)
    env["RAY_AUTH_TOKEN_PATH"] = str(token_file)
    env = {k: v for k, v in env.items() if k.startswith("RAY_AUTH")}
    child_env = {k: v for k, v in os.environ.items()
                 if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    child_env.update(env)
    dash = free_port()
    short = tempfile.mkdtemp(prefix="rdauth", dir="/tmp")    # AF_UNIX paths: < 108 bytes
    ray = Path(sys.executable).with_name("ray")
    if not ray.exists():
        ray = Path(shutil.which("ray") or "ray")
    args = [str(ray), "start", "--head", "--block", f"--port={free_port()}",
            "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--include-dashboard=true",
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}", "--num-cpus=0",
            f"--temp-dir={short}", "--disable-usage-stats"]
    log = open(tmp_path / "ray-start.log", "w")
    proc = subprocess.Popen(args, env=child_env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{dash}/api/jobs/"
    try:
        deadline, status = time.monotonic() + 120, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status = _get(url, None)
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
        assert status is not None, (tmp_path / "ray-start.log").read_text()[-2000:]
        assert status == 401                         # no token: refused
        assert _get(url, "not-the-token") == 403     # wrong token: refused
        assert _get(url, token) == 200               # the token: the API answers
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)         # `ray start --block` drains and stops its node
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        log.close()
        shutil.rmtree(short, ignore_errors=True)
