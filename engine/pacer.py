"""Prompt chunks sized to a decode-slowdown limit (`SchedulerConfig.decode_slowdown_limit`).

While streams decode, each step that carries prompt tokens delays their next token: on the
split schedule (`split_mixed`) a stream waits for a chunk step and then its decode step, on
mixed steps for the one step that carries both. How long that takes depends on the chunk, on
the decode batch, on the depth of the model and on the hardware, so a fixed token count
(`prefill_tokens_while_decoding`) holds a slowdown bound only where it was measured. The
pacer measures instead: the engine reports every step's wall time (`observe`), and the
scheduler asks for the largest chunk whose step fits (`chunk_cap`):

    split:  t_chunk(n) + t_decode(B) ≤ limit · t_decode(B)
    mixed:  t_mixed(n, B)           ≤ limit · t_decode(B)

with B the decode batch. Times are exponential moving averages keyed by power-of-two buckets
(chunk tokens; decode batch), the buckets the stock and decode graphs run in. Candidates are
the powers of two below the static cap, and the cap. A candidate never measured is judged by
the line through the smallest and the largest measured buckets below it (a step's time is
close to fixed + per-token cost, as the stock step's is below a few thousand tokens), or with
one measured bucket the line through it and the origin (an upper bound for a concave cost);
when that single bucket is the only one that fits, the next chunk is half of it, the second
point of the line. With no decode time for the batch or no chunk time yet, the chunk is a
probe of cap / 8 (at least one token), so a cold start cannot stall the streams for a whole
static-cap chunk; when even the smallest measured chunk is over the allowance, the next probe
is half of it.

Deterministic given the observations; no clock of its own (the engine times its steps).
"""
from __future__ import annotations

from dataclasses import dataclass, field

ALPHA = 0.25                 # weight of a new observation in the moving averages
PROBE_DIVISOR = 8            # first chunk without any chunk time: the cap / 8


def bucket(n: int) -> int:
    """The power-of-two bucket of a positive count (1, 2, 4, ...): the smallest ≥ n."""
    if n < 1:
        raise ValueError(f"count {n}: expected ≥ 1")
    return 1 << (n - 1).bit_length()


def candidates(cap: int) -> list[int]:
    """Chunk sizes the pacer picks from: the powers of two below `cap`, then `cap`."""
    return [1 << i for i in range(cap.bit_length()) if 1 << i < cap] + [cap]


@dataclass
class ChunkPacer:
    limit: float                    # the streams' TPOT beside a prompt / their decode-only TPOT
    mixed: bool = False             # False: the split schedule; True: mixed steps
    decode_s: dict[int, float] = field(default_factory=dict)   # batch bucket -> seconds
    chunk_s: dict[int, float] = field(default_factory=dict)    # token bucket -> seconds

    def __post_init__(self) -> None:
        if isinstance(self.limit, bool) or not isinstance(self.limit, (int, float)) \
                or not self.limit > 1.0:
            raise ValueError(f"decode_slowdown_limit = {self.limit!r}; expected a number > 1 "
                             "(the streams' TPOT beside a prompt over their TPOT without it)")

    @staticmethod
    def _avg(table: dict[int, float], key: int, seconds: float) -> None:
        old = table.get(key)
        table[key] = seconds if old is None else (1 - ALPHA) * old + ALPHA * seconds

    def observe(self, prompt_tokens: int, decodes: int, seconds: float) -> None:
        """One step's wall time: `prompt_tokens` tokens of prompt chunks (0: none) beside
        `decodes` one-token decode rows. A decode-only step times the decode batch; a chunk
        step (split: no decode rows; mixed: with them) times its token bucket. Other steps
        (a split schedule's step that mixes both, e.g. an admission beside decodes with
        splitting off) are not a sample of either and are ignored."""
        if seconds < 0:
            raise ValueError(f"step seconds {seconds}: expected ≥ 0")
        if prompt_tokens == 0 and decodes > 0:
            self._avg(self.decode_s, bucket(decodes), seconds)
        elif prompt_tokens > 0 and (decodes > 0) == self.mixed:
            self._avg(self.chunk_s, bucket(prompt_tokens), seconds)

    def _estimate(self, n: int) -> float | None:
        """Seconds of a chunk step of `n` tokens: its bucket's average; else, from the
        measured buckets below it, the line through the smallest and the largest (slope ≥ 0),
        or with one such bucket the line through it and the origin (an upper bound for a cost
        concave in the tokens); else None."""
        b = bucket(n)
        if b in self.chunk_s:
            return self.chunk_s[b]
        below = sorted(k for k in self.chunk_s if k < b)
        if not below:
            return None
        hi, t_hi = below[-1], self.chunk_s[below[-1]]
        if len(below) == 1:
            return t_hi * n / hi
        lo = below[0]
        return t_hi + max((t_hi - self.chunk_s[lo]) / (hi - lo), 0.0) * (n - hi)

    def chunk_cap(self, cap: int, decodes: int) -> int:
        """The prompt tokens a step may carry beside `decodes` decoding streams, ≤ `cap`."""
        if decodes < 1 or cap <= 1:
            return cap
        base = self.decode_s.get(bucket(decodes))
        sizes = candidates(cap)
        if base is None or not any(self._estimate(n) is not None for n in sizes):
            return max(1, cap // PROBE_DIVISOR)          # nothing to judge by: a probe
        allowance = (self.limit - (0.0 if self.mixed else 1.0)) * base
        fit = [n for n in sizes
               if (e := self._estimate(n)) is not None and e <= allowance]
        measured = [k for k in self.chunk_s if k <= bucket(cap)]
        if fit and len(measured) == 1 and max(fit) == measured[0] > 1:
            return measured[0] // 2      # one point fits: half of it gives the cost's slope
        if fit:
            return max(fit)
        # even the smallest measured bucket is over: probe half of it (never measured, so
        # no estimate judged it) — the chunk halves until one fits
        return max(1, min(cap, min(self.chunk_s) // 2))
