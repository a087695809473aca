"""Resident GEMV chain (kernels/experimental/resident_chain_cute.py) against its PyTorch reference on the GPU:
fresh random weights and x over the bench's K3 widths and small shapes, poisoned outputs,
repeated launches and graph replays (the kernel must leave its counters at zero), and a stage
size that splits a CTA's rows into a short last stage."""
from __future__ import annotations

import pytest
import torch

from raydecode.kernels.experimental import resident_chain_cute as RC
from raydecode.kernels._cute import cute_available

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and cute_available()),
                                reason="needs a CUDA GPU (sm_90+) and nvidia-cutlass-dsl")

K3 = ((1024, 7168), (7168, 1024), (1024, 7168), (7168, 1024))


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def _setup(plan: RC.ChainPlan, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    xs = torch.full((plan.x_offsets[-1],), float("nan"), device="cuda", dtype=torch.bfloat16)
    ws = torch.empty(plan.w_offsets[-1], device="cuda", dtype=torch.bfloat16)
    x, w = RC.flat_views(plan, xs, ws)
    x[0].copy_(torch.randn(x[0].numel(), device="cuda", generator=g).to(torch.bfloat16))
    for wi in w:
        wi.copy_((torch.randn(wi.shape, device="cuda", generator=g) / wi.shape[1] ** 0.5)
                 .to(torch.bfloat16))
    return xs, ws, x, w, torch.zeros(plan.scratch_words, device="cuda", dtype=torch.int32)


def _check(x, w):
    want = RC.chain_reference(x[0], w)
    for p, (got, ref) in enumerate(zip(x[1:], want)):
        assert not got.isnan().any(), f"phase {p} left poisoned values"
        # the chain from x_0: fp32 sums in another order flip a bf16 rounding (2^-8 relative)
        # now and then, and the flip is carried into later phases; 2 % of max |ref| covers it
        err = (got.float() - ref.float()).abs().max().item()
        assert err <= 0.02 * ref.float().abs().max().item(), f"phase {p}: max err {err}"
        # each phase alone, from the kernel's own x_p: at most one bf16 rounding apart
        own = RC.chain_reference(x[p], [w[p]])[0].float()
        err = (got.float() - own).abs().max().item()
        assert err <= 2 ** -7 * own.abs().max().item(), f"phase {p} alone: max err {err}"


@pytest.mark.parametrize("shapes,kw", [
    (K3, {}),                                                   # the bench's chain
    (K3, {"publish": "tagged"}),                                # x_p as tagged words
    (K3, {"inflight": 1}),                                      # one copy in flight
    (K3, {"inflight": 12, "publish": "tagged"}),                # no throttle
    (K3, {"stages": 4, "consumer_warps": 2}),                   # shallow ring, 2-warp groups
    (K3, {"groups": 1}),                                        # one group takes every stage
    (K3, {"groups": 4}),
    (K3, {"op_ns": 2000}),                                      # the bench's stand-in op
    (K3, {"groups": 6, "stages": 6}),                           # a group per slot, more groups
                                                                # than a K = 7168 phase's stages
    (((512, 256), (256, 512), (768, 256)), {"consumer_warps": 1, "stage_bytes": 1536}),
])
def test_chain_matches_reference(shapes, kw):
    plan = RC.ChainPlan(shapes, ctas=_sms(), **kw)
    xs, ws, x, w, sync = _setup(plan, seed=len(shapes) + plan.stages)
    for launch in range(3):                                     # the epoch moves the tags on
        for xi in x[1:]:
            xi.fill_(float("nan"))
        RC.resident_chain_into(plan, xs, ws, sync)
        torch.cuda.synchronize()
        _check(x, w)
        # counters reset, no spin bound, one epoch per launch
        assert sync[:RC.SYNC_WORDS].tolist() == [0, 0, 0, launch + 1]


def test_graph_replays_with_new_inputs():
    plan = RC.ChainPlan(K3, ctas=_sms())
    xs, ws, x, w, sync = _setup(plan, seed=7)
    RC.resident_chain_into(plan, xs, ws, sync)                  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        RC.resident_chain_into(plan, xs, ws, sync)
    g = torch.Generator(device="cuda").manual_seed(11)
    for _ in range(3):                                          # fresh x_0 and W_1 each replay
        x[0].copy_(torch.randn(x[0].numel(), device="cuda", generator=g).to(torch.bfloat16))
        w[1].copy_(torch.randn(w[1].shape, device="cuda", generator=g).to(torch.bfloat16) / 32)
        for xi in x[1:]:
            xi.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(x, w)
        assert sync[:3].tolist() == [0, 0, 0]


def test_bad_buffers_are_refused():
    plan = RC.ChainPlan(K3, ctas=_sms())
    xs, ws, _, _, sync = _setup(plan, seed=3)
    with pytest.raises(ValueError, match="ws"):
        RC.resident_chain_into(plan, xs, ws[:-8], sync)
    with pytest.raises(ValueError, match="scratch"):
        RC.resident_chain_into(plan, xs, ws, sync.long())
    with pytest.raises(ValueError, match="trace"):
        RC.resident_chain_into(RC.ChainPlan(K3, ctas=_sms(), trace=True), xs, ws, sync)


@pytest.mark.parametrize("publish", RC.PUBLISH)
def test_trace_stamps_are_ordered_and_change_nothing(publish):
    plan = RC.ChainPlan(K3, ctas=_sms(), trace=True, publish=publish)
    xs, ws, x, w, sync = _setup(plan, seed=5)
    trace = torch.zeros(RC.trace_words(plan), device="cuda", dtype=torch.int64)
    RC.resident_chain_into(plan, xs, ws, sync, trace)
    torch.cuda.synchronize()
    _check(x, w)
    t = trace.view(plan.ctas, plan.phases, RC.TRACE_EVENTS)[:, :, :6]
    assert (t > 0).all()
    # per CTA and phase: start ≤ x loaded ≤ stages summed ≤ y stored; first ≤ last issue
    assert (t[:, :, 0] <= t[:, :, 1]).all() and (t[:, :, 1] <= t[:, :, 2]).all()
    assert (t[:, :, 2] <= t[:, :, 3]).all() and (t[:, :, 4] <= t[:, :, 5]).all()
    # no CTA has x_p before every CTA summed its rows of phase p − 1 (y is stored after that)
    assert (t[:, 1:, 1].min(0).values >= t[:, :-1, 2].max(0).values).all()
