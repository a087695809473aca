"""Side-branch L2 prefetch (kernels/experimental/l2_prefetch.py) under a latency-bound kernel: does the GEMV
that follows read its weight from L2, and how much faster is it? (GPU only.)

    python -m raydecode.scripts.explore.l2_prefetch --out OUT.json --commit SHA [--spin-us 8]

Per K3 TP16 matrix, one CUDA graph per variant, each call on its own weight copy (the copies
together > 3× L2, so nothing is left in L2 from the previous replay):
  cold:      spin(D) → GEMV                     the layer today: the GEMV reads HBM
  kind:chunk spin(D) ‖ l2_prefetch(W) → GEMV   the prefetch (each --variants form) forked
                                                beside the spin, joined before the GEMV;
                                                controls: W read by torch.sum (read) or by the
                                                same GEMV (gemv) on that branch instead
  hot:       spin(D) → GEMV on one copy         every call reads the same W (L2-resident):
                                                the floor a prefetch can reach
  spin:      spin(D)                            subtracted from each of the above
spin(D) is a one-CTA kernel that waits D µs on %globaltimer: a stand-in for the KDA step, the
MLA attention or the router, during which HBM is idle. A prefetch that lands in time brings
its row to ≈ `hot`; one that does not land leaves it at `cold`. Measured on H200 (PERF round
17): every form recovers 25–35 % of cold − hot, with an 8 or a 16 µs window alike.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from raydecode.kernels import gemv as G
from raydecode.kernels import linear as LN
from raydecode.kernels._triton import pdl_enter, pdl_launch, tl, triton
from raydecode.kernels.experimental.l2_prefetch import KINDS, SidePrefetch, l2_prefetch, prefetch_table

from raydecode.scripts.bench.gemv import ROTATE_BYTES
from raydecode.scripts.bench.layer_timing import GraphTimer, hbm_read_bandwidth
from raydecode.scripts.bench.report_io import report_header, write_report

# (name, N, K, fp32 out): the TP16 GEMVs a side-branch prefetch would cover
SHAPES = [("kda_o_proj", 7168, 768, False), ("h2_proj", 1048, 7168, True),
          ("ffn_out", 7168, 640, False), ("qkv_a_g", 900, 7168, False),
          ("q_b_absorbed", 3456, 1536, True), ("kda_in_proj", 3216, 7168, False)]

# control forms (--variants read:16 / gemv:16; the chunk is ignored): W read on the side branch
# by a reduction over every SM, or by the same GEMV, instead of prefetched
CONTROLS = ("read", "gemv")

if triton is not None:
    @triton.jit
    def _spin_kernel(ns, PDL: tl.constexpr):
        pdl_enter(PDL)
        t0 = tl.extra.cuda.globaltimer()
        t = t0
        while t - t0 < ns:
            t = tl.extra.cuda.globaltimer()


def spin(ns: int, pdl_like: torch.Tensor | None = None) -> None:
    """Occupy the stream ns nanoseconds (one CTA). pdl_like: launch it under PDL on that
    tensor's device (`pdl_launch`), like the layer's Triton kernels, so the next PDL kernel
    may launch and start its prologue while it waits; None: a plain launch."""
    _spin_kernel[(1,)](ns, num_warps=1,
                       **(pdl_launch(pdl_like) if pdl_like is not None else {"PDL": False}))


def bench_shape(name, N, K, f32, spin_us, variants, timer, hbm) -> dict:
    """variants: [(kind, chunk_bytes)] of the prefetch (kernels/experimental/l2_prefetch.py KINDS)."""
    dev = torch.device("cuda")
    copies = max(4, math.ceil(ROTATE_BYTES / (2 * N * K)))
    ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5 for _ in range(copies)]
    x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
    od = torch.float32 if f32 else None
    side = SidePrefetch(dev)
    ns = int(spin_us * 1e3)

    def with_prefetch(table, w, kind):
        def fn():
            side.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side.stream):
                if kind == "read":           # a plain read of W by every SM: a load, not a hint
                    torch.sum(w, dtype=torch.float32)
                elif kind == "gemv":         # the same GEMV, earlier: the same SMs read each line
                    LN.linear(x, w, od)
                else:
                    l2_prefetch(table, kind)
            spin(ns)
            torch.cuda.current_stream().wait_stream(side.stream)
            LN.linear(x, w, od)
        return fn

    ref = x.float() @ ws[0].float().t()
    err = float((LN.linear(x, ws[0], od).float() - ref).abs().max() / ref.abs().max())
    t = {
        "spin": timer.run([lambda: spin(ns)] * copies, count_nodes=False),
        "cold": timer.run([lambda i=i: (spin(ns), LN.linear(x, ws[i], od))
                           for i in range(copies)], count_nodes=False),
        "hot": timer.run([lambda: (spin(ns), LN.linear(x, ws[0], od))] * copies,
                         count_nodes=False),
    }
    for kind, chunk in variants:
        fns = []
        for w in ws:
            fns.append(with_prefetch(prefetch_table([w], chunk_bytes=chunk), w, kind))
        t[f"{kind}:{chunk}"] = timer.run(fns, count_nodes=False)
    us = {k: v.us_per_call for k, v in t.items()}
    gemv = {k: us[k] - us["spin"] for k in us if k != "spin"}
    nbytes = 2 * N * K
    return {"name": name, "N": N, "K": K, "fp32_out": f32, "mbytes": nbytes / 1e6,
            "copies": copies, "spin_us": spin_us, "us": us, "gemv_us": gemv, "rel_err": err,
            "saving_us": {k: gemv["cold"] - v for k, v in gemv.items()},
            "cold_frac_hbm": nbytes / (gemv["cold"] * 1e-6) / hbm,
            "hbm_floor_us": nbytes / hbm * 1e6}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--spin-us", type=float, default=8.0,
                    help="the latency-bound kernel's length (µs) the prefetch hides behind")
    ap.add_argument("--variants", default="bulk:16384,bulk:2048,lines:16384,lines:131072",
                    help="prefetch forms kind:chunk_bytes (kind in kernels/l2_prefetch KINDS)")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES),
                    help="subset of: " + ",".join(s[0] for s in SHAPES))
    args = ap.parse_args(argv)
    variants = []
    for v in args.variants.split(","):
        kind, _, chunk = v.partition(":")
        if (kind not in KINDS + CONTROLS or not chunk.isdigit() or int(chunk) % 16
                or int(chunk) == 0):
            ap.error(f"--variants entry {v!r}; expected kind:bytes, kind in "
                     f"{KINDS + CONTROLS}, bytes a positive multiple of 16")
        variants.append((kind, int(chunk)))
    shapes = [s for s in SHAPES if s[0] in args.shapes.split(",")]
    if not torch.cuda.is_available() or triton is None or not G.cute_available():
        print("l2_prefetch: needs a CUDA GPU, Triton and CuTe DSL", file=sys.stderr)
        return 2
    t0 = time.time()
    report = report_header(args.commit, method=__doc__.split("\n\n")[2].strip(), results=[])
    report["hbm_read_Bps"] = hbm = hbm_read_bandwidth()
    timer = GraphTimer(replays=15, warm=3)
    for name, N, K, f32 in shapes:
        row = bench_shape(name, N, K, f32, args.spin_us, variants, timer, hbm)
        report["results"].append(row)
        print(f"{name:13s} {row['mbytes']:5.1f} MB spin {row['us']['spin']:.2f} floor "
              f"{row['hbm_floor_us']:.2f} GEMV µs " + " ".join(
                  f"{k} {v:.2f}" for k, v in row["gemv_us"].items()), flush=True)
        torch.cuda.empty_cache()
    write_report(report, args.out, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
