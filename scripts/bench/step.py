"""The served decode step of K3 at one rank's shapes: stock eager, specialized eager and
specialized as one CUDA graph per batch bucket (engine/step_graph.py), side by side.

    python -m raydecode.scripts.bench.step [--tp 16] [--layers 93] [--batches 1,8,64]
        [--context 1024] [--steps 20] [--out bench/results/step-….json] [--commit SHA]

One GPU plays rank 0 of a TP group (`SoloRankComm`): the all-reduces are skipped and counted
(their time is not in the figures: bench/results/allreduce-*.json has them), the all-gathers
tile this rank's slice TP times, so every later shape and copy is the real one. The model is
K3 from its published config with the first `--layers` layers (93: all of them; at TP16 the
whole rank, ≈ 110 GB of bf16 + MXFP4 weights, fits one H200), random weights drawn on the
device (`init_on_device_`, the scales of models/k3.py `_random_full`).

Each batch T starts T sequences at position `--context` (their caches hold whatever the
pool held: the timing does not depend on the values) and runs `--steps` decode steps; every
step runs once per variant, interleaved, each on its own caches:
  stock        ModelRunner, path "stock" (the eager PyTorch/cuBLAS path every engine has)
  specialized  ModelRunner, path "specialized", eager (what RankWorker runs without graphs)
  graphed      GraphedRunner: the bucket's graph, captured on its first step, replayed after
Times are host wall time of `runner.run(plan)` between two device syncs: host preparation,
the step, the logits copy (what a served step costs). The graphed variant's logits are
compared with the eager specialized ones (max-abs relative, reported).

Bytes: weights one step must read at batch T (every bf16 / fp32 parameter; of each MoE layer's
routed experts the expected distinct ones under uniform routing, E·(1 − (1 − k/E)^T)) plus the
MLA latent cache read, against the HBM read bandwidth measured in the same run. The random
model routes less evenly than that (`--routing-probe` measures it; K3 TP16, 4 layers, batch 8
on the CPU: 88–106 distinct experts against 120), so at T > 1
the expert bytes, and the HBM fraction, are upper bounds on what a step reads. Off CUDA
(`--device cpu`, the tiny config; tests/cpu/test_bench_step.py) it runs eagerly, no graphs.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import statistics
import time
from collections import Counter

import torch

from raydecode.engine.cache import BlockAllocator, SlotAllocator
from raydecode.engine.runner import ModelRunner
from raydecode.engine.scheduler import StepPlan
from raydecode.engine.step_graph import GraphedRunner, graph_cache_sizes
from raydecode.kernels import settings
from raydecode.models.cache import SeqSlice, StepBatch
from raydecode.models.config import K3Config, load_config
from raydecode.models.k3 import K3ForCausalLM, make_caches
from raydecode.models.moe import MXFP4_PARAMS
from raydecode.models.parallel import Parallel

from .options import add_decode_args, options_from_args
from .random_init import SoloRankComm, init_on_device_

VARIANTS = ("stock", "specialized", "graphed")
BLOCK = 16


# replicated weights the specialized path reads 1/TP of (models/specialized.py sharded_gemv,
# row_slice), then all-gathers the outputs; the stock path reads them whole
ROW_SHARDED = ("q_a_proj", "kv_a_proj_with_mqa", "gate", "routed_expert_down_proj",
               "routed_expert_up_proj")


def layer_config(config: str, layers: int) -> K3Config:
    """The config `config` (k3, tiny or a path) cut to its first `layers` layers (0: all);
    ValueError naming the accepted range."""
    cfg = load_config(config)
    if not layers:
        return cfg
    if not 1 <= layers <= cfg.num_layers:
        raise ValueError(f"--layers {layers}: expected 1..{cfg.num_layers} (0: all)")
    return dataclasses.replace(cfg, num_layers=layers)


def build_model(cfg: K3Config, tp: int, device, seed: int, options=None,
                dtype: torch.dtype = torch.bfloat16) -> tuple[K3ForCausalLM, float]:
    """Rank 0 of TP `tp` alone (`SoloRankComm`), random weights drawn on `device`
    (`init_on_device_`) -> (model, build seconds)."""
    par = Parallel(0, tp)
    t0 = time.perf_counter()
    with torch.device(device):
        model = init_on_device_(K3ForCausalLM(cfg, par, SoloRankComm(par), dtype, options),
                                seed)
    return model, time.perf_counter() - t0


def device_sync(device: torch.device) -> None:
    """Wait for `device`'s queued work (CUDA); nothing to wait for elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rank_vocab_rows(model: K3ForCausalLM) -> range:
    """The token ids whose embedding rows this rank holds. SoloRankComm's all-reduce is the
    identity, so any other id embeds as zeros (the rank owning it never adds its row) and
    every hidden state of the step would be token-independent (routing included)."""
    n = model.model.embed_tokens.weight.shape[0]
    return range(model.par.tp_rank * n, (model.par.tp_rank + 1) * n)


