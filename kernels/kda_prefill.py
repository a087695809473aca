"""KDA chunked prefill over a batch of variable-length sequences packed along T.

Sequence n holds tokens cu_seqlens[n] .. cu_seqlens[n+1] − 1; per token t and head, from
S = states[n] (dk, dv) fp32 (models/kda.py `kda_recurrent`):

    S ← Diag(e^{g_t}) S;   S ← S + β_t k_t (v_t − k_tᵀ S)ᵀ;   o_t = scale · Sᵀ q_t

-> o (T, h, dv) and the final states (N, h, dk, dv) fp32. q, k arrive L2-normalised, g is the
log-decay after the gate (≤ 0), β after the sigmoid: the op holds no norm, gate or sigmoid.

Dispatch (`kda_prefill`): fla-core's chunked KDA (`fla.ops.kda.chunk_kda`, Triton) when fla
imports and every tensor is on CUDA (`available`) and the inputs are not fp64; else
`kda_prefill_reference`, a loop over models/kda.py `kda_chunked` per sequence (the ground
truth; CPU, no fla, fp64).

What fla-core 0.6.0 requires (read from its source) and how the call meets it:
- layout [B, T, H, K] with B = 1 when `cu_seqlens` (N+1,) int64 on the device is given (the
  packed form; it raises otherwise); initial_state (N, H, K, V) must be fp32 (asserted); the
  final state comes back as a new (N, H, K, V) fp32 tensor, our (h, dk, dv) state layout.
- K ≤ 256 (asserted); v may have more heads than q/k (GVA), here they are equal.
- dtypes: any float q/k/v; its intermediates (per-chunk states, A⁻¹, w, u) are stored in k's
  dtype and o comes back in q's dtype. We pass fp32 (bf16/fp16 inputs are upcast): on sm_80+
  Triton runs fp32 `tl.dot` as TF32 by default (and the intra-chunk solve asks for TF32
  explicitly), so o and the final state would sit ≈ 4e-4-1e-3 (‖·‖ relative) from the fp32
  reference; a rank runs them at RAYDECODE_KDA_PRECISION, bf16x3 by default (three bf16
  products per fp32 one: 6.1e-6 at 8k tokens on the H100, and no slower there than TF32;
  `apply_precision`). bf16 inputs would in addition round the per-chunk states to bf16.
- flags: use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel off (ours
  are applied before: our L2 norm is x·rsqrt(Σx² + 1e-6)); scale passed explicitly.
- the chunk index: chunk_kda builds it from `cu_seqlens_cpu` and copies it to the device from
  pageable memory, which waits for the stream (a host sync per new batch composition). We
  call the forward under it, `fla.ops.kda.chunk_fwd.chunk_kda_fwd` (what chunk_kda runs for
  these flags: no norm, gate or sigmoid in the kernel, no backward kept), with the chunk index
  and chunk offsets built on the host and sent through pinned memory (`build_varlen_index`,
  memoized per batch composition).
- chunk_kda's dispatcher would prefer a `flash_kda` (CUTLASS) or TileLang backend when those
  packages are installed; FlashKDA accepts only bf16 with every *_in_kernel flag on, so our
  fp32 call would run the Triton kernels anyway, which chunk_kda_fwd runs directly.

Compiles (the request path must not JIT after warm-up): every Triton kernel of fla's forward
(chunk-local cumsum, token-parallel intra, inter + solve, w/u recompute, state recurrence,
output) marks T (and N) `do_not_specialize`, no autotune key holds T or N (keys: H, HV, K, V,
the block sizes BT/BC/BK/BV/NC, B = 1, IS_VARLEN, plus the tensors' dtypes, which Triton's
autotuner adds), and every block size depends on K, V and the chunk size (64) only. So one
call compiles and autotunes the whole forward for a (heads, head_dim) on a device, and every
later token count, sequence count and length mix reuses it: `warmup` makes that call. The
autotune benchmarks at the warm-up's shape (use a representative token count, the step's
prefill budget); its choice is cached on disk (fla's FLA_CACHE_RESULTS, on by default:
Triton's autotune cache under TRITON_CACHE_DIR), so a restarted rank does not re-benchmark.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import torch

from raydecode.kernels import settings

MAX_HEAD_DIM = 256          # fla's chunk_kda asserts K ≤ 256
CHUNK = 64                  # fla's chunk size (its default; 32 or 64 allowed)
WARMUP_TOKENS = 256         # engine/scheduler.py's default step budget (max_num_batched_tokens)


PRECISIONS = settings.KDA_PRECISIONS                   # Triton's fp32 dot input precisions
_applied: list[str] = []                               # the precision this process runs


def apply_precision(precision: str) -> str:
    """Set the fp32 dot precision of fla's chunked KDA for this process, before its first
    kernel compiles (`_chunk_kda` calls it with RAYDECODE_KDA_PRECISION on first use):
    - Triton's default input precision of fp32 `tl.dot`s without an explicit one
      (`triton.knobs.language.fp32_default`, what TRITON_F32_DEFAULT sets; fla 0.6.0 sets it to
      'ieee' itself on pre-Ampere NVIDIA cards): every fp32 dot of fla's forward but one;
    - fla's intra-chunk solve, which asks for TF32 explicitly through a module constant
      (`fla.ops.kda.chunk_intra.SOLVE_TRIL_DOT_PRECISION`), read when its kernel compiles.
    Process-wide: our own Triton kernels dot bf16 / fp16 operands or name their fp32 dots'
    precision, so the knob reaches fla's kernels only. 'tf32' leaves both as fla has them.
    A second call with another precision raises (a kernel compiled under the first would
    keep it: Triton's in-process cache does not key on the knob). -> the precision set."""
    if precision not in PRECISIONS:
        raise ValueError(f"KDA prefill precision {precision!r}; accepted: "
                         f"{', '.join(PRECISIONS)}")
    if _applied:
        if _applied[0] != precision:
            raise RuntimeError(f"KDA prefill precision {precision!r} asked after "
                               f"{_applied[0]!r} was set in this process: fla's kernels may "
                               "have compiled under it (one precision per process)")
        return precision
    if precision != "tf32":
        import triton
        import triton.language as tl
        from fla.ops.kda import chunk_intra

        triton.knobs.language.fp32_default = precision
        chunk_intra.SOLVE_TRIL_DOT_PRECISION = tl.constexpr(precision)
    _applied.append(precision)
    return precision


def precision() -> str | None:
    """The precision this process's fla KDA runs at, None before fla's first use."""
    return _applied[0] if _applied else None


# fla's state recurrence (`chunk_gated_delta_rule_fwd_kernel_h_blockdim64`) runs one program
# per (sequence, head, BV columns of the (dk, dv) state), serial over the sequence's 64-token
# chunks; fla autotunes BV over 32 and 64. A prompt step of one sequence at K3 TP16 (6 heads
# per rank) is then 24 programs on 132 SMs: half of fla's forward time (0.49 of 0.97 ms per
# 8,192-token layer on the H100). A state column's update reads only that column (v_new = u −
# w·S and S's rank-64 update act column by column), so BV 16 is the same arithmetic in twice
# the programs: bit-equal outputs, the recurrence 0.49 → 0.36 ms in the same run
# (docs/perf-log/prefill.md, fifteenth session). `widen_recurrence` adds BV 16 at each of
# fla's (warps, stages) to the autotuner's candidates; the autotuner keeps the fastest, so a
# card where 32 wins keeps 32. RAYDECODE_KDA_RECURRENCE_BV16=0 leaves fla's candidates as
# they are (an A/B, or an operator's way back); either way it costs only the warm-up's
# autotune (6 more configs of this one kernel on NVIDIA: fla tries warps 2, 4 × stages 2-4).
RECURRENCE_EXTRA_BV = (16,)


def widen_recurrence(tuner) -> int:
    """Add a config with each RECURRENCE_EXTRA_BV beside every BV 32 config of fla's state
    recurrence autotuner `tuner` (same warps and stages), before it first tunes. Idempotent.
    -> the number of configs added."""
    import triton
    have = {(c.kwargs.get("BV"), c.num_warps, c.num_stages) for c in tuner.configs}
    extra = []
    for c in tuner.configs:
        if c.kwargs.get("BV") != 32:
            continue
        for bv in RECURRENCE_EXTRA_BV:
            if (bv, c.num_warps, c.num_stages) not in have:
                have.add((bv, c.num_warps, c.num_stages))
                extra.append(triton.Config({**c.kwargs, "BV": bv}, num_warps=c.num_warps,
                                           num_stages=c.num_stages))
    tuner.configs = list(tuner.configs) + extra
    return len(extra)


def _recurrence_tuner():
    """fla-core 0.6.0's autotuner of the state recurrence (under its heuristics wrapper), or
    None where a later fla moved or renamed it."""
    try:
        from fla.ops.common import chunk_delta_h
        fn = chunk_delta_h.chunk_gated_delta_rule_fwd_kernel_h_blockdim64
    except Exception:
        return None
    for _ in range(4):
        if hasattr(fn, "configs") and hasattr(fn, "cache"):
            return fn
        fn = getattr(fn, "fn", None)
    return None


@functools.cache
def _chunk_kda():
    """fla's chunk_kda, or None where fla-core is not installed or does not import (CPU-only
    installs; a host without a usable Triton). Imported on first use: fla's import queries the
    device, which processes that never run the op (the coordinator, CPU ranks) must not do.
    The process's RAYDECODE_KDA_PRECISION is applied here, before any fla kernel compiles,
    and the state recurrence's BV candidates widened (`widen_recurrence`, unless
    RAYDECODE_KDA_RECURRENCE_BV16=0)."""
    try:
        from fla.ops.kda import chunk_kda
    except Exception:  # ImportError, or a broken install / no Triton driver
        return None
    apply_precision(settings.kda_precision())
    tuner = _recurrence_tuner() if settings.kda_recurrence_bv16() else None
    if tuner is not None:
        widen_recurrence(tuner)
    return chunk_kda


def available(*ts: torch.Tensor) -> bool:
    """fla's kernel can run on these tensors: all on CUDA and fla-core imports."""
    return bool(ts) and all(t.is_cuda for t in ts) and _chunk_kda() is not None


def _use_fla(q, k, v, g, beta, states) -> bool:
    return (q.dtype != torch.float64 and q.shape[-1] <= MAX_HEAD_DIM
            and available(q, k, v, g, beta, states))


@functools.cache
def _chunk_kda_fwd():
    """fla's forward pass under chunk_kda (`fla.ops.kda.chunk_fwd.chunk_kda_fwd`, fla-core
    0.6.0): it takes the chunk index the public entry point builds with a pageable host-to-
    device copy (a stream sync, once per new batch composition), so `_fla_prefill` passes one
    built on the host and copied through pinned memory. None where fla does not import."""
    if _chunk_kda() is None:
        return None
    try:
        from fla.ops.kda.chunk_fwd import chunk_kda_fwd
    except Exception:  # a later fla that moved it: the public entry point still works
        return None
    return chunk_kda_fwd


def build_varlen_index(bounds: tuple[int, ...], device: torch.device
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cu_seqlens host, cu_seqlens, chunk_indices, chunk_offsets) for one batch composition,
    the last three on the device, int64, built on the host and sent as one pinned
    non-blocking copy: no host sync. chunk_indices (NT, 2) holds (sequence, chunk within it)
    per CHUNK-token chunk, chunk_offsets (N+1,) each sequence's first chunk — the layout fla's
    kernels read (`fla.ops.utils.index` prepare_chunk_indices / prepare_chunk_offsets). Every
    KDA layer of a step passes the same tensors (memoized on the bounds), so fla's
    identity-keyed caches hit too."""
    host = torch.tensor(bounds, dtype=torch.int64)
    chunks = [-(-(b - a) // CHUNK) for a, b in zip(bounds, bounds[1:])]
    index = [(n, i) for n, c in enumerate(chunks) for i in range(c)]
    offsets = [0]
    for c in chunks:
        offsets.append(offsets[-1] + c)
    flat = torch.tensor(list(bounds) + [x for row in index for x in row] + offsets,
                        dtype=torch.int64)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:
        flat = flat.to(device)
    n1, nt = len(bounds), len(index)
    return (host, flat[:n1], flat[n1:n1 + 2 * nt].view(nt, 2),
            flat[n1 + 2 * nt:])


_varlen_index = functools.lru_cache(maxsize=64)(build_varlen_index)


def kda_prefill_reference(q, k, v, g, beta, scale: float, states: torch.Tensor,
                          cu_seqlens: torch.Tensor, chunk_size: int = CHUNK
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The op in PyTorch: models/kda.py `kda_chunked` per sequence. -> (o (T, h, dv),
    final states (N, h, dk, dv)), fp32 (fp64 for fp64 inputs); `states` is not modified."""
    from raydecode.models.kda import kda_chunked     # models/ imports kernels/: not at load
    bounds = cu_seqlens.tolist()
    dt = torch.promote_types(v.dtype, torch.float32)
    o = v.new_empty(v.shape, dtype=dt)
    finals = []
    for n in range(len(bounds) - 1):
        sl = slice(bounds[n], bounds[n + 1])
        o[sl], S = kda_chunked(q[sl], k[sl], v[sl], g[sl], beta[sl], scale, states[n],
                               chunk_size)
        finals.append(S)
    return o, torch.stack(finals)


def _fla_prefill(q, k, v, g, beta, scale: float, states: torch.Tensor,
                 cu_seqlens: torch.Tensor, index: tuple | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's chunked KDA forward on the packed batch (module docstring): fp32 in, o (T, h, dv)
    fp32 and the final states (N, h, dk, dv) fp32 out. No host sync, no compile after
    `warmup`. `index`: the caller's own `build_varlen_index` tuple instead of the memo's."""
    host, dev, chunk_indices, chunk_offsets = index if index is not None else \
        _varlen_index(tuple(cu_seqlens.tolist()), q.device)
    # contiguous, on the tensors' device: what chunk_kda's input guard does, which the forward
    # underneath does not (its kernels index dense [1, T, H, K] layouts, and Triton launches on
    # the current device)
    f32 = [t.float().contiguous().unsqueeze(0) for t in (q, k, v, g, beta)]    # (1, T, ...)
    s0 = states.float().contiguous()
    fwd = _chunk_kda_fwd()
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        if fwd is None:
            o, final = _chunk_kda()(*f32, scale=scale, initial_state=s0,
                                    output_final_state=True, cu_seqlens=dev,
                                    cu_seqlens_cpu=host)
            return o[0], final
        out = fwd(*f32, scale=scale, initial_state=s0, output_final_state=True,
                  cu_seqlens=dev, cu_seqlens_cpu=host, chunk_indices=chunk_indices,
                  chunk_size=CHUNK, chunk_offsets=chunk_offsets)
    return out[0][0], out[1]


def _check(q, k, v, g, beta, scale, states, cu_seqlens) -> None:
    """Shapes, dtypes and devices of the op's inputs; ValueError naming the offending one."""
    if q.dim() != 3:
        raise ValueError(f"q of shape {tuple(q.shape)}: expected (T, h, dk)")
    T, h, dk = q.shape
    if v.dim() != 3 or v.shape[:2] != (T, h):
        raise ValueError(f"v of shape {tuple(v.shape)}: expected (T, h, dv) = ({T}, {h}, dv)")
    dv = v.shape[2]
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 \
            or cu_seqlens.dtype != torch.int64 or cu_seqlens.device.type != "cpu":
        what = (f"shape {tuple(cu_seqlens.shape)} dtype {cu_seqlens.dtype} on "
                f"{cu_seqlens.device}" if isinstance(cu_seqlens, torch.Tensor)
                else type(cu_seqlens).__name__)
        raise ValueError(f"cu_seqlens {what}: expected a 1-D int64 CPU tensor (N+1,) of "
                         "host values (reading a device tensor would sync)")
    N = cu_seqlens.shape[0] - 1
    want = {"k": (k, (T, h, dk)), "g": (g, (T, h, dk)), "beta": (beta, (T, h)),
            "states": (states, (N, h, dk, dv))}
    for name, (x, shape) in want.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} of shape {tuple(x.shape)}: expected {shape} (T={T}, "
                             f"h={h}, dk={dk}, dv={dv}, N={N} sequences)")
    for name, x in {"q": q, "k": k, "v": v, "g": g, "beta": beta, "states": states}.items():
        if not x.dtype.is_floating_point:
            raise ValueError(f"{name} dtype {x.dtype}: expected a floating dtype")
        if x.device != q.device:
            raise ValueError(f"{name} on {x.device}: expected q's device {q.device}")
    if states.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"states dtype {states.dtype}: expected float32 (the recurrent "
                         "state's dtype; float64 for a float64 reference run)")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        raise ValueError(f"scale={scale!r}: expected a positive float (head_dim ** -0.5)")
    bounds = cu_seqlens.tolist()
    if N < 1 or bounds[0] != 0 or bounds[-1] != T \
            or any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens {bounds}: expected 0 = c_0 < c_1 < … < c_N = T = {T} "
                         "(N ≥ 1 sequences of at least one token each)")


