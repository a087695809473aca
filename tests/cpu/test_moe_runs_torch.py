"""`moe_runs_torch` (kernels/moe_mxfp4.py): the runs and chunks of the stock grouped MoE for any
number of pairs with library ops only (past 1024 pairs the one-program Triton sort compiled for
seconds to minutes per new power of two, on the request path). Against a plain-Python model of
the runs kernel's contract, exact, on uniform and skewed routings of 1 to 20,000 pairs."""
import dataclasses
import random

import pytest
import torch

from raydecode.kernels import moe_mxfp4 as M


def reference(ids: list[int], E: int, bm: int = M.BLOCK_M):
    """(pairs, sorted_e, run starts + [P], chunks [(start, end)]) of the runs kernel."""
    P = len(ids)
    pairs = sorted(range(P), key=lambda p: (ids[p], p))
    se = [ids[p] for p in pairs]
    starts = [i for i in range(P) if i == 0 or se[i] != se[i - 1]]
    bounds = starts + [P]
    chunks = []
    for a, b in zip(bounds, bounds[1:]):
        chunks += [(s, min(s + bm, b)) for s in range(a, b, bm)]
    return pairs, se, bounds, chunks


@pytest.mark.parametrize("T,k,E,skew", [(1, 1, 8, False), (3, 2, 896, False), (64, 16, 896, False),
                                        (300, 16, 896, True), (1250, 16, 896, False),
                                        (97, 8, 4, True)])
@pytest.mark.parametrize("bm", [M.BLOCK_M, 64])
def test_runs_match_the_kernel_contract(T, k, E, skew, bm):
    rng = random.Random(T * 1000 + k)
    hot = rng.sample(range(E), min(E, 5))
    ids = [[rng.choice(hot) if skew and rng.random() < 0.7 else rng.randrange(E)
            for _ in range(k)] for _ in range(T)]
    flat = [e for row in ids for e in row]
    pairs, se, bounds, chunks = reference(flat, E, bm)
    out = M.moe_runs_torch(torch.tensor(ids, dtype=torch.int32), E, bm)
    p, s, rs, nr, cs, ce, nc = (t.tolist() for t in out)
    P = len(flat)
    assert all(t.dtype == torch.int32 for t in out)
    assert p == pairs and s == se
    assert len(rs) == min(P, E) + 1 and nr == [len(bounds) - 1] and rs[:len(bounds)] == bounds
    assert len(cs) == len(ce) == M.max_chunks(P, E, bm) and nc == [len(chunks)]
    assert list(zip(cs, ce))[:len(chunks)] == chunks


def test_prefill_steps_get_the_prefill_config():
    """From PREFILL_PAIRS pairs the config is the prefill one (128-pair chunks on the swapped
    kernels, PREFILL_DECODE's decode), below it the decode table's (16-pair chunks,
    unswapped)."""
    E, I, L = 896, 192, 3584
    small = M.default_config(M.PREFILL_PAIRS - 1, E, I, L)
    assert small.block_m == M.BLOCK_M and not small.swap_ab
    cfg = M.default_config(M.PREFILL_PAIRS, E, I, L)
    assert cfg.block_m == 128 and cfg.swap_ab and cfg.decode == M.PREFILL_DECODE == "x2"
    assert cfg.split_gate_up and cfg.tile_major and cfg.gate_up_bk == 128
    assert L % cfg.gate_up_bk == 0 and I % cfg.down_bk == 0
    assert M.max_chunks(4096, E, 64) == E + 64 and M.max_chunks(4096, E) == E + 256


def test_moe_runs_sends_large_batches_to_the_library_path(monkeypatch):
    seen = []
    monkeypatch.setattr(M, "moe_runs_torch",
                        lambda ids, E, bm=M.BLOCK_M: seen.append(ids.numel()) or "torch")
    ids = torch.zeros(65, 16, dtype=torch.int32)          # 1040 pairs > RUNS_KERNEL_MAX
    assert M.moe_runs(ids, 896) == "torch" and seen == [1040]
    with pytest.raises(ValueError, match="sorts at most 1024"):
        M._runs_block(1025)
    assert [M._runs_block(n) for n in (1, 64, 65, 256, 257, 1024)] == [64, 64, 256, 256, 1024,
                                                                        1024]


