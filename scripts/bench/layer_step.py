"""One K3 decoder layer, the model's own `K3DecoderLayer`, as the layer benchmark runs it: B
sequences of one token each at rank 0's per-rank shapes, its weights, caches and AttnRes state
held by a `LayerCopy`.

    state   bank (B, n + 1, H): n block snapshots before the layer (one bank tensor, as the
            served step keeps them) and the running prefix; pending (B, H): the previous
            layer's FFN output, folded into this layer's first AttnRes mix (the served
            residual-add form); KDA conv + fp32 recurrent state or the MLA latent rows of
            `context` cached positions, the step's row stored at position `context`
    step    AttnResStream.resume(blocks, prefix, pending) → layer.forward(stream, batch,
            caches, path) — the served code, the options' kernels (models/decode_plan.py)

The specialized step is graph-shaped: the paging (block table, store index, sequence lengths)
and the KDA slots live in fixed device tensors (`LayerStatics`, the caches' `statics`, as
engine/step_graph.py's StepStatics), so it captures into a CUDA graph with no host value read.
The stock step is the model's stock path (Python loops, host syncs): the layer benchmark times
it eagerly. One device plays rank 0 (`SoloRankComm`: all-reduces skipped and counted,
all-gathers tile this rank's slice, the shapes and copies of the real ones).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from raydecode.kernels.settings import DEFAULT_OPTIONS, DecodeOptions
from raydecode.models.attnres import AttnResStream
from raydecode.models.cache import KDAStateCache, MLALatentCache, ModelCaches, StepBatch
from raydecode.models.config import K3Config
from raydecode.models.k3 import K3DecoderLayer
from raydecode.models.moe import MXFP4_PARAMS, random_mxfp4
from raydecode.models.parallel import Comm, Parallel

from .random_init import ParamSpec, SoloRankComm, init_value

BF16 = torch.bfloat16
# replicated weights the specialized path reads 1/TP of (models/specialized.py)
ROW_SHARDED = ("q_a_proj", "kv_a_proj_with_mqa", "gate", "routed_expert_down_proj",
               "routed_expert_up_proj")


@dataclass
class LayerStatics:
    """The graph-shaped step's per-step inputs in device tensors (the fields the fused MLA and
    KDA decode read from `caches.statics`), for the first T of B sequences."""
    table: torch.Tensor        # (T, pages) int32
    store: torch.Tensor        # (T,) int32: the row index this step stores
    seq_lens: torch.Tensor     # (T,) int32
    slots: torch.Tensor        # (T,) int64


@torch.no_grad()
def random_layer(cfg: K3Config, idx: int, par: Parallel, comm: Comm, seed: int, device,
                 options: DecodeOptions = DEFAULT_OPTIONS) -> K3DecoderLayer:
    """Layer `idx` at this rank's shapes, random weights drawn on the device (models/k3.py
    `_random_full` scales), balanced routing (a zero correction bias, as a trained noaux_tc
    bias aims for: the random init would favour a few experts and under-count expert bytes)."""
    with torch.device(device):
        layer = K3DecoderLayer(cfg, idx, par, comm, BF16, options)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in layer.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in MXFP4_PARAMS and leaf.endswith("_scale"):
            full = random_mxfp4(tuple(p.shape[:-1]) + (p.full_shape[-1],), True, gen)
            p.copy_(full[..., :p.shape[-1]])
        elif leaf in MXFP4_PARAMS:
            p.copy_(random_mxfp4(tuple(p.shape), False, gen))
        elif leaf == "e_score_correction_bias":
            p.zero_()
        else:
            p.copy_(init_value(name, ParamSpec(tuple(p.shape), tuple(p.full_shape), p.dtype),
                               cfg, gen, device))
    return layer


class LayerCopy:
    """One layer copy (weights, caches, state) for up to `max_batch` sequences."""

    def __init__(self, cfg: K3Config, idx: int, tp: int, max_batch: int, context: int,
                 seed: int, device, options: DecodeOptions = DEFAULT_OPTIONS,
                 layer: K3DecoderLayer | None = None):
        if idx % cfg.attn_res_block_size == 0:
            raise ValueError(f"layer {idx} starts an AttnRes block; the benchmark times layers "
                             "inside a block")
        self.cfg, self.idx, self.kind = cfg, idx, cfg.layer_kinds[idx]
        self.par = Parallel(0, tp)
        self.comm = SoloRankComm(self.par)
        self.B, self.context, self.device = max_batch, context, torch.device(device)
        self.options = options
        self.layer = layer or random_layer(cfg, idx, self.par, self.comm, seed, device, options)
        gen = torch.Generator(device=device).manual_seed(seed + 2)

        def rnd(*shape, dt=BF16, sc=1.0):
            return (sc * torch.randn(shape, generator=gen, device=device)).to(dt)

        H, B = cfg.hidden_size, max_batch
        n = -(-idx // cfg.attn_res_block_size)                   # snapshots before layer idx
        self.bank = rnd(B, n + 1, H)                             # [snapshots…, prefix]
        # attnres_bank off: the snapshots as separate tensors, as the served step keeps them
        self.separate = None if options.attnres_bank else [self.bank[:, j].clone()
                                                           for j in range(n)]
        self.pending = rnd(B, H, sc=0.1)                         # previous layer's FFN output
        self.block = next(b for b in (64, 32, 16, 8, 4, 2, 1) if context % b == 0)
        if self.kind == "kda":
            c = cfg.kda
            hl = self.par.shard(c.num_heads, "KDA num_heads")
            kda = KDAStateCache(1, B, hl, c.head_dim, c.conv_size, BF16, device)
            kda.conv.copy_(rnd(*kda.conv.shape))
            kda.rec.copy_(rnd(*kda.rec.shape, dt=torch.float32, sc=0.05))
            self.caches = ModelCaches(mla=None, kda=kda, kda_index={idx: 0})
            self.pages = 0
        else:
            self.pages = -(-(context + 1) // self.block)        # room for the step's row
            mla = MLALatentCache(1, B * self.pages, self.block, cfg.mla.latent_dim, BF16, device)
            mla.pool.copy_(rnd(*mla.pool.shape))
            mla.block_tables.update({t: list(range(t * self.pages, (t + 1) * self.pages))
                                     for t in range(B)})
            self.caches = ModelCaches(mla=mla, kda=None, mla_index={idx: 0})
        pages = max(1, self.pages)
        self._statics = LayerStatics(
            table=torch.arange(B * pages, dtype=torch.int32, device=device).view(B, pages),
            store=torch.full((B,), context, dtype=torch.int32, device=device),
            seq_lens=torch.full((B,), context + 1, dtype=torch.int32, device=device),
            slots=torch.arange(B, dtype=torch.int64, device=device))
        self.out: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def statics(self, T: int) -> LayerStatics:
        s = self._statics
        return LayerStatics(s.table[:T], s.store[:T], s.seq_lens[:T], s.slots[:T])

    def batch(self, T: int) -> StepBatch:
        return StepBatch.decode(list(range(T)), [self.context] * T)

    def step(self, T: int, path: str, fold: bool = True) -> None:
        """One decode step of the first T sequences on `path`; self.out = (prefix, deferred
        output) of the stream after the layer. fold: the previous layer's FFN output joins the
        prefix in the first mix (the served form); False: the bank's prefix as it is."""
        n = self.bank.shape[1] - 1
        bank = self.bank[:T]
        blocks = ([bank[:, j] for j in range(n)] if self.separate is None or path == "stock"
                  else [b[:T] for b in self.separate])   # bank: one strided view
        stream = AttnResStream.resume(blocks, bank[:, n], self.pending[:T] if fold else None,
                                      cute=self.options.attnres_cute)
        if path == "stock" and stream.pending is not None:   # stock adds outputs at once
            stream.add(stream.pending, new_block=False)
            stream.pending = None
        self.caches.statics = self.statics(T) if path == "specialized" else None
        try:
            self.layer(stream, self.batch(T), self.caches, path)
        finally:
            self.caches.statics = None
        self.out = (stream.prefix, stream.pending)

    def output(self) -> torch.Tensor:
        """The layer's output prefix (prefix + the deferred FFN output) of the last step."""
        p, d = self.out
        return p if d is None else (p.float() + d.float()).to(p.dtype)

    # ---- accounting ----------------------------------------------------------------------

    def state_bytes(self, T: int) -> int:
        """Cache/activation bytes an ideal step moves: the bank read by both mixes, KDA state
        and conv read + written once, or the MLA latent rows read once + the new row written."""
        H, n1 = self.cfg.hidden_size, self.bank.shape[1]
        b = 2 * T * n1 * H * 2
        if self.kind == "kda":
            k = self.caches.kda
            b += 2 * k.rec[0, :T].numel() * 4 + 2 * k.conv[0, :T].numel() * 2
        else:
            lat = self.cfg.mla.latent_dim
            b += T * self.context * lat * 2 + T * lat * 2
        return b

    def weight_bytes(self, path: str) -> int:
        """Bytes of the dense weights one step on `path` reads (routed experts excluded: they
        count by touched expert). Stock: every parameter, the replicated ones whole.
        Specialized (after a step built the derived weights): each derived weight (the packed
        GEMV buffers, W_q'', W_uv, ...) and every parameter that is no source of one, the
        replicated ones 1/TP; storage shared between them counts once."""
        params = [(n, p) for n, p in self.layer.named_parameters()
                  if n.rsplit(".", 1)[-1] not in MXFP4_PARAMS and ".experts." not in n]
        if path == "stock":
            return sum(p.numel() * p.element_size() for _, p in params)
        derived, sources = [], set()
        for m in self.layer.modules():
            d = getattr(m, "_derived", None)
            if d is not None:
                derived += list(d.built().values())
                sources |= d.source_ptrs()
        seen, total = set(), 0
        for t in derived:
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
        owned = {t.untyped_storage().data_ptr() for t in derived}
        for name, p in params:
            if p.data_ptr() in sources or p.untyped_storage().data_ptr() in owned:
                continue
            nbytes = p.numel() * p.element_size()
            owner = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
            total += nbytes // self.par.tp_size if owner in ROW_SHARDED else nbytes
        return total

    def expert_bytes(self) -> int:
        """Bytes of one routed expert on this rank (gate_up + down codes and scales)."""
        ex = self.layer.block_sparse_moe.experts
        return sum(getattr(ex, n)[0].numel() for n in MXFP4_PARAMS)


__all__ = ["BF16", "LayerCopy", "LayerStatics", "ROW_SHARDED", "random_layer"]
