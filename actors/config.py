"""The deployment config: one YAML file describes a replica (model, TP/DCP, envelope), its stock
pool and its Serve options. Key names follow vLLM's engine arguments where one exists, so
operators recognise them (`model`, `served_model_name`, `tensor_parallel_size`,
`decode_context_parallel_size`, `speculative_config`, `max_num_seqs`, `max_model_len`).

Pydantic at this edge (unknown keys rejected, a description on every field); the runtime takes
frozen dataclasses derived from it (`EngineConfig`, `EnvelopePolicy`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator,
                      model_validator)

from raydecode.engine.engine import EngineConfig
from raydecode.engine.pacer import STRETCH
from raydecode.engine.spec_engine import SpecConfig
from raydecode.kernels.settings import DEFAULT_OPTIONS, OPTION_DOCS, DecodeOptions

from .envelope import EnvelopePolicy

TP_SIZES = (1, 2, 4, 8, 16)
DCP_SIZES = (1, 2, 4, 8, 16)
SPEC_METHODS = ("dspark",)
SPEC_TOKENS = (3, 7)           # inclusive range of num_speculative_tokens (DESIGN §3)


class DeployConfigError(ValueError):
    """A deployment config that cannot be used; names the file, the field and what is accepted."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SpeculativeConfig(_Model):
    """The same choices as `raydecode generate --spec dspark --num-draft K [--draft PATH|tiny]
    [--synthetic-acceptance L]`."""
    method: str = Field(description="Speculative decoding method; accepted: 'dspark'.")
    num_speculative_tokens: int = Field(
        description="Draft tokens proposed per step (K), 3..7 and at most the drafter's block "
                    "size (7 for K3's DSpark).")
    model: str | None = Field(
        default=None, description="Drafter: a DSpark checkpoint folder or the preset 'tiny'; "
                                  "null: 'tiny' for the tiny target, else the 'dspark' folder "
                                  "inside the target checkpoint folder.")
    synthetic_acceptance_length: float | None = Field(
        default=None, description="Benchmarks only: accept the earliest drafts to this fixed "
                                  "mean acceptance length L in [1, K+1] (it counts the bonus "
                                  "token). The generated text is then meaningless; responses "
                                  "and metrics say so. null: real acceptance.")

    @field_validator("method")
    @classmethod
    def _method(cls, v: str) -> str:
        if v not in SPEC_METHODS:
            raise ValueError(f"method = {v!r}; accepted: {', '.join(SPEC_METHODS)}")
        return v

    @field_validator("num_speculative_tokens")
    @classmethod
    def _k(cls, v: int) -> int:
        lo, hi = SPEC_TOKENS
        if not lo <= v <= hi:
            raise ValueError(f"num_speculative_tokens = {v}; accepted: {lo}..{hi}")
        return v

    @model_validator(mode="after")
    def _synthetic(self) -> "SpeculativeConfig":
        L, k = self.synthetic_acceptance_length, self.num_speculative_tokens
        if L is not None and not 1.0 <= L <= k + 1:
            raise ValueError(f"synthetic_acceptance_length = {L}; accepted: 1 <= L <= "
                             f"num_speculative_tokens + 1 = {k + 1}")
        return self

    @property
    def synthetic(self) -> bool:
        return self.synthetic_acceptance_length is not None


class EnvelopeOptions(_Model):
    enabled: bool = Field(
        default=True, description="false: every step runs the stock path and the replica never "
                                  "fails over (a stock-only replica, e.g. a test stock pool).")
    max_batch: int = Field(
        default=64, ge=1, le=64,
        description="Largest non-speculative decode batch run on the specialized path (≤ 64).")


def _opt(name: str):
    """A deployment field for DecodeOptions.<name>: its default and its one-line meaning."""
    return Field(default=getattr(DEFAULT_OPTIONS, name), description=OPTION_DOCS[name] + ".")


