"""The served path's GPU side (issue: served decode at kernel speed), on one CUDA GPU:
- the device sampler draws the same tokens on CUDA as on the CPU from the same logits and
  sampling rows (its noise is an integer hash), greedy, temperature, top-k and top-p alike;
- a TP 1 replica (`build_executor`, what a TP 1 deployment builds) captures its step graphs at
  build and replays them for decode-only specialized steps, with the eager step's top-20
  logprobs (bf16 tolerance), and only token ids and asked-for logprobs come back.
Not run in CI; needs a CUDA device."""
from __future__ import annotations

import pytest
import torch

from raydecode.engine.request import SamplingParams
from raydecode.engine.sampling import SamplingRows, StepResult, sample

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TOL = 3e-2


def _rows(params, seeds, counters, logprobs=None):
    return SamplingRows.build(params, seeds, counters, logprobs)


@pytest.mark.parametrize("V", [512, 163840])
def test_device_sampler_draws_the_cpu_tokens(V):
    g = torch.Generator().manual_seed(V)
    logits = torch.randn(16, V, generator=g) * 4
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8),
              SamplingParams(temperature=1.0, top_k=20), SamplingParams(temperature=1.2,
                                                                        top_p=0.9)] * 4
    rows = _rows(params, list(range(100, 116)), list(range(7, 23)))
    cpu = sample(logits, rows).tokens
    gpu = sample(logits.cuda(), rows).tokens.cpu()
    assert torch.equal(cpu, gpu), (cpu, gpu)


def test_device_logprobs_match_log_softmax():
    logits = torch.randn(4, 163840, device="cuda") * 3
    rows = _rows([SamplingParams(temperature=0.0, logprobs=5)] * 4, [0] * 4, [0] * 4, [5] * 4)
    res = StepResult.to_host(sample(logits, rows))
    lsm = torch.log_softmax(logits.double(), -1).cpu()
    for r in range(4):
        assert res.token_ids[r] == int(logits[r].argmax())
        top = torch.topk(lsm[r], 5)
        assert res.top_ids[r] == top.indices.tolist()
        assert max(abs(a - b) for a, b in zip(res.top_logprobs[r], top.values.tolist())) < 1e-4


def _top20(n: int) -> SamplingRows:
    g = SamplingRows.greedy(n)
    return SamplingRows(g.temperature, g.top_p, g.top_k, g.seed, g.counter, (20,) * n)


def decode_script(num_slots: int, num_blocks: int, block_size: int, steps: int = 6):
    """Three prompts prefilled on the stock path, then decode-only specialized steps of 3, 2
    and 1 sequences, as an engine sends them."""
    from raydecode.engine.cache import BlockAllocator
    from raydecode.engine.scheduler import StepPlan
    from raydecode.models.cache import SeqSlice, StepBatch

    blocks = BlockAllocator(num_blocks, block_size)
    gen = torch.Generator().manual_seed(3)
    lens = {0: 5, 1: 9, 2: 3}
    seqs, at, tables = [], 0, {}
    for s, n in lens.items():
        blocks.ensure(s, n)
        tables[s] = list(blocks.tables[s])
        seqs.append(SeqSlice(s, at, n, 0))
        at += n
    plans = [StepPlan(0, StepBatch(seqs), torch.randint(0, 400, (at,), generator=gen).tolist(),
                      [q.end - 1 for q in seqs], tables, list(lens), "stock")]
    pos = dict(lens)
    for i in range(steps):
        live = [0, 1, 2][: 3 - i // 2]
        changed = {s: list(blocks.tables[s]) for s in live if blocks.ensure(s, pos[s] + 1)}
        plans.append(StepPlan(i + 1, StepBatch.decode(live, [pos[s] for s in live]),
                              torch.randint(0, 400, (len(live),), generator=gen).tolist(),
                              list(range(len(live))), changed, [], "specialized"))
        for s in live:
            pos[s] += 1
    return plans


def test_tp1_replica_replays_captured_graphs():
    import copy

    from raydecode.actors.config import parse_deploy_config
    from raydecode.actors.coordinator import build_executor
    from raydecode.engine.engine import EngineConfig
    from raydecode.engine.runner import ModelRunner
    from raydecode.engine.step_graph import GraphedRunner
    from raydecode.models.k3 import make_caches

    cfg = parse_deploy_config({"model": "tiny", "dtype": "bfloat16", "max_num_seqs": 4,
                               "max_model_len": 64, "block_size": 4,
                               "placement": {"profile": "development"}})
    ex = build_executor(cfg)
    r = ex.runner
    assert isinstance(r, GraphedRunner) and r.capture and sorted(r.graphs) == [1, 2, 4]
    assert all(ex.specialized_ready(n) for n in (1, 2, 3, 4))
    ecfg = EngineConfig(max_num_seqs=4, max_model_len=64, block_size=4)
    eager = ModelRunner(r.model, make_caches(r.model.cfg, r.model.par, 4, ecfg.blocks, 4,
                                             torch.bfloat16, device="cuda"), "cuda")
    plans = decode_script(4, ecfg.blocks, 4)
    before = r.counts["graphed"]
    for p in plans:
        p.sampling = _top20(len(p.sample_rows))
        got = ex.execute(copy.deepcopy(p))
        want = eager.execute(copy.deepcopy(p))
        assert isinstance(got, StepResult) and len(got.token_ids) == len(p.sample_rows)
        a, b = torch.tensor(got.top_logprobs), torch.tensor(want.top_logprobs)
        assert float((a - b).abs().max() / b.abs().max()) < TOL, p.step_id
    n_decode = sum(p.path == "specialized" for p in plans)
    assert r.counts["graphed"] - before == n_decode > 0
