"""The Gluon kernels (kernels/w4a16_wgmma.py, kernels/w4a8_wgmma.py). Gluon has no CPU interpreter: their results
were checked against float64 on the H200 (bench_kernels.py --check-swap and every swept config, NaN-poisoned outputs;
see benchmarks/KERNELS.md). Here: the sm_90 compile shows the pipeline they exist for, and the tuner and shape rules."""

from __future__ import annotations

import pytest
import torch
from quantkit.kernels.autotune import candidates
from quantkit.kernels.gluon_common import aligned_16, launch_grid, unit_band, wgmma_fits, wgmma_split
from quantkit.kernels.spec import TileConfig
from quantkit.kernels.w4a8_wgmma import w4a8_wgmma_matmul
from quantkit.kernels.w4a16_wgmma import w4a16_wgmma_matmul
from test_kernels_w4a16 import compile_for_sm90

WGMMA_COMPILE = """
import re
from quantkit.kernels.sm90 import ptxas_report, w4a8_wgmma_ptx, w4a16_wgmma_ptx

def assert_wgmma_not_serialized(ptx):
    # ptxas serializes every wgmma of a kernel when another instruction writes an accumulator between a wgmma and its
    # wait (C7515: e.g. zeroing it at the top of each unit); the kernels zero it once and use use_acc. (Triton 3.6's
    # PTX of the earlier kernels, the H200's, drew the warning; 3.9's of the same source does not.)
    report = ptxas_report(ptx)
    assert not report["serialized"], report["text"][-2000:]

def check(dtype, bm, bn, bk, warps, per_channel, zeros, split):
    ptx = w4a16_wgmma_ptx(bm, bn, bk, warps, dtype=dtype, per_channel=per_channel, zeros=zeros, split=split,
                          band=8 if split else 1, pdl=not zeros)
    # PDL: the ring's first weight tiles are issued before waiting for the kernel that writes x
    assert ("griddepcontrol.wait" in ptx) == (not zeros)
    assert zeros or ptx.index("cp.async.bulk.tensor") < ptx.index("griddepcontrol.wait")
    mma = re.findall(r"wgmma.mma_async.sync.aligned.m64n(\\d+)k16.f32.(\\w+).(\\w+) [{][^}]*[}], [{]", ptx)
    # per K tile: one wgmma per 64 weight rows of each warpgroup, per nibble slice (4) of each 64-input chunk
    assert len(mma) == (bn // 64) // (warps // 4) * 4 * (bk // 64), (len(mma), bm, bn, bk)
    assert all(n == str(bm) and a == dtype.replace("fp", "f") for n, a, _ in mma), mma
    waits = re.findall(r"wgmma.wait_group.sync.aligned (\\d+)", ptx)
    assert waits.count("1") == 4 * (bk // 64) and waits.count("0") == 1, waits  # one in flight; one drain
    assert "cp.async.bulk.tensor" in ptx and "mbarrier.try_wait" in ptx, "no TMA ring"
    assert ptx.count("lop3.b32") >= 4 and ("atom" in ptx) == split
    assert_wgmma_not_serialized(ptx)

for dtype in ("fp16", "bf16"):
    check(dtype, 16, 128, 128, 4, False, False, True)
check("fp16", 64, 256, 128, 8, True, True, False)
check("fp16", 256, 64, 64, 4, False, True, True)

def check8(bm, bn, warps, two_level, split):
    ptx = w4a8_wgmma_ptx(bm, bn, warps, two_level=two_level, split=split, band=1 if split else 8, pdl=two_level)
    # PDL: the ring's first weight tiles are issued before waiting for the quantization kernel (x comes after)
    assert ("griddepcontrol.wait" in ptx) == two_level
    assert not two_level or ptx.index("cp.async.bulk.tensor") < ptx.index("griddepcontrol.wait")
    mma = re.findall(r"wgmma.mma_async.sync.aligned.m64n(\\d+)k32.s32.s8.s8 [{][^}]*[}], [{]", ptx)
    assert len(mma) == (bn // 64) // (warps // 4) * 4 and set(mma) == {str(bm)}, (mma, bm, bn)  # BLOCK_K 128
    waits = re.findall(r"wgmma.wait_group.sync.aligned (\\d+)", ptx)
    # one in flight per slice and a single drain per unit, or (two-level, fewer than 64 tokens) per K tile's int32
    # tile for its group multiplier; from 64 tokens two-level slices are QQQ's exact int8 (q - 8) k by one
    # multiply-add per register of weights (4 per 64 x 32 slice, 4 slices per K tile)
    exact = two_level and bm >= 64
    assert waits.count("1") == 4 and waits.count("0") == 1, waits
    assert ptx.count("mad.lo.u32 t, u,") == (16 * (bn // 64) // (warps // 4) if exact else 0)
    assert exact or "0xF0F0F0F0" in ptx
    assert "cp.async.bulk.tensor" in ptx and ("atom" in ptx) == split
    assert_wgmma_not_serialized(ptx)

check8(16, 128, 4, True, True)
check8(128, 128, 4, True, False)
check8(64, 256, 8, False, False)
print("compiled")
"""


