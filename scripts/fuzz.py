"""Hostile input (issue 8, docs/RELIABILITY.md): schema-driven fuzzing of the HTTP API and of the
deployment config with hypothesis.

HTTP: the operations come from the app's OpenAPI schema (paths, methods, query parameters), the
bodies of the two generation endpoints from their request models' JSON schemas (the routes
read raw bodies, so the schema of the body lives on the model), then mutated: keys dropped,
wrong types, extreme numbers, NaN/Infinity, unknown keys, random JSON and bytes, prompts
beyond the context, oversized bodies. Every answer is checked: never a 5xx; 4xx on the
generation endpoints in the OpenAI error shape; a 200 is a complete answer (one finish_reason,
SSE ending in [DONE], no error event). Meanwhile a canary thread sends a greedy request over
and over: each must return exactly the undisturbed text (no effect on other requests); at the
end the replica must be healthy, idle, and never have failed a step.

Config: generated mappings and YAML texts through `parse_deploy_config` / `load_deploy_config`
and the serve command's checks: a DeployConfig or a DeployConfigError, never anything else.

    python -m raydecode.scripts.fuzz --requests 2000 --configs 2000 --out fuzz.json
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

MODEL = "tiny"
MAX_MODEL_LEN = 64
EXTREME_INTS = (0, -1, 1, 2, 63, 64, 65, 511, 512, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1,
                2**64, -(2**63), -(2**63) - 1, 10**30)
EXTREME_FLOATS = (0.0, -0.0, 1e-300, 1e308, -1e308, 0.5, 1.0, 2.0, 100.0, 100.5,
                  float("nan"), float("inf"), float("-inf"))


# ---- JSON schema → strategy -------------------------------------------------------------------
def from_schema(schema: dict, defs: dict, hints: dict | None = None, name: str = "",
                depth: int = 0) -> st.SearchStrategy:
    """A strategy of values valid by `schema` (pydantic's subset), with field-name `hints`
    mixed in to reach past validation, and extremes for numbers."""
    hints = hints or {}
    if name in hints:
        return hints[name]
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs, hints, name, depth)
    if "anyOf" in schema:
        return st.one_of([from_schema(s, defs, hints, name, depth) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    t = schema.get("type")
    if t == "object" and depth < 4:
        props = schema.get("properties", {})
        req = set(schema.get("required", ()))
        sub = {k: from_schema(v, defs, hints, k, depth + 1) for k, v in props.items()}
        return st.fixed_dictionaries({k: s for k, s in sub.items() if k in req},
                                     optional={k: s for k, s in sub.items() if k not in req})
    if t == "array":
        return st.lists(from_schema(schema.get("items", {}), defs, hints, name, depth + 1),
                        max_size=6)
    if t == "string":
        return st.one_of(st.text(max_size=24), st.sampled_from(["", " ", "\x00", "\ud7ff",
                                                                "<|end_of_msg|>", "a" * 300]))
    if t == "integer":
        lo, hi = schema.get("minimum"), schema.get("maximum")
        near = st.integers(-3 if lo is None else lo - 2, 70 if hi is None else hi + 2)
        return st.one_of(near, st.sampled_from(EXTREME_INTS))
    if t == "number":
        return st.one_of(st.floats(-3, 110), st.sampled_from(EXTREME_FLOATS))
    if t == "boolean":
        return st.booleans()
    if t == "null":
        return st.none()
    return json_values()


def json_values(depth: int = 2) -> st.SearchStrategy:
    leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.sampled_from(EXTREME_INTS),
                     st.floats(), st.text(max_size=12))
    return st.recursive(leaf, lambda c: st.one_of(st.lists(c, max_size=4),
                                                  st.dictionaries(st.text(max_size=6), c,
                                                                  max_size=4)),
                        max_leaves=12)


def _ids(lo: int = 0, hi: int = 520) -> st.SearchStrategy:
    return st.lists(st.one_of(st.integers(lo, hi), st.sampled_from(EXTREME_INTS)), max_size=12)


def body_hints() -> dict[str, st.SearchStrategy]:
    """Field-name strategies that mostly pass validation, so generation really runs."""
    small = st.integers(1, 8)
    return {
        "model": st.one_of(st.just(MODEL), st.just(MODEL), st.just(MODEL), st.text(max_size=8)),
        "max_tokens": st.one_of(small, small, st.none(), st.sampled_from(EXTREME_INTS)),
        "max_completion_tokens": st.one_of(st.none(), small, st.sampled_from(EXTREME_INTS)),
        "n": st.one_of(st.just(1), st.just(1), st.sampled_from(EXTREME_INTS)),
        "seed": st.one_of(st.none(), st.integers(0, 2**31), st.sampled_from(EXTREME_INTS)),
        "temperature": st.one_of(st.none(), st.floats(0, 2), st.sampled_from(EXTREME_FLOATS)),
        "top_p": st.one_of(st.none(), st.floats(0, 1), st.sampled_from(EXTREME_FLOATS)),
        "top_k": st.one_of(st.none(), st.integers(0, 600), st.sampled_from(EXTREME_INTS)),
        "stop_token_ids": st.one_of(st.none(), _ids()),
        "prompt": st.one_of(st.text(max_size=40), _ids(), _ids(0, 511).map(lambda x: x or [1]),
                            st.lists(st.text(max_size=8), max_size=3),
                            st.lists(_ids(), max_size=3),
                            st.integers(2, 40).map(lambda n: "token " * n),
                            st.integers(MAX_MODEL_LEN - 2, MAX_MODEL_LEN + 2).map(
                                lambda n: [5] * n)),
        "presence_penalty": st.one_of(st.none(), st.just(0.0), st.floats()),
        "frequency_penalty": st.one_of(st.none(), st.just(0.0), st.floats()),
        "logprobs": st.one_of(st.none(), st.just(False), json_values(1)),
        "echo": st.one_of(st.just(False), json_values(1)),
        "tools": st.one_of(st.none(), st.none(), json_values(1)),
    }


# ---- requests ------------------------------------------------------------------------------------
@dataclass
class HttpCase:
    method: str
    path: str
    body: bytes | None = None
    query: str = ""
    headers: dict = field(default_factory=dict)
    note: str = ""
    expect: int | None = None          # the status a fixed case must get

    def show(self) -> str:
        b = (self.body or b"")[:300].decode(errors="replace")
        return f"{self.method} {self.path}{self.query} {b}"


def _encode(obj) -> bytes:
    return json.dumps(obj, allow_nan=True).encode()


def mutate(draw, obj: dict) -> dict | list | str | int | None:
    kind = draw(st.sampled_from(["none", "none", "drop", "wrong", "extra", "replace", "nest"]))
    if kind == "none" or not isinstance(obj, dict) or not obj:
        return obj
    keys = sorted(obj)
    if kind == "drop":
        return {k: v for k, v in obj.items() if k != draw(st.sampled_from(keys))}
    if kind == "wrong":
        return {**obj, draw(st.sampled_from(keys)): draw(json_values())}
    if kind == "extra":
        return {**obj, draw(st.text(min_size=1, max_size=10)): draw(json_values())}
    if kind == "nest":
        return {**obj, draw(st.sampled_from(keys)): json.loads("[" * 200 + "]" * 200)}
    return draw(json_values())


@st.composite
def http_cases(draw, ops: list[tuple[str, str, list[str]]], schemas: dict) -> HttpCase:
    """One request to one of `ops` (method, path, query parameter names) or a path/method the
    app does not serve."""
    hints = body_hints()
    pick = draw(st.integers(0, 9))
    if pick == 0:
        path = draw(st.sampled_from(["/v1/", "/v1/engines", "/v2/completions", "/../etc",
                                     "/v1/completions/x", "/%ff", "/" + "a" * 3000]))
        return HttpCase(draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"])), path,
                        draw(st.none() | st.binary(max_size=40)), note="unserved")
    method, path, params = draw(st.sampled_from(ops))
    if method == "GET":
        q = ""
        if params and draw(st.booleans()):
            val = draw(st.one_of(st.floats(-5, 2).map(str), st.sampled_from(
                ["nan", "inf", "-1", "1e400", "abc", "", "%00", "0.01"])))
            q = f"?{params[0]}={val}"
        return HttpCase(method, path, None, q)
    schema = schemas[path]
    if draw(st.integers(0, 9)) == 0:          # raw junk bodies
        body = draw(st.one_of(st.binary(max_size=64), st.just(b""), st.just(b"{"),
                              st.just(b"[]"), st.just(b"null"), st.just(b'{"model": NaN}'),
                              st.just(b"\xff\xfe{}"), st.just(b'{"a":' * 5000)))
        return HttpCase(method, path, body, note="junk")
    obj = draw(from_schema(schema, schema.get("$defs", {}), hints))
    obj = mutate(draw, obj)
    ctype = draw(st.sampled_from(["application/json"] * 4 + ["text/plain", ""]))
    return HttpCase(method, path, _encode(obj), headers={"Content-Type": ctype} if ctype else {})


def fixed_cases(max_body: int) -> list[HttpCase]:
    """Oversized bodies, prompts beyond the context, extremes that once broke a step."""
    c, ch = "/v1/completions", "/v1/chat/completions"
    big = {"model": MODEL, "prompt": "word " * 40_000, "max_tokens": 1}
    return [
        HttpCase("POST", c, b"x" * (max_body + 1), note="oversized junk body", expect=413),
        HttpCase("POST", c, _encode({"model": MODEL, "prompt": "a" * (16 * 2**20)}),
                 note="16 MiB prompt, refused before reading", expect=413),
        HttpCase("POST", c, _encode(big), note="200 KB prompt beyond the context", expect=400),
        HttpCase("POST", c, _encode({"model": MODEL, "prompt": [5] * MAX_MODEL_LEN}),
                 note="token prompt filling the context", expect=400),
        HttpCase("POST", ch, _encode({"model": MODEL, "messages": [
            {"role": "user", "content": "hi"}] * 5000}), note="5000 messages", expect=400),
        HttpCase("POST", c, _encode({"model": MODEL, "prompt": "hi", "seed": 2**64,
                                     "temperature": 1.0}), note="seed beyond 64 bits",
                 expect=400),
        HttpCase("POST", c, _encode({"model": MODEL, "prompt": "hi", "seed": -(2**63) - 1,
                                     "temperature": 1.0}), note="seed below int64", expect=400),
        HttpCase("POST", c, _encode({"model": MODEL, "prompt": "hi", "top_k": 10**9,
                                     "temperature": 1.0}), note="top_k beyond the vocabulary",
                 expect=200),
        HttpCase("POST", c, _encode({"model": MODEL, "prompt": "hi", "stop": ["a"] * 10_000}),
                 note="10k stop strings", expect=200),
        HttpCase("POST", c, b'{"model": "tiny", "prompt": "hi", "temperature": NaN}',
                 note="NaN literal", expect=400),
        HttpCase("POST", c, b"[" * 100_000 + b"]" * 100_000, note="deeply nested JSON",
                 expect=400),
    ]


# ---- checking answers ----------------------------------------------------------------------------
def problems_of(case: HttpCase, status: int, headers: dict, raw: bytes) -> list[str]:
    out = []
    if status >= 500:
        out.append(f"HTTP {status}: {raw[:300]!r}")
    if case.expect is not None and status != case.expect:
        out.append(f"expected HTTP {case.expect}, got {status}: {raw[:160]!r}")
    gen = case.path in ("/v1/completions", "/v1/chat/completions") and case.method == "POST"
    if gen and 400 <= status < 500 and status not in (404, 405):
        try:
            err = json.loads(raw)["error"]
            if set(err) != {"message", "type", "param", "code"} or not err["message"]:
                out.append(f"error body not OpenAI-shaped: {raw[:200]!r}")
        except (ValueError, KeyError, TypeError):
            out.append(f"error body not OpenAI-shaped: {raw[:200]!r}")
    if gen and status == 200:
        if headers.get("content-type", "").startswith("text/event-stream"):
            events = [e for e in raw.decode(errors="replace").split("\n\n") if e]
            if not events or events[-1] != "data: [DONE]":
                out.append("stream does not end with [DONE]")
            chunks = [json.loads(e[6:]) for e in events[:-1] if e.startswith("data: {")]
            if any("error" in ch for ch in chunks):
                out.append(f"error event in a 200 stream: {raw[-300:]!r}")
            fins = [c.get("finish_reason") for ch in chunks for c in ch.get("choices", [])
                    if c.get("finish_reason")]
            if len(fins) != 1:
                out.append(f"stream has {len(fins)} finish_reasons")
        else:
            try:
                fin = json.loads(raw)["choices"][0]["finish_reason"]
                if fin not in ("stop", "length", "tool_calls"):
                    out.append(f"finish_reason {fin!r}")
            except (ValueError, KeyError, IndexError, TypeError):
                out.append(f"200 body is not a completion: {raw[:200]!r}")
    return out


class Canary(threading.Thread):
    """Greedy requests back to back while the fuzz runs; each must equal the reference."""

    def __init__(self, client, reference: dict, max_requests: int = 100_000):
        super().__init__(daemon=True, name="fuzz-canary")
        self.client, self.reference, self.max_requests = client, reference, max_requests
        self.stop, self.sent, self.bad = threading.Event(), 0, []

    def run(self) -> None:
        while not self.stop.is_set() and self.sent < self.max_requests:
            self.sent += 1
            try:
                got = canary_answer(self.client)
            except Exception as e:  # noqa: BLE001 — any failure is a finding
                got = {"exception": f"{type(e).__name__}: {e}"}
            if got != self.reference:
                self.bad.append(got)
            self.stop.wait(0.2)


def canary_answer(client) -> dict:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "The canary says",
                                             "max_tokens": 8, "temperature": 0,
                                             "return_token_ids": True})
    if r.status_code != 200:
        return {"status": r.status_code, "body": r.text[:200]}
    c = r.json()["choices"][0]
    return {"text": c["text"], "ids": c["token_ids"], "finish": c["finish_reason"]}


@dataclass
class FuzzReport:
    requests: int = 0
    by_status: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)        # (case, problems)
    canary_requests: int = 0
    canary_bad: list = field(default_factory=list)
    end_state: dict = field(default_factory=dict)
    slowest: list = field(default_factory=list)          # (seconds, case)
    fixed: dict = field(default_factory=dict)            # note -> (status, seconds)
    configs: int = 0
    configs_accepted: int = 0
    config_failures: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.failures or self.canary_bad or self.config_failures) and \
            self.end_state.get("ok", False)


def http_client(base: str, timeout: float = 120.0):
    try:
        import httpx2 as httpx
    except ImportError:
        import httpx
    return httpx.Client(base_url=base, timeout=timeout)


def send(client, case: HttpCase) -> tuple[int, dict, bytes]:
    r = client.request(case.method, case.path + case.query, content=case.body,
                       headers=case.headers)
    return r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.content


def fuzz_http(base: str, n: int, seed: int, app=None, report: FuzzReport | None = None,
              max_model_len: int = MAX_MODEL_LEN) -> FuzzReport:
    """n generated requests (+ the fixed cases) against the server at `base` (loopback)."""
    from raydecode.actors import openai_api as oa
    from raydecode.actors.serve import max_body_bytes

    if not base.startswith(("http://127.", "http://localhost", "http://[::1]")):
        raise ValueError(f"base = {base!r}; the fuzzer only targets loopback")
    report = report or FuzzReport()
    spec = app.openapi() if app is not None else http_client(base).get("/openapi.json").json()
    ops = [(m.upper(), path, [p["name"] for p in op.get("parameters", [])
                              if p.get("in") == "query"])
           for path, item in spec["paths"].items() for m, op in item.items()]
    schemas = {"/v1/completions": oa.CompletionRequest.model_json_schema(),
               "/v1/chat/completions": oa.ChatCompletionRequest.model_json_schema()}
    client = http_client(base)
    reference = canary_answer(client)
    canary = Canary(http_client(base), reference)
    canary.start()

    def run(case: HttpCase) -> None:
        t0 = time.perf_counter()
        try:
            status, headers, raw = send(client, case)
            probs = problems_of(case, status, headers, raw)
        except Exception as e:  # noqa: BLE001 — a dropped connection is a finding
            status, probs = 0, [f"{type(e).__name__}: {e}"]
        dt = time.perf_counter() - t0
        report.requests += 1
        report.by_status[str(status)] = report.by_status.get(str(status), 0) + 1
        if case.expect is not None:
            report.fixed[case.note] = (status, round(dt, 3))
        report.slowest = sorted(report.slowest + [(round(dt, 3), case.note or case.show()[:80])],
                                reverse=True)[:5]
        if probs:
            report.failures.append((case.show()[:400], probs))

    try:
        for case in fixed_cases(max_body_bytes(max_model_len)):
            run(case)

        @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=http_cases(ops, schemas))
        def one(case: HttpCase) -> None:
            run(case)

        hypothesis_seed(seed)(one)()
    finally:
        canary.stop.set()
        canary.join(60)
    report.canary_requests, report.canary_bad = canary.sent, canary.bad[:10]
    report.end_state = end_state(client)
    return report


def end_state(client, timeout_s: float = 30.0) -> dict:
    """Healthy, nothing left running or waiting, no step ever failed."""
    t0, state = time.monotonic(), {}
    while time.monotonic() - t0 < timeout_s:
        health = client.get("/health").json()
        m = {ln.split(" ")[0]: float(ln.rsplit(" ", 1)[1])
             for ln in client.get("/metrics").text.splitlines() if ln.startswith("raydecode_")
             and "{" not in ln.split(" ")[0]}
        state = {"health": health.get("status"), "running": m.get("raydecode_running_requests"),
                 "waiting": m.get("raydecode_waiting_requests"),
                 "failover_events": m.get("raydecode_failover_events_total")}
        state["ok"] = state["health"] == "ok" and state["running"] == 0 and \
            state["waiting"] == 0 and state["failover_events"] == 0
        if state["ok"]:
            break
        time.sleep(0.5)
    return state


# ---- the deployment config -------------------------------------------------------------------
def config_hints() -> dict[str, st.SearchStrategy]:
    return {"model": st.one_of(st.just("tiny"), st.just("tiny"), st.text(max_size=10),
                               st.just("/nonexistent/ckpt")),
            "base_url": st.one_of(st.just("http://127.0.0.1:9/v1"), st.text(max_size=20)),
            "tensor_parallel_size": st.one_of(st.sampled_from([1, 2, 4, 8, 16]),
                                              st.sampled_from(EXTREME_INTS)),
            "decode_context_parallel_size": st.one_of(st.sampled_from([1, 2, 4]),
                                                      st.sampled_from(EXTREME_INTS))}


@st.composite
def config_inputs(draw, schema: dict):
    obj = draw(from_schema(schema, schema.get("$defs", {}), config_hints()))
    obj = mutate(draw, obj)
    if draw(st.integers(0, 4)) == 0:        # as YAML text, sometimes broken
        import yaml
        text = yaml.safe_dump(obj) if draw(st.booleans()) else draw(st.text(max_size=200))
        return ("yaml", text)
    return ("dict", obj)


def check_config(kind: str, data) -> str | None:
    """'accepted' or 'refused' (a DeployConfigError with a message); anything else is a
    finding, returned as a description."""
    from raydecode.actors.config import DeployConfigError, load_deploy_config, \
        parse_deploy_config
    from raydecode.commands.serve import check_servable, with_overrides

    try:
        if kind == "yaml":
            with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
                f.write(data)
                f.flush()
                cfg = load_deploy_config(f.name)
        else:
            cfg = parse_deploy_config(data)
        with_overrides(cfg, "127.0.0.1", 8000)
        why = check_servable(cfg)
        if why is not None and not isinstance(why, str):
            return f"check_servable returned {why!r}"
    except DeployConfigError as e:
        return "refused" if str(e).strip() else "DeployConfigError without a message"
    except Exception as e:  # noqa: BLE001 — anything else is a finding
        return f"{type(e).__name__}: {e}"[:300]
    return "accepted"


def fuzz_config(n: int, seed: int, report: FuzzReport | None = None) -> FuzzReport:
    from raydecode.actors.config import DeployConfig

    report = report or FuzzReport()
    schema = DeployConfig.model_json_schema()

    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(inp=config_inputs(schema))
    def one(inp) -> None:
        report.configs += 1
        why = check_config(*inp)
        if why == "accepted":
            report.configs_accepted += 1
        elif why != "refused":
            report.config_failures.append((repr(inp)[:300], why))

    hypothesis_seed(seed)(one)()
    return report


# ---- a server of its own -------------------------------------------------------------------------
def start_local_server(max_model_len: int = MAX_MODEL_LEN):
    """The OpenAI app over a real coordinator (tiny, TP=1) on a loopback port; no Ray."""
    from raydecode.actors.config import parse_deploy_config
    from raydecode.actors.serve import LocalServer

    # without K3's thinking preamble (~180 tokens) chat prompts fit the small context
    srv = LocalServer(parse_deploy_config({"model": "tiny", "max_model_len": max_model_len,
                                           "max_num_seqs": 8, "max_waiting_requests": 64,
                                           "default_chat_template_kwargs": {"thinking": False}}))
    srv.start()
    return srv


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="generated HTTP requests")
    p.add_argument("--configs", type=int, default=2000, help="generated deployment configs")
    p.add_argument("--seed", type=int, default=None, help="default: a random seed (printed)")
    p.add_argument("--out", help="write the JSON report here")
    a = p.parse_args(argv)
    seed = a.seed if a.seed is not None else random.randrange(2**32)
    print(f"seed {seed}", flush=True)
    t0 = time.monotonic()
    report = fuzz_config(a.configs, seed) if a.configs else FuzzReport()
    if a.requests:
        srv = start_local_server()
        try:
            fuzz_http(srv.url, a.requests, seed, app=srv.server.config.app, report=report)
        finally:
            srv.stop()
    out = {"seed": seed, "ok": report.ok, "seconds": round(time.monotonic() - t0, 1),
           **{k: v for k, v in report.__dict__.items()}}
    print(json.dumps(out, indent=1, default=str))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
