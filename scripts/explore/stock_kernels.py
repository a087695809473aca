"""Where the batch-1 stock decode step's kernels come from: one eager stock step of one decoding
sequence on the prefill bench's rank under torch.profiler, every function of the model and
kernel modules wrapped in a `record_function` range of its name, each CUDA kernel (on a CPU
host: each leaf ATen op, the closest stand-in for a launch) charged to the innermost range
above its launch, counted per layer.

    python3 -m raydecode.scripts.explore.stock_kernels --out X.json [--tp 16] [--layers 8] \
        [--device cuda|cpu]

Why: issue 28 asks ≤ 30 kernels per stock layer (TP16, batch 1); the prefill bench counts
109.75 (bench/results/prefill-h100-2026-12-06-graphs512.json) but names only the 12 costliest
kernels. This names the lines that launch them, so a fusion is aimed at the lines that launch
most and its effect is counted the same way after.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import time

import torch

from raydecode.scripts.bench.prefill import PrefillRank
from raydecode.scripts.bench.report_io import report_header, write_report
from raydecode.scripts.bench.step import build_model, device_sync, layer_config
from raydecode.scripts.explore.common import rank_parser


_MODULES = ("models.kda", "models.mla", "models.moe", "models.layers", "models.attnres",
            "models.pieces", "models.k3", "models.mxfp4", "kernels.moe_mxfp4", "kernels.router",
            "kernels.kda_decode", "kernels.stock_elementwise",
            "kernels.kda_conv", "kernels.kda_prefill", "kernels.linear", "kernels.attnres_norm",
            "kernels.mla_prefill", "kernels.decode_elementwise_triton", "engine.runner")
_TAG = "rd:"


def _wrap(fn, name: str):
    if getattr(fn, "_rd_traced", False):
        return fn

    @functools.wraps(fn)
    def traced(*a, **kw):
        with torch.profiler.record_function(_TAG + name):
            return fn(*a, **kw)
    traced._rd_traced = True
    return traced


@contextlib.contextmanager
def traced_functions():
    """Every function and method defined in this repository's model and kernel modules wrapped
    in a `record_function` range named after it (the name each calling module sees it under
    patched too), restored on exit."""
    mods = [importlib.import_module("raydecode." + m) for m in _MODULES]
    ours = {id(v): f"{v.__module__.replace('raydecode.', '')}.{v.__qualname__}"
            for m in mods for v in vars(m).values()
            if inspect.isfunction(v) and v.__module__.startswith("raydecode.")}
    undo = []
    for m in mods:
        for k, v in list(vars(m).items()):
            if inspect.isfunction(v) and id(v) in ours:
                undo.append((m, k, v))
                setattr(m, k, _wrap(v, ours[id(v)]))
            elif inspect.isclass(v) and v.__module__ == m.__name__:
                for mk, mv in list(vars(v).items()):
                    if inspect.isfunction(mv) and not mk.startswith("__") or mk == "forward":
                        undo.append((v, mk, mv))
                        setattr(v, mk, _wrap(mv, f"{v.__name__}.{mk}"))
    try:
        yield
    finally:
        for owner, k, v in reversed(undo):
            setattr(owner, k, v)


def _site(ev) -> str:
    """The innermost traced function above `ev` (its `rd:` range), with the chain of the two
    ranges around it."""
    e, chain = ev.cpu_parent, []
    while e is not None and len(chain) < 3:
        if e.name.startswith(_TAG):
            chain.append(e.name[len(_TAG):])
        e = e.cpu_parent
    return " < ".join(chain) if chain else "?"


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
    """{site: {"count": n, "ops": {op -> kernel (CUDA) or op: n}}}."""
    sites: dict[str, dict] = {}

    def add(site: str, what: str, n: int = 1):
        s = sites.setdefault(site, {"count": 0, "ops": {}})
        s["count"] += n
        s["ops"][what] = s["ops"].get(what, 0) + n

    for ev in events:
        if ev.device_type != torch.autograd.DeviceType.CPU:
            continue
        if cuda:
            for k in ev.kernels:
                if not k.name.startswith(("Memcpy", "Memset")):
                    add(_site(ev), f"{_op(ev)} -> {k.name[:50]}")
        elif ev.name.startswith("aten::") and not ev.cpu_children \
                and ev.name[6:] not in _NO_KERNEL:
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
    from raydecode.models import layers as layers_mod
    L = cfg.num_layers
    report = report_header(args.commit, bench="stock_kernels", tp=args.tp, layers=L,
                           device=str(rank.device), method=__doc__,
                           counted="CUDA kernels" if cuda else "leaf ATen ops (CPU host)")
    report["variants"] = {}
    # the shipped stock path, then its PyTorch chains (RAYDECODE_STOCK_FUSED=0) in this run
    for name, fused in (("fused", layers_mod.STOCK_FUSED), ("chains", False)):
        layers_mod.STOCK_FUSED = fused
        for _ in range(3):
            rank.step(0, 1, "stock")
        plan = rank.plan(0, 1, "stock")
        device_sync(rank.device)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with traced_functions(), profile(activities=acts) as prof:
            ModelRunner.logits(rank.runner, plan)
            device_sync(rank.device)
        sites = attribute(prof.events(), cuda)
        total = sum(s["count"] for s in sites.values())
        # every CUDA kernel of the step, as the prefill bench counts them (launches the
        # profiler did not link to a host op, e.g. some Triton ones, are in here only)
        every = sum(1 for e in prof.events()          # the ranges' GPU annotations excluded
                    if e.device_type == torch.autograd.DeviceType.CUDA
                    and not e.name.startswith(("Memcpy", "Memset", _TAG)))
        report["variants"][name] = {
            "stock_fused": fused, "total": total, "per_layer": round(total / L, 2),
            "every_kernel": every, "every_per_layer": round(every / L, 2),
            "sites": [{"site": k, "count": v["count"], "per_layer": round(v["count"] / L, 2),
                       "ops": dict(sorted(v["ops"].items(), key=lambda kv: -kv[1]))}
                      for k, v in sorted(sites.items(), key=lambda kv: -kv[1]["count"])]}
        write_report(report, args.out, t0)
        print(f"[kernels] {name}: {report['counted']}: {total} attributed in {L} layers = "
              f"{round(total / L, 2)}/layer; every CUDA kernel {every} = "
              f"{round(every / L, 2)}/layer", flush=True)
        for s in report["variants"][name]["sites"][:40]:
            print(f"[kernels]   {s['per_layer']:6.2f}/layer {s['site'][:110]}  "
                  f"{list(s['ops'].items())[:2]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
