"""Prefix caching for the hybrid cache and n > 1 forks (engine/prefix_cache.py,
engine/scheduler.py, the copies in engine/runner.py) on the tiny K3 model, TP 1, CPU.

Bookkeeping first (refcounts, the prefix registry, lookup rules, LRU eviction, DCP spans),
then real engines: a follow-up turn restored from a snapshot generates exactly what the same
engine generates without caching (fp32 greedy; and bit for bit in bf16 through a GraphedRunner
whose decode steps run graph-shaped, where the two runs chunk the prompt alike), n = 2 runs
one prefill, and a random workload of shared prefixes under a small block pool — evictions and
preemptions included — gives every request the tokens of an engine without caching, leaving
no block behind."""
from __future__ import annotations

import random

import pytest
import torch

from raydecode.engine.cache import BlockAllocator
from raydecode.engine.engine import EngineConfig, LLMEngine, LocalExecutor
from raydecode.engine.loader import build_local_engine, load_shard, load_tokenizer
from raydecode.engine.prefix_cache import PrefixCache, prefix_hashes, snapshot_ref
from raydecode.engine.request import Request, SamplingParams, sample_seed
from raydecode.engine.runner import ModelRunner
from raydecode.engine.scheduler import Scheduler, SchedulerConfig
from raydecode.engine.step_graph import GraphedRunner, graph_cache_sizes
from raydecode.models.config import load_config
from raydecode.models.k3 import K3ForCausalLM, init_random_, make_caches

torch.set_num_threads(1)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


# ---- bookkeeping -------------------------------------------------------------------------------
def test_blocks_are_refcounted_and_registered_once_per_prefix():
    a = BlockAllocator(8, block_size=4)
    a.ensure(0, 10)                                  # 3 blocks
    t0 = list(a.tables[0])
    a.share(1, t0[:2])                               # a fork / a hit: the full blocks shared
    assert [a.refs[b] for b in t0] == [2, 2, 1] and a.num_free == 5
    h = prefix_hashes(list(range(10)), 4, 2)
    assert a.register(t0[0], h[1]) == t0[0] and a.register(t0[1], h[2]) == t0[1]
    a.ensure(2, 4)
    assert a.register(a.tables[2][0], h[1]) == t0[0]     # the same prefix keeps one block
    a.release(0)
    assert [a.refs[b] for b in t0] == [1, 1, 0] and a.num_free == 5
    a.release(1)
    assert a.num_free == 7 and a.by_hash == {} and a.hash_of == {}   # freed: hashes forgotten


def test_prefix_hashes_chain_the_blocks():
    x = list(range(100, 124))
    h = prefix_hashes(x, 8, 3)
    assert len(h) == 4 and h[0] == b"" and len(set(h)) == 4
    assert prefix_hashes(x[:16] + [0] * 8, 8, 3)[:3] == h[:3]        # equal prefixes agree
    assert prefix_hashes([1] + x[1:], 8, 3)[3] != h[3]               # the chain carries block 0


