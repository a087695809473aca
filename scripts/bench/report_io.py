"""The JSON every benchmark script writes to bench/results/: a common header (GPU, commit, UTC
date, library versions) and one writer, called after each case so that a run cut short by its
time limit keeps what it measured, and at the end with the run's wall time."""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import time

import torch


def git_commit() -> str:
    """HEAD of the repository this file is in ("unknown" outside a git checkout), for benches
    run without --commit."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=os.path.dirname(__file__)).stdout.strip()
    except Exception:
        return "unknown"


def report_header(commit: str, **extra) -> dict:
    """{gpu, commit, date, torch, triton} (+ extra) for a GPU benchmark's report."""
    try:
        import triton
        triton_version = triton.__version__
    except Exception:       # CPU-only installs have no Triton
        triton_version = None
    head = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "triton": triton_version}
    return head | extra


def write_report(report: dict, path: str, t0: float | None = None) -> None:
    """Write `report` as indented JSON to path; with t0 (time.time() at the start), first set
    report["wall_s"]."""
    if t0 is not None:
        report["wall_s"] = time.time() - t0
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def default_out(prefix: str, suffix: str = "") -> str:
    """bench/results/<prefix>-<gpu>[<suffix>]-<UTC date>.json, e.g. kda-verify-h200-2026-12-03
    (gpu: the last word of the device name, lower case)."""
    slug = torch.cuda.get_device_name().split()[-1].lower()
    day = datetime.date.today().isoformat()
    return os.path.join("bench", "results", f"{prefix}-{slug}{suffix}-{day}.json")


def gpu_bench_main(args, run, name: str, prefix: str, triton_module) -> int:
    """The shared tail of a GPU kernel bench's main(): 2 with a message without CUDA or Triton
    (`triton_module.triton` None), else --commit / --out defaults (`git_commit`,
    `default_out(prefix)`), run(args), 0."""
    import sys

    if not torch.cuda.is_available() or getattr(triton_module, "triton", None) is None:
        print(f"{name} bench: needs a CUDA GPU and Triton", file=sys.stderr)
        return 2
    args.commit = args.commit or git_commit()
    args.out = args.out or default_out(prefix)
    run(args)
    return 0


__all__ = ["default_out", "gpu_bench_main", "report_header", "write_report"]


def int_list(flag: str, text: str, low: int) -> list[int]:
    """A flag's comma-separated integers, each ≥ low; SystemExit naming the flag otherwise."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < low:
        raise SystemExit(f"{flag} {text}: expected comma-separated integers >= {low}")
    return vals


def run_saver(report: dict, summarize, path: str | None, t0: float):
    """save(run): add `run` to report["runs"] (once), recompute report["summary"] with
    `summarize(runs)` and rewrite the JSON at `path` (if any), so a bench cut short by its
    time limit still leaves every finished run on disk."""
    report["runs"] = []

    def save(run: dict) -> None:
        if not any(r is run for r in report["runs"]):
            report["runs"].append(run)
        report["summary"] = summarize(report["runs"])
        if path:
            write_report(report, path, t0)
    return save
