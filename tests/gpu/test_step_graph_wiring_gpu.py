"""Step graphs through the serving rank workers, TP2 on 2 GPUs: actors/rank_worker.py's
RankWorker with ShardSpec(step_graphs=True) captures every bucket at build (after the one-shot
all-reduce is connected, collective over both ranks) and then replays a graph per specialized
decode step; the same plan script with graphs off (set_dcp rebuilds the runner eagerly, the
one-shot peers reopened) gives the same logits. A random tiny checkpoint, one fresh seed (in
every message), both ranks run the same plans (no fan-out needed: plans are deterministic).
Not run in CI; the CPU twin is tests/cpu/test_step_graph_wiring.py (gloo, eager statics).

TOL 3e-2 as tests/gpu/test_step_graph_gpu.py: the graph's table is max_blocks wide (the MLA
split-KV count may differ from the eager step's), the MoE kernels sum with fp32 atomics."""
from __future__ import annotations

import os

from _numerics import TOL as NUM_TOL
from _numerics import fresh_seed, max_rel_err

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
for _k, _v in NO_MULTICAST.items():
    os.environ.setdefault(_k, _v)

import copy  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
pytestmark = pytest.mark.skipif(not TWO_GPUS, reason="needs 2 CUDA GPUs")
SLOTS, BLOCK, MAX_LEN = 6, 4, 64       # buckets (1, 2, 4, 8): 3 scratch slots
BLOCKS = SLOTS * MAX_LEN // BLOCK
TOL = NUM_TOL["bf16_path"]
TIMEOUT_S = float(os.environ.get("RAYDECODE_TEST_MP_TIMEOUT_S", "300"))


def script(seed: int, vocab: int):
    """Prefill SLOTS sequences (3..12 tokens), then decode-only specialized steps over changing
    subsets (T = 6, 5, 3, 2, 1: buckets 8, 8, 4, 2, 1) three times, and one stock decode.
    -> (plans, number of specialized steps)."""
    from raydecode.engine.cache import BlockAllocator, SlotAllocator
    from raydecode.engine.scheduler import StepPlan
    from raydecode.models.cache import SeqSlice, StepBatch

    g = torch.Generator().manual_seed(seed)
    slots, blocks, pos, plans = SlotAllocator(SLOTS), BlockAllocator(BLOCKS, BLOCK), {}, []

    def plan(seqs, changed, reset, path):
        toks = torch.randint(0, vocab, (sum(s.length for s in seqs),), generator=g).tolist()
        plans.append(StepPlan(len(plans), StepBatch(seqs), toks, [s.end - 1 for s in seqs],
                              changed, reset, path))

    seqs, changed, at = [], {}, 0
    for n in torch.randint(3, 13, (SLOTS,), generator=g).tolist():
        s = slots.allocate()
        blocks.ensure(s, n)
        changed[s], pos[s] = list(blocks.tables[s]), n
        seqs.append(SeqSlice(s, at, n, 0))
        at += n
    plan(seqs, changed, list(pos), "stock")
    live = list(pos)
    for _ in range(3):
        for T in (6, 5, 3, 2, 1):
            sl = [live[i] for i in torch.randperm(SLOTS, generator=g)[:T].tolist()]
            ch = {s: list(blocks.tables[s]) for s in sl if blocks.ensure(s, pos[s] + 1)}
            plan(StepBatch.decode(sl, [pos[s] for s in sl]).seqs, ch, [], "specialized")
            for s in sl:
                pos[s] += 1
    plan(StepBatch.decode(live, [pos[s] for s in live]).seqs,
         {s: list(blocks.tables[s]) for s in live if blocks.ensure(s, pos[s] + 1)}, [],
         "stock")
    return plans, 15


def _steps_with_logits(w, plans) -> list:
    """w.step of each plan (each rank its own copy) -> rank 0: the logits its runner handed
    the device sampler (whose greedy ids must be their argmax); other ranks: None."""
    seen, real = [], w.runner.logits

    def spy(plan):
        out = real(plan)
        seen.append(out.detach().clone())
        return out

    w.runner.logits = spy
    try:
        res = [w.step(copy.deepcopy(p)) for p in plans]
    finally:
        del w.runner.logits
    if w.par.tp_rank != 0:
        return [None] * len(plans)
    for r, x in zip(res, seen):
        assert r.token_ids == x.argmax(-1).tolist()
    return seen


