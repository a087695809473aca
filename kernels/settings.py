"""The settings surface: every RAYDECODE_* environment switch, and the decode options.

Two kinds, kept apart:
- `DecodeOptions` (frozen): the switches that change what the served decode step runs (which
  fused blocks, which kernel serves a batch). They are fields of the deployment config
  (actors/config.py `DecodeOptionsConfig`, section `decode:`), carried to every rank with the shard
  spec and read by the model (models/decode_plan.py resolves them into the plan). The
  benchmarks set them from their flags (`--decode FIELD=VALUE`). No environment variable
  reaches them, so a rank runs what its replica's config says, whatever its node's env holds.
- `SETTINGS`: what belongs to a process or a node rather than to a replica (cache folders,
  threads, host capabilities, timing switches of benchmarks), read from the environment here
  and nowhere else (`get`). This module is the only one that reads RAYDECODE_* variables.

Imports nothing from raydecode: every layer (kernels up to the CLI) may import it.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


# ---- environment settings (process / node) ---------------------------------------------------

@dataclass(frozen=True)
class Setting:
    """One RAYDECODE_* variable: its default (the value when unset), one line of meaning, the
    values accepted, and the parser that turns the raw string into the typed value (raising
    ValueError that names the variable, the value and what is accepted)."""
    name: str
    default: str
    meaning: str
    accepted: str
    parse: Callable[[str, "Setting"], object]


def _flag(raw: str, s: Setting) -> bool:        # '0' off, anything else on (as always read)
    return raw != "0"


def _strict_bool(raw: str, s: Setting) -> bool:
    if raw not in ("0", "1"):
        raise ValueError(f"{s.name}={raw!r}; accepted: {s.accepted}")
    return raw == "1"


def _tristate(raw: str, s: Setting) -> bool | None:
    if raw not in ("0", "1", ""):
        raise ValueError(f"{s.name}={raw!r}; accepted: {s.accepted}")
    return None if raw == "" else raw == "1"


def _text(raw: str, s: Setting) -> str:
    return raw


def _threads(raw: str, s: Setting) -> int:       # int(v), at least 1 (as always read)
    try:
        return max(1, int(raw))
    except ValueError:
        raise ValueError(f"{s.name}={raw!r}; accepted: {s.accepted}") from None


def _choice(*choices: str):
    def parse(raw: str, s: Setting) -> str:
        if raw not in choices:
            raise ValueError(f"{s.name}={raw!r}; accepted: {', '.join(choices)}")
        return raw
    return parse


def is_token_bucket(n: int) -> bool:
    """A stock step's token bucket (engine/step_graph.py `prefill_bucket`): a power of two up
    to 256, or a multiple of 256 up to 8192."""
    return 1 <= n <= 8192 and (n & (n - 1) == 0 if n <= 256 else n % 256 == 0)


# the expert kernels of prefill steps (kernels/moe_mxfp4.py `prefill_config`): ours picked by
# size ("auto"), one of ours, or Triton's triton_kernels matmul_ogs (kernels/moe_ogs.py)
PREFILL_EXPERT_KINDS = ("auto", "split", "blocked", "hybrid", "ogs", "ogs-hopper", "auto-ew",
                        "auto-nopf")
# MoEConfig fields (kernels/moe_mxfp4.py) a RAYDECODE_PREFILL_EXPERTS value may set after its
# kind of our kernels, for same-run A/Bs of a kernel option before it ships:
# "auto+down_bn=64+fuse_situ=1" (`parse_prefill_experts`); integers > 0 and flags 0 / 1
PREFILL_EXPERT_FIELDS: dict[str, type] = {
    "gate_up_bn": int, "gate_up_bk": int, "down_bn": int, "down_bk": int, "num_warps": int,
    "num_stages": int, "down_warps": int, "down_tiles": int, "prefetch_scales": bool,
    "fuse_situ": bool, "blocked_down": bool}


def parse_prefill_experts(raw: str) -> tuple[str, tuple[tuple[str, int | bool], ...]]:
    """A RAYDECODE_PREFILL_EXPERTS value "KIND[+FIELD=VALUE]..." -> (KIND, ((FIELD, value),
    ...)); ValueError naming the part that is wrong and what is accepted. The ogs kinds take
    no fields (their tiles are the library's)."""
    kind, *mods = str(raw).split("+")
    if kind not in PREFILL_EXPERT_KINDS:
        raise ValueError(f"prefill experts {raw!r}; accepted: {', '.join(PREFILL_EXPERT_KINDS)}"
                         f" (not {kind!r}), each but ogs / ogs-hopper optionally followed by "
                         "+FIELD=VALUE parts")
    if mods and kind.startswith("ogs"):
        raise ValueError(f"prefill experts {raw!r}: {kind} takes no +FIELD=VALUE (matmul_ogs "
                         "picks its own tiles)")
    out: list[tuple[str, int | bool]] = []
    for m in mods:
        name, eq, val = m.partition("=")
        typ = PREFILL_EXPERT_FIELDS.get(name)
        if typ is None or not eq:
            raise ValueError(f"prefill experts {raw!r}: {m!r}; expected FIELD=VALUE with FIELD "
                             f"one of {', '.join(PREFILL_EXPERT_FIELDS)}")
        if typ is bool:
            if val not in ("0", "1"):
                raise ValueError(f"prefill experts {raw!r}: {name}={val!r}; expected 0 or 1")
            out.append((name, val == "1"))
        else:
            if not (val.isascii() and val.isdigit()) or int(val) < 1:
                raise ValueError(f"prefill experts {raw!r}: {name}={val!r}; expected an "
                                 "integer ≥ 1")
            out.append((name, int(val)))
    if len({n for n, _ in out}) != len(out):
        raise ValueError(f"prefill experts {raw!r}: a field set twice")
    return kind, tuple(out)


def _prefill_experts_value(raw: str, s: "Setting") -> str:
    try:
        parse_prefill_experts(raw)
    except ValueError as e:
        raise ValueError(f"{s.name}={str(e).removeprefix('prefill experts ')}") from None
    return raw


# ogs-hopper's copy of the experts over the packed weights it copies (matmul_ogs's Hopper
# layouts pad values to 64 along N and K/2, scales to 256 along N: ≈ 2 % and 7 % at 2880 ×
# 2880); the bound the load's memory check (engine/loader.py) and the planner use
PREFILL_COPY_PAD = 1.1

# Triton's fp32 dot input precisions a rank's fla KDA may run at (kernels/kda_prefill.py)
KDA_PRECISIONS = ("tf32", "bf16x3", "tf32x3", "ieee")


def _token_bucket(raw: str, s: Setting) -> int:     # 0 (off) or a token bucket
    if not raw.isdigit() or not (int(raw) == 0 or is_token_bucket(int(raw))):
        raise ValueError(f"{s.name}={raw!r}; accepted: {s.accepted}")
    return int(raw)


def _multiple_of_16(raw: str, s: Setting) -> int:
    if not raw.isdigit() or int(raw) == 0 or int(raw) % 16:
        raise ValueError(f"{s.name}={raw!r}; accepted: {s.accepted}")
    return int(raw)


_ALL = (
    Setting("RAYDECODE_KERNEL_CACHE", "", "node-local folder of compiled decode kernels every "
            "rank loads (kernels/aot_store.py); unset: no persistence, kernels JIT",
            "a directory path, or unset", _text),
    Setting("RAYDECODE_CACHE", "", "folder of checkpoints made on first use (the tiny preset); "
            "unset: ~/.cache/raydecode", "a directory path, or unset", _text),
    Setting("RAYDECODE_RANK_THREADS", "1", "torch intra-op threads of one rank process (ranks "
            "share the host's cores; values below 1 count as 1)", "an integer", _threads),
    Setting("RAYDECODE_STEP_GRAPHS", "", "driver default for whole-step CUDA graphs when the "
            "deployment does not say (decode.step_graphs)",
            "'1' (graphs on), '0' (off) or unset (auto: on for CUDA ranks whose model the "
            "graphs support)", _tristate),
    Setting("RAYDECODE_PAD_PREFILL", "", "a rank's stock steps run padded to their token "
            "bucket (engine/step_graph.py `prefill_bucket`: one shape per bucket, warmed at the "
            "build), the pad tokens a scratch sequence, so no step meets an unwarmed shape "
            "(H100, 8 K3 layers: 50 random counts' first runs within 1.69x of steady, where "
            "unpadded eager counts above the graph cap reached 2.0-2.4x; docs/perf-log/"
            "prefill.md). Unset: on for CUDA ranks, off for CPU ones",
            "'1' (on), '0' (off) or unset (auto: CUDA ranks)", _tristate),
    Setting("RAYDECODE_STOCK_GRAPHS", "512", "stock steps (prefill, mixed, stock decode) of "
            "up to this many tokens run as piecewise CUDA graphs on a CUDA rank with step "
            "graphs (engine/piecewise.py: the per-token work captured per token bucket at the "
            "build, the attention cores eager between the graphs); 0: every stock step eager. "
            "512: the default max_prefill_tokens_while_decoding, so every chunk beside running "
            "streams replays (H100, 8 K3 layers, TP16: such steps 2.6-4.5x faster than eager, "
            "docs/perf-log/prefill.md)",
            "0, or a token bucket: a power of two up to 256 or a multiple of 256 up to 8192",
            _token_bucket),
    Setting("RAYDECODE_STOCK_SINGLE", "1", "with stock graphs on, each bucket from 2 tokens "
            "up also gets a single-sequence graph (a prompt chunk alone, the split schedule's "
            "prefill step) with its KDA attention cores inside the graph, only the MLA cores "
            "eager between the replays (models/kda.py `_core_single`): the eager KDA cores cost "
            "0.5-1.1 ms of host time each on the H100; with them inside, the split TPOT at the "
            "512-token chunk came out 2.8-3.1x the graphed decode in four H100 runs (3.5x with "
            "the general graph, an earlier run). '0': the general graph only",
            "'0' (off) or '1' (on)", _strict_bool),
    Setting("RAYDECODE_STOCK_MIXED", "0", "with stock graphs on, each bucket from 4 tokens up "
            "also gets a mixed-step graph (one prompt chunk of ≥ 2 tokens beside one-token "
            "continuations: the mixed schedule's step) with every KDA attention core inside the "
            "graph (models/kda.py `_core_mixed`: the chunk through the single-sequence core, the "
            "continuations through the decode-row kernel on fixed-length device lists), only "
            "the MLA cores eager. Measured on the H100 at 24 K3 layers beside 63 streams: a "
            "mixed step in step bucket 128 / 256 / 512 costs 1.25x / 1.6x / 2.0x their "
            "decode step (eager KDA cores: a one-token chunk already 2.08x), and with it on "
            "split_mixed_steps (auto) keeps mixed steps (docs/perf-log/prefill.md). Off by "
            "default until its memory is measured at full depth (a third graph per bucket) "
            "and the build's replay check covers live continuations. '1': on",
            "'0' (off) or '1' (on)", _strict_bool),
    Setting("RAYDECODE_STOCK_FUSED", "1", "'0': the stock path (prefill, mixed and stock "
            "decode steps) runs its PyTorch chains where it has fused kernels on CUDA bf16 "
            "(the KDA decode rows, gate and gated norm, the MLA decode rows through the paged "
            "decode kernels, the RMSNorm modules, the router's top-k, the SiTU of the shared "
            "experts and dense FFN, the shared gate and up as one GEMM and their down GEMM to "
            "fp32): the A/B and the tests' comparison; the CPU path always runs the chains",
            "'0' (off) or '1' (on)",
            _strict_bool),
    Setting("RAYDECODE_KDA_PRECISION", "bf16x3", "the fp32 dot precision of fla's chunked "
            "KDA prefill in a rank process (kernels/kda_prefill.py `apply_precision`, set before "
            "its first compile: Triton's fp32 dot default for the process and fla's intra-chunk "
            "solve). bf16x3 (default): the final state 6.1e-6 from the fp64 reference at 8k "
            "tokens, 1.12 ms per call against TF32's 1.30 (H100, one run); tf32 (fla's own "
            "default): 1.1e-3; tf32x3: 3.7e-6 at 1.22 ms; ieee: 3.7e-6 at 1.64x TF32 (H200); "
            "docs/perf-log/prefill.md",
            "tf32, bf16x3, tf32x3 or ieee", _choice(*KDA_PRECISIONS)),
    Setting("RAYDECODE_KDA_RECURRENCE_BV16", "1", "'0': fla's KDA state recurrence "
            "autotunes over fla's own BV candidates (32, 64) only; by default BV 16 beside "
            "them (kernels/kda_prefill.py `widen_recurrence`: twice the programs at 6 heads per "
            "rank, bit-equal; 0.49 -> 0.36 ms per 8k-token layer on the H100 in one probe, "
            "docs/perf-log/prefill.md); read before fla's first autotune",
            "'0' (off); anything else: on", _flag),
    Setting("RAYDECODE_PREFILL_EXPERTS", "auto", "the routed experts' kernels in prefill "
            "steps (kernels/moe_mxfp4.py `prefill_config`). auto (default): ours (the x2 "
            "decode, group scales loaded a k step ahead), hybrid (blocked gate/up, swapped "
            "down) past 128 pairs per expert, split below; split / blocked / hybrid: one of "
            "ours always; "
            "ogs-hopper: Triton's triton_kernels matmul_ogs (the `ogs` extra) on a second copy "
            "of every layer's expert weights in its Hopper layouts, converted when the rank "
            "loads (engine/loader.py `prepare_prefill_experts`; ≈ +1.0 GB per MoE layer at K3 "
            "TP16: fits a GB300's 288 GB, not an H200's 141 GB at 93 layers); the 8k prefill "
            "MFU 0.426 against 0.350 on the H100 in one run (docs/PERF.md); ogs: the same on "
            "the weights as they are (no copy; slower than ours); both below 32 pairs per "
            "expert run auto's kernels; auto-ew: auto as it was before the x2 decode "
            "(blocked past 128 pairs per expert, elementwise decode), the benchmark's baseline; "
            "auto-nopf: auto without the scales' look-ahead (`MoEConfig.prefetch_scales`; "
            "bit-equal either way), its same-run baseline. Any of our kinds may end in "
            "+FIELD=VALUE parts that set MoEConfig fields of the configs it picks (e.g. "
            "auto+down_bn=64: the down tiles auto ran before; a kernel option's A/B before it ships)",
            ", ".join(PREFILL_EXPERT_KINDS) + ", each but ogs / ogs-hopper optionally followed "
            "by +FIELD=VALUE (FIELD: " + ", ".join(PREFILL_EXPERT_FIELDS) + ")",
            _prefill_experts_value),
    Setting("RAYDECODE_ONESHOT_ALLREDUCE", "1", "'0' keeps every all-reduce of a CUDA rank on "
            "NCCL (no one-shot kernel over peer buffers)", "'0' (off); anything else: on",
            _flag),
    Setting("RAYDECODE_CUTE_TVM_FFI", "1", "'0': CuTe kernels launch through DLPack and an "
            "explicit stream (hosts without tvm-ffi; no node-cache export)",
            "'0' (off); anything else: on", _flag),
    Setting("RAYDECODE_TRITON_PDL", "1", "'0': Triton decode kernels launch without "
            "programmatic dependent launch (timing A/B, profiles without the overlap)",
            "'0' (off); anything else: on", _flag),
    Setting("RAYDECODE_API_KEY", "", "API keys the ingress accepts besides the config's, comma "
            "separated (actors/auth.py)", "comma-separated keys, or unset", _text),
    Setting("RAYDECODE_DEBUG", "", "set: the CLI shows the traceback of a user-input error",
            "any non-empty value", _text),
    Setting("RAYDECODE_COMMIT", "unknown", "git commit recorded in benchmark JSON (default of "
            "their --commit)", "any text", _text),
    Setting("RAYDECODE_L2PF_KIND", "bulk", "experimental L2 prefetch: how rows are requested "
            "(kernels/experimental/l2_prefetch.py)", "bulk, lines", _choice("bulk", "lines")),
    Setting("RAYDECODE_L2PF_CHUNK", "16384", "experimental L2 prefetch: bytes per table row",
            "a positive multiple of 16", _multiple_of_16),
)
SETTINGS: dict[str, Setting] = {s.name: s for s in _ALL}

# Switches that were environment variables and are now decode options (deployment config
# `decode.<field>`, benchmark `--decode <field>=<value>`): a leftover one is refused by name.
RETIRED: dict[str, str] = {
    "RAYDECODE_MOE_FUSED": "moe_fused", "RAYDECODE_FFN_OUT_FUSED": "ffn_out_fused",
    "RAYDECODE_MLA_ABSORBED_Q": "mla_absorbed_q", "RAYDECODE_ATTNRES_BANK": "attnres_bank",
    "RAYDECODE_SKINNY_MAX_M": "skinny_max_m",
    "RAYDECODE_GEMV_L2_PREFETCH_MIB": "gemv_l2_prefetch_mib",
}


def get(name: str):
    """The typed value of setting `name` from this process's environment (its default when
    unset). Unknown names raise KeyError naming the known ones."""
    s = SETTINGS.get(name)
    if s is None:
        raise KeyError(f"{name!r} is not a raydecode setting; known: {', '.join(SETTINGS)}")
    return s.parse(os.environ.get(name, s.default), s)


def kernel_cache_dir() -> str:
    """$RAYDECODE_KERNEL_CACHE ('' when unset)."""
    return get("RAYDECODE_KERNEL_CACHE")


def model_cache_dir() -> Path:
    """$RAYDECODE_CACHE, else ~/.cache/raydecode."""
    return Path(get("RAYDECODE_CACHE") or Path.home() / ".cache" / "raydecode")


def rank_threads() -> int:
    return get("RAYDECODE_RANK_THREADS")


def step_graphs() -> bool | None:
    return get("RAYDECODE_STEP_GRAPHS")


def pad_prefill() -> bool | None:
    return get("RAYDECODE_PAD_PREFILL")


def stock_graphs() -> int:
    return get("RAYDECODE_STOCK_GRAPHS")


def stock_single() -> bool:
    return get("RAYDECODE_STOCK_SINGLE")


def stock_mixed() -> bool:
    return get("RAYDECODE_STOCK_MIXED")


def stock_fused() -> bool:
    return get("RAYDECODE_STOCK_FUSED")


def prefill_experts() -> str:
    return get("RAYDECODE_PREFILL_EXPERTS")


def kda_precision() -> str:
    return get("RAYDECODE_KDA_PRECISION")


def kda_recurrence_bv16() -> bool:
    return get("RAYDECODE_KDA_RECURRENCE_BV16")


def oneshot_allreduce() -> bool:
    return get("RAYDECODE_ONESHOT_ALLREDUCE")


def cute_tvm_ffi() -> bool:
    return get("RAYDECODE_CUTE_TVM_FFI")


def triton_pdl() -> bool:
    return get("RAYDECODE_TRITON_PDL")


def api_keys() -> str:
    """$RAYDECODE_API_KEY as set ('' when unset)."""
    return get("RAYDECODE_API_KEY")


def debug() -> bool:
    return bool(get("RAYDECODE_DEBUG"))


def commit() -> str:
    return get("RAYDECODE_COMMIT")


def check_no_retired() -> None:
    """Raise ValueError when a retired switch is still set in the environment: it no longer
    has any effect, and an A/B run that relied on it would silently time the default."""
    stale = [f"{k}={os.environ[k]!r} (now decode option {v!r})" for k, v in RETIRED.items()
             if k in os.environ]
    if stale:
        raise ValueError("retired environment switches set: " + "; ".join(stale) + ". Set the "
                         "deployment config's decode.<option>, or a benchmark's --decode "
                         "<option>=<value>, and unset the variable")


def describe_settings() -> list[str]:
    """One line per environment setting: name, default, meaning (docs, `--help`)."""
    return [f"{s.name} (default {s.default or 'unset'!s}): {s.meaning}" for s in _ALL]


# ---- decode options (per replica, carried to the ranks) --------------------------------------

MOE_KERNELS = ("auto", "cuda_core", "resident")


@dataclass(frozen=True)
class DecodeOptions:
    """What the specialized decode step runs, per replica. Defaults are what is served; each
    field's meaning is in `OPTION_DOCS` (and the deployment config's field descriptions).
    Tables of tuned kernel configs stay in their kernel modules; `gemv_configs` and
    `moe_decode_configs` override entries of them for one replica (A/B runs)."""
    moe_fused: bool = True
    ffn_out_fused: bool = True
    mla_absorbed_q: bool = True
    attnres_bank: bool = True
    attnres_cute: bool = True
    skinny_max_m: int = 16
    moe_max_pairs: int = 256
    moe_kernel: str = "auto"
    moe_resident_predecode: int = 3
    kda_splits: int | None = None
    router_gather: bool = True
    mla_pre_tile: bool = True
    gemv_l2_prefetch_mib: int = 0
    # ((N, K), GemvConfig) M = 1 overrides of kernels/gemv.py TUNED
    gemv_configs: tuple = ()
    # ((E, I, L), DecodeConfig) overrides of kernels/moe_mxfp4_decode.py TUNED
    moe_decode_configs: tuple = ()

    def __post_init__(self) -> None:
        bad = []
        for f in ("moe_fused", "ffn_out_fused", "mla_absorbed_q", "attnres_bank",
                  "attnres_cute", "router_gather", "mla_pre_tile"):
            if not isinstance(getattr(self, f), bool):
                bad.append(f"{f} = {getattr(self, f)!r}: expected true or false")
        for f, lo in (("skinny_max_m", 0), ("moe_max_pairs", 1), ("moe_resident_predecode", 0),
                      ("gemv_l2_prefetch_mib", 0)):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                bad.append(f"{f} = {v!r}: expected an integer ≥ {lo}")
        if self.moe_kernel not in MOE_KERNELS:
            bad.append(f"moe_kernel = {self.moe_kernel!r}: accepted {', '.join(MOE_KERNELS)}")
        s = self.kda_splits
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 1):
            bad.append(f"kda_splits = {s!r}: expected null (automatic) or an integer ≥ 1")
        for f in ("gemv_configs", "moe_decode_configs"):
            if not isinstance(getattr(self, f), tuple):
                bad.append(f"{f} = {getattr(self, f)!r}: expected a tuple of (shape, config)")
        if bad:
            raise ValueError("decode options: " + "; ".join(bad))

    def replace(self, **changes) -> "DecodeOptions":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        """JSON-ready (benchmark reports)."""
        d = dataclasses.asdict(self)         # nested config dataclasses become dicts
        for f in ("gemv_configs", "moe_decode_configs"):
            d[f] = [[list(k), v] for k, v in d[f]]
        return d


