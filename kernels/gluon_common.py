"""What the Gluon (Hopper) kernels share: TMA descriptors and loads, the CTA barrier, the wgmma kernels' unit
scheduling (an output tile's K split per unit, every unit the same number of K tiles) and TMA ring, and the tile
store. Importing it needs Triton's Gluon with its Hopper module (older Tritons have none)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .common import CHUNK_TL
from .layout import CHUNK
from .spec import Problem, TileConfig, tile_config

# Triton 3.6 (the H200's) names the TMA load async_copy_global_to_shared and the CTA barrier thread_barrier; later
# Tritons async_load and barrier
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def issue_tile(w_desc, x_desc, w_smem, x_smem, bars, stage, off_n, off_m, k0, N, pred, CHUNKS: gl.constexpr):
    """TMA of one K tile (weight + x) into ring stage `stage`, signalled on its barrier."""
    _issue_weight(w_desc, x_desc, w_smem, bars, stage, off_n, k0, N, pred, CHUNKS)
    _issue_x(x_desc, x_smem, bars, stage, off_m, k0, pred, CHUNKS)


@gluon.jit
def _issue_weight(w_desc, x_desc, w_smem, bars, stage, off_n, k0, N, pred, CHUNKS: gl.constexpr):
    """The weight half of issue_tile, which arms the stage's barrier for the whole tile. The weight box's row holds
    the tile's CHUNKS * 64 inputs packed (W4A16: 4 per int16, W4A8: 2 per int8); the weight is the swap layout,
    plain or k_blocked (a descriptor row is one K block of a weight row: the plain layout's block is all of K)."""
    bar = bars.index(stage)
    mbarrier.expect(bar, w_desc.block_type.nbytes + CHUNKS * x_desc.block_type.nbytes, pred=pred)
    per_element: gl.constexpr = CHUNKS * CHUNK_TL // w_desc.block_type.shape[1]
    row, col = weight_box(w_desc, off_n, k0 // per_element, N)
    tma_load(w_desc, [row, col], bar, w_smem.index(stage), pred=pred)


@gluon.jit
def weight_box(w_desc, off_n, col, N):
    """The TMA coordinates (row, column) of weight rows off_n.. at column `col` of the plain swap layout, in w_desc's
    form (plain or k_blocked: column col of row n lies at row (col // width) N + n, column col % width)."""
    width = w_desc.shape[1]
    return col // width * N + off_n, col % width


@gluon.jit
def _issue_x(x_desc, x_smem, bars, stage, off_m, k0, pred, CHUNKS: gl.constexpr):
    """The x half of issue_tile: CHUNKS boxes of [BLOCK_M, 64]."""
    for c in gl.static_range(CHUNKS):
        tma_load(x_desc, [off_m, k0 + CHUNK_TL * c], bars.index(stage), x_smem.index(stage * CHUNKS + c), pred=pred)


@gluon.jit
def wait_for_prior_grid():
    """griddepcontrol.wait: under programmatic dependent launch, until the kernel before has finished and its
    writes are visible (a no-op otherwise)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _start_ring(w_desc, x_desc, off_n, off_m, pid_k, N, SPLIT_K, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                X_AFTER_PRIOR_GRID: gl.constexpr):
    """The TMA ring's shared memory and barriers, the first unit's first STAGES - 1 K tiles issued (a unit has at
    least that many; X_AFTER_PRIOR_GRID: their weight first, x once the kernel before, which writes x, is done):
    (weight stages, x stages, barriers)."""
    CHUNKS: gl.constexpr = BLOCK_K // CHUNK_TL
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES * CHUNKS] + x_desc.block_type.shape, x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES - 1):
        _issue_weight(w_desc, x_desc, w_smem, bars, i, off_n, (pid_k + i * SPLIT_K) * BLOCK_K, N, True, CHUNKS)
    if X_AFTER_PRIOR_GRID:
        wait_for_prior_grid()
    for i in gl.static_range(STAGES - 1):
        _issue_x(x_desc, x_smem, bars, i, off_m, (pid_k + i * SPLIT_K) * BLOCK_K, True, CHUNKS)
    return w_smem, x_smem, bars


@gluon.jit
def start_program(w_desc, x_desc, M, N, K, SPLIT_K, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, BAND: gl.constexpr,
                  X_AFTER_PRIOR_GRID: gl.constexpr = False):
    """Program p takes the units (output tile, K split) p, p + programs, ..., its TMA ring running on across them
    (the next unit's tiles load during this one's last mmas and epilogue); launched with one program per unit:
    persistent grids of 1 or 2 programs per SM measured no faster on the H200.
    -> (units, K tiles per unit, grid_n, grid_m, the ring's weight stages, x stages and barriers)."""
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    grid_n, grid_m = N // BLOCK_N, gl.cdiv(M, BLOCK_M)
    units = grid_n * grid_m * SPLIT_K
    off_n, off_m, pid_k, _ = unit_coords(gl.program_id(0), units, grid_n, grid_m, BLOCK_N, BLOCK_M, BAND)
    w_smem, x_smem, bars = _start_ring(w_desc, x_desc, off_n, off_m, pid_k, N, SPLIT_K, BLOCK_K, STAGES,
                                       X_AFTER_PRIOR_GRID)
    return units, K // BLOCK_K // SPLIT_K, grid_n, grid_m, w_smem, x_smem, bars


@gluon.jit
def unit_coords(u, units, grid_n, grid_m, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, BAND: gl.constexpr):
    """Work unit u (clamped to the last) -> (off_n, off_m, pid_k, output tile). Within a K split, bands of up to BAND
    token tiles, token tile fastest (BAND 1: n fastest); see unit_band."""
    u = gl.minimum(u, units - 1)
    if BAND == 1:  # (its own branch: the general one holds more registers, which spilled in the large tiles)
        pid_n, pid_m = u % grid_n, (u // grid_n) % grid_m
    else:
        t = u % (grid_n * grid_m)
        first_m = t // (BAND * grid_n) * BAND
        band_m = gl.minimum(grid_m - first_m, BAND)
        pid_m, pid_n = first_m + t % (BAND * grid_n) % band_m, t % (BAND * grid_n) // band_m
    return pid_n * BLOCK_N, pid_m * BLOCK_M, u // (grid_n * grid_m), pid_m * grid_n + pid_n


@gluon.jit
def tile_ahead(kt, ahead: gl.constexpr, tiles, here, there):
    """Iteration `ahead` after this unit's K tile kt: the same unit's tile kt + ahead, or the next unit's
    (here / there: a unit's (off_n, off_m, pid_k)); a unit has at least `ahead` tiles. -> (off_n, off_m, pid_k, kt)."""
    same = kt + ahead < tiles
    return (gl.where(same, here[0], there[0]), gl.where(same, here[1], there[1]), gl.where(same, here[2], there[2]),
            gl.where(same, kt + ahead, kt + ahead - tiles))


@gluon.jit
def store_tile(acc, out_ptr, part_ptr, count_ptr, bias_ptr, row_scale_ptr, col_scale_ptr, M, N, off_n, off_m, pid_k,
               out_tile, SPLIT_K, factor, IS_SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr, ROW_SCALE: gl.constexpr,
               COL_SCALE: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, num_warps: gl.constexpr):
    """acc [BLOCK_N, BLOCK_M] (out^T) -> out [M, N]: times factor and the row (weight row) / column (token) scales
    if asked, split-K partials summed by the tile's last program in split order, bias, cast."""
    # n fastest: coalesced. From 64 tokens, 8 consecutive n per thread and warps along m: one address per 8 outputs
    # instead of one each (the compiler hoists them out of the unit loop: they would stay live through it)
    TN: gl.constexpr = 32 if BLOCK_N >= 256 else BLOCK_N // 8
    if BLOCK_M >= 64:
        out_layout: gl.constexpr = gl.BlockedLayout([8, 1], [TN, 32 // TN], [1, num_warps], [0, 1])
    else:
        out_layout: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [num_warps, 1], [0, 1])
    acc = gl.convert_layout(acc.to(gl.float32), out_layout) * factor
    on = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_layout))
    om = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out_layout))
    if ROW_SCALE:
        acc = acc * gl.expand_dims(gl.load(row_scale_ptr + on).to(gl.float32), 1)
    if COL_SCALE:
        acc = acc * gl.expand_dims(gl.load(col_scale_ptr + om, mask=om < M, other=0.0).to(gl.float32), 0)
    idx = gl.expand_dims(om, 0) * N + gl.expand_dims(on, 1)
    mask = gl.expand_dims(om < M, 0) & gl.expand_dims(on < N, 1)
    if IS_SPLIT:
        gl.store(part_ptr + pid_k * M * N + idx, acc, mask=mask)
        cta_barrier()  # every thread's partial is written before the release below
        if gl.atomic_add(count_ptr + out_tile, 1, sem="acq_rel") == SPLIT_K - 1:
            acc = gl.zeros_like(acc)
            for sk in range(SPLIT_K):  # .cg: the other SMs' partials from L2, never a stale L1 line
                acc += gl.load(part_ptr + sk * M * N + idx, mask=mask, other=0.0, cache_modifier=".cg")
            gl.atomic_xchg(count_ptr + out_tile, 0)
            _store_final(acc, out_ptr, bias_ptr, on, idx, mask, HAS_BIAS)
    else:
        _store_final(acc, out_ptr, bias_ptr, on, idx, mask, HAS_BIAS)


@gluon.jit
def _store_final(acc, out_ptr, bias_ptr, on, idx, mask, HAS_BIAS: gl.constexpr):
    if HAS_BIAS:
        acc = acc + gl.expand_dims(gl.load(bias_ptr + on).to(gl.float32), 1)
    gl.store(out_ptr + idx, acc.to(out_ptr.dtype.element_ty), mask=mask)


def wgmma_fits(k: int, n: int, group_size: int, block_n: int, block_k: int) -> bool:
    """Whether a tile divides this layer: whole tiles along N and K, each K tile inside one group (or per channel),
    and a weight box row of at most 128 bytes (TMA's swizzle limit: BLOCK_K <= 256)."""
    per_channel = group_size == k
    return (n % block_n == 0 and k % block_k == 0 and block_k % CHUNK == 0 and block_k <= 256
            and (per_channel or group_size % block_k == 0))


def wgmma_split(k: int, block_k: int, split: int, stages: int) -> int:
    """The largest K split up to `split` that gives every unit the same number of K tiles, at least STAGES - 1 (the
    ring's lookahead stays within the next unit); 0 if none."""
    tiles = k // block_k
    return max((s for s in range(1, split + 1) if tiles % s == 0 and tiles // s >= stages - 1), default=0)


def launch_grid(m: int, n: int, k: int, group_size: int, config: TileConfig) -> tuple[int, int]:
    """(programs, output tiles) of a Gluon kernel's launch, one program per unit (an output tile's K split), after
    checking that the config fits the layer."""
    block_n, block_k, split = config.block_n, config.block_k, config.split_k
    if not wgmma_fits(k, n, group_size, block_n, block_k) or wgmma_split(k, block_k, split, config.num_stages) != split:
        raise ValueError(f"wgmma kernel: tile {block_n} x {block_k}, split {split}, {config.num_stages} stages "
                         f"does not fit N {n}, K {k}, group {group_size}")
    tiles = n // block_n * triton.cdiv(m, config.block_m)
    return tiles * split, tiles


def unit_band(n: int, block_n: int, sm_count: int) -> int:
    """Token tiles per band of units (unit_coords, token tile fastest inside a band). 8 when a token tile's row of units
    outnumbers half the SMs: the programs running together (about two per SM) then span fewer than four token tiles,
    and with n fastest a weight larger than the L2 (8B / 70B gate_up) streams from DRAM once per token tile; in bands
    it is read once per band. Else 1 (n fastest): there the programs running together span several token tiles
    already, and bands measured up to 9% slower on the H200."""
    return 8 if n // block_n > sm_count // 2 else 1


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def device_unit_band(n: int, block_n: int, device: torch.device) -> int:
    """unit_band for the GPU the kernel runs on (its SM count read once per device, not per launch)."""
    return unit_band(n, block_n, _sm_count(device))


def descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A TMA descriptor of t (2D, row-major) with boxes of `block`, in the swizzled layout wgmma reads."""
    layout = gl.NVMMASharedLayout.get_default_for(block, {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16,
                                                         torch.int16: gl.int16, torch.int8: gl.int8}[t.dtype])
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def aligned_16(x: torch.Tensor) -> torch.Tensor:
    """x itself if contiguous and 16-byte aligned (a slice of a larger tensor may not be), else an aligned copy."""
    return x if x.is_contiguous() and x.data_ptr() % 16 == 0 else x.contiguous().clone()


WgmmaTiles = dict[int, tuple[tuple[int, int, int, int, int], ...]]


def wgmma_candidates(tiles: WgmmaTiles) -> Callable[[Problem], list[TileConfig]]:
    """A wgmma kernel's candidates among its tiles by M bucket (8 to 256; (BM, BN, BK, warps, stages)): the configs
    that fit the layer, at the heuristic split, a half and a quarter (each the largest that gives every unit the
    same number of K tiles, see wgmma_split)."""

    def configs(p: Problem) -> list[TileConfig]:
        out = []
        for bm, bn, bk, warps, stages in tiles[min(max(p.bucket, 8), 256)]:
            bk = bk if p.per_channel else min(bk, p.group)
            if wgmma_fits(p.k, p.n, p.group, bn, bk):
                cfg = tile_config("wgmma", bm, bn, bk, warps, stages, p.m, p.n, p.k)
                splits = [wgmma_split(p.k, bk, max(1, cfg.split_k // d), stages) for d in (1, 2, 4)]
                out += [cfg.with_split(s) for s in splits if s]
        return list(dict.fromkeys(out))

    return configs
