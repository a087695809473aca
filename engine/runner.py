"""Runs one StepPlan on one model shard: the body of a rank's step and of the in-process engine.
prepare (block tables, state resets, inputs) → run (model) → post-process (logits of the rows
that sample) → on the sampling rank, sample on the device and bring only token ids (and asked-for
logprobs) to the host."""
from __future__ import annotations

import torch

from raydecode.models.cache import ModelCaches

from .sampling import SamplingRows, StepResult, sample_isolated
from .scheduler import StepPlan


class ModelRunner:
    def __init__(self, model: torch.nn.Module, caches: ModelCaches, device: str | torch.device = "cpu"):
        self.model, self.caches, self.device = model, caches, torch.device(device)

    def update_caches(self, plan: StepPlan) -> None:
        """The plan's changed block tables and KDA slot resets (host tables, device zeroing)."""
        if self.caches.mla is not None:
            self.caches.mla.block_tables.update(plan.block_tables)
        if self.caches.kda is not None:
            for slot in plan.reset_slots:
                self.caches.kda.reset(slot)

    def prepare(self, plan: StepPlan) -> torch.Tensor:
        self.update_caches(plan)
        return torch.tensor(plan.tokens, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def logits(self, plan: StepPlan) -> torch.Tensor:
        """(len(plan.sample_rows), V) fp32 logits on this runner's device. May be a view of a
        buffer the next step rewrites (graphed runners): read it before the next step."""
        tokens = self.prepare(plan)
        hidden = self.model(tokens, plan.batch, self.caches, path=plan.path)   # (T, H)
        rows = torch.tensor(plan.sample_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, rows)).float()

    def run(self, plan: StepPlan) -> torch.Tensor:
        """(len(plan.sample_rows), V) fp32 logits, a tensor of the caller's."""
        return self.logits(plan)

    @torch.inference_mode()
    def execute(self, plan: StepPlan, sample: bool = True) -> StepResult | None:
        """Run the step; sample=True (the sampling rank): its StepResult — the one host sync
        of the step; False (the other ranks): None, nothing leaves the device."""
        logits = self.logits(plan)
        if not sample:
            return None
        rows = plan.sampling or SamplingRows.greedy(len(plan.sample_rows))
        return sample_isolated(logits, rows)

    def release(self, slots: list[int]) -> None:
        if self.caches.mla is not None:
            for s in slots:
                self.caches.mla.block_tables.pop(s, None)
