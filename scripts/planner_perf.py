"""Decode step-time model for the capacity planner (docs/PLANNER.md §Performance model).

    step = Σ_sublayers count · (Σ_kernels t_kernel + Σ_collectives t_coll) + head + overhead
           + control plane(ranks, batch)
    t_kernel = max(bytes / (BW · eff(path, bytes/BW)), flops / (peak · eff_compute), floor)
    t_coll   = α(path) + link_bytes / NVLink_BW

Bytes and FLOPs per piece come from `models.params.decode_reads`; which pieces each kernel
reads, how many kernels and collectives a sublayer launches on each path, is the table below.
Efficiency factors are `Efficiency.defaults()` (documented origins) unless committed benchmark
JSON under bench/results/ replaces them (`load_efficiency`); nothing is fitted to the anchors.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

from raydecode.models import params as P
from raydecode.models.config import K3Config
from raydecode.scripts.planner_hw import GPU


# ---- efficiency ------------------------------------------------------------------------------

# DESIGN §4, measured on one H200 (cuBLAS bf16, M=1, CUDA graph) against the 4.8 TB/s peak:
# (N×7168 bf16 bytes, achieved B/s). Expressed as (ideal µs at peak, fraction of peak).
_H200_PEAK = 4.8e12
_DESIGN_CUBLAS = ((1024 * 7168 * 2, 1.6e12), (2048 * 7168 * 2, 2.2e12),
                  (16384 * 7168 * 2, 4.2e12))
STOCK_CURVE = tuple((b / _H200_PEAK * 1e6, a / _H200_PEAK) for b, a in _DESIGN_CUBLAS)
# Specialized target: hold, at every decode shape, the fraction cuBLAS reaches only on the large
# matrix (4.2 / 4.8), DESIGN §4 lever 2. A target, replaced by measurements when they exist.
SPECIALIZED_CURVE = ((1.0, STOCK_CURVE[-1][1]),)


def _linear(row: list, x: float) -> float:
    """y at x on sorted (x, y) points: linear between them, clamped at the ends; 0 if none."""
    if not row:
        return 0.0
    if x <= row[0][0]:
        return row[0][1]
    for (x0, y0), (x1, y1) in zip(row, row[1:]):
        if x <= x1:
            return y0 + (x - x0) / (x1 - x0) * (y1 - y0)
    return row[-1][1]


@dataclass(frozen=True)
class Efficiency:
    curves: dict              # path -> ((ideal µs, fraction of peak HBM BW), ...) sorted
    launch_floor_us: float    # least time a kernel takes inside a CUDA graph
    step_overhead_us: float   # per step: one graph launch from Python + host sync
    alpha_us: dict            # path -> fixed latency of one collective
    compute_eff: float        # fraction of dense tensor-core peak a decode GEMM reaches
    prefill_mfu: float        # fraction of BF16 peak a prefill reaches (TTFT estimate)
    sources: dict = field(default_factory=dict)   # what -> origin (doc string or file)
    # per step: coordinator decision -> plan to every rank -> rank 0's token ids back, with no
    # model work; (ranks, batch, µs) points, from control-plane-*.json when one is committed
    control_plane: tuple = ((1, 1, 60.0), (4, 1, 80.0), (16, 1, 150.0), (16, 64, 300.0))
    # per step: the coordinator's own host work a served step adds on top of the kernels and
    # the channel (scheduling, plan, outputs, the step loop); (batch, µs) points from the
    # newest serve-*.json (served TPOT p50 − graphed step − its 1-rank channel), none: 0
    host: tuple = ()
    # DSpark: (k, batch, spec step / non-speculative step) measured on the graphed
    # speculative step against the graphed decode step of the same run (the newest all-layer
    # spec-*.json, scripts/bench/spec.py); none: the modeled verify + draft pass
    spec_ratio: tuple = ()

    def spec_step_ratio(self, k: int, batch: int) -> float | None:
        """The measured spec / non-spec step ratio at k drafts (linear in batch between the
        measured batches, clamped at the ends); None when k was not measured."""
        pts = sorted((b, r) for kk, b, r in self.spec_ratio if kk == k)
        return _linear(pts, batch) if pts else None

    def host_us(self, batch: int) -> float:
        """µs of coordinator host work per step at `batch` sequences: linear between the
        measured points, clamped at the ends; 0 without a measurement."""
        return _linear(sorted(self.host), batch)

    def control_plane_us(self, ranks: int, batch: int) -> float:
        """µs of control plane per step: the points of the fewest measured ranks ≥ `ranks`
        (else the most measured), linear in batch between them, clamped at the ends."""
        pts = self.control_plane
        if not pts:
            return 0.0
        have = sorted({r for r, _, _ in pts})
        n = next((r for r in have if r >= ranks), have[-1])
        return _linear(sorted((b, us) for r, b, us in pts if r == n), batch)

    @staticmethod
    def defaults() -> "Efficiency":
        return Efficiency(
            curves={"stock": STOCK_CURVE, "specialized": SPECIALIZED_CURVE},
            launch_floor_us=1.2, step_overhead_us=26.0,
            alpha_us={"stock": 8.0, "specialized": 3.0},
            compute_eff=0.7, prefill_mfu=0.4,
            sources={
                "stock_curve": "DESIGN §4: H200 cuBLAS M=1 at 1.6/2.2/4.2 TB/s of 4.8",
                "specialized_curve": "target: 4.2/4.8 of peak at every shape (DESIGN §4)",
                "launch_floor_us": "DESIGN §4: ~1.2 µs per tiny kernel in a graph (H200)",
                "step_overhead_us": "DESIGN §4: ~26 µs per launch from Python (H200)",
                "alpha_us": "estimated: NCCL in-graph small all-reduce 8 µs; one-shot "
                            "all-reduce over peer buffers 3 µs (no measurement yet)",
                "compute_eff": "estimated: 0.7 of dense tensor-core peak",
                "prefill_mfu": "estimated: 0.4 of BF16 peak for a long prefill",
                "control_plane": "estimated (the prediction before the control-plane "
                                 "bench ran): 60 µs at 1 rank to 150 µs at 16, batch 1"})

    def mem_eff(self, path: str, ideal_us: float) -> float:
        """Fraction of peak HBM bandwidth a kernel of this ideal duration reaches
        (log-linear between points, clamped at the ends)."""
        c = self.curves[path]
        if ideal_us <= c[0][0]:
            return c[0][1]
        for (x0, y0), (x1, y1) in zip(c, c[1:]):
            if ideal_us <= x1:
                t = (math.log(ideal_us) - math.log(x0)) / (math.log(x1) - math.log(x0))
                return y0 + t * (y1 - y0)
        return c[-1][1]


_IMPL_PATH = {"cublas": "stock", "stock": "stock", "torch": "stock",
              "specialized": "specialized", "gemv": "specialized", "splitk": "specialized",
              "cute": "specialized", "oneshot": "specialized", "nccl": "stock"}
_DT = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1, "mxfp4": 0.53125}


def _peak_for(doc: dict, catalog: dict[str, GPU] | None) -> float | None:
    """Vendor peak of the measuring GPU: explicit, else the catalog entry named in `gpu`, else
    the measured HBM read bandwidth."""
    if doc.get("peak_bytes_per_s"):
        return float(doc["peak_bytes_per_s"])
    words = str(doc.get("gpu", "")).lower().split()
    for k, g in (catalog or {}).items():
        if k.lower() in words:
            return g.hbm_bw
    hbm = doc.get("hbm")
    if isinstance(hbm, dict) and hbm.get("read_reduction_bytes_per_s"):
        return float(hbm["read_reduction_bytes_per_s"])
    return float(doc["hbm_bytes_per_s"]) if doc.get("hbm_bytes_per_s") else None


def _gemv_points(row: dict, peak: float) -> list[tuple[str, float, float]]:
    """(path, ideal µs at peak, fraction of peak) from one GEMV row at M ≤ 2. Two row forms:
    generic {impl, n, k, m, dtype | bytes, achieved_bytes_per_s}, or scripts/bench/gemv.py's
    {N, K, M, weight_bytes, cublas_bytes_per_s, cute_bytes_per_s}."""
    if int(row.get("m", row.get("M", 1))) > 2:
        return []
    nbytes = row.get("bytes") or row.get("weight_bytes")
    if not nbytes and "n" in row:
        nbytes = row["n"] * row["k"] * _DT[row.get("dtype", "bf16")]
    if not nbytes:
        return []
    ideal = nbytes / peak * 1e6
    if "impl" in row:
        path = _IMPL_PATH.get(str(row["impl"]).lower())
        ach = row.get("achieved_bytes_per_s")
        return [(path, ideal, float(ach) / peak)] if path and ach else []
    return [(path, ideal, float(row[key]) / peak)
            for path, key in (("stock", "cublas_bytes_per_s"), ("specialized", "cute_bytes_per_s"))
            if row.get(key)]


def load_efficiency(bench_dir: str | Path | None, catalog: dict[str, GPU] | None = None,
                    base: Efficiency | None = None,
                    prefill_experts: str = "auto") -> tuple[Efficiency, list[str]]:
    """Defaults, with curves replaced from `gemv-*.json` and collective latencies from
    `comm-*.json` in `bench_dir` (fields: docs/PLANNER.md §Benchmark JSON); the prefill MFU
    that of the deployment's RAYDECODE_PREFILL_EXPERTS kind (`_prefill_mfu`). Missing dir or
    files: defaults. Returns (efficiency, notes on what was read or skipped)."""
    eff = base or Efficiency.defaults()
    notes: list[str] = []
    d = Path(bench_dir) if bench_dir else None
    if d is None or not d.is_dir():
        return eff, notes
    pts: dict[str, list[tuple[float, float]]] = {"stock": [], "specialized": []}
    alphas: dict[str, list[float]] = {"stock": [], "specialized": []}
    sources = dict(eff.sources)
    # gemv-tune-*.json are the mapping sweeps of scripts/bench/gemv_tune.py (kernels/gemv.py
    # TUNED), not efficiency curves: not planner input
    gemv = [f for f in sorted(d.glob("gemv-*.json")) if not f.name.startswith("gemv-tune-")]
    for f in gemv + sorted(d.glob("comm-*.json")):
        try:
            doc = json.loads(f.read_text())
            rows = doc["results"]
            used = 0
            if f.name.startswith("gemv-"):
                peak = _peak_for(doc, catalog)
                if not peak:
                    raise KeyError("peak_bytes_per_s, hbm.read_reduction_bytes_per_s, "
                                   "hbm_bytes_per_s or a catalog GPU name in `gpu`")
                for r in rows:
                    for path, x, y in _gemv_points(r, peak):
                        pts[path].append((x, y))
                        used += 1
            else:
                for r in rows:
                    path = _IMPL_PATH.get(str(r.get("impl", "")).lower())
                    if path is not None and float(r.get("bytes", 0)) <= 65536 \
                            and r.get("latency_us"):
                        alphas[path].append(float(r["latency_us"]))
                        used += 1
            notes.append(f"read {f.name} ({used} points)")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            notes.append(f"skipped {f.name}: {type(e).__name__}: {e}")
    curves = dict(eff.curves)
    for path, p in pts.items():
        if p:
            curves[path] = tuple(sorted(p))
            sources[f"{path}_curve"] = f"{d}/gemv-*.json ({len(p)} points)"
    alpha = dict(eff.alpha_us)
    for path, a in alphas.items():
        if a:
            alpha[path] = min(a)
            sources["alpha_us"] = f"{d}/comm-*.json"
    cp = eff.control_plane
    points, name = _control_plane_points(d, notes)
    if points:
        cp = points
        sources["control_plane"] = f"{d}/{name} (channel p50, {len(points)} points)"
    host = eff.host
    hpts, hname = _host_points(d, replace(eff, control_plane=cp), notes)
    if hpts:
        host = hpts
        sources["host"] = (f"{d}/{hname} (served TPOT p50 − graphed step − 1-rank channel, "
                           f"{len(hpts)} points)")
    mfu = eff.prefill_mfu
    measured, pname = _prefill_mfu(d, notes, prefill_experts)
    if measured is not None:
        mfu = measured
        sources["prefill_mfu"] = (f"{d}/{pname} (the served prefill kernels' fraction of the "
                                  f"same run's dense bf16 GEMM rate, longest prompt, "
                                  f"{prefill_experts} experts)")
    spec = eff.spec_ratio
    spts, sname = _spec_points(d, notes)
    if spts:
        spec = spts
        sources["spec_ratio"] = (f"{d}/{sname} (graphed speculative step / graphed decode step "
                                 f"of the same run, median over the synthetic L, "
                                 f"{len(spts)} (k, batch) points)")
    return replace(eff, curves=curves, alpha_us=alpha, sources=sources,
                   control_plane=cp, host=host, prefill_mfu=mfu, spec_ratio=spec), notes


def _spec_points(d: Path, notes: list[str]) -> tuple[tuple, str | None]:
    """(k, batch, ratio) from the newest spec-*.json that ran every layer of its model with the
    graphed runner (scripts/bench/spec.py; fewer layers weigh the drafter's fixed cost more):
    per (k, batch) the median over its rows of step_ms / nonspec_ms; ((), None) without one."""
    for f, doc in _newest_first(d, "spec-*.json", notes):
        try:
            if doc.get("layers") != doc.get("layers_total"):
                continue
            by: dict[tuple[int, int], list[float]] = {}
            for r in doc["runs"][0]["rows"]:
                if r.get("runner", "eager") == "graphed" and r.get("nonspec_ms"):
                    by.setdefault((int(r["k"]), int(r["batch"])), []).append(
                        float(r["step_ms"]) / float(r["nonspec_ms"]))
        except (ValueError, KeyError, TypeError, IndexError) as e:
            notes.append(f"skipped {f.name}: {type(e).__name__}: {e}")
            continue
        if by:
            pts = tuple(sorted((k, b, statistics.median(v)) for (k, b), v in by.items()))
            notes.append(f"read {f.name} ({len(pts)} DSpark (k, batch) step ratios)")
            return pts, f.name
    return (), None


def _our_kind(p: dict, kind: str) -> bool:
    """Whether prompt row p ran the expert kernels `kind` names: its `prefill_experts`; for
    "auto" also a row that ran ours as its run's shipped kind (the runs before "auto", and
    rows without the field: the defaults of their day). Never a row whose final AttnRes mix
    ran on every row (`final_mix` "all": the bench's baseline, not what a served runner
    does)."""
    if p.get("final_mix", "rows") != "rows":
        return False
    ran = p.get("prefill_experts")
    if ran == kind:
        return True
    return kind == "auto" and (ran is None or (p.get("shipped", False)
                                               and not str(ran).startswith("ogs")))


def _prefill_mfu(d: Path, notes: list[str],
                 kind: str = "auto") -> tuple[float | None, str | None]:
    """The fraction of the dense bf16 rate the served prefill kernels reach, from the newest
    prefill-*.json of `--kernels prefill` (scripts/bench/prefill.py; `reference` runs are the
    baseline, not what a replica runs) with a prompt row of the deployment's expert kernels
    (`kind`, RAYDECODE_PREFILL_EXPERTS: `_our_kind`): the MFU of the longest such prompt of its
    first TP (a long prompt's steady rate, what a TTFT estimate needs); (None, None) without
    one."""
    for f, doc in _newest_first(d, "prefill-*.json", notes):
        try:
            if doc.get("kernels", "prefill") != "prefill":
                continue
            # a run without a prompt case (not asked, or cut short) has no MFU to give
            rows = [p for p in doc["runs"][0].get("prompts", ())
                    if p.get("mfu") and _our_kind(p, kind)]
            if not rows:
                continue
            mfu = float(max(rows, key=lambda p: int(p["prompt_tokens"]))["mfu"])
        except (ValueError, KeyError, TypeError, IndexError) as e:
            notes.append(f"skipped {f.name}: {type(e).__name__}: {e}")
            continue
        if 0 < mfu <= 1:
            notes.append(f"read {f.name} (prefill MFU {mfu:.3f})")
            return mfu, f.name
        notes.append(f"skipped {f.name}: prefill MFU {mfu} outside (0, 1]")
    return None, None


def _newest_first(d: Path, pattern: str, notes: list[str]) -> list[tuple[Path, dict]]:
    """The bench JSONs matching `pattern`, newest first by the run's own `date` (ISO 8601, as
    report_io writes it; then the name): a second run of the same day sorts after the first by
    name (`serve-h200-2026-12-02-r2.json` < `serve-h200-2026-12-02.json`), not by date."""
    docs = []
    for f in d.glob(pattern):
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            notes.append(f"skipped {f.name}: {type(e).__name__}: {e}")
            continue
        date = doc.get("date") if isinstance(doc, dict) else None
        docs.append((str(date or ""), f.name, f, doc))
    return [(f, doc) for _, _, f, doc in sorted(docs, key=lambda x: x[:2], reverse=True)]


def _host_points(d: Path, eff: "Efficiency", notes: list[str]) -> tuple[tuple, str | None]:
    """(batch, µs) of coordinator host work per step from the newest serve-*.json
    (scripts/bench/serve.py: one rank, so its channel is the 1-rank control plane);
    ((), None) without one. Negative differences (noise) count as 0."""
    for f, doc in _newest_first(d, "serve-*.json", notes):
        try:
            pts = []
            for r in doc["levels"]:
                c, tpot = int(r["concurrency"]), r.get("tpot_ms_p50")
                g = r.get("graphed_step_ms")
                if tpot and g:
                    us = (float(tpot) - float(g)) * 1e3 - eff.control_plane_us(1, c)
                    pts.append((c, max(0.0, round(us, 1))))
        except (ValueError, KeyError, TypeError) as e:
            notes.append(f"skipped {f.name}: {type(e).__name__}: {e}")
            continue
        if pts:
            notes.append(f"read {f.name} ({len(pts)} points)")
            return tuple(pts), f.name
    return (), None


def _control_plane_points(d: Path, notes: list[str]) -> tuple[tuple, str | None]:
    """(ranks, batch, µs) of the served channel from the newest control-plane-*.json
    (scripts/bench/control_plane.py); ((), None) without one."""
    for f, doc in _newest_first(d, "control-plane-*.json", notes):
        try:
            pts = tuple((int(g["ranks"]), int(r["batch"]), float(r["p50_ms"]) * 1e3)
                        for g in doc["groups"] for r in g["rows"]
                        if r.get("variant") == "channel" and "p50_ms" in r)
        except (ValueError, KeyError, TypeError) as e:
            notes.append(f"skipped {f.name}: {type(e).__name__}: {e}")
            continue
        if pts:
            notes.append(f"read {f.name} ({len(pts)} points)")
            return pts, f.name
    return (), None


# ---- kernels per sublayer and path ----------------------------------------------------------

@dataclass(frozen=True)
class Kernel:
    name: str
    reads: tuple[str, ...] = ()   # pieces of decode_reads()[kind] this kernel moves
    needs: str | None = None      # launched only when this piece exists (e.g. an output gate)
    side: bool = False            # side stream: its floor hides under the main stream


def _k(name: str, *reads: str, needs: str | None = None, side: bool = False) -> Kernel:
    return Kernel(name, reads, needs, side)


# Stock: the unfused per-op sequence an eager-style engine captures in a graph (vLLM-like).
# Specialized: DESIGN §4 fusions (norms/AttnRes in GEMV prologues and in the all-reduce kernel,
# activation in the expert GEMV, shared expert on a side stream).
KERNELS: dict[str, dict[str, tuple[Kernel, ...]]] = {
    "stock": {
        "kda": (_k("attn_res_mix", "attn_res"), _k("rmsnorm"), _k("in_proj", "in_proj"),
                _k("f_b", "f_b"), _k("short_conv", "conv"), _k("decay_gate", "gates"),
                _k("kda_recurrent", "state"), _k("o_norm_gate"), _k("o_proj", "o_proj")),
        "mla": (_k("attn_res_mix", "attn_res"), _k("rmsnorm", needs="attn_res"),
                _k("qkv_a", "qkv_a"), _k("q_kv_norms"), _k("q_b", "q_b"),
                _k("q_absorb", "w_uk"), _k("kv_cache_write"), _k("mla_decode", "kv_cache"),
                _k("v_absorb", "w_uv"), _k("g_proj", "g_proj"),
                _k("sigmoid_gate", needs="g_proj"), _k("o_proj", "o_proj")),
        "moe": (_k("attn_res_mix", "attn_res"), _k("rmsnorm"), _k("router", "router"),
                _k("topk", "topk"), _k("latent_down", "latent_down"),
                _k("experts_gate_up", "experts_gate_up"), _k("situ"),
                _k("experts_down", "experts_down"), _k("latent_norm"),
                _k("latent_up", "latent_up"), _k("shared_gate_up", "shared_gate_up"),
                _k("shared_situ", needs="shared_gate_up"), _k("shared_down", "shared_down"),
                _k("add")),
        "dense": (_k("attn_res_mix", "attn_res"), _k("rmsnorm", needs="attn_res"),
                  _k("gate_up", "gate_up"), _k("situ"), _k("down", "down")),
        "head": (_k("embedding", "embedding"), _k("final_attn_res", "final_attn_res"),
                 _k("final_norm"), _k("lm_head", "lm_head"), _k("sampling", "sampling"),
                 _k("sampler_misc")),
        "draft_in": (_k("embedding", "embedding"), _k("context_proj", "context_proj"),
                     _k("norm")),
        "draft_head": (_k("lm_head", "lm_head"), _k("logits", "logits")),
        "markov_step": (_k("markov_bias", "markov"), _k("sample")),
    },
    "specialized": {
        "kda": (_k("in_proj", "attn_res", "in_proj"), _k("f_b_gates", "f_b", "gates"),
                _k("kda_step", "conv", "state"), _k("o_proj", "o_proj")),
        "mla": (_k("qkv_a_g", "attn_res", "qkv_a", "g_proj"), _k("q_b", "q_b"),
                _k("q_absorb", "w_uk"), _k("mla_decode", "kv_cache"), _k("v_absorb", "w_uv"),
                _k("o_proj", "o_proj")),
        "moe": (_k("router_latent_down", "attn_res", "router", "latent_down"),
                _k("topk", "topk"), _k("experts_gate_up", "experts_gate_up"),
                _k("experts_down", "experts_down"), _k("latent_up", "latent_up"),
                _k("shared_gate_up", "shared_gate_up", side=True),
                _k("shared_down", "shared_down", side=True)),
        "dense": (_k("gate_up", "attn_res", "gate_up"), _k("down", "down")),
        "head": (_k("embedding", "embedding"), _k("lm_head", "final_attn_res", "lm_head"),
                 _k("sampling", "sampling")),
        "draft_in": (_k("context_proj", "embedding", "context_proj"),),
        "draft_head": (_k("lm_head", "lm_head", "logits"),),
        "markov_step": (_k("markov_sample", "markov"),),
    },
}
KERNELS["stock"]["draft_mla"] = KERNELS["stock"]["mla"]
KERNELS["stock"]["draft_mlp"] = KERNELS["stock"]["dense"]
KERNELS["specialized"]["draft_mla"] = KERNELS["specialized"]["mla"]
KERNELS["specialized"]["draft_mlp"] = KERNELS["specialized"]["dense"]


def collectives(cfg: K3Config, kind: str, path: str, tp: int, dcp: int,
                heads: int | None = None) -> list[tuple[str, int, float]]:
    """(op, group size, message bytes per token per rank) for one sublayer occurrence.
    Stock: one all-reduce after each row-parallel output (the MoE adds one for the latent
    partial sums before latent_norm). Specialized: the 1/TP slices of what stock replicates are
    exchanged with all-gathers (qkv_a; router + latent down), the rest as stock."""
    H, m, e = cfg.hidden_size, cfg.mla, cfg.moe
    ar_h = ("all_reduce", tp, H * 2)
    spec = path == "specialized"
    base = kind.removeprefix("draft_")
    out: list[tuple[str, int, float]] = []
    if base in ("kda", "dense", "mlp"):
        out = [ar_h]
    elif base == "mla":
        out = ([("all_gather", tp, (m.q_lora_rank + m.latent_dim) / tp * 2)] if spec else [])
        out.append(ar_h)
        if dcp > 1:   # queries to the DCP group; partial outputs + LSE back to head owners
            hl = (heads or m.num_heads) // tp
            out += [("all_gather", dcp, hl * m.latent_dim * 2),
                    ("all_to_all", dcp, hl * dcp * (m.kv_lora_rank * 2 + 4))]
    elif base == "moe":
        out = ([("all_gather", tp, (e.num_experts * 4 + e.latent_size * 2) / tp)] if spec
               else [])
        out += [("all_reduce", tp, e.latent_size * 2), ar_h]
    elif base == "head":
        out = [ar_h, ("all_gather", tp, 64 if spec else cfg.vocab_size / tp * 4)]
    elif base == "in":
        out = [("all_gather", tp, H / tp * 2)]
    elif base == "markov_step":
        out = [("all_gather", tp, 64)]
    return [c for c in out if c[1] > 1]


def collective_us(op: str, n: int, msg: float, path: str, gpu: GPU, eff: Efficiency) -> float:
    """α + bytes over one GPU's NVLink. All-reduce: ring 2(n−1)/n·msg (stock, NCCL) or
    one-shot (n−1)·msg read from peers (specialized); all-gather / all-to-all: (n−1)·msg."""
    if op == "all_reduce":
        link = 2 * (n - 1) / n * msg if path == "stock" else (n - 1) * msg
    else:
        link = (n - 1) * msg
    return eff.alpha_us[path] + link / gpu.nvlink_bw * 1e6


@dataclass(frozen=True)
class SublayerTime:
    us: float
    kernels: int
    collectives: int
    comm_us: float
    detail: tuple[tuple[str, float], ...]   # (kernel or collective, µs)


def sublayer_time(cfg: K3Config, kind: str, pieces: dict[str, P.Read], tokens: int, path: str,
                  tp: int, dcp: int, gpu: GPU, eff: Efficiency,
                  heads: int | None = None) -> SublayerTime:
    floor = eff.launch_floor_us
    detail, n_k, t_sum = [], 0, 0.0
    for k in KERNELS[path][kind]:
        if k.needs is not None and k.needs not in pieces:
            continue
        present = [pieces[r] for r in k.reads if r in pieces]
        if k.reads and not present:
            continue
        nbytes = sum(r.bytes for r in present)
        ideal = nbytes / gpu.hbm_bw * 1e6
        t = ideal / eff.mem_eff(path, ideal) if nbytes else 0.0
        t_cmp = sum(r.flops / (gpu.peak_flops(r.fmt) * eff.compute_eff) for r in present) * 1e6
        t = max(t, t_cmp)
        if not k.side:
            t = max(t, floor)
            n_k += 1
        detail.append((k.name, t))
        t_sum += t
    comm = 0.0
    colls = collectives(cfg, kind, path, tp, dcp, heads)
    for op, n, msg in colls:
        c = collective_us(op, n, msg * tokens, path, gpu, eff)
        detail.append((op, c))
        comm += c
    return SublayerTime(t_sum + comm, n_k, len(colls), comm, tuple(detail))


@dataclass(frozen=True)
class StepTime:
    us: float                              # whole step (draft included for a DSpark step)
    path: str                              # the path the step ran on
    sublayers: dict                        # kind -> SublayerTime (per occurrence)
    counts: dict                           # kind -> occurrences per step
    overhead_us: float
    draft_us: float = 0.0
    control_plane_us: float = 0.0          # included in us
    host_us: float = 0.0                   # the coordinator's host work, included in us

    def layer_kinds_us(self, cfg: K3Config) -> dict[str, dict]:
        """Per layer kind ('kda+moe', 'mla+moe', 'kda+dense'): µs per layer, layers, kernels,
        collectives."""
        out: dict[str, dict] = {}
        for i, att in enumerate(cfg.layer_kinds):
            ffn = "moe" if cfg.is_moe_layer(i) else "dense"
            a, f = self.sublayers[att], self.sublayers[ffn]
            r = out.setdefault(f"{att}+{ffn}", {"us": a.us + f.us, "layers": 0,
                                                "kernels": a.kernels + f.kernels,
                                                "collectives": a.collectives + f.collectives,
                                                "comm_us": a.comm_us + f.comm_us})
            r["layers"] += 1
        return out


def step_time(cfg: K3Config, gpu: GPU, eff: Efficiency, path: str, tp: int, dcp: int,
              seqs: int, context: int, tokens_per_seq: int = 1, kv_dtype: str = "bf16",
              state_dtype: str = "fp32") -> StepTime:
    """One target decode (or verify, tokens_per_seq = k+1) step on one replica."""
    reads = P.decode_reads(cfg, tp, path, seqs, tokens_per_seq, context, dcp, kv_dtype,
                           state_dtype)
    tokens = seqs * tokens_per_seq
    counts = {**P.layer_counts(cfg), "head": 1}
    subs = {kind: sublayer_time(cfg, kind, pieces, tokens, path, tp, dcp, gpu, eff)
            for kind, pieces in reads.items()}
    cp = eff.control_plane_us(tp, seqs)
    host = eff.host_us(seqs)
    total = sum(counts[k] * s.us for k, s in subs.items()) + eff.step_overhead_us + cp + host
    return StepTime(total, path, subs, {k: counts[k] for k in subs}, eff.step_overhead_us,
                    control_plane_us=cp, host_us=host)


def draft_time(cfg: K3Config, gpu: GPU, eff: Efficiency, path: str, tp: int, dcp: int,
               seqs: int, k: int, context: int, kv_dtype: str = "bf16",
               d: P.DrafterSpec = P.DrafterSpec()) -> StepTime:
    """One DSpark draft pass: drafter layers once over seqs·k positions, then k sequential
    Markov-biased samples."""
    reads = P.drafter_reads(cfg, tp, path, seqs, k, context, dcp, kv_dtype, d)
    counts = {"draft_in": 1, "draft_mla": d.num_layers, "draft_mlp": d.num_layers,
              "draft_head": 1, "markov_step": k}
    tokens = {"draft_in": seqs, "markov_step": seqs}
    subs = {kind: sublayer_time(cfg, kind, pieces, tokens.get(kind, seqs * k), path, tp, dcp,
                                gpu, eff, heads=d.num_heads)
            for kind, pieces in reads.items()}
    total = sum(counts[kk] * s.us for kk, s in subs.items())
    return StepTime(total, path, subs, counts, 0.0)
