"""W4A16 GEMM for M = 1..64 on Hopper: out^T = W x^T, with the dequantized weight as wgmma's register operand.

Hopper's wgmma takes its A operand from registers or shared memory and its B operand from shared memory only.
The tiled kernels of w4a16.py put x in A and the weight in B, so every dequantized weight tile is written to
shared memory, synchronised and read back before its mma: a serial chain per K tile. Swapping the operands
(out^T [N, M] = W [N, K] @ x^T [K, M]; N fills wgmma's 64-row M side, the few tokens its N = 16..64 side)
lets the weight stay in registers from dequantization to the mma, and leaves shared memory to what Triton
pipelines well: cp.async copies of the packed weight and of x, several K tiles ahead.

Triton builds the register operand by hoisting the layout conversion up to the weight's load
(OptimizeDotOperands, MMAV3HoistLayoutConversion) only through elementwise ops of non-narrowing types, from
a load or a constant: no broadcast, no int32 -> int16. Hence this kernel's own weight layout, repacked once
from QuantLinear's K-packed int32 (`repack_for_swap`): int16 [N, K/4], element (n, t) holding in nibble j
the input k = 64 (t // 16) + 16 j + t % 16. A K tile of the weight is then a contiguous [BLOCK_N, BLOCK_K/4]
load, nibble slice j of it (shift, mask, OR into the fp16 1024 / bf16 128 mantissa, bitcast, subtract the
zero) is the weight for the contiguous x columns 16 j + [0, 16) of each 64-input chunk, and all of that is
elementwise. The slices are q - 8; a zero point z (asymmetric layers) would be a broadcast inside that chain,
which stops the hoist, so it is applied to the dot result instead: sum x (q - z) = sum x (q - 8) + (8 - z)
sum x, with each K tile's x sum taken from the x slices already loaded. Groups of 64 or more (each K tile
inside one group: its fp32 dot result is corrected and scaled once) or per channel (at the end).
Split-K as in w4a16.py (fused, deterministic).

The same layout also feeds a decode gemv (`w4a16_swap_gemv`, one to four tokens, CUDA cores; end of this file),
which reads x as its own fp16 pairs: on the H200 it beats the K-packed gemv_h2 on the small 8B shapes.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import (
    CHUNK_TL,
    MMA_SYNC_TILES,
    block_start,
    fp16x2,
    gemv_word_dot_ptx,
    interpreting,
    slice_ptx,
    split_buffers,
    store_output,
    swap_program,
    swap_tile_candidates,
)
from .layout import CHUNK, checked_layout
from .spec import KernelSpec, Problem, TileConfig, gemv_config, with_half_split

_F0, _F1, _F2, _F3 = (tl.constexpr(slice_ptx(j, "fp16")) for j in range(4))
_B0, _B1, _B2, _B3 = (tl.constexpr(slice_ptx(j, "bf16")) for j in range(4))


@triton.jit
def _slice(h, j: tl.constexpr, DTYPE: tl.constexpr, PTX: tl.constexpr):
    """Nibble slice j of the int16 weight tile as q - 8 in DTYPE: elementwise, so Triton keeps it (and the
    weight's load) in wgmma's register-operand layout."""
    if PTX:
        fp16: tl.constexpr = DTYPE == tl.float16
        if j == 0:
            asm: tl.constexpr = _F0 if fp16 else _B0
        elif j == 1:
            asm: tl.constexpr = _F1 if fp16 else _B1
        elif j == 2:
            asm: tl.constexpr = _F2 if fp16 else _B2
        else:
            asm: tl.constexpr = _F3 if fp16 else _B3
        w = tl.inline_asm_elementwise(asm, "=r,r", [h], dtype=tl.float16 if fp16 else tl.bfloat16, is_pure=True,
                                      pack=2)
    elif DTYPE == tl.float16:  # 0x6400 | q is fp16 1024 + q; minus 1032 leaves q - 8 exactly
        w = (((h >> (4 * j)) & 0xF) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
    else:  # the interpreter (bf16 there: no int16 -> bf16 bitcast, no bf16 dot)
        w = ((h >> (4 * j)) & 0xF).to(tl.float32) - 8.0
    return w


@triton.jit
def _w4a16_swap_kernel(x_ptr, h_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K, W,
                       GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_ZEROS: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, UPCAST_DOT: tl.constexpr, PTX: tl.constexpr):
    pid, pid_k, offs_m, offs_n = swap_program(M, BLOCK_M, BLOCK_N)
    offs_t = tl.arange(0, BLOCK_K // 4)
    h_ptrs = h_ptr + offs_n[:, None] * W + offs_t[None, :]
    x_ptrs = x_ptr + offs_m[None, :] * K + ((offs_t // 16) * CHUNK_TL + offs_t % 16)[:, None]  # slice 0, [BK/4, BM]
    m_mask = offs_m[None, :] < M
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # zero points: x summed elementwise over the slices (a reduction per slice cost more than the dots), reduced
    # once per K tile (groups) or once at the end (per channel)
    x_run = tl.zeros((BLOCK_K // 4, BLOCK_M), dtype=tl.float32)
    for kt in range(pid_k, K // BLOCK_K, SPLIT_K):
        k0 = kt * BLOCK_K
        h = tl.load(h_ptrs + block_start(k0 // 4, W, N, BLOCK_K // 4))
        tile = acc if PER_CHANNEL else tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if not PER_CHANNEL:
            x_run = tl.zeros((BLOCK_K // 4, BLOCK_M), dtype=tl.float32)
        for j in tl.static_range(4):
            w = _slice(h, j, dtype, PTX)
            xt = tl.load(x_ptrs + k0 + 16 * j, mask=m_mask, other=0.0)
            if HAS_ZEROS:
                x_run += xt.to(tl.float32)
            if UPCAST_DOT:
                tile = tl.dot(w.to(tl.float32), xt.to(tl.float32), tile, input_precision="ieee")
            else:
                tile = tl.dot(w, xt, tile)
        if PER_CHANNEL:
            acc = tile
        else:
            if HAS_ZEROS:  # sum x (q - z) = sum x (q - 8) + (8 - z) sum x: the zero stays out of the operand
                z = tl.load(z_ptr + (k0 // GROUP) * N + offs_n).to(tl.float32)
                tile += (8.0 - z)[:, None] * tl.sum(x_run, axis=0)[None, :]
            acc += tile * tl.load(s_ptr + (k0 // GROUP) * N + offs_n).to(tl.float32)[:, None]
    if PER_CHANNEL:
        if HAS_ZEROS:
            acc += (8.0 - tl.load(z_ptr + offs_n).to(tl.float32))[:, None] * tl.sum(x_run, axis=0)[None, :]
        acc *= tl.load(s_ptr + offs_n).to(tl.float32)[:, None]
    store_output(tl.trans(acc), out_ptr, part_ptr, count_ptr, bias_ptr, offs_m, offs_n, M, N, pid_k, pid,
                 SPLIT_K, SPLIT_K > 1, HAS_BIAS)


def swap_supported(k: int, n: int, group_size: int) -> bool:
    """Whether `w4a16_swap_matmul` takes this layer (with tiles of 64: BLOCK_K, BLOCK_N dividing group, N)."""
    return k % CHUNK == 0 and n % 64 == 0 and (group_size == k or group_size % CHUNK == 0)


def w4a16_swap_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                      bias: torch.Tensor | None, group_size: int, config: TileConfig) -> torch.Tensor:
    """x [M, K] contiguous (scales' dtype), packed = repack_for_swap(qweight) (or k_blocked), zeros [G, N] (uint8)
    or None (symmetric: 8) -> [M, N]."""
    m, k = x.shape
    split, block_m, block_n, block_k = config.split_k, config.block_m, config.block_n, config.block_k
    n = checked_layout(packed, k, block_k, "swap kernel")
    if k % block_k or n % block_n or (group_size != k and group_size % block_k):
        raise ValueError(f"swap kernel: K tile {block_k} / N tile {block_n} must divide K {k} / N {n} and "
                         f"the group {group_size}")
    grid = (triton.cdiv(m, block_m) * (n // block_n), split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part, counters = split_buffers(split, m, n, math.prod(grid[:-1]), x.device) if split > 1 else (out, out)
    _w4a16_swap_kernel[grid](
        x, packed, scales, zeros if zeros is not None else packed, bias if bias is not None else scales, out, part,
        counters, m, n, k, packed.shape[1], GROUP=group_size, PER_CHANNEL=group_size == k,
        HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=split, UPCAST_DOT=x.dtype == torch.bfloat16 and interpreting(),  # the interpreter's bf16 is wrong (3.9)
        PTX=not interpreting(),
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out


# ---------------------------------------------------------------------------------------------------------------
# The same layout for one to four tokens: a gemv on CUDA cores.
#
# Read as int32, word (n, u) of a weight row holds two int16 neighbours t = 2u, 2u + 1: nibble j of its low / high
# half is input 64 c + 16 j + 2 i + b (c = u // 8, i = u % 8, b = 0 / 1). Marlin's lop3 turns nibbles j of both
# halves into an fp16x2 pair at once, and that pair meets x's own aligned fp16x2 (64 c + 16 j + 2 i, + 1): no
# shuffle of x at all (the K-packed gemv_h2 builds its x pairs with prmt and a multiply per row).

_WORD_DOT = tl.constexpr(gemv_word_dot_ptx(False))
_WORD_DOT_ZEROS = tl.constexpr(gemv_word_dot_ptx(True))


@triton.jit
def _swap_gemv_loads(w_ptrs, x32_ptr, s_ptr, z_ptr, k0, N, W, offs_n, u, run_first, GROUP: tl.constexpr,
                     PER_CHANNEL: tl.constexpr, HAS_ZEROS: tl.constexpr, PTX: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K tile's words [BN, GT, GW], group scales and zero points [BN, GT, 1] (fp32; per channel: unused
    here) and, for the PTX path, x's four fp16x2 slices [1, GT, GW] (fp16 pairs as int32)."""
    # read once: first out of L2 (H200: +1-7% at M = 1 on every shape)
    words = tl.load(w_ptrs + block_start(k0 // 8, W, N, BLOCK_K // 8), eviction_policy="evict_first")
    if PER_CHANNEL:
        idx = offs_n[:, None, None]
        s = tl.zeros((1, 1, 1), tl.float32)
    else:
        idx = ((k0 + run_first) // GROUP)[None, :, None] * N + offs_n[:, None, None]  # a run is in one group
        s = tl.load(s_ptr + idx).to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(z_ptr + idx).to(tl.float32)
    else:
        z = tl.full((1, 1, 1), 8.0, tl.float32)
    if PTX:
        word = k0 // 8 + u  # x's fp16x2 of slice j for word u: 32 c + 8 j + i
        xo = (32 * (word // 8) + word % 8)[None, :, :]
        x0, x1, x2, x3 = (tl.load(x32_ptr + xo), tl.load(x32_ptr + xo + 8), tl.load(x32_ptr + xo + 16),
                          tl.load(x32_ptr + xo + 24))
    else:
        x0 = tl.zeros((1, 1, 1), tl.int32)  # unused: the fp32 path loads x itself
        x1, x2, x3 = x0, x0, x0
    return words, s, z, x0, x1, x2, x3


@triton.jit
def _swap_gemv_dots(words, z, x0, x1, x2, x3, x_ptr, k0, u, HAS_ZEROS: tl.constexpr, PTX: tl.constexpr):
    """[BN, GT, GW] fp32: each word's sum over its 8 weights of (q - z) * x (PTX: divided by 64)."""
    if PTX:
        if HAS_ZEROS:
            dot = tl.inline_asm_elementwise(
                _WORD_DOT_ZEROS, "=r,r,r,r,r,r,r,r", [words, x0, x1, x2, x3, fp16x2(-(16.0 + z / 64.0)),
                                                      fp16x2(-(1.0 + z / 64.0))], dtype=tl.float32,
                is_pure=True, pack=1)
        else:
            dot = tl.inline_asm_elementwise(_WORD_DOT, "=r,r,r,r,r,r", [words, x0, x1, x2, x3], dtype=tl.float32,
                                            is_pure=True, pack=1)
    else:
        word = k0 // 8 + u
        first = (64 * (word // 8) + 2 * (word % 8))[None, :, :]  # input of nibble 0, low half (64-input chunks)
        dot = tl.zeros(words.shape, tl.float32)
        for j in tl.static_range(4):
            for b in tl.static_range(2):
                q = ((words >> (16 * b + 4 * j)) & 0xF).to(tl.float32)
                dot += (q - z) * tl.load(x_ptr + first + 16 * j + b).to(tl.float32)
    return dot


@triton.jit(do_not_specialize=["M", "SPLIT_K"])  # one compile serves every M and split
def _w4a16_swap_gemv_kernel(x_ptr, h_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K, W,
                            GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_ZEROS: tl.constexpr,
                            HAS_BIAS: tl.constexpr, SPLIT_K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_WORDS: tl.constexpr, IS_SPLIT: tl.constexpr, PTX: tl.constexpr):
    # Program (x row m, BLOCK_N weight rows, every SPLIT_K-th K tile). Its words are [BN, GT, GW]: GT runs of
    # GW words (GROUP_WORDS) that share a group scale, which so stays a [BN, GT, 1] broadcast (no per-word load).
    m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    GT: tl.constexpr = BLOCK_K // 8 // GROUP_WORDS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    run_first = 8 * GROUP_WORDS * tl.arange(0, GT)  # [GT]: each run's first input in the tile
    u = tl.arange(0, GT)[:, None] * GROUP_WORDS + tl.arange(0, GROUP_WORDS)[None, :]  # [GT, GW] word of the tile
    # W: int32 words per row of the (plain or k_blocked) layout
    w_ptrs = h_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + offs_n[:, None, None] * W + u[None, :, :]
    x32_ptr = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + m * (K // 2)
    x_row = x_ptr + m * K
    last = K // BLOCK_K - 1
    acc = tl.zeros((BLOCK_N, GT, GROUP_WORDS), dtype=tl.float32)
    # register prefetch, as the K-packed gemv: the next tile's loads go out before this tile's arithmetic. (A
    # cp.async ring instead, which Triton builds for this dot-free loop when tl.range asks for stages, was 10-25%
    # slower at every depth on the H200.) (Two tiles in flight, the second in its own registers, lost 4-13%.)
    words, s, z, x0, x1, x2, x3 = _swap_gemv_loads(w_ptrs, x32_ptr, s_ptr, z_ptr, pid_k * BLOCK_K, N, W, offs_n, u,
                                                   run_first, GROUP, PER_CHANNEL, HAS_ZEROS, PTX, BLOCK_K)
    for t in range(pid_k, K // BLOCK_K, SPLIT_K):
        k0, k_next = t * BLOCK_K, tl.minimum(t + SPLIT_K, last) * BLOCK_K  # the last tile re-reads itself
        nxt = _swap_gemv_loads(w_ptrs, x32_ptr, s_ptr, z_ptr, k_next, N, W, offs_n, u, run_first, GROUP,
                               PER_CHANNEL, HAS_ZEROS, PTX, BLOCK_K)
        dots = _swap_gemv_dots(words, z, x0, x1, x2, x3, x_row, k0, u, HAS_ZEROS, PTX)
        acc += dots if PER_CHANNEL else dots * s
        words, s, z, x0, x1, x2, x3 = nxt
    out = tl.sum(tl.sum(acc, axis=2), axis=1) * (64.0 if PTX else 1.0)
    if PER_CHANNEL:
        out *= tl.load(s_ptr + offs_n).to(tl.float32)
    store_output(out[None, :], out_ptr, part_ptr, count_ptr, bias_ptr, m + tl.arange(0, 1), offs_n, M, N, pid_k,
                 m * tl.num_programs(1) + pid_n, SPLIT_K, IS_SPLIT, HAS_BIAS)


def swap_gemv_fits(k: int, n: int, group_size: int, block_n: int, block_k: int) -> bool:
    """Whether a swap gemv tile divides this layer: whole 64-input chunks, and a K tile holding whole groups or
    lying inside one."""
    grouped = group_size != k
    return (n % block_n == 0 and k % block_k == 0 and block_k % CHUNK == 0
            and not (grouped and group_size % block_k and block_k % group_size))


def w4a16_swap_gemv(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    bias: torch.Tensor | None, group_size: int, config: TileConfig) -> torch.Tensor:
    """x [M, K] (M small: one program row per token) on the swap layout -> [M, N]. fp16 on CUDA runs the
    half2 PTX word dots; bf16 and Triton's interpreter the same loop in fp32."""
    m, k = x.shape
    split, block_n, block_k = config.split_k, config.block_n, config.block_k
    n = checked_layout(packed, k, block_k, "swap gemv")
    if not swap_gemv_fits(k, n, group_size, block_n, block_k):
        raise ValueError(f"swap gemv: tile {block_n} x {block_k} does not fit N {n}, K {k}, group {group_size}")
    ptx = x.dtype == torch.float16 and not interpreting()
    if ptx and x.data_ptr() % 4:  # x is read as fp16 pairs
        x = x.clone()
    grid = (m, n // block_n, split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part, counters = split_buffers(split, m, n, m * (n // block_n), x.device) if split > 1 else (out, out)
    _w4a16_swap_gemv_kernel[grid](
        x, packed, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, out, part,
        counters, m, n, k, packed.shape[1] // 2, GROUP=group_size, PER_CHANNEL=group_size == k,
        HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP_WORDS=min(group_size, block_k) // 8, IS_SPLIT=split > 1, PTX=ptx, num_warps=config.num_warps,
        num_stages=config.num_stages)
    return out


# (BM, BN, BK, warps, stages). On the H200, (16, 128, 128, 4, 4) is within 5% of the best in every M <= 16 cell,
# (64, 128, 128, 8, 3) in 6 of 6 at M = 64; BLOCK_N 256 and BLOCK_K 64 never were; every tile lost from M = 256 on.
SWAP_TILES = ((16, 128, 128, 4, 4), (16, 64, 128, 4, 4), (32, 128, 128, 4, 4), (32, 128, 128, 8, 3),
              (64, 128, 128, 8, 3), (64, 128, 128, 4, 3), (64, 256, 128, 8, 3)) + MMA_SYNC_TILES

# The gemv's (BLOCK_N, BLOCK_K, warps): the H200 sweep's winners, BK 256 with 32 or 64 rows on every shape, at the
# heuristic split or half
SWAP_GEMV_TILES = ((32, 256, 4), (64, 256, 4), (32, 512, 4))


def swap_gemv_candidates(p: Problem) -> list[TileConfig]:
    """The swap-layout gemv's configs that fit the layer, at the heuristic split and at half of it."""
    return with_half_split([gemv_config(p.n, p.k, bn, bk, warps, stages=1, kind="swap_gemv")
                            for bn, bk, warps in SWAP_GEMV_TILES if swap_gemv_fits(p.k, p.n, p.group, bn, bk)])


SPECS = (
    KernelSpec("swap", "w4a16", "swap", lambda p: swap_tile_candidates(p, SWAP_TILES), w4a16_swap_matmul,
               buckets=(1, 64)),
    KernelSpec("swap_gemv", "w4a16", "swap", swap_gemv_candidates, w4a16_swap_gemv, buckets=(1, 4)),
)
