"""MLA absorbed decode kernels (kernels/mla_decode_triton.py) vs references, over the paged
latent cache. On CUDA (the H200) every case; on a CPU under TRITON_INTERPRET=1 the small ones:

    TRITON_INTERPRET=1 python -m pytest \
        tests/gpu/test_mla_decode.py -q -x

Fresh random inputs per case (seed from os.urandom, in every failure message); outputs are
preallocated NaN, so an element a kernel never writes fails; block tables are shuffled over a
pool with spare blocks; seq_lens vary per sequence (1, non-multiples of the block size, full).
Tolerances `TOL` (‖out − ref‖ / ‖ref‖, fp64): the kernel rounds p to bf16 before p·V, so
o_lat is checked against an fp64 reference at bf16-level tolerance; outputs against the stock
composition (p bf16 after softmax) at bf16 tolerance. The interpreter truncates
fp32 -> bf16 (1 ulp), the tolerances cover both.
"""
from __future__ import annotations

import os

import pytest
import torch

from raydecode.kernels import mla_decode as M
from raydecode.kernels import mla_decode_triton as MT

from _numerics import fresh_seed, rel_err

ON_GPU = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(MT.triton is None or not (ON_GPU or INTERP),
                                reason="needs Triton and CUDA (or TRITON_INTERPRET=1)")
gpu_only = pytest.mark.skipif(not ON_GPU, reason="large shape: GPU only (interpreter too slow)")
DEV = "cuda" if ON_GPU else "cpu"
BF = torch.bfloat16
TOL = {
    "q": 8e-3,        # one bf16 rounding (reduction order / interpreter truncation)
    "row": 8e-3,
    "absorb": 8e-3,
    "o_lat": 6e-3,    # vs fp64: p rounded to bf16 (relative 2^-9 per weight)
    "lse": 1e-5,      # absolute / max|lse|, fp32 reductions
    "out": 1.5e-2,    # vs the stock composition: bf16 p there, here; o_lat, o, out rounded
    # the fused op rounds at 6 points (q_n, q_abs, p, o_lat, o, out): under the interpreter
    # each is a truncation, biased the same way (max 0.0234 over 120 seeded cases there;
    # 0.011 between the two round-to-nearest references)
    "fused": 3e-2 if INTERP and not ON_GPU else 1.5e-2,
}
# (h, kv_lora, rope, nope, v, q_lora)
SHAPES = {"small": (4, 64, 16, 32, 32, 64), "tp16": (6, 512, 64, 128, 128, 1536),
          "tp8": (12, 512, 64, 128, 128, 1536)}


def _nan(*shape, dtype=BF):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


