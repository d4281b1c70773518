"""W4A16 on Hopper for M = 1..512 in Gluon: the swap layout's weight as an *asynchronous* wgmma's register operand.

`w4a16_swap.py` computes out^T = W x^T with the dequantized weight as wgmma's register A operand, but plain Triton
makes such a wgmma synchronous (a `wgmma.wait_group 0` after every slice dot), so dequantization and mma serialize.
Gluon (Triton's lower-level language) states the pipeline itself:
- a ring of STAGES shared-memory buffers filled by TMA: the weight's int16 swap-layout tile [BLOCK_N, BLOCK_K / 4]
  and x's tile as BLOCK_K / 64 boxes [BLOCK_M, 64] (a box row is 128 bytes: the TMA swizzle limit);
- per 64-input chunk, the int16 [BLOCK_N, 16] is read from shared memory straight into wgmma's A-operand layout;
  each nibble slice j (Marlin's lop3 into the fp16 1024 / bf16 128 mantissa, `slice_ptx`) is the weight of the x
  columns 16 j .. 16 j + 15 of the chunk, times its group scale (Marlin's order: the dequantized weight is rounded
  to fp16 / bf16 once; per-channel scales go to the epilogue instead);
- every wgmma is issued async and followed by `wait(1)`: the next slice is dequantized while the previous mma runs.
  The previous slice's registers are threaded through that wait (as Triton's own WGMMA pipeliner does) so they stay
  untouched until its mma has read them.
Split K as in w4a16.py: fp32 partials, the last program of a tile sums them in split order. A program runs over
units (an output tile's K split, every unit the same number of K tiles: `wgmma_split`) with its ring running on
across them (`start_program`); it is launched with one program per unit (persistent grids measured no faster).

Gluon kernels have no CPU interpreter: the tests check the sm_90 compile (async register-operand wgmma, one wait per
slice, TMA ring); results against float64 are checked on the GPU (bench_kernels.py --check-swap and every sweep).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from .common import CHUNK_TL, dependent_launch_args, slice_ptx, split_buffers
from .gluon_common import (
    aligned_16,
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

_F0, _F1, _F2, _F3 = (gl.constexpr(slice_ptx(j, "fp16")) for j in range(4))
_B0, _B1, _B2, _B3 = (gl.constexpr(slice_ptx(j, "bf16")) for j in range(4))


@gluon.jit
def _slice_q8(h, j: gl.constexpr, FP16: gl.constexpr):
    """Nibble slice j of the int16 weight tile as q - 8 (exact), in the tile's own layout."""
    if j == 0:
        asm: gl.constexpr = _F0 if FP16 else _B0
    elif j == 1:
        asm: gl.constexpr = _F1 if FP16 else _B1
    elif j == 2:
        asm: gl.constexpr = _F2 if FP16 else _B2
    else:
        asm: gl.constexpr = _F3 if FP16 else _B3
    return gl.inline_asm_elementwise(asm, "=r,r", [h], dtype=gl.float16 if FP16 else gl.bfloat16, is_pure=True,
                                     pack=2)


@gluon.jit
def _row_params(s_ptr, z_ptr, k0, N, offs_n, GROUP: gl.constexpr, HAS_ZEROS: gl.constexpr, dtype: gl.constexpr):
    """A K tile's group scales and zero points minus 8, [BLOCK_N, 1] in the weight operand's layout."""
    g = k0 // GROUP
    s = gl.load(s_ptr + g * N + offs_n)
    zc = (gl.load(z_ptr + g * N + offs_n).to(gl.float32) - 8.0).to(dtype) if HAS_ZEROS else s
    return gl.expand_dims(s, 1), gl.expand_dims(zc, 1)


