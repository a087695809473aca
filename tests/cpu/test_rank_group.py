"""TP rank groups on real Ray actors and a real gloo group (tiny checkpoint, CPU):
TP = 2 and 4 greedy decodes equal TP = 1; the specialized step equals the stock step through the
actors; DCP = 2 and 4 (TP = 4) equal DCP = 1; deadlines and a killed rank become RankFailure.

One Ray instance for the module and at most one rank group alive at a time: spawning rank
processes (importing torch) is the expensive part on a 2-core machine, so the TP = 4 group is
re-laid out in place for each DCP size; tests run in file order and share groups.
"""
import pytest
import ray
import torch

from raydecode.actors.rank_group import RankFailure, make_rank_group_executor
from raydecode.engine.cache import BlockAllocator
from raydecode.engine.engine import EngineConfig, LLMEngine, LocalExecutor
from raydecode.engine.loader import load_shard, load_tokenizer
from raydecode.engine.request import SamplingParams
from raydecode.engine.runner import ModelRunner
from raydecode.engine.sampling import SamplingRows
from raydecode.engine.scheduler import StepPlan
from raydecode.models.cache import SeqSlice, StepBatch

torch.set_num_threads(1)

PROMPTS = ["hello there", "Ray"]
N_DECODE = 64          # decode steps of the TP runs (max_tokens = 1 from prefill + 64)
N_DCP = 24             # decode steps of the DCP runs
BLOCK, MAX_LEN, SLOTS = 4, 96, 2
STEP_TIMEOUT_S = 60.0


class Groups:
    """At most one live group: one per TP size, re-laid out in place for another DCP size;
    asking for another TP size closes the current group."""

    def __init__(self):
        self.ex, self.pg = None, None

    def get(self, tp: int, dcp: int, placement_group=None):
        if self.ex is None or self.ex.tp_size != tp:
            self.close()
            self.pg = placement_group
            self.ex = make_rank_group_executor(
                "tiny", tp, dcp, "float32", SLOTS, engine_cfg(1).blocks, BLOCK,
                STEP_TIMEOUT_S, placement_group, num_cpus_per_rank=0.5)
        elif self.ex.dcp_size != dcp:
            self.ex.set_dcp(dcp)
        return self.ex

    def close(self):
        if self.ex is not None:
            self.ex.close()
        if self.pg is not None:
            ray.util.remove_placement_group(self.pg)
        self.ex, self.pg = None, None


@pytest.fixture(scope="module")
def groups():
    ray.init(address="local", num_cpus=4, include_dashboard=False,
             object_store_memory=100 * 2**20, log_to_driver=False)
    g = Groups()
    yield g
    g.close()
    ray.shutdown()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


def engine_cfg(dcp: int) -> EngineConfig:
    return EngineConfig(max_num_seqs=SLOTS, max_model_len=MAX_LEN, block_size=BLOCK,
                        dcp_size=dcp)


def greedy(executor, tok, dcp: int, n_decode: int) -> list[list[int]]:
    eng = LLMEngine(executor, tok, engine_cfg(dcp), eos_ids=(497,))
    reqs = eng.generate(PROMPTS, SamplingParams(max_tokens=n_decode + 1, temperature=0.0,
                                                ignore_eos=True))
    assert eng.stats["steps"] == n_decode + 1          # one prefill step, then decode steps
    return [r.output_ids for r in reqs]


@pytest.fixture(scope="module")
def tp1_tokens(tok):
    shard = load_shard("tiny", num_slots=SLOTS, num_blocks=engine_cfg(1).blocks,
                       block_size=BLOCK)
    out = greedy(LocalExecutor(ModelRunner(shard.model, shard.caches)), tok, 1, N_DECODE)
    assert all(len(o) == N_DECODE + 1 for o in out) and out[0] != out[1]
    return out


def TOP20(n: int) -> SamplingRows:
    """n greedy rows that also return their top-20 logprobs."""
    g = SamplingRows.greedy(n)
    return SamplingRows(g.temperature, g.top_p, g.top_k, g.seed, g.counter, (20,) * n)


