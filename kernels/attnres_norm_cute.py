"""CuTe DSL kernel of the fused AttnRes mix + RMSNorm (kernels/attnres_norm.py has the math).

Shapes (per call): bank (T, n, H) bf16 (n block snapshots, strided slots of one tensor, last dim
contiguous), prefix / out / new_prefix / h / mix (T, H) bf16 rows, weights w_res, w_proj, w_out
(H,) fp32 or bf16. Every token's math (rounding points as the references):

    V   = [b_0 … b_{n-1}, p]          add form first: p ← bf16(p + o), stored to new_prefix
    s_j = (Σ V_j·w_res·w_proj) · rsqrt(Σ V_j² / H + eps_res)               fp32, j = 0..n
    mix = bf16(Σ_j softmax(s)_j · V_j)  (fp32 sum)
    h   = bf16(mix · rsqrt(Σ mix² / H + eps_out) · w_out)

Mapping: a token is `cluster` CTAs (k ∈ {1, 2, 4}, a thread-block cluster), CTA r owning the
chunks [r·H/8k, (r+1)·H/8k) of every row; in a CTA chunk c belongs to thread c mod threads
(C = H / 8 / k / threads chunks each, coalesced per warp).

  1. the weight chunks are requested before the PDL wait (they never depend on the previous
     kernel), then ALL (n+1)·C bank/prefix chunks (and the C `out` chunks) of the token are
     requested (into registers or shared memory, below) before any is used: the token costs one
     HBM round trip, not n+1 dependent ones (the Triton kernel's 8 µs at batch 1);
  2. per thread the 2(n+1) partial sums (Σv², Σv·w_res·w_proj), warp butterflies, one
     shared-memory pass (NW ≤ 32 warps × 2(n+1)), every warp re-reduces the NW partials by a
     butterfly; k > 1: thread 0 publishes the CTA's sums, cluster barrier, every thread adds the
     k CTAs' sums through DSMEM in rank order (identical in every CTA); softmax in registers;
  3. mix in fp32 from the held values, rounded; Σ mix² reduced the same way; h written with
     16-byte stores (a last cluster barrier keeps each CTA's sums alive for its peers).

Where the values wait (`MixNormConfig.smem_values`, chosen by `default_config`):
  * registers (4·C·(n+1) 32-bit registers per thread, 16-byte LDG straight into them): the
    fewest threads with C ≤ 2 whose estimate (`estimated_registers`) fits the per-thread cap
    ptxas applies (4 register quadrants of 16384: 448 threads -> 128, 896 -> 72). K3 rows
    (H = 7168, fp32 weights), k = 1: n ≤ 4 -> 448 threads, C = 2, 128 registers, no spills;
    k = 4: 224 threads, C = 1, 79 (n = 4) to 127 (n = 8) registers;
  * shared memory (k = 1 and n ≥ 5 at K3 rows; ptxas spilled from n = 5 in registers): one
    16-byte cp.async (LDGSTS) per chunk, all issued, then cp.async.wait_all; 448 threads;
    (n+2)·(H/k)·2 bytes of dynamic shared memory (n ≤ 13 at H = 7168, k = 1, in 227 KB).
`cluster_for` picks k from the batch (measured, see there). Compile facts (CUTE_DSL_ARCH=sm_90a,
ptxas): every global access 128-bit, no local memory, all value loads issued before the first
shuffle (tests/cpu/test_attnres_cute.py checks the SASS).

Prediction (before measuring; `predicted_us`, one CTA per token): batch 1 ≈ 2.5 µs (one 72 KB
round trip at one SM's request rate ≈ 1 µs + ~1.5 µs latency, barriers, launch), batch 64
≈ 2.8 µs, vs ~8 µs for the Triton kernel.
Outcome (H200, 2026-11-29, residual form, H = 7168, per call in a CUDA graph of back-to-back
calls over 128 MB of banks, tests/gpu/test_attnres_cute.py::test_timing_vs_triton; printed by
that test, not committed as JSON — indicative only; the committed in-layer figure is 4.4 µs per
call in bench/results/layer-h200-2026-11-29-r3.json's profile):
  n = 4: T = 1 3.8 µs (k = 4; one CTA 4.3 µs), T = 64 5.4 µs (k = 1); Triton 7.9 / 8.7 µs;
  n = 8: T = 1 4.9 µs (k = 4; one CTA 7.2 µs), T = 64 7.1 µs (k = 2, 224 threads); Triton
  12.7 / 13.8 µs. One CTA streams ≈ 20–25 GB/s (marginal µs per extra row), so the prediction's
  per-SM rate was 3× optimistic; what is left at batch 1 is latency and launch, not bytes.

Layers (STYLE §6): `MixNormKernel` (@cute.jit host + @cute.kernel device) → `_compiled` cache
keyed by (n, H, dtypes, forms, config) → `mix_norm_cute` (same inputs/outputs as
`attnres_norm_triton.mix_norm_triton`; None when `problem` names an unsupported layout, so the
dispatcher falls back). T and every row stride are runtime values (one compile per n, H).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from raydecode.kernels._cute import CompileCache, cute_available
from raydecode.kernels._cute_dsl import Float32, _dsl, _Stream, _Tensor, const_expr, cute, cutlass
from raydecode.kernels.attnres_norm_triton import bank_view

if cutlass is not None:
    from cutlass._mlir.dialects import llvm as _llvm
    from cutlass.cutlass_dsl import T as _T, dsl_user_op as _user_op

    @_user_op
    def _load_peer_f32(ptr, rank, *, loc=None, ip=None):
        """fp32 at the same shared-memory offset as `ptr` in cluster CTA `rank`
        (mapa + ld.shared::cluster)."""
        return Float32(_llvm.inline_asm(
            _T.f32(), [ptr.toint(loc=loc, ip=ip).ir_value(),
                       cutlass.Int32(rank).ir_value(loc=loc, ip=ip)],
            "{ .reg .u32 a; mapa.shared::cluster.u32 a, $1, $2; ld.shared::cluster.f32 $0, [a]; }",
            "=f,r,r", has_side_effects=True, is_align_stack=False,
            asm_dialect=_llvm.AsmDialect.AD_ATT))


WARP = 32
VEC = 8                        # bf16 elements per 16-byte chunk
MAX_BLOCKS = 16                # n: block snapshots besides the prefix
MAX_THREADS = 1024
REG_FILE = 65536               # 32-bit registers per SM (one CTA may use them all)
ACT_DTYPES = (torch.bfloat16,)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16)
PDL_DEFAULT = True             # weight loads overlap the previous kernel's tail
CLUSTERS = (1, 2, 4, 8)        # CTAs per token (portable cluster sizes)
SMEM_PER_CTA = 227 * 1024      # sm_90 opt-in maximum (the DSL sets the kernel attribute)
SMEM_THREADS = 448             # threads of the shared-memory staged mapping
CLUSTER_MAX = 4                # largest cluster `cluster_for` picks
REG_MAX_CHUNKS = 2             # register staging only up to 2 chunks per row per thread: ptxas
                               # spilled at C = 4 even under the estimate (n = 6, 224 threads)


@dataclass(frozen=True)
class MixNormConfig:
    """Thread mapping of one launch (compile-time constants)."""

    threads: int               # per CTA (one CTA per token), a multiple of 32, ≤ 1024
    pdl: bool = False          # programmatic dependent launch
    smem_values: bool = False  # stage the value rows in shared memory (cp.async), not registers
    cluster: int = 1           # CTAs per token (a thread-block cluster), each owning H / cluster

    @property
    def warps(self) -> int:
        return self.threads // WARP

    def chunks_per_thread(self, H: int) -> int:
        return H // VEC // self.cluster // self.threads

    def chunks_per_cta(self, H: int) -> int:
        return H // VEC // self.cluster

    def smem_bytes(self, n: int, H: int, add: bool = True) -> int:
        """Shared memory: staged rows ((n+1) values + `out`) and the two reduction buffers."""
        rows = (n + 1 + int(add)) * (H // self.cluster) * 2 if self.smem_values else 0
        return rows + (WARP + 1) * 4 * (2 * (n + 1) + 1) + 64

    def validate(self, n: int, H: int) -> None:
        """Raise ValueError when this mapping does not tile (n, H) exactly."""
        problems = []
        if not 0 <= n <= MAX_BLOCKS:
            problems.append(f"n={n} block snapshots: accepted 0..{MAX_BLOCKS}")
        if H <= 0 or H % VEC:
            problems.append(f"H={H} must be a positive multiple of {VEC} (16-byte chunks)")
        if self.threads % WARP or not WARP <= self.threads <= MAX_THREADS:
            problems.append(f"threads={self.threads} must be a multiple of {WARP} in "
                            f"[{WARP}, {MAX_THREADS}]")
        elif H > 0 and H % VEC == 0 and (H // VEC) % (self.threads * self.cluster):
            problems.append(f"H={H} ({H // VEC} chunks of {VEC}) does not split over "
                            f"cluster={self.cluster} × threads={self.threads}")
        if self.cluster not in CLUSTERS:
            problems.append(f"cluster={self.cluster}: accepted {CLUSTERS}")
        if self.smem_bytes(n, H) > SMEM_PER_CTA:
            problems.append(f"{self.smem_bytes(n, H)} bytes of shared memory > {SMEM_PER_CTA}")
        if problems:
            raise ValueError(f"MixNormConfig {self} does not fit (n={n}, H={H}): "
                             + "; ".join(problems))


def estimated_registers(n: int, H: int, threads: int, weight_bytes: int = 4,
                        add: bool = True) -> int:  # H: the columns one CTA owns
    """32-bit registers per thread: the held values (bf16 pairs), w_res·w_proj (fp32) and w_out,
    the `out` chunks, the 2(n+1) partial sums, and ~32 of addresses and indices (calibrated on
    ptxas reports: n = 5 at 448 threads spills with fp32 weights, n = 4 does not)."""
    C = H // VEC // threads
    values = 4 * C * (n + 1) + (4 * C if add else 0)
    weights = 8 * C + C * VEC * weight_bytes // 4
    return values + weights + 2 * (n + 1) + 32


def register_budget(threads: int) -> int:
    """Per-thread register cap ptxas applies at `threads` threads (reqntid): the register file
    is 4 quadrants of 16384, warps spread round-robin, 8-register steps (448 threads -> 128,
    896 -> 72, as the ptxas reports show)."""
    warps_per_quadrant = -(-(threads // WARP) // 4)
    return min(255, REG_FILE // 4 // (WARP * warps_per_quadrant) // 8 * 8)


def default_config(n: int, H: int, pdl: bool = PDL_DEFAULT,
                   weight_dtype: torch.dtype = torch.float32, cluster: int = 1) -> MixNormConfig:
    """Each of the `cluster` CTAs of a token owns H / cluster columns. Values in registers on the
    most threads (≤ 1024, C ≤ REG_MAX_CHUNKS) whose register estimate fits the budget; when none
    fits (large n·H), the values are staged in shared memory by cp.async on 448 threads (or the
    most below; measured faster than 896 at n = 8). Raises ValueError when no mapping tiles H
    (or the staged rows exceed shared memory)."""
    if H <= 0 or H % VEC:
        raise ValueError(f"H={H} must be a positive multiple of {VEC} (16-byte chunks)")
    if cluster not in CLUSTERS or (H // VEC) % cluster:
        raise ValueError(f"cluster={cluster}: accepted {CLUSTERS} dividing H/8={H // VEC}")
    chunks = H // VEC // cluster
    options = [t for t in range(WARP, MAX_THREADS + 1, WARP) if chunks % t == 0]
    if not options:
        raise ValueError(f"H={H} ({chunks} chunks of {VEC} per CTA) does not split over a "
                         f"multiple of {WARP} threads ≤ {MAX_THREADS}")
    wb = torch.empty((), dtype=weight_dtype).element_size()
    fits = [t for t in options if chunks // t <= REG_MAX_CHUNKS
            and estimated_registers(n, H // cluster, t, wb) <= register_budget(t)]
    if fits:   # fewest threads (C = 2 where it tiles): measured faster than C = 1 at k = 1, 2
        cfg = MixNormConfig(min(fits), pdl, False, cluster)
    else:
        staged = [t for t in options if t <= SMEM_THREADS] or options
        cfg = MixNormConfig(max(staged), pdl, True, cluster)
    cfg.validate(n, H)
    return cfg


def cluster_for(T: int, n: int, H: int, sms: int = 132) -> int:
    """CTAs per token. One CTA streams its token at one SM's request rate, so small batches
    spread each token over a cluster of CLUSTER_MAX SMs while T·4 CTAs fit one wave; mid
    batches use 2 only where one CTA could not hold the values in registers (n ≥ 5 at K3 rows).
    Measured (H200, residual form, H = 7168): T = 1: k = 4 3.8 µs vs k = 1 4.3 µs (n = 4), 4.9 vs
    7.2 µs (n = 8); T = 64: k = 1 5.4 µs vs k = 2 6.5 µs (n = 4), k = 2 7.1 vs k = 1 8.8 µs (n = 8)."""
    def tiles(k):
        return (H // VEC) % (k * WARP) == 0
    if T * CLUSTER_MAX <= sms and tiles(CLUSTER_MAX):
        return CLUSTER_MAX
    if T * 2 <= sms and tiles(2):
        try:
            if default_config(n, H).smem_values:
                return 2
        except ValueError:
            return 2
    return 1


@functools.lru_cache(maxsize=None)
def _auto_config(n: int, H: int, T: int, weight_dtype: torch.dtype) -> MixNormConfig:
    """`default_config` on `cluster_for(T, H)` CTAs per token (one CTA when that does not tile)."""
    try:
        return default_config(n, H, weight_dtype=weight_dtype, cluster=cluster_for(T, n, H))
    except ValueError:
        return default_config(n, H, weight_dtype=weight_dtype)


def _rows_ok(x: torch.Tensor) -> bool:
    """16-byte aligned rows: last dim contiguous, every other stride a multiple of 8."""
    return (x.stride(-1) == 1 and all(s % VEC == 0 for s in x.stride()[:-1])
            and x.data_ptr() % 16 == 0)


def problem(bank: torch.Tensor | None, prefix: torch.Tensor, weights, out=None, new_prefix=None,
            h=None, mix=None) -> str | None:
    """Why the CuTe kernel cannot take these tensors (None: it can). bank (T, n, H) or None
    (n = 0); weights (w_res (H,), w_proj (1, H) or (H,), w_out (H,)). Device-independent, so the
    CPU tests exercise it."""
    if prefix.dim() != 2:
        return f"prefix of shape {tuple(prefix.shape)}; expected (T, H)"
    T, H = prefix.shape
    if bank is not None and (bank.dim() != 3 or bank.shape[0] != T or bank.shape[2] != H):
        return f"bank of shape {tuple(bank.shape)}; expected ({T}, n, {H})"
    n = 0 if bank is None else bank.shape[1]
    try:
        default_config(n, H)
    except ValueError as e:
        return str(e)
    if bank is not None and n == 0:
        bank = None
    if T < 1:
        return f"T={T} tokens; expected ≥ 1"
    rows = {"prefix": prefix, "bank": bank, "out": out, "new_prefix": new_prefix, "h": h,
            "mix": mix}
    for name, x in rows.items():
        if x is None:
            continue
        if x.dtype not in ACT_DTYPES:
            return f"{name} dtype {x.dtype}; accepted {ACT_DTYPES}"
        if name != "bank" and tuple(x.shape) != (T, H):
            return f"{name} of shape {tuple(x.shape)}; expected ({T}, {H})"
        if not _rows_ok(x):
            return (f"{name} strides {x.stride()} / address {x.data_ptr():#x}: need a contiguous "
                    f"last dim, other strides multiples of {VEC}, 16-byte aligned")
        if x.device != prefix.device:
            return f"{name} on {x.device}; expected {prefix.device} like the prefix"
    for name, w in zip(("res_norm_w", "res_proj_w", "out_norm_w"), weights):
        if w.dtype not in WEIGHT_DTYPES:
            return f"{name} dtype {w.dtype}; accepted {WEIGHT_DTYPES}"
        if w.numel() != H or not w.is_contiguous() or w.data_ptr() % 16:
            return f"{name} of shape {tuple(w.shape)}: need {H} contiguous 16-byte-aligned values"
        if w.device != prefix.device:
            return f"{name} on {w.device}; expected {prefix.device}"
    return None


class MixNormKernel:
    """One compiled mix + norm for fixed (n, H, forms, config); T and row strides at run time.

    Tensors: mB bank (T, max(n, 1), H) (unread when n = 0), mP prefix, mO out, mNP new_prefix,
    mMix, mH (T, H); mWr, mWp, mWo (H,). Unused outputs/inputs of a form are passed as dummies
    and never touched (`add`, `write_mix` are compile-time)."""

    def __init__(self, n: int, H: int, cfg: MixNormConfig, add: bool, write_mix: bool):
        cfg.validate(n, H)
        self.n, self.H, self.cfg, self.add, self.write_mix = n, H, cfg, add, write_mix

    @_dsl.jit
    def __call__(self, mB: _Tensor, mP: _Tensor, mO: _Tensor, mNP: _Tensor, mWr: _Tensor,
                 mWp: _Tensor, mWo: _Tensor, mMix: _Tensor, mH: _Tensor, res_eps: Float32,
                 out_eps: Float32, stream: _Stream):
        K_ = self.cfg.cluster
        self.kernel(mB, mP, mO, mNP, mWr, mWp, mWo, mMix, mH, res_eps, out_eps).launch(
            grid=[mP.shape[0] * K_, 1, 1],
            block=[self.cfg.threads, 1, 1],
            cluster=[K_, 1, 1] if const_expr(K_ > 1) else None,
            stream=stream,
            use_pdl=self.cfg.pdl,
        )

    @_dsl.kernel
    def kernel(self, mB: _Tensor, mP: _Tensor, mO: _Tensor, mNP: _Tensor, mWr: _Tensor,
               mWp: _Tensor, mWo: _Tensor, mMix: _Tensor, mH: _Tensor, res_eps: Float32,
               out_eps: Float32):
        cfg = self.cfg
        NB = self.n                  # block snapshots; value row NB is the prefix
        NV = NB + 1
        NT = cfg.threads
        C = cfg.chunks_per_thread(self.H)
        act = mP.element_type

        K_ = cfg.cluster
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        t = bidx // K_                                # token; CTA rank r owns chunks r·CPK ..
        first = (bidx % K_) * cfg.chunks_per_cta(self.H) if const_expr(K_ > 1) else 0
        warp = tidx // WARP
        lane = tidx % WARP

        gB = cute.zipped_divide(mB, (1, 1, VEC))     # ((1, 1, 8), (T, n, H/8))
        gP = cute.zipped_divide(mP, (1, VEC))        # ((1, 8), (T, H/8)), same for O, NP, Mix, H
        gO = cute.zipped_divide(mO, (1, VEC))
        gNP = cute.zipped_divide(mNP, (1, VEC))
        gMix = cute.zipped_divide(mMix, (1, VEC))
        gH = cute.zipped_divide(mH, (1, VEC))
        gW = [cute.zipped_divide(w, (VEC,)) for w in (mWr, mWp, mWo)]   # ((8,), (H/8,))

        def chunk(i):                                 # this thread's i-th chunk of a row
            return first + tidx + i * NT

        def vec_tensor(rows, dtype):                  # (rows, 8) registers, row-major
            return cute.make_rmem_tensor(cute.make_layout((rows, VEC), stride=(VEC, 1)), dtype)

        # weights never depend on the previous kernel: requested before the PDL wait
        rW = [vec_tensor(C, w.element_type) for w in (mWr, mWp, mWo)]
        for k in cutlass.range_constexpr(3):
            for i in cutlass.range_constexpr(C):
                cute.autovec_copy(gW[k][(None, chunk(i))], rW[k][(i, None)])
        if const_expr(cfg.pdl):
            cute.arch.griddepcontrol_launch_dependents()
            cute.arch.griddepcontrol_wait()

        smem = cutlass.memory.SmemAllocator()
        # partials (32 warp slots, q) column-major: lane w reads slot w of column q conflict-free
        red_s = smem.allocate_tensor(Float32, cute.make_layout((WARP, 2 * NV), stride=(1, WARP)),
                                     byte_alignment=16)
        red_h = smem.allocate_tensor(Float32, cute.make_layout((WARP, 1), stride=(1, WARP)),
                                     byte_alignment=16)
        # this CTA's totals, read by the other CTAs of the cluster (DSMEM)
        xs_s = smem.allocate_tensor(Float32, cute.make_layout(2 * NV), byte_alignment=16)
        xs_h = smem.allocate_tensor(Float32, cute.make_layout(1), byte_alignment=16)

        # every value chunk of the token in flight before any is used. Row NV holds `out`.
        NR = NV + (1 if const_expr(self.add) else 0)
        if const_expr(cfg.smem_values):
            # sV (rows, C, threads, 8): thread tid's chunk i of row j at ((j·C + i)·NT + tid)·16 B,
            # consecutive threads on consecutive 16 bytes (conflict-free cp.async and reads)
            sV = smem.allocate_tensor(
                act, cute.make_layout((NR, C, NT, VEC), stride=(C * NT * VEC, NT * VEC, VEC, 1)),
                byte_alignment=16)
            cp = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), act, num_bits_per_copy=128)

            def stage(src, j, i):     # one 16-byte cp.async: global chunk -> sV[j, i, tid]
                flat = cute.make_tensor(src.iterator, cute.make_layout(VEC))
                cute.copy(cp, flat, sV[(j, i, tidx, None)])

            for j in cutlass.range_constexpr(NB):
                for i in cutlass.range_constexpr(C):
                    stage(gB[(None, (t, j, chunk(i)))], j, i)
            for i in cutlass.range_constexpr(C):
                stage(gP[(None, (t, chunk(i)))], NB, i)
                if const_expr(self.add):
                    stage(gO[(None, (t, chunk(i)))], NV, i)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)   # own chunks only: no barrier needed

            def val(j, i):
                return sV[(j, i, tidx, None)]
        else:
            rV = cute.make_rmem_tensor(
                cute.make_layout((NR, C, VEC), stride=(C * VEC, VEC, 1)), act)
            for j in cutlass.range_constexpr(NB):
                for i in cutlass.range_constexpr(C):
                    cute.autovec_copy(gB[(None, (t, j, chunk(i)))], rV[(j, i, None)])
            for i in cutlass.range_constexpr(C):
                cute.autovec_copy(gP[(None, (t, chunk(i)))], rV[(NB, i, None)])
                if const_expr(self.add):
                    cute.autovec_copy(gO[(None, (t, chunk(i)))], rV[(NV, i, None)])

            def val(j, i):
                return rV[(j, i, None)]

        if const_expr(self.add):      # p ← bf16(p + o), stored, then used as the last value
            rP = vec_tensor(C, act)
            for i in cutlass.range_constexpr(C):
                p = val(NB, i).load().to(Float32) + val(NV, i).load().to(Float32)
                rP[(i, None)].store(p.to(act))
                val(NB, i).store(rP[(i, None)].load())
                cute.autovec_copy(rP[(i, None)], gNP[(None, (t, chunk(i)))])

        # pass 1: per value row j, Σ v² and Σ v·w_res·w_proj
        wrp = [rW[0][(i, None)].load().to(Float32) * rW[1][(i, None)].load().to(Float32)
               for i in range(C)]
        parts = []
        for j in cutlass.range_constexpr(NV):
            ss = Float32(0.0)
            dd = Float32(0.0)
            for i in cutlass.range_constexpr(C):
                v = val(j, i).load().to(Float32)
                ss = ss + (v * v).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                dd = dd + (v * wrp[i]).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            parts.append(ss)
            parts.append(dd)
        tot = self._block_sum(parts, red_s, tidx, warp, lane)
        if const_expr(K_ > 1):
            tot = self._cluster_sum(tot, xs_s, tidx)
        # s_j = RMSNorm(V_j; w_res)·w_proj; softmax over j (every thread holds all n+1)
        s = [tot[2 * j + 1] * cute.math.rsqrt(tot[2 * j] / Float32(self.H) + res_eps)
             for j in range(NV)]
        smax = s[0]
        for j in cutlass.range_constexpr(1, NV):
            smax = cute.arch.fmax(smax, s[j])
        e = [cute.math.exp(s[j] - smax) for j in range(NV)]
        den = e[0]
        for j in cutlass.range_constexpr(1, NV):
            den = den + e[j]
        prob = [e[j] / den for j in range(NV)]

        # pass 2: mix = bf16(Σ_j p_j·V_j) (fp32 sum); Σ mix²
        rM = vec_tensor(C, act)
        sq = Float32(0.0)
        for i in cutlass.range_constexpr(C):
            acc = val(0, i).load().to(Float32) * prob[0]
            for j in cutlass.range_constexpr(1, NV):
                acc = acc + val(j, i).load().to(Float32) * prob[j]
            rM[(i, None)].store(acc.to(act))
            x = rM[(i, None)].load().to(Float32)
            sq = sq + (x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            if const_expr(self.write_mix):
                cute.autovec_copy(rM[(i, None)], gMix[(None, (t, chunk(i)))])
        tot_h = self._block_sum([sq], red_h, tidx, warp, lane)
        if const_expr(K_ > 1):
            tot_h = self._cluster_sum(tot_h, xs_h, tidx)
            cute.arch.cluster_arrive()    # peers' reads of xs_h done before any CTA exits
        rstd = cute.math.rsqrt(tot_h[0] / Float32(self.H) + out_eps)
        # h = bf16(mix·rstd·w_out), the reference's (x·r)·w order
        rH = vec_tensor(C, act)
        for i in cutlass.range_constexpr(C):
            y = (rM[(i, None)].load().to(Float32) * rstd) * rW[2][(i, None)].load().to(Float32)
            rH[(i, None)].store(y.to(act))
            cute.autovec_copy(rH[(i, None)], gH[(None, (t, chunk(i)))])
        if const_expr(K_ > 1):
            cute.arch.cluster_wait()

    @_dsl.jit
    def _cluster_sum(self, tot, xs, tidx):
        """Sums of the per-CTA totals `tot` over the cluster's CTAs, identical in every CTA (rank
        order 0..k-1): thread 0 publishes tot in xs, cluster barrier (release/acquire), every
        thread reads each rank's xs through DSMEM."""
        if tidx == 0:
            for q in cutlass.range_constexpr(len(tot)):
                xs[q] = tot[q]
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        out = []
        for q in cutlass.range_constexpr(len(tot)):
            acc = _load_peer_f32(xs.iterator + q, 0)
            for r in cutlass.range_constexpr(1, self.cfg.cluster):
                acc = acc + _load_peer_f32(xs.iterator + q, r)
            out.append(acc)
        return out

    @_dsl.jit
    def _block_sum(self, vals, red, tidx, warp, lane):
        """CTA-wide sums of the per-thread scalars `vals`, returned to every thread: warp
        butterflies, lane 0 of each warp stores its warp's sums in red (32, q) (slots ≥ NW
        zeroed), one barrier, then every warp butterflies the 32 slots of each column."""
        NW = self.cfg.warps
        sums = [cute.arch.warp_reduction_sum(v) for v in vals]
        if const_expr(NW > 1):
            if lane == 0:
                for q in cutlass.range_constexpr(len(vals)):
                    red[(warp, q)] = sums[q]
            if const_expr(NW < WARP):
                if tidx < WARP - NW:
                    for q in cutlass.range_constexpr(len(vals)):
                        red[(NW + tidx, q)] = Float32(0.0)
            cute.arch.sync_threads()
            sums = [cute.arch.warp_reduction_sum(red[(lane, q)]) for q in range(len(vals))]
        return sums


