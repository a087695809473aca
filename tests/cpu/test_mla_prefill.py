"""MLA prefill attention (kernels/mla_prefill.py): the SDPA formulation (decompressed K/V,
lower-right causal bias) in fp32 on the CPU against the absorbed fp32 reference, with and
without the padded V that the flash route takes; chunks at position 0 and after a context;
validation; the layer's stock prefill on the SDPA path against the naive prefill.

The GPU twin (bf16, K3 TP16 shapes, the backend that runs): tests/gpu/test_mla_prefill_gpu.py.
"""
import pytest
import torch
import torch.nn.functional as F

from raydecode.kernels.mla_prefill import (decompress, mla_prefill_attention, mla_prefill_into,
                                           mla_prefill_reference, resolve_impl)
from raydecode.models.cache import SeqSlice, StepBatch
from raydecode.models.config import load_config
from raydecode.models.k3 import K3ForCausalLM, init_random_, make_caches
from raydecode.models.mla import mla_absorbed_attention
from raydecode.models.parallel import Parallel

from _numerics import TOL, fresh_seed, max_rel_err, rel_err

torch.set_num_threads(1)

# (heads, kv_lora, rope, nope, v): small; K3's per-rank head shape at TP16 (6 of 96 heads)
SHAPES = {"small": (3, 32, 8, 16, 12), "k3_tp16": (6, 512, 64, 128, 128)}


class Case:
    """Fresh random rows, kv_b weight and queries: n queries at positions ctx .. ctx + n − 1."""

    def __init__(self, shape: str, n: int, ctx: int, seed: int):
        self.h, self.c, self.rope, self.nope, self.v = SHAPES[shape]
        gen = torch.Generator().manual_seed(seed)
        self.n, self.ctx, self.seed = n, ctx, seed
        self.rows = torch.randn(ctx + n, self.c + self.rope, generator=gen)
        self.w = torch.randn(self.h * (self.nope + self.v), self.c, generator=gen) / self.c ** .5
        self.q = torch.randn(n, self.h, self.nope + self.rope, generator=gen)
        self.scale = (self.nope + self.rope) ** -0.5

    @property
    def kw(self) -> dict:
        return dict(nope=self.nope, vdim=self.v, kv_lora=self.c, scale=self.scale)

    def reference(self) -> torch.Tensor:
        return mla_prefill_reference(self.q, self.rows, self.ctx, self.w, **self.kw)


@pytest.mark.parametrize("shape", ["small", "k3_tp16"])
@pytest.mark.parametrize("ctx", [0, 37])
@pytest.mark.parametrize("n", [1, 2, 17, 64])
@pytest.mark.parametrize("pad_v", [None, True])
def test_sdpa_formulation_matches_the_absorbed_reference(shape, ctx, n, pad_v):
    """pad_v True: V is the E-wide view [v | k_nope[:E − v]] the flash route attends with,
    its extra output columns dropped; None: the v-wide V (the CPU route)."""
    cs = Case(shape, n, ctx, seed := fresh_seed())
    ref = cs.reference()
    out = torch.full((n, cs.h, cs.v), float("nan"))                    # every element written
    route = mla_prefill_into(out, cs.q, cs.rows, ctx, cs.w, pad_v=pad_v, **cs.kw)
    assert route == "cpu"
    assert torch.isfinite(out).all(), seed
    assert rel_err(out, ref) < TOL["fp32_path"], (rel_err(out, ref), seed)


def test_reference_is_the_models_absorbed_math():
    """mla_prefill_reference == W_uv · mla_absorbed_attention (models/mla.py) on the same
    inputs: the kernel's ground truth is the stock path's math."""
    cs = Case("small", 9, 14, seed := fresh_seed())
    w = cs.w.view(cs.h, cs.nope + cs.v, cs.c)
    q_abs = torch.cat([torch.einsum("thn,hnc->thc", cs.q[..., :cs.nope], w[:, :cs.nope]),
                       cs.q[..., cs.nope:]], -1)
    m = cs.ctx + cs.n
    o_lat, _ = mla_absorbed_attention(q_abs, cs.rows, torch.arange(m),
                                      torch.arange(cs.ctx, m), cs.c, cs.scale)
    model = torch.einsum("thc,hvc->thv", o_lat, w[:, cs.nope:])
    assert max_rel_err(cs.reference(), model) < 1e-6, seed


