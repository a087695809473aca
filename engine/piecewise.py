"""Piecewise CUDA graphs of the stock step: prefill chunks, mixed steps and stock decode steps
of up to a token cap run as captured graphs of their per-token work, with the attention cores
run eagerly between the graphs (models/pieces.py says which work is which).

Why: an eager stock step launches ~110 kernels per layer from Python, so a step of 1 to 2,048
tokens costs 28-38 ms on the host for 8 K3 layers whatever its device time (H200, TP16,
bench/results/prefill-h200-2026-12-04-c-swap128.json: the steady bucket table), which sets
the TPOT of streams decoding beside a prefill and the TTFT of every short prompt. vLLM runs
its stock path the same way (piecewise graphs split at attention).

One `StockGraph` per token bucket C (engine/step_graph.py `prefill_bucket`), built at the
rank's warm-up on the scratch rows:
1. warm: the bucket's step runs eagerly with `caches.pieces` a `Pieces` in "warm" mode: every
   core runs (Triton JIT, autotune, cuBLAS heuristics happen here) and its signature — the
   shapes and dtypes of its tensors and of its output — is recorded;
2. capture: the same step again with `Pieces` in "capture" mode: the per-token work from the
   start (or a core) to the next core is captured as one graph; at a core, its tensors are
   copied into shared input buffers (inside the graph that made them), the graph ends, the
   shared output buffer of the core's signature is handed to the code after the core, and the
   next graph begins. No core runs during the capture: its output buffer holds zeros.
3. replay (`StockGraph.replay(batch)`): graph 0, core 0 on the step's real batch writing its
   output buffer, graph 1, core 1, …, the last graph; the step's hidden state is the tensor
   the last graph wrote.

Buffers: one per (role, tensor index, trailing shape, dtype), sized for the largest bucket
captured (capture runs largest first) and shared by every core of that signature and every
bucket (a view of the first C rows): graph k writes input buffer b, core k reads it before
graph k+1 runs, and the next core of the signature is fed only by a later graph. So the
tensors a graph makes for its core are not held across graphs (memory of one bucket's cores,
not of every layer's), and the captured graphs share the runner's memory pool with the decode
graphs (one step replays at a time).

Each bucket is checked once at the build (`check_replay`): a replay against an eager step
with the pad's attention skipped, at every core's inputs and the hidden state.

Single-sequence graphs (`SingleSeq`, RAYDECODE_STOCK_SINGLE): for a step of one sequence the
cores that have an `inline` form (the KDA layers: models/kda.py `_core_single`) read the
sequence's slot, start and length from device tensors and stay inside the graph; only the
others (MLA) split it. The runner writes those tensors before each replay.

Every replay must see the per-token work of the capture: the graphs replay fixed kernels on
fixed addresses, so nothing between two cores may depend on the batch's layout (it reads only
the token count C) — the contract models/pieces.py states, checked on the CPU by replaying
recorded operations (tests/_graph_emulator.py) against the eager step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch


class GraphBackend(Protocol):
    """Captures one piece at a time: begin() … end() -> an object with replay(); abort() ends
    a capture left open by an exception."""

    def begin(self) -> None: ...
    def end(self): ...
    def abort(self) -> None: ...


class CudaPieces:
    """CUDA graphs captured into `pool` on the current stream (the caller holds a side stream:
    capture never runs on the default stream), errors local to the capturing thread.

    Every graph begun here stays referenced (`kept`), also those of a bucket that failed its
    capture or its check: the caching allocator counts a shared pool's users by its live
    graphs, and once the count drops to zero (the failed bucket's graphs freed) a later
    capture into the same pool aborts the process-wide allocator check ("use_count > 0",
    CUDACachingAllocator.cpp) — the first H100 round lost every bucket after the first
    failure so. Their memory is the pool's, which the other graphs share anyway."""

    def __init__(self, pool):
        self.pool = pool
        self._open: torch.cuda.CUDAGraph | None = None
        self.kept: list[torch.cuda.CUDAGraph] = []

    def begin(self) -> None:
        g = torch.cuda.CUDAGraph()
        self.kept.append(g)
        g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        self._open = g

    def end(self) -> torch.cuda.CUDAGraph:
        g, self._open = self._open, None
        g.capture_end()
        return g

    def abort(self) -> None:
        g, self._open = self._open, None
        if g is not None:
            try:
                g.capture_end()
            except Exception:  # noqa: BLE001 — the capture already failed; drop it
                pass


@dataclass(frozen=True)
class Signature:
    """A core's tensors and output: ((trailing shape, dtype) per tensor, (trailing shape,
    dtype) of the output); the leading dimension is the step's token count."""
    ins: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    out: tuple[tuple[int, ...], torch.dtype]


def _meta(t: torch.Tensor, tokens: int, what: str) -> tuple[tuple[int, ...], torch.dtype]:
    if t.dim() < 1 or t.shape[0] != tokens:
        raise RuntimeError(f"{what} of shape {tuple(t.shape)}: an attention core's tensors "
                           f"and output are (T, ...) with T = {tokens}, the step's tokens "
                           "(models/pieces.py)")
    return tuple(t.shape[1:]), t.dtype


class Buffers:
    """The shared core buffers (module docstring): `get(key, rows)` -> the first `rows` rows of
    the (capacity, *shape) buffer of `key`, allocated (zeros) on first use with `rows` as its
    capacity. A later request for more rows than the capacity raises: buckets are captured
    largest first."""

    def __init__(self, device):
        self.device = torch.device(device)
        self._bufs: dict[tuple, torch.Tensor] = {}

    def get(self, key: tuple, shape: tuple[int, ...], dtype: torch.dtype,
            rows: int) -> torch.Tensor:
        k = (key, shape, dtype)
        buf = self._bufs.get(k)
        if buf is None:
            buf = self._bufs[k] = torch.zeros(rows, *shape, dtype=dtype, device=self.device)
        if buf.shape[0] < rows:
            raise RuntimeError(f"core buffer {key} holds {buf.shape[0]} rows, a bucket of "
                               f"{rows} asks for more: capture the largest bucket first")
        return buf[:rows]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


class SingleSeq:
    """The device tensors a single-sequence stock graph reads instead of the batch (models/
    pieces.py `attention_core`'s `inline` cores): `slot` (1,) int64, the real sequence's KDA
    slot; `cont` (1,) bool, whether it continues (pos > 0); `n` (1,) int64, its token count
    (rows [0, n) of the bucket; the scratch pad after). `set` writes them before a replay (a
    pinned non-blocking copy on CUDA: no host sync). `index(T)`: fla's varlen index of one
    T-row sequence for an inline core (kernels/kda_prefill.py `build_varlen_index`): while a
    graph is captured (`capturing`) the bucket's own, built once and held for the graph's
    life; otherwise a fresh one each call, so nothing fla cached for an eager pass is what
    the capture reads."""

    mixed = False               # MixedSeq: a prompt chunk beside one-token continuations

    def __init__(self, device):
        self.device = torch.device(device)
        self._dev = torch.zeros(3, dtype=torch.int64, device=self.device)
        self.slot, self.n = self._dev[0:1], self._dev[2:3]
        self.cont = torch.zeros(1, dtype=torch.bool, device=self.device)
        self.capturing = False
        self._held: dict[int, tuple] = {}

    def index(self, T: int) -> tuple:
        from raydecode.kernels.kda_prefill import build_varlen_index
        if not self.capturing:
            return build_varlen_index((0, T), self.device)
        if T not in self._held:
            self._held[T] = build_varlen_index((0, T), self.device)
        return self._held[T]

    def set(self, slot: int, pos: int, n: int) -> None:
        self._write(self._dev, [int(slot), int(pos > 0), int(n)])

    def _write(self, dev: torch.Tensor, values: list[int]) -> None:
        """`values` into `dev` (starting with [slot, cont, n]) in one copy, then `cont`."""
        host = torch.tensor(values, dtype=torch.int64)
        if self.device.type == "cuda":     # the host allocator keeps the block until copied
            dev.copy_(host.pin_memory(), non_blocking=True)
        else:
            dev.copy_(host)
        torch.ne(self._dev[1:2], 0, out=self.cont)


class MixedSeq(SingleSeq):
    """The device tensors a mixed-step stock graph reads (RAYDECODE_STOCK_MIXED): one prompt
    chunk (`slot`, `cont`, `n` as `SingleSeq`, and `start`, its first row in the bucket) and
    the step's one-token continuations as fixed-length lists of `spare` = bucket − 1 entries:
    `dec_rows`, `dec_slots` and `dec_count` (1,), the live entries first; the others name the
    chunk's first row and the scratch slot (kernels/kda_decode.py `kda_decode_rows` with
    `count` skips them). models/kda.py `_core_single` gathers the chunk's rows to the front
    (rows start … start + n − 1, then the rest, β = g = 0 past n), runs the single-sequence
    core on them, scatters its rows back, and steps the continuations with the decode-row
    kernel: every KDA core of a mixed step inside the graph. One pinned copy per replay (one
    device buffer holds SingleSeq's tensors and these)."""

    mixed = True

    def __init__(self, device, bucket: int):
        super().__init__(device)
        self.spare = max(1, bucket - 1)
        # one buffer: SingleSeq's [slot, cont, n], then start, count, rows, slots (one copy)
        self._all = torch.zeros(5 + 2 * self.spare, dtype=torch.int64, device=self.device)
        self._dev = self._all[0:3]
        self.slot, self.n = self._dev[0:1], self._dev[2:3]
        self.start, self.dec_count = self._all[3:4], self._all[4:5]
        self.dec_rows = self._all[5:5 + self.spare]
        self.dec_slots = self._all[5 + self.spare:]

    def set_mixed(self, chunk, decodes, pad_slot: int) -> None:
        """The step's prompt chunk (a SeqSlice) and its one-token continuations (SeqSlices);
        the spare entries name the chunk's first row and `pad_slot` (the scratch slot)."""
        d = len(decodes)
        if not 0 <= d <= self.spare:
            raise ValueError(f"{d} decode rows in a mixed graph of {self.spare} entries")
        rows = [s.start for s in decodes] + [chunk.start] * (self.spare - d)
        slots = [s.slot for s in decodes] + [int(pad_slot)] * (self.spare - d)
        self._write(self._all, [chunk.slot, int(chunk.pos > 0), chunk.length, chunk.start, d]
                    + rows + slots)


@dataclass
class _Core:
    fn: Callable[..., torch.Tensor]
    caches: object
    ins: list[torch.Tensor]
    out: torch.Tensor


class Pieces:
    """What `caches.pieces` is while a bucket's step is warmed ("warm") or captured
    ("capture"): models/pieces.py `attention_core` calls `core`."""

    def __init__(self, mode: str, tokens: int, *, signatures: list[Signature] | None = None,
                 buffers: Buffers | None = None, backend: GraphBackend | None = None,
                 keep_inputs: bool = False, single: SingleSeq | None = None):
        if mode not in ("warm", "capture"):
            raise ValueError(f"mode {mode!r}; accepted: warm, capture")
        if mode == "capture" and (signatures is None or buffers is None or backend is None):
            raise ValueError("capture needs the warm pass's signatures, buffers and a backend")
        self.mode, self.tokens = mode, tokens
        self.signatures: list[Signature] = [] if signatures is None else signatures
        self.buffers, self.backend = buffers, backend
        self.cores: list[_Core] = []
        self.graphs: list = []
        self.keep_inputs = keep_inputs      # warm: each core's tensors copied (check_replay)
        self.single = single                # set: cores with an `inline` form stay inside

    def core(self, fn, batch, caches, *tensors: torch.Tensor) -> torch.Tensor:
        k, C = len(self.cores), self.tokens
        if self.mode == "warm":
            out = fn(batch, caches, *tensors)
            ins = tuple(_meta(t, C, f"core {k} tensor {i}") for i, t in enumerate(tensors))
            self.signatures.append(Signature(ins, _meta(out, C, f"core {k} output")))
            kept = [t.clone() for t in tensors] if self.keep_inputs else []
            self.cores.append(_Core(fn, caches, kept, out))
            return out
        if k >= len(self.signatures):
            raise RuntimeError(f"core {k} met in the capture; the warm pass met "
                               f"{len(self.signatures)}: the step's cores must not depend on "
                               "the batch")
        sig = self.signatures[k]
        got = tuple(_meta(t, C, f"core {k} tensor {i}") for i, t in enumerate(tensors))
        if got != sig.ins:
            raise RuntimeError(f"core {k} takes {got} in the capture, {sig.ins} in the warm "
                               "pass")
        ins = [self.buffers.get(("in", i), shape, dtype, C)
               for i, (shape, dtype) in enumerate(sig.ins)]
        for buf, t in zip(ins, tensors):
            buf.copy_(t)                                     # captured: the graph feeds it
        self.graphs.append(self.backend.end())
        out = self.buffers.get(("out",), *sig.out, C)        # read by the next graph
        self.cores.append(_Core(fn, caches, ins, out))
        self.backend.begin()
        return out


@dataclass
class StockGraph:
    """One token bucket's captured stock step (module docstring)."""
    bucket: int
    tokens: torch.Tensor                 # (C,) int64, the step's tokens (pads after the real)
    graphs: list                         # len(cores) + 1 pieces
    cores: list[_Core]
    hidden: torch.Tensor                 # (C, H), written by the last graph
    replays: int = field(default=0)
    single: SingleSeq | None = None      # set: a single-sequence graph (its inline cores)

    def replay(self, batch, observe: Callable[[int, list[torch.Tensor]], None] | None = None
               ) -> torch.Tensor:
        """Run the step on `batch` (C tokens in `tokens`): graph, core, …, graph. -> hidden
        (C, H), the graphs' buffer (the next replay of any bucket may rewrite it). `observe(k,
        inputs)`: called with core k's input buffers as graph k left them (check_replay)."""
        for k, (graph, c) in enumerate(zip(self.graphs, self.cores)):
            graph.replay()
            if observe is not None:
                observe(k, c.ins)
            c.out.copy_(c.fn(batch, c.caches, *c.ins))
        self.graphs[-1].replay()
        self.replays += 1
        return self.hidden


def capture_stock_graph(forward: Callable[[], torch.Tensor], caches, bucket: int,
                        tokens: torch.Tensor, buffers: Buffers, backend: GraphBackend,
                        single: SingleSeq | None = None) -> tuple[torch.Tensor, StockGraph]:
    """Warm and capture one bucket (module docstring, steps 1-2). `forward()` runs the model
    on `tokens` (C,) and the bucket's batch with `caches`; the caller provides the stream
    (CUDA: a side stream). With `single` (its tensors set by the caller): the single-sequence
    graph, cores with an inline form captured inside it. -> (the warm pass's hidden (C, H),
    the StockGraph). Raises what the warm pass or the capture raised, the capture closed and
    `caches.pieces` cleared."""
    warm = Pieces("warm", bucket, single=single)
    caches.pieces = warm
    try:
        ref = forward()
    finally:
        caches.pieces = None
    if tokens.is_cuda:
        torch.cuda.synchronize(tokens.device)
    cap = Pieces("capture", bucket, signatures=warm.signatures, buffers=buffers,
                 backend=backend, single=single)
    # every buffer of the bucket before the first graph begins: no allocation of the
    # runner's own between pieces while a capture is open
    for sig in warm.signatures:
        for i, (shape, dtype) in enumerate(sig.ins):
            buffers.get(("in", i), shape, dtype, bucket)
        buffers.get(("out",), *sig.out, bucket)
    caches.pieces = cap
    if single is not None:
        single.capturing = True
    try:
        backend.begin()
        hidden = forward()
        cap.graphs.append(backend.end())
    except BaseException:
        backend.abort()
        raise
    finally:
        caches.pieces = None
        if single is not None:
            single.capturing = False
    if len(cap.cores) != len(warm.cores):
        raise RuntimeError(f"bucket {bucket}: the capture met {len(cap.cores)} cores, the "
                           f"warm pass {len(warm.cores)}")
    return ref, StockGraph(bucket, tokens, cap.graphs, cap.cores, hidden, single=single)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got − want| / max |want| (fp32; NaN where got is not finite)."""
    got, want = got.float(), want.float()
    if not bool(torch.isfinite(got).all()):
        return math.nan
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def check_replay(forward: Callable[[], torch.Tensor], caches, sg: StockGraph,
                 batch) -> tuple[float, str]:
    """How far a replay of `sg` on `batch` is from the eager step: an eager pass of `forward()`
    keeping every core's tensors, then the replay, compared at each core's inputs (what each
    graph made for its core) and at the hidden state. -> (the largest relative max-abs
    difference, NaN if a replay tensor is not finite; where it is).

    The step must be deterministic for this to mean anything: the caller runs it with the pad
    sequence's attention skipped. (At the build the scratch sequence's MLA rows all map to one
    scratch block, so a bucket above one block writes several rows per cache row at once and
    its attention reads whichever write won: two eager passes of bucket 2,048 differ by 0.7
    on the H100, while every graph's output equals the eager one's bit for bit.)"""
    rec = Pieces("warm", sg.bucket, keep_inputs=True, single=sg.single)
    caches.pieces = rec
    try:
        want = forward().clone()
    finally:
        caches.pieces = None
    if len(rec.cores) != len(sg.cores):
        return math.inf, f"the eager step met {len(rec.cores)} cores, the graph {len(sg.cores)}"
    errs: list[tuple[float, str]] = []

    def observe(k: int, ins: list[torch.Tensor]) -> None:
        for i, (a, b) in enumerate(zip(ins, rec.cores[k].ins)):
            errs.append((_rel(a, b), f"core {k} input {i}"))

    got = sg.replay(batch, observe)
    errs.append((_rel(got, want), "the hidden state"))
    bad = [e for e in errs if math.isnan(e[0])]
    return bad[0] if bad else max(errs, key=lambda e: e[0])


__all__ = ["Buffers", "CudaPieces", "GraphBackend", "MixedSeq", "Pieces", "Signature",
           "SingleSeq", "StockGraph", "capture_stock_graph", "check_replay"]
