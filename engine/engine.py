"""The stock engine loop, independent of Ray: schedule → execute → sample → finish checks.

`LLMEngine` takes its executor by injection: `LocalExecutor` runs the model in this process (the
CLI's `generate`, tests); the coordinator actor (actors/) drives the same scheduler with an
executor that fans a StepPlan out to TP rank workers.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol, Sequence

from .pacer import STRETCH, check_stretch
from .request import Request, RequestError, SamplingParams, Status, sample_seed
from .runner import ModelRunner
from .sampling import NO_LOGPROBS, SamplingRows, StepResult
from .scheduler import Scheduler, SchedulerConfig, StepPlan


class Executor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult: ...     # a token id per sample row


class LocalExecutor:
    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def execute(self, plan: StepPlan) -> StepResult:
        return self.runner.execute(plan)


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 16
    max_model_len: int = 4096
    max_num_batched_tokens: int = 256
    block_size: int = 16
    num_blocks: int | None = None          # None: enough for max_num_seqs × max_model_len
    dcp_size: int = 1
    enable_prefix_caching: bool = False    # restore cached prefixes (engine/prefix_cache.py)
    num_snapshots: int = 0                 # KDA snapshot slots per rank (prefix caching)
    fork: bool = True                      # n > 1 samples share one prefill
    split_mixed: bool = False              # decode tokens never ride a prefill step (scheduler)
    prefill_tokens_while_decoding: int | None = None   # prompt tokens per step beside decodes
    decode_slowdown_limit: float | None = None   # those sized to this TPOT bound (engine/pacer.py)
    prompt_stretch_limit: float = STRETCH   # ... but a prompt keeps ≥ 1/this of its rate

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "block_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} = {v!r}; expected a positive integer")
        cap = self.prefill_tokens_while_decoding
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"prefill_tokens_while_decoding = {cap!r}; expected a positive "
                             "integer or None (the whole step budget)")
        lim = self.decode_slowdown_limit
        if lim is not None and (isinstance(lim, bool) or not isinstance(lim, (int, float))
                                or not lim > 1.0):
            raise ValueError(f"decode_slowdown_limit = {lim!r}; expected a number > 1 (the "
                             "streams' TPOT beside a prompt over their TPOT without it) or "
                             "None (off)")
        check_stretch(self.prompt_stretch_limit)
        if isinstance(self.num_snapshots, bool) or not isinstance(self.num_snapshots, int) \
                or self.num_snapshots < 0:
            raise ValueError(f"num_snapshots = {self.num_snapshots!r}; expected an integer >= 0")
        if self.enable_prefix_caching and self.num_snapshots < 1:
            raise ValueError("enable_prefix_caching needs num_snapshots >= 1 (a cached prefix "
                             "is only usable where a KDA state snapshot exists)")

    @property
    def blocks(self) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        per_seq = -(-(-(-self.max_model_len // self.dcp_size)) // self.block_size)
        return self.max_num_seqs * per_seq

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(max_num_seqs=self.max_num_seqs,
                               max_num_batched_tokens=self.max_num_batched_tokens,
                               num_blocks=self.blocks, block_size=self.block_size,
                               dcp_size=self.dcp_size,
                               prefix_caching=self.enable_prefix_caching,
                               num_snapshots=self.num_snapshots, fork=self.fork,
                               split_mixed=self.split_mixed,
                               prefill_tokens_while_decoding=self.prefill_tokens_while_decoding,
                               decode_slowdown_limit=self.decode_slowdown_limit,
                               prompt_stretch_limit=self.prompt_stretch_limit)


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: str | None
    # per new token, when the request asked for logprobs: (logprob, [(id, logprob) × top n])
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    error: str | None = None            # this request failed alone (its sampling raised)
    index: int = 0                      # n > 1: which sample of its request (choice index)
    cached_tokens: int = 0              # prompt tokens served from the prefix cache


class LLMEngine:
    def __init__(self, executor: Executor, tokenizer, cfg: EngineConfig, eos_ids: tuple[int, ...]):
        self.executor, self.tokenizer, self.cfg = executor, tokenizer, cfg
        self.eos_ids = set(eos_ids)
        self.scheduler = Scheduler(cfg.scheduler_config())
        self.requests: dict[str, Request] = {}
        self._emitted: dict[str, int] = {}          # chars of output_text already returned
        self._detok: dict[str, object] = {}         # request id -> its IncrementalDecoder
        self.stats = {"steps": 0, "tokens": 0, "prefill_tokens": 0}

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None, forks: Sequence[str] = ()) -> Request:
        """Queue a request; `forks`: the request ids of samples 1..n-1 of it (n > 1), which
        share its prefill and sample with their own seeds (request.sample_seed)."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RequestError("prompt is empty; expected at least one token")
        if len(ids) + 1 > self.cfg.max_model_len:
            raise RequestError(f"prompt has {len(ids)} tokens; max_model_len is "
                               f"{self.cfg.max_model_len} (prompt + at least one new token)")
        kw = {"request_id": request_id} if request_id else {}
        req = Request(prompt_ids=ids, params=params, **kw)
        names = [req.request_id, *forks]
        taken = [i for i in names if i in self.requests]
        if taken or len(set(names)) != len(names):
            raise RequestError(f"request_id {(taken or names)[0]!r} is already in use")
        for i, rid in enumerate(forks, start=1):
            req.forks.append(Request(prompt_ids=list(ids), params=params, request_id=rid,
                                     sample_seed=sample_seed(req.sample_seed, i),
                                     sample_index=i, fork_of=req))
        for r in (req, *req.forks):
            if r.params.seed is not None:
                r.sample_seed = sample_seed(r.params.seed, r.sample_index)
            self.requests[r.request_id] = r
            self._emitted[r.request_id] = 0
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            req.finish_reason = "abort"
            self.finish_request(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def cache_stats(self) -> dict:
        """Prefill work and what the prefix cache and n > 1 forks saved of it: prefill tokens
        run, forks, and with prefix caching the cache's counters (prefix_cache.PrefixStats)
        plus the snapshots held."""
        sch = self.scheduler
        out = {"prefill_tokens": self.stats["prefill_tokens"], "forks": sch.num_forks,
               "prefix_caching": sch.prefix is not None}
        if sch.prefix is not None:
            out |= sch.prefix.stats.as_dict() | {"snapshots": sch.prefix.num_cached,
                                                 "snapshot_slots": sch.prefix.num_snapshots}
        return out

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        plan = self.scheduler.schedule()                               # prepare
        if plan is None:
            return []
        reqs = self.scheduler.requests_of(plan)
        emits = [r.num_cached + s.length == r.num_tokens for r, s in zip(reqs, plan.batch.seqs)]
        forked = self.scheduler.forks_of(plan)          # rows past the seqs: they emit
        rows, emits = reqs + forked, emits + [True] * len(forked)
        plan.sampling = sampling_rows(rows, emits)
        result = self._execute(plan, plan.step_id)                     # run (device sampling)
        for r, s in zip(reqs, plan.batch.seqs):                        # post-process
            r.num_cached += s.length
        self.stats["steps"] += 1
        self.stats["prefill_tokens"] += sum(s.length for s in plan.batch.seqs if s.length > 1)
        outputs = [self.take_row(r, result, i) for i, (r, e) in enumerate(zip(rows, emits)) if e]
        self.stats["tokens"] += len(outputs)
        return outputs

    def _execute(self, plan, step_id: int):
        """The executor's run of `plan`, its wall time reported to the scheduler (the pacer's
        sample of step `step_id`, the scheduler's plan)."""
        t0 = time.perf_counter()
        result = self.executor.execute(plan)
        self.scheduler.observe(step_id, time.perf_counter() - t0)
        return result

    def take_row(self, req: Request, result: StepResult, i: int) -> StepOutput:
        """Sample row i of `result` for `req`: its token appended, or the request failed alone
        when its row could not be sampled."""
        why = result.failed[i] if result.failed else None
        if why is not None:
            req.finish_reason = "error"
            self.finish_request(req)
            return StepOutput(req.request_id, [], "", True, "error", error=why,
                              index=req.sample_index)
        out = self.append_token(req, result.token_ids[i])
        if req.params.logprobs is not None and result.logprob is not None and out.new_token_ids:
            tops = list(zip(result.top_ids[i], result.top_logprobs[i])) if result.top_ids else []
            out.logprobs = [(result.logprob[i], tops[:req.params.logprobs])]
        return out

    def append_token(self, req: Request, tok: int) -> StepOutput:
        """Add one sampled token to a request: stop token/string, max_tokens and context
        checks, detokenization; returns the delta a client has not seen yet."""
        p = req.params
        stop_tok = (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids
        if not stop_tok:
            req.output_ids.append(tok)
        text = self._detokenize(req)
        reason = None
        for s in p.stop:
            cut = text.find(s)
            if cut >= 0:
                text, reason = text[:cut], "stop"
        if stop_tok:
            reason = "stop"
        elif reason is None and (len(req.output_ids) >= p.max_tokens
                                 or req.num_tokens >= self.cfg.max_model_len):
            reason = "length"
        req.output_text = text
        if reason is not None:
            req.finish_reason = reason
            self.finish_request(req)
        return self.delta(req, [] if stop_tok else [tok])

    def _detokenize(self, req: Request) -> str:
        """The request's output text: incrementally where the tokenizer can (each token
        decodes only its own bytes: a long output does not make every step slower), else a
        full decode."""
        markers = req.params.channel_markers
        make = getattr(self.tokenizer, "incremental", None)
        if make is None:
            return self.tokenizer.decode(req.output_ids, skip_special=True, markers=markers)
        ids, dec = req.output_ids, self._detok.get(req.request_id)
        if dec is None or dec.n > len(ids):
            dec = self._detok[req.request_id] = make(skip_special=True, markers=markers)
        return dec.feed(ids[dec.n:])

    def delta(self, req: Request, new_ids: list[int]) -> StepOutput:
        """The request's text not yet returned (holding back a possible stop-string prefix or
        an incomplete UTF-8 sequence until it finishes), marked as returned."""
        text, done = req.output_text, req.finished
        end = len(text)
        if not done:
            # hold back what may still become a stop string or an incomplete UTF-8 sequence
            hold = max((len(s) - 1 for s in req.params.stop), default=0)
            end = max(self._emitted[req.request_id], len(text) - hold)
            while end > self._emitted[req.request_id] and text[end - 1] == "\ufffd":
                end -= 1
        delta = text[self._emitted[req.request_id]:end]
        self._emitted[req.request_id] = end
        return StepOutput(req.request_id, new_ids, delta, done, req.finish_reason,
                          index=req.sample_index, cached_tokens=req.cached_prompt_tokens or 0)

    def finish_request(self, req: Request) -> None:
        self.scheduler.finish(req)

    def resume_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       output_ids: list[int], emitted_chars: int) -> Request:
        """Track a request generated elsewhere (e.g. continued on the stock pool) so its next
        tokens go through the same `append_token` rules; it never enters the scheduler."""
        req = Request(prompt_ids=list(prompt_ids), params=params, request_id=request_id,
                      output_ids=list(output_ids), status=Status.RUNNING)
        self.requests[request_id] = req
        self._emitted[request_id] = emitted_chars
        self._detok.pop(request_id, None)
        return req

    def pop_finished(self, request_id: str) -> Request:
        self._emitted.pop(request_id, None)
        self._detok.pop(request_id, None)
        return self.requests.pop(request_id)

    # ---- convenience --------------------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]], params: SamplingParams) -> list[Request]:
        reqs = [self.add_request(p, params) for p in prompts]
        while self.has_unfinished():
            self.step()
        return reqs


def sampling_rows(reqs: list[Request], emits: list[bool]) -> SamplingRows:
    """The plan's per-sample-row sampling: each emitting row draws token len(output_ids) of its
    request with the request's seed; rows that emit nothing (a prompt chunk ending mid-prompt)
    are greedy and unread."""
    return SamplingRows.build(
        [r.params if e else None for r, e in zip(reqs, emits)],
        [r.sample_seed for r in reqs], [len(r.output_ids) for r in reqs],
        [(NO_LOGPROBS if r.params.logprobs is None else r.params.logprobs) if e else NO_LOGPROBS
         for r, e in zip(reqs, emits)])
