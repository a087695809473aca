"""The teacher-forced harness of tests/gpu/test_prefill_greedy_gpu.py on the CPU (every run on
the reference kernels), so the GPU test's comparisons are known to work and to fail:
- forced with its own greedy tokens, a run reproduces them and its own argmax and gaps;
- a prefill whose chunks lose the recurrent state handed over from the previous chunk (the
  bug class the GPU test guards) fails the fp32 test's checks (first-token logits beyond
  TOL_FP32, other tokens at positions whose reference top-2 gap is ≥ TIE_FP32) and the bf16
  test's (further from the fp32 ground truth than 2× the bf16 reference's noise)."""
from __future__ import annotations

import pytest
import torch

from raydecode.models import kda as kda_mod

from _numerics import rel_err
from _prefill_forced import (TIE_FP32, TOL_FP32, run_forced, tiny_model, upcast_,
                             within_bf16_noise)

torch.set_num_threads(1)
N = 12


def _forget_states(monkeypatch):
    real = kda_mod.kda_chunked

    def forgetful(q, k, v, g, beta, scale, state, chunk_size=64):
        return real(q, k, v, g, beta, scale, torch.zeros_like(state), chunk_size)

    monkeypatch.setattr(kda_mod, "kda_chunked", forgetful)


def test_forced_with_its_own_tokens_reproduces_the_greedy_run():
    model, prompts = tiny_model("cpu")
    ref = run_forced(model, prompts[0], N)
    again = run_forced(model, prompts[0], N, forced=ref.tokens)
    assert ref.tokens == ref.argmax == again.argmax == again.tokens
    assert ref.gaps == again.gaps and torch.equal(ref.first_logits, again.first_logits)
    assert len(ref.tokens) == N and all(g >= 0 for g in ref.gaps) and len(ref.rows) == N


def test_a_lost_state_hand_over_fails_the_fp32_checks(monkeypatch):
    model, prompts = tiny_model("cpu", torch.float32)
    ref = run_forced(model, prompts[0], N)                      # 200 tokens: 3 chunks
    _forget_states(monkeypatch)
    got = run_forced(model, prompts[0], N, forced=ref.tokens)
    wrong = [j for j, (a, b, gap) in enumerate(zip(got.argmax, ref.tokens, ref.gaps))
             if gap >= TIE_FP32 and a != b]
    first = rel_err(got.first_logits, ref.first_logits)
    assert wrong and first > TOL_FP32, (f"a broken prefill: first-token logits rel "
                                        f"{first:.2e}, non-tie positions differing: {wrong}")


@pytest.mark.parametrize("broken", [False, True])
def test_the_bf16_noise_check_passes_the_reference_and_fails_a_broken_prefill(broken,
                                                                               monkeypatch):
    model, prompts = tiny_model("cpu")
    ref16 = run_forced(model, prompts[0], N)
    with monkeypatch.context() as m:
        if broken:
            _forget_states(m)
        got16 = run_forced(model, prompts[0], N, forced=ref16.tokens)
    truth = run_forced(upcast_(model), prompts[0], N, forced=ref16.tokens)
    e_ref = [rel_err(a, b) for a, b in zip(ref16.rows, truth.rows)]
    e_got = [rel_err(a, b) for a, b in zip(got16.rows, truth.rows)]
    assert min(e_ref) > 0                        # bf16 is noisy: the bound is not vacuous
    assert within_bf16_noise(e_got, e_ref) is not broken, (e_got[0], e_ref[0])


def test_a_reordered_but_correct_prefill_passes_the_fp32_checks():
    """The fp32 bounds are not tighter than a correct path's rounding: the KDA chunk loop at
    16-token chunks instead of 64 (other sums, other order) passes both checks."""
    model, prompts = tiny_model("cpu", torch.float32)
    ref = run_forced(model, prompts[0], N)
    for m in model.modules():
        if isinstance(m, kda_mod.KDAAttention):
            m.chunk_size = 16
    got = run_forced(model, prompts[0], N, forced=ref.tokens)
    assert rel_err(got.first_logits, ref.first_logits) <= TOL_FP32
    assert all(a == b for a, b, gap in zip(got.argmax, ref.tokens, ref.gaps) if gap >= TIE_FP32)
    assert 0 < rel_err(got.first_logits, ref.first_logits)        # it did run other sums
