"""One-shot all-reduce + residual + RMSNorm kernel (kernels/allreduce_oneshot_triton.py) vs the
reference (kernels/allreduce_oneshot.py).

(i)   N simulated ranks in ONE process (N buffers on one device, flags preset so no wait
      blocks, the kernel run once per rank index): the one-shot's math, the slot parity, the
      flag cells each rank publishes, the device epoch, the timeout path (both forms; the
      two-shot's simulated protocol: tests/cpu/test_allreduce_oneshot.py). CPU under the interpreter
      (`TRITON_INTERPRET=1 python -m pytest tests/gpu/test_allreduce_oneshot.py -q`, small
      shapes) or compiled on one GPU (adds the K3 shapes: H = 7168, TP8 and TP16 ranks).
(ii)  2 processes on ONE GPU, CUDA IPC between them, the real protocol (the two contexts are
      time-sliced, so waits are long but finite) over several epochs with fresh inputs, both
      the copy and the in-place producer form, then a CUDA graph captured once and replayed
      with new inputs.
(iii) the same on 2 GPUs (real NVLink P2P), skipped with fewer than 2 peer-capable GPUs.
      (ii) and (iii) interleave the plain all-reduce (no residual, no norm) with the fused
      calls, and each fused call with the other form (two-shot from 32 rows, kernels/
      allreduce_twoshot_triton.py; they share the epochs: same new_residual bits) and end with the collective PeerBuffers.close().
(iv)  OneShotComm over a NCCL TorchComm on 2 GPUs: one rank disabling it turns it off on all;
      bf16 (…, H) all-reduces of 1..64 rows take the kernel and equal the reference bit for bit
      on every rank, fp32 / other widths / more rows go to NCCL and equal dist.all_reduce,
      eagerly and in a CUDA graph; then close().
(v)   actors/rank_worker.py's wiring: 2 RankWorkers (gloo, both on GPU 0, the rendezvous store
      in the test process) build the tiny bf16 model; the comm the model holds is a connected
      OneShotComm (hidden from the model's config), serves a one-shot call, and shutdown()
      closes it.
Every multi-process case runs under a wall-clock limit (the processes are killed past it), and
a rank that dies by a signal (e.g. SIGSEGV at teardown) fails the test.

Fresh random inputs, seed in every message; outputs start as NaN. Tolerances: new_residual is
bit-exact compiled (fp32 adds in rank order, one rounding, like the reference), ≤ 1 bf16 ulp
under the interpreter (it truncates fp32 → bf16); normed ≤ TOL_NORM relative (reduction order
of Σx² and rsqrt; looser under the interpreter). Across ranks the outputs are compared bit for bit.
"""
from __future__ import annotations

import os

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from raydecode.kernels import allreduce_oneshot as AR  # noqa: E402
from raydecode.kernels import allreduce_oneshot_triton as ART  # noqa: E402
from raydecode.models.parallel import Parallel, TorchComm  # noqa: E402

from _numerics import fresh_seed, rel_err

INTERPRET = ART.triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
COMPILED = ART.triton is not None and torch.cuda.is_available() and not INTERPRET
SIM_DEV = "cpu" if INTERPRET else "cuda"    # the interpreter needs host addresses
pytestmark = pytest.mark.skipif(not (INTERPRET or COMPILED),
                                reason="needs CUDA + Triton, or TRITON_INTERPRET=1")
BF = torch.bfloat16
EPS = 1e-6
# ‖normed − ref‖ / ‖ref‖: one bf16 rounding ≈ eps/√12 = 2.3e-3 rms; the interpreter truncates
# (≈ eps/√3 = 4.5e-3 rms), new_residual and normed both
TOL_NORM = 1e-2 if INTERPRET else 4e-3
TOL_OWN_NORM = 6e-3 if INTERPRET else 4e-3   # normed vs RMSNorm of the kernel's own new_residual
MP_TIMEOUT_S = 300


def _max_ulps(a, b) -> float:
    ulp = torch.finfo(BF).eps * b.float().abs().clamp_min(torch.finfo(BF).tiny)
    return float(((a.float() - b.float()).abs() / ulp).max())


