"""DSpark's device sampler (engine/spec_sampling.py): 100,000 verifying sequences with fixed draft
and target distributions on a small vocabulary, drafts drawn from q with the draft stream; the
first emitted token is distributed as the target p (chi-square), the second as p as well; the
same test fails when the acceptance rule or the residual is perturbed; greedy rows emit exactly
what host greedy verification does."""
import pytest
import torch

from raydecode.engine import spec_sampling as S
from raydecode.engine.request import SamplingParams
from raydecode.engine.sampling import SamplingRows
from raydecode.engine.spec import verify_greedy

N, K, V = 100_000, 3, 6
CHI2_DF5_P001 = 20.52
Q = torch.tensor([[0.30, 0.30, 0.20, 0.10, 0.05, 0.05],
                  [0.10, 0.10, 0.10, 0.30, 0.30, 0.10],
                  [0.50, 0.10, 0.10, 0.10, 0.10, 0.10]])
P = torch.tensor([[0.10, 0.40, 0.15, 0.15, 0.10, 0.10],
                  [0.25, 0.05, 0.30, 0.10, 0.20, 0.10],
                  [0.05, 0.05, 0.40, 0.20, 0.20, 0.10],
                  [0.20, 0.20, 0.20, 0.20, 0.10, 0.10]])


def rows(n, temperature=1.0, counter=0):
    p = SamplingParams(temperature=temperature)
    return SamplingRows.build([p] * n, list(range(7, 7 + n)), [counter] * n)


def run():
    r = rows(N)
    drafts, qs = [], []
    for j in range(K):
        tok, q = S.draft_sample(Q[j].log().expand(N, V), r, j)
        drafts.append(tok)
        qs.append(q)
    drafts, q = torch.stack(drafts, 1), torch.stack(qs, 1)
    assert torch.allclose(q[0], Q, atol=1e-6)                       # softmax(log q) = q
    return S.verify(drafts, q, P.log().expand(N, K + 1, V), r), drafts


def chi2(tokens, probs):
    counts = torch.bincount(tokens, minlength=V).double()
    exp = probs.double() * counts.sum()
    return float(((counts - exp) ** 2 / exp).sum())


def test_drafts_follow_q_and_emitted_tokens_follow_p():
    (emitted, lengths), drafts = run()
    assert chi2(drafts[:, 0], Q[0]) < CHI2_DF5_P001                 # the draft stream samples q
    assert chi2(emitted[:, 0], P[0]) < CHI2_DF5_P001                # first emitted token ~ p_0
    two = lengths >= 2
    # the token at position 1, where the first draft was accepted: also ~ p_1 (p does not
    # depend on the prefix here)
    assert chi2(emitted[two, 1], P[1]) < CHI2_DF5_P001
    assert bool(((lengths >= 1) & (lengths <= K + 1)).all())
    assert bool((emitted.gather(1, (lengths - 1).unsqueeze(1)) >= 0).all())
    mean_accept = float((lengths - 1).double().mean())
    # P(accept draft 0) = Σ min(p, q) = 0.6 here: the rule is the standard one
    assert abs(float((lengths >= 2).double().mean()) - float(torch.minimum(P[0], Q[0]).sum())) \
        < 0.01 and mean_accept > 0


def test_perturbed_acceptance_rule_fails_the_same_test(monkeypatch):
    monkeypatch.setattr(S, "accepts", lambda u, p, q: (u * q <= 1.5 * p) & (q > 0))
    (emitted, _), _ = run()
    assert chi2(emitted[:, 0], P[0]) > CHI2_DF5_P001


def test_sampling_p_instead_of_the_residual_fails_the_same_test(monkeypatch):
    monkeypatch.setattr(S, "residual", lambda p, q: p)
    (emitted, _), _ = run()
    assert chi2(emitted[:, 0], P[0]) > CHI2_DF5_P001


def test_greedy_rows_emit_what_host_greedy_verification_does():
    g = torch.Generator().manual_seed(3)
    B, k, V2 = 64, 5, 50
    logits = torch.randn(B, k + 1, V2, generator=g)
    best = logits.argmax(-1)
    drafts = torch.where(torch.rand(B, k, generator=g) < 0.6, best[:, :k],
                         torch.randint(0, V2, (B, k), generator=g))
    q = torch.zeros(B, k, V2).scatter_(-1, drafts.unsqueeze(-1), 1.0)
    emitted, lengths = S.verify(drafts, q, logits, rows(B, temperature=0.0))
    for b in range(B):
        want = verify_greedy(drafts[b].tolist(), logits[b])
        assert emitted[b, :lengths[b]].tolist() == want
        assert bool((emitted[b, lengths[b]:] == -1).all())


def test_synthetic_accepts_the_given_count_then_the_targets_argmax():
    logits = torch.randn(3, 5, 20)
    drafts = torch.randint(0, 20, (3, 4))
    emitted, lengths = S.synthetic(drafts, logits, torch.tensor([0, 2, 4]))
    assert lengths.tolist() == [1, 3, 5]
    assert emitted[1, :2].tolist() == drafts[1, :2].tolist()
    assert int(emitted[2, 4]) == int(logits[2, 4].argmax()) and int(emitted[0, 1]) == -1