def step_bytes(model: K3ForCausalLM, T: int, context: int, path: str) -> dict[str, float]:
    """Bytes one decode step of T sequences reads on `path` (module docstring): the embedding
    is T rows; ROW_SHARDED weights count 1/TP on the specialized path."""
    cfg, tp, dense, experts, embed = model.cfg, model.par.tp_size, 0.0, 0.0, 0.0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        leaf_owner = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
        if name.rsplit(".", 1)[-1] in MXFP4_PARAMS:
            experts += nbytes
        elif leaf_owner == "embed_tokens":
            embed += T * p.shape[-1] * p.element_size()
        elif path != "stock" and leaf_owner in ROW_SHARDED and p.shape == p.full_shape:
            dense += nbytes / tp
        else:
            dense += nbytes
    E, k = cfg.moe.num_experts, cfg.moe.top_k
    distinct = E * (1.0 - (1.0 - k / E) ** T)
    kv_row = cfg.mla.latent_dim * next(model.parameters()).element_size()
    kv = len(cfg.mla_layers) * T * math.ceil((context + 1) / model.par.dcp_size) * kv_row
    routed = experts * distinct / E
    return {"dense": dense, "embedding": embed, "experts": routed, "kv": float(kv),
            "total": dense + embed + routed + kv, "distinct_experts": round(distinct, 2)}