def _case(world, T, H, seed, dev):
    """Fresh partials (column 0 adversarial for the rank order when world ≥ 3), residual, w."""
    g = torch.Generator().manual_seed(seed)
    partials = [torch.randn(T, H, generator=g) for _ in range(world)]
    if world >= 3:    # fp32 in rank order: 2^30 − 2^30 + 0… + 1 = 1; reversed or rotated: 0
        partials[0][:, 0], partials[1][:, 0], partials[-1][:, 0] = 2.0 ** 30, -2.0 ** 30, 1.0
        for p in partials[2:-1]:
            p[:, 0] = 0.0
    residual = 4 * torch.randn(T, H, generator=g)
    w = 1 + 0.1 * torch.randn(H, generator=g)
    return ([p.to(BF).to(dev) for p in partials], residual.to(BF).to(dev), w.to(dev))


def _nan(T, H, dev):
    return torch.full((T, H), float("nan"), dtype=BF, device=dev)


def _check_new(new, ref, msg):
    if INTERPRET:
        assert _max_ulps(new, ref) <= 1.0, msg
    else:
        assert torch.equal(new, ref), msg


# ---- (i) simulated ranks in one process -----------------------------------------------------

SIM_SMALL = [(2, 1, 64), (3, 3, 40), (4, 2, 36)]             # H = 36: the unaligned path
SIM_K3 = [(8, 1, 7168), (8, 4, 7168), (8, 64, 7168), (16, 2, 7168), (16, 64, 7168)]


@pytest.mark.parametrize("world,T,H", SIM_SMALL + [pytest.param(
    *s, marks=pytest.mark.skipif(not COMPILED, reason="K3 shapes: compiled only (slow in "
                                                      "the interpreter)")) for s in SIM_K3])
def test_simulated_ranks(world, T, H):
    seed = fresh_seed()
    MT = max(T, 4)
    pbs = AR.PeerBuffers.local_group(world, MT, H, SIM_DEV)
    unset = 1 << 40                                  # ≥ any epoch: no wait blocks
    for e in (1, 2, 3):                              # epochs: slots 1, 0, 1
        partials, residual, w = _case(world, T, H, seed + e, SIM_DEV)
        ref_new, ref_h = AR.allreduce_residual_norm_reference(partials, residual, w, EPS)
        copy = e != 2                                # e = 2: the producer wrote in place
        for q, pb in enumerate(pbs):
            pb.flags.fill_(unset)
            pb.buffer.fill_(float("nan"))
            if not copy:
                pb.next_input_slot_sync(T).copy_(partials[q])
        outs = []
        for r, pb in enumerate(pbs):
            later = range(r + 1, world) if copy else ()
            for q in later:          # ranks that have not run yet: their copy, simulated
                pbs[q].buffer[e & 1, :T] = partials[q]
            res = residual.clone()
            new = res if e == 3 else _nan(T, H, SIM_DEV)        # e = 3: residual in place
            h = _nan(T, H, SIM_DEV)
            pb.all_reduce_residual_norm(partials[r] if copy else None, res, w, EPS,
                                        new_residual=new, out=h, two_shot=False)
            outs.append((new, h))
            for q in later:          # NaN again: each rank's own kernel must copy its rows
                pbs[q].buffer[e & 1, :T] = float("nan")
        msg = f"seed {seed} epoch {e}"
        for r, (new, h) in enumerate(outs):
            _check_new(new, ref_new, f"{msg} rank {r}")
            assert rel_err(h, ref_h) <= TOL_NORM, f"{msg} rank {r}: {rel_err(h, ref_h)}"
            own = AR.rms_norm_reference(new, w, EPS)         # the norm of ITS new residual
            assert rel_err(h, own) <= TOL_OWN_NORM, f"{msg} rank {r}: {rel_err(h, own)}"
            assert torch.equal(new, outs[0][0]) and torch.equal(h, outs[0][1]), \
                f"{msg}: rank {r} differs from rank 0"
        for p, pb in enumerate(pbs):
            assert pb.state.tolist()[:3] == [e, 0, 0], f"{msg}: epoch/arrivals/timeout"
            want = torch.full((world, MT), unset, dtype=torch.int64)
            want[:, :T] = e                          # every rank r published rows < T into p
            assert torch.equal(pb.flags.cpu(), want), f"{msg}: flags of rank {p}"
            assert torch.equal(pb.buffer[e & 1, :T], partials[p]), f"{msg}: slot {e & 1}"


