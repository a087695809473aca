"""Where the batch-1 stock decode step's kernels come from: one eager stock step of one decoding
sequence on the prefill bench's rank under torch.profiler with Python stacks, each CUDA kernel
(on a CPU host: each leaf ATen op, the closest stand-in for a launch) charged to the first
frame of this repository on its op's stack (Triton launches, which have no ATen op, by kernel
name), counted per layer.

    python3 -m raydecode.scripts.explore.stock_kernels --out X.json [--tp 16] [--layers 8] \
        [--device cuda|cpu]

Why: issue 28 asks ≤ 30 kernels per stock layer (TP16, batch 1); the prefill bench counts
109.75 (bench/results/prefill-h100-2026-12-06-graphs512.json) but names only the 12 costliest
kernels. This names the lines that launch them, so a fusion is aimed at the lines that launch
most and its effect is counted the same way after.
"""
from __future__ import annotations

import re
import time

import torch

from raydecode.scripts.bench.prefill import PrefillRank
from raydecode.scripts.bench.report_io import report_header, write_report
from raydecode.scripts.bench.step import build_model, device_sync, layer_config
from raydecode.scripts.explore.common import rank_parser


_OURS = ("models/", "engine/", "kernels/", "actors/", "cluster/")
_FRAME = re.compile(r"^(\S+\.py)\((\d+)\): (.*)$")


def _site(ev) -> str:
    """The innermost Python frame of this repository above `ev` (the profiler records each
    Python call as an event, `path(line): function`, the op's ancestors)."""
    e = ev.cpu_parent
    while e is not None:
        m = _FRAME.match(e.name)
        if m:
            path = m.group(1)
            for folder in _OURS:
                i = path.find(folder)
                if i >= 0 and "site-packages" not in path[:i] and "torch/" not in path[:i]:
                    return f"{path[i:]}:{m.group(2)} {m.group(3)}"
        e = e.cpu_parent
    return "?"


def _op(ev) -> str:
    e = ev
    while e is not None and not e.name.startswith("aten::"):
        e = e.cpu_parent
    return e.name if e is not None else ev.name


_NO_KERNEL = {"as_strided", "empty", "empty_strided", "empty_like", "view", "reshape",
              "_reshape_alias", "t", "transpose", "permute", "expand", "select", "slice",
              "unsqueeze", "squeeze", "narrow", "alias", "detach", "resize_", "set_", "unbind",
              "split", "chunk", "lift_fresh", "_unsafe_view", "_local_scalar_dense", "item",
              "is_nonzero", "view_as", "split_with_sizes", "as_strided_", "contiguous",
              "result_type", "size", "stride", "numel", "is_same_size", "to", "_to_copy"}


def attribute(events, cuda: bool) -> dict[str, dict]:
    """{site: {"count": n, "ops": {op or kernel: n}}}."""
    sites: dict[str, dict] = {}

    def add(site: str, what: str, n: int = 1):
        s = sites.setdefault(site, {"count": 0, "ops": {}})
        s["count"] += n
        s["ops"][what] = s["ops"].get(what, 0) + n

    for ev in events:
        if ev.device_type != torch.autograd.DeviceType.CPU:
            continue
        if cuda:
            ks = [k for k in ev.kernels if not k.name.startswith(("Memcpy", "Memset"))]
            if not ks:
                continue
            site = _site(ev)
            for k in ks:
                add(site if site != "?" else f"kernel {k.name[:60]}",
                    f"{_op(ev)} -> {k.name[:50]}")
        elif ev.name.startswith("aten::") and not ev.cpu_children and ev.name[6:] not in _NO_KERNEL:
            add(_site(ev), ev.name)
    return sites


def main(argv=None) -> int:
    ap = rank_parser(__doc__)
    args = ap.parse_args(argv)
    cfg = layer_config("k3", args.layers)
    model, _ = build_model(cfg, args.tp, args.device, args.seed)
    rank = PrefillRank(model, args.device, 2048, 512, 63, 1024, args.seed)
    cuda = rank.device.type == "cuda"
    t0 = time.time()
    from torch.profiler import ProfilerActivity, profile

    from raydecode.engine.runner import ModelRunner
    for _ in range(3):
        rank.step(0, 1, "stock")
    plan = rank.plan(0, 1, "stock")
    device_sync(rank.device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts, with_stack=True) as prof:
        ModelRunner.logits(rank.runner, plan)
        device_sync(rank.device)
    sites = attribute(prof.events(), cuda)
    L = cfg.num_layers
    total = sum(s["count"] for s in sites.values())
    report = report_header(args.commit, bench="stock_kernels", tp=args.tp, layers=L,
                           device=str(rank.device), method=__doc__,
                           counted="CUDA kernels" if cuda else "leaf ATen ops (CPU host)")
    report["total"] = total
    report["per_layer"] = round(total / L, 2)
    report["sites"] = [{"site": k, "count": v["count"], "per_layer": round(v["count"] / L, 2),
                        "ops": dict(sorted(v["ops"].items(), key=lambda kv: -kv[1]))}
                       for k, v in sorted(sites.items(), key=lambda kv: -kv[1]["count"])]
    write_report(report, args.out, t0)
    print(f"[kernels] {report['counted']}: {total} in {L} layers = {report['per_layer']}/layer",
          flush=True)
    for s in report["sites"][:60]:
        print(f"[kernels] {s['per_layer']:6.2f}/layer {s['site'][:110]}  "
              f"{list(s['ops'].items())[:3]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