@gluon.jit(do_not_specialize=["M", "SPLIT_K"])  # one compile serves every M and split
def _w4a16_wgmma_kernel(x_desc, w_desc, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K,
                        GROUP: gl.constexpr, PER_CHANNEL: gl.constexpr, HAS_ZEROS: gl.constexpr,
                        HAS_BIAS: gl.constexpr, SPLIT_K, IS_SPLIT: gl.constexpr, STAGES: gl.constexpr,
                        BAND: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = 4 * w_desc.block_type.shape[1]
    CHUNKS: gl.constexpr = BLOCK_K // CHUNK_TL
    dtype: gl.constexpr = x_desc.dtype
    FP16: gl.constexpr = dtype == gl.float16
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_layout))

    # PDL (common.dependent_launch): the ring's first weight tiles load before waiting for the kernel that writes x
    units, tiles, grid_n, grid_m, w_smem, x_smem, bars = start_program(w_desc, x_desc, M, N, K, SPLIT_K, BLOCK_K,
                                                                         STAGES, BAND, PDL)
    pid, programs = gl.program_id(0), gl.num_programs(0)
    off_n, off_m, pid_k, out_tile = unit_coords(pid, units, grid_n, grid_m, BLOCK_N, BLOCK_M, BAND)
    s, zc = _row_params(s_ptr, z_ptr, pid_k * BLOCK_K, N, off_n + rows, GROUP, HAS_ZEROS, dtype)
    a_prev = gl.zeros([BLOCK_N, 16], dtype, a_layout)
    # zeroed once: a unit's first mma ignores it (use_acc). A zeroing inside the loops is an instruction other than
    # wgmma writing its accumulator, for which ptxas serializes every wgmma of the kernel (its warning C7515)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, acc_layout)
    f = 0  # this program's K tiles so far: the ring position
    for u in range(pid, units, programs):
        off_n, off_m, pid_k, out_tile = unit_coords(u, units, grid_n, grid_m, BLOCK_N, BLOCK_M, BAND)
        nxt_n, nxt_m, nxt_k, _ = unit_coords(u + programs, units, grid_n, grid_m, BLOCK_N, BLOCK_M, BAND)
        more = u + programs < units
        for kt in range(tiles):
            stage = f % STAGES
            # the next iteration's scales go out now (after the last unit's last tile: re-read)
            sn, _, sk, skt = tile_ahead(kt, 1, tiles, (off_n, off_m, pid_k), (nxt_n, nxt_m, nxt_k))
            s_next, zc_next = _row_params(s_ptr, z_ptr, (sk + skt * SPLIT_K) * BLOCK_K, N, sn + rows, GROUP,
                                          HAS_ZEROS, dtype)
            mbarrier.wait(bars.index(stage), (f // STAGES) & 1)
            for c in gl.static_range(CHUNKS):
                h = w_smem.index(stage).slice(16 * c, 16, dim=1).load(a_layout)
                for j in gl.static_range(4):
                    a = _slice_q8(h, j, FP16)
                    if HAS_ZEROS:
                        a = a - zc
                    if not PER_CHANNEL:
                        a = a * s
                    b = x_smem.index(stage * CHUNKS + c).slice(16 * j, 16, dim=1).permute((1, 0))
                    acc = warpgroup_mma(a, b, acc, use_acc=kt > 0 or c + j > 0, is_async=True)
                    acc, a_prev = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_prev))
                    a_prev = a
                    if c == 0 and j == 0:
                        # every mma of the previous iteration is done (two warpgroups: in both, hence the
                        # barrier), so its stage takes iteration f + STAGES - 1
                        if num_warps > 4:
                            cta_barrier()
                        n_, m_, k_, kt_ = tile_ahead(kt, STAGES - 1, tiles, (off_n, off_m, pid_k), (nxt_n, nxt_m, nxt_k))
                        issue_tile(w_desc, x_desc, w_smem, x_smem, bars, (f + STAGES - 1) % STAGES, n_, m_,
                                   (k_ + kt_ * SPLIT_K) * BLOCK_K, N, more | (kt + STAGES - 1 < tiles), CHUNKS)
            s, zc = s_next, zc_next
            f += 1
        acc, a_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_prev))
        store_tile(acc, out_ptr, part_ptr, count_ptr, bias_ptr, s_ptr, s_ptr, M, N, off_n, off_m, pid_k, out_tile,
                   SPLIT_K, 1.0, IS_SPLIT, HAS_BIAS, PER_CHANNEL, False, BLOCK_N, BLOCK_M, num_warps)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


def w4a16_wgmma_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                       bias: torch.Tensor | None, group_size: int, config: TileConfig) -> torch.Tensor:
    """x [M, K] (scales' dtype), packed = repack_for_swap(qweight) [N, K/4] (or k_blocked), zeros [G, N] or None
    -> [M, N]."""
    m, k = x.shape
    split, block_m, block_n, block_k = config.split_k, config.block_m, config.block_n, config.block_k
    n = checked_layout(packed, k, block_k, "wgmma kernel")
    programs, tiles = launch_grid(m, n, k, group_size, config)
    x = aligned_16(x)  # TMA reads 16-byte aligned rows
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part, counters = split_buffers(split, m, n, tiles, x.device) if split > 1 else (out, out)
    _w4a16_wgmma_kernel[(programs,)](
        descriptor(x, [block_m, CHUNK]), descriptor(packed, [block_n, block_k // 4]), scales,
        zeros if zeros is not None else scales, bias if bias is not None else scales, out, part, counters, m, n, k,
        GROUP=group_size, PER_CHANNEL=group_size == k, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None,
        SPLIT_K=split, IS_SPLIT=split > 1, STAGES=config.num_stages,
        BAND=device_unit_band(n, block_n, x.device), num_warps=config.num_warps, **dependent_launch_args(x.device))
    return out


# By M bucket: (BM, BN, BK, warps, stages). BM is wgmma's N (the tokens), BN the weight rows (64 per warpgroup), BK <=
# 256 (TMA's 128-byte rows). The H200 sweeps' winners (32 and 128 interpolated); since the unit loop, 128-input K tiles
# win at 16 and 256 tokens.
WGMMA_TILES = {
    8: ((8, 128, 128, 4, 4), (8, 256, 128, 8, 4), (8, 128, 64, 4, 6), (8, 64, 128, 4, 6)),
    16: ((16, 128, 64, 4, 6), (16, 256, 64, 4, 4), (16, 256, 128, 8, 4), (16, 128, 128, 4, 4), (16, 256, 128, 4, 4)),
    32: ((32, 128, 64, 4, 6), (32, 64, 128, 4, 4), (32, 256, 128, 8, 4)),
    64: ((64, 64, 128, 4, 4), (64, 128, 64, 4, 6), (64, 256, 128, 8, 3), (64, 256, 64, 4, 4)),
    128: ((128, 128, 64, 4, 3), (64, 128, 64, 4, 6), (64, 256, 128, 8, 3)),
    256: ((256, 64, 64, 4, 3), (128, 128, 64, 4, 3), (256, 128, 64, 8, 3), (128, 128, 128, 4, 3),
          (128, 256, 128, 8, 3)),
}

SPECS = (KernelSpec("wgmma", "w4a16", "swap", wgmma_candidates(WGMMA_TILES), w4a16_wgmma_matmul, buckets=(1, 4096),
                    hopper=True),)