def kda_prefill(q, k, v, g, beta, scale: float, states: torch.Tensor,
                cu_seqlens: torch.Tensor, index: tuple | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The op (module docstring). q, k, g (T, h, dk); v (T, h, dv); beta (T, h); states
    (N, h, dk, dv) fp32 initial states (not modified); cu_seqlens (N+1,) int64 on the host.
    -> (o (T, h, dv), final states (N, h, dk, dv)), fp32 (fp64 for fp64 inputs: reference).

    `index` (fla's path): `build_varlen_index(cu_seqlens, device)` of the caller's own, used
    instead of the memoized one. A CUDA graph captured around this op reads the index at
    fixed addresses, and fla derives and caches tensors keyed by the identity of what it is
    handed: a capturing caller passes an index nothing eager has used (held for the graph's
    life), so fla computes those inside the graph instead of handing it cached tensors that a
    later eager step may drop."""
    _check(q, k, v, g, beta, scale, states, cu_seqlens)
    if _use_fla(q, k, v, g, beta, states):
        return _fla_prefill(q, k, v, g, beta, float(scale), states, cu_seqlens, index)
    return kda_prefill_reference(q, k, v, g, beta, float(scale), states, cu_seqlens)


@torch.inference_mode()
def warmup(heads: int, head_dim: int, device, tokens: Sequence[int] = (WARMUP_TOKENS,)) -> int:
    """Compile and autotune fla's forward for `heads` heads of `head_dim` on `device` before
    the first request: one call per entry of `tokens` (a batch of two sequences summing to
    it; one entry suffices, T being no compile or autotune key: module docstring). Fresh
    inputs on the device, nothing kept. -> the number of calls made (0 where fla cannot run
    on `device`)."""
    if any(T < 2 for T in tokens):
        raise ValueError(f"tokens {list(tokens)}: each warm-up call needs T ≥ 2 (two "
                         "sequences)")
    device = torch.device(device)
    if head_dim > MAX_HEAD_DIM or not available(torch.empty(0, device=device)):
        return 0
    gen = torch.Generator(device=device).manual_seed(0)

    def rn(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    h, d = heads, head_dim
    for T in tokens:
        q, k = rn(T, h, d), rn(T, h, d)
        q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
        g, beta = -5.0 * torch.sigmoid(rn(T, h, d)), torch.sigmoid(rn(T, h))
        cu = torch.tensor([0, T - T // 2, T], dtype=torch.int64)
        kda_prefill(q, k, rn(T, h, d), g, beta, d ** -0.5, 0.05 * rn(2, h, d, d), cu)
    return len(tokens)


__all__ = ["available", "apply_precision", "kda_prefill", "kda_prefill_reference", "precision",
           "warmup", "MAX_HEAD_DIM", "PRECISIONS", "WARMUP_TOKENS"]
