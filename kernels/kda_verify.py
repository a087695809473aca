"""KDA verify step for speculative decoding: T = k + 1 consecutive tokens of each of B sequences
through the fused KDA decode math (kernels/kda_decode.py, one token after the other), with the
state after EVERY position written to a per-position slot instead of the sequence's own slot.

Inputs as `kda_decode`, except:
    proj (B·T, P)        rows b·T + j = token j of sequence b ([anchor, d_1 … d_k]), in order
    slots (B,)           each sequence's state row in the pool (conv_state, rec_state): READ only
    pos_conv (N, 3C, W−1) model dtype, pos_rec (N, h, d, d) fp32, N ≥ B·T: the per-position
                         slots; row b·T + j holds sequence b's conv tail and recurrent state
                         after its positions 0 … j (what `kda_decode` would leave in the slot
                         after feeding those j + 1 tokens one at a time)
    -> out (B·T, C): row b·T + j is the decode output of token j

Accepting a_b drafts of sequence b keeps its positions 0 … a_b: `kda_verify_commit` copies
per-position row b·T + a_b into slot slots[b] for every KDA layer at once (two index copies per
state tensor, device indices, no host sync, capturable). Nothing is recomputed, and a rejected
suffix never touched the slot.

Layers (STYLE §6): `kda_verify_reference` is the PyTorch reference (kda_decode_reference per
position on a copy of the slots' state), `kda_verify` the public op and dispatch point (the
two Triton kernels of kernels/kda_verify_triton.py on CUDA bf16, else the reference).

Memory: per-position slots cost T times a KDA slot per verifying sequence (K3: 28.1 MB per
slot at TP16, 56.2 MB at TP8; k = 7, 8 sequences: 1.8 GB / 3.6 GB per rank), counted by
`per_position_bytes` (the capacity planner and the spec graphs' allocation use it).
"""
from __future__ import annotations

import torch

from raydecode.kernels import kda_decode as _dec
from raydecode.kernels import kda_verify_triton as _tri

MAX_POSITIONS = 16        # T = k + 1 the kernel unrolls (DSpark's published k is 7)


def _use_triton(proj: torch.Tensor) -> bool:
    return proj.is_cuda and proj.dtype == torch.bfloat16 and _tri.available(proj)


def kda_verify_reference(proj, fb_w, conv_state, conv_w, exp_a, dt_bias, o_norm_w, rec_state,
                         pos_conv, pos_rec, slots, *, positions: int, heads: int,
                         head_dim: int, lower_bound: float, eps: float,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """The op in PyTorch (module docstring): per position, `kda_decode_reference` of the B
    sequences' token j on a copy of their state, the copy stored after each position."""
    B, T = slots.shape[0], positions
    idx = slots.long()
    cs = conv_state.index_select(0, idx)          # copies: the slots stay untouched
    rs = rec_state.index_select(0, idx)
    rows = proj.reshape(B, T, proj.shape[1])
    res = []
    for j in range(T):
        res.append(_dec.kda_decode_reference(
            rows[:, j], fb_w, cs, conv_w, exp_a, dt_bias, o_norm_w, rs, heads=heads,
            head_dim=head_dim, lower_bound=lower_bound, eps=eps))
        at = torch.arange(B, device=proj.device) * T + j
        pos_conv.index_copy_(0, at, cs)
        pos_rec.index_copy_(0, at, rs)
    y = torch.stack(res, 1).reshape(B * T, heads * head_dim)
    if out is None:
        return y
    out.copy_(y)
    return out


def _check(proj, fb_w, conv_state, conv_w, exp_a, dt_bias, o_norm_w, rec_state, pos_conv,
           pos_rec, slots, positions, heads, head_dim, out) -> None:
    """As kda_decode's `_check` for one token per sequence, plus the verify shapes; ValueError
    naming the offending input."""
    if isinstance(positions, bool) or not isinstance(positions, int) \
            or not 1 <= positions <= MAX_POSITIONS:
        raise ValueError(f"positions={positions!r}: expected an int in [1, {MAX_POSITIONS}] "
                         "(k + 1 verify tokens per sequence)")
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots of shape {tuple(slots.shape)} dtype {slots.dtype}: expected "
                         "(B,) int32 or int64, one state row per sequence")
    B, T = slots.shape[0], positions
    if proj.dim() != 2 or proj.shape[0] != B * T:
        raise ValueError(f"proj of shape {tuple(proj.shape)}: expected (B·T, P) = "
                         f"({B * T}, P) for {B} sequences of {T} positions")
    # one row per sequence through the decode op's checks (shapes, dtypes, slot values)
    _dec._check(proj[::T], fb_w, conv_state, conv_w, exp_a, dt_bias, o_norm_w, rec_state,
                heads, head_dim, None, slots)
    C, W = heads * head_dim, conv_w.shape[1]
    want = {"pos_conv": (pos_conv, (3 * C, W - 1), conv_state.dtype),
            "pos_rec": (pos_rec, (heads, head_dim, head_dim), torch.float32)}
    for name, (x, shape, dtype) in want.items():
        if x.dim() != 1 + len(shape) or tuple(x.shape[1:]) != shape or x.shape[0] < B * T \
                or x.dtype != dtype or x.device != proj.device:
            raise ValueError(f"{name} of shape {tuple(x.shape)} {x.dtype} on {x.device}: "
                             f"expected (N ≥ {B * T}, {', '.join(map(str, shape))}) {dtype} on "
                             f"{proj.device}")
    if out is not None and (tuple(out.shape) != (B * T, C) or out.dtype != proj.dtype):
        raise ValueError(f"out of shape {tuple(out.shape)} {out.dtype}: expected "
                         f"({B * T}, {C}) {proj.dtype}")


