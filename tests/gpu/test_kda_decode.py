"""Fused KDA decode kernel (Triton) vs its PyTorch reference (kernels/kda_decode.py).

Runs on CUDA, or on CPU through the Triton interpreter (TRITON_INTERPRET=1: the small cases
only; the K3 shapes and graph capture need the GPU). Fresh random inputs per case (seed from
os.urandom, in every failure message); `out` is preallocated NaN; proj is a column slice of a
wider GEMV-like buffer (row stride), conv and recurrent state are checked after the in-place
update (conv state bit for bit: it is a shift of bf16 values).

Tolerances (`TOL`, ‖x − ref‖ / ‖ref‖ in fp64): both sides round at the same points (f_b and
the conv output to bf16, the output to bf16) with round-to-nearest-even, so differences come
from fp32 reduction order and exp/sigmoid/rsqrt ulps, plus the rare bf16 flip of an
intermediate near a rounding boundary.
"""
from __future__ import annotations

import os

import pytest
import torch

from raydecode.kernels import kda_decode as K
from raydecode.kernels import kda_decode_triton as KT

from _numerics import fresh_seed, random_kda_params_, rel_err

ON_GPU = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(KT.triton is None or not (ON_GPU or INTERP),
                                reason="needs Triton and CUDA (or TRITON_INTERPRET=1)")
gpu_only = pytest.mark.skipif(not ON_GPU, reason="K3 shapes / graphs: GPU only (slow or "
                                                "unsupported in the interpreter)")
DEV = "cuda" if ON_GPU else "cpu"
BF = torch.bfloat16
LB, EPS = -5.0, 1e-5
TOL = {               # H200, 160 random cases (T 4..64, 6/12 × 128, 4 × 32): max ×~4-6
    "out": 2e-3,      # measured max 3.3e-4
    "rec": 2.5e-4,    # fp32 state, measured max 6.0e-5 (one flipped bf16 k/v/fb element
                      # moves a whole row or column of the state)
    "rec_bulk": 1e-2,  # fraction of state elements off by > 1e-5 (measured max 2.7e-3)
}


def _inputs(T, h, d, seed, W=4, pad=48):
    g = torch.Generator(device=DEV).manual_seed(seed)
    C = h * d
    P = 4 * C + h + d
    rn = lambda *s: torch.randn(*s, generator=g, device=DEV)      # noqa: E731
    return dict(
        proj=rn(T, P + pad).to(BF)[:, :P],
        fb_w=(rn(C, d) / d ** 0.5).to(BF),
        conv_state=rn(T, 3 * C, W - 1).to(BF),
        conv_w=0.5 * rn(3 * C, W),
        exp_a=(torch.rand(h, generator=g, device=DEV) * 1.386).exp(),
        dt_bias=0.5 * rn(C) - 1.0,
        o_norm_w=1.0 + 0.1 * rn(d),
        rec_state=0.05 * rn(T, h, d, d))


def _clone(x):
    return {k: v.clone() for k, v in x.items()}


def _run_kernel(x, h, d, out, **cfg):
    return KT.kda_decode_triton(**x, out=out, heads=h, head_dim=d, lower_bound=LB, eps=EPS,
                                **cfg)


def _ref(x, h, d):
    return K.kda_decode_reference(**x, heads=h, head_dim=d, lower_bound=LB, eps=EPS)


def _check(x, xr, out, ref, seed, what=""):
    msg = f"seed {seed} {what}"
    assert not out.isnan().any(), f"{msg}: unwritten output"
    assert torch.equal(x["conv_state"], xr["conv_state"]), f"{msg}: conv state"
    e_out, e_rec = rel_err(out, ref), rel_err(x["rec_state"], xr["rec_state"])
    assert e_out <= TOL["out"], f"{msg}: out rel {e_out:.2e}"
    assert e_rec <= TOL["rec"], f"{msg}: rec_state rel {e_rec:.2e}"
    bulk = float(((x["rec_state"] - xr["rec_state"]).abs() > 1e-5).double().mean())
    assert bulk <= TOL["rec_bulk"], f"{msg}: {bulk:.2e} of the state off by > 1e-5"
    return e_out, e_rec


