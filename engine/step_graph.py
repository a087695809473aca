"""One CUDA graph per batch bucket for the whole specialized decode step (DESIGN §4, lever 5).
On by default for CUDA ranks (`setting`, `resolve`: RAYDECODE_STEP_GRAPHS unset; '0' turns them
off, '1' forces them); measured on H200 in docs/PERF.md.

A graph replays fixed kernels on fixed addresses, so everything the decode-only specialized
forward reads per step lives in preallocated device tensors of one bucket B (`StepStatics`):
    tokens (B,) int64, slots (B,) int64                     one (2, B) int64 buffer
    table (B, W) int32, store (B,) int32, seq_lens (B,) int32   one int32 buffer, decode_meta's
                                                                layout; W = max_blocks, fixed
While `caches.statics` is set (models/cache.py), the fused MLA decode reads (table, store,
seq_lens) and the fused KDA decode reads slots from it, instead of building them from the batch
(models/mla.py `decode_meta`, models/kda.py `slot_index`); a layer that cannot run fused raises.
Nothing else in the step depends on host values (the kernels capture: scripts/bench/layer*.py).

Padding: a step of T sequences runs in the smallest bucket B ≥ T; rows T..B-1 are scratch rows
that never touch a real sequence. Row T+i uses KDA slot `scratch.slots[i]` (the fused KDA op
needs distinct slots, so one scratch slot per padded row: max_padding(BUCKETS) = 31) and an MLA
table row made of the one scratch block, at position PAD_POS. The cache builder appends them:
`graph_cache_sizes(num_slots, num_blocks)` gives the slot and block counts to allocate, the
scheduler still hands out only slots < num_slots and blocks < num_blocks. Memory (K3, 69 KDA
layers of 96 heads × 128², conv 4; 24 MLA layers, latent 576 bf16): one KDA slot is
69·(h_local·128²·4 + 3·h_local·128·3·2) B = 28.1 MB at TP16 (h_local 6), 56.2 MB at TP8, so
31 scratch slots cost 0.87 GB per rank at TP16 and 1.74 GB at TP8; the scratch block costs
24·block_size·576·2 B (1.8 MB at block_size 64). `scratch_bytes` computes it for any config.

Per step on the host: the T rows' values into pinned staging, then at most three non-blocking
copies (store/seq_lens, tokens/slots, and the span of table rows whose block list changed since
the bucket's last step), then the replay. Logits are computed for all B rows in the graph (the
lm_head GEMV reads the same weights at B = 1..64) and the first T returned.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from raydecode.kernels import kda_decode as kda_decode_op
from raydecode.kernels import settings
from raydecode.models.cache import ModelCaches, SeqSlice, StepBatch
from raydecode.models.decode_plan import BUCKETS     # the plan's batch buckets (DESIGN §3)

from .piecewise import (Buffers, CudaPieces, MixedSeq, SingleSeq, StockGraph,
                        capture_stock_graph, check_replay)
from .runner import ModelRunner
from .scheduler import StepPlan

ENV = "RAYDECODE_STEP_GRAPHS"
PAD_POS = 1          # scratch rows' position: > 0 as the fused KDA path needs
_PAD = object()      # a table row holding the scratch block only


def setting() -> bool | None:
    """RAYDECODE_STEP_GRAPHS: '1' on, '0' off, unset or '' -> None: auto (`resolve`)."""
    return settings.step_graphs()


def resolve(step_graphs: bool | None, device) -> bool:
    """Whether a rank on `device` builds a GraphedRunner: the setting, or for auto (None) on
    a CUDA device. Auto then keeps the runner only where the model is supported
    (actors/rank_worker.py `load_runner`); '1' keeps it anyway (stock where unsupported)."""
    return torch.device(device).type == "cuda" if step_graphs is None else bool(step_graphs)


def check_buckets(buckets) -> tuple[int, ...]:
    b = tuple(buckets)
    if not b or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in b) \
            or list(b) != sorted(set(b)):
        raise ValueError(f"buckets {b!r}: expected strictly ascending positive ints, "
                         f"e.g. {BUCKETS}")
    return b


def bucket_for(num_seqs: int, buckets=BUCKETS) -> int | None:
    """The smallest bucket ≥ num_seqs, None above the largest."""
    return next((b for b in buckets if b >= num_seqs), None)


def max_padding(buckets=BUCKETS) -> int:
    """Most padded rows any step needs: bucket b serves T ≥ (previous bucket) + 1."""
    prev = [0] + list(buckets[:-1])
    return max(b - p - 1 for b, p in zip(buckets, prev))


@dataclass(frozen=True)
class ScratchRows:
    """KDA slots [num_slots, num_slots + count) and MLA block num_blocks: padded rows only."""
    num_slots: int       # real slots are [0, num_slots)
    count: int
    block: int           # = the number of real blocks

    @property
    def slots(self) -> range:
        return range(self.num_slots, self.num_slots + self.count)


def graph_cache_sizes(num_slots: int, num_blocks: int, buckets=BUCKETS) -> tuple[int, int]:
    """(KDA slots, MLA blocks) the cache builder allocates when step graphs are on."""
    return num_slots + max_padding(check_buckets(buckets)), num_blocks + 1


def scratch_bytes(cfg, par, block_size: int, dtype: torch.dtype = torch.bfloat16,
                  buckets=BUCKETS) -> dict[str, int]:
    """Bytes per rank the scratch rows add: {'kda_slots', 'mla_block', 'per_kda_slot'}."""
    el = torch.empty((), dtype=dtype).element_size()
    per_slot = 0
    if cfg.kda_layer_ids:
        h, d = par.shard(cfg.kda.num_heads, "KDA num_heads"), cfg.kda.head_dim
        per_slot = len(cfg.kda_layer_ids) * (h * d * d * 4 + 3 * h * d * (cfg.kda.conv_size - 1)
                                             * el)
    mla = len(cfg.mla_layers) * block_size * cfg.mla.latent_dim * el
    return {"per_kda_slot": per_slot, "kda_slots": per_slot * max_padding(buckets),
            "mla_block": mla}


class StepStatics:
    """The per-step inputs of a bucket-B decode step in fixed device tensors (module docstring).
    `fill` runs outside any capture; the model reads the tensors while caches.statics is it."""

    def __init__(self, bucket: int, max_blocks: int, scratch: ScratchRows, block_size: int,
                 dcp_rank: int = 0, dcp_size: int = 1, device="cpu"):
        B, W = bucket, max_blocks
        self.bucket, self.max_blocks, self.scratch = B, W, scratch
        self.block_size, self.dcp_rank, self.dcp_size = block_size, dcp_rank, dcp_size
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        n32 = B * W + 2 * B
        self._d32 = torch.zeros(n32, dtype=torch.int32, device=self.device)
        self._d64 = torch.empty(2, B, dtype=torch.int64, device=self.device)
        self._h32 = torch.empty(n32, dtype=torch.int32, pin_memory=self._cuda)
        self._h64 = torch.empty(2, B, dtype=torch.int64, pin_memory=self._cuda)
        self.table = self._d32[:B * W].view(B, W)              # (B, W) block ids
        self.store = self._d32[B * W:B * W + B]                # (B,) local row index or −1
        self.seq_lens = self._d32[B * W + B:]                  # (B,) rows ≤ p on this rank
        self.tokens, self.slots = self._d64[0], self._d64[1]   # (B,) each
        self._rows: list = [None] * B      # what table row t holds: _PAD or (list, len)
        self._copied: torch.cuda.Event | None = None
        self._idle: list[int] = []         # fill_idle's slots

    def fill(self, plan: StepPlan, block_tables: dict[int, list[int]] | None) -> None:
        """Copy a decode-only plan of T ≤ B sequences in (rows T..B-1: scratch). block_tables:
        the rank's slot -> block ids (after the plan's updates), None for a model without MLA.
        Waits for the previous fill's copy (an event long complete in serving)."""
        B, T, sc = self.bucket, plan.num_seqs, self.scratch
        if not 1 <= T <= B:
            raise ValueError(f"step {plan.step_id}: {T} sequences for bucket {B}; expected "
                             f"1..{B}")
        if len(plan.tokens) != T:
            raise ValueError(f"step {plan.step_id}: {len(plan.tokens)} tokens for {T} "
                             "sequences; a graph-shaped step is decode-only (one token each)")
        rows = []
        for t, s in enumerate(plan.batch.seqs):
            if s.length != 1 or s.start != t:
                raise ValueError(f"step {plan.step_id}: sequence {s} is not a decode token at "
                                 f"row {t}; graph-shaped steps are decode-only")
            if not 0 <= s.slot < sc.num_slots:
                raise ValueError(f"step {plan.step_id}: slot {s.slot} outside the real slots "
                                 f"[0, {sc.num_slots}) (slots ≥ {sc.num_slots} are scratch)")
            tbl = None if block_tables is None else block_tables.get(s.slot)
            if block_tables is not None and tbl is None:
                raise ValueError(f"step {plan.step_id}: slot {s.slot} has no block table")
            rows.append((plan.tokens[t], s.slot, s.pos, tbl))
        if len({r[1] for r in rows}) != T:
            raise ValueError(f"step {plan.step_id}: slots {[r[1] for r in rows]} repeat; each "
                             "sequence owns its slot")
        pads = [(0, slot, PAD_POS, _PAD) for slot in sc.slots[:B - T]]
        self._write(rows + pads, block_tables is not None, plan.step_id)

    def fill_idle(self, slots: list[int]) -> None:
        """Warm-up / capture rows on idle slots (no live sequence): every row at PAD_POS on the
        scratch block, row t on slots[t] (B distinct slots)."""
        assert len(slots) == self.bucket == len(set(slots)), (slots, self.bucket)
        self._idle = list(slots)
        self._write([(0, s, PAD_POS, _PAD) for s in slots], True, "idle")

    def padded_batch(self, plan: StepPlan | None) -> StepBatch:
        """The StepBatch the model sees for a filled bucket: the plan's T decode tokens, then
        B - T scratch tokens at PAD_POS (plan None: `fill_idle`'s rows)."""
        seqs = list(plan.batch.seqs) if plan is not None else []
        slots = self._idle if plan is None else list(self.scratch.slots)
        seqs += [SeqSlice(slot=slots[i], start=len(seqs) + i, length=1, pos=PAD_POS)
                 for i in range(self.bucket - len(seqs))]
        return StepBatch(seqs)

    def _write(self, rows: list[tuple], paged: bool, step) -> None:
        """rows: B × (token, slot, pos, table list | _PAD) -> staging -> device."""
        B, W, bs, sc = self.bucket, self.max_blocks, self.block_size, self.scratch
        D, r = self.dcp_size, self.dcp_rank
        # every row is checked before the staging is touched: a refused fill changes nothing
        stores, lens, todo = [], [], []        # todo: (row, table) to copy again
        for t, (_, slot, p, tbl) in enumerate(rows):
            n = (p + D - r) // D                   # rows of positions ≤ p on this rank
            stores.append(p // D if p % D == r else -1)
            lens.append(n)
            if not paged:
                continue
            held = self._rows[t]
            if tbl is _PAD:
                if held is not _PAD:
                    todo.append((t, _PAD))
                continue
            if len(tbl) > W or -(-n // bs) > len(tbl):
                raise (ValueError if len(tbl) > W else RuntimeError)(
                    f"step {step}: slot {slot} at position {p} with {len(tbl)} cache blocks; "
                    f"expected ⌈{n}/{bs}⌉ ≤ blocks ≤ max_blocks = {W}")
            if held is _PAD or held is None or held[0] is not tbl or held[1] != len(tbl):
                if tbl and (min(tbl) < 0 or max(tbl) >= sc.block):
                    raise ValueError(f"step {step}: slot {slot}'s blocks {tbl} leave the real "
                                     f"blocks [0, {sc.block}) (block {sc.block} is scratch)")
                todo.append((t, tbl))
        if self._copied is not None:
            self._copied.synchronize()     # the staging is read by the previous copy
        ht = self._h32[:B * W].view(B, W)
        for t, tbl in todo:
            if tbl is _PAD:
                ht[t] = sc.block
                self._rows[t] = _PAD
            else:
                ht[t, :len(tbl)] = torch.tensor(tbl, dtype=torch.int32)
                ht[t, len(tbl):] = sc.block
                self._rows[t] = (tbl, len(tbl))     # the list is held: its id stays unique
        changed = [t for t, _ in todo]
        self._h32[B * W:] = torch.tensor(stores + lens, dtype=torch.int32)
        self._h64.copy_(torch.tensor([[row[0] for row in rows], [row[1] for row in rows]],
                                     dtype=torch.int64))
        nb = self._cuda
        if changed:
            lo, hi = min(changed) * W, (max(changed) + 1) * W
            self._d32[lo:hi].copy_(self._h32[lo:hi], non_blocking=nb)
        self._d32[B * W:].copy_(self._h32[B * W:], non_blocking=nb)
        self._d64.copy_(self._h64, non_blocking=nb)
        if self._cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()


def graph_support(model, caches: ModelCaches) -> tuple[bool, str]:
    """Whether every layer of `model` runs the fused decode on `caches` (what a graph-shaped
    step needs), the reason if not. Per-step conditions are the runner's (`why_not`)."""
    ok, why = getattr(model, "specialized_support", (False, "model has no specialized step"))
    if not ok:
        return False, why
    cfg, dtype = model.cfg, model.dtype
    if caches.mla is not None:
        if dtype != torch.bfloat16 or caches.mla.pool.dtype != torch.bfloat16:
            return False, (f"model dtype {dtype}, MLA pool {caches.mla.pool.dtype}: the fused "
                           "MLA decode needs bf16")
        if not cfg.mla.use_output_gate:
            return False, "the fused MLA decode needs the output gate (mla_use_output_gate)"
    if caches.kda is not None:
        if cfg.kda.head_dim not in kda_decode_op.HEAD_DIMS or cfg.kda.conv_size < 2:
            return False, (f"KDA head_dim {cfg.kda.head_dim}, conv {cfg.kda.conv_size}: the "
                           f"fused op takes head_dim in {kda_decode_op.HEAD_DIMS}, conv ≥ 2")
        if caches.kda.conv.dtype != dtype:
            return False, f"KDA conv state {caches.kda.conv.dtype} ≠ model dtype {dtype}"
    return True, "ok"


def mixed_parts(batch: StepBatch):
    """(the prompt chunk, the one-token continuations) of a mixed step that a mixed-step
    graph serves: exactly one sequence of ≥ 2 tokens and at least one other, every other one
    token at pos > 0 (what models/kda.py `_core` steps as a decode row); else None."""
    chunks = [s for s in batch.seqs if s.length >= 2]
    rest = [s for s in batch.seqs if s.length < 2]
    if len(chunks) != 1 or not rest or any(s.length != 1 or s.pos <= 0 for s in rest):
        return None
    return chunks[0], rest


SINGLE_MIN_BUCKET = 2    # the smallest bucket with a single-sequence graph (`capture_stock`)
MIXED_MIN_BUCKET = 4     # ... with a mixed-step graph (a ≥ 2-token chunk and ≥ 1 continuation)
PAD_MAX = 8192           # the largest padded stock step (tokens); above it a step runs as is


def host_bound_experts(model) -> str | None:
    """Why `model`'s routed experts cannot be captured in a graph (bf16 experts loop over the
    selected experts on the host), or None."""
    if any(hasattr(m, "mxfp4") and not m.mxfp4 for m in model.modules()):
        return ("bf16 routed experts loop over experts on the host (not capturable); graphs "
                "need MXFP4 experts")
    return None


def resolve_pad(pad_prefill: bool | None, device) -> bool:
    """Whether a runner on `device` pads its stock steps: `pad_prefill`, or where None the
    RAYDECODE_PAD_PREFILL setting, or where that is unset whether the device is CUDA (the
    first run of an unwarmed eager shape costs up to 2.4x its steady time there): the same
    auto rule as the step graphs' (`resolve`)."""
    return resolve(settings.pad_prefill() if pad_prefill is None else pad_prefill, device)


def prefill_bucket(tokens: int, cap: int = PAD_MAX) -> int | None:
    """The token bucket a padded stock step of `tokens` runs in: the next power of two up to
    256, then the next multiple of 256, up to `cap`; None above `cap` (the step runs as is).
    Padding costs ≤ 2× tokens below 256 (where the step is host-bound) and < 256 tokens
    above (≤ 12.5 % from 2,048)."""
    if tokens < 1:
        raise ValueError(f"{tokens} tokens: a step has at least one")
    b = 1 << (tokens - 1).bit_length() if tokens <= 256 else -(-tokens // 256) * 256
    return b if b <= cap else None


def prefill_buckets(budget: int, cap: int = PAD_MAX) -> list[int]:
    """Every bucket a step of 1..budget tokens pads to (what the build warms)."""
    buckets = {prefill_bucket(t, cap) for t in range(1, min(budget, cap) + 1)}
    return sorted(b for b in buckets if b is not None)


def unpadded_buckets(budget: int) -> list[int]:
    """The token counts an unpadded rank warms: the powers of two below the budget, and the
    budget (every step of 1..budget tokens then shares its compiled kernels with one of them:
    no kernel of the stock step specializes on finer ranges)."""
    if budget < 1:
        raise ValueError(f"budget {budget}: expected ≥ 1 token")
    return [1 << i for i in range(budget.bit_length()) if 1 << i < budget] + [budget]


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    logits: torch.Tensor              # (B, V) fp32, rewritten by every replay


class GraphedRunner(ModelRunner):
    """ModelRunner whose decode-only specialized steps of ≤ max(buckets) sequences run
    graph-shaped: statics of the bucket filled, then on CUDA one graph replay per step
    (captured at `capture_all` or on the bucket's first step, after an eager warm-up that is
    that step), on CPU the same statics path eagerly. Every other plan runs ModelRunner.run.
    A bucket whose capture raises keeps running eagerly on the statics (`capture_failed`
    says why; `ready` is False for it, so the coordinator's envelope can choose stock).

    The caches must hold the scratch rows: built with `graph_cache_sizes(num_slots,
    num_blocks)`; num_slots / num_blocks are the counts the scheduler allocates from."""

    def __init__(self, model, caches: ModelCaches, device="cpu", *, num_slots: int,
                 num_blocks: int, max_blocks: int | None = None, buckets=BUCKETS,
                 capture: bool | None = None, pad_prefill: bool | None = None,
                 prefill_budget: int | None = None, stock_graphs: int | None = None,
                 stock_backend=None, stock_single: bool | None = None,
                 stock_mixed: bool | None = None):
        super().__init__(model, caches, device)
        self.buckets = check_buckets(buckets)
        need_slots, need_blocks = graph_cache_sizes(num_slots, num_blocks, self.buckets)
        have = (caches.kda.conv.shape[1] if caches.kda is not None else need_slots,
                caches.mla.pool.shape[1] if caches.mla is not None else need_blocks)
        if num_slots < 1 or num_blocks < 1 or have[0] < need_slots or have[1] < need_blocks:
            raise ValueError(f"caches with {have[0]} KDA slots and {have[1]} MLA blocks for "
                             f"num_slots={num_slots}, num_blocks={num_blocks}: step graphs "
                             f"need {need_slots} slots and {need_blocks} blocks (the scratch "
                             "rows; build the caches with graph_cache_sizes)")
        self.max_blocks = num_blocks if max_blocks is None else max_blocks
        if isinstance(self.max_blocks, bool) or not isinstance(self.max_blocks, int) \
                or not 1 <= self.max_blocks <= num_blocks:
            raise ValueError(f"max_blocks={max_blocks!r}: expected an int in [1, {num_blocks}]"
                             " (⌈⌈max model length / DCP⌉ / block size⌉)")
        self.capture = self.device.type == "cuda" if capture is None else bool(capture)
        if self.capture and self.device.type != "cuda":
            raise ValueError(f"capture=True on device {self.device}; CUDA graphs need a CUDA "
                             "device (capture=False runs the statics path eagerly)")
        self.scratch = ScratchRows(num_slots, max_padding(self.buckets), num_blocks)
        self.support = graph_support(model, caches)
        experts = host_bound_experts(model)          # why the experts cannot be captured
        if self.capture and self.support[0] and experts:
            self.support = (False, experts)
        self.statics: dict[int, StepStatics] = {}
        self.graphs: dict[int, _Captured] = {}
        self.capture_failed: dict[int, str] = {}     # bucket -> why (it then runs eagerly)
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.counts = {"graphed": 0, "eager_statics": 0, "plain": 0, "captured": 0,
                       "padded": 0, "stock_graphed": 0, "stock_captured": 0,
                       "stock_single": 0, "stock_mixed": 0}
        # stock steps padded to `prefill_bucket` (None: RAYDECODE_PAD_PREFILL, unset: on for a
        # CUDA runner); prefill_budget: the step token budget, whose buckets `warm_prefill`
        # runs at build
        self.pad_prefill = resolve_pad(pad_prefill, self.device)
        self.prefill_budget = prefill_budget
        # piecewise-graphed stock steps of ≤ stock_graphs tokens (engine/piecewise.py; None:
        # RAYDECODE_STOCK_GRAPHS, 0 off), captured per token bucket by `warm_prefill`;
        # stock_backend: the graph backend (CUDA: graphs in this runner's pool; tests: an
        # emulation on the CPU)
        cap = settings.stock_graphs() if stock_graphs is None else stock_graphs
        if isinstance(cap, bool) or not isinstance(cap, int) or not (
                cap == 0 or settings.is_token_bucket(cap)):
            raise ValueError(f"stock_graphs={stock_graphs!r}: expected 0 (off) or a token "
                             "bucket (a power of two up to 256, or a multiple of 256 up to "
                             f"{PAD_MAX})")
        self.stock_backend = stock_backend if stock_backend is not None else (
            CudaPieces(self._pool) if self.capture else None)
        why = ("no graph backend (graphs off)" if self.stock_backend is None
               else "no scratch rows" if not self.scratch.count else experts)
        self.stock_graphs_asked = cap
        self.stock_graph_tokens = cap if why is None else 0
        self.stock_support = (why is None, why or "ok")
        self.stock_graphs: dict[int, StockGraph] = {}
        self.stock_failed: dict[int, str] = {}            # bucket -> why (it runs eagerly)
        # single-sequence stock graphs (stock_single; None: RAYDECODE_STOCK_SINGLE, default
        # on): a second graph per bucket for steps of one sequence, its KDA cores inside
        # the graph (models/kda.py `_core_single`), the MLA cores still eager
        self.stock_single = bool(self.stock_graph_tokens) and (
            settings.stock_single() if stock_single is None else bool(stock_single))
        self.stock_single_graphs: dict[int, StockGraph] = {}
        self.stock_single_failed: dict[int, str] = {}
        self._single = SingleSeq(self.device)
        # mixed-step stock graphs (stock_mixed; None: RAYDECODE_STOCK_MIXED, default off): a
        # third graph per bucket for a prompt chunk beside one-token continuations, every KDA
        # core inside (models/kda.py `_core_mixed`), each bucket its own device lists
        self.stock_mixed = bool(self.stock_graph_tokens) and (
            settings.stock_mixed() if stock_mixed is None else bool(stock_mixed))
        self.stock_mixed_graphs: dict[int, StockGraph] = {}
        self.stock_mixed_failed: dict[int, str] = {}
        self._stock_buffers = Buffers(self.device)
        self._side = None                                 # the capture stream (CUDA)

    # ---- which steps -------------------------------------------------------------------------
    def why_not(self, plan: StepPlan) -> str | None:
        """None if `plan` runs graph-shaped, else why it runs ModelRunner.run."""
        if not self.support[0]:
            return self.support[1]
        if plan.path != "specialized":
            return f"path {plan.path!r}"
        if getattr(plan, "spec_k", None) is not None:
            return "speculative verification step"
        if not plan.batch.is_decode_only:
            return "a prefill chunk in the batch"
        T = plan.num_seqs
        if not 1 <= T <= self.buckets[-1]:
            return f"{T} sequences; the buckets go to {self.buckets[-1]}"
        if any(s.pos == 0 for s in plan.batch.seqs):
            return "a sequence at position 0 (the fused KDA path needs history)"
        if plan.sample_rows != list(range(T)):
            return f"sample rows {plan.sample_rows}; a decode step samples every row in order"
        if self.caches.kda_observer is not None:
            return "a KDA observer is set (speculative rollback)"
        return None

    def ready(self, num_seqs: int) -> bool:
        """Whether a step of num_seqs runs graph-shaped without capturing first (CUDA: its
        bucket is captured; CPU: the eager statics path needs nothing)."""
        b = bucket_for(num_seqs, self.buckets)
        return (self.support[0] and b is not None and num_seqs >= 1
                and (not self.capture or b in self.graphs))

    # ---- the step --------------------------------------------------------------------------
    @torch.inference_mode()
    def logits(self, plan: StepPlan) -> torch.Tensor:
        """(T, V) fp32 logits; for a replayed graph a view of its output buffer, which the next
        replay of the bucket rewrites (the sampler reads it first, in stream order)."""
        if self.why_not(plan) is not None:
            self.counts["plain"] += 1
            return self._stock_logits(plan)
        self.update_caches(plan)
        T, B = plan.num_seqs, bucket_for(plan.num_seqs, self.buckets)
        st = self._statics(B)
        st.fill(plan, self._tables())
        if not self.capture or B in self.capture_failed:
            self.counts["eager_statics"] += 1
            return self._forward(st, st.padded_batch(plan))[:T]
        if B not in self.graphs:      # this step is the warm-up, then capture (no execution)
            logits = self._warm_and_capture(B, st, st.padded_batch(plan))
            self.counts["graphed" if B in self.graphs else "eager_statics"] += 1
            return logits[:T]
        g = self.graphs[B]
        g.graph.replay()
        self.counts["graphed"] += 1
        return g.logits[:T]

    def run(self, plan: StepPlan) -> torch.Tensor:
        """(T, V) fp32 logits, a fresh tensor (the graph's output buffer is copied out)."""
        return self.logits(plan).clone()

    @torch.inference_mode()
    def capture_all(self) -> list[int]:
        """Startup, before any sequence holds a slot: warm up and (CUDA) capture every bucket,
        largest first, on idle rows (scratch slots, then real slots 0.., which are reset after;
        MLA rows go to the scratch block). Collective at TP > 1: every rank calls it. -> the
        buckets now ready (a failed capture is in `capture_failed`)."""
        if not self.support[0]:
            raise RuntimeError(f"step graphs unsupported: {self.support[1]}")
        if self.caches.mla is not None and self.caches.mla.block_tables:
            raise RuntimeError(f"capture_all with live sequences (slots "
                               f"{sorted(self.caches.mla.block_tables)} hold blocks); call it "
                               "before serving")
        done = []
        for B in sorted(self.buckets, reverse=True):
            if B in self.graphs or B in self.capture_failed:
                continue
            slots = list(self.scratch.slots)[:B]
            real = list(range(B - len(slots)))
            if len(real) > self.scratch.num_slots:
                raise RuntimeError(f"bucket {B} needs {B} idle slots; there are "
                                   f"{self.scratch.num_slots} real + {self.scratch.count} "
                                   "scratch")
            st = self._statics(B)
            st.fill_idle(slots + real)
            if self.capture:
                self._warm_and_capture(B, st, st.padded_batch(None))
            else:
                self._forward(st, st.padded_batch(None))
            if self.caches.kda is not None:
                for s in real:
                    self.caches.kda.reset(s)
            if not self.capture or B in self.graphs:
                done.append(B)
        return done

    # ---- padded and piecewise-graphed stock steps -------------------------------------------
    def pad_of(self, plan: StepPlan) -> int | None:
        """The bucket this step pads to, or None (padding off, not the stock path, nothing to
        pad, above PAD_MAX, or a KDA observer: speculative rollback reads every sequence in
        turn)."""
        if (not self.pad_prefill or plan.path != "stock" or not self.scratch.count
                or self.caches.kda_observer is not None):
            return None
        T = plan.batch.num_tokens
        b = prefill_bucket(T) if T >= 1 else None
        return b if b is not None and b > T else None

    def stock_graph_of(self, plan: StepPlan) -> StockGraph | None:
        """The captured graph this stock step replays (its token bucket's; the bucket's
        single-sequence graph for a step of one sequence where captured), or None: stock
        graphs off, above their cap, the bucket not captured (or its capture failed), or a KDA
        observer (speculative rollback reads every sequence in turn)."""
        T = plan.batch.num_tokens
        if (plan.path != "stock" or not 1 <= T <= self.stock_graph_tokens
                or self.caches.kda_observer is not None):
            return None
        b = prefill_bucket(T)
        if len(plan.batch.seqs) == 1 and b in self.stock_single_graphs:
            return self.stock_single_graphs[b]
        if b in self.stock_mixed_graphs and mixed_parts(plan.batch) is not None:
            return self.stock_mixed_graphs[b]
        return self.stock_graphs.get(b)

    def _padded(self, plan: StepPlan, bucket: int) -> StepPlan:
        """The plan with one more sequence of bucket − T pad tokens (none at T = bucket), at
        position 0 on the first scratch KDA slot: a sequence start ignores the slot's contents,
        and `_pad_table` puts every position's MLA row on the scratch block (the rows overwrite
        each other: only the pad tokens read them)."""
        T = plan.batch.num_tokens
        if bucket == T:
            return plan
        pad = SeqSlice(self.scratch.slots[0], T, bucket - T, 0)
        return dataclasses.replace(plan, batch=StepBatch(list(plan.batch.seqs) + [pad]),
                                   tokens=list(plan.tokens) + [0] * (bucket - T))

    @contextlib.contextmanager
    def _pad_table(self, bucket: int, skip: bool = True):
        """The scratch sequence's MLA block table while a padded step runs; with `skip`, the
        attention cores skip it too (`caches.pad_slot`: its rows of their output are zeros, its
        fla and SDPA work is not done). The build's warm-up and capture run it (skip False):
        their steps are pad tokens only, which must meet the kernels."""
        mla, pad = self.caches.mla, self.scratch.slots[0]
        if mla is not None:
            mla.block_tables[pad] = [self.scratch.block] * -(-bucket // mla.block_size)
        if skip:
            self.caches.pad_slot = pad
        try:
            yield
        finally:
            self.caches.pad_slot = None
            if mla is not None:
                mla.block_tables.pop(pad, None)

    def _stock_logits(self, plan: StepPlan, bucket: int | None = None) -> torch.Tensor:
        """ModelRunner.logits of the plan: replayed on its bucket's stock graph where one is
        captured (`stock_graph_of`), else eagerly, padded to its bucket where `pad_of` says
        (or to `bucket`). The real sequences, their caches and sample rows are the unpadded
        step's; the per-token work (projections, experts, norms) runs at the bucket's
        shape."""
        sg = self.stock_graph_of(plan) if bucket is None else None
        if sg is not None:
            return self._replay_stock(plan, sg)
        b = self.pad_of(plan) if bucket is None else bucket
        if b is None:
            return super().logits(plan)
        with self._pad_table(b, skip=bucket is None):      # a given bucket: the warm-up
            out = super().logits(self._padded(plan, b))
        self.counts["padded"] += 1
        return out

    def _replay_stock(self, plan: StepPlan, sg: StockGraph) -> torch.Tensor:
        """One stock step on its bucket's graph: the plan's cache updates, its tokens (and the
        pads') into the graph's token buffer, the replay on the padded batch, then the sample
        rows' logits from the graphs' hidden state."""
        padded = self._padded(plan, sg.bucket)
        sg.tokens.copy_(self.prepare(padded))        # the plan's cache updates, then its tokens
        if sg.single is not None and sg.single.mixed:   # the chunk and the continuations
            sg.single.set_mixed(*mixed_parts(plan.batch), pad_slot=self.scratch.slots[0])
            self.counts["stock_mixed"] += 1
        elif sg.single is not None:                  # its one sequence: slot, start, length
            s, = plan.batch.seqs
            sg.single.set(s.slot, s.pos, s.length)
            self.counts["stock_single"] += 1
        with self._pad_table(sg.bucket):
            hidden = sg.replay(padded.batch)                                      # (C, H)
        self.counts["stock_graphed"] += 1
        return self.sample_logits(hidden, plan)

    @torch.inference_mode()
    def warm_prefill(self, budget: int) -> list[int]:
        """Startup: one stock step of every token bucket a step of 1..budget tokens meets, all
        pad tokens (the scratch sequence alone), so the first request of each shape meets
        warm kernels (Triton JIT and autotune, cuBLAS heuristics, fla's autotune) and
        allocator blocks instead of paying them on the request path (on the H200, K3 TP16,
        8 layers: 5.6 s at the first one-token step, 1.4 s at the first 128-token one).
        Buckets up to the stock-graph cap are captured (`capture_stock`, largest first: the
        warm-up is its first pass); the others run eagerly: with padding on the buckets steps
        pad to (`prefill_buckets`), off the powers of two below the budget and the budget
        (`unpadded_buckets`), the shapes whose first runs compile (the MoE's one-program sort:
        one specialization per power of two of pairs). -> the buckets run ([] without
        scratch rows: graphs off)."""
        if not self.scratch.count:
            return []
        graphed = prefill_buckets(min(budget, self.stock_graph_tokens)) \
            if self.stock_graph_tokens else []
        for b in sorted(graphed, reverse=True):
            self.capture_stock(b)
        eager = prefill_buckets(budget) if self.pad_prefill else unpadded_buckets(budget)
        done = list(graphed)
        for b in eager:
            if b in self.stock_graphs:
                continue
            plan = StepPlan(0, StepBatch([]), [], [b - 1], {}, [], "stock")
            self._stock_logits(plan, bucket=b)
            done.append(b)
        return sorted(set(done))

    @torch.inference_mode()
    def capture_stock(self, bucket: int) -> bool:
        """Warm and capture the stock graph of one token bucket on the scratch rows (all pad
        tokens), then check one replay against an eager step (`check_replay`, on tokens that
        vary by row, the pad's attention skipped): a capture that raises, or a replay that is
        not finite or whose core inputs or hidden state leave the eager step's by more than
        1e-2 (relative, max-abs), leaves the bucket eager (`stock_failed` says why). Collective
        at TP > 1 (the passes' all-reduces): the ranks agree after the capture and after the
        replay, so a failure on one rank leaves the bucket eager on all and none waits in a
        replay the others skip. With `stock_single` on, the bucket's single-sequence graph
        too (its KDA cores inside the graph: `stock_single_graphs`, failures in
        `stock_single_failed`), from bucket 2 up: a one-token step keeps the general graph,
        whose eager core gives a lone token the fp32 recurrent update (`_decode_rows` or
        `kda_recurrent`) the eager step gives it, where fla's chunked forward inside a single
        graph would read the state through bf16 (0.015-0.024 from the eager logits on the H100
        in bf16). -> the general graph captured."""
        ok = bucket in self.stock_graphs or self._capture_variant(bucket, None)
        if self.stock_single and bucket >= SINGLE_MIN_BUCKET \
                and bucket not in self.stock_single_graphs \
                and bucket not in self.stock_single_failed:
            self._capture_variant(bucket, self._single)
        if self.stock_mixed and bucket >= MIXED_MIN_BUCKET \
                and bucket not in self.stock_mixed_graphs \
                and bucket not in self.stock_mixed_failed:
            self._capture_variant(bucket, MixedSeq(self.device, bucket))
        return ok

    def _capture_variant(self, bucket: int, single: SingleSeq | None) -> bool:
        """`capture_stock` of the general graph (single None), of the single-sequence one (its
        tensors set to the scratch slot, a start, all rows real) or of the mixed-step one (a
        MixedSeq: the same chunk, no continuation live)."""
        graphs, failed = ((self.stock_graphs, self.stock_failed) if single is None else
                          (self.stock_mixed_graphs, self.stock_mixed_failed) if single.mixed
                          else (self.stock_single_graphs, self.stock_single_failed))
        plan = self._padded(StepPlan(0, StepBatch([]), [], [], {}, [], "stock"), bucket)
        tokens = torch.zeros(bucket, dtype=torch.long, device=self.device)
        if single is not None and single.mixed:
            pad = self.scratch.slots[0]
            single.set_mixed(SeqSlice(pad, 0, bucket, 0), [], pad_slot=pad)
        elif single is not None:
            single.set(self.scratch.slots[0], 0, bucket)

        def forward():
            return self.model(tokens, plan.batch, self.caches, path="stock")

        cuda = self.device.type == "cuda"
        side, sg, why = self._capture_stream(), None, None
        if cuda:
            side.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with self._pad_table(bucket, skip=False), \
                    (torch.cuda.stream(side) if cuda else contextlib.nullcontext()):
                _, sg = capture_stock_graph(forward, self.caches, bucket, tokens,
                                            self._stock_buffers, self.stock_backend, single)
        except Exception as e:      # noqa: BLE001 — the bucket stays eager
            why = f"{type(e).__name__}: {e}"
        finally:                    # what the side stream queued, before any later step
            if cuda:
                torch.cuda.current_stream(self.device).wait_stream(side)
                torch.cuda.synchronize(self.device)
        if self._group_ok(why is None):
            try:
                # the check step skips the pad's attention as served padded steps do; run,
                # the scratch sequence's MLA row writes race (check_replay's docstring). Its
                # tokens vary by row, so a piece that moves rows cannot pass on equal ones
                gen = torch.Generator().manual_seed(bucket)
                tokens.copy_(torch.randint(0, self.model.cfg.vocab_size, (bucket,),
                                           generator=gen))
                with self._pad_table(bucket):
                    err, where = check_replay(forward, self.caches, sg, plan.batch)
                if not err <= 1e-2:
                    why = (f"replay left the eager step by {err:.3g} (relative max-abs) at "
                           f"{where}; the bucket runs eagerly")
            except Exception as e:  # noqa: BLE001 — the bucket stays eager
                why = f"{type(e).__name__}: {e}"
            if self._group_ok(why is None):
                graphs[bucket] = sg
                self.counts["stock_captured"] += 1
                return True
        failed[bucket] = why or "the capture failed on another rank of the group"
        return False

    # ---- internals -------------------------------------------------------------------------
    def _group_ok(self, ok: bool) -> bool:
        """Whether every rank of the TP group says ok (a sum over the group's comm of the
        failures; one rank: its own answer). Build time: reads the sum on the host."""
        comm = getattr(self.model, "comm", None)
        flag = torch.tensor([0.0 if ok else 1.0], device=self.device)
        if comm is not None:
            flag = comm.all_reduce(flag)
        return float(flag[0]) == 0.0

    def _capture_stream(self):
        """The one side stream every stock-graph capture runs on (CUDA; None elsewhere): a
        stream per capture would give cuBLAS a workspace per stream."""
        if self.device.type != "cuda":
            return None
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    def _tables(self):
        return self.caches.mla.block_tables if self.caches.mla is not None else None

    def _statics(self, B: int) -> StepStatics:
        if B not in self.statics:
            m = self.caches.mla
            self.statics[B] = StepStatics(
                B, self.max_blocks if m is not None else 1, self.scratch,
                m.block_size if m is not None else 1, m.dcp_rank if m is not None else 0,
                m.dcp_size if m is not None else 1, self.device)
        return self.statics[B]

    def _forward(self, st: StepStatics, batch: StepBatch) -> torch.Tensor:
        """(B, V) fp32 logits of the statics' rows, the model reading caches.statics."""
        self.caches.statics = st
        try:
            hidden = self.model(st.tokens, batch, self.caches, path="specialized")   # (B, H)
            return self.model.compute_logits(hidden).float()
        finally:
            self.caches.statics = None

    def _warm_and_capture(self, B: int, st: StepStatics, batch: StepBatch) -> torch.Tensor:
        """`warm_and_capture` of this bucket's forward: the warm-up IS the step (caches
        advance once); a failed capture leaves the bucket eager (`capture_failed`)."""
        logits, g, out, err = warm_and_capture(lambda: self._forward(st, batch), self.device,
                                               self._pool)
        if err is not None:
            self.capture_failed[B] = err
            return logits
        self.graphs[B] = _Captured(g, out)
        self.counts["captured"] += 1
        return logits


def warm_and_capture(fn, device, pool):
    """Eager run of fn() on a side stream (JIT, lazy handles; the caller's step), then the
    same fn captured (recorded, not executed) into `pool`. -> (eager outputs, graph, captured
    outputs, None), or (eager outputs, None, None, "Type: message") when the capture raised.
    The outputs: a tensor or a tuple of tensors / None."""
    cur = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        warm = fn()
    cur.wait_stream(side)
    for t in (warm if isinstance(warm, tuple) else (warm,)):
        if t is not None:
            t.record_stream(cur)       # allocated on `side`, read on `cur` by the caller
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    try:   # thread_local: other threads (NCCL watchdog, Ray) may query CUDA meanwhile
        with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
            out = fn()
    except Exception as e:     # noqa: BLE001 — the step itself ran (the warm-up)
        return warm, None, None, f"{type(e).__name__}: {e}"
    return warm, g, out, None


__all__ = ["BUCKETS", "ENV", "PAD_MAX", "PAD_POS", "GraphedRunner", "ScratchRows",
           "StepStatics", "bucket_for", "check_buckets", "graph_cache_sizes", "graph_support",
           "max_padding", "prefill_bucket", "prefill_buckets", "scratch_bytes",
           "warm_and_capture"]
