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

`--mode mixed`: the mixed schedule (each step carries the chunk beside the decode rows and
is the streams' TPOT sample). Its step times are pooled from every mixed schedule row of
the sources (fixed chunks and paced; comma-separated files of one lease) and keyed by the
step's token bucket (chunk + rows: the stock graph it replays, which sets its cost); a step
is drawn from its bucket's samples, or from the nearest sampled bucket's shifted along the
medians' line in step tokens. The decode-only step is each row's median (the mixed rows keep
no decode samples). `--limit` replays at another limit than the source's.

    python3 -m raydecode.scripts.explore.pacer_replay \\
        --source bench/results/prefill-h100-2026-12-06-paced.json --out X.json [--seeds 3] \\
        [--stretch 4]
    python3 -m raydecode.scripts.explore.pacer_replay --mode mixed --limit 1.8 --cap 448 \\
        --source A.json,B.json --out X.json
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

from raydecode.engine.pacer import STRETCH, ChunkPacer, bucket, check_stretch


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


def measured_mixed(sources: list[dict]) -> tuple[dict, list[float], dict]:
    """(step bucket -> its mixed steps' seconds, the rows' decode-only medians (seconds),
    {decodes, prompt_tokens}) pooled over every mixed schedule row with samples."""
    steps: dict[int, list[float]] = {}
    decode, shape = [], None
    for source in sources:
        for run in source["runs"]:
            for row in run.get("schedule", []):
                if row.get("mode") != "mixed" or not row.get("samples"):
                    continue
                B, P = row["decodes"], row["prompt_tokens"]
                if shape is None:
                    shape = {"decodes": B, "prompt_tokens": P}
                elif shape != {"decodes": B, "prompt_tokens": P}:
                    raise SystemExit(f"mixed rows of {B} decodes and a {P}-token prompt beside "
                                     f"rows of {shape}: pool one schedule's sources only")
                for x in row["samples"]:
                    n = x.get("chunk_tokens") or min(row["chunk_tokens"], P - x["pos"])
                    steps.setdefault(bucket(n + B), []).append(x["mixed_ms"] / 1e3)
                decode.append(row["tpot_ms_decode_only"] / 1e3)
    if shape is None:
        raise SystemExit("the sources have no mixed schedule row with samples "
                         "(prefill.py --schedule-modes mixed)")
    return steps, decode, shape


def replay_mixed(steps: dict, decodes: list[float], shape: dict, cap: int, limit: float,
                 seed: int, stretch: float, min_samples: int) -> dict:
    """The mixed schedule of `shape` paced at `limit`: per step the pacer's chunk, its step's
    time drawn from its token bucket's samples; -> as `replay`."""
    keys = sorted(k for k, v in steps.items() if len(v) >= min_samples)
    if not keys:
        raise SystemExit(f"no step bucket with ≥ {min_samples} samples: "
                         f"{ {k: len(v) for k, v in sorted(steps.items())} }")
    med = {k: statistics.median(steps[k]) for k in keys}
    slope = (med[keys[-1]] - med[keys[0]]) / (keys[-1] - keys[0]) if len(keys) > 1 else 0.0
    rng = random.Random(seed)
    B, prompt = shape["decodes"], shape["prompt_tokens"]
    base = statistics.median(decodes)

    def step_s(n: int) -> float:
        k = bucket(n + B)
        near = min(keys, key=lambda j: abs(j - k))
        return max(1e-4, rng.choice(steps[near]) + slope * (k - near))

    pacer = ChunkPacer(limit, mixed=True, stretch=stretch)
    for _ in range(3):
        pacer.observe(0, B, base)
    pos, total, tpot, chosen = 0, 0.0, [], {}
    while pos < prompt:
        n = min(pacer.chunk_cap(cap, B), prompt - pos)
        t = step_s(n)
        pacer.observe(n, B, t)
        tpot.append(t)
        chosen[n] = chosen.get(n, 0) + 1
        total += t
        pos += n
    return _summary(seed, chosen, tpot, base, total, pacer)


def _summary(seed: int, chosen: dict, tpot: list[float], base: float, total: float,
             pacer: ChunkPacer) -> dict:
    tpot = sorted(tpot)

    def pct(q: float) -> float:
        return tpot[min(len(tpot) - 1, max(0, math.ceil(q * len(tpot)) - 1))]
    return {"seed": seed, "chunks_chosen": dict(sorted(chosen.items())), "pairs": len(tpot),
            "p50_over_decode_only": round(pct(0.5) / base, 3),
            "p99_over_decode_only": round(pct(0.99) / base, 3),
            "prompt_s": round(total, 3), "infeasible": pacer.infeasible,
            "reprobes": pacer.reprobes, "stretched": pacer.stretched}


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
    return _summary(seed, chosen, tpot, statistics.median(decodes), total, pacer)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", required=True, help="a prefill bench JSON with a paced row "
                    "(mixed: comma-separated JSONs whose mixed rows are pooled)")
    ap.add_argument("--mode", default="split", choices=("split", "mixed"))
    ap.add_argument("--limit", type=float, default=None,
                    help="the pacer's limit (default: the source's paced row's)")
    ap.add_argument("--cap", type=int, default=None, help="mixed: the static chunk cap "
                    "(default: the largest chunk in the sources' mixed rows)")
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
    if a.limit is not None and not a.limit > 1.0:
        ap.error(f"--limit {a.limit}: expected a number > 1")
    if a.cap is not None and a.cap < 1:
        ap.error(f"--cap {a.cap}: expected a positive token count")
    from raydecode.scripts.bench.report_io import report_header, write_report
    t0 = time.time()
    if a.mode == "mixed":
        return _main_mixed(a, t0, report_header, write_report)
    with open(a.source) as f:
        source = json.load(f)
    chunks, decodes, row = measured(source)
    if a.limit is not None:
        row = {**row, "pacer_limit": a.limit}
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


def _main_mixed(a, t0: float, report_header, write_report) -> None:
    paths = [p for p in a.source.split(",") if p]
    sources = []
    for p in paths:
        with open(p) as f:
            sources.append(json.load(f))
    steps, decodes, shape = measured_mixed(sources)
    rows = [r for s in sources for run in s["runs"] for r in run.get("schedule", [])
            if r.get("mode") == "mixed"]
    cap = a.cap or max(r.get("chunk_cap") or r.get("chunk_tokens") for r in rows)
    limit = a.limit or next((r["pacer_limit"] for r in rows if "pacer_limit" in r), None)
    if limit is None:
        raise SystemExit("no paced mixed row in the sources: give --limit")
    runs = [replay_mixed(steps, decodes, shape, cap, limit, s, a.stretch, a.min_samples)
            for s in range(a.seeds)]
    report = report_header(
        a.commit, method=__doc__, mode="mixed", source=paths,
        source_gpu=sorted({s.get("gpu") for s in sources}, key=str),
        source_commit=sorted({s.get("commit") for s in sources}, key=str),
        source_date=sorted({s.get("date") for s in sources}, key=str),
        limit=limit, stretch=a.stretch, chunk_cap=cap, **shape,
        measured={"step_buckets_sampled": {k: len(v) for k, v in sorted(steps.items())},
                  "step_ms_median": {k: round(statistics.median(v) * 1e3, 3)
                                     for k, v in sorted(steps.items())},
                  "decode_ms_median": round(statistics.median(decodes) * 1e3, 3)},
        runs=runs)
    for r in runs:
        print(f"[pacer-replay] {json.dumps(r)}", flush=True)
    write_report(report, a.out, t0)


if __name__ == "__main__":
    main()
