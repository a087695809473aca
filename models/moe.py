"""K3's latent MoE: sigmoid router with a selection-only correction bias, routed experts in a
down-projected latent, RMSNorm of the latent sum, up-projection, plus shared experts.

    logits = x · W_gateᵀ (fp32);  s = sigmoid(logits)                      (T, E)
    ids    = top-k of (s + e_score_correction_bias)  [group-limited when num_expert_group > 1]
    w      = s[ids] / Σ s[ids] · routed_scaling_factor                        bias never in w
    z      = routed_expert_down_proj(x)                                       (T, L) latent
    y_lat  = Σ_k w_k · w2_e(SiTU(w1_e z, w3_e z))                            (T, L) fp32
    out    = routed_expert_up_proj(RMSNorm(y_lat)) + shared_experts(x)       (T, H)

Specialized step (models/specialized.py): router and latent down rows are computed 1/TP per
rank and all-gathered; routing is the fused `kernels.router.route_topk` (one expert group).
With shared experts, the latent norm and a bf16 model (K3) the block is fused
(`LatentMoE._forward_fused`, the layer benchmark's kernel sequence): one fp32-out GEMV for
router rows ‖ latent down rows ‖ shared gate ‖ up, the experts, one op for the latent norm +
shared SiTU, one GEMV for this rank's latent up columns ‖ shared down whose partial sums are
all-reduced (bf16, like every row-parallel output). Its packed weights: the shared gate/up
params live inside the first (`pack_rows_`: no second copy); the 1/TP router / latent-down
rows and the second weight are copies, (E + L)/TP·H + H·(L/TP + I_sh, padded) values per
layer (K3 TP16: 4.0 + 9.2 MB, 1.2 GB per rank). DecodeOptions.moe_fused off runs the unfused
block.

TP: the router, latent down/up projections and latent norm are replicated; each expert's
intermediate I is split (w1/w3 rows, w2 columns), so y_lat is a partial sum per rank that is
all-reduced BEFORE the latent RMSNorm (which needs the full sum). Shared experts are a
column/row-parallel gated MLP; their partial output rides in the same all-reduce (one collective
per MoE layer, summed in fp32).

Routed experts, two storages (`RoutedExperts`; which one: `routed_experts_mxfp4(cfg, layer)`):
- MXFP4-resident (the config's quantization_config covers the experts, K3): uint8 parameters in
  the kernels/moe_mxfp4.py `MXFP4Experts` layout of this rank's I slice, never dequantized:
      experts.w13_packed (E, 2, I_local, L/2)  experts.w13_scale (E, 2, I_local, L/32)  [gate; up]
      experts.w2_packed  (E, L, I_local/2)     experts.w2_scale  (E, L, I_local/32)     [down]
  shard_dim 2 of each full shape (I, or I/2 bytes, or I/32 groups: I_local % 32 == 0). The
  (E, 2, I_local, ·) tensors are the kernels' (E, 2I_local, ·) w13 / s13 as free views.
  Forward: kernels/moe_decode.py `routed_moe` picks the kernel (on CUDA the few-token kernels
  on the specialized path up to DecodeOptions.moe_max_pairs pairs, else the stock grouped
  kernel; device-side ids, no host sync, capturable; elsewhere `moe_mxfp4_reference`, a host
  sync on the unique ids).
- bf16 (no quantization_config): stacked parameters in the model dtype,
  experts.w1, experts.w3 (E, I_local, L) [gate, up] and experts.w2 (E, L, I_local) [down];
  shard_dim 1 for w1/w3 and 2 for w2 in the full shapes (E, I, L) / (E, L, I); a Python loop
  over the selected experts (host sync).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from raydecode.kernels.decode_elementwise_triton import latent_norm_situ
from raydecode.kernels.gemm_skinny_triton import skinny_gemm
from raydecode.kernels.gemv_norm_situ import norm_situ_gemv_cute
from raydecode.kernels.gemv_norm_situ import supports as norm_situ_gemv_supports
from raydecode.kernels.moe_decode import routed_moe
from raydecode.kernels.moe_mxfp4 import MAX_SCALE, MXFP4Experts
from raydecode.kernels.router import route_topk, router_logits
from raydecode.kernels.settings import DEFAULT_OPTIONS, DecodeOptions
from raydecode.kernels.stock_elementwise import add_rounded, add_rounded_reference

from .checkpoint import PREFIX, expert_is_mxfp4
from .config import K3Config
from .layers import (DerivedWeights, GatedMLP, RMSNorm, new_param, pack_rows_, replicated_linear,
                     situ, stock_fused, stock_linear, stock_skinny)
from .mxfp4 import E2M1_VALUES, GROUP_SIZE, SCALE_BIAS
from .parallel import Comm, LocalComm, Parallel
from .params import ffn_out_k, moe_block_fused
from .specialized import linear_for, row_slice, sharded_gemv


def route(logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int,
          num_groups: int = 1, topk_group: int = 1, renormalize: bool = True,
          scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """noaux_tc routing. logits (T, E) -> (weights (T, k) fp32, expert ids (T, k) int64).

    Selection uses sigmoid(logits) + bias; the weights are the uncorrected sigmoid scores of the
    selected experts, renormalised to sum to 1, times `scaling`. With groups, a group scores the
    sum of its top-2 selection scores (the max when there is no bias) and only the best
    `topk_group` groups are eligible."""
    scores = torch.sigmoid(logits.float())
    sel = scores if correction_bias is None else scores + correction_bias.float()
    if num_groups > 1:
        T, E = sel.shape
        grouped = sel.view(T, num_groups, E // num_groups)
        if correction_bias is not None:
            gscore = grouped.topk(min(2, E // num_groups), dim=-1).values.sum(-1)
        else:
            gscore = grouped.max(-1).values
        keep = torch.zeros_like(gscore, dtype=torch.bool)
        keep.scatter_(1, gscore.topk(topk_group, dim=-1).indices, True)
        sel = sel.masked_fill(~keep.repeat_interleave(E // num_groups, dim=1), float("-inf"))
    ids = sel.topk(top_k, dim=-1, sorted=True).indices
    w = scores.gather(1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w * scaling, ids


class MoEGate(nn.Module):
    """Router: weight (E, H) and e_score_correction_bias (E,) fp32, both replicated."""

    def __init__(self, hidden: int, num_experts: int, dtype: torch.dtype):
        super().__init__()
        self.weight = new_param((num_experts, hidden), Parallel(), None, dtype)
        self.e_score_correction_bias = new_param((num_experts,), Parallel(), None,
                                                 torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # (T, H) -> fp32 logits (T, E)
        return linear_fp32_out(x, self.weight)


# [0] cleared when this torch build has no mm(..., out_dtype=) for the operands, [1] when it
# has no out= for it (then the op and a copy)
_MM_OUT_DTYPE = [True, True]


def linear_fp32_out(x: torch.Tensor, w: torch.Tensor,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, K) · w (N, K)ᵀ -> fp32 (T, N), products exact and summed in fp32. For bf16 / fp16
    CUDA operands one tensor-core GEMM with fp32 output (`torch.mm(..., out_dtype=)`, cuBLAS),
    instead of upcasting both operands to fp32 and running the fp32 GEMM without tensor cores
    (the K3 router at a 2,048-token prefill chunk: 3.6 ms of 39 per 8 layers on an H200).
    Elsewhere, and where this torch build lacks the op, the fp32 upcast (the CPU reference).
    out: an fp32 (T, N) tensor (e.g. a column block of a wider buffer) the GEMM writes into.
    Stock decode batches (models/layers.py `stock_skinny`) run the skinny GEMM instead, where
    `out` is absent or contiguous (one row of a column block is)."""
    if x.dim() == 2 and (out is None or out.is_contiguous()) and stock_skinny(x, w):
        return skinny_gemm(x, w, out_dtype=torch.float32, out=out)
    half = x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype
    if half and x.is_cuda and _MM_OUT_DTYPE[0] and x.dim() == 2:
        try:
            if out is not None and _MM_OUT_DTYPE[1]:
                try:
                    return torch.mm(x, w.t(), out_dtype=torch.float32, out=out)
                except (TypeError, RuntimeError, NotImplementedError):
                    _MM_OUT_DTYPE[1] = False       # the op without out=, and a copy
            return _into(torch.mm(x, w.t(), out_dtype=torch.float32), out)
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_OUT_DTYPE[0] = False
    return _into(F.linear(x.float(), w.float()), out)


