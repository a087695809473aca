"""The fused decode kernels (Triton) vs their PyTorch references on the GPU (needs CUDA +
Triton): AttnRes mix + RMSNorm (plain and residual-add), router top-k, few-token MXFP4 expert
GEMV, shared SiTU, latent RMSNorm. On a CPU the small test_moe_decode_* cases run through the
interpreter: `TRITON_INTERPRET=1 python -m pytest tests/gpu/test_fused_triton.py -k moe_decode`.

Fresh random inputs per case (seed from os.urandom, in every failure message); outputs are
preallocated NaN (or −1 for ids) or the caching allocator is poisoned with NaN first, so an
element a kernel never writes fails the check. Tolerances: the `TOL` table below (bf16
outputs, same rounding points as the references, differences only from the fp32 reduction
order and the tanh/sigmoid forms).
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from raydecode.kernels import attnres_norm as A
from raydecode.kernels import attnres_norm_triton as AT
from raydecode.kernels import decode_elementwise_triton as X
from raydecode.kernels import moe_mxfp4 as M
from raydecode.kernels import moe_mxfp4_decode as D
from raydecode.kernels import router as R
from raydecode.kernels import router_triton as RT

from _numerics import TOL as NUM_TOL
from _numerics import fresh_seed, rel_err

ON_GPU = torch.cuda.is_available() and AT.triton is not None
INTERPRET = (not torch.cuda.is_available() and AT.triton is not None
             and os.environ.get("TRITON_INTERPRET") == "1")
pytestmark = pytest.mark.skipif(not (ON_GPU or INTERPRET),
                                reason="needs CUDA and Triton (or TRITON_INTERPRET=1 for the "
                                       "small test_moe_decode_* cases)")
DEV = "cuda" if ON_GPU else "cpu"
BF = torch.bfloat16
TOL = {                        # ‖out − ref‖ / ‖ref‖ (fp64)
    "attnres_h": 6e-3,         # mix rounded to bf16 (1 ulp flips) then normed, rounded
    "attnres_mix": 4e-3,
    "router_w": 1e-6,          # fp32 only
    "moe": NUM_TOL["bf16_3round"],   # three bf16 rounding points (as test_moe_mxfp4.py)
    "situ": 6e-3,
    "rms_cast": 4e-3,
}


@pytest.fixture(autouse=True)
def _gpu_unless_moe_decode(request):
    """Under TRITON_INTERPRET=1 (CPU) only the few-token MoE tests run, on their small shapes."""
    if not ON_GPU and not request.node.name.startswith("test_moe_decode"):
        pytest.skip("needs CUDA (the interpreter runs only the small test_moe_decode_* cases)")


# These tests compare the public AttnRes ops with the Triton kernel bit for bit: the dispatch
# is kept off the CuTe DSL kernel (cute=False; tests/gpu/test_attnres_cute.py covers that one).


def _poison(nbytes: int = 1 << 28) -> None:
    if ON_GPU:      # the CPU allocator does not reuse like this; NaN `out`s still catch misses
        torch.empty(nbytes // 4, device=DEV).fill_(float("nan"))   # freed, then reused


def _nan(*shape, dtype=BF):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


# ---- AttnRes mix + RMSNorm ------------------------------------------------------------------

def _attnres_case(T, n, H, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    bank = torch.randn(T, n + 1, H, generator=g, device=DEV).to(BF)
    wr = 1 + 0.1 * torch.randn(H, generator=g, device=DEV)
    wp = torch.randn(1, H, generator=g, device=DEV)
    wo = 1 + 0.1 * torch.randn(H, generator=g, device=DEV)
    out = torch.randn(T, H, generator=g, device=DEV).to(BF)
    return bank, wr, wp, wo, out


@pytest.mark.parametrize("T,n,H", [(1, 4, 7168), (8, 4, 7168), (64, 4, 7168), (3, 0, 7168),
                                   (5, 2, 300), (2, 7, 256)])
def test_attnres_mix_norm(T, n, H):
    seed = fresh_seed()
    bank, wr, wp, wo, _ = _attnres_case(T, n, H, seed)
    blocks, pre = [bank[:, j] for j in range(n)], bank[:, n]
    ref = A.attnres_mix_norm_reference(blocks, pre, wr, wp, wo, 1e-6, 1e-5)
    values = torch.stack(blocks + [pre], 1).float()
    probs = (A._rms(values, wr, 1e-6) @ wp[0].float()).softmax(-1)
    ref_mix = (probs.unsqueeze(1) @ values).squeeze(1).to(BF)
    h, mix = _nan(T, H), _nan(T, H)
    AT.mix_norm_triton(blocks, pre, wr, wp, wo, 1e-6, 1e-5, h=h, mix=mix)
    assert not h.isnan().any() and not mix.isnan().any(), f"seed {seed}"
    assert rel_err(mix, ref_mix) <= TOL["attnres_mix"], f"seed {seed}"
    assert rel_err(h, ref) <= TOL["attnres_h"], f"seed {seed}: {rel_err(h, ref)}"
    # the public op dispatches here on CUDA; separate (non-view) blocks take the stack path
    h2 = A.attnres_mix_norm([b.clone() for b in blocks], pre.clone(), wr, wp, wo, 1e-6, 1e-5,
                            cute=False)
    assert torch.equal(h2, h), f"seed {seed}"


@pytest.mark.parametrize("T,n,H", [(1, 4, 7168), (16, 4, 7168), (4, 1, 300)])
def test_attnres_add_mix_norm_into_bank(T, n, H):
    """Residual form as the benchmark runs it: blocks are views of a bank, the new prefix is
    written into a slot of a second bank (aliasing view, not a fresh tensor)."""
    seed = fresh_seed()
    bank, wr, wp, wo, out = _attnres_case(T, n, H, seed)
    blocks, pre = [bank[:, j] for j in range(n)], bank[:, n]
    ref_p, ref_h = A.attnres_add_mix_norm_reference(blocks, pre, out, wr, wp, wo, 1e-6, 1e-5)
    mid = torch.full_like(bank, float("nan"))
    h = _nan(T, H)
    AT.mix_norm_triton(blocks, pre, wr, wp, wo, 1e-6, 1e-5, out=out, new_prefix=mid[:, n], h=h)
    assert torch.equal(mid[:, n], ref_p), f"seed {seed}: p + o rounds once, as the reference"
    assert mid[:, :n].isnan().all(), f"seed {seed}: wrote outside the prefix slot"
    assert rel_err(h, ref_h) <= TOL["attnres_h"], f"seed {seed}: {rel_err(h, ref_h)}"
    p2, h2 = A.attnres_add_mix_norm(blocks, pre, out, wr, wp, wo, 1e-6, 1e-5, cute=False)
    assert torch.equal(p2, ref_p) and torch.equal(h2, h), f"seed {seed}"


def test_attnres_graph_replay_reads_new_inputs():
    seed = fresh_seed()
    bank, wr, wp, wo, out = _attnres_case(2, 4, 7168, seed)
    blocks, pre = [bank[:, j] for j in range(4)], bank[:, 4]
    newp, h = _nan(2, 7168), _nan(2, 7168)
    fn = lambda: AT.mix_norm_triton(blocks, pre, wr, wp, wo, 1e-6, 1e-5, out=out,  # noqa: E731
                                    new_prefix=newp, h=h)
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    bank.copy_(torch.randn_like(bank, dtype=torch.float32).to(BF))
    h.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    _, ref_h = A.attnres_add_mix_norm_reference(blocks, pre, out, wr, wp, wo, 1e-6, 1e-5)
    assert rel_err(h, ref_h) <= TOL["attnres_h"], f"seed {seed}"


# ---- router ---------------------------------------------------------------------------------

def _near_tie(sel_row: torch.Tensor, k: int) -> bool:
    top = sel_row.topk(k + 1).values
    return bool((top[:-1] - top[1:]).abs().min() < 1e-6)


@pytest.mark.parametrize("sort,gather", [(False, False), (True, False), (True, True),
                                         (False, True)])
@pytest.mark.parametrize("T,E,k,bias", [(1, 896, 16, True), (8, 896, 16, True),
                                         (64, 896, 16, True), (5, 896, 16, False),
                                         (3, 32, 4, True), (2, 100, 7, False)])
def test_route_topk(T, E, k, bias, sort, gather):
    seed = fresh_seed()
    g = torch.Generator(device=DEV).manual_seed(seed)
    logits = 2 * torch.randn(T, E, generator=g, device=DEV)
    b = 0.1 * torch.randn(E, generator=g, device=DEV) if bias else None
    w = _nan(T, k, dtype=torch.float32)
    ids = torch.full((T, k), -1, dtype=torch.int64, device=DEV)
    RT.route_topk_triton(logits, b, k, True, 2.5, weights=w, ids=ids, sort=sort, gather=gather)
    rw, rid = R.route_topk_reference(logits, b, k, True, 2.5)
    sel = torch.sigmoid(logits) + (b if b is not None else 0)
    for t in range(T):
        if not torch.equal(ids[t], rid[t]):
            assert _near_tie(sel[t], k), f"seed {seed} token {t}: {ids[t]} vs {rid[t]}"
            continue
        assert rel_err(w[t], rw[t]) <= TOL["router_w"], f"seed {seed} token {t}"
    torch.testing.assert_close(w.sum(-1), torch.full((T,), 2.5, device=DEV))
    w2, i2 = R.route_topk(logits, b, k, True, 2.5)           # dispatch: the kernel on CUDA
    assert torch.equal(i2, ids), f"seed {seed}"               # every form, the same ids
    # the weights: the sigmoid of the same fp32 logits whether gathered from registers or
    # re-loaded, but compiled in different code (the full score vector or the k winners), so
    # equal to the default form only within a few ulps (H200: bit-equal within a form, not
    # across gather / re-load)
    torch.testing.assert_close(w2, w, rtol=1e-6, atol=0, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("sort", [False, True])
def test_route_topk_warps_give_the_same_ids_and_weights(sort):
    """`num_warps` (1 or 2 warps per token's program: reductions in shuffles, the layout a
    prefill step's thousands of programs may prefer) gives the default launch's ids and
    weights bit for bit: the same selection and the same sigmoid code. A count Triton cannot
    launch is refused naming it."""
    seed = fresh_seed()
    g = torch.Generator(device=DEV).manual_seed(seed)
    logits = 2 * torch.randn(24, 896, generator=g, device=DEV)
    b = 0.1 * torch.randn(896, generator=g, device=DEV)
    w0, i0 = RT.route_topk_triton(logits, b, 16, sort=sort)
    for nw in (1, 2):
        w, ids = RT.route_topk_triton(logits, b, 16, sort=sort, num_warps=nw)
        assert torch.equal(ids, i0), f"seed {seed} warps {nw}"
        assert torch.equal(w, w0), f"seed {seed} warps {nw}"
    with pytest.raises(ValueError, match="num_warps 3: expected 1, 2, 4, 8 or 16"):
        RT.route_topk_triton(logits, b, 16, num_warps=3)


@pytest.mark.parametrize("sort", [False, True])
def test_route_topk_negative_selection_scores_order(sort):
    """A bias making every selection score negative: the int64 key must still order them."""
    seed = fresh_seed()
    g = torch.Generator(device=DEV).manual_seed(seed)
    logits = torch.randn(4, 896, generator=g, device=DEV)
    b = torch.full((896,), -3.0, device=DEV) - torch.rand(896, generator=g, device=DEV)
    w, ids = RT.route_topk_triton(logits, b, 16, sort=sort)
    _, rid = R.route_topk_reference(logits, b, 16)
    assert torch.equal(ids, rid), f"seed {seed}"


# ---- few-token MXFP4 experts ----------------------------------------------------------------

# K3 per-rank experts at TP16 / TP8 (GPU only: minutes under the interpreter) + small shapes
MOE_K3 = [(896, 3584, 192, 16), (896, 3584, 384, 16)]
MOE_SHAPES = (MOE_K3 if ON_GPU else []) + [(32, 128, 128, 4)]
MOE_T = [1, 2, 4, 8, 32] if ON_GPU else [1, 2]   # interpreter: T = 4 costs a minute per case;
# GPU: T = 8 and 32 (128 and 512 pairs) are the mid batches the few-token kernel may serve
# (E, L, I, k, T) for the split-K test (`_split_configs`): L = 256 has 8 groups: KS 1 / 2 / 4
# at GB 2, KS 1 at GB 8 (the interpreter's two cases, ~15 s each); K3 (112 groups): KS 1 / 2 /
# 7 / 56 at GB 2, KS 1 / 7 at GB 16
MOE_SPLIT = ([(*s, T) for s in MOE_K3 for T in (1, 4)] if ON_GPU else []) \
    + [(8, 256, 64, 4, 1), (8, 256, 128, 2, 2)]
# the interpreter truncates fp32 -> bf16 (1 ulp more at each of the three rounding points)
MOE_TOL = TOL["moe"] if ON_GPU else NUM_TOL["interpreter"]
gpu_only = pytest.mark.skipif(not ON_GPU, reason="K3 shapes / CUDA graphs: GPU only")


def _moe_case(E, L, I, k, T, seed, lin=25.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    ex = M.MXFP4Experts.random(E, L, I, 4.0, lin, device=DEV, seed=seed).validate()
    z = torch.randn(T, L, generator=g, device=DEV).to(BF)
    w, ids = torch.rand(T, E, generator=g, device=DEV).topk(k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).float()
    if T > 1:       # two tokens share their first expert: both pairs add into their own rows
        ids[1, 0] = ids[0, 0] if ids[0, 0] not in ids[1] else ids[1, 0]
    return ex, z, w, ids, g


def _split_configs(I: int, L: int) -> list:
    """Every split factor KS of gate_up at two K-step widths (1 and 2+ unrolled steps per
    slice), down looped and unrolled; ks = 1 is the looped gate_up kernel. Each config three
    times: bytes, int32-word code reads (`words`) and the packed-fp16 decode (`f16x2`)."""
    kg = L // 32
    out = []
    for gb in sorted({D._pow2_divisor(kg, 16), D._pow2_divisor(kg, 2)}):
        for ks in (d for d in range(1, kg // gb + 1) if (kg // gb) % d == 0):
            if kg // gb > 16 and ks not in (1, 2, 7, kg // gb):   # K3 at GB 2: a few KS
                continue
            out.append(D.DecodeConfig(gate_up_bn=D._pow2_divisor(I, 8), gate_up_gb=gb,
                                      gate_up_warps=2, down_bn=D._pow2_divisor(L, 32),
                                      down_gb=D._pow2_divisor(I // 32, 2), gate_up_ks=ks,
                                      down_unroll=ks % 2 == 0))
    small = kg <= 16        # K3: f16x2 at KS 1 and 7 only (GPU compile time)
    return (out + [dataclasses.replace(c, words=True) for c in out]
            + [dataclasses.replace(c, words=True, f16x2=True) for c in out
               if small or c.gate_up_ks in (1, 7)])


@pytest.mark.parametrize("E,L,I,k", MOE_SHAPES)
@pytest.mark.parametrize("T", MOE_T)
@pytest.mark.parametrize("lin", [None, 25.0])
def test_moe_decode_matches_reference(E, L, I, k, T, lin):
    """The default config (split-K gate_up at the K3 shapes, ks = 1 at the small ones)."""
    seed = fresh_seed()
    ex, z, w, ids, _ = _moe_case(E, L, I, k, T, seed, lin)
    ref = M.moe_mxfp4_reference(z, w, ids, ex)
    out = _nan(T, L, dtype=torch.float32)
    _poison()
    D.moe_mxfp4_decode(z, w, ids, ex, out=out)
    assert not out.isnan().any(), f"seed {seed}"
    assert rel_err(out, ref) <= MOE_TOL, f"seed {seed}: {rel_err(out, ref)}"


@pytest.mark.parametrize("E,L,I,k,T", MOE_SPLIT)
def test_moe_decode_split_k(E, L, I, k, T):
    """Every gate_up split factor (and ks = 1) against the reference, `out` NaN-poisoned (the
    split grid must zero all of it) and the allocator poisoned (an unwritten partial is NaN)."""
    seed = fresh_seed()
    ex, z, w, ids, _ = _moe_case(E, L, I, k, T, seed, lin=None if T == 1 else 25.0)
    ref = M.moe_mxfp4_reference(z, w, ids, ex)
    cfgs = _split_configs(I, L)
    assert any(c.gate_up_ks > 1 for c in cfgs) and any(c.gate_up_ks == 1 for c in cfgs)
    assert any(c.words for c in cfgs) and any(not c.words for c in cfgs)
    assert any(c.f16x2 for c in cfgs) and any(c.words and not c.f16x2 for c in cfgs)
    for cfg in cfgs:
        out = _nan(T, L, dtype=torch.float32)
        _poison()
        D.moe_mxfp4_decode(z, w, ids, ex, cfg, out=out)
        assert not out.isnan().any(), f"seed {seed} {cfg}"
        assert rel_err(out, ref) <= MOE_TOL, f"seed {seed} {cfg}: {rel_err(out, ref)}"


def test_moe_decode_split_k_config_rejected():
    """A split factor not dividing L/32/GB is refused before any launch."""
    ex, z, w, ids, _ = _moe_case(8, 256, 64, 4, 1, 0)
    with pytest.raises(ValueError, match="gate_up KS 3"):
        D.moe_mxfp4_decode(z, w, ids, ex, D.DecodeConfig(8, 2, 2, 32, 2, 2, gate_up_ks=3))


@pytest.mark.parametrize("scale", [2.0 ** -20, 1.0, 3.0e4])
def test_moe_decode_f16x2_activation_range(scale):
    """The packed-fp16 decode scales each K step's activations by a power of two into fp16's
    range: tiny and large activations, and one outlier 2**12 above the rest of its row, still
    match the reference (plain fp16 would flush 2**-20·x products or overflow at 3e4·6)."""
    seed = fresh_seed()
    E, L, I, k, T = MOE_SPLIT[0]
    ex, z, w, ids, _ = _moe_case(E, L, I, k, T, seed, lin=None)
    z = (z.float() * scale)
    z[0, 5] *= 4096.0
    z = z.to(BF)
    ref = M.moe_mxfp4_reference(z, w, ids, ex)
    cfg = dataclasses.replace(_split_configs(I, L)[1], words=True, f16x2=True)
    out = D.moe_mxfp4_decode(z, w, ids, ex, cfg)
    assert out.isfinite().all(), f"seed {seed}"
    assert rel_err(out, ref) <= MOE_TOL, f"seed {seed} {cfg}: {rel_err(out, ref)}"
    zero = D.moe_mxfp4_decode(torch.zeros_like(z), w, ids, ex, cfg)
    assert (zero == 0).all(), f"seed {seed}: all-zero activations gave {zero.abs().max()}"


def test_moe_decode_f16x2_needs_words():
    ex, z, w, ids, _ = _moe_case(8, 256, 64, 4, 1, 0)
    with pytest.raises(ValueError, match="f16x2 needs words=True"):
        D.moe_mxfp4_decode(z, w, ids, ex, D.DecodeConfig(8, 2, 2, 32, 2, 2, f16x2=True))


@gpu_only
@pytest.mark.parametrize("cfg", [D.DecodeConfig(8, 16, 4, 32, 2, 4),
                                 D.DecodeConfig(8, 16, 4, 64, 2, 2, gate_up_ks=7,
                                                down_unroll=True, words=True, f16x2=True),
                                 D.DecodeConfig(32, 8, 8, 128, 2, 8),
                                 D.DecodeConfig(4, 16, 2, 64, 2, 4, gate_up_ks=7),
                                 D.DecodeConfig(16, 8, 4, 128, 2, 2, gate_up_ks=14,
                                                down_unroll=True)])
def test_moe_decode_other_tiles(cfg):
    seed = fresh_seed()
    ex, z, w, ids, _ = _moe_case(896, 3584, 192, 16, 1, seed)
    ref = M.moe_mxfp4_reference(z, w, ids, ex)
    assert rel_err(D.moe_mxfp4_decode(z, w, ids, ex, cfg), ref) <= TOL["moe"], f"seed {seed}"


@gpu_only
@pytest.mark.parametrize("ks", [1, 7])
def test_moe_decode_fp32_z_rounds_like_bf16(ks):
    seed = fresh_seed()
    g = torch.Generator(device=DEV).manual_seed(seed)
    ex = M.MXFP4Experts.random(896, 3584, 192, 4.0, 25.0, device=DEV, seed=seed)
    z32 = torch.randn(2, 3584, generator=g, device=DEV)
    w, ids = torch.rand(2, 896, generator=g, device=DEV).topk(16, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).float()
    cfg = D.DecodeConfig(8, 16, 4, 64, 2, 4, gate_up_ks=ks)
    a = D.moe_mxfp4_decode(z32, w, ids, ex, cfg)
    b = D.moe_mxfp4_decode(z32.to(BF), w, ids, ex, cfg)
    assert rel_err(a, b) <= 1e-6, f"seed {seed}: {rel_err(a, b)}"   # atomics order only


@gpu_only
@pytest.mark.parametrize("I,ks", [(192, 1), (192, 7), (384, 7)])
def test_moe_decode_graph_replays_new_routing(I, ks):
    """Captured once (workspace allocated inside the capture), replayed with new routings."""
    seed = fresh_seed()
    g = torch.Generator(device=DEV).manual_seed(seed)
    ex = M.MXFP4Experts.random(896, 3584, I, 4.0, 25.0, device=DEV, seed=seed)
    z = torch.randn(2, 3584, generator=g, device=DEV).to(BF)
    w, ids = torch.rand(2, 896, generator=g, device=DEV).topk(16, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).float()
    cfg = dataclasses.replace(D.default_decode_config(896, I, 3584), gate_up_ks=ks)
    out = torch.empty(2, 3584, device=DEV)
    D.moe_mxfp4_decode(z, w, ids, ex, cfg, out=out)
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        D.moe_mxfp4_decode(z, w, ids, ex, cfg, out=out)
    for _ in range(2):      # replays: new routing each time, out re-zeroed by the kernel
        w2, i2 = torch.rand(2, 896, generator=g, device=DEV).topk(16, dim=-1)
        w.copy_(w2 / w2.sum(-1, keepdim=True))
        ids.copy_(i2)
        out.fill_(float("nan"))
        gr.replay()
        torch.cuda.synchronize()
        assert not out.isnan().any(), f"seed {seed}"
        assert rel_err(out, M.moe_mxfp4_reference(z, w, ids, ex)) <= TOL["moe"], f"seed {seed}"


def test_moe_decode_dispatch_follows_the_options(monkeypatch):
    """`moe_decode` (the served few-token dispatch) runs the CUDA-core kernel with its config
    from the options' override, else from the TUNED table / default rule, for a shape not in
    RESIDENT; moe_kernel 'resident' without a resident plan (no CuTe on these tensors, or a
    shape that does not fit) falls back to the CUDA-core kernel. The real kernel runs, wrapped
    to record the config, and the result is checked against the reference."""
    from raydecode.kernels import moe_decode as MDE
    from raydecode.kernels.settings import DecodeOptions
    seed = fresh_seed()
    E, L, I, k = 16, 256, 64, 4
    ex, z, w, ids, _ = _moe_case(E, L, I, k, 1, seed)
    ref = M.moe_mxfp4_reference(z, w, ids, ex)
    ran, real = [], D.moe_mxfp4_decode
    monkeypatch.setattr(D, "moe_mxfp4_decode",
                        lambda *a, **kw: ran.append(a[4]) or real(*a, **kw))
    mine = D.DecodeConfig(gate_up_bn=16, gate_up_gb=8, gate_up_warps=2, down_bn=64, down_gb=2,
                          down_warps=2, gate_up_ks=1)
    assert mine != D.default_decode_config(E, I, L)
    cases = ((DecodeOptions(), D.default_decode_config(E, I, L)),
             (DecodeOptions(moe_decode_configs=(((E, I, L), mine),)), mine))
    if not ON_GPU:      # no CuTe here: the resident choice has no plan and falls through
        cases += ((DecodeOptions(moe_kernel="resident"), D.default_decode_config(E, I, L)),)
    for opts, want in cases:
        ran.clear()
        out = MDE.moe_decode(z, w, ids, ex, options=opts)
        assert rel_err(out, ref) <= MOE_TOL, f"seed {seed} {opts}"
        assert ran == [want], f"seed {seed}: {opts} ran {ran}"


# ---- SiTU and latent RMSNorm ----------------------------------------------------------------

@pytest.mark.parametrize("T,I", [(1, 256), (8, 256), (3, 300)])
@pytest.mark.parametrize("lin", [None, 25.0])
def test_situ_mul(T, I, lin):
    seed = fresh_seed()
    g = torch.Generator(device=DEV).manual_seed(seed)
    gu = (4 * torch.randn(T, 2 * I, generator=g, device=DEV)).to(BF)
    _poison()
    a = X.situ_mul(gu, 4.0, lin)
    ref = X.situ_mul_reference(gu, 4.0, lin)
    assert not a.isnan().any() and rel_err(a, ref) <= TOL["situ"], f"seed {seed}"


@pytest.mark.parametrize("T,Dm", [(1, 3584), (64, 3584), (3, 100)])
def test_rms_norm_cast(T, Dm):
    seed = fresh_seed()
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = 3 * torch.randn(T, Dm, generator=g, device=DEV)
    w = 1 + 0.1 * torch.randn(Dm, generator=g, device=DEV)
    _poison()
    y = X.rms_norm_cast(x, w, 1e-6)
    ref = X.rms_norm_cast_reference(x, w, 1e-6)
    assert y.dtype == BF and not y.isnan().any(), f"seed {seed}"
    assert rel_err(y, ref) <= TOL["rms_cast"], f"seed {seed}"


@pytest.mark.parametrize("T,D,c0,n,I,k_out", [(1, 3584, 0, 224, 384, 640), (64, 3584, 0, 448, 768, 1280),
                                              (3, 3584, 224, 224, 384, 608), (2, 128, 32, 32, 96, 160)])
@pytest.mark.parametrize("lin", [None, 25.0])
def test_latent_norm_situ(T, D, c0, n, I, k_out, lin):
    seed = fresh_seed()
    g = torch.Generator(device=DEV).manual_seed(seed)
    lat = 3 * torch.randn(T, D, generator=g, device=DEV)
    w = 1 + 0.1 * torch.randn(D, generator=g, device=DEV)
    big = 4 * torch.randn(T, 56 + 2 * I, generator=g, device=DEV)   # fp32 GEMV output block
    gu = big[:, 56:]                                                 # strided column slice
    out = _nan(T, k_out)
    X.latent_norm_situ(lat, w, 1e-6, c0, n, gu, 4.0, lin, out)
    ref = X.latent_norm_situ_reference(lat, w, 1e-6, c0, n, gu, 4.0, lin, k_out)
    assert not out.isnan().any(), f"seed {seed}: unwritten columns {out.isnan().nonzero()[:4]}"
    assert torch.equal(out[:, n + I:], torch.zeros_like(out[:, n + I:])), f"seed {seed}: pad"
    assert rel_err(out[:, :n], ref[:, :n]) <= TOL["rms_cast"], f"seed {seed}"
    assert rel_err(out[:, n:n + I], ref[:, n:n + I]) <= TOL["situ"], f"seed {seed}"

