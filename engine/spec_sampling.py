"""DSpark's sampling on the device: drafting and verification for a batch of verifying sequences,
counter-based like engine/sampling.py (no host generator, no host sync until the emitted ids).

For sequence b at output index n (its anchor is output token n - 1), draft j (0-based) becomes
output token n + j if accepted. Three noise streams of the request's seed s, each hashed with
the token index (engine/sampling.py `uniform`):
    draft    seed s ^ DRAFT_SALT,  index n + j: Gumbel noise of draft j's sample from q_j
    accept   seed s ^ ACCEPT_SALT, index n + j: the uniform u_j of draft j's acceptance test
    target   seed s,               index n + i: Gumbel noise of the correction / bonus sample
The target stream is the one a non-speculative step uses for token n + i.

Verification (speculative sampling; every emitted token is distributed as under p):
    accept draft j while u_j · q_j(d_j) ≤ p_j(d_j)   (probability min(1, p/q))
    a = number of leading accepted drafts
    emit d_0 … d_{a-1}, then x ~ norm(max(0, p_a − q_a)) if a < k (p_a where that is zero),
    else the bonus x ~ p_k.
Greedy rows accept while d_j = argmax p_j and emit argmax p_a: the non-speculative greedy
output exactly. p and q are the filtered distributions of the request's sampling parameters
(temperature, top-k, top-p), as the drafter sampled from q.
"""
from __future__ import annotations

import torch

from .sampling import GREEDY_EPS, SamplingRows, filter_batch, gumbel, uniform

DRAFT_SALT = 0x6A09E667F3BCC908        # distinct constants in the int64 range
ACCEPT_SALT = 0x3C6EF372FE94F82B


def salted(seed: torch.Tensor, salt: int) -> torch.Tensor:
    return seed ^ salt


