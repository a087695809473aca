"""DSpark on the GPU behind the OpenAI API (issue 27: greedy speculative output equals greedy
non-speculative output token for token, through the API, on the GPU).

Two TP 1 replicas in this process (actors/serve.py LocalServer: uvicorn, the CoordinatorCore,
the model on CUDA in bf16, its step graphs captured at build), the tiny K3 checkpoint:
- the non-speculative one decodes on its captured step graphs;
- the speculating one (DSpark, k = 4) on engine/spec_graph.py's graphs captured at build, its
  drafter a real DSpark checkpoint folder whose Markov head is the bigram table of the first
  prompt's non-speculative continuation (drafts mostly accepted there, partly rejected on the
  other prompts).
The `openai` client's greedy completions (`return_token_ids`) of three prompts are equal token
for token, except that a stream may part where the reference's top-2 logprobs tie (gap < TIE:
the H200 run at c942ca4 parted at token 38 of the third prompt, gap 0.000); at least 3/4 of
the tokens are compared. (The CPU's bf16 reference ops meet a non-tie difference at the first
prompt's 17th token, so the CPU twin is fp32: tests/cpu/test_serve_dspark.py.) The speculating replica ran its steps on the spec graphs (no eager speculative step,
no capture failure) and accepted drafts. Needs CUDA and the serve wheels (fastapi, uvicorn,
openai)."""
from __future__ import annotations

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from raydecode.actors.config import parse_deploy_config  # noqa: E402
from raydecode.actors.serve import LocalServer  # noqa: E402
from raydecode.engine.loader import load_tokenizer  # noqa: E402

from _matched_drafter import matched_drafter  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
NAME, K, N_TOKENS = "tiny-k3-gpu", 4, 40
TIE = 0.01            # nats: top-2 logprobs this close are a tie within the lm_head's
                      # fp32 accumulation (1-row decode and (k+1)-row verify GEMMs differ)
PROMPTS = ["The river ran past the old mill", "def f(x):", "one two three"]


def _cfg(**kw):
    return parse_deploy_config({
        "model": "tiny", "max_model_len": 256, "max_num_seqs": 4, "dtype": "bfloat16",
        "served_model_name": NAME, "decode": {"step_graphs": True},
        "placement": {"profile": "development"}, "serve": {"num_cpus": 0}, **kw})


def _complete(cfg, logprobs: bool):
    """[(prompt ids, output ids, top-2 logprob gap per output token (logprobs; else None))] of
    the greedy completions of PROMPTS (a speculating deployment rejects logprobs), and the replica's CoordinatorCore (its runner's counters and the acceptance
    read after the requests)."""
    srv = LocalServer(cfg)
    url = srv.start()
    tok = load_tokenizer("tiny")
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        outs = []
        for p in PROMPTS:
            ch = c.completions.create(model=NAME, prompt=p, max_tokens=N_TOKENS, temperature=0,
                                      logprobs=2 if logprobs else None,
                                      extra_body={"ignore_eos": True, "return_token_ids": True}
                                      ).choices[0]
            gaps = None if not logprobs else [
                (lambda v: v[0] - v[1] if len(v) == 2 else 0.0)(sorted(d.values(), reverse=True))
                for d in ch.logprobs.top_logprobs]
            outs.append((tok.encode(p), ch.model_extra["token_ids"], gaps))
        return outs, srv.core
    finally:
        srv.stop()


def test_graphed_speculative_replica_streams_the_non_speculative_tokens(tmp_path):
    ref, core = _complete(_cfg(), True)
    plain = core._path_exec.inner.runner
    assert plain.counts["graphed"] > 0, plain.counts             # decode on the step graphs
    drafter = matched_drafter(tmp_path / "dspark", ref[0][0] + ref[0][1])
    got, core = _complete(_cfg(speculative_config={
        "method": "dspark", "num_speculative_tokens": K, "model": str(drafter)}), False)
    spec = core._path_exec.inner.runner
    assert not spec.graphs.capture_failed, spec.graphs.capture_failed
    assert core.engine.acceptance.accepted_at[0] > 0          # drafts were accepted
    assert spec.counts["graphed"] > 0 and spec.counts["eager"] == 0, spec.counts
    equal = 0
    for i, ((_, r, gaps), (_, g, _)) in enumerate(zip(ref, got)):
        assert len(r) == len(g) == N_TOKENS
        j = next((j for j, (a, b) in enumerate(zip(r, g)) if a != b), N_TOKENS)
        assert j == N_TOKENS or gaps[j] < TIE, (
            f"prompt {i}: first difference at token {j}, where the reference's top-2 logprob "
            f"gap is {gaps[j]:.4f} ≥ {TIE}: not a tie")
        equal += j
    assert equal >= len(PROMPTS) * N_TOKENS * 3 // 4, f"{equal} tokens equal before a tie"
