"""kernels/experimental/l2_prefetch.py: the (address, bytes) tables cover exactly the tensors' bytes, in
aligned chunks, padded for the one-warp programs; bad tables and chunk sizes are refused; on
CPU the prefetch and the side branch are no-ops that still validate."""
import os
import subprocess
import sys

import pytest
import torch

from raydecode.kernels.experimental import l2_prefetch as P


def _distinct(table: torch.Tensor) -> list[tuple[int, int]]:
    return sorted({tuple(r) for r in table.tolist()})


def _covered(table: torch.Tensor) -> set[int]:
    return {b for a, n in _distinct(table) for b in range(a, a + n)}


def test_ranges_of_separate_tensors_are_their_bytes():
    a = torch.randn(37, 11)                         # 1628 bytes: not a multiple of 16
    b = torch.randn(5, dtype=torch.float64)
    spans = P.prefetch_ranges([a, b])
    want = sorted([(a.data_ptr() // 16 * 16, -(-(a.data_ptr() + a.nbytes) // 16) * 16),
                   (b.data_ptr() // 16 * 16, -(-(b.data_ptr() + b.nbytes) // 16) * 16)])
    covered = {b for lo, hi in spans for b in range(lo, hi)}
    assert covered == {b for lo, hi in want for b in range(lo, hi)}   # merged if they abut
    assert all(lo % 16 == 0 and hi % 16 == 0 for lo, hi in spans)


def test_views_of_one_storage_merge_and_strided_views_span():
    base = torch.randn(64, 128)
    top, bottom, overlap = base[:40], base[40:], base[20:50]
    assert P.prefetch_ranges([bottom, top, overlap]) == [(base.data_ptr(),
                                                          base.data_ptr() + base.nbytes)]
    col = base[:, 3]                                # stride 128: spans rows 0..63 of column 3
    (lo, hi), = P.prefetch_ranges([col])
    assert lo <= col.data_ptr() and hi >= base[63, 3:4].data_ptr() + 4
    assert hi - lo < base.nbytes


@pytest.mark.parametrize("chunk", [16, 4096, 16384])
def test_table_chunks_cover_exactly_and_pad(chunk):
    g = torch.Generator().manual_seed(chunk)
    ts = [torch.randn(int(n), generator=g) for n in torch.randint(1, 9000, (5,), generator=g)]
    table = P.prefetch_table(ts, chunk_bytes=chunk)
    assert table.dtype == torch.int64 and table.shape[1] == 2
    assert table.shape[0] % P.ROWS_PER_PROGRAM == 0
    rows = table.tolist()
    assert all(a % 16 == 0 and 0 < n <= chunk and n % 16 == 0 for a, n in rows)
    n_real = len(_distinct(table))
    assert all(r == rows[n_real - 1] for r in rows[n_real:])     # padding repeats the last row
    want = {b for lo, hi in P.prefetch_ranges(ts) for b in range(lo, hi)}
    assert _covered(table) == want
    assert P.table_bytes(table) == len(want)


def test_budget_takes_the_leading_bytes():
    w = torch.randn(1000, 256)                      # 1 024 000 bytes
    table = P.prefetch_table([w], chunk_bytes=4096, max_bytes=100_000)
    assert P.table_bytes(table) == 100_000 // 16 * 16
    assert min(a for a, _ in _distinct(table)) == w.data_ptr() // 16 * 16
    assert P.prefetch_table([w], max_bytes=0).shape == (0, 2)
    assert P.table_bytes(P.prefetch_table([w], max_bytes=10 ** 9)) == w.nbytes


def test_empty_inputs_give_an_empty_table():
    assert P.prefetch_table([]).shape == (0, 2)
    assert P.prefetch_table([torch.empty(0, 7)]).shape == (0, 2)


@pytest.mark.parametrize("chunk", [0, -16, 24])
def test_bad_chunk_size_is_named(chunk):
    with pytest.raises(ValueError, match=f"chunk_bytes = {chunk}"):
        P.prefetch_table([torch.randn(4)], chunk_bytes=chunk)


def test_bad_budget_and_inputs_are_named():
    with pytest.raises(ValueError, match="max_bytes = -1"):
        P.prefetch_table([torch.randn(4)], max_bytes=-1)
    with pytest.raises(TypeError, match="list"):
        P.prefetch_ranges([[1, 2]])


@pytest.mark.parametrize("table, match", [
    (torch.zeros(32, 2, dtype=torch.int32), "dtype torch.int32"),
    (torch.zeros(32, 3, dtype=torch.int64), r"shape \(32, 3\)"),
    (torch.zeros(31, 2, dtype=torch.int64), "31 rows"),
])
def test_prefetch_refuses_malformed_tables(table, match):
    with pytest.raises(ValueError, match=match):
        P.l2_prefetch(table)
    with pytest.raises(ValueError, match=match):
        P.SidePrefetch().issue(table)


def test_cpu_prefetch_and_side_branch_are_no_ops():
    w = torch.randn(300, 77)
    before = w.clone()
    table = P.prefetch_table([w])
    P.l2_prefetch(table)
    side = P.SidePrefetch()
    side.issue(table)
    assert side.launches == 0                       # nothing launched on CPU tensors
    side.join()
    assert torch.equal(w, before)


@pytest.mark.parametrize("variants, named", [("bulk:24", "bulk:24"), ("warp:16", "warp:16"),
                                             ("lines:0", "lines:0"), ("bulk", "'bulk'")])
def test_bench_refuses_bad_variants_by_name(variants, named, tmp_path, capsys):
    from raydecode.scripts.explore import l2_prefetch as bench

    with pytest.raises(SystemExit) as e:
        bench.main(["--out", str(tmp_path / "o.json"), "--variants", variants])
    assert e.value.code == 2
    assert named in capsys.readouterr().err


def test_chain_bench_refuses_unknown_variants(tmp_path, capsys):
    from raydecode.scripts.explore import persistent_chain as bench

    with pytest.raises(SystemExit) as e:
        bench.main(["--out", str(tmp_path / "o.json"), "--variants", "persist,megakernel"])
    assert e.value.code == 2
    assert "megakernel" in capsys.readouterr().err


@pytest.mark.parametrize("env, value, named", [
    ("RAYDECODE_L2PF_KIND", "warp", "RAYDECODE_L2PF_KIND='warp'"),
    ("RAYDECODE_L2PF_CHUNK", "1000", "RAYDECODE_L2PF_CHUNK='1000'"),
    ("RAYDECODE_L2PF_CHUNK", "big", "RAYDECODE_L2PF_CHUNK='big'"),
])
def test_bad_environment_switches_are_named(env, value, named):
    r = subprocess.run([sys.executable, "-c", "import raydecode.kernels.experimental.l2_prefetch"],
                       env={**os.environ, env: value}, capture_output=True, text=True)
    assert r.returncode != 0 and named in r.stderr
