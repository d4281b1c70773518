"""W4A16 decode gemv on Hopper in Gluon: the swap layout's weight streamed through a TMA ring, dots on CUDA cores.

The Triton swap gemv (w4a16_swap.py) holds one prefetched K tile per program in registers; on the H200 it moved
2.6-3.3 TB/s on the large shapes, against a copy roof of 4.25 TB/s. Here each program keeps STAGES K tiles of its
weight rows in flight in shared memory (TMA bulk copies behind mbarriers, a ring over the program's contiguous range
of K tiles; a stage is refilled as soon as every warp has read it), and its warps read a landed tile with 16-byte
shared loads (H200: 5-15% faster on the 70B shapes at one token, 9-25% at two and four tokens; slower on small
layers):
- the weight is the swap layout read as int32 words [N, K / 8] (w4a16_swap.py: word u of a row holds nibble slices
  j = 0..3 of two neighbouring int16, the inputs 64 (u // 8) + 16 j + 2 (u % 8) + {0, 1});
- each thread takes 4 consecutive words of BLOCK_N / (rows per pass) rows; for each j, x's fp16 pairs of its 4 words
  are one 16-byte global load (L1/L2: x is 2-57 KB), shared by the thread's rows;
- a word's 8 products go through the swap gemv's half2 PTX (`gemv_word_dot_ptx`: lop3 into the fp16 mantissa,
  one fma to (q - z) / 64, half2 fmas with x, fp32 out); the 4 words of a thread share a group (64-input chunks lie
  in one group, group >= 64), so a thread's group scale multiplies their sum once.
Split K over contiguous ranges of K tiles (longer DRAM runs per row than interleaved tiles); the partials are summed
by the tile's last program in split order (gluon_common.store_tile, deterministic). fp16 only: bf16 has no mantissa
room for the odd nibble's 16 q (the Triton swap gemv serves bf16).

Gluon has no CPU interpreter: the tests check the sm_90 compile; results against float64 are checked on the GPU
(bench_kernels.py --check-swap and every sweep).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .common import dependent_launch_args, gemv_word_dot_ptx, split_buffers
from .gluon_common import aligned_16, cta_barrier, store_tile, tma_load, wait_for_prior_grid, weight_box
from .layout import checked_layout
from .spec import SMS_TO_FILL, KernelSpec, Problem, TileConfig

_DOT = gl.constexpr(gemv_word_dot_ptx(False))
_DOT_ZEROS = gl.constexpr(gemv_word_dot_ptx(True))
# the ring's layout: unswizzled (a warp reads whole 16-byte runs of each row, so there are no bank conflicts to spread)
WORDS_SMEM_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


@gluon.jit
def _half2(v):
    """v (fp32) rounded to fp16 in both halves of an int32: a half2 operand of the word-dot PTX."""
    bits = v.to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    return bits | (bits << 16)


@gluon.jit
def _issue(w_desc, ring, bars, stage, off_n, t, N, pred):
    """TMA of K tile t of the program's weight rows (plain or k_blocked) into ring stage `stage`, signalled on its
    barrier."""
    bar = bars.index(stage)
    mbarrier.expect(bar, w_desc.block_type.nbytes, pred=pred)
    row, col = weight_box(w_desc, off_n, t * w_desc.block_type.shape[1], N)
    tma_load(w_desc, [row, col], bar, ring.index(stage), pred=pred)


@gluon.jit
def _ring_start(w_desc, off_n, first_tile, tiles, N, STAGES: gl.constexpr):
    """The ring of STAGES K tiles of the program's weight rows and its barriers, every stage's copy issued."""
    ring = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES):
        _issue(w_desc, ring, bars, i, off_n, first_tile + i, N, i < tiles)
    return ring, bars


@gluon.jit
def _ring_take(w_desc, ring, bars, kt, off_n, first_tile, tiles, N, STAGES: gl.constexpr, LAYOUT: gl.constexpr):
    """The program's K tile kt from the ring in registers (LAYOUT); its stage then takes the tile STAGES ahead."""
    stage = kt % STAGES
    mbarrier.wait(bars.index(stage), (kt // STAGES) & 1)
    words = ring.index(stage).load(LAYOUT)
    cta_barrier()  # every warp holds this tile in registers
    _issue(w_desc, ring, bars, stage, off_n, first_tile + kt + STAGES, N, kt + STAGES < tiles)
    return words


@gluon.jit
def _ring_end(bars, STAGES: gl.constexpr):
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def _tile_params(x32_ptr, s_ptr, z_ptr, t, N, rows, quads, lanes, GROUP: gl.constexpr, KW: gl.constexpr,
                 PER_CHANNEL: gl.constexpr, HAS_ZEROS: gl.constexpr, LAYOUT: gl.constexpr):
    """K tile t's x pairs of nibble slices 0..3 ([1, KW / 4, 4] int32 each) and the group scales and zero points of
    each thread's words ([BLOCK_N, KW / 4] fp32; per channel: unused)."""
    # a thread's 4 words: half q % 2 of chunk t KW / 8 + q // 2 (8 words, 64 inputs), whose x pairs of slice j are
    # 32 chunk + 8 j + 0..7: 16 contiguous bytes per slice
    chunk = t * (KW // 8) + quads // 2
    pair = gl.expand_dims(gl.expand_dims(32 * chunk + 4 * (quads % 2), 0), 2) + gl.expand_dims(
        gl.expand_dims(lanes, 0), 0)
    x0, x1, x2, x3 = (gl.load(x32_ptr + pair), gl.load(x32_ptr + pair + 8), gl.load(x32_ptr + pair + 16),
                      gl.load(x32_ptr + pair + 24))
    idx = gl.expand_dims(64 * chunk // GROUP, 0) * N + gl.expand_dims(rows, 1)  # per channel: GROUP = K, row 0
    if PER_CHANNEL:  # scaled in the epilogue
        s = gl.full([1, 1], 1.0, gl.float32, layout=gl.SliceLayout(2, LAYOUT))
    else:
        s = gl.load(s_ptr + idx).to(gl.float32)
    z = gl.load(z_ptr + idx).to(gl.float32) if HAS_ZEROS else s
    return x0, x1, x2, x3, s, z


@gluon.jit(do_not_specialize=["M", "SPLIT_K"])  # one compile serves every M and split
def _w4a16_tma_gemv_kernel(w_desc, x_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K,
                           GROUP: gl.constexpr, PER_CHANNEL: gl.constexpr, HAS_ZEROS: gl.constexpr,
                           HAS_BIAS: gl.constexpr, SPLIT_K, IS_SPLIT: gl.constexpr, STAGES: gl.constexpr,
                           PDL: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    KW: gl.constexpr = w_desc.block_type.shape[1]  # int32 words per row of a K tile (8 inputs each)
    Q: gl.constexpr = KW // 4  # threads along a row's K tile (4 words each)
    TQ: gl.constexpr = 32 if Q > 32 else Q
    words_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // TQ, TQ], [num_warps, 1], [1, 0])
    layout: gl.constexpr = gl.BlockedLayout([1, 1, 4], [32 // TQ, TQ, 1], [num_warps, 1, 1], [2, 1, 0])
    acc_layout: gl.constexpr = gl.SliceLayout(2, layout)

    # program: x row m (fastest: the rows reading one weight tile run together and share it in L2), BLOCK_N weight
    # rows, a contiguous range of K tiles
    pid = gl.program_id(0)
    grid_n = N // BLOCK_N
    m, pid_n, pid_k = pid % M, pid // M % grid_n, pid // M // grid_n
    tiles = K // (8 * KW) // SPLIT_K
    first_tile = pid_k * tiles
    off_n = pid_n * BLOCK_N
    rows = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    quads = gl.arange(0, Q, layout=gl.SliceLayout(0, acc_layout))
    lanes = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, layout)))
    x32_ptr = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + m * (K // 2)

    ring, bars = _ring_start(w_desc, off_n, first_tile, tiles, N, STAGES)
    if PDL:  # launched early (common.dependent_launch): the weight is in flight, x is the kernel before's to write
        wait_for_prior_grid()

    x0, x1, x2, x3, s, z = _tile_params(x32_ptr, s_ptr, z_ptr, first_tile, N, rows, quads, lanes, GROUP, KW,
                                        PER_CHANNEL, HAS_ZEROS, layout)
    acc = gl.zeros([BLOCK_N, Q], gl.float32, acc_layout)
    for kt in range(tiles):
        # the next tile's x, scales and zeros go out now (the last tile re-reads its own)
        nxt = _tile_params(x32_ptr, s_ptr, z_ptr, first_tile + gl.minimum(kt + 1, tiles - 1), N, rows, quads, lanes,
                           GROUP, KW, PER_CHANNEL, HAS_ZEROS, layout)
        words = _ring_take(w_desc, ring, bars, kt, off_n, first_tile, tiles, N, STAGES, words_layout)
        words = gl.convert_layout(words.reshape([BLOCK_N, Q, 4]), layout)
        if HAS_ZEROS:
            dots = gl.inline_asm_elementwise(
                _DOT_ZEROS, "=r,r,r,r,r,r,r,r",
                [words, x0, x1, x2, x3, gl.expand_dims(_half2(-(16.0 + z / 64.0)), 2),
                 gl.expand_dims(_half2(-(1.0 + z / 64.0)), 2)], dtype=gl.float32, is_pure=True, pack=1)
        else:
            dots = gl.inline_asm_elementwise(_DOT, "=r,r,r,r,r,r", [words, x0, x1, x2, x3], dtype=gl.float32,
                                             is_pure=True, pack=1)
        quad_dots = gl.sum(dots, axis=2)  # a thread's 4 words: one group
        acc += quad_dots if PER_CHANNEL else quad_dots * s
        x0, x1, x2, x3, s, z = nxt
    _ring_end(bars, STAGES)
    out = gl.expand_dims(gl.sum(acc, axis=1), 1)  # [BLOCK_N, 1]: out^T of one token, divided by 64 (the PTX's)
    store_tile(out, out_ptr, part_ptr, count_ptr, bias_ptr, s_ptr, s_ptr, M, N, off_n, m, pid_k,
               m * grid_n + pid_n, SPLIT_K, 64.0, IS_SPLIT, HAS_BIAS, PER_CHANNEL, False, BLOCK_N, 1, num_warps)


def tma_gemv_fits(k: int, n: int, group_size: int, block_n: int, block_k: int, split: int) -> bool:
    """Whether a tile divides this layer: power-of-two tiles (the thread layout's) of whole 64-input chunks, whole
    tiles along N and K, an equal number of K tiles per split, a TMA box of at most 256 rows and 256 words a row
    (BLOCK_K <= 2048), and chunks inside one group (group a multiple of 64, or per channel)."""
    per_channel = group_size == k
    powers_of_two = block_n & (block_n - 1) == 0 and block_k & (block_k - 1) == 0
    return (powers_of_two and 64 <= block_k <= 2048 and block_n <= 256 and n % block_n == 0 and k % block_k == 0
            and (k // block_k) % split == 0 and (per_channel or group_size % 64 == 0))


def _descriptor(packed: torch.Tensor, block_n: int, block_k: int) -> TensorDescriptor:
    """The swap layout [N, K / 4] int16 (or k_blocked) as int32 words [N, K / 8], boxes of [block_n, block_k / 8]."""
    words = packed.view(torch.int32)
    return TensorDescriptor(words, list(words.shape), list(words.stride()), [block_n, block_k // 8], WORDS_SMEM_LAYOUT)


def w4a16_tma_gemv(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                   bias: torch.Tensor | None, group_size: int, config: TileConfig) -> torch.Tensor:
    """x [M, K] fp16 (M small: one program per token and tile), packed = repack_for_swap(qweight) [N, K/4] (or
    k_blocked), zeros [G, N] or None -> [M, N]."""
    m, k = x.shape
    split, block_n, block_k = config.split_k, config.block_n, config.block_k
    n = checked_layout(packed, k, block_k, "tma gemv")
    if x.dtype != torch.float16:
        raise ValueError(f"tma gemv: fp16 activations only, got {x.dtype}")
    if not tma_gemv_fits(k, n, group_size, block_n, block_k, split):
        raise ValueError(f"tma gemv: tile {block_n} x {block_k}, split {split} does not fit N {n}, K {k}, "
                         f"group {group_size}")
    x = aligned_16(x)  # x is read as 16-byte runs of fp16 pairs
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tiles = m * (n // block_n)
    part, counters = split_buffers(split, m, n, tiles, x.device) if split > 1 else (out, out)
    _w4a16_tma_gemv_kernel[(tiles * split,)](
        _descriptor(packed, block_n, block_k), x, scales, zeros if zeros is not None else scales,
        bias if bias is not None else scales, out, part, counters, m, n, k, GROUP=group_size,
        PER_CHANNEL=group_size == k, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, SPLIT_K=split,
        IS_SPLIT=split > 1, STAGES=config.num_stages, num_warps=config.num_warps,
        **dependent_launch_args(x.device))
    return out


# (BLOCK_N, BLOCK_K, warps, stages). An H200 sweep of 41 tiles (M = 1 on six shapes, 2 and 4 on three): the first is
# the best in 11 of the 12 cells, the second in the other (70B gate_up, 5% ahead). Two stages won: fewer shared-memory
# bytes per program, more programs per SM. The third: 128-input tiles led on 8B qkv / o (2-6%) on the K-blocked layout.
TMA_GEMV_TILES = ((128, 256, 4, 2), (64, 256, 4, 3), (128, 128, 4, 2))


def tma_gemv_split(n: int, k: int, block_n: int, block_k: int) -> int:
    """The largest power-of-two K split that divides the K tiles, leaves each split at least two of them and keeps
    a token's programs within about four per SM (2 * SMS_TO_FILL); 1 if none. It picked the best measured split
    for both TMA_GEMV_TILES on all six benchmark shapes but one tie (8B o, 64 rows)."""
    tiles, split = k // block_k, 1
    while tiles % (2 * split) == 0 and tiles // (2 * split) >= 2 and n // block_n * 2 * split <= 2 * SMS_TO_FILL:
        split *= 2
    return split


def tma_gemv_candidates(p: Problem, tiles: tuple[tuple[int, int, int, int], ...] = TMA_GEMV_TILES
                        ) -> list[TileConfig]:
    """The TMA gemv's configs of these tiles (BLOCK_N, BLOCK_K, warps, stages) that fit the layer, at
    tma_gemv_split and half of it."""
    out = []
    for bn, bk, warps, stages in tiles:
        split = tma_gemv_split(p.n, p.k, bn, bk)
        out += [TileConfig("tma_gemv", 1, bn, bk, s, warps, stages) for s in dict.fromkeys((split, max(1, split // 2)))
                if tma_gemv_fits(p.k, p.n, p.group, bn, bk, s)]
    return out


SPECS = (KernelSpec("tma_gemv", "w4a16", "swap", tma_gemv_candidates, w4a16_tma_gemv, buckets=(1, 4), hopper=True,
                    fp16=True),)
