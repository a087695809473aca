"""Static SASS instruction counts of the few-token MoE decode kernels (no GPU needed).

Compiles the split-K gate_up and the down kernel of kernels/moe_mxfp4_decode.py offline for
sm_90a (kernels/aot_triton.py `compile_kernel`, Triton's own ptxas and cuobjdump) at K3's TP16
shapes (E 896, I 192, L 3584) for a set of tiles, in the words and f16x2 decode modes, and
reports SASS instructions per thread ÷ weight bytes per thread: the issue cost per weight byte
the round-5 Nsight run found the kernels bound by (docs/PERF.md rounds 5, 7, 11). The kernels
are fully unrolled at these tiles, so the static count is the executed count per thread.

    python -m raydecode.scripts.explore.moe_decode_sass --out sass.json --commit $(git rev-parse HEAD)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile

from raydecode.kernels.aot_triton import PDL_KW, TritonSpec, compile_kernel

E, I, L = 896, 192, 3584
MOD = "raydecode.kernels.moe_mxfp4_decode"
# (rows, groups per K step, K slices, warps): the round-7 TUNED tile and row-reuse tiles
GATE_UP_TILES = [(8, 16, 7, 4), (16, 8, 14, 2), (16, 8, 14, 1), (32, 4, 28, 2),
                 (32, 4, 28, 1), (64, 4, 28, 2), (16, 16, 7, 2), (32, 8, 14, 2)]
DOWN_TILES = [(64, 2, 2), (64, 2, 1), (128, 2, 2)]          # (rows, groups per step, warps)
MODES = {"words": (True, False), "f16x2": (True, True)}


def _spec(name, kernel, args, kw) -> TritonSpec:
    return TritonSpec(name, f"{MOD}:{kernel}", tuple(args), tuple(kw.items()) + PDL_KW)


def gate_up_spec(bn, gb, ks, warps, words, f16x2) -> TritonSpec:
    args = [("ptr", "bfloat16"), ("ptr", "int64"), ("ptr", "uint8"), ("ptr", "uint8"),
            ("ptr", "float32"), ("ptr", "float32"), ("int", L), ("int", 16)]
    kw = dict(L=L, I=I, KB=L // 2, KG=L // 32, KS=ks, KGS=L // 32 // ks, BN=bn, GB=gb, ZB=16,
              WORDS=words, F16X2=f16x2, ASM=True, num_warps=warps)
    return _spec(f"gate_up {bn}x{gb} ks{ks} w{warps}", "_gate_up_split_kernel", args, kw)


def down_spec(bn, gb, warps, words, f16x2) -> TritonSpec:
    args = [("ptr", "float32"), ("ptr", "int64"), ("ptr", "float32"), ("ptr", "uint8"),
            ("ptr", "uint8"), ("ptr", "float32"), ("int", 16), ("float", 4.0),
            ("float", 25.0)]
    kw = dict(L=L, I=I, KB=I // 2, KG=I // 32, KS=7, HAS_LIN=True, BN=bn, GB=gb, UNROLL=True,
              WORDS=words, F16X2=f16x2, ASM=True, num_warps=warps)
    return _spec(f"down {bn}x{gb} w{warps}", "_down_kernel", args, kw)


def sass_count(kernel, tmp: str) -> int:
    """Instructions in the kernel's SASS (cuobjdump of its cubin)."""
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    path = os.path.join(tmp, "k.cubin")
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    out = subprocess.run([tool, "-sass", path], capture_output=True, text=True,
                         check=True).stdout
    return len(re.findall(r"/\*[0-9a-f]{4}\*/\s+[^;]*;", out))


def rows(tmp: str) -> list[dict]:
    out = []
    cases = [("gate_up", t, gate_up_spec(*t, *m), t[0] * 2 * t[1] * 16 / (32 * t[3]))
             for t in GATE_UP_TILES for m in MODES.values()]
    cases += [("down", t, down_spec(*t, *m), t[0] * (I // 32) * 16 / (32 * t[2]))
              for t in DOWN_TILES for m in MODES.values()]
    for kind, tile, spec, bytes_per_thread in cases:
        mode = "f16x2" if dict(spec.kwargs)["F16X2"] else "words"
        n = sass_count(compile_kernel(spec, "sm_90a", os.path.join(tmp, "cache")), tmp)
        out.append({"kernel": kind, "tile": spec.name, "mode": mode, "sass": n,
                    "weight_bytes_per_thread": bytes_per_thread,
                    "sass_per_weight_byte": round(n / bytes_per_thread, 2)})
        print(f"{spec.name:28s} {mode:6s} {n:5d} instr  {n / bytes_per_thread:5.1f} / B",
              flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--commit", default="unknown", help="git commit of the compiled tree")
    args = ap.parse_args(argv)
    try:
        import triton
    except ImportError:
        print("needs Triton (no GPU: it compiles offline)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        report = {"what": __doc__.splitlines()[0], "arch": "sm_90a", "gpu": "none (offline "
                  "compile for H200's sm_90a)", "triton": triton.__version__,
                  "commit": args.commit,
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                      timespec="seconds"),
                  "shapes": {"E": E, "I": I, "L": L}, "rows": rows(tmp)}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
