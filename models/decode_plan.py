"""The decode plan: which kernel serves every piece of a specialized decode step, per batch
bucket, resolved once per replica. This is the one place a step's kernels are chosen.

    resolve_plan(cfg, tp, options, buckets, dcp, dtype, sm_count) -> DecodePlan
        inputs: the model config and TP/DCP layout, the replica's DecodeOptions (deployment
        config `decode:`, kernels/settings.py), the GPU's SM count, and the tuned tables the
        op dispatches read (kernels/gemv.py TUNED, kernels/moe_mxfp4_decode.py TUNED,
        kernels/moe_decode.py RESIDENT);
        per bucket M (`StepKernels`):
          gemvs    every decode GEMV shape (models/params.py `decode_gemv_shapes`) with its
                   kernel: cute (+ GemvConfig) | skinny | cublas (kernels/linear.py)
          moe      the routed experts' kernel: resident (+ its launch plan) | cuda_core
                   (+ DecodeConfig) | grouped (kernels/moe_decode.py)
          fusions  the fused MoE block, the ffn_out GEMV's norm + SiTU prologue, the MLA
                   decode form, the AttnRes bank and kernel, the KDA split, the router gather

The rules live in the ops' dispatch modules (kernels/linear.py `gemv_choice`,
kernels/moe_decode.py `moe_kernel`, kernels/gemv_norm_situ.py `shape_ok`) and in the model's
own conditions (models/params.py `moe_block_fused`); the plan applies them to the replica's
shapes, and the model's layers apply the same rules with the same options at run time, so a
step launches what its bucket's plan lists (tests/cpu/test_decode_plan.py). The node kernel
cache compiles the plan's CuTe kernels (kernels/aot.py `kernel_plan`); `raydecode
kernels-warmup --dry-run` prints it. Where a kernel cannot run the tensors at hand (a CPU rank,
no CuTe DSL or Triton) the ops fall back to their PyTorch references, which the plan does not
list: it describes a CUDA rank.
"""
from __future__ import annotations

from dataclasses import dataclass

from raydecode.kernels import gemm_skinny_triton as _skinny
from raydecode.kernels import gemv_norm_situ as _norm_situ
from raydecode.kernels import linear as _linear
from raydecode.kernels import moe_decode as _moe
from raydecode.kernels.settings import DEFAULT_OPTIONS, DecodeOptions

from . import layers as _layers
from .config import K3Config
from .params import ShardError, decode_gemv_shapes, gemv_out_dtype, moe_block_fused

BUCKETS = (1, 2, 4, 8, 16, 32, 64)   # decode batch buckets (DESIGN §3: specialized batch ≤ 64)


@dataclass(frozen=True)
class GemvChoice:
    name: str                 # decode_gemv_shapes key
    M: int
    N: int
    K: int
    out_dtype: str            # 'bf16' | 'fp32' (params.gemv_out_dtype)
    kernel: str               # 'cute' | 'skinny' | 'cublas' (kernels/linear.py)
    config: object | None     # GemvConfig (cute), SkinnyConfig (skinny), None (cublas)
    why: str


@dataclass(frozen=True)
class MoEChoice:
    kernel: str               # 'resident' | 'cuda_core' | 'grouped' | 'dense' (bf16 experts)
    tokens: int
    top_k: int
    experts: tuple[int, int, int]     # (E, I/TP, L)
    config: object | None     # ResidentMoEPlan | DecodeConfig | None
    why: str
    wanted: str = ""          # the rule's kernel before the resident kernel's fit check


@dataclass(frozen=True)
class Fusions:
    moe_block: bool           # the fused specialized MoE block (models/moe.py _forward_fused)
    ffn_out_prologue: bool    # its latent norm + SiTU inside the ffn_out CuTe GEMV
    mla: str                  # 'absorbed' (2 kernels) | 'folded' (3) | 'dcp' | 'none'
    attnres_bank: bool
    attnres_kernel: str       # 'cute' | 'triton'
    kda_splits: int | None    # None: automatic
    router_gather: bool
    mla_pre_tile: bool


@dataclass(frozen=True)
class StepKernels:
    """What one bucket's specialized decode step launches."""
    tokens: int
    gemvs: tuple[GemvChoice, ...]
    moe: MoEChoice | None
    fusions: Fusions
    ffn_out: tuple | None = None     # (M, N, K, D, n_cols, I, gu_stride, has_lin) if fused

    def gemv(self, name: str) -> GemvChoice:
        for g in self.gemvs:
            if g.name == name:
                return g
        raise KeyError(f"no decode GEMV {name!r} in this plan; known: "
                       f"{', '.join(g.name for g in self.gemvs)}")


