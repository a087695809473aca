"""kernels/moe_ogs.py on the CPU: the routing indices it hands triton_kernels' matmul_ogs,
checked by emulating the library's documented contract (sorted row s gathers x row
order[s] // k; each expert's rows are a hist-sized run, experts in order) and this module's
sum (`weighted_sum` reads pair (t, j)'s row at inverse[t·k + j]) against
`moe_mxfp4_reference`; and the fallbacks where the library cannot run. The library's
kernels are tests/gpu/test_moe_ogs.py's."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raydecode.kernels import moe_mxfp4 as M
from raydecode.kernels import moe_ogs as O
from raydecode.models.layers import situ
from raydecode.models.mxfp4 import unpack_mxfp4

from _numerics import fresh_seed, rel_err


def _case(E, L, I, k, T, seed, skew=False):
    gen = torch.Generator().manual_seed(seed)
    ex = M.MXFP4Experts.random(E, L, I, 4.0, 25.0, seed=seed).validate()
    z = torch.randn(T, L, generator=gen).to(torch.bfloat16)
    scores = torch.rand(T, E, generator=gen)
    if skew:                        # every token's first choice expert 2; half the experts unused
        scores[:, 2] = 2.0
        scores[:, E // 2:] = -1.0
    w, ids = scores.topk(k, dim=-1)
    return ex, z, (w / w.sum(-1, keepdim=True)).float(), ids


def _emulate(z, w, ids, ex, order, inverse, hist):
    """matmul_ogs's gather → (our SiTU) → per-run GEMM in sorted order, then the sum."""
    k, I = ids.shape[1], ex.intermediate
    y = torch.zeros(ids.numel(), z.shape[1], dtype=z.dtype)
    lo = 0
    for e, n in enumerate(hist.tolist()):
        rows = order[lo:lo + n].long()
        assert (ids.reshape(-1)[rows] == e).all(), "a run holds another expert's pair"
        h = z[rows // k]
        w13 = unpack_mxfp4(ex.w13[e], ex.s13[e], z.dtype)
        w2 = unpack_mxfp4(ex.w2[e], ex.s2[e], z.dtype)
        a = situ(F.linear(h, w13[:I]), F.linear(h, w13[I:]), ex.beta, ex.linear_beta)
        y[lo:lo + n] = F.linear(a, w2)
        lo += n
    assert lo == ids.numel()
    rows = y[inverse.long()].float().view(ids.shape[0], k, -1)        # pair order
    out = torch.zeros(z.shape, dtype=torch.float32)
    for j in range(k):                                                 # j in order, fp32
        out += rows[:, j] * w[:, j, None]
    return out


@pytest.mark.parametrize("E,L,I,k,T", [(8, 64, 32, 2, 40), (16, 128, 96, 4, 33)])
@pytest.mark.parametrize("skew", [False, True])
def test_indices_give_the_reference_under_the_librarys_contract(E, L, I, k, T, skew):
    seed = fresh_seed()
    ex, z, w, ids = _case(E, L, I, k, T, seed, skew)
    order, inverse, hist, gammas = O.ogs_indices(ids, w, E)
    P = T * k
    assert order.dtype == inverse.dtype == hist.dtype == torch.int32
    assert torch.equal(inverse[order.long()], torch.arange(P, dtype=torch.int32))
    assert torch.equal(hist, torch.bincount(ids.reshape(-1), minlength=E).int())
    sorted_e = ids.reshape(-1)[order.long()]
    assert (sorted_e[1:] >= sorted_e[:-1]).all()
    same = sorted_e[1:] == sorted_e[:-1]               # stable: token order inside an expert
    assert (order[1:][same] > order[:-1][same]).all()
    assert torch.equal(gammas, w.reshape(-1)[order.long()])
    out = _emulate(z, w, ids, ex, order, inverse, hist)
    ref = M.moe_mxfp4_reference(z, w, ids, ex)
    assert rel_err(out, ref) < 1e-5, f"seed {seed}: rel err {rel_err(out, ref):.2e}"


def test_without_the_library_prefill_falls_back_and_a_direct_call_says_why():
    """No triton_kernels / no GPU here: "ogs" kinds resolve to "auto"'s choice, and a call
    that asks for matmul_ogs anyway names what is missing."""
    why = O.ogs_unavailable()
    if why is None:
        pytest.skip("matmul_ogs can run here: the GPU test covers it")
    was = M.PREFILL_EXPERTS
    try:
        for kind in ("ogs", "ogs-hopper"):
            M.PREFILL_EXPERTS = kind
            cfg = M.prefill_config(3584, 192, 131072, 896)
            assert cfg.ogs == "" and cfg.blocked           # auto: blocked past 128 per expert
            assert not M.prefill_config(3584, 192, 2048 * 16, 896).blocked
    finally:
        M.PREFILL_EXPERTS = was
    ex, z, w, ids = _case(8, 64, 32, 2, 4, 0)
    with pytest.raises(RuntimeError, match="matmul_ogs experts: "):
        O.moe_mxfp4_ogs(z, w, ids, ex)
    with pytest.raises(ValueError, match="layout 'swizzled'"):
        O.ogs_weights(ex, "swizzled")


def test_ogs_kinds_take_matmul_ogs_only_for_calls_with_enough_pairs_per_expert(monkeypatch):
    """matmul_ogs pins block_m at 128 rows: "ogs" / "ogs-hopper" run it from OGS_MIN_LOAD
    pairs per expert (K3 TP16: 1,792 tokens of top-16) and "auto"'s kernels below, so a
    mixed or small chunk step keeps our kernels (the library stood in for here)."""
    monkeypatch.setattr(O, "ogs_ready", lambda device: True)
    edge = M.OGS_MIN_LOAD * 896
    for kind, layout in (("ogs", "strided"), ("ogs-hopper", "hopper")):
        monkeypatch.setattr(M, "PREFILL_EXPERTS", kind)
        assert M.prefill_config(3584, 192, edge, 896).ogs == layout
        assert M.prefill_config(3584, 192, 131072, 896).ogs == layout
        small = M.prefill_config(3584, 192, edge - 1, 896)
        mixed = M.default_config(255 * 16, 896, 192, 3584, tuned=False)  # 192 + 63 rows
        monkeypatch.setattr(M, "PREFILL_EXPERTS", "auto")
        assert small == M.prefill_config(3584, 192, edge - 1, 896) and not small.ogs
        assert mixed == M.default_config(255 * 16, 896, 192, 3584, tuned=False)


def test_converted_weights_are_cached_by_memory_not_by_view(monkeypatch):
    """Every call's MXFP4Experts holds new views of the same parameters (`RoutedExperts.packed`):
    the layer's weights convert once, other weights convert on their own."""
    calls = []
    monkeypatch.setattr(O, "_wrap", lambda v, s, layout: calls.append(v.data_ptr()) or (v, s))
    O.forget_weights()
    ex, *_ = _case(8, 64, 32, 2, 4, 0)

    def view(e):            # what packed() hands each call: fresh views, same storage
        return M.MXFP4Experts(e.w13.view(e.w13.shape), e.s13.view(e.s13.shape),
                              e.w2.view(e.w2.shape), e.s2.view(e.s2.shape), e.beta,
                              e.linear_beta)
    a = O.ogs_weights(view(ex), "hopper")
    b = O.ogs_weights(view(ex), "hopper")
    assert a is b and len(calls) == 2                  # w13 and w2, once
    O.ogs_weights(view(ex), "strided")
    other, *_ = _case(8, 64, 32, 2, 4, 1)
    O.ogs_weights(other, "hopper")
    assert len(calls) == 6
    O.forget_weights()
