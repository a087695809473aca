"""The Kimi K3 text model in plain PyTorch: the stock path and the numerical reference.

Module names are the checkpoint names without the `language_model.` prefix:
    model.embed_tokens, model.layers.{i}.{input_layernorm, post_attention_layernorm,
    self_attention_res_norm, self_attention_res_proj, mlp_res_norm, mlp_res_proj, self_attn,
    mlp | block_sparse_moe}, model.norm, model.output_attn_res_norm, model.output_attn_res_proj,
    lm_head.
Every parameter is created at its local shape for the given `Parallel` and carries `shard_dim`,
`full_shape` (and for KDA A_log `shard_fn`), see models/layers.py.

One layer (AttnRes, see models/attnres.py):
    h = input_layernorm(mix_attn(bank));          bank.add(self_attn(h), new_block=i % B == 0)
    h = post_attention_layernorm(mix_mlp(bank));  bank.add(ffn(h))
and at the end: hidden = norm(mix_output(bank)). Rounding as vLLM's K3 (docs/NUMERICS.md): a
sublayer's mix stays fp32 into its norm and h is rounded once; the final mix is rounded to the
model dtype before `norm`, an RMSNorm rounded as vLLM's op (models/layers.py
`rms_norm`, op_rounding).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from raydecode.kernels.settings import DEFAULT_OPTIONS, DecodeOptions

from .attnres import AttnResStream, attnres_fusable
from .cache import KDAStateCache, MLALatentCache, ModelCaches, SeqSlice, StepBatch
from .config import K3Config
from .decode_plan import BUCKETS, DecodePlan, resolve_plan
from .kda import KDAAttention
from .layers import (GatedMLP, RMSNorm, VocabParallelEmbedding, column_linear,
                     replicated_linear, shard_tensor)
from .mla import MLAAttention
from .moe import MXFP4_PARAMS, LatentMoE, random_mxfp4
from .parallel import Comm, LocalComm, Parallel
from .specialized import check_path, specialized_supported


class K3DecoderLayer(nn.Module):
    def __init__(self, cfg: K3Config, layer_idx: int, par: Parallel, comm: Comm,
                 dtype: torch.dtype, options: DecodeOptions = DEFAULT_OPTIONS):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_idx = layer_idx
        self.starts_block = layer_idx % cfg.attn_res_block_size == 0
        self.kind = cfg.layer_kinds[layer_idx]
        attn_cls = KDAAttention if self.kind == "kda" else MLAAttention
        self.self_attn = attn_cls(cfg, layer_idx, par, comm, dtype, options=options)
        self.is_moe = cfg.is_moe_layer(layer_idx)
        if self.is_moe:
            self.block_sparse_moe = LatentMoE(cfg, par, comm, dtype, layer_idx, options)
        else:
            self.mlp = GatedMLP(H, cfg.intermediate_size, cfg.situ_beta, cfg.situ_linear_beta,
                                par, comm, dtype, options)
        self.input_layernorm = RMSNorm(H, eps, dtype)
        self.post_attention_layernorm = RMSNorm(H, eps, dtype)
        self.self_attention_res_norm = RMSNorm(H, eps, dtype)
        self.self_attention_res_proj = replicated_linear(H, 1, dtype)
        self.mlp_res_norm = RMSNorm(H, eps, dtype)
        self.mlp_res_proj = replicated_linear(H, 1, dtype)

    def forward(self, bank: AttnResStream, batch: StepBatch, caches: ModelCaches | None,
                path: str = "stock"):
        ffn = self.block_sparse_moe if self.is_moe else self.mlp
        if path == "specialized" or bank.fused:   # residual add + AttnRes mix + norm fused
            h = bank.mix_norm(self.self_attention_res_norm, self.self_attention_res_proj.weight,
                              self.input_layernorm, snapshot=self.starts_block)
            bank.defer(self.self_attn(h, batch, caches, path), new_block=self.starts_block)
            h = bank.mix_norm(self.mlp_res_norm, self.mlp_res_proj.weight,
                              self.post_attention_layernorm)
            bank.defer(ffn(h, path), new_block=False)
            return
        h = bank.mix_then_norm(self.self_attention_res_norm, self.self_attention_res_proj.weight,
                               self.input_layernorm)
        bank.add(self.self_attn(h, batch, caches), new_block=self.starts_block)
        h = bank.mix_then_norm(self.mlp_res_norm, self.mlp_res_proj.weight,
                               self.post_attention_layernorm)
        bank.add(ffn(h), new_block=False)


class K3Model(nn.Module):
    def __init__(self, cfg: K3Config, par: Parallel, comm: Comm, dtype: torch.dtype,
                 options: DecodeOptions = DEFAULT_OPTIONS):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.options = options
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, H, par, comm, dtype)
        self.layers = nn.ModuleList(K3DecoderLayer(cfg, i, par, comm, dtype, options)
                                    for i in range(cfg.num_layers))
        self.num_blocks = cfg.num_attn_res_blocks
        self.norm = RMSNorm(H, eps, dtype, op_rounding=True)   # vLLM's RMSNorm op (logits)
        self.output_attn_res_norm = RMSNorm(H, eps, dtype)
        self.output_attn_res_proj = replicated_linear(H, 1, dtype)

    # the stock path's AttnRes on CUDA with Triton: the fused residual-add + mix + norm op of
    # kernels/attnres_norm.py (the specialized step's, Triton form at any T; same roundings as
    # the PyTorch mix, which stays the CPU path and the reference). False: the PyTorch mix.
    stock_fused_attnres: bool = True

    def forward(self, tokens: torch.Tensor, batch: StepBatch, caches: ModelCaches | None,
                path: str = "stock", taps: tuple[int, ...] = (),
                rows: torch.Tensor | None = None):
        emb = self.embed_tokens(tokens)
        fused = path == "specialized" or (self.stock_fused_attnres and attnres_fusable(emb))
        # fused: the snapshots in one bank tensor (DecodeOptions.attnres_bank); the stock
        # path's fused mix uses the Triton kernel (cute only where the specialized step runs)
        cap = self.num_blocks if fused and self.options.attnres_bank else 0
        bank = AttnResStream(emb, capacity=cap,
                             cute=self.options.attnres_cute and path == "specialized",
                             fused=fused)
        tapped = []
        for i, layer in enumerate(self.layers):
            layer(bank, batch, caches, path)
            if i in taps:
                tapped.append(_layer_output(bank))
        # the final mix is rounded to the model dtype before the RMSNorm (vLLM's order), on both
        # paths: unlike a sublayer's, it is not the fused op's fp32-into-the-norm form. Both
        # are per token: with `rows`, only those rows (the ones that sample) are mixed and
        # normalised (an 8,192-token chunk at 24 layers: 166.8 → 162.4 ms of device time,
        # H100, bench/results/prefill-h100-2026-12-07-onerun6.json `step_profiles`)
        bank.flush()
        out = self.norm(bank.mix(self.output_attn_res_norm, self.output_attn_res_proj.weight,
                                 rows))
        return (out, torch.cat(tapped, -1)) if taps else out


def _layer_output(bank: AttnResStream) -> torch.Tensor:
    """The hidden state after a layer for a DSpark tap (T, H): AttnRes's running prefix with the
    layer's last output added (vLLM's `prefix_sum + hidden_states`)."""
    pending = getattr(bank, "pending", None)
    if pending is None:
        return bank.prefix
    return (bank.prefix.float() + pending.float()).to(bank.prefix.dtype)


class K3ForCausalLM(nn.Module):
    """`forward(tokens (T,), batch, caches, path) -> hidden (T, H)`;
    `compute_logits(hidden) -> (T, V)`.

    path "stock" (default) or "specialized" (models/specialized.py): the same weights, caches,
    inputs and outputs; specialized shards the replicated projections 1/TP + all-gather and runs
    the fused kernels/ ops. `specialized_support` = specialized_supported(cfg, par).
    options: the replica's DecodeOptions (what the specialized step runs; default: served).
    `decode_plan`: the kernels every batch bucket's specialized step runs under those options
    on this shard's device (models/decode_plan.py), resolved on first use (the rank build).

    caches=None: every sequence of `batch` must be a prefill from position 0 (naive MLA, zero
    KDA state; nothing is stored). With caches, each sequence reads and writes its slot: KDA conv
    tail and fp32 state are updated in place (a sequence at pos 0 starts from zero state whatever
    the slot holds), MLA rows of the step's positions are written, and attention runs over the
    sequence's cached positions up to each token's own (absorbed form). Any mix of decode
    tokens and prefill chunks works in one step. `batch=None` means one sequence from 0.
    """

    def __init__(self, cfg: K3Config, par: Parallel = Parallel(), comm: Comm = LocalComm(),
                 dtype: torch.dtype = torch.float32, options: DecodeOptions | None = None):
        super().__init__()
        self.cfg, self.par, self.comm, self.dtype = cfg, par, comm, dtype
        self.options = DEFAULT_OPTIONS if options is None else options
        self.specialized_support = specialized_supported(cfg, par)   # (ok, reason)
        self.model = K3Model(cfg, par, comm, dtype, self.options)
        self.lm_head = column_linear(cfg.hidden_size, cfg.vocab_size, par, dtype, "vocab_size")
        self._plan: DecodePlan | None = None

    @property
    def decode_plan(self) -> DecodePlan:
        """This shard's decode plan for every bucket (memoized: a pure function of the config,
        the layout, the options, the dtype and the device's SM count)."""
        if self._plan is None:
            dev = self.lm_head.weight.device
            sms = (torch.cuda.get_device_properties(dev).multi_processor_count
                   if dev.type == "cuda" else None)
            self._plan = resolve_plan(self.cfg, self.par.tp_size, self.options, BUCKETS,
                                      self.par.dcp_size, str(self.dtype).removeprefix("torch."),
                                      sms)
        return self._plan

    def forward(self, tokens: torch.Tensor, batch: StepBatch | None = None,
                caches: ModelCaches | None = None, path: str = "stock",
                taps: tuple[int, ...] = (), rows: torch.Tensor | None = None
                ) -> torch.Tensor:
        """With `taps` (0-indexed layers, ascending) -> (hidden, tapped (T, len(taps)·H)): the
        hidden state after each tapped layer, concatenated (DSpark's context input). With
        `rows` ((R,) int64 token indices on the model's device), the hidden state is only
        those rows' (R, H): the final AttnRes mix and norm run on them alone (taps stay
        every row's)."""
        if batch is None:
            batch = StepBatch([SeqSlice(slot=0, start=0, length=int(tokens.shape[0]), pos=0)])
        self._check_step(tokens, batch, caches)
        check_path(path)
        if path == "specialized" and not self.specialized_support[0]:
            raise ValueError(f"{self.specialized_support[1]} (model {self.cfg.name!r}); run "
                             "this step with path='stock'")
        if rows is not None and (rows.dim() != 1 or rows.dtype != torch.long):
            raise ValueError(f"rows of shape {tuple(rows.shape)} and dtype {rows.dtype}; "
                             "expected a flat int64 tensor of token indices")
        return self.model(tokens, batch, caches, path, taps, rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (T, H) -> fp32 logits (T, V), gathered over the vocab-parallel lm_head."""
        return self.comm.all_gather(self.lm_head(hidden).float(), dim=-1)

    def _check_step(self, tokens, batch: StepBatch, caches: ModelCaches | None) -> None:
        T = tokens.shape[0]
        if tokens.dim() != 1 or batch.num_tokens != T:
            raise ValueError(f"tokens of shape {tuple(tokens.shape)} for a batch of "
                             f"{batch.num_tokens} tokens; expected a flat (T,) tensor, "
                             "T = sum of sequence lengths")
        for s in batch.seqs:
            if s.length < 1 or s.start < 0 or s.end > T or s.pos < 0:
                raise ValueError(f"sequence {s} does not fit the {T}-token step")
        if caches is None:
            bad = [s for s in batch.seqs if s.pos != 0]
            if bad:
                raise ValueError(f"caches=None runs pure prefill from position 0, got {bad[0]}; "
                                 "pass ModelCaches to continue a sequence")
            return
        kinds = set(self.cfg.layer_kinds)
        if "mla" in kinds and caches.mla is None or "kda" in kinds and caches.kda is None:
            raise ValueError("caches lack the MLA or KDA storage this model needs "
                             "(build them with make_caches)")


def make_caches(cfg: K3Config, par: Parallel, num_slots: int, num_blocks: int, block_size: int,
                dtype: torch.dtype = torch.float32, device=None,
                extra_mla_layers: int = 0, num_snapshots: int = 0) -> ModelCaches:
    """Empty cache storage for one rank: MLA latent pools (this rank's DCP share) for the MLA
    layers and KDA conv/state for num_slots sequences. Block tables are the engine's to set
    (`caches.mla.block_tables[slot] = [block ids]`). `extra_mla_layers` adds pool rows under
    the virtual layer keys num_layers, num_layers + 1, … (the DSpark drafter's layers), which
    share the target's block tables. `num_snapshots`: KDA snapshot slots (prefix caching)."""
    mla_ids = cfg.mla_layers + tuple(range(cfg.num_layers, cfg.num_layers + extra_mla_layers))
    kda_ids = cfg.kda_layer_ids
    mla = (MLALatentCache(len(mla_ids), num_blocks, block_size, cfg.mla.latent_dim, dtype,
                          device, dcp_rank=par.dcp_rank, dcp_size=par.dcp_size)
           if mla_ids else None)
    kda = (KDAStateCache(len(kda_ids), num_slots, par.shard(cfg.kda.num_heads, "KDA num_heads"),
                         cfg.kda.head_dim, cfg.kda.conv_size, dtype, device, num_snapshots)
           if kda_ids else None)
    return ModelCaches(mla=mla, kda=kda, mla_index={l: i for i, l in enumerate(mla_ids)},
                       kda_index={l: i for i, l in enumerate(kda_ids)})


def _random_full(name: str, shape: tuple[int, ...], cfg: K3Config, gen: torch.Generator
                 ) -> torch.Tensor:
    """A full (unsharded) random tensor for parameter `name` at a scale that keeps activations
    O(1): norms ~1, linear weights ~N(0, 1/fan_in), AttnRes logits ~N(0, 1)."""
    leaf = name.rsplit(".", 1)[-1]
    owner = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    if leaf in MXFP4_PARAMS:     # MXFP4-resident routed experts: codes / scales
        return random_mxfp4(shape, leaf.endswith("_scale"), gen)
    # drawn on the host whatever device context is active: the same seed gives the same weights
    randn = torch.randn(shape, generator=gen, device="cpu")
    if leaf == "A_log":   # exp(A) in [1, 4] for the heads, zero tail padding as in K3
        full = torch.rand(shape, generator=gen, device="cpu") * math.log(4.0)
        full[cfg.kda.num_heads:] = 0
        return full
    if leaf == "dt_bias":
        return 0.5 * randn - 1.0
    if leaf == "e_score_correction_bias":
        return 0.1 * randn
    if owner.endswith("conv1d"):
        return 0.5 * randn
    if owner.endswith("norm"):
        return 1.0 + 0.1 * randn
    if owner == "embed_tokens":
        return randn
    return randn / math.sqrt(shape[-1])     # linear / expert weights: fan-in is the last dim


@torch.no_grad()
def init_random_(model: K3ForCausalLM, seed: int) -> K3ForCausalLM:
    """Fill every parameter with seeded random values. The full tensors are drawn in parameter
    order and sliced with `shard_tensor`, so a TP=N model gets exactly the slices of the TP=1
    model built with the same seed. For small (test) configs: it materialises full tensors."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        full = _random_full(name, p.full_shape, model.cfg, gen)
        p.copy_(shard_tensor(full, p, model.par).to(p.dtype))
    return model
