"""Resident MoE kernel (kernels/moe_resident_cute.py) on a CPU-only machine: the plan's
validation and what fits, the split of row pairs and output rows over CTAs, and the bulk-copy
list (`plan_copies`, the host mirror of the kernel's `_issue`) byte for byte. With
nvidia-cutlass-dsl (a venv with nvidia-cutlass-dsl, `CUTE_DSL_ARCH=sm_90a`) the kernel also COMPILES, and its
SASS has bulk copies, prmt decodes and no local memory; running it needs the GPU
(tests/gpu/test_moe_resident_kernel.py)."""
from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")   # before cutlass is imported

import random  # noqa: E402

import pytest  # noqa: E402

from raydecode.kernels import moe_resident_cute as R  # noqa: E402

K3_TP16 = dict(tokens=1, top_k=16, num_experts=896, intermediate=192, latent=3584, ctas=132)


def _plan(**kw) -> R.ResidentMoEPlan:
    return R.ResidentMoEPlan(**{**K3_TP16, **kw})


@pytest.mark.parametrize("kw,match", [
    ({"tokens": 0}, "tokens=0"), ({"top_k": True}, "top_k=True"), ({"ctas": 0}, "ctas=0"),
    ({"warps": 33}, "warps=33"), ({"latent": 3000}, "latent=3000"),
    ({"intermediate": 96}, "intermediate=96"), ({"beta": 0.0}, "beta=0.0"),
    ({"linear_beta": -1.0}, "linear_beta=-1.0"), ({"latent": 512, "ctas": 600}, "ctas=600; every CTA"),
    ({"top_k": 1, "intermediate": 64, "latent": 512, "ctas": 100}, "64 row pairs, ctas=100"),
    ({"num_experts": 4096}, "exceed 2\\^31"), ({"tokens": 2}, "shared memory"),
    ({"tokens": 3, "intermediate": 64, "latent": 512}, "48 pairs"),
    ({"predecode": -1}, "predecode=-1"), ({"predecode": True}, "predecode=True"),
    ({"intermediate": 384}, "shared memory")])
def test_plan_refusals_name_the_value(kw, match):
    with pytest.raises(ValueError, match=match):
        _plan(**kw)


def test_k3_tp16_batch1_fits_and_its_sizes():
    p = _plan()
    assert p.pairs == 16 and p.units == 3072 and p.max_units == 24
    assert p.rounds == 2 and p.down_rows == 28 and p.pairs_per_cta == 2
    assert p.copies == 2 * 2 + 2 * 24 + 2 * 16 and p.barriers == 26
    assert p.smem_bytes <= R.SMEM_MAX
    # every touched expert once: 16 × (2·192 rows × (1792 + 112) B + 3584 rows × (96 + 6) B)
    assert p.weight_bytes() == 16 * (384 * 1904 + 3584 * 102)
    assert p.down_scale_span >= p.down_rows * 6 + 30 and p.down_scale_span % 16 == 0