def _case(T, h, d, W=4, **cfg):
    seed = fresh_seed()
    x = _inputs(T, h, d, seed, W)
    xr = _clone(x)
    out = torch.full((T, h * d), float("nan"), dtype=BF, device=DEV)
    _run_kernel(x, h, d, out, **cfg)
    ref = _ref(xr, h, d)
    e = _check(x, xr, out, ref, seed, f"T={T} h={h} d={d} W={W} {cfg}")
    print(f"T={T} h={h} d={d} W={W} {cfg} seed {seed}: out {e[0]:.2e} rec {e[1]:.2e}")


@pytest.mark.parametrize("T,h,d,W", [(1, 4, 32, 4), (2, 4, 32, 4), (3, 3, 16, 4),
                                     (2, 2, 64, 4), (2, 2, 16, 2), (1, 1, 128, 4)])
def test_small(T, h, d, W):
    """The bench's small config (4 × 32), odd heads, every head_dim class, W = 2."""
    _case(T, h, d, W)


@pytest.mark.parametrize("splits", [None, 1], ids=["auto", "single"])
@pytest.mark.parametrize("h", [6, 12], ids=["tp16", "tp8"])
@pytest.mark.parametrize("T", [1, 2, 4, 64])
def test_k3_shapes(T, h, splits):
    """K3 per-rank heads at the automatic form (split at T ≤ 4 at TP16, T ≤ 2 at TP8:
    KT.split_count) and at the one-program form."""
    if T > 4 and not ON_GPU:
        pytest.skip("batch 64 at K3 shapes: GPU only (slow in the interpreter)")
    _case(T, h, 128, splits=splits)


@pytest.mark.parametrize("T,h,d,ns,nw", [(1, 2, 32, 4, None), (2, 3, 16, 2, None),
                                         (1, 1, 128, 16, None), (3, 2, 64, 8, 8),
                                         (1, 6, 128, 16, 8), (2, 12, 128, 2, None)])
def test_split_form(T, h, d, ns, nw):
    """The split form: ns programs per head (down to 8 value columns each), the last one to
    finish normalises; 4 and 8 warps."""
    _case(T, h, d, splits=ns, num_warps=nw)


def test_split_form_counters_return_to_zero():
    """Every launch leaves its arrival counters at zero (graph replays rely on it), also when
    the same scratch serves consecutive launches."""
    T, h, d = 2, 3, 32
    for _ in range(3):
        _case(T, h, d, splits=4)
    mine = [cnt for (_, rows, hd), (_, cnt) in KT._SCRATCH.items() if (rows, hd) == (T * h, d)]
    assert mine and all(int(c.abs().sum()) == 0 for c in mine)


def test_bad_splits_are_named():
    x = _inputs(1, 2, 32, fresh_seed())
    out = torch.empty(1, 64, dtype=BF, device=DEV)
    for bad in (3, 0, 64):
        with pytest.raises(ValueError, match=f"splits = {bad}"):
            _run_kernel(x, 2, 32, out, splits=bad)


@pytest.mark.parametrize("bv,nw", [(16, 1), (32, 4), (64, 4), (128, 8)])
def test_block_v_variants(bv, nw):
    """Every dv blocking the launcher may pick (the looped form, NV = D / BV steps)."""
    _case(2, 2, 128, block_v=bv, num_warps=nw, splits=1)


@gpu_only
@pytest.mark.parametrize("T", [1, 4, 64])
def test_small_config_batches(T):
    _case(T, 4, 32)


