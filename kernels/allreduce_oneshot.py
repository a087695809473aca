"""One-shot all-reduce + residual add + RMSNorm over peer buffers, for the decode step (issue #6).

The TP all-reduce of a decode activation (T ≤ 64 rows of H = 7168 bf16) is latency-bound; a ring
costs 2(N−1) dependent steps. One-shot: every rank puts its partial in its own registered buffer
and signals; every rank then reads all N buffers over NVLink and computes, in one kernel,

    acc          = Σ_{q=0..N−1} fp32(partial_q)            in rank order, from +0.0
    new_residual = round(acc + fp32(residual))             rounded to the residual dtype
    normed       = round(fp32(new_residual) · rsqrt(mean(fp32(new_residual)²) + eps) · fp32(w))

The fixed order makes the result bit-identical on every rank and independent of the transport.
`allreduce_residual_norm_reference` is that spec in PyTorch; the kernel, its memory-ordering and
buffer-reuse arguments and the latency prediction are in kernels/allreduce_oneshot_triton.py.

Layers: `PeerBuffers` owns this rank's registered memory (buffer, flags, device epoch), opens the
peers' copies with legacy CUDA IPC and launches the kernel. `OneShotComm` is the Comm-style
adapter a model shard calls; it falls back to an all-gather + the reference (bit-identical to the
kernel's spec) when the group is one rank, not all on CUDA, or not all pairwise P2P-capable. The
choice is made once, collectively, and is the same on every rank (DESIGN §6).

IPC choice: `torch.multiprocessing.reductions.reduce_tensor` / `rebuild_cuda_tensor`, i.e.
cudaIpcGetMemHandle / cudaIpcOpenMemHandle on a caching-allocator block: it maps one device
allocation into another process and nothing else, so it cannot create a multicast object; it
works between processes on one GPU (the 2-process single-GPU test) and across NVLink peers.
torch.distributed._symmetric_memory was not used: its CUDA backend allocates with cuMemCreate and
sets up multicast during rendezvous when the device reports support, so "no multicast" would rest
on the TORCH_SYMM_MEM_DISABLE_MULTICAST environment variable instead of on the code path.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Sequence

import torch

from raydecode.kernels import allreduce_oneshot_triton as _tri

BUFFER_DTYPE = torch.bfloat16


# ---- the spec -------------------------------------------------------------------------------

def rms_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 x · rsqrt(mean(x²) + eps) · w over the last dim, rounded to x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def allreduce_residual_norm_reference(partials: Sequence[torch.Tensor], residual: torch.Tensor,
                                      w: torch.Tensor | None, eps: float
                                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """partials N × (T, H), residual (T, H), w (H,) -> (new_residual, normed), both (T, H) in
    residual's dtype; normed is None when w is None."""
    acc = torch.zeros(residual.shape, dtype=torch.float32, device=residual.device)
    for p in partials:                                   # rank order 0..N−1
        acc = acc + p.float()
    new_residual = (acc + residual.float()).to(residual.dtype)
    return new_residual, (None if w is None else rms_norm_reference(new_residual, w, eps))


def check_inputs(partial: torch.Tensor | None, residual: torch.Tensor, w: torch.Tensor | None,
                 hidden: int, max_tokens: int, dtype: torch.dtype) -> None:
    """ValueError naming the offending value for anything the op does not accept."""
    if residual.dim() != 2:
        raise ValueError(f"residual of shape {tuple(residual.shape)}; expected (T, H) with "
                         f"H = {hidden}")
    T, H = residual.shape
    if H != hidden:
        raise ValueError(f"hidden size {H} (residual {tuple(residual.shape)}) does not match "
                         f"the all-reduce buffers' hidden size {hidden}")
    if not 1 <= T <= max_tokens:
        raise ValueError(f"{T} token rows; the all-reduce buffers hold 1..{max_tokens} "
                         f"(max_tokens)")
    if partial is not None and partial.shape != residual.shape:
        raise ValueError(f"partial of shape {tuple(partial.shape)}; expected "
                         f"{tuple(residual.shape)} like the residual")
    for name, t in (("partial", partial), ("residual", residual)):
        if t is not None and t.dtype != dtype:
            raise ValueError(f"{name} dtype {t.dtype}; the all-reduce runs in {dtype}")
    if w is not None and tuple(w.shape) != (H,):
        raise ValueError(f"RMSNorm weight of shape {tuple(w.shape)}; expected ({H},)")
    if w is not None and not w.is_floating_point():
        raise ValueError(f"RMSNorm weight dtype {w.dtype}; expected a floating dtype")


# ---- peers ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class DeviceInfo:
    """What a rank tells the others about its GPU, to decide P2P capability."""
    host: str
    uuid: str           # "" for a CPU rank
    index: int          # device index in the rank's own CUDA_VISIBLE_DEVICES view


def device_info(device: torch.device) -> DeviceInfo:
    if device.type != "cuda":
        return DeviceInfo(socket.gethostname(), "", -1)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return DeviceInfo(socket.gethostname(), str(torch.cuda.get_device_properties(idx).uuid), idx)


