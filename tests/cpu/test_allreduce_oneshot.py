"""One-shot all-reduce (+ residual + RMSNorm) (kernels/allreduce_oneshot.py) without a GPU: the
references against independent computations over real torch.distributed gloo groups, the
adapter's routing over a gloo TorchComm (which calls reach the one-shot buffers, which go to the
base comm unchanged), the rank-order sum, close(), and the named input errors.

The plain all-reduce kernel runs here only under the Triton interpreter, on simulated ranks
(`TRITON_INTERPRET=1 python -m pytest
tests/cpu/test_allreduce_oneshot.py -q`); without Triton (the CI venv) those cases skip and the
routing test checks that the one-shot calls reach the kernel launcher (which then names the
missing Triton). The compiled kernel and the real IPC protocol: tests/gpu/test_allreduce_oneshot.py.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from raydecode.kernels import allreduce_oneshot as AR
from raydecode.kernels import allreduce_oneshot_triton as ART
from raydecode.models.parallel import LocalComm, Parallel, TorchComm

from _numerics import fresh_seed

from _net import free_port

torch.set_num_threads(1)
BF = torch.bfloat16
EPS = 1e-6
INTERPRET = ART.triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
UNSET = 1 << 40                     # a preset flag ≥ any epoch: a simulated rank never waits


class RecordingComm(TorchComm):
    """The real gloo TorchComm, recording (shape, dtype) of each all_reduce it serves."""

    def __init__(self, par: Parallel):
        super().__init__(par)
        self.reduced: list[tuple[tuple[int, ...], torch.dtype]] = []

    def all_reduce(self, x):
        self.reduced.append((tuple(x.shape), x.dtype))
        return super().all_reduce(x)


def _sim_prefill(pbs, r: int, rows) -> None:
    """Before simulated rank r of `pbs` (PeerBuffers.local_group) calls the kernel: the rows the
    other ranks' kernels copy are written into their slots, rank r's own slot is NaN (its kernel
    must copy it). rows: every rank's (T, H) input."""
    e, T = int(pbs[r].state[0]) + 1, rows[r].shape[0]
    for q, p in enumerate(pbs):
        p.buffer[e & 1, :T] = float("nan") if q == r else rows[q]


def _sim_epoch(pbs, xs, outs):
    """Every simulated rank runs PeerBuffers.all_reduce(xs[r], out=outs[r]) once, in rank
    order; the flags are preset so no wait blocks (the kernels publish e over them)."""
    for p in pbs:
        p.flags.fill_(UNSET)
    res = []
    for r, pb in enumerate(pbs):
        _sim_prefill(pbs, r, xs)
        res.append(pb.all_reduce(xs[r], out=None if outs is None else outs[r]))
    return res


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


def test_plain_reference_sums_in_rank_order_and_rounds_once():
    H = 8
    big, one = torch.full((1, H), 2.0 ** 30).to(BF), torch.ones(1, H, dtype=BF)
    assert torch.equal(AR.allreduce_reference([big, one, -big]), torch.zeros(1, H, dtype=BF))
    assert torch.equal(AR.allreduce_reference([big, -big, one]), one)
    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(4, 96, generator=g).to(BF) for _ in range(5)]
    got = AR.allreduce_reference(parts)
    exact = sum(p.double() for p in parts)           # fp64: exact for 5 bf16 addends
    assert got.dtype == BF and float(_ulps(got, exact.to(BF)).max()) <= 1.0


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


def test_close_is_idempotent_and_later_calls_name_the_state():
    pbs = AR.PeerBuffers.local_group(2, 4, 32, "cpu")
    x = torch.randn(2, 32).to(BF)
    pbs[0].close()
    pbs[0].close()                                   # idempotent
    assert pbs[0].closed and pbs[0].buffer is None and pbs[0].buf_addrs is None
    for call in (lambda: pbs[0].all_reduce(x), lambda: pbs[0].next_input_slot_sync(2),
                 lambda: pbs[0].all_reduce_residual_norm(x, x, None, EPS),
                 pbs[0].check_timeouts):
        with pytest.raises(RuntimeError, match="rank 0 of 2 are closed"):
            call()
    assert pbs[1].next_input_slot_sync(2).shape == (2, 32)   # the other rank is still open
    comm = AR.OneShotComm(LocalComm(), peers=pbs[1], world=2, max_tokens=4, hidden=32)
    assert comm.dcp_group is None
    comm.close()
    comm.close()
    assert comm.closed and pbs[1].closed
    for call in (lambda: comm.all_reduce(x), lambda: comm.all_gather(x),
                 lambda: comm.dcp_all_gather(x),
                 lambda: comm.all_reduce_residual_norm(x, x, None, EPS)):
        with pytest.raises(RuntimeError, match="OneShotComm is closed"):
            call()


