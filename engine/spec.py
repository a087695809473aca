"""Speculative decoding verification: which drafted tokens a target step accepts.

For one sequence with k drafts d_1..d_k, the target scores k+1 positions in one step (the token
before the drafts and every draft), giving p_1..p_{k+1}; the drafter sampled d_i from q_i.

- Greedy: accept d_i while d_i == argmax p_i; the first mismatch emits argmax p_i; if all k match,
  the bonus argmax p_{k+1} follows. Output equals non-speculative greedy decoding exactly.
- Probabilistic (speculative sampling): accept d_i with probability min(1, p_i(d_i) / q_i(d_i));
  on the first rejection emit a sample of norm(max(0, p_i − q_i)) and stop; if all are accepted,
  emit a bonus sample of p_{k+1}. Every emitted token is distributed exactly as under p.
- Synthetic (benchmarks only, output meaningless): a fixed mean acceptance length L ∈ [1, k+1];
  each step accepts the earliest ⌊L−1⌋ or ⌈L−1⌉ drafts, mixed so the mean is L.

The acceptance length of a step counts the emitted tokens (accepted drafts + the correction or
bonus token), so it lies in [1, k+1].
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


def verify_greedy(drafts: list[int], target_logits: torch.Tensor) -> list[int]:
    """drafts (k,), target_logits (k+1, V) → emitted tokens (1..k+1)."""
    best = target_logits.argmax(-1).tolist()
    out = []
    for i, d in enumerate(drafts):
        out.append(best[i])
        if d != best[i]:
            return out
    out.append(best[len(drafts)])
    return out


def verify_rejection(drafts: list[int], draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     generator: torch.Generator | None = None) -> list[int]:
    """drafts (k,), draft_probs q (k, V), target_probs p (k+1, V) → emitted tokens (1..k+1)."""
    out = []
    u = torch.rand(len(drafts), generator=generator).tolist()
    for i, d in enumerate(drafts):
        p, q = float(target_probs[i, d]), float(draft_probs[i, d])
        if q > 0 and u[i] * q <= p:                      # accept with prob min(1, p/q)
            out.append(d)
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp_min(0)
        mass = float(residual.sum())
        dist = residual / mass if mass > 0 else target_probs[i]
        out.append(int(torch.multinomial(dist, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator)))
    return out


class SyntheticAcceptance:
    """Accept the earliest drafts so that the mean acceptance length is `length` (benchmarks)."""

    def __init__(self, length: float, num_drafts: int, seed: int = 0):
        if not 1.0 <= length <= num_drafts + 1:
            raise ValueError(f"synthetic acceptance length {length}; expected 1 <= L <= k+1 = "
                             f"{num_drafts + 1}")
        self.length, self.k = float(length), num_drafts
        self._g = torch.Generator().manual_seed(seed)

    def accepted_drafts(self) -> int:
        extra = self.length - 1.0
        lo = math.floor(extra)
        frac = extra - lo
        return lo + int(frac > 0 and float(torch.rand(1, generator=self._g)) < frac)

    def emit(self, drafts: list[int], target_logits: torch.Tensor) -> list[int]:
        """Accepted drafts (the earliest ones) + the target's token after them."""
        a = min(self.accepted_drafts(), len(drafts))
        return list(drafts[:a]) + [int(target_logits[a].argmax())]


@dataclass
class AcceptanceStats:
    """Acceptance lengths and per-position acceptance counts (for metrics)."""
    num_drafts: int
    steps: int = 0
    emitted: int = 0
    accepted_at: list[int] = field(default_factory=list)   # [i]: steps where draft i accepted

    def __post_init__(self) -> None:
        self.accepted_at = [0] * self.num_drafts

    def record(self, emitted: int) -> None:
        if not 1 <= emitted <= self.num_drafts + 1:
            raise ValueError(f"acceptance length {emitted} outside [1, {self.num_drafts + 1}]")
        self.steps += 1
        self.emitted += emitted
        for i in range(emitted - 1):
            self.accepted_at[i] += 1

    @property
    def mean_length(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    @property
    def position_rates(self) -> list[float]:
        return [a / self.steps if self.steps else 0.0 for a in self.accepted_at]
