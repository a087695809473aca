"""Model spec → checkpoint folder → model shard, caches and tokenizer.

A spec is a preset name or a checkpoint folder. The `tiny` preset has no published weights: its
random checkpoint (real safetensors files in K3's layout, plus a small BPE tokenizer) is written
once to the cache folder ($RAYDECODE_CACHE or ~/.cache/raydecode) and loaded like any other.
"""
from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from raydecode.kernels import settings
from raydecode.kernels.settings import DecodeOptions
from raydecode.models.cache import ModelCaches
from raydecode.models.config import PRESETS, ConfigError, K3Config, load_config
from raydecode.models.parallel import Comm, LocalComm, Parallel

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16}

TINY_SEED = 0
log = logging.getLogger(__name__)


def parse_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ConfigError(f"dtype {name!r}; accepted: {sorted(_DTYPES)}")
    return _DTYPES[name]


def cache_root() -> Path:
    return settings.model_cache_dir()


def resolve_checkpoint(spec: str | Path) -> Path:
    """Checkpoint folder for a spec; writes the tiny preset's checkpoint on first use."""
    from raydecode.models.checkpoint import write_checkpoint

    s = str(spec)
    if s == "tiny":
        from raydecode.models.bpe import TINY_TOKENIZER_LAYOUT

        # q2: the tiny config names its MXFP4 modules by regex (models/config.py); a folder
        # written before holds the old config.json, read under the new quantization rules
        out = cache_root() / f"tiny-seed{TINY_SEED}-{TINY_TOKENIZER_LAYOUT}-q2"
        if not (out / "model.safetensors.index.json").is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            # write into a temp folder and rename, so concurrent first uses never see half a
            # checkpoint (several rank actors may start at once)
            tmp = Path(tempfile.mkdtemp(prefix="tiny-", dir=out.parent))
            write_checkpoint(load_config("tiny"), tmp, seed=TINY_SEED)
            try:
                tmp.rename(out)
            except OSError:           # another process won the race; theirs is identical
                import shutil
                shutil.rmtree(tmp, ignore_errors=True)
        return out
    if s in PRESETS:
        raise ConfigError(f"preset {s!r} describes the architecture only and has no weights; "
                          "pass a checkpoint folder (config.json + safetensors) or 'tiny'")
    p = Path(s)
    if not (p / "config.json").is_file():
        raise ConfigError(f"model {s!r}: no config.json in that folder; expected a K3 "
                          f"checkpoint folder or a preset ('tiny')")
    return p


@dataclass
class LoadedShard:
    cfg: K3Config
    model: torch.nn.Module
    caches: ModelCaches
    path: Path


def load_shard(spec: str | Path, par: Parallel = Parallel(), comm: Comm | None = None,
               dtype: str = "float32", device: str = "cpu", num_slots: int = 16,
               num_blocks: int = 256, block_size: int = 16,
               options: DecodeOptions | None = None, num_snapshots: int = 0) -> LoadedShard:
    """This rank's model shard (built with the replica's DecodeOptions; None: the served
    defaults), its decode plan resolved for this device (`model.decode_plan`, logged) and its
    caches (num_snapshots KDA snapshot slots: prefix caching)."""
    from raydecode.models.k3 import make_caches
    from raydecode.models.weights import load_model

    path = resolve_checkpoint(spec)
    dt = parse_dtype(dtype)
    cfg, model = load_model(path, par, comm or LocalComm(), dt, device, options=options)
    plan = model.decode_plan                         # resolved once, at the rank's build
    log.info("rank %d/%d decode plan: %s", par.tp_rank, par.tp_size,
             "; ".join(f"M={s.tokens} moe={s.moe.kernel if s.moe else '-'} "
                       f"fused_block={s.fusions.moe_block}" for s in plan.steps))
    caches = make_caches(cfg, par, num_slots=num_slots, num_blocks=num_blocks,
                         block_size=block_size, dtype=dt, device=device,
                         num_snapshots=num_snapshots)
    check_prefill_experts(model)
    warm_prefill_kernels(model, device)
    prepare_prefill_experts(model, device)
    return LoadedShard(cfg, model, caches, path)


# bytes left free after the Hopper copies (the first prefill step's activations and the
# conversion's own temporaries come out of it)
PREFILL_COPY_HEADROOM = 4 * 2 ** 30


def check_prefill_experts(model) -> None:
    """RAYDECODE_PREFILL_EXPERTS's +FIELD=VALUE parts against every MXFP4 MoE layer's shapes
    (kernels/moe_mxfp4.py `check_prefill_kind`), on any device: a ValueError naming the
    setting and the field when the rank loads, before the warm-up compiles anything, not at
    the first prefill step."""
    from raydecode.kernels import moe_mxfp4
    from raydecode.models.moe import RoutedExperts

    packs = [m.packed() for m in model.modules() if isinstance(m, RoutedExperts) and m.mxfp4]
    for L, I, E in sorted({(p.latent, p.intermediate, p.num_experts) for p in packs}):
        moe_mxfp4.check_prefill_kind(L, I, E)


