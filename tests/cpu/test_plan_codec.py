"""The control plane's wire format (engine/plan_codec.py): plans and results round-trip exactly
(random plans of every shape the scheduler makes), speculative plans travel pickled, foreign or
other-version frames are refused by name, and a result frame never carries more than ids."""
import random
import struct

import pytest

from raydecode.engine import plan_codec as pc
from raydecode.engine.request import SamplingParams
from raydecode.engine.sampling import SamplingRows, StepResult
from raydecode.engine.scheduler import StepPlan
from raydecode.engine.spec_runner import SpecSeq, SpecStepPlan, SpecStepResult
from raydecode.models.cache import SeqSlice, StepBatch


def random_plan(rng: random.Random, step_id: int) -> StepPlan:
    seqs, at = [], 0
    for slot in rng.sample(range(200), rng.randint(1, 64)):
        n = rng.choice([1, 1, 1, rng.randint(2, 300)])
        seqs.append(SeqSlice(slot, at, n, rng.randint(0, 1 << 20)))
        at += n
    tables = {s.slot: rng.sample(range(5000), rng.randint(1, 40))
              for s in rng.sample(seqs, rng.randint(0, len(seqs)))}
    rows = [s.end - 1 for s in seqs]
    params = [None if rng.random() < 0.2 else SamplingParams(
        temperature=rng.choice([0.0, 0.7, 1.3]), top_p=rng.choice([1.0, 0.9, 1e-6]),
        top_k=rng.choice([0, 5]), logprobs=rng.choice([None, 0, 3])) for _ in rows]
    sampling = None if rng.random() < 0.2 else SamplingRows.build(
        params, [rng.randint(-(2**63), 2**63 - 1) for _ in rows],
        [rng.randint(0, 1 << 30) for _ in rows],
        [-1 if p is None or p.logprobs is None else p.logprobs for p in params])
    return StepPlan(step_id, StepBatch(seqs), [rng.randrange(163840) for _ in range(at)], rows,
                    tables, rng.sample([s.slot for s in seqs], rng.randint(0, len(seqs))),
                    rng.choice(["stock", "specialized"]), sampling=sampling)


def roundtrip_plan(frame: bytes) -> StepPlan:
    kind, step_id, n = pc.parse_header(frame, pc.PLAN_MAGIC)
    assert len(frame) == pc.HEADER.size + n
    return pc.decode_plan(kind, step_id, frame[pc.HEADER.size:])


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


@pytest.mark.parametrize("seed", range(20))
def test_random_plans_round_trip_exactly(seed):
    rng = random.Random(seed)
    plan = random_plan(rng, rng.randint(0, 2**40))
    got = roundtrip_plan(pc.encode_plan(plan))
    assert got.step_id == plan.step_id and got.path == plan.path
    assert got.batch.seqs == plan.batch.seqs and got.tokens == plan.tokens
    assert got.sample_rows == plan.sample_rows and got.block_tables == plan.block_tables
    assert got.reset_slots == plan.reset_slots and got.request_ids == []
    if plan.sampling is None:
        assert got.sampling is None
    else:
        a, b = plan.sampling, got.sampling
        assert b.seed == a.seed and b.counter == a.counter and b.top_k == a.top_k
        assert b.logprobs == a.logprobs
        # temperature and top_p travel as fp32: what the device sampler reads anyway
        assert b.temperature == tuple(map(_f32, a.temperature))
        assert b.top_p == tuple(map(_f32, a.top_p))


def test_a_decode_plan_is_small():
    plan = StepPlan(7, StepBatch.decode([3], [1000]), [42], [0], {}, [], "specialized",
                    sampling=SamplingRows.greedy(1))
    assert len(pc.encode_plan(plan)) < 128


def test_speculative_plans_and_results_travel_pickled():
    p = SamplingParams(temperature=0.0)
    plan = SpecStepPlan(3, StepBatch([SeqSlice(0, 0, 4, 9)]), [5, 0, 0, 0], [], {0: [1]}, [],
                        "stock", spec=[SpecSeq("r", 0, 0, 9, p, 11)], num_drafts=3)
    got = roundtrip_plan(pc.encode_plan(plan))
    assert type(got) is SpecStepPlan and got.spec == plan.spec and got.num_drafts == 3
    res = SpecStepResult(None, [[1, 2]], StepResult([4]))
    frame = pc.encode_result(3, res)
    kind, _, _ = pc.parse_header(frame, pc.RESULT_MAGIC)
    back = pc.decode_result(kind, frame[pc.HEADER.size:])
    assert back.emitted == [[1, 2]] and back.plain.token_ids == [4]


def test_results_round_trip_with_logprobs_and_failed_rows():
    res = StepResult([5, -1, 7], logprob=[-0.5, float("nan"), -2.0],
                     top_ids=[[5, 6], [], [7, 1]], top_logprobs=[[-0.5, -1.0], [], [-2.0, -3.0]],
                     failed=[None, "sampling failed: boom", None])
    frame = pc.encode_result(9, res)
    kind, step_id, _ = pc.parse_header(frame, pc.RESULT_MAGIC)
    back = pc.decode_result(kind, frame[pc.HEADER.size:])
    assert step_id == 9 and back.token_ids == [5, -1, 7] and back.failed == res.failed
    assert back.top_ids == [[5, 6], [-1, -1], [7, 1]]
    assert back.logprob[0] == -0.5 and back.top_logprobs[2] == [-2.0, -3.0]
    plain = pc.encode_result(1, StepResult(list(range(64))))
    assert len(plain) == pc.HEADER.size + 7 + 8 * 64          # ids only: no logits, ever


def test_foreign_and_other_version_frames_are_refused_by_name():
    frame = pc.encode_plan(StepPlan(1, StepBatch.decode([0], [1]), [1], [0], {}, []))
    with pytest.raises(pc.FrameError, match="magic b'RDPL'; expected b'RDRS'"):
        pc.parse_header(frame, pc.RESULT_MAGIC)
    other = frame[:4] + struct.pack("<H", pc.VERSION + 1) + frame[6:]
    with pytest.raises(pc.FrameError, match=f"version {pc.VERSION + 1}.*speaks version"):
        pc.parse_header(other, pc.PLAN_MAGIC)
    with pytest.raises(pc.FrameError, match="plan frame kind 9"):
        pc.decode_plan(9, 1, b"")
    assert pc.decode_plan(pc.STOP, -1, b"") is None
