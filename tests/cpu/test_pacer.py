"""The decode-slowdown pacer (engine/pacer.py): prompt chunks beside decoding streams sized
from the steps' measured times, in the pacer alone and driven through the Scheduler and the
engine against a synthetic step-cost model."""
import pytest

from raydecode.engine import engine as engine_mod
from raydecode.engine.engine import EngineConfig, LLMEngine
from raydecode.engine.loader import load_tokenizer
from raydecode.engine.pacer import (REPROBE, STRETCH, ChunkPacer, bucket, candidates,
                                    mixed_candidates)
from raydecode.engine.request import SamplingParams
from raydecode.engine.sampling import StepResult
from raydecode.engine.scheduler import Scheduler, SchedulerConfig

from test_scheduler import req, run_step


def test_mixed_candidates_fill_the_step_buckets():
    """Beside B one-token rows a mixed step of n prompt tokens replays the stock graph of
    bucket(n + B): the candidates are the chunks that fill one (and the cap)."""
    assert mixed_candidates(448, 63) == [1, 65, 193, 448]
    assert mixed_candidates(512, 63) == [1, 65, 193, 449, 512]
    assert mixed_candidates(512, 0) == candidates(512)
    assert mixed_candidates(100, 200) == [56, 100]      # 256 − 200; nothing smaller fits
    assert mixed_candidates(1, 63) == [1]
    for cap, B in [(448, 63), (512, 5), (8192, 1)]:
        assert all(bucket(n + B) == n + B for n in mixed_candidates(cap, B)[:-1])


def test_buckets_and_candidates():
    assert [bucket(n) for n in (1, 2, 3, 64, 65, 448)] == [1, 2, 4, 64, 128, 512]
    assert candidates(512) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert candidates(448) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 448]
    with pytest.raises(ValueError, match="count 0"):
        bucket(0)


@pytest.mark.parametrize("limit", [1.0, 0.5, True, "2", None])
def test_limit_must_be_a_number_above_one(limit):
    with pytest.raises(ValueError, match="decode_slowdown_limit = .*expected a number > 1"):
        ChunkPacer(limit)
    if limit is not None:
        with pytest.raises(ValueError, match="decode_slowdown_limit = "):
            EngineConfig(decode_slowdown_limit=limit)


def test_cold_pacer_probes_an_eighth_of_the_cap_then_half_of_it():
    p = ChunkPacer(2.0)                                 # split: chunk ≤ (2 − 1) · decode
    assert p.chunk_cap(512, decodes=63) == 64           # nothing measured: cap / 8
    p.observe(0, 63, 0.004)                             # a decode-only step of 63 streams
    assert p.chunk_cap(512, decodes=63) == 64           # no chunk time yet: still the probe
    p.observe(64, 0, 0.0009)
    # one point: the line through it and the origin bounds a concave cost: 256 (3.6 ms) fits
    assert p.chunk_cap(512, decodes=63) == 256
    p.observe(256, 0, 0.003)                            # 10.9 µs per token between the two
    assert p.chunk_cap(512, decodes=63) == 256          # 512: 5.8 ms
    q = ChunkPacer(2.0, decode_s={64: 0.004}, chunk_s={64: 0.0025})
    assert q.chunk_cap(512, decodes=63) == 32           # only 64 fits: half of it, a slope
    assert p.chunk_cap(512, decodes=5) == 64            # batch 5's decode not measured
    assert p.chunk_cap(512, decodes=0) == 512           # nothing decodes: not paced
    assert p.chunk_cap(4, decodes=63) == 1              # a probe is at least one token


def test_split_chunk_follows_the_measured_line_and_backs_off():
    """The limit's own logic; the prompt's rate floor held out of the way (stretch 64), else
    at the end 128 tokens (every size's step 8 ms: 128 keeps 1/4 of the cap's rate, 16
    could not) would be the chunk instead of the search below 32."""
    p = ChunkPacer(2.0, stretch=64.0)
    p.observe(0, 63, 0.004)
    p.observe(32, 0, 0.001)
    p.observe(64, 0, 0.0015)                            # 15.6 µs per token
    assert p.chunk_cap(512, 63) == 128                  # 128: 2.5 ms; 256: 4.5 > 4
    p.observe(128, 0, 0.0025)                           # measured as the line said
    assert p.chunk_cap(512, 63) == 128
    p.observe(0, 63, 0.0052)                            # a slower decode step: averaged
    assert p.decode_s[64] == pytest.approx(0.75 * 0.004 + 0.25 * 0.0052)
    for _ in range(20):
        p.observe(0, 63, 0.006)                         # → 6 ms: 256 at 4.5 fits, 512 (8.5) not
    assert p.chunk_cap(512, 63) == 256
    for _ in range(20):                                 # every measured chunk over 6 ms now
        for n in (32, 64, 128):
            p.observe(n, 0, 0.008)
    assert p.chunk_cap(512, 63) == 16                   # half the smallest measured
    p.observe(16, 0, 0.002)
    assert p.chunk_cap(512, 63) == 16
    q = ChunkPacer(2.0, decode_s=dict(p.decode_s))      # the default stretch (4): the floor
    for n in (32, 64, 128):
        for _ in range(3):
            q.observe(n, 0, 0.008)
    assert q.chunk_cap(512, 63) == 128 and q.stretched == 1 and q.infeasible == 1


