"""The GEMV tuning sweep's candidate mappings and the layer benchmark's `--gemv-config` override
(pure config logic: the timing itself needs a GPU)."""
from __future__ import annotations

import json

import pytest

from raydecode.kernels import gemv as G
from raydecode.scripts.explore import gemv_tune as T
from raydecode.scripts.bench import options as LB

K3_TP16 = [(3584, 7168), (7168, 768), (3216, 7168), (1048, 7168), (900, 7168), (7168, 640),
           (1152, 1536)]


@pytest.mark.parametrize("N,K", K3_TP16)
def test_candidates_are_valid_distinct_and_start_with_production(N, K):
    cs = T.candidate_configs(N, K, 24)
    prod = G.config_for(1, N, K)
    assert (cs[0].lanes_per_row, cs[0].k_warps, cs[0].rows_per_group, cs[0].row_warps) == \
        (prod.lanes_per_row, prod.k_warps, prod.rows_per_group, prod.row_warps)
    assert len(cs) == len(set(cs)) <= 25
    for c in cs:
        c.validate(1, N, K)                     # raises if the mapping does not tile the shape
        assert c.pdl and c.l2_prefetch_mib == 0
    counts = [T.warps(c, N) for c in cs[1:]]
    assert max(counts.count(n) for n in counts) <= 4
    assert len(set(counts)) >= 3                 # spans several warp counts


def test_spread_counts_the_last_wave():
    c = G.GemvConfig(32, 4, 4, 4, 1)             # 16 rows per CTA: 3584 rows -> 224 CTAs
    assert T.spread(c, 3584) == pytest.approx(224 / 264)
    assert T.spread(G.GemvConfig(32, 1, 1, 1, 1), 4224) == 1.0     # 4224 CTAs = 32 per SM


def test_layer_gemv_override_sets_tuned_and_rejects_bad_input():
    """--gemv-config becomes an override of the tuned table in the run's DecodeOptions;
    config_for under those options returns it (the table itself is untouched)."""
    before = dict(G.TUNED)
    over = LB.gemv_mapping('3584,7168=' + json.dumps(
        {"lanes_per_row": 32, "k_warps": 2, "rows_per_group": 1, "row_warps": 4}))
    got = G.config_for(1, 3584, 7168, overrides=(over,))
    assert (got.lanes_per_row, got.k_warps, got.rows_per_group, got.row_warps) == (32, 2, 1, 4)
    assert G.TUNED == before and G.config_for(1, 3584, 7168) != got
    with pytest.raises(ValueError, match="accepted keys"):
        LB.gemv_mapping('3584,7168={"lanes": 32}')
    with pytest.raises(ValueError, match="rows_per_cta"):      # 3584 % 24 rows per CTA
        LB.gemv_mapping('3584,7168=' + json.dumps(
            {"lanes_per_row": 4, "k_warps": 1, "rows_per_group": 3, "row_warps": 1}))


@pytest.mark.parametrize("spec", ['3584,7168={"lanes": 32}', "3584", 'x,7168={}'])
def test_gemv_config_flags_name_the_bad_value(spec):
    """layer.py and step.py's --gemv-config: one message names the value and the form."""
    with pytest.raises(ValueError, match=r"--gemv-config .*expected N,K=\{GemvConfig"):
        LB.gemv_mappings([spec])