def test_public_op_dispatch():
    """On CUDA the public op is the kernel (bit-identical to a direct launch); elsewhere the
    reference."""
    T, h, d, seed = 2, 4, 32, fresh_seed()
    x = _inputs(T, h, d, seed)
    x2 = _clone(x)
    got = K.kda_decode(**x, heads=h, head_dim=d, lower_bound=LB, eps=EPS)
    out = torch.full((T, h * d), float("nan"), dtype=BF, device=DEV)
    if ON_GPU:
        _run_kernel(x2, h, d, out)
    else:
        out = _ref(x2, h, d)
    assert torch.equal(got, out), f"seed {seed}"
    assert torch.equal(x["rec_state"], x2["rec_state"]), f"seed {seed}"


@gpu_only
@pytest.mark.parametrize("T,h,d", [(4, 6, 128), (3, 4, 32), (1, 6, 128), (64, 6, 128)])
def test_graph_replay_reads_new_inputs(T, h, d):
    """Capture once, then replay three times on new proj / weights / state values written into
    the captured buffers; each replay equals the reference on the same values (the split form
    at T ≤ 4: its counters must be back at zero after each replay)."""
    seed = fresh_seed()
    x = _inputs(T, h, d, seed)
    out = torch.full((T, h * d), float("nan"), dtype=BF, device=DEV)
    kw = dict(heads=h, head_dim=d, lower_bound=LB, eps=EPS, out=out)
    K.kda_decode(**_clone(x), **kw)                                      # compile, warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        K.kda_decode(**x, **kw)
    for r in range(3):
        new = _inputs(T, h, d, seed + 1 + r)
        for k, v in new.items():
            x[k].copy_(v)
        xr = _clone(x)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(x, xr, out, _ref(xr, h, d), seed, f"replay {r}")


@gpu_only
@pytest.mark.parametrize("T", [1, 4])
def test_two_steps_chain_state(T):
    """Two consecutive steps on the same state buffers (the second reads what the first
    wrote: the split form's prologue reads the state before the PDL wait), kernel vs
    reference each carrying its own state."""
    h, d, seed = 6, 128, fresh_seed()
    x = _inputs(T, h, d, seed)
    xr = _clone(x)
    for step in range(2):
        p = _inputs(T, h, d, seed + 7 + step)["proj"]
        x["proj"], xr["proj"] = p, p.clone()
        out = torch.full((T, h * d), float("nan"), dtype=BF, device=DEV)
        _run_kernel(x, h, d, out)
        _check(x, xr, out, _ref(xr, h, d), seed, f"step {step}")


# ---- slots: the state is a slot pool (the model passes a layer's whole KDA cache) -------------

def _scatter(x, slots, S):
    """x with its T state rows moved to rows `slots` of S-row pools; the other rows NaN."""
    y = dict(x)
    for k in ("conv_state", "rec_state"):
        pool = torch.full((S,) + tuple(x[k].shape[1:]), float("nan"), dtype=x[k].dtype,
                          device=DEV)
        pool[slots.long()] = x[k]
        y[k] = pool
    return y


def _slot_case(T, h, d, S, idx_dtype=torch.int64, seed=None, **cfg):
    """Kernel over a NaN-poisoned pool at random distinct slots vs the reference on the
    per-sequence rows: named rows stepped, others untouched."""
    seed = fresh_seed() if seed is None else seed
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(S, generator=g)[:T].to(DEV, idx_dtype)
    x = _inputs(T, h, d, seed)
    xr = _clone(x)
    xp = _scatter(x, slots, S)
    out = torch.full((T, h * d), float("nan"), dtype=BF, device=DEV)
    KT.kda_decode_triton(**xp, out=out, heads=h, head_dim=d, lower_bound=LB, eps=EPS,
                         slots=slots, **cfg)
    ref = _ref(xr, h, d)
    what = f"T={T} h={h} d={d} S={S} slots={slots.tolist()} {cfg}"
    got = {k: xp[k][slots.long()] for k in ("conv_state", "rec_state")}
    _check({**x, **got}, xr, out, ref, seed, what)
    rest = torch.ones(S, dtype=torch.bool, device=DEV)
    rest[slots.long()] = False
    for k in ("conv_state", "rec_state"):
        assert xp[k][rest].isnan().all(), f"seed {seed} {what}: {k} row outside slots written"