class DecodeOptionsConfig(_Model):
    """What the specialized decode step runs on every rank of the replica (kernels/settings.py
    DecodeOptions; the defaults are the served kernels). Carried to the ranks with the shard
    spec; no rank reads these from its environment."""
    moe_fused: bool = _opt("moe_fused")
    ffn_out_fused: bool = _opt("ffn_out_fused")
    mla_absorbed_q: bool = _opt("mla_absorbed_q")
    attnres_bank: bool = _opt("attnres_bank")
    attnres_cute: bool = _opt("attnres_cute")
    skinny_max_m: int = _opt("skinny_max_m")
    moe_max_pairs: int = _opt("moe_max_pairs")
    moe_kernel: Literal["auto", "cuda_core", "resident"] = _opt("moe_kernel")
    moe_resident_predecode: int = _opt("moe_resident_predecode")
    kda_splits: int | None = _opt("kda_splits")
    router_gather: bool = _opt("router_gather")
    mla_pre_tile: bool = _opt("mla_pre_tile")
    step_graphs: bool | None = Field(
        default=None, description="Whole-step CUDA graphs per batch bucket: null (auto: on for "
                                  "CUDA ranks whose model the graphs support), true (forced), "
                                  "false (eager Python launches).")
    oneshot_allreduce: bool = Field(
        default=True, description="The one-shot all-reduce over CUDA-IPC peer buffers for the "
                                  "model's bf16 hidden-width all-reduces of CUDA ranks (false: "
                                  "every all-reduce on NCCL).")

    @model_validator(mode="after")
    def _valid(self) -> "DecodeOptionsConfig":
        self.options()          # ValueError naming the field and what is accepted
        return self

    def options(self) -> DecodeOptions:
        """The frozen options the ranks build their model with."""
        return DecodeOptions(**self.model_dump(exclude={"step_graphs", "oneshot_allreduce"}))


class StockPoolOptions(_Model):
    base_url: str = Field(description="OpenAI-compatible stock endpoint, e.g. "
                                      "'http://stock-pool:8000/v1'.")
    model: str | None = Field(default=None, description="Model name on the stock pool; "
                                                        "null: this replica's served_model_name.")
    timeout_s: float = Field(default=600.0, gt=0, description="Timeout of one stock request, "
                                                              "seconds.")
    api_key_env: str | None = Field(
        default=None, description="Environment variable holding the pool's API key; null: "
                                  "the key 'EMPTY' (vLLM without --api-key).")

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"base_url = {v!r}; expected an http:// or https:// URL")
        return v.rstrip("/")


try:        # the cluster layer owns placement options when it is present (DESIGN §2)
    from raydecode.cluster.placement import PlacementOptions  # type: ignore[import-not-found]
except ImportError:
    class PlacementOptions(_Model):      # minimal stand-in until cluster/placement.py lands
        profile: Literal["production", "development"] = Field(
            default="production",
            description="production: the specialized path needs TP 8 or 16 in a verified NVLink "
                        "domain. development: also TP 1, 2, 4 and no domain check (reports "
                        "say so).")


