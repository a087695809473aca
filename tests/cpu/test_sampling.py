import math

import pytest
import torch

from raydecode.engine import sampling
from raydecode.engine.request import RequestError, SamplingParams
from raydecode.engine.sampling import (SamplingRows, StepResult, filter_batch, filter_logits,
                                       sample, sample_isolated, uniform)


def _rows(params, seeds=None, counters=None, logprobs=None):
    n = len(params)
    return SamplingRows.build(params, seeds or [0] * n, counters or [0] * n, logprobs)


def _draw(logits, p, seed, counter):
    return int(sample(logits.unsqueeze(0), _rows([p], [seed], [counter])).tokens[0])


def test_greedy_picks_argmax_for_every_row():
    torch.manual_seed(0)
    logits = torch.randn(5, 97)
    out = sample(logits, _rows([SamplingParams(temperature=0.0)] * 5))
    assert out.tokens.tolist() == logits.argmax(-1).tolist()
    assert out.logprob is None and out.top_ids is None


def test_top_k_keeps_exactly_k_candidates():
    torch.manual_seed(1)
    x = torch.randn(200)
    out = filter_logits(x, SamplingParams(temperature=1.0, top_k=7))
    kept = torch.isfinite(out)
    assert int(kept.sum()) == 7
    assert set(torch.nonzero(kept).flatten().tolist()) == set(torch.topk(x, 7).indices.tolist())


