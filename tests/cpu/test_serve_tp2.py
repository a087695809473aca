"""Greedy output through the OpenAI API at TP 2 (two real rank actors over gloo, their steps on
the step channel, rank 0 sampling) equals the in-process engine `raydecode generate` runs, token
for token, streamed and not, and what came back per step was token ids only."""
import asyncio

import openai
import pytest
import ray
import torch

from raydecode.actors.config import parse_deploy_config
from raydecode.actors.serve import LocalServer
from raydecode.engine.loader import build_local_engine
from raydecode.engine.request import SamplingParams

torch.set_num_threads(1)
PROMPTS = ["The river ran past the old mill", "def greet(name):"]


@pytest.fixture(scope="module")
def server():
    ray.init(address="local", num_cpus=2, include_dashboard=False,
             object_store_memory=80 * 2**20, log_to_driver=False)
    cfg = parse_deploy_config({"model": "tiny", "served_model_name": "tiny-tp2",
                               "tensor_parallel_size": 2, "max_model_len": 96,
                               "max_num_seqs": 4, "placement": {"profile": "development"},
                               "serve": {"num_cpus": 0}})
    s = LocalServer(cfg)
    yield s, s.start()
    s.stop()
    ray.shutdown()


def test_tp2_api_greedy_equals_generate(server):
    s, url = server
    eng = build_local_engine("tiny", max_num_seqs=4, max_model_len=96)
    want = [r.output_ids for r in eng.generate(PROMPTS, SamplingParams(max_tokens=24,
                                                                       temperature=0.0))]

    async def run():
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        extra = {"return_token_ids": True}
        plain = await asyncio.gather(*(c.completions.create(
            model="tiny-tp2", prompt=p, max_tokens=24, temperature=0, extra_body=extra)
            for p in PROMPTS))
        streamed = []
        for p in PROMPTS:
            ids = []
            async for ch in await c.completions.create(model="tiny-tp2", prompt=p,
                                                       max_tokens=24, temperature=0,
                                                       stream=True, extra_body=extra):
                ids += getattr(ch.choices[0], "token_ids", None) or []
            streamed.append(ids)
        return [r.choices[0].token_ids for r in plain], streamed

    plain, streamed = asyncio.run(run())
    assert plain == want and streamed == want
    st = s.core.stats()
    assert st["tensor_parallel_size"] == 2 and st["paths"]["specialized"]["steps"] > 0
    cp = st["control_plane"]
    assert cp["transports"] == ["uds", "uds"]
    assert cp["max_result_bytes"] <= 7 + 8 * 4        # ids of at most 4 rows, no logits
    # rank 0's loop timing is one Ray call: only the /metrics scrape (detail) asks for it
    assert cp["rank0_timing"] is None
    r0 = s.core.stats(detail=True)["control_plane"]["rank0_timing"]
    assert r0["steps"] >= cp["steps"] and r0["step_s"] > 0