def test_unconnected_comm_routes_everything_to_base():
    comm = AR.OneShotComm.wrap(LocalComm())
    x = torch.randn(3, 16).to(BF)
    assert comm.world == 1 and comm.all_reduce(x) is x and comm.all_gather(x) is x
    with pytest.raises(RuntimeError, match="not connected"):
        comm.all_reduce_residual_norm(x, x, None, EPS)
    comm.connect(4, 16, "cpu")
    with pytest.raises(RuntimeError, match="already connected"):
        comm.connect(4, 16, "cpu")
    new, _ = comm.all_reduce_residual_norm(x, x, None, EPS)
    assert torch.equal(new, AR.allreduce_residual_norm_reference([x], x, None, EPS)[0])


@pytest.mark.skipif(not INTERPRET, reason="the kernel: Triton + TRITON_INTERPRET=1")
@pytest.mark.parametrize("world,T,H", [(2, 1, 64), (3, 3, 40), (4, 2, 36)])  # 36, 40: unaligned
def test_sim_all_reduce_matches_reference(world, T, H):
    """Simulated ranks, kernel under the interpreter. Epoch 1: values k/8, |k| < 32, whose
    sums are exact in bf16, plus a rank-order column (2^30, −2^30, 0…, 1 → 1; any other order
    → 0): bit-exact even though the interpreter truncates instead of rounding. Epochs 2, 3:
    normal values, ≤ 1 ulp (truncation), out allocated by the call at epoch 3."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    pbs = AR.PeerBuffers.local_group(world, 4, H, "cpu")
    for e in (1, 2, 3):
        if e == 1:
            xs = [torch.randint(-31, 32, (T, H), generator=g) / 8 for _ in range(world)]
            if world >= 3:
                xs[0][:, 0], xs[1][:, 0], xs[-1][:, 0] = 2.0 ** 30, -2.0 ** 30, 1.0
                for x in xs[2:-1]:
                    x[:, 0] = 0.0
        else:
            xs = [torch.randn(T, H, generator=g) for _ in range(world)]
        xs = [x.to(BF) for x in xs]
        outs = [torch.full((T, H), float("nan"), dtype=BF) for _ in range(world)]
        ys = _sim_epoch(pbs, xs, None if e == 3 else outs)
        ref, msg = AR.allreduce_reference(xs), f"seed {seed} epoch {e}"
        for r, y in enumerate(ys):
            assert e == 3 or y is outs[r], msg
            if e == 1:
                assert torch.equal(y, ref), f"{msg} rank {r}"
            else:
                assert float(_ulps(y, ref).max()) <= 1.0, f"{msg} rank {r}"
            assert torch.equal(y, ys[0]), f"{msg}: rank {r} differs from rank 0"
        for p, pb in enumerate(pbs):
            assert pb.state.tolist()[:3] == [e, 0, 0], f"{msg}: epoch/arrivals/timeout"
            want = torch.full((world, 4), UNSET, dtype=torch.int64)
            want[:, :T] = e                          # every rank r published rows < T into p
            assert torch.equal(pb.flags, want), f"{msg}: flags of rank {p}"
            assert torch.equal(pb.buffer[e & 1, :T], xs[p]), f"{msg}: slot {e & 1} of {p}"


def _ss_bits(x: torch.Tensor) -> torch.Tensor:
    """(…, HS) bf16 -> the int64 word the two-shot kernel pushes: fp32 bits of Σ fp32(x)²."""
    return x.float().square().sum(-1).view(torch.int32).to(torch.int64)


@pytest.mark.skipif(not INTERPRET, reason="the kernel: Triton + TRITON_INTERPRET=1")
@pytest.mark.parametrize("world,T,H", [(2, 3, 64), (4, 2, 48), (3, 1, 24)])  # 24/3: unaligned
def test_sim_two_shot_matches_reference_and_pushes_its_slice(world, T, H):
    """Simulated ranks, two-shot kernel under the interpreter, one rank at a time: before
    rank r's call its peers' partials are in their slots, every flag is preset (no wait
    blocks), and its gather row holds the peers' reduced slices and their sums of squares
    (what their kernels push); its own slice is NaN. Epoch 1 uses exact values (k/8: sums
    exact even under the interpreter's truncation); epochs 2, 3 normal values. Checks: new
    residual = the reference (bit-exact at epoch 1, ≤ 1 ulp after), the norm ≤ 2 ulps, the
    same as the one-shot's spec; rank r pushed its slice and its sum of squares into every
    rank's gather row and aux lane r, and flags2[r, :T] = e everywhere."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    pbs = AR.PeerBuffers.local_group(world, 4, H, "cpu")
    assert all(pb.gather is not None for pb in pbs)
    HS = H // world
    for e in (1, 2, 3):
        if e == 1:
            xs = [(torch.randint(-31, 32, (T, H), generator=g) / 8).to(BF) for _ in range(world)]
            res = (torch.randint(-31, 32, (T, H), generator=g) / 8).to(BF)
        else:
            xs = [torch.randn(T, H, generator=g).to(BF) for _ in range(world)]
            res = (2 * torch.randn(T, H, generator=g)).to(BF)
        w = 1 + 0.1 * torch.randn(H, generator=g)
        ref_new, ref_norm = AR.allreduce_residual_norm_reference(xs, res, w, EPS)
        s, msg = e & 1, f"seed {seed} epoch {e}"
        for r, pb in enumerate(pbs):
            for p in pbs:
                p.flags.fill_(UNSET)
                p.flags2.fill_(UNSET)
            _sim_prefill(pbs, r, xs)
            pb.gather[s, :T] = ref_new
            pb.gather[s, :T, r * HS:(r + 1) * HS] = float("nan")
            for q in range(world):
                pb.aux[s, :T, q] = -1 if q == r else _ss_bits(ref_new[:, q * HS:(q + 1) * HS])
            new, normed = pb.all_reduce_residual_norm(xs[r], res, w, EPS, two_shot=True)
            m = f"{msg} rank {r}"
            if e == 1:
                assert torch.equal(new, ref_new), m
            else:
                assert float(_ulps(new, ref_new).max()) <= 1.0, m
            assert float(_ulps(normed, ref_norm).max()) <= 2.0, m
            mine = new[:, r * HS:(r + 1) * HS]
            for q, p in enumerate(pbs):
                assert torch.equal(p.gather[s, :T, r * HS:(r + 1) * HS], mine), f"{m} -> {q}"
                got = p.aux[s, :T, r].to(torch.int32).view(torch.float32)
                assert torch.allclose(got, mine.float().square().sum(-1), rtol=1e-5), m
                assert torch.equal(p.flags2[r, :T], torch.full((T,), e)), f"{m}: flags2 of {q}"
            assert pb.state.tolist()[:3] == [e, 0, 0], f"{m}: epoch/arrivals/timeout"


def test_two_shot_form_choice_and_limits():
    """`uses_two_shot`: from two_shot_min_tokens rows; forced either way; buffers without the
    two-shot form (a hidden size the world does not divide, or raw buffers) name why."""
    pbs = AR.PeerBuffers.local_group(2, 64, 32, "cpu")
    pb = pbs[0]
    assert pb.two_shot_min_tokens == 32
    assert not pb.uses_two_shot(31) and pb.uses_two_shot(32) and pb.uses_two_shot(64)
    assert pb.uses_two_shot(1, True) and not pb.uses_two_shot(64, False)
    odd = AR.PeerBuffers.local_group(3, 4, 32, "cpu")[0]            # 32 % 3 != 0
    assert odd.gather is None and not odd.uses_two_shot(4)
    with pytest.raises(ValueError, match="two_shot=True.*hidden 32 over 3 ranks"):
        odd.uses_two_shot(4, True)


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
        _routing(rank, world, seed, H)
    finally:
        dist.destroy_process_group()


def _routing(rank: int, world: int, seed: int, H: int) -> None:
    """OneShotComm over a gloo RecordingComm with this rank's simulated one-shot buffers
    (PeerBuffers.local_group in this process, the other ranks' rows prefilled): bf16
    (…, H) tensors of 1..max_tokens rows reach the kernel, the rest reach gloo unchanged."""
    import torch.distributed as dist

    MT = 8
    pbs = AR.PeerBuffers.local_group(world, MT, H, "cpu")
    base = RecordingComm(Parallel(rank, world))
    comm = AR.OneShotComm(base, None, pbs[rank], world=world, max_tokens=MT, hidden=H)
    assert comm.par == Parallel(rank, world) and comm.dcp_group is None
    kernel = ART.available(torch.zeros(1))          # Triton under TRITON_INTERPRET=1
    g = torch.Generator().manual_seed(seed + 7)
    for shape in ((3, H), (2, 2, H), (H,), (MT, H)):   # (…, H) with 1..MT rows
        xs = [t.to(BF) for t in torch.randn(world, *shape, generator=g)]
        pbs[rank].flags.fill_(UNSET)
        _sim_prefill(pbs, rank, [x.reshape(-1, H) for x in xs])
        msg = f"seed {seed} rank {rank} shape {shape}"
        if not kernel:                               # routed to the kernel, which needs Triton
            with pytest.raises(RuntimeError, match="needs Triton"):
                comm.all_reduce(xs[rank])
            continue
        y = comm.all_reduce(xs[rank])
        assert y.shape == xs[rank].shape, msg
        assert float(_ulps(y, AR.allreduce_reference(xs)).max()) <= 1.0, msg
        every = [torch.empty_like(y.view(torch.uint8)) for _ in range(world)]
        dist.all_gather(every, y.contiguous().view(torch.uint8))
        assert all(torch.equal(t, every[0]) for t in every), f"{msg}: ranks differ"
    assert base.reduced == [] and int(pbs[rank].state[0]) == (4 if kernel else 0)
    others = [torch.randn(3, H, generator=g),                      # fp32 (MoE latents)
              torch.randn(3, H // 2, generator=g).to(BF),          # another width
              torch.randn(MT + 1, H, generator=g).to(BF),          # more rows than MT
              torch.randn(2, H, generator=g).to(torch.float16)]    # another 16-bit dtype
    for x in others:
        x = x * (rank + 1)
        want = x.clone()
        dist.all_reduce(want)
        assert torch.equal(comm.all_reduce(x), want), f"seed {seed} rank {rank} {x.shape}"
    assert base.reduced == [(tuple(x.shape), x.dtype) for x in others]
    assert int(pbs[rank].state[0]) == (4 if kernel else 0), "no epoch for the base calls"
    z = torch.randn(2, 5, generator=g)
    assert torch.equal(comm.all_gather(z), base.all_gather(z))
    assert torch.equal(comm.dcp_all_gather(z), z)                  # DCP size 1
    comm.close()
    with pytest.raises(RuntimeError, match="closed"):
        comm.all_reduce(z)
    # the collective close (what `create`d buffers run): its two barriers over the real group
    bufs = [torch.zeros(2, 2, 8, dtype=BF) for _ in range(world)]
    flags = [torch.zeros(world, 2, dtype=torch.int64) for _ in range(world)]
    pb = AR.PeerBuffers(rank, bufs, flags, torch.zeros(4, dtype=torch.int64), 2, 8,
                        collective=True)
    pb.close()
    pb.close()                                       # idempotent
    assert pb.closed and pb.buffer is None and pb.buf_addrs is None
    dist.barrier()


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_group_matches_reference(world):
    seed = fresh_seed()
    mp.spawn(_gloo_worker, args=(world, free_port(), seed), nprocs=world, join=True)
