"""Greedy decoding after a GPU prefill equals the reference path's (issue 28), teacher-forced.

Models on CUDA: the tiny K3 checkpoint's config (TP 1, random weights) and a K3 slice at rank
0's TP16 shapes (the first 4 layers: KDA and MLA, solo rank, prompt ids on the rank's vocab
rows). Per prompt (chunked by a Scheduler at a 96-token step budget, so the prefill takes
several chunks and later chunks attend to earlier ones):
- the REFERENCE path (scripts/bench/prefill.py `use_kernels("reference")`: the kda_chunked
  loop, MLA's absorbed fp32 einsums, the MoE's reference chunks) prefills, then decodes N
  tokens greedily, keeping every position's logits and top-2 gap;
- the PREFILL-KERNEL path (fla-core's chunked KDA, MLA decompress + SDPA, the MoE prefill
  chunks) prefills the same prompt, then decodes fed the reference's tokens (teacher-forced:
  every position is a comparison, not only the ones before the first tie).

fp32 models (the equality check): every position whose reference top-2 gap is ≥ TIE_FP32 must
pick the reference's token, fewer than half may be ties, and the first token's logits agree
within TOL_FP32 — what is left between the paths is fla's TF32 dots (≈ 4e-4 on o) and the
order of the sums, where a wrong cache write, a lost state hand-over between chunks or a
wrong attention mask moves logits by O(their spread).

bf16 models (the served dtype): top-2 gaps of a random bf16 model are often below bf16's own
rounding noise, so equality would test the ties. The check is instead that the kernel path is
no further from the fp32 ground truth (the same weights upcast, reference path) than the bf16
reference path is: per position, ‖logits − fp32 logits‖ / ‖fp32 logits‖ of the kernel path ≤
2 × the bf16 reference's + 2e-3 (mean over the positions, and the first token's).

The decode steps after the prefill run the same code on both paths, so what differs is the
prefill's caches and state. `run_forced` is device-agnostic (the CPU runs it with both paths on
the references: tests/cpu/test_prefill_greedy_harness.py). Needs CUDA and fla-core."""
from __future__ import annotations

import pytest
import torch

from raydecode.kernels import kda_prefill, moe_mxfp4
from raydecode.models.mla import MLAAttention
from raydecode.scripts.bench.prefill import use_kernels

from _numerics import rel_err
from _prefill_forced import (BUDGET, TIE_FP32, TOL_FP32, k3_slice, run_forced, tiny_model,
                             upcast_, within_bf16_noise)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
N_TOKENS = 24


def _model(which: str, dtype: torch.dtype):
    """The case's model and prompts on CUDA (skips without fla-core: the KDA prefill kernel
    would be the reference, and both paths the same)."""
    if kda_prefill._chunk_kda() is None:
        pytest.skip("fla-core is not installed: the KDA prefill kernel would be the reference")
    return tiny_model("cuda", dtype) if which == "tiny" else k3_slice("cuda", dtype=dtype)


def _reference_runs(model, prompts, monkeypatch, forced=None, budget=BUDGET):
    with monkeypatch.context() as m:
        m.setattr(kda_prefill, "available", kda_prefill.available)     # restored after
        m.setattr(MLAAttention, "prefill_impl", MLAAttention.prefill_impl)
        m.setattr(moe_mxfp4, "PREFILL_PAIRS", moe_mxfp4.PREFILL_PAIRS)
        m.setattr(moe_mxfp4, "GROUPED_PAIRS", moe_mxfp4.GROUPED_PAIRS)
        use_kernels("reference")
        return [run_forced(model, p, N_TOKENS, forced=None if forced is None else f.tokens,
                           budget=budget)
                for p, f in zip(prompts, forced or [None] * len(prompts))]


# (model, step budget): at 96 tokens K3's top-16 makes 1,536 (token, expert) pairs, below the
# MoE's PREFILL_PAIRS; at 160 a chunk of 131 or 160 tokens (2,096 / 2,560 pairs) runs the
# prefill MoE kernels (kernels/moe_mxfp4.py `prefill_config`: the swapped-operand kernels);
# grouped: those chunks on the grouped bf16 experts instead (GROUPED_PAIRS at PREFILL_PAIRS,
# kernels/moe_grouped.py): shipped off (slower on the H100), the prefill bench's A/B path;
# experts: the prefill chunks' expert kernels (PREFILL_EXPERTS, None: the shipped kind; the
# "ogs" kinds with OGS_MIN_LOAD 0, so the slice's small chunks run matmul_ogs).
@pytest.mark.parametrize("which,budget,grouped,experts",
                         [("tiny", BUDGET, 0, None), ("k3-slice", BUDGET, 0, None),
                          ("k3-slice", 160, 0, None),
                          ("k3-slice", 160, moe_mxfp4.PREFILL_PAIRS, None)]
                         + [("k3-slice", 160, 0, x) for x in moe_mxfp4.PREFILL_EXPERT_KINDS
                            if x != moe_mxfp4.PREFILL_EXPERTS])
