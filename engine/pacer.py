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

with B the decode batch. Decode times are exponential moving averages keyed by the batch's
power-of-two bucket; a chunk step's time is keyed by its token bucket (split: the chunk's
tokens; mixed: the chunk's plus the B decode rows, the step's tokens, which pick the stock
graph it replays and so its cost) and is the median of that bucket's last WINDOW samples, so
one outlier (a bucket's first replay, a host stall: on the H100 a 2-token chunk step took 2.8
ms and once 28 ms) neither decides nor sticks. Candidates on the split schedule are the
powers of two below the static cap, and the cap; on mixed steps the chunks that fill a
power-of-two step bucket beside the B rows (b − B: with 63 rows 1, 65, 193, 449), and the
cap. (Measured on the H100 at 24 K3 layers with mixed-step graphs, 63 rows: a mixed step
cost 14.8-15.8 ms in step bucket 128, 19.2 in 256, 24.1-24.4 in 512, against a 12.0 ms
decode step, whatever the chunk inside the bucket: powers of two in chunk tokens paid a
whole bucket's padding, 128 tokens a 256-token step and 256 a 512-token one.) A candidate
never measured is judged by the line through the smallest and the largest measured buckets
below it (a step's time is close to fixed + per-token cost, as
the stock step's is below a few thousand tokens), or with one measured bucket the line
through it and the origin (an upper bound for a concave cost); when that single bucket is the
only one that fits, the next chunk is half of it, the second point of the line. With no
decode time for the batch or no chunk time yet, the chunk is a probe of cap / 8 (at least one
token), so a cold start cannot stall the streams for a whole static-cap chunk; when even the
smallest measured chunk is over the allowance, the next probe is half of it.

A bucket judged over the allowance is not run again on its own, so its samples would never
change: every REPROBE-th chunk below the cap is the next candidate up instead (one step in
REPROBE may run over the limit, below the 1 % a p99 allows), every REPROBE_SOON-th while that
size's judgement stands on fewer than TRUST samples of its own and the line through the
trusted buckets below does not put it over too (at most TRUST − 1 such steps per size over
the pacer's life), so a chunk size that fits again (an outlier aged out, a faster decode
batch) is found, while a size both its own sample and its neighbours rule out costs the
streams one over-limit step per REPROBE, not three in the first hundred. Where even a
one-token chunk does not fit, the limit cannot be held on this schedule at all (H100, 8 K3
layers, split: a chunk step costs 2.8 ms at any size below 8 tokens against a 4.1 ms decode
step, so a limit below ≈ 1.7 is out of reach); the pacer then gives the prompt's rate floor
below, `infeasible` counts such steps, and the prompt is not starved one token per step for
a bound nothing could hold.

The limit is held for the streams, but not at any price to the prompt: where the largest chunk
that fits moves the prompt at less than 1/`stretch` of the rate the static cap would
(`prompt_stretch_limit`, default 4), the chunk is the smallest candidate that keeps that rate
instead, and `stretched` counts such steps. The prompt's rate is its tokens per second of
wall time: n / t_mixed(n) on mixed steps, n / (t_chunk(n) + t_decode(B)) on the split
schedule (each chunk step is followed by a decode step). Measured on the H100 at 24 K3
layers: a chunk step's cost is nearly flat below ≈ 128 tokens (split: 8 tokens 11.4 ms, 64
tokens 12.6; the decode step 11.9), so the largest size under a 2.0 limit came out at 8-32
tokens, noise deciding between sizes 5 % apart, and the 32k prompt took 36.9 s against 2.4 s
at a 448-token cap (mixed steps, where a one-token step already sits at 2.08×: 6,160
one-token chunks, 130 s). Where no size fits at all the chunk is this floor too (not the
cap): the least slowdown that keeps the prompt's rate.

Deterministic given the observations; no clock of its own (the engine times its steps).
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

ALPHA = 0.25                 # weight of a new observation in the decode times' moving averages
PROBE_DIVISOR = 8            # first chunk without any chunk time: the cap / 8
WINDOW = 8                   # a chunk bucket's time: the median of its last WINDOW samples
REPROBE = 128                # every REPROBE-th chunk below the cap: the next candidate up
REPROBE_SOON = 32            # the same where the size up has fewer than TRUST samples
TRUST = 3                    # samples before a bucket's own median outweighs its neighbours'
STRETCH = 4.0                # default prompt_stretch_limit: the prompt keeps ≥ 1/4 of its rate


def bucket(n: int) -> int:
    """The power-of-two bucket of a positive count (1, 2, 4, ...): the smallest ≥ n."""
    if n < 1:
        raise ValueError(f"count {n}: expected ≥ 1")
    return 1 << (n - 1).bit_length()


def check_stretch(stretch) -> float:
    """A prompt_stretch_limit: a number ≥ 1 (1: the static cap whenever it is measured)."""
    if isinstance(stretch, bool) or not isinstance(stretch, (int, float)) \
            or not stretch >= 1.0 or stretch == float("inf"):
        raise ValueError(f"prompt_stretch_limit = {stretch!r}; expected a finite number ≥ 1 "
                         "(how many times slower than at the static cap a paced prompt may "
                         "prefill)")
    return float(stretch)


def candidates(cap: int) -> list[int]:
    """Chunk sizes the pacer picks from: the powers of two below `cap`, then `cap`."""
    return [1 << i for i in range(cap.bit_length()) if 1 << i < cap] + [cap]


def mixed_candidates(cap: int, decodes: int) -> list[int]:
    """Chunk sizes beside `decodes` one-token rows on mixed steps: each that fills a power-of-
    two step bucket (b − decodes, at least one token, below `cap`), then `cap`."""
    return [b - decodes for b in (1 << i for i in range((cap + decodes).bit_length() + 1))
            if 1 <= b - decodes < cap] + [cap]


@dataclass
class ChunkPacer:
    limit: float                    # the streams' TPOT beside a prompt / their decode-only TPOT
    mixed: bool = False             # False: the split schedule; True: mixed steps
    stretch: float = STRETCH        # the prompt's rate at the cap / its least paced rate
    decode_s: dict[int, float] = field(default_factory=dict)   # batch bucket -> seconds
    chunk_s: dict[int, float] = field(default_factory=dict)    # token bucket -> seconds (median)
    infeasible: int = 0             # chunks where no size fits the limit (given the floor)
    reprobes: int = 0               # chunks run one candidate above the fitting one
    stretched: int = 0              # chunks raised to the floor that keeps the prompt's rate

    def __post_init__(self) -> None:
        if isinstance(self.limit, bool) or not isinstance(self.limit, (int, float)) \
                or not self.limit > 1.0:
            raise ValueError(f"decode_slowdown_limit = {self.limit!r}; expected a number > 1 "
                             "(the streams' TPOT beside a prompt over their TPOT without it)")
        check_stretch(self.stretch)
        # each bucket's recent samples (seeded with any chunk_s given); chunk_s their medians
        self._window = {k: deque([v], maxlen=WINDOW) for k, v in self.chunk_s.items()}
        self._below = 0             # chunks below the cap since the last reprobe

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
            b = bucket(prompt_tokens + decodes)         # split: decodes is 0
            w = self._window.setdefault(b, deque(maxlen=WINDOW))
            w.append(seconds)
            self.chunk_s[b] = statistics.median(w)

    def _trusted(self, b: int) -> bool:
        """A bucket whose median stands on at least TRUST samples."""
        return len(self._window.get(b, ())) >= TRUST

    def _estimate(self, n: int) -> float | None:
        """Seconds of a chunk step of `n` tokens (mixed: the chunk's and the decode rows'):
        its bucket's median where that stands on
        TRUST samples. Else the line through the measured buckets below it (the smallest and
        the largest, slope ≥ 0; with one, the line through it and the origin, an upper bound
        for a cost concave in the tokens), from the trusted ones only where the bucket has
        samples of its own, and then the lower of the line and its own median: one outlier
        sample does not rule a size out before it is sampled again. None where nothing
        judges it."""
        b = bucket(n)
        own = self.chunk_s.get(b)
        if own is not None and self._trusted(b):
            return own
        line = self._line(n, trusted=own is not None)
        if line is None:
            return own
        return line if own is None else min(own, line)

    def _line(self, n: int, trusted: bool) -> float | None:
        """The line `_estimate` judges an unmeasured or untrusted bucket by: through the
        smallest and the largest buckets below bucket(n) (trusted ones only, or, where
        `trusted` is False and none is, any), slope ≥ 0; with one, through it and the
        origin. None where no bucket lies below."""
        b = bucket(n)
        below = [k for k in sorted(self.chunk_s) if k < b and self._trusted(k)] or \
            ([] if trusted else [k for k in sorted(self.chunk_s) if k < b])
        if not below:
            return None
        hi, t_hi = below[-1], self.chunk_s[below[-1]]
        if len(below) == 1:
            return t_hi * n / hi
        lo = below[0]
        return t_hi + max((t_hi - self.chunk_s[lo]) / (hi - lo), 0.0) * (n - hi)

    def _floor(self, sizes: list[int], est: dict[int, float | None],
               base: float) -> int | None:
        """The smallest candidate whose estimated prompt rate (tokens per second of wall time:
        n / t(n) on mixed steps, n / (t(n) + base) split) is at least 1/stretch of the cap's.
        Sizes below the smallest measured one have no estimate; for a cost concave in the
        tokens t(n) ≥ t(m)·n/m below a measured m, so their rate is at most m's: they are
        ruled out where m's rate is short, and where it is not the floor is unknown (None:
        the limit's own probing finds them). None too before the cap's step has an estimate.
        est: each size's `_estimate`."""
        extra = 0.0 if self.mixed else base
        top = est[sizes[-1]]
        if top is None:
            return None
        want = sizes[-1] / (top + extra) / self.stretch
        unknown = False
        for n in sizes:
            e = est[n]
            if e is None:
                unknown = True          # below every measured size
                continue
            if n / (e + extra) >= want:
                return None if unknown else n
            unknown = False             # the smallest measured size is short: so are those below
        return sizes[-1]

    def _judged(self, n: int, allowance: float) -> bool:
        """Whether the judgement that a step of `n` tokens is over `allowance` stands without
        more samples of its own: its bucket is trusted, or the line through the trusted
        buckets below puts it over too (its own few samples are then not the only witness;
        H100, 24 K3 layers, 63 rows, limit 1.8: bucket 512 at 24 ms against a 22.0 ms
        allowance, the line through 128 and 256 at 22.8, and each soon reprobe of it a
        1.9-2.0× step for the streams)."""
        if self._trusted(bucket(n)):
            return True
        line = self._line(n, trusted=True)
        return line is not None and line > allowance

    def _reprobe_due(self, every: int) -> bool:
        """Count one chunk that could be a reprobe; True (counted as one) every `every`-th."""
        self._below += 1
        if self._below < every:
            return False
        self._below = 0
        self.reprobes += 1
        return True

    def chunk_cap(self, cap: int, decodes: int) -> int:
        """The prompt tokens a step may carry beside `decodes` decoding streams, ≤ `cap`."""
        if decodes < 1 or cap <= 1:
            return cap
        base = self.decode_s.get(bucket(decodes))
        shift = decodes if self.mixed else 0            # a mixed step's rows beside the chunk
        sizes = mixed_candidates(cap, decodes) if self.mixed else candidates(cap)
        est = {n: self._estimate(n + shift) for n in sizes}   # once per step: the hot path
        if base is None or all(e is None for e in est.values()):
            return max(1, cap // PROBE_DIVISOR)          # nothing to judge by: a probe
        allowance = (self.limit - (0.0 if self.mixed else 1.0)) * base
        fit = [n for n in sizes if est[n] is not None and est[n] <= allowance]
        measured = [k for k in self.chunk_s if k <= bucket(cap + shift)]
        if fit and len(measured) == 1 and max(fit) + shift == measured[0] > 1 \
                and measured[0] // 2 > shift:
            # one point fits: the step of half its tokens gives the cost's slope
            return measured[0] // 2 - shift
        floor = self._floor(sizes, est, base)
        if floor is not None and (not fit or max(fit) < floor):
            # the limit would cost the prompt more than `stretch`: the least slowdown that
            # keeps its rate (no size fits at all: the same, counted as infeasible too)
            self.stretched += 1
            self.infeasible += 0 if fit else 1
            return floor
        if fit:
            best = max(fit)
            if best < cap:
                # the next size up, once in a while: fresh samples for a size judged over
                # (sooner while its judgement stands on fewer than TRUST samples)
                up = sizes[sizes.index(best) + 1]
                if self._reprobe_due(REPROBE if self._judged(up + shift, allowance)
                                     else REPROBE_SOON):
                    return up
            return best
        # even the smallest measured bucket is over, and it keeps the prompt's rate (else the
        # floor above), so the smaller sizes may too: probe half of it (never measured, so
        # no estimate judged it) — the chunk halves until one fits or the floor is known.
        # (Once the one-token step is measured the floor always is: no size lies below it.)
        return max(1, min(cap, min(self.chunk_s) // 2 - shift))
