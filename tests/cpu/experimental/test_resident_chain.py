"""Resident GEMV chain (kernels/experimental/resident_chain_cute.py) on a CPU-only machine: the plan's
validation and derived layout (row split, stages, partial-sum rows, buffer offsets), the
reference, the op's buffer checks, and every bench variant's plan. With nvidia-cutlass-dsl
(a venv with nvidia-cutlass-dsl, `CUTE_DSL_ARCH=sm_90a`) the kernel also COMPILES and its SASS has the bulk
copies and no local memory; running it needs the GPU (tests/gpu/test_resident_chain.py)."""
from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")   # before cutlass is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from raydecode.kernels.experimental import resident_chain_cute as RC  # noqa: E402

torch.set_num_threads(1)
K3 = ((1024, 7168), (7168, 1024), (1024, 7168), (7168, 1024))


@pytest.mark.parametrize("kw,needle", [
    (dict(shapes=()), "shapes is empty"),
    (dict(ctas=0), "ctas=0"),
    (dict(stage_bytes=1000), "stage_bytes=1000"),
    (dict(stages=1, groups=1, inflight=1), "stages=1"),
    (dict(shapes=((1024, 7168), (512, 1000))), "K=1000"),
    (dict(shapes=((1024, 7168), (512, 2048))), "K=2048 != phase 0 N=1024"),
    (dict(stage_bytes=8192), "row of K=7168 is 14336 B"),
    (dict(stages=16), "shared memory"),
    (dict(publish="nvls"), "publish='nvls'"),
    (dict(probe="fast"), "probe='fast'"),
    (dict(groups=5), "groups=5, stages=12"),
    (dict(inflight=0), "inflight=0"),
    (dict(inflight=13), "inflight=13"),
    (dict(groups=12, consumer_warps=4), "groups=12"),
    (dict(op_ns=-1), "op_ns=-1"),
    (dict(op_ns=1.5), "op_ns=1.5"),
])
def test_bad_plans_are_refused_naming_the_value(kw, needle):
    args = dict(shapes=K3, ctas=132) | kw
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        RC.ChainPlan(**args)


def test_one_cta_cannot_hold_a_phases_partials():
    with pytest.raises(ValueError, match="shared memory"):   # 7168 rows × 4 warps of fp32
        RC.ChainPlan(K3, ctas=1)


