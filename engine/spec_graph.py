"""DSpark's speculative step on the fast path (issue 27): CUDA graphs of the drafter's pass and
of the target's verify step per (sequence bucket B, drafts k), per-position KDA state slots,
acceptance on the device, one host sync per step.

A step of n ≤ B speculating sequences (every sequence of the plan speculates, each at p > 0)
runs in the smallest bucket B ≥ n with B·(k+1) ≤ MAX_VERIFY_TOKENS (`SpecGraphs.why_not`; any
other plan runs the eager SpecRunner). Per step:

  fill     VerifyStatics (engine/step_graph.py StepStatics over B·T rows, T = k + 1): row
           b·T + j = sequence b at position p_b + j, its block table, the local store index,
           the rows ≤ p_b + j on this rank; plus each sequence's slot, positions and context
           length (rows < p_b). Padded sequences n … B-1 use scratch slots and the scratch
           block at PAD_POS, as the decode graphs' padded rows.
  draft    graph D: the drafter (models/dspark.py `forward_static`) over rows [anchor, mask ×
           (k−1)] of every sequence, its base logits, the k left-to-right Markov samples
           (engine/spec_sampling.py: `greedy_drafts` when every row is greedy or the step is
           synthetic, else `draft_sample_t` on the statics' sampling tensors), rank 0's drafts
           written into the statics' token rows 1 … k. Graphs are keyed (B, k, greedy).
  verify   graph V: the target's specialized forward over the B·T rows with the drafter's
           taps: KDA layers through kernels/kda_verify.py (the slots only read, the state after
           every position into per-position rows), MLA layers store all rows first and attend
           causally (models/mla.py verify branch), the MoE at B·T tokens; the drafter context
           rows of every row (`write_context_static`); the lm_head of all rows.
  accept   engine/spec_sampling.py on the device (`accept_greedy`, `verify`, `synthetic`), then
           kernels/kda_verify.py `kda_verify_commit`: slot ← per-position row of the last kept
           position, every KDA layer at once; the emitted ids to the host (the step's sync).

MLA rows at rejected positions stay in the pool and are overwritten by later steps, as on the
eager path; the draft context rows likewise. Per-position rows: one shared buffer of
MAX_VERIFY_TOKENS rows per KDA layer (kernels/kda_verify.py `per_position_bytes`; the graphs
replay one at a time; `raydecode plan` counts them).
Captured at build (`capture_all(k)`, load_spec_runner: every bucket at the replica's k, greedy
and sampling, on idle scratch rows) or else on a (bucket, k, greedy)'s first step: an eager
warm-up that is the step, then the capture. On the CPU the same statics path runs eagerly
(tests/cpu/test_spec_graph.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from raydecode.kernels import kda_verify as kda_verify_op
from raydecode.models.cache import SeqSlice, StepBatch

from . import spec_sampling
from .spec_engine import MAX_VERIFY_TOKENS
from .spec_runner import rank0_value
from .step_graph import (PAD_POS, _PAD, ScratchRows, StepStatics, check_buckets,
                         warm_and_capture)

SPEC_BUCKETS = (1, 2, 4, 8, 16)       # sequences per speculative step (B·(k+1) ≤ 64 bounds it)


def spec_bucket(num_seqs: int, k: int, buckets=SPEC_BUCKETS) -> int | None:
    """The smallest bucket ≥ num_seqs whose B·(k+1) fits MAX_VERIFY_TOKENS, None if none."""
    return next((b for b in buckets if b >= num_seqs and b * (k + 1) <= MAX_VERIFY_TOKENS),
                None)


class VerifyStatics(StepStatics):
    """The statics of a bucket-B verify step of T = k + 1 rows per sequence (module docstring).
    Attributes the model reads while caches.statics is it: `verify` = T (KDA and MLA take their
    verify branch), `seqs` = B, `seq_slots` (B,), `no_store` (B·T,) all −1, `positions` (B·T,),
    `draft_positions` / `draft_table` / `draft_ctx_lens` (B·k rows, derived on the device),
    `pos_conv` / `pos_rec` (the shared per-position rows), `scratch`."""

    def __init__(self, seqs: int, positions: int, max_blocks: int, scratch: ScratchRows,
                 block_size: int, pos_conv: torch.Tensor | None, pos_rec: torch.Tensor | None,
                 dcp_rank: int = 0, dcp_size: int = 1, device="cpu"):
        B, T = seqs, positions
        super().__init__(B * T, max_blocks, scratch, block_size, dcp_rank, dcp_size, device)
        self.seqs, self.verify = B, T
        self.pos_conv, self.pos_rec = pos_conv, pos_rec
        self.no_store = torch.full((B * T,), -1, dtype=torch.int32, device=self.device)
        n = B + B * T + B
        self._e64 = torch.zeros(n, dtype=torch.int64, device=self.device)
        self._eh64 = torch.zeros(n, dtype=torch.int64, pin_memory=self._cuda)
        self.seq_slots = self._e64[:B]
        self.positions = self._e64[B:B + B * T]
        self._ctx = self._e64[B + B * T:]                 # rows < p_b on this rank (B,)
        # the draft rows' sampling (SamplingRows.tensors' layout): [temperature, top_p],
        # [top_k, seed, counter]; padded rows greedy
        self.samp_f = torch.zeros(2, B, dtype=torch.float32, device=self.device)
        self.samp_i = torch.zeros(3, B, dtype=torch.int64, device=self.device)
        self._sf = torch.zeros(2, B, dtype=torch.float32, pin_memory=self._cuda)
        self._si = torch.zeros(3, B, dtype=torch.int64, pin_memory=self._cuda)
        self.num_real = 0

    # the drafter's B·k rows, derived on the device (inside graph D)
    def draft_views(self) -> None:
        B, T, W = self.seqs, self.verify, self.max_blocks
        k = T - 1
        self.draft_positions = self.positions.view(B, T)[:, :k].reshape(B * k)
        self.draft_table = self.table.view(B, T, W)[:, :k].reshape(B * k, W)
        self.draft_ctx_lens = self._ctx.view(B, 1).expand(B, k).reshape(B * k).to(torch.int32)

    def fill_spec(self, spec: list, anchors: list[int], block_tables, step,
                  sampling=None) -> None:
        """n ≤ B speculating sequences (engine/spec_runner.py SpecSeq) with their anchor
        tokens and (sampling: SamplingRows of the n) their draft sampling; the rest padded. Draft
        token rows hold 0 until graph D writes them."""
        B, T, sc = self.seqs, self.verify, self.scratch
        n = len(spec)
        if not 1 <= n <= B:
            raise ValueError(f"step {step}: {n} speculating sequences for bucket {B}")
        if len({s.slot for s in spec}) != n:
            raise ValueError(f"step {step}: slots {[s.slot for s in spec]} repeat")
        rows, seq_slots, ctx = [], [], []
        D, r = self.dcp_size, self.dcp_rank
        for s, a in zip(spec, anchors):
            if not 0 <= s.slot < sc.num_slots or s.pos < 1:
                raise ValueError(f"step {step}: sequence at slot {s.slot}, position {s.pos}: "
                                 f"a graphed verify needs a real slot < {sc.num_slots} and "
                                 "position ≥ 1")
            tbl = None if block_tables is None else block_tables.get(s.slot)
            if block_tables is not None and tbl is None:
                raise ValueError(f"step {step}: slot {s.slot} has no block table")
            rows += [(a if j == 0 else 0, s.slot, s.pos + j, tbl) for j in range(T)]
            seq_slots.append(s.slot)
            ctx.append((s.pos - 1 + D - r) // D)
        pads = list(sc.slots[:B - n])
        if len(pads) < B - n:
            raise ValueError(f"step {step}: bucket {B} needs {B - n} scratch slots, "
                             f"{sc.count} exist")
        for slot in pads:
            rows += [(0, slot, PAD_POS + j, _PAD) for j in range(T)]
            seq_slots.append(slot)
            ctx.append((PAD_POS - 1 + D - r) // D)
        self._write(rows, block_tables is not None, step)
        self._stage(seq_slots, [row[2] for row in rows], ctx, sampling, n)

    def _stage(self, seq_slots: list[int], pos: list[int], ctx: list[int], sampling,
               n: int) -> None:
        """After `_write` (which waited for the previous copy): the sequences' slots, the
        rows' positions, the context lengths and the draft sampling of the first n
        sequences (SamplingRows or None: greedy) through pinned staging to the device."""
        self._eh64.copy_(torch.tensor(seq_slots + pos + ctx, dtype=torch.int64))
        self._e64.copy_(self._eh64, non_blocking=self._cuda)
        self._sf.zero_()
        self._sf[1] = 1.0
        self._si.zero_()
        if sampling is not None:
            sm = sampling
            self._sf[:, :n] = torch.tensor([sm.temperature, sm.top_p], dtype=torch.float32)
            self._si[:, :n] = torch.tensor([sm.top_k, sm.seed, sm.counter], dtype=torch.int64)
        self.samp_f.copy_(self._sf, non_blocking=self._cuda)
        self.samp_i.copy_(self._si, non_blocking=self._cuda)
        if self._cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.num_real = n

    def fill_idle(self) -> None:
        """Warm-up / capture rows: all B sequences on scratch slots at PAD_POS, the scratch
        block as their table, greedy sampling (no live sequence is touched)."""
        B, T, sc = self.seqs, self.verify, self.scratch
        if B > sc.count:
            raise RuntimeError(f"bucket {B} needs {B} idle slots; {sc.count} scratch exist")
        slots = list(sc.slots[:B])
        self._write([(0, slot, PAD_POS + j, _PAD) for slot in slots for j in range(T)], True,
                    "idle")
        D, r = self.dcp_size, self.dcp_rank
        self._stage(slots, [PAD_POS + j for _ in slots for j in range(T)],
                    [(PAD_POS - 1 + D - r) // D] * B, None, B)

    def flat_batch(self) -> StepBatch:
        """What the target sees: B·T one-row slices (the fused ops read the statics)."""
        B, T = self.seqs, self.verify
        return StepBatch([SeqSlice(0, i, 1, PAD_POS + i % T) for i in range(B * T)])


@dataclass
class _Graphs:
    statics: VerifyStatics
    greedy: bool                           # drafts by argmax (every row greedy, synthetic)
    draft: "torch.cuda.CUDAGraph | None" = None
    verify: "torch.cuda.CUDAGraph | None" = None
    drafts: tuple | None = None            # graph D's outputs: drafts (B, k), q (B, k, V)|None
    logits: torch.Tensor | None = None     # (B·T, V) fp32 target logits (graph V's output)


class SpecGraphs:
    """The graphed speculative step of one rank (module docstring). `runner` is the rank's
    GraphedRunner (its scratch rows, max_blocks, capture setting), `drafter` its DSpark drafter.
    `counts`: steps graphed / eager-statics (CPU or a failed capture) / captures."""

    def __init__(self, runner, drafter, buckets=SPEC_BUCKETS):
        self.runner, self.drafter = runner, drafter
        self.model, self.caches, self.device = runner.model, runner.caches, runner.device
        self.buckets = check_buckets(buckets)
        self.capture = runner.capture
        self.support = runner.support
        kda = self.caches.kda
        self.pos_conv = self.pos_rec = None
        if kda is not None:
            N = MAX_VERIFY_TOKENS
            self.pos_conv = kda.conv.new_zeros(kda.conv.shape[0], N, *kda.conv.shape[2:])
            self.pos_rec = kda.rec.new_zeros(kda.rec.shape[0], N, *kda.rec.shape[2:])
        self.graphs: dict[tuple[int, int, bool], _Graphs] = {}
        self.capture_failed: dict[tuple[int, int, bool], str] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.counts = {"graphed": 0, "eager_statics": 0, "captured": 0}

    def why_not(self, plan) -> str | None:
        """None if the SpecStepPlan runs graphed, else why the eager SpecRunner runs it."""
        if not self.support[0]:
            return self.support[1]
        if plan.path != "specialized":
            return f"path {plan.path!r}"
        spec, k = plan.spec, plan.num_drafts
        if not spec:
            return "no speculating sequence"
        if len(spec) != len(plan.batch.seqs) or plan.sample_rows:
            return "plain sequences in the step (prefill chunks or non-speculating decodes)"
        if spec_bucket(len(spec), k, self.buckets) is None:
            return f"{len(spec)} sequences × {k + 1} rows exceed the buckets"
        if any(s.pos < 1 for s in spec):
            return "a sequence at position 0"
        if self.caches.kda_observer is not None:
            return "a KDA observer is set"
        return None

    # ---- capture at build ---------------------------------------------------------------
    def capture_all(self, k: int) -> list[tuple[int, int, bool]]:
        """Before serving, at the replica's k: warm up and (CUDA) capture graphs D and V of
        every bucket with bucket·(k+1) ≤ MAX_VERIFY_TOKENS, greedy and sampling, on idle rows
        (scratch slots and the scratch block only), so no speculative step captures on the
        request path. Collective at TP > 1 (every rank calls it). -> the keys now captured
        (CPU: run eagerly once, none captured)."""
        if not self.support[0]:
            raise RuntimeError(f"spec graphs unsupported: {self.support[1]}")
        done = []
        for B in sorted((b for b in self.buckets if spec_bucket(b, k, self.buckets) == b),
                        reverse=True):
            for greedy in (True, False):
                g = self._graphs_for(B, k, greedy)
                g.statics.fill_idle()
                self.draft(g)
                self.verify_logits(g)
                if g.draft is not None and g.verify is not None:
                    done.append((B, k, greedy))
        return done

    # ---- the step ------------------------------------------------------------------------------
    def _graphs_for(self, B: int, k: int, greedy: bool) -> _Graphs:
        g = self.graphs.get((B, k, greedy))
        if g is None:
            m = self.caches.mla
            st = VerifyStatics(
                B, k + 1, self.runner.max_blocks if m is not None else 1, self.runner.scratch,
                m.block_size if m is not None else 1, self.pos_conv, self.pos_rec,
                m.dcp_rank if m is not None else 0, m.dcp_size if m is not None else 1,
                self.device)
            g = self.graphs[(B, k, greedy)] = _Graphs(st, greedy)
        return g

    def prepare(self, plan, rows, greedy: bool) -> tuple[_Graphs, int]:
        """Cache ops, the statics filled (rows: the draft sampling; greedy: every row takes
        the argmax), the (bucket, k, greedy) graphs (None before their capture)."""
        self.runner.update_caches(plan)
        k = plan.num_drafts
        B = spec_bucket(len(plan.spec), k, self.buckets)
        g = self._graphs_for(B, k, greedy)
        tables = self.caches.mla.block_tables if self.caches.mla is not None else None
        g.statics.fill_spec(plan.spec, [plan.tokens[s.start] for s in plan.spec], tables,
                            plan.step_id, rows)
        return g, k

    def draft(self, g: _Graphs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Graph D (or its eager form): the drafter, its base logits, the k Markov samples,
        the drafts written into the token rows -> drafts (n, k), q (n, k, V) or None (greedy)
        of the real sequences."""
        st = g.statics
        key = (st.seqs, st.verify - 1, g.greedy)
        if g.draft is not None:
            g.draft.replay()
            self.counts["graphed"] += 1
            out = g.drafts
        elif not self.capture or key in self.capture_failed:
            self.counts["eager_statics"] += 1
            out = self._draft_forward(st, g.greedy)
        else:
            out = self._warm_and_capture(g, "draft", lambda s: self._draft_forward(s, g.greedy))
        n = st.num_real
        return out[0][:n], (None if out[1] is None else out[1][:n])

    def verify_logits(self, g: _Graphs) -> torch.Tensor:
        """(n, T, V) fp32 target logits of the real sequences' rows (graph V or eager)."""
        st = g.statics
        key = (st.seqs, st.verify - 1, g.greedy)
        if g.verify is not None:
            g.verify.replay()
            logits = g.logits
        elif not self.capture or key in self.capture_failed:
            logits = self._verify_forward(st)
        else:
            logits = self._warm_and_capture(g, "verify", self._verify_forward)
        return logits.view(st.seqs, st.verify, -1)[:st.num_real]

    def commit(self, g: _Graphs, lengths: torch.Tensor) -> None:
        """Every KDA layer's slot of each real sequence ← its last kept position's row
        (lengths (n,) device: emitted tokens = kept positions)."""
        if self.caches.kda is None:
            return
        st, n = g.statics, g.statics.num_real
        kda = self.caches.kda
        kda_verify_op.kda_verify_commit(kda.conv, kda.rec, st.pos_conv, st.pos_rec,
                                        st.seq_slots[:n], lengths.to(torch.int64) - 1,
                                        st.verify)

    # ---- forwards (captured) ---------------------------------------------------------------
    def _draft_forward(self, st: VerifyStatics, greedy: bool):
        B, T = st.seqs, st.verify
        k = T - 1
        st.draft_views()
        rows = st.tokens.view(B, T)
        toks = torch.full((B, k), self.drafter.cfg.mask_token_id, dtype=torch.long,
                          device=st.tokens.device)
        toks[:, 0] = rows[:, 0]
        hidden = self.drafter(toks.flatten(), None, self.caches, st=st)
        base = self.drafter.base_logits(hidden).view(B, k, -1)                   # (B, k, V)
        anchors, bias = rows[:, 0].clone(), self.drafter.markov_bias
        if greedy:
            drafts, q = spec_sampling.greedy_drafts(base, bias, anchors), None
        else:
            drafts, q = spec_sampling.sample_drafts(base, bias, anchors, st.samp_f, st.samp_i)
        drafts = rank0_value(self.model, drafts)
        rows[:, 1:].copy_(drafts)
        return drafts, q

    def _verify_forward(self, st: VerifyStatics) -> torch.Tensor:
        self.caches.statics = st
        try:
            hidden, tapped = self.model(st.tokens, st.flat_batch(), self.caches,
                                        path="specialized", taps=self.drafter.taps)
            self.drafter.write_context_static(tapped, st, self.caches)
            return self.model.compute_logits(hidden).float()                     # (B·T, V)
        finally:
            self.caches.statics = None

    def _warm_and_capture(self, g: _Graphs, which: str, fn):
        """engine/step_graph.py `warm_and_capture` of graph `which` ("draft" | "verify"): the
        eager run IS this step; a failed capture keeps the key eager (`capture_failed`)."""
        st = g.statics
        warm, graph, res, err = warm_and_capture(lambda: fn(st), self.device, self._pool)
        if err is not None:
            self.capture_failed[(st.seqs, st.verify - 1, g.greedy)] = f"{which}: {err}"
            return warm
        if which == "draft":
            g.draft, g.drafts = graph, res
        else:
            g.verify, g.logits = graph, res
        self.counts["captured"] += 1
        return warm


__all__ = ["SPEC_BUCKETS", "SpecGraphs", "VerifyStatics", "spec_bucket"]
