"""Host time of two per-step inputs, the shipped form against the one it replaced, in one run
(CPU: what the host spends before or inside a step, whatever the GPU):

    python3 -m raydecode.scripts.explore.host_step_inputs --out X.json [--reps 50]

- `decode_meta` (models/mla.py): a stock step's decode-row paging, 64 rows at 1,024 tokens of
  context, with and without one row holding a 2,100-block table (a 32k-token sequence), over
  steps whose tables the engine kept: the shipped form copies each slot's row from a tensor
  kept across steps (`_table_row`); the baseline rebuilds T × max_blocks Python ints per step
  (the form before de1ad6a). Both outputs are compared element for element first.
- the step's token ids (engine/runner.py `ModelRunner.prepare`): 8,192 ids through numpy
  against `torch.tensor` of the list (the form before 64b0c64); the same int64 values.

Medians of --reps timings (time.perf_counter) after one untimed call; JSON with the host
header (`gpu` null on a CPU host)."""
from __future__ import annotations

import argparse
import random
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch

from raydecode.models import mla
from raydecode.models.cache import SeqSlice, StepBatch
from raydecode.scripts.bench.report_io import git_commit, report_header, write_report


def _flat_meta(batch: StepBatch, cache) -> torch.Tensor:
    """The baseline: decode_meta's host buffer [table | store | seq_lens] built as one list."""
    order = sorted(batch.seqs, key=lambda s: s.start)
    tables = [cache.block_tables[s.slot] for s in order]
    D, r = cache.dcp_size, cache.dcp_rank
    width = max(1, max(len(t) for t in tables))
    flat = [b for t in tables for b in t + [0] * (width - len(t))]
    flat += [s.pos // D if s.pos % D == r else -1 for s in order]
    flat += [(s.pos + D - r) // D for s in order]
    return torch.tensor(flat, dtype=torch.int32)


def _median_ms(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return round(statistics.median(ts) * 1e3, 4)


def paging_rows(reps: int, rows: int = 64, context: int = 1024, wide: int = 2100) -> list:
    out = []
    for wide_blocks in (None, wide):
        tables = {s: list(range(s * 4096, s * 4096 + context // 16 + 1)) for s in range(rows)}
        if wide_blocks:
            tables[0] = list(range(wide_blocks))
        cache = SimpleNamespace(dcp_size=1, dcp_rank=0, block_size=16, block_tables=tables)
        seqs = [SeqSlice(s, s, 1, 56 if (s == 0 and wide_blocks) else context)
                for s in range(rows)]

        def shipped():
            return mla.decode_meta(StepBatch(list(seqs)), cache, "cpu")   # a new step each

        table, store, lens = shipped()
        T, W = table.shape
        base = _flat_meta(StepBatch(list(seqs)), cache)
        if not torch.equal(torch.cat([table.reshape(-1), store, lens]), base):
            raise SystemExit("decode_meta differs from the flat baseline")
        out.append({"case": "decode_meta", "rows": T, "width": W,
                    "shipped_ms": _median_ms(shipped, reps),
                    "baseline_ms": _median_ms(lambda: _flat_meta(StepBatch(list(seqs)), cache),
                                              reps)})
    return out


def token_rows(reps: int, n: int = 8192) -> list:
    ids = [random.Random(0).randrange(163840) for _ in range(n)]
    new = torch.from_numpy(np.array(ids, dtype=np.int64).reshape(-1))
    if not torch.equal(new, torch.tensor(ids, dtype=torch.long)):
        raise SystemExit("token ids differ")
    return [{"case": "token_ids", "tokens": n,
             "shipped_ms": _median_ms(
                 lambda: torch.from_numpy(np.array(ids, dtype=np.int64).reshape(-1)), reps),
             "baseline_ms": _median_ms(lambda: torch.tensor(ids, dtype=torch.long), reps)}]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)
    if args.reps < 1:
        raise SystemExit(f"--reps {args.reps}: expected ≥ 1")
    t0 = time.time()
    rows = paging_rows(args.reps) + token_rows(args.reps)
    for r in rows:
        r["speedup"] = round(r["baseline_ms"] / r["shipped_ms"], 2)
        print(r, flush=True)
    write_report(report_header(git_commit(), bench="host_step_inputs", reps=args.reps,
                               method="median of --reps perf_counter timings after one "
                                      "untimed call; baseline = the form each replaced",
                               rows=rows), args.out, t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
