"""K3's latent MoE: sigmoid router with a selection-only correction bias, routed experts in a
down-projected latent, RMSNorm of the latent sum, up-projection, plus shared experts.

    logits = x · W_gateᵀ (fp32);  s = sigmoid(logits)                      (T, E)
    ids    = top-k of (s + e_score_correction_bias)  [group-limited when num_expert_group > 1]
    w      = s[ids] / Σ s[ids] · routed_scaling_factor                        bias never in w
    z      = routed_expert_down_proj(x)                                       (T, L) latent
    y_lat  = Σ_k w_k · w2_e(SiTU(w1_e z, w3_e z))                            (T, L) fp32
    out    = routed_expert_up_proj(RMSNorm(y_lat)) + shared_experts(x)       (T, H)

Specialized step (models/specialized.py): router, latent down and latent up rows are computed
1/TP per rank from row views of the replicated weights and all-gathered; routing is the fused
`kernels.router.route_topk` (one expert group).

TP: the router, latent down/up projections and latent norm are replicated; each expert's
intermediate I is split (w1/w3 rows, w2 columns), so y_lat is a partial sum per rank that is
all-reduced BEFORE the latent RMSNorm (which needs the full sum). Shared experts are a
column/row-parallel gated MLP; their partial output rides in the same all-reduce (one collective
per MoE layer, summed in fp32).

Routed experts are stacked parameters in the model dtype (MXFP4 is dequantized by the loader):
experts.w1, experts.w3 (E, I_local, L) [gate, up] and experts.w2 (E, L, I_local) [down];
shard_dim 1 for w1/w3 and 2 for w2 in the full stacked shapes (E, I, L) / (E, L, I).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raydecode.kernels.router import route_topk, router_logits

from .config import K3Config
from .layers import GatedMLP, RMSNorm, new_param, replicated_linear, situ
from .parallel import Comm, LocalComm, Parallel
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
        return F.linear(x.float(), self.weight.float())


class RoutedExperts(nn.Module):
    def __init__(self, num_experts: int, latent: int, intermediate: int, beta: float,
                 linear_beta: float | None, par: Parallel, dtype: torch.dtype):
        super().__init__()
        self.beta, self.linear_beta = beta, linear_beta
        what = "moe_intermediate_size"
        self.w1 = new_param((num_experts, intermediate, latent), par, 1, dtype, what=what)
        self.w3 = new_param((num_experts, intermediate, latent), par, 1, dtype, what=what)
        self.w2 = new_param((num_experts, latent, intermediate), par, 2, dtype, what=what)

    def forward(self, z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                path: str = "stock") -> torch.Tensor:
        """z (T, L), weights/ids (T, k) -> Σ_k w·expert(z) (T, L) fp32 (partial over I shards).
        Loops over the selected experts (host sync on the unique ids), never over tokens.
        GPU note: the `.tolist()` is a host sync per MoE layer; the specialized GPU step needs a
        grouped expert kernel that reads ids on the device (kernels issue)."""
        lin = linear_for(path)
        out = z.new_zeros(z.shape, dtype=torch.float32)
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
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        m, H = cfg.moe, cfg.hidden_size
        self.cfg, self.par, self.comm = cfg, par, comm
        self.gate = MoEGate(H, m.num_experts, dtype)
        self.routed_expert_down_proj = replicated_linear(H, m.latent_size, dtype)
        self.experts = RoutedExperts(m.num_experts, m.latent_size, m.expert_intermediate,
                                     cfg.situ_beta, cfg.situ_linear_beta, par, dtype)
        self.routed_expert_norm = (RMSNorm(m.latent_size, cfg.rms_norm_eps, dtype)
                                   if m.latent_norm else None)
        self.routed_expert_up_proj = replicated_linear(m.latent_size, H, dtype)
        self.shared_experts = (GatedMLP(H, m.shared_intermediate, cfg.situ_beta,
                                        cfg.situ_linear_beta, par, comm, dtype)
                               if m.num_shared_experts > 0 else None)

    def forward(self, x: torch.Tensor, path: str = "stock") -> torch.Tensor:
        """(T, H) -> (T, H), full sum."""
        if path == "specialized":
            return self._forward_specialized(x)
        m = self.cfg.moe
        w, ids = route(self.gate(x), self.gate.e_score_correction_bias, m.top_k,
                       m.num_expert_group, m.topk_group, m.renormalize,
                       m.routed_scaling_factor)
        lat, shared = self._reduce(self.experts(self.routed_expert_down_proj(x), w, ids), x,
                                   "stock")
        if self.routed_expert_norm is not None:
            lat = self.routed_expert_norm(lat)
        out = self.routed_expert_up_proj(lat)
        return out if shared is None else out + shared

    def _reduce(self, lat: torch.Tensor, x: torch.Tensor, path: str):
        """One all-reduce for the routed latent partial (T, L) fp32 and the shared experts'
        partial output (T, H): -> (full latent sum, full shared output or None), x's dtype.
        The latent must be summed before its norm, the shared output anyway: one collective."""
        if self.shared_experts is None:
            return self.comm.all_reduce(lat).to(x.dtype), None
        L = lat.shape[1]
        both = torch.cat([lat, self.shared_experts.partial(x, path).float()], -1)
        both = self.comm.all_reduce(both).to(x.dtype)       # (T, L + H)
        return both[:, :L], both[:, L:]

    def _forward_specialized(self, x: torch.Tensor) -> torch.Tensor:
        """Router rows, latent down rows and latent up rows 1/TP per rank + all-gathers; the
        fused router op; experts and shared experts on the kernels/ GEMVs."""
        m = self.cfg.moe
        logits = self.comm.all_gather(router_logits(x, row_slice(self.gate.weight, self.par)),
                                      dim=-1)                          # (T, E) fp32
        w, ids = route_topk(logits, self.gate.e_score_correction_bias, m.top_k,
                            m.renormalize, m.routed_scaling_factor)
        z = sharded_gemv(x, [self.routed_expert_down_proj.weight], self.par, self.comm)
        lat, shared = self._reduce(self.experts(z, w, ids, "specialized"), x, "specialized")
        if self.routed_expert_norm is not None:
            lat = self.routed_expert_norm(lat)
        out = sharded_gemv(lat, [self.routed_expert_up_proj.weight], self.par, self.comm)
        return out if shared is None else out + shared