def _settle(p, cost, steps, cap=448, decode=0.004):
    """`steps` split chunks chosen by `p` against decode steps of `decode` s, each chunk
    'taking' cost(n, i) s -> the chunk sizes chosen."""
    p.observe(0, 63, decode)
    chosen = []
    for i in range(steps):
        n = p.chunk_cap(cap, 63)
        p.observe(n, 0, cost(n, i))
        p.observe(0, 63, decode)
        chosen.append(n)
    return chosen


def test_one_outlier_sample_neither_decides_nor_sticks():
    """The H100 run's failure (8 K3 layers, split, limit 2): a few slow chunk steps (a 32-token
    step 5.3 ms once where it mostly takes 3.6, 8 and 16 at 5.0 once each) walked the chunk
    down to 1-4 tokens and kept it there, never sampling the larger sizes again: the 32k
    prompt took 142 s against 0.81 s at fixed 448-token chunks. Cost here: 2.8 ms + 25 µs
    per token, every size's first step 2.2 ms slower; the allowance 4 ms fits 32 tokens
    (3.6 ms), not 64 (4.4). The prompt's rate floor is lifted (stretch 16: 32-token chunks
    keep more than 1/16 of the cap's rate), so the limit's own logic is what is tested."""
    seen = set()

    def cost(n, i):
        first = bucket(n) not in seen
        seen.add(bucket(n))
        return 0.0028 + 25e-6 * n + (0.0022 if first else 0.0)

    p = ChunkPacer(2.0, stretch=16.0)
    chosen = _settle(p, cost, 300)
    early = p.infeasible        # while every measured size stood on its slow first sample
    chosen += _settle(p, cost, 300)
    assert chosen[:4] == [56, 32, 16, 8]                # the first samples all over: halving
    late = chosen[300:]
    assert max(set(late), key=late.count) == 32 and late.count(32) > 0.95 * len(late)
    assert p.chunk_s[32] == pytest.approx(0.0036) and p.infeasible == early < 4
    # the sizes above 32 are sampled again now and then (REPROBE): 64 stays over
    assert 64 in late and late.count(64) <= len(late) // REPROBE + 1
    assert p.chunk_s[64] == pytest.approx(0.0044)


def _rate_floor(cost, decode, cap, stretch, mixed=False):
    """The smallest candidate whose prompt rate (tokens per second of wall time) under
    `cost` is ≥ 1/stretch of the cap's: what the pacer should settle on below it."""
    extra = 0.0 if mixed else decode
    want = cap / (cost(cap) + extra) / stretch
    return min(n for n in candidates(cap) if n / (cost(n) + extra) >= want)


def test_a_limit_no_chunk_can_hold_gives_the_rate_floor_or_the_cap():
    """A one-token chunk step over the allowance: the limit is out of reach (the split
    schedule's chunk step costs about a decode step at 8 layers). The prompt is not starved
    one token per step: it gets the smallest chunk that keeps 1/stretch of the rate the
    static cap would give it (the least slowdown at that price), and the pacer counts those
    steps; at stretch 1 that is the static cap itself."""
    def cost(n, i=0):
        return 0.0028 + 25e-6 * n

    p = ChunkPacer(1.5)                                 # allowance 0.5 · 4 ms = 2 ms
    chosen = _settle(p, cost, 40 + REPROBE)
    floor = _rate_floor(cost, 0.004, 448, STRETCH)
    assert 1 < floor < 448 and chosen[0] == 56          # the probe, then the floor's search
    assert set(chosen[20:]) == {floor}
    assert p.infeasible == p.stretched >= len(chosen) - 20 and p.reprobes == 0
    q = ChunkPacer(1.5, stretch=1.0)
    chosen = _settle(q, cost, 40)
    assert chosen[0] == 56 and set(chosen[1:]) == {448} and q.stretched == 39
    r = ChunkPacer(1.5, decode_s={64: 0.004}, chunk_s={1: 0.003})
    # one one-token sample: the line through it and the origin puts the cap's step at 1.34 s,
    # so one token already keeps 1/4 of the cap's rate: the floor is one token
    assert r.chunk_cap(448, 63) == 1


