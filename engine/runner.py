"""Runs one StepPlan on one model shard: the body of a rank's step and of the in-process engine.
prepare (block tables, state resets, inputs) → run (model) → post-process (logits of the rows
that sample) → on the sampling rank, sample on the device and bring only token ids (and asked-for
logprobs) to the host."""
from __future__ import annotations

import gc

import numpy as np
import torch

from raydecode.models.cache import ModelCaches, host_to_device

from .sampling import SamplingRows, StepResult, sample_isolated
from .scheduler import StepPlan


class ModelRunner:
    # the model returns only the sample rows' hidden state (its final AttnRes mix and norm
    # run on those rows alone); False: every row's, then the sample rows (the form before,
    # kept as the prefill bench's same-run baseline: scripts/bench/prefill.py --final-mix)
    final_rows: bool = True

    def __init__(self, model: torch.nn.Module, caches: ModelCaches, device: str | torch.device = "cpu"):
        self.model, self.caches, self.device = model, caches, torch.device(device)

    def update_caches(self, plan: StepPlan) -> None:
        """Before the forward, the plan's cache ops in their order (engine/scheduler.py): KDA
        state copies (prefix-cache saves and restores, n > 1 forks), MLA block copies, then
        the changed block tables and the KDA slot resets. Host tables; on the device copies
        and zeroing in stream order, no host sync."""
        mla, kda = self.caches.mla, self.caches.kda
        if kda is not None:
            for src, dst in plan.state_copies:
                kda.copy(src, dst)
        if mla is not None:
            for src, dst in plan.block_copies:
                mla.copy_block(src, dst)
            mla.block_tables.update(plan.block_tables)
        if kda is not None:
            for slot in plan.reset_slots:
                kda.reset(slot)

    def prepare(self, plan: StepPlan) -> torch.Tensor:
        self.update_caches(plan)
        # through numpy: an 8,192-token chunk's ids in 0.14 ms against torch.tensor's 0.43
        # (CPU, bench/results/host-step-inputs-cpu-2026-12-07.json), host time before the
        # step's first kernel (the same int64 values)
        ids = torch.from_numpy(np.array(plan.tokens, dtype=np.int64).reshape(-1))
        return host_to_device(ids, self.device)

    @torch.inference_mode()
    def logits(self, plan: StepPlan) -> torch.Tensor:
        """(len(plan.sample_rows), V) fp32 logits on this runner's device. May be a view of a
        buffer the next step rewrites (graphed runners): read it before the next step."""
        tokens = self.prepare(plan)
        if not self.final_rows:
            hidden = self.model(tokens, plan.batch, self.caches, path=plan.path)   # (T, H)
            return self.sample_logits(hidden, plan)
        hidden = self.model(tokens, plan.batch, self.caches, path=plan.path,
                            rows=self._sample_rows(plan))                          # (R, H)
        return self.model.compute_logits(hidden).float()

    def _sample_rows(self, plan: StepPlan) -> torch.Tensor:
        return host_to_device(torch.tensor(plan.sample_rows, dtype=torch.long), self.device)

    def sample_logits(self, hidden: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """(len(plan.sample_rows), V) fp32 logits of the plan's sample rows of `hidden`."""
        rows = self._sample_rows(plan)
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


def freeze_host_heap() -> int:
    """After a rank's build (weights, caches, graphs, warm-up): collect once and move every
    object alive now into the GC's permanent generation (`gc.freeze`), so a later collection
    (which the step's many small allocations trigger every few steps) walks only what the
    steps allocate, not the model's thousands of modules, parameters and graph records
    (measured on an H200 rank, 8 K3 layers: 5.6 ms of GC over 100 first runs of prefill steps
    live, 1.6 ms frozen; bench/results/gc-prefill-h200-2026-12-03.json). -> objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
