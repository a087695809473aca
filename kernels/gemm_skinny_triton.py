"""Skinny GEMM  y (M, N) = x (M, K) · Wᵀ  for decode batches 1 ≤ M ≤ 64, on tensor cores (Triton).

W (N, K) bf16 row-major (nn.Linear layout), x (M, K) bf16, y (M, N) bf16 or fp32 (the fp32
accumulator unrounded, for `linear(..., out_dtype=torch.float32)`). The CuTe GEMV
(kernels/gemv.py) serves M ≤ 2; past that it is FMA-bound on CUDA cores (M FMAs per weight
element), and cuBLAS reads these per-rank matrices at 0.2–0.6 of HBM. Here the math is a
tensor-core dot, so M up to 64 costs about the issue of M = 1, and the kernel is a weight
stream:

    program (nb, ks): W rows [nb·BN, nb·BN + BN), K slice [ks·K/KS, (ks+1)·K/KS) in BK steps;
        acc (BN, MB) += dot(W tile (BN, BK), x tile (MB, BK)ᵀ)     MB = M padded to 16/32/64
    KS = 1: acc → y[:, rows] (one rounding)
    KS > 1: acc → workspace[ks] (fp32); the program that takes the last ticket of its row
        block (an acq_rel counter per block) sums the KS partials IN ks ORDER (so the result
        does not depend on which program finished last), writes y and resets the counter for
        the next call or graph replay.

W takes the dot's M side in its natural row-major layout; x is loaded row-major (whole rows
masked past M) and transposed in registers. The default tile is BN 32 (mma.sync; a BN 64
wgmma form with x loaded transposed streamed slower than cuBLAS: docs/PERF.md §5).
Split-K is for the shapes with few row blocks: `default_config` picks the smallest KS ≤ 8
dividing K/BK that gives ≥ 1.5 programs per SM (K3 TP16: in_proj 3216 × 7168 → KS 2,
qkv_a_g 900 × 7168 → KS 7, o_proj 7168 × 768 → KS 1). The partials cost M·4 bytes per row and
slice, mostly in L2. PDL: `pdl_enter` first, like every Triton decode kernel
(kernels/_triton.py); the software pipeline (num_stages) keeps several W tiles in flight per
program. Measured on the H200: 1.1–1.8× cuBLAS at M = 4–16 on the TP16 GEMVs, still
1.3–1.9× the CuTe GEMV's M = 1 time; at M = 64 it loses on most of them, so
`DecodeOptions.skinny_max_m` is 16 (docs/PERF.md §1.3).

Workspace and counters (split-K only) are per (device, N, BN, KS, MB), allocated and zeroed
eagerly on the first call (the step graph's eager warm-up precedes its capture) and reused;
`supports` says no to a first split-K call under capture, so `linear` takes cuBLAS there.

Layers: `_skinny_kernel` → `SkinnyConfig` / `default_config` (pure Python, validated) →
`skinny_gemm` (validation, the kernel on CUDA or on CPU tensors under TRITON_INTERPRET=1) →
`supports` (the dispatch predicate kernels/linear.py asks). Reference: `gemv.gemv_reference`
/ `linear.linear_f32_reference`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from raydecode.kernels._triton import available, pdl_enter, pdl_launch, sm_count, tl, triton

MAX_M = 64
MIN_M = 1            # the specialized dispatch sends M ≤ 2 to the CuTe GEMV (kernels/linear.py);
                     # the stock path's decode GEMMs come here from M = 1 (models/layers.py)


@dataclass(frozen=True)
class SkinnyConfig:
    """BN W rows per program, BK K columns per step, KS K slices (grid (⌈N/BN⌉, KS)); warps and
    pipelining depth of the K loop."""
    bn: int = 32
    bk: int = 128
    ks: int = 1
    warps: int = 4
    stages: int = 4

    def validate(self, M: int, N: int, K: int) -> "SkinnyConfig":
        bad = []
        if not MIN_M <= M <= MAX_M:
            bad.append(f"M={M}: the skinny GEMM serves {MIN_M} ≤ M ≤ {MAX_M}")
        if N < 1:
            bad.append(f"N={N}: need ≥ 1")
        if self.bn not in (16, 32, 64, 128):
            bad.append(f"bn {self.bn}: need one of 16, 32, 64, 128")
        if self.bk not in (32, 64, 128, 256) or K % self.bk:
            bad.append(f"bk {self.bk}: need one of 32, 64, 128, 256 dividing K={K}")
        elif self.ks < 1 or (K // self.bk) % self.ks:
            bad.append(f"ks {self.ks}: need ≥ 1 dividing K/bk = {K // self.bk}")
        if self.warps not in (1, 2, 4, 8):
            bad.append(f"warps {self.warps}: need one of 1, 2, 4, 8")
        if self.stages < 1:
            bad.append(f"stages {self.stages}: need ≥ 1")
        if bad:
            raise ValueError(f"SkinnyConfig {self} for M={M}, N={N}, K={K}: " + "; ".join(bad))
        return self


def m_block(M: int) -> int:
    """x rows of the dot: M padded to 16, 32 or 64."""
    return max(16, 1 << (M - 1).bit_length())


@functools.lru_cache(maxsize=1024)      # `supports` asks on every dispatched call
def default_config(M: int, N: int, K: int, sms: int = 132, bn: int = 32,
                   bk: int | None = None) -> SkinnyConfig:
    """BN 32 (mma.sync tiles: a BN 64 wgmma form streamed slower), BK
    (default: the widest ≤ 128 dividing K), and the smallest KS ≤ 8 dividing K/BK that gives
    ≥ 1.5 programs per SM (the last program of a block sums KS partials: long sums were the slow
    tail at M = 64); 3 stages at MB = 64 (its x tile doubles the stage), else 4."""
    bk = bk or next((b for b in (128, 64, 32) if K % b == 0), 128)
    steps = max(K // bk, 1)
    blocks = -(-N // bn)
    divs = [d for d in range(1, min(steps, 8) + 1) if steps % d == 0]
    ks = next((d for d in divs if 2 * blocks * d >= 3 * sms), divs[-1])
    return SkinnyConfig(bn=bn, bk=bk, ks=ks, stages=3 if m_block(M) == 64 else 4)


# (M-bucket, N, K) → measured config (scripts/bench/skinny.py); else `default_config`.
TUNED: dict[tuple[int, int, int], SkinnyConfig] = {}


def config_for(M: int, N: int, K: int, sms: int = 132) -> SkinnyConfig:
    return TUNED.get((m_block(M), N, K)) or default_config(M, N, K, sms)


if triton is not None:

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K: tl.constexpr,
                       MB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       KS: tl.constexpr, STEPS: tl.constexpr, DOT_F32: tl.constexpr,
                       PDL: tl.constexpr):
        nb = tl.program_id(0)
        ks = tl.program_id(1)
        rows = nb * BN + tl.arange(0, BN)
        rok = rows < N
        m = tl.arange(0, MB)
        mok = m < M
        kk = tl.arange(0, BK)
        pdl_enter(PDL)
        wrow = w_ptr + rows[:, None].to(tl.int64) * K
        acc = tl.zeros((BN, MB), tl.float32)
        k0 = ks * (STEPS * BK)
        for i in range(STEPS):
            k = k0 + i * BK + kk
            w = tl.load(wrow + k[None, :], mask=rok[:, None], other=0.0)          # (BN, BK)
            x = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=mok[:, None],
                        other=0.0)                                 # (MB, BK), rows contiguous
            if DOT_F32:     # the CPU interpreter's bf16 dot reads raw bits (Triton 3.9)
                acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc,
                             input_precision="ieee")
            else:
                acc = tl.dot(w, tl.trans(x), acc)
        ok = rok[:, None] & mok[None, :]
        yo = y_ptr + m[None, :] * N + rows[:, None]
        if KS == 1:
            tl.store(yo, acc.to(y_ptr.dtype.element_ty), mask=ok)
        else:
            part = ws_ptr + rows[:, None].to(tl.int64) * MB + m[None, :]         # slice 0
            tl.store(part + ks * N * MB, acc, mask=ok)
            tl.debug_barrier()                       # every thread's partial before the ticket
            ticket = tl.atomic_add(cnt_ptr + nb, 1, sem="acq_rel", scope="gpu")
            if ticket == KS - 1:                     # last of the block: sum in ks order
                tot = tl.zeros((BN, MB), tl.float32)
                for j in range(KS):
                    tot += tl.load(part + j * N * MB, mask=ok, other=0.0, cache_modifier=".cg")
                tl.store(yo, tot.to(y_ptr.dtype.element_ty), mask=ok)
                tl.atomic_xchg(cnt_ptr + nb, 0, sem="relaxed", scope="gpu")


_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _scratch_key(device: torch.device, N: int, cfg: SkinnyConfig, MB: int) -> tuple:
    return (str(device), N, cfg.bn, cfg.ks, MB)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _scratch(device: torch.device, N: int, cfg: SkinnyConfig, MB: int):
    """(workspace (KS, N, MB) fp32, counters (⌈N/BN⌉,) int32 zeros), one pair per (device,
    N, BN, KS, MB). Allocated and zeroed EAGERLY: inside a graph capture the zeroing would be
    a node of that graph only (a later replay would read stale counters: NaN rows), so a first
    call under capture is refused. Calls that share a pair
    must not overlap: the decode step issues its GEMVs on one stream, in order."""
    key = _scratch_key(device, N, cfg, MB)
    if key not in _SCRATCH:
        if _capturing(device):
            raise ValueError(f"skinny_gemm: first split-K call for N={N}, {cfg}, MB={MB} inside "
                             "CUDA graph capture; call it once eagerly before capturing")
        _SCRATCH[key] = (torch.empty(cfg.ks, N, MB, dtype=torch.float32, device=device),
                         torch.zeros(-(-N // cfg.bn), dtype=torch.int32, device=device))
    return _SCRATCH[key]


def shape_ok(M: int, N: int, K: int) -> bool:
    """The (M, N, K) the kernel tiles (the shape part of `supports`)."""
    return MIN_M <= M <= MAX_M and K % 32 == 0 and N >= 1


def supports(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The shapes/dtypes/devices `skinny_gemm` runs (no exception: the dispatch predicate)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        return False
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return False
    if not available(x, w) or not (x.is_contiguous() and w.is_contiguous()):
        return False
    M, K = x.shape
    N = w.shape[0]
    if not shape_ok(M, N, K):
        return False
    cfg = config_for(M, N, K, sm_count(str(x.device)))     # split-K needs its scratch first
    return cfg.ks == 1 or not _capturing(x.device) or \
        _scratch_key(x.device, N, cfg, m_block(M)) in _SCRATCH


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
                config: SkinnyConfig | None = None, out: torch.Tensor | None = None
                ) -> torch.Tensor:
    """y (M, N) = x (M, K) · Wᵀ with fp32 accumulation, rounded once to out_dtype (None: x's
    dtype; torch.float32: the accumulator unrounded). Writes `out` when given."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"skinny_gemm: x {tuple(x.shape)}, w {tuple(w.shape)}; expected "
                         "x (M, K) and w (N, K)")
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        raise ValueError(f"skinny_gemm: x {x.dtype}, w {w.dtype}; accepted: torch.bfloat16")
    dt = out_dtype or x.dtype
    if dt not in (torch.bfloat16, torch.float32):
        raise ValueError(f"skinny_gemm: out_dtype={out_dtype}; accepted: None, torch.bfloat16, "
                         "torch.float32")
    M, K = x.shape
    N = w.shape[0]
    cfg = (config or config_for(M, N, K, sm_count(str(x.device)))).validate(M, N, K)
    if not available(x, w):
        raise ValueError("skinny_gemm needs Triton and CUDA tensors (or CPU tensors under "
                         "TRITON_INTERPRET=1)")
    if out is None:
        out = torch.empty(M, N, dtype=dt, device=x.device)
    elif out.shape != (M, N) or out.dtype != dt or not out.is_contiguous():
        raise ValueError(f"skinny_gemm: out {tuple(out.shape)} {out.dtype}; expected a "
                         f"contiguous ({M}, {N}) {dt}")
    x, w = x.contiguous(), w.contiguous()
    MB = m_block(M)
    ws, cnt = _scratch(x.device, N, cfg, MB) if cfg.ks > 1 else (out, out)  # KS 1: unused
    steps = K // cfg.bk // cfg.ks
    _skinny_kernel[(-(-N // cfg.bn), cfg.ks)](
        x, w, out, ws, cnt, M, N, K=K, MB=MB, BN=cfg.bn, BK=cfg.bk, KS=cfg.ks, STEPS=steps,
        DOT_F32=not x.is_cuda, num_warps=cfg.warps, num_stages=cfg.stages, **pdl_launch(x))
    return out


__all__ = ["MAX_M", "MIN_M", "SkinnyConfig", "TUNED", "config_for", "default_config", "m_block",
           "shape_ok", "skinny_gemm", "supports"]
