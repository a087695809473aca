"""The specialized decode step of the layer benchmark (round 3): one K3 layer, B sequences of
one token each, at per-rank shapes, in the fewest kernels that keep the stock step's numerics.

    prefix = prefix + ffn_prev;  h = AttnRes mix + RMSNorm(bank)  1 kernel (kernels/attnres_norm,
                                                                  residual-add form: the previous
                                                                  layer's FFN output joins here)
    KDA:   proj = in_proj(h)                                      GEMV (q|k|v|g|b|f_a)
           o    = kda_decode(proj, …)                             1 kernel (kernels/kda_decode:
                                                                  f_b, gate, conv, L2 norms,
                                                                  delta rule, gated RMSNorm)
           attn = o_proj(o)                                       GEMV            [all-reduce]
    MLA:   y    = [qkv_a 1/TP ‖ g_proj](h)                        GEMV
           qkv  = all-gather(y[:, :qkv_a/TP])                     (memcpy stand-in)
           q''  = W_q''(qkv[:, :q_lora])                          GEMV (W_uk and the q_a norm
                                                                  weight folded into q_b:
                                                                  round 16)
           o    = mla_decode_absorbed(qkv, q'', pages, W_uv,      2 kernels (split-KV attention
                                   gate = y[:, qkv_a/TP:])        with the rms scale of q and
                                                                  the cache row; merge + W_uv
                                                                  + gate). RAYDECODE_BENCH_MLA
                                                                  = r9: q_b' + mla_decode_fused
                                                                  (3 kernels), r8: round 8's
           attn = o_proj(o)                                       GEMV            [all-reduce]
    prefix, h2 = prefix + attn, AttnRes mix + RMSNorm             1 kernel (residual-add form)
    y2     = [router 1/TP ‖ latent down 1/TP ‖ shared gate|up](h2)   one GEMV, fp32 out
    logits, z = all-gather(y2[:, router], y2[:, latent down])     (memcpy stand-ins, fp32)
    w, ids = router top-k(logits)                                 1 kernel (kernels/router)
    lat    = Σ_k w · expert(z)                                    2 kernels (few pairs) or the
                                                                  stock grouped MoE  [all-reduce]
    x      = [RMSNorm(bf16(lat))[1/TP] ‖ SiTU(y2[:, shared]) ‖ 0]  1 kernel
    ffn    = [latent up 1/TP ‖ shared down ‖ 0](x)                 GEMV            [all-reduce]
    -> (prefix, ffn): the next layer's first AttnRes op adds them (above), so a layer costs no
       separate residual kernel; `finish()` materialises prefix_out = prefix + ffn for checks.
       With fold_residual=False the step ends with that add instead and starts from bank_in.

Rounding points are the stock step's (layer_step.py): every GEMV output that stock rounds to
bf16 is rounded once where it is read (fp32 GEMV outputs round in the consumer, which equals
F.linear's single rounding); the only re-association is ffn = up + sd accumulated in one fp32
sum instead of two bf16 GEMVs and a bf16 add. On one GPU the all-gathers copy rank 0's slice
into buffers whose other slices hold fixed random values (as in round 2); the collectives are
listed by `collectives()` and never timed.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from raydecode.kernels.attnres_norm import attnres_add_mix_norm, attnres_mix_norm
from raydecode.kernels.decode_elementwise_triton import latent_norm_situ
from raydecode.kernels.experimental.ffn_gemv_triton import norm_situ_gemv
from raydecode.kernels.experimental.ffn_gemv_triton import uses_kernel as uses_ffn_kernel
from raydecode.kernels.gemv_norm_situ import supports as cute_ffn_supports
from raydecode.kernels.kda_decode import kda_decode
from raydecode.kernels.experimental.l2_prefetch import SidePrefetch, prefetch_table
from raydecode.kernels.mla_decode import (mla_absorb, mla_decode, mla_decode_absorbed,
                                          mla_decode_fused, mla_prep)
from raydecode.kernels.moe_mxfp4 import fused_moe_mxfp4
from raydecode.kernels.moe_mxfp4_decode import use_decode_kernel
from raydecode.kernels.moe_decode import moe_decode
from raydecode.kernels.settings import DEFAULT_OPTIONS
from raydecode.kernels.router import route_topk

from .layer_step import BF16, DecodeStep, mm_f32
from .layer_weights import MLA_PATH, env_choice


# RAYDECODE_BENCH_FFN: the latent norm + SiTU and the ffn_out GEMV as
#   served (default): the model's rule (models/moe.py FUSED_FFN_OUT, RAYDECODE_FFN_OUT_FUSED):
#       the CuTe form with the norm + SiTU as its prologue where it serves
#       (kernels/gemv_norm_situ.py `supports`: T = 1 at TP16), else the pair;
#   pair: latent_norm_situ + the CuTe GEMV (round 14 and before);
#   fused: a fused kernel wherever one serves: the CuTe form, else the Triton one
#       (kernels/experimental/ffn_gemv_triton.py, round 10).
FFN_PATH = env_choice("RAYDECODE_BENCH_FFN", ("served", "pair", "fused"), "served")

# RAYDECODE_BENCH_L2PF: weight prefetch into L2 on a side branch (kernels/experimental/l2_prefetch.py, round
# 17), forked where the chain enters latency-bound kernels:
#   off (default; PERF round 17 measured no gain at batch 1): none;
#   mid: after in_proj / W_q'' (o_proj + h2_proj, during the KDA step / MLA attention) and
#        after h2_proj (ffn_out, during the router and the MoE decode);
#   all: mid + at the layer start (the first GEMVs' leading RAYDECODE_BENCH_L2PF_START_MIB
#        = 24 MiB, during the first AttnRes mix + norm);
#   next: mid + the next layer's first GEMVs (the same budget) with ffn_out, during this
#        layer's router and MoE decode (`link_next`: the bench's next weight copy).
L2PF = env_choice("RAYDECODE_BENCH_L2PF", ("off", "mid", "all", "next"), "off")
_start = os.environ.get("RAYDECODE_BENCH_L2PF_START_MIB", "24")
if not _start.isdigit():
    raise ValueError(f"RAYDECODE_BENCH_L2PF_START_MIB={_start!r}; accepted: MiB, an integer ≥ 0")
L2PF_START_MIB = int(_start)


class SpecializedStep(DecodeStep):
    """`DecodeStep` with variant 'specialized' (the module docstring's kernel sequence)."""

    def __init__(self, W, S, batch: int, linear=None, fold_residual: bool = True):
        super().__init__(W, S, "specialized", batch, linear)
        self.fold_residual = fold_residual
        self.out: tuple[torch.Tensor, torch.Tensor] | None = None   # (prefix, ffn) when folded
        self.first_table: torch.Tensor | None = None
        self.pf = self._prefetch_plan() if L2PF != "off" else {}
        self.side = SidePrefetch() if self.pf else None

    def _prefetch_plan(self) -> dict[str, torch.Tensor]:
        """{fork point: prefetch table} of this layer's weights (L2PF above)."""
        W, t = self.W, self.W.t
        if W.kind == "kda":
            first, mid = [t["kda_in_proj"]], [t["kda_o_proj"], W.spec["h2_proj_local"]]
        elif MLA_PATH == "r16":
            first = [W.spec["qkv_a_g_local"], W.spec["q_b_absorbed"]]
            mid = [t["o_proj"], W.spec["h2_proj_local"]]
        else:
            return {}
        plan = {"attn": prefetch_table(mid), "moe": prefetch_table([W.spec["ffn_out_local"]])}
        self.first_table = prefetch_table(first, max_bytes=L2PF_START_MIB << 20)
        if L2PF == "all":
            plan["start"] = self.first_table
        return plan

    def link_next(self, nxt: "SpecializedStep") -> None:
        """L2PF=next: the MoE-time prefetch also requests `nxt`'s first GEMVs."""
        if L2PF == "next" and "moe" in self.pf and getattr(nxt, "first_table", None) is not None:
            self.pf["moe"] = torch.cat([self.pf["moe"], nxt.first_table])

    def _prefetch(self, point: str) -> None:
        if point in self.pf and self.side is not None:
            self.side.issue(self.pf[point])

    @property
    def prefetch_launches(self) -> int:
        """Side-branch prefetch kernels per step (not on the dependent chain)."""
        return len(self.pf) if self.side is not None and self.side.stream is not None else 0

    def _lin(self, x: torch.Tensor, w: torch.Tensor, f32: bool = False) -> torch.Tensor:
        if self.lin is F.linear:        # batches above the GEMV kernel's: cuBLAS
            return mm_f32(x, w) if f32 else F.linear(x, w)
        return self.lin(x, w, torch.float32) if f32 else self.lin(x, w)

    def step(self) -> None:
        W, S, T, n, eps = self.W, self.S, self.T, self.n, self.eps
        t = W.t
        bank = S.bank_in[:T]
        blocks = [bank[:, j] for j in range(n)]          # one strided view for the kernel
        self._prefetch("start")
        mix1 = (t["self_attention_res_norm"], t["self_attention_res_proj"][None],
                t["input_layernorm"], eps, eps)
        if self.fold_residual:      # the previous layer's FFN output joins the prefix here
            p1, h = attnres_add_mix_norm(blocks, bank[:, n], S.ffn_prev[:T], *mix1)
        else:
            p1, h = bank[:, n], attnres_mix_norm(blocks, bank[:, n], *mix1)
        attn = self.kda(h) if W.kind == "kda" else self.mla(h)
        prefix, h2 = attnres_add_mix_norm(blocks, p1, attn, t["mlp_res_norm"],
                                          t["mlp_res_proj"][None],
                                          t["post_attention_layernorm"], eps, eps)
        ffn = self.moe(h2)
        if self.side is not None:
            self.side.join()
        if self.fold_residual:
            self.out = (prefix, ffn)
        else:
            torch.add(prefix, ffn, out=S.prefix_out[:T])   # [all-reduce + residual]
        if self.trace is not None:
            self.trace.update(h=h, attn=attn, h2=h2, ffn=ffn)

    __call__ = step

    def finish(self) -> None:
        """prefix_out = prefix + ffn of the last folded step (what the next layer would add)."""
        if self.out is not None:
            torch.add(*self.out, out=self.S.prefix_out[:self.T])

    def kda(self, h: torch.Tensor) -> torch.Tensor:
        W, S, T = self.W, self.S, self.T
        t, w = W.t, W.widths
        proj = self._lin(h, t["kda_in_proj"])                    # (T, [q k v g b f_a pad])
        self._prefetch("attn")
        o = kda_decode(proj, t["kda_f_b"], S.kda_conv[:T], t["kda_conv"], t["kda_exp_A"],
                       t["kda_dt_bias"], t["kda_o_norm"], S.kda_rec[:T], heads=w["heads"],
                       head_dim=w["head_dim"], lower_bound=W.cfg.kda.gate_lower_bound,
                       eps=self.eps)
        return self._lin(o, t["kda_o_proj"])                    # [all-reduce]

    def mla(self, h: torch.Tensor) -> torch.Tensor:
        W, S, T = self.W, self.S, self.T
        t, m, w = W.t, W.cfg.mla, W.widths
        nq = w["qkv_a_local"]
        y = self._lin(h, W.spec["qkv_a_g_local"])               # (T, qkv_a/TP + h·v)
        qkv = S.gather_qkv_a[:T]
        qkv[:, :nq].copy_(y[:, :nq])                             # [all-gather]
        if MLA_PATH == "r8":            # A/B: round 8's prep → q_b → absorb → split, output
            qn = mla_prep(qkv, t["q_a_norm"], t["kv_a_norm"], S.mla_pages(),
                          S.mla_block_table[:T], S.mla_positions[:T], q_lora=m.q_lora_rank,
                          kv_lora=m.kv_lora_rank, eps=self.eps)
            q = self._lin(qn, t["q_b"]).view(T, w["heads"], m.qk_head_dim)
            q_abs = mla_absorb(q, t["w_uk"], nope=m.qk_nope_head_dim)
            o = mla_decode(q_abs, S.mla_pages(), S.mla_block_table[:T], S.mla_seq_lens[:T],
                           t["w_uv_t"], y[:, nq:], kv_lora=m.kv_lora_rank,
                           scale=m.qk_head_dim ** -0.5)
            return self._lin(o, t["o_proj"])
        if MLA_PATH == "r16":           # the served form: q_abs out of the GEMV, 2 kernels
            q = self._lin(qkv[:, :m.q_lora_rank], W.spec["q_b_absorbed"], f32=True).view(
                T, w["heads"], m.latent_dim)                    # fp32: rounded after the scale
            self._prefetch("attn")
            o = mla_decode_absorbed(qkv, q, t["kv_a_norm"], S.mla_pages(),
                                    S.mla_block_table[:T], S.mla_positions[:T],
                                    S.mla_seq_lens[:T], t["w_uv_t"], y[:, nq:],
                                    q_lora=m.q_lora_rank, kv_lora=m.kv_lora_rank, eps=self.eps,
                                    scale=m.qk_head_dim ** -0.5)
            return self._lin(o, t["o_proj"])                     # [all-reduce]
        q = self._lin(qkv[:, :m.q_lora_rank], W.spec["q_b_folded"], f32=True).view(
            T, w["heads"], m.qk_head_dim)                       # fp32: rounded after the scale
        o = mla_decode_fused(qkv, q, t["kv_a_norm"], t["w_uk"], S.mla_pages(),
                             S.mla_block_table[:T], S.mla_positions[:T], S.mla_seq_lens[:T],
                             t["w_uv_t"], y[:, nq:], q_lora=m.q_lora_rank,
                             kv_lora=m.kv_lora_rank, eps=self.eps,
                             scale=m.qk_head_dim ** -0.5)
        return self._lin(o, t["o_proj"])                         # [all-reduce]

    def moe(self, h2: torch.Tensor) -> torch.Tensor:
        W, S, T, mc, w = self.W, self.S, self.T, self.W.cfg.moe, self.W.widths
        t = W.t
        ne, nz = w["router_local"], w["latent_local"]
        y = self._lin(h2, W.spec["h2_proj_local"], f32=True)    # (T, E/TP + L/TP + 2·I_sh)
        self._prefetch("moe")
        logits = S.gather_logits[:T]
        logits[:, :ne].copy_(y[:, :ne])                           # [all-gather]
        z = S.gather_z[:T]
        z[:, :nz].copy_(y[:, ne:ne + nz])                         # [all-gather] (fp32)
        weights, ids = route_topk(logits, t["router_bias"], mc.top_k, mc.renormalize,
                                  mc.routed_scaling_factor)
        S.last_ids = ids
        if use_decode_kernel(z, ids, W.experts):                 # few-token expert GEMV
            lat = moe_decode(z, weights, ids, W.experts)         # (T, L) fp32 [all-reduce]
        else:
            lat = fused_moe_mxfp4(z.to(BF16), weights, ids, W.experts)   # [all-reduce]
        gu, w_out, w_norm = y[:, ne + nz:], W.spec["ffn_out_local"], t["latent_norm"]
        if ((FFN_PATH == "served" and DEFAULT_OPTIONS.ffn_out_fused
             and cute_ffn_supports(lat, w_norm, nz, gu, w_out))
                or (FFN_PATH == "fused" and uses_ffn_kernel(lat, nz, gu, w_out, w_norm))):
            return norm_situ_gemv(lat, t["latent_norm"], self.eps, 0, nz, y[:, ne + nz:],
                                  W.cfg.situ_beta, W.cfg.situ_linear_beta,
                                  W.spec["ffn_out_local"])      # [all-reduce]
        x = latent_norm_situ(lat, t["latent_norm"], self.eps, 0, nz, y[:, ne + nz:],
                             W.cfg.situ_beta, W.cfg.situ_linear_beta, S.ffn_in[:T])
        return self._lin(x, W.spec["ffn_out_local"])             # [all-reduce]


def make_step(W, S, variant: str, batch: int, linear=None, fold_residual: bool = True
              ) -> DecodeStep:
    """The benchmark step of `variant` ('stock' or 'specialized') on (W, S)."""
    if variant == "specialized":
        return SpecializedStep(W, S, batch, linear, fold_residual)
    return DecodeStep(W, S, variant, batch, linear)


__all__ = ["SpecializedStep", "make_step"]
