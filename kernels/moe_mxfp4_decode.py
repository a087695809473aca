"""MXFP4 routed experts for FEW tokens (decode, T·k ≤ `MAX_PAIRS`): the SPECIALIZED variant.

Same math, weights and rounding points as kernels/moe_mxfp4.py (the stock grouped kernel, kept
unchanged as the baseline; its docstring has the layout). Pair p = t·k + j, e = ids[p]:

    gate_up  a[p] = bf16 SiTU(bf16 W1_e z[t], bf16 W3_e z[t])           (P, I) bf16
    down     out[t] += w[p] · bf16(W2_e a[p])                            (T, L) fp32 (atomics)

Why a second kernel: at batch 1 the stock kernel streams the 16 touched experts at ~0.2 TB/s.
It pads every pair to a 16-row tl.dot, needs a sort/run kernel first, and its few programs
(≤ 17 chunks × I/BN) keep too few bytes in flight. Here each pair is its own work item (no sort:
the grid is P × N-tiles; a duplicate expert of two tokens is read twice, so this is for small
P only) and the math runs on CUDA cores as a GEMV:

    a program = one pair × BN output rows; its K loop reads (BN, GB, 16) bytes of packed codes
    per step (GB MXFP4 groups of 16 bytes per row, 16-byte contiguous runs) + (BN, GB) scales;
    each byte gives its low code (even k) and high code (odd k) as fp16 bit patterns
    ((c & 7) << 9 | (c & 8) << 12 = e2m1 · 2**-14 exactly); Σ over the 16 bytes of
    lo·x[2i] + hi·x[2i+1] in fp32, × 2**(s − 113) per group, Σ over groups.

No runs kernel and no Σ_k kernel: gate_up zeroes `out` (each program a slice; the down kernel
starts after it) and the down programs add their pair's rows with fp32 atomics. 2 launches
per call, no host sync, capturable. Triton (round 2 of issue 6); a CuTe DSL version is the
follow-up.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from raydecode.kernels.attnres_norm_triton import available, tl, triton
from raydecode.kernels.moe_mxfp4 import MXFP4Experts, _check_inputs

MAX_PAIRS = 64           # T·k up to which the specialized step uses this kernel


if triton is not None:

    @triton.jit
    def _tanh(x):
        return 2.0 * tl.sigmoid(2.0 * x) - 1.0

    @triton.jit
    def _group_dot(w_ptr, s_ptr, rows, byte, grp, xe, xo, KB: tl.constexpr, KG: tl.constexpr):
        """Σ_k W[rows, k] x[k] over the GB groups `grp` of one K step -> (BN,) fp32.
        w_ptr: (N, KB) packed bytes; s_ptr: (N, KG) scales; byte (GB, 16) byte columns;
        xe / xo (GB, 16) fp32 activations at the even / odd k of those bytes."""
        pb = tl.load(w_ptr + rows[:, None, None] * KB + byte[None, :, :]).to(tl.int32)
        lo = (((pb & 7) << 9) | ((pb & 8) << 12)).to(tl.int16)
        hi = (((pb & 0x70) << 5) | ((pb & 0x80) << 8)).to(tl.int16)
        lo = lo.to(tl.float16, bitcast=True).to(tl.float32)
        hi = hi.to(tl.float16, bitcast=True).to(tl.float32)
        part = tl.sum(lo * xe[None, :, :] + hi * xo[None, :, :], 2)          # (BN, GB)
        s = tl.load(s_ptr + rows[:, None] * KG + grp[None, :]).to(tl.int32)
        sc = ((s + 14) << 23).to(tl.float32, bitcast=True)                    # 2**(s − 113)
        return tl.sum(part * sc, 1)

    @triton.jit
    def _gate_up_kernel(z_ptr, ids_ptr, w_ptr, s_ptr, a_ptr, y_ptr, n_zero, top_k, beta,
                        lin_beta, L: tl.constexpr, I: tl.constexpr, KB: tl.constexpr,
                        KG: tl.constexpr, HAS_LIN: tl.constexpr, BN: tl.constexpr,
                        GB: tl.constexpr, ZB: tl.constexpr):
        """KB = L/2 bytes and KG = L/32 groups per row of W13 (passed: constexpr arithmetic
        inside the kernel differs between the compiler and the interpreter)."""
        p = tl.program_id(0)
        nb = tl.program_id(1)
        zo = (p * tl.num_programs(1) + nb) * ZB + tl.arange(0, ZB)     # zero out's slice
        tl.store(y_ptr + zo, tl.zeros((ZB,), tl.float32), mask=zo < n_zero)
        e = tl.load(ids_ptr + p).to(tl.int64)
        t = p // top_k
        w_e = w_ptr + e * (2 * I * KB)
        s_e = s_ptr + e * (2 * I * KG)
        n = nb * BN + tl.arange(0, BN)
        gi = tl.arange(0, GB)
        j = tl.arange(0, 16)
        acc_g = tl.zeros((BN,), tl.float32)
        acc_u = tl.zeros((BN,), tl.float32)
        for g0 in range(0, KG, GB):
            grp = g0 + gi
            byte = grp[:, None] * 16 + j[None, :]                          # (GB, 16)
            # z bf16, or fp32 rounded to bf16 here (what a bf16 GEMV output would hold)
            xe = tl.load(z_ptr + t * L + 2 * byte).to(tl.bfloat16).to(tl.float32)
            xo = tl.load(z_ptr + t * L + 2 * byte + 1).to(tl.bfloat16).to(tl.float32)
            acc_g += _group_dot(w_e, s_e, n, byte, grp, xe, xo, KB, KG)
            acc_u += _group_dot(w_e, s_e, n + I, byte, grp, xe, xo, KB, KG)
        g = acc_g.to(tl.bfloat16).to(tl.float32)
        u = acc_u.to(tl.bfloat16).to(tl.float32)
        act = beta * _tanh(g / beta) * tl.sigmoid(g)
        if HAS_LIN:
            u = lin_beta * _tanh(u / lin_beta)
        tl.store(a_ptr + p * I + n, (act * u).to(tl.bfloat16))

    @triton.jit
    def _down_kernel(a_ptr, ids_ptr, topw_ptr, w_ptr, s_ptr, y_ptr, top_k,
                     L: tl.constexpr, I: tl.constexpr, KB: tl.constexpr, KG: tl.constexpr,
                     BN: tl.constexpr, GB: tl.constexpr):
        """KB = I/2 bytes and KG = I/32 groups per row of W2."""
        p = tl.program_id(0)
        e = tl.load(ids_ptr + p).to(tl.int64)
        t = p // top_k
        w_e = w_ptr + e * (L * KB)
        s_e = s_ptr + e * (L * KG)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        gi = tl.arange(0, GB)
        j = tl.arange(0, 16)
        acc = tl.zeros((BN,), tl.float32)
        for g0 in range(0, KG, GB):
            grp = g0 + gi
            byte = grp[:, None] * 16 + j[None, :]
            xe = tl.load(a_ptr + p * I + 2 * byte).to(tl.float32)
            xo = tl.load(a_ptr + p * I + 2 * byte + 1).to(tl.float32)
            acc += _group_dot(w_e, s_e, n, byte, grp, xe, xo, KB, KG)
        y = acc.to(tl.bfloat16).to(tl.float32) * tl.load(topw_ptr + p)
        tl.atomic_add(y_ptr + t * L + n, y, sem="relaxed")


@dataclass(frozen=True)
class DecodeConfig:
    """Tiles: BN output rows per program, GB MXFP4 groups (16 bytes per row each) per K step,
    warps per program; GB must divide K/32 (L/32 for gate_up, I/32 for down), BN the N."""
    gate_up_bn: int = 16
    gate_up_gb: int = 16
    gate_up_warps: int = 4
    down_bn: int = 64
    down_gb: int = 2
    down_warps: int = 4

    def validate(self, I: int, L: int) -> "DecodeConfig":
        bad = []
        if I % self.gate_up_bn or (L // 32) % self.gate_up_gb:
            bad.append(f"gate_up BN {self.gate_up_bn} | I={I}, GB {self.gate_up_gb} | L/32")
        if L % self.down_bn or (I // 32) % self.down_gb:
            bad.append(f"down BN {self.down_bn} | L={L}, GB {self.down_gb} | I/32")
        if bad:
            raise ValueError(f"DecodeConfig {self}: " + "; ".join(bad))
        return self


# Best of the `layer.py --moe-decode-sweep` candidates per (E, I, L), batch 1, from
# bench/results/layer-h200-2026-11-29-r2.json (H200, Triton 3.6): K3 TP16 (I = 192) 26.8 µs,
# TP8 (I = 384) 37.7 µs. The sweep overwrites these in-process; missing keys: the default rule.
TUNED: dict[tuple[int, int, int], DecodeConfig] = {
    (896, 192, 3584): DecodeConfig(8, 16, 4, 64, 2, 4),
    (896, 384, 3584): DecodeConfig(8, 16, 4, 64, 4, 4),
}


def _pow2_divisor(n: int, cap: int) -> int:
    b = cap
    while b > 1 and n % b:
        b //= 2
    return b


def default_decode_config(num_experts: int, intermediate: int, latent: int,
                          tuned: bool = True) -> DecodeConfig:
    """TUNED entry if any (and `tuned`); else BN 16 / 64 and the widest K steps dividing K."""
    hit = TUNED.get((num_experts, intermediate, latent)) if tuned else None
    if hit is not None:
        return hit
    return DecodeConfig(gate_up_bn=_pow2_divisor(intermediate, 16),
                        gate_up_gb=_pow2_divisor(latent // 32, 16),
                        down_bn=_pow2_divisor(latent, 64),
                        down_gb=_pow2_divisor(intermediate // 32, 4))


def moe_mxfp4_decode(z: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     experts: MXFP4Experts, config: DecodeConfig | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_k w·expert(z) (T, L) fp32 for few tokens (2 launches, see module docstring).

    z may also be fp32 (the specialized step's fused GEMV output): it is rounded to bf16 on
    load, so the result equals the call with z.to(bf16)."""
    _check_inputs(z, topk_weights, topk_ids, experts, (torch.bfloat16, torch.float32))
    T, L = z.shape
    k = topk_ids.shape[1]
    P, I = T * k, experts.intermediate
    cfg = (config or default_decode_config(experts.num_experts, I, L)).validate(I, L)
    ids = topk_ids.reshape(-1)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    if out is None:
        out = torch.empty(T, L, dtype=torch.float32, device=z.device)
    a = torch.empty(P, I, dtype=torch.bfloat16, device=z.device)
    nprog = P * (I // cfg.gate_up_bn)
    zb = triton.next_power_of_2(-(-(T * L) // nprog))
    lin = experts.linear_beta
    _gate_up_kernel[(P, I // cfg.gate_up_bn)](
        z.contiguous(), ids, experts.w13, experts.s13, a, out, T * L, k,
        float(experts.beta), float(lin if lin is not None else 1.0), L=L, I=I, KB=L // 2,
        KG=L // 32, HAS_LIN=lin is not None, BN=cfg.gate_up_bn, GB=cfg.gate_up_gb, ZB=zb,
        num_warps=cfg.gate_up_warps)
    _down_kernel[(P, L // cfg.down_bn)](
        a, ids, topk_weights.contiguous(), experts.w2, experts.s2, out, k, L=L, I=I, KB=I // 2,
        KG=I // 32, BN=cfg.down_bn, GB=cfg.down_gb, num_warps=cfg.down_warps)
    return out


def use_decode_kernel(z: torch.Tensor, topk_ids: torch.Tensor, experts: MXFP4Experts) -> bool:
    """Whether `moe_mxfp4_decode` serves this call (few pairs, Triton on these tensors)."""
    return topk_ids.numel() <= MAX_PAIRS and available(z, experts.w13)


__all__ = ["DecodeConfig", "MAX_PAIRS", "TUNED", "default_decode_config", "moe_mxfp4_decode",
           "use_decode_kernel"]
