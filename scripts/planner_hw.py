"""Hardware catalog for the capacity planner: `scripts/data/hardware.yaml` plus user YAML files.

The YAML is a user-facing edge: each entry is validated by `GPUEntry` (pydantic, unknown keys
rejected) and turned into a frozen `GPU`. Later files add GPUs or replace earlier ones by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class PlanError(ValueError):
    """Planner input that cannot be planned; the message says what to change."""


class GPUEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    description: str = Field("", description="free text: product and form factor")
    hbm_gb: float = Field(gt=0, description="HBM per GPU in vendor GB, read as 1e9 bytes")
    hbm_tb_s: float = Field(gt=0, description="peak HBM bandwidth per GPU, TB/s (1e12 B/s)")
    nvlink_gb_s: float = Field(gt=0, description="NVLink bandwidth per GPU per direction, GB/s")
    nvlink_domain: int = Field(gt=0, description="GPUs in one NVLink domain (one rack for NVL72)")
    bf16_tflops: float = Field(gt=0, description="dense BF16 tensor-core TFLOP/s")
    fp4_tflops: float | None = Field(None, gt=0, description="dense FP4 tensor-core TFLOP/s; "
                                     "null if the GPU has none (MXFP4 runs at the BF16 rate)")
    price_usd_per_gpu_hour: float | None = Field(None, gt=0, description="optional $/GPU-hour")
    estimated: list[str] = Field(default_factory=list, description="fields that are estimates")
    sources: str = Field("", description="where the numbers come from")


class CatalogFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gpus: dict[str, GPUEntry] = Field(description="GPU kind name -> its figures")


@dataclass(frozen=True)
class GPU:
    name: str
    hbm_bytes: float
    hbm_bw: float            # B/s
    nvlink_bw: float         # B/s per direction
    nvlink_domain: int
    bf16_flops: float        # FLOP/s dense
    fp4_flops: float | None
    price_usd_per_gpu_hour: float | None
    estimated: tuple[str, ...] = ()
    description: str = ""
    sources: str = ""

    def peak_flops(self, fmt: str) -> float:
        """Tensor-core rate for a GEMM whose weights are stored as `fmt`."""
        if fmt == "mxfp4" and self.fp4_flops:
            return self.fp4_flops
        return self.bf16_flops

    def to_dict(self) -> dict:
        return {"name": self.name, "description": self.description,
                "hbm_gb": self.hbm_bytes / 1e9, "hbm_tb_s": self.hbm_bw / 1e12,
                "nvlink_gb_s": self.nvlink_bw / 1e9, "nvlink_domain": self.nvlink_domain,
                "bf16_tflops": self.bf16_flops / 1e12,
                "fp4_tflops": None if self.fp4_flops is None else self.fp4_flops / 1e12,
                "price_usd_per_gpu_hour": self.price_usd_per_gpu_hour,
                "estimated": list(self.estimated)}


def _parse(text: str, where: str) -> dict[str, GPU]:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise PlanError(f"{where}: not valid YAML ({e})") from None
    try:
        cat = CatalogFile.model_validate(raw)
    except ValidationError as e:
        raise PlanError(f"{where}: invalid hardware catalog; expected `gpus: {{NAME: {{hbm_gb, "
                        f"hbm_tb_s, nvlink_gb_s, nvlink_domain, bf16_tflops, ...}}}}`:\n{e}") \
            from None
    return {name: GPU(name=name, hbm_bytes=g.hbm_gb * 1e9, hbm_bw=g.hbm_tb_s * 1e12,
                      nvlink_bw=g.nvlink_gb_s * 1e9, nvlink_domain=g.nvlink_domain,
                      bf16_flops=g.bf16_tflops * 1e12,
                      fp4_flops=None if g.fp4_tflops is None else g.fp4_tflops * 1e12,
                      price_usd_per_gpu_hour=g.price_usd_per_gpu_hour,
                      estimated=tuple(g.estimated), description=g.description,
                      sources=g.sources)
            for name, g in cat.gpus.items()}


def load_catalog(extra: list[str | Path] | tuple = ()) -> dict[str, GPU]:
    """The shipped catalog, then each extra YAML file in order (same name replaces)."""
    text = resources.files("raydecode.scripts").joinpath("data/hardware.yaml").read_text()
    cat = _parse(text, "scripts/data/hardware.yaml")
    for p in extra:
        p = Path(p)
        if not p.is_file():
            raise PlanError(f"--hardware {p}: no such file")
        cat.update(_parse(p.read_text(), str(p)))
    return cat


def find_gpu(catalog: dict[str, GPU], name: str) -> GPU:
    """Case-insensitive lookup; an unknown name lists the known ones."""
    for k, g in catalog.items():
        if k.lower() == name.lower():
            return g
    raise PlanError(f"unknown GPU {name!r}; known: {', '.join(sorted(catalog))} (add one with "
                    "--hardware FILE.yaml, same fields as scripts/data/hardware.yaml)")
