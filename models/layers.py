"""Building blocks shared by the K3 modules: parameters that know their TP slice, linear layers,
RMSNorm, SiTU, the vocab-parallel embedding and the gated (SiTU) MLP.

Sharding contract (the weight loader is written against it). Every parameter carries:
- `shard_dim`: None = replicated; else the dim of the *full checkpoint tensor* that is split 1/TP
  across ranks, rank r holding the r-th contiguous chunk;
- `full_shape`: the shape of that full checkpoint tensor (before slicing);
- optionally `shard_fn(full, par) -> local`: a custom slice the loader calls instead (KDA A_log).
`shard_tensor(full, param, par)` applies the contract and checks the result's shape.

Parameters are created at their LOCAL shapes with `torch.empty` and no device argument, so
`with torch.device("cuda"): K3ForCausalLM(...)` builds directly on a GPU. `Module.to_empty`
replaces Parameter objects (attributes are lost); use `to_empty_(model, device)` instead.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from raydecode.kernels import gemm_skinny_triton as _skinny
from raydecode.kernels import settings as _settings
from raydecode.kernels.settings import DEFAULT_OPTIONS, DecodeOptions

from .parallel import Comm, LocalComm, Parallel
from .specialized import linear_for

ShardFn = Callable[[torch.Tensor, Parallel], torch.Tensor]


# ---- parameters that know their slice -------------------------------------------------------

def new_param(full_shape: tuple[int, ...], par: Parallel, shard_dim: int | None,
              dtype: torch.dtype, shard_fn: ShardFn | None = None,
              local_shape: tuple[int, ...] | None = None, what: str = "parameter") -> nn.Parameter:
    """An uninitialised parameter holding this rank's slice of a `full_shape` tensor."""
    if local_shape is None:
        local_shape = tuple(full_shape)
        if shard_dim is not None:
            local_shape = list(local_shape)
            local_shape[shard_dim] = par.shard(full_shape[shard_dim], what)
            local_shape = tuple(local_shape)
    p = nn.Parameter(torch.empty(local_shape, dtype=dtype), requires_grad=False)
    p.shard_dim = shard_dim
    p.full_shape = tuple(full_shape)
    if shard_fn is not None:
        p.shard_fn = shard_fn
    return p


def shard_tensor(full: torch.Tensor, param: nn.Parameter, par: Parallel) -> torch.Tensor:
    """This rank's slice of checkpoint tensor `full` for `param` (a view where possible)."""
    fn = getattr(param, "shard_fn", None)
    dim = getattr(param, "shard_dim", None)
    if fn is not None:
        out = fn(full, par)
    elif dim is None:
        out = full
    else:
        size = par.shard(full.shape[dim], f"dim {dim} of a tensor of shape {tuple(full.shape)}")
        out = full.narrow(dim, par.tp_rank * size, size)
    if tuple(out.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint tensor of shape {tuple(full.shape)} sliced for tp_rank "
                         f"{par.tp_rank}/{par.tp_size} gives {tuple(out.shape)}; the parameter "
                         f"expects {tuple(param.shape)} (full shape "
                         f"{getattr(param, 'full_shape', '?')}, shard_dim {dim})")
    return out


# the stock path's fused kernels on CUDA bf16 (RAYDECODE_STOCK_FUSED), read once at import;
# tests set it to False to run the PyTorch chains on the same device and compare
STOCK_FUSED = _settings.stock_fused()