def _into(y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return y if out is None else out.copy_(y)


# ---- routed experts ------------------------------------------------------------------------

MXFP4_PARAMS = ("w13_packed", "w13_scale", "w2_packed", "w2_scale")


def routed_experts_mxfp4(cfg: K3Config, layer_idx: int | None = None) -> bool:
    """Whether layer `layer_idx`'s routed experts are MXFP4 in the checkpoint (its
    quantization_config, ignore list applied; default: the first MoE layer). w1/w2/w3 must
    agree: a layer with some packed and some bf16 expert linears is refused."""
    if layer_idx is None:
        layer_idx = next((i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)), 0)
    mod = f"{PREFIX}model.layers.{layer_idx}.block_sparse_moe.experts.0"
    kinds = {w: expert_is_mxfp4(cfg, f"{mod}.{w}") for w in ("w1", "w2", "w3")}
    if len(set(kinds.values())) != 1:
        raise ValueError(f"layer {layer_idx}: quantization_config makes routed experts "
                         f"{kinds} MXFP4 (True) / bf16 (False); w1, w2 and w3 must agree")
    return kinds["w1"]


def random_mxfp4(full_shape: tuple[int, ...], scales: bool,
                 gen: torch.Generator) -> torch.Tensor:
    """Random full MXFP4 expert data on the host: uniform codes (two per byte), or ue8m0
    scales 2**(s − 127) ≈ 1/(rms(e2m1) · sqrt(K)) (K = 32 · groups, the fan-in) with a jitter
    of ×{1/2, 1}, so the dequantized weights are ~N(0, 1/K)-sized. Every byte decodes. Drawn
    on the generator's device (the host one for init_random_), whatever device context is
    active: the same seed gives the same experts under `with torch.device("cuda")`."""
    if not scales:
        return torch.randint(0, 256, full_shape, generator=gen, dtype=torch.uint8,
                             device=gen.device)
    rms = math.sqrt(sum(v * v for v in E2M1_VALUES) / len(E2M1_VALUES))
    k = GROUP_SIZE * full_shape[-1]
    base = SCALE_BIAS + round(math.log2(1.0 / (rms * math.sqrt(k))))
    jitter = torch.randint(-1, 1, full_shape, generator=gen, device=gen.device)
    return (base + jitter).clamp(1, MAX_SCALE).to(torch.uint8)


