"""MLA: absorbed attention over latent rows == naive attention with decompressed k/v; DCP
partials merged through log-sum-exp == attention over all rows; the layer's cached decode and
chunked prefill == one naive prefill."""
import torch

from raydecode.models.cache import SeqSlice, StepBatch
from raydecode.models.config import load_config
from raydecode.models.k3 import K3ForCausalLM, init_random_, make_caches
from raydecode.models.mla import merge_attn_partials, mla_absorbed_attention, naive_attention
from raydecode.models.parallel import Parallel

from _numerics import max_rel_err

torch.set_num_threads(1)

C, R, NOPE, V, H = 32, 8, 16, 12, 3     # kv_lora, rope, nope, v, heads


def _problem(m, T, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(m, C + R, generator=gen)                  # [c, k_pe]
    w_kv_b = torch.randn(H, NOPE + V, C, generator=gen) / C ** 0.5
    q = torch.randn(T, H, NOPE + R, generator=gen)
    return rows, w_kv_b, q


def _naive(rows, w_kv_b, q, q_pos, scale):
    kvb = torch.einsum("hdc,mc->mhd", w_kv_b, rows[:, :C])      # (m, h, nope + v)
    k = torch.cat([kvb[..., :NOPE], rows[:, None, C:].expand(-1, H, R)], -1)
    return naive_attention(q, k, kvb[..., NOPE:], scale, q_pos, torch.arange(rows.shape[0]))


def _absorbed_q(q, w_kv_b):
    return torch.cat([torch.einsum("thn,hnc->thc", q[..., :NOPE], w_kv_b[:, :NOPE]),
                      q[..., NOPE:]], -1)


def test_absorbed_equals_naive_for_decode_and_causal_chunks():
    m, T = 23, 5
    rows, w, q = _problem(m, T, seed=1)
    scale = (NOPE + R) ** -0.5
    q_pos = torch.tensor([0, 7, 15, 21, 22])          # queries at various depths (causal)
    ref = _naive(rows, w, q, q_pos, scale)
    o_lat, lse = mla_absorbed_attention(_absorbed_q(q, w), rows, torch.arange(m), q_pos, C, scale)
    out = torch.einsum("thc,hvc->thv", o_lat, w[:, NOPE:])
    assert max_rel_err(out, ref) < 1e-5
    # lse is the log-normaliser of the scores it attended over
    s = torch.einsum("thd,md->thm", _absorbed_q(q, w), rows) * scale
    s = s.masked_fill(torch.arange(m)[None, None, :] > q_pos[:, None, None], float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=1e-5, atol=1e-5)


def test_dcp_partials_merge_to_the_full_attention():
    """Rows split by position parity (DCP = 2): merging the two partials through their lse
    gives exactly the attention over all rows, including a query at position 0 for which the
    odd partition sees nothing (lse = -inf)."""
    m, T = 19, 4
    rows, w, q = _problem(m, T, seed=2)
    scale = (NOPE + R) ** -0.5
    qa = _absorbed_q(q, w)
    pos = torch.arange(m)
    q_pos = torch.tensor([0, 1, 10, 18])
    full_o, full_lse = mla_absorbed_attention(qa, rows, pos, q_pos, C, scale)
    parts = [mla_absorbed_attention(qa, rows[pos % 2 == r], pos[pos % 2 == r], q_pos, C, scale)
             for r in (0, 1)]
    assert torch.isinf(parts[1][1][0]).all()          # position 0: nothing on the odd rank
    o, lse = merge_attn_partials(torch.stack([p[0] for p in parts]),
                                 torch.stack([p[1] for p in parts]))
    assert max_rel_err(o, full_o) < 1e-5
    torch.testing.assert_close(lse, full_lse, rtol=1e-5, atol=1e-5)
    # merging with the weights swapped must not pass (the check can fail)
    bad, _ = merge_attn_partials(torch.stack([parts[1][0], parts[0][0]]),
                                 torch.stack([p[1] for p in parts]))
    assert max_rel_err(bad, full_o) > 1e-2


def _layer(seed=0):
    cfg = load_config("tiny")
    model = init_random_(K3ForCausalLM(cfg), seed)
    layer = cfg.mla_layers[0]
    return cfg, model.model.layers[layer].self_attn


def test_layer_cached_decode_and_chunks_match_naive_prefill():
    cfg, attn = _layer()
    gen = torch.Generator().manual_seed(4)
    T = 10
    x = torch.randn(T, cfg.hidden_size, generator=gen)
    ref = attn(x, StepBatch([SeqSlice(0, 0, T, 0)]), None)            # naive, decompressed
    caches = make_caches(cfg, Parallel(), num_slots=2, num_blocks=8, block_size=4)
    caches.mla.block_tables[1] = [5, 2, 7]                              # non-contiguous blocks
    dec = torch.cat([attn(x[t:t + 1], StepBatch.decode([1], [t]), caches) for t in range(T)])
    assert max_rel_err(dec, ref) < 1e-5
    caches.mla.block_tables[0] = [0, 1, 3]
    a = attn(x[:6], StepBatch([SeqSlice(0, 0, 6, 0)]), caches)
    b = attn(x[6:], StepBatch([SeqSlice(0, 0, 4, 6)]), caches)
    assert max_rel_err(torch.cat([a, b]), ref) < 1e-5


def test_layer_batches_sequences_independently():
    """One step holding a decode token of sequence A and a prefill chunk of sequence B gives the
    same rows as running them alone."""
    cfg, attn = _layer(seed=1)
    gen = torch.Generator().manual_seed(5)
    xa = torch.randn(4, cfg.hidden_size, generator=gen)
    xb = torch.randn(3, cfg.hidden_size, generator=gen)
    ref_a = attn(xa, StepBatch([SeqSlice(0, 0, 4, 0)]), None)
    ref_b = attn(xb, StepBatch([SeqSlice(0, 0, 3, 0)]), None)
    caches = make_caches(cfg, Parallel(), num_slots=2, num_blocks=4, block_size=4)
    caches.mla.block_tables[0], caches.mla.block_tables[1] = [0], [1]
    attn(xa[:3], StepBatch([SeqSlice(0, 0, 3, 0)]), caches)
    step = StepBatch([SeqSlice(0, 0, 1, 3), SeqSlice(1, 1, 3, 0)])
    out = attn(torch.cat([xa[3:], xb]), step, caches)
    assert max_rel_err(out[:1], ref_a[3:]) < 1e-5
    assert max_rel_err(out[1:], ref_b) < 1e-5


def test_output_gate_uses_the_layer_input():
    """Zeroing g_proj halves the output exactly (sigmoid(0) = 1/2): the gate is applied per
    output channel before o_proj, computed from the layer input."""
    cfg, attn = _layer(seed=2)
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    batch = StepBatch([SeqSlice(0, 0, 5, 0)])
    with torch.no_grad():
        attn.g_proj.weight.zero_()
        half = attn(x, batch, None)
        attn.g_proj = None
        full = attn(x, batch, None)
    torch.testing.assert_close(half, 0.5 * full, rtol=1e-5, atol=1e-6)
