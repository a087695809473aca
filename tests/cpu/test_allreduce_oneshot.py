"""One-shot all-reduce + residual + RMSNorm (kernels/allreduce_oneshot.py) without a GPU: the
reference against an independent computation over real torch.distributed gloo groups, the
fallback adapter over gloo, the rank-order sum, and the named input errors. The kernel itself is
tested in tests/gpu/test_allreduce_oneshot.py."""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from raydecode.kernels import allreduce_oneshot as AR
from raydecode.models.parallel import LocalComm, Parallel, TorchComm

from _net import free_port

torch.set_num_threads(1)
BF = torch.bfloat16
EPS = 1e-6


def _inputs(world: int, T: int, H: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    partials = [torch.randn(T, H, generator=g).to(BF) for _ in range(world)]
    residual = (4 * torch.randn(T, H, generator=g)).to(BF)
    w = 1 + 0.1 * torch.randn(H, generator=g)
    return partials, residual, w


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a − b| in units of b's bf16 ulp (elementwise)."""
    ulp = torch.finfo(BF).eps * b.float().abs().clamp_min(torch.finfo(BF).tiny)
    return (a.float() - b.float()).abs() / ulp


def test_reference_sums_in_rank_order():
    """fp32: (2^30 + 1) − 2^30 = 0 but (2^30 − 2^30) + 1 = 1; the spec is rank order."""
    H = 8
    big, one = torch.full((1, H), 2.0 ** 30).to(BF), torch.ones(1, H, dtype=BF)
    residual = torch.full((1, H), 0.5, dtype=BF)
    r_order, _ = AR.allreduce_residual_norm_reference([big, one, -big], residual, None, EPS)
    other, _ = AR.allreduce_residual_norm_reference([big, -big, one], residual, None, EPS)
    assert torch.equal(r_order, residual)                 # the 1 was absorbed by 2^30
    assert torch.equal(other, torch.full((1, H), 1.5, dtype=BF))


def test_reference_norm_is_rmsnorm_of_the_rounded_sum():
    partials, residual, w = _inputs(3, 5, 96, seed=1)
    new, normed = AR.allreduce_residual_norm_reference(partials, residual, w, EPS)
    exact = sum(p.double() for p in partials) + residual.double()
    assert float(_ulps(new, exact.to(BF)).max()) <= 1.0
    # RMSNorm computed independently in fp64 from the ROUNDED new residual
    x = new.double()
    want = x / torch.sqrt(x.square().mean(-1, keepdim=True) + EPS) * w.double()
    assert float(_ulps(normed, want).max()) <= 1.0
    assert normed.dtype == BF and new.dtype == BF
    assert AR.allreduce_residual_norm_reference(partials, residual, None, EPS)[1] is None


def test_bad_inputs_are_named():
    comm = AR.OneShotComm(LocalComm(), world=1, max_tokens=4, hidden=16)
    x = torch.randn(2, 16).to(BF)
    w = torch.ones(16)
    with pytest.raises(ValueError, match="5 token rows.*1..4"):
        comm.all_reduce_residual_norm(torch.zeros(5, 16, dtype=BF), torch.zeros(5, 16, dtype=BF),
                                      w, EPS)
    with pytest.raises(ValueError, match="hidden size 12.*16"):
        comm.all_reduce_residual_norm(x[:, :12], x[:, :12], w[:12], EPS)
    with pytest.raises(ValueError, match="partial dtype torch.float32"):
        comm.all_reduce_residual_norm(x.float(), x, w, EPS)
    with pytest.raises(ValueError, match=r"partial of shape \(1, 16\)"):
        comm.all_reduce_residual_norm(x[:1], x, w, EPS)
    with pytest.raises(ValueError, match=r"RMSNorm weight of shape \(15,\)"):
        comm.all_reduce_residual_norm(x, x, w[:15], EPS)
    with pytest.raises(ValueError, match=r"residual of shape \(16,\)"):
        comm.all_reduce_residual_norm(x[0], x[0], w, EPS)
    with pytest.raises(ValueError, match="max_tokens=0"):
        AR.PeerBuffers.local_group(2, 0, 16, "cpu")
    with pytest.raises(ValueError, match="need a CUDA device"):
        AR.PeerBuffers.create(None, 4, 16, "cpu")


def test_world_one_is_the_reference():
    partials, residual, w = _inputs(1, 3, 32, seed=2)
    comm = AR.OneShotComm(LocalComm(), world=1, max_tokens=4, hidden=32)
    new, normed = comm.all_reduce_residual_norm(partials[0], residual, w, EPS)
    rn, rh = AR.allreduce_residual_norm_reference(partials, residual, w, EPS)
    assert torch.equal(new, rn) and torch.equal(normed, rh)
    assert comm.all_reduce(partials[0]) is partials[0]     # the base comm's collectives


def test_p2p_capability_rules():
    a = AR.DeviceInfo("node-a", "uuid-0", 0)
    assert AR.p2p_capable(a, AR.DeviceInfo("node-a", "uuid-0", 0))     # same GPU
    assert not AR.p2p_capable(a, AR.DeviceInfo("node-b", "uuid-0", 0))  # other host
    assert not AR.p2p_capable(a, AR.DeviceInfo("node-a", "", -1))       # a CPU rank
    assert AR.device_info(torch.device("cpu")).uuid == ""


def _gloo_worker(rank: int, world: int, port: int, seed: int):
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        T, H = 4, 256
        partials, residual, w = _inputs(world, T, H, seed)
        ref_new, ref_normed = AR.allreduce_residual_norm_reference(partials, residual, w, EPS)
        # independent: gloo all_reduce of fp32 partials (its own order), manual norm in fp64
        s = partials[rank].float()
        dist.all_reduce(s)
        ind_new = (s + residual.float()).to(BF)
        x = ind_new.double()
        ind_normed = x / torch.sqrt(x.square().mean(-1, keepdim=True) + EPS) * w.double()
        assert float(_ulps(ref_new, ind_new).max()) <= 1.0, f"seed {seed} rank {rank}"
        assert float((ref_new != ind_new).float().mean()) < 0.02, f"seed {seed}"
        assert float(_ulps(ref_normed, ind_normed).max()) <= 2.0, f"seed {seed} rank {rank}"
        # the adapter over gloo: CPU ranks -> the all-gather fallback, bit-exact to the spec
        comm = AR.OneShotComm.create(TorchComm(Parallel(rank, world)), None, max_tokens=8,
                                     hidden=H, device="cpu")
        assert comm.peers is None and comm.world == world
        new, normed = comm.all_reduce_residual_norm(partials[rank], residual, w, EPS)
        assert torch.equal(new, ref_new) and torch.equal(normed, ref_normed), f"seed {seed}"
        # identical on every rank, bit for bit
        got = [torch.empty_like(normed.view(torch.uint8)) for _ in range(world)]
        dist.all_gather(got, normed.view(torch.uint8))
        assert all(torch.equal(g, got[0]) for g in got)
        if world >= 3:   # rank order through the real transport: 2^30, 1, 0…, −2^30
            big = torch.full((1, H), 2.0 ** 30)
            mine = [big, torch.ones(1, H)] + [torch.zeros(1, H)] * (world - 3) + [-big]
            half = torch.full((1, H), 0.5, dtype=BF)
            new, _ = comm.all_reduce_residual_norm(mine[rank].to(BF), half, None, EPS)
            assert torch.equal(new, half)                 # not 1.5: the 1 was absorbed
        # the wrapped comm still serves plain collectives
        assert torch.equal(comm.all_reduce(torch.ones(3)), torch.full((3,), float(world)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_group_matches_reference(world):
    seed = int.from_bytes(os.urandom(4), "little") % (1 << 31)
    mp.spawn(_gloo_worker, args=(world, free_port(), seed), nprocs=world, join=True)
