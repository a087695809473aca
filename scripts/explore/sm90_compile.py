"""The MoE prefill kernels compiled for sm_90 on a machine without a GPU: registers, stack
(spills), wgmma count and what the k loop loads synchronously, read off Triton's own output
(TTGIR, cubin), for a kernel change before any device time.

    python3 -m raydecode.scripts.explore.sm90_compile --out X.json \
        [--kernels gate_up_blocked,down_swap,gate_up_split] [--kind auto] [--pairs 131072]
        [--set prefetch_scales=1 --set num_warps=8 ...] [--dump DIR]

Needs Triton itself (`pip install --target DIR triton==3.6.0`, the GPU hosts' version, then
PYTHONPATH=DIR): `triton.compile` with `GPUTarget("cuda", 90, 128)` runs the whole pipeline
through the wheel's bundled ptxas, and `cuobjdump -res-usage` / `nvdisasm` read the cubin.
The kernels are those `fused_moe_mxfp4_triton` launches for `kernels/moe_mxfp4.py`
`prefill_config` at K3 TP16 (L 3,584, I 192, top-16 of 896) under `--kind` (a
RAYDECODE_PREFILL_EXPERTS value) and `--pairs`, with `--set FIELD=VALUE` applied to the
MoEConfig. Each pointer argument is declared 16-byte aligned and `top_k` divisible by 16, as
the launch's specialisation makes them: without that every load compiles scalar and the
kernels appear to spill kilobytes (docs/perf-log/prefill.md, fifteenth session).

Per kernel: `regs`, `stack` bytes, `spill_insts` (STL / LDL in the SASS), `hgmma` (HGMMA
instructions), `loop_sync_loads` (`tt.load` inside an `scf.for` of the TTGIR: global loads the
software pipeliner left synchronous), `loop_async_copies` (cp.async loads it pipelined),
`tile_via_smem` (a register tile stored to shared memory and loaded back as a dot operand
inside the loop: `local_alloc` of a tensor followed by a `local_load` to a `dot_op` layout).
`--dump DIR`: each kernel's TTGIR, PTX and SASS.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import tempfile
import time

PTR_TYPES = {"z_ptr": "*bf16", "a_ptr": "*bf16", "gu_ptr": "*bf16", "y_ptr": "*bf16",
             "w_ptr": "*u8", "s_ptr": "*u8", "pairs_ptr": "*i32", "sorted_e_ptr": "*i32",
             "chunk_start_ptr": "*i32", "chunk_end_ptr": "*i32", "num_chunks_ptr": "*i32"}
INT_ARGS = {"top_k": "i32", "beta": "fp32", "lin_beta": "fp32"}   # scalars (beta: SiTU's)
K3_TP16 = dict(L=3584, I=192, E=896, top_k=16)


def _launches(cfg, L: int, I: int) -> dict[str, tuple]:
    """name -> (JIT function, constexprs, warps, stages) of the kernels cfg launches on CUDA
    (X2 = 2: the asm decode), from kernels/moe_mxfp4.py `prefill_launches`, the table the
    launches themselves read."""
    from raydecode.kernels.moe_mxfp4 import prefill_launches
    if not (cfg.blocked or (cfg.swap_ab and cfg.split_gate_up)):
        raise SystemExit(f"{cfg}: only the blocked and the swapped split forms are covered")
    specs = prefill_launches(cfg, L, I, x2=2 if cfg.decode == "x2" else 0, dot32=False)
    return {k: (v.kernel, v.consts, v.warps, v.stages) for k, v in specs.items()}


def _loop_stats(ttgir: str) -> dict:
    """Synchronous loads, cp.async copies and smem round trips of dot operands inside loops."""
    regions: list[bool] = []                    # open regions: whether each is a loop body
    sync, cp, allocs, via_smem = 0, 0, set(), 0
    for line in ttgir.splitlines():
        body = line.strip()
        if body.startswith("}") and regions:
            kind = regions.pop()
            if body.endswith("{"):                  # `} else {`: the same construct goes on
                regions.append(kind)
        elif body.endswith("{"):
            regions.append("scf.for" in body or "scf.while" in body)
        if any(regions):
            if re.search(r"= tt\.load ", line):
                sync += 1
            if "async_copy_global_to_local" in line:
                cp += 1
            m = re.search(r"(%\S+) = ttg\.local_alloc %\S+ :", line)
            if m:
                allocs.add(m.group(1))
            m = re.search(r"= ttg\.local_load (%\S+) .*dot_op", line)
            if m and m.group(1) in allocs:
                via_smem += 1
    return dict(loop_sync_loads=sync, loop_async_copies=cp, tile_via_smem=via_smem)


def compile_one(fn, consts: dict, warps: int, stages: int, dump: str | None, name: str) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import inspect
    names = fn.arg_names
    defaults = {p.name: p.default for p in inspect.signature(fn.fn).parameters.values()
                if p.default is not inspect.Parameter.empty}
    consts = {**{n: defaults[n] for n in names if n in defaults and n not in consts
                 and n not in INT_ARGS}, **consts}
    sig, attrs, cx = {}, {}, {}
    for i, n in enumerate(names):
        if n in consts:
            sig[n] = "constexpr"
            cx[(i,)] = consts[n]
        elif n in PTR_TYPES or n in INT_ARGS:
            sig[n] = PTR_TYPES.get(n) or INT_ARGS[n]
            if sig[n] != "fp32":
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            raise SystemExit(f"{fn.__name__}: argument {n!r} has no declared type here")
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs),
                       target=GPUTarget("cuda", 90, 128),
                       options=dict(num_warps=warps, num_stages=stages))
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(k.asm["cubin"])
        res = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", cubin],
                             capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(bindir, "nvdisasm"), "-c", cubin],
                              capture_output=True, text=True).stdout
    reg = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    row = dict(kernel=name, warps=warps, stages=stages,
               constexprs={k_: (v if isinstance(v, (int, float, bool, str)) else str(v))
                           for k_, v in consts.items()},
               regs=int(reg.group(1)) if reg else None,
               stack=int(stack.group(1)) if stack else None,
               spill_insts=len(re.findall(r"\b(?:STL|LDL)\b", sass)),
               hgmma=len(re.findall(r"\bHGMMA\b", sass)), shared_bytes=k.metadata.shared,
               **_loop_stats(k.asm["ttgir"]))
    if dump:
        os.makedirs(dump, exist_ok=True)
        for ext, text in (("ttgir", k.asm["ttgir"]), ("ptx", k.asm["ptx"]), ("sass", sass)):
            with open(os.path.join(dump, f"{name}.{ext}"), "w") as f:
                f.write(text)
    return row


def _value(raw: str):
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(raw.lower(), raw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--kernels", default="", help="comma-separated names (default: all the "
                    "config launches)")
    ap.add_argument("--kind", default="auto")
    ap.add_argument("--pairs", type=int, default=8192 * K3_TP16["top_k"])
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    ap.add_argument("--dump", default=None)
    a = ap.parse_args()
    from raydecode.kernels import moe_mxfp4 as M
    if a.kind not in M.PREFILL_EXPERT_KINDS or a.kind.startswith("ogs"):
        raise SystemExit(f"--kind {a.kind!r}: expected one of our kinds "
                         f"{[k for k in M.PREFILL_EXPERT_KINDS if not k.startswith('ogs')]}")
    M.PREFILL_EXPERTS = a.kind
    L, I, E = K3_TP16["L"], K3_TP16["I"], K3_TP16["E"]
    cfg = M.prefill_config(L, I, a.pairs, E)
    fields = {f.name for f in dataclasses.fields(cfg)}
    for s in a.set:
        key, _, raw = s.partition("=")
        if key not in fields:
            raise SystemExit(f"--set {s!r}: {key!r} is no MoEConfig field; fields: "
                             f"{sorted(fields)}")
        cfg = dataclasses.replace(cfg, **{key: _value(raw)})
    launches = _launches(cfg, L, I)
    want = [k for k in a.kernels.split(",") if k] or list(launches)
    rows = []
    for name in want:
        if name not in launches:
            raise SystemExit(f"--kernels {name!r}: this config launches {list(launches)}")
        fn, consts, warps, stages = launches[name]
        row = compile_one(fn, consts, warps, stages, a.dump, name)
        print(json.dumps(row))
        rows.append(row)
    report = dict(commit=a.commit, date=time.strftime("%Y-%m-%d"), target="sm_90 (CPU compile)",
                  kind=a.kind, pairs=a.pairs, config=dataclasses.asdict(cfg), rows=rows,
                  method=__doc__)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