_CACHE = CompileCache()


def _cute_dtype(dtype: torch.dtype):
    return {torch.bfloat16: cutlass.BFloat16, torch.float32: cutlass.Float32}[dtype]


def compile_mix_norm(n: int, H: int, w_dtypes: tuple, add: bool, write_mix: bool,
                     cfg: MixNormConfig, extra_options: str = ""):
    """cute.compile one kernel (TVM-FFI entry, current torch stream, capturable). Returns
    `launch(bank, prefix, out, new_prefix, w_res, w_proj, w_out, mix, h, res_eps, out_eps)`.
    extra_options: more cute.compile flags (the CPU tests pass --keep-sass to read `__sass__`)."""
    bf = cutlass.BFloat16
    T = cute.sym_int32(symbol="T")                 # one symbol: every tensor has the same T

    def ld():
        return cute.sym_int64(divisibility=VEC)    # row strides: 16-byte multiples

    def rows():
        return cute.runtime.make_fake_tensor(bf, (T, H), (ld(), 1), assumed_align=16)

    bank = cute.runtime.make_fake_tensor(bf, (T, max(n, 1), H), (ld(), ld(), 1),
                                         assumed_align=16)
    ws = [cute.runtime.make_fake_compact_tensor(_cute_dtype(d), (H,), assumed_align=16)
          for d in w_dtypes]
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    kernel = MixNormKernel(n, H, cfg, add, write_mix)
    return cute.compile(kernel, bank, rows(), rows(), rows(), *ws, rows(), rows(), Float32(1e-6),
                        Float32(1e-6), stream, options=f"--enable-tvm-ffi {extra_options}".strip())


