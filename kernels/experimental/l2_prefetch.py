"""Weight prefetch into L2 on a side branch of the decode graph (DESIGN §4 lever 4).

A decode layer at batch 1 alternates bandwidth-bound GEMVs with latency-bound kernels (the KDA
step, the MLA attention, the router, the MoE decode) during which HBM is mostly idle. Weights do
not depend on activations, so the next GEMVs' matrices can be requested while those kernels run;
the GEMV then reads them from L2.

    table = prefetch_table([w1, w2])      (n, 2) int64 rows (address, bytes): each tensor's byte
                                          range [data_ptr, data_ptr + nbytes) cut into chunks of
                                          ≤ chunk_bytes, 16-byte aligned, padded by repeating the
                                          last row to a multiple of ROWS_PER_PROGRAM
    l2_prefetch(table)                    one launch, n / ROWS_PER_PROGRAM one-warp programs; lane
                                          i issues `cp.async.bulk.prefetch.L2.global` for row i
    side = SidePrefetch(); side.issue(table)   fork: a side stream waits for the work issued so
                                          far on the current stream, then launches the prefetch
    side.join()                           the current stream waits for the side stream (before a
                                          graph capture ends, or a step returns)

Why many small programs: a bulk prefetch is expanded by the issuing SM's copy engine, so the
requests for tens of MB are spread over many SMs (ROWS_PER_PROGRAM × chunk_bytes, 512 KiB by
default, per program). The `lines` form (KIND) issues `prefetch.global.L2` per 128-byte line
from the load units instead.

Measured (H200, docs/PERF.md round 17): a GEMV after a prefetch that had 8–16 µs to land
recovers only about a third of what an L2-resident weight gains, in every form and chunk size
tried, and the layer bench shows no gain at batch 1. So the layer bench keeps it off
(`RAYDECODE_BENCH_L2PF`) and the served path does not call it; it stays for A/B runs and for
other parts (sm_100) where the balance may differ.

The prefetch has no effect on any value: it is a cache hint. On CPU tensors (or without Triton,
or before sm_90) `l2_prefetch` validates its table and does nothing. The ranges must lie inside
live allocations: rounding a range to 16 bytes stays inside PyTorch's 512-byte allocation blocks.
Tables hold raw addresses: build them for the tensors a CUDA graph will read, keep them (and the
tensors) alive as long as the graph.
"""
from __future__ import annotations

import functools

import torch

from raydecode.kernels._triton import tl, triton
from raydecode.kernels import settings

ROWS_PER_PROGRAM = 32        # one warp per program, one row per lane
ALIGN = 16                   # cp.async.bulk.prefetch: 16-byte address and size
LINE = 128                   # bytes per `prefetch.global.L2` (one L2 line)
# How the rows are requested (A/B runs: RAYDECODE_L2PF_KIND, RAYDECODE_L2PF_CHUNK):
#   bulk:  one `cp.async.bulk.prefetch.L2` per row (lane), ROWS_PER_PROGRAM rows per program;
#   lines: one program per row, one `prefetch.global.L2` per 128-byte line of it (a thread
#          per line: the requests come from the SM's load units, not its copy engine).
KINDS = ("bulk", "lines")
KIND = settings.get("RAYDECODE_L2PF_KIND")
CHUNK_BYTES = settings.get("RAYDECODE_L2PF_CHUNK")      # bytes per table row (a multiple of ALIGN)