@dataclass(frozen=True)
class DecodePlan:
    model: str
    tp: int
    dcp: int
    dtype: str
    path: str
    sm_count: int | None
    options: DecodeOptions
    steps: tuple[StepKernels, ...]

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(s.tokens for s in self.steps)

    def step(self, tokens: int) -> StepKernels:
        """The plan of the smallest bucket ≥ tokens (a padded graph step runs that bucket)."""
        for s in self.steps:
            if s.tokens >= tokens:
                return s
        raise ValueError(f"{tokens} tokens: above the plan's largest bucket "
                         f"{self.steps[-1].tokens}; accepted 1..{self.steps[-1].tokens}")

    def describe(self) -> list[str]:
        """One line per choice, by bucket (the kernels-warmup --dry-run listing)."""
        o = self.options
        lines = [f"# decode plan {self.model} TP{self.tp} DCP{self.dcp} {self.dtype} "
                 f"{self.path}, SMs {self.sm_count or 'unknown'}; options: "
                 + ", ".join(f"{k}={v}" for k, v in o.as_dict().items()
                             if k not in ("gemv_configs", "moe_decode_configs"))]
        for s in self.steps:
            f = s.fusions
            lines.append(f"## M={s.tokens}: moe_block={'fused' if f.moe_block else 'unfused'}"
                         f" ffn_out_prologue={f.ffn_out_prologue} mla={f.mla} "
                         f"attnres={f.attnres_kernel}{'+bank' if f.attnres_bank else ''} "
                         f"kda_splits={f.kda_splits or 'auto'} router_gather={f.router_gather}")
            for g in s.gemvs:
                c = g.config
                cfg = (f" (L={c.lanes_per_row} KW={c.k_warps} R={c.rows_per_group} "
                       f"WR={c.row_warps})" if g.kernel == "cute" else "")
                lines.append(f"  {g.name:16s} M={g.M} N={g.N} K={g.K} out={g.out_dtype} "
                             f"{g.kernel}{cfg}")
            if s.moe is not None:
                m = s.moe
                lines.append(f"  {'moe':16s} T={m.tokens} top-{m.top_k} E,I,L={m.experts} "
                             f"{m.kernel}: {m.why}")
        return lines


def _mla_form(cfg: K3Config, dcp: int, dtype: str, options: DecodeOptions) -> str:
    """models/mla.py `_fused_decode_ok` / `_fused_decode`: bf16, the output gate."""
    if not cfg.mla_layers or not cfg.mla.use_output_gate or dtype != "bfloat16":
        return "none"
    if dcp > 1:
        return "dcp"
    return "absorbed" if options.mla_absorbed_q else "folded"


def _moe_choice(cfg: K3Config, tp: int, M: int, path: str, moe_block: bool,
                options: DecodeOptions, sm_count: int | None) -> MoEChoice | None:
    """kernels/moe_decode.py's rule at M tokens; the resident kernel's launch plan where the
    SM count is known and it fits (else the CUDA-core kernel, as the dispatch falls back)."""
    from .moe import routed_experts_mxfp4

    m = cfg.moe
    if m is None or m.num_experts == 0 or not any(cfg.is_moe_layer(i)
                                                  for i in range(cfg.num_layers)):
        return None
    I = m.expert_intermediate // tp
    shape = (m.num_experts, I, m.latent_size)
    if not routed_experts_mxfp4(cfg):
        return MoEChoice("dense", M, m.top_k, shape, None,
                         "bf16 experts: a loop over the selected experts")
    kernel = _moe.moe_kernel(M, m.top_k, *shape, path, options)
    if kernel == "grouped":
        return MoEChoice("grouped", M, m.top_k, shape, None,
                         f"T·k = {M * m.top_k} > moe_max_pairs {options.moe_max_pairs}"
                         if path == "specialized" else "stock path")
    if kernel == "resident":
        from raydecode.kernels import moe_resident_cute as R
        if sm_count is None:
            why = "resident kernel needs the GPU's SM count (pass sm_count)"
        else:
            lin = cfg.situ_linear_beta
            try:
                plan = R.ResidentMoEPlan(
                    tokens=M, top_k=m.top_k, num_experts=m.num_experts, intermediate=I,
                    latent=m.latent_size, ctas=sm_count, beta=float(cfg.situ_beta),
                    linear_beta=None if lin is None else float(lin), z_fp32=moe_block,
                    predecode=options.moe_resident_predecode)
                return MoEChoice("resident", M, m.top_k, shape, plan,
                                 f"one resident CuTe launch on {sm_count} CTAs", "resident")
            except ValueError as e:
                why = f"resident kernel does not fit ({e})"
        return MoEChoice("cuda_core", M, m.top_k, shape,
                         _moe.decode_config_for(*shape, options), why + "; CUDA-core kernel",
                         "resident")
    return MoEChoice("cuda_core", M, m.top_k, shape, _moe.decode_config_for(*shape, options),
                     "few-token CUDA-core kernels")