def test_greedy_after_gpu_prefill_equals_the_reference_path_fp32(which, budget, grouped,
                                                                 experts, monkeypatch):
    model, prompts = _model(which, torch.float32)
    refs = _reference_runs(model, prompts, monkeypatch, budget=budget)
    total = ties = 0
    with monkeypatch.context() as m:
        m.setattr(MLAAttention, "prefill_impl", "sdpa")      # "auto" keeps fp32 on the reference
        m.setattr(moe_mxfp4, "GROUPED_PAIRS", grouped)
        m.setattr(moe_mxfp4, "PREFILL_EXPERTS", experts or moe_mxfp4.PREFILL_EXPERTS)
        m.setattr(moe_mxfp4, "OGS_MIN_LOAD", 0)     # the slice's chunks are few pairs per expert
        for i, (p, ref) in enumerate(zip(prompts, refs)):
            got = run_forced(model, p, N_TOKENS, forced=ref.tokens, budget=budget)
            msg = f"{which} fp32 budget {budget} experts {experts} prompt {i}"
            first = rel_err(got.first_logits, ref.first_logits)
            assert first <= TOL_FP32, f"{msg}: first-token logits rel err {first:.2e} > {TOL_FP32}"
            for j, (a, b, gap) in enumerate(zip(got.argmax, ref.tokens, ref.gaps)):
                total += 1
                if gap < TIE_FP32:
                    ties += 1
                    continue
                assert a == b, (f"{msg}: position {j} picks {a}, the reference {b} (its top-2 "
                                f"gap {gap:.3f} ≥ {TIE_FP32})")
    assert ties * 2 < total, f"{which}: {ties} of {total} positions are ties"


@pytest.mark.parametrize("which", ["tiny", "k3-slice"])
def test_gpu_prefill_bf16_is_within_the_bf16_reference_noise(which, monkeypatch):
    model, prompts = _model(which, torch.bfloat16)
    ref16 = _reference_runs(model, prompts, monkeypatch)
    got16 = [run_forced(model, p, N_TOKENS, forced=r.tokens) for p, r in zip(prompts, ref16)]
    upcast_(model)                                    # the same weights, fp32: ground truth
    truth = _reference_runs(model, prompts, monkeypatch, forced=ref16)
    for i, (r16, g16, t) in enumerate(zip(ref16, got16, truth)):
        e_ref = [rel_err(a, b) for a, b in zip(r16.rows, t.rows)]
        e_got = [rel_err(a, b) for a, b in zip(g16.rows, t.rows)]
        msg = (f"{which} bf16 prompt {i}: kernel path vs fp32 first {e_got[0]:.2e} mean "
               f"{sum(e_got) / len(e_got):.2e}; bf16 reference first {e_ref[0]:.2e} mean "
               f"{sum(e_ref) / len(e_ref):.2e}")
        assert within_bf16_noise(e_got, e_ref), msg


def test_gpu_final_mix_on_the_sample_rows_equals_every_rows():
    """The served runner mixes and normalises only the sample rows (ModelRunner.final_rows):
    on CUDA, bf16, the K3 TP16 slice (the stock path's fused AttnRes bank, whose snapshots are
    strided views), forward(rows=...) gives those rows of the every-row forward within one
    bf16 rounding (a row mixed from the wrong tokens or snapshots is O(1) off)."""
    model, prompts = _model("k3-slice", torch.bfloat16)
    toks = torch.tensor(prompts[-1], device="cuda")
    T = toks.shape[0]
    with torch.inference_mode():
        full = model(toks)
        for rows in ([T - 1], [0, T // 2, T - 1]):
            idx = torch.tensor(rows, device="cuda")
            got = model(toks, rows=idx)
            want = full.index_select(0, idx)
            err = rel_err(got.float(), want.float())
            assert err <= 8e-3, f"rows {rows}: rel err {err:.2e} of the every-row forward's"
