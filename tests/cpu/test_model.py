"""Whole tiny K3: cached decode and chunked prefill == one prefill, batching, the parameter
contract, AttnRes bookkeeping, and TP=2 (with and without DCP=2) == TP=1 over real gloo."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raydecode.models.attnres import AttnResStream, attn_res_mix
from raydecode.models.cache import SeqSlice, StepBatch
from raydecode.models.config import load_config
from raydecode.models.k3 import K3ForCausalLM, init_random_, make_caches
from raydecode.models.layers import RMSNorm, shard_tensor
from raydecode.models.parallel import Parallel, TorchComm

from _net import free_port

torch.set_num_threads(1)
SEED, T = 1234, 12


def max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def tokens(cfg, n=T, seed=5):
    return torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def reserve(caches, slot, first_block, n):
    caches.mla.block_tables[slot] = list(range(first_block, first_block + n))


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config("tiny")
    model = init_random_(K3ForCausalLM(cfg), SEED)
    toks = tokens(cfg)
    return cfg, model, toks, model.compute_logits(model(toks))


def test_parameter_count_and_contract(tiny):
    cfg, model, _, _ = tiny
    n = sum(p.numel() for p in model.parameters())
    assert 100_000 < n < 5_000_000
    for name, p in model.named_parameters():
        assert hasattr(p, "shard_dim") and hasattr(p, "full_shape"), name
    names = dict(model.named_parameters())
    for must in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                 "model.output_attn_res_proj.weight",
                 "model.layers.0.mlp.gate_proj.weight",
                 "model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
                 "model.layers.1.block_sparse_moe.experts.w2_packed",
                 "model.layers.2.self_attn.kv_a_proj_with_mqa.weight",
                 "model.layers.2.self_attn.g_proj.weight",
                 "model.layers.1.self_attn.A_log", "model.layers.1.self_attn.q_conv1d.weight"):
        assert must in names, must
    assert names["model.output_attn_res_proj.weight"].shape == (1, cfg.hidden_size)
    assert names["model.layers.1.self_attn.A_log"].full_shape == (cfg.kda.head_dim,)


def test_init_random_of_a_tp_shard_is_the_slice_of_tp1(tiny):
    cfg, model, _, _ = tiny
    full = dict(model.named_parameters())
    for rank in (0, 1):
        par = Parallel(rank, 2, 2)
        shard = init_random_(K3ForCausalLM(cfg, par), SEED)
        for name, p in shard.named_parameters():
            assert torch.equal(p, shard_tensor(full[name], p, par)), name
            if p.shard_dim is not None:
                assert p.shape[p.shard_dim] * 2 == full[name].shape[p.shard_dim]


def test_decode_one_by_one_matches_prefill(tiny):
    cfg, model, toks, ref = tiny
    caches = make_caches(cfg, model.par, num_slots=3, num_blocks=8, block_size=4)
    reserve(caches, 2, 4, 3)
    out = [model.compute_logits(model(toks[t:t + 1], StepBatch.decode([2], [t]), caches))
           for t in range(T)]
    assert max_rel(torch.cat(out), ref) < 1e-4
    assert ref.shape == (T, cfg.vocab_size)


def test_chunked_prefill_matches_prefill(tiny):
    cfg, model, toks, ref = tiny
    caches = make_caches(cfg, model.par, num_slots=1, num_blocks=4, block_size=4)
    reserve(caches, 0, 0, 3)
    a = model(toks[:5], StepBatch([SeqSlice(0, 0, 5, 0)]), caches)
    b = model(toks[5:], StepBatch([SeqSlice(0, 0, T - 5, 5)]), caches)
    assert max_rel(model.compute_logits(torch.cat([a, b])), ref) < 1e-4


def test_mixed_step_of_decode_and_prefill_matches_separate_runs(tiny):
    cfg, model, toks, ref = tiny
    other = tokens(cfg, 6, seed=9)
    ref_other = model.compute_logits(model(other))
    caches = make_caches(cfg, model.par, num_slots=2, num_blocks=8, block_size=4)
    reserve(caches, 0, 0, 3)
    reserve(caches, 1, 3, 2)
    model(toks[:T - 1], StepBatch([SeqSlice(0, 0, T - 1, 0)]), caches)
    step = StepBatch([SeqSlice(1, 0, 6, 0), SeqSlice(0, 6, 1, T - 1)])
    logits = model.compute_logits(model(torch.cat([other, toks[T - 1:]]), step, caches))
    assert max_rel(logits[:6], ref_other) < 1e-4
    assert max_rel(logits[6:], ref[T - 1:]) < 1e-4


def test_rows_give_those_rows_of_the_full_forward(tiny):
    """forward(rows=...) mixes and normalises only the rows asked for (the sample rows): the
    same hidden state as every row's forward, those rows selected, in the order asked; no rows
    gives an empty (0, H); taps stay every row's."""
    cfg, model, toks, ref = tiny
    full = model(toks)
    for rows in ([T - 1], [3, 0, T - 1], []):
        idx = torch.tensor(rows, dtype=torch.long)
        got = model(toks, rows=idx)
        assert got.shape == (len(rows), cfg.hidden_size)
        if rows:
            assert max_rel(got, full[idx]) < 1e-5
            assert max_rel(model.compute_logits(got), ref[idx]) < 1e-5
    _, tapped = model(toks, taps=(0,), rows=torch.tensor([1]))
    assert tapped.shape == (T, cfg.hidden_size)
    for bad in (torch.tensor([[1]]), torch.tensor([1.0]), torch.tensor([1], dtype=torch.int32)):
        with pytest.raises(ValueError, match="flat int64"):
            model(toks, rows=bad)