class Case:
    """Random weights/cache for one shape: paged cache (bs rows per block, spare blocks,
    shuffled table), seq_lens with 1 and non-multiples of bs."""

    def __init__(self, shape: str, T: int, ctx: int, bs: int, seed: int):
        self.h, self.kl, self.r, self.nope, self.v, self.ql = SHAPES[shape]
        self.T, self.ctx, self.bs, self.seed = T, ctx, bs, seed
        g = torch.Generator(device=DEV).manual_seed(seed)
        rn = lambda *s, sc=1.0: (sc * torch.randn(*s, generator=g, device=DEV)).to(BF)  # noqa
        mb = -(-ctx // bs)
        nb = T * mb + 5
        self.cache = rn(nb, bs, self.kl + self.r)
        self.bt = torch.randperm(nb, generator=g, device=DEV)[:T * mb].view(T, mb).int()
        lens = torch.randint(1, ctx + 1, (T,), generator=g, device=DEV)
        fixed = [1, ctx, max(1, ctx - bs // 2 - 1), min(ctx, bs + 3)]
        lens[:min(T, 4)] = torch.tensor(fixed[:min(T, 4)], device=DEV)
        self.seq = lens.int()
        self.q_abs = rn(T, self.h, self.kl + self.r)
        self.scale = (self.nope + self.r) ** -0.5
        self.w_uv = rn(self.h, self.kl, self.v, sc=self.kl ** -0.5)
        big = rn(T, 3 * self.h * self.v)
        self.gate = big[:, self.h * self.v:2 * self.h * self.v]        # strided column slice

    @property
    def msg(self) -> str:
        return f"seed {self.seed} h {self.h} c {self.kl} T {self.T} ctx {self.ctx} bs {self.bs}"


def _attn_fp64(c: Case) -> tuple[torch.Tensor, torch.Tensor]:
    rows, idx = M.paged_rows(c.cache, c.bt, c.T)
    r = rows.double()
    s = torch.bmm(c.q_abs.double(), r.transpose(1, 2)) * c.scale
    s = s.masked_fill((idx[None] >= c.seq[:, None].long())[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.bmm(torch.softmax(s, -1), r[..., :c.kl]), lse


def _stock_o_lat(c: Case) -> torch.Tensor:
    """The stock composition's rounding: fp32 scores and softmax, p to bf16, p·V fp32."""
    rows, idx = M.paged_rows(c.cache, c.bt, c.T)
    s = torch.bmm(c.q_abs.float(), rows.float().transpose(1, 2)) * c.scale
    s = s.masked_fill((idx[None] >= c.seq[:, None].long())[:, None], float("-inf"))
    p = s.softmax(-1).to(BF)
    return torch.bmm(p.float(), rows[..., :c.kl].float())


def _attention(c: Case, S: int | None):
    """Split kernel + merge kernel (or the split kernel alone at S = 1), NaN workspaces."""
    S = S or M.default_num_splits(c.T, c.bt.shape[1] * c.bs)
    o_p, l_p = _nan(c.T, S, c.h, c.kl, dtype=torch.float32), _nan(c.T, S, c.h,
                                                                  dtype=torch.float32)
    M.attention_partials(c.q_abs, c.cache, c.bt, c.seq, kv_lora=c.kl, scale=c.scale,
                         o_part=o_p, lse_part=l_p)
    o, lse = _nan(c.T, c.h, c.kl, dtype=torch.float32), _nan(c.T, c.h, dtype=torch.float32)
    MT.merge_triton(o_p, l_p, o, lse)
    return o, lse, o_p, l_p


SMALL_CASES = [("small", 1, 40, 16), ("small", 4, 150, 16), ("small", 3, 200, 64)]
BIG_CASES = [(s, T, ctx, 64) for s in ("tp16", "tp8") for T in (1, 2, 4, 64)
             for ctx in (1024, 8192)]
CASES = SMALL_CASES + [("tp16", 2, 100, 64)] + [pytest.param(*a, marks=gpu_only)
                                                for a in BIG_CASES]


@pytest.mark.parametrize("shape,T,ctx,bs", CASES)
@pytest.mark.parametrize("splits", [1, 3, None])
def test_attention_and_output(shape, T, ctx, bs, splits):
    c = Case(shape, T, ctx, bs, fresh_seed())
    o, lse, o_p, l_p = _attention(c, splits)
    assert not o.isnan().any() and not lse.isnan().any(), c.msg
    assert not o_p.isnan().any() and not l_p.isnan().any(), c.msg      # empty splits written
    ro, rl = _attn_fp64(c)
    assert rel_err(o, ro) <= TOL["o_lat"], c.msg
    assert float((lse - rl).abs().max() / rl.abs().max()) <= TOL["lse"], c.msg
    stock = M.mla_output_reference(_stock_o_lat(c), rl.float(), c.w_uv, c.gate)
    out = _nan(T, c.h * c.v)
    MT.output_triton(o_p, l_p, c.w_uv, c.gate, out)                  # merge fused in
    assert not out.isnan().any(), c.msg
    assert rel_err(out, stock) <= TOL["out"], c.msg
    assert rel_err(out, M.mla_output_reference(o_p, l_p, c.w_uv, c.gate)) <= TOL["out"], c.msg
    if ON_GPU:   # the public ops dispatch to the kernels on CUDA
        po, pl = M.mla_attention(c.q_abs, c.cache, c.bt, c.seq, kv_lora=c.kl, scale=c.scale,
                                 num_splits=splits)
        assert rel_err(po, ro) <= TOL["o_lat"], c.msg
        d = M.mla_decode(c.q_abs, c.cache, c.bt, c.seq, c.w_uv, c.gate, kv_lora=c.kl,
                         scale=c.scale, num_splits=splits)
        assert rel_err(d, stock) <= TOL["out"], c.msg


def test_many_splits_empty_sequence_and_dcp_layout():
    """More splits than rows (empty splits), a 0-row sequence (o 0, lse −inf), and partials
    handed to the output kernel in DCP's gathered (S, T, h, c) layout, permuted (strided)."""
    c = Case("small", 3, 70, 16, fresh_seed())
    c.seq[2] = 0
    o, lse, o_p, l_p = _attention(c, 40)
    assert torch.equal(o[2], torch.zeros_like(o[2])), c.msg
    assert bool((lse[2] == float("-inf")).all()), c.msg
    ro, rl = _attn_fp64(c)
    assert rel_err(o[:2], ro[:2]) <= TOL["o_lat"], c.msg
    gathered_o = o_p.transpose(0, 1).contiguous()                       # (S, T, h, c)
    gathered_l = l_p.transpose(0, 1).contiguous()
    out = _nan(c.T, c.h * c.v)
    MT.output_triton(gathered_o.transpose(0, 1), gathered_l.transpose(0, 1), c.w_uv, c.gate, out)
    ref = M.mla_output_reference(o_p, l_p, c.w_uv, c.gate)
    assert torch.equal(out[2], torch.zeros_like(out[2])), c.msg
    assert rel_err(out, ref) <= TOL["out"], c.msg


PREP = [("small", 1, 16), ("small", 5, 16), ("tp16", 2, 64),
        pytest.param("tp16", 64, 64, marks=gpu_only), pytest.param("tp8", 4, 64, marks=gpu_only)]


@pytest.mark.parametrize("shape,T,bs", PREP)
def test_prep(shape, T, bs):
    seed = fresh_seed()
    c = Case(shape, T, 3 * bs, bs, seed)
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    w = c.ql + c.kl + c.r
    qkv = torch.randn(T, w + 24, generator=g, device=DEV).to(BF)[:, 8:8 + w]  # row stride
    wq = 1 + 0.1 * torch.randn(c.ql, generator=g, device=DEV)
    wkv = 1 + 0.1 * torch.randn(c.kl, generator=g, device=DEV)
    pos = torch.randint(0, 3 * bs, (T,), generator=g, device=DEV)
    pos[0] = bs - 1
    if T > 1:
        pos[1] = -1                                                      # not written
    ref_cache = c.cache.clone()
    rq = M.mla_prep_reference(qkv, wq, wkv, ref_cache, c.bt, pos, q_lora=c.ql, kv_lora=c.kl,
                              eps=1e-6)
    q = _nan(T, c.ql)
    MT.prep_triton(qkv, wq, wkv, c.cache, c.bt, pos, c.ql, c.kl, 1e-6, q)
    assert rel_err(q, rq) <= TOL["q"], f"seed {seed}"
    diff = (c.cache != ref_cache).any(-1)
    written = (ref_cache != Case(shape, T, 3 * bs, bs, seed).cache).any(-1)
    assert int(written.sum()) == T - (T > 1), f"seed {seed}"
    assert rel_err(c.cache[written], ref_cache[written]) <= TOL["row"], f"seed {seed}"
    assert not bool((diff & ~written).any()), f"seed {seed}: a row outside the positions"


@pytest.mark.parametrize("shape,T", [("small", 1), ("small", 20), ("tp16", 3),
                                     pytest.param("tp8", 64, marks=gpu_only)])
def test_absorb(shape, T):
    seed = fresh_seed()
    h, kl, r, nope, _, _ = SHAPES[shape]
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(T, h, nope + r, generator=g, device=DEV).to(BF)
    w_uk = (torch.randn(h, nope, kl, generator=g, device=DEV) / nope ** 0.5).to(BF)
    out = _nan(T, h, kl + r)
    MT.absorb_triton(q, w_uk, nope, out)
    ref = M.mla_absorb_reference(q, w_uk, nope=nope)
    assert not out.isnan().any(), f"seed {seed}"
    assert rel_err(out, ref) <= TOL["absorb"], f"seed {seed}"
    assert torch.equal(out[..., kl:], q[..., nope:]), f"seed {seed}"


@gpu_only
@pytest.mark.parametrize("shape,T,ctx", [("tp16", 1, 1024), ("tp8", 64, 8192), ("small", 4, 300)])
def test_graph_capture_and_replay(shape, T, ctx):
    """prep → absorb → decode (4 kernels) captured once, replayed with new inputs."""
    c = Case(shape, T, ctx, 64, fresh_seed())
    g = torch.Generator(device=DEV).manual_seed(c.seed + 7)
    w = c.ql + c.kl + c.r
    qkv = torch.randn(T, w, generator=g, device=DEV).to(BF)
    wq = 1 + 0.1 * torch.randn(c.ql, generator=g, device=DEV)
    wkv = 1 + 0.1 * torch.randn(c.kl, generator=g, device=DEV)
    q = torch.randn(T, c.h, c.nope + c.r, generator=g, device=DEV).to(BF)
    w_uk = (torch.randn(c.h, c.nope, c.kl, generator=g, device=DEV) / c.nope ** 0.5).to(BF)
    pos = (c.seq - 1).long()
    q_n, q_abs, out = _nan(T, c.ql), _nan(T, c.h, c.kl + c.r), _nan(T, c.h * c.v)

    def step():
        M.mla_prep(qkv, wq, wkv, c.cache, c.bt, pos, q_lora=c.ql, kv_lora=c.kl, eps=1e-6,
                   q_out=q_n)
        M.mla_absorb(q, w_uk, nope=c.nope, out=q_abs)
        M.mla_decode(q_abs, c.cache, c.bt, c.seq, c.w_uv, c.gate, kv_lora=c.kl,
                     scale=c.scale, out=out)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()                                                         # compile / warm up
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(2):      # new inputs in the static buffers, new lengths
        qkv.copy_(torch.randn(T, w, generator=g, device=DEV))
        q.copy_(torch.randn(T, c.h, c.nope + c.r, generator=g, device=DEV))
        c.gate.copy_(torch.randn(T, c.h * c.v, generator=g, device=DEV))
        c.seq.copy_(torch.randint(1, ctx + 1, (T,), generator=g, device=DEV))
        pos.copy_(c.seq - 1)
        ref_cache = c.cache.clone()
        q_n.fill_(float("nan")), q_abs.fill_(float("nan")), out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        rq = M.mla_prep_reference(qkv, wq, wkv, ref_cache, c.bt, pos, q_lora=c.ql,
                                  kv_lora=c.kl, eps=1e-6)
        assert rel_err(q_n, rq) <= TOL["q"] and rel_err(c.cache, ref_cache) <= TOL["row"], c.msg
        ra = M.mla_absorb_reference(q, w_uk, nope=c.nope)
        assert rel_err(q_abs, ra) <= TOL["absorb"], c.msg
        c.q_abs = q_abs.clone()
        ro, rl = _attn_fp64(c)
        stock = M.mla_output_reference(_stock_o_lat(c), rl.float(), c.w_uv, c.gate)
        assert rel_err(out, stock) <= TOL["out"], c.msg


# ---- the fused op: prep's row store + q norm, absorb, split, output in one kernel ----------

def _fused_inputs(c: Case, g: torch.Generator):
    """qkv (row-strided), norm weights, raw q_b and w_uk; pos = seq_len − 1 (one row unset).
    Token 0 attends over the whole context (Case gives it 1 row, where softmax is flat)."""
    c.seq[0] = c.ctx
    w = c.ql + c.kl + c.r
    qkv = torch.randn(c.T, w + 16, generator=g, device=DEV)
    qkv[:, 8:8 + c.ql] *= 0.25 + 4 * torch.rand(c.T, 1, generator=g, device=DEV)  # rms ≠ 1
    qkv = qkv.to(BF)[:, 8:8 + w]
    wq = 1 + 0.2 * torch.randn(c.ql, generator=g, device=DEV)
    wkv = 1 + 0.2 * torch.randn(c.kl, generator=g, device=DEV)
    q_b = (torch.randn(c.h * (c.nope + c.r), c.ql, generator=g, device=DEV)
           / c.ql ** 0.5).to(BF)
    w_uk = (torch.randn(c.h, c.nope, c.kl, generator=g, device=DEV) / c.nope ** 0.5).to(BF)
    pos = (c.seq - 1).long()
    if c.T > 2:
        pos[2] = -1                                                    # padding: no store
    return qkv, wq, wkv, q_b, w_uk, pos


def _stock_mla(c: Case, qkv, wq, wkv, q_b, w_uk, pos, cache):
    """The stock composition: prep (norms, row store), q_b GEMV on q_n, absorb, attention
    with p rounded to bf16 after softmax, output."""
    q_n = M.mla_prep_reference(qkv, wq, wkv, cache, c.bt, pos, q_lora=c.ql, kv_lora=c.kl,
                               eps=1e-6)
    q = torch.nn.functional.linear(q_n, q_b).view(c.T, c.h, c.nope + c.r)
    ref = Case.__new__(Case)
    ref.__dict__.update(c.__dict__, cache=cache, q_abs=M.mla_absorb_reference(q, w_uk,
                                                                             nope=c.nope))
    _, rl = _attn_fp64(ref)
    return M.mla_output_reference(_stock_o_lat(ref), rl.float(), c.w_uv, c.gate)


def _check_call(c: Case, out, ref, before, ref_cache, stock, msg: str, fold: str) -> None:
    """One call of a DCP-1 decode op (output `out`, cache `c.cache`, which held `before`) vs
    its reference (output `ref`, cache `ref_cache`) and the stock composition's `stock`: the
    output, the rows written (every token but the one at position −1) and no other row."""
    assert not out.isnan().any(), msg
    assert rel_err(out, ref) <= TOL["fused"], msg
    written = (ref_cache != before).any(-1)
    assert int(written.sum()) == c.T - (c.T > 2), msg
    assert rel_err(c.cache[written], ref_cache[written]) <= TOL["row"], msg
    assert torch.equal(c.cache[~written], before[~written]), f"{msg}: a row off positions"
    assert rel_err(out, stock) <= TOL["fused"], f"{msg}: {fold} vs stock"


FUSED = [("small", 1, 40, 16), ("small", 3, 150, 16), ("small", 9, 70, 16),
         ("tp16", 1, 100, 64)] + [pytest.param(*a, marks=gpu_only) for a in
                                  [("tp16", 1, 1024, 64), ("tp16", 4, 1024, 64),
                                   ("tp16", 64, 1024, 64), ("tp8", 1, 8192, 64),
                                   ("tp8", 16, 1024, 64)]]


def _fused(c: Case, qkv, q, wkv, w_uk, pos, sync, out, three: bool):
    """The fused op as one launch, or (three) phase A alone + the split + output kernels,
    on NaN workspaces."""
    S = M.default_num_splits(c.T, c.bt.shape[1] * c.bs)
    q_abs = _nan(c.T, c.h, c.kl + c.r)
    o_p, l_p = (_nan(c.T, S, c.h, c.kl, dtype=torch.float32),
                _nan(c.T, S, c.h, dtype=torch.float32))
    MT.fused_triton(qkv, q, wkv, w_uk, c.cache, c.bt, pos, c.seq, c.w_uv, c.gate, c.ql, c.kl,
                    1e-6, c.scale, q_abs, o_p, l_p, sync, out, only_a=three)
    if three:
        assert not q_abs.isnan().any(), c.msg
        MT.split_triton(q_abs, c.cache, c.bt, c.seq, c.kl, c.scale, o_p, l_p)
        MT.output_triton(o_p, l_p, c.w_uv, c.gate, out)


@pytest.mark.parametrize("three", [False, True])
@pytest.mark.parametrize("shape,T,ctx,bs", FUSED)
def test_fused_equals_reference_and_stock(shape, T, ctx, bs, three):
    """One launch (or phase A + split + output) vs its reference (same rounding points) and
    vs the stock 4-op composition with unfolded weights; the cache rows; the counters left
    zero; two calls back to back (the second starts from the first's reset counters)."""
    c = Case(shape, T, ctx, bs, fresh_seed())
    g = torch.Generator(device=DEV).manual_seed(c.seed + 3)
    qkv, wq, wkv, q_b, w_uk, pos = _fused_inputs(c, g)
    wf = M.folded_q_b_weight(q_b, wq).float()
    q = (qkv[:, :c.ql].float() @ wf.t()).view(c.T, c.h, c.nope + c.r)   # fp32, as the step
    sync = torch.zeros(8, dtype=torch.int32, device=DEV)
    for call in range(2):
        before = c.cache.clone()
        ref_cache, stock_cache = before.clone(), before.clone()
        out = _nan(T, c.h * c.v)
        _fused(c, qkv, q, wkv, w_uk, pos, sync, out, three)
        msg = f"{c.msg} call {call} three {three}"
        assert torch.equal(sync[:4], torch.zeros_like(sync[:4])) and int(sync[4]) == 0, \
            f"{msg}: counters {sync.tolist()}"
        ref = M.mla_decode_fused_reference(qkv, q, wkv, w_uk, ref_cache, c.bt, pos, c.seq,
                                           c.w_uv, c.gate, q_lora=c.ql, kv_lora=c.kl,
                                           eps=1e-6, scale=c.scale)
        _check_call(c, out, ref, before, ref_cache,
                    _stock_mla(c, qkv, wq, wkv, q_b, w_uk, pos, stock_cache),
                    msg, "folded q norm")
        qkv.copy_(torch.randn(qkv.shape, generator=g, device=DEV))
        q = (qkv[:, :c.ql].float() @ wf.t()).view(c.T, c.h, c.nope + c.r)


def _capture(step) -> torch.cuda.CUDAGraph:
    """`step` run once on a side stream (compiles, allocates), then captured."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def _replays_equal_reference(c: Case, g, ctx: int, qkv, pos, out, graph, reference) -> None:
    """Three replays with new qkv, gate, lengths and positions (= length − 1); after each,
    `reference(cache copy from before the replay)` equals the replay's output and cache."""
    for k in range(3):
        qkv.copy_(torch.randn(qkv.shape, generator=g, device=DEV))
        c.gate.copy_(torch.randn(c.gate.shape, generator=g, device=DEV))
        c.seq.copy_(torch.randint(1, ctx + 1, (c.T,), generator=g, device=DEV))
        pos.copy_(c.seq - 1)
        ref_cache = c.cache.clone()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference(ref_cache)
        assert rel_err(out, ref) <= TOL["fused"], f"{c.msg} replay {k}"
        assert rel_err(c.cache, ref_cache) <= TOL["row"], f"{c.msg} replay {k}"


@gpu_only
@pytest.mark.parametrize("shape,T,ctx", [("tp16", 1, 1024), ("tp16", 2, 1024),
                                         ("tp16", 64, 1024)])
def test_fused_graph_replays(shape, T, ctx):
    """The fused op captured once and replayed with new inputs and lengths: the counters
    reset inside the kernel, so every replay is right."""
    c = Case(shape, T, ctx, 64, fresh_seed())
    g = torch.Generator(device=DEV).manual_seed(c.seed + 5)
    qkv, wq, wkv, q_b, w_uk, pos = _fused_inputs(c, g)
    wf = M.folded_q_b_weight(q_b, wq).float()
    q = torch.empty(T, c.h, c.nope + c.r, device=DEV)                  # fp32, as the step
    out = _nan(T, c.h * c.v)
    sync = torch.zeros(8, dtype=torch.int32, device=DEV)

    def step():
        torch.matmul(qkv[:, :c.ql].float(), wf.t(), out=q.view(T, -1))
        M.mla_decode_fused(qkv, q, wkv, w_uk, c.cache, c.bt, pos, c.seq, c.w_uv, c.gate,
                           q_lora=c.ql, kv_lora=c.kl, eps=1e-6, scale=c.scale, out=out,
                           sync=sync)

    def reference(ref_cache):
        M.check_fused_sync(sync)
        return M.mla_decode_fused_reference(qkv, q, wkv, w_uk, ref_cache, c.bt, pos, c.seq,
                                            c.w_uv, c.gate, q_lora=c.ql, kv_lora=c.kl,
                                            eps=1e-6, scale=c.scale)

    _replays_equal_reference(c, g, ctx, qkv, pos, out, _capture(step), reference)


# ---- the absorbed-q op (the served DCP-1 form): split (+ q scale, row), output ----------------

def _absorbed_q(c: Case, qkv, wq, q_b, w_uk):
    """W_q'' (W_uk and the q norm weight folded into q_b) and q = x·W_q''ᵀ in fp32, as the
    step's GEMV writes it."""
    wa = M.absorbed_q_weight(q_b, w_uk, c.h, c.nope, c.r, q_norm_w=wq).float()
    return wa, (qkv[:, :c.ql].float() @ wa.t()).view(c.T, c.h, c.kl + c.r)


@pytest.mark.parametrize("shape,T,ctx,bs", FUSED)
def test_absorbed_equals_reference_and_stock(shape, T, ctx, bs):
    """mla_decode_absorbed (2 kernels) vs its reference (same rounding points) and vs the
    stock 4-op composition with unfolded weights; the cache rows (one token's position −1:
    not stored); two calls back to back on NaN outputs."""
    c = Case(shape, T, ctx, bs, fresh_seed())
    g = torch.Generator(device=DEV).manual_seed(c.seed + 7)
    qkv, wq, wkv, q_b, w_uk, pos = _fused_inputs(c, g)
    wa, q = _absorbed_q(c, qkv, wq, q_b, w_uk)
    for call in range(2):
        before = c.cache.clone()
        ref_cache, stock_cache = before.clone(), before.clone()
        out = _nan(T, c.h * c.v)
        M.mla_decode_absorbed(qkv, q, wkv, c.cache, c.bt, pos, c.seq, c.w_uv, c.gate,
                              q_lora=c.ql, kv_lora=c.kl, eps=1e-6, scale=c.scale, out=out)
        msg = f"{c.msg} call {call}"
        ref = M.mla_decode_absorbed_reference(qkv, q, wkv, ref_cache, c.bt, pos, c.seq,
                                              c.w_uv, c.gate, q_lora=c.ql, kv_lora=c.kl,
                                              eps=1e-6, scale=c.scale)
        _check_call(c, out, ref, before, ref_cache,
                    _stock_mla(c, qkv, wq, wkv, q_b, w_uk, pos, stock_cache),
                    msg, "folded W_uk and q norm")
        qkv.copy_(torch.randn(qkv.shape, generator=g, device=DEV))
        q = (qkv[:, :c.ql].float() @ wa.t()).view(c.T, c.h, c.kl + c.r)


@gpu_only
@pytest.mark.parametrize("shape,T,ctx", [("tp16", 1, 1024), ("tp16", 2, 1024),
                                         ("tp16", 64, 1024), ("tp8", 1, 8192)])
def test_absorbed_graph_replays(shape, T, ctx):
    """The absorbed op captured once and replayed with new inputs, lengths and positions (the
    row's owning split moves with them): every replay equals the reference."""
    c = Case(shape, T, ctx, 64, fresh_seed())
    g = torch.Generator(device=DEV).manual_seed(c.seed + 9)
    qkv, wq, wkv, q_b, w_uk, pos = _fused_inputs(c, g)
    wa, _ = _absorbed_q(c, qkv, wq, q_b, w_uk)
    q = torch.empty(T, c.h, c.kl + c.r, device=DEV)                    # fp32, as the step
    out = _nan(T, c.h * c.v)

    def step():
        torch.matmul(qkv[:, :c.ql].float(), wa.t(), out=q.view(T, -1))
        M.mla_decode_absorbed(qkv, q, wkv, c.cache, c.bt, pos, c.seq, c.w_uv, c.gate,
                              q_lora=c.ql, kv_lora=c.kl, eps=1e-6, scale=c.scale, out=out)

    def reference(ref_cache):
        return M.mla_decode_absorbed_reference(qkv, q, wkv, ref_cache, c.bt, pos, c.seq,
                                               c.w_uv, c.gate, q_lora=c.ql, kv_lora=c.kl,
                                               eps=1e-6, scale=c.scale)

    _replays_equal_reference(c, g, ctx, qkv, pos, out, _capture(step), reference)


# ---- the served model's specialized MLA decode (models/mla.py) on these kernels --------------

@pytest.fixture
def kernels_dispatched(monkeypatch):
    """The public ops run the kernels: on CUDA as shipped; under the interpreter also on CPU
    tensors (the ops otherwise take their references off-GPU). Counts the launches of the
    DCP-1 decode's first kernel (the model's D = 1 decode is one `split_rows_triton` per layer
    and step; `fused_triton` with DecodeOptions.mla_absorbed_q off)."""
    if not ON_GPU:
        monkeypatch.setattr(M, "_use_triton", MT.available)
    launches = [0]
    for name in ("fused_triton", "split_rows_triton"):
        real = getattr(MT, name)

        def counted(*a, _real=real, **k):
            launches[0] += 1
            return _real(*a, **k)

        monkeypatch.setattr(MT, name, counted)
    return launches


# (T sequences, longest prompt, block size): T = 1; a batch with S > 1 splits; batch 64
MODEL_CASES = [(1, 5, 4), (3, 150, 16), pytest.param(64, 300, 64, marks=gpu_only)]


@pytest.mark.parametrize("T,prompt,bs", MODEL_CASES)
def test_model_layer_specialized_decode_equals_stock(T, prompt, bs, kernels_dispatched):
    """tiny K3 in bf16: one MLA layer, prefill (stock) then 3 decode steps with sequences at
    different positions in shuffled non-contiguous slots and blocks; path 'specialized' (the
    kernels) vs 'stock' (PyTorch) on separate caches, same inputs: outputs and cache rows."""
    from raydecode.models.cache import SeqSlice, StepBatch
    from raydecode.models.config import load_config
    from raydecode.models.k3 import K3ForCausalLM, init_random_, make_caches

    seed, steps = fresh_seed(), 3
    msg = f"seed {seed} T {T} prompt {prompt} bs {bs}"
    cfg = load_config("tiny")
    model = init_random_(K3ForCausalLM(cfg, dtype=BF), seed).to(DEV)
    attn = model.model.layers[cfg.mla_layers[0]].self_attn
    g = torch.Generator().manual_seed(seed)
    lens = [max(1, prompt - 37 * i % prompt) for i in range(T)]       # prompt lengths
    slots = torch.randperm(2 * T, generator=g)[:T].tolist()            # sparse, shuffled
    per = [-(-(n + steps) // bs) for n in lens]
    nb = sum(per) + 3
    blocks = torch.randperm(nb, generator=g).tolist()
    tables = {s: blocks[sum(per[:i]):sum(per[:i + 1])] for i, s in enumerate(slots)}
    n_pre = sum(lens)
    x = torch.randn(n_pre + steps * T, cfg.hidden_size, generator=g).to(BF).to(DEV)
    starts = [sum(lens[:i]) for i in range(T)]
    prefill = StepBatch([SeqSlice(s, st, n, 0) for s, st, n in zip(slots, starts, lens)])
    out, pools = {}, {}
    for path in ("stock", "specialized"):
        c = make_caches(cfg, model.par, 2 * T, nb, bs, BF, DEV)
        c.mla.block_tables.update({s: list(t) for s, t in tables.items()})
        c.mla.pool.fill_(float("nan"))                  # rows never written stay NaN
        with torch.inference_mode():
            ys = []
            attn(x[:n_pre], prefill, c, "stock")
            for k in range(steps):
                b = StepBatch.decode(slots, [n + k for n in lens])
                ys.append(attn(x[n_pre + k * T:n_pre + (k + 1) * T], b, c, path))
        out[path], pools[path] = torch.cat(ys), c.mla.pool
    if ON_GPU:
        torch.cuda.synchronize()
    assert kernels_dispatched[0] == steps, msg                          # the kernels ran
    assert not out["specialized"].isnan().any(), msg
    for t in range(steps * T):
        assert rel_err(out["specialized"][t], out["stock"][t]) <= 3e-2, (msg, t)
    ps, pf = pools["stock"], pools["specialized"]
    assert torch.equal(ps.isnan(), pf.isnan()), msg                     # same rows written
    written = ~ps.isnan().any(-1)
    assert rel_err(pf[written], ps[written]) <= TOL["row"], msg
