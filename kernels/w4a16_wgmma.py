"""W4A16 on Hopper for M = 1..512 in Gluon: the swap layout's weight as an *asynchronous* wgmma's register operand.

`w4a16_swap.py` computes out^T = W x^T with the dequantized weight as wgmma's register A operand, but plain Triton
makes such a wgmma synchronous (a `wgmma.wait_group 0` after every slice dot), so dequantization and mma serialize.
Gluon (Triton's lower-level language) states the pipeline itself:
- a ring of STAGES shared-memory buffers filled by TMA: the weight's int16 swap-layout tile [BLOCK_N, BLOCK_K / 4]
  and x's tile as BLOCK_K / 64 boxes [BLOCK_M, 64] (a box row is 128 bytes: the TMA swizzle limit);
- per 64-input chunk, the int16 [BLOCK_N, 16] is read from shared memory straight into wgmma's A-operand layout;
  each nibble slice j (Marlin's lop3 into the fp16 1024 / bf16 128 mantissa, `_slice_ptx`) is the weight of the x
  columns 16 j .. 16 j + 15 of the chunk, times its group scale (Marlin's order: the dequantized weight is rounded
  to fp16 / bf16 once; per-channel scales go to the epilogue instead);
- every wgmma is issued async and followed by `wait(1)`: the next slice is dequantized while the previous mma runs.
  The previous slice's registers are threaded through that wait (as Triton's own WGMMA pipeliner does) so they stay
  untouched until its mma has read them.
Split K as in w4a16.py: fp32 partials, the last program of a tile sums them in split order. A program runs over
units (an output tile's K split, every unit the same number of K tiles: `wgmma_split`) with its ring running on
across them (`_start_program`); it is launched with one program per unit (persistent grids measured no faster).

Gluon kernels have no CPU interpreter: the tests check the sm_90 compile (async register-operand wgmma, one wait per
slice, TMA ring); results against float64 are checked on the GPU (bench_kernels.py --check-swap and every sweep).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .w4a8 import dependent_launch_args
from .w4a16 import split_buffers
from .w4a16_swap import _CHUNK, CHUNK, _slice_ptx, checked_layout

# Triton 3.6 (the H200's) names the TMA load async_copy_global_to_shared and the CTA barrier thread_barrier; later
# Tritons async_load and barrier
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
_F0, _F1, _F2, _F3 = (gl.constexpr(_slice_ptx(j, "fp16")) for j in range(4))
_B0, _B1, _B2, _B3 = (gl.constexpr(_slice_ptx(j, "bf16")) for j in range(4))


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
def _issue_tile(w_desc, x_desc, w_smem, x_smem, bars, stage, off_n, off_m, k0, N, pred, CHUNKS: gl.constexpr):
    """TMA of one K tile (weight + x) into ring stage `stage`, signalled on its barrier."""
    _issue_weight(w_desc, x_desc, w_smem, bars, stage, off_n, k0, N, pred, CHUNKS)
    _issue_x(x_desc, x_smem, bars, stage, off_m, k0, pred, CHUNKS)


@gluon.jit
def _issue_weight(w_desc, x_desc, w_smem, bars, stage, off_n, k0, N, pred, CHUNKS: gl.constexpr):
    """The weight half of _issue_tile, which arms the stage's barrier for the whole tile. The weight box's row holds
    the tile's CHUNKS * 64 inputs packed (W4A16: 4 per int16, W4A8: 2 per int8); the weight is the swap layout,
    plain or k_blocked (a descriptor row is one K block of a weight row: the plain layout's block is all of K)."""
    bar = bars.index(stage)
    mbarrier.expect(bar, w_desc.block_type.nbytes + CHUNKS * x_desc.block_type.nbytes, pred=pred)
    per_element: gl.constexpr = CHUNKS * _CHUNK // w_desc.block_type.shape[1]
    row, col = _weight_box(w_desc, off_n, k0 // per_element, N)
    _tma_load(w_desc, [row, col], bar, w_smem.index(stage), pred=pred)


@gluon.jit
def _weight_box(w_desc, off_n, col, N):
    """The TMA coordinates (row, column) of weight rows off_n.. at column `col` of the plain swap layout, in w_desc's
    form (plain or k_blocked: column col of row n lies at row (col // width) N + n, column col % width)."""
    width = w_desc.shape[1]
    return col // width * N + off_n, col % width


@gluon.jit
def _issue_x(x_desc, x_smem, bars, stage, off_m, k0, pred, CHUNKS: gl.constexpr):
    """The x half of _issue_tile: CHUNKS boxes of [BLOCK_M, 64]."""
    for c in gl.static_range(CHUNKS):
        _tma_load(x_desc, [off_m, k0 + _CHUNK * c], bars.index(stage), x_smem.index(stage * CHUNKS + c), pred=pred)


@gluon.jit
def _wait_for_prior_grid():
    """griddepcontrol.wait: under programmatic dependent launch, until the kernel before has finished and its
    writes are visible (a no-op otherwise)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _start_ring(w_desc, x_desc, off_n, off_m, pid_k, N, SPLIT_K, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                X_AFTER_PRIOR_GRID: gl.constexpr):
    """The TMA ring's shared memory and barriers, the first unit's first STAGES - 1 K tiles issued (a unit has at
    least that many; X_AFTER_PRIOR_GRID: their weight first, x once the kernel before, which writes x, is done):
    (weight stages, x stages, barriers)."""
    CHUNKS: gl.constexpr = BLOCK_K // _CHUNK
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES * CHUNKS] + x_desc.block_type.shape, x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES - 1):
        _issue_weight(w_desc, x_desc, w_smem, bars, i, off_n, (pid_k + i * SPLIT_K) * BLOCK_K, N, True, CHUNKS)
    if X_AFTER_PRIOR_GRID:
        _wait_for_prior_grid()
    for i in gl.static_range(STAGES - 1):
        _issue_x(x_desc, x_smem, bars, i, off_m, (pid_k + i * SPLIT_K) * BLOCK_K, True, CHUNKS)
    return w_smem, x_smem, bars


@gluon.jit
def _start_program(w_desc, x_desc, M, N, K, SPLIT_K, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, BAND: gl.constexpr,
                   X_AFTER_PRIOR_GRID: gl.constexpr = False):
    """Program p takes the units (output tile, K split) p, p + programs, ..., its TMA ring running on across them
    (the next unit's tiles load during this one's last mmas and epilogue); launched with one program per unit:
    persistent grids of 1 or 2 programs per SM measured no faster on the H200 (sweep_wgmma_persistent_2026-12-04).
    -> (units, K tiles per unit, grid_n, grid_m, the ring's weight stages, x stages and barriers)."""
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    grid_n, grid_m = N // BLOCK_N, gl.cdiv(M, BLOCK_M)
    units = grid_n * grid_m * SPLIT_K
    off_n, off_m, pid_k, _ = _unit(gl.program_id(0), units, grid_n, grid_m, BLOCK_N, BLOCK_M, BAND)
    w_smem, x_smem, bars = _start_ring(w_desc, x_desc, off_n, off_m, pid_k, N, SPLIT_K, BLOCK_K, STAGES,
                                       X_AFTER_PRIOR_GRID)
    return units, K // BLOCK_K // SPLIT_K, grid_n, grid_m, w_smem, x_smem, bars


@gluon.jit
def _unit(u, units, grid_n, grid_m, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, BAND: gl.constexpr):
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
def _ahead(kt, ahead: gl.constexpr, tiles, here, there):
    """Iteration `ahead` after this unit's K tile kt: the same unit's tile kt + ahead, or the next unit's
    (here / there: a unit's (off_n, off_m, pid_k)); a unit has at least `ahead` tiles. -> (off_n, off_m, pid_k, kt)."""
    same = kt + ahead < tiles
    return (gl.where(same, here[0], there[0]), gl.where(same, here[1], there[1]), gl.where(same, here[2], there[2]),
            gl.where(same, kt + ahead, kt + ahead - tiles))


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
    CHUNKS: gl.constexpr = BLOCK_K // _CHUNK
    dtype: gl.constexpr = x_desc.dtype
    FP16: gl.constexpr = dtype == gl.float16
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_layout))

    # PDL (w4a8.dependent_launch): the ring's first weight tiles load before waiting for the kernel that writes x
    units, tiles, grid_n, grid_m, w_smem, x_smem, bars = _start_program(w_desc, x_desc, M, N, K, SPLIT_K, BLOCK_K,
                                                                         STAGES, BAND, PDL)
    pid, programs = gl.program_id(0), gl.num_programs(0)
    off_n, off_m, pid_k, out_tile = _unit(pid, units, grid_n, grid_m, BLOCK_N, BLOCK_M, BAND)
    s, zc = _row_params(s_ptr, z_ptr, pid_k * BLOCK_K, N, off_n + rows, GROUP, HAS_ZEROS, dtype)
    a_prev = gl.zeros([BLOCK_N, 16], dtype, a_layout)
    # zeroed once: a unit's first mma ignores it (use_acc). A zeroing inside the loops is an instruction other than
    # wgmma writing its accumulator, for which ptxas serializes every wgmma of the kernel (its warning C7515)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, acc_layout)
    f = 0  # this program's K tiles so far: the ring position
    for u in range(pid, units, programs):
        off_n, off_m, pid_k, out_tile = _unit(u, units, grid_n, grid_m, BLOCK_N, BLOCK_M, BAND)
        nxt_n, nxt_m, nxt_k, _ = _unit(u + programs, units, grid_n, grid_m, BLOCK_N, BLOCK_M, BAND)
        more = u + programs < units
        for kt in range(tiles):
            stage = f % STAGES
            # the next iteration's scales go out now (after the last unit's last tile: re-read)
            sn, _, sk, skt = _ahead(kt, 1, tiles, (off_n, off_m, pid_k), (nxt_n, nxt_m, nxt_k))
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
                            _cta_barrier()
                        n_, m_, k_, kt_ = _ahead(kt, STAGES - 1, tiles, (off_n, off_m, pid_k), (nxt_n, nxt_m, nxt_k))
                        _issue_tile(w_desc, x_desc, w_smem, x_smem, bars, (f + STAGES - 1) % STAGES, n_, m_,
                                    (k_ + kt_ * SPLIT_K) * BLOCK_K, N, more | (kt + STAGES - 1 < tiles), CHUNKS)
            s, zc = s_next, zc_next
            f += 1
        acc, a_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_prev))
        _store_tile(acc, out_ptr, part_ptr, count_ptr, bias_ptr, s_ptr, s_ptr, M, N, off_n, off_m, pid_k, out_tile,
                    SPLIT_K, 1.0, IS_SPLIT, HAS_BIAS, PER_CHANNEL, False, BLOCK_N, BLOCK_M, num_warps)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def _store_tile(acc, out_ptr, part_ptr, count_ptr, bias_ptr, row_scale_ptr, col_scale_ptr, M, N, off_n, off_m, pid_k,
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
        _cta_barrier()  # every thread's partial is written before the release below
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


def launch_grid(m: int, n: int, k: int, group_size: int, config: dict) -> tuple[int, int]:
    """(programs, output tiles) of a Gluon kernel's launch, one program per unit (an output tile's K split), after
    checking that the config fits the layer."""
    block_n, block_k, split = config["BLOCK_N"], config["BLOCK_K"], config["SPLIT_K"]
    if not wgmma_fits(k, n, group_size, block_n, block_k) or wgmma_split(k, block_k, split, config["num_stages"]) != split:
        raise ValueError(f"wgmma kernel: tile {block_n} x {block_k}, split {split}, {config['num_stages']} stages "
                         f"does not fit N {n}, K {k}, group {group_size}")
    tiles = n // block_n * triton.cdiv(m, config["BLOCK_M"])
    return tiles * split, tiles


def unit_band(n: int, block_n: int, sm_count: int) -> int:
    """Token tiles per band of units (_unit, token tile fastest inside a band). 8 when a token tile's row of units
    outnumbers half the SMs: the programs running together (about two per SM) then span fewer than four token tiles,
    and with n fastest a weight larger than the L2 (8B / 70B gate_up) streams from DRAM once per token tile; in bands
    it is read once per band. Else 1 (n fastest): there the programs running together span several token tiles
    already, and bands measured up to 9% slower (H200: benchmarks/kernels/log_ab_unit_bands_2026-12-04.txt)."""
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


def w4a16_wgmma_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                       bias: torch.Tensor | None, group_size: int, config: dict) -> torch.Tensor:
    """x [M, K] (scales' dtype), packed = repack_for_swap(qweight) [N, K/4] (or k_blocked), zeros [G, N] or None
    -> [M, N]."""
    m, k = x.shape
    split, block_m, block_n, block_k = config["SPLIT_K"], config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    n = checked_layout(packed, k, block_k, "wgmma kernel")
    programs, tiles = launch_grid(m, n, k, group_size, config)
    x = aligned_16(x)  # TMA reads 16-byte aligned rows
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part, counters = split_buffers(split, m, n, tiles, x.device) if split > 1 else (out, out)
    _w4a16_wgmma_kernel[(programs,)](
        descriptor(x, [block_m, CHUNK]), descriptor(packed, [block_n, block_k // 4]), scales,
        zeros if zeros is not None else scales, bias if bias is not None else scales, out, part, counters, m, n, k,
        GROUP=group_size, PER_CHANNEL=group_size == k, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None,
        SPLIT_K=split, IS_SPLIT=split > 1, STAGES=config["num_stages"],
        BAND=device_unit_band(n, block_n, x.device), num_warps=config["num_warps"], **dependent_launch_args(x.device))
    return out