def _compiled(n, H, w_dtypes, add, write_mix, cfg):
    key = (n, H, w_dtypes, add, write_mix, cfg)
    return _CACHE.get(key, lambda: compile_mix_norm(n, H, w_dtypes, add, write_mix, cfg))


def _as_bank(blocks, prefix: torch.Tensor) -> torch.Tensor | None:
    """blocks as one (T, n, H) view (a tensor passes through; a list must sit in uniform slots
    of one storage, `bank_view`); an empty list -> None (n = 0). Raises LookupError when a list
    is not one strided view (the caller falls back)."""
    if isinstance(blocks, torch.Tensor):
        return blocks if blocks.shape[1] else None
    blocks = list(blocks)
    if not blocks:
        return None
    bank = bank_view(blocks, prefix)
    if bank is None:
        raise LookupError("AttnRes blocks are not uniform slots of one tensor")
    return bank


def mix_norm_cute(blocks, prefix: torch.Tensor, res_norm_w: torch.Tensor,
                  res_proj_w: torch.Tensor, out_norm_w: torch.Tensor, res_eps: float,
                  out_eps: float, out: torch.Tensor | None = None,
                  new_prefix: torch.Tensor | None = None, h: torch.Tensor | None = None,
                  mix: torch.Tensor | None = None, config: MixNormConfig | None = None,
                  strict: bool = False) -> torch.Tensor | None:
    """The fused op on the CuTe kernel, `mix_norm_triton`'s contract: blocks a list of n (T, H)
    slots of one tensor or a (T, n, H) view; `out` given: residual form, bf16(p + out) written
    to `new_prefix` (allocated when None; may alias a bank slot). Returns h (T, H), or None when
    the layout is unsupported (`strict`: ValueError naming it). No host sync; capturable."""
    try:
        bank = _as_bank(blocks, prefix)
    except LookupError as e:
        if strict:
            raise ValueError(f"{e}; stack them or use mix_norm_triton") from None
        return None
    weights = (res_norm_w, res_proj_w, out_norm_w)
    why = problem(bank, prefix, weights, out, new_prefix, h, mix)
    if why is None and not (prefix.is_cuda and cute_available()):
        why = f"needs CUDA tensors and nvidia-cutlass-dsl (prefix on {prefix.device})"
    if why is not None:
        if strict:
            raise ValueError(f"attnres mix_norm_cute: {why}")
        return None
    if h is None:
        h = torch.empty(prefix.shape, dtype=prefix.dtype, device=prefix.device)
    if out is not None and new_prefix is None:
        new_prefix = torch.empty_like(h)
    T, H = prefix.shape
    n = 0 if bank is None else bank.shape[1]
    cfg = config or _auto_config(n, H, T, res_norm_w.dtype)
    cfg.validate(n, H)
    wr, wp, wo = res_norm_w, res_proj_w.reshape(-1), out_norm_w
    launch = _compiled(n, H, (wr.dtype, wp.dtype, wo.dtype), out is not None, mix is not None,
                       cfg)
    launch(bank if bank is not None else prefix.unsqueeze(1), prefix,
           out if out is not None else prefix, new_prefix if out is not None else h,
           wr, wp, wo, mix if mix is not None else h, h, float(res_eps), float(out_eps))
    return h


def predicted_us(T: int, n: int, H: int, sms: int = 132) -> float:
    """Model behind the docstring's prediction, per wave of `sms` CTAs (one token per SM):
    1.5 µs fixed (launch, latency, two barriers) + the read bytes at the slower of ~70 GB/s per
    SM and ~3.5 TB/s for the whole chip."""
    per_token = (n + 1) * H * 2
    waves = -(-T // sms)
    wave_tokens = min(T, sms)
    stream_s = max(per_token / 70e9, wave_tokens * per_token / 3.5e12)
    return waves * (1.5 + stream_s * 1e6)


__all__ = ["MixNormConfig", "MixNormKernel", "compile_mix_norm", "default_config",
           "estimated_registers", "mix_norm_cute", "predicted_us", "problem", "register_budget"]
