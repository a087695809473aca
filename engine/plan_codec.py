"""The wire format of the per-step control plane: a StepPlan (with its sampling rows) packed into
one small versioned frame for the ranks, and a StepResult frame back from the sampling rank.

Every frame is a fixed header then a payload:

    header  '<4sHHqI'  magic (b"RDPL" plan / b"RDRS" result), VERSION, kind, step_id, length

Plan kinds: PLAN (packed below), PICKLED (any other plan object, e.g. a speculative
SpecStepPlan, as pickle protocol 5), STOP (end the rank's step loop). A PLAN payload:

    '<BBIIIIII'  path code, flags (1: sampling rows), seqs S, tokens T, sample rows R,
                 changed tables N, table entries E, reset slots Z
    int32 seqs (S, 4) [slot, start, length, pos] · tokens (T,) · sample rows (R,) ·
    table slots (N,) · table lengths (N,) · table entries (E,) · resets (Z,)
    [flags & 1] fp32 temperature, top_p (R,) · int32 top_k (R,) · int64 seed (R,) ·
                int32 counter, logprobs (R,)

Result kinds: RESULT (packed below), PICKLED_RESULT (a SpecStepResult), ERROR (utf-8 text of
the rank's exception), HELLO (a rank announcing itself: int32 rank + the channel's secret).
A RESULT payload:

    '<IBH'  rows R, flags (1: logprob, 2: failed rows), top n
    int64 token ids (R,) · [1] fp32 logprob (R,) · int32 top ids (R, n) · fp32 top lp (R, n)
    · [2] utf-8 JSON list of (row, why)

Request ids travel in neither (ranks never need them); a decoded plan has request_ids = [].
"""
from __future__ import annotations

import itertools
import json
import pickle
import struct

import numpy as np

from raydecode.models.cache import SeqSlice, StepBatch
from raydecode.models.specialized import PATHS

from .sampling import SamplingRows, StepResult
from .scheduler import StepPlan

VERSION = 1
HEADER = struct.Struct("<4sHHqI")
PLAN_MAGIC, RESULT_MAGIC = b"RDPL", b"RDRS"
PLAN, PICKLED, STOP = 1, 2, 3
RESULT, PICKLED_RESULT, ERROR, HELLO = 1, 2, 3, 4
_COUNTS = struct.Struct("<BBIIIIII")
_RES = struct.Struct("<IBH")
_I32, _I64, _F32 = np.dtype("<i4"), np.dtype("<i8"), np.dtype("<f4")


class FrameError(ValueError):
    """A frame that is not ours or not this version; names what was found."""


def header(magic: bytes, kind: int, step_id: int, payload: bytes) -> bytes:
    return HEADER.pack(magic, VERSION, kind, step_id, len(payload)) + payload


def parse_header(buf: bytes | memoryview, magic: bytes) -> tuple[int, int, int]:
    """-> (kind, step_id, payload length); FrameError on a foreign magic or version."""
    m, ver, kind, step_id, n = HEADER.unpack_from(buf)
    if m != magic:
        raise FrameError(f"frame magic {m!r}; expected {magic!r}")
    if ver != VERSION:
        raise FrameError(f"frame version {ver}; this build speaks version {VERSION} (ranks and "
                         "coordinator must run the same raydecode)")
    return kind, step_id, n


# ---- plans ------------------------------------------------------------------------------------
def _pack(code: str, values) -> bytes:
    values = tuple(values)
    return struct.pack(f"<{len(values)}{code}", *values)


def encode_plan(plan: StepPlan) -> bytes:
    """A plan frame: PLAN for a plain StepPlan, PICKLED for subclasses (speculative plans)."""
    if type(plan) is not StepPlan:
        return header(PLAN_MAGIC, PICKLED, plan.step_id, pickle.dumps(plan, protocol=5))
    seqs = plan.batch.seqs
    tables = plan.block_tables
    entries = [b for blocks in tables.values() for b in blocks]
    rows = plan.sampling
    parts = [
        _COUNTS.pack(PATHS.index(plan.path), 1 if rows is not None else 0, len(seqs),
                     len(plan.tokens), len(plan.sample_rows), len(tables), len(entries),
                     len(plan.reset_slots)),
        _pack("i", itertools.chain.from_iterable(seqs)),     # SeqSlice: (slot, start, len, pos)
        _pack("i", plan.tokens), _pack("i", plan.sample_rows), _pack("i", tables),
        _pack("i", map(len, tables.values())), _pack("i", entries), _pack("i", plan.reset_slots),
    ]
    if rows is not None:
        if len(rows) != len(plan.sample_rows):
            raise ValueError(f"step {plan.step_id}: {len(rows)} sampling rows for "
                             f"{len(plan.sample_rows)} sample rows")
        parts += [_pack("f", rows.temperature), _pack("f", rows.top_p), _pack("i", rows.top_k),
                  _pack("q", rows.seed), _pack("i", rows.counter), _pack("i", rows.logprobs)]
    return header(PLAN_MAGIC, PLAN, plan.step_id, b"".join(parts))


