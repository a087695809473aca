"""Speculative verification: greedy exactness, distribution preservation, synthetic mode."""
import pytest
import torch

from raydecode.engine.spec import (AcceptanceStats, SyntheticAcceptance, verify_greedy,
                                   verify_rejection)

V = 6
CHI2_CRIT_DF5_P001 = 20.515   # chi-square critical value, 5 degrees of freedom, alpha = 0.001


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    exp = probs * counts.sum()
    return float(((counts - exp) ** 2 / exp).sum())


def test_greedy_accepts_matching_prefix_then_corrects():
    logits = torch.full((4, 10), -5.0)
    best = [3, 7, 1, 9]
    for i, b in enumerate(best):
        logits[i, b] = 5.0
    assert verify_greedy([3, 7, 1], logits) == [3, 7, 1, 9]      # all accepted + bonus
    assert verify_greedy([3, 2, 1], logits) == [3, 7]            # mismatch at 2: emit target's 7
    assert verify_greedy([0, 7, 1], logits) == [3]


def _draws(rule, n=20000, seed=0):
    """Emitted first tokens over n trials: draft d ~ q, target p; returns counts (V,)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.tensor([[0.05, 0.30, 0.10, 0.25, 0.20, 0.10], [0.2] * 5 + [0.0]])
    q = torch.tensor([[0.40, 0.05, 0.20, 0.05, 0.10, 0.20]])
    counts = torch.zeros(V)
    for _ in range(n):
        d = int(torch.multinomial(q[0], 1, generator=g))
        counts[rule([d], q, p, g)[0]] += 1
    return counts, p[0]


def test_rejection_sampling_preserves_target_distribution():
    counts, p = _draws(verify_rejection)
    assert chi2(counts, p) < CHI2_CRIT_DF5_P001


def test_broken_acceptance_rule_is_caught_by_the_same_test():
    def accept_if_likely(drafts, q, p, g):      # accepts with p alone, no residual correction
        d = drafts[0]
        if float(torch.rand(1, generator=g)) < float(p[0, d]) / float(p[0].max()):
            return [d]
        return [int(torch.multinomial(p[0], 1, generator=g))]

    counts, p = _draws(accept_if_likely)
    assert chi2(counts, p) > CHI2_CRIT_DF5_P001


def test_two_drafts_joint_distribution_of_second_token():
    """Conditioned on the first emitted token being an accepted draft, the second is ~ p_2."""
    g = torch.Generator().manual_seed(3)
    q = torch.tensor([[0.5, 0.5, 0, 0, 0, 0], [0.1, 0.1, 0.5, 0.1, 0.1, 0.1]])
    p = torch.tensor([[0.5, 0.5, 0, 0, 0, 0], [0.3, 0.2, 0.1, 0.2, 0.1, 0.1],
                      [1 / 6] * 6])
    counts = torch.zeros(V)
    for _ in range(15000):
        d = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        out = verify_rejection(d, q, p, g)
        assert out[0] == d[0]                    # p_1 == q_1: first draft always accepted
        counts[out[1]] += 1
    assert chi2(counts, p[1]) < CHI2_CRIT_DF5_P001


@pytest.mark.parametrize("L,k", [(6.0, 7), (3.4, 5), (1.0, 3), (8.0, 7)])
def test_synthetic_acceptance_mean_within_tolerance(L, k):
    syn = SyntheticAcceptance(L, k, seed=11)
    stats = AcceptanceStats(k)
    logits = torch.randn(k + 1, 32)
    for _ in range(1000):
        out = syn.emit(list(range(k)), logits)
        assert out[:-1] == list(range(len(out) - 1))      # the earliest drafts are the accepted
        stats.record(len(out))
    assert abs(stats.mean_length - L) <= 0.05
    rates = stats.position_rates
    assert all(a >= b for a, b in zip(rates, rates[1:]))   # earlier positions accepted at least as often


def test_acceptance_bounds_are_enforced():
    with pytest.raises(ValueError, match="expected 1 <= L"):
        SyntheticAcceptance(9.0, 7)
    s = AcceptanceStats(3)
    with pytest.raises(ValueError, match="outside"):
        s.record(5)