def _nvml_nvlink_p2p(uuid_a: str, uuid_b: str) -> bool | None:
    """NVML's NVLink P2P status between two GPUs by UUID (works when CUDA_VISIBLE_DEVICES
    hides the peer); None when NVML cannot answer."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            a = pynvml.nvmlDeviceGetHandleByUUID("GPU-" + uuid_a)
            b = pynvml.nvmlDeviceGetHandleByUUID("GPU-" + uuid_b)
            st = pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
            return st == pynvml.NVML_P2P_STATUS_OK
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def p2p_capable(mine: DeviceInfo, peer: DeviceInfo) -> bool:
    """This rank's GPU can load from and do atomics on the peer's memory: same host, both CUDA,
    and the same GPU or an NVLink P2P pair (NVML), else torch's peer-access check."""
    if not mine.uuid or not peer.uuid or mine.host != peer.host:
        return False
    if mine.uuid == peer.uuid:
        return True
    nv = _nvml_nvlink_p2p(mine.uuid, peer.uuid)
    if nv is not None:
        return nv
    visible = {str(torch.cuda.get_device_properties(i).uuid): i
               for i in range(torch.cuda.device_count())}
    if peer.uuid not in visible:
        return False
    return torch.cuda.can_device_access_peer(mine.index, visible[peer.uuid])


class PeerBuffers:
    """This rank's registered memory and the peers' mapped copies (see the Triton module's
    docstring for the layout and protocol). Build with `create` (collective over a
    torch.distributed group) or `local_group` (N simulated ranks in one process)."""

    def __init__(self, rank: int, buffers: list[torch.Tensor], flags: list[torch.Tensor],
                 state: torch.Tensor, max_tokens: int, hidden: int):
        self.rank, self.world = rank, len(buffers)
        self.max_tokens, self.hidden = max_tokens, hidden
        self.buffer, self.flags, self.state = buffers[rank], flags[rank], state
        self._keep = (buffers, flags)                        # mapped peer memory stays open
        dev = state.device
        self.buf_addrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64,
                                      device=dev)
        self.flag_addrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64,
                                       device=dev)

    @staticmethod
    def _alloc(world: int, max_tokens: int, hidden: int, device):
        buf = torch.zeros(2, max_tokens, hidden, dtype=BUFFER_DTYPE, device=device)
        flags = torch.zeros(world, max_tokens, dtype=torch.int64, device=device)
        state = torch.zeros(4, dtype=torch.int64, device=device)
        return buf, flags, state

    @staticmethod
    def _check_size(max_tokens: int, hidden: int, device: torch.device) -> None:
        if max_tokens < 1 or hidden < 1:
            raise ValueError(f"max_tokens={max_tokens} hidden={hidden}: both must be >= 1")
        if device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            if max_tokens > sms:
                raise ValueError(f"max_tokens={max_tokens} exceeds the {sms} SMs of {device}: "
                                 "every row's program must be resident at once (no deadlock)")

    @classmethod
    def local_group(cls, world: int, max_tokens: int, hidden: int,
                    device: torch.device | str) -> list["PeerBuffers"]:
        """`world` simulated ranks in one process on one device (tests, single-GPU checks)."""
        device = torch.device(device)
        cls._check_size(max_tokens, hidden, device)
        parts = [cls._alloc(world, max_tokens, hidden, device) for _ in range(world)]
        bufs, flags = [p[0] for p in parts], [p[1] for p in parts]
        return [cls(r, bufs, flags, parts[r][2], max_tokens, hidden) for r in range(world)]

    @classmethod
    def create(cls, group, max_tokens: int, hidden: int,
               device: torch.device | str) -> "PeerBuffers":
        """Collective over `group` (every rank calls it): allocate, exchange CUDA IPC handles
        with dist.all_gather_object, open the peers' handles on this rank's device."""
        import torch.distributed as dist
        from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"PeerBuffers need a CUDA device, got {device}")
        cls._check_size(max_tokens, hidden, device)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        buf, flags, state = cls._alloc(world, max_tokens, hidden, device)
        torch.cuda.synchronize(device)     # zeroed before any peer can publish into `flags`
        handles = [None] * world
        dist.all_gather_object(handles, (reduce_tensor(buf)[1], reduce_tensor(flags)[1]),
                               group=group)

        def _open(args):                   # map into THIS rank's device context (arg 6)
            args = list(args)
            args[6] = device.index if device.index is not None else torch.cuda.current_device()
            return rebuild_cuda_tensor(*args)

        bufs = [buf if q == rank else _open(handles[q][0]) for q in range(world)]
        flgs = [flags if q == rank else _open(handles[q][1]) for q in range(world)]
        torch.cuda.synchronize(device)
        dist.barrier(group=group)          # every rank mapped everything before any call
        return cls(rank, bufs, flgs, state, max_tokens, hidden)

    def next_input_slot_sync(self, T: int) -> torch.Tensor:
        """(T, H) view of this rank's buffer slot the NEXT call reads, for a producer that
        writes its partial in place (then call with partial=None). Host sync (reads the device
        epoch); a kernel producer computes the slot on device from state[0] instead."""
        return self.buffer[(int(self.state[0]) + 1) & 1, :T]

    def all_reduce_residual_norm(self, partial: torch.Tensor | None, residual: torch.Tensor,
                                 w: torch.Tensor | None, eps: float, *,
                                 new_residual: torch.Tensor | None = None,
                                 out: torch.Tensor | None = None,
                                 max_spins: int = _tri.DEFAULT_MAX_SPINS):
        """One call of the protocol -> (new_residual, normed or None). Every rank of the group
        must make the same sequence of calls with the same T. No host sync; capturable."""
        check_inputs(partial, residual, w, self.hidden, self.max_tokens, BUFFER_DTYPE)
        if not _tri.available(residual, self.state):
            raise RuntimeError("the one-shot kernel needs Triton on CUDA tensors (or CPU "
                               "tensors under TRITON_INTERPRET=1)")
        rows = [t if t is None or t.stride(-1) == 1 else t.contiguous()
                for t in (partial, residual)]
        partial, residual = rows
        if new_residual is None:
            new_residual = torch.empty_like(residual, memory_format=torch.contiguous_format)
        if w is not None and out is None:
            out = torch.empty_like(new_residual)
        _tri.oneshot_triton(self.buf_addrs, self.flag_addrs, self.state, self.rank,
                            self.max_tokens, partial, residual, w, eps, new_residual, out,
                            max_spins)
        return new_residual, (out if w is not None else None)

    def check_timeouts(self) -> None:
        """Host sync: raise if any wait of this rank gave up (a peer never published)."""
        ep = int(self.state[2])
        if ep:
            raise RuntimeError(f"one-shot all-reduce: rank {self.rank} of {self.world} timed "
                               f"out waiting for its peers at epoch {ep}")


