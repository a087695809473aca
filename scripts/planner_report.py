"""Rendering of a `planner.plan()` result: the text table and the PNG plots (matplotlib is
imported only when plotting, so a plain run stays fast)."""
from __future__ import annotations

from pathlib import Path

GB = 1e9
KIND_LABELS = {
    "routed_experts": "routed experts (MXFP4)", "shared_experts": "shared experts",
    "latent": "latent down/up", "router": "router", "mla_qkv_a": "MLA fused qkv_a",
    "mla": "MLA q_b/kv_b/o/gate", "kda": "KDA projections/conv/gates", "dense_ffn": "dense FFN",
    "embedding": "embedding", "lm_head": "lm_head", "norms": "norms / AttnRes",
}
REPLICATED = ("latent", "router", "mla_qkv_a")


def _row(label: str, *vals, w: int = 34) -> str:
    return f"  {label:<{w}}" + "".join(f"{v:>16}" for v in vals)


def render(r: dict) -> str:
    d, m, g, mod = r["deployment"], r["memory"], r["gpu"], r["model"]
    L = [f"raydecode plan: {mod['name']} on {g['name']} (TP{d['tp']}, DCP{d['dcp']}), path "
         f"{d['path']}, batch {d['batch']}, context {d['context']:,}"
         + (f", DSpark k={d['dspark_k']} L={d['acceptance']:g}" if d["dspark_k"] else ""),
         f"model: {mod['total_params'] / 1e12:.3f}T parameters, "
         f"{mod['active_params'] / 1e9:.1f}B active per token "
         f"({mod['active_params_excl_embedding'] / 1e9:.1f}B without the embedding table)", "",
         "memory per GPU (GB; [R] = whole on every rank in the stock layout)"]
    for k, v in sorted(m["weights_by_kind"].items(), key=lambda kv: -kv[1]):
        tag = " [R]" if k in REPLICATED else ""
        L.append(_row(KIND_LABELS.get(k, k) + tag, f"{v / GB:.2f}"))
    if m.get("prefill_experts_copy"):
        L.append(_row("routed experts, prefill copy (ogs-hopper)",
                      f"{m['prefill_experts_copy'] / GB:.2f}"))
    L += [_row("weights", f"{m['weights'] / GB:.2f}"),
          _row("  of which replicated", f"{m['weights_replicated'] / GB:.2f}"),
          _row("DSpark drafter", f"{m['drafter'] / GB:.2f}"),
          _row("activation workspace", f"{m['workspace'] / GB:.2f}"),
          _row(f"KDA snapshots ×{d['kda_snapshots']} (prefix cache)",
               f"{m['kda_snapshots'] / GB:.2f}"),
          _row("DSpark per-position KDA state",
               f"{m.get('spec_per_position_state', 0.0) / GB:.2f}"),
          _row("reserved (1 - utilization)", f"{m['reserved'] / GB:.2f}"),
          _row("KV + KDA cache budget", f"{m['cache_budget'] / GB:.2f}"),
          _row(f"cache in use at batch {d['batch']}", f"{m['cache_used'] / GB:.2f}"),
          _row("HBM", f"{m['hbm'] / GB:.2f}"),
          _row("MLA KV per token per rank", f"{m['kv_bytes_per_token']:,.0f} B"),
          _row("KDA state per sequence per rank", f"{m['kda_state_bytes_per_seq'] / 1e6:.2f} MB"),
          "", f"capacity per replica: {m['max_concurrency']:,} sequences at context "
          f"{d['context']:,}; max context {m['max_context_at_batch']:,} tokens at batch "
          f"{d['batch']}, {m['max_context_single']:,} for one sequence", ""]
    sp, st = r["speed"]["specialized"], r["speed"]["stock"]
    L.append(_row(f"decode at batch {d['batch']}", "specialized", "stock"))
    L.append(_row("runs as", sp["runs_as"], st["runs_as"]))
    kinds = sorted(set(sp["layer_kinds"]) | set(st["layer_kinds"]))
    for k in kinds:
        a, b = sp["layer_kinds"][k], st["layer_kinds"][k]
        L.append(_row(f"{k} ×{a['layers']} µs (kern+coll)",
                      f"{a['us']:.1f} ({a['kernels']}+{a['collectives']})",
                      f"{b['us']:.1f} ({b['kernels']}+{b['collectives']})"))
    L += [_row("head (embed, lm_head, sample) µs", f"{sp['sublayers']['head']['us']:.1f}",
               f"{st['sublayers']['head']['us']:.1f}"),
          _row("step overhead µs", f"{sp['overhead_us']:.1f}", f"{st['overhead_us']:.1f}"),
          _row("control plane µs", f"{sp['control_plane_us']:.1f}",
               f"{st['control_plane_us']:.1f}"),
          _row("coordinator host µs", f"{sp.get('host_us', 0.0):.1f}",
               f"{st.get('host_us', 0.0):.1f}")]
    if d["dspark_k"]:
        L.append(_row("draft pass µs", f"{sp['draft_us']:.1f}", f"{st['draft_us']:.1f}"))
    L += [_row("step µs", f"{sp['step_us']:.1f}", f"{st['step_us']:.1f}"),
          _row("served TPOT ms", f"{sp['served_tpot_ms']:.2f}", f"{st['served_tpot_ms']:.2f}"),
          _row("tok/s per user", f"{sp['tok_s_user']:.1f}", f"{st['tok_s_user']:.1f}"),
          _row("tok/s per replica", f"{sp['tok_s']:.1f}", f"{st['tok_s']:.1f}")]
    if r["cost"]:
        c = r["cost"]
        price = c["usd_per_gpu_hour"]
        L.append(_row("$ per million output tokens",
                      *(f"{price * d['tp'] / (s['tok_s'] * 3600) * 1e6:.2f}" for s in (sp, st))))
        L.append(f"  (at ${price:g}/GPU-hour, ${c['usd_per_hour_replica']:.2f}/hour per replica)")
    f = r["fleet"]
    if f:
        w = r["workload"]
        demand = (f"{w['requests_per_s']:g} requests/s" if w["requests_per_s"] is not None
                  else f"{w['concurrent_users']:,} concurrent users")
        L += ["", f"workload: {demand}, {w['input_len']:,} in / {w['output_len']:,} out tokens"
              + (f", target {w['target_tps_user']:g} tok/s/user" if w["target_tps_user"] else "")
              + (f", TTFT target {w['ttft_target_s']:g} s" if w["ttft_target_s"] else ""),
              _row("replicas", f"{f['replicas']:,}"),
              _row("GPUs", f"{f['gpus']:,}"),
              _row("NVLink domains (racks for NVL72)", f"{f['domains']:,}"),
              _row("replicas per domain", f"{f['replicas_per_domain']:,}"),
              _row("sequences per replica", f"{f['users_per_replica']:,}"),
              _row("tok/s per user (with prefill share)", f"{f['tok_s_user']:.1f}"),
              _row("prefill share of replica time", f"{100 * f['prefill_share']:.1f} %"),
              _row("TTFT (prefill alone) s", f"{f['ttft_s']:.3f}"),
              _row("output tok/s served", f"{f['output_tok_s']:,.0f}")]
        if "usd_per_hour" in f:
            L += [_row("$ per hour (replica GPUs)", f"{f['usd_per_hour']:,.2f}"),
                  _row("$ per hour (whole domains)", f"{f['usd_per_hour_whole_domains']:,.2f}"),
                  _row("$ per million output tokens", f"{f['usd_per_million_output_tokens']:.2f}")]
    if r["anchors"]:
        L += ["", f"public anchors (K3, GB300, TP16, DCP1; context {r['anchors'][0]['context']:,}"
              " assumed; no constant fitted to them)",
              _row("", "public tok/s", "predicted", "error", w=40)]
        for a in r["anchors"]:
            L.append(_row(a["anchor"], f"{a['public_tok_s']:,.1f}",
                          f"{a['predicted_tok_s']:,.1f}", f"{a['error_pct']:+.1f} %", w=40))
        pk = r.get("public_kernels_per_layer")
        if pk:
            L.append(f"  public kernels per layer: stock {pk['stock']}, specialized "
                     f"{pk['specialized']} (ours above, kernels+collectives per layer kind)")
    src = r["efficiency"]["sources"]
    L += ["", "efficiency: " + "; ".join(f"{k}: {v}" for k, v in src.items())]
    for n in r["efficiency"]["bench"]:
        L.append(f"  bench: {n}")
    for wmsg in r["warnings"]:
        L.append(f"warning: {wmsg}")
    return "\n".join(L)


