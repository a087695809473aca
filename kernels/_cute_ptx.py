"""Inline-PTX device helpers shared by the resident CuTe kernels (kernels/experimental/resident_chain_cute.py,
kernels/moe_resident_cute.py): gpu-scope counters for grid-wide dependencies and L2 loads.

Only defined where cutlass imports (the kernels that call them are only traced there). The
`$` placeholders are the DSL's (`{$r0}` read, `{$w0}` write); `%` would be mangled.
"""
from __future__ import annotations

from raydecode.kernels._cute_dsl import Float32, cute, cutlass

if cutlass is not None:
    def ld_relaxed(ptr):
        """u32 at a global address, relaxed at gpu scope (polled across SMs)."""
        return cute.arch.inline_ptx("ld.relaxed.gpu.global.u32 {$w0}, [{$r0}];",
                                    write_only_types=[cutlass.Int32], read_only_args=[ptr])

    def ld_acquire(ptr):
        """u32 at a global address, acquire at gpu scope: what the releaser wrote before its
        release is visible to this thread after it."""
        return cute.arch.inline_ptx("ld.acquire.gpu.global.u32 {$w0}, [{$r0}];",
                                    write_only_types=[cutlass.Int32], read_only_args=[ptr])

    def red_relaxed_add(ptr, v=1):
        cute.arch.inline_ptx("red.relaxed.gpu.global.add.u32 [{$r0}], {$r1};",
                             read_only_args=[ptr, cutlass.Int32(v)])

    def red_release_add(ptr, v=1):
        """Add v at gpu scope with release: this thread's earlier writes (and, after a bar.sync,
        its CTA's) are visible to whoever acquires the sum."""
        cute.arch.inline_ptx("red.release.gpu.global.add.u32 [{$r0}], {$r1};",
                             read_only_args=[ptr, cutlass.Int32(v)])

    def atom_add_acq_rel(ptr):
        """Old value of a gpu-scope fetch-and-add of 1 (acquire + release)."""
        return cute.arch.inline_ptx("atom.acq_rel.gpu.global.add.u32 {$w0}, [{$r0}], 1;",
                                    write_only_types=[cutlass.Int32], read_only_args=[ptr])

    def st_relaxed(ptr, v):
        cute.arch.inline_ptx("st.relaxed.gpu.global.u32 [{$r0}], {$r1};",
                             read_only_args=[ptr, cutlass.Int32(v)])

    def ld_cg_u32(ptr):
        """u32 at a global address through L2 (.cg: never a stale L1 line of an earlier launch)."""
        return cute.arch.inline_ptx("ld.global.cg.u32 {$w0}, [{$r0}];",
                                    write_only_types=[cutlass.Int32], read_only_args=[ptr])

    def ld_cg_f32(ptr):
        """fp32 at a global address, through L2."""
        return cute.arch.inline_ptx("ld.global.cg.f32 {$w0}, [{$r0}];",
                                    write_only_types=[Float32], read_only_args=[ptr])

    def ld_cg_f32x4(ptr):
        """4 fp32 at a 16-byte aligned global address, through L2."""
        return cute.arch.inline_ptx("ld.global.cg.v4.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
                                    write_only_types=[Float32] * 4, read_only_args=[ptr])

    def ld_cg_bf16x8(ptr):
        """8 bf16 at a 16-byte aligned global address as 8 fp32, through L2."""
        return cute.arch.inline_ptx(
            "{ .reg .b32 a, b, c, d;\n"
            " ld.global.cg.v4.b32 {a, b, c, d}, [{$r0}];\n"
            " shl.b32 {$w0}, a, 16;  and.b32 {$w1}, a, 0xffff0000;\n"
            " shl.b32 {$w2}, b, 16;  and.b32 {$w3}, b, 0xffff0000;\n"
            " shl.b32 {$w4}, c, 16;  and.b32 {$w5}, c, 0xffff0000;\n"
            " shl.b32 {$w6}, d, 16;  and.b32 {$w7}, d, 0xffff0000; }",
            write_only_types=[Float32] * 8, read_only_args=[ptr])