@pytest.mark.parametrize("world,T,H", SIM_SMALL + [pytest.param(
    *s, marks=pytest.mark.skipif(not COMPILED, reason="K3 shapes: compiled only (slow in "
                                                      "the interpreter)")) for s in SIM_K3])
def test_simulated_ranks_plain_all_reduce(world, T, H):
    """PeerBuffers.all_reduce (no residual, no norm) on simulated ranks, two epochs (both
    slots), NaN-poisoned outputs; the sum in rank order (column 0 adversarial when world ≥ 3)."""
    seed = fresh_seed()
    MT = max(T, 4)
    pbs = AR.PeerBuffers.local_group(world, MT, H, SIM_DEV)
    for e in (1, 2):
        partials, _, _ = _case(world, T, H, seed + e, SIM_DEV)
        ref = AR.allreduce_reference(partials)
        for pb in pbs:
            pb.flags.fill_(1 << 40)                  # ≥ any epoch: no wait blocks
        outs = []
        for r, pb in enumerate(pbs):
            for q, other in enumerate(pbs):          # the others' copies, simulated; own NaN
                other.buffer[e & 1, :T] = float("nan") if q == r else partials[q]
            outs.append(pb.all_reduce(partials[r], out=_nan(T, H, SIM_DEV), two_shot=False))
        msg = f"seed {seed} epoch {e}"
        for r, y in enumerate(outs):
            _check_new(y, ref, f"{msg} rank {r}")
            assert torch.equal(y, outs[0]), f"{msg}: rank {r} differs from rank 0"
            assert pbs[r].state.tolist()[:3] == [e, 0, 0], f"{msg}: epoch/arrivals/timeout"
            assert torch.equal(pbs[r].buffer[e & 1, :T], partials[r]), f"{msg}: own copy"
        if world >= 3:
            assert bool((ref[:, 0] == 1).all()), msg     # 2^30 − 2^30 + 0… + 1 in rank order


@pytest.mark.parametrize("two_shot", [False, True])
def test_wait_times_out_and_is_reported(two_shot):
    """A peer that never publishes: the wait (both of the two-shot's) gives up after
    max_spins and records the epoch."""
    world, T, H = 2, 2, 32
    pbs = AR.PeerBuffers.local_group(world, 4, H, SIM_DEV)
    partials, residual, w = _case(world, T, H, fresh_seed(), SIM_DEV)
    pbs[1].buffer[1, :T] = partials[1]
    pbs[0].flags[1].fill_(0)                         # rank 1 never published to rank 0
    pbs[0].all_reduce_residual_norm(partials[0], residual, w, EPS, max_spins=20,
                                    two_shot=two_shot)
    assert pbs[0].state.tolist()[:3] == [1, 0, 1]
    with pytest.raises(RuntimeError, match="rank 0 of 2 timed out .* epoch 1"):
        pbs[0].check_timeouts()
    pbs[1].check_timeouts()                          # rank 1 never ran: nothing recorded


def test_buffer_limits_are_named():
    pbs = AR.PeerBuffers.local_group(2, 4, 32, SIM_DEV)
    x = torch.randn(5, 32, device=SIM_DEV).to(BF)
    with pytest.raises(ValueError, match="5 token rows"):
        pbs[0].all_reduce_residual_norm(x, x, None, EPS)
    with pytest.raises(ValueError, match="partial dtype torch.float32"):
        pbs[0].all_reduce_residual_norm(x[:2].float(), x[:2], None, EPS)


# ---- (ii)/(iii) real protocol between processes ---------------------------------------------