def prefetch_ranges(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """(start, end) byte ranges of the tensors' storage spans, 16-byte aligned outward and merged
    where they touch or overlap. A non-contiguous view prefetches its whole span."""
    spans = []
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"prefetch_ranges takes tensors; got {type(t).__name__}")
        if t.numel() == 0:
            continue
        lo = t.data_ptr()
        extent = sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1
        hi = lo + extent * t.element_size()
        spans.append((lo // ALIGN * ALIGN, -(-hi // ALIGN) * ALIGN))
    spans.sort()
    merged: list[tuple[int, int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def prefetch_table(tensors: list[torch.Tensor], chunk_bytes: int = CHUNK_BYTES,
                   max_bytes: int | None = None) -> torch.Tensor:
    """(n, 2) int64 (address, bytes) rows on the tensors' device: `prefetch_ranges` cut into
    chunks of ≤ chunk_bytes, in order, at most max_bytes in all (the leading bytes: a budget for
    L2), n a multiple of ROWS_PER_PROGRAM (the last row repeated: a second prefetch of the same
    bytes is free)."""
    if chunk_bytes <= 0 or chunk_bytes % ALIGN:
        raise ValueError(f"chunk_bytes = {chunk_bytes}; expected a positive multiple of {ALIGN}")
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes = {max_bytes}; expected ≥ 0 or None (no budget)")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"prefetch_table: tensors on {sorted(map(str, devices))}; expected one "
                         "device")
    rows: list[tuple[int, int]] = []
    left = max_bytes if max_bytes is not None else float("inf")
    for lo, hi in prefetch_ranges(tensors):
        for a in range(lo, hi, chunk_bytes):
            n = min(chunk_bytes, hi - a, left)
            n = n // ALIGN * ALIGN
            if n <= 0:
                break
            rows.append((a, n))
            left -= n
    if rows:
        rows += [rows[-1]] * (-len(rows) % ROWS_PER_PROGRAM)
    device = devices.pop() if devices else torch.device("cpu")
    return torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1, 2)


def table_bytes(table: torch.Tensor) -> int:
    """Distinct bytes a table requests (padding rows repeat the last row and count once)."""
    return sum(n for _, n in {tuple(r) for r in table.tolist()})


def _check_table(table: torch.Tensor) -> None:
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != 2:
        raise ValueError(f"prefetch table of dtype {table.dtype} and shape "
                         f"{tuple(table.shape)}; expected int64 (n, 2) from prefetch_table")
    if table.shape[0] % ROWS_PER_PROGRAM:
        raise ValueError(f"prefetch table of {table.shape[0]} rows; expected a multiple of "
                         f"{ROWS_PER_PROGRAM} (prefetch_table pads it)")


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def l2_prefetch(table: torch.Tensor, kind: str | None = None) -> None:
    """Request every row of `table` into L2 (one launch on the current stream; `kind` as KIND,
    default KIND). A no-op on CPU tensors, without Triton, and before sm_90."""
    _check_table(table)
    kind = KIND if kind is None else kind
    if kind not in KINDS:
        raise ValueError(f"l2_prefetch kind={kind!r}; accepted: {', '.join(KINDS)}")
    if table.shape[0] == 0 or not table.is_cuda or triton is None:
        return
    if not _supported(table.device.index if table.device.index is not None
                      else torch.cuda.current_device()):
        return
    if kind == "bulk":
        _l2_prefetch_kernel[(table.shape[0] // ROWS_PER_PROGRAM,)](
            table, ROWS=ROWS_PER_PROGRAM, num_warps=1)
        return
    _l2_prefetch_lines_kernel[(table.shape[0],)](table, LINES=128, num_warps=4)


class SidePrefetch:
    """Prefetches on a side stream forked from the current one (in a CUDA graph: a branch that
    depends on the work captured so far and joins where `join` is called)."""

    def __init__(self, device: torch.device | None = None):
        self.stream = torch.cuda.Stream(device) if torch.cuda.is_available() else None
        self.launches = 0            # prefetch launches issued since the last join

    def issue(self, table: torch.Tensor) -> None:
        if self.stream is None or not table.is_cuda or table.shape[0] == 0:
            _check_table(table)
            return
        self.stream.wait_stream(torch.cuda.current_stream(table.device))
        with torch.cuda.stream(self.stream):
            l2_prefetch(table)
        self.launches += 1

    def join(self) -> None:
        if self.launches:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self.launches = 0


if triton is not None:
    @triton.jit
    def _l2_prefetch_kernel(table, ROWS: tl.constexpr):
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)      # one row per lane
        addr = tl.load(table + 2 * r)
        size = tl.load(table + 2 * r + 1).to(tl.int32)
        tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
            [addr, size], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _l2_prefetch_lines_kernel(table, LINES: tl.constexpr):
        addr = tl.load(table + 2 * tl.program_id(0))
        size = tl.load(table + 2 * tl.program_id(0) + 1)
        lane = tl.arange(0, LINES).to(tl.int64) * 128
        for base in range(0, size, LINES * 128):        # one line per thread per pass
            off = base + lane
            a = addr + tl.where(off < size, off, 0)      # lanes past the row repeat its start
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                      [a], dtype=tl.int32, is_pure=False, pack=1)


__all__ = ["CHUNK_BYTES", "KIND", "KINDS", "ROWS_PER_PROGRAM", "SidePrefetch", "l2_prefetch",
           "prefetch_ranges", "prefetch_table", "table_bytes"]
