"""DSpark speculative decoding behind the Serve endpoint (tiny model, CPU, real Ray, real HTTP).

- A TP=2, DCP=2 Serve deployment with a DSpark drafter read from a real checkpoint folder:
  greedy completions through the official `openai` client equal the non-speculative greedy
  output of the same prompts, and /metrics exports the acceptance series (mean in [1, k+1],
  the length histogram over 1..k+1, per-position rates, the synthetic flag off).
  The drafter is "matched" to one prompt: a real DSpark checkpoint whose backbone output is
  zeroed (final_norm = 0) and whose Markov head is the bigram table of the target's greedy
  continuation of that prompt, so drafts are mostly accepted there (mean length well above 1)
  and mostly rejected on the other prompt; both must still equal non-speculative greedy.
- The config check rejects num_speculative_tokens above the drafter's block size, naming both.
- The envelope (CoordinatorCore without HTTP): verification steps with batch·(k+1) > 64 run
  stock, ≤ 64 specialized.
- Synthetic acceptance (benchmarks): every response carries the warning; metrics flag it.
"""
import asyncio
import json
import urllib.error
import urllib.request

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from raydecode.actors import envelope as env
from raydecode.actors.config import DeployConfigError, check_speculative, parse_deploy_config
from raydecode.actors.coordinator import CoordinatorCore, build_executor
from raydecode.actors.serve import WARNING_HEADER, LocalServer, build_app, deployment_for
from raydecode.cli import main as cli
from raydecode.commands.serve import check_servable, start_http
from raydecode.engine.loader import build_local_engine
from raydecode.engine.request import SamplingParams
from raydecode.models.dspark import load_dspark_config

from _matched_drafter import matched_drafter as matched_drafter_checkpoint
from _net import free_port

torch.set_num_threads(1)
MML = 128
NAME = "tiny-k3-dspark"
K = 5
MATCHED = "The river ran past the old mill"
OTHER = "def fib(n):"
N_TOKENS = 24


