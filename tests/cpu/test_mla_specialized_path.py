"""The model's specialized MLA decode through the fused ops of kernels/mla_decode.py (their
PyTorch references on CPU): the layer's outputs and cache rows equal the stock path's, over
batches with different positions and non-contiguous slots and blocks, after a prefill; DCP = 2
over gloo; the fast path is taken exactly where it should be (a spy that calls the real op)."""
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import raydecode.models.mla as mla
from raydecode.kernels.settings import DEFAULT_OPTIONS, DecodeOptions
from raydecode.models.cache import SeqSlice, StepBatch
from raydecode.models.config import load_config
from raydecode.models.k3 import K3ForCausalLM, init_random_, make_caches
from raydecode.models.layers import shard_tensor
from raydecode.models.parallel import Parallel, TorchComm

from _net import free_port
from _numerics import BF16_ULP, max_rel_err
from _numerics import TOL as NUM_TOL

torch.set_num_threads(1)
BF = torch.bfloat16
TOL = NUM_TOL["bf16_path"]     # bf16 specialized vs stock
ULP = BF16_ULP                  # one bf16 rounding, relative
# slot -> shuffled, non-contiguous blocks (pool of 16 blocks of 4 rows); slot 1 unused
TABLES = {3: [9, 2, 14], 0: [5, 11, 1, 7], 2: [4, 0]}
PREFILL = StepBatch([SeqSlice(0, 0, 5, 0), SeqSlice(3, 5, 2, 0), SeqSlice(2, 7, 3, 0)])
DECODE_ORDER = [3, 0, 2]                       # batch rows not in slot order
SEED = 11


# the DCP-1 fast path's op: the served absorbed-q form, or the folded-q_b one
# (DecodeOptions.mla_absorbed_q off)
DCP1 = "mla_decode_absorbed" if DEFAULT_OPTIONS.mla_absorbed_q else "mla_decode_fused"


class Spy:
    """Counts calls of the real models.mla.mla_decode_absorbed / mla_decode_fused /
    mla_attention and still runs them."""

    def __init__(self, monkeypatch=None):
        self.calls = {"mla_decode_absorbed": 0, "mla_decode_fused": 0, "mla_attention": 0}
        self.real = {n: getattr(mla, n) for n in self.calls}
        for n in self.calls:
            wrapped = self._wrap(n)
            if monkeypatch is not None:
                monkeypatch.setattr(mla, n, wrapped)
            else:     # spawned workers: patched for the process's life
                setattr(mla, n, wrapped)

    def _wrap(self, name):
        def call(*a, **k):
            self.calls[name] += 1
            return self.real[name](*a, **k)
        return call


def tiny(top_k: int | None = None):
    cfg = load_config("tiny")
    if top_k is not None:   # every expert selected: no routing flips amplify bf16 noise
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, top_k=top_k))
    return cfg


def fresh_caches(cfg, par, dtype=BF):
    c = make_caches(cfg, par, num_slots=4, num_blocks=16, block_size=4, dtype=dtype)
    c.mla.block_tables.update({s: list(t) for s, t in TABLES.items()})
    return c


def decode_steps(n: int, start: dict[int, int]):
    pos = dict(start)
    for _ in range(n):
        yield StepBatch.decode(DECODE_ORDER, [pos[s] for s in DECODE_ORDER])
        for s in DECODE_ORDER:
            pos[s] += 1


AFTER_PREFILL = {s.slot: s.pos + s.length for s in PREFILL.seqs}


# ---- one layer, TP = 1 -----------------------------------------------------------------------

def run_layer(attn, cfg, par, x, paths, steps=4):
    """Prefill (stock) then decode steps, each path on its own caches with the same inputs.
    -> {path: (outputs (T_total, H), pool)}."""
    out = {}
    for path in paths:
        c = fresh_caches(cfg, par, attn.o_proj.weight.dtype)
        with torch.inference_mode():
            ys = [attn(x[:PREFILL.num_tokens], PREFILL, c, "stock")]
            t = PREFILL.num_tokens
            for b in decode_steps(steps, AFTER_PREFILL):
                ys.append(attn(x[t:t + b.num_tokens], b, c, path))
                t += b.num_tokens
        out[path] = (torch.cat(ys), c.mla.pool)
    return out


