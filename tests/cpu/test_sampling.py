import pytest
import torch

from raydecode.engine.request import RequestError, SamplingParams
from raydecode.engine.sampling import Sampler, filter_logits


def test_greedy_picks_argmax_for_every_row():
    torch.manual_seed(0)
    logits = torch.randn(5, 97)
    toks = Sampler().sample(logits, [SamplingParams(temperature=0.0)] * 5, [f"r{i}" for i in range(5)])
    assert toks == logits.argmax(-1).tolist()


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


def test_seeded_sampling_is_reproducible_and_batch_independent():
    torch.manual_seed(2)
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=1.0, seed=1234)
    a = [Sampler().sample(logits[1:2], [p], ["x"])[0] for _ in range(3)]
    assert len(set(a)) == 1
    s = Sampler()
    seq1 = [s.sample(logits, [p, p, p], ["a", "x", "b"])[1] for _ in range(20)]
    s2 = Sampler()
    seq2 = [s2.sample(logits[1:2], [p], ["x"])[0] for _ in range(20)]
    assert seq1 == seq2


def test_temperature_sampling_matches_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().unsqueeze(0)
    s = Sampler()
    p = SamplingParams(temperature=1.0, seed=7)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[s.sample(logits, [p], ["r"])[0]] += 1
    freq = counts / counts.sum()
    assert torch.allclose(freq, probs, atol=0.03), freq


@pytest.mark.parametrize("kw,needle", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"), ({"stop": ("",)}, "stop"),
    ({"seed": "x"}, "seed"), ({"seed": 2**64}, "seed")])
def test_bad_sampling_params_name_the_field(kw, needle):
    with pytest.raises(RequestError, match=needle):
        SamplingParams(**kw)
