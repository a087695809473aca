"""The teacher-forced harness of tests/gpu/test_prefill_greedy_gpu.py on the CPU (both runs on
the reference kernels), so the GPU test's comparison is known to work and to fail:
- forced with its own greedy tokens, a run reproduces them and its own argmax and gaps;
- a prefill whose chunks lose the recurrent state handed over from the previous chunk (the
  bug class the GPU test guards: state hand-over between chunks) fails both of the GPU test's
  checks: its first-token logits are beyond TOL and it picks other tokens at positions whose
  reference top-2 gap is ≥ TIE (here: 0.12 relative, and non-tie positions that differ)."""
from __future__ import annotations

import torch

from raydecode.models import kda as kda_mod

from _prefill_forced import TIE, TOL, run_forced, tiny_model

torch.set_num_threads(1)
N = 12


def test_forced_with_its_own_tokens_reproduces_the_greedy_run():
    model, prompts = tiny_model("cpu")
    ref = run_forced(model, prompts[0], N)
    again = run_forced(model, prompts[0], N, forced=ref.tokens)
    assert ref.tokens == ref.argmax == again.argmax == again.tokens
    assert ref.gaps == again.gaps and torch.equal(ref.first_logits, again.first_logits)
    assert len(ref.tokens) == N and all(g >= 0 for g in ref.gaps)


def test_a_lost_state_hand_over_between_chunks_is_caught(monkeypatch):
    model, prompts = tiny_model("cpu")
    ref = run_forced(model, prompts[0], N)                      # 200 tokens: 3 chunks
    real = kda_mod.kda_chunked

    def forgetful(q, k, v, g, beta, scale, state, chunk_size=64):
        return real(q, k, v, g, beta, scale, torch.zeros_like(state), chunk_size)

    monkeypatch.setattr(kda_mod, "kda_chunked", forgetful)
    got = run_forced(model, prompts[0], N, forced=ref.tokens)
    wrong = [j for j, (a, b, gap) in enumerate(zip(got.argmax, ref.tokens, ref.gaps))
             if gap >= TIE and a != b]
    rel = float((got.first_logits - ref.first_logits).norm() / ref.first_logits.norm())
    # the GPU test's two checks: first-token logits within TOL, no non-tie position differs
    assert wrong and rel > TOL, (f"a broken prefill: first-token logits rel {rel:.2e}, "
                                 f"non-tie positions differing: {wrong}")