class Bench:
    """The three runners on their own caches, fed the same plans."""

    def __init__(self, model, device, num_slots: int, context: int, variants=VARIANTS):
        self.model, self.device, self.context = model, torch.device(device), context
        per_seq = math.ceil((context + 64) / BLOCK)
        self.num_slots, self.max_blocks = num_slots, per_seq
        self.num_blocks = num_slots * per_seq
        self.runners = {}
        for v in variants:     # only the graphed runner needs the scratch rows
            ns, nb = (graph_cache_sizes(num_slots, self.num_blocks) if v == "graphed"
                      else (num_slots, self.num_blocks))
            c = make_caches(model.cfg, model.par, ns, nb, BLOCK, model.dtype, device=device)
            self.runners[v] = (GraphedRunner(model, c, device, num_slots=num_slots,
                                             num_blocks=self.num_blocks,
                                             max_blocks=self.max_blocks)
                               if v == "graphed" else ModelRunner(model, c, device))
        self.slots, self.blocks = SlotAllocator(num_slots), BlockAllocator(self.num_blocks, BLOCK)
        self.pos: dict[int, int] = {}
        self.collectives: dict[str, dict] = {}    # eager variant -> comm calls of its last step
        self.gen = torch.Generator().manual_seed(0)
        self.step_id = 0

    def start(self, T: int) -> list[int]:
        """T fresh sequences at position `context` (state reset on their first step)."""
        for s in list(self.pos):
            self.slots.release(s)
            self.blocks.release(s)
        self.pos.clear()
        slots = [self.slots.allocate() for _ in range(T)]
        for s in slots:
            self.pos[s] = self.context
        self._reset = list(slots)
        return slots

    def plan(self, slots: list[int], path: str) -> StepPlan:
        changed = {}
        for s in slots:
            if self.blocks.ensure(s, self.pos[s] + 1):
                changed[s] = list(self.blocks.tables[s])
        # this rank's vocab rows only: any other id embeds as zeros here (rank_vocab_rows)
        rows = rank_vocab_rows(self.model)
        toks = torch.randint(rows.start, rows.stop, (len(slots),), generator=self.gen).tolist()
        batch = StepBatch([SeqSlice(s, i, 1, self.pos[s]) for i, s in enumerate(slots)])
        return StepPlan(self.step_id, batch, toks, list(range(len(slots))), changed,
                        list(self._reset), path)

    def step(self, slots: list[int], around=None) -> dict[str, tuple[float, torch.Tensor]]:
        """One decode step per variant -> {variant: (seconds, logits)}. around(variant): a
        context manager the variant's run is timed inside (a profiler), or None."""
        self.step_id += 1
        base = self.plan(slots, "specialized")
        out = {}
        for v, r in self.runners.items():
            plan = dataclasses.replace(base, path="stock" if v == "stock" else "specialized")
            before = Counter(self.model.comm.counts)
            with (around(v) if around else contextlib.nullcontext()):
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                logits = r.run(plan)
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                out[v] = (time.perf_counter() - t0, logits)
            if v != "graphed":     # a replay makes no Python comm calls (its capture did)
                self.collectives[v] = dict(self.model.comm.counts - before)
        self._reset = []
        for s in slots:
            self.pos[s] += 1
        return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def run_batch(bench: Bench, T: int, steps: int, warm: int = 3) -> dict:
    slots = bench.start(T)
    times = {v: [] for v in bench.runners}
    rel, finite, spread = [], True, {}
    for i in range(warm + steps):
        out = bench.step(slots)
        if i >= warm:
            for v, (t, _) in out.items():
                times[v].append(t)
        for v, (_, lg) in out.items():
            finite &= bool(torch.isfinite(lg).all())
            spread[v] = float(lg.float().std())
        if "graphed" in out and "specialized" in out:
            rel.append(_rel(out["graphed"][1], out["specialized"][1]))
    row = {"batch": T, "steps": steps,
           "ms": {v: round(statistics.median(ts) * 1e3, 3) for v, ts in times.items()},
           "ms_min": {v: round(min(ts) * 1e3, 3) for v, ts in times.items()},
           "logits_finite": finite, "last_logits_std": spread}
    if rel:
        row["graphed_vs_specialized_max_rel"] = max(rel)
    g = bench.runners.get("graphed")
    if g is not None:
        row["graph_counts"] = dict(g.counts)
        row["capture_failed"] = {str(k): v for k, v in g.capture_failed.items()}
    return row, slots


def profile_step(bench: Bench, slots: list[int]) -> dict:
    """One more step per variant under the CUDA profiler: kernels launched, device µs (sum of
    kernel times: no gaps) against the step's wall µs, the kernel names by time."""
    from torch.profiler import ProfilerActivity, profile

    from .layer_timing import kernel_summary

    profs = {}

    @contextlib.contextmanager
    def around(v):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            yield
        profs[v] = prof

    out = bench.step(slots, around)
    res = {}
    for v, prof in profs.items():
        k = kernel_summary(prof.events(), top_n=25)
        k["wall_us"] = round(out[v][0] * 1e6, 1)
        k["kernel_us"] = round(k["kernel_us"], 1)
        k["busy_fraction"] = round(k["kernel_us"] / k["wall_us"], 3)
        res[v] = k
    return res


