"""The decode-slowdown pacer (engine/pacer.py) replayed on step times a GPU measured: a CPU
run, no GPU. The source is a prefill bench JSON whose paced split schedule kept its samples
(`scripts/bench/prefill.py --schedule-pacer`): per chunk size its chunk steps' wall times, and
the streams' decode steps. The replay prefills the same prompt with the current pacer,
each chunk step's time drawn (seeded) from the measured times of the nearest chunk size that
has at least `--min-samples` of them, shifted along the line through the medians of the
smallest and the largest such sizes; each decode step's time drawn from the measured ones.
What it answers: which chunks the pacer settles on, the streams' TPOT p50 / p99 against the
median decode step, and the prompt's time, per seed, for step times with the measured
spread. What it does not: time correlations (the draws are independent) and the steps of
chunk sizes the GPU run did not sample (extrapolated along that line).

    python3 -m raydecode.scripts.explore.pacer_replay \\
        --source bench/results/prefill-h100-2026-12-06-paced.json --out X.json [--seeds 3] \\
        [--stretch 4]
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

from raydecode.engine.pacer import STRETCH, ChunkPacer, check_stretch


def measured(source: dict) -> tuple[dict, list[float], dict]:
    """(chunk size -> its chunk steps' seconds, the decode steps' seconds, the paced row) of
    the source's first paced split schedule."""
    for run in source["runs"]:
        for row in run.get("schedule", []):
            if "pacer_limit" in row and row["mode"] == "split" and row.get("samples"):
                chunks: dict[int, list[float]] = {}
                for x in row["samples"]:
                    chunks.setdefault(x["chunk_tokens"], []).append(x["chunk_ms"] / 1e3)
                return chunks, [x["decode_ms"] / 1e3 for x in row["samples"]], row
    raise SystemExit("the source has no paced split schedule with samples "
                     "(prefill.py --schedule-pacer L --schedule-modes split)")


def replay(chunks: dict, decodes: list[float], row: dict, limit: float, seed: int,
           stretch: float, min_samples: int) -> dict:
    sizes = sorted(n for n, v in chunks.items() if len(v) >= min_samples)
    if len(sizes) < 2:
        raise SystemExit(f"fewer than two chunk sizes with ≥ {min_samples} samples: {sizes}")
    med = {n: statistics.median(chunks[n]) for n in sizes}
    slope = (med[sizes[-1]] - med[sizes[0]]) / (sizes[-1] - sizes[0])
    rng = random.Random(seed)

    def chunk_s(n: int) -> float:
        near = min(sizes, key=lambda k: abs(k - n))
        return max(1e-4, rng.choice(chunks[near]) + slope * (n - near))

    pacer = ChunkPacer(limit, stretch=stretch)
    cap, prompt = row["chunk_cap"], row["prompt_tokens"]
    for _ in range(3):
        pacer.observe(0, row["decodes"], rng.choice(decodes))
    pos, total, tpot, chosen = 0, 0.0, [], {}
    while pos < prompt:
        n = min(pacer.chunk_cap(cap, row["decodes"]), prompt - pos)
        tc, td = chunk_s(n), rng.choice(decodes)
        pacer.observe(n, 0, tc)
        pacer.observe(0, row["decodes"], td)
        tpot.append(tc + td)
        chosen[n] = chosen.get(n, 0) + 1
        total += tc + td
        pos += n
    tpot.sort()
    base = statistics.median(decodes)

    def pct(q: float) -> float:
        return tpot[min(len(tpot) - 1, max(0, math.ceil(q * len(tpot)) - 1))]
    return {"seed": seed, "chunks_chosen": dict(sorted(chosen.items())), "pairs": len(tpot),
            "p50_over_decode_only": round(pct(0.5) / base, 3),
            "p99_over_decode_only": round(pct(0.99) / base, 3),
            "prompt_s": round(total, 3), "infeasible": pacer.infeasible,
            "reprobes": pacer.reprobes, "stretched": pacer.stretched}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", required=True, help="a prefill bench JSON with a paced row")
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--min-samples", type=int, default=10)
    ap.add_argument("--stretch", type=float, default=STRETCH,
                    help="the pacer's prompt_stretch_limit (≥ 1)")
    a = ap.parse_args(argv)
    try:
        check_stretch(a.stretch)
    except ValueError as e:
        ap.error(str(e))
    if a.seeds < 1 or a.min_samples < 1:
        ap.error(f"--seeds {a.seeds} --min-samples {a.min_samples}: expected ≥ 1 each")
    from raydecode.scripts.bench.report_io import report_header, write_report
    t0 = time.time()
    with open(a.source) as f:
        source = json.load(f)
    chunks, decodes, row = measured(source)
    runs = [replay(chunks, decodes, row, row["pacer_limit"], s, a.stretch, a.min_samples)
            for s in range(a.seeds)]
    report = report_header(
        a.commit, method=__doc__, source=a.source, source_gpu=source.get("gpu"),
        source_commit=source.get("commit"), source_date=source.get("date"),
        limit=row["pacer_limit"], stretch=a.stretch, prompt_tokens=row["prompt_tokens"],
        chunk_cap=row["chunk_cap"], decodes=row["decodes"],
        measured={"chunk_sizes_sampled": {n: len(v) for n, v in sorted(chunks.items())},
                  "decode_ms_median": round(statistics.median(decodes) * 1e3, 3),
                  "source_pacer_prompt_s": row.get("prompt_ttft_s"),
                  "source_p99_over_decode_only": row.get("p99_over_decode_only")},
        runs=runs)
    for r in runs:
        print(f"[pacer-replay] {json.dumps(r)}", flush=True)
    write_report(report, a.out, t0)


if __name__ == "__main__":
    main()