class ForceSpecialized:
    """Runs every decode-only step of the engine on the specialized path."""

    def __init__(self, inner):
        self.inner = inner

    def execute(self, plan: StepPlan) -> torch.Tensor:
        if plan.batch.is_decode_only:
            plan.path = "specialized"
        return self.inner.execute(plan)


def specialized_counts(ex) -> list[int]:
    return [s["steps"]["specialized"] for s in ex.stats()]


def check_specialized_step_equals_stock(ex, tok, dcp: int, n_steps: int = 3) -> None:
    """Two slots prefilled with the same prompt; each decode position runs stock on slot 0
    and specialized on slot 1 with the same token: the greedy tokens and the top-20 logprobs
    rank 0 returns (no logits leave the ranks) must agree (fp32 < 1e-4)."""
    prompt = tok.encode(PROMPTS[0])
    P = len(prompt)
    blocks = BlockAllocator(1, BLOCK, dcp).blocks_for(P + n_steps)
    tables = {0: list(range(blocks)), 1: list(range(blocks, 2 * blocks))}
    before = specialized_counts(ex)
    pre = ex.execute(StepPlan(step_id=1000, batch=StepBatch([SeqSlice(0, 0, P, 0),
                                                             SeqSlice(1, P, P, 0)]),
                              tokens=prompt * 2, sample_rows=[P - 1, 2 * P - 1],
                              block_tables=tables, reset_slots=[0, 1], sampling=TOP20(2)))
    assert pre.token_ids[0] == pre.token_ids[1] and pre.top_ids[0] == pre.top_ids[1]
    torch.testing.assert_close(torch.tensor(pre.top_logprobs[0]),
                               torch.tensor(pre.top_logprobs[1]))
    nxt = pre.token_ids[0]
    for i in range(n_steps):
        plans = [StepPlan(step_id=1001 + 2 * i + j, batch=StepBatch.decode([j], [P + i]),
                          tokens=[nxt], sample_rows=[0], block_tables={}, reset_slots=[],
                          path=path, sampling=TOP20(1))
                 for j, path in enumerate(("stock", "specialized"))]
        stock, spec = (ex.execute(p) for p in plans)
        assert spec.token_ids == stock.token_ids and spec.top_ids == stock.top_ids, i
        a, b = torch.tensor(spec.top_logprobs), torch.tensor(stock.top_logprobs)
        rel = float((a - b).abs().max() / b.abs().max())
        assert rel < 1e-4, (i, rel)
        nxt = stock.token_ids[0]
    assert [a - b for a, b in zip(specialized_counts(ex), before)] == [n_steps] * ex.tp_size


# ---- TP = 2 ----------------------------------------------------------------------------------

def test_tp2_greedy_equals_tp1(groups, tok, tp1_tokens):
    pg = ray.util.placement_group([{"CPU": 0.5}] * 2)     # bundle i hosts rank i
    ray.get(pg.ready(), timeout=STEP_TIMEOUT_S)
    ex = groups.get(2, 1, pg)
    assert ex.specialized_ready(2) and ex.tp_size == 2 and ex.dcp_size == 1
    assert [s["placement_group"] for s in ex.stats()] == [pg.id.hex()] * 2
    assert greedy(ex, tok, 1, N_DECODE) == tp1_tokens


def test_tp2_specialized_step_equals_stock(groups, tok):
    check_specialized_step_equals_stock(groups.get(2, 1), tok, dcp=1)


def test_tp2_forced_specialized_decode_equals_stock(groups, tok, tp1_tokens):
    ex = groups.get(2, 1)
    before = specialized_counts(ex)
    assert greedy(ForceSpecialized(ex), tok, 1, N_DECODE) == tp1_tokens
    # every decode step reached every rank's runner on the specialized path
    assert [a - b for a, b in zip(specialized_counts(ex), before)] == [N_DECODE] * 2


def test_unknown_path_is_refused_before_the_ranks(groups, tok):
    ex = groups.get(2, 1)
    before = ex.stats()
    plan = StepPlan(step_id=50, batch=StepBatch.decode([0], [3]), tokens=[1], sample_rows=[0],
                    block_tables={0: [0]}, reset_slots=[0], path="fast")
    with pytest.raises(ValueError, match="path = 'fast'; accepted: stock, specialized"):
        ex.execute(plan)
    assert ex.healthy and [s["steps"] for s in ex.stats()] == [s["steps"] for s in before]


