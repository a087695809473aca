"""Attention Residuals (AttnRes): K3's replacement for the plain residual stream.

The stream is a bank of block snapshots b_0 … b_{n-1} plus a running prefix p (the sum of the
sublayer outputs since the last snapshot; at the start p is the embedding). Before every sublayer
(and once before the final norm) a single learned query mixes them over depth:

    V = [b_0, …, b_{n-1}, p]                     (T, n+1, H)
    s_j = RMSNorm(V_j; w_norm) · w_proj          (T, n+1)    w_proj is the (1, H) `*_res_proj`
    mix = Σ_j softmax(s)_j · V_j                 (T, H)      raw (un-normalised) values

A new block starts at every layer i with i % attn_res_block_size == 0: the prefix as it stands
before that layer's attention becomes snapshot b_{i / block_size}, and the attention output
starts the next prefix. Every other sublayer output is added to the prefix. With 93 layers and
blocks of 12 this leaves 8 snapshots for the final mix. Mixes are per token, so nothing here is
cached across decode steps.
"""
from __future__ import annotations

import torch

from raydecode.kernels.attnres_norm import (attnres_add_mix_norm, attnres_mix_norm,
                                            triton_serves)

from .layers import RMSNorm, rms_norm_fp32


def attnres_fusable(x: torch.Tensor) -> bool:
    """Whether the fused mix + norm op runs a kernel on this stream's tensors (CUDA + Triton:
    kernels/attnres_norm.py); elsewhere it would run its PyTorch reference, which the stock
    path's own mix already is."""
    return triton_serves(x)


def attn_res_mix(values: torch.Tensor, norm_weight: torch.Tensor, proj_weight: torch.Tensor,
                 eps: float, keep_fp32: bool = False) -> torch.Tensor:
    """values (T, n, H), norm_weight (H,), proj_weight (1, H) -> (T, H) in values' dtype, or
    fp32 with keep_fp32. In fp32 throughout, as vLLM's attn_res kernel:
        s_j = rsqrt(mean(v_j²) + eps) · Σ_h v_jh · (w_norm ⊙ w_proj)_h      (keys never rounded)"""
    v = values.float()                                                  # (T, n, H)
    rstd = torch.rsqrt(v.square().mean(-1) + eps)                       # (T, n)
    probs = ((v @ (norm_weight.float() * proj_weight[0].float())) * rstd).softmax(-1)
    mix = (probs.unsqueeze(1) @ v).squeeze(1)                           # (T, H) fp32
    return mix if keep_fp32 else mix.to(values.dtype)


