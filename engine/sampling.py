"""Token sampling on the device that holds the logits: greedy, temperature, top-k, top-p,
seeded per request, logprobs on demand; only token ids (and asked-for logprobs) leave it.

Sampling is counter-based. Row r draws token n of its request as

    t = argmax_v ( x_v / T + g_v ),   g_v = −log(−log u_v),   u_v = hash(seed, n, v) ∈ (0, 1)

(Gumbel-max over the temperature-scaled, top-k/top-p-filtered logits x): a sample of
softmax(x / T) whose noise depends only on (seed, n, v). So a seeded request's tokens depend on
its own logits alone — not on the batch, the device, a preemption or a replica rebuild — and the
same ops run on CPU and GPU with no host sync and no data-dependent shapes (CUDA-graph safe).
Unseeded requests get a seed drawn once at admission (engine/request.py). Greedy rows
(T < GREEDY_EPS) take the plain argmax.

`SamplingRows` is the per-row description a StepPlan carries (host lists, packed by
engine/plan_codec.py); `sample(logits, rows)` is the device op; `to_host` is the step's one
host sync on the sampling rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from raydecode.models.cache import host_to_device

from .request import SamplingParams

GREEDY_EPS = 1e-5           # temperature below this (SamplingParams refuses 0 < T < 0.01) = argmax
NO_LOGPROBS = -1            # SamplingRows.logprobs: none; 0: the chosen token's; n: + top n
_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


# ---- per-row description ------------------------------------------------------------------------
@dataclass(frozen=True)
class SamplingRows:
    """One entry per sample row of a step (aligned with StepPlan.sample_rows)."""
    temperature: tuple[float, ...]
    top_p: tuple[float, ...]
    top_k: tuple[int, ...]
    seed: tuple[int, ...]            # int64 (SamplingParams seeds folded into 64 bits)
    counter: tuple[int, ...]         # index of the token to draw in its request's output
    logprobs: tuple[int, ...]        # NO_LOGPROBS, 0, or the number of top alternatives

    def __len__(self) -> int:
        return len(self.temperature)

    @staticmethod
    def build(params: list[SamplingParams | None], seeds: list[int], counters: list[int],
              logprobs: list[int] | None = None) -> "SamplingRows":
        """params None: a row nobody reads (a prefill chunk that ends mid-prompt): greedy."""
        n = len(params)
        lp = logprobs or [NO_LOGPROBS] * n
        return SamplingRows(
            temperature=tuple(0.0 if p is None else float(p.temperature) for p in params),
            top_p=tuple(1.0 if p is None else float(p.top_p) for p in params),
            top_k=tuple(0 if p is None else int(p.top_k) for p in params),
            seed=tuple(fold_seed(s) for s in seeds), counter=tuple(int(c) for c in counters),
            logprobs=tuple(int(x) for x in lp))

    @staticmethod
    def greedy(n: int) -> "SamplingRows":
        return SamplingRows((0.0,) * n, (1.0,) * n, (0,) * n, (0,) * n, (0,) * n,
                            (NO_LOGPROBS,) * n)

    @property
    def all_greedy(self) -> bool:
        return all(t < GREEDY_EPS for t in self.temperature)

    @property
    def filtered(self) -> bool:
        """Some sampled row applies top-k or top-p (needs the sort)."""
        return any(t >= GREEDY_EPS and (k > 0 or p < 1.0)
                   for t, k, p in zip(self.temperature, self.top_k, self.top_p))

    @property
    def max_logprobs(self) -> int:
        return max(self.logprobs, default=NO_LOGPROBS)

    def subset(self, rows: list[int]) -> "SamplingRows":
        return SamplingRows(*(tuple(getattr(self, f)[i] for i in rows) for f in _FIELDS))

    def tensors(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(2, R) float32 [temperature, top_p] and (3, R) int64 [top_k, seed, counter]."""
        f = torch.tensor([self.temperature, self.top_p], dtype=torch.float32)
        i = torch.tensor([self.top_k, self.seed, self.counter], dtype=torch.int64)
        return host_to_device(f, device), host_to_device(i, device)   # no host sync on CUDA