def routing_probe(bench: Bench, slots: list[int], num_experts: int, top_k: int) -> dict:
    """One more step with the specialized path's routing recorded (a host sync per MoE call,
    so only eager variants see it): distinct experts per call, against the uniform-routing
    expectation E·(1 − (1 − k/E)^T) that `step_bytes` assumes."""
    from raydecode.models import moe as moe_mod

    seen, on = [], [False]
    real = moe_mod.route_topk

    def spy(*a, **k):
        w, ids = real(*a, **k)
        if on[0]:
            seen.append(int(ids.unique().numel()))
        return w, ids

    @contextlib.contextmanager
    def around(v):          # only the eager specialized variant's calls (a CPU graphed runner
        on[0] = v == "specialized"     # runs eagerly on rows padded to its bucket)
        try:
            yield
        finally:
            on[0] = False

    moe_mod.route_topk = spy
    try:
        bench.step(slots, around)
    finally:
        moe_mod.route_topk = real
    T = len(slots)
    out = {"calls": len(seen),
           "uniform_expected": round(num_experts * (1 - (1 - top_k / num_experts) ** T), 1)}
    if seen:
        out.update(distinct_median=statistics.median(seen), distinct_min=min(seen),
                   distinct_max=max(seen))
    return out


def host_profile_step(bench: Bench, slots: list[int], variant: str = "specialized",
                      top: int = 30) -> list[dict]:
    """cProfile of one more eager step of `variant` (other variants run too, unprofiled):
    the functions with the most own time."""
    import cProfile
    import pstats

    pr = cProfile.Profile()

    @contextlib.contextmanager
    def around(v):
        if v == variant:
            pr.enable()
        try:
            yield
        finally:
            if v == variant:
                pr.disable()

    bench.step(slots, around)
    st = pstats.Stats(pr)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{os.path.basename(fn)}:{line}({name})", "calls": nc,
             "own_ms": round(tt * 1e3, 2), "cum_ms": round(ct * 1e3, 2)}
            for (fn, line, name), (cc, nc, tt, ct, _) in rows]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="k3", help="model config: k3 (default), tiny or a path")
    ap.add_argument("--tp", type=int, default=16, help="tensor-parallel size one device plays")
    ap.add_argument("--layers", type=int, default=0, help="first N layers (0: all)")
    ap.add_argument("--batches", default="1,8,64", help="comma-separated sequences per step")
    ap.add_argument("--context", type=int, default=1024, help="tokens cached per sequence")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per batch")
    ap.add_argument("--device", default="cuda", help="cuda (graphs) or cpu (eager, tests)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated subset of {','.join(VARIANTS)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true",
                    help="per batch, one more step per variant under the CUDA profiler")
    ap.add_argument("--host-profile", action="store_true",
                    help="per batch, cProfile of one more eager specialized step")
    ap.add_argument("--routing-probe", action="store_true",
                    help="per batch, one more step recording the distinct routed experts per "
                         "MoE call of the eager specialized variant (needs it in --variants)")
    ap.add_argument("--kda-splits", type=int, default=None,
                    help="programs per head of the fused KDA decode (DecodeOptions.kda_splits; "
                         "default: automatic)")
    ap.add_argument("--router-gather", type=int, choices=(0, 1), default=1,
                    help="router top-k weights from registers (1: DecodeOptions.router_gather) "
                         "or re-loaded (0: A/B runs)")
    ap.add_argument("--attnres-bank", type=int, choices=(0, 1), default=1,
                    help="AttnRes snapshots as slots of one bank tensor (1: DecodeOptions"
                         ".attnres_bank) or separate tensors (0: A/B runs)")
    ap.add_argument("--mla-pre-tile", type=int, choices=(0, 1), default=1,
                    help="MLA split kernel's first KV tile before its PDL wait (1: "
                         "DecodeOptions.mla_pre_tile) or after it (0: A/B runs)")
    add_decode_args(ap)
    ap.add_argument("--out", default=None, help="JSON path (default: print only)")
    ap.add_argument("--commit", default=settings.commit())
    args = ap.parse_args(argv)
    try:
        settings.check_no_retired()
        options = options_from_args(args, kda_splits=args.kda_splits,
                                    router_gather=bool(args.router_gather),
                                    attnres_bank=bool(args.attnres_bank),
                                    mla_pre_tile=bool(args.mla_pre_tile))
    except ValueError as e:
        raise SystemExit(str(e))
    batches = [int(b) for b in args.batches.split(",")]
    variants = tuple(args.variants.split(","))
    if not variants or any(v not in VARIANTS for v in variants):
        raise SystemExit(f"--variants {args.variants}: accepted {', '.join(VARIANTS)}")
    if args.routing_probe and "specialized" not in variants:
        raise SystemExit("--routing-probe records the eager specialized step: add specialized "
                         f"to --variants (got {args.variants})")
    if any(b < 1 or b > 64 for b in batches):
        raise SystemExit(f"--batches {args.batches}: each must be in 1..64 (the graph buckets)")
    try:
        cfg = layer_config(args.config, args.layers)
    except ValueError as e:
        raise SystemExit(str(e))
    model, build_s = build_model(cfg, args.tp, args.device, args.seed, options)
    env = {"device": str(args.device)}
    hbm = None
    if args.device == "cuda":
        from .layer import _env
        from .layer_timing import hbm_read_bandwidth
        env = _env()
        hbm = hbm_read_bandwidth()
    bench = Bench(model, args.device, max(batches), args.context, variants)
    rows = []
    for T in batches:
        row, slots = run_batch(bench, T, args.steps)
        row["collectives_per_step"] = bench.collectives
        if args.profile and args.device == "cuda":
            row["profile"] = profile_step(bench, slots)
        if args.routing_probe:
            row["routing"] = routing_probe(bench, slots, cfg.moe.num_experts, cfg.moe.top_k)
        if args.host_profile and "specialized" in bench.runners:
            row["host_profile_specialized"] = host_profile_step(bench, slots)
        ms = row["ms"]
        row["bytes"] = {p: step_bytes(model, T, args.context, p) for p in ("stock", "specialized")}
        if hbm:
            need = {v: row["bytes"]["stock" if v == "stock" else "specialized"]["total"]
                    for v in ms}
            row["roofline_ms"] = {v: round(b / hbm * 1e3, 3) for v, b in need.items()}
            row["hbm_fraction"] = {v: round(need[v] / hbm / (ms[v] * 1e-3), 3) for v in ms}
        row["ratios"] = {f"{a}/{c}": round(ms[a] / ms[c], 2) for a, c in
                         (("stock", "graphed"), ("specialized", "graphed"),
                          ("stock", "specialized")) if a in ms and c in ms}
        rows.append(row)
        print(f"[step] TP{args.tp} L={cfg.num_layers} T={T}: " +
              ", ".join(f"{v} {t:.2f} ms" for v, t in ms.items()) +
              f"  {row['ratios']}" + (f"  HBM fraction {row['hbm_fraction']}" if hbm else ""),
              flush=True)
    report = {**env, "commit": args.commit,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "config": cfg.name, "tp": args.tp, "layers": cfg.num_layers,
              "layer_kinds": Counter(cfg.layer_kinds), "context": args.context,
              "hbm_read_bytes_per_s": hbm, "build_s": round(build_s, 1),
              "kda_splits": options.kda_splits, "router_gather": int(options.router_gather),
              "attnres_bank": int(options.attnres_bank),
              "mla_pre_tile": int(options.mla_pre_tile),
              "moe_max_pairs": options.moe_max_pairs,
              "moe_fused": options.moe_fused,
              "ffn_out_fused": options.ffn_out_fused,
              "mla_absorbed_q": options.mla_absorbed_q, "gemv_config": args.gemv_config,
              "decode_options": options.as_dict(),
              "method": __doc__.split("\n\n", 2)[2], "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
