"""scripts/explore/moe_prefill_sweep.py's candidate sets: every config a set lists is one the
kernels accept (a decode its kernels have: the unswapped kernels elementwise / pairs / split,
the swapped and blocked ones elementwise / x2), so a GPU sweep spends its lease on timings,
not on error rows; the x2 set's baseline (its first row, what the others are compared to) is
the elementwise decode."""
from __future__ import annotations

import pytest

from raydecode.kernels import moe_mxfp4 as M
from raydecode.scripts.explore import moe_prefill_sweep as S

SETS = ["all", "base", "pairs", "swap", "shipped", "order", "split", "grouped", "tiles",
        "blocked", "ogs", "x2", "warps", "prefetch", "down", "situ"]


@pytest.mark.parametrize("which", SETS)
def test_every_candidate_has_a_decode_its_kernels_take(which):
    for c in S.candidates(3584, 192, which):
        if c.ogs or c.grouped_bf16:
            continue
        ok = M.SWAP_DECODES if (c.swap_ab or c.blocked) else tuple(M.DECODES)
        assert c.decode in ok, f"{which}: {c}"


def test_the_x2_set_compares_x2_against_the_elementwise_decode():
    rows = S.candidates(3584, 192, "x2")
    assert rows[0].decode == "elementwise" and not rows[0].blocked
    assert [c.decode for c in rows[:4]] == ["elementwise", "elementwise", "x2", "x2"]
    assert rows[2] == M.prefill_config(3584, 192) and rows[4].ogs == "hopper"


@pytest.mark.parametrize("which", ["warps", "prefetch", "down", "situ"])
def test_the_option_sets_time_distinct_configs(which):
    """Each option set's rows are distinct configs (a row equal to another, e.g. an option the
    shipped form already takes, would time the same kernels twice under two names)."""
    rows = S.candidates(3584, 192, which)
    assert len(set(rows)) == len(rows), which


def test_the_down_set_compares_the_shipped_tiles_against_64():
    rows = S.candidates(3584, 192, "down")
    shipped = M._prefill_config("hybrid", 3584, 192, 0, 0)
    assert rows[0].down_bn == 64 and rows[1].down_bn == shipped.down_bn == 128
