"""The compile report's reading of SASS: loops, load and MMA kinds, MMA FLOPs (no compiler needed)."""

import pytest
import torch

from tools.compile_report.capture import TorchTraffic
from tools.compile_report.cases import allowed_pairs, allowed_tiles
from tools.compile_report.sass import find_loops, load_class, mma_flops, mma_kind, parse_sass

SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;                          /* 0x00000a00ff017b82 */
                                                                                   /* 0x000e620000000800 */
        /*0010*/                   LDGSTS.E.BYPASS.128 [R35], desc[UR20][R2.64], P2 ;
        /*0020*/              @!P2 BRA 0x60 ;
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR12], RZ, !UPT ;
        /*0040*/                   LDG.E.U16 R7, desc[UR4][R2.64] ;
        /*0050*/              @P0 BRA 0x30 ;
        /*0060*/                   LDG.E.128 R8, desc[UR4][R4.64] ;
        /*0070*/                   HMMA.16816.F32.BF16 R8, R12, R16, R8 ;
        /*0080*/                   BRA 0x60 ;
        /*0090*/                   EXIT ;
        /*00a0*/                   BRA 0xa0;
"""


def test_parse_sass_reads_addresses_predicates_and_opcodes():
    instructions = parse_sass(SASS)
    assert [i.address for i in instructions] == list(range(0, 0xB0, 0x10))
    assert instructions[2].predicate == "@!P2" and instructions[2].opcode == "BRA"
    assert instructions[1].opcode == "LDGSTS.E.BYPASS.128"


def test_loops_are_innermost_backward_branch_ranges_largest_first():
    loops = find_loops(parse_sass(SASS))
    # 0x30..0x50 (3 instructions) and 0x60..0x80 (3); the trap's self-jump is no loop
    assert sorted((loop.start, loop.end, loop.instructions) for loop in loops) == [(0x30, 0x50, 3), (0x60, 0x80, 3)]


def test_nested_loops_keep_only_the_inner_one():
    sass = "\n".join(
        f"        /*{a:04x}*/                   {op} ;"
        for a, op in [(0, "NOP"), (0x10, "IADD3 R1, R1, 1"), (0x20, "@P0 BRA 0x10"), (0x30, "@P1 BRA 0x0")]
    )
    loops = find_loops(parse_sass(sass))
    assert [(loop.start, loop.end) for loop in loops] == [(0x10, 0x20)]


def test_load_classes():
    assert load_class("UTMALDG.2D") == "TMA"
    assert load_class("LDGSTS.E.BYPASS.128") == "cp.async.128"
    assert load_class("LDGSTS.E") == "cp.async.32"
    assert load_class("LDG.E.128") == "LDG.128"
    assert load_class("LDG.E.64.CONSTANT") == "LDG.64"
    assert load_class("LDG.E") == "LDG.32"
    assert load_class("LDG.E.U16") == "LDG.16"
    assert load_class("LDG.E.S8") == "LDG.8"
    assert load_class("LDS.128") is None and load_class("STG.E.128") is None


def test_mma_kinds_and_flops():
    assert mma_kind({"HGMMA.64x64x16.F32.BF16": 4, "FFMA": 9}) == "wgmma"
    assert mma_kind({"HMMA.16816.F32.BF16": 2}) == "mma.sync"
    assert mma_kind({"IMMA.16832.S8.S8": 2}) == "mma.sync"
    assert mma_kind({"FFMA": 100}) == "–"
    # wgmma is one instruction per warpgroup of 4 warps; mma.sync one per warp
    assert mma_flops("HGMMA.64x64x16.F32.BF16", num_warps=8) == 2 * 64 * 64 * 16 * 2
    assert mma_flops("HMMA.16816.F32.BF16", num_warps=4) == 2 * 16 * 8 * 16 * 4
    assert mma_flops("HMMA.1688.F32.TF32", num_warps=1) == 2 * 16 * 8 * 8
    assert mma_flops("IMMA.16832.S8.S8", num_warps=1) == 2 * 16 * 8 * 32
    assert mma_flops("FFMA", num_warps=8) == 0


def test_causal_counts():
    assert allowed_pairs(4, 4, causal=False) == 16
    assert allowed_pairs(4, 4, causal=True) == 10
    assert allowed_pairs(3, 5, causal=True) == 6  # top-left aligned, as SDPA
    assert allowed_tiles(512, 512, 128, 64, causal=False) == 32
    # query block i sees key blocks up to its diagonal: 2 + 4 + 6 + 8
    assert allowed_tiles(512, 512, 128, 64, causal=True) == 20
    assert allowed_tiles(500, 500, 128, 64, causal=True) == 2 + 4 + 6 + 8


def test_capture_leaves_gemm_outputs_unwritten_in_their_layout():
    # The capture records launches without running them, so the GEMMs around them would
    # multiply garbage: their outputs keep the op's shape, dtype and strides, unwritten.
    a, b, out = torch.randn(5, 3), torch.randn(3, 4), torch.full((5, 4), 7.0)
    with TorchTraffic():
        product = a @ b.bfloat16().float()
        written = torch.mm(a, b, out=out)
        batched = torch.baddbmm(torch.zeros(2, 5, 4), a.expand(2, 5, 3), b.expand(2, 3, 4).mT.contiguous().mT)
        with pytest.raises(RuntimeError, match="same reduction dim"):  # the meta op checks shapes
            torch.mm(a, a)
    assert product.shape == (5, 4) and product.dtype == torch.float32
    assert written.data_ptr() == out.data_ptr() and torch.equal(out, torch.full((5, 4), 7.0))
    assert batched.shape == (2, 5, 4) and batched.stride() == torch.empty(2, 5, 4).stride()
