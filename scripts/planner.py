"""Capacity planner: memory per GPU, max concurrency/context, decode speed on both paths,
replicas, racks and cost for a workload (issue 7; docs/PLANNER.md).

`plan(...)` is the whole computation and returns a JSON-ready dict; `raydecode plan` is its CLI
(raydecode/commands/plan.py) and `planner_report` renders the table and plots. Inputs are frozen
dataclasses checked by `validate`, which raises `PlanError` saying what to change.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from raydecode.kernels.settings import PREFILL_COPY_PAD, parse_prefill_experts
from raydecode.models import params as P
from raydecode.models.config import K3Config
from raydecode.scripts.planner_hw import GPU, PlanError
from raydecode.scripts.planner_perf import Efficiency, draft_time, step_time

# DESIGN §3 envelope of the specialized path
SPEC_MAX_TOKENS = 64
SPEC_K_RANGE = (3, 7)
SPEC_TP = (8, 16)
GIB = 2 ** 30


@dataclass(frozen=True)
class Deployment:
    tp: int = 16
    dcp: int = 1
    path: str = "specialized"          # requested; steps outside the envelope run stock
    batch: int = 1                     # concurrent sequences per replica
    context: int = 8192                # tokens each sequence may reach (memory is reserved)
    dspark_k: int = 0                  # drafts per step; 0 = no speculative decoding
    acceptance: float | None = None    # mean tokens per verify step, in [1, k+1]
    kv_dtype: str = "bf16"
    state_dtype: str = "fp32"
    gpu_memory_utilization: float = 0.90
    prefill_chunk: int = 8192          # tokens per prefill chunk (activation workspace)
    kda_snapshots: int = 0             # KDA state snapshots per rank (prefix caching)
    prefill_experts: str = "auto"      # RAYDECODE_PREFILL_EXPERTS; ogs-hopper: a second copy


@dataclass(frozen=True)
class Workload:
    requests_per_s: float | None = None
    concurrent_users: int | None = None
    input_len: int = 2048
    output_len: int = 512
    target_tps_user: float | None = None
    ttft_target_s: float | None = None

    @property
    def given(self) -> bool:
        return self.requests_per_s is not None or self.concurrent_users is not None


def validate(cfg: K3Config, gpu: GPU, dep: Deployment, wl: Workload | None = None) -> None:
    if dep.tp < 1:
        raise PlanError(f"--tp {dep.tp}: expected a positive integer")
    try:
        P.check_tp(cfg, dep.tp)
        if dep.dspark_k:
            P.drafter_bytes_per_rank(cfg, dep.tp)
            if P.DrafterSpec().num_heads % dep.tp:
                raise P.ShardError(f"TP = {dep.tp} does not divide the drafter's "
                                   f"{P.DrafterSpec().num_heads} heads")
    except P.ShardError as e:
        ok = [t for t in P.valid_tps(cfg, gpu.nvlink_domain)
              if not dep.dspark_k or P.DrafterSpec().num_heads % t == 0]
        raise PlanError(f"--tp {dep.tp}: {e}; TP degrees that shard {cfg.name} inside one "
                        f"{gpu.name} NVLink domain: {ok}") from None
    if dep.dcp < 1 or dep.tp % dep.dcp:
        raise PlanError(f"--dcp {dep.dcp} must divide --tp {dep.tp}; choose one of "
                        f"{[d for d in range(1, dep.tp + 1) if dep.tp % d == 0]}")
    if dep.tp > gpu.nvlink_domain:
        raise PlanError(f"--tp {dep.tp} exceeds the NVLink domain of {gpu.name} "
                        f"({gpu.nvlink_domain} GPUs); a replica must sit in one domain: use "
                        f"--tp <= {gpu.nvlink_domain} or a GPU with a larger domain (GB300)")
    if dep.path not in P.PATHS:
        raise PlanError(f"--path {dep.path!r}; expected one of {P.PATHS}")
    if dep.batch < 1:
        raise PlanError(f"--batch {dep.batch}: expected >= 1")
    if dep.context < 1:
        raise PlanError(f"--context {dep.context}: expected a positive number of tokens (1.."
                        f"{cfg.max_position_embeddings:,})")
    if dep.context > cfg.max_position_embeddings:
        raise PlanError(f"--context {dep.context}: the model supports 1.."
                        f"{cfg.max_position_embeddings:,} tokens (max_position_embeddings); use "
                        "a shorter context")
    for nm, v in (("--kv-dtype", dep.kv_dtype), ("--state-dtype", dep.state_dtype)):
        ok = ("bf16", "fp8") if nm == "--kv-dtype" else ("fp32", "bf16")
        if v not in ok:
            raise PlanError(f"{nm} {v!r}; expected one of {ok}")
    try:
        parse_prefill_experts(dep.prefill_experts)
    except ValueError as e:
        raise PlanError(f"--prefill-experts: {e}") from None
    if isinstance(dep.kda_snapshots, bool) or not isinstance(dep.kda_snapshots, int) \
            or dep.kda_snapshots < 0:
        raise PlanError(f"--kda-snapshots {dep.kda_snapshots}: expected an integer >= 0 (the "
                        "deployment's kda_snapshot_slots; 0 without prefix caching)")
    if not 0.0 < dep.gpu_memory_utilization <= 1.0:
        raise PlanError(f"--gpu-memory-utilization {dep.gpu_memory_utilization}: expected (0, 1]")
    if dep.dspark_k:
        block = P.DrafterSpec().block_size
        if not 1 <= dep.dspark_k <= block:
            raise PlanError(f"--dspark-k {dep.dspark_k}: the drafter drafts blocks of {block}; "
                            f"more drafts collapse acceptance (DESIGN §6). Use 1..{block}")
        L = dep.acceptance
        if L is None:
            raise PlanError(f"--dspark-k {dep.dspark_k} needs --acceptance-length L in "
                            f"[1, {dep.dspark_k + 1}] (mean tokens per verify step, bonus "
                            "token included)")
        if not 1.0 <= L <= dep.dspark_k + 1:
            raise PlanError(f"--acceptance-length {L:g}: with --dspark-k {dep.dspark_k} it must "
                            f"lie in [1, {dep.dspark_k + 1}] (it counts the bonus token)")
    if wl is not None:
        for nm, v in (("--requests-per-s", wl.requests_per_s),
                      ("--concurrent-users", wl.concurrent_users),
                      ("--target-tps-user", wl.target_tps_user),
                      ("--ttft-target", wl.ttft_target_s)):
            if v is not None and v <= 0:
                raise PlanError(f"{nm} {v}: expected > 0")
        if wl.input_len < 1 or wl.output_len < 1:
            raise PlanError("--input-len and --output-len must be >= 1")
        if wl.given and wl.input_len + wl.output_len > dep.context:
            raise PlanError(f"--input-len {wl.input_len} + --output-len {wl.output_len} exceeds "
                            f"--context {dep.context}; raise --context")


def runs_as(path: str, seqs: int, k: int = 0) -> str:
    """The path a step takes (DESIGN §3): specialized only inside the envelope."""
    if path == "stock":
        return "stock"
    if k:
        lo, hi = SPEC_K_RANGE
        return "specialized" if lo <= k <= hi and seqs * (k + 1) <= SPEC_MAX_TOKENS else "stock"
    return "specialized" if seqs <= SPEC_MAX_TOKENS else "stock"


# ---- memory -----------------------------------------------------------------------------------

def memory(cfg: K3Config, gpu: GPU, dep: Deployment) -> dict:
    """Bytes per GPU. Weights are held in the stock layout (the stock step runs on the same
    ranks, DESIGN §3); the specialized kernels read 1/TP slices of the replicated tensors."""
    tp = dep.tp
    w = P.weight_bytes_per_rank(cfg, tp, "stock")
    drafter = P.drafter_bytes_per_rank(cfg, tp) if dep.dspark_k else 0.0
    H, e = cfg.hidden_size, cfg.moe
    # activation workspace: the largest step (a prefill chunk) × per-token live bytes: AttnRes
    # bank rows + 4 of the widest per-rank intermediates; + fp32 logits of the decode tokens.
    widest = max(2 * cfg.intermediate_size // tp, e.top_k * 2 * e.expert_intermediate // tp,
                 4 * cfg.kda.inner_dim // tp + cfg.kda.head_dim)
    per_tok = (cfg.num_attn_res_blocks + 1) * H * 2 + 4 * widest * 2
    decode_tokens = dep.batch * (dep.dspark_k + 1)
    workspace = max(dep.prefill_chunk, decode_tokens) * per_tok \
        + decode_tokens * cfg.vocab_size // tp * 4
    usable = dep.gpu_memory_utilization * gpu.hbm_bytes
    weights = sum(w.values())
    # RAYDECODE_PREFILL_EXPERTS=ogs-hopper: every MoE layer's experts again, in matmul_ogs's
    # Hopper layouts (engine/loader.py `prepare_prefill_experts`, padded ≤ PREFILL_COPY_PAD)
    prefill_copy = (w["routed_experts"] * PREFILL_COPY_PAD
                    if dep.prefill_experts == "ogs-hopper" else 0.0)
    weights += prefill_copy
    kv_tok = P.kv_bytes_per_token(cfg, dep.dcp, dep.kv_dtype,
                                  P.DrafterSpec().num_layers if dep.dspark_k else 0)
    kda_seq = P.kda_state_bytes_per_seq(cfg, tp, dep.state_dtype)
    # prefix caching: each snapshot slot is one sequence's KDA state, allocated at start (its
    # MLA blocks come out of the cache budget's block pool and are evicted under pressure)
    snapshots = dep.kda_snapshots * kda_seq
    # DSpark's graphed verify step: per-position KDA state rows, one per verify token of the
    # largest step (MAX_VERIFY_TOKENS = batch·(k+1) ≤ 64), allocated at build
    # (engine/spec_graph.py, kernels/kda_verify.py)
    spec_positions = SPEC_MAX_TOKENS * kda_seq if dep.dspark_k else 0.0
    cache = usable - weights - drafter - workspace - snapshots - spec_positions
    per_seq = dep.context * kv_tok + kda_seq
    return {
        "hbm": gpu.hbm_bytes, "usable": usable, "reserved": gpu.hbm_bytes - usable,
        "weights_by_kind": w, "weights": weights, "prefill_experts_copy": prefill_copy,
        "weights_replicated": sum(w[k] for k in P.REPLICATED_IN_STOCK),
        "drafter": drafter, "workspace": workspace, "kda_snapshots": snapshots,
        "spec_per_position_state": spec_positions,
        "cache_budget": cache,
        "kv_bytes_per_token": kv_tok, "kda_state_bytes_per_seq": kda_seq,
        "bytes_per_seq": per_seq, "cache_used": dep.batch * per_seq,
        "max_concurrency": max(0, int(cache // per_seq)),
        "max_context_at_batch": _max_context(cfg, cache, dep.batch, kv_tok, kda_seq),
        "max_context_single": _max_context(cfg, cache, 1, kv_tok, kda_seq),
    }


def _max_context(cfg: K3Config, cache: float, seqs: int, kv_tok: float, kda_seq: float) -> int:
    c = int((cache / seqs - kda_seq) // kv_tok) if cache > 0 else 0
    return max(0, min(c, cfg.max_position_embeddings))


def larger_tps(cfg: K3Config, gpu: GPU, tp: int) -> list[int]:
    """TP degrees above `tp` that shard the model and fit in one NVLink domain."""
    return [t for t in P.valid_tps(cfg, gpu.nvlink_domain) if t > tp]


def _fits(cfg: K3Config, gpu: GPU, dep: Deployment) -> bool:
    mem = memory(cfg, gpu, dep)
    return mem["cache_budget"] > 0 and mem["cache_used"] <= mem["cache_budget"]


def fitting_alternatives(cfg: K3Config, gpu: GPU, dep: Deployment) -> tuple[int | None,
                                                                           int | None]:
    """(smallest larger TP, smallest larger DCP at this TP) at which this batch and context fit,
    None where none does: a suggestion the planner makes must itself fit. A larger TP keeps
    the DCP when it divides it, else the DCP that does."""
    tp = next((t for t in larger_tps(cfg, gpu, dep.tp)
               if _fits(cfg, gpu, replace(dep, tp=t, dcp=dep.dcp if t % dep.dcp == 0 else 1))),
              None)
    dcp = next((d for d in range(dep.dcp + 1, dep.tp + 1)
                if dep.tp % d == 0 and _fits(cfg, gpu, replace(dep, dcp=d))), None)
    return tp, dcp


def check_fits(cfg: K3Config, gpu: GPU, dep: Deployment, mem: dict) -> None:
    gb = 1e9
    bigger = larger_tps(cfg, gpu, dep.tp)
    fit_tp, fit_dcp = fitting_alternatives(cfg, gpu, dep)
    if fit_tp is not None:
        tp_hint = f"--tp {fit_tp}"
    elif bigger:
        tp_hint = (f"a GPU with more HBM (no TP up to {bigger[-1]} fits at this batch and "
                   "context)")
    else:
        tp_hint = (f"a GPU with more HBM ({gpu.name} allows no larger TP inside its "
                   f"{gpu.nvlink_domain}-GPU NVLink domain)")
    if mem["cache_budget"] <= 0:
        over = -mem["cache_budget"]
        raise PlanError(
            f"weights {mem['weights'] / gb:.1f} GB + drafter {mem['drafter'] / gb:.1f} GB + "
            f"workspace {mem['workspace'] / gb:.1f} GB "
            + (f"+ {dep.kda_snapshots} KDA snapshots {mem['kda_snapshots'] / gb:.1f} GB "
               if dep.kda_snapshots else "")
            + (f"+ DSpark per-position KDA state {mem['spec_per_position_state'] / gb:.1f} GB "
               if dep.dspark_k else "") + "per GPU exceed the usable "
            f"{mem['usable'] / gb:.1f} GB of {gpu.name} at --tp {dep.tp} (over by {over / gb:.1f} "
            f"GB); "
            f"use {tp_hint}, or a smaller --prefill-chunk if the workspace is the excess"
            + (f", or --prefill-experts auto (its Hopper copy of the experts: "
               f"{mem['prefill_experts_copy'] / gb:.1f} GB of the weights)"
               if mem["prefill_experts_copy"] else "")
            + (", or fewer --kda-snapshots" if dep.kda_snapshots else ""))
    if mem["cache_used"] > mem["cache_budget"]:
        over = mem["cache_used"] - mem["cache_budget"]
        raise PlanError(
            f"--batch {dep.batch} at --context {dep.context:,} needs {mem['cache_used'] / gb:.1f} "
            f"GB of KV/KDA cache per GPU but {mem['cache_budget'] / gb:.1f} GB is left "
            f"(over by {over / gb:.1f} GB): "
            + "; or ".join(_cache_hints(mem, fit_tp, fit_dcp, tp_hint)))


def _cache_hints(mem: dict, fit_tp: int | None, fit_dcp: int | None, tp_hint: str) -> list[str]:
    """What does fit, each option checked: a smaller batch or context, or a DCP / TP at which
    this batch and context fit; a larger GPU when no TP does."""
    hints = []
    if mem["max_concurrency"] >= 1:
        hints.append(f"use --batch <= {mem['max_concurrency']} at this context")
    if mem["max_context_at_batch"] >= 1:
        hints.append(f"--context <= {mem['max_context_at_batch']:,} at this batch")
    if fit_dcp is not None:
        hints.append(f"--dcp {fit_dcp} (splits the MLA cache)")
    hints.append(tp_hint)
    return hints


# ---- speed ------------------------------------------------------------------------------------

def speed(cfg: K3Config, gpu: GPU, eff: Efficiency, dep: Deployment, path: str, seqs: int,
          context: int | None = None, detail: bool = True) -> dict:
    """Decode speed at `seqs` sequences on `path` (requested; the envelope may turn it stock)."""
    ctx = dep.context if context is None else context
    k = dep.dspark_k
    p = runs_as(path, seqs, k)
    st = step_time(cfg, gpu, eff, p, dep.tp, dep.dcp, seqs, ctx, k + 1, dep.kv_dtype,
                   dep.state_dtype)
    draft = draft_time(cfg, gpu, eff, p, dep.tp, dep.dcp, seqs, k, ctx, dep.kv_dtype).us \
        if k else 0.0
    per_step = dep.acceptance if k else 1.0
    total = st.us + draft
    ratio = eff.spec_step_ratio(k, seqs) if k and p == "specialized" else None
    if ratio is not None:   # the measured graphed speculative step, over the modeled decode
        plain = step_time(cfg, gpu, eff, p, dep.tp, dep.dcp, seqs, ctx, 1, dep.kv_dtype,
                          dep.state_dtype)
        total = plain.us * ratio
    out = {"requested": path, "runs_as": p, "batch": seqs, "context": ctx,
           "step_us": total, "target_step_us": st.us, "draft_us": draft,
           "spec_step": (None if not k else "modeled: verify at batch·(k+1) + draft pass"
                         if ratio is None else f"measured: {ratio:.3f} × the decode step "
                         "(graphed spec step / graphed decode step, spec-*.json)"),
           "tokens_per_step_per_seq": per_step, "control_plane_us": st.control_plane_us,
           "host_us": st.host_us,
           # what a client sees between tokens: the step with its control plane and the
           # coordinator's host work, per token
           "served_tpot_ms": total / per_step / 1e3,
           "tok_s_user": per_step * 1e6 / total, "tok_s": seqs * per_step * 1e6 / total}
    if detail:
        out["layer_kinds"] = st.layer_kinds_us(cfg)
        out["sublayers"] = {kk: {"us": s.us, "kernels": s.kernels, "collectives": s.collectives,
                                 "count": st.counts[kk], "comm_us": s.comm_us}
                            for kk, s in st.sublayers.items()}
        out["overhead_us"] = st.overhead_us
    return out


def prefill_seconds(cfg: K3Config, gpu: GPU, eff: Efficiency, tp: int, tokens: int) -> float:
    """Compute-bound prefill estimate: 2·active params·tokens + MLA attention
    (2·heads·(qk+v)·tokens²/2 per MLA layer) at prefill_mfu × BF16 peak on TP GPUs."""
    pc = P.param_counts(cfg)
    m = cfg.mla
    attn = len(cfg.mla_layers) * 2 * m.num_heads * (m.qk_head_dim + m.v_head_dim) \
        * tokens * tokens / 2
    flops = 2 * pc["active_excl_embedding"] * tokens + attn
    return flops / (tp * gpu.bf16_flops * eff.prefill_mfu)


# ---- fleet: replicas, racks, cost ---------------------------------------------------------------

def size_workload(cfg: K3Config, gpu: GPU, eff: Efficiency, dep: Deployment, wl: Workload,
                  mem: dict, price: float | None, warnings: list[str]) -> dict:
    """Smallest replica count R that serves the workload at the tok/s/user target.

    Per replica: u concurrent sequences (≤ the memory limit, ≤ the largest batch meeting the
    target),
    arrivals λ/R each needing a prefill of t_pf seconds, which takes the fraction f = λ/R · t_pf
    of the replica's time from decode (so decode tok/s/user is tps(u)·(1 − f)); by Little's law
    u = λ/R · (t_pf + output_len / (tps(u)·(1 − f)))."""
    cache: dict[int, float] = {}

    def tps(b: int) -> float:
        if b not in cache:
            cache[b] = speed(cfg, gpu, eff, dep, dep.path, b, detail=False)["tok_s_user"]
        return cache[b]

    b_mem = mem["max_concurrency"]
    target = wl.target_tps_user
    if target is not None and tps(1) < target:
        warnings.append(f"target {target:g} tok/s/user is out of reach: batch 1 gives "
                        f"{tps(1):.1f}; sizing at batch 1 (try --dspark-k, another --tp or GPU)")
        target = None
        b_cap = 1
    elif target is None:
        b_cap = b_mem
    else:
        lo, hi = 1, b_mem        # largest b with tps(b) >= target (tps falls with b)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if tps(mid) >= target else (lo, mid - 1)
        b_cap = lo
    t_pf = prefill_seconds(cfg, gpu, eff, dep.tp, wl.input_len)
    if wl.ttft_target_s is not None and t_pf > wl.ttft_target_s:
        warnings.append(f"TTFT target {wl.ttft_target_s:g} s is below the prefill time alone "
                        f"({t_pf:.2f} s for {wl.input_len} tokens at --tp {dep.tp}); use a larger "
                        "--tp, shorter prompts, or separate prefill capacity")

    def serve(R: int):
        if wl.requests_per_s is not None:
            lam = wl.requests_per_s / R
            f = lam * t_pf
            if f >= 1:
                return None
            u = 1
            for _ in range(60):
                nu = max(1, math.ceil(lam * (t_pf + wl.output_len / (tps(u) * (1 - f)))))
                if nu > b_cap or nu == u:
                    u = nu
                    break
                u = nu
        else:
            u = math.ceil(wl.concurrent_users / R)
            if u > b_cap:
                return None
            f = 0.0
            for _ in range(30):   # λ from Little's law, f from λ
                lam = u / (t_pf + wl.output_len / (tps(u) * (1 - f)))
                nf = min(lam * t_pf, 0.99)
                if abs(nf - f) < 1e-9:
                    break
                f = nf
        rate = tps(u) * (1 - f)
        if u > b_cap or (target is not None and rate < target):
            return None
        return {"users_per_replica": u, "prefill_share": f, "tok_s_user": rate,
                "requests_per_s_per_replica": lam}

    R_hi = 1
    while serve(R_hi) is None:
        R_hi *= 2
        if R_hi > 10 ** 7:
            raise PlanError("no replica count serves this workload (prefill alone saturates "
                            "every replica); shorten --input-len or raise --tp")
    R_lo = max(1, R_hi // 2)
    while R_lo < R_hi:
        mid = (R_lo + R_hi) // 2
        R_lo, R_hi = (R_lo, mid) if serve(mid) is not None else (mid + 1, R_hi)
    R, s = R_hi, serve(R_hi)
    per_rack = gpu.nvlink_domain // dep.tp
    racks = math.ceil(R / per_rack)
    lam_total = s["requests_per_s_per_replica"] * R
    out_tok_s = lam_total * wl.output_len
    fleet = {"replicas": R, "gpus": R * dep.tp, "replicas_per_domain": per_rack,
             "domains": racks, "gpus_in_domains": racks * gpu.nvlink_domain,
             "batch_limit_memory": b_mem, "batch_limit_target": b_cap, "ttft_s": t_pf,
             "requests_per_s": lam_total, "output_tok_s": out_tok_s, **s}
    if price is not None:
        fleet["usd_per_hour"] = R * dep.tp * price
        fleet["usd_per_hour_whole_domains"] = racks * gpu.nvlink_domain * price
        fleet["usd_per_million_output_tokens"] = R * dep.tp * price / (out_tok_s * 3600) * 1e6
    return fleet


# ---- anchors ---------------------------------------------------------------------------------

# Public figures (DESIGN §4), K3 on GB300 at TP16: (label, deployment overrides, tok/s).
ANCHORS = (
    ("batch 1, specialized", {"path": "specialized", "batch": 1}, 256.4),
    ("batch 1, stock", {"path": "stock", "batch": 1}, 136.0),
    ("batch 64, specialized (aggregate)", {"path": "specialized", "batch": 64}, 3606.0),
    ("DSpark k=7 L=6, batch 1, specialized",
     {"path": "specialized", "batch": 1, "dspark_k": 7, "acceptance": 6.0}, 842.0),
    ("DSpark k=7 L=6, batch 1, stock",
     {"path": "stock", "batch": 1, "dspark_k": 7, "acceptance": 6.0}, 488.0),
)
# The write-ups do not state the context; decode benchmarks use short prompts. Assumed, not fit.
ANCHOR_CONTEXT = 2048
PUBLIC_KERNELS_PER_LAYER = {"stock": 23, "specialized": 13}


def anchors(cfg: K3Config, gpu: GPU, eff: Efficiency) -> list[dict]:
    """Predicted vs public at the anchor setting (K3, GB300, TP16, DCP1, bf16 KV, fp32 state)."""
    rows = []
    for label, over, public in ANCHORS:
        dep = Deployment(**{"tp": 16, "context": ANCHOR_CONTEXT, **over})
        s = speed(cfg, gpu, eff, dep, dep.path, dep.batch, detail=False)
        rows.append({"anchor": label, "public_tok_s": public, "predicted_tok_s": s["tok_s"],
                     "error_pct": 100.0 * (s["tok_s"] - public) / public,
                     "runs_as": s["runs_as"], "context": ANCHOR_CONTEXT})
    return rows


# ---- the whole plan ----------------------------------------------------------------------------

SWEEP = (1, 2, 4, 8, 16, 24, 32, 48, 64, 65, 96, 128, 192, 256)


def plan(cfg: K3Config, gpu: GPU, dep: Deployment, wl: Workload | None = None,
         eff: Efficiency | None = None, price: float | None = None, anchor_gpu: GPU | None = None,
         anchor_cfg: K3Config | None = None, sweep: bool = True,
         bench_notes: list[str] | None = None) -> dict:
    eff = eff or Efficiency.defaults()
    wl = wl or Workload()
    validate(cfg, gpu, dep, wl)
    mem = memory(cfg, gpu, dep)
    check_fits(cfg, gpu, dep, mem)
    warnings: list[str] = []
    if dep.tp not in SPEC_TP:
        warnings.append(f"TP {dep.tp} is outside the specialized envelope TP ∈ "
                        f"{{{', '.join(map(str, SPEC_TP))}}}; the "
                        "specialized figures assume a development profile (DESIGN §3)")
    if price is None:
        price = gpu.price_usd_per_gpu_hour
        if price is not None and "price_usd_per_gpu_hour" in gpu.estimated:
            warnings.append(f"$/GPU-hour {price:g} for {gpu.name} is a catalog estimate; pass "
                            "--price")
    pc = P.param_counts(cfg)
    speeds = {p: speed(cfg, gpu, eff, dep, p, dep.batch) for p in ("specialized", "stock")}
    if dep.path == "specialized" and speeds["specialized"]["runs_as"] == "stock":
        warnings.append(f"batch {dep.batch}" + (f" × (k+1) = {dep.batch * (dep.dspark_k + 1)}"
                        if dep.dspark_k else "") + " is outside the specialized envelope "
                        f"(≤ {SPEC_MAX_TOKENS} tokens, k ∈ {list(SPEC_K_RANGE)}): steps run "
                        "stock")
    cap = min(mem["max_concurrency"], SWEEP[-1])
    sweep_rows = []
    if sweep:
        for b in (b for b in SWEEP if b <= cap):
            row = {"batch": b}
            for p in ("specialized", "stock"):
                s = speed(cfg, gpu, eff, dep, p, b, detail=False)
                row[p] = {k: s[k] for k in ("tok_s_user", "tok_s", "runs_as", "step_us")}
            sweep_rows.append(row)
    chosen = speeds[dep.path]
    cost = None
    if price is not None:
        cost = {"usd_per_gpu_hour": price, "usd_per_hour_replica": price * dep.tp,
                "usd_per_million_output_tokens": price * dep.tp / (chosen["tok_s"] * 3600) * 1e6,
                "at_batch": dep.batch, "path": dep.path}
    fleet = size_workload(cfg, gpu, eff, dep, wl, mem, price, warnings) if wl.given else None
    out = {
        "model": {"name": cfg.name, "total_params": pc["total"], "active_params": pc["active"],
                  "active_params_excl_embedding": pc["active_excl_embedding"],
                  "max_position_embeddings": cfg.max_position_embeddings},
        "gpu": gpu.to_dict(), "deployment": asdict(dep),
        "workload": asdict(wl) if wl.given else None,
        "memory": mem,
        "capacity": {k: mem[k] for k in ("max_concurrency", "max_context_at_batch",
                                         "max_context_single")},
        "speed": speeds, "sweep": sweep_rows, "cost": cost, "fleet": fleet,
        "efficiency": {"sources": eff.sources, "bench": bench_notes or [],
                       "launch_floor_us": eff.launch_floor_us,
                       "step_overhead_us": eff.step_overhead_us, "alpha_us": eff.alpha_us,
                       "compute_eff": eff.compute_eff,
                       "control_plane_points": [list(p) for p in eff.control_plane],
                       "host_points": [list(p) for p in eff.host]},
        "anchors": None, "warnings": warnings,
    }
    if anchor_gpu is not None and anchor_cfg is not None:
        out["anchors"] = anchors(anchor_cfg, anchor_gpu, eff)
        out["public_kernels_per_layer"] = PUBLIC_KERNELS_PER_LAYER
    return out