def plot(r: dict, out_dir: str | Path) -> list[str]:
    """tok_s_user_vs_batch.png (both paths) and memory_breakdown.png under out_dir."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    d, rows = r["deployment"], r["sweep"]
    files = []
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for p, style in (("specialized", "-o"), ("stock", "--s")):
        b = [x["batch"] for x in rows]
        a1.plot(b, [x[p]["tok_s_user"] for x in rows], style, label=f"{p} (requested)", ms=3)
        a2.plot(b, [x[p]["tok_s"] for x in rows], style, label=f"{p} (requested)", ms=3)
    for a, yl in ((a1, "tok/s per user"), (a2, "tok/s per replica")):
        a.set_xscale("log", base=2)
        a.axvline(64, color="grey", lw=0.8, ls=":")
        a.set_xlabel("concurrent sequences (batch)")
        a.set_ylabel(yl)
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(f"{r['model']['name']} on {r['gpu']['name']} TP{d['tp']} DCP{d['dcp']}, "
                 f"context {d['context']:,} (specialized runs stock above the envelope, dotted)",
                 fontsize=9)
    fig.tight_layout()
    p1 = out / "tok_s_user_vs_batch.png"
    fig.savefig(p1, dpi=110)
    plt.close(fig)
    files.append(str(p1))

    m = r["memory"]
    parts = [(KIND_LABELS.get(k, k) + (" [R]" if k in REPLICATED else ""), v / GB)
             for k, v in sorted(m["weights_by_kind"].items(), key=lambda kv: -kv[1])]
    if m.get("prefill_experts_copy"):
        parts.append(("routed experts, prefill copy", m["prefill_experts_copy"] / GB))
    parts += [("DSpark drafter", m["drafter"] / GB), ("workspace", m["workspace"] / GB),
              ("KDA snapshots (prefix cache)", m["kda_snapshots"] / GB),
              (f"KV + KDA cache (batch {d['batch']})", m["cache_used"] / GB),
              ("cache free", max(0.0, (m["cache_budget"] - m["cache_used"]) / GB)),
              ("reserved", m["reserved"] / GB)]
    fig, ax = plt.subplots(figsize=(8, 5))
    labels, vals = zip(*parts)
    ax.barh(range(len(vals)), vals, color="tab:blue")
    ax.set_yticks(range(len(vals)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("GB per GPU")
    ax.set_title(f"memory per GPU: {r['model']['name']} on {r['gpu']['name']} TP{d['tp']} "
                 f"(HBM {m['hbm'] / GB:.0f} GB)", fontsize=9)
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:.2f}", va="center", fontsize=7)
    fig.tight_layout()
    p2 = out / "memory_breakdown.png"
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    files.append(str(p2))
    return files
