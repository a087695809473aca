"""The graphed speculative step on the GPU (engine/spec_graph.py): graphs D and V of every
bucket captured at build on the tiny K3 model (bf16, the Triton decode and verify kernels),
greedy speculative output equal to the non-speculative graphed output token for token, no
capture failure."""
from __future__ import annotations

import pytest
import torch

from _spec_graph_case import run_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_captured_greedy_speculative_equals_non_speculative():
    ref, got, runner, engine = run_case("cuda", k=4, max_tokens=48, at_build=True)
    assert not runner.graphs.capture_failed, runner.graphs.capture_failed
    # every bucket of k = 4 (1, 2, 4, 8), greedy and sampling, captured at build: D and V each
    assert len(runner.built) == 8 and runner.graphs.counts["captured"] == 16
    assert runner.spec_graphed            # what splits a speculating replica's mixed steps
    assert runner.counts["graphed"] > 0 and runner.counts["eager"] == 0
    for i, (r, g) in enumerate(zip(ref, got)):
        assert g == r, f"prompt {i}: first difference at {next(j for j, (a, b) in enumerate(zip(r, g)) if a != b)}"
    assert engine.acceptance.accepted_at[0] > 0
