"""Decode GEMV  y (M, N) = x (M, K) · Wᵀ  with W (N, K) bf16 row-major (nn.Linear layout).

Small-M decode projections are memory-bound: every weight byte is read once, the math is
2·M·N·K flops over 2·N·K bytes. The kernel runs on CUDA cores:

  * a lane group of L lanes (L a power of two ≤ 32, one warp holds 32/L groups) walks one row's
    K in 16-byte chunks (8 bf16): chunk c = (j·KW + kw)·L + kl, so the L lanes of a group read
    L·16 contiguous bytes per step (coalesced), and each lane holds R rows × J chunks of loads
    in flight (J = K / (8·L·KW), fully unrolled);
  * KW warps of a CTA split the same rows' K (split-K inside the CTA) when N alone gives too few
    warps to cover the HBM latency; their partial sums meet in shared memory;
  * fp32 accumulation; lanes of a group combine with butterfly shuffles;
  * x (M, K) is tiny and read through L1 by every warp; a CTA owns MT ≤ 8 rows of x (grid.x
    walks M in MT-row blocks, fastest, so CTAs that re-read the same W rows run together);
  * PDL (programmatic dependent launch, `GemvConfig.pdl`): the first batch of W loads is issued
    before `griddepcontrol.wait`, so weights stream while the previous kernel drains; x is read
    and y written only after the wait, so a dependent chain stays ordered.

Layers (STYLE §6): `GemvKernel` (@cute.jit host + @cute.kernel device) → `_compiled` cache keyed
by (dtype, M-bucket, N, K, config) → `gemv_into` (writes a caller-allocated `out`) → `gemv`
(allocates); the dispatch that chooses it over the skinny GEMM and cuBLAS is
kernels/linear.py. `gemv_reference` is the PyTorch reference.

M-bucket: M ≤ 8 compiles for that exact M (the decode engine pads batches to a few buckets).
8 < M ≤ 64 is supported by `gemv` (MT = 8-row blocks, W re-read per block) for testing, but
the dispatch sends no M > 2 to it: the FMA rate, not HBM, bounds this kernel from M ≈ 4 (M FMAs
per weight element; measured 0.33 of HBM bandwidth at M = 8).
The structure is generic SIMT code (no wgmma, no TMA), so it builds unchanged for sm_100/103.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from raydecode.kernels import settings
from raydecode.kernels._cute import CompileCache, cute_available
from raydecode.kernels._cute_dsl import (Float32, _dsl, _Stream, _Tensor, const_expr, cp_async_bulk_prefetch,
                                         cute, cutlass)


WARP = 32
VEC = 8  # bf16 elements per 16-byte load
MAX_M = 64  # largest M `gemv` accepts
MAX_M_TILE = 8  # x rows one CTA holds in registers
SUPPORTED_DTYPES = (torch.bfloat16,)


def gemv_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y (M, N) = x (M, K) · Wᵀ, accumulated in fp32, rounded to x.dtype."""
    return (x.float() @ w.float().t()).to(x.dtype)