def stop_frame() -> bytes:
    return header(PLAN_MAGIC, STOP, -1, b"")


def decode_plan(kind: int, step_id: int, payload: bytes | memoryview) -> StepPlan | None:
    """The plan of a frame (None for STOP)."""
    if kind == STOP:
        return None
    if kind == PICKLED:
        return pickle.loads(payload)
    if kind != PLAN:
        raise FrameError(f"plan frame kind {kind}; expected {PLAN}, {PICKLED} or {STOP}")
    path, flags, S, T, R, N, E, Z = _COUNTS.unpack_from(payload)
    at = _COUNTS.size

    def take(code: str, n: int) -> tuple:
        nonlocal at
        out = struct.unpack_from(f"<{n}{code}", payload, at)
        at += n * (8 if code == "q" else 4)
        return out

    flat = take("i", 4 * S)
    seqs = list(map(SeqSlice._make, zip(flat[0::4], flat[1::4], flat[2::4], flat[3::4])))
    tokens, sample_rows = list(take("i", T)), list(take("i", R))
    slots, lens, entries = take("i", N), take("i", N), take("i", E)
    resets = list(take("i", Z))
    tables, off = {}, 0
    for slot, n in zip(slots, lens):
        tables[slot] = list(entries[off:off + n])
        off += n
    rows = None
    if flags & 1:
        rows = SamplingRows(take("f", R), take("f", R), take("i", R), take("q", R),
                            take("i", R), take("i", R))
    return StepPlan(step_id=step_id, batch=StepBatch(seqs), tokens=tokens,
                    sample_rows=sample_rows, block_tables=tables, reset_slots=resets,
                    path=PATHS[path], sampling=rows)


# ---- results ----------------------------------------------------------------------------------
def encode_result(step_id: int, res) -> bytes:
    """A result frame of the sampling rank: RESULT for a StepResult, PICKLED_RESULT else."""
    if not isinstance(res, StepResult):
        return header(RESULT_MAGIC, PICKLED_RESULT, step_id, pickle.dumps(res, protocol=5))
    R = len(res.token_ids)
    n = len(res.top_ids[0]) if res.top_ids else 0
    failed = [(i, w) for i, w in enumerate(res.failed or []) if w is not None]
    flags = (1 if res.logprob is not None else 0) | (2 if failed else 0)
    parts = [_RES.pack(R, flags, n), np.array(res.token_ids, _I64).tobytes()]
    if res.logprob is not None:
        parts.append(np.array(res.logprob, _F32).tobytes())
        tops = res.top_ids if n else []
        parts.append(np.array([r if len(r) == n else [-1] * n for r in tops], _I32).tobytes())
        lps = res.top_logprobs if n else []
        parts.append(np.array([r if len(r) == n else [0.0] * n for r in lps], _F32).tobytes())
    if failed:
        parts.append(json.dumps(failed).encode())
    return header(RESULT_MAGIC, RESULT, step_id, b"".join(parts))


def error_frame(step_id: int, text: str) -> bytes:
    return header(RESULT_MAGIC, ERROR, step_id, text.encode("utf-8", "replace"))


def hello_frame(rank: int, secret: str) -> bytes:
    return header(RESULT_MAGIC, HELLO, -1, struct.pack("<i", rank) + secret.encode())


def decode_result(kind: int, payload: bytes | memoryview):
    """StepResult / SpecStepResult of a RESULT / PICKLED_RESULT frame."""
    if kind == PICKLED_RESULT:
        return pickle.loads(payload)
    if kind != RESULT:
        raise FrameError(f"result frame kind {kind}; expected {RESULT} or {PICKLED_RESULT}")
    R, flags, n = _RES.unpack_from(payload)
    at = _RES.size
    res = StepResult(np.frombuffer(payload, _I64, R, at).tolist())
    at += 8 * R
    if flags & 1:
        res.logprob = np.frombuffer(payload, _F32, R, at).tolist()
        at += 4 * R
        if n:
            res.top_ids = np.frombuffer(payload, _I32, R * n, at).reshape(R, n).tolist()
            at += 4 * R * n
            res.top_logprobs = np.frombuffer(payload, _F32, R * n, at).reshape(R, n).tolist()
            at += 4 * R * n
    if flags & 2:
        res.failed = [None] * R
        for i, why in json.loads(bytes(payload[at:]).decode()):
            res.failed[i] = why
    return res


__all__ = ["VERSION", "HEADER", "PLAN_MAGIC", "RESULT_MAGIC", "PLAN", "PICKLED", "STOP",
           "RESULT", "PICKLED_RESULT", "ERROR", "HELLO", "FrameError", "encode_plan",
           "decode_plan", "stop_frame", "encode_result", "decode_result", "error_frame",
           "hello_frame", "parse_header", "header"]
