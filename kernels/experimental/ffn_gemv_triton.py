"""The FFN-out GEMV of the specialized decode step with the latent norm + SiTU as its prologue
(Triton): ONE launch where the step runs `latent_norm_situ` and then the GEMV.

    x (T, K)   = [RMSNorm(bf16(lat); w)[:, c0:c0+n] ‖ SiTU(bf16 g, bf16 u) ‖ 0]   bf16, in registers
    out (T, N) = bf16(x · Wᵀ)                                              fp32 accumulation

lat (T, D) fp32 (the all-reduced routed latent; the rms runs over all D columns, then the
c0:c0+n slice is kept), gu (T, 2I) gate ‖ up (fp32 or bf16; may be a strided column slice of
the wider h2 GEMV output), W (N, K) bf16, K ≥ n + I (the [latent up 1/TP ‖ shared down ‖ 0]
weight). Rounding points are `latent_norm_situ`'s: lat → bf16 before the norm, g and u → bf16
before SiTU, x → bf16; the output is rounded once. Differences from the reference composition:
fp32 reduction order (rms, dot) and SiTU's form (`_situ`); W's zero-pad columns [n + I, K)
meet x = 0 and are never read (K3: 5 % fewer bytes; a non-finite pad weight would differ).

Program p owns W rows [p·BN, p·BN + BN) for all T ≤ 8 tokens (T constexpr); BN = 32, 4 warps
(224 programs at N = 7168, 1.7 per H200 SM, all resident):
  1. pdl_enter; the whole (BN, n + I) bf16 tile is requested at once in power-of-two column
     pieces (norm 224 → 256, SiTU 384 = 256 + 128 at TP16; 448 → 512, 768 = 512 + 256 at
     TP8), 16-byte loads; a bar.sync pins them ahead of the prologue (ptxas sank them below
     the rms loads otherwise);
  2. while W streams: r[t] from Σ_D bf16(lat)² (L2-resident, 14 KB a token), x's pieces;
  3. W → shared memory → tensor cores (mma.sync m16n8k16, tokens padded to 16 rows), fp32
     accumulators, one bf16 store. An identity asm on W keeps Triton's shared-memory copy,
     which it places right after the load (stalling the warp until W lands), behind step 2.
Every program redoes step 2 (T·D lat values + T·(n + I) x columns): the price of one launch.

Design check without a GPU (SASS of Triton 3.6, the GPU host's, compiled for sm_90a here):
thread-instructions × warps × programs per SM / (4 issue/clk × 1.98 GHz) = issue time per SM,
against the HBM time of the tile stream at 4.3 TB/s:
    TP16 (8.72 MB, 2.0 µs)  T = 1: 760 instr/thread → 0.65 µs; T = 2: 1.15; T = 4: 1.6; T = 8: 2.4
    TP8 (17.4 MB, 4.1 µs)   T = 1: 1240 → 1.06 µs;          T = 2: 1.43; T = 4: 2.1; T = 8: 3.3
(no spills; 126–255 registers). A CUDA-core Σ_k (fp32 FMAs + shuffles instead of the dot) was
2–4× the instructions (TP16 T = 1: 1300, T = 8: 6800): rejected; BN = 16/64 and 8/16 warps
were no better (redundant prologue, or register caps and spills).

Prediction (H200, CUDA graph over rotating weights, written before any GPU run; the lead
compares with scripts/explore/ffn_gemv.py): TP16 T = 1 reads 7168 × 608 × 2 = 8.72 MB (the
9.18 MB K = 640 tile minus its pad; lat 14 KB, gu 3 KB, out 14 KB negligible) → 2.2 µs at
~4 TB/s effective + ~1 µs of launch and prologue latency ≈ 3.2 µs per call; TP8 T = 1:
17.4 MB → 4.4 + 1 ≈ 5.4 µs; T = 8 adds ≈ 0.5–1.5 µs (issue ≈ stream time above). The pair
it replaces: latent_norm_situ ≈ 2.2 µs (r3 layer profile) + the CuTe GEMV ≈ 3.2 µs (between
gemv run2's 2.1 µs for 7168 × 384 and 3.5 µs for 7168 × 768) ≈ 5 µs at TP16 T = 1, so the
fused kernel should save ≈ 2 µs per layer (more at T ≥ 4, where the pair's GEMV is cuBLAS).

Layers: `_norm_situ_gemv_kernel` → `config_for` → `norm_situ_gemv` (validation; the kernel on
CUDA, or on CPU tensors under TRITON_INTERPRET=1, for 1 ≤ T ≤ 8 and tiles ≤ MAX_TILE_COLS;
otherwise the pair `latent_norm_situ` + F.linear, on CPU the reference composition bit for bit)
and `norm_situ_gemv_reference`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raydecode.kernels import gemv_norm_situ as _cute_ns
from raydecode.kernels.gemv_norm_situ import norm_situ_gemv_reference
from raydecode.kernels._triton import available, pdl_enter, pdl_launch, tl, triton
from raydecode.kernels.decode_elementwise_triton import (latent_norm_situ,
                                                         latent_norm_situ_reference)

MAX_T = 8              # tokens the kernel serves (weight-bound GEMV; above: the pair + cuBLAS)
MAX_TILE_COLS = 1280   # Σ column pieces: the (32, ·) bf16 tile is ≤ 160 registers a thread
LAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# `norm_situ_gemv` takes the CuTe form (kernels/gemv_norm_situ.py: the CuTe GEMV with this
# prologue in shared memory) where it serves (`gemv_norm_situ.supports`), this Triton kernel
# elsewhere up to MAX_T. False: Triton only (the round-10 form, for A/B runs).
USE_CUTE = True
HBM_BYTES_PER_S = 4.8e12   # H200 nominal

if triton is not None:

    @triton.jit
    def _bf(x, CPU: tl.constexpr):
        """fp32 → the nearest bf16 value (ties to even), kept in fp32. CPU (the interpreter,
        whose .to(bf16) truncates): by hand on the bits (finite x), so both round alike."""
        if CPU:
            b = x.to(tl.uint32, bitcast=True)
            b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
            return b.to(tl.float32, bitcast=True)
        return x.to(tl.bfloat16).to(tl.float32)

    @triton.jit
    def _mm(x, w, acc, CPU: tl.constexpr):
        """acc (BT, BN) + x (BT, BC) · w (BN, BC)ᵀ: bf16 values, fp32 accumulation on tensor
        cores. The identity asm holds w's shared-memory copy (which Triton places right after
        the load, stalling the warp's in-order issue until W arrives) behind the prologue.
        CPU (interpreter, whose bf16 dot reads raw bits): fp32 operands, the same products."""
        if CPU:
            return tl.dot(x.to(tl.float32), tl.trans(w).to(tl.float32), acc,
                          input_precision="ieee")
        w = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [w], dtype=tl.bfloat16,
                                      is_pure=False, pack=2)
        return tl.dot(x.to(tl.bfloat16), tl.trans(w), acc)

    @triton.jit
    def _situ(gu_ptr, gu_st, tt, t_ok, j, I, beta, inv_beta, lin_beta, inv_lin_beta,
              HAS_LIN: tl.constexpr, CPU: tl.constexpr):
        """bf16 SiTU(bf16 g, bf16 u) (BT, BJ) for gate columns j < I (0 elsewhere):
        β·tanh(g/β)·σ(g) · β_l·tanh(u/β_l) as one quotient of 3 exp2 terms, tanh(y) =
        (e − 1)/(e + 1) with e = exp(2y) clamped where tanh is ±1 in fp32 (no inf/inf),
        σ(g) = 1/(1 + exp(−g)) (inf gives 0, the limit); SiTU(0, 0) = 0."""
        L2E2: tl.constexpr = 2.8853900817779268        # 2·log2(e)
        m = t_ok[:, None] & (j < I)[None, :]
        gp = gu_ptr + tt[:, None] * gu_st + j[None, :]
        g = _bf(tl.load(gp, mask=m, other=0.0).to(tl.float32), CPU)
        u = _bf(tl.load(gp + I, mask=m, other=0.0).to(tl.float32), CPU)
        e2 = tl.exp2(tl.minimum(tl.maximum(g * inv_beta * L2E2, -40.0), 40.0))
        e1 = tl.exp2(g * -0.5 * L2E2)
        num = beta * (e2 - 1.0)
        den = (e2 + 1.0) * (1.0 + e1)
        if HAS_LIN:
            e3 = tl.exp2(tl.minimum(tl.maximum(u * inv_lin_beta * L2E2, -40.0), 40.0))
            num = num * lin_beta * (e3 - 1.0)
            den = den * (e3 + 1.0)
        else:
            num = num * u
        return _bf(num / den, CPU)

    @triton.jit
    def _norm_situ_gemv_kernel(lat_ptr, lat_st, wn_ptr, eps, c0, gu_ptr, gu_st, beta, inv_beta,
                               lin_beta, inv_lin_beta, w_ptr, w_st, N, out_ptr, out_st,
                               D: tl.constexpr, NC: tl.constexpr, I: tl.constexpr,
                               T: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_NC: tl.constexpr,
                               IA: tl.constexpr, IB: tl.constexpr, BN: tl.constexpr,
                               BLOCK_D: tl.constexpr, HAS_LIN: tl.constexpr,
                               CPU: tl.constexpr, PDL: tl.constexpr):
        # x's nonzero columns in power-of-two pieces: [0, NC) the latent norm (BLOCK_NC ≥ NC),
        # [NC, NC + IA) and [NC + IA, NC + I) SiTU (IB ≥ I − IA, 0: none); W's zero-pad
        # columns [NC + I, K) meet x = 0 and are never read.
        pdl_enter(PDL)
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        row_ok = rows < N
        w_row = w_ptr + rows[:, None] * w_st
        kn = tl.arange(0, BLOCK_NC)
        ja = tl.arange(0, IA)
        # 1. the (BN, NC + I) weight tile: every load in flight before the prologue starts
        w_n = tl.load(w_row + kn[None, :], mask=row_ok[:, None] & (kn < NC)[None, :], other=0.0)
        w_a = tl.load(w_row + NC + ja[None, :], mask=row_ok[:, None], other=0.0)
        if IB > 0:
            jb = IA + tl.arange(0, IB)
            w_b = tl.load(w_row + NC + jb[None, :], mask=row_ok[:, None] & (jb < I)[None, :],
                          other=0.0)
        tl.debug_barrier()   # ptxas otherwise sinks the W loads below the rms loads
        # 2. r[t] = 1 / sqrt(mean_D(bf16(lat[t])²) + eps)                       (BLOCK_T,)
        tt = tl.arange(0, BLOCK_T)
        t_ok = tt < T
        ss = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
        for d0 in tl.static_range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            v = tl.load(lat_ptr + tt[:, None] * lat_st + d[None, :],
                        mask=t_ok[:, None] & (d < D)[None, :], other=0.0)
            v = _bf(v.to(tl.float32), CPU)
            ss += v * v
        r = tl.rsqrt(tl.sum(ss, 1) / D + eps)
        # 3. x pieces (BLOCK_T, ·): bf16(bf16(lat)·r·w_norm) at c0 + kn; SiTU
        m_n = t_ok[:, None] & (kn < NC)[None, :]
        xl = tl.load(lat_ptr + tt[:, None] * lat_st + c0 + kn[None, :], mask=m_n, other=0.0)
        wn = tl.load(wn_ptr + c0 + kn, mask=kn < NC, other=0.0).to(tl.float32)
        x_n = _bf(_bf(xl.to(tl.float32), CPU) * r[:, None] * wn[None, :], CPU)
        x_a = _situ(gu_ptr, gu_st, tt, t_ok, ja, I, beta, inv_beta, lin_beta, inv_lin_beta,
                    HAS_LIN, CPU)
        # 4. out[t, rows] = bf16(Σ_k x[t, k] · W[rows, k]): tensor cores, fp32 accumulation
        acc = _mm(x_n, w_n, tl.zeros((BLOCK_T, BN), tl.float32), CPU)
        acc = _mm(x_a, w_a, acc, CPU)
        if IB > 0:
            x_b = _situ(gu_ptr, gu_st, tt, t_ok, jb, I, beta, inv_beta, lin_beta, inv_lin_beta,
                        HAS_LIN, CPU)
            acc = _mm(x_b, w_b, acc, CPU)                        # (BLOCK_T, BN)
        y = _bf(acc, CPU).to(out_ptr.dtype.element_ty)          # exact: already a bf16 value
        tl.store(out_ptr + tt[:, None] * out_st + rows[None, :], y,
                 mask=t_ok[:, None] & row_ok[None, :])


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def pieces(n_cols: int, I: int) -> tuple[int, int, int]:
    """(BLOCK_NC, IA, IB): power-of-two widths (≥ 16, tl.dot's K minimum) of x's nonzero
    column pieces, the norm [0, n_cols) and SiTU [0, IA) + [IA, I) (IB = 0: no second piece);
    IA ≤ I for I ≥ 16. K3 TP16: 224 → 256, 384 = 256 + 128; TP8: 448 → 512, 768 = 512 + 256."""
    ia = 1 << (max(I, 16).bit_length() - 1)
    return max(16, _pow2_ceil(n_cols)), ia, (max(16, _pow2_ceil(I - ia)) if I > ia else 0)


@dataclass(frozen=True)
class FusedGemvConfig:
    block_n: int = 32   # BN: W rows per program (N / BN programs)
    num_warps: int = 4
    block_d: int = 4096  # lat columns per rms step, for each of the BLOCK_T tokens


def config_for(T: int, D: int) -> FusedGemvConfig:
    """BN = 32, 4 warps (module docstring); the rms step loads 32 lat values a thread."""
    return FusedGemvConfig(block_d=min(_pow2_ceil(D), max(32, 4096 // _pow2_ceil(T))))


def _validate(lat, w_norm, c0, n_cols, gu, beta, linear_beta, weight, out) -> None:
    what = (f"lat {tuple(lat.shape)} {lat.dtype}, w_norm {tuple(w_norm.shape)}, gu "
            f"{tuple(gu.shape)} {gu.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    if lat.dim() != 2 or gu.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"norm_situ_gemv: {what}; expected 2-D lat (T, D), gu (T, 2I), "
                         "weight (N, K)")
    T, D = lat.shape
    if (lat.dtype not in LAT_DTYPES or not gu.dtype.is_floating_point
            or tuple(w_norm.shape) != (D,) or gu.shape[0] != T or gu.shape[1] % 2):
        raise ValueError(f"norm_situ_gemv: {what}; expected lat (T, D) in {LAT_DTYPES}, "
                         "w_norm (D,), gu (T, 2I) floating point")
    I = gu.shape[1] // 2
    if not 0 <= c0 or not 0 <= n_cols or c0 + n_cols > D:
        raise ValueError(f"norm_situ_gemv: columns [{c0}, {c0 + n_cols}) of lat with D={D}; "
                         "need 0 ≤ c0, 0 ≤ n_cols and c0 + n_cols ≤ D")
    if not beta > 0 or not (linear_beta is None or linear_beta > 0):
        raise ValueError(f"norm_situ_gemv: beta={beta}, linear_beta={linear_beta}; need "
                         "beta > 0 and linear_beta > 0 or None")
    if weight.dtype != torch.bfloat16 or weight.shape[1] < n_cols + I:
        raise ValueError(f"norm_situ_gemv: {what}; weight must be bf16 (N, K) with K ≥ "
                         f"n_cols + I = {n_cols + I}")
    if out is not None and (tuple(out.shape) != (T, weight.shape[0])
                            or out.dtype != torch.bfloat16 or out.stride(-1) != 1):
        raise ValueError(f"norm_situ_gemv: out {tuple(out.shape)} {out.dtype} stride "
                         f"{out.stride()}; need bf16 ({T}, {weight.shape[0]}) with unit "
                         "column stride")
    devs = {t.device for t in (lat, w_norm, gu, weight) + ((out,) if out is not None else ())}
    if len(devs) != 1:
        raise ValueError(f"norm_situ_gemv: tensors on several devices {sorted(map(str, devs))}")


def uses_kernel(lat: torch.Tensor, n_cols: int, gu: torch.Tensor, weight: torch.Tensor,
                w_norm: torch.Tensor | None = None) -> bool:
    """A fused kernel serves these (validated) inputs: the CuTe form (with `w_norm` given and
    USE_CUTE) or this Triton one; else the latent_norm_situ + F.linear pair. I ≥ 16 keeps the
    SiTU piece IA inside the row."""
    if USE_CUTE and w_norm is not None and _cute_ns.supports(lat, w_norm, n_cols, gu, weight):
        return True
    I = gu.shape[1] // 2
    return (available(lat, gu, weight) and 1 <= lat.shape[0] <= MAX_T and I >= 16
            and sum(pieces(n_cols, I)) <= MAX_TILE_COLS and weight.stride(1) == 1
            and weight.shape[0] * weight.stride(0) < 2**31)


def norm_situ_gemv(lat: torch.Tensor, w_norm: torch.Tensor, eps: float, c0: int, n_cols: int,
                   gu: torch.Tensor, beta: float, linear_beta: float | None,
                   weight: torch.Tensor, out: torch.Tensor | None = None,
                   config: FusedGemvConfig | None = None) -> torch.Tensor:
    """out (T, N) bf16 = [RMSNorm(bf16(lat); w_norm)[:, c0:c0+n_cols] ‖ SiTU(bf16(gu)) ‖ 0] · Wᵀ.

    One kernel for 1 ≤ T ≤ 8 on CUDA (no allocation when `out` is given, no host sync:
    capturable in a CUDA graph): the CuTe form where it serves (`USE_CUTE`; not with an explicit
    Triton `config`), else this module's; otherwise latent_norm_situ + F.linear (on CPU: the
    reference composition)."""
    _validate(lat, w_norm, c0, n_cols, gu, beta, linear_beta, weight, out)
    T, D = lat.shape
    N, K = weight.shape
    I = gu.shape[1] // 2
    if USE_CUTE and config is None and _cute_ns.supports(lat, w_norm, n_cols, gu, weight, out):
        if out is None:
            out = torch.empty(T, N, dtype=torch.bfloat16, device=lat.device)
        return _cute_ns.norm_situ_gemv_cute(lat, w_norm, eps, c0, n_cols, gu, beta,
                                            linear_beta, weight, out)
    if not uses_kernel(lat, n_cols, gu, weight):
        x = torch.empty(T, K, dtype=torch.bfloat16, device=lat.device)
        y = F.linear(latent_norm_situ(lat, w_norm, eps, c0, n_cols, gu, beta, linear_beta, x),
                     weight)
        return y if out is None else out.copy_(y)
    if out is None:
        out = torch.empty(T, N, dtype=torch.bfloat16, device=lat.device)
    if lat.stride(1) != 1:
        lat = lat.contiguous()
    if gu.stride(1) != 1:
        gu = gu.contiguous()
    cfg = config or config_for(T, D)
    bnc, ia, ib = pieces(n_cols, I)
    lb = float(linear_beta) if linear_beta is not None else 1.0
    _norm_situ_gemv_kernel[(triton.cdiv(N, cfg.block_n),)](
        lat, lat.stride(0), w_norm, float(eps), c0, gu, gu.stride(0), float(beta),
        1.0 / float(beta), lb, 1.0 / lb, weight, weight.stride(0), N, out, out.stride(0),
        D=D, NC=n_cols, I=I, T=T, BLOCK_T=_pow2_ceil(T), BLOCK_NC=bnc, IA=ia, IB=ib,
        BN=cfg.block_n, BLOCK_D=cfg.block_d, HAS_LIN=linear_beta is not None,
        CPU=not out.is_cuda, num_warps=cfg.num_warps, **pdl_launch(out))
    return out


def read_bytes(N: int, n_cols: int, I: int) -> int:
    """W bytes the kernel reads: the pad columns are skipped."""
    return 2 * N * (n_cols + I)


def predicted_us(N: int, K: int, bw: float = 4.3e12, prologue_us: float = 1.0) -> float:
    """(N, K) bf16 read once at `bw` plus ~1 µs of launch and prologue latency the stream does
    not hide (pass K = n_cols + I for the bytes the kernel reads)."""
    return 2 * N * K / bw * 1e6 + prologue_us


__all__ = ["FusedGemvConfig", "MAX_T", "config_for", "norm_situ_gemv",
           "norm_situ_gemv_reference", "pieces", "predicted_us", "read_bytes", "uses_kernel"]