def stock_fused(x: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Whether a stock-path op on `x` runs its fused kernel (kernels/stock_elementwise.py and
    the decode kernels it shares): the setting on and x a CUDA bf16 tensor (or, with dtype,
    a CUDA tensor the op rounds to bf16 as it reads it); otherwise the PyTorch chain (the CPU
    path, fp32 models, and the reference the kernels are tested on)."""
    return STOCK_FUSED and x.is_cuda and (dtype or x.dtype) == torch.bfloat16


# The stock path's bf16 GEMMs of 1..STOCK_SKINNY_MAX_M rows on CUDA (decode batches) run the
# skinny tensor-core GEMM (kernels/gemm_skinny_triton.py), whose split-K partials are summed
# inside the kernel, instead of cuBLAS: at these shapes cuBLAS picks split-K forms that add
# a reduce kernel per GEMM, and how many varies by GPU (K3 TP16 at batch 1: 3.5 reduces per
# layer on the H100, 4.5 on the H200, where the stock layer came to 30.25 kernels against the
# ≤ 30 of issue 28: bench/results/prefill-h200-2026-12-07-blocked24c.json). Its compile keys
# do not depend on M below 16 but for Triton's M = 1 and M = 16 specializations, which the
# warm-up's token buckets 1, 2 and 16 compile. 0: cuBLAS always.
STOCK_SKINNY_MAX_M = 16


def stock_skinny_shape(M: int, N: int, K: int, bf16: bool) -> bool:
    """The shape rule of the comment above, on a CUDA rank: what the decode plan lists
    (models/decode_plan.py) and `stock_skinny` applies to real tensors."""
    return (bf16 and STOCK_FUSED and 0 < M <= STOCK_SKINNY_MAX_M
            and _skinny.shape_ok(M, N, K))


def stock_skinny(x2: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the stock GEMM x2 (M, K) · wᵀ runs the skinny kernel: the shape rule on a CUDA
    x2, and the kernel takes these tensors (`gemm_skinny_triton.supports`)."""
    return (x2.is_cuda and stock_skinny_shape(x2.shape[0], w.shape[0], w.shape[-1],
                                              x2.dtype == torch.bfloat16)
            and _skinny.supports(x2, w))


def stock_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """F.linear on the stock path: the skinny GEMM where `stock_skinny` says so (bf16, one
    rounding of the fp32 sums, as cuBLAS), else F.linear."""
    if bias is None and x.is_cuda:
        x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        if stock_skinny(x2, w):
            return _skinny.skinny_gemm(x2, w).reshape(*x.shape[:-1], w.shape[0])
    return F.linear(x, w, bias)


_SHARD_ATTRS = ("shard_dim", "full_shape", "shard_fn")


def to_empty_(module: nn.Module, device) -> nn.Module:
    """`module.to_empty(device=...)` that keeps the sharding attributes on every parameter."""
    saved = {n: {a: getattr(p, a) for a in _SHARD_ATTRS if hasattr(p, a)}
             for n, p in module.named_parameters()}
    module.to_empty(device=device)
    for n, p in module.named_parameters():
        for a, v in saved[n].items():
            setattr(p, a, v)
    return module


# ---- elementwise --------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             op_rounding: bool = False) -> torch.Tensor:
    """x / sqrt(mean(x²) + eps) · weight over the last dim, in fp32, returned in x's dtype (one
    rounding: vLLM's fused norm kernels, e.g. K3's q/kv-a norm). op_rounding: as vLLM's plain
    RMSNorm op rounds instead (K3's final norm): the normalised x rounded to the weight's dtype,
    times the weight in that dtype, then to x's (a bf16 weight: two roundings)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y.to(weight.dtype) * weight if op_rounding else y * weight.float()
    return y.to(x.dtype)


def rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm wholly in fp32 (x, weight and product), unrounded: the output norm of vLLM's
    AttnRes kernel, which reads the fp32 mix. -> fp32; the caller rounds once."""
    xf = x.float()
    return xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.float()


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None):
    """SiTU-and-multiply: β·tanh(gate/β)·sigmoid(gate) · β_lin·tanh(up/β_lin), in fp32."""
    g, u = gate.float(), up.float()
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (a * u).to(gate.dtype)


