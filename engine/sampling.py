"""Token sampling from full-vocabulary logits: greedy, temperature, top-k, top-p, per-request seed.

Each request with a seed owns a torch.Generator so its samples do not depend on what else is in
the batch. Nothing here synchronizes with a device except where the name says so.
"""
from __future__ import annotations

import torch

from .request import SamplingParams


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """(V,) logits → (V,) logits with temperature, top-k and top-p applied (-inf outside)."""
    x = logits.float() / max(p.temperature, 1e-6)
    if p.top_k and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = probs.cumsum(-1) - probs >= p.top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(0, idx, sorted_x)
    return x


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        g = self._generators.get(request_id)
        if g is None:
            g = self._generators[request_id] = torch.Generator().manual_seed(seed)
        return g

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def probs(self, logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        """(V,) sampling distribution (one-hot for greedy)."""
        if p.greedy:
            out = torch.zeros_like(logits, dtype=torch.float32)
            out[int(torch.argmax(logits))] = 1.0
            return out
        return torch.softmax(filter_logits(logits, p), dim=-1)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               request_ids: list[str]) -> list[int]:
        """(B, V) logits on the host → one token per row (the host-sync point of a step)."""
        logits = logits.float().cpu()
        out = []
        for row, p, rid in zip(logits, params, request_ids):
            if p.greedy:
                out.append(int(torch.argmax(row)))
                continue
            probs = torch.softmax(filter_logits(row, p), dim=-1)
            out.append(int(torch.multinomial(probs, 1, generator=self.generator(rid, p.seed))))
        return out