@pytest.mark.parametrize("dcp", [1, 2])
def test_lookup_takes_the_longest_ready_prefix_within_the_limit(dcp):
    blocks = BlockAllocator(64, block_size=4, dcp_size=dcp)
    pc = PrefixCache(blocks, num_snapshots=4)
    span = blocks.span                                   # 4 · dcp tokens per full block
    toks = list(range(1, 41))
    blocks.ensure(0, 40)
    table = blocks.tables[0]
    s13 = pc.save(toks[:13], table)
    s24 = pc.save(toks[:24], table)
    assert pc.save(toks[:13], table) is None             # cached already: no second copy
    assert pc.save(toks[:span - 1], table) is None       # shorter than one block: not worth it
    assert len(s13.blocks) == 13 // span and len(s13.tail) == 13 % span
    assert (s13.tail_block is None) == (13 % span == 0)
    assert s24.blocks[:len(s13.blocks)] == s13.blocks     # registered once, held twice
    assert pc.lookup(toks, 39) is None                    # not ready: its save not shipped
    s13.ready = s24.ready = True
    assert pc.lookup(toks, 39) is s24 and pc.lookup(toks, 23) is s13
    assert pc.lookup(toks[:20] + [0] * 20, 39) is s13     # diverges before 24
    other = toks[:12] + [99] + toks[13:]
    assert pc.lookup(other, 39) is None                   # position 12 differs: s13's tail
    kda, blk = pc.save_ops(s13, 3, table)
    assert kda == (3, snapshot_ref(s13.index)) and snapshot_ref(0) == -1
    assert blk == ((table[13 // span], s13.tail_block) if s13.tail_block is not None else None)
    pc.record(s24)
    pc.record(None)
    assert pc.stats.as_dict() | {"saves": 2} == {"queries": 2, "hits": 1, "hit_tokens": 24,
                                                 "saves": 2, "evictions": 0, "skipped": 0}


def test_least_recently_used_snapshots_go_first_and_free_their_blocks():
    blocks = BlockAllocator(16, block_size=4)
    pc = PrefixCache(blocks, num_snapshots=2)
    snaps = []
    for s in range(3):                                    # 3 prefixes, 2 slots
        toks = [s * 100 + i for i in range(10)]
        blocks.ensure(s, 10)
        snaps.append(pc.save(toks, blocks.tables[s]))
        snaps[-1].ready = True
    assert pc.num_cached == 2 and pc.stats.evictions == 1 and snaps[0] not in pc.lru.values()
    for s in range(3):
        blocks.release(s)
    # what is left is what the two snapshots hold: 2 full blocks + 1 tail copy each
    assert blocks.num_free == 16 - 2 * 3
    hit = pc.lookup([100 + i for i in range(10)] + [7], 10)
    assert hit is snaps[1]
    pc.record(hit)                                         # used: the most recent now
    assert pc.evict_one() and pc.num_cached == 1 and snaps[2] not in pc.lru.values()
    assert pc.evict_one() and not pc.evict_one() and blocks.num_free == 16


def test_samples_get_distinct_seeds_and_sample_0_keeps_the_requests():
    seeds = [sample_seed(7, i) for i in range(64)]
    assert seeds[0] == 7 and len(set(seeds)) == 64 and all(0 <= s < 2**64 for s in seeds)
    assert sample_seed(8, 1) != sample_seed(7, 1)


def test_scheduler_forks_share_the_prompt_and_copy_the_partial_block():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, num_blocks=32,
                                  block_size=4))
    p = Request(prompt_ids=list(range(1, 11)), params=GREEDY)
    kids = [Request(prompt_ids=list(p.prompt_ids), params=GREEDY, request_id=f"{p.request_id}#"
                    f"{i}", sample_index=i, fork_of=p) for i in (1, 2)]
    p.forks = list(kids)
    s.add(p)
    plan = s.schedule()
    assert plan.sample_rows == [9, 9, 9] and plan.forked_ids == [k.request_id for k in kids]
    pt = s.blocks.tables[p.slot]
    for k in kids:
        kt = s.blocks.tables[k.slot]
        assert kt[:2] == pt[:2] and kt[2] != pt[2] and k.num_cached == 10
    assert plan.state_copies == [] and plan.reset_slots == [p.slot]
    p.num_cached = 10
    for r in (p, *kids):
        r.output_ids.append(5)
    nxt = s.schedule()                                    # the forks' copies ship now
    assert nxt.state_copies == [(p.slot, k.slot) for k in kids]
    assert nxt.block_copies == [(pt[2], s.blocks.tables[k.slot][2]) for k in kids]
    assert [s.blocks.refs[b] for b in pt] == [3, 3, 1]


# ---- engines -----------------------------------------------------------------------------------
def _engine(on: bool, **kw) -> LLMEngine:
    return build_local_engine("tiny", max_model_len=kw.pop("max_model_len", 512),
                              enable_prefix_caching=on, num_snapshots=8 if on else 0, **kw)


def _turns(n_prefix: int, seed: int = 0) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    return ([rng.randrange(3, 490) for _ in range(n_prefix)],
            [rng.randrange(3, 490) for _ in range(9)])


@pytest.mark.parametrize("block_size", [16, 7])       # restored at a block end / mid-block
def test_follow_up_turn_restored_from_cache_equals_recompute(block_size):
    turn1, new = _turns(150)
    outs = {}
    for on in (False, True):
        eng = _engine(on, block_size=block_size, max_num_batched_tokens=64)
        r1 = eng.generate([turn1], GREEDY)[0]
        before = eng.stats["prefill_tokens"]
        turn2 = turn1 + r1.output_ids + new              # the agent's next turn
        r2 = eng.generate([turn2], GREEDY)[0]
        repeat = eng.generate([turn2], GREEDY)[0]         # the same prompt again
        outs[on] = (r1.output_ids, r2.output_ids, repeat.output_ids)
        if on:
            # the finished first turn's snapshot: its prompt and all but its last output token
            assert r2.cached_prompt_tokens == len(turn1) + len(r1.output_ids) - 1
            assert eng.stats["prefill_tokens"] - before < len(turn2) // 2
            assert repeat.cached_prompt_tokens >= len(turn2) - 64    # the aligned chunk end
            st = eng.cache_stats()
            assert st["hits"] == 2 and st["snapshots"] <= 8
        else:
            assert r2.cached_prompt_tokens == 0
    assert outs[True] == outs[False]


class Specialized:
    """Decode steps at pos > 0 on the specialized path (graph-shaped on a GraphedRunner)."""

    def __init__(self, inner):
        self.inner = inner

    def execute(self, plan):
        if plan.batch.is_decode_only and all(s.pos > 0 for s in plan.batch.seqs):
            plan.path = "specialized"
        return self.inner.execute(plan)


def test_graphed_runner_restores_bit_for_bit():
    """bf16, decode graph-shaped (the CPU statics path): the same first-turn prompt ends at
    the same chunk boundary with and without caching (budget = its length), so a follow-up
    that resumes at the prompt's end must generate the same tokens exactly."""
    model = init_random_(K3ForCausalLM(load_config("tiny"), dtype=torch.bfloat16), seed=3)
    tok = load_tokenizer("tiny")
    turn1, new = _turns(96, seed=1)
    got = {}
    for on in (False, True):
        ecfg = EngineConfig(max_num_seqs=2, max_model_len=256, block_size=16,
                            max_num_batched_tokens=len(turn1), enable_prefix_caching=on,
                            num_snapshots=4 if on else 0)
        ns, nb = graph_cache_sizes(2, ecfg.blocks, (1, 2))
        caches = make_caches(model.cfg, model.par, ns, nb, 16, torch.bfloat16,
                             num_snapshots=ecfg.num_snapshots)
        runner = GraphedRunner(model, caches, num_slots=2, num_blocks=ecfg.blocks,
                               buckets=(1, 2))
        eng = LLMEngine(Specialized(LocalExecutor(runner)), tok, ecfg, eos_ids=())
        r1 = eng.generate([turn1], GREEDY)[0]
        r2 = eng.generate([turn1 + new], GREEDY)[0]      # a different follow-up of turn 1
        got[on] = (r1.output_ids, r2.output_ids)
        assert runner.counts["eager_statics"] >= 2 * (GREEDY.max_tokens - 1)
        assert r2.cached_prompt_tokens == (len(turn1) if on else 0)
    assert got[True] == got[False]


def test_n2_runs_one_prefill_and_samples_with_distinct_seeds():
    prompt, _ = _turns(120, seed=2)
    P = len(prompt)
    eng = _engine(False, max_num_batched_tokens=64)
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=11, ignore_eos=True)
    a = eng.add_request(prompt, seeded, request_id="g", forks=["g#1"])
    b = eng.requests["g#1"]
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert eng.stats["prefill_tokens"] == P and eng.cache_stats()["forks"] == 1   # one prefill
    assert {o.index for o in outs if o.request_id == "g#1"} == {1}
    assert b.sample_seed == sample_seed(11, 1) != a.sample_seed == 11
    assert len(a.output_ids) == len(b.output_ids) == 10 and a.output_ids != b.output_ids
    solo = _engine(False, max_num_batched_tokens=64).generate([prompt], seeded)[0]
    assert solo.output_ids == a.output_ids               # sample 0 is the n = 1 answer
    # greedy: both samples are the greedy answer; a fork ending at its first token too
    eng2 = _engine(True, max_num_batched_tokens=64)
    g = eng2.add_request(prompt, GREEDY, forks=["x#1", "x#2"])
    one = eng2.add_request(prompt[:40], SamplingParams(max_tokens=1, temperature=0.0),
                           forks=["y#1"])
    while eng2.has_unfinished():
        eng2.step()
    ref = _engine(False).generate([prompt, prompt[:40]], GREEDY)
    for r in (g, eng2.requests["x#1"], eng2.requests["x#2"]):
        assert r.output_ids == ref[0].output_ids
    assert one.output_ids == eng2.requests["y#1"].output_ids == ref[1].output_ids[:1]


