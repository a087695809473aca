"""The speculative decode loop (coordinator side): schedule → speculate → execute → accept.

`SpecEngine` is `LLMEngine` with DSpark: the scheduler's plan is turned into a `SpecStepPlan`
in which every sequence in decode (its newest token not yet cached, at position p) becomes a
verify slice of k+1 tokens at p (cache blocks for p … p+k reserved; a sequence without room
or too close to max_model_len decodes one token as usual). The executor runs the whole
draft → verify → accept → rollback on the ranks (engine/spec_runner.py) and returns, per
speculating sequence, the emitted tokens e (1 ≤ |e| ≤ k+1); here they are appended one by one
(stop conditions apply to each), num_cached grows by |e| (anchor + accepted drafts) and the
acceptance length is recorded. Prefill chunks and plain decodes in the same step are sampled
here as in LLMEngine.

Synthetic acceptance (`SpecConfig.synthetic_length`) is for benchmarks only: it accepts the
earliest drafts to a fixed mean length; the text it produces is meaningless and
`outputs_meaningless` says so.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from raydecode.models.cache import SeqSlice, StepBatch
from raydecode.models.config import ConfigError

from .cache import CacheFullError
from .engine import EngineConfig, LLMEngine, LocalExecutor, StepOutput, sampling_rows
from .request import Request
from .scheduler import StepPlan
from .spec import AcceptanceStats
from .spec_runner import SpecSeq, SpecStepPlan, SpecStepResult

SPEC_K_RANGE = (3, 7)               # drafts per step the specialized verify path supports
MAX_VERIFY_TOKENS = 64              # batch·(k+1) bound of the specialized verify step


def verify_in_envelope(num_seqs: int, k: int, max_tokens: int = MAX_VERIFY_TOKENS) -> bool:
    """DESIGN §3: a verification step may run specialized only with k ∈ [3, 7] and
    batch·(k+1) ≤ 64; otherwise the same step runs stock."""
    return SPEC_K_RANGE[0] <= k <= SPEC_K_RANGE[1] and num_seqs * (k + 1) <= max_tokens


@dataclass(frozen=True)
class SpecConfig:
    num_drafts: int                          # k: drafts proposed per sequence and step
    synthetic_length: float | None = None    # benchmarks only: fixed mean acceptance length L
    seed: int = 0                            # seeds of unseeded requests and synthetic mode

    def __post_init__(self) -> None:
        k = self.num_drafts
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"num_drafts = {k!r}; expected an integer >= 1")
        L = self.synthetic_length
        if L is not None and not 1.0 <= float(L) <= k + 1:
            raise ConfigError(f"synthetic acceptance length {L}; accepted: 1 <= L <= k+1 = "
                              f"{k + 1} (it counts the bonus token)")


class SpecEngine(LLMEngine):
    def __init__(self, executor, tokenizer, cfg: EngineConfig, eos_ids: tuple[int, ...],
                 spec: SpecConfig):
        if cfg.enable_prefix_caching:
            raise ValueError("prefix caching is not supported with speculative decoding yet "
                             "(a snapshot would need the drafter's context rows too)")
        # n > 1 samples prefill one by one: a verify plan's sample rows are its plain seqs'
        super().__init__(executor, tokenizer, dataclasses.replace(cfg, fork=False), eos_ids)
        self.spec = spec
        self.acceptance = AcceptanceStats(spec.num_drafts)
        self._rng = random.Random(spec.seed)
        self._seeds: dict[str, int] = {}
        self._released: list[str] = []
        self.last_acceptance: dict[str, int] = {}     # request id -> |emitted| of the last step

    @property
    def outputs_meaningless(self) -> bool:
        return self.spec.synthetic_length is not None

    def metrics(self) -> dict:
        """Acceptance metrics for export: mean length in [1, k+1] and per-position rates."""
        a = self.acceptance
        return {"num_drafts": a.num_drafts, "spec_steps": a.steps,
                "mean_acceptance_length": a.mean_length,
                "acceptance_rate_per_position": a.position_rates,
                "synthetic": self.outputs_meaningless}

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        plan = self.scheduler.schedule()                               # prepare
        if plan is None:
            return []
        splan = self._speculate(plan)
        result: SpecStepResult = self._execute(splan, plan.step_id)    # run
        reqs = self.scheduler.requests_of(plan)                        # post-process
        emitted = {s.request_id: e for s, e in zip(splan.spec, result.emitted)}
        plain = [(r, s) for r, s in zip(reqs, splan.batch.seqs) if r.request_id not in emitted]
        emits = [r.num_cached + s.length == r.num_tokens for r, s in plain]
        for r, s in plain:
            r.num_cached += s.length
        outputs = [self.take_row(r, result.plain, i)
                   for i, ((r, _), e) in enumerate(zip(plain, emits)) if e]
        n_plain = len(outputs)
        n_spec = 0
        self.last_acceptance = {rid: len(e) for rid, e in emitted.items()}
        for r in reqs:
            e = emitted.get(r.request_id)
            if e is not None:
                self.acceptance.record(len(e))
                r.num_cached += len(e)            # anchor + accepted drafts are cached now
                outputs.append(self._append_many(r, e))
                n_spec += len(outputs[-1].new_token_ids)
        self.stats["steps"] += 1
        self.stats["prefill_tokens"] += sum(s.length for _, s in plain if s.length > 1)
        self.stats["tokens"] += n_plain + n_spec
        return outputs

    def _speculate(self, plan: StepPlan) -> SpecStepPlan:
        """Decode sequences -> verify slices of k+1 tokens; everything else as scheduled."""
        k = self.spec.num_drafts
        seqs, tokens, rows, spec, plain = [], [], [], [], []
        tables = dict(plan.block_tables)
        for r, s in zip(self.scheduler.requests_of(plan), plan.batch.seqs):
            start = len(tokens)
            if s.length == 1 and s.pos == r.num_tokens - 1 and self._reserve(r, k, tables):
                seqs.append(SeqSlice(s.slot, start, k + 1, s.pos))
                tokens += [plan.tokens[s.start]] + [0] * k           # drafts: filled on ranks
                spec.append(SpecSeq(r.request_id, s.slot, start, s.pos, r.params, self._seed(r),
                                    len(r.output_ids)))
            else:
                seqs.append(SeqSlice(s.slot, start, s.length, s.pos))
                tokens += plan.tokens[s.start:s.end]
                rows.append(start + s.length - 1)
                plain.append((r, r.num_cached + s.length == r.num_tokens))
        released, self._released = self._released, []
        return SpecStepPlan(step_id=plan.step_id, batch=StepBatch(seqs), tokens=tokens,
                            sample_rows=rows, block_tables=tables, reset_slots=plan.reset_slots,
                            path=plan.path, request_ids=plan.request_ids,
                            state_copies=plan.state_copies, block_copies=plan.block_copies,
                            spec=spec,
                            num_drafts=k, synthetic_length=self.spec.synthetic_length,
                            synthetic_seed=self.spec.seed, release_ids=released,
                            sampling=sampling_rows([r for r, _ in plain], [e for _, e in plain]))

    def _reserve(self, r: Request, k: int, tables: dict[int, list[int]]) -> bool:
        """Cache blocks for positions num_cached … num_cached + k; False if there is no room."""
        if r.num_tokens + k > self.cfg.max_model_len:
            return False
        try:
            if self.scheduler.blocks.ensure(r.slot, r.num_cached + k + 1):
                tables[r.slot] = list(self.scheduler.blocks.tables[r.slot])
        except CacheFullError:
            return False
        return True

    def _seed(self, r: Request) -> int:
        if r.params.seed is not None:
            return r.sample_seed           # the seed, or sample i's of an n > 1 request
        return self._seeds.setdefault(r.request_id, self._rng.getrandbits(63))

    def _append_many(self, req: Request, toks: list[int]) -> StepOutput:
        ids, text, out = [], "", None
        for t in toks:
            out = self.append_token(req, t)
            ids += out.new_token_ids
            text += out.delta_text
            if req.finished:
                break
        return StepOutput(req.request_id, ids, text, out.finished, out.finish_reason,
                          index=out.index, cached_tokens=out.cached_tokens)

    def finish_request(self, req: Request) -> None:
        super().finish_request(req)
        self._seeds.pop(req.request_id, None)
        self._released.append(req.request_id)


def build_local_spec_engine(model: str, num_drafts: int, draft: str | None = None,
                            synthetic_length: float | None = None, dtype: str = "float32",
                            max_num_seqs: int = 8, max_model_len: int | None = None,
                            max_num_batched_tokens: int = 256, block_size: int = 16,
                            seed: int = 0) -> SpecEngine:
    """The single-process speculating engine (TP=1) for `raydecode generate --spec dspark`."""
    from raydecode.models.config import load_config
    from raydecode.models.dspark import check_num_drafts
    from raydecode.models.parallel import LocalComm, Parallel

    from .loader import load_tokenizer, resolve_checkpoint
    from .spec_runner import SpecShardSpec, load_spec_runner

    cfg = load_config(resolve_checkpoint(model))
    mml = max_model_len or min(cfg.max_position_embeddings, 4096)
    ecfg = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=mml,
                        max_num_batched_tokens=max_num_batched_tokens, block_size=block_size)
    runner = load_spec_runner(SpecShardSpec(model, draft, dtype, max_num_seqs, ecfg.blocks,
                                            block_size, seed), Parallel(), LocalComm())
    check_num_drafts(num_drafts, runner.drafter.cfg)
    tok = load_tokenizer(model)
    eos = tuple(sorted(set(tok.eos_ids) | {cfg.eos_token_id}))
    return SpecEngine(LocalExecutor(runner), tok, ecfg, eos,
                      SpecConfig(num_drafts, synthetic_length, seed))


__all__ = ["SpecEngine", "SpecConfig", "verify_in_envelope", "build_local_spec_engine",
           "SPEC_K_RANGE", "MAX_VERIFY_TOKENS"]