@dataclass(frozen=True)
class GemvConfig:
    """Thread mapping of one GEMV launch (all compile-time constants)."""

    lanes_per_row: int  # L: lanes of a warp sharing one row's K (power of two, ≤ 32)
    k_warps: int  # KW: warps of a CTA splitting the same rows' K
    rows_per_group: int  # R: rows each lane group computes together
    row_warps: int  # WR: warp rows per CTA; CTA = KW·WR warps
    m_tile: int  # MT: rows of x per CTA
    batch: int = 0  # U: chunks per lane loaded together (double-buffered); 0 = auto
    pdl: bool = False  # programmatic dependent launch: W loads start before the previous kernel ends
    l2_prefetch_mib: int = 0  # > 0: bulk-prefetch the leading bytes of each row into L2 at entry,
    #                           at most this many MiB per launch (`prefetch_row_bytes`); 0 = off

    @property
    def groups_per_warp(self) -> int:
        return WARP // self.lanes_per_row

    @property
    def threads(self) -> int:
        return WARP * self.k_warps * self.row_warps

    @property
    def rows_per_cta(self) -> int:
        return self.row_warps * self.groups_per_warp * self.rows_per_group

    def chunks_per_lane(self, K: int) -> int:
        return K // VEC // (self.lanes_per_row * self.k_warps)

    def batch_for(self, K: int) -> int:
        """U: 16-byte chunks per lane per load batch; two batches are in flight at once."""
        J = self.chunks_per_lane(K)
        if self.batch:
            return min(self.batch, J)
        return max(1, min(J, 12 // (self.m_tile + self.rows_per_group)))

    def prefetch_row_bytes(self, N: int, K: int) -> int:
        """Bytes of each W row the entry prefetch requests (0: none): the whole row (2·K) while
        N rows fit the budget, else the leading floor16(budget / N) bytes, which the K-ordered
        loop reads first."""
        if self.l2_prefetch_mib <= 0:
            return 0
        return min(2 * K, (self.l2_prefetch_mib * 2**20 // N) // 16 * 16)

    def validate(self, M: int, N: int, K: int) -> None:
        """Raise ValueError when this mapping does not tile (M, N, K) exactly."""
        L, KW = self.lanes_per_row, self.k_warps
        problems = []
        if L < 1 or L > WARP or L & (L - 1):
            problems.append(f"lanes_per_row={L} must be a power of two in [1, 32]")
        if K % VEC or (K // VEC) % (L * KW):
            problems.append(f"K={K} must split into 16-byte chunks over lanes_per_row·k_warps={L * KW}")
        if N % self.rows_per_cta:
            problems.append(f"N={N} is not a multiple of rows_per_cta={self.rows_per_cta}")
        if not 1 <= self.m_tile <= MAX_M_TILE or M % self.m_tile:
            problems.append(f"m_tile={self.m_tile} must be in [1, {MAX_M_TILE}] and divide M={M}")
        if self.batch < 0:
            problems.append(f"batch={self.batch} must be ≥ 0 (0 = auto)")
        if self.l2_prefetch_mib < 0:
            problems.append(f"l2_prefetch_mib={self.l2_prefetch_mib} must be ≥ 0 (0 = off)")
        if self.threads > 1024:
            problems.append(f"{self.threads} threads per CTA exceeds 1024")
        if KW > 1 and self.rows_per_cta * self.m_tile > self.threads:
            problems.append("split-K partials exceed one per thread")
        if N // self.rows_per_cta > 65535:
            problems.append(f"N={N} needs more than 65535 CTAs in grid.y")
        if problems:
            raise ValueError(f"GemvConfig {self} does not fit (M={M}, N={N}, K={K}): " + "; ".join(problems))


def chunk_index(cfg: GemvConfig, j, kw, kl):
    """16-byte chunk of K read at step j by lane kl of split-K warp kw (plain arithmetic, so the
    kernel traces it with DSL integers and the CPU tests enumerate it with ints)."""
    return (j * cfg.k_warps + kw) * cfg.lanes_per_row + kl


def row_index(cfg: GemvConfig, nb, wr, grp, r):
    """Row of W (and column of y) computed by lane group grp of warp row wr in CTA nb."""
    return nb * cfg.rows_per_cta + (wr * cfg.groups_per_warp + grp) * cfg.rows_per_group + r


def _lanes_per_row(K: int) -> int:
    chunks = K // VEC
    L = WARP
    while L > 1 and chunks % L:
        L //= 2
    return L


def default_config(M: int, N: int, K: int, sm_count: int = 132) -> GemvConfig:
    """Heuristic mapping: enough warps to cover HBM latency, ≥ 2 chunks of loads per lane.

    Raises ValueError when the shape is not supported (see `supports`)."""
    if K % VEC:
        raise ValueError(f"K={K} must be a multiple of {VEC} (16-byte rows)")
    mt = _m_tile(M)
    L = _lanes_per_row(K)
    per_lane = K // VEC // L  # chunks per lane before split-K
    target_warps = sm_count * 16
    best = None
    for R in ((2, 1) if mt <= 2 else (1,)):
        for KW in range(1, 9):
            if per_lane % KW or (KW > 1 and per_lane // KW < 2):
                continue
            for WR in (4, 2, 1):
                if KW * WR > 8 and WR > 1:
                    continue
                cfg = GemvConfig(L, KW, R, WR, mt)
                try:
                    cfg.validate(M, N, K)
                except ValueError:
                    continue
                warps = (N // (cfg.groups_per_warp * R)) * KW
                # fewest split-K warps that reach the target; else the most warps available
                score = (warps >= target_warps, -KW if warps >= target_warps else warps, R, WR)
                if best is None or score > best[0]:
                    best = (score, cfg)
                break
    if best is None:
        raise ValueError(f"no GEMV mapping tiles M={M}, N={N}, K={K}")
    return best[1]


# Per-shape M = 1 mappings. First the fastest PDL launch of an 8-config sweep in
# bench/results/gemv-h200-2026-11-29-run2.json; then (marked *) the winners of
# scripts/explore/gemv_tune.py over 25 mappings per shape, adopted where ≥ 3% faster and confirmed
# inside the layer (bench/results/gemv-tune-h200-2026-11-30-tp{16,8}.json;
# the packed shapes of the served step had no entry before). H200, CUDA graph, rotating weights.
# Key (M, N, K) -> (lanes_per_row, k_warps, rows_per_group, row_warps); others use default_config.
TUNED: dict[tuple[int, int, int], GemvConfig] = {
    (1, N, K): GemvConfig(L, KW, R, WR, 1)
    for (N, K), (L, KW, R, WR) in {
        (1152, 1536): (32, 6, 2, 2), (2304, 1536): (32, 6, 4, 1), (2112, 7168): (32, 7, 4, 1),  # *
        (3216, 7168): (32, 4, 2, 1),  # * KDA in_proj TP16
        (6288, 7168): (16, 7, 2, 1),  # * KDA in_proj TP8
        (7168, 768): (16, 3, 4, 1),  # * o_proj TP16
        (7168, 1536): (32, 1, 2, 4),
        (3584, 7168): (16, 7, 2, 1),  # * latent_down (replicated, stock)
        (7168, 3584): (32, 1, 2, 4),
        (896, 7168): (16, 7, 1, 2),  # * router (replicated, stock)
        (768, 7168): (32, 7, 2, 2), (1536, 7168): (32, 2, 1, 4),
        (7168, 384): (16, 3, 2, 2), (10240, 7168): (32, 2, 4, 2), (20480, 7168): (32, 1, 2, 4),
        (16384, 7168): (32, 2, 4, 2),
        # * packed GEMVs of the specialized step (models/moe.py _h2_proj / _ffn_out,
        #   models/mla.py _qkv_a_g): TP16, then TP8
        (1048, 7168): (16, 7, 1, 1), (7168, 640): (8, 5, 4, 2), (900, 7168): (16, 8, 1, 2),
        (2096, 7168): (16, 7, 2, 1), (1800, 7168): (32, 7, 4, 1),
        # * W_q'' (models/mla.py _q_b_absorbed) TP16, its own sweep (3.46 -> 3.30 µs;
        #   bench/results/gemv-tune-h200-2026-11-30-r16-wq.json); TP8's 6912 × 1536 kept
        (3456, 1536): (32, 2, 4, 1),
    }.items()
}
# Launch with programmatic dependent launch (PDL): W loads overlap the previous kernel's tail.
PDL_DEFAULT = True


def _m_tile(M: int) -> int:
    if M <= MAX_M_TILE:
        return M
    return max(d for d in range(1, MAX_M_TILE + 1) if M % d == 0)


def config_for(M: int, N: int, K: int, l2_prefetch_mib: int = 0,
               overrides: tuple = ()) -> GemvConfig:
    """The launch config of an (M, N, K) GEMV: `overrides` ((N, K), GemvConfig) pairs for
    M = 1 (DecodeOptions.gemv_configs, A/B runs), else the TUNED entry, else `default_config`;
    with PDL and the entry L2 prefetch budget (an experiment, 0 = off:
    DecodeOptions.gemv_l2_prefetch_mib). Raises ValueError when no mapping tiles the shape."""
    return _config_for(M, N, K, PDL_DEFAULT, l2_prefetch_mib, overrides)


@functools.lru_cache(maxsize=4096)
def _config_for(M: int, N: int, K: int, pdl: bool, l2_prefetch_mib: int,
                overrides: tuple) -> GemvConfig:
    # memoized: default_config's search cost ≈ 35 µs of host time per GEMV call (an eager
    # K3 TP16 step made 3126 calls: 108 ms of its 213; bench/results/step-*.json host profile)
    mine = next((c for nk, c in overrides if tuple(nk) == (N, K)), None) if M == 1 else None
    cfg = mine or TUNED.get((M, N, K)) or default_config(M, N, K)
    return replace(cfg, pdl=pdl, l2_prefetch_mib=l2_prefetch_mib)


def supports(x: torch.Tensor, w: torch.Tensor, max_m: int = MAX_M, l2_prefetch_mib: int = 0,
             overrides: tuple = ()) -> bool:
    """Shapes/dtypes/layouts the CuTe kernel handles (no exception: used by dispatch)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        return False
    if x.dtype not in SUPPORTED_DTYPES or w.dtype != x.dtype:
        return False
    if not (x.is_cuda and w.is_cuda and x.device == w.device):
        return False
    M, K = x.shape
    N = w.shape[0]
    if not 1 <= M <= max_m or K % VEC or N < 1:
        return False
    if not (x.is_contiguous() and w.is_contiguous()):
        return False
    if x.data_ptr() % 16 or w.data_ptr() % 16:
        return False
    try:
        config_for(M, N, K, l2_prefetch_mib, overrides)
    except ValueError:
        return False
    return True


class GemvKernel:
    """One compiled GEMV for fixed (M, N, K, config); bf16 in, fp32 accumulation, y in the
    output tensor's dtype (bf16, or fp32 for consumers that keep full precision: the router)."""

    def __init__(self, M: int, N: int, K: int, cfg: GemvConfig):
        cfg.validate(M, N, K)
        self.M, self.N, self.K, self.cfg = M, N, K, cfg

    @_dsl.jit
    def __call__(self, mX: _Tensor, mW: _Tensor, mY: _Tensor, stream: _Stream):
        cfg = self.cfg
        self.kernel(mX, mW, mY).launch(
            grid=[self.M // cfg.m_tile, self.N // cfg.rows_per_cta, 1],
            block=[cfg.threads, 1, 1],
            stream=stream,
            use_pdl=cfg.pdl,
        )

    @_dsl.kernel
    def kernel(self, mX: _Tensor, mW: _Tensor, mY: _Tensor):
        self._gemv(mW, mY, lambda smem, tidx, warp, lane: cute.zipped_divide(mX, (1, VEC)))

    @_dsl.jit
    def _gemv(self, mW: _Tensor, mY: _Tensor, x_tiles):
        """The kernel body. x_tiles(smem, tidx, warp, lane) -> x as ((1, 8), (M, K/8)) tiles,
        called after the PDL wait: the plain GEMV's x in global memory, or an operand a fused
        prologue builds in shared memory (kernels/gemv_norm_situ.py)."""
        cfg = self.cfg
        L = cfg.lanes_per_row
        KW = cfg.k_warps
        R = cfg.rows_per_group
        MT = cfg.m_tile
        G = cfg.groups_per_warp
        J = cfg.chunks_per_lane(self.K)

        tidx, _, _ = cute.arch.thread_idx()
        mb, nb, _ = cute.arch.block_idx()
        warp = tidx // WARP
        lane = tidx % WARP
        kw = warp % KW
        wr = warp // KW
        grp = lane // L
        kl = lane % L
        row0 = row_index(cfg, nb, wr, grp, 0)  # this group's R rows of W / y: row0 .. row0+R-1
        m0 = mb * MT

        gW = cute.zipped_divide(mW, (1, VEC))  # ((1, 8), (N, K/8))

        # acc[i][r]: 8 fp32 partial sums (one per element of a 16-byte chunk) of y[m0+i, row0+r]
        acc = [[cute.full((VEC,), 0.0, Float32) for _ in range(R)] for _ in range(MT)]
        # two load buffers (U chunks × rows × 8), row-major so one 16-byte load fills 8 values
        U = cfg.batch_for(self.K)
        n_batches = (J + U - 1) // U
        bufs = []
        for _ in cutlass.range_constexpr(2):
            rx = cute.make_rmem_tensor(
                cute.make_layout((U, MT, VEC), stride=(MT * VEC, VEC, 1)), mW.element_type)
            rw = cute.make_rmem_tensor(
                cute.make_layout((U, R, VEC), stride=(R * VEC, VEC, 1)), mW.element_type)
            bufs.append((rx, rw))
        # W never depends on the previous kernel: its first batch is requested before the PDL wait,
        # so it streams while the previous grid drains; x (and the y store) come after the wait.
        # Entry L2 prefetch (`l2_prefetch_mib`): in the first M-tile's CTA, lane 0 of warp w asks
        # for the leading `prefetch_row_bytes` of the CTA's rows w, w + warps, … (one lane per
        # warp: a bulk prefetch is a uniform instruction, so divergent lanes would serialize).
        # Bulk prefetches hold no registers or shared memory, so the whole tile can be in flight
        # at once (the register loads keep only a few chunks per lane); under PDL they run while
        # the previous kernel drains.
        pf = cfg.prefetch_row_bytes(self.N, self.K)
        if const_expr(pf > 0):
            n_warps = cfg.threads // WARP
            for w0 in cutlass.range_constexpr(0, cfg.rows_per_cta, n_warps):
                if mb == 0 and lane == 0 and warp + w0 < cfg.rows_per_cta:
                    cp_async_bulk_prefetch(mW.iterator + (nb * cfg.rows_per_cta + warp + w0) * self.K, pf)
        self._load_w(gW, bufs[0], 0, U, J, row0, kw, kl)
        if const_expr(cfg.pdl):
            cute.arch.griddepcontrol_launch_dependents()
            cute.arch.griddepcontrol_wait()
        smem = cutlass.memory.SmemAllocator()
        gX = x_tiles(smem, tidx, warp, lane)  # ((1, 8), (M, K/8)), x's dtype = W's
        self._load_x(gX, bufs[0], 0, U, J, m0, kw, kl)
        for b in cutlass.range_constexpr(n_batches):
            if const_expr(b + 1 < n_batches):  # batch b+1 in flight while batch b is summed
                self._load_w(gW, bufs[(b + 1) % 2], b + 1, U, J, row0, kw, kl)
                self._load_x(gX, bufs[(b + 1) % 2], b + 1, U, J, m0, kw, kl)
            self._fma_batch(acc, bufs[b % 2], min(U, J - b * U))

        if const_expr(KW == 1):
            for i in cutlass.range_constexpr(MT):
                for r in cutlass.range_constexpr(R):
                    s = acc[i][r].reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    s = cute.arch.warp_reduction_sum(s, threads_in_group=L)
                    if kl == 0:
                        mY[(m0 + i, row0 + r)] = s.to(mY.element_type)
        else:
            # partials (KW, rows_per_cta·MT): slot = (local row)·MT + i
            red = smem.allocate_tensor(
                Float32, cute.make_layout((KW, cfg.rows_per_cta * MT), stride=(cfg.rows_per_cta * MT, 1)),
                byte_alignment=16,
            )
            local_row0 = (wr * G + grp) * R
            for i in cutlass.range_constexpr(MT):
                for r in cutlass.range_constexpr(R):
                    s = acc[i][r].reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    s = cute.arch.warp_reduction_sum(s, threads_in_group=L)
                    if kl == 0:
                        red[(kw, (local_row0 + r) * MT + i)] = s
            cute.arch.sync_threads()
            if tidx < cfg.rows_per_cta * MT:
                t = red[(0, tidx)]
                for q in cutlass.range_constexpr(1, KW):
                    t = t + red[(q, tidx)]
                mY[(m0 + tidx % MT, nb * cfg.rows_per_cta + tidx // MT)] = t.to(mY.element_type)

    def _load_w(self, gW, buf, b, U, J, row0, kw, kl):
        """Issue batch b's 16-byte W loads (steps j = b·U + u, rows row0 .. row0+R-1)."""
        cfg = self.cfg
        for u in range(min(U, J - b * U)):
            ck = chunk_index(cfg, b * U + u, kw, kl)
            for r in range(cfg.rows_per_group):
                cute.autovec_copy(gW[(None, (row0 + r, ck))], buf[1][(u, r, None)])

    def _load_x(self, gX, buf, b, U, J, m0, kw, kl):
        """Issue batch b's 16-byte x loads (rows m0 .. m0+MT-1 of x; L1-resident after first use)."""
        cfg = self.cfg
        for u in range(min(U, J - b * U)):
            ck = chunk_index(cfg, b * U + u, kw, kl)
            for i in range(cfg.m_tile):
                cute.autovec_copy(gX[(None, (m0 + i, ck))], buf[0][(u, i, None)])

    def _fma_batch(self, acc, buf, n):
        """acc[i][r] (8 fp32 lanes) += w[r, :] · x[i, :] elementwise over the batch's n chunks."""
        cfg = self.cfg
        rx, rw = buf
        for u in range(n):
            xs = [rx[(u, i, None)].load().to(Float32) for i in range(cfg.m_tile)]
            for r in range(cfg.rows_per_group):
                wv = rw[(u, r, None)].load().to(Float32)
                for i in range(cfg.m_tile):
                    acc[i][r] = acc[i][r] + wv * xs[i]


_CACHE = CompileCache()
_TORCH_TO_CUTE = {}


def _cute_dtype(dtype: torch.dtype):
    if not _TORCH_TO_CUTE:
        _TORCH_TO_CUTE[torch.bfloat16] = cutlass.BFloat16
        _TORCH_TO_CUTE[torch.float32] = cutlass.Float32
    return _TORCH_TO_CUTE[dtype]


def compile_gemv(dtype: torch.dtype, M: int, N: int, K: int, cfg: GemvConfig, ffi: bool | None = None,
                 out_dtype: torch.dtype | None = None):
    """cute.compile one GEMV for static (M, N, K); returns `launch(x, w, out)` that enqueues on the
    current torch stream (so it can be captured in a CUDA graph). out_dtype: y's dtype (default
    `dtype`; torch.float32 keeps the fp32 accumulator unrounded).

    ffi=True: TVM-FFI entry (torch tensors passed straight through, microseconds of host time);
    ffi=False: DLPack wrappers + an explicit stream per call. None: `FFI_DEFAULT`."""
    ffi = FFI_DEFAULT if ffi is None else ffi
    el = _cute_dtype(dtype)
    fake = cute.runtime.make_fake_compact_tensor
    mx = fake(el, (M, K), stride_order=(1, 0), assumed_align=16)
    mw = fake(el, (N, K), stride_order=(1, 0), assumed_align=16)
    my = fake(_cute_dtype(out_dtype or dtype), (M, N), stride_order=(1, 0), assumed_align=16)
    kernel = GemvKernel(M, N, K, cfg)
    if ffi:
        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        return cute.compile(kernel, mx, mw, my, stream, options="--enable-tvm-ffi")
    from cuda.bindings.driver import CUstream
    from cutlass.cute.runtime import from_dlpack

    compiled = cute.compile(kernel, mx, mw, my, CUstream(0))

    def launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        stream = CUstream(torch.cuda.current_stream(x.device).cuda_stream)
        compiled(*(from_dlpack(t, assumed_align=16) for t in (x, w, out)), stream)

    return launch


# TVM-FFI launch path; RAYDECODE_CUTE_TVM_FFI=0 selects DLPack + explicit stream (hosts without tvm-ffi)
FFI_DEFAULT = settings.cute_tvm_ffi()


def _compiled(dtype: torch.dtype, M: int, N: int, K: int, cfg: GemvConfig,
              out_dtype: torch.dtype | None = None):
    out_dtype = out_dtype or dtype

    def build():
        if FFI_DEFAULT:  # persistent node cache ($RAYDECODE_KERNEL_CACHE; kernels/aot_store.py)
            from raydecode.kernels.aot_store import load_or_compile_gemv

            hit = load_or_compile_gemv(dtype, M, N, K, cfg, compile_gemv, out_dtype=out_dtype)
            if hit is not None:
                return hit
        return compile_gemv(dtype, M, N, K, cfg, out_dtype=out_dtype)

    return _CACHE.get((dtype, M, N, K, cfg, FFI_DEFAULT, out_dtype), build)


def gemv_into(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, config: GemvConfig | None = None) -> torch.Tensor:
    """out (M, N) ← x (M, K) · Wᵀ with the CuTe kernel; no allocation, no host sync. `out` is
    x's dtype (rounded once) or torch.float32 (the accumulator as is)."""
    if not cute_available():
        raise RuntimeError("gemv_into needs CUDA and nvidia-cutlass-dsl; use linear() to fall back")
    if not supports(x, w):
        raise ValueError(
            f"gemv: unsupported x {tuple(x.shape)} {x.dtype} / w {tuple(w.shape)} {w.dtype}: need 2-D "
            f"contiguous 16-byte-aligned CUDA bf16 tensors, 1 ≤ M ≤ {MAX_M}, K a multiple of {VEC}"
        )
    M, K = x.shape
    N = w.shape[0]
    if (out.shape != (M, N) or out.dtype not in (x.dtype, torch.float32) or not out.is_contiguous()
            or out.device != x.device or out.data_ptr() % 16):
        raise ValueError(f"gemv: out must be a contiguous 16-byte-aligned {x.dtype} or torch.float32 "
                         f"tensor of shape ({M}, {N}) on {x.device}; got {tuple(out.shape)} {out.dtype}")
    cfg = config or config_for(M, N, K)
    _compiled(x.dtype, M, N, K, cfg, out.dtype)(x, w, out)
    return out


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, config: GemvConfig | None = None,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y (M, N) = x (M, K) · Wᵀ on the CuTe kernel (allocates `out` of `out_dtype`, default x's,
    when not given)."""
    if out is None:
        out = torch.empty((x.shape[0], w.shape[0]), dtype=out_dtype or x.dtype, device=x.device)
    return gemv_into(x, w, out, config)


def weight_bytes(N: int, K: int, dtype: torch.dtype = torch.bfloat16) -> int:
    return N * K * torch.empty((), dtype=dtype).element_size()


def predicted_us(N: int, K: int, bandwidth_bytes_per_s: float = 4.3e12) -> float:
    """HBM floor: the weight read once at `bandwidth` (x and y are negligible)."""
    return weight_bytes(N, K) / bandwidth_bytes_per_s * 1e6


__all__ = [
    "GemvConfig",
    "GemvKernel",
    "chunk_index",
    "compile_gemv",
    "config_for",
    "default_config",
    "gemv",
    "gemv_into",
    "gemv_reference",
    "predicted_us",
    "row_index",
    "supports",
    "weight_bytes",
]
