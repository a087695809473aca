"""A chain of dependent decode GEMVs as launches vs one resident (persistent) kernel with grid
barriers: the building block a per-layer kernel would need (issue #6's 80 %-of-roofline point;
docs/PERF.md round 17 bounds the launch chain below it). GPU only; exploration, not production.

    python -m raydecode.scripts.explore.persistent_chain --out OUT.json --commit SHA

The chain (K3 TP16-like widths, M = 1, bf16, each output the next input):
    x1 = W0·x0  (1024 × 7168)    x2 = W1·x1  (7168 × 1024)
    x3 = W2·x2  (1024 × 7168)    x4 = W3·x3  (7168 × 1024)      4 × 14.7 MB
Variants, each in one CUDA graph over rotating weight copies (> 3× L2):
  cute:     4 production CuTe GEMV launches (kernels/gemv.py, PDL)
  launches: 4 launches of this file's Triton phase kernel (PDL: `pdl_enter` first)
  persist:  one launch of `_chain_kernel`: every CTA (one per SM) computes its row blocks of a
            phase, then a grid barrier (CTA barrier; one thread: release atomic add to a
            counter, acquire spin to phases·CTAs; CTA barrier), then the next phase
  persist_pf: as persist, and before each barrier every CTA bulk-prefetches into L2 the rows it
            will read in the next phase (weights never depend on the chain, so their bytes can
            stream while the barrier waits; the prefetching SM is the reading SM)
  persist8: persist with 8 warps per CTA (persist_pre's warps)
  persist_pre: as persist (8 warps), and before each barrier every CTA loads into registers
            the leading PRELOAD columns of the row block it computes next (one block per CTA
            and phase)
  barrier:  the persistent kernel with no GEMV work: µs per grid barrier
  cute_op, ring_op: cute / ring with a stand-in latency-bound op (a --op-us wait; in cute a
            one-CTA PDL kernel, in ring the consumers wait) after every GEMV: how much of the
            ops the weight stream hides (PERF round 18; `ops_us` is their sum)
  ring, ring_*: kernels/experimental/resident_chain_cute.py (CuTe): one resident launch whose producer
            lane streams every phase's rows through a shared-memory ring with bulk copies and
            mbarriers, never waiting for the chain (only for a free slot), so the weights keep
            streaming while the consumers wait for x (PERF round 18); ring: 12 slots × 16 KiB,
            ≤ 2 copies in flight, 2 groups of 4 consumer warps, a counter grid barrier;
            ring_dN: ≤ N in flight; ring_g1/_g4: 1, 4 groups; ring_s6: 6 slots;
            ring_tagged*: x_p as tagged words, no fence; ring_stream / ring_nobar: probes (no
            math and no barrier / no barrier), timed only
Each variant's x4 is checked against a float64 chain before it is timed. Measured on H200
(PERF round 17): a grid barrier costs about a PDL launch boundary (persist8 ties cute at 0.45
of the roofline); issuing the next phase's weights before the barrier (persist_pf,
persist_pre) loses. Round 18: ring reaches 0.62 (1.36× cute); with an op after every GEMV
the lead falls to 2 µs (ring_op vs cute_op: PDL already hides half of each op).
The spin is bounded (SPIN_MAX polls); a kernel that hit the bound sets a flag and the variant
is reported failed — a grid barrier needs every CTA resident, which the grid size (SM count,
1 CTA each) ensures on an otherwise idle GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace

import torch

from raydecode.kernels import gemv as G
from raydecode.kernels import linear as LN
from raydecode.kernels.experimental import resident_chain_cute as RC
from raydecode.kernels._triton import pdl_enter, pdl_launch, tl, triton

from raydecode.scripts.bench.gemv import ROTATE_BYTES
from .l2_prefetch import spin
from raydecode.scripts.bench.layer_timing import GraphTimer, hbm_read_bandwidth
from raydecode.scripts.bench.report_io import report_header, write_report

WIDTHS = (7168, 1024, 7168, 1024, 7168)      # x0 … x4: W_i is (WIDTHS[i+1], WIDTHS[i])
SPIN_MAX = 1 << 22
CFG = {7168: (8, 512), 1024: (64, 256)}      # K -> (rows per block BN, K tile BK)
PRELOAD = {7168: 2048, 1024: 256}            # K -> columns persist_pre holds (32 KB per CTA)

if triton is not None:
    @triton.jit
    def _rows(w_ptr, x_ptr, y_ptr, N, K, blk, BN: tl.constexpr, BK: tl.constexpr):
        """y[blk·BN : +BN] = bf16(W[rows, :] · x), fp32 sums; x read through L2 (.cg: it was
        written by other CTAs in this launch)."""
        rows = blk * BN + tl.arange(0, BN)
        rm = rows < N
        acc = tl.zeros((BN, BK), tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + ks[None, :], mask=rm[:, None],
                        other=0.0, eviction_policy="evict_first")
            xv = tl.load(x_ptr + ks, cache_modifier=".cg")
            acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
        tl.store(y_ptr + rows, tl.sum(acc, 1).to(tl.bfloat16), mask=rm)

    @triton.jit
    def _preload(w_ptr, N, K, blk, BN: tl.constexpr, PK: tl.constexpr):
        """The leading PK columns of row block blk (registers): issued before a grid barrier,
        they stream while the barrier waits."""
        rows = blk * BN + tl.arange(0, BN)
        return tl.load(w_ptr + rows[:, None].to(tl.int64) * K + tl.arange(0, PK)[None, :],
                       mask=rows[:, None] < N, other=0.0, eviction_policy="evict_first")

    @triton.jit
    def _rows_pre(w_ptr, x_ptr, y_ptr, N, K, blk, wpre, BN: tl.constexpr, BK: tl.constexpr,
                  PK: tl.constexpr):
        """_rows with columns [0, PK) already in registers (wpre, from `_preload`)."""
        rows = blk * BN + tl.arange(0, BN)
        rm = rows < N
        x0 = tl.load(x_ptr + tl.arange(0, PK), cache_modifier=".cg")
        s0 = tl.sum(wpre.to(tl.float32) * x0.to(tl.float32)[None, :], 1)
        acc = tl.zeros((BN, BK), tl.float32)
        for k0 in range(PK, K, BK):
            ks = k0 + tl.arange(0, BK)
            w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + ks[None, :], mask=rm[:, None],
                        other=0.0, eviction_policy="evict_first")
            xv = tl.load(x_ptr + ks, cache_modifier=".cg")
            acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
        tl.store(y_ptr + rows, (s0 + tl.sum(acc, 1)).to(tl.bfloat16), mask=rm)

    @triton.jit
    def _pre_chain_kernel(x0, x1, x2, x3, x4, w0, w1, w2, w3, counter, flag,
                          G_: tl.constexpr, N0: tl.constexpr, N1: tl.constexpr,
                          BN0: tl.constexpr, BK0: tl.constexpr, PK0: tl.constexpr,
                          BN1: tl.constexpr, BK1: tl.constexpr, PK1: tl.constexpr):
        # one row block per CTA and phase (host checks cdiv(N, BN) ≤ G_); each CTA loads the
        # leading PK columns of its next block before the barrier that guards that phase's x
        pid = tl.program_id(0)
        a = _preload(w0, N1, N0, pid, BN0, PK0)
        if pid < tl.cdiv(N1, BN0):
            _rows_pre(w0, x0, x1, N1, N0, pid, a, BN0, BK0, PK0)
        b = _preload(w1, N0, N1, pid, BN1, PK1)
        _grid_sync(counter, flag, G_)
        if pid < tl.cdiv(N0, BN1):
            _rows_pre(w1, x1, x2, N0, N1, pid, b, BN1, BK1, PK1)
        a = _preload(w2, N1, N0, pid, BN0, PK0)
        _grid_sync(counter, flag, 2 * G_)
        if pid < tl.cdiv(N1, BN0):
            _rows_pre(w2, x2, x3, N1, N0, pid, a, BN0, BK0, PK0)
        b = _preload(w3, N0, N1, pid, BN1, PK1)
        _grid_sync(counter, flag, 3 * G_)
        if pid < tl.cdiv(N0, BN1):
            _rows_pre(w3, x3, x4, N0, N1, pid, b, BN1, BK1, PK1)

    @triton.jit
    def _phase(w_ptr, x_ptr, y_ptr, N, K, pid, G_: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr):
        for blk in range(pid, tl.cdiv(N, BN), G_):
            _rows(w_ptr, x_ptr, y_ptr, N, K, blk, BN, BK)

    @triton.jit
    def _prefetch_rows(w_ptr, N, K, pid, G_: tl.constexpr, BN: tl.constexpr):
        """One bulk L2 prefetch per row block this CTA reads next (rows are contiguous)."""
        for blk in range(pid, tl.cdiv(N, BN), G_):
            a = w_ptr + blk * BN * K
            nbytes = (tl.minimum(N - blk * BN, BN) * K * 2).to(tl.int32)
            tl.inline_asm_elementwise(
                "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                [a, nbytes], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _load_acquire(p):
        return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [p],
                                         dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _grid_sync(counter, flag, target):
        """All CTAs reach here before any leaves (counter counts arrivals; target = this
        barrier's index · CTAs). Bounded: past SPIN_MAX polls the flag is set and it returns."""
        tl.debug_barrier()
        tl.atomic_add(counter, 1, sem="release", scope="gpu")     # one per CTA (scalar)
        c = _load_acquire(counter)
        n = 0
        while (c < target) & (n < 4194304):
            c = _load_acquire(counter)
            n += 1
        if n >= 4194304:
            tl.atomic_xchg(flag, 1)
        tl.debug_barrier()

    @triton.jit
    def _chain_kernel(x0, x1, x2, x3, x4, w0, w1, w2, w3, counter, flag,
                      G_: tl.constexpr, WORK: tl.constexpr, PF: tl.constexpr,
                      N0: tl.constexpr, N1: tl.constexpr,
                      BN0: tl.constexpr, BK0: tl.constexpr, BN1: tl.constexpr,
                      BK1: tl.constexpr):
        # phases alternate W (N0 × N1) on x of width N1 and W (N1 × N0) on x of width N0
        pid = tl.program_id(0)
        if WORK:
            if PF:
                _prefetch_rows(w0, N1, N0, pid, G_, BN0)
            _phase(w0, x0, x1, N1, N0, pid, G_, BN0, BK0)
            if PF:
                _prefetch_rows(w1, N0, N1, pid, G_, BN1)
        _grid_sync(counter, flag, G_)
        if WORK:
            _phase(w1, x1, x2, N0, N1, pid, G_, BN1, BK1)
            if PF:
                _prefetch_rows(w2, N1, N0, pid, G_, BN0)
        _grid_sync(counter, flag, 2 * G_)
        if WORK:
            _phase(w2, x2, x3, N1, N0, pid, G_, BN0, BK0)
            if PF:
                _prefetch_rows(w3, N0, N1, pid, G_, BN1)
        _grid_sync(counter, flag, 3 * G_)
        if WORK:
            _phase(w3, x3, x4, N0, N1, pid, G_, BN1, BK1)

    @triton.jit
    def _phase_kernel(w_ptr, x_ptr, y_ptr, N, K, G_: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        _phase(w_ptr, x_ptr, y_ptr, N, K, tl.program_id(0), G_, BN, BK)


RING = {"ring": {},                            # ChainPlan defaults: 12 × 16 KiB slots, ≤ 2
        "ring_d1": dict(inflight=1),            # copies in flight, 2 groups × 4 consumer warps,
        "ring_d3": dict(inflight=3),            # counter barrier; _dN: ≤ N in flight
        "ring_d12": dict(inflight=12),
        "ring_g1": dict(groups=1),
        "ring_g4": dict(groups=4),
        "ring_s6": dict(stages=6),
        "ring_tagged": dict(publish="tagged"),
        "ring_tagged_d12": dict(publish="tagged", inflight=12),
        "ring_stream": dict(probe="stream"),
        "ring_nobar": dict(probe="nobarrier"),
        "ring_op": {}}                          # + a --op-us wait after each phase's sums
OPS = ("cute_op", "ring_op")                    # a latency-bound op after every GEMV
PROBED = ("ring_stream", "ring_nobar")          # no valid output: timed, not checked
TRACE_US = ("phase start", "x loaded", "stages summed", "y stored + arrived",
            "first stage issued", "last stage issued")


def trace_summary(name: str, chains: list, grid: int, scratch, op_ns: int = 0) -> dict:
    """One traced launch of `name`'s plan on the last weight copy (after one on each of the
    others, so L2 does not hold its weights): per phase and event, min / median / max over CTAs
    of µs since the earliest CTA's start."""
    plan = replace(ring_plan(name, grid, op_ns), trace=True)
    trace = torch.zeros(RC.trace_words(plan), device="cuda", dtype=torch.int64)
    for c in chains:
        RC.resident_chain_into(plan, c.xflat, c.wflat, scratch, trace)
    torch.cuda.synchronize()
    t = trace.view(grid, plan.phases, RC.TRACE_EVENTS)[:, :, :len(TRACE_US)].double()
    t = (t - t[:, 0, 0].min()) / 1e3
    out = {}
    for p in range(plan.phases):
        out[f"phase{p}"] = {ev: [round(float(v), 2) for v in (t[:, p, k].min(), t[:, p, k].median(),
                                                              t[:, p, k].max())]
                            for k, ev in enumerate(TRACE_US)}
    return out


def ring_plan(name: str, grid: int, op_ns: int = 0) -> RC.ChainPlan:
    return RC.ChainPlan(tuple((WIDTHS[i + 1], WIDTHS[i]) for i in range(4)), ctas=grid,
                        op_ns=op_ns if name in OPS else 0, **RING[name])


class Chain:
    """One weight copy of the chain: a flat weight buffer with W_i views into it, and the
    shared flat activation buffer's x_i views (the ring kernel takes both flat; the views are
    `RC.flat_views` of `plan`, whose offsets depend on the widths only)."""

    def __init__(self, plan: RC.ChainPlan, xflat: torch.Tensor, seed: int):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.wflat = torch.empty(plan.w_offsets[-1], device="cuda", dtype=torch.bfloat16)
        self.xs, self.w = RC.flat_views(plan, xflat, self.wflat)
        for w in self.w:
            w.copy_(torch.randn(w.shape, device="cuda", dtype=torch.bfloat16, generator=g)
                    / w.shape[1] ** 0.5)
        self.xflat = xflat

    def reference(self) -> torch.Tensor:
        x = self.xs[0].double()
        for w in self.w:
            x = (w.double() @ x).to(torch.bfloat16).double()      # bf16 between phases
        return x


def run_variant(name: str, chain: Chain, grid: int, counter, flag, sync, op_ns: int = 0) -> None:
    xs, w = chain.xs, chain.w
    if name == "cute_op":
        for i in range(4):
            xs[i + 1].copy_(LN.linear(xs[i][None], w[i])[0])
            spin(op_ns, pdl_like=xs[i])            # the op: a one-CTA wait, PDL
        return
    if name in RING:
        RC.resident_chain_into(ring_plan(name, grid, op_ns), chain.xflat, chain.wflat, sync)
        return
    if name == "cute":
        for i in range(4):
            xs[i + 1].copy_(LN.linear(xs[i][None], w[i])[0])
        return
    if name == "launches":
        for i in range(4):
            BN, BK = CFG[WIDTHS[i]]
            _phase_kernel[(grid,)](w[i], xs[i], xs[i + 1], WIDTHS[i + 1], WIDTHS[i], G_=grid,
                                   BN=BN, BK=BK, num_warps=4, **pdl_launch(xs[i]))
        return
    counter.zero_()
    (BN0, BK0), (BN1, BK1) = CFG[WIDTHS[0]], CFG[WIDTHS[1]]
    if name == "persist_pre":
        if -(-WIDTHS[1] // BN0) > grid or -(-WIDTHS[0] // BN1) > grid:
            raise ValueError(f"persist_pre needs ≤ {grid} row blocks per phase")
        _pre_chain_kernel[(grid,)](*xs, *w, counter, flag, G_=grid, N0=WIDTHS[0], N1=WIDTHS[1],
                                   BN0=BN0, BK0=BK0, PK0=PRELOAD[WIDTHS[0]], BN1=BN1, BK1=BK1,
                                   PK1=PRELOAD[WIDTHS[1]], num_warps=8)   # 4: spills
        return
    _chain_kernel[(grid,)](*xs, *w, counter, flag, G_=grid, WORK=name != "barrier",
                           PF=name == "persist_pf", N0=WIDTHS[0], N1=WIDTHS[1], BN0=BN0,
                           BK0=BK0, BN1=BN1, BK1=BK1, num_warps=8 if name == "persist8" else 4)


VARIANTS = ("cute", "launches", "persist", "persist8", "persist_pf", "persist_pre", "barrier",
            *RING, "cute_op")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--op-us", type=float, default=4.0,
                    help="cute_op / ring_op: the stand-in latency-bound op after each GEMV (µs)")
    ap.add_argument("--trace", action="store_true",
                    help="ring variants: also one traced launch, per-phase event times in the JSON")
    args = ap.parse_args(argv)
    bad = [v for v in args.variants.split(",") if v not in VARIANTS]
    if bad:
        ap.error(f"--variants {bad}: accepted {', '.join(VARIANTS)}")
    if args.op_us < 0:
        ap.error(f"--op-us {args.op_us}: need ≥ 0")
    if not torch.cuda.is_available() or triton is None or not G.cute_available():
        print("persistent_chain: needs a CUDA GPU, Triton and CuTe DSL", file=sys.stderr)
        return 2
    op_ns = int(args.op_us * 1e3)
    t0 = time.time()
    grid = torch.cuda.get_device_properties(0).multi_processor_count
    plan = ring_plan("ring", grid)
    xflat = torch.empty(plan.x_offsets[-1], device="cuda", dtype=torch.bfloat16)
    chain_bytes = plan.weight_bytes
    copies = max(4, math.ceil(ROTATE_BYTES / chain_bytes))
    chains = [Chain(plan, xflat, 100 + c) for c in range(copies)]
    xs = chains[0].xs                                 # the same views in every chain
    xs[0].normal_()
    counter = torch.zeros(1, device="cuda", dtype=torch.int32)
    flag = torch.zeros(1, device="cuda", dtype=torch.int32)
    # ring variants' counters and tagged x copies (same shapes: one size for all)
    sync = torch.zeros(plan.scratch_words, device="cuda", dtype=torch.int32)
    report = report_header(
        args.commit, sm_count=grid,
        method=__doc__.split("\n\n")[1].strip() + "\n" + __doc__.split("\n\n")[2],
        widths=WIDTHS, chain_bytes=chain_bytes, copies=copies, op_us=args.op_us, results={})
    report["hbm_read_Bps"] = hbm = hbm_read_bandwidth()
    report["roofline_us"] = chain_bytes / hbm * 1e6
    timer = GraphTimer(replays=15, warm=3)
    want = chains[0].reference()
    for v in args.variants.split(","):
        row = {}
        try:
            flag.zero_()
            sync.zero_()
            xs[4].fill_(float("nan"))                  # poisoned: each variant must write it
            run_variant(v, chains[0], grid, counter, flag, sync, op_ns)
            torch.cuda.synchronize()
            if v not in ("barrier", *PROBED):
                got = xs[4].double()
                row["rel_err"] = float((got - want).abs().max() / want.abs().max())
            t = timer.run([lambda c=c: run_variant(v, c, grid, counter, flag, sync, op_ns)
                           for c in chains], count_nodes=False)
            torch.cuda.synchronize()
            row.update(us=t.us_per_call, us_min=t.us_min, us_max=t.us_max,
                       spin_bound_hit=bool(flag.item() or sync[2].item()))
            if v in RING:                              # the replays left the counters at zero
                row["sync_after"] = sync[:RC.SYNC_WORDS].tolist()
            if v in RING and args.trace:
                row["trace_us"] = trace_summary(v, chains, grid, sync, op_ns)
            if v in OPS:                               # the ops' own time, were none hidden
                row["ops_us"] = 4 * args.op_us
            if v != "barrier":
                row["frac_of_roofline"] = report["roofline_us"] / t.us_per_call
            else:
                row["us_per_barrier"] = t.us_per_call / 3
        except Exception as e:                    # a variant that fails is reported, not fatal
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        report["results"][v] = row
        print(v, json.dumps(row), flush=True)
    write_report(report, args.out, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