class ServeOptions(_Model):
    host: str = Field(default="127.0.0.1", description="HTTP listen address of the Serve proxy; "
                                                       "0.0.0.0 to serve other machines.")
    port: int = Field(default=8000, ge=1, le=65535, description="HTTP port of the Serve proxy.")
    num_replicas: int = Field(default=1, ge=1, description="Replicas (each a coordinator and "
                                                           "its TP group).")
    route_prefix: str = Field(default="/", description="URL prefix of the app; the OpenAI "
                                                       "routes live under it (…/v1/…).")
    max_ongoing_requests: int = Field(default=512, ge=1,
                                      description="Requests one ingress replica holds at once.")
    num_cpus: float = Field(default=1.0, ge=0, description="CPUs reserved for the ingress and "
                                                           "for the coordinator actor each.")
    request_timeout_s: float = Field(
        default=600.0, gt=0, description="A non-streaming request not finished this many seconds "
                                         "after it arrived is aborted and answered 503 + "
                                         "Retry-After.")
    api_keys: list[SecretStr] = Field(
        default_factory=list,
        description="Bearer keys every /v1 route requires (any one of them); with none from "
                    "here, api_key_file or $RAYDECODE_API_KEY the routes are open. Prefer the "
                    "file or the environment variable to keys written in this file.")
    api_key_file: str | None = Field(
        default=None, description="File of API keys, one per line ('#' comments), read by "
                                  "each ingress replica (e.g. a mounted secret).")
    metrics_port: int | None = Field(
        default=None, ge=0, le=65535,
        description="Serve /metrics and /health on this port (of metrics_host) instead of the "
                    "public one; with several ingress replicas on a node, the replica of "
                    "local rank r binds metrics_port + r. 0: an OS-chosen port. null: on the "
                    "public port.")
    metrics_host: str = Field(default="127.0.0.1",
                              description="Listen address of metrics_port (local by default).")

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, v: list[SecretStr]) -> list[SecretStr]:
        from .auth import check_key
        for i, k in enumerate(v):
            check_key(k.get_secret_value(), f"key {i}")
        return v

    @field_validator("route_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"route_prefix = {v!r}; expected a path starting with '/'")
        return v


class DeployConfig(_Model):
    model: str = Field(description="Model preset ('tiny') or checkpoint folder.")
    served_model_name: str | None = Field(
        default=None, description="Name clients pass as `model`; null: the model spec.")
    tensor_parallel_size: int = Field(default=1, description="TP ranks of one replica: 1, 2, "
                                                             "4, 8 or 16.")
    decode_context_parallel_size: int = Field(
        default=1, description="DCP size (MLA latent cache split by token position); 1, 2, 4, "
                               "8 or 16, dividing tensor_parallel_size.")
    speculative_config: SpeculativeConfig | None = Field(
        default=None, description="Speculative decoding (DSpark); null: off.")
    max_num_seqs: int = Field(default=64, ge=1, description="Sequences decoded together at most.")
    max_model_len: int | None = Field(
        default=None, ge=2, description="Prompt + output tokens per request; null: the model's "
                                        "context, capped at 4096.")
    max_num_batched_tokens: int = Field(
        default=8192, ge=1,
        description="Token budget of one step (prefill chunk). 8192: on the H200 (K3 TP16 rank, "
                    "8 layers) a stock prefill step costs 17-22 ms at one token, 28-35 at 2048, "
                    "44-46 at 4096 and 84-86 at 8192 (two runs), so an 8k prompt's TTFT is "
                    "0.084 s in one step against 0.145 s in four of 2048 (MFU 0.26 vs 0.15, "
                    "bench/results/budget-prefill-h200-2026-12-04.json).")
    max_prefill_tokens_while_decoding: int | None = Field(
        default=512, ge=1,
        description="Prompt tokens of one step while other sequences decode; null: the whole "
                    "max_num_batched_tokens. A long prompt then prefills in chunks this size "
                    "while streams run (each running stream waits at most one such chunk step "
                    "per token) and in budget-sized chunks when nothing decodes. 512: with the "
                    "stock graphs (RAYDECODE_STOCK_GRAPHS, default 512) a chunk step that size "
                    "costs 10.2 ms for 8 K3 layers on the H100 against 20.6 at 2048 and 8.7 at "
                    "256, so a running stream's token takes 3.5x its decode-alone time beside "
                    "a prompt (2048: 6.0x; eager 2048: 8.0x) while the prompt gets 36k tok/s "
                    "(bench/results/prefill-h100-2026-12-06-graphs.json).")
    decode_slowdown_limit: float | None = Field(
        default=None, gt=1,
        description="While streams decode, size each step's prompt tokens (at most "
                    "max_prefill_tokens_while_decoding) so that a stream's token beside a "
                    "prompt takes at most this many times its token without one, from the "
                    "steps' measured times (engine/pacer.py: probes from 1/8 of the cap, then "
                    "the largest chunk whose measured or extrapolated step fits). null: the "
                    "fixed max_prefill_tokens_while_decoding alone.")
    prompt_stretch_limit: float = Field(
        default=STRETCH, ge=1, allow_inf_nan=False,
        description="With decode_slowdown_limit set: the pacer never slows a prompt's prefill "
                    "below 1/this of its rate at max_prefill_tokens_while_decoding. Where the "
                    "largest chunk under the slowdown limit would (a chunk step's fixed cost "
                    "near a decode step's: on the H100 at 24 K3 layers the 2.0 limit fit 8-32 "
                    "token chunks and a 32k prompt took 36.9 s against 2.4 s), the chunk is "
                    "the smallest that keeps that rate, and the streams' slowdown goes over "
                    "the limit by what it costs (engine/pacer.py). 1: the static cap "
                    "whenever it is measured.")
    max_waiting_requests: int = Field(
        default=256, ge=0, description="Requests queued beyond the running ones before new ones "
                                       "get 503 + Retry-After (a request's n samples count "
                                       "n; n above this limit is a 400).")
    block_size: int = Field(default=16, ge=1, description="Tokens per latent-cache block.")
    enable_prefix_caching: bool | None = Field(
        default=None, description="Reuse the cache of earlier requests that share a token "
                                  "prefix: MLA latent blocks shared by prefix hash and KDA "
                                  "state snapshots where conversations resume (a prompt's end, "
                                  "a finished request's end), so a follow-up turn prefills only "
                                  "its new tokens; usage reports them as "
                                  "prompt_tokens_details.cached_tokens. null: on, except with "
                                  "speculative_config (not supported together yet).")
    kda_snapshot_slots: int = Field(
        default=32, ge=0, description="KDA state snapshots each rank keeps for prefix "
                                      "caching, evicted least recently used: each holds one "
                                      "sequence's recurrent + conv state (K3: 28.1 MB per rank "
                                      "at TP16, 56.2 MB at TP8; `raydecode plan "
                                      "--kda-snapshots` counts them). Unused when prefix "
                                      "caching is off.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="Weights/activations dtype; auto: bfloat16 on GPU, float32 "
                                    "on CPU.")
    rank_step_timeout_s: float = Field(
        default=60.0, gt=0, description="A step that has not returned after this many seconds "
                                        "marks the replica unhealthy and fails its requests over.")
    split_mixed_steps: bool | None = Field(
        default=None,
        description="Never put decode tokens into a prefill step: while prompts prefill and "
                    "sequences decode, steps alternate between prefill chunks and decode "
                    "tokens alone, so the decodes keep the specialized (graphed) path. null: "
                    "on when decode steps replay captured graphs and the envelope is on.")
    coordinator_switch_interval_ms: float = Field(
        default=0.2, gt=0, le=100,
        description="The coordinator process's GIL switch interval (sys.setswitchinterval), ms. "
                    "Its step thread waits for the GIL at each wake-up (a rank's result, a "
                    "socket send) while the event loop streams outputs; under such load "
                    "Python's 5 ms default made a step's channel round trip average 0.8-3.4 ms "
                    "(1-4 ranks, batch 1-64), 0.2 ms makes it 0.33-0.94 "
                    "(docs/perf-log/served-path.md).")
    envelope: EnvelopeOptions = Field(default_factory=EnvelopeOptions,
                                      description="The specialized-path envelope (DESIGN §3).")
    stock_pool: StockPoolOptions | None = Field(
        default=None, description="Where requests continue when this replica is unhealthy; "
                                  "null: they get 503 + Retry-After.")
    placement: PlacementOptions = Field(default_factory=PlacementOptions,
                                        description="Where ranks may run and under which profile.")
    serve: ServeOptions = Field(default_factory=ServeOptions, description="Ray Serve options.")
    decode: DecodeOptionsConfig = Field(
        default_factory=DecodeOptionsConfig,
        description="What the specialized decode step runs (kernels and fused blocks); the "
                    "defaults are the served ones.")
    default_chat_template_kwargs: dict | None = Field(
        default=None, description="Chat template options for requests that do not set them "
                                  "(vLLM's --default-chat-template-kwargs): 'thinking' (or "
                                  "'enable_thinking', default true) and 'thinking_effort' "
                                  "(low, high, max; default max).")

    @field_validator("default_chat_template_kwargs")
    @classmethod
    def _chat_kwargs(cls, v: dict | None) -> dict | None:
        from .openai_api import APIError, chat_options
        try:
            chat_options(None, v)
        except APIError as e:
            raise ValueError(e.message) from None
        return v

    @field_validator("tensor_parallel_size")
    @classmethod
    def _tp(cls, v: int) -> int:
        if v not in TP_SIZES:
            raise ValueError(f"tensor_parallel_size = {v}; accepted: {TP_SIZES}")
        return v

    @field_validator("decode_context_parallel_size")
    @classmethod
    def _dcp(cls, v: int) -> int:
        if v not in DCP_SIZES:
            raise ValueError(f"decode_context_parallel_size = {v}; accepted: {DCP_SIZES}")
        return v

    @model_validator(mode="after")
    def _prefix_caching(self) -> "DeployConfig":
        if self.enable_prefix_caching and self.speculative_config is not None:
            raise ValueError("enable_prefix_caching = true with speculative_config: not "
                             "supported together yet; set enable_prefix_caching to false or "
                             "null (null turns it off for speculative replicas)")
        if self.enable_prefix_caching and self.kda_snapshot_slots < 1:
            raise ValueError("enable_prefix_caching = true needs kda_snapshot_slots >= 1 (a "
                             "cached prefix is only usable where a KDA state snapshot exists)")
        return self

    @model_validator(mode="after")
    def _dcp_divides_tp(self) -> "DeployConfig":
        if self.tensor_parallel_size % self.decode_context_parallel_size:
            raise ValueError(f"decode_context_parallel_size = {self.decode_context_parallel_size}"
                             f" must divide tensor_parallel_size = {self.tensor_parallel_size}")
        return self

    # ---- derived (nothing mutates a config) ----------------------------------------------
    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def profile(self) -> str:
        return getattr(self.placement, "profile", "production")

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        import torch
        return "bfloat16" if torch.cuda.is_available() else "float32"

    def resolved_max_model_len(self, model_max_positions: int) -> int:
        return self.max_model_len or min(model_max_positions, 4096)

    @property
    def prefix_caching(self) -> bool:
        """enable_prefix_caching resolved: null is on without speculative_config and with
        snapshot slots to keep."""
        if self.enable_prefix_caching is not None:
            return self.enable_prefix_caching
        return self.speculative_config is None and self.kda_snapshot_slots > 0

    def engine_config(self, model_max_positions: int) -> EngineConfig:
        on = self.prefix_caching
        return EngineConfig(max_num_seqs=self.max_num_seqs,
                            max_model_len=self.resolved_max_model_len(model_max_positions),
                            max_num_batched_tokens=self.max_num_batched_tokens,
                            block_size=self.block_size,
                            dcp_size=self.decode_context_parallel_size,
                            enable_prefix_caching=on,
                            num_snapshots=self.kda_snapshot_slots if on else 0,
                            prefill_tokens_while_decoding=self.max_prefill_tokens_while_decoding,
                            decode_slowdown_limit=self.decode_slowdown_limit,
                            prompt_stretch_limit=self.prompt_stretch_limit)

    def decode_options(self) -> DecodeOptions:
        """The replica's DecodeOptions (the `decode` section), for every rank's shard spec."""
        return self.decode.options()

    def envelope_policy(self) -> EnvelopePolicy:
        return EnvelopePolicy(enabled=self.envelope.enabled, max_batch=self.envelope.max_batch,
                              profile=self.profile)

    @property
    def drafter(self) -> str | None:
        """The drafter spec (preset or folder) a speculating replica loads; None: no
        speculation. Default: 'tiny' for the tiny target, else <model>/dspark."""
        sc = self.speculative_config
        if sc is None:
            return None
        if sc.model is not None:
            return sc.model
        return "tiny" if self.model == "tiny" else str(Path(self.model) / "dspark")

    def spec_config(self) -> SpecConfig | None:
        sc = self.speculative_config
        if sc is None:
            return None
        return SpecConfig(num_drafts=sc.num_speculative_tokens,
                          synthetic_length=sc.synthetic_acceptance_length)

    @property
    def synthetic_warning(self) -> str | None:
        """The warning every response carries in synthetic-acceptance mode (benchmarks)."""
        sc = self.speculative_config
        if sc is None or not sc.synthetic:
            return None
        return (f"synthetic acceptance (speculative_config.synthetic_acceptance_length = "
                f"{sc.synthetic_acceptance_length:g}) is on: this deployment is for benchmarks "
                "and its generated text is meaningless")


def check_speculative(cfg: DeployConfig, source: str = "deployment config",
                      require_drafter: bool = True) -> int | None:
    """DESIGN §6: acceptance collapses when more drafts are requested than the drafter's block
    size (7 drafts on a 5-token-block drafter: ~4 % acceptance), so the check reads the
    drafter's config (a preset, or DRAFTER/config.json) and rejects
    num_speculative_tokens > block_size. -> the drafter's block size; None without
    speculative_config, or when require_drafter is False and the drafter's folder is not on
    this machine (a client deploying to a remote cluster: the replica checks it at start)."""
    from raydecode.models.config import ConfigError
    from raydecode.models.dspark import DSPARK_PRESETS, check_num_drafts, load_dspark_config

    sc, spec = cfg.speculative_config, cfg.drafter
    pre = f"{source}: " if source else ""
    if sc is None:
        return None
    if not require_drafter and spec not in DSPARK_PRESETS and not Path(spec).exists():
        return None
    try:
        dcfg = load_dspark_config(spec)
    except ConfigError as e:
        raise DeployConfigError(f"{pre}speculative_config.model: drafter {spec!r}: {e}") \
            from None
    k, bs = sc.num_speculative_tokens, dcfg.block_size
    try:
        check_num_drafts(k, dcfg)
    except ConfigError:
        lo, hi = SPEC_TOKENS
        accepted = f"{lo}..{min(hi, bs)}" if bs >= lo else f"none (at least {lo} are needed)"
        raise DeployConfigError(
            f"{pre}speculative_config.num_speculative_tokens = {k} exceeds the block size "
            f"{bs} of drafter {spec!r} (more drafts than its block collapse acceptance); "
            f"accepted with this drafter: {accepted}") from None
    return bs


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        secret = "api_keys" in e["loc"]           # a key never shows in a message
        got = f" (got {e['input']!r})" if e["type"] not in ("missing", "extra_forbidden",
                                                           "value_error") and \
            not isinstance(e.get("input"), dict) and not secret else ""
        lines.append(f"  {loc}: {msg}{got}")
    return "\n".join(lines)


def parse_deploy_config(data: object, source: str = "deployment config") -> DeployConfig:
    if not isinstance(data, dict):
        raise DeployConfigError(f"{source}: expected a mapping of keys (model: …, "
                                f"tensor_parallel_size: …), got {type(data).__name__}")
    try:
        return DeployConfig.model_validate(data)
    except ValidationError as e:
        raise DeployConfigError(f"{source}: invalid deployment config\n{_format_errors(e)}") \
            from None


def load_deploy_config(path: str | Path) -> DeployConfig:
    p = Path(path)
    if not p.is_file():
        raise DeployConfigError(f"deployment config {str(p)!r}: no such file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise DeployConfigError(f"{p}: not valid YAML ({e})") from None
    return parse_deploy_config(data, str(p))