# ---- the Comm-style adapter -----------------------------------------------------------------

class OneShotComm:
    """Duck-typed `models.parallel.Comm` (kernels/ does not import models/): all_reduce,
    all_gather and dcp_all_gather go to the wrapped `base` comm; all_reduce_residual_norm runs
    the one-shot kernel when `peers` is set, else the all-gather fallback."""

    def __init__(self, base, group=None, peers: PeerBuffers | None = None, *, world: int,
                 max_tokens: int, hidden: int, dtype: torch.dtype = BUFFER_DTYPE):
        self.base, self.group, self.peers, self.world = base, group, peers, world
        self.max_tokens, self.hidden, self.dtype = max_tokens, hidden, dtype

    @classmethod
    def create(cls, base, group, max_tokens: int, hidden: int, device: torch.device | str,
               dtype: torch.dtype = BUFFER_DTYPE) -> "OneShotComm":
        """Collective: one-shot only if every rank is on CUDA, every pair is P2P-capable and
        the dtype is the buffers'; the decision is gathered, so all ranks agree."""
        import torch.distributed as dist

        device = torch.device(device)
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        if world == 1:
            return cls(base, group, None, world=1, max_tokens=max_tokens, hidden=hidden,
                       dtype=dtype)
        infos = [None] * world
        dist.all_gather_object(infos, device_info(device), group=group)
        mine = infos[dist.get_rank(group)]
        ok = dtype == BUFFER_DTYPE and all(p2p_capable(mine, p) for p in infos)
        votes = [None] * world
        dist.all_gather_object(votes, ok, group=group)
        peers = PeerBuffers.create(group, max_tokens, hidden, device) if all(votes) else None
        return cls(base, group, peers, world=world, max_tokens=max_tokens, hidden=hidden,
                   dtype=dtype)

    def all_reduce(self, x):
        return self.base.all_reduce(x)

    def all_gather(self, x, dim: int = -1):
        return self.base.all_gather(x, dim)

    def dcp_all_gather(self, x, dim: int = 0):
        return self.base.dcp_all_gather(x, dim)

    def all_reduce_residual_norm(self, partial: torch.Tensor, residual: torch.Tensor,
                                 w: torch.Tensor | None, eps: float):
        """-> (new_residual, RMSNorm(new_residual; w) or None), identical on every rank."""
        check_inputs(partial, residual, w, self.hidden, self.max_tokens, self.dtype)
        if self.peers is not None:
            return self.peers.all_reduce_residual_norm(partial, residual, w, eps)
        return allreduce_residual_norm_reference(self._gather(partial), residual, w, eps)

    def _gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's partial, bit-exact (sent as bytes), in rank order."""
        if self.world == 1:
            return [x]
        import torch.distributed as dist

        bits = x.contiguous().view(torch.uint8)              # (T, H · itemsize)
        parts = [torch.empty_like(bits) for _ in range(self.world)]
        dist.all_gather(parts, bits, group=self.group)
        return [p.view(x.dtype) for p in parts]


__all__ = ["BUFFER_DTYPE", "DeviceInfo", "OneShotComm", "PeerBuffers",
           "allreduce_residual_norm_reference", "check_inputs", "device_info", "p2p_capable",
           "rms_norm_reference"]
