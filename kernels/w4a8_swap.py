"""W4A8 GEMM on Hopper: out^T = W x_int8^T on int8 wgmma, with the int4 weight as the register operand.

The W4A8 sibling of w4a16_swap.py (read its doc first): the weight fills wgmma's 64-row side from registers,
the per-token int8 activations (common.quantize_rows) its N side from shared memory, both cp.async-pipelined.
Int8 wgmma takes K = 32 per instruction, so the weight's own layout has two slices of 32 inputs per 64-input
chunk: int8 [N, K/2], byte (n, t) holding input 64 (t // 32) + t % 32 in its high nibble and input
64 (t // 32) + 32 + t % 32 in its low one, each as q - 8 in 4-bit two's complement (q xor 8). A nibble in
the high half of a byte *is* the int8 16 (q - 8), so a slice costs one `and` (high) or `shl` + `and` (low) per
four weights, and the int32 accumulator holds 16 times the dot product (|16 (q - 8)| <= 128: no overflow for
K <= 2**31 / (127 * 128) = 132,104).

Two-level (QQQ) scales are taken when every group scale is an integer k in 0..16 (what quantkit's QQQ writes:
s_g = k * s_ch): then round((q - 8) k) = (q - 8) k, QQQ's int8 weight exactly (a K tile never spans two groups).
Tiles of EXACT_FROM_M tokens or more make it in registers with one multiply-add per four weights: with u the bytes q
(nibble xor 8), u * k + (128 - 8 k) * 0x01010101 puts (q - 8) k + 128 in [0, 255] in each byte with no carry into the
next, and xor 0x80 per byte leaves the int8 (q - 8) k; the int32 accumulator then runs over all of K as per channel.
Smaller tiles accumulate each K tile's 16 (q - 8) x into its own int32 tile, shifted back by 4 and multiplied by k
exactly (fewer instructions per slice, one drain per K tile). Epilogue: token scale x channel scale (/ 16 for
16 (q - 8) weights), bias, fused split-K (common.store_output). Symmetric weights only (zero 8). On sm_90 the kernel is
launched as quantize_rows' programmatic dependent (common.dependent_launch) and waits for it before anything else.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from .common import (
    CHUNK_TL,
    EXACT_FROM_M,
    HIGH_SLICE_K_PTX,
    HIGH_SLICE_PTX,
    LOW_SLICE_K_PTX,
    LOW_SLICE_PTX,
    MAX_K,
    MMA_SYNC_TILES,
    SLICE_K_CONSTRAINTS,
    block_start,
    dependent_launch_args,
    interpreting,
    quantize_rows,
    require_symmetric,
    split_buffers,
    store_output,
    swap_program,
    swap_tile_candidates,
)
from .layout import CHUNK, checked_layout
from .spec import KernelSpec, TileConfig

RUN = 32  # contiguous inputs per slice: int8 wgmma's K
_RUN = tl.constexpr(RUN)
@triton.jit
def _slice(b, j: tl.constexpr, PTX: tl.constexpr):
    """Slice j of the int8 weight tile as 16 (q - 8): elementwise, so it stays in wgmma's register layout."""
    if PTX:  # four bytes per instruction
        return tl.inline_asm_elementwise(HIGH_SLICE_PTX if j == 0 else LOW_SLICE_PTX, "=r,r", [b], dtype=tl.int8, is_pure=True, pack=4)
    return b & -16 if j == 0 else b << 4


@triton.jit
def _slice_times_k(b, k, c, j: tl.constexpr, PTX: tl.constexpr):
    """Slice j as QQQ's int8 (q - 8) k; k (int32, 0..16) and c = (128 - 8 k) * 0x01010101 broadcast along rows."""
    if PTX:
        return tl.inline_asm_elementwise(HIGH_SLICE_K_PTX if j == 0 else LOW_SLICE_K_PTX, SLICE_K_CONSTRAINTS, [b, k, c], dtype=tl.int8,
                                         is_pure=True, pack=4)
    return ((_slice(b, j, PTX) >> 4) * k).to(tl.int8)