def test_prefill_experts_switch(monkeypatch):
    """PREFILL_EXPERTS picks the prefill steps' kernels: split (the swapped split kernels on
    128-pair chunks), blocked (≤ 256-pair chunks in 64-pair sub-blocks, 128-row down tiles),
    hybrid (blocked gate/up, swapped down), auto (hybrid where the experts' mean load is above
    AUTO_BLOCKED_LOAD pairs, else split; the decision by the pair count alone), all with the
    x2 decode and the scales a k step ahead (prefetch_scales); auto-ew: auto before x2
    (blocked past the threshold, elementwise decode, no look-ahead); auto-nopf: auto without
    prefetch_scales."""
    assert M.PREFILL_EXPERTS in M.PREFILL_EXPERT_KINDS
    monkeypatch.setattr(M, "PREFILL_EXPERTS", "split")
    split = M.prefill_config(3584, 192)
    assert split.split_gate_up and not split.blocked and split.block_m == 128
    assert split.decode == "x2" and split.prefetch_scales
    assert M.default_config(1 << 17, 896, 192, 3584, tuned=False) == split
    monkeypatch.setattr(M, "PREFILL_EXPERTS", "blocked")
    blocked = M.default_config(1 << 17, 896, 192, 3584, tuned=False)
    assert blocked.blocked and blocked.block_m == 256 and 3584 % blocked.gate_up_bk == 0
    assert blocked.blocked_down and blocked.down_bn == 128 and blocked.down_tiles == 1
    monkeypatch.setattr(M, "PREFILL_EXPERTS", "hybrid")
    hybrid = M.prefill_config(3584, 192)
    assert hybrid.blocked and not hybrid.blocked_down and hybrid.down_bn == 128
    assert blocked.decode == hybrid.decode == "x2"
    assert blocked.prefetch_scales and hybrid.prefetch_scales
    monkeypatch.setattr(M, "PREFILL_EXPERTS", "auto")
    edge = M.AUTO_BLOCKED_LOAD * 896                # K3 TP16: 7,168 tokens of top-16
    assert M.default_config(edge + 1, 896, 192, 3584, tuned=False) == hybrid
    assert M.default_config(edge, 896, 192, 3584, tuned=False) == split
    assert M.default_config(M.PREFILL_PAIRS, 896, 192, 3584, tuned=False) == split
    assert M.prefill_config(3584, 192) == split     # no pair count given: split
    monkeypatch.setattr(M, "PREFILL_EXPERTS", "auto-ew")
    ew = dataclasses.replace
    assert M.default_config(edge + 1, 896, 192, 3584, tuned=False) == \
        ew(blocked, decode="elementwise", prefetch_scales=False)
    assert M.default_config(edge, 896, 192, 3584, tuned=False) == \
        ew(split, decode="elementwise", prefetch_scales=False)
    monkeypatch.setattr(M, "PREFILL_EXPERTS", "auto-nopf")    # auto, no scales look-ahead
    assert M.default_config(edge + 1, 896, 192, 3584, tuned=False) == \
        ew(hybrid, prefetch_scales=False)
    assert M.default_config(edge, 896, 192, 3584, tuned=False) == \
        ew(split, prefetch_scales=False)


@pytest.mark.parametrize("T,skew", [(100, True), (1250, False)])
def test_runs_two_cut_one_order_into_both_chunk_sizes(T, skew):
    """`moe_runs_two` (the hybrid form's gate/up and down chunking) past RUNS_KERNEL_MAX
    pairs, where it sorts once: each half equals `moe_runs_torch` at its block size."""
    rng = random.Random(T)
    hot = rng.sample(range(896), 5)
    ids = torch.tensor([[rng.choice(hot) if skew and rng.random() < 0.7 else rng.randrange(896)
                         for _ in range(16)] for _ in range(T)], dtype=torch.int32)
    one, two = M.moe_runs_two(ids, 896, 256, 128)
    for got, bm in ((one, 256), (two, 128)):
        want = M.moe_runs_torch(ids, 896, bm)
        assert len(got) == len(want) == 7
        for g, w in zip(got, want):
            assert torch.equal(g, w), bm
    assert one[4].numel() != two[4].numel()         # the two cuts differ