class DerivedWeights:
    """Tensors derived from parameters (a concatenation, a transposed contiguous copy, exp of a
    log-parameter) for the decode kernels, built once and rebuilt only when a source's storage
    or version changes (a loader's copy_, a new state dict): no per-step rebuild on the hot
    path. Built without autograd (decode runs no backward)."""

    def __init__(self) -> None:
        self._memo: dict[str, tuple] = {}

    @staticmethod
    def _key(sources) -> tuple:
        return tuple((t.data_ptr(), 0 if t.is_inference() else t._version, t.device, t.dtype)
                     for t in sources)

    def built(self) -> dict[str, torch.Tensor]:
        """Every derived tensor built so far, by name."""
        return {k: v[1] for k, v in self._memo.items()}

    def source_ptrs(self) -> set[int]:
        """data_ptr of every source the current derived tensors were built from (after the
        build: a source `pack_rows_` moved points into its buffer)."""
        return {k[0] for key, _ in self._memo.values() for k in key}

    def peek(self, name: str) -> torch.Tensor | None:
        """The last tensor built under `name` (whether or not it is still current)."""
        hit = self._memo.get(name)
        return None if hit is None else hit[1]

    def get(self, name: str, sources, build) -> torch.Tensor:
        hit = self._memo.get(name)
        if hit is None or hit[0] != self._key(sources):
            with torch.inference_mode(False), torch.no_grad():
                out = build()
            # keyed after the build: a build may move its sources (`pack_rows_`)
            hit = self._memo[name] = (self._key(sources), out)
        return hit[1]


