"""W4A8 on Hopper in Gluon: int8 wgmma with the int4 weight as its asynchronous register operand.

The W4A8 sibling of w4a16_wgmma.py (read it first), on w4a8_swap.py's int8 [N, K/2] layout (two slices of 32 inputs
per 64-input chunk, a nibble already being the int8 16 (q - 8) in the high half of a byte: `and` or `shl` + `and`
per four weights). Per-token int8 activations come from common.quantize_rows; x's int8 tile is TMA'd as boxes of
[BLOCK_M, 64]. On sm_90 the kernel is launched as quantize_rows' programmatic dependent (common.dependent_launch): its
ring's first weight tiles are issued before it waits for that kernel (griddepcontrol.wait), x's after. Each slice is
one async int8 wgmma (K = 32) followed by `wait_group 1`.
Per channel the slices are 16 (q - 8) and the int32 accumulator runs over all of K (epilogue x channel scale x token
scale / 16). Two-level (QQQ, integer group multipliers k in 0..16, a K tile inside one group), as w4a8_swap.py:
- tiles of 64 tokens or more: the slices are QQQ's int8 weights (q - 8) k, made by a multiply-add per four weights
  from the K tile's k of each row, and the accumulator runs over all of K as per channel;
- fewer tokens: each K tile accumulates 16 (q - 8) x into its own int32 tile, drained (`wait_group 0`) and added as
  (tile >> 4) k; cheaper there, where a slice's mma is small next to its dequantization (an H200 A/B).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from .common import (
    CHUNK_TL,
    EXACT_FROM_M,
    HIGH_SLICE_K_PTX,
    HIGH_SLICE_PTX,
    LOW_SLICE_K_PTX,
    LOW_SLICE_PTX,
    MAX_K,
    SLICE_K_CONSTRAINTS,
    dependent_launch_args,
    quantize_rows,
    require_symmetric,
    split_buffers,
)
from .gluon_common import (
    cta_barrier,
    descriptor,
    device_unit_band,
    issue_tile,
    launch_grid,
    start_program,
    store_tile,
    tile_ahead,
    unit_coords,
    wgmma_candidates,
)
from .layout import CHUNK, checked_layout
from .spec import KernelSpec, TileConfig


@gluon.jit
def _slice(b, k, c, j: gl.constexpr, TWO_LEVEL: gl.constexpr):
    """Slice j (0: high nibbles, inputs 0..31 of a chunk; 1: low, 32..63) of the int8 weight tile: 16 (q - 8), or
    (two-level) (q - 8) k with k and c = (128 - 8 k) * 0x01010101 broadcast along the rows."""
    if TWO_LEVEL:
        return gl.inline_asm_elementwise(HIGH_SLICE_K_PTX if j == 0 else LOW_SLICE_K_PTX, SLICE_K_CONSTRAINTS, [b, k, c], dtype=gl.int8,
                                         is_pure=True, pack=4)
    return gl.inline_asm_elementwise(HIGH_SLICE_PTX if j == 0 else LOW_SLICE_PTX, "=r,r", [b], dtype=gl.int8, is_pure=True, pack=4)


@gluon.jit(do_not_specialize=["M", "SPLIT_K"])
def _w4a8_wgmma_kernel(x_desc, w_desc, ts_ptr, cs_ptr, gs_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K,
                       GROUP: gl.constexpr, TWO_LEVEL: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT_K,
                       IS_SPLIT: gl.constexpr, STAGES: gl.constexpr, BAND: gl.constexpr, PDL: gl.constexpr,
                       num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = 2 * w_desc.block_type.shape[1]
    CHUNKS: gl.constexpr = BLOCK_K // CHUNK_TL
    DRAIN: gl.constexpr = TWO_LEVEL and BLOCK_M < EXACT_FROM_M
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_M, 32])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=4)
    if DRAIN:  # the group multipliers scale a drained tile, else the weight registers
        rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
        tile = gl.zeros([BLOCK_N, BLOCK_M], gl.int32, acc_layout)
    else:
        rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_layout))

    # PDL: launched while quantize_rows runs; the ring's first weight tiles load before waiting for its x
    units, tiles, grid_n, grid_m, w_smem, x_smem, bars = start_program(w_desc, x_desc, M, N, K, SPLIT_K, BLOCK_K,
                                                                         STAGES, BAND, PDL)
    pid, programs = gl.program_id(0), gl.num_programs(0)
    # zeroed once: a unit's first mma ignores it (use_acc); see w4a16_wgmma.py (ptxas's C7515)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.int32, acc_layout)
    f = 0
    for u in range(pid, units, programs):
        off_n, off_m, pid_k, out_tile = unit_coords(u, units, grid_n, grid_m, BLOCK_N, BLOCK_M, BAND)
        nxt_n, nxt_m, nxt_k, _ = unit_coords(u + programs, units, grid_n, grid_m, BLOCK_N, BLOCK_M, BAND)
        more = u + programs < units
        if DRAIN:  # there acc is no mma's accumulator
            acc = gl.zeros_like(acc)
        for kt in range(tiles):
            stage = f % STAGES
            if TWO_LEVEL:  # this tile's integer group multipliers (broadcast along the rows), before the data wait
                group = (pid_k + kt * SPLIT_K) * BLOCK_K // GROUP
                k = gl.expand_dims(gl.load(gs_ptr + group * N + off_n + rows).to(gl.int32), 1)
                c = k * -134744072 + -2139062144  # (128 - 8 k) * 0x01010101, in wrapping int32 arithmetic
            else:
                k = 0
                c = 0
            mbarrier.wait(bars.index(stage), (f // STAGES) & 1)
            for ch in gl.static_range(CHUNKS):
                b8 = w_smem.index(stage).slice(32 * ch, 32, dim=1).load(a_layout)
                for j in gl.static_range(2):
                    xt = x_smem.index(stage * CHUNKS + ch).slice(32 * j, 32, dim=1).permute((1, 0))
                    # (int8 registers cannot be threaded through the wait in Triton 3.6; ptxas keeps an in-flight
                    # wgmma's registers live, which it reports when it has to serialize: it does not here)
                    if DRAIN:
                        tile = warpgroup_mma(_slice(b8, k, c, j, False), xt, tile, use_acc=ch + j > 0, is_async=True)
                        tile = warpgroup_mma_wait(num_outstanding=1, deps=(tile,))
                    else:
                        acc = warpgroup_mma(_slice(b8, k, c, j, TWO_LEVEL), xt, acc, use_acc=kt > 0 or ch + j > 0,
                                            is_async=True)
                        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                    if ch == 0 and j == 0:  # the previous iteration's mmas are done: its stage takes f + STAGES - 1
                        if num_warps > 4:
                            cta_barrier()
                        n_, m_, k_, kt_ = tile_ahead(kt, STAGES - 1, tiles, (off_n, off_m, pid_k), (nxt_n, nxt_m, nxt_k))
                        issue_tile(w_desc, x_desc, w_smem, x_smem, bars, (f + STAGES - 1) % STAGES, n_, m_,
                                   (k_ + kt_ * SPLIT_K) * BLOCK_K, N, more | (kt + STAGES - 1 < tiles), CHUNKS)
            if DRAIN:  # 16 (q - 8) . x is divisible by 16: shifted back exactly, times the group's multiplier
                tile = warpgroup_mma_wait(num_outstanding=0, deps=(tile,))
                acc += (tile >> 4) * k
            f += 1
        if not DRAIN:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        store_tile(acc, out_ptr, part_ptr, count_ptr, bias_ptr, cs_ptr, ts_ptr, M, N, off_n, off_m, pid_k, out_tile,
                   SPLIT_K, 1.0 if TWO_LEVEL else 0.0625, IS_SPLIT, HAS_BIAS, True, True, BLOCK_N, BLOCK_M,
                   num_warps)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


def w4a8_wgmma_matmul(x: torch.Tensor, packed: torch.Tensor, channel_scales: torch.Tensor,
                      group_scales: torch.Tensor | None, zeros: torch.Tensor | None, bias: torch.Tensor | None,
                      group_size: int, config: TileConfig) -> torch.Tensor:
    """As w4a8_swap_matmul (same layout and arguments), on the Gluon kernel."""
    require_symmetric(zeros, "w4a8 wgmma kernel")
    m, k = x.shape
    split, block_m, block_n, block_k = config.split_k, config.block_m, config.block_n, config.block_k
    n = checked_layout(packed, k, block_k, "w4a8 wgmma kernel")
    two_level = group_scales is not None and group_size != k
    if k > MAX_K:
        raise ValueError(f"w4a8 wgmma kernel: K {k} over {MAX_K} (int32 accumulation)")
    programs, tiles = launch_grid(m, n, k, group_size if two_level else k, config)
    if group_scales is not None and not two_level:  # one group over all of K: its multiplier joins the channel
        channel_scales = channel_scales * group_scales[0].float()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part, counters = split_buffers(split, m, n, tiles, x.device) if split > 1 else (out, out)
    xq, ts, _ = quantize_rows(x, sums=False)  # the kernel launched right before the GEMM (its PDL predecessor)
    _w4a8_wgmma_kernel[(programs,)](
        descriptor(xq, [block_m, CHUNK]), descriptor(packed, [block_n, block_k // 2]), ts, channel_scales,
        group_scales if two_level else channel_scales, bias if bias is not None else channel_scales, out, part,
        counters, m, n, k, GROUP=group_size, TWO_LEVEL=two_level, HAS_BIAS=bias is not None, SPLIT_K=split,
        IS_SPLIT=split > 1, STAGES=config.num_stages, BAND=device_unit_band(n, block_n, x.device),
        num_warps=config.num_warps, **dependent_launch_args(x.device))
    return out


# By M bucket: (BM, BN, BK, warps, stages), BK 128 (a K tile inside a QQQ group of 128). From 256 tokens also 8-warp
# 128 x 128 tiles, which ptxas fits without spills since the kernels stopped serializing their wgmmas.
WGMMA_TILES = {
    8: ((8, 128, 128, 4, 4), (8, 256, 128, 8, 4), (8, 64, 128, 4, 6)),
    16: ((16, 128, 128, 4, 4), (16, 256, 128, 4, 4), (16, 128, 128, 4, 6), (16, 256, 128, 8, 4)),
    32: ((32, 128, 128, 4, 4), (32, 256, 128, 8, 4)),
    64: ((64, 128, 128, 4, 4), (64, 256, 128, 4, 4), (64, 256, 128, 8, 3), (64, 64, 128, 4, 4)),
    128: ((128, 128, 128, 4, 3), (64, 256, 128, 8, 3), (128, 64, 128, 4, 4)),
    256: ((128, 128, 128, 4, 3), (128, 64, 128, 4, 4), (64, 256, 128, 8, 3), (128, 128, 128, 8, 4),
          (128, 256, 128, 8, 3)),  # int8 wgmma: N <= 224
}

SPECS = (KernelSpec("wgmma", "w4a8", "swap", wgmma_candidates(WGMMA_TILES), w4a8_wgmma_matmul, buckets=(1, 4096),
                    hopper=True),)