def _rank(rank: int, port: int, ckpt, seed: int, out) -> None:
    """Graphs on, then off (the factory swapped, set_dcp(1) rebuilds); rank 0 compares."""
    from raydecode.actors.rank_worker import RankWorker, ShardSpec, load_runner
    from raydecode.engine.step_graph import GraphedRunner

    msg = f"seed {seed} rank {rank}"
    try:
        spec = ShardSpec(str(ckpt), dtype="bfloat16", num_slots=SLOTS, num_blocks=BLOCKS,
                         block_size=BLOCK, max_model_len=MAX_LEN, step_graphs=True)
        w = RankWorker(rank, 2, 1, functools.partial(load_runner, spec), f"graphs-{seed}")
        info = w.init_group("127.0.0.1", port, timeout_s=120.0)
        assert type(w.runner) is GraphedRunner and w.runner.capture, msg
        assert info["graph_buckets"] == [1, 2, 4, 8], f"{msg}: {info}"
        assert info["graph_failed"] is None, f"{msg}: {info['graph_failed']}"
        plans, k = script(seed, w.runner.model.cfg.vocab_size)
        peers_on = getattr(w.comm, "peers", None) is not None
        t0 = time.perf_counter()
        on = _steps_with_logits(w, plans)
        torch.cuda.synchronize()
        t_on = time.perf_counter() - t0
        counts = dict(w.runner.counts)
        assert counts == {"graphed": k, "eager_statics": 0, "plain": len(plans) - k,
                          "captured": 4, "padded": 0, "stock_graphed": 0,
                          "stock_captured": 0}, f"{msg}: {counts}"
        w.factory = functools.partial(load_runner, dataclasses.replace(spec, step_graphs=False))
        info = w.set_dcp(1)
        assert type(w.runner).__name__ == "ModelRunner" and info["graph_buckets"] is None, msg
        t0 = time.perf_counter()
        off = _steps_with_logits(w, plans)
        torch.cuda.synchronize()
        t_off = time.perf_counter() - t0
        w.comm.check_timeouts()
        w.shutdown()
        if rank == 0:
            worst = 0.0
            for p, a, b in zip(plans, on, off, strict=True):
                assert a.shape == b.shape == (len(p.sample_rows), a.shape[1]), (msg, p.step_id)
                assert torch.isfinite(a).all(), f"{msg} step {p.step_id}: non-finite logits"
                r = max_rel_err(a, b)
                assert r < TOL, f"{msg} step {p.step_id} ({p.path}, {p.num_seqs} seqs): {r}"
                worst = max(worst, r)
            (out / "summary.json").write_text(json.dumps({
                "seed": seed, "steps": len(plans), "graphed": k, "one_shot_peers": peers_on,
                "max_rel_logit_diff": worst, "script_s_graphed": round(t_on, 4),
                "script_s_eager": round(t_off, 4)}))
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def test_tp2_rank_workers_replay_graphs_equal_eager(tmp_path):
    import datetime

    import torch.distributed as dist
    from multiprocessing.connection import wait

    from raydecode.models.checkpoint import write_checkpoint
    from raydecode.models.config import load_config

    seed = fresh_seed()
    ckpt = tmp_path / "tiny"
    write_checkpoint(load_config("tiny"), ckpt, seed=seed)
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = vis.split(",")[:2] if vis else ["0", "1"]
    procs = []
    for rank in range(2):        # each rank sees its own GPU, as a Ray rank actor does
        procs.append(ctx.Process(target=_rank, args=(rank, store.port, ckpt, seed, tmp_path)))
        with pytest.MonkeyPatch.context() as m:
            m.setenv("CUDA_VISIBLE_DEVICES", gpus[rank])
            procs[-1].start()
    deadline = time.monotonic() + TIMEOUT_S
    while (left := deadline - time.monotonic()) > 0 and any(p.exitcode is None for p in procs) \
            and not any(p.exitcode for p in procs):
        wait([p.sentinel for p in procs if p.exitcode is None], timeout=left)
    for p in procs:
        if p.exitcode is None:
            p.kill()
        p.join()
    errs = "\n".join(f.read_text()[-3000:] for f in sorted(tmp_path.glob("rank*.err")))
    if errs or any(p.exitcode for p in procs):
        pytest.fail(f"seed {seed}: exit codes {[p.exitcode for p in procs]}"
                    f"{' (timeout)' if left <= 0 else ''}\n{errs}")
    summary = json.loads((tmp_path / "summary.json").read_text())
    print(f"step graphs through RankWorker, TP2 tiny: {summary}")
    assert summary["graphed"] == 15