def test_the_prompt_keeps_its_rate_where_the_limit_would_starve_it():
    """Where the largest chunk under the limit moves the prompt at less than 1/stretch of the
    cap's rate, the chunk is the rate floor. The split schedule on the H100 at 24 K3 layers
    (`prefill-h100-2026-12-06-paced24.json`, the medians the pacer reported): a decode step
    11.89 ms, chunk steps flat from 11.4 ms at 8 tokens to 14.1 at 128, so the 2.0 limit fits
    only 8 tokens and the 32k prompt took 36.9 s against 2.4 s at 448-token chunks."""
    table = {8: 11.367, 16: 12.024, 32: 12.099, 64: 12.588, 128: 14.13}
    p = ChunkPacer(2.0)
    for _ in range(3):
        p.observe(0, 63, 0.011893)
        for n, ms in table.items():
            p.observe(n, 0, ms / 1e3)
    n = p.chunk_cap(448, 63)
    # the cap's step by the pacer's own line through 8 and 128 tokens
    slope = (table[128] - table[8]) / 120

    def cost(k):
        return (table[8] + slope * (k - 8)) / 1e3

    assert n == _rate_floor(cost, 0.011893, 448, STRETCH) and n > 8
    assert p.stretched == 1 and p.infeasible == 0       # 8 tokens fit: not infeasible
    loose = ChunkPacer(2.0, stretch=64.0, decode_s=dict(p.decode_s))
    loose._window, loose.chunk_s = p._window, p.chunk_s
    assert loose.chunk_cap(448, 63) == 8 and loose.stretched == 0   # the limit's own choice


@pytest.mark.parametrize("stretch", [0.5, 0.999, True, "4", None, float("inf"),
                                     float("nan")])
def test_stretch_must_be_a_finite_number_of_at_least_one(stretch):
    with pytest.raises(ValueError, match="prompt_stretch_limit = .*finite number ≥ 1"):
        ChunkPacer(2.0, stretch=stretch)


def test_mixed_steps_get_the_whole_limit_and_only_their_own_samples():
    p = ChunkPacer(2.0, mixed=True)                     # mixed: step ≤ 2 · decode
    p.observe(0, 63, 0.004)
    p.observe(64, 0, 0.001)                             # a chunk alone: not a mixed sample
    assert p.chunk_s == {}
    p.observe(64, 63, 0.005)                            # 64 + 63 decode rows: 5 ms
    assert p.chunk_s == {128: 0.005}                    # keyed by the step's tokens
    assert p.chunk_cap(512, 63) == 1                    # fits: the 64-token step for a slope
    p.observe(1, 63, 0.0042)
    # the line through the 64- and 128-token steps: 256 tokens 6.6 ms ≤ 2 · 4 ms, 512 tokens
    # 9.8: the chunk that fills the 256-token step beside the 63 rows
    assert p.chunk_cap(512, 63) == 256 - 63
    q = ChunkPacer(2.0)                                 # split ignores mixed samples
    q.observe(64, 63, 0.005)
    assert q.chunk_s == {}


def test_a_size_its_neighbours_rule_out_too_is_reprobed_rarely():
    """The H100's mixed steps (24 K3 layers, 63 rows; pacer-replay-h100-2026-12-06-mixed24):
    step bucket 64 14.8 ms, 128 15.2, 256 19.0, 512 24.0, decode 12.2; limit 1.8 allows 22.0
    ms, so the 193-token chunk (bucket 256) fits and 449 (bucket 512) does not. Once bucket
    512 has one sample over and the line through the trusted 128 and 256 (22.8 ms) agrees,
    449 is run again once per REPROBE chunks, not once per REPROBE_SOON until it is trusted:
    over one 32k prompt (≈ 170 steps) at most one step beyond the first sample runs over."""
    cost = {64: 0.0148, 128: 0.0152, 256: 0.019, 512: 0.024}
    p = ChunkPacer(1.8, mixed=True)
    chosen = []
    for _ in range(4 * REPROBE):
        p.observe(0, 63, 0.0122)
        n = p.chunk_cap(448, 63)
        p.observe(n, 63, cost[bucket(n + 63)])
        chosen.append(n)
    over = [i for i, n in enumerate(chosen) if bucket(n + 63) == 512]
    settled = chosen[over[0] + 1:]
    assert max(set(settled), key=settled.count) == 193
    assert len(over) - 1 <= len(settled) // REPROBE + 1, (over, len(settled))
    assert len([i for i in over if i < over[0] + 170]) <= 2