@torch.no_grad()
def pack_rows_(params: list[nn.Parameter], copies: list[torch.Tensor] = (),
               old: torch.Tensor | None = None, align: int = 1) -> torch.Tensor:
    """One contiguous (Σ rows, K) buffer: `copies` (row slices of replicated weights: copied)
    then `params`, whose storage moves into the buffer (each becomes a row view of it, so their
    bytes are held once; the stock path reads the same views). `old`: the buffer a previous
    call returned; it is reused, and only the copies are rewritten, while the params are still
    its views (a loader's copy_ wrote through them). Rows are zero-padded to a multiple of
    `align` (GEMV tiling). For one GEMV over many weights sharing their input."""
    n_copy = sum(c.shape[0] for c in copies)
    rows = [p.shape[0] for p in params]
    at = [n_copy + sum(rows[:i]) for i in range(len(rows))]
    n = -(-(n_copy + sum(rows)) // align) * align
    buf = old
    if buf is None or buf.shape[0] != n or not all(
            p.data_ptr() == buf[a].data_ptr() and p.shape == buf[a:a + r].shape
            for p, a, r in zip(params, at, rows)):
        ref = params[0] if params else copies[0]
        buf = torch.zeros(n, ref.shape[1], dtype=ref.dtype, device=ref.device)
        for p, a, r in zip(params, at, rows):
            buf[a:a + r].copy_(p)
            p.data = buf[a:a + r]
    a = 0
    for c in copies:
        buf[a:a + c.shape[0]].copy_(c)
        a += c.shape[0]
    return buf


def adjacent_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """[a; b] as one (Na + Nb, K) view where b's rows follow a's in the same storage (both
    row-major, e.g. two weights `pack_rows_` moved into one buffer), else None."""
    if (a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1] or a.dtype != b.dtype
            or not (a.is_contiguous() and b.is_contiguous())
            or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
            or b.storage_offset() != a.storage_offset() + a.numel()):
        return None
    return a.as_strided((a.shape[0] + b.shape[0], a.shape[1]), a.stride())


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32,
                 op_rounding: bool = False):
        super().__init__()
        self.eps, self.op_rounding = eps, op_rounding
        self.weight = new_param((dim,), Parallel(), None, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.op_rounding)

    def stock(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """forward(x.to(dtype)) on the stock path (dtype: x's unless given; an fp32 sum is
        rounded to the model dtype first, as the chains round it): one kernel where
        `stock_fused` holds for the rounded input (kernels/decode_elementwise_triton.py
        `rms_norm_cast`: the rounding, fp32 math, one rounding of the output, as `rms_norm`
        without op_rounding); else forward."""
        dtype = dtype or x.dtype
        if self.op_rounding or not stock_fused(x, dtype) or x.shape[-1] != self.weight.numel():
            return self.forward(x.to(dtype))
        from raydecode.kernels.decode_elementwise_triton import rms_norm_cast
        return rms_norm_cast(x.reshape(-1, x.shape[-1]), self.weight, self.eps,
                             dtype).view(x.shape)


class Linear(nn.Module):
    """y = x Wᵀ, no bias. shard_dim None: replicated; 0: column-parallel (output rows split,
    output is this rank's slice); 1: row-parallel (input split; the output is a partial sum the
    caller reduces with comm.all_reduce)."""

    def __init__(self, in_features: int, out_features: int, par: Parallel = Parallel(),
                 shard_dim: int | None = None, dtype: torch.dtype = torch.float32,
                 what: str = "linear"):
        super().__init__()
        self.weight = new_param((out_features, in_features), par, shard_dim, dtype, what=what)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def column_linear(in_f: int, out_f: int, par: Parallel, dtype: torch.dtype, what: str = ""):
    return Linear(in_f, out_f, par, 0, dtype, what or "output features")


def row_linear(in_f: int, out_f: int, par: Parallel, dtype: torch.dtype, what: str = ""):
    return Linear(in_f, out_f, par, 1, dtype, what or "input features")


def replicated_linear(in_f: int, out_f: int, dtype: torch.dtype):
    return Linear(in_f, out_f, Parallel(), None, dtype)


class VocabParallelEmbedding(nn.Module):
    """Rows split by vocab: rank r holds ids [r·V/TP, (r+1)·V/TP); others contribute zeros and
    the all-reduce assembles the full (T, H) embedding."""

    def __init__(self, vocab: int, hidden: int, par: Parallel, comm: Comm, dtype: torch.dtype):
        super().__init__()
        self.par, self.comm = par, comm
        self.weight = new_param((vocab, hidden), par, 0, dtype, what="vocab_size")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.par.tp_size == 1:
            return F.embedding(ids, self.weight)
        n = self.weight.shape[0]
        local = ids - self.par.tp_rank * n
        mine = (local >= 0) & (local < n)
        out = F.embedding(local.clamp(0, n - 1), self.weight) * mine.unsqueeze(-1)
        return self.comm.all_reduce(out)


class GatedMLP(nn.Module):
    """down(SiTU(gate(x), up(x))): gate/up column-parallel, down row-parallel + all-reduce.
    The dense FFN of the first layers and the MoE shared experts."""

    def __init__(self, hidden: int, intermediate: int, beta: float, linear_beta: float | None,
                 par: Parallel, comm: Comm = LocalComm(), dtype: torch.dtype = torch.float32,
                 options: DecodeOptions = DEFAULT_OPTIONS):
        super().__init__()
        self.comm, self.beta, self.linear_beta = comm, beta, linear_beta
        self.options = options
        self.gate_proj = column_linear(hidden, intermediate, par, dtype, "MLP intermediate size")
        self.up_proj = column_linear(hidden, intermediate, par, dtype, "MLP intermediate size")
        self.down_proj = row_linear(intermediate, hidden, par, dtype, "MLP intermediate size")

    def forward(self, x: torch.Tensor, path: str = "stock") -> torch.Tensor:
        """(T, H) -> (T, H), full sum. Specialized: the same math on the kernels/ GEMVs."""
        return self.comm.all_reduce(self.partial(x, path))

    def partial(self, x: torch.Tensor, path: str = "stock", down=None) -> torch.Tensor:
        """(T, H) -> this rank's partial sum (T, H) of the output, before the all-reduce (for a
        caller that reduces it together with other partials). down: the down projection's
        GEMM `down(a, w)` (default the path's linear), e.g. one with fp32 output."""
        lin = linear_for(path, self.options)
        fused = path == "stock" and stock_fused(x)
        gu_w = adjacent_rows(self.gate_proj.weight, self.up_proj.weight) if fused else None
        if gu_w is not None:           # gate ‖ up already one buffer (a packed weight): one GEMM
            gu = lin(x, gu_w)
            n = self.gate_proj.weight.shape[0]
            gate, up = gu[:, :n], gu[:, n:]
        else:
            gate, up = lin(x, self.gate_proj.weight), lin(x, self.up_proj.weight)
        if fused:                                       # one kernel for the SiTU chain
            from raydecode.kernels.stock_elementwise import situ_pair
            a = situ_pair(gate, up, self.beta, self.linear_beta)
        else:
            a = situ(gate, up, self.beta, self.linear_beta)
        return (down or lin)(a, self.down_proj.weight)
