"""The Gluon TMA gemv (kernels/w4a16_tma_gemv.py). Gluon has no CPU interpreter: its results were checked against
float64 on the H200 (NaN-poisoned outputs, g64 / g128 / g256 / per channel, zero points, bias, split K, 1 and 3 tokens:
benchmarks/kernels/RESULTS.md; bench_kernels.py --check-swap). Here: the sm_90 compile shows the
pipeline it exists for, and the tuner and shape rules."""

from __future__ import annotations

import pytest
import torch
from quantkit.kernels.autotune import candidates
from quantkit.kernels.spec import Problem, TileConfig
from quantkit.kernels.w4a16_tma_gemv import tma_gemv_candidates, tma_gemv_fits, tma_gemv_split, w4a16_tma_gemv
from test_kernels_w4a16 import compile_for_sm90

TMA_GEMV_COMPILE = """
from quantkit.kernels.sm90 import ptxas_report, w4a16_tma_gemv_ptx

def check(bn, bk, warps, stages, per_channel, zeros, split):
    ptx = w4a16_tma_gemv_ptx(bn, bk, warps, stages, per_channel=per_channel, zeros=zeros, split=split)
    words = bk // 8  # int32 words per row of a K tile
    threads_along_k = min(32, words // 4)
    rows = bn // (32 // threads_along_k * warps)  # weight rows per thread
    # the weight only by TMA into the ring (one copy per stage up front, one per tile after), behind mbarriers
    assert ptx.count("cp.async.bulk.tensor.2d") == stages + 1 and "mbarrier.try_wait" in ptx, "no TMA ring"
    assert ptx.count("ld.shared.v4.b32") == rows, (ptx.count("ld.shared.v4.b32"), rows)  # 4 words a row, 16 bytes
    # x: one 16-byte load per nibble slice, for the first tile and each prefetch of the next
    assert ptx.count("ld.global.v4.b32") == 8, ptx.count("ld.global.v4.b32")
    assert ptx.count("lop3.b32") == 16 * rows  # 4 per word (Marlin's nibble-to-fp16 OR), 4 words a row
    assert ("atom" in ptx) == split
    # PDL: the ring's first weight tiles are in flight before the wait for the kernel that writes x, x loads after
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.index("cp.async.bulk.tensor") < wait < ptx.index("ld.global.v4.b32")
    report = ptxas_report(ptx)
    assert report["spill_bytes"] == 0, report["text"][-2000:]

check(128, 256, 4, 2, False, False, False)
check(64, 256, 4, 3, False, True, True)
check(128, 1024, 8, 2, True, False, True)
check(32, 512, 4, 4, True, True, False)
print("compiled")
"""


def test_tma_gemv_compiles_to_a_tma_ring_and_vector_loads_for_sm90() -> None:
    """What the kernel exists for, on its sm_90 compile (Triton's bundled ptxas, no GPU): the weight arrives only
    through TMA copies behind mbarriers, each thread reads 16 bytes of a row per shared load and x's pairs in
    16-byte loads, the half2 word dots are assembled, nothing spills; g128 / per channel, zero points, split K; under
    PDL the weight ring starts before the wait for x."""
    compile_for_sm90(TMA_GEMV_COMPILE)


def test_tma_gemv_is_a_candidate_for_fp16_decode_on_hopper_only() -> None:
    def kinds(m: int, n: int, k: int, hopper: bool = True, fp16: bool = True, swap: bool = True) -> list[str]:
        return [c.kernel for c in candidates("w4a16", m, n, k, 128, swap, hopper, fp16)]

    assert "tma_gemv" not in kinds(1, 28672, 4096, hopper=False)
    assert "tma_gemv" not in kinds(1, 28672, 4096, fp16=False)  # bf16: no half2 dot
    assert "tma_gemv" not in kinds(1, 28672, 4096, swap=False)  # it reads the swap layout
    assert "tma_gemv" not in kinds(8, 28672, 4096)
    assert not any(c.kernel == "tma_gemv" for c in candidates("w4a8", 1, 28672, 4096, 128, True, True))
    # one token: it leads on large layers (2**26 weights and up), the swap gemv on the others; bf16 keeps gemv_h2
    assert kinds(1, 28672, 4096)[0] == "tma_gemv" and kinds(1, 57344, 8192)[0] == "tma_gemv"
    assert kinds(1, 6144, 4096)[0] == "swap_gemv" and "tma_gemv" in kinds(1, 6144, 4096)
    assert kinds(1, 28672, 4096, fp16=False)[0] == "gemv_h2"
    # two to four tokens: after the tensor-core swap kernel, ahead of the other gemvs
    options = kinds(4, 4096, 14336)
    assert options[0] == "swap" and options.index("tma_gemv") < options.index("swap_gemv")


def test_tma_gemv_splits_keep_about_four_programs_per_sm() -> None:
    # the measured best split of both tuned tiles on the H200 (BLOCK_K 256; 8B o, 64 rows: S8 and S4 tied)
    for (n, k), best in {(6144, 4096): (8, 4), (4096, 4096): (8, 8), (28672, 4096): (2, 1), (4096, 14336): (8, 8),
                         (57344, 8192): (1, 1), (8192, 28672): (8, 4)}.items():
        assert (tma_gemv_split(n, k, 128, 256), tma_gemv_split(n, k, 64, 256)) == best, (n, k)
    assert tma_gemv_split(4096, 512, 128, 256) == 1  # 2 K tiles: a split would leave one each
    for c in tma_gemv_candidates(Problem("w4a16", 1, 4096, 14336, 128)):
        assert tma_gemv_fits(14336, 4096, 128, c.block_n, c.block_k, c.split_k)
    assert tma_gemv_candidates(Problem("w4a16", 1, 4096, 4096, 32)) == []  # a 64-input chunk across two groups


def test_tma_gemv_tile_rules_and_errors() -> None:
    assert tma_gemv_fits(4096, 4096, 128, 128, 256, 8) and tma_gemv_fits(4096, 4096, 4096, 64, 2048, 2)
    assert not tma_gemv_fits(4096, 4096, 128, 128, 256, 3)  # 16 K tiles do not split in 3 equal ranges
    assert not tma_gemv_fits(4096, 4096, 128, 128, 4096, 1)  # a TMA box row over 256 words
    assert not tma_gemv_fits(4096, 4160, 128, 128, 256, 1)  # N not a multiple of the tile
    assert not tma_gemv_fits(4096, 4096, 32, 128, 256, 1)  # group under a 64-input chunk
    assert not tma_gemv_fits(6144, 4096, 128, 128, 192, 1)  # 24 words a row: no power-of-two thread layout
    assert not tma_gemv_fits(4096, 4032, 128, 96, 256, 1)
    cfg = TileConfig("tma_gemv", 1, 128, 256, 1, num_warps=4, num_stages=2)
    packed, scales = torch.zeros(4160, 1024, dtype=torch.int16), torch.ones(32, 4160, dtype=torch.float16)
    with pytest.raises(ValueError, match="does not fit N 4160"):
        w4a16_tma_gemv(torch.zeros(1, 4096, dtype=torch.float16), packed, scales, None, None, 128, cfg)
    with pytest.raises(ValueError, match="fp16 activations only"):
        w4a16_tma_gemv(torch.zeros(1, 4096, dtype=torch.bfloat16), packed, scales.bfloat16(), None, None, 128, cfg)