@pytest.fixture(scope="module")
def bf16_model():
    cfg = tiny()
    return cfg, init_random_(K3ForCausalLM(cfg, dtype=BF), SEED)


@pytest.mark.parametrize("absorbed", [True, False])
def test_layer_fused_decode_equals_stock(bf16_model, monkeypatch, absorbed):
    """Both DCP-1 forms: the served absorbed-q one and the folded-q_b one (the option)."""
    cfg, model = bf16_model
    attn = model.model.layers[cfg.mla_layers[0]].self_attn
    x = torch.randn(30, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(BF)
    monkeypatch.setattr(attn, "options", DecodeOptions(mla_absorbed_q=absorbed))
    spy = Spy(monkeypatch)
    got = run_layer(attn, cfg, model.par, x, ("stock", "specialized"))
    op, other = (("mla_decode_absorbed", "mla_decode_fused") if absorbed
                 else ("mla_decode_fused", "mla_decode_absorbed"))
    assert spy.calls[op] == 4 and spy.calls[other] == 0          # every decode step, fused
    (ys, ps), (yf, pf) = got["stock"], got["specialized"]
    n = PREFILL.num_tokens
    assert torch.equal(yf[:n], ys[:n])                       # prefill ran stock in both
    for t in range(n, yf.shape[0]):
        assert max_rel_err(yf[t], ys[t]) < TOL, (t, max_rel_err(yf[t], ys[t]))
    # rows written at the same (block, offset) places, equal within one bf16 rounding
    assert torch.equal((pf != 0).any(-1), (ps != 0).any(-1))
    torch.testing.assert_close(pf.float(), ps.float(), rtol=ULP, atol=0)
    written = int((pf[0] != 0).any(-1).sum())                # this layer's pool row
    assert written == sum(AFTER_PREFILL.values()) + 4 * len(DECODE_ORDER), written


def test_fast_path_only_inside_its_envelope(bf16_model, monkeypatch):
    cfg, model = bf16_model
    attn = model.model.layers[cfg.mla_layers[0]].self_attn
    x = torch.randn(12, cfg.hidden_size, generator=torch.Generator().manual_seed(2)).to(BF)
    spy = Spy(monkeypatch)
    c = fresh_caches(cfg, model.par)
    with torch.inference_mode():
        attn(x[:10], PREFILL, c, "specialized")                        # prefill
        mixed = StepBatch([SeqSlice(0, 0, 1, 5), SeqSlice(1, 1, 2, 0)])
        c.mla.block_tables[1] = [3]
        attn(x[:3], mixed, c, "specialized")                           # decode + prefill
        dec = StepBatch.decode([2], [3])
        attn(x[3:4], dec, c, "stock")                                  # stock path
        assert spy.calls[DCP1] == 0
        attn(x[4:5], StepBatch.decode([2], [4]), c, "specialized")
        assert spy.calls[DCP1] == 1
    # no output gate; fp32 model and pool: the PyTorch code
    gateless = init_random_(K3ForCausalLM(cfg, dtype=BF), SEED)
    ga = gateless.model.layers[cfg.mla_layers[0]].self_attn
    ga.g_proj = None
    with torch.inference_mode():
        ga(x[5:6], StepBatch.decode([2], [0]), fresh_caches(cfg, gateless.par), "specialized")
    assert spy.calls[DCP1] == 1
    f32 = init_random_(K3ForCausalLM(cfg), SEED)
    a32 = f32.model.layers[cfg.mla_layers[0]].self_attn
    c32 = fresh_caches(cfg, f32.par, torch.float32)
    with torch.inference_mode():
        a32(x[:1].float(), StepBatch.decode([0], [0]), c32, "specialized")
    assert spy.calls[DCP1] == 1                                              # unchanged


def test_position_beyond_the_blocks_is_refused(bf16_model):
    cfg, model = bf16_model
    attn = model.model.layers[cfg.mla_layers[0]].self_attn
    c = fresh_caches(cfg, model.par)
    x = torch.randn(1, cfg.hidden_size).to(BF)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="position 8 beyond its 2"):
        attn(x, StepBatch.decode([2], [8]), c, "specialized")        # slot 2: 2 blocks of 4


