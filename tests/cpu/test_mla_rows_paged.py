"""The stock MLA layer's one-token sequences through the paged decode ops (models/mla.py
`_rows_paged`: kernels/mla_decode.py `mla_absorb` + `mla_attention` + bf16(o_lat)·W_uv, the
specialized step's kernels on CUDA bf16 with RAYDECODE_STOCK_FUSED on). Here, on the CPU, the
ops run their PyTorch references and the route is forced on (`stock_fused` patched for the MLA
module only): the routing is what is tested — which rows go there, in which order, the decode
rows of a mixed step written back at their rows, the prefill rows untouched by it, one paging
build per step — against the same steps with the route off (the absorbed fp32 math). bf16
model: the two differ by the paged route's roundings (q_abs and o_lat to bf16)."""
from __future__ import annotations

import pytest
import torch

from raydecode.models import mla as mla_mod
from raydecode.models.cache import SeqSlice, StepBatch
from raydecode.models.mla import MLAAttention

from _numerics import rel_err
from _prefill_forced import clone_caches
from _stock_steps import PROMPTS, prefilled_tiny

torch.set_num_threads(1)
BS = 8
TOL = 3e-2           # bf16 q_abs / o_lat roundings against the fp32 absorbed math


@pytest.fixture(scope="module")
def setup():
    return prefilled_tiny(torch.bfloat16, block_size=BS)


def _step(model, base, seqs, tokens, paged: bool, monkeypatch, ran):
    caches = clone_caches(base)
    with monkeypatch.context() as m:
        m.setattr(mla_mod, "stock_fused", lambda x: paged and x.dtype == torch.bfloat16)
        orig = MLAAttention._rows_paged
        m.setattr(MLAAttention, "_rows_paged", lambda self, q, dec, *a: (
            ran.append(tuple(s.slot for s in dec)), orig(self, q, dec, *a))[1])
        with torch.inference_mode():
            out = model(tokens, StepBatch(seqs), caches)
    return out, caches


@pytest.mark.parametrize("chunk,impl,order", [(0, "auto", (3, 0, 2, 1)),
                                              (9, "auto", (3, 0, 2, 1)),
                                              (9, "sdpa", (1, 3)), (0, "auto", (2,))])
def test_paged_decode_rows_match_the_absorbed_math(setup, chunk, impl, order, monkeypatch):
    model, base, V = setup
    monkeypatch.setattr(MLAAttention, "prefill_impl", impl)
    g = torch.Generator().manual_seed(len(order) + chunk)
    dec = [SeqSlice(s, i, 1, PROMPTS[s]) for i, s in enumerate(order)]
    seqs = dec + ([SeqSlice(4, len(dec), chunk, PROMPTS[4])] if chunk else [])
    tokens = torch.randint(0, V, (len(dec) + chunk,), generator=g)
    ran_on, ran_off = [], []
    got, c_on = _step(model, base, seqs, tokens, True, monkeypatch, ran_on)
    want, c_off = _step(model, base, seqs, tokens, False, monkeypatch, ran_off)
    n_mla = sum(isinstance(layer.self_attn, MLAAttention) for layer in model.model.layers)
    assert ran_off == [] and ran_on == [order] * n_mla          # every decode row, in order
    assert torch.isfinite(got).all()
    for s in seqs:
        assert rel_err(got[s.start:s.end].float(), want[s.start:s.end].float()) < TOL, s
    # the route only reads the pool: the first MLA layer (its input the same on both) wrote
    # the same rows; later layers' rows follow the first's output
    assert torch.equal(c_on.mla.pool[0], c_off.mla.pool[0])


def test_one_paging_build_per_step(setup, monkeypatch):
    """`decode_meta` builds the decode rows' paging once for all MLA layers of a step (the
    sub-batch is memoized per step), and a new step builds it anew."""
    model, base, V = setup
    built = []
    orig = mla_mod.host_to_device
    monkeypatch.setattr(mla_mod, "host_to_device", lambda t, d: (built.append(1), orig(t, d))[1])
    dec = [SeqSlice(s, i, 1, PROMPTS[s]) for i, s in enumerate((0, 1))]
    tokens = torch.tensor([3, 4])
    for step in range(2):
        _step(model, base, dec, tokens, True, monkeypatch, [])
        assert len(built) == step + 1