def prepare_prefill_experts(model, device, kind: str | None = None) -> int:
    """With RAYDECODE_PREFILL_EXPERTS=ogs-hopper, convert every MXFP4 MoE layer's experts into
    matmul_ogs's Hopper layouts now (kernels/moe_ogs.py `ogs_weights`), at load, so the first
    prompt does not pay the conversion and the copies' memory is taken before serving. Refuses
    (RuntimeError naming the setting) where the library cannot run on this GPU or the copies
    do not fit in free memory with PREFILL_COPY_HEADROOM to spare. -> bytes converted (0: not
    that kind, or not CUDA: the CPU path runs the PyTorch reference)."""
    from raydecode.kernels import moe_mxfp4
    from raydecode.models.moe import RoutedExperts

    kind = moe_mxfp4.PREFILL_EXPERTS if kind is None else kind
    dev = torch.device(device)
    if kind != "ogs-hopper" or dev.type != "cuda":
        return 0
    from raydecode.kernels import moe_ogs

    why = moe_ogs.ogs_unavailable(dev)
    if why is not None:
        raise RuntimeError(f"RAYDECODE_PREFILL_EXPERTS=ogs-hopper: {why}; install the `ogs` "
                           "extra on a Hopper or newer GPU, or leave the setting unset (auto)")
    layers = [m.packed() for m in model.modules() if isinstance(m, RoutedExperts) and m.mxfp4]
    need = sum(ex.expert_bytes() * ex.num_experts for ex in layers)
    free, _ = torch.cuda.mem_get_info(dev)
    if need * settings.PREFILL_COPY_PAD + PREFILL_COPY_HEADROOM > free:
        raise RuntimeError(
            f"RAYDECODE_PREFILL_EXPERTS=ogs-hopper: the Hopper copies of {len(layers)} MoE "
            f"layers' experts take ≈ {need * settings.PREFILL_COPY_PAD / 2 ** 30:.1f} GiB, "
            f"{free / 2 ** 30:.1f} GiB are free (and {PREFILL_COPY_HEADROOM / 2 ** 30:.0f} "
            "GiB must stay free); leave the setting unset (auto), or use more GPUs per replica")
    for ex in layers:
        moe_ogs.ogs_weights(ex, "hopper")
    log.info("prefill experts: %d MoE layers converted to matmul_ogs's Hopper layouts "
             "(%.1f GiB)", len(layers), need / 2 ** 30)
    return need


def warm_prefill_kernels(model, device) -> int:
    """Compile and autotune the KDA prefill kernel (fla-core's, kernels/kda_prefill.py) for
    this shard's KDA heads before the first request: its token count is no compile key, so one
    call serves every prompt; without it the first prefill on each rank pays fla's import,
    autotune and compiles on the request path. -> calls made (0 off CUDA or without fla)."""
    from raydecode.kernels import kda_prefill
    from raydecode.models.kda import KDAAttention

    kda = next((m for m in model.modules() if isinstance(m, KDAAttention)), None)
    if kda is None or torch.device(device).type != "cuda":
        return 0
    n = kda_prefill.warmup(kda.heads, kda.dim, device)
    if n:
        log.info("KDA prefill kernel warmed: %d heads of %d", kda.heads, kda.dim)
    return n


def load_tokenizer(spec: str | Path):
    from raydecode.engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(resolve_checkpoint(spec))


def build_local_engine(spec: str | Path, dtype: str = "float32", max_num_seqs: int = 8,
                       max_model_len: int | None = None, max_num_batched_tokens: int = 256,
                       block_size: int = 16, enable_prefix_caching: bool = False,
                       num_snapshots: int = 0):
    """The single-process stock engine (TP=1) for `raydecode generate` and tests; with
    enable_prefix_caching, num_snapshots KDA snapshot slots (engine/prefix_cache.py)."""
    from .engine import EngineConfig, LLMEngine, LocalExecutor
    from .runner import ModelRunner

    torch.set_num_threads(1)    # tiny decode ops: a busy intra-op pool costs more than it gives
    cfg = load_config(resolve_checkpoint(spec))
    mml = max_model_len or min(cfg.max_position_embeddings, 4096)
    ecfg = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=mml,
                        max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                        enable_prefix_caching=enable_prefix_caching, num_snapshots=num_snapshots)
    shard = load_shard(spec, dtype=dtype, num_slots=max_num_seqs, num_blocks=ecfg.blocks,
                       block_size=block_size, num_snapshots=num_snapshots)
    tok = load_tokenizer(spec)
    eos = tuple(sorted(set(tok.eos_ids) | {shard.cfg.eos_token_id}))
    return LLMEngine(LocalExecutor(ModelRunner(shard.model, shard.caches)), tok, ecfg, eos)
