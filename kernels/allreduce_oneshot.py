"""One-shot (and two-shot) all-reduce + residual add + RMSNorm over peer buffers, for the decode
step (issues #6, 32).

The TP all-reduce of a decode activation (T ≤ 64 rows of H = 7168 bf16) is latency-bound; a ring
costs 2(N−1) dependent steps. One-shot: every rank puts its partial in its own registered buffer
and signals; every rank then reads all N buffers over NVLink and computes, in one kernel,

    acc          = Σ_{q=0..N−1} fp32(partial_q)            in rank order, from +0.0
    new_residual = round(acc + fp32(residual))             rounded to the residual dtype
    normed       = round(fp32(new_residual) · rsqrt(mean(fp32(new_residual)²) + eps) · fp32(w))

The fixed order makes the result bit-identical on every rank and independent of the transport.
`allreduce_residual_norm_reference` is that spec in PyTorch; the kernel, its memory-ordering and
buffer-reuse arguments and the latency prediction are in kernels/allreduce_oneshot_triton.py.
The plain all-reduce is the same kernel without residual and norm: round(acc), spec
`allreduce_reference`; it is what `OneShotComm.all_reduce` runs for the model's bf16 (T, H)
activations (models call `comm.all_reduce`), everything else goes to the wrapped comm.

Two forms of the same op, one epoch counter: the one-shot kernel (every rank pulls every peer's
whole row) below `two_shot_min_tokens` rows, the two-shot kernel (kernels/
allreduce_twoshot_triton.py: each rank reduces its H/N column slice and pushes it to every
peer, 2/N of the one-shot's NVLink bytes for a second barrier) from there on; their
new_residual is bit-identical, so the choice (`PeerBuffers.uses_two_shot`, by T only, the same
on every rank) changes no token.

Layers: `PeerBuffers` owns this rank's registered memory (partial and gather slots, flags,
device epoch), opens the peers' copies with legacy CUDA IPC, launches the kernels and tears it
all down in a fixed order (`close`). `OneShotComm` is the Comm-style adapter a model shard
calls; it falls back to an all-gather + the reference (bit-identical to the kernel's spec)
when the group is one rank, not all on CUDA, or not all pairwise P2P-capable. The choice is made once, collectively, and is the
same on every rank (DESIGN §6).

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
from raydecode.kernels import allreduce_twoshot_triton as _two

BUFFER_DTYPE = torch.bfloat16
# the connect-time self-test's wait bound: the ranks just met in a collective, so a broken
# mapping falls back to NCCL after 2**24 polls (the bound every step had before it became
# _tri.DEFAULT_MAX_SPINS) instead of holding up the replica's start for 8× as long
SELF_TEST_MAX_SPINS = 1 << 24


# ---- the spec -------------------------------------------------------------------------------

def rms_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 x · rsqrt(mean(x²) + eps) · w over the last dim, rounded to x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def allreduce_reference(partials: Sequence[torch.Tensor]) -> torch.Tensor:
    """partials N × (T, H) -> round(Σ_{q=0..N−1} fp32(partial_q)) in rank order from +0.0,
    (T, H) in the partials' dtype: the plain all-reduce's spec."""
    acc = torch.zeros(partials[0].shape, dtype=torch.float32, device=partials[0].device)
    for p in partials:                                   # rank order 0..N−1
        acc = acc + p.float()
    return acc.to(partials[0].dtype)


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


def check_rows(name: str, x: torch.Tensor, hidden: int, max_tokens: int,
               dtype: torch.dtype | None = None) -> None:
    """ValueError naming the offending value unless x is (T, hidden), 1 ≤ T ≤ max_tokens, and
    (dtype given) of that dtype."""
    if x.dim() != 2:
        raise ValueError(f"{name} of shape {tuple(x.shape)}; expected (T, H) with H = {hidden}")
    T, H = x.shape
    if H != hidden:
        raise ValueError(f"hidden size {H} ({name} {tuple(x.shape)}) does not match "
                         f"the all-reduce buffers' hidden size {hidden}")
    if not 1 <= T <= max_tokens:
        raise ValueError(f"{T} token rows; the all-reduce buffers hold 1..{max_tokens} "
                         f"(max_tokens)")
    if dtype is not None and x.dtype != dtype:
        raise ValueError(f"{name} dtype {x.dtype}; the all-reduce runs in {dtype}")


def check_inputs(partial: torch.Tensor | None, residual: torch.Tensor, w: torch.Tensor | None,
                 hidden: int, max_tokens: int, dtype: torch.dtype) -> None:
    """ValueError naming the offending value for anything the op does not accept."""
    check_rows("residual", residual, hidden, max_tokens)
    if partial is not None and partial.shape != residual.shape:
        raise ValueError(f"partial of shape {tuple(partial.shape)}; expected "
                         f"{tuple(residual.shape)} like the residual")
    for name, t in (("partial", partial), ("residual", residual)):
        if t is not None and t.dtype != dtype:
            raise ValueError(f"{name} dtype {t.dtype}; the all-reduce runs in {dtype}")
    H = residual.shape[1]
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
    torch.distributed group) or `local_group` (N simulated ranks in one process); end with
    `close` (collective for `create`d buffers), after which every call raises."""

    def __init__(self, rank: int, buffers: list[torch.Tensor], flags: list[torch.Tensor],
                 state: torch.Tensor, max_tokens: int, hidden: int, *,
                 gathers: list[torch.Tensor] | None = None,
                 exts: list[torch.Tensor] | None = None,
                 two_shot_min_tokens: int | None = _two.TWO_SHOT_MIN_TOKENS,
                 collective: bool = False, group=None):
        self.rank, self.world = rank, len(buffers)
        self.max_tokens, self.hidden = max_tokens, hidden
        self.buffer, self.flags, self.state = buffers[rank], flags[rank], state
        self.device = state.device
        self.group, self._collective, self.closed = group, collective, False
        # the two-shot form (kernels/allreduce_twoshot_triton.py): every rank's gather buffer
        # and ext words; without them (or hidden not a multiple of the world) one-shot only
        two = gathers is not None and exts is not None and hidden % self.world == 0
        self.gather = gathers[rank] if two else None
        nmt = self.world * max_tokens
        self.flags2 = exts[rank][:nmt].view(self.world, max_tokens) if two else None
        # aux[s, t, q]: the fp32 bits of rank q's slice sum of squares of row t, slot s
        self.aux = exts[rank][nmt:].view(2, max_tokens, -1) if two else None
        self.two_shot_min_tokens = two_shot_min_tokens if two else None
        # the only references to the peers' tensors (mapped memory for `create`): close drops them
        every = buffers + flags + ((gathers + exts) if two else [])
        self._peer_tensors = [t for q, t in enumerate(every) if q % self.world != rank]
        addrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64,  # noqa
                                        device=self.device)
        self.buf_addrs, self.flag_addrs = addrs(buffers), addrs(flags)
        self.gat_addrs = addrs(gathers) if two else None
        self.ext_addrs = addrs(exts) if two else None

    @staticmethod
    def _alloc(world: int, max_tokens: int, hidden: int, device):
        """(partial slots, phase-1 flags, state, gather slots, ext words) of one rank."""
        buf = torch.zeros(2, max_tokens, hidden, dtype=BUFFER_DTYPE, device=device)
        flags = torch.zeros(world, max_tokens, dtype=torch.int64, device=device)
        state = torch.zeros(4, dtype=torch.int64, device=device)
        gat = torch.zeros(2, max_tokens, hidden, dtype=BUFFER_DTYPE, device=device)
        ext = torch.zeros(_two.ext_words(world, max_tokens), dtype=torch.int64, device=device)
        return buf, flags, state, gat, ext

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
        gats, exts = [p[3] for p in parts], [p[4] for p in parts]
        return [cls(r, bufs, flags, parts[r][2], max_tokens, hidden, gathers=gats, exts=exts)
                for r in range(world)]

    @classmethod
    def create(cls, group, max_tokens: int, hidden: int,
               device: torch.device | str) -> "PeerBuffers":
        """Collective over `group` (every rank calls it): allocate, exchange CUDA IPC handles
        with dist.all_gather_object, open the peers' handles on this rank's device.

        One `reduce_tensor` per (buffer, receiving peer): each `_share_cuda_` gives the producer
        a fresh ref counter set to 1 that exactly one receiver decrements when its mapping is
        freed (one share sent to N−1 peers would be decremented N−1 times). While a counter is
        > 0, freeing the producer's tensor parks the block in torch's CudaIPCSentDataLimbo,
        emptied only by a later IPC free, torch.cuda.ipc_collect() or, failing both, a static
        destructor at process exit; `close` orders the unmaps before the frees so nothing is
        parked."""
        import torch.distributed as dist
        from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"PeerBuffers need a CUDA device, got {device}")
        cls._check_size(max_tokens, hidden, device)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        buf, flags, state, gat, ext = cls._alloc(world, max_tokens, hidden, device)
        torch.cuda.synchronize(device)     # zeroed before any peer can publish into `flags`
        mine = (buf, flags, gat, ext)
        shares = [None if q == rank else tuple(reduce_tensor(t)[1] for t in mine)
                  for q in range(world)]
        handles = [None] * world           # handles[p][q]: producer p's share for receiver q
        dist.all_gather_object(handles, shares, group=group)
        del shares

        def _open(args):                   # map into THIS rank's device context (arg 6)
            args = list(args)
            args[6] = device.index if device.index is not None else torch.cuda.current_device()
            return rebuild_cuda_tensor(*args)

        opened = [[mine[i] if q == rank else _open(handles[q][rank][i]) for q in range(world)]
                  for i in range(len(mine))]
        torch.cuda.synchronize(device)
        dist.barrier(group=group)          # every rank mapped everything before any call
        return cls(rank, opened[0], opened[1], state, max_tokens, hidden, gathers=opened[2],
                   exts=opened[3], collective=True, group=group)

    def close(self, group=None) -> None:
        """Unmap the peers' memory and free this rank's, in an order that is safe for every
        rank. Collective for `create`d buffers (every rank of the group calls it; `group`
        defaults to the one they were created on); local for `local_group`. Idempotent.

        The caller first drops everything that can still launch the kernel on these buffers:
        the CUDA graphs that captured it (a replay after close reads unmapped memory) and any
        pending producer. Then, on every rank:
          1. synchronize this device, barrier: no kernel of ANY rank is still reading or
             writing this rank's memory (each rank's own kernels completed before it arrived);
          2. drop the mapped peer tensors and the address tables, gc.collect(): the storage
             deleters close the IPC mappings (cudaIpcCloseMemHandle) and decrement the
             producers' ref counters;
          3. synchronize, barrier: every peer has unmapped this rank's memory;
          4. drop this rank's buffers, gc.collect(), torch.cuda.ipc_collect(): every producer
             counter is 0, so the blocks go straight back to the caching allocator and the
             ref-counter file is closed; nothing is left in torch's IPC limbo or mapped from a
             peer when the process exits (a block freed from limbo by a static destructor at
             exit, or a mapping outliving its owner, is what this order rules out).
        If a barrier fails (a dead peer), steps 2 and 4 still run (4 without the barrier of 3)
        and the error propagates; memory a live peer may still map then stays parked in the
        limbo instead of being reused. Every later call raises RuntimeError."""
        if self.closed:
            return
        import gc

        self.closed = True
        cuda = self.device.type == "cuda"
        g = group if group is not None else self.group

        def fence() -> None:
            if cuda:
                torch.cuda.synchronize(self.device)
            if self._collective:
                import torch.distributed as dist
                dist.barrier(group=g)

        fenced = False
        try:
            fence()                                                     # 1
            fenced = True
        finally:
            self._peer_tensors = self.buf_addrs = self.flag_addrs = None  # 2
            self.gat_addrs = self.ext_addrs = None
            gc.collect()
            try:
                if fenced:
                    fence()                                             # 3
            finally:
                self.buffer = self.flags = self.state = None            # 4
                self.gather = self.flags2 = self.aux = None
                gc.collect()
                if cuda:
                    torch.cuda.ipc_collect()

    def _live(self) -> None:
        if self.closed:
            raise RuntimeError(f"PeerBuffers of rank {self.rank} of {self.world} are closed "
                               "(close() unmapped the peers and freed the buffers); create "
                               "new ones")

    def next_input_slot_sync(self, T: int) -> torch.Tensor:
        """(T, H) view of this rank's buffer slot the NEXT call reads, for a producer that
        writes its partial in place (then call with partial=None). Host sync (reads the device
        epoch); a kernel producer computes the slot on device from state[0] instead."""
        self._live()
        return self.buffer[(int(self.state[0]) + 1) & 1, :T]

    def _check_kernel(self, *ts: torch.Tensor) -> None:
        if not _tri.available(*ts, self.state):
            raise RuntimeError("the one-shot kernel needs Triton on CUDA tensors (or CPU "
                               "tensors under TRITON_INTERPRET=1)")

    def all_reduce_residual_norm(self, partial: torch.Tensor | None, residual: torch.Tensor,
                                 w: torch.Tensor | None, eps: float, *,
                                 new_residual: torch.Tensor | None = None,
                                 out: torch.Tensor | None = None,
                                 max_spins: int = _tri.DEFAULT_MAX_SPINS,
                                 two_shot: bool | None = None):
        """One call of the protocol -> (new_residual, normed or None), one-shot or two-shot
        (`uses_two_shot`). Every rank of the group must make the same sequence of calls with
        the same T (and so picks the same form). No host sync; capturable."""
        self._live()
        check_inputs(partial, residual, w, self.hidden, self.max_tokens, BUFFER_DTYPE)
        self._check_kernel(residual)
        rows = [t if t is None or t.stride(-1) == 1 else t.contiguous()
                for t in (partial, residual)]
        partial, residual = rows
        if new_residual is None:
            new_residual = torch.empty_like(residual, memory_format=torch.contiguous_format)
        if w is not None and out is None:
            out = torch.empty_like(new_residual)
        self._launch(partial, residual, w, eps, new_residual, out, max_spins, two_shot)
        return new_residual, (out if w is not None else None)

    def all_reduce(self, x: torch.Tensor, *, out: torch.Tensor | None = None,
                   max_spins: int = _tri.DEFAULT_MAX_SPINS,
                   two_shot: bool | None = None) -> torch.Tensor:
        """One call of the protocol without residual and norm: x (T, H) bf16 -> (T, H)
        round(Σ_q fp32(x_q)) in rank order (`allreduce_reference`), identical on every rank,
        written to `out` (rows stride 1) or a new tensor. Same call-sequence contract as
        all_reduce_residual_norm (the two share the epochs). No host sync; capturable."""
        self._live()
        check_rows("x", x, self.hidden, self.max_tokens, BUFFER_DTYPE)
        self._check_kernel(x)
        if x.stride(-1) != 1:
            x = x.contiguous()
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        elif out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1:
            raise ValueError(f"out of shape {tuple(out.shape)} {out.dtype} stride "
                             f"{out.stride()}; expected {tuple(x.shape)} {x.dtype} with "
                             "stride-1 rows")
        self._launch(x, None, None, 0.0, out, None, max_spins, two_shot)
        return out

    def uses_two_shot(self, T: int, two_shot: bool | None = None) -> bool:
        """The form a call of T rows runs: two_shot True / False forces it (True raises where
        the buffers have no two-shot form); None: two-shot from `two_shot_min_tokens` rows."""
        if two_shot is None:
            return self.two_shot_min_tokens is not None and T >= self.two_shot_min_tokens
        if two_shot and self.gather is None:
            raise ValueError(f"two_shot=True: these buffers have no two-shot form (hidden "
                             f"{self.hidden} over {self.world} ranks needs a multiple of the "
                             "world, and buffers from create / local_group)")
        return bool(two_shot)

    def _launch(self, partial, residual, w, eps, new_residual, out, max_spins, two_shot):
        if self.uses_two_shot(new_residual.shape[0], two_shot):
            _two.twoshot_triton(self.buf_addrs, self.flag_addrs, self.gat_addrs,
                                self.ext_addrs, self.state, self.rank, self.max_tokens,
                                partial, residual, w, eps, new_residual, out, max_spins)
        else:
            _tri.oneshot_triton(self.buf_addrs, self.flag_addrs, self.state, self.rank,
                                self.max_tokens, partial, residual, w, eps, new_residual, out,
                                max_spins)

    def check_timeouts(self) -> None:
        """Host sync: raise if any wait of this rank gave up (a peer never published)."""
        self._live()
        ep = int(self.state[2])
        if ep:
            raise RuntimeError(f"peer all-reduce: rank {self.rank} of {self.world} timed "
                               f"out waiting for its peers at epoch {ep}")


