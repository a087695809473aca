"""MLA absorbed decode over the paged latent cache (kernels/mla_decode.py) on the CPU: the
references agree with the models/ functions (fp32 where exact) and with the model layer's
stock MLA step (models/mla.py; bf16 tolerance), paged indexing through shuffled block tables, the public ops fall back to the references bit for bit, and bad
inputs raise ValueError naming the value. The Triton kernels: tests/gpu/test_mla_decode.py; the
prep kernel's cache rows (shared with the fused kernel's phase A) here too, under the interpreter
(`TRITON_INTERPRET=1 python -m pytest tests/cpu/test_mla_decode.py`)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from raydecode.kernels import mla_decode as M
from raydecode.kernels import mla_decode_triton as MT
from raydecode.models.cache import MLALatentCache
from raydecode.models.layers import rms_norm
from raydecode.models.mla import merge_attn_partials, mla_absorbed_attention

from _numerics import fresh_seed, rel_err

torch.set_num_threads(1)
BF = torch.bfloat16
KL, R, NOPE, V, QL, H = 64, 16, 32, 32, 64, 4           # the bench small config
INTERPRET = MT.triton is not None and os.environ.get("TRITON_INTERPRET") == "1"


def _paged(T, max_blocks, bs, seed, extra=3):
    """A random pool with more blocks than needed and a shuffled block table (T, max_blocks)."""
    g = torch.Generator().manual_seed(seed)
    nb = T * max_blocks + extra
    cache = torch.randn(nb, bs, KL + R, generator=g).to(BF)
    bt = torch.randperm(nb, generator=g)[:T * max_blocks].view(T, max_blocks).int()
    return cache, bt, g


def test_prep_reference_writes_the_paged_row_and_norms():
    T, bs = 4, 16
    cache, bt, g = _paged(T, 3, bs, seed=1)
    before = cache.clone()
    qkv = torch.randn(T, QL + KL + R + 8, generator=g).to(BF)[:, :QL + KL + R]   # row stride
    wq, wkv = 1 + 0.1 * torch.randn(QL, generator=g), 1 + 0.1 * torch.randn(KL, generator=g)
    pos = torch.tensor([0, 17, 47, -1])                                   # −1: not written
    q = M.mla_prep_reference(qkv, wq, wkv, cache, bt, pos, q_lora=QL, kv_lora=KL, eps=1e-5)
    # models/layers.py rms_norm (an op chain) vs F.rms_norm: same math, ≤ 1 bf16 ulp apart
    assert (q.float() - rms_norm(qkv[:, :QL], wq, 1e-5).float()).abs().max() <= 2 ** -7 * 4
    row = torch.cat([rms_norm(qkv[:, QL:QL + KL], wkv, 1e-5), qkv[:, QL + KL:]], -1)
    for t, p in enumerate(pos.tolist()[:3]):
        got = cache[bt[t, p // bs], p % bs]
        assert torch.equal(got[KL:], qkv[t, QL + KL:])
        assert rel_err(got, row[t]) < 4e-3
    changed = (cache != before).any(-1).sum()
    assert int(changed) == 3                                               # nothing else


def _ulps(a, b) -> torch.Tensor:
    """|a − b| in bf16 ulps of max(|a|, |b|), elementwise."""
    a, b = a.double(), b.double()
    mag = torch.maximum(a.abs(), b.abs()).clamp_min(2.0 ** -126)
    return (a - b).abs() / torch.exp2(torch.floor(torch.log2(mag)) - 7)


@pytest.mark.skipif(not INTERPRET, reason="the kernels: Triton + TRITON_INTERPRET=1")
@pytest.mark.parametrize("ql,kl,r", [(QL, KL, R), (96, 80, 24)])   # 2nd: masked tile tails
def test_prep_kernel_rows_equal_reference_and_fused_phase_a(ql, kl, r):
    """prep_triton (the DCP > 1 path) vs mla_prep_reference on fresh random inputs with DCP 2
    rank 1 positions (odd p: local row p // 2; even: −1, not stored), a shuffled table over a
    pool with spare blocks and a row-strided qkv: q and the latent ≤ 1 bf16 ulp (the
    interpreter truncates to bf16), the rope part copied exactly, no other row touched; the
    fused kernel's phase A (the same `_row_store_part`) writes the same bits."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    T, bs, mb, h, nope = 7, 16, 3, 2, 32
    nb = T * mb + 4
    cache0 = torch.randn(nb, bs, kl + r, generator=g).to(BF)
    bt = torch.randperm(nb, generator=g)[:T * mb].view(T, mb).int()
    w = ql + kl + r
    qkv = torch.randn(T, w + 24, generator=g) * (0.1 + 4 * torch.rand(T, 1, generator=g))
    qkv = qkv.to(BF)[:, 8:8 + w]                                           # row stride
    wq = 1 + 0.2 * torch.randn(ql, generator=g)
    wkv = (1 + 0.2 * torch.randn(kl, generator=g)).to(BF)
    p = torch.randint(0, 2 * mb * bs, (T,), generator=g)
    p[0], p[1] = 2 * bs - 1, 2 * bs                     # local row bs − 1 (block end); even
    pos = torch.where(p % 2 == 1, p // 2, -1)
    ref = cache0.clone()
    rq = M.mla_prep_reference(qkv, wq, wkv, ref, bt, pos, q_lora=ql, kv_lora=kl, eps=1e-6)
    got, q = cache0.clone(), torch.full((T, ql), float("nan"), dtype=BF)
    MT.prep_triton(qkv, wq, wkv, got, bt, pos, ql, kl, 1e-6, q)
    msg = f"seed {seed} positions {pos.tolist()}"
    assert float(_ulps(q, rq).max()) <= 1, msg
    keep = pos >= 0
    slot = torch.zeros(nb, bs, dtype=torch.bool)
    slot[bt[keep].long().gather(1, (pos[keep] // bs)[:, None])[:, 0], pos[keep] % bs] = True
    assert int(slot.sum()) == int(keep.sum()) >= 1, msg
    assert torch.equal(got[~slot], cache0[~slot]), f"{msg}: a row off the positions"
    assert torch.equal(got[slot][:, kl:], ref[slot][:, kl:]), msg             # rope: a copy
    assert float(_ulps(got[slot][:, :kl], ref[slot][:, :kl]).max()) <= 1, msg
    fused = cache0.clone()
    S = 2
    MT.fused_triton(qkv, torch.randn(T, h, nope + r, generator=g), wkv,
                    torch.randn(h, nope, kl, generator=g).to(BF), fused, bt, pos,
                    torch.full((T,), mb * bs, dtype=torch.int32),
                    torch.randn(h, kl, V, generator=g).to(BF),
                    torch.randn(T, h * V, generator=g).to(BF), ql, kl, 1e-6, 0.1,
                    torch.empty(T, h, kl + r, dtype=BF), torch.empty(T, S, h, kl),
                    torch.empty(T, S, h), torch.zeros(8, dtype=torch.int32), None,
                    only_a=True)
    assert torch.equal(fused, got), msg


def test_attention_reference_equals_models_mla_over_the_engine_cache():
    """The same pool read through models/cache.py MLALatentCache.read + models/mla.py."""
    T, bs, mb = 3, 16, 4
    cache, bt, g = _paged(T, mb, bs, seed=2)
    q_abs = torch.randn(T, H, KL + R, generator=g).to(BF)
    seq = torch.tensor([1, 23, 64], dtype=torch.int32)       # 1, non-multiple, full table
    o, lse = M.mla_attention_reference(q_abs, cache, bt, seq, kv_lora=KL, scale=0.1)
    eng = MLALatentCache(1, cache.shape[0], bs, KL + R, BF)
    eng.pool[0].copy_(cache)
    for t in range(T):
        eng.block_tables[t] = bt[t].tolist()
        rows, rpos = eng.read(0, t, int(seq[t]))
        ro, rl = mla_absorbed_attention(q_abs[t:t + 1], rows, rpos, rpos[-1:], KL, 0.1)
        assert torch.allclose(o[t], ro[0], rtol=1e-5, atol=1e-6)
        assert torch.allclose(lse[t], rl[0], rtol=1e-6, atol=1e-6)


def test_empty_sequence_gives_zero_and_minus_inf():
    cache, bt, g = _paged(2, 2, 16, seed=3)
    q_abs = torch.randn(2, H, KL + R, generator=g).to(BF)
    o, lse = M.mla_attention_reference(q_abs, cache, bt, torch.tensor([0, 5]), kv_lora=KL,
                                       scale=0.1)
    assert torch.equal(o[0], torch.zeros_like(o[0])) and bool((lse[0] == float("-inf")).all())
    assert bool(torch.isfinite(lse[1]).all())


def test_output_reference_merges_partials_like_models_mla():
    """Partials over disjoint row sets (some empty) -> the same output as the full attention;
    the merge itself equals models/mla.py merge_attn_partials."""
    T, bs = 2, 16
    cache, bt, g = _paged(T, 4, bs, seed=4)
    q_abs = torch.randn(T, H, KL + R, generator=g).to(BF)
    w_uv = (torch.randn(H, KL, V, generator=g) / 8).to(BF)
    gate = torch.randn(T, H * V + 5, generator=g).to(BF)[:, :H * V]
    seq = torch.tensor([50, 3])
    rows, idx = M.paged_rows(cache, bt, T)
    parts_o, parts_l = [], []
    for lo, hi in ((0, 16), (16, 40), (40, 64)):                 # seq 3: splits 2, 3 empty
        o_p, l_p = [], []
        for t in range(T):
            r = rows[t, lo:min(hi, int(seq[t]))]
            pos = torch.arange(lo, lo + r.shape[0])
            o1, l1 = mla_absorbed_attention(q_abs[t:t + 1], r, pos, torch.tensor([10 ** 6]),
                                            KL, 0.1)
            o_p.append(o1[0]), l_p.append(l1[0])
        parts_o.append(torch.stack(o_p)), parts_l.append(torch.stack(l_p))
    po, pl = torch.stack(parts_o, 1), torch.stack(parts_l, 1)                  # (T, 3, h, ·)
    full_o, full_l = M.mla_attention_reference(q_abs, cache, bt, seq, kv_lora=KL, scale=0.1)
    mo, ml = merge_attn_partials(po.transpose(0, 1), pl.transpose(0, 1))
    assert torch.allclose(mo, full_o, rtol=1e-5, atol=1e-6)
    assert torch.allclose(ml, full_l, rtol=1e-6, atol=1e-6)
    a = M.mla_output_reference(po, pl, w_uv, gate)
    b = M.mla_output_reference(full_o, full_l, w_uv, gate)
    assert rel_err(a, b) < 4e-3                                   # bf16(o_lat) flips only


def _stock_mla_case(T: int, ctx: int, bs: int, seed: int):
    """A bench-small MLA layer (the model's MLAAttention, bf16, TP 1, random weights), an input
    h, a paged copy (block bs, shuffled table) of its cache, and the layer's stock output on
    one decode token per sequence at position ctx − 1 (which writes that row into the layer's
    own cache, S.mla_cache). W: the layer's weights as the op references take them."""
    from types import SimpleNamespace

    from raydecode.models.cache import MLALatentCache, ModelCaches, StepBatch
    from raydecode.models.mla import MLAAttention
    from raydecode.models.parallel import LocalComm, Parallel
    from raydecode.scripts.bench.layer_check import small_config
    from raydecode.scripts.bench.random_init import ParamSpec, init_value
    cfg = small_config()
    idx = next(i for i in range(cfg.num_layers) if cfg.layer_kinds[i] == "mla"
               and i % cfg.attn_res_block_size)
    attn = MLAAttention(cfg, idx, Parallel(), LocalComm(), BF)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(init_value(name, ParamSpec(tuple(p.shape), tuple(p.full_shape), p.dtype),
                               cfg, gen, "cpu"))
    m, nb = cfg.mla, ctx // bs
    mla = MLALatentCache(1, T * nb, bs, m.latent_dim, BF)
    mla.block_tables.update({t: list(range(t * nb, (t + 1) * nb)) for t in range(T)})
    g = torch.Generator().manual_seed(seed + 1)
    mla.pool.copy_(torch.randn(mla.pool.shape, generator=g).to(BF))
    S = SimpleNamespace(mla_cache=mla.pool[0].view(T, ctx, -1))
    h = torch.randn(T, cfg.hidden_size, generator=g).to(BF)
    bt = torch.randperm(T * nb + 2, generator=g)[:T * nb].view(T, nb).int()
    cache = torch.randn(T * nb + 2, bs, m.latent_dim, generator=g).to(BF)
    cache[bt.long()] = S.mla_cache[:T].view(T, nb, bs, -1)
    w_uk, w_uv = attn.absorbed_weights()
    W = SimpleNamespace(
        stock={"fused_qkv_a": torch.cat([attn.q_a_proj.weight, attn.kv_a_proj_with_mqa.weight])
               .detach()},
        t={"q_a_norm": attn.q_a_layernorm.weight.detach().float(),
           "kv_a_norm": attn.kv_a_layernorm.weight.detach().float(),
           "q_b": attn.q_b_proj.weight.detach(), "w_uk": w_uk.detach().contiguous(),
           "w_uv_t": w_uv.detach().transpose(1, 2).contiguous(),
           "g_proj": attn.g_proj.weight.detach(), "o_proj": attn.o_proj.weight.detach()},
        widths={"heads": attn.heads})
    caches = ModelCaches(mla=mla, kda=None, mla_index={idx: 0})
    with torch.inference_mode():
        ref = attn(h, StepBatch.decode(list(range(T)), [ctx - 1] * T), caches, "stock")
    return cfg, W, S, h, bt, cache, ref


@pytest.mark.parametrize("fold", [False, True])
def test_composition_matches_layer_step_mla(fold):
    """The model layer's stock MLA step vs prep → q_b → absorb → attention → output over a
    paged copy of the same cache (block 16, shuffled)."""
    T, ctx, bs = 3, 48, 16
    cfg, W, S, h, bt, cache, ref = _stock_mla_case(T, ctx, bs, seed=5)
    m, t = cfg.mla, W.t

    qkv = F.linear(h, W.stock["fused_qkv_a"])
    pos = torch.full((T,), ctx - 1)
    q_n = M.mla_prep(qkv, t["q_a_norm"], t["kv_a_norm"], cache, bt, pos, q_lora=m.q_lora_rank,
                     kv_lora=m.kv_lora_rank, eps=cfg.rms_norm_eps)
    rows, _ = M.paged_rows(cache, bt, T)
    assert torch.equal(rows, S.mla_cache[:T])                 # the written row, bit for bit
    hl = W.widths["heads"]
    if fold:
        wq = M.absorbed_q_weight(t["q_b"], t["w_uk"], hl, m.qk_nope_head_dim,
                                 m.qk_rope_head_dim)
        q_abs = F.linear(q_n, wq).view(T, hl, -1)
    else:
        q = F.linear(q_n, t["q_b"]).view(T, hl, m.qk_head_dim)
        q_abs = M.mla_absorb(q, t["w_uk"], nope=m.qk_nope_head_dim)
    gate = F.linear(h, t["g_proj"])
    o = M.mla_decode(q_abs, cache, bt, torch.full((T,), ctx, dtype=torch.int32), t["w_uv_t"],
                     gate, kv_lora=m.kv_lora_rank, scale=m.qk_head_dim ** -0.5)
    out = F.linear(o, t["o_proj"])
    assert rel_err(out, ref) < (1.5e-2 if fold else 1e-2)


def _served_inputs(cfg, W, h):
    """The specialized step's inputs to its DCP-1 MLA op: qkv = fused_qkv_a(h), the local
    heads, q_lora, x = qkv's q_a part in fp64 and its rms scale (T, 1)."""
    qkv = F.linear(h, W.stock["fused_qkv_a"])
    ql = cfg.mla.q_lora_rank
    x = qkv[:, :ql].double()
    rs = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    return qkv, W.widths["heads"], ql, x, rs


def _check_served(o, W, S, bt, cache, ref) -> None:
    """The op's rows equal mla_prep's bit for bit (the layer's stock step wrote them into
    S.mla_cache); o_proj(o) is within bf16 tolerance of the stock layer output `ref`."""
    T = o.shape[0]
    assert torch.equal(M.paged_rows(cache, bt, T)[0], S.mla_cache[:T])
    assert rel_err(F.linear(o, W.t["o_proj"]), ref) < 1.5e-2


def test_fused_composition_matches_layer_step_mla():
    """The layer's stock MLA step vs the specialized form: q_b' = q_b with the q_a norm weight
    folded in, applied to the raw latent, then mla_decode_fused (reference on the CPU) over a
    paged copy of the cache; the written row bit for bit equals mla_prep's."""
    T, ctx, bs = 3, 48, 16
    cfg, W, S, h, bt, cache, ref = _stock_mla_case(T, ctx, bs, seed=15)
    m, t = cfg.mla, W.t
    qkv, hl, ql, x, rs = _served_inputs(cfg, W, h)
    wf = M.folded_q_b_weight(t["q_b"], t["q_a_norm"]).float()
    q = (qkv[:, :ql].float() @ wf.t()).view(T, hl, -1)       # fp32 GEMV output, as the step
    pos = torch.full((T,), ctx - 1)
    o = M.mla_decode_fused(qkv, q, t["kv_a_norm"], t["w_uk"], cache, bt, pos,
                           torch.full((T,), ctx, dtype=torch.int32), t["w_uv_t"],
                           F.linear(h, t["g_proj"]), q_lora=ql, kv_lora=m.kv_lora_rank,
                           eps=cfg.rms_norm_eps, scale=m.qk_head_dim ** -0.5)
    _check_served(o, W, S, bt, cache, ref)
    # the fold is exact in the math: q_b(RMSNorm(x)) = rms_scale(x) · q_b'(x) before rounding
    two = (x * rs * t["q_a_norm"].double()) @ t["q_b"].double().t()
    one = rs * (x @ (t["q_b"].double() * t["q_a_norm"].double()).t())
    assert rel_err(one, two) < 1e-12


def test_absorbed_composition_matches_layer_step_mla():
    """The layer's stock MLA step vs the served form: W_q'' = q_b with W_uk and the q_a norm
    weight folded in, applied to the raw latent, then mla_decode_absorbed (reference on the
    CPU) over a paged copy of the cache; the written row bit for bit equals mla_prep's."""
    T, ctx, bs = 3, 48, 16
    cfg, W, S, h, bt, cache, ref = _stock_mla_case(T, ctx, bs, seed=25)
    m, t = cfg.mla, W.t
    qkv, hl, ql, x, rs = _served_inputs(cfg, W, h)
    wa = M.absorbed_q_weight(t["q_b"], t["w_uk"], hl, m.qk_nope_head_dim, m.qk_rope_head_dim,
                             q_norm_w=t["q_a_norm"])
    assert wa.shape == (hl * (m.kv_lora_rank + m.qk_rope_head_dim), ql)
    q = (qkv[:, :ql].float() @ wa.float().t()).view(T, hl, -1)   # fp32 GEMV output
    o = M.mla_decode_absorbed(qkv, q, t["kv_a_norm"], cache, bt, torch.full((T,), ctx - 1),
                              torch.full((T,), ctx, dtype=torch.int32), t["w_uv_t"],
                              F.linear(h, t["g_proj"]), q_lora=ql, kv_lora=m.kv_lora_rank,
                              eps=cfg.rms_norm_eps, scale=m.qk_head_dim ** -0.5)
    _check_served(o, W, S, bt, cache, ref)
    # the fold is exact in the math: q_abs = rms_scale(x) · x·W_q''ᵀ before rounding
    qn = (x * rs * t["q_a_norm"].double()) @ t["q_b"].double().t()
    qn = qn.view(T, hl, -1)
    nope = m.qk_nope_head_dim
    two = torch.cat([torch.einsum("thn,hnc->thc", qn[..., :nope], t["w_uk"].double()),
                     qn[..., nope:]], -1)
    one = rs[:, :, None] * q.double()
    assert rel_err(one, two) < 1e-2                                # W_q'' rounded to bf16 once


@pytest.mark.skipif(not INTERPRET, reason="the kernels: Triton + TRITON_INTERPRET=1")
@pytest.mark.parametrize("pre_tile", [True, False])
@pytest.mark.parametrize("ctx_rows", [(1, 40, 17, 64), (1, 129, 5, 3)])
def test_split_rows_kernel_equals_reference(ctx_rows, pre_tile):
    """split_rows_triton + output_triton (the two kernels of mla_decode_absorbed) vs
    mla_decode_absorbed_reference on fresh random inputs: per token a different length, the
    new row at positions[t] = len − 1 (one token −1: not stored, its row read as it was), a
    shuffled table over a pool with spare blocks, S = 3 splits (so the row's owner is not
    always the last split). Output ≤ 2e-2 rel, every row but the stored ones untouched, the
    stored rows equal the reference's bits up to 1 bf16 ulp. pre_tile: each split's first
    tile read before the row store (as before the PDL wait on the GPU), so a row stored into
    it (lengths 1, 17, 129: in the first tile of its split) must come from registers."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    T, bs, mb, S = len(ctx_rows), 16, 9, 3
    nb = T * mb + 3
    cache0 = torch.randn(nb, bs, KL + R, generator=g).to(BF)
    bt = torch.randperm(nb, generator=g)[:T * mb].view(T, mb).int()
    qkv = (torch.randn(T, QL + KL + R, generator=g) * 2).to(BF)
    q = torch.randn(T, H, KL + R, generator=g)
    wkv = (1 + 0.2 * torch.randn(KL, generator=g)).to(BF)
    w_uv = torch.randn(H, KL, V, generator=g).to(BF)
    gate = torch.randn(T, H * V, generator=g).to(BF)
    seq = torch.tensor(ctx_rows, dtype=torch.int32)
    pos = (seq - 1).long()
    pos[0] = -1
    kw = dict(q_lora=QL, kv_lora=KL, eps=1e-6, scale=0.1)
    ref_c = cache0.clone()
    ref = M.mla_decode_absorbed_reference(qkv, q, wkv, ref_c, bt, pos, seq, w_uv, gate, **kw)
    got_c = cache0.clone()
    o_p, l_p = torch.empty(T, S, H, KL), torch.empty(T, S, H)
    MT.split_rows_triton(q, qkv, wkv, got_c, bt, pos, seq, QL, KL, 1e-6, 0.1, o_p, l_p,
                         pre_tile=pre_tile)
    got = MT.output_triton(o_p, l_p, w_uv, gate, torch.empty(T, H * V, dtype=BF))
    msg = f"seed {seed}"
    assert rel_err(got, ref) < 2e-2, msg
    changed = (got_c != cache0).any(-1)
    assert int(changed.sum()) <= T - 1, msg
    assert float(_ulps(got_c, ref_c).max()) <= 1, msg


def _refuser(op, args: list, kw: dict):
    """bad(i, value, match): `op(*args, **kw)` with args[i] = value raises a ValueError whose
    message matches `match`."""
    def bad(i, value, match):
        a = list(args)
        a[i] = value
        with pytest.raises(ValueError, match=match):
            op(*a, **kw)
    return bad


def test_fused_op_inputs_are_named():
    T = 2
    cache, bt, g = _paged(T, 2, 16, seed=17)
    qkv = torch.randn(T, QL + KL + R, generator=g).to(BF)
    q = torch.randn(T, H, NOPE + R, generator=g).to(BF)
    w_uk = torch.randn(H, NOPE, KL, generator=g).to(BF)
    w_uv = torch.randn(H, KL, V, generator=g).to(BF)
    gate = torch.randn(T, H * V, generator=g).to(BF)
    seq = torch.tensor([3, 4], dtype=torch.int32)
    args = [qkv, q, torch.ones(KL), w_uk, cache, bt, seq - 1, seq, w_uv, gate]
    kw = dict(q_lora=QL, kv_lora=KL, eps=1e-5, scale=0.1)

    bad = _refuser(M.mla_decode_fused, args, kw)

    bad(0, qkv.float(), "qkv of shape")
    bad(1, q[:, :, :R], r"q of shape .*expected fp32 or bf16 \(2, h, nope \+ 16\)")
    bad(1, q.half(), "q of shape")
    bad(1, q[:1], "q of shape")
    bad(2, torch.ones(KL + 1), "kv norm weight of shape")
    bad(3, w_uk[:, :NOPE - 1], "w_uk of shape")
    bad(7, seq[:1], "seq_lens of shape")
    bad(9, gate[:, 1:], "gate of shape")
    with pytest.raises(ValueError, match="q_b weight .* and q norm weight"):
        M.folded_q_b_weight(torch.ones(8, QL), torch.ones(QL + 1))
    sync = torch.zeros(8, dtype=torch.int32)
    sync[4] = 1
    with pytest.raises(RuntimeError, match="phase wait gave up"):
        M.check_fused_sync(sync)


def test_absorbed_op_inputs_are_named():
    """mla_decode_absorbed refuses bad inputs with a ValueError naming the value and what is
    accepted, before touching the cache."""
    T = 2
    cache, bt, g = _paged(T, 2, 16, seed=19)
    before = cache.clone()
    qkv = torch.randn(T, QL + KL + R, generator=g).to(BF)
    q = torch.randn(T, H, KL + R, generator=g)
    w_uv = torch.randn(H, KL, V, generator=g).to(BF)
    gate = torch.randn(T, H * V, generator=g).to(BF)
    seq = torch.tensor([3, 4], dtype=torch.int32)
    args = [qkv, q, torch.ones(KL), cache, bt, seq - 1, seq, w_uv, gate]
    kw = dict(q_lora=QL, kv_lora=KL, eps=1e-5, scale=0.1)

    bad = _refuser(M.mla_decode_absorbed, args, kw)

    bad(0, qkv.float(), "qkv of shape")
    bad(1, q[:, :, :NOPE + R], rf"q of shape .*expected fp32 or bf16 \(2, h, {KL} \+ {R}\)")
    bad(1, q.half(), "q of shape")
    bad(2, torch.ones(KL + 1), "kv norm weight of shape")
    bad(3, cache[..., :KL], "cache")
    bad(5, (seq - 1)[:1], "positions of shape")
    bad(7, w_uv[:, :KL - 1], "w_uv_t of shape")
    bad(8, gate[:, 1:], "gate of shape")
    assert torch.equal(cache, before)
    with pytest.raises(ValueError, match="q norm weight of shape"):
        M.absorbed_q_weight(torch.ones(H * (NOPE + R), QL), torch.ones(H, NOPE, KL), H, NOPE, R,
                            q_norm_w=torch.ones(QL + 1))


def test_absorbed_q_weight_equals_two_step_form():
    g = torch.Generator().manual_seed(7)
    q_b = (torch.randn(H * (NOPE + R), QL, generator=g) / QL ** 0.5).to(BF)
    w_uk = (torch.randn(H, NOPE, KL, generator=g) / KL ** 0.5).to(BF)
    x = torch.randn(5, QL, generator=g).to(BF)
    two = M.mla_absorb_reference(F.linear(x, q_b).view(5, H, -1), w_uk, nope=NOPE)
    one = F.linear(x, M.absorbed_q_weight(q_b, w_uk, H, NOPE, R)).view(5, H, -1)
    assert rel_err(one, two) < 1e-2
    assert torch.equal(one[..., KL:], two[..., KL:])           # q_pe rows copied, not mixed
    with pytest.raises(ValueError, match="q_b weight"):
        M.absorbed_q_weight(q_b[:-1], w_uk, H, NOPE, R)


def test_public_ops_fall_back_to_reference_on_cpu():
    T, bs = 3, 16
    cache, bt, g = _paged(T, 2, bs, seed=8)
    q_abs = torch.randn(T, H, KL + R, generator=g).to(BF)
    seq = torch.tensor([1, 17, 32], dtype=torch.int32)
    o, lse = M.mla_attention(q_abs, cache, bt, seq, kv_lora=KL, scale=0.2)
    ro, rl = M.mla_attention_reference(q_abs, cache, bt, seq, kv_lora=KL, scale=0.2)
    assert torch.equal(o, ro) and torch.equal(lse, rl)
    w_uv = torch.randn(H, KL, V, generator=g).to(BF)
    gate = torch.randn(T, H * V, generator=g).to(BF)
    out = torch.empty(T, H * V, dtype=BF)
    assert M.mla_output(o, lse, w_uv, gate, out=out) is out
    assert torch.equal(out, M.mla_output_reference(ro, rl, w_uv, gate))
    assert torch.equal(M.mla_decode(q_abs, cache, bt, seq, w_uv, gate, kv_lora=KL, scale=0.2),
                       out)
    q = torch.randn(T, H, NOPE + R, generator=g).to(BF)
    w_uk = torch.randn(H, NOPE, KL, generator=g).to(BF)
    assert torch.equal(M.mla_absorb(q, w_uk, nope=NOPE),
                       M.mla_absorb_reference(q, w_uk, nope=NOPE))
    assert not M._use_triton(q)


def test_num_splits_heuristic():
    assert M.default_num_splits(1, 1024) == 16              # 64 rows per split
    assert M.default_num_splits(1, 128 * 1024) == 132        # every SM
    assert M.default_num_splits(64, 1024) == 3
    assert M.default_num_splits(64, 10) == 1
    assert M.default_num_splits(200, 1 << 17) == 1


def test_bad_inputs_are_named():
    T = 2
    cache, bt, g = _paged(T, 2, 16, seed=9)
    q_abs = torch.randn(T, H, KL + R, generator=g).to(BF)
    seq = torch.tensor([3, 4], dtype=torch.int32)
    kw = dict(kv_lora=KL, scale=0.1)
    with pytest.raises(ValueError, match="q_abs of shape"):
        M.mla_attention(q_abs.float(), cache, bt, seq, **kw)
    with pytest.raises(ValueError, match=r"cache row width 80; expected 96"):
        M.mla_attention(torch.randn(T, H, 96).to(BF), cache, bt, seq, **kw)
    with pytest.raises(ValueError, match="block_table of shape"):
        M.mla_attention(q_abs, cache, bt.float(), seq, **kw)
    with pytest.raises(ValueError, match="seq_lens of shape"):
        M.mla_attention(q_abs, cache, bt, seq[:1], **kw)
    with pytest.raises(ValueError, match="num_splits = 0"):
        M.mla_attention(q_abs, cache, bt, seq, num_splits=0, **kw)
    qkv = torch.randn(T, QL + KL + R).to(BF)
    w = torch.ones(QL), torch.ones(KL)
    with pytest.raises(ValueError, match="positions of shape"):
        M.mla_prep(qkv, *w, cache, bt, torch.zeros(T, 1), q_lora=QL, kv_lora=KL, eps=1e-5)
    with pytest.raises(ValueError, match="norm weights"):
        M.mla_prep(qkv, torch.ones(3), w[1], cache, bt, seq, q_lora=QL, kv_lora=KL, eps=1e-5)
    with pytest.raises(ValueError, match="w_uk of shape"):
        M.mla_absorb(torch.randn(T, H, NOPE + R).to(BF), torch.randn(H, 7, KL).to(BF), nope=NOPE)
    o, lse = M.mla_attention(q_abs, cache, bt, seq, **kw)
    w_uv = torch.randn(H, KL, V).to(BF)
    with pytest.raises(ValueError, match="partials"):
        M.mla_output(o.to(BF), lse, w_uv, torch.randn(T, H * V).to(BF))
    with pytest.raises(ValueError, match="gate of shape"):
        M.mla_output(o, lse, w_uv, torch.randn(T, H * V + 1).to(BF))
    with pytest.raises(ValueError, match="w_uv_t of shape"):
        M.mla_output(o, lse, w_uv[:, :10], torch.randn(T, H * V).to(BF))
