"""The envelope of DESIGN §3: whether one step may run on the specialized path.

A step runs specialized only when all hold:
- every sequence is in decode (no prefill chunk in the batch);
- non-speculative: batch ≤ max_batch (64); speculative: k ∈ [3, 7] and batch·(k+1) ≤ 64;
- TP ∈ {8, 16} inside one verified NVLink domain — or the development profile, which also allows
  TP ∈ {1, 2, 4} and skips the domain check (and must say so in every report);
- the executor reports the kernels for this shape compiled and the batch bucket's graph captured.

`decide` is pure: the coordinator calls it once per step and writes the result into the plan, so
every rank runs the same path (never a per-rank vote).
"""
from __future__ import annotations

from dataclasses import dataclass

from raydecode.engine.spec_engine import MAX_VERIFY_TOKENS, SPEC_K_RANGE as SPEC_K

PRODUCTION_TP = (8, 16)
DEVELOPMENT_TP = (1, 2, 4, 8, 16)
MAX_TOKENS_PER_STEP = MAX_VERIFY_TOKENS    # batch·(k+1) bound of the specialized verify step

DEVELOPMENT_NOTE = ("development profile: the specialized path is allowed at TP 1/2/4 and "
                    "without a verified NVLink domain; its numbers are not production numbers")

# reasons a step falls back to stock (each counted in the metrics)
DISABLED = "envelope_disabled"
PREFILL = "prefill_in_batch"
BATCH = "batch_too_large"
SPEC_K_RANGE = "spec_k_out_of_range"
SPEC_BATCH = "spec_tokens_too_many"
TP_SIZE = "tp_size_not_supported"
DOMAIN = "domain_not_verified"
KERNELS = "kernels_not_ready"
REASONS = (DISABLED, PREFILL, BATCH, SPEC_K_RANGE, SPEC_BATCH, TP_SIZE, DOMAIN, KERNELS)


@dataclass(frozen=True)
class EnvelopePolicy:
    enabled: bool = True
    max_batch: int = 64
    profile: str = "production"          # "production" | "development"

    def __post_init__(self) -> None:
        if self.profile not in ("production", "development"):
            raise ValueError(f"profile = {self.profile!r}; accepted: production, development")
        if not 1 <= self.max_batch <= MAX_TOKENS_PER_STEP:
            raise ValueError(f"max_batch = {self.max_batch}; accepted: 1..{MAX_TOKENS_PER_STEP}")

    @property
    def note(self) -> str | None:
        return DEVELOPMENT_NOTE if self.profile == "development" else None


@dataclass(frozen=True)
class StepShape:
    """What the decision depends on, for one step."""
    num_seqs: int
    decode_only: bool
    tp_size: int
    domain_verified: bool
    kernels_ready: bool
    spec_k: int | None = None            # drafts per sequence when verifying; None: plain decode


@dataclass(frozen=True)
class Decision:
    path: str                            # "specialized" | "stock"
    reasons: tuple[str, ...]             # why not specialized (empty when specialized)


def decide(shape: StepShape, policy: EnvelopePolicy) -> Decision:
    if not policy.enabled:
        return Decision("stock", (DISABLED,))
    why: list[str] = []
    if not shape.decode_only:
        why.append(PREFILL)
    if shape.spec_k is None:
        if shape.num_seqs > policy.max_batch:
            why.append(BATCH)
    else:
        if not SPEC_K[0] <= shape.spec_k <= SPEC_K[1]:
            why.append(SPEC_K_RANGE)
        if shape.num_seqs * (shape.spec_k + 1) > MAX_TOKENS_PER_STEP:
            why.append(SPEC_BATCH)
    if policy.profile == "development":
        if shape.tp_size not in DEVELOPMENT_TP:
            why.append(TP_SIZE)
    else:
        if shape.tp_size not in PRODUCTION_TP:
            why.append(TP_SIZE)
        if not shape.domain_verified:
            why.append(DOMAIN)
    if not shape.kernels_ready:
        why.append(KERNELS)
    return Decision("stock" if why else "specialized", tuple(why))
