"""Triton fused grouped MoE over MXFP4 vs its PyTorch reference (needs CUDA + Triton; on a CPU
with Triton, TRITON_INTERPRET=1 runs the small cases through the interpreter).

Fresh random weights, inputs and routing per case (seed from os.urandom, printed on failure);
the caching allocator is poisoned with NaN first, so an output row the kernels never write
shows up as NaN; error ‖out − ref‖ / ‖ref‖ against `moe_mxfp4_reference` (cuBLAS bf16 with
fp32 accumulation and the same rounding points) and, for one case, against an fp64 evaluation
with no intermediate rounding.
"""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from raydecode.kernels import moe_mxfp4 as M

from _numerics import fresh_seed, rel_err

ON_GPU = torch.cuda.is_available() and M.triton is not None
INTERPRET = (not torch.cuda.is_available() and M.triton is not None
             and os.environ.get("TRITON_INTERPRET") == "1")
pytestmark = pytest.mark.skipif(not (ON_GPU or INTERPRET),
                                reason="needs CUDA + Triton (or Triton with TRITON_INTERPRET=1)")
DEV = "cuda" if ON_GPU else "cpu"

# (E, L, I, top_k): K3 per-rank experts at TP16 and TP8 (GPU only), small shapes everywhere
K3_SHAPES = [(896, 3584, 192, 16), (896, 3584, 384, 16)]
SMALL_SHAPES = [(32, 128, 128, 4), (16, 256, 96, 2)]
# GPU: same rounding points as the reference, differences only from accumulation order.
# Interpreter: Triton 3.9's interpreter truncates fp32 -> bf16 instead of rounding (1 ulp more).
REL_TOL = 1e-2 if ON_GPU else 2.5e-2


