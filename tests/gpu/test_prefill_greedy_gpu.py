"""Greedy decoding after a GPU prefill equals the reference path's (issue 28), teacher-forced.

Models, bf16 on CUDA: the tiny K3 checkpoint's config (TP 1, random weights) and a K3 slice at
rank 0's TP16 shapes (the first 4 layers: KDA and MLA, solo rank, prompt ids on the rank's
vocab rows). Per prompt (chunked by a Scheduler at a 96-token step budget, so the prefill
takes several chunks and later chunks attend to earlier ones):
- the REFERENCE path (scripts/bench/prefill.py `use_kernels("reference")`: the kda_chunked
  loop, MLA's absorbed fp32 einsums, the MoE's reference chunks) prefills, then decodes N
  tokens greedily, keeping every position's top-2 logit gap;
- the PREFILL-KERNEL path (the defaults: fla-core's chunked KDA, MLA decompress + flash SDPA,
  the MoE prefill chunks) prefills the same prompt, then decodes fed the reference's tokens
  (teacher-forced: the context stays the reference's after a tie, so every position is a
  comparison, not only the ones before the first tie).
Every position whose reference top-2 gap is ≥ TIE must pick the reference's token; fewer than
half of the positions may be ties (the comparison is not vacuous: 26 of 72 on the tiny model's
reference run on the CPU); the first token's logits
(the prefill's own output) agree within TOL relative. A wrong cache write, state hand-over
between chunks or attention mask moves logits by O(their spread) and fails at non-tie
positions. The decode steps after the prefill run the same code on both paths, so what differs
is the prefill's caches and state.

`run_forced` is device-agnostic (the CPU runs it with both paths on the references: see
tests/cpu/test_prefill_greedy_harness.py). Needs CUDA and fla-core (the `gpu` extra)."""
from __future__ import annotations

import pytest
import torch

from raydecode.kernels import kda_prefill, moe_mxfp4
from raydecode.models.mla import MLAAttention
from raydecode.scripts.bench.prefill import use_kernels

from _prefill_forced import TIE, TOL, k3_slice, run_forced, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
N_TOKENS = 24


@pytest.mark.parametrize("which", ["tiny", "k3-slice"])
def test_greedy_after_gpu_prefill_equals_the_reference_path(which, monkeypatch):
    if _fla_missing():
        pytest.skip("fla-core is not installed: the KDA prefill kernel would be the reference")
    model, prompts = tiny_model("cuda") if which == "tiny" else k3_slice("cuda")
    with monkeypatch.context() as m:
        m.setattr(kda_prefill, "available", kda_prefill.available)     # restored after
        m.setattr(MLAAttention, "prefill_impl", MLAAttention.prefill_impl)
        m.setattr(moe_mxfp4, "PREFILL_PAIRS", moe_mxfp4.PREFILL_PAIRS)
        use_kernels("reference")
        refs = [run_forced(model, p, N_TOKENS) for p in prompts]
    total = ties = 0
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        got = run_forced(model, p, N_TOKENS, forced=ref.tokens)
        msg = f"{which} prompt {i}"
        first = float((got.first_logits - ref.first_logits).norm() / ref.first_logits.norm())
        assert first <= TOL, f"{msg}: first-token logits rel err {first:.2e} > {TOL}"
        for j, (a, b, gap) in enumerate(zip(got.argmax, ref.tokens, ref.gaps)):
            total += 1
            if gap < TIE:
                ties += 1
                continue
            assert a == b, (f"{msg}: position {j} picks {a}, the reference {b} (its top-2 gap "
                            f"{gap:.3f} ≥ {TIE})")
    assert ties * 2 < total, f"{which}: {ties} of {total} positions are ties"


def _fla_missing() -> bool:
    return kda_prefill._chunk_kda() is None