OPTION_DOCS: dict[str, str] = {
    "moe_fused": "the fused specialized MoE block (two packed GEMVs around the router and the "
                 "experts, one norm + SiTU op) where the layer has its parts; false: the "
                 "unfused block",
    "ffn_out_fused": "inside the fused MoE block, the latent norm + SiTU as the prologue of the "
                     "ffn_out CuTe GEMV where it serves (K3 TP16 batch 1)",
    "mla_absorbed_q": "MLA decode at DCP 1: W_uk and the q_a norm folded into the q_b GEMV, "
                      "then mla_decode_absorbed (2 kernels); false: q_b' + mla_decode_fused (3)",
    "attnres_bank": "the AttnRes block snapshots as slots of one bank tensor (the fused mix + "
                    "norm reads one strided view); false: separate tensors",
    "attnres_cute": "the CuTe AttnRes mix + norm kernel where it supports the layout; false: "
                    "the Triton kernel",
    "skinny_max_m": "largest batch (M) the tensor-core skinny GEMM serves (2 < M); above it, "
                    "cuBLAS; 0: off",
    "moe_max_pairs": "T·top_k up to which the specialized MoE runs the few-token kernels (the "
                     "stock grouped kernel above)",
    "moe_kernel": "few-token MoE kernel: auto (the resident CuTe kernel for the shapes in "
                  "kernels/moe_decode.py RESIDENT, else the CUDA-core kernel), cuda_core, or "
                  "resident (wherever it fits)",
    "moe_resident_predecode": "the resident MoE kernel's down rows per lane decoded before "
                              "its PDL wait",
    "kda_splits": "programs per head of the fused KDA decode (1: one per head); null: "
                  "automatic",
    "router_gather": "the router's top-k weights gathered from registers (false: re-loaded)",
    "mla_pre_tile": "the MLA split kernel loads its first KV tile before the PDL wait",
    "gemv_l2_prefetch_mib": "experimental: entry L2 prefetch budget per CuTe GEMV launch in "
                            "MiB; 0: off",
    "gemv_configs": "A/B runs: M = 1 CuTe GEMV mappings per (N, K) over the tuned table",
    "moe_decode_configs": "A/B runs: CUDA-core MoE decode configs per (E, I, L) over the "
                          "tuned table",
}