def test_decode_meta_layout_memo_and_table_change():
    cfg = tiny()
    c = fresh_caches(cfg, Parallel())
    b = StepBatch.decode([3, 0], [9, 0])
    table, store, lens = mla.decode_meta(b, c.mla, "cpu")
    assert table.tolist() == [[9, 2, 14, 0], [5, 11, 1, 7]]
    assert store.tolist() == [9, 0] and lens.tolist() == [10, 1]
    assert store.is_contiguous() and lens.is_contiguous() and table.stride(1) == 1
    assert mla.decode_meta(b, c.mla, "cpu")[0] is table                # same step: memo
    c.mla.block_tables[3] = [8, 2, 14]                                  # engine replaced it
    assert mla.decode_meta(b, c.mla, "cpu")[0][0, 0].item() == 8
    # DCP 2, rank 1: positions 9 (odd: local row 4, 5 rows) and 0 (even: not stored, 0 rows)
    d = make_caches(cfg, Parallel(1, 2, 2), 4, 16, 4, BF)
    d.mla.block_tables.update({3: [1, 6], 0: [2]})
    _, store, lens = mla.decode_meta(b, d.mla, "cpu")
    assert store.tolist() == [4, -1] and lens.tolist() == [5, 0]


def test_decode_meta_rows_follow_the_tables_across_steps():
    """Each step's paging holds its tables' blocks, 0-padded to the widest, while the rows
    are kept as tensors across steps (`_table_row`): a table the engine kept is not rebuilt,
    a replaced one (longer, or the same length with other blocks) is read anew, and a
    wider table in the step widens every row."""
    cfg = tiny()
    c = fresh_caches(cfg, Parallel())
    gen = torch.Generator().manual_seed(5)

    def blocks(n):
        return torch.randint(0, 16, (n,), generator=gen).tolist()

    c.mla.block_tables.update({0: blocks(3), 1: blocks(1), 2: blocks(2)})
    for step, (grow, same_len, wide) in enumerate([(False, False, False), (True, False, False),
                                                   (False, True, False), (False, False, True)]):
        if grow:                                      # slot 1's table replaced, one block more
            c.mla.block_tables[1] = c.mla.block_tables[1] + blocks(1)
        if same_len:                                  # slot 0's replaced at the same length
            c.mla.block_tables[0] = blocks(3)
        if wide:
            c.mla.block_tables[2] = blocks(7)
        kept = mla._TABLE_ROWS.get((id(c.mla), 2))
        tables = {s: c.mla.block_tables[s] for s in (0, 1, 2)}
        pos = {s: 4 * len(t) - 1 for s, t in tables.items()}
        b = StepBatch.decode([0, 1, 2], [pos[0], pos[1], pos[2]])
        table, _, lens = mla.decode_meta(b, c.mla, "cpu")
        width = max(len(t) for t in tables.values())
        assert table.tolist() == [tables[s] + [0] * (width - len(tables[s])) for s in (0, 1, 2)]
        assert lens.tolist() == [pos[s] + 1 for s in (0, 1, 2)]
        if step and not wide:                         # slot 2 kept its list: its row too
            assert mla._TABLE_ROWS[(id(c.mla), 2)][2] is kept[2]