@pytest.mark.parametrize("ctas", [7, 132, 148])
def test_rows_split_into_whole_stages_and_partials_fit(ctas):
    plan = RC.ChainPlan(K3, ctas=ctas, stages=6)
    for p, (N, K) in enumerate(plan.shapes):
        R = plan.rows_per_stage(p)
        assert R == plan.stage_bytes // (2 * K) and R * 2 * K <= plan.stage_bytes
        spans = [plan.cta_rows(p, b) for b in range(ctas)]
        assert spans[0][0] == 0 and spans[-1][1] == N            # exact cover, in order
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        sizes = {r1 - r0 for r0, r1 in spans}
        assert max(sizes) - min(sizes) <= 1                        # balanced to one row
        # the partial-sum rows hold every stage the kernel writes (s·R + r < ns·R)
        assert all(-(-(r1 - r0) // R) * R <= plan.red_rows for r0, r1 in spans)
        assert plan.chunks_per_lane(p) * 8 * 32 * plan.consumer_warps == K


def test_buffer_offsets_and_views():
    plan = RC.ChainPlan(K3, ctas=132)
    widths = [7168, 1024, 7168, 1024, 7168]
    assert plan.x_offsets == tuple(sum(widths[:i]) for i in range(6))
    assert plan.weight_bytes == 2 * sum(N * K for N, K in K3)
    # tagged copies of x_1 … x_3 after the counters, each 16-byte aligned, then the end
    assert [plan.tag_offset(p) for p in (1, 2, 3)] == [4, 4 + 1024, 4 + 1024 + 7168]
    assert all(plan.tag_offset(p) % 4 == 0 for p in (1, 2, 3))
    assert plan.scratch_words == 4 + 1024 + 7168 + 1024
    assert RC.trace_words(plan) == 1
    assert RC.trace_words(RC.ChainPlan(K3, ctas=132, trace=True)) == 132 * 4 * RC.TRACE_EVENTS
    xs = torch.arange(plan.x_offsets[-1], dtype=torch.float32)
    ws = torch.zeros(plan.w_offsets[-1])
    x, w = RC.flat_views(plan, xs, ws)
    assert [t.numel() for t in x] == widths and [tuple(t.shape) for t in w] == list(K3)
    assert x[2][0].item() == plan.x_offsets[2] and all(t.is_contiguous() for t in w)
    w[1][3, 5] = 1.0                                               # views, not copies
    assert ws[plan.w_offsets[1] + 3 * 1024 + 5].item() == 1.0


def test_reference_rounds_to_bf16_between_phases():
    g = torch.Generator().manual_seed(0)
    shapes = ((64, 256), (128, 64), (32, 128))
    ws = [(torch.randn(N, K, generator=g) / K ** 0.5).to(torch.bfloat16) for N, K in shapes]
    x0 = torch.randn(256, generator=g).to(torch.bfloat16)
    got = RC.chain_reference(x0, ws)
    x = x0.double()
    for w, y in zip(ws, got):
        x = (w.double() @ x).to(torch.bfloat16)
        assert y.dtype == torch.bfloat16 and torch.allclose(y.float(), x.float(), rtol=0.01, atol=1e-3)
        x = x.double()


def test_op_refuses_bad_buffers_before_compiling():
    plan = RC.ChainPlan(K3, ctas=132)
    xs = torch.zeros(plan.x_offsets[-1], dtype=torch.bfloat16)
    ws = torch.zeros(plan.w_offsets[-1], dtype=torch.bfloat16)
    scratch = torch.zeros(plan.scratch_words, dtype=torch.int32)
    with pytest.raises(ValueError, match="xs is .* on cpu; need a 16-byte aligned CUDA"):
        RC.resident_chain_into(plan, xs, ws, scratch)
    with pytest.raises(ValueError, match="plan.trace is set"):
        RC.resident_chain_into(RC.ChainPlan(K3, ctas=132, trace=True), xs, ws, scratch)


def test_every_bench_variant_is_a_valid_plan():
    from raydecode.scripts.explore import persistent_chain as bench

    for name in bench.RING:
        plan = bench.ring_plan(name, 132)
        assert plan.shapes == K3 and plan.smem_bytes <= RC.SMEM_MAX
    assert set(bench.PROBED) <= set(bench.RING) <= set(bench.VARIANTS)


# ---- compiles (needs nvidia-cutlass-dsl; skipped where cutlass does not import) -----------------

@pytest.mark.parametrize("publish", RC.PUBLISH)
def test_kernel_compiles_with_bulk_copies_and_no_local_memory(publish, tmp_path):
    if RC.cute is None:
        pytest.skip("nvidia-cutlass-dsl not importable (CI venv): compile checks need nvidia-cutlass-dsl")
    plan = RC.ChainPlan(K3, ctas=132, publish=publish)
    sass = RC.compile_chain(plan, f"--keep-sass --dump-dir={tmp_path}").__sass__
    assert sass.count("UBLKCP") >= plan.phases                      # one bulk copy site per phase
    assert "LDL" not in sass and "STL" not in sass
    membars = sass.count("MEMBAR.ALL.GPU") + sass.count("MEMBAR.SC.GPU")
    # counter: a release per barrier + the final acq_rel; tagged: only the final acq_rel
    assert membars == (plan.phases if publish == "counter" else 1)


def test_bench_refuses_a_negative_op_time():
    from raydecode.scripts.explore import persistent_chain as bench

    with pytest.raises(SystemExit):
        bench.main(["--out", "/dev/null", "--op-us", "-1"])