def distributions(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """(B, L, V) logits of B rows' sequences -> (B, L, V) fp32 sampling distributions under each
    row's temperature / top-k / top-p (greedy rows: one-hot at the argmax)."""
    return distributions_t(logits, *rows.tensors(logits.device))


def distributions_t(logits: torch.Tensor, f: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """`distributions` on the rows' device tensors (SamplingRows.tensors: f (2, B) [temperature,
    top_p], i (3, B) [top_k, seed, counter]): no host value, capturable."""
    B, L, V = logits.shape
    temp = f[0]
    greedy = temp < GREEDY_EPS
    x = logits.float() / torch.where(greedy, torch.ones_like(temp), temp).view(B, 1, 1)
    x = filter_batch(x.reshape(B * L, V), f[1].repeat_interleave(L),
                     i[0].repeat_interleave(L)).view(B, L, V)
    p = torch.softmax(x, dim=-1)
    hot = torch.zeros_like(p).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy.view(B, 1, 1), hot, p)


def _seeds_index(rows: SamplingRows, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(seeds (B,), first-draft output index n (B,), greedy (B,) bool) of the rows."""
    f, i = rows.tensors(device)
    return i[1], i[2], f[0] < GREEDY_EPS


def draft_sample(logits: torch.Tensor, rows: SamplingRows, j: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, V) logits of draft position j -> (tokens (B,), q (B, V)): each row samples its
    filtered distribution with its draft-stream noise at output index n + j (greedy rows take
    the argmax; their q is one-hot). rows.counter holds each row's n."""
    return draft_sample_t(logits, *rows.tensors(logits.device), j)


def draft_sample_t(logits: torch.Tensor, f: torch.Tensor, i: torch.Tensor, j: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """`draft_sample` on the rows' device tensors (`distributions_t`): capturable."""
    seeds, n, greedy = i[1], i[2], f[0] < GREEDY_EPS
    q = distributions_t(logits.unsqueeze(1), f, i).squeeze(1)
    V = logits.shape[-1]
    tok = (torch.log(q) + gumbel(salted(seeds, DRAFT_SALT), n + j, V, logits.device)).argmax(-1)
    return torch.where(greedy, logits.argmax(-1), tok), q


def sample_drafts(base: torch.Tensor, bias, anchors: torch.Tensor, f: torch.Tensor,
                  i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, k, V) base logits, bias(prev (B,)) -> (B, V) the Markov bias, the rows' device
    tensors f, i (`distributions_t`) -> drafts (B, k), q (B, k, V): left to right, draft j
    sampled (`draft_sample_t`) from base_j + bias(d_{j-1}), d_{-1} = the anchor."""
    drafts, qs, prev = [], [], anchors
    for j in range(base.shape[1]):
        prev, q = draft_sample_t(base[:, j] + bias(prev), f, i, j)
        drafts.append(prev)
        qs.append(q)
    return torch.stack(drafts, 1), torch.stack(qs, 1)


def greedy_drafts(base: torch.Tensor, bias, anchors: torch.Tensor) -> torch.Tensor:
    """Every row greedy: (B, k, V) base logits, bias(prev (B,)) -> (B, V) the Markov bias ->
    drafts (B, k), d_j = argmax(base_j + bias(d_{j-1})), d_{-1} = the anchor. What
    `draft_sample` gives greedy rows, without their one-hot q."""
    drafts, prev = [], anchors
    for j in range(base.shape[1]):
        prev = (base[:, j] + bias(prev)).argmax(-1)
        drafts.append(prev)
    return torch.stack(drafts, 1)


def accept_greedy(drafts: torch.Tensor, target_logits: torch.Tensor):
    """Every row greedy: accept while d_j = argmax p_j, then the argmax where the first draft
    fails (or the bonus) -> as `verify`; the same tokens `verify` gives greedy rows."""
    B, k = drafts.shape
    best = target_logits.argmax(-1)                                          # (B, k+1)
    a = torch.cumprod((drafts == best[:, :k]).to(torch.int64), dim=1).sum(1)
    return synthetic(drafts, target_logits, a)


def accepts(u: torch.Tensor, p_d: torch.Tensor, q_d: torch.Tensor) -> torch.Tensor:
    """The acceptance test of each draft: u · q(d) ≤ p(d), q(d) > 0 (probability min(1, p/q))."""
    return (u * q_d <= p_d) & (q_d > 0)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(…, V) the distribution to sample after a rejection: norm(max(0, p − q)), p where the
    residual has no mass."""
    r = (p - q).clamp_min(0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(1e-30), p)


def verify(drafts: torch.Tensor, q: torch.Tensor, target_logits: torch.Tensor,
           rows: SamplingRows) -> tuple:
    """drafts (B, k), q (B, k, V) the draft distributions they were sampled from, target logits
    (B, k+1, V) -> (emitted (B, k+1) int64, -1 past each row's length; lengths (B,) in
    [1, k+1]). rows.counter: output index n of each row's first draft."""
    B, k = drafts.shape
    V = target_logits.shape[-1]
    dev = target_logits.device
    seeds, index, greedy = _seeds_index(rows, dev)
    p = distributions(target_logits, rows)                                   # (B, k+1, V)
    j = torch.arange(k, device=dev)
    p_d = p[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)              # (B, k)
    q_d = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    u = uniform(salted(seeds, ACCEPT_SALT).repeat_interleave(k),
                (index.unsqueeze(1) + j).reshape(-1), 1, dev).view(B, k)
    best = target_logits.argmax(-1)                                          # (B, k+1)
    ok = torch.where(greedy.unsqueeze(1), drafts == best[:, :k], accepts(u, p_d, q_d))
    a = torch.cumprod(ok.to(torch.int64), dim=1).sum(1)                      # (B,)
    dist = torch.cat([residual(p[:, :k], q), p[:, k:]], dim=1)               # (B, k+1, V)
    i = torch.arange(k + 1, device=dev)
    g = gumbel(seeds.repeat_interleave(k + 1), (index.unsqueeze(1) + i).reshape(-1), V, dev)
    x = (torch.log(dist) + g.view(B, k + 1, V)).argmax(-1)                   # (B, k+1)
    x = torch.where(greedy.unsqueeze(1), best, x)
    last = x.gather(1, a.unsqueeze(1)).squeeze(1)
    emitted = torch.where(j.unsqueeze(0) < a.unsqueeze(1), drafts, torch.full_like(drafts, -1))
    emitted = torch.cat([emitted, torch.full_like(drafts[:, :1], -1)], dim=1)
    emitted.scatter_(1, a.unsqueeze(1), last.unsqueeze(1))
    return emitted, a + 1


def synthetic(drafts: torch.Tensor, target_logits: torch.Tensor, accepted: torch.Tensor):
    """Benchmarks only: accept the first `accepted` (B,) drafts, then the target's argmax
    there (the emitted text is meaningless). -> as `verify`."""
    B, k = drafts.shape
    j = torch.arange(k, device=drafts.device)
    best = target_logits.argmax(-1)
    emitted = torch.where(j.unsqueeze(0) < accepted.unsqueeze(1), drafts,
                          torch.full_like(drafts, -1))
    emitted = torch.cat([emitted, torch.full_like(drafts[:, :1], -1)], dim=1)
    emitted.scatter_(1, accepted.unsqueeze(1), best.gather(1, accepted.unsqueeze(1)))
    return emitted, accepted + 1


__all__ = ["DRAFT_SALT", "ACCEPT_SALT", "accepts", "distributions", "distributions_t",
           "draft_sample", "draft_sample_t", "accept_greedy", "greedy_drafts", "residual",
           "salted", "sample_drafts", "synthetic", "verify"]
