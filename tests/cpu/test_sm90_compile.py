"""scripts/explore/sm90_compile.py's reading of a TTGIR (the compile itself needs Triton and
runs by hand): loads inside a loop, cp.async copies, and a register tile sent through shared
memory to a dot operand, counted only inside loop bodies (nested regions and `} else {`
tracked)."""
from raydecode.scripts.explore.sm90_compile import _loop_stats, _value

TTGIR = """\
    %a = tt.load %p : tensor<64x!tt.ptr<i32>, #blocked>
    %r:2 = scf.for %i = %c0 to %c8 step %c1 iter_args(%x = %z) -> (tensor<64xf32>) : i32 {
      %s = tt.load %q, %m, %o : tensor<64x2x!tt.ptr<i8>, #blocked3>
      %c = ttg.async_copy_global_to_local %ptrs, %buf mask %m : tensor<...> -> <...>
      %t = ttg.local_alloc %w : (tensor<64x64xbf16, #blocked9>) -> !ttg.memdesc<64x64xbf16>
      %u = ttg.local_load %t : !ttg.memdesc<64x64xbf16> -> tensor<64x64xbf16, #ttg.dot_op<{opIdx = 0}>>
      %v = scf.if %cond -> (tensor<64xf32>) {
        %y = tt.load %q2 : tensor<64x!tt.ptr<f32>, #blocked>
        scf.yield %y : tensor<64xf32>
      } else {
        scf.yield %x : tensor<64xf32>
      } loc(#loc3)
      %n = tt.load %q3 : tensor<64x!tt.ptr<f32>, #blocked>
      scf.yield %v : tensor<64xf32>
    } loc(#loc1)
    %b = tt.load %p2 : tensor<64x!tt.ptr<i32>, #blocked>
    %d = ttg.local_alloc %e : (tensor<64x64xbf16, #blocked9>) -> !ttg.memdesc<64x64xbf16>
    %f = ttg.local_load %d : !ttg.memdesc<64x64xbf16> -> tensor<64x64xbf16, #ttg.dot_op<{opIdx = 0}>>
"""


def test_loop_stats_count_only_inside_loop_bodies():
    assert _loop_stats(TTGIR) == dict(loop_sync_loads=3, loop_async_copies=1, tile_via_smem=1)
    flat = "\n".join(line for line in TTGIR.splitlines() if "scf.for" not in line)
    assert _loop_stats(flat) == dict(loop_sync_loads=0, loop_async_copies=0, tile_via_smem=0)


def test_set_values_parse_as_numbers_and_booleans():
    assert [_value(v) for v in ("8", "0.5", "true", "False", "x2")] == [8, 0.5, True, False,
                                                                        "x2"]