DEFAULT_OPTIONS = DecodeOptions()


def parse_option_pairs(pairs, base: DecodeOptions = DEFAULT_OPTIONS) -> DecodeOptions:
    """`FIELD=VALUE` strings (benchmark --decode flags) over `base`. Booleans take 0/1/true/
    false, integers digits, kda_splits also 'none'. Raises ValueError naming the pair and
    what is accepted."""
    changes: dict = {}
    fields = {f.name: f for f in dataclasses.fields(DecodeOptions)}
    table = ("gemv_configs", "moe_decode_configs")
    for p in pairs:
        name, sep, raw = p.partition("=")
        if not sep or name not in fields or name in table:
            known = ", ".join(n for n in fields if n not in table)
            raise ValueError(f"--decode {p!r}: expected FIELD=VALUE with FIELD one of {known}")
        cur = getattr(base, name)
        try:
            if isinstance(cur, bool):
                if raw.lower() not in ("0", "1", "true", "false"):
                    raise ValueError("expected 0, 1, true or false")
                val = raw.lower() in ("1", "true")
            elif name == "kda_splits":
                val = None if raw.lower() in ("none", "null", "") else int(raw)
            elif isinstance(cur, int):
                val = int(raw)
            else:
                val = raw
        except ValueError as e:
            raise ValueError(f"--decode {p!r}: {e}") from None
        changes[name] = val
    return dataclasses.replace(base, **changes)


__all__ = ["DEFAULT_OPTIONS", "DecodeOptions", "MOE_KERNELS", "OPTION_DOCS", "RETIRED",
           "SETTINGS", "Setting", "check_no_retired", "describe_settings", "get",
           "is_token_bucket", "parse_option_pairs"]