_FIELDS = ("temperature", "top_p", "top_k", "seed", "counter", "logprobs")


def fold_seed(seed: int) -> int:
    """A seed in [−2⁶³, 2⁶⁴) as the int64 with the same low 64 bits."""
    s = int(seed) & (2**64 - 1)
    return s - 2**64 if s >= 2**63 else s


# ---- the device op --------------------------------------------------------------------------------
@dataclass
class SampleOut:
    """Device tensors of one step's sample rows (R rows); logprob fields only when asked."""
    tokens: torch.Tensor                         # (R,) int64
    logprob: torch.Tensor | None = None          # (R,) fp32: log-softmax of the chosen token
    top_ids: torch.Tensor | None = None          # (R, n) int64
    top_logprobs: torch.Tensor | None = None     # (R, n) fp32


def sample(logits: torch.Tensor, rows: SamplingRows) -> SampleOut:
    """(R, V) logits -> SampleOut on logits.device (no host sync). Logprobs are those of the
    raw model distribution log_softmax(logits), as OpenAI's API reports them."""
    x = logits.float()
    R, V = x.shape
    if len(rows) != R:
        raise ValueError(f"{R} logit rows for {len(rows)} sampling rows")
    best = x.argmax(-1)
    if rows.all_greedy:
        tokens = best
    else:
        f, i = rows.tensors(x.device)
        temp = f[0]
        greedy = temp < GREEDY_EPS
        scaled = x / torch.where(greedy, torch.ones_like(temp), temp).unsqueeze(-1)
        if rows.filtered:
            scaled = filter_batch(scaled, f[1], i[0])
        choice = (scaled + gumbel(i[1], i[2], V, x.device)).argmax(-1)
        tokens = torch.where(greedy, best, choice)
    out = SampleOut(tokens)
    n = rows.max_logprobs
    if n >= 0:
        lsm = torch.log_softmax(x, dim=-1)
        out.logprob = lsm.gather(1, tokens.unsqueeze(1)).squeeze(1)
        if n > 0:
            out.top_logprobs, out.top_ids = torch.topk(lsm, min(n, V), dim=-1)
    return out


def filter_batch(x: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """(R, V) scaled logits -> the same with -inf outside each row's top-k, then outside the
    smallest prefix (by probability) of the top-k-renormalised distribution whose mass reaches
    top_p; the most likely token always stays. top_k 0 = off, top_p 1 = off."""
    R, V = x.shape
    sx, idx = torch.sort(x, dim=-1, descending=True)
    rank = torch.arange(V, device=x.device).unsqueeze(0)                   # (1, V)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V)).unsqueeze(-1)
    sx = sx.masked_fill(rank >= k, float("-inf"))
    probs = torch.softmax(sx, dim=-1)
    before = probs.cumsum(-1) - probs                                     # mass ahead of each
    drop = (before >= top_p.unsqueeze(-1)) & (rank > 0)
    sx = sx.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, idx, sx)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser on int64 tensors holding values in [0, 2³²) (xorshift-multiply;
    products wrap mod 2⁶⁴, the mask keeps the exact low 32 bits)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def uniform(seed: torch.Tensor, counter: torch.Tensor, V: int, device) -> torch.Tensor:
    """(R, V) fp32 u ∈ (0, 1), a hash of (seed, counter, v): the same on every device."""
    lo, hi = seed & _M32, (seed >> 32) & _M32
    key = _mix32(_mix32(_mix32(lo) ^ hi) ^ (counter & _M32))              # (R,)
    v = torch.arange(V, device=device, dtype=torch.int64) * _GOLDEN & _M32
    h = _mix32(_mix32((key.unsqueeze(-1) + v.unsqueeze(0)) & _M32) ^ key.unsqueeze(-1))
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))     # 23 bits + ½: exact in fp32