@pytest.mark.parametrize("T,h,d,S", [(3, 2, 32, 7), (2, 3, 16, 2), (1, 1, 128, 3),
                                     (4, 4, 32, 9)])
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_slots_small(T, h, d, S, idx_dtype):
    """Shuffled slots, a subset of the pool, every slot (S = T), int32 and int64 indices."""
    _slot_case(T, h, d, S, idx_dtype)


@gpu_only
@pytest.mark.parametrize("h", [6, 12], ids=["tp16", "tp8"])
@pytest.mark.parametrize("T", [1, 2, 4, 64])
def test_slots_k3_shapes(T, h):
    _slot_case(T, h, 128, 2 * T + 5)


@gpu_only
@pytest.mark.parametrize("bv,nw", [(16, 1), (32, 4), (128, 8)])
def test_slots_block_v_variants(bv, nw):
    _slot_case(8, 6, 128, 21, block_v=bv, num_warps=nw, splits=1)


@pytest.mark.parametrize("T,h,d,S,ns", [(1, 6, 128, 5, 16), (3, 2, 32, 7, 4), (2, 12, 128, 9, 8)])
def test_slots_split_form(T, h, d, S, ns):
    _slot_case(T, h, d, S, splits=ns)


def test_public_op_with_slots_dispatch():
    """The public op with slots: the kernel on CUDA (bit-identical to a direct launch), the
    reference elsewhere; both step the same pool rows."""
    T, h, d, S, seed = 3, 4, 32, 6, fresh_seed()
    slots = torch.tensor([4, 0, 2], device=DEV)
    x = _scatter(_inputs(T, h, d, seed), slots, S)
    x2 = _clone(x)
    got = K.kda_decode(**x, heads=h, head_dim=d, lower_bound=LB, eps=EPS, slots=slots)
    if ON_GPU:
        out = torch.full((T, h * d), float("nan"), dtype=BF, device=DEV)
        _run_kernel(x2, h, d, out, slots=slots)
    else:
        out = K.kda_decode_reference(**x2, heads=h, head_dim=d, lower_bound=LB, eps=EPS,
                                     slots=slots)
    assert torch.equal(got, out), f"seed {seed}"
    assert torch.equal(x["rec_state"][slots], x2["rec_state"][slots]), f"seed {seed}"
    assert torch.equal(x["conv_state"][slots], x2["conv_state"][slots]), f"seed {seed}"


@gpu_only
def test_slots_graph_replay_reads_new_slots():
    """Capture with a slots buffer, replay after writing other slot values into it: the rows
    stepped follow the buffer's contents, not the captured values."""
    T, h, d, S, seed = 4, 6, 128, 12, fresh_seed()
    x = _scatter(_inputs(T, h, d, seed), torch.arange(T, device=DEV), S)
    x["conv_state"].copy_(torch.randn(x["conv_state"].shape, device=DEV).to(BF))
    x["rec_state"].copy_(0.05 * torch.randn(x["rec_state"].shape, device=DEV))
    slots = torch.arange(T, device=DEV)
    out = torch.full((T, h * d), float("nan"), dtype=BF, device=DEV)
    kw = dict(heads=h, head_dim=d, lower_bound=LB, eps=EPS, out=out, slots=slots)
    K.kda_decode(**_clone(x), **kw)                                      # compile, warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        K.kda_decode(**x, **kw)
    for r, new in enumerate(([11, 3, 7, 0], [5, 6, 1, 10])):
        slots.copy_(torch.tensor(new, device=DEV))
        x["proj"].copy_(_inputs(T, h, d, seed + 1 + r)["proj"])
        xr = _clone(x)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = K.kda_decode_reference(**xr, heads=h, head_dim=d, lower_bound=LB, eps=EPS,
                                     slots=slots)
        idx = slots.long()
        rows = {k: (x[k][idx], xr[k][idx]) for k in ("conv_state", "rec_state")}
        _check({**x, "conv_state": rows["conv_state"][0], "rec_state": rows["rec_state"][0]},
               {**xr, "conv_state": rows["conv_state"][1], "rec_state": rows["rec_state"][1]},
               out, ref, seed, f"replay {r} slots {new}")
        rest = torch.ones(S, dtype=torch.bool, device=DEV)
        rest[idx] = False
        assert torch.equal(x["rec_state"][rest], xr["rec_state"][rest]), f"seed {seed}"