def _poison_allocator(nbytes: int = 1 << 28) -> None:
    if DEV == "cuda":
        torch.empty(nbytes // 4, device=DEV).fill_(float("nan"))   # freed, then reused


def _routing(T, E, k, gen, skew=False):
    scores = torch.rand(T, E, generator=gen, device=DEV)
    if skew:       # every token's first choice is expert 3: one run longer than BLOCK_M
        scores[:, 3] = 2.0
    w, ids = scores.topk(k, dim=-1)
    return (w / w.sum(-1, keepdim=True)).float(), ids


def _case(E, L, I, k, T, seed, skew=False, lin=25.0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    ex = M.MXFP4Experts.random(E, L, I, 4.0, lin, device=DEV, seed=seed).validate()
    z = torch.randn(T, L, generator=gen, device=DEV).to(torch.bfloat16)
    w, ids = _routing(T, E, k, gen, skew)
    return ex, z, w, ids


def _shapes():
    return (K3_SHAPES if ON_GPU else []) + SMALL_SHAPES


@pytest.mark.parametrize("E,L,I,k", _shapes())
@pytest.mark.parametrize("T", [1, 4, 64])
def test_fused_matches_reference(E, L, I, k, T):
    if not ON_GPU and T == 64:
        pytest.skip("interpreter: 64 tokens take minutes")   # the GPU runs them
    seed = fresh_seed()
    ex, z, w, ids = _case(E, L, I, k, T, seed)
    _poison_allocator()
    out = M.fused_moe_mxfp4(z, w, ids, ex)
    ref = M.moe_mxfp4_reference(z, w, ids, ex)
    assert out.shape == (T, L) and out.dtype == torch.float32
    assert torch.isfinite(out).all(), f"seed {seed}: unwritten (NaN) output"
    assert rel_err(out, ref) < REL_TOL, f"seed {seed}: rel err {rel_err(out, ref):.2e}"


@pytest.mark.parametrize("skew", [False, True])
def test_runs_group_every_pair_once(skew):
    seed = fresh_seed()
    gen = torch.Generator(device=DEV).manual_seed(seed)
    T, E, k = 37, 64, 8
    _, ids = _routing(T, E, k, gen, skew)
    pairs, sorted_e, run_start, num_runs, c_start, c_end, n_chunks = M.moe_runs(ids, E)
    P, flat = T * k, ids.reshape(-1).cpu()
    pairs, sorted_e = pairs.cpu().long(), sorted_e.cpu().long()
    n = int(num_runs)
    assert sorted(pairs.tolist()) == list(range(P)), f"seed {seed}"
    assert torch.equal(flat[pairs], sorted_e)                 # sorted_e[i] = expert of pair
    assert torch.equal(sorted_e, sorted_e.sort().values)      # grouped by expert
    assert n == flat.unique().numel()
    rs = run_start.cpu().long()[:n + 1].tolist()
    assert rs[0] == 0 and rs[-1] == P and rs == sorted(rs)
    for r in range(n):                                         # one expert per run
        assert sorted_e[rs[r]:rs[r + 1]].unique().numel() == 1
    # chunks: ≤ BLOCK_M consecutive pairs inside one run, covering every pair once, in order
    nc = int(n_chunks)
    cs, ce = c_start.cpu().long()[:nc].tolist(), c_end.cpu().long()[:nc].tolist()
    assert nc <= M.max_chunks(P, E) and cs[0] == 0 and ce[-1] == P
    assert all(ce[j] == cs[j + 1] for j in range(nc - 1))
    assert all(0 < ce[j] - cs[j] <= M.BLOCK_M for j in range(nc))
    assert all(sorted_e[cs[j]:ce[j]].unique().numel() == 1 for j in range(nc))
    assert nc == sum(-(-(rs[r + 1] - rs[r]) // M.BLOCK_M) for r in range(n))


@pytest.mark.parametrize("decode", list(M.DECODES))
def test_decodes_long_run_and_no_linear_beta(decode):
    """Every decode on a run longer than BLOCK_M (several chunks of one expert)."""
    seed = fresh_seed()
    ex, z, w, ids = _case(32, 128, 64, 4, 40, seed, skew=True, lin=None)
    cfg = M.MoEConfig(16, 64, 64, 64, decode=decode)
    _poison_allocator()
    out = M.fused_moe_mxfp4_triton(z, w, ids, ex, cfg)
    ref = M.moe_mxfp4_reference(z, w, ids, ex)
    assert torch.isfinite(out).all() and rel_err(out, ref) < REL_TOL, f"seed {seed}"


def _fp64(z, w, ids, ex):
    """Σ_k w · W2 SiTU(W1 z, W3 z) in fp64 with no intermediate rounding."""
    w1, w3, w2 = (t.double() for t in ex.dequantized(torch.float32))
    out = torch.zeros(z.shape, dtype=torch.float64, device=z.device)
    x = z.double()
    for t in range(z.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = w1[e] @ x[t], w3[e] @ x[t]
            a = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
            out[t] += float(w[t, j]) * (w2[e] @ a)
    return out


@pytest.mark.skipif(not ON_GPU, reason="the interpreter's bf16 truncation makes this moot")
def test_error_vs_fp64_is_the_references():
    seed = fresh_seed()
    ex, z, w, ids = _case(64, 512, 128, 8, 3, seed)
    ideal = _fp64(z, w, ids, ex)
    e_k = rel_err(M.fused_moe_mxfp4(z, w, ids, ex), ideal)
    e_r = rel_err(M.moe_mxfp4_reference(z, w, ids, ex), ideal)
    assert e_k <= 1.5 * e_r + 1e-3, f"seed {seed}: kernel {e_k:.2e} vs reference {e_r:.2e}"


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs")
def test_graph_capture_replays_new_routing():
    """One capture serves any routing: the grid never depends on the routing, no host sync."""
    seed = fresh_seed()
    E, L, I, k, T = 128, 256, 128, 8, 16
    ex, z, w, ids = _case(E, L, I, k, T, seed)
    fused = M.fused_moe_mxfp4
    fused(z, w, ids, ex)                           # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fused(z, w, ids, ex)
    for _ in range(2):
        gen = torch.Generator(device=DEV).manual_seed(fresh_seed())
        w2, ids2 = _routing(T, E, k, gen)
        z.copy_(torch.randn(T, L, generator=gen, device=DEV).to(torch.bfloat16))
        w.copy_(w2), ids.copy_(ids2)
        g.replay()
        torch.cuda.synchronize()
        ref = M.moe_mxfp4_reference(z, w, ids, ex)
        assert rel_err(out, ref) < REL_TOL, f"seed {seed}"


@pytest.mark.skipif(not ON_GPU, reason="the runs kernel on CUDA")
@pytest.mark.parametrize("T,k,skew", [(1, 16, False), (37, 8, True), (64, 16, False)])
def test_library_runs_equal_the_runs_kernel(T, k, skew):
    """moe_runs_torch (any pair count, nothing compiled) writes what the one-program kernel
    writes, wherever the GEMM kernels read."""
    seed = fresh_seed()
    E = 896
    _, ids = _routing(T, E, k, torch.Generator(device=DEV).manual_seed(seed), skew)
    a, b = M.moe_runs(ids, E), M.moe_runs_torch(ids, E)
    n, nc = int(a[3]), int(a[6])
    assert int(b[3]) == n and int(b[6]) == nc, f"seed {seed}"
    for x, y in zip(a[:2], b[:2]):
        assert torch.equal(x, y), f"seed {seed}"
    assert torch.equal(a[2][:n + 1], b[2][:n + 1]), f"seed {seed}"
    assert torch.equal(a[4][:nc], b[4][:nc]) and torch.equal(a[5][:nc], b[5][:nc])


@pytest.mark.skipif(not ON_GPU, reason="K3 shapes on CUDA")
def test_fused_past_the_runs_kernel_matches_reference():
    """1,500 tokens at top-16 (24,000 pairs: the one-program sort compiled for minutes there)
    go through moe_runs_torch and match the reference."""
    seed = fresh_seed()
    ex, z, w, ids = _case(896, 3584, 192, 16, 1500, seed)
    _poison_allocator()
    out = M.fused_moe_mxfp4(z, w, ids, ex)
    ref = M.moe_mxfp4_reference(z, w, ids, ex)
    assert torch.isfinite(out).all() and rel_err(out, ref) < REL_TOL, f"seed {seed}"


@pytest.mark.skipif(not ON_GPU, reason="K3 shapes on CUDA")
@pytest.mark.parametrize("E,L,I,k", K3_SHAPES)
@pytest.mark.parametrize("block_m", [None, 64, 128])
def test_prefill_chunks_match_reference(E, L, I, k, block_m):
    """A prefill step (200 tokens: 3,200 pairs ≥ PREFILL_PAIRS) on the prefill config, or with
    an explicit block_m; skewed routing puts 200 pairs on one expert (a run of several
    chunks)."""
    seed = fresh_seed()
    ex, z, w, ids = _case(E, L, I, k, 200, seed, skew=True)
    cfg = M.default_config(ids.numel(), E, I, L)
    assert cfg.block_m == 128 and cfg.swap_ab
    if block_m is not None:
        cfg = replace(cfg, block_m=block_m)
    _poison_allocator()
    out = M.fused_moe_mxfp4(z, w, ids, ex, cfg)
    ref = M.moe_mxfp4_reference(z, w, ids, ex)
    assert torch.isfinite(out).all(), f"seed {seed}: unwritten (NaN) output"
    assert rel_err(out, ref) < REL_TOL, f"seed {seed}: rel err {rel_err(out, ref):.2e}"


@pytest.mark.parametrize("block_m,bn,warps", [(64, 64, 4), (128, 64, 4), (256, 64, 8),
                                              (128, 128, 8)])
def test_swapped_operands_match_reference(block_m, bn, warps):
    """The swapped kernels (`swap_ab`: decoded tile as the register operand, `a` in sorted
    order) on skewed routing (one expert's run spans several chunks) and a partial last chunk
    per expert; GPU: K3 TP16 experts at 200 tokens, interpreter: a small shape."""
    seed = fresh_seed()
    E, L, I, k, T = (896, 3584, 192, 16, 200) if ON_GPU else (16, 128, 64, 4, 40)
    ex, z, w, ids = _case(E, L, I, k, T, seed, skew=True)
    cfg = M.MoEConfig(bn, 64, bn, 64, num_warps=warps, block_m=block_m, swap_ab=True)
    _poison_allocator()
    out = M.fused_moe_mxfp4_triton(z, w, ids, ex, cfg)
    ref = M.moe_mxfp4_reference(z, w, ids, ex)
    assert torch.isfinite(out).all(), f"seed {seed}: unwritten (NaN) output"
    assert rel_err(out, ref) < REL_TOL, f"seed {seed}: rel err {rel_err(out, ref):.2e}"


@pytest.mark.parametrize("swap", [False, True])
def test_tile_major_grid_and_out_block(swap):
    """`tile_major` (grid (tiles, chunks)) only reorders the programs: its output equals the
    chunk-major launch's bit for bit. `out`, a column block of a wider fp32 buffer (as
    models/moe.py `_reduce` passes it), gets the sum and the buffer's other columns are left
    alone; a wrong out is refused naming its dtype and shape."""
    seed = fresh_seed()
    E, L, I, k, T = (896, 3584, 192, 16, 200) if ON_GPU else (16, 128, 64, 4, 40)
    ex, z, w, ids = _case(E, L, I, k, T, seed, skew=True)
    cfg = (M.MoEConfig(64, 64, 64, 64, block_m=128, swap_ab=True) if swap
           else M.MoEConfig(64, 64, 64, 64, block_m=64))
    _poison_allocator()
    chunk_major = M.fused_moe_mxfp4_triton(z, w, ids, ex, cfg)
    buf = torch.full((T, L + 96), 7.0, device=z.device)
    out = M.fused_moe_mxfp4_triton(z, w, ids, ex, replace(cfg, tile_major=True),
                                   out=buf[:, :L])
    assert out.data_ptr() == buf.data_ptr()
    assert torch.equal(buf[:, :L], chunk_major), f"seed {seed}: tile-major differs"
    assert bool((buf[:, L:] == 7.0).all()), "columns past the block were written"
    ref = M.moe_mxfp4_reference(z, w, ids, ex)
    err = rel_err(chunk_major, ref)
    assert err < REL_TOL, f"seed {seed}: rel err {err:.2e}"
    with pytest.raises(ValueError, match="bfloat16"):
        M.fused_moe_mxfp4_triton(z, w, ids, ex, cfg, out=buf[:, :L].to(torch.bfloat16))


@pytest.mark.parametrize("block_m", [128, 256])
def test_split_gate_up_matches_the_two_accumulator_kernel(block_m):
    """`split_gate_up`: gate and up rows as separate tiles (one accumulator each) into a bf16
    (P, 2I) buffer, then the SiTU pass: the same rounding points as the two-accumulator
    kernel, so the interpreter gives the same bits and CUDA the reference's tolerance; every
    row written (poisoned allocator); it refuses the unswapped kernels."""
    seed = fresh_seed()
    E, L, I, k, T = (896, 3584, 192, 16, 200) if ON_GPU else (16, 128, 64, 4, 40)
    ex, z, w, ids = _case(E, L, I, k, T, seed, skew=True)
    cfg = M.MoEConfig(64, 64, 64, 64, num_warps=4, block_m=block_m, swap_ab=True,
                      tile_major=True)
    _poison_allocator()
    two = M.fused_moe_mxfp4_triton(z, w, ids, ex, cfg)
    one = M.fused_moe_mxfp4_triton(z, w, ids, ex, replace(cfg, split_gate_up=True))
    assert torch.isfinite(one).all(), f"seed {seed}: unwritten (NaN) output"
    if not ON_GPU:
        assert torch.equal(one, two), f"seed {seed}"
    ref = M.moe_mxfp4_reference(z, w, ids, ex)
    err = rel_err(one, ref)
    assert err < REL_TOL, f"seed {seed}: rel err {err:.2e}"
    with pytest.raises(ValueError, match="split_gate_up needs swap_ab"):
        M.fused_moe_mxfp4_triton(z, w, ids, ex, replace(cfg, swap_ab=False, block_m=64,
                                                          split_gate_up=True))


def test_swapped_operands_refuse_other_decodes():
    ex, z, w, ids = _case(16, 128, 64, 4, 4, 0)
    with pytest.raises(ValueError, match="decode 'pairs': expected one of .*'x2'.* swapped"):
        M.fused_moe_mxfp4_triton(z, w, ids, ex, M.MoEConfig(64, 64, 64, 64, decode="pairs",
                                                            swap_ab=True))
    with pytest.raises(ValueError, match="decode 'x2': expected one of .*'split'"):
        M.fused_moe_mxfp4_triton(z, w, ids, ex, M.MoEConfig(64, 64, 64, 64, decode="x2"))


if M.triton is not None:
    tl = M.tl

    @M.triton.jit
    def _both_decodes(w_ptr, s_ptr, ew_ptr, x2_ptr, K: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, ASM: tl.constexpr):
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        ok = rows >= 0
        for k0 in tl.static_range(0, K, BK):
            cols = k0 + tl.arange(0, BK)
            at = rows[:, None] * K + cols[None, :]
            tl.store(ew_ptr + at, M._dequant_tile(w_ptr, s_ptr, rows, ok, k0, K, BN, BK))
            tl.store(x2_ptr + at, M._dequant_tile_x2(w_ptr, s_ptr, rows, ok, k0, K, BN, BK,
                                                     ASM))


def test_x2_decode_equals_the_elementwise_one_on_every_code():
    """`_dequant_tile_x2` (8 codes per 32-bit word, bf16x2 arithmetic; on CUDA its inline asm,
    in the interpreter its emulation) gives the elementwise decode's tile and the reference's
    `unpack_mxfp4` bit for bit: every byte value (both nibbles, signs, e2m1's subnormal),
    scale bytes 64-240, fresh random rows."""
    from raydecode.models.mxfp4 import unpack_mxfp4
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    N, K, BN, BK = 64, 256, 16, 128
    w = torch.randint(0, 256, (N, K // 2), generator=gen, dtype=torch.uint8)
    w[:2] = torch.arange(256, dtype=torch.uint8).reshape(2, 128)
    s = torch.randint(64, 241, (N, K // 32), generator=gen, dtype=torch.uint8)
    s[0, 0], s[1, 1] = 64, 240
    w, s = w.to(DEV), s.to(DEV)
    ew = torch.full((N, K), float("nan"), dtype=torch.bfloat16, device=DEV)
    x2 = ew.clone()
    _both_decodes[(N // BN,)](w, s, ew, x2, K=K, BN=BN, BK=BK, ASM=ON_GPU)
    ref = unpack_mxfp4(w[None], s[None], torch.bfloat16)[0]
    assert torch.equal(ew, ref), f"seed {seed}: elementwise decode differs from unpack_mxfp4"
    bad = (x2.float() != ref.float()).nonzero()
    assert bad.numel() == 0, f"seed {seed}: x2 decode differs at {bad[:8].tolist()}: " \
        f"{x2[tuple(bad[0])].item()} against {ref[tuple(bad[0])].item()}"


@pytest.mark.parametrize("form", ["split", "blocked", "hybrid"])
def test_x2_decode_gives_the_same_expert_outputs(form, monkeypatch):
    """The split, blocked and hybrid kernels with decode "x2" (what `prefill_config` gives
    them: PREFILL_DECODE) return the elementwise decode's output bit for bit (the same weight
    tiles into the same dots), every row written (poisoned allocator); on CUDA at a K3 TP16
    prefill shape too."""
    seed = fresh_seed()
    shapes = [(16, 128, 64, 4, 200)] + ([(896, 3584, 192, 16, 2048)] if ON_GPU else [])
    for E, L, I, k, T in shapes:
        ex, z, w, ids = _case(E, L, I, k, T, seed)
        monkeypatch.setattr(M, "PREFILL_EXPERTS", form)
        x2 = M.prefill_config(L, I)
        base = replace(x2, decode="elementwise")
        assert x2.decode == "x2"
        _poison_allocator()
        out = M.fused_moe_mxfp4_triton(z, w, ids, ex, x2)
        assert torch.isfinite(out).all(), f"seed {seed}: unwritten (NaN) output"
        ref = M.fused_moe_mxfp4_triton(z, w, ids, ex, base)
        assert torch.equal(out, ref), \
            f"seed {seed} {form} {E}x{L}x{I}: x2 vs elementwise rel err {rel_err(out, ref):.2e}"


def _option_is_bit_equal(monkeypatch, form: str, option: dict, base_fields: dict,
                         lin: float | None = 25.0):
    """Asserts that `form`'s prefill config (PREFILL_EXPERTS = form) with `option` set returns
    its output with base_fields set bit for bit, every row written (poisoned allocator), on
    a small shape and, on CUDA, a K3 TP16 prefill shape; -> the last case's (z, w, ids,
    experts) for the caller's refusals."""
    seed = fresh_seed()
    shapes = [(16, 128, 64, 4, 200)] + ([(896, 3584, 192, 16, 2048)] if ON_GPU else [])
    for E, L, I, k, T in shapes:
        ex, z, w, ids = _case(E, L, I, k, T, seed, lin=lin)
        monkeypatch.setattr(M, "PREFILL_EXPERTS", form)
        base = replace(M.prefill_config(L, I, T * k, E), **base_fields)
        _poison_allocator()
        out = M.fused_moe_mxfp4_triton(z, w, ids, ex, replace(base, **option))
        assert torch.isfinite(out).all(), f"seed {seed}: unwritten (NaN) output"
        ref = M.fused_moe_mxfp4_triton(z, w, ids, ex, base)
        assert torch.equal(out, ref), (f"seed {seed} {form} {option} on {base_fields} lin={lin} "
                                       f"{E}x{L}x{I}: rel err {rel_err(out, ref):.2e}")
    return z, w, ids, ex


@pytest.mark.parametrize("form", ["split", "blocked", "hybrid"])
@pytest.mark.parametrize("decode", ["x2", "elementwise"])
def test_prefetched_scales_give_the_same_expert_outputs(form, decode, monkeypatch):
    """`prefetch_scales` (each k step's group scales loaded one step ahead) in the split,
    blocked and hybrid forms, on both decodes: the output equals the form's without it bit
    for bit (the same scales reach the same decode), every row written (poisoned allocator);
    the last k step's look-ahead (past the row's groups) is masked off: 1-2 k steps per GEMM
    here, 3 (down) and 28-56 (gate/up) at the K3 TP16 shape on CUDA. The fused swapped
    gate/up kernel refuses it by name."""
    z, w, ids, ex = _option_is_bit_equal(monkeypatch, form, dict(prefetch_scales=True),
                                         dict(decode=decode, prefetch_scales=False))
    fused = M.MoEConfig(64, 64, 64, 64, block_m=128, swap_ab=True, prefetch_scales=True)
    with pytest.raises(ValueError, match="prefetch_scales needs the blocked kernels"):
        M.fused_moe_mxfp4_triton(z, w, ids, ex, fused)


@pytest.mark.parametrize("form", ["blocked", "hybrid"])
@pytest.mark.parametrize("lin", [25.0, None])
def test_fused_situ_gives_the_same_expert_outputs(form, lin, monkeypatch):
    """`fuse_situ` (each blocked gate/up tile: BN / 2 gate rows and their up rows, stored as
    SiTU(gate, up) into `a`; no gu buffer, no SiTU pass) returns the unfused form's output
    bit for bit, with and without SiTU's linear clamp, every row written (poisoned
    allocator); on CUDA at a K3 TP16 prefill shape too. The unblocked forms refuse it, as
    does a tile whose half does not divide I."""
    z, w, ids, ex = _option_is_bit_equal(monkeypatch, form, dict(fuse_situ=True),
                                         dict(fuse_situ=False), lin=lin)
    with pytest.raises(ValueError, match="fuse_situ needs the blocked kernels"):
        M.fused_moe_mxfp4_triton(z, w, ids, ex, M.MoEConfig(64, 64, 64, 64, block_m=128,
                                                            swap_ab=True, fuse_situ=True))
    base = M.prefill_config(ex.latent, ex.intermediate, ids.numel(), ex.num_experts)
    with pytest.raises(ValueError, match="gate_up_bn 16 must be"):
        M.fused_moe_mxfp4_triton(z, w, ids, ex, replace(base, fuse_situ=True, gate_up_bn=16))


@pytest.mark.parametrize("warps", [0, 8])
def test_hybrid_down_at_bn128(warps, monkeypatch):
    """The hybrid form's swapped down kernel at BN 128 (auto's since the 24-layer step's A/B:
    half the output tiles per 128-pair chunk, so each chunk's `a` block is read from L2 half
    as often) on the gate/up's warps (0) and on 8: every row written (poisoned allocator),
    within 1e-3 of BN 64 (`auto+down_bn=64`: the same k order and rounding points; only
    the dots' M differs); on CUDA at a K3 TP16 prefill shape too."""
    seed = fresh_seed()
    shapes = [(16, 128, 64, 4, 200)] + ([(896, 3584, 192, 16, 2048)] if ON_GPU else [])
    monkeypatch.setattr(M, "PREFILL_EXPERTS", "hybrid")
    for E, L, I, k, T in shapes:
        ex, z, w, ids = _case(E, L, I, k, T, seed)
        shipped = M.prefill_config(L, I, T * k, E)
        assert shipped.blocked and not shipped.blocked_down and shipped.down_bn == 128
        _poison_allocator()
        out = M.fused_moe_mxfp4_triton(z, w, ids, ex, replace(shipped, down_warps=warps))
        assert torch.isfinite(out).all(), f"seed {seed}: unwritten (NaN) output"
        bn64 = M.fused_moe_mxfp4_triton(z, w, ids, ex, replace(shipped, down_bn=64))
        err = rel_err(out, bn64)
        assert err < 1e-3, f"seed {seed} {E}x{L}x{I}: BN 128 vs 64 rel err {err:.2e}"


def _counted_routing(counts: list[int], T: int, k: int, gen):
    """(weights, ids (T, k)) in which expert e gets counts[e] pairs, distinct experts per
    token (the sorted id list dealt column by column), rows shuffled."""
    assert sum(counts) == T * k and max(counts) <= T
    flat = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    ids = flat.reshape(k, T).t()
    ids = ids[torch.randperm(T, generator=torch.Generator().manual_seed(7))].contiguous()
    w = torch.rand(T, k, generator=gen, device=DEV) + 0.1
    return (w / w.sum(-1, keepdim=True)).float(), ids.to(DEV)


@pytest.mark.parametrize("block_m,blocked_down,down_tiles,down_bn",
                         [(64, True, 1, 64), (128, True, 1, 64), (256, True, 1, 64),
                          (256, False, 1, 64), (256, True, 2, 64), (128, True, 3, 64),
                          (256, True, 1, 128)])
def test_blocked_kernels_match_reference_every_class(block_m, blocked_down, down_tiles,
                                                     down_bn):
    """`blocked`: chunks of ≤ block_m pairs in 64-pair sub-blocks, each program running the
    body compiled for its chunk's sub-block count. Expert loads 1, 63, 64, 65, 128, 129, 150
    and 200 pairs give chunks of 1-4 sub-blocks (and split the 129-200 loads over two chunks
    at block_m 64/128); with blocked_down False the down kernel is the swapped one on its own
    128-pair chunks; down_tiles 2 / 3: one down program writes all of L = 128 (3: its third
    tile wholly past L, masked); down_bn 128 (the shipped blocked form's): one tile of all of
    L. Every output row written (poisoned allocator), within the reference's tolerance and
    within 1e-3 of the split kernels (the same rounding points; only the dots' widths
    differ)."""
    seed = fresh_seed()
    gen = torch.Generator(device=DEV).manual_seed(seed)
    E, L, I, k, T = 16, 128, 64, 4, 200
    counts = [0, 1, 63, 64, 65, 128, 129, 150, 200] + [0] * 7
    ex = M.MXFP4Experts.random(E, L, I, 4.0, 25.0, device=DEV, seed=seed).validate()
    z = torch.randn(T, L, generator=gen, device=DEV).to(torch.bfloat16)
    w, ids = _counted_routing(counts, T, k, gen)
    cfg = M.MoEConfig(64, 64, down_bn, 64, block_m=block_m, blocked=True,
                      blocked_down=blocked_down, down_tiles=down_tiles)
    _poison_allocator()
    out = M.fused_moe_mxfp4_triton(z, w, ids, ex, cfg)
    assert torch.isfinite(out).all(), f"seed {seed}: unwritten (NaN) output"
    ref = M.moe_mxfp4_reference(z, w, ids, ex)
    err = rel_err(out, ref)
    assert err < REL_TOL, f"seed {seed}: rel err {err:.2e}"
    split = M.MoEConfig(64, 64, 64, 64, block_m=128, swap_ab=True, split_gate_up=True)
    err = rel_err(out, M.fused_moe_mxfp4_triton(z, w, ids, ex, split))
    assert err < 1e-3, f"seed {seed}: blocked vs split rel err {err:.2e}"
    with pytest.raises(ValueError, match="blocked needs block_m"):
        M.fused_moe_mxfp4_triton(z, w, ids, ex, replace(cfg, block_m=32))
    with pytest.raises(ValueError, match="down_tiles must be ≥ 1, got 0"):
        M.fused_moe_mxfp4_triton(z, w, ids, ex, replace(cfg, down_tiles=0))


@pytest.mark.skipif(not ON_GPU, reason="K3 shapes on CUDA")
@pytest.mark.parametrize("tokens", [2048, 8192])
def test_blocked_kernels_k3_prefill_shape(tokens, monkeypatch):
    """The blocked kernels at a K3 TP16 prefill step's shape (balanced routing: ≈ 37 pairs per
    expert at 2,048 tokens, ≈ 146 at 8,192, where the shipped "auto" form takes its blocked
    gate/up: "hybrid") against the split kernels: within 1e-3 (the same rounding points)."""
    seed = fresh_seed()
    ex, z, w, ids = _case(896, 3584, 192, 16, tokens, seed)
    monkeypatch.setattr(M, "PREFILL_EXPERTS", "auto")
    P = tokens * 16
    cfg = M.default_config(P, 896, 192, 3584)
    assert cfg.blocked == (P > M.AUTO_BLOCKED_LOAD * 896) and not cfg.blocked_down
    monkeypatch.setattr(M, "PREFILL_EXPERTS", "blocked")
    cfg = M.prefill_config(3584, 192)                            # the blocked form
    assert cfg.blocked and cfg.blocked_down and cfg.down_bn == 128
    _poison_allocator()
    out = M.fused_moe_mxfp4_triton(z, w, ids, ex, cfg)
    assert torch.isfinite(out).all(), f"seed {seed}: unwritten (NaN) output"
    monkeypatch.setattr(M, "PREFILL_EXPERTS", "split")
    base = M.fused_moe_mxfp4_triton(z, w, ids, ex, M.prefill_config(3584, 192))
    err = rel_err(out, base)
    assert err < 1e-3, f"seed {seed}: blocked vs split rel err {err:.2e}"