def gumbel(seed: torch.Tensor, counter: torch.Tensor, V: int, device) -> torch.Tensor:
    """(R, V) fp32 standard Gumbel noise −log(−log u)."""
    return -torch.log(-torch.log(uniform(seed, counter, V, device)))


# ---- the host side ----------------------------------------------------------------------------------
@dataclass
class StepResult:
    """What a step returns to the coordinator: per sample row its token id and, for rows that
    asked, logprobs. `failed[i]` names why row i could not be sampled (None: fine); such a row's
    token is -1 and only its request fails."""
    token_ids: list[int]
    logprob: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    failed: list[str | None] | None = None

    @staticmethod
    def to_host(out: SampleOut) -> "StepResult":
        """The step's one host sync on the sampling rank: token ids (and logprobs) to lists."""
        parts = [out.tokens.to(torch.float64)]
        if out.logprob is not None:
            parts.append(out.logprob.to(torch.float64).unsqueeze(-1))
        if out.top_ids is not None:
            parts += [out.top_ids.to(torch.float64), out.top_logprobs.to(torch.float64)]
        if len(parts) == 1:
            return StepResult(out.tokens.tolist())
        host = torch.cat([p.reshape(p.shape[0], -1) for p in parts], dim=-1).cpu()
        tok = host[:, 0].long().tolist()
        res = StepResult(tok, host[:, 1].tolist())
        if out.top_ids is not None:
            n = out.top_ids.shape[1]
            res.top_ids = host[:, 2:2 + n].long().tolist()
            res.top_logprobs = host[:, 2 + n:2 + 2 * n].tolist()
        return res


def sample_isolated(logits: torch.Tensor, rows: SamplingRows) -> StepResult:
    """sample + to_host; if the batch op raises, each row is sampled alone and a row that still
    raises fails by itself (token -1, `failed` says why): one request's sampling never fails
    the step of the others."""
    try:
        return StepResult.to_host(sample(logits, rows))
    except Exception:  # noqa: BLE001 — isolate the offending row below
        pass
    res = StepResult([-1] * len(rows), failed=[None] * len(rows))
    lp = rows.max_logprobs >= 0
    if lp:
        res.logprob = [float("nan")] * len(rows)
    if rows.max_logprobs > 0:
        res.top_ids, res.top_logprobs = [[] for _ in rows.temperature], [[] for _ in rows.temperature]
    for r in range(len(rows)):
        try:
            one = StepResult.to_host(sample(logits[r:r + 1], rows.subset([r])))
        except Exception as e:  # noqa: BLE001
            res.failed[r] = f"sampling failed: {type(e).__name__}: {str(e)[:200]}"
            continue
        res.token_ids[r] = one.token_ids[0]
        if lp and one.logprob is not None:
            res.logprob[r] = one.logprob[0]
        if one.top_ids is not None and res.top_ids is not None:
            res.top_ids[r], res.top_logprobs[r] = one.top_ids[0], one.top_logprobs[0]
    return res


# ---- per-row reference (speculative decoding's distributions, tests) ------------------------------
def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """(V,) logits → (V,) logits with temperature, top-k and top-p applied (-inf outside); the
    one-row form of `filter_batch` (same rule)."""
    x = logits.float() / max(p.temperature, GREEDY_EPS)
    return filter_batch(x.unsqueeze(0), torch.tensor([float(p.top_p)], device=x.device),
                        torch.tensor([int(p.top_k)], device=x.device)).squeeze(0)


def probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """(V,) sampling distribution of one row (one-hot for greedy)."""
    if p.greedy:
        out = torch.zeros_like(logits, dtype=torch.float32)
        out[int(torch.argmax(logits))] = 1.0
        return out
    return torch.softmax(filter_logits(logits, p), dim=-1)


__all__ = ["GREEDY_EPS", "NO_LOGPROBS", "SamplingRows", "SampleOut", "StepResult", "fold_seed",
           "sample", "sample_isolated", "filter_batch", "filter_logits", "probs", "gumbel",
           "uniform"]