@pytest.mark.parametrize("G", [1, 7, 132, 133])
def test_cta_split_is_exact_and_balanced(G):
    p = _plan(top_k=4, intermediate=64, latent=512, ctas=G) if G > 132 else _plan(ctas=G) \
        if G == 132 else _plan(top_k=2, intermediate=64, latent=512, ctas=G)
    units = [p.cta_units(b) for b in range(G)]
    rows = [p.cta_rows(b) for b in range(G)]
    for spans, total, most in ((units, p.units, p.max_units), (rows, p.latent, p.down_rows)):
        assert spans[0][0] == 0 and spans[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        sizes = [b - a for a, b in spans]
        assert max(sizes) <= most and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("kw", [{}, dict(top_k=4, intermediate=64, latent=512, ctas=7, warps=2),
                                dict(tokens=3, top_k=4, num_experts=40, intermediate=128,
                                     latent=1024, ctas=24, warps=4)])
def test_copies_cover_every_byte_once(kw):
    """Over all CTAs: the gate/up code and scale rows of each pair's expert are copied exactly
    once, each into its CTA's slot of its row pair; every CTA's down rows of every pair too; the
    down-scale spans are 16-byte aligned, cover the rows, stay inside the tensor and their slot;
    no two copies of a CTA overlap in shared memory; every copy is a positive multiple of 16."""
    p = _plan(**kw)
    rng = random.Random(0)
    ids = [rng.randrange(p.num_experts) for _ in range(p.pairs)]
    ids[0] = p.num_experts - 1
    I, L = p.intermediate, p.latent
    KB, KG, KB2, KG2 = L // 2, L // 32, I // 2, I // 32
    seen = {"w13": {}, "s13": {}}
    down = {"w2": set(), "s2": set()}
    size = {"w13": p.num_experts * 2 * I * KB, "s13": p.num_experts * 2 * I * KG,
            "w2": p.num_experts * L * KB2, "s2": p.num_experts * L * KG2}
    region = {"w13": 2 * p.max_units * KB, "s13": 2 * p.max_units * KG,
              "w2": p.pairs * p.down_rows * KB2, "s2": p.pairs * p.down_scale_span}
    n_copies = 0
    for b in range(p.ctas):
        u0, u1 = p.cta_units(b)
        l0, l1 = p.cta_rows(b)
        cps = R.plan_copies(p, b, ids)
        arrivals = {}
        n_copies = max(n_copies, len(cps))
        dst = {k: [] for k in size}
        for name, src, off, nb, bar in cps:
            assert nb > 0 and nb % 16 == 0 and src % 16 == 0 and off % 16 == 0
            assert 0 <= src and src + nb <= size[name]
            assert 0 <= off and off + nb <= region[name]
            dst[name].append((off, off + nb))
            want_bar = {"s13": 0, "w13": 1 + (off // KB) % p.max_units}.get(name, p.max_units + 1)
            assert bar == want_bar, f"{name} copy on mbarrier {bar}, expected {want_bar}"
            arrivals[bar] = arrivals.get(bar, 0) + 1
            if name in seen:
                row_bytes = KB if name == "w13" else KG
                for i in range(nb // row_bytes):
                    key = src // row_bytes + i                 # global row of w13 / s13
                    assert key not in seen[name], f"{name} row {key} copied twice"
                    seen[name][key] = (b, off // row_bytes + i)
            elif name == "w2":
                e, lr = divmod(src // KB2, L)
                down["w2"].add((b, e, lr, nb // KB2))
            else:
                assert src <= ((ids[off // p.down_scale_span] * L + l0) * KG2)
                assert src + nb >= (ids[off // p.down_scale_span] * L + l1) * KG2
                assert nb <= p.down_scale_span
        # each mbarrier is initialised with the arrivals its copies make (else the kernel hangs)
        assert arrivals == {0: 2 * ((u1 - 1) // I - u0 // I + 1), p.max_units + 1: 2 * p.pairs,
                            **{1 + u: 2 for u in range(u1 - u0)}}
        for spans in dst.values():
            spans.sort()
            assert all(a[1] <= b_[0] for a, b_ in zip(spans, spans[1:])), "copies overlap"
        # down: every pair's rows [l0, l1) of its expert, once
        assert sorted((e, lr, n) for bb, e, lr, n in down["w2"] if bb == b) == \
            sorted((ids[q], l0, l1 - l0) for q in range(p.pairs))
    assert n_copies <= p.copies
    # gate/up: rows [0, 2I) of every pair's expert, each once, in its CTA's slot
    for q in range(p.pairs):
        e = ids[q]
        for half in range(2):
            for n in range(I):
                key = e * 2 * I + half * I + n
                U = q * I + n
                b = next(b for b in range(p.ctas) if p.cta_units(b)[0] <= U < p.cta_units(b)[1])
                slot = half * p.max_units + U - p.cta_units(b)[0]
                if ids.count(e) == 1:
                    assert seen["w13"][key] == (b, slot) and seen["s13"][key] == (b, slot)


# ---- compiles (needs nvidia-cutlass-dsl; skipped where cutlass does not import) -------------

def test_kernel_compiles_with_bulk_copies_prmt_and_no_local_memory(tmp_path):
    if R.cute is None:
        pytest.skip("nvidia-cutlass-dsl not importable (CI venv): compile checks need nvidia-cutlass-dsl")
    plan = _plan(beta=4.0, linear_beta=25.0)
    sass = R.compile_moe(plan, f"--keep-sass --dump-dir={tmp_path}").__sass__
    assert "UBLKCP" in sass and "LDL" not in sass and "STL" not in sass
    assert sass.count("PRMT") >= 6 * (plan.latent // 512 * 4 + plan.intermediate // 64)
    assert "HFMA2" in sass and "UTMA" not in sass


def test_dispatch_table_fits_and_cpu_calls_fall_through():
    """Every shape `moe_decode` sends to the resident kernel fits one launch on an H200
    (132 SMs) with the served predecode; on CPU tensors it never plans a launch."""
    import torch

    from raydecode.kernels import moe_decode as D
    from raydecode.kernels.moe_mxfp4 import MXFP4Experts
    from raydecode.kernels.settings import DEFAULT_OPTIONS

    assert (896, 192, 3584, 1) in D.RESIDENT
    for E, I, L, T in D.RESIDENT:
        R.ResidentMoEPlan(tokens=T, top_k=16, num_experts=E, intermediate=I, latent=L, ctas=132,
                          predecode=DEFAULT_OPTIONS.moe_resident_predecode)
    ex = MXFP4Experts.random(4, 512, 64, 4.0, None)
    assert D.resident_plan(torch.zeros(1, 512, dtype=torch.bfloat16),
                            torch.zeros(1, 4, dtype=torch.int64), ex) is None