# ---- the model's specialized KDA decode (models/kda.py) runs this kernel --------------------

MODEL_TOL = 3e-2      # max-abs relative, bf16 specialized vs stock (tests/cpu/test_specialized.py)


def _maxrel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts launches through kda_decode_triton (the attribute the dispatcher calls)."""
    calls = []
    real = KT.kda_decode_triton

    def counting(*a, **kw):
        calls.append(kw.get("slots"))
        return real(*a, **kw)

    monkeypatch.setattr(KT, "kda_decode_triton", counting)
    return calls


def _random_layer(cfg, par, seed):
    """A KDAAttention (bf16, on DEV) with weights at models/k3.py init_random_ scales."""
    from raydecode.models.kda import KDAAttention

    return random_kda_params_(KDAAttention(cfg, 0, par, dtype=BF), seed).to(DEV)


@gpu_only
@pytest.mark.parametrize("name,tp", [("tiny", 1), ("small", 1), ("k3", 16), ("k3", 8)],
                         ids=["tiny", "small-4x32", "k3-tp16", "k3-tp8"])
@pytest.mark.parametrize("T", [1, 4, 64])
def test_model_layer_specialized_decode_equals_stock(name, tp, T, kernel_calls):
    """KDAAttention.forward on CUDA bf16: path 'specialized' (the kernel over the cache's slot
    pool) vs 'stock' (the per-sequence PyTorch loop), three decode steps from the same random
    state at scattered slots; unused slots (NaN) untouched by both."""
    import dataclasses

    from raydecode.models.cache import KDAStateCache, ModelCaches, StepBatch
    from raydecode.models.config import load_config
    from raydecode.models.parallel import Parallel

    seed = fresh_seed()
    cfg = load_config("tiny" if name == "small" else name)
    if name == "small":
        cfg = dataclasses.replace(cfg, kda=dataclasses.replace(cfg.kda, head_dim=32))
    par = Parallel(0, tp)
    layer = _random_layer(cfg, par, seed)
    g = torch.Generator().manual_seed(seed)
    S = 2 * T + 3
    slots = torch.randperm(S, generator=g)[:T].tolist()
    caches = {}
    for p in ("stock", "specialized"):
        kc = KDAStateCache(1, S, layer.heads, layer.dim, layer.width, BF, DEV)
        kc.conv.fill_(float("nan"))
        kc.rec.fill_(float("nan"))
        caches[p] = ModelCaches(mla=None, kda=kc, kda_index={0: 0})
    conv0 = torch.randn((T,) + tuple(kc.conv.shape[2:]), generator=g).to(BF).to(DEV)
    rec0 = (0.05 * torch.randn((T,) + tuple(kc.rec.shape[2:]), generator=g)).to(DEV)
    for c in caches.values():
        c.kda.conv[0, slots], c.kda.rec[0, slots] = conv0, rec0
    what = f"seed {seed} {name} T={T} slots={slots}"
    with torch.inference_mode():
        for step in range(3):
            x = torch.randn(T, cfg.hidden_size, generator=g).to(BF).to(DEV)
            batch = StepBatch.decode(slots, [5 + step] * T)
            out = {p: layer(x, batch, c, p) for p, c in caches.items()}
            assert len(kernel_calls) == step + 1, f"{what}: kernel not used at step {step}"
            e = _maxrel(out["specialized"], out["stock"])
            assert e < MODEL_TOL, f"{what} step {step}: out {e:.2e}"
    s, p = caches["stock"].kda, caches["specialized"].kda
    for k in ("conv", "rec"):
        a, b = getattr(p, k)[0, slots], getattr(s, k)[0, slots]
        assert _maxrel(a, b) < MODEL_TOL, f"{what}: {k} {_maxrel(a, b):.2e}"
        rest = [i for i in range(S) if i not in slots]
        assert getattr(p, k)[0, rest].isnan().all(), f"{what}: {k} outside slots written"


@gpu_only
def test_whole_model_specialized_decode_on_cuda(kernel_calls, monkeypatch):
    """The tiny K3 model on CUDA bf16, path 'specialized': prefill three sequences at
    scattered slots, then decode steps. Every KDA layer launches the kernel on each decode step,
    and each call is checked against the stock layer on the same input and a copy of the same
    cache (a shadow run): end-to-end logits are not compared because a bf16 MoE top-k near-tie
    can flip between any two roundings of the step (tests/cpu/test_kda_specialized_path.py)."""
    import copy

    from raydecode.models.cache import SeqSlice, StepBatch
    from raydecode.models.config import load_config
    from raydecode.models.k3 import K3ForCausalLM, init_random_, make_caches

    cfg = load_config("tiny")
    with torch.device(DEV):
        model = init_random_(K3ForCausalLM(cfg, dtype=BF), seed=fresh_seed())
    errs = []

    def shadowed(attn):
        real = attn.forward

        def forward(x, batch, caches, path="stock"):
            shadow = copy.copy(caches)
            shadow.kda = copy.copy(caches.kda)
            shadow.kda.conv, shadow.kda.rec = caches.kda.conv.clone(), caches.kda.rec.clone()
            want = real(x, batch, shadow, "stock")
            got = real(x, batch, caches, path)
            sl = [s.slot for s in batch.seqs]
            errs.append((_maxrel(got, want), _maxrel(caches.kda.rec[:, sl], shadow.kda.rec[:, sl]),
                         _maxrel(caches.kda.conv[:, sl], shadow.kda.conv[:, sl])))
            return got
        return forward

    for i in cfg.kda_layer_ids:
        attn = model.model.layers[i].self_attn
        monkeypatch.setattr(attn, "forward", shadowed(attn))
    g = torch.Generator().manual_seed(4)
    toks = torch.randint(0, cfg.vocab_size, (40,), generator=g).to(DEV)
    slots, lens = [6, 1, 4], [5, 2, 3]
    with torch.inference_mode():
        c = make_caches(cfg, model.par, 8, 32, 4, BF, device=DEV)
        for s in range(8):
            c.mla.block_tables[s] = [4 * s + j for j in range(4)]
        seqs, start = [], 0
        for s, n in zip(slots, lens):
            seqs.append(SeqSlice(s, start, n, 0))
            start += n
        model(toks[:start], StepBatch(seqs), c, "specialized")
        n_prefill = len(errs)
        for step in range(4):
            t = toks[start + 3 * step:start + 3 * step + 3]
            h = model(t, StepBatch.decode(slots, [n + step for n in lens]), c, "specialized")
            assert h.isfinite().all()
    assert len(kernel_calls) == 4 * len(cfg.kda_layer_ids)
    assert n_prefill == len(cfg.kda_layer_ids) and len(errs) == 5 * n_prefill
    worst = [max(e[j] for e in errs) for j in range(3)]
    assert max(worst) < MODEL_TOL, f"out / rec / conv max rel {worst}"
