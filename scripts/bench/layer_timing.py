"""Timing and counting primitives of the layer benchmark (GPU only).

- `hbm_read_bandwidth()`: bytes/s of a large read-only reduction (torch.sum over 2 × 4 GiB of
  fp32, in a CUDA graph), the roofline's denominator, measured in the same run.
- `GraphTimer`: capture fns back to back in one CUDA graph, count its nodes by type (kernel,
  memcpy, memset: cudaGraphGetNodes on the kept cudaGraph_t), replay, median µs per replay.
- `profile_kernel_count(fn)`: kernels one eager call launches (torch.profiler; a cross-check of
  the graph count where the graph cannot be kept).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch


def _graph(keep: bool):
    try:
        return torch.cuda.CUDAGraph(keep_graph=keep), keep
    except TypeError:            # torch without keep_graph
        return torch.cuda.CUDAGraph(), False


def graph_node_counts(g) -> dict | None:
    """{'kernel': n, 'memcpy': n, 'memset': n, 'other': n} of a kept graph, or None."""
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        try:
            from cuda import cudart as rt      # older cuda-python
        except ImportError:
            return None
    try:
        graph = rt.cudaGraph_t(init_value=int(g.raw_cuda_graph()))
        err, _, n = rt.cudaGraphGetNodes(graph, 0)
        if int(err) != 0:
            return None
        err, nodes, n = rt.cudaGraphGetNodes(graph, n)
        if int(err) != 0:
            return None
        T = rt.cudaGraphNodeType
        names = {T.cudaGraphNodeTypeKernel: "kernel", T.cudaGraphNodeTypeMemcpy: "memcpy",
                 T.cudaGraphNodeTypeMemset: "memset"}
        out = {"kernel": 0, "memcpy": 0, "memset": 0, "other": 0}
        for node in nodes[:n]:
            err, typ = rt.cudaGraphNodeGetType(node)
            out[names.get(typ, "other")] += 1
        return out
    except Exception:
        return None


@dataclass
class Timed:
    us_per_call: float          # median replay time / calls in the graph
    us_min: float
    us_max: float
    replays: int
    nodes_per_call: dict | None


class GraphTimer:
    def __init__(self, replays: int = 20, warm: int = 3):
        self.replays, self.warm = replays, warm

    def run(self, fns: list, count_nodes: bool = True) -> Timed:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):      # eager warm-up: JIT compiles, cuBLAS handles
            for fn in fns:
                fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g, kept = _graph(count_nodes)
        with torch.cuda.graph(g):
            for fn in fns:
                fn()
        nodes = graph_node_counts(g) if kept else None
        if kept:
            g.instantiate()
        for _ in range(self.warm):
            g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.replays):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / len(fns))
        del g
        per = {k: v / len(fns) for k, v in nodes.items()} if nodes else None
        return Timed(statistics.median(times), min(times), max(times), self.replays, per)


def profile_kernel_count(fn) -> dict:
    """Kernels (and memcpy/memset) one eager call of fn launches, with the kernel time by name
    (device µs of that eager call: execution only, no launch gaps)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return kernel_summary(prof.events())


def kernel_summary(events, top_n: int = 40) -> dict:
    """Profiler CUDA events -> {kernel, memcpy, memset counts, kernel_us, names: the top_n
    kernel names by total µs}."""
    kinds = {"kernel": 0, "memcpy": 0, "memset": 0, "kernel_us": 0.0}
    names: dict[str, list] = {}
    for ev in events:
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        nm = ev.name
        k = "memcpy" if nm.startswith("Memcpy") else "memset" if nm.startswith("Memset") \
            else "kernel"
        kinds[k] += 1
        if k == "kernel":
            us = ev.time_range.elapsed_us()
            kinds["kernel_us"] += us
            ent = names.setdefault(nm[:90], [0, 0.0])
            ent[0] += 1
            ent[1] += us
    top = sorted(names.items(), key=lambda kv: -kv[1][1])[:top_n]
    kinds["names"] = {n: {"count": c, "us": round(t, 2)} for n, (c, t) in top}
    return kinds


def hbm_read_bandwidth(gib_per_buffer: int = 4) -> float:
    """Read-only bytes/s: torch.sum over two fp32 buffers, alternating, in one graph."""
    n = gib_per_buffer * 2**30 // 4
    bufs = [torch.randn(n, device="cuda") for _ in range(2)]
    outs = [torch.empty((), device="cuda") for _ in range(2)]
    fns = [lambda i=i: torch.sum(bufs[i % 2], dim=0, out=outs[i % 2]) for i in range(6)]
    t = GraphTimer(replays=7, warm=1).run(fns, count_nodes=False)
    bufs.clear()
    torch.cuda.empty_cache()
    return n * 4 / (t.us_per_call * 1e-6)