def _ffn_out_item(cfg: K3Config, M: int, shapes: dict, moe_block: bool,
                  options: DecodeOptions) -> tuple | None:
    """The fused ffn_out kernel's shape at M where the block launches it (models/moe.py
    `_forward_fused` with ffn_out_fused; `gemv_norm_situ.supports` alignment: the h2 GEMV's
    fp32 rows and the gate ‖ up slice start on 16 bytes)."""
    if not (moe_block and options.ffn_out_fused and "ffn_out" in shapes):
        return None
    N, K = shapes["ffn_out"]
    D, n, I = cfg.moe.latent_size, shapes["latent_down"][0], shapes["shared_gate"][0]
    ys, gu0 = shapes["h2_proj"][0], shapes["router"][0] + n    # gate ‖ up = y[:, gu0:]
    if ys % 4 or gu0 % 4 or not _norm_situ.shape_ok(M, N, K, D, n, I):
        return None
    return (M, N, K, D, n, I, ys, cfg.situ_linear_beta is not None)


def _stock_gemm(M: int, N: int, K: int, dtype: str) -> tuple[str, object, str]:
    """The stock path's GEMM on a CUDA rank (models/layers.py `stock_linear`): the skinny
    GEMM for bf16 rows 1..STOCK_SKINNY_MAX_M with the stock kernels on, else cuBLAS."""
    if _layers.stock_skinny_shape(M, N, K, dtype == "bfloat16"):
        return ("skinny", _skinny.config_for(M, N, K),
                f"stock path: skinny GEMM (M ≤ {_layers.STOCK_SKINNY_MAX_M})")
    return "cublas", None, "stock path: F.linear"


def resolve_plan(cfg: K3Config, tp: int, options: DecodeOptions = DEFAULT_OPTIONS,
                 buckets=BUCKETS, dcp: int = 1, dtype: str | None = None,
                 sm_count: int | None = None, path: str = "specialized") -> DecodePlan:
    """The decode plan of one rank of a (cfg, TP, DCP) replica under `options` (module
    docstring). dtype: the model's ('bfloat16', ...; default the config's); sm_count: the
    GPU's SMs (the resident MoE kernel's grid; None: that kernel is reported unplanned).
    Raises ShardError when TP does not shard the model, ValueError for bad buckets."""
    b = tuple(buckets)
    if not b or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in b) \
            or list(b) != sorted(set(b)):
        raise ValueError(f"buckets {b!r}: expected strictly ascending positive ints, "
                         f"e.g. {BUCKETS}")
    dtype = dtype or cfg.dtype
    shapes = decode_gemv_shapes(cfg, tp, path)
    spec = path == "specialized"
    moe_block = (spec and options.moe_fused and cfg.moe is not None and moe_block_fused(cfg)
                 and dtype == "bfloat16")
    steps = []
    for M in b:
        gemvs = []
        for name, (N, K) in shapes.items():
            kernel, config, why = _linear.gemv_choice(M, N, K, options) if spec else \
                _stock_gemm(M, N, K, dtype)
            gemvs.append(GemvChoice(name, M, N, K, gemv_out_dtype(name, path), kernel, config,
                                    why))
        ffn = _ffn_out_item(cfg, M, shapes, moe_block, options) if spec else None
        fus = Fusions(moe_block=moe_block, ffn_out_prologue=ffn is not None,
                      mla=_mla_form(cfg, dcp, dtype, options) if spec else "none",
                      attnres_bank=spec and options.attnres_bank,
                      attnres_kernel="cute" if options.attnres_cute else "triton",
                      kda_splits=options.kda_splits, router_gather=options.router_gather,
                      mla_pre_tile=options.mla_pre_tile)
        steps.append(StepKernels(M, tuple(gemvs),
                                 _moe_choice(cfg, tp, M, path, moe_block, options, sm_count),
                                 fus, ffn))
    return DecodePlan(cfg.name, tp, dcp, dtype, path, sm_count, options, tuple(steps))


__all__ = ["BUCKETS", "DecodePlan", "Fusions", "GemvChoice", "MoEChoice", "ShardError",
           "StepKernels", "resolve_plan"]
