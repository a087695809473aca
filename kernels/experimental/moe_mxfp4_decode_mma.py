"""MXFP4 routed experts for FEW tokens on TENSOR CORES: `tl.dot_scaled(bf16, e2m1 + ue8m0)`.

Same contract, math and rounding points as kernels/moe_mxfp4_decode.py (the CUDA-core GEMV
variant; its docstring has the split-K design this file keeps). Pair p = t·k + j, e = ids[p]:

    gate_up  part[p, ks, n] = Σ_{k ∈ slice ks} W13_e[n, k] z[t, k]          (P, KS, 2I) fp32
    down     a[p] = bf16 SiTU(bf16 Σ_ks part[p, ks, :I], bf16 Σ_ks part[p, ks, I:])   (in-kernel)
             out[t] += w[p] · bf16(W2_e a[p])                                (T, L) fp32 atomics

Why: Nsight on the H200 (K3 TP16 batch 1) put the CUDA-core gate_up at ~21 SASS thread-
instructions per weight byte (byte → int32, bit ops to fp16 patterns, cvt, unfused mul/add,
shuffles): issue-bound at 0.86 TB/s (bench/results/ncu-moe-h200-2026-11-29-r5.json). Here
each K step is ONE scaled dot per program:

    gate_up program (p, nb, ks): rows R = [nb·BN, nb·BN + BN) ∪ [I + nb·BN, ...) of W13 (gate
        and up in one 2BN-row tile; R is also the part column), K slice [ks·L/KS, ...) in BK
        steps: x (16, BK) bf16 = z[t] in row 0, rows 1..15 zero;  W (BK/2, 2BN) uint8 packed
        e2m1 (pointer arithmetic transposes the row-major (2I, L/2) bytes, low nibble = even
        k) + scales (2BN, BK/32) ue8m0;  acc (16, 2BN) += dot_scaled(x, W); row 0 → part.
    down program (p, nb): a (BK,) built from part (Σ over ks in ks order, SiTU, bf16), W2 rows
        [nb·BN, ...) in BK steps; row 0 of the (16, BN) acc → bf16 → × w[p] → atomics.

`weights_m` swaps the operands (out^T = W · x^T: W (2BN or BN, BK/2) e2m1 is the lhs in its
natural row-major layout, x^T (BK, 16) the rhs, column 0 kept), so the weights take the dot's
M side (≥ 64 rows with 4 warps can lower to wgmma instead of mma.sync); a sweep candidate.
On sm_90 Triton decomposes the scaled dot: e2m1 → bf16 (Fp4ToFp), × the bf16 scale (exact:
a power of two times a 3-significant-bit value), then a bf16 tensor-core dot with fp32
accumulation, so every product is exact and only the fp32 summation order differs from
`moe_mxfp4_reference`. fast_math=True drops the scale-0xFF NaN select (scales ≤ MAX_SCALE
are checked by `MXFP4Experts.validate`).

Instruction estimate (thread-instructions per weight byte = 2 codes). Written before compiling:
16-byte loads 0.06; Fp4ToFp ≈ 1.5–2; bf16 scale multiply (HMUL2, 2 codes) 1; scale broadcast
≈ 0.2; shared-memory round trip to the dot-operand layout ≈ 0.5; mma (64 weight bytes per
m16n8k16) 0.5; addresses ≈ 0.5: ≈ 4.5–5. Checked on this CPU host by compiling for sm_90a with
Triton 3.9 and counting SASS (slope between BK = 256 and 512 tiles of 64 rows, 4 warps): ≈ 11
per byte (PRMT ≈ 3.9, IMAD ≈ 1.8, LOP3 ≈ 1, HMUL2 1, SHF ≈ 0.8; the raw bytes go through
shared memory and ldmatrix before the upcast, the HMMA/HGMMA count is negligible). Without the
scale it is ≈ 9.5: Triton's e2m1 → bf16 upcast itself is the cost, ≈ 2× below the CUDA-core
kernel's 21, not the 4–5× hoped for. At 132 SMs × 4 issue/clk × 32 lanes × 1.98 GHz ≈ 33 T
thread-instr/s that is ≈ 3.9 µs of pure issue for TP16 batch 1's 11.7 MB (7.4 µs at 21), about
the HBM time (3.3 µs at 3.5 TB/s): issue and memory roughly balanced. (A hand decode, fp16/bf16
bit placement two codes per int op as kernels/moe_mxfp4.py "pairs" + the scale on the bf16
pair, would be ≈ 4 per byte: the follow-up if this lands issue-bound again.)

Prediction (H200 at 3.5–4 TB/s, batch 1, k = 16, unmeasured; the measured TUNED CUDA-core
kernels in brackets, Nsight per-kernel at TP16, sweep totals):
    TP16 (I 192)  gate_up 11.7 MB → 6–8 µs [13.5];  down 5.9 MB → 4–6 µs [8.9]
                  both ≈ 12 µs [20.9]
    TP8  (I 384)  gate_up 23.5 MB → 10–12 µs;  down 11.8 MB → 6–8 µs;  ≈ 18 µs [33.4]
(≈ 2 µs launch + tail per kernel, PDL hides part of the second; the down programs also re-read
the partials from L2, P·KS·2I·4 bytes per row tile, and redo SiTU on I values each.) Risks:
Triton 3.6's layouts around a 16-row dot differ from 3.9's; register pressure of the upcast
tile (2BN × BK bf16 per program; the candidates keep it ≤ 32 KB).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from raydecode.kernels._triton import (LAUNCH_WARPS, available, pdl_enter, pdl_launch, tl,
                                       triton)
from raydecode.kernels.moe_mxfp4 import MXFP4Experts, _check_inputs
from raydecode.kernels import moe_mxfp4_decode as _cuda_core
from raydecode.kernels.moe_mxfp4_decode import _pow2_divisor, unique_valid

BM = 16                  # activation rows of a dot (tl.dot's minimum); row 0 holds the pair

if triton is not None:
    from raydecode.kernels.moe_mxfp4_decode import _down_prologue, _pair_prologue, _split_input

    _BM = tl.constexpr(BM)

    @triton.jit
    def _gate_up_mma_kernel(z_ptr, ids_ptr, w_ptr, s_ptr, part_ptr, y_ptr, n_zero, top_k,
                            L: tl.constexpr, I: tl.constexpr, KB: tl.constexpr,
                            KG: tl.constexpr, KS: tl.constexpr, LS: tl.constexpr,
                            BN: tl.constexpr, BK: tl.constexpr, ZB: tl.constexpr,
                            WM: tl.constexpr, PDL: tl.constexpr):
        """Program (p, nb, ks): part[p, ks, R] = Σ_{k in slice ks} W13_e[R, k] z[t, k]
        for the 2BN rows R (module docstring). KB = L/2 bytes, KG = L/32 scales per row
        (passed: constexpr arithmetic differs between the compiler and the interpreter).
        Each part element is written by exactly one program; the programs also zero out."""
        pdl_enter(PDL)
        p = tl.program_id(0)
        nb = tl.program_id(1)
        ks = tl.program_id(2)
        t, w_e, s_e = _pair_prologue(ids_ptr, y_ptr, n_zero, (p * tl.num_programs(1) + nb) * KS
                                     + ks, p, top_k, w_ptr, s_ptr, I, KB, KG, ZB)
        r = tl.arange(0, 2 * BN)
        rows = tl.where(r < BN, nb * BN + r, I + nb * BN + r - BN)      # gate rows, up rows
        m = tl.arange(0, _BM)
        kb = tl.arange(0, BK // 2)
        kg = tl.arange(0, BK // 32)
        kx = tl.arange(0, BK)
        if WM:
            acc = tl.zeros((2 * BN, _BM), tl.float32)
        else:
            acc = tl.zeros((_BM, 2 * BN), tl.float32)
        for kk in range(0, LS, BK):
            k0 = ks * LS + kk
            # z bf16, or fp32 rounded to bf16 here (what a bf16 GEMV output would hold)
            x = tl.load(z_ptr + t * L + k0 + kx).to(tl.bfloat16)                 # (BK,)
            sc = tl.load(s_e + rows[:, None] * KG + k0 // 32 + kg[None, :])      # (2BN, BK/32)
            if WM:
                w = tl.load(w_e + rows[:, None] * KB + k0 // 2 + kb[None, :])    # (2BN, BK/2)
                xt = tl.where(m[None, :] == 0, x[:, None], 0.0).to(tl.bfloat16)  # (BK, 16)
                acc = tl.dot_scaled(w, sc, "e2m1", xt, None, "bf16", acc, fast_math=True)
            else:
                w = tl.load(w_e + rows[None, :] * KB + k0 // 2 + kb[:, None])    # (BK/2, 2BN)
                xl = tl.where(m[:, None] == 0, x[None, :], 0.0).to(tl.bfloat16)  # (16, BK)
                acc = tl.dot_scaled(xl, None, "bf16", w, sc, "e2m1", acc, fast_math=True)
        row = part_ptr + (p * KS + ks) * (2 * I)
        if WM:
            tl.store(row + rows[:, None] + 0 * m[None, :], acc, mask=(m == 0)[None, :])
        else:
            tl.store(row + rows[None, :] + 0 * m[:, None], acc, mask=(m == 0)[:, None])

    @triton.jit
    def _down_mma_kernel(part_ptr, ids_ptr, topw_ptr, w_ptr, s_ptr, y_ptr, top_k, beta,
                         lin_beta, L: tl.constexpr, I: tl.constexpr, KB: tl.constexpr,
                         KG: tl.constexpr, KS: tl.constexpr, HAS_LIN: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr, WM: tl.constexpr,
                         PDL: tl.constexpr):
        """Program (p, nb): out[t, n] += w[p] · bf16(Σ_k W2_e[n, k] a[p, k]) for the BN rows n,
        a[p] = bf16 SiTU of the Σ_ks partials (`_split_input`, ks order). KB = I/2, KG = I/32."""
        pdl_enter(PDL)
        p = tl.program_id(0)
        t, w_e, s_e = _down_prologue(ids_ptr, p, top_k, w_ptr, s_ptr, L, KB, KG)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        m = tl.arange(0, _BM)
        kb = tl.arange(0, BK // 2)
        kg = tl.arange(0, BK // 32)
        kx = tl.arange(0, BK)
        pp = part_ptr + p * (KS * 2 * I)
        if WM:
            acc = tl.zeros((BN, _BM), tl.float32)
        else:
            acc = tl.zeros((_BM, BN), tl.float32)
        for k0 in range(0, I, BK):
            a = _split_input(pp, k0 + kx, beta, lin_beta, I, KS, HAS_LIN)          # (BK,)
            sc = tl.load(s_e + n[:, None] * KG + k0 // 32 + kg[None, :])         # (BN, BK/32)
            if WM:
                w = tl.load(w_e + n[:, None] * KB + k0 // 2 + kb[None, :])       # (BN, BK/2)
                at = tl.where(m[None, :] == 0, a[:, None], 0.0).to(tl.bfloat16)  # (BK, 16)
                acc = tl.dot_scaled(w, sc, "e2m1", at, None, "bf16", acc, fast_math=True)
            else:
                w = tl.load(w_e + n[None, :] * KB + k0 // 2 + kb[:, None])       # (BK/2, BN)
                al = tl.where(m[:, None] == 0, a[None, :], 0.0).to(tl.bfloat16)  # (16, BK)
                acc = tl.dot_scaled(al, None, "bf16", w, sc, "e2m1", acc, fast_math=True)
        y = acc.to(tl.bfloat16).to(tl.float32) * tl.load(topw_ptr + p)
        if WM:
            tl.atomic_add(y_ptr + t * L + n[:, None] + 0 * m[None, :], y,
                          mask=(m == 0)[None, :], sem="relaxed")
        else:
            tl.atomic_add(y_ptr + t * L + n[None, :] + 0 * m[:, None], y,
                          mask=(m == 0)[:, None], sem="relaxed")


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


@dataclass(frozen=True)
class MmaConfig:
    """Tiles of the two tensor-core kernels. gate_up: BN gate + BN up rows per program (one
    2BN-row tile), BK codes per K step, KS K slices (grid (P, I/BN, KS); each program loops
    over L/KS/BK steps). down: BN rows of W2 per program (grid (P, L/BN)), BK codes per step
    (I/BK steps). Stages: Triton software-pipelining depth of each kernel's K loop. weights_m:
    the weights on the dot's M side (module docstring)."""
    gate_up_bn: int = 16
    gate_up_bk: int = 256
    gate_up_ks: int = 14
    gate_up_warps: int = 4
    gate_up_stages: int = 1
    down_bn: int = 64
    down_bk: int = 64
    down_warps: int = 4
    down_stages: int = 3
    weights_m: bool = False

    def validate(self, I: int, L: int) -> "MmaConfig":
        bad = []
        if not _pow2(self.gate_up_bn) or self.gate_up_bn < 8 or I % self.gate_up_bn:
            bad.append(f"gate_up_bn {self.gate_up_bn}: need a power of two ≥ 8 dividing I={I}")
        if self.gate_up_ks < 1 or L % self.gate_up_ks:
            bad.append(f"gate_up_ks {self.gate_up_ks}: need KS ≥ 1 dividing L={L}")
        elif (not _pow2(self.gate_up_bk) or self.gate_up_bk < 64
              or (L // self.gate_up_ks) % self.gate_up_bk):
            bad.append(f"gate_up_bk {self.gate_up_bk}: need a power of two ≥ 64 dividing "
                       f"L/KS = {L // self.gate_up_ks}")
        if not _pow2(self.down_bn) or self.down_bn < 16 or L % self.down_bn:
            bad.append(f"down_bn {self.down_bn}: need a power of two ≥ 16 dividing L={L}")
        if not _pow2(self.down_bk) or self.down_bk < 64 or I % self.down_bk:
            bad.append(f"down_bk {self.down_bk}: need a power of two ≥ 64 dividing I={I}")
        for f in ("gate_up_warps", "down_warps"):
            if getattr(self, f) not in LAUNCH_WARPS:
                bad.append(f"{f} {getattr(self, f)}: need one of 1, 2, 4, 8, 16")
        for f in ("gate_up_stages", "down_stages"):
            if getattr(self, f) < 1:
                bad.append(f"{f} {getattr(self, f)}: need ≥ 1")
        if bad:
            raise ValueError(f"MmaConfig {self}: " + "; ".join(bad))
        return self


def default_mma_config(num_experts: int, intermediate: int, latent: int) -> MmaConfig:
    """One BK = 256 step per gate_up program (KS = L/256: 14 at L = 3584), BN 16 (a 32-row
    tile); down BN 64 over BK = 64 steps (divides I = 192 and 384)."""
    I, L = intermediate, latent
    bk = _pow2_divisor(L, 256)
    return MmaConfig(gate_up_bn=_pow2_divisor(I, 16), gate_up_bk=max(bk, 64),
                     gate_up_ks=max(L // max(bk, 64), 1), down_bn=_pow2_divisor(L, 64),
                     down_bk=_pow2_divisor(I, 64))


def candidates(num_experts: int, intermediate: int, latent: int) -> list[MmaConfig]:
    """~12 configs for the GPU sweep around the default: K slice size (1, 2 or 4 steps per
    program), tile width, warps, pipelining, and the swapped (weights-on-M) orientation."""
    I, L = intermediate, latent
    d = default_mma_config(num_experts, I, L)
    rep = lambda **kw: dataclasses.replace(d, **kw)     # noqa: E731
    out = [d,
           rep(gate_up_bk=128, gate_up_ks=L // 128),                        # 128-code slices
           rep(gate_up_bk=128, gate_up_ks=L // 256, gate_up_stages=2),       # 2 steps, piped
           rep(gate_up_bk=128, gate_up_ks=L // 512, gate_up_stages=4),       # 4 steps (KS 7)
           rep(gate_up_bn=32, gate_up_bk=128, gate_up_ks=L // 256, gate_up_stages=2),
           rep(gate_up_bn=8, gate_up_warps=2),
           rep(gate_up_warps=8, down_warps=8),
           rep(down_bn=128, down_warps=8),
           rep(down_bn=32, down_warps=2),
           rep(down_stages=1),
           rep(weights_m=True, gate_up_bn=32, gate_up_bk=128, gate_up_ks=L // 128,
               down_bn=64),                                                 # 64-row M tiles
           rep(weights_m=True, gate_up_bn=32, gate_up_bk=128, gate_up_ks=L // 256,
               gate_up_stages=2, down_bn=128, down_warps=8)]
    return unique_valid(out, I, L)


def moe_mxfp4_decode_mma(z: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         experts: MXFP4Experts, config: MmaConfig | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_k w·expert(z) (T, L) fp32 for T·k ≤ MAX_PAIRS pairs on tensor cores (2 launches, no
    host sync, capturable). z bf16, or fp32 rounded to bf16 on load (equals the bf16 call)."""
    _check_inputs(z, topk_weights, topk_ids, experts, (torch.bfloat16, torch.float32))
    T, L = z.shape
    k = topk_ids.shape[1]
    P, I = T * k, experts.intermediate
    if P > _cuda_core.MAX_PAIRS:
        raise ValueError(f"{P} (token, expert) pairs: moe_mxfp4_decode_mma serves at most "
                         f"{_cuda_core.MAX_PAIRS} (T·k); use fused_moe_mxfp4")
    if not available(z, experts.w13):
        raise ValueError("moe_mxfp4_decode_mma needs Triton and CUDA tensors (or CPU tensors "
                         "under TRITON_INTERPRET=1)")
    cfg = (config or default_mma_config(experts.num_experts, I, L)).validate(I, L)
    ks = cfg.gate_up_ks
    ids = topk_ids.reshape(-1)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    if out is None:
        out = torch.empty(T, L, dtype=torch.float32, device=z.device)
    part = torch.empty(P, ks, 2 * I, dtype=torch.float32, device=z.device)
    grid = (P, I // cfg.gate_up_bn, ks)
    zb = triton.next_power_of_2(-(-(T * L) // (grid[0] * grid[1] * ks)))
    pdl = pdl_launch(z)
    _gate_up_mma_kernel[grid](
        z.contiguous(), ids, experts.w13, experts.s13, part, out, T * L, k, L=L, I=I,
        KB=L // 2, KG=L // 32, KS=ks, LS=L // ks, BN=cfg.gate_up_bn, BK=cfg.gate_up_bk,
        ZB=zb, WM=cfg.weights_m, num_warps=cfg.gate_up_warps, num_stages=cfg.gate_up_stages,
        **pdl)
    lin = experts.linear_beta
    _down_mma_kernel[(P, L // cfg.down_bn)](
        part, ids, topk_weights.contiguous(), experts.w2, experts.s2, out, k,
        float(experts.beta), float(lin if lin is not None else 1.0), L=L, I=I, KB=I // 2,
        KG=I // 32, KS=ks, HAS_LIN=lin is not None, BN=cfg.down_bn, BK=cfg.down_bk,
        WM=cfg.weights_m, num_warps=cfg.down_warps, num_stages=cfg.down_stages, **pdl)
    return out


# Shapes (E, I, L) whose few-token MoE runs on tensor cores, with their measured config; the
# CUDA-core kernel (moe_mxfp4_decode) serves every other shape. `USE_MMA` forces the tensor-core
# kernel (TUNED entry, else the default config) for A/B timing; None = TUNED decides.
TUNED: dict[tuple[int, int, int], MmaConfig] = {}
USE_MMA: bool | None = None

__all__ = ["BM", "MmaConfig", "TUNED", "USE_MMA", "candidates",
           "default_mma_config", "moe_mxfp4_decode_mma"]