def http(url, body: bytes | None = None):
    """A plain GET (or POST of raw bytes): status, headers (case-insensitive), body."""
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def samples(text: str) -> dict[tuple, float]:
    """Every raydecode_spec_* sample of a /metrics text: (name, sorted labels) -> value."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("raydecode_spec_") or s.name.startswith("raydecode_steps"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def cfg(**kw):
    base = {"model": "tiny", "max_model_len": MML, "max_num_seqs": 4,
            "placement": {"profile": "development"}, "serve": {"num_cpus": 0}}
    return parse_deploy_config({**base, **kw})


@pytest.fixture(scope="module")
def reference():
    """Non-speculative greedy (prompt ids, output ids, text) of both prompts, in process."""
    eng = build_local_engine("tiny", max_num_seqs=2, max_model_len=MML)
    reqs = eng.generate([MATCHED, OTHER], SamplingParams(max_tokens=N_TOKENS, temperature=0.0,
                                                         ignore_eos=True))
    return [(r.prompt_ids, r.output_ids, r.output_text) for r in reqs]


@pytest.fixture(scope="module")
def matched_drafter(tmp_path_factory, reference):
    """A DSpark checkpoint folder (tiny layout, Markov rank = vocab) matched to MATCHED."""
    prompt_ids, out_ids, _ = reference[0]
    return matched_drafter_checkpoint(tmp_path_factory.mktemp("dspark-matched"),
                                      prompt_ids + out_ids)


@pytest.fixture(scope="module")
def server(matched_drafter):
    import ray
    from ray import serve

    ray.init(address="local", num_cpus=4, include_dashboard=False,
             object_store_memory=100 * 2**20, log_to_driver=False)
    try:
        port = free_port()
        port = start_http("127.0.0.1", port, retry_free=2)
        c = cfg(served_model_name=NAME, tensor_parallel_size=2, decode_context_parallel_size=2,
                speculative_config={"method": "dspark", "num_speculative_tokens": K,
                                    "model": str(matched_drafter)})
        serve.run(deployment_for(c), name="dspark", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


# ---- TP = 2, DCP = 2 behind Serve ---------------------------------------------------------------

def test_tp2_dcp2_greedy_equals_non_speculative_and_metrics_export_acceptance(server,
                                                                              reference):
    ref = reference

    async def run():
        c = openai.AsyncOpenAI(base_url=server + "/v1", api_key="none", max_retries=0,
                               timeout=180)
        kw = dict(model=NAME, max_tokens=N_TOKENS, temperature=0, extra_body={
            "ignore_eos": True})
        plain = asyncio.create_task(c.completions.create(prompt=MATCHED, **kw))   # concurrent
        stream = await c.completions.create(prompt=OTHER, stream=True, **kw)
        text = "".join([ch.choices[0].text async for ch in stream])
        return (await plain).choices[0].text, text

    matched_text, other_text = asyncio.run(run())
    assert matched_text == ref[0][2] and other_text == ref[1][2]
    assert len(ref[0][1]) == len(ref[1][1]) == N_TOKENS

    status, _, raw = http(server + "/metrics")
    m = samples(raw.decode())
    assert status == 200
    mean = m[("raydecode_spec_mean_acceptance_length", ())]
    assert 1.0 <= mean <= K + 1
    # the matched prompt needs few verify steps of long acceptance, the other one N_TOKENS - 1
    # steps of mostly 1: over both, the mean is still well above 1
    assert mean > 1.3
    assert m[("raydecode_spec_num_drafts", ())] == K
    steps = m[("raydecode_spec_acceptance_length_count", ())]
    emitted = m[("raydecode_spec_acceptance_length_sum", ())]
    assert emitted / steps == pytest.approx(mean)
    # every request's output after its first (prefill-sampled) token came from verify steps
    assert emitted >= 2 * (N_TOKENS - 1)
    buckets = [m[("raydecode_spec_acceptance_length_bucket", (("le", f"{j}.0"),))]
               for j in range(1, K + 2)]
    assert buckets == sorted(buckets) and buckets[-1] == steps
    assert buckets[0] < steps                   # some step accepted at least one draft
    rates = [m[("raydecode_spec_acceptance_rate", (("position", str(i)),))]
             for i in range(1, K + 1)]
    assert rates == sorted(rates, reverse=True) and rates[0] > 0.1
    # mean = 1 + Σ_i rate_i (each accepted draft adds one token to the bonus/correction)
    assert mean == pytest.approx(1 + sum(rates))
    assert m[("raydecode_spec_synthetic_acceptance", (("length", ""),))] == 0.0
    # verify steps of ≤ 2 sequences · (K+1) ≤ 64 tokens: specialized on TP=2 (development)
    assert m[("raydecode_steps_total", (("path", "specialized"),))] > 0


# ---- the config check (DESIGN §6) ---------------------------------------------------------------

def test_num_speculative_tokens_above_the_drafters_block_size_is_rejected(tmp_path, capsys):
    folder = tmp_path / "dspark-block5"
    folder.mkdir()
    raw = load_dspark_config("tiny").raw | {"block_size": 5}
    (folder / "config.json").write_text(json.dumps(raw))
    spec = {"method": "dspark", "num_speculative_tokens": 6, "model": str(folder)}
    bad = cfg(speculative_config=spec)
    for check in (lambda: check_speculative(bad), lambda: CoordinatorCore(bad),
                  lambda: deployment_for(bad),
                  lambda: build_app({"model": "tiny", "speculative_config": spec})):
        with pytest.raises(DeployConfigError) as e:
            check()
        msg = str(e.value)
        assert "num_speculative_tokens = 6" in msg and "block size 5" in msg, msg
        assert "accepted with this drafter: 3..5" in msg
    yaml_file = tmp_path / "deploy.yaml"
    yaml_file.write_text(f"model: tiny\nspeculative_config: {json.dumps(spec)}\n")
    assert cli(["serve", str(yaml_file)]) == 2
    err = capsys.readouterr().err
    assert "num_speculative_tokens = 6" in err and "block size 5" in err
    # at the block size it is accepted; the range check of the config itself still applies
    assert check_speculative(cfg(speculative_config={**spec, "num_speculative_tokens": 5})) == 5
    with pytest.raises(DeployConfigError, match="synthetic_acceptance_length = 7.0; accepted: "
                                                "1 <= L <= num_speculative_tokens \\+ 1 = 6"):
        cfg(speculative_config={**spec, "num_speculative_tokens": 5,
                                "synthetic_acceptance_length": 7})
    # a drafter folder that is not here: refused for a local Ray, left to the replicas (which
    # refuse it at start) when deploying to a remote cluster
    missing = cfg(speculative_config={**spec, "model": str(tmp_path / "none")})
    assert "speculative_config.model: drafter" in check_servable(missing, local=True)
    assert check_servable(missing, local=False) is None
    with pytest.raises(DeployConfigError, match="speculative_config.model: drafter"):
        CoordinatorCore(missing)


# ---- the envelope of verification steps (no HTTP) -----------------------------------------------

class StepRecorder:
    """The real TP=1 speculating executor, recording what each plan reached it with."""

    def __init__(self, inner):
        self.inner, self.steps = inner, []
        self.tp_size, self.dcp_size, self.domain_verified = 1, 1, False

    def specialized_ready(self, n):
        return True

    def execute(self, plan):
        self.steps.append((plan.path, plan.spec_k, plan.num_seqs))
        return self.inner.execute(plan)

    def close(self):
        pass


@pytest.mark.parametrize("n", [8, 9])
def test_verification_steps_over_64_tokens_run_stock(n, reference):
    """k = 7: 8 verifying sequences are 64 tokens (specialized), 9 are 72 (stock)."""
    ref = reference
    c = cfg(max_num_seqs=n, speculative_config={"method": "dspark",
                                                "num_speculative_tokens": 7})
    rec = []
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def factory():
        rec.append(StepRecorder(build_executor(c)))
        return rec[-1]

    async def run():
        core = CoordinatorCore(c, factory)
        await core.start()
        outs = await asyncio.gather(*[_collect(core, f"r{i}", ref[0][0], params)
                                      for i in range(n)])
        await core.close()
        return core.stats(), outs

    stats, outs = asyncio.run(run())
    assert all(o == ref[0][1][:4] for o in outs)          # greedy == non-speculative
    steps = rec[0].steps
    assert steps[0] == ("stock", None, n)                 # the prefill step
    verify = steps[1:]
    assert verify and all(k == 7 and seqs == n for _, k, seqs in verify)
    want = "specialized" if n * 8 <= 64 else "stock"
    assert all(path == want for path, _, _ in verify)
    paths, why = stats["paths"], stats["fallback_reasons"]
    expect = {"specialized": 0, "stock": 1}                # + the prefill step
    expect[want] += len(verify)
    assert {p: v["steps"] for p, v in paths.items()} == expect
    if want == "specialized":                             # n verify slices of k+1 each
        assert paths["specialized"]["tokens"] == len(verify) * n * 8
    assert why[env.SPEC_BATCH] == (len(verify) if n == 9 else 0)
    assert why[env.PREFILL] == 1 and why[env.SPEC_K_RANGE] == 0
    sp = stats["speculative"]
    assert sp["steps"] == len(verify) * n and sp["num_drafts"] == 7
    assert 1.0 <= sp["mean_acceptance_length"] <= 8.0
    assert sum(sp["acceptance_length_counts"]) == sp["steps"]


async def _collect(core, rid, ids, params):
    return sum([o.new_token_ids async for o in core.generate(rid, ids, params)], [])


# ---- synthetic acceptance: flagged in every response ---------------------------------------------

def test_synthetic_acceptance_is_flagged_in_responses_and_metrics():
    c = cfg(served_model_name=NAME, speculative_config={
        "method": "dspark", "num_speculative_tokens": 7, "synthetic_acceptance_length": 6})
    srv = LocalServer(c)
    url = srv.start()
    try:
        body = json.dumps({"model": NAME, "prompt": "Hello", "max_tokens": 18,
                           "ignore_eos": True}).encode()
        status, headers, raw = http(url + "/v1/completions", body)
        out = json.loads(raw)
        stream_body = json.dumps({"model": NAME, "prompt": "Hi", "max_tokens": 4,
                                  "stream": True}).encode()
        s_status, s_headers, _ = http(url + "/v1/completions", stream_body)
        health = json.loads(http(url + "/health")[2])
        m = samples(http(url + "/metrics")[2].decode())
    finally:
        srv.stop()
    assert status == 200 and s_status == 200
    for h in (headers, s_headers):
        assert "meaningless" in (h.get(WARNING_HEADER) or "")
    assert "meaningless" in out["warning"] and out["usage"]["completion_tokens"] == 18
    assert "meaningless" in health["warning"]
    assert m[("raydecode_spec_synthetic_acceptance", (("length", "6"),))] == 1.0
    assert m[("raydecode_spec_mean_acceptance_length", ())] == 6.0


# ---- the graphed speculative step behind the OpenAI API (engine/spec_graph.py) ------------------

def test_spec_graphs_through_the_api_stream_what_the_eager_speculative_step_streams(
        matched_drafter):
    """bf16, TP 1: a speculating replica with decode.step_graphs on (the CPU runs the spec
    graphs' statics path eagerly: kda_verify, MLA rows stored before the causal attention, the
    drafter's static forward, device acceptance, the KDA commit) streams through the OpenAI
    client exactly what the same replica with the graphs off (the eager SpecRunner, KDA
    rollback by recompute) streams. Against the NON-speculative replica bf16 is not exact on
    this checkpoint: at the matched prompt's 17th token the single-row decode and the 6-row
    verify pick different members of a near tie (fp32 logits 2.900 / 2.827: the verify rows
    pick the fp32 winner), so that comparison is made where numerics allow it: fp32 (above)
    and tests/cpu/test_spec_graph.py."""
    base = dict(served_model_name=NAME, dtype="bfloat16")
    texts, counts = {}, {}
    for graphs in (True, False):
        srv = LocalServer(cfg(**base, decode={"step_graphs": graphs}, speculative_config={
            "method": "dspark", "num_speculative_tokens": K, "model": str(matched_drafter)}))
        url = srv.start()
        try:
            c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
            texts[graphs] = [c.completions.create(model=NAME, prompt=p, max_tokens=N_TOKENS,
                                                  temperature=0, extra_body={"ignore_eos": True}
                                                  ).choices[0].text for p in (MATCHED, OTHER)]
            counts[graphs] = dict(srv.core._path_exec.inner.runner.counts)
            m = samples(http(url + "/metrics")[2].decode())
            assert m[("raydecode_spec_mean_acceptance_length", ())] > 1.2
        finally:
            srv.stop()
    assert texts[True] == texts[False] and all(texts[True])
    assert counts[True]["graphed"] > 0 and counts[True]["eager"] == 0   # on the spec graphs
    assert counts[False]["graphed"] == 0 and counts[False]["eager"] > 0