def test_forks_without_a_free_slot_prefill_alone():
    prompt, _ = _turns(40, seed=4)
    eng = _engine(False, max_num_seqs=1)
    eng.add_request(prompt, GREEDY, request_id="a", forks=["a#1"])
    while eng.has_unfinished():
        eng.step()
    assert eng.requests["a"].output_ids == eng.requests["a#1"].output_ids
    assert eng.stats["prefill_tokens"] == 2 * len(prompt) and eng.cache_stats()["forks"] == 0


@pytest.mark.parametrize("NB, min_hits, min_preempted", [(48, 4, 0), (24, 0, 1)])
def test_random_conversations_under_pressure_equal_no_cache_and_leak_nothing(
        NB, min_hits, min_preempted):
    """Conversations in waves: each turn is the last turn's prompt + its output + new
    tokens, or a branch of it; 6 of them on 4 slots, a pool of NB blocks of 4 (a sequence
    needs up to 18) and 8 snapshot slots (2 saves per turn: each conversation's newest demotes
    its older ones). At 48 blocks snapshots are evicted and hit; at 24 running sequences take
    every block (snapshots evicted first, then sequences preempted). Every request's greedy
    tokens equal those of the engine without caching; afterwards only snapshots hold blocks,
    and evicting them frees every block."""
    rng = random.Random(5)
    tok = load_tokenizer("tiny")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    new = lambda k: [rng.randrange(3, 490) for _ in range(k)]          # noqa: E731
    waves = [[new(rng.randint(12, 20)) for _ in range(6)]]
    res, engines = {}, {}
    for on in (False, True):
        ecfg = EngineConfig(max_num_seqs=4, max_model_len=72, block_size=4, num_blocks=NB,
                            max_num_batched_tokens=24, enable_prefix_caching=on,
                            num_snapshots=8 if on else 0)
        shard = load_shard("tiny", num_slots=4, num_blocks=NB, block_size=4,
                           num_snapshots=ecfg.num_snapshots)
        engines[on] = LLMEngine(LocalExecutor(ModelRunner(shard.model, shard.caches)), tok,
                                ecfg, eos_ids=())
        res[on] = []
    for w in range(3):
        for on, eng in engines.items():
            reqs = []
            for i, p in enumerate(waves[w]):              # arrivals spread over the steps
                reqs.append(eng.add_request(p, params))
                for _ in range(i % 3):
                    eng.step()
            while eng.has_unfinished():
                eng.step()
            res[on].append([r.output_ids for r in reqs])
        assert res[True][w] == res[False][w], w
        nxt = []
        for p, out in zip(waves[w], res[False][w]):       # the next turn, or a branch
            nxt.append(p + (out if rng.random() < 0.7 else []) + new(rng.randint(2, 6)))
        waves.append(nxt)
    eng = engines[True]
    st, blocks = eng.cache_stats(), eng.scheduler.blocks
    assert st["hits"] >= min_hits and st["evictions"] >= 1, st
    assert eng.scheduler.num_preemptions >= min_preempted
    assert engines[False].scheduler.num_preemptions >= min_preempted
    if min_hits:
        assert st["prefill_tokens"] < engines[False].stats["prefill_tokens"] * 0.8
    held = {b for s in eng.scheduler.prefix.lru.values()
            for b in s.blocks + [s.tail_block] if b is not None}
    assert {b for b, r in enumerate(blocks.refs) if r} == held
    while eng.scheduler.prefix.evict_one():
        pass
    for e in engines.values():
        b = e.scheduler.blocks
        assert b.num_free == NB and not any(b.refs) and b.by_hash == {}


def test_speculative_engines_run_n2_as_two_requests_and_refuse_caching():
    from raydecode.engine.spec_engine import SpecConfig, SpecEngine, build_local_spec_engine

    eng = build_local_spec_engine("tiny", num_drafts=3, max_num_seqs=2, max_model_len=128)
    prompt, _ = _turns(20, seed=6)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=4, ignore_eos=True)
    a = eng.add_request(prompt, seeded, forks=["s#1"])
    while eng.has_unfinished():
        eng.step()
    b = eng.requests["s#1"]
    assert eng.stats["prefill_tokens"] == 2 * len(prompt) and eng.cache_stats()["forks"] == 0
    assert len(a.output_ids) == len(b.output_ids) == 8 and a.output_ids != b.output_ids
    with pytest.raises(ValueError, match="not supported with speculative decoding"):
        SpecEngine(None, None, EngineConfig(enable_prefix_caching=True, num_snapshots=2), (),
                   SpecConfig(3))
