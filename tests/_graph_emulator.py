"""A CUDA-graph stand-in for CPU tests: a captured piece is the list of ATen operations the
code dispatched while it was open, and a replay runs them again on the same tensor objects.

What a real graph does that this keeps: a replay re-executes fixed operations on fixed
storage. An operation's fresh output is written back into the tensor the capture returned
(the graph's fixed address), in-place and `out=` operations write their operands again, views
keep aliasing their bases; values that were host data at capture time (a Python int turned
into a tensor, a `torch.tensor` of a list) stay what they were then. So code that is wrong to
capture — whose per-token work reads the batch's layout on the host, or that allocates in one
piece what another piece reads without holding it — replays to other values than the eager
step, and the test comparing them fails. What it cannot see: kernels that misbehave under
capture on a GPU, and memory-pool reuse (a freed capture tensor is kept alive here); the GPU
tests cover those.

Refused while a piece is open, as on a GPU: a read of a tensor's value on the host
(`.item()`, `bool()`, `torch.equal`, a data-dependent shape such as `nonzero` or `unique`).
`.tolist()` reads the data without an operation a mode sees: tests/gpu's no-sync test
catches that one.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from raydecode.models.layers import situ

# a replay cannot re-run these: their output shape or a host value depends on tensor data
# (under inference mode `.item()` and `bool()` reach a mode as item / is_nonzero)
_aten = torch.ops.aten
_HOST_READS = {_aten._local_scalar_dense.default, _aten.item.default,
               _aten.is_nonzero.default, _aten.equal.default, _aten.nonzero.default,
               _aten._unique2.default, _aten.unique_dim.default,
               _aten.unique_consecutive.default, _aten.masked_select.default}


class CaptureError(RuntimeError):
    pass


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS:
            raise CaptureError(f"{func} reads tensor data on the host under capture")
        out = func(*args, **kwargs)
        # which outputs share storage with an input (views, in-place and out= results): their
        # storage is written by re-running the op; the others (fresh tensors, also the copies
        # a `reshape` or `to` makes despite their alias annotation) are written back
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        fresh = [isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs
                 for o in tree_flatten(out)[0]]
        self.ops.append((func, args, kwargs, out, fresh))
        return out


class EmulatedPiece:
    def __init__(self, ops: list):
        self.ops = ops

    def replay(self) -> None:
        for func, args, kwargs, out, fresh in self.ops:
            new = func(*args, **kwargs)
            for o, n, f in zip(tree_flatten(out)[0], tree_flatten(new)[0], fresh):
                if not f:
                    continue
                if o.shape != n.shape:
                    raise CaptureError(f"{func}: output shape {tuple(n.shape)} at replay, "
                                       f"{tuple(o.shape)} at capture")
                o.copy_(n)

    def __len__(self) -> int:
        return len(self.ops)


class EmulatedGraphs:
    """engine/piecewise.py's GraphBackend on recorded operations; `pieces` lists every piece
    captured (tests count them)."""

    def __init__(self):
        self._rec: _Recorder | None = None
        self.pieces: list[EmulatedPiece] = []

    def begin(self) -> None:
        assert self._rec is None, "a piece is already open"
        self._rec = _Recorder()
        self._rec.__enter__()

    def end(self) -> EmulatedPiece:
        rec, self._rec = self._rec, None
        rec.__exit__(None, None, None)
        piece = EmulatedPiece(rec.ops)
        self.pieces.append(piece)
        return piece

    def abort(self) -> None:
        if self._rec is not None:
            rec, self._rec = self._rec, None
            rec.__exit__(None, None, None)


def capture(fn):
    """fn() recorded as one piece -> (its output, the piece)."""
    g = EmulatedGraphs()
    g.begin()
    try:
        out = fn()
    except BaseException:
        g.abort()
        raise
    return out, g.end()


_DENSE: dict = {}


def gathered_moe(z, weights, ids, experts, path="stock", options=None, out=None):
    """Σ_k w·expert(z) (T, L) fp32 with every pair's expert gathered from the dequantized
    stack: kernels/moe_mxfp4.py `moe_mxfp4_reference`'s math without its host read of the
    unique ids. The stack is dequantized once per layer (its validity check reads the scales
    on the host), at the first call: an eager step, before any capture. out: written into,
    as kernels/moe_decode.py `routed_moe` does."""
    key = (experts.w13.data_ptr(), z.dtype)
    if key not in _DENSE:     # the codes held too: their storage (the key) is never reused
        _DENSE[key] = (experts.w13, experts.dequantized(z.dtype))
    w1, w3, w2 = _DENSE[key][1]                        # (E, I, L), (E, I, L), (E, L, I)
    T, k = ids.shape
    flat = ids.reshape(-1)
    h = z.repeat_interleave(k, 0)                      # (P, L)
    a = situ(torch.einsum("pl,pil->pi", h, w1[flat]), torch.einsum("pl,pil->pi", h, w3[flat]),
             experts.beta, experts.linear_beta)
    y = torch.einsum("pi,pli->pl", a, w2[flat])        # (P, L)
    r = (y.float().view(T, k, -1) * weights.float().unsqueeze(-1)).sum(1)
    return r if out is None else out.copy_(r)