class AttnResStream:
    """The residual bank of one forward pass: `blocks` snapshots and the running `prefix`.

    Stock: `add` then `mix`, and the caller normalises. Specialized: `defer` holds a sublayer
    output in `pending` and the next `mix_norm` adds it to the prefix, mixes and normalises in
    the one fused op of kernels/attnres_norm.py."""

    def __init__(self, embedding: torch.Tensor, capacity: int = 0, cute: bool = True,
                 fused: bool = False):
        """capacity > 0: room for that many snapshots in one (T, capacity, H) tensor; each
        snapshot is slot j of it (`blocks[j]` a view), so the blocks form one strided view
        the fused mix + norm reads without a stack copy (the specialized step:
        DecodeOptions.attnres_bank). Past the capacity, or with 0, snapshots are the prefix
        tensors themselves. cute: `mix_norm` may use the CuTe kernel (DecodeOptions
        .attnres_cute; False: Triton). fused: the layers drive this stream through `mix_norm`
        and `defer` (the specialized step; the stock step where `attnres_fusable`), else
        through `mix_then_norm` and `add`."""
        self.fused = fused
        if capacity < 0:
            raise ValueError(f"AttnRes bank capacity {capacity}; expected ≥ 0 snapshots")
        self.cute = cute
        self.blocks: list[torch.Tensor] = []
        self.prefix = embedding                                  # (T, H)
        self.pending: torch.Tensor | None = None                 # output not yet in prefix
        self.bank = (embedding.new_empty(embedding.shape[0], capacity, embedding.shape[-1])
                     if capacity else None)

    @classmethod
    def resume(cls, blocks: list[torch.Tensor], prefix: torch.Tensor,
               pending: torch.Tensor | None = None, cute: bool = True) -> "AttnResStream":
        """The stream as it stands inside a forward: these snapshots (views of one bank
        tensor, or separate tensors), the running prefix and a deferred sublayer output (a
        layer benchmark's state before one layer). No capacity: the layer must not start a
        block."""
        s = cls(prefix, capacity=0, cute=cute)
        s.blocks, s.pending = list(blocks), pending
        return s

    def _next_slot(self) -> torch.Tensor | None:
        """The bank slot the next snapshot goes to (None: no bank, or full)."""
        n = len(self.blocks)
        if self.bank is None or n >= self.bank.shape[1]:
            return None
        return self.bank[:, n]

    def mix(self, norm: RMSNorm, proj_weight: torch.Tensor,
            rows: torch.Tensor | None = None) -> torch.Tensor:
        """The mix rounded to the stream's dtype (before the final norm: vLLM's as well).
        rows: (R,) token indices -> only those tokens' mix (R, H): mixes are per token, so the
        rows that sample need no other row (the final mix of a prefill chunk: 1 row of 8,192)."""
        parts = self.blocks + [self.prefix]
        if rows is not None:
            parts = [p.index_select(0, rows) for p in parts]
        values = torch.stack(parts, dim=1)                       # (T or R, n+1, H)
        return attn_res_mix(values, norm.weight, proj_weight, norm.eps)

    def mix_then_norm(self, res_norm: RMSNorm, proj_weight: torch.Tensor,
                      out_norm: RMSNorm) -> torch.Tensor:
        """out_norm(mix) for a sublayer's input, rounded as vLLM's attn_res kernel: the fp32
        mix enters the norm unrounded and h is rounded once, to the stream's dtype."""
        values = torch.stack(self.blocks + [self.prefix], dim=1)  # (T, n+1, H)
        mix = attn_res_mix(values, res_norm.weight, proj_weight, res_norm.eps, keep_fp32=True)
        return rms_norm_fp32(mix, out_norm.weight, out_norm.eps).to(self.prefix.dtype)

    def add(self, out: torch.Tensor, new_block: bool) -> None:
        """Account a sublayer output; `new_block` snapshots the prefix first and restarts it."""
        if new_block:
            slot = self._next_slot()
            if slot is not None and slot.data_ptr() != self.prefix.data_ptr():
                slot.copy_(self.prefix)       # a prefix not written there by `mix_norm`
            self.blocks.append(self.prefix if slot is None else slot)
            self.prefix = out
        else:   # rounded once to the model dtype, like the reference's bf16 prefix
            self.prefix = (self.prefix.float() + out.float()).to(self.prefix.dtype)

    def flush(self) -> None:
        """Add a deferred sublayer output to the prefix (rounded once, as `add`)."""
        if self.pending is not None:
            self.prefix = (self.prefix.float() + self.pending.float()).to(self.prefix.dtype)
            self.pending = None

    def defer(self, out: torch.Tensor, new_block: bool) -> None:
        """`add` for the specialized step: a new block snapshots at once, anything else waits
        for the next `mix_norm` (the residual-add form of the fused op)."""
        assert self.pending is None, "mix_norm must consume the previous output first"
        if new_block:
            self.add(out, new_block=True)
        else:
            self.pending = out

    def mix_norm(self, res_norm: RMSNorm, proj_weight: torch.Tensor, out_norm: RMSNorm,
                 snapshot: bool = False) -> torch.Tensor:
        """out_norm(mix(bank)) after adding `pending`, as one fused op. -> (T, H)
        snapshot: the prefix formed here becomes the next block (the layer starts one), so the
        op writes it straight into the bank's next slot and `add` copies nothing."""
        args = (res_norm.weight, proj_weight, out_norm.weight, res_norm.eps, out_norm.eps)
        if self.pending is None:
            return attnres_mix_norm(self.blocks, self.prefix, *args, cute=self.cute)
        slot = self._next_slot() if snapshot else None
        self.prefix, h = attnres_add_mix_norm(self.blocks, self.prefix, self.pending, *args,
                                              new_prefix=slot, cute=self.cute)
        self.pending = None
        return h