def test_a_chunk_after_context_sees_the_lower_right_triangle():
    """Query t of a chunk at ctx sees rows 0 .. ctx + t: its first query equals a one-query
    chunk at ctx. The check can fail: SDPA's is_causal (upper-left: query t sees rows 0 .. t)
    on the same K/V gives a different result."""
    cs = Case("small", 6, 10, seed := fresh_seed())
    out = mla_prefill_attention(cs.q, cs.rows, cs.ctx, cs.w, impl="sdpa", **cs.kw)
    assert rel_err(out, cs.reference()) < TOL["fp32_path"], seed
    one = mla_prefill_attention(cs.q[:1], cs.rows[:cs.ctx + 1], cs.ctx, cs.w, impl="sdpa",
                                **cs.kw)
    assert rel_err(out[:1], one) < TOL["fp32_path"], seed
    buf = decompress(cs.rows, cs.w, cs.h, nope=cs.nope, vdim=cs.v, kv_lora=cs.c,
                     dtype=torch.float32)
    k, v = buf[..., cs.v:].transpose(0, 1), buf[..., :cs.v].transpose(0, 1)
    upper_left = F.scaled_dot_product_attention(cs.q.transpose(0, 1), k, v, is_causal=True,
                                                scale=cs.scale).transpose(0, 1)
    assert rel_err(upper_left, out) > 1e-2, seed


def test_dispatch_and_impl_switch():
    cs = Case("small", 5, 3, seed := fresh_seed())
    assert resolve_impl("auto", cs.q) == "reference"                   # a CPU tensor
    assert resolve_impl("sdpa", cs.q) == "sdpa"
    auto = mla_prefill_attention(cs.q, cs.rows, cs.ctx, cs.w, **cs.kw)
    assert auto.dtype == torch.float32 and torch.equal(auto, cs.reference())
    out = torch.full((5, cs.h, cs.v), float("nan"))
    got = mla_prefill_attention(cs.q, cs.rows, cs.ctx, cs.w, impl="sdpa", out=out, **cs.kw)
    assert got is out and rel_err(out, auto) < TOL["fp32_path"], seed
    ref_out = torch.full((5, cs.h, cs.v), float("nan"))
    mla_prefill_attention(cs.q, cs.rows, cs.ctx, cs.w, impl="reference", out=ref_out, **cs.kw)
    assert torch.equal(ref_out, auto)


@pytest.mark.parametrize("bad, match", [
    (dict(impl="flash"), "impl = 'flash'; accepted: auto, sdpa, reference"),
    (dict(ctx=4), r"rows of shape \(8, 40\): expected .* \(9, 40\)"),
    (dict(ctx=-1), "ctx = -1: expected an int"),
    (dict(q=torch.randn(5, 3, 16)), r"q of shape \(5, 3, 16\)"),
    (dict(q=torch.randn(0, 3, 24)), r"q of shape \(0, 3, 24\)"),
    (dict(w=torch.randn(3 * 28, 16)), r"kv_b weight of shape \(84, 16\): expected .*\(84, 32\)"),
    (dict(out=torch.empty(5, 3, 16)), r"out of shape \(5, 3, 16\)"),
])
@pytest.mark.parametrize("impl", ["sdpa", "reference"])
def test_validation_names_the_value(bad, match, impl):
    cs = Case("small", 5, 3, 0)
    args = dict(q=cs.q, ctx=cs.ctx, w=cs.w, out=None, impl=impl) | bad
    with pytest.raises(ValueError, match=match):
        mla_prefill_attention(args["q"], cs.rows, args["ctx"], args["w"], impl=args["impl"],
                              out=args["out"], **cs.kw)


# ---- the layer --------------------------------------------------------------------------

