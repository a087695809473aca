"""The engine's host work per decode step (CPU): what the coordinator spends in `LLMEngine.step`
besides the model — scheduling, the plan, sampling rows, appending tokens, detokenizing, stop
checks — at B running sequences that have already produced W tokens each.

    python -m raydecode.scripts.bench.engine_host [--batches 1,16,64] [--after 100,1000]
        [--steps 100] [--out bench/results/engine-host-<host>-<date>.json]

The executor answers every step at once with token ids (no model): the step time is the host
work alone. Variants, measured in the same run on the same requests: `incremental` (the served
path: engine/tokenizer.py `IncrementalDecoder`) and `full_decode` (the tokenizer without its
incremental decoder: the engine decodes each request's whole output every token — the path
before). Prompts are 16 tokens; ids are drawn so the text mixes ASCII and multi-byte
characters. ms = mean over --steps steps after W warm steps, best of --repeats.
Summary: `host_ms_b64_after1000` (incremental), `full_over_incremental_b64_after1000`.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time

from raydecode.scripts.bench.report_io import git_commit, report_header, write_report


class _NullExecutor:
    """Answers a step with one id per sample row, drawn from a fixed cycle of ids whose text
    mixes ASCII and multi-byte characters."""

    def __init__(self, ids: list[int]):
        self.ids, self.i = ids, 0

    def execute(self, plan):
        from raydecode.engine.sampling import StepResult
        out = []
        for _ in plan.sample_rows:
            out.append(self.ids[self.i % len(self.ids)])
            self.i += 1
        return StepResult(out)


class _FullDecodeTokenizer:
    """The tokenizer without `incremental`: LLMEngine then decodes the whole output."""

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        if name == "incremental":
            raise AttributeError(name)
        return getattr(self._tok, name)


def measure(tok, cycle: list[int], batch: int, after: int, steps: int, full: bool) -> float:
    from raydecode.engine.engine import EngineConfig, LLMEngine
    from raydecode.engine.sampling import SamplingParams

    t = _FullDecodeTokenizer(tok) if full else tok
    cfg = EngineConfig(max_num_seqs=batch, max_model_len=16 + after + steps + 64,
                       block_size=16, max_num_batched_tokens=max(1024, 16 * batch))
    eng = LLMEngine(_NullExecutor(cycle), t, cfg, (0,))
    params = SamplingParams(max_tokens=after + steps + 32, temperature=0, ignore_eos=True)
    for i in range(batch):
        eng.add_request([5 + i % 50] * 16, params, request_id=f"r{i}")
    for _ in range(after + 1):          # the prefill step, then `after` tokens each
        eng.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    return (time.perf_counter() - t0) / steps * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--after", default="100,1000")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None)
    args = ap.parse_args(argv)
    from raydecode.engine.tokenizer import Tokenizer
    from raydecode.scripts.bench.serve import checkpoint_dir

    t0 = time.time()
    ckpt = checkpoint_dir("tiny")
    try:
        tok = Tokenizer.from_dir(ckpt)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    cycle = tok.encode("def f(x):\n    return 'héllo — 日本 🙂' + str(x)  # ok\n")
    batches = [int(x) for x in args.batches.split(",")]
    afters = [int(x) for x in args.after.split(",")]
    rows = []
    for b in batches:
        for w in afters:
            row = {"batch": b, "after_tokens": w, "ms": {}}
            for variant, full in (("incremental", False), ("full_decode", True)):
                row["ms"][variant] = round(min(measure(tok, cycle, b, w, args.steps, full)
                                               for _ in range(args.repeats)), 4)
            row["full_over_incremental"] = round(row["ms"]["full_decode"]
                                                 / row["ms"]["incremental"], 2)
            rows.append(row)
            print(f"[engine-host] B={b} after {w}: {row['ms']} "
                  f"({row['full_over_incremental']}x)", flush=True)
    key = next((r for r in rows if r["batch"] == 64 and r["after_tokens"] == 1000), None)
    report = report_header(args.commit or git_commit(), bench="engine_host",
                           host={"cpu": platform.processor() or platform.machine(),
                                 "cores": os.cpu_count(), "python": sys.version.split()[0]},
                           shapes={"batches": batches, "after_tokens": afters,
                                   "prompt_tokens": 16, "steps": args.steps},
                           method=__doc__.split("\n\n", 2)[2], rows=rows,
                           summary={"host_ms_b64_after1000":
                                    key["ms"]["incremental"] if key else None,
                                    "full_over_incremental_b64_after1000":
                                    key["full_over_incremental"] if key else None})
    if args.out:
        write_report(report, args.out, t0)
    print(json.dumps(report["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