def test_bad_steps_are_refused(tiny):
    _, model, toks, _ = tiny
    with pytest.raises(ValueError, match="position 0"):
        model(toks[:2], StepBatch([SeqSlice(0, 0, 2, 3)]), None)
    with pytest.raises(ValueError, match="T = sum"):
        model(toks[:3], StepBatch([SeqSlice(0, 0, 2, 0)]), None)


def test_attn_res_stream_bookkeeping():
    """Snapshots are taken at block starts; a single source mixes to itself; the final mix sees
    ceil(L / B) snapshots plus the prefix."""
    gen = torch.Generator().manual_seed(3)
    emb = torch.randn(2, 8, generator=gen)
    norm = RMSNorm(8, 1e-5)
    with torch.no_grad():
        norm.weight.fill_(1.0)
    proj = torch.randn(1, 8, generator=gen)
    bank = AttnResStream(emb)
    torch.testing.assert_close(bank.mix(norm, proj), emb)
    outs = [torch.randn(2, 8, generator=gen) for _ in range(4)]
    bank.add(outs[0], new_block=True)     # layer 0 attention: embedding becomes block 0
    bank.add(outs[1], new_block=False)    # layer 0 mlp
    bank.add(outs[2], new_block=False)    # layer 1 attention
    assert len(bank.blocks) == 1 and torch.equal(bank.blocks[0], emb)
    torch.testing.assert_close(bank.prefix, outs[0] + outs[1] + outs[2])
    values = torch.stack([emb, bank.prefix], 1)
    keys = values / values.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()
    p = (keys @ proj[0]).softmax(-1)
    torch.testing.assert_close(bank.mix(norm, proj), (p[..., None] * values).sum(1))
    torch.testing.assert_close(attn_res_mix(values, norm.weight, proj, 1e-5),
                               (p[..., None] * values).sum(1))


# ---- TP = 2 over gloo ---------------------------------------------------------------------

def _tp_worker(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        cfg = load_config("tiny")
        ref_model = init_random_(K3ForCausalLM(cfg), SEED)
        full = dict(ref_model.named_parameters())
        toks = tokens(cfg)
        ref = ref_model.compute_logits(ref_model(toks))
        for dcp in (1, 2):
            par = Parallel(rank, world, dcp)
            model = K3ForCausalLM(cfg, par, TorchComm(par))
            with torch.no_grad():   # what the weight loader does: slice the full tensors
                for name, p in model.named_parameters():
                    p.copy_(shard_tensor(full[name], p, par))
            got = model.compute_logits(model(toks))
            assert max_rel(got, ref) < 1e-4, ("prefill", dcp, max_rel(got, ref))
            caches = make_caches(cfg, par, num_slots=1, num_blocks=4, block_size=4)
            caches.mla.block_tables[0] = [3, 0, 2]
            n0 = 5   # chunked prefill, then decode token by token
            outs = [model(toks[:n0], StepBatch([SeqSlice(0, 0, n0, 0)]), caches)]
            outs += [model(toks[t:t + 1], StepBatch.decode([0], [t]), caches)
                     for t in range(n0, T)]
            got = model.compute_logits(torch.cat(outs))
            assert max_rel(got, ref) < 1e-4, ("cached", dcp, max_rel(got, ref))
            if dcp == 2:   # this rank holds only its parity of the positions
                rows, pos = caches.mla.read(0, 0, T)
                assert pos.tolist() == list(range(rank, T, 2))
    finally:
        dist.destroy_process_group()


def test_tp2_and_dcp2_match_tp1_over_gloo():
    mp.spawn(_tp_worker, args=(2, free_port()), nprocs=2, join=True)


def test_step_batch_rejects_out_of_order_sequences():
    ok = StepBatch([SeqSlice(slot=3, start=0, length=2, pos=5), SeqSlice(slot=1, start=2, length=1, pos=9)])
    assert ok.positions().tolist() == [5, 6, 9]
    with pytest.raises(ValueError, match="slot 3 starts at 1"):
        StepBatch([SeqSlice(slot=3, start=1, length=1, pos=5), SeqSlice(slot=1, start=0, length=1, pos=9)])
    with pytest.raises(ValueError, match="length 0"):
        StepBatch([SeqSlice(slot=3, start=0, length=0, pos=5)])