def test_step_deadline_names_the_step_and_marks_the_group_unhealthy(groups, tok):
    ex = groups.get(2, 1)
    prompt = tok.encode(PROMPTS[1])
    plan = StepPlan(step_id=77, batch=StepBatch([SeqSlice(0, 0, len(prompt), 0)]),
                    tokens=prompt, sample_rows=[len(prompt) - 1],
                    block_tables={0: [0, 1]}, reset_slots=[0])
    with pytest.raises(RankFailure, match=r"rank\(s\) \[0, 1\] did not finish step 77 "
                                          r"\(stock\) within 1e-06 s") as e:
        ex.execute(plan, timeout_s=1e-6)
    assert e.value.ranks == [0, 1] and not ex.healthy and not ex.specialized_ready(1)
    with pytest.raises(RankFailure, match="unhealthy; step 78 not run"):
        ex.execute(StepPlan(78, plan.batch, plan.tokens, plan.sample_rows, {}, []))
    groups.close()


# ---- TP = 4, DCP ∈ {1, 2, 4} -----------------------------------------------------------------

def test_tp4_greedy_equals_tp1(groups, tok, tp1_tokens):
    assert greedy(groups.get(4, 1), tok, 1, N_DECODE) == tp1_tokens


def test_tp4_specialized_step_equals_stock(groups, tok):
    check_specialized_step_equals_stock(groups.get(4, 1), tok, dcp=1)


@pytest.mark.parametrize("dcp", [2, 4])
def test_dcp_greedy_equals_dcp1(groups, tok, tp1_tokens, dcp):
    ex = groups.get(4, dcp)
    assert ex.dcp_size == dcp and ex.healthy
    # tp1_tokens == the TP=4, DCP=1 tokens (test_tp4_greedy_equals_tp1)
    assert greedy(ex, tok, dcp, N_DCP) == [t[:N_DCP + 1] for t in tp1_tokens]


def test_dcp4_specialized_step_equals_stock(groups, tok):
    check_specialized_step_equals_stock(groups.get(4, 4), tok, dcp=4)


def test_killed_rank_fails_the_step_naming_it_and_close_cleans_up(groups, tok):
    import time

    ex = groups.get(4, 4)
    eng = LLMEngine(ex, tok, engine_cfg(4), eos_ids=(497,))
    for p in PROMPTS:
        eng.add_request(p, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    eng.step()
    eng.step()
    ray.kill(ex.workers[2], no_restart=True)
    t0 = time.monotonic()
    # ranks 0, 1 and 3 block inside the step's first all-reduce, waiting for rank 2
    with pytest.raises(RankFailure, match=r"could not finish step 3 \(stock\): rank 2 died") \
            as e:
        eng.step()
    # failed at rank 2's death, not at the deadline the blocked survivors would have run into
    assert time.monotonic() - t0 < STEP_TIMEOUT_S / 2
    assert e.value.ranks[0] == 2 and not ex.healthy
    workers = list(ex.workers)
    groups.close()
    for w in workers:     # every rank actor is gone, the blocked ones included
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(w.ping.remote(), timeout=STEP_TIMEOUT_S)


def test_the_deployments_decode_section_reaches_every_rank(groups):
    """decode: options and oneshot_allreduce travel to the ranks in the ShardSpec / group
    options: every rank's model is built with them."""
    from raydecode.actors.config import parse_deploy_config

    groups.close()
    cfg = parse_deploy_config({"model": "tiny", "decode": {"skinny_max_m": 0,
                                                           "oneshot_allreduce": False}})
    ex = make_rank_group_executor("tiny", 2, 1, "float32", SLOTS, engine_cfg(1).blocks, BLOCK,
                                  STEP_TIMEOUT_S, num_cpus_per_rank=0.5,
                                  decode=cfg.decode_options(),
                                  oneshot_allreduce=cfg.decode.oneshot_allreduce)
    try:
        stats = ex.stats()
        assert [s["oneshot_allreduce"] for s in stats] == [False, False]
        assert all("skinny_max_m=0" in s["decode_options"] for s in stats)
    finally:
        ex.close()