def _ipc_worker(rank, world, port, seed, same_gpu, epochs):
    import gc

    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dev = torch.device("cuda", 0 if same_gpu else rank)
    torch.cuda.set_device(dev)
    MT, H = 64, 7168
    pb = AR.PeerBuffers.create(None, MT, H, dev)

    def check(new, h, ref_new, ref_h, msg):
        torch.cuda.synchronize()
        pb.check_timeouts()
        assert torch.equal(new, ref_new), msg
        assert rel_err(h, ref_h) <= TOL_NORM, f"{msg}: {rel_err(h, ref_h)}"
        mine = torch.cat([new.view(torch.uint8), h.view(torch.uint8)]).cpu()
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        assert all(torch.equal(x, every[0]) for x in every), f"{msg}: ranks differ"

    for e in range(1, epochs + 1):
        T = (1, 2, 4, 64, 3)[e % 5]
        partials, residual, w = _case(world, T, H, seed + e, dev)
        ref_new, ref_h = AR.allreduce_residual_norm_reference(partials, residual, w, EPS)
        new, h = _nan(T, H, dev), _nan(T, H, dev)
        if e % 2:
            pb.all_reduce_residual_norm(partials[rank], residual, w, EPS, new_residual=new,
                                        out=h)
        else:
            pb.next_input_slot_sync(T).copy_(partials[rank])
            pb.all_reduce_residual_norm(None, residual, w, EPS, new_residual=new, out=h)
        check(new, h, ref_new, ref_h, f"seed {seed} epoch {e} rank {rank} T {T}")
        other = not pb.uses_two_shot(T)              # the other form: same new_residual bits
        new2, h2 = _nan(T, H, dev), _nan(T, H, dev)
        pb.all_reduce_residual_norm(partials[rank], residual, w, EPS, new_residual=new2,
                                    out=h2, two_shot=other)
        check(new2, h2, ref_new, ref_h, f"seed {seed} epoch {e} rank {rank} T {T} "
                                        f"{'two' if other else 'one'}-shot")
        assert rel_err(h2, h) <= TOL_OWN_NORM, f"seed {seed} epoch {e}: forms' norms"
        s = pb.all_reduce(partials[rank], out=_nan(T, H, dev))      # plain, the next epoch
        torch.cuda.synchronize()
        pb.check_timeouts()
        assert torch.equal(s, AR.allreduce_reference(partials)), \
            f"seed {seed} epoch {e} rank {rank} T {T}: plain all-reduce"

    T = 4                                            # CUDA graph: capture once, replay
    sp, sr = torch.empty(T, H, dtype=BF, device=dev), torch.empty(T, H, dtype=BF, device=dev)
    sw, new, h = torch.empty(H, device=dev), _nan(T, H, dev), _nan(T, H, dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        pb.all_reduce_residual_norm(sp, sr, sw, EPS, new_residual=new, out=h)
    for k in range(5):
        partials, residual, w = _case(world, T, H, seed + 1000 + k, dev)
        ref_new, ref_h = AR.allreduce_residual_norm_reference(partials, residual, w, EPS)
        sp.copy_(partials[rank]), sr.copy_(residual), sw.copy_(w)
        new.fill_(float("nan")), h.fill_(float("nan"))
        g.replay()
        check(new, h, ref_new, ref_h, f"seed {seed} graph replay {k} rank {rank}")
    assert int(pb.state[0]) == 3 * epochs + 5, "one epoch per call, replays included"
    g.reset()
    g = None                                         # the graph launches the kernel: first
    gc.collect()
    pb.close()                                       # collective: unmap, barrier, free
    pb.close()                                       # idempotent
    with pytest.raises(RuntimeError, match=f"rank {rank} of {world} are closed"):
        pb.all_reduce(sp)
    dist.destroy_process_group()


class _Recording(TorchComm):
    """The real TorchComm, recording (shape, dtype) of each all_reduce it serves."""

    def __init__(self, par):
        super().__init__(par)
        self.reduced = []

    def all_reduce(self, x):
        self.reduced.append((tuple(x.shape), x.dtype))
        return super().all_reduce(x)


def _comm_worker(rank, world, port, seed):
    """(iv): OneShotComm over NCCL, eager then in a CUDA graph, then close()."""
    import gc

    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    H, MT = 7168, 64
    off = AR.OneShotComm.create(TorchComm(Parallel(rank, world)), None, MT, H, dev,
                                enable=rank != 0)    # one rank says no: off on every rank
    assert off.peers is None, f"rank {rank}: rank 0 disabled the one-shot path"
    base = _Recording(Parallel(rank, world))
    comm = AR.OneShotComm.create(base, None, MT, H, dev)
    assert comm.peers is not None, f"rank {rank}: no one-shot buffers (P2P vote or self-test)"
    calls = int(comm.peers.state[0])                 # the self-test's call

    def inputs(shape, dtype, k):                     # every rank's input, fresh per k
        g = torch.Generator().manual_seed(seed + k)
        return [torch.randn(shape, generator=g).to(dtype).to(dev) for _ in range(world)]

    def same_everywhere(y, msg):
        b = y.contiguous().view(torch.uint8).flatten()
        every = [torch.empty_like(b) for _ in range(world)]
        dist.all_gather(every, b)
        assert all(torch.equal(t, every[0]) for t in every), f"{msg}: ranks differ"

    def want_nccl(xs):
        w = xs[rank].clone()
        dist.all_reduce(w)
        return w

    for k, shape in enumerate(((1, H), (3, H), (MT, H), (2, 2, H))):      # -> the kernel
        xs = inputs(shape, BF, k)
        ref = AR.allreduce_reference([x.reshape(-1, H) for x in xs]).view(shape)
        y = comm.all_reduce(xs[rank].clone())
        torch.cuda.synchronize()
        comm.peers.check_timeouts()
        msg = f"seed {seed} rank {rank} shape {shape}"
        assert torch.equal(y, ref), msg
        same_everywhere(y, msg)
        calls += 1
    assert base.reduced == [] and int(comm.peers.state[0]) == calls
    others = [((3, H), torch.float32), ((3, H // 2), BF), ((MT + 1, H), BF)]   # -> NCCL
    for k, (shape, dt) in enumerate(others):
        xs = inputs(shape, dt, 100 + k)
        assert torch.equal(comm.all_reduce(xs[rank].clone()), want_nccl(xs)), \
            f"seed {seed} rank {rank} {shape} {dt}"
    assert base.reduced == others and int(comm.peers.state[0]) == calls

    # CUDA graph: the kernel and two NCCL all-reduces captured once, replayed on new inputs
    sb, sf = torch.zeros(3, H, dtype=BF, device=dev), torch.zeros(3, H, device=dev)
    sw = torch.zeros(2, H // 2, dtype=BF, device=dev)

    def step():
        return comm.all_reduce(sb), comm.all_reduce(sf), comm.all_reduce(sw)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                    # warm-up outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    calls += 1
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yb, yf, yw = step()
    assert base.reduced[len(others):] == [((3, H), torch.float32), ((2, H // 2), BF)] * 2
    for k in range(3):
        xb, xf, xw = inputs((3, H), BF, 200 + k), inputs((3, H), torch.float32, 300 + k), \
            inputs((2, H // 2), BF, 400 + k)
        sb.copy_(xb[rank]), sf.copy_(xf[rank]), sw.copy_(xw[rank])
        yb.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        comm.peers.check_timeouts()
        msg = f"seed {seed} rank {rank} graph replay {k}"
        assert torch.equal(yb, AR.allreduce_reference(xb)), msg
        same_everywhere(yb, msg)
        assert torch.equal(yf, want_nccl(xf)) and torch.equal(yw, want_nccl(xw)), msg
        calls += 1
    assert int(comm.peers.state[0]) == calls, "one epoch per one-shot call, replays included"

    g.reset()
    g = yb = yf = yw = None                          # the graph launches the kernel: first
    gc.collect()
    peers = comm.peers
    comm.close()                                     # collective: unmap, barrier, free
    comm.close()
    assert peers.closed and peers.buffer is None
    with pytest.raises(RuntimeError, match="closed"):
        comm.all_reduce(sb)
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


def _rank_worker_proc(rank, world, port, seed):
    """(v): one RankWorker of a TP group, the way a Ray actor runs it (minus Ray)."""
    import functools

    from raydecode.actors.rank_worker import (ONESHOT_MAX_TOKENS, RankWorker, ShardSpec,
                                              load_runner)

    for k in ("RAYDECODE_KERNEL_CACHE", "RAYDECODE_ONESHOT_ALLREDUCE"):
        os.environ.pop(k, None)                      # no AOT warm-up; the default (on)
    # eager steps (graphs are on by default for CUDA ranks: test_step_graph_wiring_gpu.py)
    factory = functools.partial(load_runner, ShardSpec("tiny", dtype="bfloat16", num_slots=4,
                                                       step_graphs=False))
    w = RankWorker(rank, world, 1, factory, f"oneshot-{seed}", backend="gloo")
    info = w.init_group("127.0.0.1", port, timeout_s=120.0)
    comm, model = w.comm, w.runner.model
    assert info["device"] == "cuda" and isinstance(comm, AR.OneShotComm), type(comm)
    assert model.comm is comm, "the model must hold the comm that gets connected"
    assert comm.peers is not None, f"rank {rank}: one-shot buffers did not open"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert comm.hidden == model.cfg.hidden_size, (comm.hidden, model.cfg.hidden_size)
    assert comm.max_tokens == min(ONESHOT_MAX_TOKENS, sms) and comm.par == w.par
    x = torch.full((3, comm.hidden), float(rank + 1), dtype=BF, device="cuda")
    y = comm.all_reduce(x)
    torch.cuda.synchronize()
    comm.peers.check_timeouts()
    assert torch.equal(y, torch.full_like(x, world * (world + 1) // 2)), f"rank {rank}"
    peers = comm.peers
    w.shutdown()                                     # collective: close, then destroy
    assert comm.closed and peers.closed


def _spawn(fn, world, *args, port=None):
    """Run fn(rank, world, port, seed, *args) in `world` spawned processes. Fails the test on a
    timeout, on a raised exception (re-raised with the worker's traceback), and on a rank
    that exits by a signal or a nonzero code (ProcessExitedException, not swallowed)."""
    import socket

    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    seed = fresh_seed()
    ctx = mp.start_processes(fn, args=(world, port, seed, *args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + MP_TIMEOUT_S
    try:
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                pytest.fail(f"seed {seed}: {world} ranks did not finish within "
                            f"{MP_TIMEOUT_S} s (a wait never completed?)")
    except mp.ProcessExitedException as e:
        pytest.fail(f"seed {seed}: {e} (a rank died; at teardown this is the IPC/NCCL "
                    "shutdown order)")
    assert all(p.exitcode == 0 for p in ctx.processes), \
        f"seed {seed}: exit codes {[p.exitcode for p in ctx.processes]}"


@pytest.mark.skipif(not COMPILED, reason="needs a CUDA GPU (compiled kernel)")
def test_two_processes_one_gpu():
    _spawn(_ipc_worker, 2, True, 8)


@pytest.mark.skipif(not COMPILED, reason="needs a CUDA GPU (compiled kernel)")
def test_rank_worker_wires_the_oneshot_comm():
    import datetime

    import torch.distributed as dist

    # the rendezvous server (rank 0's open_store under Ray); both ranks join as clients
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    _spawn(_rank_worker_proc, 2, port=store.port)


def _two_peer_gpus() -> bool:
    return (COMPILED and torch.cuda.device_count() >= 2
            and torch.cuda.can_device_access_peer(0, 1)
            and torch.cuda.can_device_access_peer(1, 0))


@pytest.mark.skipif(not _two_peer_gpus(), reason="needs 2 P2P-capable GPUs")
def test_two_gpus_p2p():
    _spawn(_ipc_worker, 2, False, 8)


@pytest.mark.skipif(not _two_peer_gpus(), reason="needs 2 P2P-capable GPUs")
def test_comm_over_nccl_two_gpus():
    _spawn(_comm_worker, 2)
