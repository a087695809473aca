"""Request state and sampling parameters (validated at construction: they come from users)."""
from __future__ import annotations

import enum
import itertools
import random
from dataclasses import dataclass, field


class RequestError(ValueError):
    """A request that cannot be served as asked; the message names the value and the range."""


MIN_TEMPERATURE = 0.01
MIN_TOP_P = 1e-6
MAX_LOGPROBS = 20
MAX_TOP_K = 2**31 - 1


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0        # 0 → greedy
    top_p: float = 1.0
    top_k: int = 0                  # 0 → off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None     # None: none; n: the chosen token's logprob + the top n
    # output text keeps K3's structural tokens as marker characters (engine/k3_chat.py MARKS)
    # for the chat endpoint's channel parser, instead of dropping them with the other specials
    channel_markers: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 1:
            raise RequestError(f"max_tokens = {self.max_tokens!r}; expected an integer >= 1")
        t = float(self.temperature)
        if not (t == 0.0 or MIN_TEMPERATURE <= t <= 100.0):
            # a tiny T overflows logits / T in fp32 (inf - inf = nan in the sampler)
            raise RequestError(f"temperature = {self.temperature!r}; expected 0 (greedy) or "
                               f"{MIN_TEMPERATURE} <= temperature <= 100")
        if not MIN_TOP_P <= float(self.top_p) <= 1.0:
            # below fp32's resolution of a cumulative probability the top-p cut is meaningless
            # (2.2e-313 reads as 0.0 in fp32 and dropped every token)
            raise RequestError(f"top_p = {self.top_p!r}; expected {MIN_TOP_P} <= top_p <= 1")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) \
                or not 0 <= self.top_k <= MAX_TOP_K:
            # int32 on the wire and on the device; any k past the vocabulary keeps every token
            raise RequestError(f"top_k = {self.top_k!r}; expected an integer in [0, {MAX_TOP_K}]"
                               " (0 = off)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -2**63 <= self.seed < 2**64):
            # torch.Generator.manual_seed raises past 64 bits, inside the step of every request
            raise RequestError(f"seed = {self.seed!r}; expected an integer in [-2**63, 2**64)")
        if self.logprobs is not None and (isinstance(self.logprobs, bool)
                                          or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise RequestError(f"logprobs = {self.logprobs!r}; expected an integer in "
                               f"[0, {MAX_LOGPROBS}] (the number of top alternatives) or null")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError(f"stop = {self.stop!r}; expected non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Status(enum.Enum):
    WAITING = "waiting"        # queued, no cache yet (or preempted and queued again)
    RUNNING = "running"        # owns a slot and cache blocks
    FINISHED = "finished"


_ids = itertools.count()
_seeds = random.SystemRandom()
_M64 = 2**64 - 1
_GOLDEN64 = 0x9E3779B97F4A7C15


def sample_seed(seed: int, index: int) -> int:
    """The sampler seed of sample `index` of a request whose seed is `seed` (n > 1): sample 0
    keeps the request's seed (its tokens equal the n = 1 answer's), sample i > 0 takes
    splitmix64(seed + i·0x9E3779B97F4A7C15 mod 2⁶⁴): a bijection of distinct inputs, so the
    n samples of one request have distinct 64-bit seeds, whose noise streams the sampler's hash
    makes independent (engine/sampling.py)."""
    if index == 0:
        return seed
    z = (int(seed) + index * _GOLDEN64) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


@dataclass(eq=False)       # identity: `req in running` must not compare (shared) prompts
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None      # "stop" | "length" | "abort"
    slot: int | None = None
    num_cached: int = 0                   # tokens whose KV/state is in the cache
    output_text: str = ""                 # detokenized output, stop strings cut off
    num_preemptions: int = 0
    # the sampler's seed: params.seed, else drawn once here, so a request's noise never depends
    # on its batch (engine/sampling.py); kept across preemption and resubmission
    sample_seed: int = field(default_factory=lambda: _seeds.getrandbits(63))
    # n > 1: sample `sample_index` of its request; samples 1.. wait in their parent's `forks`
    # until its prompt is cached, then share its prefill (engine/scheduler.py)
    sample_index: int = 0
    fork_of: "Request | None" = field(default=None, repr=False)
    forks: list["Request"] = field(default_factory=list, repr=False)
    # prompt tokens served from the prefix cache at the first admission (usage.cached_tokens)
    cached_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.sample_seed = self.params.seed

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids_slice(self, start: int, stop: int) -> list[int]:
        """all_ids[start:stop] without building all_ids (a decode step reads one token of a
        32k-token prompt + output: no copy of the rest). 0 <= start <= stop."""
        P = len(self.prompt_ids)
        if stop <= P:
            return self.prompt_ids[start:stop]
        if start >= P:
            return self.output_ids[start - P:stop - P]
        return self.prompt_ids[start:] + self.output_ids[:stop - P]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        """True while some known token is not yet in the cache besides the newest one."""
        return self.num_cached < self.num_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
