"""fla's chunked KDA forward (kernels/kda_prefill.py) at each RAYDECODE_KDA_PRECISION: the
final state's and o's error against the fp64 reference, and the time of one 8k-token call, at
K3 rank shapes (GPU). Which precision the served prefill can afford for a ≤ 1e-4 state.

    python3 -m raydecode.scripts.explore.kda_prefill_precision --out X.json [--tp 16] \
        [--modes tf32,bf16x3,tf32x3,ieee] [--lens 8192 2048,700,65,1]

The setting is one per process, applied before fla's first compile (kernels/kda_prefill.py
`apply_precision`: Triton's fp32 dot default and fla's intra-chunk solve), so each mode runs
in its own subprocess with RAYDECODE_KDA_PRECISION set (its own compile and autotune, with its
own Triton cache directory: `first_call_s` is that cost); on the same seeded inputs: q, k
L2-normalised, g = −5·sigmoid(3·N(0,1)) (K3's lower bound), β = sigmoid, states 0.3·N(0,1),
fp32; the reference is models/kda.py `kda_chunked` per sequence in fp64. Errors are
‖x − ref‖ / ‖ref‖ per sequence (the max over sequences is reported); `ms` the median of
`--reps` calls after the first.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

D = 128                  # K3 linear_attn_config.head_dim
K3_HEADS = 96


def _inputs(lens: list[int], h: int, seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lens)

    def rn(*s):
        return torch.randn(*s, device="cuda", generator=gen)

    def l2(x):
        return x / x.norm(dim=-1, keepdim=True)

    bounds = [0]
    for n in lens:
        bounds.append(bounds[-1] + n)
    return dict(q=l2(rn(T, h, D)), k=l2(rn(T, h, D)), v=rn(T, h, D),
                g=-5.0 * torch.sigmoid(3.0 * rn(T, h, D)), beta=torch.sigmoid(rn(T, h)),
                scale=D ** -0.5, states=0.3 * rn(len(lens), h, D, D),
                cu_seqlens=torch.tensor(bounds, dtype=torch.int64))


def child(tp: int, cases: list[list[int]], reps: int, seed: int, mode: str) -> dict:
    """One mode's measurements (this process's RAYDECODE_KDA_PRECISION, applied at fla's
    first use)."""
    from raydecode.kernels import kda_prefill as KP
    from raydecode.scripts.explore.common import median_cuda_ms, rel_err
    h = K3_HEADS // tp
    out = {"mode": mode, "cases": []}
    for i, lens in enumerate(cases):
        x = _inputs(lens, h, seed + i)
        t0 = time.time()
        o, s = KP.kda_prefill(**x)
        torch.cuda.synchronize()
        first = time.time() - t0
        if KP.precision() != mode:
            raise SystemExit(f"mode {mode}: the process ran at {KP.precision()}")
        ref64 = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point()
                     else v) for k, v in x.items()}
        o_ref, s_ref = KP.kda_prefill_reference(**ref64)
        b = x["cu_seqlens"].tolist()
        e_o = max(rel_err(o[b[n]:b[n + 1]], o_ref[b[n]:b[n + 1]]) for n in range(len(lens)))
        e_s = max(rel_err(s[n], s_ref[n]) for n in range(len(lens)))
        ms = median_cuda_ms(lambda: KP.kda_prefill(**x), reps, warm=False)
        out["cases"].append({"lens": lens, "heads": h, "first_call_s": round(first, 2),
                             "o_rel_max": e_o, "state_rel_max": e_s,
                             "ms": ms})
        print(json.dumps(out["cases"][-1]), flush=True)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--tp", type=int, default=16)
    ap.add_argument("--modes", default="tf32,bf16x3,tf32x3,ieee",
                    help="comma-separated RAYDECODE_KDA_PRECISION values, one process each")
    ap.add_argument("--lens", nargs="+", default=["8192", "2048,700,65,1"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    cases = [[int(n) for n in s.split(",")] for s in a.lens]
    from raydecode.kernels.kda_prefill import PRECISIONS
    bad = [m for m in a.modes.split(",") if m not in PRECISIONS]
    if bad:
        ap.error(f"--modes {a.modes}: {', '.join(bad)} not a precision; accepted: "
                 f"{', '.join(PRECISIONS)}")
    if a.child:
        with open(a.out, "w") as f:
            json.dump(child(a.tp, cases, a.reps, a.seed, a.modes), f)
        return
    from raydecode.scripts.bench.report_io import report_header, write_report
    t0 = time.time()
    report = report_header(a.commit, tp=a.tp, method=__doc__, modes=[])
    for mode in a.modes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, RAYDECODE_KDA_PRECISION=mode, TRITON_CACHE_DIR=tmp)
            env.pop("TRITON_F32_DEFAULT", None)
            part = os.path.join(tmp, "mode.json")
            r = subprocess.run([sys.executable, "-m", __spec__.name, "--child", "--out", part,
                                "--modes", mode,
                                "--tp", str(a.tp), "--reps", str(a.reps), "--seed",
                                str(a.seed), "--lens", *a.lens], env=env)
            row = (json.load(open(part)) if r.returncode == 0 and os.path.exists(part)
                   else {"mode": mode, "error": f"child rc={r.returncode}"})
        report["modes"].append(row)
        print(f"[kda-precision] {json.dumps(row)}", flush=True)
        write_report(report, a.out)
    write_report(report, a.out, t0)


if __name__ == "__main__":
    main()
