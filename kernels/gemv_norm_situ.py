"""The FFN-out GEMV of the specialized decode step with the latent norm + SiTU as its prologue,
on the CuTe DSL GEMV (kernels/gemv.py): ONE launch where the step runs `latent_norm_situ` and
then the GEMV. Same contract as the unserved Triton form (kernels/experimental/
ffn_gemv_triton.py: one kernel fewer but ≈ 1 µs slower, its tensor-core tile streamed W at
0.33 of HBM); this one keeps the CuTe GEMV's W stream (0.71 of HBM at TP16, 0.82 at TP8).

    a (M, K)   = [RMSNorm(bf16(lat); w)[:, c0:c0+n] ‖ SiTU(bf16 g, bf16 u) ‖ 0]   bf16, in smem
    out (M, N) = bf16(a · Wᵀ)                                             fp32 accumulation

lat (M, D) fp32 (the all-reduced routed latent), w (D,) bf16 or fp32, gu (M, 2I) fp32 gate ‖ up (a
column slice of the h2 GEMV's fp32 output: row stride free, last dim contiguous), W (N, K) bf16
with K ≥ n + I; served where it measured faster than the pair: M = 1 and n + I ≤
PROLOGUE_MAX_COLS (K3 TP16; `supports`).

Per CTA (the GEMV's grid and mapping, `gemv.config_for(M, N, K)`):
  1. the GEMV's entry: W's first load batch in flight, then the PDL wait;
  2. prologue: Σ_D bf16(lat)² per token (16-byte loads, L2-resident, 14 KB a token), warp
     shuffles + one shared-memory exchange; then each thread writes its columns of a: the norm
     slice (x·r)·w, SiTU β·tanh(g/β)·sigmoid(g)·β_l·tanh(u/β_l), zeros; one barrier;
  3. the GEMV's loop with x read from shared memory (`GemvKernel._gemv`'s x_tiles hook).
Every CTA redoes step 2 (M·D lat values + M·(n + I) columns): the price of one launch.
Rounding points are `latent_norm_situ_reference`'s (lat, g, u → bf16 first; a → bf16); the
differences are the fp32 reduction order and tanh's implementation: ≤ 1 bf16 ulp of a.

Prediction (written before the first GPU run): the pair is latent_norm_situ 2.2 µs (layer
profile) + the ffn_out GEMV 2.95 µs (7168 × 640, `gemv-h200-2026-11-30-r14.json`) plus one
graph boundary; the prologue adds ≈ 1 µs (L2 round trip + reduction + barrier) to the GEMV
after its PDL wait. Fused ≈ 4 µs vs ≈ 5.2 µs: ≈ −1 µs per layer at TP16 batch 1, one kernel
fewer (KDA 11 → 10, MLA 14 → 13).
Measured (H200, docs/PERF.md §2.2): TP16 T = 1 4.61 vs 5.10 µs for the pair (−0.5); the
layer fell 11 → 10 / 14 → 13 kernels; T = 2 and TP8 lose (PROLOGUE_MAX_COLS above).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from raydecode.kernels import gemv as G
from raydecode.kernels._cute import CompileCache, cute_available
from raydecode.kernels._cute_dsl import Float32, _dsl, _Stream, _Tensor, const_expr, cute, cutlass

WARP = 32
LAT_VEC = 4          # fp32 lat values per 16-byte load
# Where the fused form serves (`supports`): one token and at most this many a columns (n + I).
# Measured against the pair on the H200 (scripts/explore/ffn_gemv.py):
# TP16 T = 1 (608 columns) 4.61 vs 5.10 µs; TP16 T = 2 10.48 vs 5.53; TP8 T = 1 (1216) 8.73
# vs 6.89: every CTA redoes the prologue, and its SiTU work grows with the columns and tokens.
PROLOGUE_MAX_COLS = 640


class NormSituGemvKernel(G.GemvKernel):
    """One compiled fused GEMV for static (M, N, K, D, n, I, config, has_lin); c0, eps, β and
    β_lin at run time (c0 = rank · n differs per rank, one kernel serves all ranks)."""

    def __init__(self, M: int, N: int, K: int, cfg: G.GemvConfig, D: int, n_cols: int, I: int,
                 has_lin: bool):
        super().__init__(M, N, K, cfg)
        if D % LAT_VEC or n_cols + I > K or n_cols > D:
            raise ValueError(f"norm+SiTU GEMV: D={D} (multiple of {LAT_VEC}), n={n_cols}, "
                             f"I={I}, K={K}: need n ≤ D and n + I ≤ K")
        self.D, self.n_cols, self.I, self.has_lin = D, n_cols, I, has_lin

    @_dsl.jit
    def __call__(self, mLat: _Tensor, mNw: _Tensor, mGU: _Tensor, mW: _Tensor, mY: _Tensor,
                 c0: cutlass.Int32, eps: Float32, beta: Float32, lin_beta: Float32,
                 stream: _Stream):
        cfg = self.cfg
        self.kernel(mLat, mNw, mGU, mW, mY, c0, eps, beta, lin_beta).launch(
            grid=[self.M // cfg.m_tile, self.N // cfg.rows_per_cta, 1],
            block=[cfg.threads, 1, 1],
            stream=stream,
            use_pdl=cfg.pdl,
        )

    @_dsl.kernel
    def kernel(self, mLat: _Tensor, mNw: _Tensor, mGU: _Tensor, mW: _Tensor, mY: _Tensor,
               c0: cutlass.Int32, eps: Float32, beta: Float32, lin_beta: Float32):
        self._gemv(mW, mY, lambda smem, tidx, warp, lane: self._build_a(
            mLat, mNw, mGU, mW.element_type, c0, eps, beta, lin_beta, smem, tidx, warp, lane))

    @_dsl.jit
    def _build_a(self, mLat, mNw, mGU, act, c0, eps, beta, lin_beta, smem, tidx, warp, lane):
        """a (M, K) in shared memory, returned as the GEMV's ((1, 8), (M, K/8)) x tiles."""
        M, D, n, I, K = self.M, self.D, self.n_cols, self.I, self.K
        NT = self.cfg.threads
        NW = NT // WARP
        sA = smem.allocate_tensor(act, cute.make_layout((M, K), stride=(K, 1)), byte_alignment=16)
        red = smem.allocate_tensor(Float32, cute.make_layout((NW, M), stride=(M, 1)),
                                   byte_alignment=16)
        gLat = cute.zipped_divide(mLat, (1, LAT_VEC))           # ((1, 4), (M, D/4))
        rL = cute.make_rmem_tensor(cute.make_layout(LAT_VEC), Float32)
        # Σ bf16(lat)² per token, this thread's 16-byte pieces p = tidx + k·NT < D/4
        D4 = D // LAT_VEC
        sums = []
        for m in cutlass.range_constexpr(M):
            ss = Float32(0.0)
            for k in cutlass.range_constexpr((D4 + NT - 1) // NT):
                p = tidx + k * NT
                if const_expr((k + 1) * NT <= D4):
                    cute.autovec_copy(gLat[(None, (m, p))], rL)
                    v = rL.load().to(act).to(Float32)
                    ss = ss + (v * v).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                else:                                           # the ragged last round
                    rL.fill(0.0)
                    if p < D4:
                        cute.autovec_copy(gLat[(None, (m, p))], rL)
                    v = rL.load().to(act).to(Float32)
                    ss = ss + (v * v).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            sums.append(cute.arch.warp_reduction_sum(ss))
        if lane == 0:
            for m in cutlass.range_constexpr(M):
                red[(warp, m)] = sums[m]
        cute.arch.sync_threads()
        rstd = []
        for m in cutlass.range_constexpr(M):
            tot = red[(0, m)]
            for q in cutlass.range_constexpr(1, NW):
                tot = tot + red[(q, m)]
            rstd.append(cute.math.rsqrt(tot / Float32(D) + eps))
        # a's columns: j < n the norm slice, n ≤ j < n + I SiTU, the rest zeros
        for m in cutlass.range_constexpr(M):
            for k in cutlass.range_constexpr((K + NT - 1) // NT):
                j = tidx + k * NT
                if j < n:
                    x = mLat[(m, c0 + j)].to(act).to(Float32)
                    sA[(m, j)] = ((x * rstd[m]) * mNw[(c0 + j)].to(Float32)).to(act)
                elif j < n + I:
                    g = mGU[(m, j - n)].to(act).to(Float32)
                    u = mGU[(m, j - n + I)].to(act).to(Float32)
                    sig = Float32(1.0) / (Float32(1.0) + cute.math.exp(-g))
                    a = beta * cute.math.tanh(g / beta) * sig
                    if const_expr(self.has_lin):
                        u = lin_beta * cute.math.tanh(u / lin_beta)
                    sA[(m, j)] = (a * u).to(act)
                elif j < K:
                    sA[(m, j)] = Float32(0.0).to(act)
        cute.arch.sync_threads()
        return cute.zipped_divide(sA, (1, G.VEC))


_CACHE = CompileCache()


def compile_norm_situ_gemv(M: int, N: int, K: int, D: int, n_cols: int, I: int, gu_stride: int,
                           has_lin: bool, cfg: G.GemvConfig, w_norm_dtype=torch.bfloat16,
                           extra_options: str = ""):
    """cute.compile one fused GEMV (TVM-FFI entry, current torch stream, capturable). Returns
    `launch(lat, w_norm, gu, weight, out, c0, eps, beta, lin_beta)`; gu's row stride is part
    of the kernel (the h2 GEMV's width)."""
    bf, f32 = cutlass.BFloat16, cutlass.Float32
    fake = cute.runtime.make_fake_compact_tensor
    args = (fake(f32, (M, D), stride_order=(1, 0), assumed_align=16),
            fake(G._cute_dtype(w_norm_dtype), (D,), stride_order=(0,), assumed_align=16),
            cute.runtime.make_fake_tensor(f32, (M, 2 * I), (gu_stride, 1), assumed_align=16),
            fake(bf, (N, K), stride_order=(1, 0), assumed_align=16),
            fake(bf, (M, N), stride_order=(1, 0), assumed_align=16))
    kernel = NormSituGemvKernel(M, N, K, cfg, D, n_cols, I, has_lin)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(kernel, *args, cutlass.Int32(0), Float32(1e-6), Float32(1.0),
                        Float32(1.0), stream, options=f"--enable-tvm-ffi {extra_options}".strip())


def cache_key(M: int, N: int, K: int, D: int, n_cols: int, I: int, gu_stride: int,
              has_lin: bool, cfg: G.GemvConfig, w_norm_dtype: torch.dtype, arch: str) -> dict:
    """The node kernel cache key (kernels/aot_store.py): shapes, config, arch, package versions
    and both sources (this file and the GEMV body in kernels/gemv.py)."""
    from raydecode.kernels import aot_store as S
    return {"kind": "cute_gemv_norm_situ", "M": M, "N": N, "K": K, "D": D, "n_cols": n_cols,
            "I": I, "gu_stride": gu_stride, "has_lin": has_lin,
            "w_norm_dtype": S._dname(w_norm_dtype), "config": dataclasses.asdict(cfg),
            "arch": arch, "ffi": True,
            "versions": {k: v for k, v in S.versions().items() if k != "triton"},
            "source": S.source_sha() + S.source_sha(Path(__file__))}


def compiled(M: int, N: int, K: int, D: int, n_cols: int, I: int, gu_stride: int, has_lin: bool,
             cfg: G.GemvConfig, w_norm_dtype: torch.dtype = torch.bfloat16, root=None,
             arch: str | None = None):
    """The launch function: from this process's cache, else the node kernel cache
    ($RAYDECODE_KERNEL_CACHE: compiled once per node, loaded by the other ranks), else a JIT
    compile. root / arch: an explicit cache dir and target (kernels/aot.py `warm`)."""
    def build():
        from raydecode.kernels import aot_store as S
        where = S.cache_dir(root)
        if where is None:
            return compile_norm_situ_gemv(M, N, K, D, n_cols, I, gu_stride, has_lin, cfg,
                                          w_norm_dtype)
        key = cache_key(M, N, K, D, n_cols, I, gu_stride, has_lin, cfg, w_norm_dtype,
                        arch or S.current_arch())

        def export(path: Path, symbol: str) -> None:
            compile_norm_situ_gemv(M, N, K, D, n_cols, I, gu_stride, has_lin, cfg,
                                   w_norm_dtype).export_to_c(str(path), function_name=symbol)
        return S._store(where).get_or_build(key, export, S._load_gemv)

    if root is not None:        # warming another cache dir: not this process's launch cache
        return build()
    return _CACHE.get((M, N, K, D, n_cols, I, gu_stride, has_lin, cfg, w_norm_dtype), build)


def norm_situ_gemv_reference(lat, w_norm, eps, c0, n_cols, gu, beta, linear_beta, weight):
    """The composition the fused kernel replaces: latent_norm_situ_reference, then F.linear."""
    from raydecode.kernels.decode_elementwise_triton import latent_norm_situ_reference
    x = latent_norm_situ_reference(lat, w_norm, eps, c0, n_cols, gu, beta, linear_beta,
                                   weight.shape[1])
    return torch.nn.functional.linear(x, weight)


def shape_ok(M: int, N: int, K: int, D: int, n_cols: int, I: int) -> bool:
    """The shapes the fused form serves (where it measured faster than the pair: one token,
    ≤ PROLOGUE_MAX_COLS columns of a) and a GEMV mapping tiles; `supports` and the kernel plan
    (kernels/aot.py) both ask this."""
    if not (M == 1 and n_cols + I <= PROLOGUE_MAX_COLS and n_cols + I <= K and D % LAT_VEC == 0
            and n_cols <= D):
        return False
    try:
        G.config_for(M, N, K)
    except ValueError:
        return False
    return True


def supports(lat: torch.Tensor, w_norm: torch.Tensor, n_cols: int, gu: torch.Tensor,
             weight: torch.Tensor, out: torch.Tensor | None = None) -> bool:
    """Whether the CuTe kernel serves these (validated) operands; no exception: used by
    dispatch."""
    if not (cute_available() and lat.is_cuda and gu.is_cuda and weight.is_cuda):
        return False
    if (w_norm.dtype not in (torch.bfloat16, torch.float32) or not w_norm.is_contiguous()
            or w_norm.data_ptr() % 16
            or (out is not None and (not out.is_contiguous() or out.data_ptr() % 16))):
        return False
    M, D = lat.shape
    N, K = weight.shape
    return (shape_ok(M, N, K, D, n_cols, gu.shape[1] // 2)
            and lat.dtype == gu.dtype == torch.float32 and weight.dtype == torch.bfloat16
            and lat.is_contiguous() and weight.is_contiguous()
            and gu.stride(1) == 1 and gu.stride(0) % 4 == 0
            and all(t.data_ptr() % 16 == 0 for t in (lat, gu, weight)))


def norm_situ_gemv_cute(lat: torch.Tensor, w_norm: torch.Tensor, eps: float, c0: int,
                        n_cols: int, gu: torch.Tensor, beta: float, linear_beta: float | None,
                        weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (M, N) bf16 ← the fused op on operands `supports` accepted (the Triton module's
    `norm_situ_gemv` validates and dispatches here); no allocation, no host sync."""
    M, D = lat.shape
    N, K = weight.shape
    I = gu.shape[1] // 2
    cfg = G.config_for(M, N, K)
    has_lin = linear_beta is not None
    fn = compiled(M, N, K, D, n_cols, I, gu.stride(0), has_lin, cfg, w_norm.dtype)
    fn(lat, w_norm, gu, weight, out, c0, float(eps), float(beta),
       float(linear_beta) if has_lin else 1.0)
    return out


__all__ = ["NormSituGemvKernel", "cache_key", "compile_norm_situ_gemv", "compiled",
           "norm_situ_gemv_cute", "norm_situ_gemv_reference", "shape_ok", "supports"]