def kda_verify(proj, fb_w, conv_state, conv_w, exp_a, dt_bias, o_norm_w, rec_state, pos_conv,
               pos_rec, slots, *, positions: int, heads: int, head_dim: int,
               lower_bound: float, eps: float, out: torch.Tensor | None = None,
               splits: int | None = None) -> torch.Tensor:
    """The public op (module docstring) -> out (B·T, heads·head_dim); per-position rows
    [0, B·T) of pos_conv / pos_rec written, the slots' state unchanged. On CUDA bf16: two
    kernels, no host sync (capturable after an eager warm-up)."""
    _check(proj, fb_w, conv_state, conv_w, exp_a, dt_bias, o_norm_w, rec_state, pos_conv,
           pos_rec, slots, positions, heads, head_dim, out)
    kw = dict(positions=positions, heads=heads, head_dim=head_dim, lower_bound=lower_bound,
              eps=eps)
    if _use_triton(proj):
        if out is None:
            out = proj.new_empty(proj.shape[0], heads * head_dim)
        return _tri.kda_verify_triton(proj, fb_w, conv_state, conv_w, exp_a, dt_bias,
                                      o_norm_w, rec_state, out, pos_conv, pos_rec, slots,
                                      splits=splits, **kw)
    return kda_verify_reference(proj, fb_w, conv_state, conv_w, exp_a, dt_bias, o_norm_w,
                                rec_state, pos_conv, pos_rec, slots, out=out, **kw)


def kda_verify_commit(conv: torch.Tensor, rec: torch.Tensor, pos_conv: torch.Tensor,
                      pos_rec: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor,
                      positions: int) -> None:
    """Every KDA layer at once: slot slots[b] ← per-position row b·T + keep[b], where keep[b]
    = accepted drafts of sequence b (its positions 0 … keep[b] are kept).

    conv (L, S, 3C, W−1), rec (L, S, h, d, d): the cache (models/cache.py KDAStateCache);
    pos_conv (L, N, 3C, W−1), pos_rec (L, N, h, d, d); slots, keep (B,) int64 device tensors
    (values in range: a caller invariant, a check would sync)."""
    src = torch.arange(slots.shape[0], device=slots.device) * positions + keep
    conv.index_copy_(1, slots, pos_conv.index_select(1, src))
    rec.index_copy_(1, slots, pos_rec.index_select(1, src))


def per_position_bytes(slot_bytes: int, seqs: int, num_drafts: int) -> int:
    """Per-position slots of `seqs` verifying sequences at k = num_drafts: (k + 1) KDA slots
    each (slot_bytes: one slot over every KDA layer, engine/step_graph.py `scratch_bytes`)."""
    return int(slot_bytes) * int(seqs) * (int(num_drafts) + 1)


__all__ = ["MAX_POSITIONS", "kda_verify", "kda_verify_commit", "kda_verify_reference",
           "per_position_bytes"]