# ---- the Comm-style adapter -----------------------------------------------------------------

class OneShotComm:
    """Duck-typed `models.parallel.Comm` (kernels/ does not import models/). With `peers`:
    all_reduce of a bf16 (…, hidden) tensor of 1..max_tokens rows on the peers' device runs the
    one-shot kernel (`PeerBuffers.all_reduce`); every other all_reduce (fp32 MoE latents, other
    widths, more rows, no peers) and all_gather / dcp_all_gather go to the wrapped `base` comm
    unchanged. The routing depends only on shape and dtype, so every rank of a step routes
    each call the same way. all_reduce_residual_norm runs the fused kernel, or the all-gather
    fallback without peers. `par` and `dcp_group` are the base comm's.

    Build with `create` (collective), or `wrap` then `connect` (collective) when the hidden
    size is known only after the model that holds this comm was built. End with `close`."""

    def __init__(self, base, group=None, peers: PeerBuffers | None = None, *, world: int,
                 max_tokens: int = 0, hidden: int | None = None,
                 dtype: torch.dtype = BUFFER_DTYPE):
        self.base, self.group, self.peers, self.world = base, group, peers, world
        self.max_tokens, self.hidden, self.dtype = max_tokens, hidden, dtype
        self.closed = False

    @property
    def par(self):
        return self.base.par

    @property
    def dcp_group(self):
        return getattr(self.base, "dcp_group", None)

    @classmethod
    def wrap(cls, base, group=None) -> "OneShotComm":
        """Not connected yet: every collective goes to `base` until `connect`."""
        import torch.distributed as dist

        world = dist.get_world_size(group) if dist.is_initialized() else 1
        return cls(base, group, None, world=world)

    def connect(self, max_tokens: int, hidden: int, device: torch.device | str,
                dtype: torch.dtype = BUFFER_DTYPE, enable: bool = True) -> "OneShotComm":
        """Collective: open the one-shot buffers only if every rank enables it, is on CUDA,
        every pair is P2P-capable and the dtype is the buffers', then keep them only if the
        self-test call succeeded on every rank; both decisions are gathered, so all ranks
        agree. -> self."""
        import torch.distributed as dist

        self._live()
        if self.hidden is not None:
            raise RuntimeError(f"OneShotComm already connected (hidden={self.hidden}, "
                               f"max_tokens={self.max_tokens})")
        device = torch.device(device)
        self.max_tokens, self.hidden, self.dtype = max_tokens, hidden, dtype
        if self.world == 1:
            return self
        infos = [None] * self.world
        dist.all_gather_object(infos, device_info(device), group=self.group)
        mine = infos[dist.get_rank(self.group)]
        ok = bool(enable) and dtype == BUFFER_DTYPE and all(p2p_capable(mine, p) for p in infos)
        votes = [None] * self.world
        dist.all_gather_object(votes, ok, group=self.group)
        if not all(votes):
            return self
        peers = PeerBuffers.create(self.group, max_tokens, hidden, device)
        votes = [None] * self.world
        dist.all_gather_object(votes, self._self_test(peers), group=self.group)
        if all(v[0] for v in votes):
            self.peers = peers
            if not all(v[1] for v in votes):       # the two-shot failed somewhere: one-shot
                peers.two_shot_min_tokens = None
        else:
            peers.close()
        return self

    def _self_test(self, peers: PeerBuffers) -> tuple[bool, bool]:
        """(one-shot ok, two-shot ok): one call of each form on fresh buffers (they also
        compile the kernels before any step or graph capture): rank q contributes q + 1
        everywhere, so every element must be N(N+1)/2 (exact in bf16 for N ≤ 32) and no wait
        may have timed out; the two-shot call (T = min(max_tokens, two_shot_min_tokens) rows,
        zero residual, unit norm weight) must also give a normed row of ones (within a bf16
        step). Never raises: a failure
        on any rank keeps every rank on the base comm (one-shot) or off the two-shot (with a
        warning)."""
        import warnings

        want = self.world * (self.world + 1) // 2
        results = []
        for two in (False, True):
            if two and peers.two_shot_min_tokens is None:
                results.append(False)
                break
            try:
                T = min(peers.max_tokens, peers.two_shot_min_tokens) if two else 1
                x = torch.full((T, peers.hidden), float(peers.rank + 1), dtype=BUFFER_DTYPE,
                               device=peers.device)
                if two:
                    zero = torch.zeros_like(x)
                    w = torch.ones(peers.hidden, device=peers.device)
                    y, normed = peers.all_reduce_residual_norm(
                        x, zero, w, 1e-6, max_spins=SELF_TEST_MAX_SPINS, two_shot=True)
                else:
                    y = peers.all_reduce(x, max_spins=SELF_TEST_MAX_SPINS, two_shot=False)
                    normed = None
                torch.cuda.synchronize(peers.device)
                peers.check_timeouts()
                ok = bool((y == want).all()) and (normed is None or bool(
                    ((normed.float() - 1.0).abs() <= 2 ** -7).all()))
                why = "" if ok else f"got {y.float().unique()[:4].tolist()}, expected {want}"
            except Exception as e:       # a compile or launch error: fall back, never hang
                ok, why = False, f"{type(e).__name__}: {e}"
            if not ok:
                warnings.warn(f"{'two' if two else 'one'}-shot all-reduce self-test failed on "
                              f"rank {peers.rank} ({why}); every rank keeps "
                              f"{'the one-shot' if two else 'the base comm'}", RuntimeWarning,
                              stacklevel=3)
            results.append(ok)
            if not ok:
                break
        results += [False] * (2 - len(results))
        return results[0], results[1]

    @classmethod
    def create(cls, base, group, max_tokens: int, hidden: int, device: torch.device | str,
               dtype: torch.dtype = BUFFER_DTYPE, enable: bool = True) -> "OneShotComm":
        """Collective: `wrap` + `connect`."""
        return cls.wrap(base, group).connect(max_tokens, hidden, device, dtype, enable)

    def close(self) -> None:
        """Collective when peers are open (`PeerBuffers.close`: drop the CUDA graphs that
        captured the kernel first); idempotent. The base comm stays open (its owner destroys
        the process group); every later call of this comm raises RuntimeError."""
        if self.closed:
            return
        self.closed = True
        if self.peers is not None:
            self.peers.close()

    def check_timeouts(self) -> None:
        """Host sync when connected: raise if a one-shot wait of this rank gave up (its
        result was wrong); nothing to check on the base comm."""
        if self.peers is not None and not self.closed:
            self.peers.check_timeouts()

    def _live(self) -> None:
        if self.closed:
            raise RuntimeError("OneShotComm is closed (close() released the one-shot buffers); "
                               "build a new comm")

    def _oneshot_fits(self, x: torch.Tensor) -> bool:
        p = self.peers
        return (p is not None and x.dtype == BUFFER_DTYPE and x.dim() >= 1
                and x.shape[-1] == self.hidden and x.device == p.device
                and 1 <= x.numel() // self.hidden <= self.max_tokens)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Σ over the group; the one-shot result is round(Σ_q fp32(x_q)) in rank order."""
        self._live()
        if self._oneshot_fits(x):
            return self.peers.all_reduce(x.reshape(-1, self.hidden)).view(x.shape)
        return self.base.all_reduce(x)

    def all_gather(self, x, dim: int = -1):
        self._live()
        return self.base.all_gather(x, dim)

    def dcp_all_gather(self, x, dim: int = 0):
        self._live()
        return self.base.dcp_all_gather(x, dim)

    def all_reduce_residual_norm(self, partial: torch.Tensor, residual: torch.Tensor,
                                 w: torch.Tensor | None, eps: float):
        """-> (new_residual, RMSNorm(new_residual; w) or None), identical on every rank."""
        self._live()
        if self.hidden is None:
            raise RuntimeError("OneShotComm is not connected: call connect(max_tokens, hidden, "
                               "device) first")
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


__all__ = ["BUFFER_DTYPE", "DeviceInfo", "OneShotComm", "PeerBuffers", "allreduce_reference",
           "allreduce_residual_norm_reference", "check_inputs", "check_rows", "device_info",
           "p2p_capable", "rms_norm_reference"]
