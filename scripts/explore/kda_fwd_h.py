"""fla's chunked KDA forward at one K3 rank's shapes, one long sequence: where its state
recurrence (`chunk_gated_delta_rule_fwd_kernel_h_blockdim64`, serial over the sequence's
64-token chunks) can go faster. At K3 TP16 a rank holds 6 KDA heads, so the recurrence runs
6 × 128 / BV programs on 132 SMs: 24 at BV 32, half the forward's time in an 8k step (9.0 of
≈ 17 ms over 18 KDA layers on the H100, docs/perf-log/prefill.md).

    python3 -m raydecode.scripts.explore.kda_fwd_h --out X.json [--tp 16] [--tokens 8192]
        [--splits 4,8,16] [--reps 10]

Variants, each on the same seeded inputs (q, k L2-normalised, g = −5·sigmoid(3·N(0,1)), β =
sigmoid, initial state 0.3·N(0,1), fp32), timed as the median of `--reps` calls:
- shipped: kernels/kda_prefill.py as it runs in a prefill step (its index, chunk_offsets;
  since the fifteenth session its recurrence autotunes BV 16 beside fla's 32 and 64:
  `widen_recurrence`);
- fla-bv: the same on fla's own candidates only (BV 32 / 64: how fla ships), the baseline
  of the widening (measured the other way round first, cd300cf: BV 16 added to fla's);
- split-P: fla's own intra-card context parallelism (`fla.ops.common.intracard_cp`, enabled
  by FLA_INTRACARD_CP=1 for calls without chunk_offsets) with the sequence cut into P
  chunk-aligned parts: a pre-scan summarises each part as an affine map of its incoming
  state, a merge chains them, then the parts run in parallel. fla 0.6.0 splits only
  sequences of ≥ 3 · 128 chunks (24,576 tokens), never a prefill step's 8,192, so the probe
  replaces its part-length rule for the call (`compute_subseq_len`).
Each variant's o and final state are compared with shipped's (relative error) and its kernels
listed (device ms per call). Nothing here changes the served path.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch

from raydecode.kernels import kda_prefill as KP
from raydecode.scripts.explore.common import kernel_ms, median_cuda_ms, rel_err
from raydecode.scripts.explore.kda_prefill_precision import D, K3_HEADS, _inputs


def _recurrence_autotuner():
    """fla's autotuner object of the state recurrence (kernels/kda_prefill.py's lookup)."""
    tuner = KP._recurrence_tuner()
    if tuner is None:
        raise RuntimeError("fla-core's state recurrence autotuner not found (fla moved it?)")
    return tuner


@contextlib.contextmanager
def _fla_bv():
    """The recurrence on fla's own BV candidates (without kernels/kda_prefill.py's
    RECURRENCE_EXTRA_BV), its autotune cache cleared."""
    from raydecode.kernels.kda_prefill import RECURRENCE_EXTRA_BV
    tuner = _recurrence_autotuner()
    was = list(tuner.configs)
    tuner.configs = [c for c in was if c.kwargs.get("BV") not in RECURRENCE_EXTRA_BV]
    tuner.cache.clear()
    try:
        yield tuner
    finally:
        tuner.configs = was
        tuner.cache.clear()


@contextlib.contextmanager
def _split(parts: int):
    """fla's intra-card CP on, its part length T / parts (chunk-aligned) for every call."""
    from fla.ops.common import intracard_cp
    was_fn, was_env = intracard_cp.compute_subseq_len, os.environ.get("FLA_INTRACARD_CP")

    def subseq_len(seq_len, num_sms, num_heads, chunk_size=64):
        chunks = -(-seq_len // chunk_size)
        return -(-chunks // parts) * chunk_size

    intracard_cp.compute_subseq_len = subseq_len
    intracard_cp._intracard_cache.clear()
    os.environ["FLA_INTRACARD_CP"] = "1"
    try:
        yield
    finally:
        intracard_cp.compute_subseq_len = was_fn
        intracard_cp._intracard_cache.clear()
        if was_env is None:
            os.environ.pop("FLA_INTRACARD_CP", None)
        else:
            os.environ["FLA_INTRACARD_CP"] = was_env


def _call(x: dict, offsets: bool):
    """One forward through kernels/kda_prefill.py `_fla_prefill`; offsets False: its index
    without chunk_offsets (what fla's intra-card backend needs to take the call)."""
    index = KP._varlen_index(tuple(x["cu_seqlens"].tolist()), x["q"].device)
    if not offsets:
        index = index[:3] + (None,)
    return KP._fla_prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"],
                           x["states"], x["cu_seqlens"], index)


@torch.inference_mode()
def run(tp: int, tokens: int, splits: list[int], reps: int, seed: int, log=print) -> dict:
    h = K3_HEADS // tp
    x = _inputs([tokens], h, seed)
    KP.warmup(h, D, "cuda")
    rows = []
    o_ref, s_ref = _call(x, True)
    variants = [("shipped", contextlib.nullcontext, True), ("fla-bv", _fla_bv, True)]
    variants += [(f"split-{p}", (lambda p=p: _split(p)), False) for p in splits]
    for name, ctx, offsets in variants:
        row = dict(variant=name, tokens=tokens, heads=h)
        try:
            with ctx() as extra:
                t0 = time.perf_counter()
                o, s = _call(x, offsets)
                torch.cuda.synchronize()
                row["first_call_s"] = round(time.perf_counter() - t0, 3)
                row["ms"] = round(median_cuda_ms(lambda: _call(x, offsets), reps), 4)
                row["kernels"] = kernel_ms(lambda: _call(x, offsets), calls=3, top=8)
                row["rel_err_o"] = rel_err(o, o_ref)
                row["rel_err_state"] = rel_err(s, s_ref)
                tuner = extra or _recurrence_autotuner()
                row["chosen"] = str(next(iter(tuner.cache.values()), None))
        except Exception as e:  # noqa: BLE001 — a variant that cannot run is a result too
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        log(f"[kda-fwd-h] {json.dumps(row)}")
        rows.append(row)
    return dict(rows=rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--tp", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--splits", default="",
                    help="P for split-P variants, e.g. 4,8,16 (at cd300cf split-4 had not "
                         "finished after 190 s on the H100: none by default)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if K3_HEADS % a.tp:
        raise SystemExit(f"--tp {a.tp}: expected a divisor of K3's {K3_HEADS} KDA heads")
    report = dict(gpu=torch.cuda.get_device_name(), commit=a.commit, tp=a.tp,
                  date=time.strftime("%Y-%m-%d"), method=__doc__)
    report.update(run(a.tp, a.tokens, [int(p) for p in a.splits.split(",") if p], a.reps,
                      a.seed))
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
