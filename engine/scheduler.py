"""Continuous batching: which tokens of which sequences run in the next step.

Policy per step (a token budget bounds the step):
1. every running sequence in decode gets its one token (decode never starves behind prompts);
2. running sequences still in prefill get the next chunk of their prompt;
3. waiting requests are admitted (a slot + cache blocks) while budget and cache last; with
   prefix caching a request first restores the longest cached prefix of its tokens
   (engine/prefix_cache.py) and prefills only the rest.
When the cache cannot hold the tokens of a running sequence, cached prefixes are evicted (least
recently used first), then the most recently admitted other sequence is preempted: its cache is
freed and it re-queues at the front, to be recomputed from its prompt plus what it generated so
far (so nothing it produced is lost).

n > 1: samples 1..n-1 of a request wait in `forks` of sample 0 (their parent). In the step whose
chunk ends the parent's prompt each of them forks: a slot of its own, the parent's full blocks
shared, a copy of the partial block and of the KDA state (the next plan's copies), and a sample
row on the parent's last prompt row, drawn with its own seed. So the prompt is prefilled once.

Cache ops travel in the plan and run on every rank before the step's forward, reading what the
previous steps left: `state_copies` (KDA state, in order), `block_copies` (MLA blocks, in
order), then `reset_slots`. A copy of a state reached at the end of step k (a snapshot save, a
fork) is therefore shipped with plan k+1; the ops of one plan run in the order they were
decided, so a slot or block freed and reused meanwhile is read before it is overwritten.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from raydecode.models.cache import SeqSlice, StepBatch

from .cache import BlockAllocator, CacheFullError, SlotAllocator
from .pacer import STRETCH, ChunkPacer
from .prefix_cache import PrefixCache, Snapshot, snapshot_ref
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
    # before the forward, in order: KDA state copies (src, dst), a slot ≥ 0 or a snapshot
    # slot -1 - i (prefix_cache.snapshot_ref); then MLA block copies (src, dst); then resets
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # host only: the request of each sample row past the sequences' own (n > 1 forks drawing
    # their first token from their parent's last prompt row)
    forked_ids: list[str] = field(default_factory=list)

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
    prefix_caching: bool = False
    num_snapshots: int = 0                # KDA snapshot slots per rank (prefix caching)
    fork: bool = True                     # n > 1 shares the prefill (False: each prefills)
    # never mix decode tokens into a prefill step: while both wait, steps alternate between
    # prefill chunks (+ admissions) and decode tokens alone, so the decodes keep the fast
    # (graphed, specialized) path instead of riding the stock path with the prompt
    split_mixed: bool = False
    # prompt tokens per step while other sequences decode (None: the whole budget): a long
    # prompt's chunks then cost each decoding stream at most one such chunk step per token,
    # and the budget's big chunks serve prompts that arrive when nothing decodes
    prefill_tokens_while_decoding: int | None = None
    # the prompt tokens beside decodes sized to this bound on the streams' slowdown (their TPOT
    # beside a prompt over their TPOT without it) from the steps' measured times
    # (engine/pacer.py), at most prefill_tokens_while_decoding; None: that static cap alone
    decode_slowdown_limit: float | None = None
    # the pacer never slows a prompt's prefill below 1/this of its rate at the static cap
    prompt_stretch_limit: float = STRETCH


class Scheduler:
    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []          # admission order
        self.slots = SlotAllocator(cfg.max_num_seqs)
        self.blocks = BlockAllocator(cfg.num_blocks, cfg.block_size, cfg.dcp_size)
        self.prefix = PrefixCache(self.blocks, cfg.num_snapshots) if cfg.prefix_caching \
            else None
        self.step_id = 0
        self.num_preemptions = 0
        self.num_forks = 0
        # copies of states reached by the last step, shipped with the next plan
        self._next_state: list[tuple[int, int]] = []
        self._next_block: list[tuple[int, int]] = []
        self._next_made: list[Snapshot] = []
        self._behind: dict[str, list[Snapshot]] = {}   # request -> its superseded snapshots
        self._prefill_turn = True                 # split_mixed: the next mixed step's half
        self.num_split_steps = 0                  # steps that left one half for the next
        self.pacer = None if cfg.decode_slowdown_limit is None else \
            ChunkPacer(cfg.decode_slowdown_limit, mixed=not cfg.split_mixed,
                       stretch=cfg.prompt_stretch_limit)
        self._last_counts: tuple[int, int, int] | None = None   # step id, prompt, decodes

    def add(self, req: Request) -> None:
        self.waiting.append(req)
        if not self.cfg.fork:
            self._unfork(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
            if req.finish_reason != "error":
                self._save(req, req.num_cached)     # where its conversation may resume
            self._free(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req.fork_of is not None and req in req.fork_of.forks:
            req.fork_of.forks.remove(req)
        self._behind.pop(req.request_id, None)
        self._unfork(req)             # a parent that ends before forking: its samples go alone
        req.status = Status.FINISHED

    def _unfork(self, parent: Request) -> None:
        """Pending forks of `parent` become requests of their own (queued first)."""
        for child in reversed(parent.forks):
            child.fork_of = None
            if parent in self.waiting:
                self.waiting.insert(self.waiting.index(parent) + 1, child)
            else:
                self.waiting.appendleft(child)
        parent.forks = []

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

    def _reserve(self, n_blocks: int, keep: Snapshot | None = None) -> bool:
        """At least n_blocks free, evicting cached prefixes (never `keep`) if needed."""
        while self.blocks.num_free < n_blocks:
            if self.prefix is None or not self.prefix.evict_one(keep):
                return False
        return True

    def _grow(self, req: Request, n_tokens: int, changed: dict[int, list[int]]) -> bool:
        """Make room for n_tokens of req: evicting cached prefixes, then preempting later
        sequences if needed."""
        while True:
            self._reserve(self.blocks.extra_needed(req.slot, n_tokens))
            try:
                if self.blocks.ensure(req.slot, n_tokens):
                    changed[req.slot] = list(self.blocks.tables[req.slot])
                return True
            except CacheFullError:
                if not self._preempt(keep=req):
                    return False

    def _save(self, req: Request, h: int) -> None:
        """Snapshot req's state after its first h tokens (reached by the last step run)."""
        if self.prefix is None or req.slot is None:
            return
        table = self.blocks.tables.get(req.slot, [])
        snap = self.prefix.save(req.all_ids[:h], table)
        if snap is not None:
            for old in self._behind.get(req.request_id, ()):
                self.prefix.demote(old)                  # superseded by the longer one
            self._behind[req.request_id] = [snap]
            kda, blk = self.prefix.save_ops(snap, req.slot, table)
            self._next_state.append(kda)
            if blk is not None:
                self._next_block.append(blk)
            self._next_made.append(snap)

    def _admit(self, req: Request, budget: int, changed: dict[int, list[int]],
               reset: list[int], state: list, block: list) -> int:
        """Slot, cached prefix and blocks for the first waiting request; -> the tokens it
        runs this step, 0 if it does not fit now."""
        hit = self.prefix.lookup(req.all_ids, req.num_tokens - 1) if self.prefix else None
        h = hit.length if hit is not None else 0
        n = min(req.num_tokens - h, budget)
        if not self._reserve(self.blocks.blocks_for(h + n) - (len(hit.blocks) if hit else 0),
                             keep=hit):
            return 0
        req.slot = self.slots.allocate()
        if self.prefix is not None:
            self.prefix.record(hit)
        if hit is None:
            reset.append(req.slot)
        else:                                    # restore: its state, blocks, partial block
            self._behind[req.request_id] = [hit]
            table = self.blocks.share(req.slot, hit.blocks)
            state.append((snapshot_ref(hit.index), req.slot))
            if hit.tail_block is not None:
                table.append(self.blocks.allocate())
                block.append((hit.tail_block, table[-1]))
        self.blocks.ensure(req.slot, h + n)
        changed[req.slot] = list(self.blocks.tables[req.slot])
        req.num_cached = h
        if req.cached_prompt_tokens is None:
            req.cached_prompt_tokens = min(h, len(req.prompt_ids))
        req.status = Status.RUNNING
        self.running.append(req)
        return n

    def _fork(self, parent: Request, child: Request, changed: dict[int, list[int]]) -> bool:
        """child (a pending fork of parent, whose prompt the running step completes) takes a
        slot, the parent's full blocks and copies of its partial block and KDA state."""
        P, span = parent.num_tokens, self.blocks.span
        full, partial = P // span, P % span != 0
        if not self.slots.num_free or not self._reserve(int(partial)):
            return False
        child.slot = self.slots.allocate()
        ptable = self.blocks.tables[parent.slot]
        table = self.blocks.share(child.slot, ptable[:full])
        if partial:
            table.append(self.blocks.allocate())
            self._next_block.append((ptable[full], table[-1]))
        self._next_state.append((parent.slot, child.slot))
        changed[child.slot] = list(table)
        child.num_cached, child.status, child.fork_of = P, Status.RUNNING, None
        child.cached_prompt_tokens = parent.cached_prompt_tokens
        self.running.append(child)
        self.num_forks += 1
        return True

    def schedule(self) -> StepPlan | None:
        budget = self.cfg.max_num_batched_tokens
        chosen: list[tuple[Request, int]] = []      # (request, number of tokens this step)
        changed: dict[int, list[int]] = {}
        reset: list[int] = []
        state, block, made = self._next_state, self._next_block, self._next_made
        self._next_state, self._next_block, self._next_made = [], [], []
        for s in made:
            s.ready = True

        decode = [r for r in self.running if not r.in_prefill]
        prefill = [r for r in self.running if r.in_prefill]
        halves = [(decode, prefill, True)]                 # (decode, prefill, admit)
        if self.cfg.split_mixed and decode and (prefill or (self.waiting and
                                                            self.slots.num_free)):
            first, second = ([], prefill, True), (decode, [], False)
            if not self._prefill_turn:
                first, second = second, first
            halves = [first, second]         # the second only if the first runs nothing
        admitted = set()
        ran_prefill = False
        cap = self.cfg.prefill_tokens_while_decoding
        prompt_left = cap if decode and cap is not None else budget   # prompt tokens, this step
        if decode and self.pacer is not None:
            prompt_left = self.pacer.chunk_cap(min(prompt_left, budget), len(decode))
        for d, p, admit in halves:
            ran_prefill = not d
            for req in d + p:
                if budget <= 0 or req not in self.running:   # may have been preempted meanwhile
                    continue
                n = min(req.num_tokens - req.num_cached, budget)
                if req.in_prefill:
                    if prompt_left <= 0:
                        continue
                    n = min(n, prompt_left)
                if not self._grow(req, req.num_cached + n, changed):
                    continue
                chosen.append((req, n))
                budget -= n
                if req.in_prefill:
                    prompt_left -= n
            chosen = [(r, n) for r, n in chosen if r in self.running]
            while admit and self.waiting and min(budget, prompt_left) > 0 \
                    and self.slots.num_free:
                req = self.waiting[0]
                n = self._admit(req, min(budget, prompt_left), changed, reset, state, block)
                if not n:
                    break
                self.waiting.popleft()
                admitted.add(id(req))
                chosen.append((req, n))
                budget -= n
                prompt_left -= n
            if chosen:
                break
        if len(halves) == 2:                 # the half that waited goes first next time
            self._prefill_turn = not ran_prefill
            self.num_split_steps += 1

        if not chosen:             # nothing ran: the copies wait for the next plan
            for s in made:
                s.ready = False
            self._next_state, self._next_block, self._next_made = state, block, made
            return None
        seqs, tokens, rows, ids, forked = [], [], [], [], []
        for req, n in chosen:
            start = len(tokens)
            seqs.append(SeqSlice(slot=req.slot, start=start, length=n, pos=req.num_cached))
            tokens.extend(req.ids_slice(req.num_cached, req.num_cached + n))
            rows.append(start + n - 1)
            ids.append(req.request_id)
        span, budget = self.blocks.span, self.cfg.max_num_batched_tokens
        for (req, n), row in zip(chosen, list(rows)):
            end = req.num_cached + n
            if not (n > 1 or id(req) in admitted or req.num_cached < len(req.prompt_ids)):
                continue                         # a decode token
            if end < req.num_tokens:             # a chunk: the last aligned one before the
                if end % span == 0 and req.num_tokens - end <= budget:     # end (a repeated
                    self._save(req, end)         # prompt resumes there)
                continue
            self._save(req, end)                 # the prompt's end: after this step
            for child in list(req.forks) if not req.output_ids else ():
                if not self._fork(req, child, changed):
                    break
                req.forks.remove(child)
                rows.append(row)
                forked.append(child.request_id)
            self._unfork(req)                    # no room for the rest: they prefill alone
        self.step_id += 1
        if self.pacer is not None:               # what the step's time will be a sample of
            prompt = [n for r, n in chosen if id(r) in admitted or r.in_prefill]
            self._last_counts = (self.step_id, sum(prompt), len(chosen) - len(prompt))
        return StepPlan(step_id=self.step_id, batch=StepBatch(seqs), tokens=tokens,
                        sample_rows=rows, block_tables=changed, reset_slots=reset,
                        request_ids=ids, state_copies=state, block_copies=block,
                        forked_ids=forked)

    def observe(self, step_id: int, seconds: float) -> None:
        """The wall time of the step `schedule` planned last (the engine times its run): a
        sample for the pacer (`decode_slowdown_limit`); others are ignored."""
        if self.pacer is not None and self._last_counts and self._last_counts[0] == step_id:
            _, prompt, decodes = self._last_counts
            self.pacer.observe(prompt, decodes, seconds)

    def requests_of(self, plan: StepPlan) -> list[Request]:
        by_id = {r.request_id: r for r in self.running}
        return [by_id[i] for i in plan.request_ids]

    def forks_of(self, plan: StepPlan) -> list[Request]:
        """The requests of the plan's fork rows (sample rows past its sequences)."""
        by_id = {r.request_id: r for r in self.running}
        return [by_id[i] for i in plan.forked_ids]
