"""The model's specialized KDA decode runs the fused op (kernels/kda_decode.py `kda_decode`,
its PyTorch reference on CPU) over the layer's slot pool: a multi-step decode equals the stock
path (logits and caches, test_specialized.py's tolerances), the op is really called (a spy that
forwards to the real function), and the per-sequence loop still handles what the op cannot: a
sequence at pos 0 (stale slot contents), a speculative observer, an unsupported head_dim.

Most cases step one KDA layer (`layer=True`: both paths get the same input x, so only the KDA
math differs). Whole-model comparisons use fixed seeds: in bf16 the tiny model's MoE top-k can
flip on a near-tie between the paths' roundings (seen with the fast path disabled too), which
no tolerance covers."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from raydecode.engine.spec_runner import KDARollback
from raydecode.kernels import kda_decode as kda_decode_op
from raydecode.kernels.settings import DecodeOptions
from raydecode.models.cache import SeqSlice, StepBatch
from raydecode.models.config import load_config
from raydecode.models.k3 import K3ForCausalLM, init_random_, make_caches

from _numerics import TOL as NUM_TOL
from _numerics import max_rel_err

torch.set_num_threads(1)

TOL = {torch.float32: NUM_TOL["fp32_path"], torch.bfloat16: NUM_TOL["bf16_path"]}     # test_specialized.py, max-abs relative
NUM_SLOTS, SENTINEL = 8, 7.0
PATHS = ("stock", "specialized")


def _cfg(name: str):
    """tiny; `small`: tiny with 2 heads × 32, conv width 2 and the low-rank output gate;
    `odd_dim`: head_dim 24, which the fused op does not take (the loop runs)."""
    cfg = load_config("tiny")
    kda = {"tiny": {}, "small": dict(num_heads=2, head_dim=32, conv_size=2,
                                     use_full_rank_gate=False),
           "odd_dim": dict(head_dim=24)}[name]
    return dataclasses.replace(cfg, kda=dataclasses.replace(cfg.kda, **kda))


# Whole models are compared at bf16 tolerance here; the fused specialized MoE block's
# re-association (tests/cpu/test_moe_fused.py) is not this file's subject: the unfused block.
UNFUSED_MOE = DecodeOptions(moe_fused=False)


@pytest.fixture
def spy(monkeypatch):
    """Counts calls of the module attribute the model calls; forwards to the real op."""
    calls = []
    real = kda_decode_op.kda_decode

    def counting(*a, **kw):
        calls.append(kw["slots"].tolist())
        return real(*a, **kw)

    monkeypatch.setattr(kda_decode_op, "kda_decode", counting)
    return calls


class Pair:
    """One model, a stock and a specialized cache set stepped with the same inputs: the whole
    model (random tokens -> logits) or, with layer=True, its first KDA layer alone (random
    hidden states -> layer output)."""

    def __init__(self, cfg, dtype, seed=11, layer=False):
        self.cfg, self.dtype = cfg, dtype
        self.model = init_random_(K3ForCausalLM(cfg, dtype=dtype, options=UNFUSED_MOE),
                                  seed=seed)
        self.layer = self.model.model.layers[cfg.kda_layer_ids[0]].self_attn if layer else None
        self.caches = {p: make_caches(cfg, self.model.par, NUM_SLOTS, 32, 4, dtype) for p in PATHS}
        for c in self.caches.values():
            for s in range(NUM_SLOTS):
                c.mla.block_tables[s] = [4 * s + j for j in range(4)]
            c.kda.conv.fill_(SENTINEL)      # slots never stepped must keep this
            c.kda.rec.fill_(SENTINEL)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.kda_layers = 1 if layer else len(cfg.kda_layer_ids)

    def _run(self, inp, seqs, caches, path):
        if self.layer is not None:
            return self.layer(inp, StepBatch(seqs), caches, path)
        return self.model.compute_logits(self.model(inp, StepBatch(seqs), caches, path))

    def step(self, seqs: list[SeqSlice], observer=None) -> dict[str, torch.Tensor]:
        T = sum(s.length for s in seqs)
        if self.layer is not None:
            inp = torch.randn(T, self.cfg.hidden_size, generator=self.gen).to(self.dtype)
        else:
            inp = torch.randint(0, self.cfg.vocab_size, (T,), generator=self.gen)
        out = {}
        with torch.inference_mode():
            for p in PATHS:
                c = self.caches[p]
                c.kda_observer = observer[p] if observer else None
                try:
                    out[p] = self._run(inp, seqs, c, p)
                finally:
                    c.kda_observer = None
        return out

    def check(self, out, used: set[int]):
        tol = TOL[self.dtype]
        assert max_rel_err(out["specialized"], out["stock"]) < tol
        s, p = self.caches["stock"].kda, self.caches["specialized"].kda
        u = sorted(used)
        assert max_rel_err(p.rec[:, u], s.rec[:, u]) < tol
        assert max_rel_err(p.conv[:, u].float(), s.conv[:, u].float()) < tol
        rest = [i for i in range(NUM_SLOTS) if i not in used]
        assert (p.rec[:, rest] == SENTINEL).all() and (p.conv[:, rest] == SENTINEL).all()


def _decode(slots, positions) -> list[SeqSlice]:
    return StepBatch.decode(slots, positions).seqs


def _prefill(pair: Pair, slots: list[int], lengths: list[int]) -> list[int]:
    """Prefill each slot (a chunked multi-token step: the loop) -> next positions."""
    seqs, start = [], 0
    for s, n in zip(slots, lengths):
        seqs.append(SeqSlice(s, start, n, 0))
        start += n
    pair.check(pair.step(seqs), set(slots))
    return list(lengths)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["tiny", "small"])
def test_layer_decode_equals_stock_on_scattered_slots(name, dtype, spy):
    pair = Pair(_cfg(name), dtype, layer=True)
    slots = [6, 1, 4]                                  # unsorted, non-contiguous in the pool
    pos = _prefill(pair, slots, [5, 2, 3])
    assert spy == []                                   # prefill: the per-sequence loop
    for step in range(4):
        pair.check(pair.step(_decode(slots, pos)), set(slots))
        pos = [p + 1 for p in pos]
        assert spy == [slots] * (step + 1)             # the op, slots in token order
    # subsets of the slots in other orders (seqs listed in start order, as StepBatch wants)
    for sub in ([4, 6], [1], [4, 1, 6]):
        at = [slots.index(s) for s in sub]
        pair.check(pair.step(_decode(sub, [pos[i] for i in at])), set(slots))
        for i in at:
            pos[i] += 1
        assert spy[-1] == sub


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_model_decode_equals_stock(dtype, spy):
    """Every KDA layer of the tiny model takes the op on each decode step."""
    pair = Pair(_cfg("tiny"), dtype)
    slots = [6, 1, 4]
    pos = _prefill(pair, slots, [5, 2, 3])
    assert spy == []
    for step in range(3):
        pair.check(pair.step(_decode(slots, pos)), set(slots))
        pos = [p + 1 for p in pos]
        assert spy == [slots] * pair.kda_layers * (step + 1)


def test_sequence_at_pos_0_takes_the_loop_and_ignores_stale_slot(spy):
    """Slot 3 holds a finished sequence's state; a new sequence starting there in a decode-only
    batch (pos 0, length 1) must see zeros: the whole batch runs the loop, then the fast path
    resumes once every sequence has history."""
    pair = Pair(_cfg("tiny"), torch.bfloat16, layer=True)
    pos = _prefill(pair, [2, 3], [4, 3])
    slots = [2, 3]
    pair.check(pair.step(_decode(slots, pos)), {2, 3})               # slot 3 now "stale"
    assert spy == [slots]
    row = pair.caches["specialized"].kda_index[pair.layer.layer_idx]
    for c in pair.caches.values():      # a stale state far from zero: reading it would show
        assert c.kda.rec[row, 3].abs().max() > 0.1 and c.kda.conv[row, 3].abs().max() > 0.1
    pair.check(pair.step(_decode(slots, [pos[0] + 1, 0])), {2, 3})  # slot 3 restarts
    assert spy == [slots]                                           # the loop ran
    pair.check(pair.step(_decode(slots, [pos[0] + 2, 1])), {2, 3})
    assert spy == [slots] * 2                                       # fast again


def test_observer_set_keeps_the_loop_and_the_observer_sees_every_layer(spy):
    """A speculative verify step (engine/spec_runner.py) needs the per-token conv input and
    q, k, v, g, β for rollback: with an observer the fused op is not used."""
    pair = Pair(_cfg("tiny"), torch.bfloat16)
    slots = [5, 0]
    pos = _prefill(pair, slots, [3, 4])
    obs = {p: KDARollback(set(slots)) for p in PATHS}
    pair.check(pair.step(_decode(slots, pos), observer=obs), set(slots))
    assert spy == []
    rows = set(range(pair.kda_layers))
    for p in PATHS:
        assert set(obs[p].records) == {(r, s) for r in rows for s in slots}


def test_unsupported_head_dim_takes_the_loop(spy):
    pair = Pair(_cfg("odd_dim"), torch.bfloat16, layer=True)
    assert pair.cfg.kda.head_dim not in kda_decode_op.HEAD_DIMS
    slots = [1, 7]
    pos = _prefill(pair, slots, [2, 2])
    pair.check(pair.step(_decode(slots, pos)), set(slots))
    assert spy == []


def test_cacheless_specialized_forward_takes_the_loop(spy):
    cfg = _cfg("tiny")
    model = init_random_(K3ForCausalLM(cfg, dtype=torch.bfloat16, options=UNFUSED_MOE), seed=3)
    toks = torch.randint(0, cfg.vocab_size, (1,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        a = model(toks, path="specialized")
        b = model(toks, path="stock")
    assert spy == [] and max_rel_err(a, b) < TOL[torch.bfloat16]