def _drive(limit, cost, steps_after_warm=40):
    """A split schedule (cap 512, budget 8192): streams a, c decode while b's 16k prompt
    prefills; each step 'takes' cost(prompt, decodes) seconds, reported to the scheduler. ->
    [(chunk tokens, the streams' TPOT = that chunk's step + the decode step after it)]."""
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8192, num_blocks=2048,
                                  block_size=16, split_mixed=True,
                                  prefill_tokens_while_decoding=512,
                                  decode_slowdown_limit=limit))
    a, c = req(3, max_tokens=10 ** 6), req(2, max_tokens=10 ** 6)
    s.add(a)
    s.add(c)
    s.observe(run_step(s).step_id, cost(5, 0))          # both prompts (nothing decodes yet)
    b = req(16384)
    s.add(b)
    pairs, chunk = [], None
    while b.num_cached < 16384:
        plan = run_step(s)
        prompt = sum(q.length for rid, q in zip(plan.request_ids, plan.batch.seqs)
                     if rid == b.request_id)
        t = cost(prompt, len(plan.batch.seqs) - (prompt > 0))
        s.observe(plan.step_id, t)
        if prompt:
            chunk = (prompt, t)
        elif chunk is not None:
            pairs.append((chunk[0], chunk[1] + t))
            chunk = None
    return pairs


def test_scheduler_keeps_the_streams_within_the_limit():
    """Cost model: a decode step of 2 streams 4 ms; a chunk step 2 ms + 10 µs per token (so
    256 tokens 4.56 ms, 128 3.28 ms). With the pacer at 2.0 the chunks settle on 128 (the
    largest bucket ≤ 4 ms) and every pair after the first probes keeps TPOT ≤ 2 × 4 ms; the
    static cap alone (512 tokens: 7.1 ms) breaks it — the bound is the pacer's doing."""
    def cost(prompt, decodes):
        return 0.002 + 1e-5 * prompt if prompt else 0.004

    paced = _drive(2.0, cost)
    # the first probe 512 / 8; then the line through it and the first prompts' 5-token step
    # (bucket 8) says 128, where the chunks stay (the last one: the prompt's rest)
    assert paced[0][0] == 64
    assert {n for n, _ in paced[1:-1]} == {128}
    assert all(t <= 2 * 0.004 + 1e-12 for _, t in paced)
    static = _drive(None, cost)
    assert {n for n, _ in static[:-1]} == {512}
    assert all(t > 2 * 0.004 for _, t in static[:-1])


class _TimedExecutor:
    """Every step 'runs' for a fixed time per kind (the engine's clock reads it): decode-only
    steps of the one stream 3 ms, any other 9 ms."""

    def __init__(self, clock):
        self.clock = clock

    def execute(self, plan):
        busy = len(plan.batch.seqs) > 1 or plan.batch.seqs[0].length > 1
        self.clock[0] += 0.009 if busy else 0.003
        return StepResult(token_ids=[7] * len(plan.sample_rows))


def test_engine_reports_each_step_time_to_the_pacer(monkeypatch):
    """LLMEngine.step times the executor's run and hands it to the scheduler's pacer: a
    decoding stream and a second prompt on mixed steps (split_mixed off): the decode-only
    steps are batch-1 samples, the steps carrying the prompt beside the decode mixed ones,
    the first prompt's solo step (nothing decoding) neither."""
    clock = [0.0]
    monkeypatch.setattr(engine_mod.time, "perf_counter", lambda: clock[0])
    eng = LLMEngine(_TimedExecutor(clock), load_tokenizer("tiny"),
                    EngineConfig(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=32,
                                 decode_slowdown_limit=4.0, prefill_tokens_while_decoding=8),
                    eos_ids=())
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eng.add_request(list(range(5, 12)), params)
    for _ in range(3):
        eng.step()                                  # the prompt, then 2 decode-only steps
    pacer = eng.scheduler.pacer
    assert pacer is not None and pacer.mixed
    assert pacer.decode_s == {1: pytest.approx(0.003)} and pacer.chunk_s == {}
    eng.add_request(list(range(5, 45)), params)     # 40 tokens beside the stream
    while eng.scheduler.waiting or any(r.in_prefill for r in eng.scheduler.running):
        eng.step()
    assert set(pacer.chunk_s) <= {1, 2, 4, 8} and pacer.chunk_s
    assert all(v == pytest.approx(0.009) for v in pacer.chunk_s.values())


def test_deployment_field_reaches_the_scheduler_and_refuses_one(tmp_path):
    from raydecode.actors.config import DeployConfigError, load_deploy_config
    p = tmp_path / "deploy.yaml"
    p.write_text("model: tiny\ndecode_slowdown_limit: 2.5\n")
    ecfg = load_deploy_config(p).engine_config(model_max_positions=4096)
    assert ecfg.decode_slowdown_limit == 2.5
    sch = Scheduler(ecfg.scheduler_config())
    assert sch.pacer is not None and sch.pacer.limit == 2.5
    p.write_text("model: tiny\n")
    assert Scheduler(load_deploy_config(p).engine_config(4096).scheduler_config()).pacer is None
    p.write_text("model: tiny\ndecode_slowdown_limit: 1.0\n")
    with pytest.raises(DeployConfigError, match="decode_slowdown_limit"):
        load_deploy_config(p)
