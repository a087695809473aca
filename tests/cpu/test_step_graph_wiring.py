"""Step graphs wired into the rank workers (actors/rank_worker.py, actors/rank_group.py), tiny
model, bf16, CPU: a RankWorker whose ShardSpec has step_graphs builds a GraphedRunner on caches
with the scratch rows, runs `capture_all` at build (eagerly here; CUDA capture is
tests/gpu/test_step_graph_gpu.py) and reports the buckets; its logits over a fixed plan script
equal the same script with graphs off. TP = 1 in this process, TP = 2 (DCP 1 and 2) in two
spawned processes over gloo; the driver side (RAYDECODE_STEP_GRAPHS -> ShardSpec, the
specialized_ready bucket rule) on one small Ray group."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import uuid

import pytest
import ray
import torch
import torch.multiprocessing as mp

from raydecode.actors.rank_group import GroupReadiness, make_rank_group_executor
from raydecode.actors.rank_worker import RankWorker, ShardSpec, load_runner
from raydecode.engine.cache import BlockAllocator, SlotAllocator
from raydecode.engine.engine import EngineConfig
from raydecode.engine.runner import ModelRunner
from raydecode.engine.scheduler import StepPlan
from raydecode.engine.step_graph import (ENV, GraphedRunner, prefill_bucket, prefill_buckets,
                                         setting)
from raydecode.models.cache import SeqSlice, StepBatch

from _numerics import max_rel_err

torch.set_num_threads(1)
SLOTS, BS, MAX_LEN = 5, 4, 32     # buckets (1, 2, 4, 8): 3 scratch slots; 8 blocks per seq
# max-abs relative, logits. The padded (bucket B) and plain (T rows) CPU paths block their
# GEMMs differently: fp32 KDA states drift by ~1e-7 and a bf16 rounding may flip downstream.
# Observed: every step equal bit for bit but one (5.9e-3, one row, TP1); a stale table row or
# a scratch row on a live slot moves the logits by 0.5..1 or raises.
# On a CUDA host the TP1 tests capture for real (the graph's table width may change the MLA
# split-KV count, the MoE kernels sum with fp32 atomics): tests/gpu/test_step_graph_gpu.py's 3e-2.
ON_CUDA = torch.cuda.is_available()
TOL = 3e-2 if ON_CUDA else 2e-2
TIMEOUT_S = 60.0
CPU_ONLY = pytest.mark.skipif(ON_CUDA, reason="CPU wiring test: ranks on one host share GPU 0 "
                              "here (TP2 on GPUs: tests/gpu/test_oneshot_model_step.py)")


def num_blocks(dcp: int) -> int:
    return EngineConfig(max_num_seqs=SLOTS, max_model_len=MAX_LEN, block_size=BS,
                        dcp_size=dcp).blocks


def spec(step_graphs: bool | None, dcp: int = 1, pad_budget: int | None = None) -> ShardSpec:
    """pad_budget: stock steps padded to their token bucket, buckets up to it warmed."""
    return ShardSpec(model="tiny", dtype="bfloat16", num_slots=SLOTS,
                     num_blocks=num_blocks(dcp), block_size=BS, max_model_len=MAX_LEN,
                     step_graphs=step_graphs, pad_prefill=pad_budget is not None,
                     prefill_budget=pad_budget)


def script(dcp: int, seed: int = 0) -> list[StepPlan]:
    """What an engine sends: 5 prefills, decode-only specialized steps of 5 (bucket 8, 3
    scratch rows), 3, 2 and 1 sequences across block boundaries, a stock decode, a released
    slot reused by a new prefill, then a full decode step again."""
    slots, blocks = SlotAllocator(SLOTS), BlockAllocator(num_blocks(dcp), BS, dcp)
    gen = torch.Generator().manual_seed(seed)
    pos: dict[int, int] = {}
    plans: list[StepPlan] = []

    def plan(seqs, changed, reset, path):
        T = sum(s.length for s in seqs)
        toks = torch.randint(0, 512, (T,), generator=gen).tolist()
        plans.append(StepPlan(len(plans), StepBatch(seqs), toks, [s.end - 1 for s in seqs],
                              changed, reset, path))

    def admit(lengths):
        seqs, changed, new, at = [], {}, [], 0
        for n in lengths:
            s = slots.allocate()
            blocks.ensure(s, n)
            changed[s] = list(blocks.tables[s])
            seqs.append(SeqSlice(s, at, n, 0))
            at, pos[s] = at + n, n
            new.append(s)
        plan(seqs, changed, new, "stock")
        return new

    def decode(sl, path="specialized"):
        changed = {s: list(blocks.tables[s]) for s in sl if blocks.ensure(s, pos[s] + 1)}
        plan(StepBatch.decode(sl, [pos[s] for s in sl]).seqs, changed, [], path)
        for s in sl:
            pos[s] += 1

    a, b, c, d, e = admit([3, 6, 2, 7, 4])
    for sl in ([a, b, c, d, e], [a, b, c, d, e], [c, a, e], [b, d], [d]):
        decode(sl)
    decode([a, b], "stock")
    blocks.release(b)
    slots.release(b)
    del pos[b]
    (f,) = admit([5])
    assert f == b
    decode([a, f, c, d, e])
    return plans


N_SPECIALIZED = 6          # decode steps of script() on the specialized path


def drive(w: RankWorker, plans: list[StepPlan]) -> list:
    """The plans as the executor sends them (each rank its own copy) -> rank 0's logits (a
    copy of what its runner handed the device sampler; the others: None). Every rank's step
    returns only sampled token ids (rank 0) or nothing."""
    seen, real = [], w.runner.logits

    def spy(plan):
        out = real(plan)
        seen.append(out.detach().clone())
        return out

    w.runner.logits = spy
    try:
        results = [w.step(copy.deepcopy(p)) for p in plans]
    finally:
        del w.runner.logits
    if w.par.tp_rank != 0:
        assert results == [None] * len(plans)
        return [None] * len(plans)
    for p, r, x in zip(plans, results, seen):
        assert r.token_ids == x.argmax(-1).tolist(), p.step_id     # greedy rows on the device
    return seen


def check_equal(on: list, off: list, plans: list[StepPlan], what: str) -> None:
    for p, x, y in zip(plans, on, off, strict=True):
        assert x.shape == y.shape == (len(p.sample_rows), 512), (what, p.step_id)
        assert torch.isfinite(x).all(), (what, p.step_id)
        assert max_rel_err(x, y) < TOL, f"{what}, step {p.step_id}: {max_rel_err(x, y)}"


def check_graphed(w: RankWorker, info: dict, dcp: int) -> None:
    r = w.runner
    assert type(r) is GraphedRunner
    assert info["graph_buckets"] == [1, 2, 4, 8] and info["graph_failed"] is None
    # scratch rows allocated beyond the scheduler's counts; table width ⌈⌈32/D⌉/4⌉
    assert r.caches.kda.conv.shape[1] == SLOTS + 3
    assert r.caches.mla.pool.shape[1] == num_blocks(dcp) + 1
    assert r.scratch.num_slots == SLOTS and r.scratch.block == num_blocks(dcp)
    assert r.max_blocks == -(-(-(-MAX_LEN // dcp)) // BS)


def check_plain(w: RankWorker, info: dict, dcp: int) -> None:
    assert type(w.runner) is ModelRunner
    assert info["graph_buckets"] is None and info["graph_failed"] is None
    assert w.runner.caches.kda.conv.shape[1] == SLOTS
    assert w.runner.caches.mla.pool.shape[1] == num_blocks(dcp)


# ---- TP = 1 in this process -------------------------------------------------------------------

@contextlib.contextmanager
def tp1_worker(shard: ShardSpec):
    """A TP = 1 RankWorker through its real rendezvous (a world-1 gloo group here)."""
    w = RankWorker(0, 1, 1, functools.partial(load_runner, shard),
                   f"wiring-{uuid.uuid4().hex[:8]}")
    host, port = w.open_store(TIMEOUT_S)
    try:
        yield w, w.init_group(host, port, TIMEOUT_S)
    finally:
        w.shutdown()


def run_tp1(step_graphs: bool, plans: list[StepPlan]):
    with tp1_worker(spec(step_graphs)) as (w, info):
        (check_graphed if step_graphs else check_plain)(w, info, 1)
        logits = drive(w, plans)
        counts = dict(w.runner.counts) if step_graphs else None
        return info, logits, counts, dict(w.steps)


def test_tp1_worker_graphs_on_equal_off():
    plans = script(1)
    info_on, on, counts, steps = run_tp1(True, plans)
    info_off, off, _, steps_off = run_tp1(False, plans)
    check_equal(on, off, plans, "TP1")
    n, k = len(plans), N_SPECIALIZED      # CUDA: captured at build, then every step replays
    # the stock graphs (RAYDECODE_STOCK_GRAPHS, default 512) need a graph backend: none on
    # the CPU; on CUDA they capture at the build, which these counts do not cover
    stock = ("stock_graphed", "stock_captured", "stock_single", "stock_mixed")
    got = {key: v for key, v in counts.items() if key not in stock or not ON_CUDA}
    assert got == ({"graphed": k, "eager_statics": 0, "plain": n - k, "captured": 4,
                    "padded": 0} if ON_CUDA else
                   {"graphed": 0, "eager_statics": k, "plain": n - k, "captured": 0,
                    "padded": 0, **{key: 0 for key in stock}})
    assert steps == steps_off == {"stock": n - k, "specialized": k}
    on_ready = GroupReadiness.from_infos([info_on])
    off_ready = GroupReadiness.from_infos([info_off])
    assert on_ready.graph_buckets == {1, 2, 4, 8} and off_ready.graph_buckets is None
    assert [on_ready.specialized_ready(k) for k in (1, 3, 5, 8, 9, 64)] == [True] * 4 + [False] * 2
    assert all(off_ready.specialized_ready(k) for k in (1, 5, 9, 64, 65, 1000))


def test_tp1_worker_padded_stock_steps_equal_unpadded():
    """ShardSpec.pad_prefill: the rank warms every padded bucket up to the budget at build,
    then its stock steps run padded (engine/step_graph.py) with the unpadded logits."""
    plans = script(1)
    with tp1_worker(spec(True, pad_budget=64)) as (w, info):
        warmed = w.runner.counts["padded"]
        assert w.runner.pad_prefill and warmed == len(prefill_buckets(64))
        padded = drive(w, plans)
        stepped = w.runner.counts["padded"] - warmed
    _, plain, _, _ = run_tp1(True, plans)
    check_equal(padded, plain, plans, "TP1 padded")
    # every stock step not already at its bucket was padded
    want = sum(1 for p in plans if p.path == "stock"
               and prefill_bucket(p.batch.num_tokens) != p.batch.num_tokens)
    assert stepped == want > 0


def test_auto_setting_graphs_only_cuda_ranks():
    """ShardSpec.step_graphs None (RAYDECODE_STEP_GRAPHS unset): graphs on CUDA ranks only
    (the CUDA side: tests/gpu/test_step_graph_gpu.py::test_rank_runner_defaults_to_graphs_on_cuda)."""
    with tp1_worker(spec(None)) as (w, info):
        assert isinstance(w.runner, GraphedRunner) == ON_CUDA
        assert (info["graph_buckets"] is None) == (not ON_CUDA)


def test_unsupported_graphs_capture_nothing_and_say_why():
    """fp32: the specialized step exists but the graphs (fused bf16 decode) do not, so with
    step graphs on no bucket is ready (the envelope chooses stock); steps still run."""
    plans = script(1)[:2]
    with tp1_worker(dataclasses.replace(spec(True), dtype="float32")) as (w, info):
        assert type(w.runner) is GraphedRunner and info["specialized"] == (True, "ok")
        assert info["graph_buckets"] == [] and "bf16" in info["graph_failed"]
        out = drive(w, plans)
        assert w.runner.counts["plain"] == 2 and torch.isfinite(out[1]).all()
    r = GroupReadiness.from_infos([info])
    assert not any(r.specialized_ready(k) for k in (1, 2, 5, 8)) and "bf16" in r.graph_failed


def test_readiness_takes_the_buckets_every_rank_captured():
    base = {"specialized": (True, "ok"), "graph_failed": None}
    infos = [dict(base, rank=0, graph_buckets=[1, 2, 4, 8]),
             dict(base, rank=1, graph_buckets=[1, 2, 8], graph_failed="bucket 4: OOM")]
    r = GroupReadiness.from_infos(infos)
    assert r.graph_buckets == {1, 2, 8} and r.graph_failed == "rank 1: bucket 4: OOM"
    assert [r.specialized_ready(k) for k in (1, 2, 3, 4, 5, 8, 9)] == \
        [True, True, False, False, True, True, False]
    off = GroupReadiness.from_infos([dict(base, rank=i, graph_buckets=None) for i in (0, 1)])
    unsupported = GroupReadiness.from_infos([dict(infos[0], specialized=(False, "odd TP"))])
    assert off.graph_buckets is None and all(off.specialized_ready(k) for k in (1, 9, 65))
    assert not any(unsupported.specialized_ready(k) for k in (1, 2, 8))


def test_spec_graphs_count_as_graphed_decode_only_on_every_rank():
    """A speculating group's ranks report spec_graphed (engine/spec_runner.py prepare_spec_
    graphs at the build): the group then splits mixed steps as a graphed decode group does,
    and only when every rank replays its spec graphs; decode buckets stay None (ready)."""
    from raydecode.actors.rank_group import RankGroupExecutor

    base = {"specialized": (True, "ok"), "graph_failed": None, "graph_buckets": None}
    both = GroupReadiness.from_infos([dict(base, rank=i, spec_graphed=True) for i in (0, 1)])
    one = GroupReadiness.from_infos([dict(base, rank=0, spec_graphed=True),
                                     dict(base, rank=1, spec_graphed=False,
                                          graph_failed="RuntimeError: no memory")])
    assert both.spec_graphed and not one.spec_graphed
    assert one.graph_failed == "rank 1: RuntimeError: no memory"
    assert all(both.specialized_ready(k) for k in (1, 8, 64))
    ex = RankGroupExecutor.__new__(RankGroupExecutor)
    for r, want in ((both, True), (one, False)):
        ex.readiness = r
        assert ex.decode_graphed is want


# ---- TP = 2 over gloo, two processes ----------------------------------------------------------

def _tp2_rank(rank: int, replica_id: str, addr, infos) -> None:
    """Rank `rank` of a TP2 group: DCP 1 then 2 (set_dcp rebuilds, and recaptures), each with
    graphs on then off (the worker's factory swapped between rebuilds)."""
    torch.set_num_threads(1)
    w = RankWorker(rank, 2, 1, functools.partial(load_runner, spec(True, 1)), replica_id)
    if rank == 0:
        host, port = w.open_store(TIMEOUT_S)
        addr.put((host, port))
    else:
        host, port = addr.get()
    info = w.init_group(host, port, TIMEOUT_S, TIMEOUT_S)
    try:
        for dcp in (1, 2):
            plans = script(dcp, seed=dcp)
            if dcp == 2:
                w.factory = functools.partial(load_runner, spec(True, 2))
                info = w.set_dcp(2)
            check_graphed(w, info, dcp)
            on = drive(w, plans)
            assert w.runner.counts["eager_statics"] == N_SPECIALIZED
            infos.put((dcp, info))
            w.factory = functools.partial(load_runner, spec(False, dcp))
            off_info = w.set_dcp(dcp)
            check_plain(w, off_info, dcp)
            off = drive(w, plans)
            if rank == 0:
                check_equal(on, off, plans, f"TP2 DCP{dcp}")
            else:
                assert on == off == [None] * len(plans)
    finally:
        w.shutdown()


@CPU_ONLY
def test_tp2_workers_graphs_on_equal_off_and_recapture_on_set_dcp():
    ctx = mp.get_context("spawn")
    addr, infos = ctx.SimpleQueue(), ctx.SimpleQueue()
    mp.spawn(_tp2_rank, args=(f"wiring-tp2-{uuid.uuid4().hex[:8]}", addr, infos), nprocs=2,
             join=True)
    got: dict[int, list] = {1: [], 2: []}
    while not infos.empty():
        dcp, info = infos.get()
        got[dcp].append(info)
    for dcp in (1, 2):
        infos_d = sorted(got[dcp], key=lambda i: i["rank"])
        assert [i["rank"] for i in infos_d] == [0, 1]
        assert [i["dcp_rank"] for i in infos_d] == ([0, 0] if dcp == 1 else [0, 1])
        r = GroupReadiness.from_infos(infos_d)
        assert r.support == (True, "ok") and r.graph_buckets == {1, 2, 4, 8}
        assert r.specialized_ready(5) and not r.specialized_ready(9)


# ---- the driver side: one Ray group -----------------------------------------------------------

@CPU_ONLY
def test_driver_env_turns_graphs_on_and_gates_specialized_by_bucket(monkeypatch):
    """RAYDECODE_STEP_GRAPHS=1 on the driver: the ranks (whose env does not matter) build
    graphed runners; specialized_ready follows the captured buckets, also after set_dcp."""
    ray.init(address="local", num_cpus=2, include_dashboard=False,
             object_store_memory=100 * 2**20, log_to_driver=False)
    ex = None
    try:
        monkeypatch.setenv(ENV, "yes")
        with pytest.raises(ValueError, match="RAYDECODE_STEP_GRAPHS='yes'"):
            make_rank_group_executor("tiny", 2, 1, "bfloat16", SLOTS, num_blocks(1), BS,
                                     TIMEOUT_S, num_cpus_per_rank=0.5, max_model_len=MAX_LEN)
        monkeypatch.setenv(ENV, "1")
        assert setting() is True
        ex = make_rank_group_executor("tiny", 2, 1, "bfloat16", SLOTS, num_blocks(1), BS,
                                      TIMEOUT_S, num_cpus_per_rank=0.5, max_model_len=MAX_LEN)
        assert ex.readiness.graph_buckets == {1, 2, 4, 8}
        assert [ex.specialized_ready(k) for k in (1, 3, 5, 8, 9, 64)] == [True] * 4 + [False] * 2
        plans = script(1)
        for p in plans:
            out = ex.execute(p)
            assert len(out.token_ids) == len(p.sample_rows)
            assert all(0 <= t < 512 for t in out.token_ids)
        n = len(plans)
        assert [r["steps"] for r in ex.stats()] == [
            {"stock": n - N_SPECIALIZED, "specialized": N_SPECIALIZED}] * 2
        ex.set_dcp(2)
        assert ex.readiness.graph_buckets == {1, 2, 4, 8} and ex.specialized_ready(5)
    finally:
        if ex is not None:
            ex.close()
        ray.shutdown()