def test_wgmma_kernels_compile_to_async_register_operand_wgmma_for_sm90() -> None:
    """What the kernels exist for, on their sm_90 compile (Triton's bundled ptxas, no GPU): register-operand wgmma
    with the tokens as its N, one mma left in flight per slice (wait_group 1) and a single drain (W4A8 two-level
    under 64 tokens: one per K tile), which ptxas does not serialize, TMA copies behind mbarriers, the slice PTX
    assembled; W4A16 fp16 / bf16, per channel / groups, zero points, split K, 8 warps; W4A8 int8 two-level (exact
    int8 slices from 64 tokens) / per channel, its weight TMAs ahead of waiting for x (PDL)."""
    compile_for_sm90(WGMMA_COMPILE)


def test_wgmma_configs_are_timed_on_hopper_only() -> None:
    assert all(c.kernel != "wgmma" for m in (8, 64, 256) for c in candidates("w4a16", m, 4096, 4096, 128, True))
    assert all(c.kernel != "wgmma" for c in candidates("w4a16", 64, 4096, 4096, 128, False, True))  # no layout
    w4a8 = candidates("w4a8", 64, 4096, 4096, 128, True, True)  # W4A8: timed after the swap kernel
    assert w4a8[0].kernel == "swap" and {c.block_k for c in w4a8 if c.kernel == "wgmma"} == {128}
    assert all(c.block_m <= 224 for m in (256, 512) for c in candidates("w4a8", m, 4096, 4096, 128, True, True)
               if c.kernel == "wgmma")  # int8 wgmma's N
    for scheme in ("w4a16", "w4a8"):  # decode: timed after the gemvs and the swap kernel, 8 tokens wide
        for m in (1, 4):
            options = candidates(scheme, m, 4096, 4096, 128, True, True)
            first = next(i for i, c in enumerate(options) if c.kernel == "wgmma")
            assert all(c.kernel == "wgmma" and c.block_m == 8 for c in options[first:]), options[first:]
    for m, first in ((16, "swap"), (32, "wgmma"), (64, "wgmma"), (256, "wgmma"), (512, "wgmma"), (1024, "dequant_mm")):
        options = candidates("w4a16", m, 4096, 14336, 128, True, True)
        assert options[0].kernel == first and any(c.kernel == "wgmma" for c in options), m
        wgmma = [c for c in options if c.kernel == "wgmma"]
        assert all(wgmma_fits(14336, 4096, 128, c.block_n, c.block_k) for c in wgmma)
        assert all(c.block_m <= max(16, m) for c in wgmma)  # wgmma's N never wider than the tokens
    for m in (256, 1024, 4096):  # W4A8 from 256 tokens: the Gluon kernel first on Hopper, int8 cuBLAS elsewhere
        assert candidates("w4a8", m, 4096, 14336, 128, True, True)[0].kernel == "wgmma"
        assert candidates("w4a8", m, 4096, 14336, 128, True, False)[0].kernel == ("int_mm" if m >= 1024 else "gemm")
    g64 = [c for c in candidates("w4a16", 64, 4096, 4096, 64, True, True) if c.kernel == "wgmma"]
    assert g64 and all(c.block_k == 64 for c in g64)  # a K tile inside one group


