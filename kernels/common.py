"""What the Triton kernels share (every kernel file imports this; no kernel file imports another): inline-PTX
snippets and the jit helpers built on them, the split-K output store with its buffers and tile counters, the gemv
programs' loads, programmatic-dependent-launch arguments, the per-token int8 quantization of activations that
every W4A8 kernel runs first (`quantize_rows`), and what the grouped MoE GEMMs share (the routed tokens' alignment,
the stacked experts, tiles, K split and block forward). The Gluon (Hopper) kernels' own helpers are in
gluon_common.py."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .layout import CHUNK
from .spec import Problem, TileConfig, gemv_config, split_k_for, tile_config, with_half_split

CHUNK_TL = tl.constexpr(CHUNK)

MAGIC_F32 = tl.constexpr(8388608.0)  # 2**23: OR-ing an integer below 2**23 into its mantissa adds it exactly


@triton.jit
def group_rows(s_ptr, z_ptr, k0, N, offs_n, n_mask, ROWS: tl.constexpr, GROUP: tl.constexpr,
               BLOCK_K: tl.constexpr, HAS_ZEROS: tl.constexpr, WORD_LAYOUT: tl.constexpr = False):
    """Scale and zero point (fp32) for the 8-input rows k0 + 8r of a K tile: [1, BN] if one group spans the
    tile, else [ROWS, BN] (groups are multiples of 8, so a packed row never straddles two groups).
    WORD_LAYOUT: always [ROWS, BN], the int32 word tile's shape, so the compiler gives both loads one register
    layout (a [1, BN] scale made it convert the gemv's whole partial tile through shared memory per K tile)."""
    if WORD_LAYOUT:
        g = (k0 + 8 * tl.arange(0, ROWS)) // GROUP
    elif BLOCK_K <= GROUP:
        g = (k0 // GROUP) + tl.zeros([1], dtype=tl.int32)
    else:
        g = (k0 + 8 * tl.arange(0, ROWS)) // GROUP
    idx = g[:, None] * N + offs_n[None, :]
    s = tl.load(s_ptr + idx, mask=n_mask[None, :], other=0.0).to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(z_ptr + idx, mask=n_mask[None, :], other=0).to(tl.float32)
    else:
        z = tl.full(s.shape, 8.0, tl.float32)
    return s, z


@triton.jit
def store_output(acc, out_ptr, part_ptr, count_ptr, bias_ptr, offs_m, offs_n, M, N, pid_k, tile, n_splits,
                 IS_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """acc [BM, BN] fp32 -> the output tile (bias added, cast). Split K: each program writes its fp32 partial
    and counts itself in at the tile's counter; the last to arrive sums the partials in split order
    (deterministic, the same sum as a separate reduce kernel, without its launch) and resets the counter."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    idx = offs_m[:, None] * N + offs_n[None, :]
    if IS_SPLIT:
        tl.store(part_ptr + pid_k * M * N + idx, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == n_splits - 1:
            total = tl.zeros_like(acc)
            for s in range(n_splits):  # .cg: read the other SMs' partials from L2, never a stale L1 line
                total += tl.load(part_ptr + s * M * N + idx, mask=mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + tile, 0)
            _store_final(total, out_ptr, bias_ptr, offs_n, idx, mask, N, HAS_BIAS)
    else:
        _store_final(acc, out_ptr, bias_ptr, offs_n, idx, mask, N, HAS_BIAS)


@triton.jit
def _store_final(acc, out_ptr, bias_ptr, offs_n, idx, mask, N, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + idx, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def fp16_bits(v):
    """v rounded to fp16, its 16 bits in the low half of an int32."""
    return v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def fp16x2(v):
    """v as fp16 in both halves of an int32 (an fp16x2 operand)."""
    bits = fp16_bits(v)
    return bits | (bits << 16)


@triton.jit
def zero_pairs(words, z, HAS_ZEROS: tl.constexpr):
    """1024 + z as fp16x2 per word (z = 8 when symmetric): what lop3's 1024 + q pairs subtract."""
    if HAS_ZEROS:
        zh = z.to(tl.int32) | 0x6400
        pairs = zh | (zh << 16)
    else:
        pairs = tl.zeros_like(words) + 0x64086408
    return pairs


# sum_j w_j x_j over the 8 nibbles of word $1, w_j = q_j - z: x pairs $2..$5, (1024 + z) as fp16x2 in $6;
# fp32 out. ROUND (W4A8 two-level): w_j = round_half_even((q_j - z) * s) with the fp16x2 group scale in $7, as
# QQQ does: one fma onto 1536 (spacing 1 there) rounds the exact product once, then 1536 comes off exactly.
_NIBBLE_PAIR = """shr.u32 t, $1, {shift};
lop3.b32 q, t, 0x000F000F, 0x64006400, 0xEA;
sub.f16x2 q, q, $6;
{round}fma.rn.f16x2 a, q, ${pair}, a;
"""

_ROUND_PAIR = "fma.rn.f16x2 q, q, $7, r;\nsub.f16x2 q, q, r;\n"


def _word_dot_ptx(round_scale: bool) -> str:
    pairs = "".join(_NIBBLE_PAIR.format(shift=4 * j, pair=2 + j, round=_ROUND_PAIR if round_scale else "")
                    for j in range(4))
    return ("{\n.reg .b32 q, t, a, r;\n.reg .b16 lo, hi;\n.reg .f32 fl, fh;\nmov.b32 a, 0;\n"
            "mov.b32 r, 0x66006600;\n" + pairs
            + "mov.b32 {lo, hi}, a;\ncvt.f32.f16 fl, lo;\ncvt.f32.f16 fh, hi;\nadd.f32 $0, fl, fh;\n}")

_WORD_DOT_PTX = tl.constexpr(_word_dot_ptx(False))

_WORD_DOT_ROUND_PTX = tl.constexpr(_word_dot_ptx(True))


@triton.jit
def half2_word_dots(p0, p1, p2, p3, words, z, s, HAS_ZEROS: tl.constexpr, ROUND: tl.constexpr):
    """[ROWS, BN] fp32: sum over each word's 8 nibbles of w * x for the x pairs p0..p3 [ROWS] (see gemv_h2
    above; ROUND: W4A8's two-level int8 weights, s the [ROWS, BN] fp32 group scale, exact in fp16)."""
    zz = zero_pairs(words, z, HAS_ZEROS)
    tile = tl.zeros_like(words)  # broadcasts each row's x pair across the row
    q0, q1, q2, q3 = p0[:, None] + tile, p1[:, None] + tile, p2[:, None] + tile, p3[:, None] + tile
    if ROUND:
        return tl.inline_asm_elementwise(_WORD_DOT_ROUND_PTX, "=r,r,r,r,r,r,r,r",
                                         [words, q0, q1, q2, q3, zz, fp16x2(s)], dtype=tl.float32,
                                         is_pure=True, pack=1)
    return tl.inline_asm_elementwise(_WORD_DOT_PTX, "=r,r,r,r,r,r,r", [words, q0, q1, q2, q3, zz],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def gemv_program(N, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A gemv program's x row, K split, output tile index (for the split-K counters), output columns (and
    mask) and packed-row indices."""
    m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return m, tl.program_id(2), m * tl.num_programs(1) + pid_n, offs_n, offs_n < N, tl.arange(0, BLOCK_K // 8)


@triton.jit
def gemv_weights(qw_ptr, s_ptr, z_ptr, k0, N, offs_n, n_mask, rows, ROWS: tl.constexpr, GROUP: tl.constexpr,
                 BLOCK_K: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """A gemv K tile's packed words and their scales and zero points, each [ROWS, BLOCK_N]."""
    s, z = group_rows(s_ptr, z_ptr, k0, N, offs_n, n_mask, ROWS, GROUP, BLOCK_K, HAS_ZEROS, True)
    return gemv_words(qw_ptr, k0, N, offs_n, n_mask, rows), s, z


@triton.jit
def gemv_words(qw_ptr, k0, N, offs_n, n_mask, rows):
    """A gemv K tile's packed words [ROWS, BLOCK_N] (coalesced along N)."""
    return tl.load(qw_ptr + (k0 // 8 + rows)[:, None] * N + offs_n[None, :], mask=n_mask[None, :], other=0)


def half2_word_sums(xs: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the half2 word dots compute, in PyTorch: per packed row r and output n, the low fp16 lane sums
    w[r, j] * x[r, j] for j < 4 and the high lane j >= 4, each step one fused multiply-add rounded to fp16;
    the two lanes are added in fp32. xs [M, K/8, 8] and w [K/8, 8, N]: values exact in fp16. -> [M, K/8, N]."""
    lanes = []
    for lane in (0, 4):
        acc = torch.zeros(xs.shape[0], xs.shape[1], w.shape[2], dtype=torch.float16, device=xs.device)
        for j in range(lane, lane + 4):
            acc = (w[None, :, j, :] * xs[:, :, j, None] + acc.float()).half()
        lanes.append(acc.float())
    return lanes[0] + lanes[1]


def unpacked_codes(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [K/8, N] -> fp32 codes [K/8, 8, N] (nibble j of row r is input 8r + j)."""
    return torch.stack([(qweight >> (4 * j)) & 0xF for j in range(8)], dim=1).float()


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def split_buffers(split: int, m: int, n: int, tiles: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 partials [split, m, n] and the tile counters of a split-K launch."""
    return torch.empty(split, m, n, dtype=torch.float32, device=device), tile_counters(device, tiles)

_COUNTERS: dict[str, torch.Tensor] = {}


def tile_counters(device: torch.device, tiles: int = 1 << 16) -> torch.Tensor:
    """The device's split-K tile counters (int32, zero between launches: the last program of each tile
    resets its own). One buffer serves every layer and every CUDA-graph replay; make_kernel_forward
    allocates it eagerly so no capture ever has to. Split-K launches of one device must not run
    concurrently on two streams (they would share counters)."""
    counters = _COUNTERS.get(str(device))
    if counters is None or counters.numel() < tiles:
        counters = torch.zeros(max(tiles, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[str(device)] = counters
    return counters

ROUND_F32 = tl.constexpr(12582912.0)  # 1.5 * 2**23: x + ROUND_F32 rounds x to an integer (nearest-even) for |x| < 2**22

ONE_PASS_K = 32768  # rows up to this long are held in registers: one read of x, one memory latency


@triton.jit
def _quantize_block(x, scale, xq_ptr, offs, mask):
    """Stores round_half_even(x / scale) clamped to +-127 as int8; returns the int32 codes (0 where masked)."""
    q = (tl.math.div_rn(x, scale) + ROUND_F32) - ROUND_F32
    q = tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int32)
    tl.store(xq_ptr + offs, q.to(tl.int8), mask=mask)
    return q


@triton.jit
def _quantize_rows_kernel(x_ptr, xq_ptr, scale_ptr, sum_ptr, K, SEGMENT, BLOCK: tl.constexpr, SEG_BLOCK: tl.constexpr,
                          ONE_PASS: tl.constexpr, SEGMENTED: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # a dependent GEMM may start now: it waits for this grid (griddepcontrol.wait) before reading x
        gdc_launch_dependents()
    row, seg = tl.program_id(0), tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:  # the whole row in registers: one read of x, one memory latency
        x = tl.load(x_ptr + row * K + offs, mask=offs < K, other=0.0).to(tl.float32)
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-8), 127.0)
        if SEGMENTED:  # every program of the row finds its max; each quantizes one segment (read again, from L1)
            offs = seg * SEGMENT + tl.arange(0, SEG_BLOCK)
            mask = (offs < K) & (tl.arange(0, SEG_BLOCK) < SEGMENT)
            x = tl.load(x_ptr + row * K + offs, mask=mask, other=0.0).to(tl.float32)
            total = _quantize_block(x, scale, xq_ptr + row * K, offs, mask)
        else:
            total = _quantize_block(x, scale, xq_ptr + row * K, offs, offs < K)
    else:  # long rows: a max pass, then a quantizing pass
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_ptr + row * K + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-8), 127.0)
        total = tl.zeros((BLOCK,), dtype=tl.int32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_ptr + row * K + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            total += _quantize_block(x, scale, xq_ptr + row * K + k0, offs, k0 + offs < K)
    if seg == 0:
        tl.store(scale_ptr + row, scale)
    if not SEGMENTED:
        tl.store(sum_ptr + row, tl.sum(total, axis=0))


def row_segments(m: int, k: int) -> int:
    """Programs per row for a few tokens: one program quantizing a whole row is bound by its SM (M = 1, K = 14336:
    5.6 us on an H200; 14 programs of 1024 inputs each: 2.2 us), so rows are
    cut into segments of at least 1024 inputs, up to about 256 programs (each reads its whole row for the max)."""
    return max(1, min(k // 1024, 256 // m))


@functools.cache
def dependent_launch(device: torch.device) -> bool:
    """Whether the GEMMs are launched as programmatic dependents of the kernel before them (PDL, sm_90 on): W4A8's of
    quantize_rows, which lets them start at once, W4A16's TMA kernels of whatever wrote x (which, not asking for it,
    lets them start as its last programs leave). Their programs then run their launch, prologue and the weight
    ring's first tiles early and wait for that kernel only before reading x. QUANTKIT_PDL=0 turns it off."""
    return (device.type == "cuda" and not interpreting() and torch.cuda.get_device_capability(device) >= (9, 0)
            and os.environ.get("QUANTKIT_PDL", "1") != "0")


def dependent_launch_args(device: torch.device) -> dict:
    """Launch keywords of a GEMM launched as a programmatic dependent: the kernel's PDL constexpr (wait for the kernel
    before reading x, and before any write) and Triton's launch_pdl, always together: a kernel launched early that
    did not wait would race."""
    return dict(PDL=True, launch_pdl=True) if dependent_launch(device) else dict(PDL=False)


def quantize_rows(x: torch.Tensor, one_pass_k: int = ONE_PASS_K, sums: bool = True, segments: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [M, K] -> (int8 [M, K], fp32 token scales [M], int32 sums of the int8 rows [M], or None without `sums`).
    Without sums, rows held in registers are quantized in `segments` programs each (default: row_segments).
    On dependent_launch devices the kernel lets the next launch start early (which waits for it, see there)."""
    m, k = x.shape
    xq = torch.empty(m, k, dtype=torch.int8, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    total = torch.empty(m, dtype=torch.int32, device=x.device)  # written only when a program takes a whole row
    one_pass = k <= one_pass_k
    segments = (segments or row_segments(m, k)) if one_pass and not sums else 1
    segment = -(-k // segments // 256) * 256  # 512-byte aligned segment starts
    block = triton.next_power_of_2(k) if one_pass else 4096
    _quantize_rows_kernel[(m, -(-k // segment))](
        x, xq, scale, total, k, segment, BLOCK=block, SEG_BLOCK=triton.next_power_of_2(segment), ONE_PASS=one_pass,
        SEGMENTED=segment < k, PDL=dependent_launch(x.device), num_warps=max(4, min(16, block // 1024)))
    return xq, scale, total if sums else None


@triton.jit
def block_start(col, W, N, TILE: tl.constexpr):
    """Where column col (a K tile's first, a multiple of its TILE elements) of weight row 0 lies in a swap-layout
    weight, plain or k_blocked (W elements a row): the rows of a tile inside one block are W apart from there.
    Stated a multiple of TILE: else Triton cannot prove the rows' 16-byte alignment, and the tile's load leaves its
    cp.async pipeline (and goes through shared memory into the mma's operand)."""
    return tl.multiple_of(col // W * N * W + col % W, TILE)


def slice_ptx(j: int, dtype: str) -> str:
    """Nibble slice j of two packed int16 ($1) as the pair q - 8 in fp16x2 / bf16x2 ($0), Marlin-style: lop3
    ORs the nibbles into the mantissa of 1024 (fp16) or 128 (bf16), where the spacing is 1, and one half2
    op removes it. fp16's odd slices are masked in place at 16 q (1024 + 16 q, still exact) and scaled back
    by the fma (1/16, -72), which saves their shift."""
    if dtype == "fp16":
        shift, mask, base = 8 * (j // 2), ("0x00F000F0" if j % 2 else "0x000F000F"), "0x64006400"
        fix = ("mov.b32 a, 0x2C002C00;\nmov.b32 b, 0xD480D480;\nfma.rn.f16x2 $0, t, a, b;" if j % 2 else
               "mov.b32 b, 0x64086408;\nsub.f16x2 $0, t, b;")  # odd: t / 16 - 72; even: t - 1032
    else:
        shift, mask, base = 4 * j, "0x000F000F", "0x43004300"
        fix = "mov.b32 a, 0x3F803F80;\nmov.b32 b, 0xC308C308;\nfma.rn.bf16x2 $0, t, a, b;"  # t * 1 - 136
    shr = f"shr.b32 t, $1, {shift};\n" if shift else "mov.b32 t, $1;\n"
    return ("{\n.reg .b32 t, a, b;\n" + shr + f"lop3.b32 t, t, {mask}, {base}, 0xEA;\n" + fix + "\n}")


@triton.jit
def swap_program(M, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(pid, pid_k, offs_m, offs_n) of a swap kernel program; the M blocks of one weight tile run together
    (L2 reuse)."""
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    grid_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = pid % grid_m, pid // grid_m
    return pid, pid_k, pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


def _fp16_pair(value: float) -> str:
    bits = int(torch.tensor(value, dtype=torch.float16).view(torch.int16)) & 0xFFFF
    return f"0x{bits:04X}{bits:04X}"


def gemv_word_dot_ptx(zeros: bool) -> str:
    """sum_j w_j x_j over the 8 nibbles of word $1, fp32 in $0: x pairs of slices 0..3 in $2..$5. lop3 ORs
    nibbles j into the fp16 mantissa of 1024 (even j, 1024 + q) or at 16 q (odd j, 1024 + 16 q, no shift needed);
    one fma per pair turns that into w = (q - z) / 64 exactly (16 + q / 64 - (16 + z / 64), 1 + q / 64 - (1 + z / 64);
    all exact in fp16), which keeps each half's sum of 4 products within |x|max * 60 / 64 (no fp16 overflow) without
    touching x. Zero points: the pairs -(16 + z / 64) in $6, -(1 + z / 64) in $7; else z = 8 as constants."""
    consts = f"mov.b32 se, {_fp16_pair(2.0**-6)};\nmov.b32 so, {_fp16_pair(2.0**-10)};\n"
    if zeros:
        consts += "mov.b32 fe, $6;\nmov.b32 fo, $7;\n"
    else:  # half2 operands are registers, never immediates
        consts += f"mov.b32 fe, {_fp16_pair(-(1024 + 8) / 64)};\nmov.b32 fo, {_fp16_pair(-(64 + 8) / 64)};\n"
    body = ""
    for j in range(4):
        src = "$1" if j < 2 else "v"
        mask, scale, fix = ("0x000F000F", "se", "fe") if j % 2 == 0 else ("0x00F000F0", "so", "fo")
        body += (f"lop3.b32 t, {src}, {mask}, 0x64006400, 0xEA;\nfma.rn.f16x2 t, t, {scale}, {fix};\n"
                 + (f"mul.rn.f16x2 a, t, ${2 + j};\n" if j == 0 else f"fma.rn.f16x2 a, t, ${2 + j}, a;\n"))
        if j == 1:
            body += "shr.b32 v, $1, 8;\n"
    return ("{\n.reg .b32 t, v, a, se, so, fe, fo;\n.reg .b16 lo, hi;\n.reg .f32 fl, fh;\n" + consts + body
            + "mov.b32 {lo, hi}, a;\ncvt.f32.f16 fl, lo;\ncvt.f32.f16 fh, hi;\nadd.f32 $0, fl, fh;\n}")

MAX_K = 2**31 // (127 * 128)  # the int32 accumulator of 127 * 16 (q - 8) products stays exact up to this K

EXACT_FROM_M = tl.constexpr(64)  # two-level tiles of this many tokens or more take the exact int8 (q - 8) k slices

HIGH_SLICE_PTX = tl.constexpr("and.b32 $0, $1, 0xF0F0F0F0;")

LOW_SLICE_PTX = tl.constexpr("{\n.reg .b32 t;\nshl.b32 t, $1, 4;\nand.b32 $0, t, 0xF0F0F0F0;\n}")


# Two-level: $1 four weight bytes, $2 the row's k, $6 (128 - 8 k) * 0x01010101 (k and c come once per weight: pack 4)
# -> the int8 (q - 8) k of the high (u = (b >> 4) & 0xF ^ 8) or low (u = b & 0xF ^ 8) nibbles; lop3 0x6A = (a & b) ^ c
_TIMES_K = "mad.lo.u32 t, u, $2, $6;\nxor.b32 $0, t, 0x80808080;\n}"

HIGH_SLICE_K_PTX = tl.constexpr("{\n.reg .b32 t, u;\nshr.b32 t, $1, 4;\nlop3.b32 u, t, 0x0F0F0F0F, 0x08080808, 0x6A;\n"
                       + _TIMES_K)

LOW_SLICE_K_PTX = tl.constexpr("{\n.reg .b32 t, u;\nlop3.b32 u, $1, 0x0F0F0F0F, 0x08080808, 0x6A;\n" + _TIMES_K)

SLICE_K_CONSTRAINTS = tl.constexpr("=r,r" + ",r" * 8)
GEMV_KERNELS = ("gemv_h2", "gemv")  # half2 PTX (fp16 on CUDA; the fp32 gemv elsewhere), then fp32 FMAs


# The K-packed tiled kernels' tiles (BM, BN, BK, warps, stages) by largest M bucket, BK raised to each kernel's least
TILED_TILES = {
    16: ((16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (16, 64, 256, 4, 3), (16, 128, 256, 8, 3)),
    64: ((0, 64, 128, 4, 4), (0, 128, 128, 4, 3), (0, 128, 64, 4, 4), (0, 64, 256, 4, 3)),  # BM 0: the bucket
    4096: ((128, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3),
           (64, 256, 64, 8, 4)),
}


def tiled_candidates(kernel: str, least_block_k: int) -> Callable[[Problem], list[TileConfig]]:
    """A K-packed tiled kernel's candidates: its configs, each at the heuristic split and at half of it."""

    def configs(p: Problem) -> list[TileConfig]:
        out: list[TileConfig] = []
        for bm, bn, bk, warps, stages in TILED_TILES[next(b for b in TILED_TILES if p.bucket <= b)]:
            cfg = tile_config(kernel, bm or p.bucket, bn, max(bk, least_block_k), warps, stages, p.m, p.n, p.k)
            if cfg not in out:
                out += with_half_split([cfg])
        return out

    return configs


# The K-packed gemvs' tiles (BN, BK, warps), the H200 sweeps' best first: BK 256 and 512 (W4A8 on every shape, W4A16
# with register prefetch)
GEMV_TILES = ((64, 256, 4), (64, 512, 4), (64, 128, 4), (64, 64, 4), (128, 256, 4), (128, 128, 8))


def gemv_candidates(kind: str) -> Callable[[Problem], list[TileConfig]]:
    """A K-packed gemv's candidates: its configs at the heuristic split, then its first tile at half of that split."""

    def configs(p: Problem) -> list[TileConfig]:
        out = [gemv_config(p.n, p.k, bn, bk, warps, kind=kind) for bn, bk, warps in GEMV_TILES]
        return out + ([out[0].with_split(out[0].split_k // 2)] if out[0].split_k > 1 else [])

    return configs


# Two warps and 16 tokens: Triton emits mma.sync (no wgmma, whose register operand it makes synchronous); on the
# H200 these won 8 of 18 M = 1 / 16 cells by up to 19% (70B down) and lost the rest by <= 13%; narrower mma.sync
# tiles and 64-token ones lost everywhere.
MMA_SYNC_TILES = ((16, 128, 128, 2, 4), (16, 64, 128, 2, 3))


def swap_tile_candidates(p: Problem, tiles: tuple[tuple[int, int, int, int, int], ...]) -> list[TileConfig]:
    """A swap kernel's configs among these tiles (BM, BN, BK, warps, stages): BM is wgmma's N, the tokens (the M
    bucket up to 64, at least 16; 128 at M = 128..512), a K tile inside one group."""
    b = p.bucket
    block_m = max(16, b) if b <= 64 else 128 if b <= 512 else 0
    out = []
    for bm, bn, bk, warps, stages in tiles:
        bk = bk if p.per_channel else min(bk, p.group)
        if bm != block_m or p.n % bn or p.k % bk or (not p.per_channel and p.group % bk):
            continue
        cfg = tile_config("swap", bm, bn, bk, warps, stages, p.m, p.n, p.k)
        # each register-operand wgmma waits for the one before (Triton's rule for operands computed in the
        # loop), so more resident programs hide that latency: the heuristic split, half and double of it
        for split in (cfg.split_k, cfg.split_k // 2, cfg.split_k * 2):
            if 1 <= split <= max(1, p.k // bk // 2):
                out.append(cfg.with_split(split))
    return list(dict.fromkeys(out))


def require_symmetric(zeros: torch.Tensor | None, kernel: str) -> None:
    """The W4A8 swap layout holds q - 8: a kernel reading it takes symmetric weights only (zeros None)."""
    if zeros is not None:
        raise ValueError(f"{kernel}: symmetric weights only (the swap layout holds q - 8), got zero points")


@triton.jit
def int8_tile(words, s, z, TWO_LEVEL: tl.constexpr):
    """Packed words [R, BN] -> int8 [8R, BN]: raw codes, or QQQ's rne((q - z) * group_scale)."""
    shifts = tl.arange(0, 8) * 4
    codes = (words[:, None, :] >> shifts[None, :, None]) & 0xF
    if TWO_LEVEL:
        q = (codes | 0x4B000000).to(tl.float32, bitcast=True) - (MAGIC_F32 + z[:, None, :])
        w = ((q * s[:, None, :] + ROUND_F32) - ROUND_F32).to(tl.int8)  # an exact integer by now
    else:
        w = codes.to(tl.int8)
    return tl.reshape(w, (words.shape[0] * 8, words.shape[1]))


@triton.jit
def without_zero_points(acc, z_ptr, xsum_ptr, rows, row_mask, offs_n, n_mask, first_split, HAS_ZEROS: tl.constexpr):
    """Per-channel W4A8 on the raw codes: acc (int32, sum_k x q) -> sum_k x (q - z) = acc - z * sum_k x, with the
    output's zero point (8 when symmetric) and the row's sum of int8 x; taken off once per output, by split 0."""
    if HAS_ZEROS:
        z = tl.load(z_ptr + offs_n, mask=n_mask, other=0).to(tl.int32)
    else:
        z = tl.zeros_like(offs_n) + 8
    xsum = tl.load(xsum_ptr + rows, mask=row_mask, other=0) * first_split.to(tl.int32)
    return acc - xsum[:, None] * z[None, :]


@triton.jit
def expert_weights(expert, qw_ptr, s_ptr, z_ptr, N, K, GROUP: tl.constexpr):
    """Expert `expert`'s packed words, scales and zero points in the stacked [E, ...] tensors (per channel, GROUP =
    K: one row of each)."""
    return qw_ptr + expert * (K // 8) * N, s_ptr + expert * (K // GROUP) * N, z_ptr + expert * (K // GROUP) * N


# The grouped MoE GEMMs (moe_w4a16.py, moe_w4a8.py): the routed tokens' alignment, the stacked experts, the tiles and
# K split, a program's rows, and the block forward they share.

MOE_KERNEL = "moe_gemm"
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) by the largest average rows per expert they serve: decode-sized runs
# want short M tiles (a padded row costs as much as a real one), prefill-sized ones the tensor cores' wide tiles.
MOE_TILES = {
    # BLOCK_N 32: decode on a long-K projection (Mixtral's down: K 14336, 2 experts) has few N tiles to spread
    16: ((16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (16, 64, 64, 4, 4), (16, 32, 128, 4, 4)),
    64: ((32, 64, 128, 4, 4), (32, 128, 64, 4, 4), (64, 64, 64, 4, 4), (16, 128, 128, 4, 3)),
    1 << 30: ((64, 128, 64, 4, 4), (64, 64, 128, 4, 3), (128, 128, 64, 8, 3), (32, 128, 64, 4, 4)),
}
LEAST_BLOCK_K = 32  # the fallback tile's K: the kernels have no K mask, so K and the group must be multiples of it


@dataclass(frozen=True)
class StackedExperts:
    """One projection of every expert, stacked: qweight int32 [E, K/8, N]; scales [E, K/group, N] (W4A16's, or
    W4A8's two-level group scales; None: W4A8 per channel, group = K); zeros uint8 [E, K/group, N] or None
    (symmetric, the implicit 8); channel_scales fp32 [E, N] (W4A8 only)."""

    qweight: torch.Tensor
    scales: torch.Tensor | None
    zeros: torch.Tensor | None
    group_size: int
    channel_scales: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, K, N)"""
        e, rows, n = self.qweight.shape
        return e, rows * 8, n


@dataclass(frozen=True)
class AlignedTokens:
    """(token, slot) rows sorted by expert, each expert's run padded to block_m: `sorted_rows` [capacity] (padding:
    the sentinel tokens * top_k), `block_expert` [capacity / block_m] (-1: a block past the last run)."""

    sorted_rows: torch.Tensor
    block_expert: torch.Tensor
    block_m: int
    rows: int  # tokens * top_k


def supports(k: int, group: int) -> bool:
    """Whether a projection of K inputs quantized in groups of `group` (K when per channel) has a tile here."""
    return k % LEAST_BLOCK_K == 0 and group % LEAST_BLOCK_K == 0


def moe_candidates(rows_per_expert: float, k: int, n: int, group: int) -> list[TileConfig]:
    """The launch configs worth timing at this many routed rows per expert, unsplit: BLOCK_K dividing K, and a K
    tile within one group or a whole number of groups (group_rows' two cases); BLOCK_N <= N."""
    tiles = MOE_TILES[next(bound for bound in MOE_TILES if rows_per_expert <= bound)]
    return [TileConfig(MOE_KERNEL, bm, min(bn, triton.next_power_of_2(n)), bk, 1, warps, stages)
            for bm, bn, bk, warps, stages in tiles if k % bk == 0 and (group % bk == 0 or bk % group == 0)]


def aligned_capacity(rows: int, num_experts: int, block_m: int) -> int:
    """Rows of align_tokens' output: at most min(rows, E) experts have rows, each padding fewer than block_m."""
    return triton.cdiv(rows + min(rows, num_experts) * (block_m - 1), block_m) * block_m


def with_moe_split(config: TileConfig, rows: int, num_experts: int, k: int, n: int) -> TileConfig:
    """The config at the dense kernels' K split rule (spec.split_k_for) over the output tiles of the most blocks
    align_tokens can make: decode's few rows per expert (Mixtral: 2 of 8 experts at one token) leave most SMs idle
    unless K is split. An upper bound on the blocks, so a split is never more than the grid needs."""
    blocks = aligned_capacity(rows, num_experts, config.block_m) // config.block_m
    return config.with_split(split_k_for(blocks * triton.cdiv(n, config.block_n), k // config.block_k))


def default_configs(rows: int, gate_up: StackedExperts, down: StackedExperts) -> tuple[TileConfig, TileConfig]:
    """(gate_up's, down's) configs where nothing was tuned: the first candidate (the fallback tile where none fits)
    for the rows per expert, one BLOCK_M for both (one alignment serves both), K split by with_moe_split."""
    num_experts, hidden, _ = gate_up.shape
    configs = []
    for experts in (gate_up, down):
        _, k, n = experts.shape
        fallback = TileConfig(MOE_KERNEL, 16, 64, LEAST_BLOCK_K, 1, 4, 2)
        config = (moe_candidates(rows / num_experts, k, n, experts.group_size) or [fallback])[0]
        config = replace(config, block_m=configs[0].block_m) if configs else config
        configs.append(with_moe_split(config, rows, num_experts, k, n))
    return configs[0], configs[1]


def align_tokens(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedTokens:
    """Sort the (token, slot) rows of topk_ids [tokens, top_k] by expert, each expert's run padded to block_m.
    All on the device, shapes known in advance (capacity: aligned_capacity)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    rows = flat.numel()
    capacity = aligned_capacity(rows, num_experts, block_m)  # a decode step's grid stays small
    # scatter_add, not bincount: bincount on CUDA reads the largest id back to the host (a sync, no graph capture)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    run_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    dest = (run_end - padded)[by_expert] + torch.arange(rows, device=flat.device) - first_of_expert[by_expert]
    sorted_rows = torch.full((capacity,), rows, dtype=torch.int32, device=flat.device)
    sorted_rows[dest] = order.to(torch.int32)
    block_start = torch.arange(0, capacity, block_m, device=flat.device)
    expert = torch.searchsorted(run_end, block_start, right=True)
    block_expert = torch.where(expert < num_experts, expert, -1).to(torch.int32)
    return AlignedTokens(sorted_rows, block_expert, block_m, rows)


@triton.jit
def moe_program(block_expert_ptr, sorted_rows_ptr, N, rows, X_ROW_DIV: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """A grouped program's expert (int64; -1: a block past the last run, nothing to do), its output tile (for the
    split-K counters), its (token, slot) rows (int64; padding: `rows`) and their mask, the input rows they read (row
    t * top_k + s reads t when X_ROW_DIV = top_k), and its output columns with their mask."""
    tile = tl.program_id(0)
    grid_n = tl.cdiv(N, BLOCK_N)
    # The N slices of one M block are neighbours in launch order: the block's x rows stay in L2.
    pid_m, pid_n = tile // grid_n, tile % grid_n
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)  # E * K/8 * N words overflow int32 on the largest
    offs_row = tl.load(sorted_rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # rows * N too
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, tile, offs_row, offs_row < rows, offs_row // X_ROW_DIV, offs_n, offs_n < N


def moe_launch(aligned: AlignedTokens, n: int, config: TileConfig, out: torch.Tensor
               ) -> tuple[tuple[int, int], torch.Tensor, torch.Tensor]:
    """A grouped launch's grid (blocks x N tiles, K splits) and its split-K partials and tile counters (`out` twice
    when unsplit)."""
    if config.block_m != aligned.block_m:
        raise ValueError(f"config BLOCK_M {config.block_m} != the tokens' alignment {aligned.block_m}")
    grid = (aligned.block_expert.numel() * triton.cdiv(n, config.block_n), config.split_k)
    if config.split_k == 1:
        return grid, out, out
    return (grid, *split_buffers(config.split_k, aligned.rows, n, grid[0], out.device))


GroupedMatmul = Callable[..., torch.Tensor]  # (x, experts, aligned, config, routing_weights=None) -> [rows, N]


def moe_block_forward(matmul: GroupedMatmul, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      gate_up: StackedExperts, down: StackedExperts, act: Callable[[torch.Tensor], torch.Tensor],
                      configs: tuple[TileConfig, TileConfig] | None = None) -> torch.Tensor:
    """An MoE block's experts on x [tokens, hidden] through a grouped matmul: down(act(gate(x)) * up(x)) of each
    routed expert times its routing weight, summed over the top_k slots -> [tokens, hidden]. gate_up stacks each
    expert's gate and up projections along N (gate first). configs: (gate_up's, down's), one BLOCK_M; default:
    default_configs."""
    tokens, top_k = topk_ids.shape
    num_experts, hidden, _ = gate_up.shape
    if tokens == 0:
        return x.new_empty(0, hidden)
    configs = configs or default_configs(tokens * top_k, gate_up, down)
    aligned = align_tokens(topk_ids, num_experts, configs[0].block_m)
    gate, up = matmul(x.contiguous(), gate_up, aligned, configs[0]).chunk(2, dim=1)
    return (matmul((act(gate) * up).contiguous(), down, aligned, configs[1], topk_weights)
            .view(tokens, top_k, hidden).sum(dim=1))


def routed_reference(x: torch.Tensor, topk_ids: torch.Tensor, expert_weight: Callable[[int], torch.Tensor],
                     routing_weights: torch.Tensor | None = None) -> torch.Tensor:
    """A grouped matmul in float64, for the tests: each (token, slot) row of x (float64 [tokens, K], each row feeding
    its top_k slots, or [tokens * top_k, K]) times its expert's weight expert_weight(e) (float64 [K, N]), times its
    routing weight where given -> [tokens * top_k, N]."""
    tokens, top_k = topk_ids.shape
    rows = x if x.shape[0] == tokens * top_k else x.repeat_interleave(top_k, dim=0)
    flat = topk_ids.reshape(-1)
    out = None
    for e in flat.unique().tolist():
        mask = flat == e
        y = rows[mask] @ expert_weight(e)
        out = y.new_zeros(tokens * top_k, y.shape[1]) if out is None else out
        out[mask] = y
    return out if routing_weights is None else out * routing_weights.reshape(-1, 1).double()