def _layer(seed: int):
    cfg = load_config("tiny")
    model = init_random_(K3ForCausalLM(cfg), seed)
    return cfg, model.model.layers[cfg.mla_layers[0]].self_attn


def test_layer_prefill_chunks_on_sdpa_match_the_naive_prefill():
    """Chunks of 6 (position 0) and 4 (position 6) with a decode row of another sequence in
    the second step, the layer's prefill_impl forced to SDPA on the CPU: the naive prefill's
    output (the stock default on the CPU stays the reference, bit for bit as before)."""
    cfg, attn = _layer(seed := fresh_seed())
    gen = torch.Generator().manual_seed(seed)
    T = 10
    x = torch.randn(T, cfg.hidden_size, generator=gen)
    xb = torch.randn(3, cfg.hidden_size, generator=gen)
    ref = attn(x, StepBatch([SeqSlice(0, 0, T, 0)]), None)
    ref_b = attn(xb, StepBatch([SeqSlice(0, 0, 3, 0)]), None)
    outs = {}
    for impl in ("sdpa", "reference", "auto"):
        attn.prefill_impl = impl
        caches = make_caches(cfg, Parallel(), num_slots=2, num_blocks=8, block_size=4)
        caches.mla.block_tables[0], caches.mla.block_tables[1] = [5, 2, 7], [0, 1]
        a = attn(x[:6], StepBatch([SeqSlice(0, 0, 6, 0)]), caches)
        attn(xb[:2], StepBatch([SeqSlice(1, 0, 2, 0)]), caches)
        step = StepBatch([SeqSlice(1, 0, 1, 2), SeqSlice(0, 1, 4, 6)])     # decode + chunk
        b = attn(torch.cat([xb[2:], x[6:]]), step, caches)
        outs[impl] = torch.cat([a, b[1:]]), b[:1]
        assert max_rel_err(outs[impl][0], ref) < 1e-5, (impl, seed)
        assert max_rel_err(outs[impl][1], ref_b[2:]) < 1e-5, (impl, seed)
    assert torch.equal(outs["auto"][0], outs["reference"][0])
    assert not torch.equal(outs["sdpa"][0], outs["reference"][0])   # the switch took effect


@pytest.mark.parametrize("route", ["flash", "efficient", "other"])
@pytest.mark.parametrize("ctx", [0, 37])
def test_the_sdpa_call_runs_on_its_routes_backend_alone(monkeypatch, route, ctx):
    """At ctx = 0 the chunk is plain is_causal SDPA, which torch may give to cuDNN (a graph
    built per shape on its first call, on the request path); the call is restricted to the
    route's backend (flash / memory-efficient), 'other' left to torch. The CPU cannot run
    those kernels: the route is forced and SDPA replaced by a recorder of the backends
    allowed while it runs."""
    from raydecode.kernels import mla_prefill as MP
    from torch.nn.attention import SDPBackend, _cur_sdpa_kernel_backends
    cs = Case("small", 5, ctx, fresh_seed())
    seen = []

    def fake_route(q4, k4, buf, vdim, pad_v=None):
        return route, MP._heads_first(buf[..., :vdim])

    def fake_sdpa(q4, k4, v4, attn_mask=None, scale=None):
        seen.append(set(_cur_sdpa_kernel_backends()))
        return q4.new_zeros(*q4.shape[:-1], v4.shape[-1])
    monkeypatch.setattr(MP, "sdpa_route", fake_route)
    monkeypatch.setattr(MP.F, "scaled_dot_product_attention", fake_sdpa)
    before = set(_cur_sdpa_kernel_backends())
    out = torch.full((5, cs.h, cs.v), float("nan"))
    assert MP.mla_prefill_into(out, cs.q, cs.rows, ctx, cs.w, **cs.kw) == route
    want = {"flash": {SDPBackend.FLASH_ATTENTION},
            "efficient": {SDPBackend.EFFICIENT_ATTENTION}}.get(route, before)
    assert seen == [want]
    assert set(_cur_sdpa_kernel_backends()) == before       # restored after the call
