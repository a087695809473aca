"""Random weights drawn on the device and a one-device stand-in for a TP group, shared by the
step and layer benchmarks (moved verbatim from step.py and layer_weights.py)."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch

from raydecode.models.config import K3Config
from raydecode.models.k3 import K3ForCausalLM
from raydecode.models.moe import MXFP4_PARAMS, random_mxfp4
from raydecode.models.parallel import Comm, Parallel


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]       # local (this rank)
    full_shape: tuple[int, ...]
    dtype: torch.dtype


def layer_param_specs(cfg: K3Config, layer_idx: int, par: Parallel) -> dict[str, ParamSpec]:
    """The model's parameters of layer `layer_idx` at this rank's shapes (meta device)."""
    with torch.device("meta"):
        layer = K3DecoderLayer(cfg, layer_idx, par, LocalComm(), BF16)
    return {n: ParamSpec(tuple(p.shape), tuple(p.full_shape), p.dtype)
            for n, p in layer.named_parameters()}


def init_value(name: str, spec: ParamSpec, cfg: K3Config, gen: torch.Generator,
               device) -> torch.Tensor:
    """A random local tensor for parameter `name` (models/k3.py `_random_full` rules)."""
    leaf = name.rsplit(".", 1)[-1]
    owner = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    shape = spec.shape

    def randn():
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32)

    if leaf == "A_log":
        v = torch.rand(shape, generator=gen, device=device) * math.log(4.0)
    elif leaf == "dt_bias":
        v = 0.5 * randn() - 1.0
    elif leaf == "e_score_correction_bias":
        v = 0.1 * randn()
    elif owner.endswith("conv1d"):
        v = 0.5 * randn()
    elif owner.endswith("norm"):
        v = 1.0 + 0.1 * randn()
    else:
        v = randn() / math.sqrt(spec.full_shape[-1])
    return v.to(spec.dtype)


class SoloRankComm(Comm):
    """One device playing rank 0 of TP `par.tp_size`: all-reduce is the identity (counted),
    the gathers concatenate this rank's slice TP (DCP) times: the shapes and copies of the real
    gather, the values of rank 0 everywhere."""

    def __init__(self, par: Parallel):
        self.par, self.counts = par, Counter()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.counts["all_reduce"] += 1
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self.counts["all_gather"] += 1
        return torch.cat([x] * self.par.tp_size, dim=dim) if self.par.tp_size > 1 else x

    def dcp_all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        self.counts["dcp_all_gather"] += 1
        return torch.cat([x] * self.par.dcp_size, dim=dim) if self.par.dcp_size > 1 else x


@torch.no_grad()
def init_on_device_(model: K3ForCausalLM, seed: int) -> K3ForCausalLM:
    """Random local parameters drawn where they live (no full host tensors: K3 has 2.8T
    parameters). Scales follow models/k3.py `_random_full` with the full fan-in; MXFP4 codes
    are uniform bytes, scales drawn for the full group count and sliced."""
    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in MXFP4_PARAMS and leaf.endswith("_scale"):
            full = random_mxfp4(tuple(p.shape[:-1]) + (p.full_shape[-1],), True, gen)
            p.copy_(full[..., :p.shape[-1]])
        elif leaf in MXFP4_PARAMS:
            p.copy_(random_mxfp4(tuple(p.shape), False, gen))
        else:
            spec = ParamSpec(tuple(p.shape), tuple(p.full_shape), p.dtype)
            p.copy_(init_value(name, spec, model.cfg, gen, dev))
    return model


__all__ = ["ParamSpec", "SoloRankComm", "init_on_device_", "init_value"]
