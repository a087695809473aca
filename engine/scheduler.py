"""Continuous batching: which tokens of which sequences run in the next step.

Policy per step (a token budget bounds the step):
1. every running sequence in decode gets its one token (decode never starves behind prompts);
2. running sequences still in prefill get the next chunk of their prompt;
3. waiting requests are admitted (a slot + cache blocks) while budget and cache last.
When the cache cannot hold the tokens of a running sequence, the most recently admitted other
sequence is preempted: its cache is freed and it re-queues at the front, to be recomputed from its
prompt plus what it generated so far (so nothing it produced is lost).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from raydecode.models.cache import SeqSlice, StepBatch

from .cache import BlockAllocator, CacheFullError, SlotAllocator
from .request import Request, Status
from .sampling import SamplingRows


@dataclass
class StepPlan:
    """Everything a rank needs to run one step; identical on every rank (picklable)."""
    step_id: int
    batch: StepBatch
    tokens: list[int]                       # flat token ids, len == batch.num_tokens
    sample_rows: list[int]                  # flat rows whose logits are returned (seq ends)
    block_tables: dict[int, list[int]]      # full tables of slots that changed this step
    reset_slots: list[int]                  # slots newly assigned: zero their KDA state
    path: str = "stock"                     # "stock" | "specialized", decided per step
    request_ids: list[str] = field(default_factory=list)   # per seq, for logging
    # per sample row: how the sampling rank draws its token (engine.sampling); set by the
    # engine after scheduling; None: greedy for every row
    sampling: SamplingRows | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.batch.seqs)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256     # token budget of one step (prefill chunk bound)
    num_blocks: int = 1024
    block_size: int = 16
    dcp_size: int = 1


class Scheduler:
    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []          # admission order
        self.slots = SlotAllocator(cfg.max_num_seqs)
        self.blocks = BlockAllocator(cfg.num_blocks, cfg.block_size, cfg.dcp_size)
        self.step_id = 0
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
            self._free(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = Status.FINISHED

    def _free(self, req: Request) -> None:
        if req.slot is not None:
            self.blocks.release(req.slot)
            self.slots.release(req.slot)
        req.slot, req.num_cached = None, 0

    def _preempt(self, keep: Request) -> bool:
        victims = [r for r in self.running if r is not keep]
        if not victims:
            return False
        victim = victims[-1]
        self.running.remove(victim)
        self._free(victim)
        victim.status = Status.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        return True

    def _grow(self, req: Request, n_tokens: int, changed: dict[int, list[int]]) -> bool:
        """Make room for n_tokens of req, preempting later sequences if needed."""
        while True:
            try:
                if self.blocks.ensure(req.slot, n_tokens):
                    changed[req.slot] = list(self.blocks.tables[req.slot])
                return True
            except CacheFullError:
                if not self._preempt(keep=req):
                    return False

    def schedule(self) -> StepPlan | None:
        budget = self.cfg.max_num_batched_tokens
        chosen: list[tuple[Request, int]] = []      # (request, number of tokens this step)
        changed: dict[int, list[int]] = {}
        reset: list[int] = []

        decode = [r for r in self.running if not r.in_prefill]
        prefill = [r for r in self.running if r.in_prefill]
        for req in decode + prefill:
            if budget <= 0 or req not in self.running:   # may have been preempted meanwhile
                continue
            n = min(req.num_tokens - req.num_cached, budget)
            if not self._grow(req, req.num_cached + n, changed):
                continue
            chosen.append((req, n))
            budget -= n
        chosen = [(r, n) for r, n in chosen if r in self.running]

        while self.waiting and budget > 0 and self.slots.num_free:
            req = self.waiting[0]
            n = min(req.num_tokens, budget)
            if self.blocks.blocks_for(n) > self.blocks.num_free:
                break
            self.waiting.popleft()
            req.slot = self.slots.allocate()
            req.num_cached = 0
            req.status = Status.RUNNING
            self.blocks.ensure(req.slot, n)
            changed[req.slot] = list(self.blocks.tables[req.slot])
            reset.append(req.slot)
            self.running.append(req)
            chosen.append((req, n))
            budget -= n

        if not chosen:
            return None
        seqs, tokens, rows, ids = [], [], [], []
        for req, n in chosen:
            start = len(tokens)
            seqs.append(SeqSlice(slot=req.slot, start=start, length=n, pos=req.num_cached))
            tokens.extend(req.all_ids[req.num_cached:req.num_cached + n])
            rows.append(start + n - 1)
            ids.append(req.request_id)
        self.step_id += 1
        return StepPlan(step_id=self.step_id, batch=StepBatch(seqs), tokens=tokens,
                        sample_rows=rows, block_tables=changed, reset_slots=reset,
                        request_ids=ids)

    def requests_of(self, plan: StepPlan) -> list[Request]:
        by_id = {r.request_id: r for r in self.running}
        return [by_id[i] for i in plan.request_ids]
