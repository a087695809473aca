"""MLA prefill attention at K3 per-rank shapes: which SDPA backend is fastest for one chunk over
its cached rows (GPU only; kernels/mla_prefill.py serves the "flash" variant).

    python3 -m raydecode.scripts.explore.mla_prefill_sdpa --out X.json [--tp 16] \
        [--cases 512:0,2048:0,512:8192,2048:30720,4096:126976]

Per case n queries at ctx (m = ctx + n rows), bf16, median of CUDA-event timings:
  flash      the served route: V padded to E = 192 (a view), lower-right causal bias -> FA2
  efficient  sdpa_kernel(EFFICIENT), the v-wide V: CausalFromBottomRight in the cutlass kernel
  cudnn      ctx = 0 only: sdpa_kernel(CUDNN), v-wide V (192 / 128), plain is_causal
  decompress the kv_b GEMM + the [v | k_nope | k_pe] buffer alone (part of every variant)
  reference  the stock absorbed fp32 math, where its (n, h, m) scores fit in 8 GB
Each variant is checked against the reference (or, past 8 GB, against flash) first; the JSON
has ms, TFLOP/s of the attention part (causal: n·m − n²/2 scores, E + v flops each ×2) and the
error.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from raydecode.kernels.mla_prefill import decompress, mla_prefill_into, mla_prefill_reference
from raydecode.models.config import load_config
from raydecode.scripts.bench.report_io import report_header, write_report
from raydecode.scripts.explore.common import median_cuda_ms

BF = torch.bfloat16


def run_case(n: int, ctx: int, heads: int, mla) -> dict:
    c, r, nope, v = mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.v_head_dim
    kw = dict(nope=nope, vdim=v, kv_lora=c, scale=mla.qk_head_dim ** -0.5)
    m = ctx + n
    rows = torch.randn(m, c + r, device="cuda").to(BF)
    w = (torch.randn(heads * (nope + v), c, device="cuda") / c ** 0.5).to(BF)
    q = (2 * torch.randn(n, heads, nope + r, device="cuda")).to(BF)
    out = torch.empty(n, heads, v, dtype=BF, device="cuda")
    scores = n * m - (n * n) / 2
    attn_flops = 2 * scores * heads * (nope + r + v)
    res = {"n": n, "ctx": ctx, "heads": heads, "variants": {}}
    ref = None
    if n * heads * m * 4 <= 8 * 2**30:
        ref = mla_prefill_reference(q, rows, ctx, w, **kw)
        res["variants"]["reference"] = {"ms": median_cuda_ms(lambda: mla_prefill_reference(
            q, rows, ctx, w, **kw), reps=3)}
    res["variants"]["decompress"] = {"ms": median_cuda_ms(lambda: decompress(
        rows, w, heads, nope=nope, vdim=v, kv_lora=c, dtype=BF))}
    variants = {"flash": ([SDPBackend.FLASH_ATTENTION], None),
                "efficient": ([SDPBackend.EFFICIENT_ATTENTION], False)}
    if ctx == 0:
        variants["cudnn"] = ([SDPBackend.CUDNN_ATTENTION], False)
    for name, (backends, pad_v) in variants.items():
        try:
            with sdpa_kernel(backends):
                route = mla_prefill_into(out, q, rows, ctx, w, pad_v=pad_v, **kw)
                ms = median_cuda_ms(lambda: mla_prefill_into(out, q, rows, ctx, w, pad_v=pad_v,
                                                             **kw))
        except RuntimeError as e:
            res["variants"][name] = {"error": str(e).splitlines()[0]}
            continue
        if ref is None:
            ref = out.float().clone()       # the first variant (flash) is the check past 8 GB
        err = float((out.double() - ref.double()).norm() / ref.double().norm())
        dec = res["variants"]["decompress"]["ms"]
        res["variants"][name] = {"route": route, "ms": ms, "rel_err": err,
                                 "attn_tflops": attn_flops / max(ms - dec, 1e-3) / 1e9}
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--tp", type=int, default=16)
    ap.add_argument("--cases", default="512:0,2048:0,512:8192,2048:30720,4096:126976",
                    help="n:ctx pairs")
    a = ap.parse_args(argv)
    mla = load_config("k3").mla
    t0 = time.time()
    report = report_header(a.commit, tp=a.tp, cudnn=torch.backends.cudnn.version(), cases=[])
    for pair in a.cases.split(","):
        n, ctx = (int(x) for x in pair.split(":"))
        report["cases"].append(run_case(n, ctx, mla.num_heads // a.tp, mla))
        print(report["cases"][-1], flush=True)
        write_report(report, a.out)
    write_report(report, a.out, t0)


if __name__ == "__main__":
    main()