def test_units_go_in_bands_of_token_tiles_only_for_wide_layers() -> None:
    """Bands where a token tile's row of units outnumbers half the SMs (H200: 132): the gate_up shapes."""
    assert unit_band(28672, 128, 132) == 8 and unit_band(57344, 256, 132) == 8 and unit_band(28672, 256, 132) == 8
    assert unit_band(4096, 128, 132) == 1 and unit_band(6144, 128, 132) == 1 and unit_band(8192, 128, 132) == 1
    assert unit_band(8192, 64, 132) == 8 and unit_band(8192, 64, 256) == 1  # the SM count moves the line


def test_k_splits_give_every_unit_the_same_k_tiles() -> None:
    assert wgmma_split(14336, 128, 16, 4) == 16 and wgmma_split(14336, 128, 8, 4) == 8  # 112 K tiles
    assert wgmma_split(11008, 128, 16, 4) == 2  # 86 K tiles = 2 x 43: no larger split divides them
    assert wgmma_split(4096, 128, 16, 6) == 4  # 32 K tiles: at least 5 per unit (the ring looks 5 ahead)
    assert wgmma_split(256, 128, 4, 4) == 0  # 2 K tiles cannot fill a 4-stage ring's lookahead
    for m, n, k in ((1, 4096, 14336), (64, 28672, 4096), (300, 6144, 4096)):
        for c in (c for c in candidates("w4a16", m, n, k, 128, True, True) if c.kernel == "wgmma"):
            tiles = k // c.block_k
            assert tiles % c.split_k == 0 and tiles // c.split_k >= c.num_stages - 1, c
            assert launch_grid(m, n, k, 128, c) == ((n // c.block_n) * -(-m // c.block_m) * c.split_k,
                                                    (n // c.block_n) * -(-m // c.block_m))
    cfg = TileConfig("wgmma", 16, 128, 128, 16, num_warps=4, num_stages=4)
    with pytest.raises(ValueError, match="split 16, 4 stages does not fit"):
        launch_grid(16, 4096, 4096, 128, cfg)  # 2 K tiles per unit


def test_tile_rules() -> None:
    assert wgmma_fits(4096, 4096, 128, 128, 128) and wgmma_fits(4096, 4096, 4096, 256, 256)
    assert not wgmma_fits(4096, 4096, 4096, 128, 512)  # a 256-byte weight box row: over TMA's swizzle limit
    assert not wgmma_fits(4096, 4096, 64, 128, 128)  # a K tile across two groups (one scale per tile)
    assert not wgmma_fits(4096, 4160, 128, 128, 128)  # N not a multiple of the tile
    assert not wgmma_fits(4000, 4096, 4000, 128, 160)  # K tiles of whole 64-input chunks only
    x, packed = torch.zeros(16, 4096, dtype=torch.float16), torch.zeros(4160, 1024, dtype=torch.int16)
    cfg = TileConfig("wgmma", 16, 128, 128, 1, num_warps=4, num_stages=4)
    with pytest.raises(ValueError, match="does not fit N 4160"):
        w4a16_wgmma_matmul(x, packed, torch.ones(32, 4160, dtype=torch.float16), None, None, 128, cfg)
    packed8, channel = torch.zeros(4160, 2048, dtype=torch.int8), torch.ones(4160)
    with pytest.raises(ValueError, match="does not fit N 4160"):  # before the activations are quantized
        w4a8_wgmma_matmul(x, packed8, channel, torch.ones(32, 4160, dtype=torch.float16), None, None, 128, cfg)


def test_activations_reach_tma_16_byte_aligned() -> None:
    """An aligned contiguous x passes as it is; a slice starting 2 bytes in, or a transposed view, is copied to an
    aligned contiguous tensor with the same values."""
    base = torch.randn(9, 64, dtype=torch.float16)
    assert aligned_16(base) is base
    for view in (base.reshape(-1)[1:1 + 8 * 64].reshape(8, 64), base[:, :32].t()):
        assert view.data_ptr() % 16 or not view.is_contiguous()
        copy = aligned_16(view)
        assert copy.is_contiguous() and copy.data_ptr() % 16 == 0
        assert torch.equal(copy, view)