def test_w_uv_t_copy_follows_the_weight():
    cfg = tiny()
    attn = init_random_(K3ForCausalLM(cfg, dtype=BF), SEED).model.layers[2].self_attn
    w = attn._w_uv_t()
    assert w.is_contiguous() and attn._w_uv_t() is w                    # kept
    torch.testing.assert_close(w, attn.absorbed_weights()[1].transpose(1, 2), rtol=0, atol=0)
    with torch.no_grad():
        attn.kv_b_proj.weight.mul_(2)                                   # weight reloaded
    w2 = attn._w_uv_t()
    assert w2 is not w
    torch.testing.assert_close(w2, 2 * w, rtol=0, atol=0)


# ---- whole model, TP = 1 ---------------------------------------------------------------------

def test_model_decode_error_matches_stock_bf16(monkeypatch):
    """bf16 logits of the fused path are as close to the fp32 model as stock bf16's are (the
    tiny model amplifies bf16 noise to ~10% over its layers, so the direct specialized-vs-stock
    gap is bf16 noise, not a bound: both are measured against fp32)."""
    cfg = tiny(top_k=8)
    toks = torch.randint(0, cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(4))
    spy = Spy(monkeypatch)

    def run(dtype, path):
        model = init_random_(K3ForCausalLM(cfg, dtype=dtype), SEED)
        c = fresh_caches(cfg, model.par, dtype)
        with torch.inference_mode():
            outs, t = [model(toks[:PREFILL.num_tokens], PREFILL, c, path)], PREFILL.num_tokens
            for b in decode_steps(4, AFTER_PREFILL):
                outs.append(model(toks[t:t + b.num_tokens], b, c, path))
                t += b.num_tokens
            return model.compute_logits(torch.cat(outs))[PREFILL.num_tokens:]

    truth = run(torch.float32, "stock")
    stock = run(BF, "stock")
    assert spy.calls[DCP1] == 0
    fused = run(BF, "specialized")
    assert spy.calls[DCP1] == 4 * len(cfg.mla_layers)
    e_stock, e_fused = max_rel_err(stock, truth), max_rel_err(fused, truth)
    assert e_fused < 1.25 * e_stock + 1e-2, (e_fused, e_stock)


# ---- DCP = 2 (TP = 2) over gloo --------------------------------------------------------------

def _dcp_worker(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        cfg = tiny()
        full = dict(init_random_(K3ForCausalLM(cfg, dtype=BF), SEED).named_parameters())
        x = torch.randn(30, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to(BF)
        spy = Spy()
        for dcp in (1, 2):
            par = Parallel(rank, world, dcp)
            model = K3ForCausalLM(cfg, par, TorchComm(par), BF)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(shard_tensor(full[name], p, par))
            attn = model.model.layers[cfg.mla_layers[1]].self_attn
            before = dict(spy.calls)
            got = run_layer(attn, cfg, par, x, ("stock", "specialized"))
            (ys, ps), (yf, pf) = got["stock"], got["specialized"]
            fused = DCP1 if dcp == 1 else "mla_attention"
            assert spy.calls[fused] - before[fused] == 4, (dcp, spy.calls)
            for t in range(PREFILL.num_tokens, yf.shape[0]):
                assert max_rel_err(yf[t], ys[t]) < TOL, (dcp, t, max_rel_err(yf[t], ys[t]))
            assert torch.equal((pf != 0).any(-1), (ps != 0).any(-1)), dcp
            torch.testing.assert_close(pf.float(), ps.float(), rtol=ULP, atol=0)
            held = int((pf[1] != 0).any(-1).sum())                    # rows of this rank
            ends = [AFTER_PREFILL[s] + 4 for s in DECODE_ORDER]
            assert held == sum(len(range(par.dcp_rank, e, dcp)) for e in ends), (dcp, held)
    finally:
        dist.destroy_process_group()


def test_tp2_dcp1_and_dcp2_fused_decode_equal_stock_over_gloo():
    mp.spawn(_dcp_worker, args=(2, free_port()), nprocs=2, join=True)