@triton.jit
def _w4a8_swap_kernel(xq_ptr, ts_ptr, b_ptr, cs_ptr, gs_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K, W,
                      GROUP: tl.constexpr, TWO_LEVEL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PTX: tl.constexpr,
                      PDL: tl.constexpr):
    if PDL:  # launched while quantize_rows runs: wait for its x and token scales
        gdc_wait()
    pid, pid_k, offs_m, offs_n = swap_program(M, BLOCK_M, BLOCK_N)
    offs_t = tl.arange(0, BLOCK_K // 2)
    b_ptrs = b_ptr + offs_n[:, None] * W + offs_t[None, :]  # W: bytes per row of the plain or k_blocked layout
    x_ptrs = xq_ptr + offs_m[None, :] * K + ((offs_t // _RUN) * CHUNK_TL + offs_t % _RUN)[:, None]  # slice 0, [BK/2, BM]
    m_mask = offs_m[None, :] < M
    exact: tl.constexpr = TWO_LEVEL and BLOCK_M >= EXACT_FROM_M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32)
    for kt in range(pid_k, K // BLOCK_K, SPLIT_K):
        k0 = kt * BLOCK_K
        b = tl.load(b_ptrs + block_start(k0 // 2, W, N, BLOCK_K // 2))
        if TWO_LEVEL:  # the group's integer multipliers, one per row
            k = tl.load(gs_ptr + (k0 // GROUP) * N + offs_n).to(tl.int32)[:, None]
            c = k * -134744072 + -2139062144  # (128 - 8 k) * 0x01010101, in wrapping int32 arithmetic
        tile = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32) if TWO_LEVEL and not exact else acc
        for j in tl.static_range(2):
            xt = tl.load(x_ptrs + k0 + _RUN * j, mask=m_mask, other=0)
            a = _slice_times_k(b, k, c, j, PTX) if exact else _slice(b, j, PTX)
            tile = tl.dot(a, xt, tile, out_dtype=tl.int32)
        if TWO_LEVEL and not exact:  # 16 (q - 8) . x, exactly divisible by 16, times the group's multiplier
            acc += (tile >> 4) * k
        else:
            acc = tile
    out = acc.to(tl.float32) * tl.load(cs_ptr + offs_n)[:, None]
    out *= tl.load(ts_ptr + offs_m, mask=offs_m < M, other=0.0)[None, :] * (1.0 if TWO_LEVEL else 0.0625)
    store_output(tl.trans(out), out_ptr, part_ptr, count_ptr, bias_ptr, offs_m, offs_n, M, N, pid_k, pid,
                 SPLIT_K, SPLIT_K > 1, HAS_BIAS)


def w4a8_swap_supported(k: int, n: int, group_size: int, symmetric: bool,
                        group_scales: torch.Tensor | None) -> bool:
    """Whether `w4a8_swap_matmul` takes this layer: symmetric, K and N multiples of 64, per channel or
    two-level with groups of 64 or more and integer group scales in 0..16."""
    integer = group_scales is None or bool(((group_scales == group_scales.round()) & (group_scales >= 0)
                                            & (group_scales <= 16)).all())
    grouped = group_scales is not None and group_size != k
    return (symmetric and integer and k % CHUNK == 0 and n % 64 == 0 and k <= MAX_K
            and (not grouped or group_size % CHUNK == 0))


def w4a8_swap_matmul(x: torch.Tensor, packed: torch.Tensor, channel_scales: torch.Tensor,
                     group_scales: torch.Tensor | None, zeros: torch.Tensor | None, bias: torch.Tensor | None,
                     group_size: int, config: TileConfig) -> torch.Tensor:
    """x [M, K] fp16/bf16 contiguous, packed = repack_for_w4a8_swap(qweight) (or k_blocked), channel_scales fp32
    [N], group_scales [G, N] integers in 0..16 (two-level) or None (per channel), zeros None (symmetric weights
    only) -> [M, N] in x's dtype."""
    require_symmetric(zeros, "w4a8 swap kernel")
    m, k = x.shape
    split, block_m, block_n, block_k = config.split_k, config.block_m, config.block_n, config.block_k
    n = checked_layout(packed, k, block_k, "w4a8 swap kernel")
    two_level = group_scales is not None and group_size != k
    if k % block_k or n % block_n or block_k % CHUNK or (two_level and group_size % block_k):
        raise ValueError(f"w4a8 swap kernel: K tile {block_k} (a multiple of {CHUNK}) / N tile {block_n} must "
                         f"divide K {k} / N {n} and the group {group_size}")
    if group_scales is not None and not two_level:  # one group over all of K: its multiplier joins the channel
        channel_scales = channel_scales * group_scales[0].float()
    grid = (triton.cdiv(m, block_m) * (n // block_n), split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part, counters = split_buffers(split, m, n, math.prod(grid[:-1]), x.device) if split > 1 else (out, out)
    xq, ts, _ = quantize_rows(x, sums=False)  # the kernel launched right before the GEMM (its PDL predecessor)
    _w4a8_swap_kernel[grid](
        xq, ts, packed, channel_scales, group_scales if two_level else channel_scales,
        bias if bias is not None else channel_scales, out, part, counters, m, n, k, packed.shape[1], GROUP=group_size,
        TWO_LEVEL=two_level, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=split, PTX=not interpreting(), num_warps=config.num_warps, num_stages=config.num_stages,
        **dependent_launch_args(x.device))
    return out


# (BM, BN, BK, warps, stages). On the H200 BLOCK_K 256 never won; at M = 128..512 a 128-token tile (wgmma N 128) beat
# int8 cuBLAS on 4 of 6 shapes at M = 256 and lost from M = 1024 on; BLOCK_M 256 always lost (0.1-0.5x).
SWAP_TILES = ((16, 128, 128, 4, 4), (16, 128, 128, 4, 3), (16, 64, 128, 4, 4), (32, 128, 128, 4, 4),
              (32, 64, 128, 4, 4), (64, 128, 128, 8, 3), (64, 128, 128, 4, 3), (128, 128, 128, 8, 3)) + MMA_SYNC_TILES

SPECS = (
    KernelSpec("swap", "w4a8", "swap", lambda p: swap_tile_candidates(p, SWAP_TILES), w4a8_swap_matmul,
               buckets=(1, 512)),
)