class RoutedExperts(nn.Module):
    """One layer's routed experts on one rank: MXFP4-resident (`mxfp4`) or model-dtype
    parameters (module docstring). forward -> Σ_k w·expert(z) (T, L) fp32, partial over I."""

    def __init__(self, num_experts: int, latent: int, intermediate: int, beta: float,
                 linear_beta: float | None, par: Parallel, dtype: torch.dtype,
                 mxfp4: bool = False, options: DecodeOptions = DEFAULT_OPTIONS):
        super().__init__()
        self.beta, self.linear_beta, self.mxfp4 = beta, linear_beta, mxfp4
        self.options = options
        E, L, I, what = num_experts, latent, intermediate, "moe_intermediate_size"
        if not mxfp4:
            self.w1 = new_param((E, I, L), par, 1, dtype, what=what)
            self.w3 = new_param((E, I, L), par, 1, dtype, what=what)
            self.w2 = new_param((E, L, I), par, 2, dtype, what=what)
            return
        local = par.shard(I, what)
        if local % GROUP_SIZE:
            raise ValueError(f"experts.w2: tensor_parallel_size {par.tp_size} splits K = {I} "
                             f"into {local}-wide slices; MXFP4 slices must be whole groups of "
                             f"{GROUP_SIZE} (moe_intermediate_size/TP a multiple of "
                             f"{GROUP_SIZE})")
        if L % GROUP_SIZE:
            raise ValueError(f"routed_expert_hidden_size = {L}: MXFP4 experts need a multiple "
                             f"of the group size {GROUP_SIZE}")
        u8 = torch.uint8
        self.w13_packed = new_param((E, 2, I, L // 2), par, 2, u8, what=what)
        self.w13_scale = new_param((E, 2, I, L // GROUP_SIZE), par, 2, u8, what=what)
        self.w2_packed = new_param((E, L, I // 2), par, 2, u8, what=what)
        self.w2_scale = new_param((E, L, I // GROUP_SIZE), par, 2, u8, what=what)

    def packed(self) -> MXFP4Experts:
        """The resident weights as the kernels' container (views, no copy)."""
        E, _, I, Lh = self.w13_packed.shape
        return MXFP4Experts(self.w13_packed.view(E, 2 * I, Lh), self.w13_scale.view(E, 2 * I, -1),
                            self.w2_packed, self.w2_scale, self.beta, self.linear_beta)

    @torch.no_grad()
    def dense(self, dtype: torch.dtype | None = None):
        """(w1 (E, I_local, L), w3, w2 (E, L, I_local)) in `dtype` (tests, debugging): the
        parameters themselves, or a dequantized copy of the MXFP4 ones."""
        if not self.mxfp4:
            return tuple(w if dtype is None else w.to(dtype) for w in (self.w1, self.w3, self.w2))
        return self.packed().dequantized(dtype or torch.bfloat16)

    @torch.no_grad()
    def copy_experts_(self, experts: MXFP4Experts) -> None:
        """Set this rank's experts from an `MXFP4Experts` of its shapes (dequantized when the
        parameters are not MXFP4)."""
        if not self.mxfp4:
            for p, w in zip((self.w1, self.w3, self.w2), experts.dequantized(self.w1.dtype)):
                p.copy_(w)
            return
        dst = self.packed()
        for name in ("w13", "s13", "w2", "s2"):
            getattr(dst, name).copy_(getattr(experts, name))

    def forward(self, z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                path: str = "stock", out: torch.Tensor | None = None) -> torch.Tensor:
        """z (T, L), weights (T, k) fp32, ids (T, k) -> Σ_k w·expert(z) (T, L) fp32 (partial
        over I shards), written into `out` when given (fp32 (T, L), unit column stride).
        MXFP4: the kernel kernels/moe_decode.py `routed_moe` picks (on CUDA the ids stay on
        the device: no host sync)."""
        if not self.mxfp4:
            return self._forward_dense(z, weights, ids, path, out)
        return routed_moe(z, weights, ids, self.packed(), path, self.options, out=out)

    def _forward_dense(self, z, weights, ids, path: str, out=None) -> torch.Tensor:
        """Loops over the selected experts (host sync on the unique ids), never over tokens."""
        lin = linear_for(path, self.options)
        if out is None:
            out = z.new_zeros(z.shape, dtype=torch.float32)
        else:
            out.zero_()
        for e in torch.unique(ids).tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            h = z[tok]
            a = situ(lin(h, self.w1[e]), lin(h, self.w3[e]), self.beta, self.linear_beta)
            y = lin(a, self.w2[e])
            out.index_add_(0, tok, y.float() * weights[tok, slot].unsqueeze(-1))
        return out


class LatentMoE(nn.Module):
    """`block_sparse_moe` of a K3 layer."""

    def __init__(self, cfg: K3Config, par: Parallel = Parallel(), comm: Comm = LocalComm(),
                 dtype: torch.dtype = torch.float32, layer_idx: int | None = None,
                 options: DecodeOptions = DEFAULT_OPTIONS):
        super().__init__()
        m, H = cfg.moe, cfg.hidden_size
        self.cfg, self.par, self.comm, self.options = cfg, par, comm, options
        self.gate = MoEGate(H, m.num_experts, dtype)
        self.routed_expert_down_proj = replicated_linear(H, m.latent_size, dtype)
        self.experts = RoutedExperts(m.num_experts, m.latent_size, m.expert_intermediate,
                                     cfg.situ_beta, cfg.situ_linear_beta, par, dtype,
                                     mxfp4=routed_experts_mxfp4(cfg, layer_idx),
                                     options=options)
        self.routed_expert_norm = (RMSNorm(m.latent_size, cfg.rms_norm_eps, dtype)
                                   if m.latent_norm else None)
        self.routed_expert_up_proj = replicated_linear(m.latent_size, H, dtype)
        self.shared_experts = (GatedMLP(H, m.shared_intermediate, cfg.situ_beta,
                                        cfg.situ_linear_beta, par, comm, dtype, options)
                               if m.num_shared_experts > 0 else None)
        self._derived = DerivedWeights()    # the fused specialized block's packed weights

    def forward(self, x: torch.Tensor, path: str = "stock") -> torch.Tensor:
        """(T, H) -> (T, H), full sum."""
        if path == "specialized":
            return self._forward_specialized(x)
        m = self.cfg.moe
        logits = self.gate(x)
        if stock_fused(x) and m.num_expert_group <= 1:      # one kernel: kernels/router.py
            w, ids = route_topk(logits, self.gate.e_score_correction_bias, m.top_k,
                                m.renormalize, m.routed_scaling_factor)
        else:
            w, ids = route(logits, self.gate.e_score_correction_bias, m.top_k,
                           m.num_expert_group, m.topk_group, m.renormalize,
                           m.routed_scaling_factor)
        # the summed partials stay fp32 here: their rounding to x's dtype happens inside the
        # latent norm's kernel and the final add's (`rms_norm_cast`, `add_rounded`), not in a
        # (T, L + H) cast kernel of its own, and the add reads the shared block where it lies
        # (a strided view: PyTorch's add took its slow non-vectorized kernel)
        lat, shared = self._reduce(stock_linear(x, self.routed_expert_down_proj.weight), w, ids,
                                   x, "stock", rounded=False)
        if self.routed_expert_norm is not None:
            lat = self.routed_expert_norm.stock(lat, x.dtype)
        out = stock_linear(lat.to(x.dtype), self.routed_expert_up_proj.weight)
        if shared is None:
            return out
        return (add_rounded if stock_fused(x) else add_rounded_reference)(out, shared)

    def _reduce(self, z: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, x: torch.Tensor,
                path: str, rounded: bool = True):
        """The routed experts on z (their latent partial (T, L) fp32) and the shared experts on
        x (their partial output (T, H)) under one all-reduce: -> (full latent sum, full shared
        output or None), x's dtype (rounded=False: fp32 views of the summed buffer, for a
        caller that rounds them as it reads them). The latent must be summed before its norm,
        the shared output anyway: one collective. Both partials are written into the column
        blocks of one (T, L + H) fp32 buffer (the experts' weighted sum and, on the fused stock
        path, the shared down GEMM write there), not concatenated after: at an 8,191-token
        step of K3 the concatenation copied 302 MB per MoE layer (2.2 ms of 68 on 8 layers,
        H100)."""
        if self.shared_experts is None:
            lat = self.comm.all_reduce(self.experts(z, w, ids, path))
            return (lat.to(x.dtype) if rounded else lat), None
        L, H = z.shape[1], x.shape[1]
        both = torch.empty(x.shape[0], L + H, dtype=torch.float32, device=x.device)
        self.experts(z, w, ids, path, out=both[:, :L])
        shared = both[:, L:]
        if path == "stock" and stock_fused(x):
            # the shared down GEMM straight to fp32 into its block (no bf16 round trip, no
            # upcast kernel); the chains round it to x's dtype first, as before
            self.shared_experts.partial(x, path, down=lambda a, wd: linear_fp32_out(
                a, wd, out=shared))
        else:
            shared.copy_(self.shared_experts.partial(x, path))
        both = self.comm.all_reduce(both)                   # (T, L + H) fp32
        if rounded:
            both = both.to(x.dtype)
        return both[:, :L], both[:, L:]

    def _fused_ok(self, x: torch.Tensor) -> bool:
        """The fused specialized block (`_forward_fused`): shared experts and the latent norm
        present, a bf16 model (the norm + SiTU op writes the bf16 GEMV input), and
        DecodeOptions.moe_fused on."""
        # the parts: params.moe_block_fused(cfg), which the decode plan reads as well
        return (self.options.moe_fused and moe_block_fused(self.cfg)
                and x.dtype == torch.bfloat16)

    def _h2_proj(self) -> torch.Tensor:
        """(E/TP + L/TP + 2·I_sh, H): this rank's router rows and latent-down rows (copies of
        row slices, 1/TP of the replicated weights; at TP 1 the weights themselves) over the
        shared gate ‖ up, whose storage moves into the buffer (`pack_rows_`): one fp32-out
        GEMV for all four."""
        sh = self.shared_experts
        rep = [self.gate.weight, self.routed_expert_down_proj.weight]
        own = [sh.gate_proj.weight, sh.up_proj.weight]
        if self.par.tp_size == 1:       # the whole replicated weights: moved in as well
            own, rep = rep + own, []
        return self._derived.get("h2_proj", rep + own, lambda: pack_rows_(
            own, copies=[row_slice(w, self.par) for w in rep],
            old=self._derived.peek("h2_proj")))

    def _ffn_out(self) -> torch.Tensor:
        """(H, L/TP + I_sh padded to FFN_K_ALIGN): [this rank's latent-up columns ‖ shared
        down ‖ 0], a copy (columns cannot be views of row-major weights): one GEMV whose
        partial sums the all-reduce adds."""
        up, down = self.routed_expert_up_proj.weight, self.shared_experts.down_proj.weight
        n = self.par.shard(up.shape[1], "routed_expert_hidden_size")

        def build():
            k = n + down.shape[1]
            w = up.new_zeros(up.shape[0], ffn_out_k(n, down.shape[1]))
            w[:, :n].copy_(up[:, self.par.tp_rank * n:(self.par.tp_rank + 1) * n])
            w[:, n:k].copy_(down)
            return w

        return self._derived.get("ffn_out", [up, down], build)

    def _forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """The specialized block in two GEMVs and one norm + SiTU op around the router and
        the experts:

            y   = x · [router 1/TP ‖ latent down 1/TP ‖ shared gate ‖ up]ᵀ   fp32 (T, ·)
            logits, z = all-gather(y router cols), all-gather(y latent cols)
            lat = all-reduce(Σ_k w · expert(z))                               fp32 (T, L)
            a   = [RMSNorm(bf16(lat))[rank's L/TP cols] ‖ SiTU(bf16(gate, up)) ‖ 0]  one op
            out = all-reduce(a · [latent up cols ‖ shared down ‖ 0]ᵀ)         (T, H)
        (a and the GEMV in one CuTe kernel where it serves: DecodeOptions.ffn_out_fused)

        Rounding points are the stock block's (fp32 GEMV outputs round where they are read);
        the latent up and shared down partials add in one fp32 accumulator and the ranks'
        bf16 partials in the all-reduce, where stock all-gathers the up rows and adds."""
        m, sh, par = self.cfg.moe, self.shared_experts, self.par
        ne, nz = par.shard(m.num_experts, "num_experts"), par.shard(m.latent_size, "latent")
        lin, opt = linear_for("specialized", self.options), self.options
        y = lin(x, self._h2_proj(), torch.float32)
        logits = self.comm.all_gather(y[:, :ne], dim=-1)                   # (T, E) fp32
        w, ids = route_topk(logits.contiguous(), self.gate.e_score_correction_bias, m.top_k,
                            m.renormalize, m.routed_scaling_factor, gather=opt.router_gather)
        z = self.comm.all_gather(y[:, ne:ne + nz], dim=-1)                 # (T, L) fp32
        if not (z.is_cuda and self.experts.mxfp4):   # moe_decode rounds fp32 z as it loads
            z = z.to(x.dtype)
        lat = self.comm.all_reduce(self.experts(z, w, ids, "specialized"))
        w_out, nw, gu = self._ffn_out(), self.routed_expert_norm.weight, y[:, ne + nz:]
        args = (nw, self.routed_expert_norm.eps, par.tp_rank * nz, nz, gu, sh.beta,
                sh.linear_beta)
        if opt.ffn_out_fused and norm_situ_gemv_supports(lat, nw, nz, gu, w_out):
            out = norm_situ_gemv_cute(lat, *args, w_out, x.new_empty(x.shape[0], w_out.shape[0]))
        else:
            a = latent_norm_situ(lat, *args, x.new_empty(x.shape[0], w_out.shape[1]))
            out = lin(a, w_out)
        return self.comm.all_reduce(out)

    def _forward_specialized(self, x: torch.Tensor) -> torch.Tensor:
        """Router rows, latent down rows and latent up rows 1/TP per rank + all-gathers; the
        fused router op; experts and shared experts on the kernels/ GEMVs. `_forward_fused`
        where the layer has its parts (K3 does)."""
        if self._fused_ok(x):
            return self._forward_fused(x)
        m = self.cfg.moe
        logits = self.comm.all_gather(router_logits(x, row_slice(self.gate.weight, self.par)),
                                      dim=-1)                          # (T, E) fp32
        w, ids = route_topk(logits, self.gate.e_score_correction_bias, m.top_k,
                            m.renormalize, m.routed_scaling_factor,
                            gather=self.options.router_gather)
        z = sharded_gemv(x, [self.routed_expert_down_proj.weight], self.par, self.comm,
                         self.options)
        lat, shared = self._reduce(z, w, ids, x, "specialized")
        if self.routed_expert_norm is not None:
            lat = self.routed_expert_norm(lat)
        out = sharded_gemv(lat, [self.routed_expert_up_proj.weight], self.par, self.comm,
                           self.options)
        return out if shared is None else out + shared