def test_top_p_keeps_smallest_prefix_reaching_mass():
    x = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    out = filter_logits(x, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.isfinite(out).tolist() == [True, True, False, False]
    out = filter_logits(x, SamplingParams(temperature=1.0, top_p=0.81))
    assert torch.isfinite(out).tolist() == [True, True, True, False]


def test_batched_filter_applies_each_rows_own_rule():
    torch.manual_seed(3)
    x = torch.randn(4, 300)
    ps = [SamplingParams(top_k=5), SamplingParams(top_p=0.5), SamplingParams(top_k=40, top_p=0.3),
          SamplingParams()]
    got = filter_batch(x, torch.tensor([p.top_p for p in ps]), torch.tensor([p.top_k for p in ps]))
    for r, p in enumerate(ps):
        want = filter_logits(x[r], p)
        assert torch.equal(torch.isfinite(got[r]), torch.isfinite(want)), r
    assert bool(torch.isfinite(got[3]).all())            # no filter: every token stays


def test_seeded_sampling_is_reproducible_and_batch_independent():
    torch.manual_seed(2)
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = [_draw(logits[1], p, 1234, n) for n in range(20)]
    for n in range(20):
        rows = _rows([SamplingParams(temperature=0.7, seed=9), p, SamplingParams(top_k=3)],
                     [9, 1234, 55], [n + 3, n, 0])
        assert int(sample(logits, rows).tokens[1]) == alone[n]
    assert len(set(alone)) > 3                 # the counter moves the noise: not one token


def test_noise_is_an_exact_integer_hash_the_same_on_every_device():
    # a pure-Python model of the hash (exact integers): the tensor ops must agree bit for bit,
    # which is what makes CPU and GPU draw the same tokens from the same logits
    M = 0xFFFFFFFF

    def mix(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & M
        x ^= x >> 15
        x = (x * 0x846CA68B) & M
        return x ^ (x >> 16)

    for seed, counter in [(0, 0), (1234, 7), (-5, 3), (2**63 - 1, 2**20), (-(2**63), 1)]:
        lo, hi = seed & M, (seed >> 32) & M
        key = mix(mix(mix(lo) ^ hi) ^ counter)
        want = [((mix(mix((key + (v * 0x9E3779B9 & M)) & M) ^ key) >> 9) + 0.5) / 2**23
                for v in range(64)]
        got = uniform(torch.tensor([seed]), torch.tensor([counter]), 64, "cpu")[0]
        assert got.tolist() == pytest.approx(want, rel=0, abs=0), (seed, counter)


def test_seeds_beyond_int64_fold_to_their_low_64_bits():
    assert sampling.fold_seed(2**64 - 1) == -1 and sampling.fold_seed(2**63) == -(2**63)
    assert sampling.fold_seed(-3) == -3


def test_temperature_sampling_matches_distribution_chi_square():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    logits = probs.log().unsqueeze(0).expand(4000, -1).contiguous()
    p = SamplingParams(temperature=1.0)
    rows = _rows([p] * 4000, [11] * 4000, list(range(4000)))
    toks = sample(logits, rows).tokens
    counts = torch.bincount(toks, minlength=5).double()
    expected = probs.double() * 4000
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.47, (chi2, counts)        # p = 0.001 at 4 degrees of freedom


def test_temperature_and_top_k_shape_the_distribution():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log().unsqueeze(0).expand(3000, -1).contiguous()
    hot = sample(logits, _rows([SamplingParams(temperature=2.0)] * 3000, [5] * 3000,
                               list(range(3000)))).tokens
    # T = 2 flattens: p ∝ sqrt(probs)
    want = probs.sqrt() / probs.sqrt().sum()
    freq = torch.bincount(hot, minlength=4).double() / 3000
    assert torch.allclose(freq, want.double(), atol=0.03), freq
    top2 = sample(logits, _rows([SamplingParams(top_k=2)] * 3000, [5] * 3000,
                                list(range(3000)))).tokens
    assert set(top2.tolist()) == {0, 1}


def test_logprobs_are_the_models_log_softmax_with_top_alternatives():
    torch.manual_seed(4)
    logits = torch.randn(3, 40)
    rows = _rows([SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=1.0),
                  SamplingParams(temperature=0.0)], logprobs=[2, -1, 0])
    res = StepResult.to_host(sample(logits, rows))
    lsm = torch.log_softmax(logits, -1)
    assert res.token_ids[0] == int(logits[0].argmax())
    assert res.logprob[0] == pytest.approx(float(lsm[0, res.token_ids[0]]), abs=1e-6)
    top = torch.topk(lsm[0], 2)
    assert res.top_ids[0] == top.indices.tolist()
    assert res.top_logprobs[0] == pytest.approx(top.values.tolist(), abs=1e-6)


def test_one_row_that_cannot_be_sampled_fails_alone(monkeypatch):
    torch.manual_seed(5)
    logits = torch.randn(3, 30)
    real = sampling.gumbel

    def broken(seed, counter, V, device):          # row with counter 666 cannot be sampled
        if bool((counter == 666).any()):
            raise RuntimeError("probability tensor contains inf")
        return real(seed, counter, V, device)

    monkeypatch.setattr(sampling, "gumbel", broken)
    p = SamplingParams(temperature=1.0)
    rows = _rows([SamplingParams(temperature=0.0), p, p], [0, 1, 2], [0, 666, 4])
    res = sample_isolated(logits, rows)
    assert res.token_ids[0] == int(logits[0].argmax())
    assert res.token_ids[1] == -1 and "probability tensor" in res.failed[1]
    assert res.failed[0] is None and res.failed[2] is None and 0 <= res.token_ids[2] < 30


@pytest.mark.parametrize("kw,needle", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"), ({"stop": ("",)}, "stop"),
    ({"seed": "x"}, "seed"), ({"seed": 2**64}, "seed"),
    # hostile values that underflow in fp32 and used to fail the whole batch's step
    ({"top_p": 2.2e-313}, "top_p"), ({"top_p": 1e-300}, "top_p"),
    ({"temperature": 1e-300}, "temperature"), ({"temperature": 1e-3}, "temperature"),
    ({"temperature": math.nan}, "temperature"), ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"), ({"top_k": 2**63}, "top_k"), ({"top_k": 2**31}, "top_k")])
def test_bad_sampling_params_name_the_field(kw, needle):
    with pytest.raises(RequestError, match=needle):
        SamplingParams(**kw)


def test_smallest_accepted_values_sample_without_error():
    logits = torch.randn(2, 1000) * 30
    rows = _rows([SamplingParams(temperature=0.01, top_p=1e-6),
                  SamplingParams(temperature=100.0, top_k=1)])
    toks = sample(logits, rows).tokens
    assert toks[0] == logits[0].argmax() and toks[1] == logits[1].argmax()
