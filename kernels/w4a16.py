"""W4A16 GEMM: fp16/bf16 activations [M, K] x packed int4 weights -> [M, N].

The weight stays in QuantLinear's K-packed layout (int32 [K/8, N], nibble j of row r is input 8r+j): a tile
of it is a coalesced [BLOCK_K/8, BLOCK_N] load along N, which is what every path below wants, so no repack.

Three paths, chosen per M bucket by quantkit.kernels.autotune (plus, for symmetric layers from M = 2 to 64,
the swap kernel of w4a16_swap.py on its own weight layout):
  gemv        M small: no tensor cores, fp32 FMAs. Each nibble is masked *in place* (no shift per element):
              OR-ing it into the mantissa of 2**23 gives 2**23 + q * 16**i exactly, and the activation is
              pre-scaled by 16**-i once per tile instead (the high 16 bits of each word get one shift).
              The 8 nibbles of a word are summed at once (accumulator: one fp32 per word of the tile) and
              the group scale applied to that sum; x rows are the fastest grid axis (weight tile read from
              DRAM once, from L2 for the other rows); K is split at run time (no recompile per split).
  gemv_h2     fp16 on CUDA: the same gemv on packed half2 arithmetic in inline PTX (Marlin's dequant: one lop3
              turns nibbles j and j+4 of a word into the fp16x2 pair 1024 + q; then sub.f16x2 of 1024 + z and
              fma.f16x2 with the x pair (x[8r+j], x[8r+j+4])): ~20 instructions per word of 8 weights instead
              of ~40, the gemv's limit. Each word's 8 products are summed in fp16 (4 per half), x pre-scaled
              by 2**-6 so |sum| <= 4 * 15 * 2**-6 |x|max never overflows; fp32 from the word sum on. Elsewhere
              (bf16, Triton's CPU interpreter, which has no PTX) the fp32 gemv runs instead.
  gemm        tiled tl.dot (tensor cores) on weights dequantized in registers; split-K for small grids.
              `gemm_sliced`: 8 dots of K = BLOCK_K / 8 on the nibble slices (no reshape of the tile);
              `gemm_h2` (fp16 on CUDA): the same, each word's 8 slices dequantized by one inline-PTX block
              (gemv_h2's lop3 pairs, sub.f16x2 and mul.f16x2 by the scale; the same rounding).
  dequant_mm  M large: dequantize the whole weight once, then cuBLAS (vLLM does the same for AWQ above
              a token threshold); the dequant costs ~K*N*2.5 bytes, small next to a compute-bound GEMM.
Split-K programs write fp32 partials; the last program of each output tile to finish (a per-tile counter)
sums them in split order into the output: one launch, deterministic.

Numerics match QuantLinear.reference_forward: w = (q - zero) * scale rounded once to the activation dtype
(products of a 4-bit integer and a 16-bit scale are exact in fp32, so rounding once is the same thing),
fp32 accumulation.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import (
    GEMV_KERNELS,
    MAGIC_F32,
    fp16x2,
    gemv_candidates,
    gemv_program,
    gemv_weights,
    group_rows,
    half2_word_dots,
    half2_word_sums,
    interpreting,
    split_buffers,
    store_output,
    tiled_candidates,
    unpacked_codes,
    zero_pairs,
)
from .spec import M_BUCKETS, KernelSpec, TileConfig


@triton.jit
def dequant_tile(words, s, z, OUT_DTYPE: tl.constexpr):
    """Packed words [R, BN] with per-row scale/zero [R or 1, BN] -> weights [8R, BN] in OUT_DTYPE."""
    shifts = tl.arange(0, 8) * 4
    codes = (words[:, None, :] >> shifts[None, :, None]) & 0xF
    if OUT_DTYPE == tl.float16:
        # 0x6400 | q is fp16 1024 + q: no int->float conversion, and (1024+q) - (1024+z) is exact.
        w = (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        w = (w - (z + 1024.0).to(tl.float16)[:, None, :]) * s.to(tl.float16)[:, None, :]
    else:
        w = (codes | 0x4B000000).to(tl.float32, bitcast=True) - MAGIC_F32
        w = ((w - z[:, None, :]) * s[:, None, :]).to(OUT_DTYPE)
    return tl.reshape(w, (words.shape[0] * 8, words.shape[1]))


@triton.jit
def _codes_minus_zero(words, z, j: tl.constexpr, DTYPE: tl.constexpr):
    """Nibble j of every word as the exact value q - z in DTYPE (fp16 or bf16), no int->float conversion:
    OR-ing q into the mantissa of 1024 (fp16) or 2**23 (fp32, then rounded to bf16) adds it exactly."""
    codes = (words >> (4 * j)) & 0xF
    if DTYPE == tl.float16:
        return (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - (z + 1024.0).to(tl.float16)
    return ((codes | 0x4B000000).to(tl.float32, bitcast=True) - (MAGIC_F32 + z)).to(DTYPE)


def _nibbles_ptx(scaled: bool) -> str:
    """All 8 nibbles of word $8 as fp16 (q - z) [* s]: lop3 of nibbles j, j + 4 gives the fp16x2 pair
    1024 + q, sub.f16x2 (1024 + z) [$9], mul.f16x2 by the scale pair [$10]; mov splits the pair into
    outputs $j and $(j+4) (a register rename, no instruction)."""
    body = ""
    for j in range(4):
        src = "$8" if j == 0 else "t"
        body += (f"shr.u32 t, $8, {4 * j};\n" if j else "") + (
            f"lop3.b32 q, {src}, 0x000F000F, 0x64006400, 0xEA;\nsub.f16x2 q, q, $9;\n"
            + ("mul.rn.f16x2 q, q, $10;\n" if scaled else "") + f"mov.b32 {{${j}, ${j + 4}}}, q;\n")
    return "{\n.reg .b32 q, t;\n" + body + "}"


_NIBBLES_PTX = tl.constexpr(_nibbles_ptx(False))
_NIBBLES_SCALED_PTX = tl.constexpr(_nibbles_ptx(True))


@triton.jit
def _half2_slices(words, s, z, HAS_ZEROS: tl.constexpr, SCALED: tl.constexpr):
    """The 8 nibble slices [ROWS, BN] of a word tile as fp16 q - z (times s if SCALED), by inline PTX."""
    zz = zero_pairs(words, z, HAS_ZEROS)
    if SCALED:
        return tl.inline_asm_elementwise(_NIBBLES_SCALED_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r",
                                         [words, zz, fp16x2(s)], dtype=(tl.float16,) * 8, is_pure=True,
                                         pack=1)
    return tl.inline_asm_elementwise(_NIBBLES_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, zz],
                                     dtype=(tl.float16,) * 8, is_pure=True, pack=1)


@triton.jit
def _sliced_tile(x_ptr, words, s, z, offs_m, m_mask, k0, K, ROWS: tl.constexpr, SCALE_AFTER: tl.constexpr,
                 UPCAST_DOT: tl.constexpr, HALF2: tl.constexpr = False, HAS_ZEROS: tl.constexpr = True):
    """x [:, k0:k0+8*ROWS] @ W for one K tile, as 8 dots of K = ROWS: nibble j of word row r is input
    k0 + 8r + j, so slice j of the weight is [ROWS, BN] in the words' own layout and its x operand a stride-8
    column load. No [R, 8, BN] -> [8R, BN] reshape (a shared-memory layout conversion per tile).
    SCALE_AFTER (one group spans the tile): the dots see the exact integers q - z and the [1, BN] scale
    multiplies their fp32 sum once; else the per-row scale is applied to each slice (rounded once)."""
    rows = tl.arange(0, ROWS)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((offs_m.shape[0], words.shape[1]), dtype=tl.float32)
    if HALF2:
        slices = _half2_slices(words, s, z, HAS_ZEROS, not SCALE_AFTER)
    for j in tl.static_range(8):
        x = tl.load(x_ptr + offs_m[:, None] * K + (k0 + 8 * rows + j)[None, :], mask=m_mask[:, None], other=0.0)
        if HALF2:
            w = slices[j]
        else:
            w = _codes_minus_zero(words, z, j, dtype)
            if not SCALE_AFTER:
                w = (w.to(tl.float32) * s).to(dtype)
        if UPCAST_DOT:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    return acc * s if SCALE_AFTER else acc


@triton.jit
def _w4a16_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K,
                       GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT_K: tl.constexpr, UPCAST_DOT: tl.constexpr, SLICED: tl.constexpr,
                       HALF2: tl.constexpr = False):
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    grid_m = tl.cdiv(M, BLOCK_M)
    # M-blocks of one weight tile are neighbours in launch order, so the weight comes from DRAM once.
    pid_m, pid_n = pid % grid_m, pid // grid_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    ROWS: tl.constexpr = BLOCK_K // 8
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(pid_k, K // BLOCK_K, SPLIT_K):
        k0 = t * BLOCK_K
        words = tl.load(qw_ptr + (k0 // 8 + tl.arange(0, ROWS))[:, None] * N + offs_n[None, :],
                        mask=n_mask[None, :], other=0)
        if SLICED:
            s, z = group_rows(s_ptr, z_ptr, k0, N, offs_n, n_mask, ROWS, GROUP, BLOCK_K, HAS_ZEROS,
                              BLOCK_K > GROUP)
            acc += _sliced_tile(x_ptr, words, s, z, offs_m, m_mask, k0, K, ROWS, BLOCK_K <= GROUP, UPCAST_DOT,
                                HALF2, HAS_ZEROS)
        else:
            x = tl.load(x_ptr + offs_m[:, None] * K + (k0 + tl.arange(0, BLOCK_K))[None, :],
                        mask=m_mask[:, None], other=0.0)
            s, z = group_rows(s_ptr, z_ptr, k0, N, offs_n, n_mask, ROWS, GROUP, BLOCK_K, HAS_ZEROS)
            w = dequant_tile(words, s, z, x_ptr.dtype.element_ty)
            if UPCAST_DOT:
                acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
    store_output(acc, out_ptr, part_ptr, count_ptr, bias_ptr, offs_m, offs_n, M, N, pid_k, pid, SPLIT_K,
                 SPLIT_K > 1, HAS_BIAS)


# x words (pairs 8r+2p, 8r+2p+1, p < 4) -> the pairs (x[8r+j], x[8r+j+4]) that lop3 of nibbles j, j+4 meets,
# times 2**-6 (0x2400 in fp16).
_X_PAIRS_PTX = tl.constexpr("""{
.reg .b32 k;
mov.b32 k, 0x24002400;
prmt.b32 $0, $4, $6, 0x5410;
prmt.b32 $1, $4, $6, 0x7632;
prmt.b32 $2, $5, $7, 0x5410;
prmt.b32 $3, $5, $7, 0x7632;
mul.rn.f16x2 $0, $0, k;
mul.rn.f16x2 $1, $1, k;
mul.rn.f16x2 $2, $2, k;
mul.rn.f16x2 $3, $3, k;
}""")

@triton.jit
def _fp16_x_pairs(x_ptr, x_base, rows):
    """The x pairs (x[8r+j], x[8r+j+4]) * 2**-6, j < 4, of each packed row r, as fp16x2 words [ROWS]."""
    xw = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + x_base // 2 + 4 * rows
    x0, x1, x2, x3 = tl.load(xw), tl.load(xw + 1), tl.load(xw + 2), tl.load(xw + 3)
    return tl.inline_asm_elementwise(_X_PAIRS_PTX, "=r,=r,=r,=r,r,r,r,r", [x0, x1, x2, x3],
                                     dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit(do_not_specialize=["M", "SPLIT_K"])  # one compile serves every M and split
def _w4a16_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K,
                       GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
                       SPLIT_K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IS_SPLIT: tl.constexpr,
                       HALF2: tl.constexpr):
    # SPLIT_K is a runtime argument; IS_SPLIT picks the store (final output or fp32 partial).
    # Rows of x are the fastest grid axis: the programs sharing a weight tile run together and all but
    # the first find it in L2, so the weight crosses DRAM once for any M.
    m, pid_k, tile, offs_n, n_mask, rows = gemv_program(N, BLOCK_N, BLOCK_K)
    ROWS: tl.constexpr = BLOCK_K // 8
    last = K // BLOCK_K - 1
    # Every tensor is [ROWS, BLOCK_N] in the layout of the coalesced weight load (nibbles are a static
    # loop, not a tensor axis): no layout conversion inside the K loop, one fp32 accumulator per word.
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    # Register prefetch: the next K tile's loads are issued before this tile's arithmetic (Triton pipelines
    # only loops with a dot), so a tile is always in flight. H200: +4-12% at M = 1.
    words, s, z = gemv_weights(qw_ptr, s_ptr, z_ptr, pid_k * BLOCK_K, N, offs_n, n_mask, rows, ROWS, GROUP,
                               BLOCK_K, HAS_ZEROS)
    if HALF2:
        p0, p1, p2, p3 = _fp16_x_pairs(x_ptr, m * K + pid_k * BLOCK_K, rows)
    for t in range(pid_k, K // BLOCK_K, SPLIT_K):
        k0, k_next = t * BLOCK_K, tl.minimum(t + SPLIT_K, last) * BLOCK_K  # the last tile re-reads itself
        words_next, s_next, z_next = gemv_weights(qw_ptr, s_ptr, z_ptr, k_next, N, offs_n, n_mask, rows, ROWS,
                                                  GROUP, BLOCK_K, HAS_ZEROS)
        if HALF2:
            q0, q1, q2, q3 = _fp16_x_pairs(x_ptr, m * K + k_next, rows)
            acc += half2_word_dots(p0, p1, p2, p3, words, z, s, HAS_ZEROS, False) * s
            p0, p1, p2, p3 = q0, q1, q2, q3
        else:
            partial = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
            for h in tl.static_range(2):  # 16-bit half h of each word holds inputs 8r + 4h + i, i < 4
                half = (words >> (16 * h)) & 0xFFFF
                for i in tl.static_range(4):
                    x = tl.load(x_ptr + m * K + k0 + 8 * rows + 4 * h + i).to(tl.float32) * (1.0 / (1 << (4 * i)))
                    q = ((half & (0xF << (4 * i))) | 0x4B000000).to(tl.float32, bitcast=True)
                    partial += (q - (MAGIC_F32 + z * (1 << (4 * i)))) * x[:, None]  # exact: (q - z) * 16**i
            acc += partial * s  # the group scale once per word, after its 8 nibbles are summed
        words, s, z = words_next, s_next, z_next
    out = tl.sum(acc, axis=0) * (64.0 if HALF2 else 1.0)
    store_output(out[None, :], out_ptr, part_ptr, count_ptr, bias_ptr, m + tl.arange(0, 1), offs_n, M, N, pid_k,
                 tile, SPLIT_K, IS_SPLIT, HAS_BIAS)


@triton.jit
def _dequant_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_k, pid_n = tl.program_id(0), tl.program_id(1)
    k0 = pid_k * BLOCK_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    ROWS: tl.constexpr = BLOCK_K // 8
    words = tl.load(qw_ptr + (k0 // 8 + tl.arange(0, ROWS))[:, None] * N + offs_n[None, :],
                    mask=n_mask[None, :], other=0)
    s, z = group_rows(s_ptr, z_ptr, k0, N, offs_n, n_mask, ROWS, GROUP, BLOCK_K, HAS_ZEROS)
    w = dequant_tile(words, s, z, w_ptr.dtype.element_ty)
    tl.store(w_ptr + (k0 + tl.arange(0, BLOCK_K))[:, None] * N + offs_n[None, :], w, mask=n_mask[None, :])


def half2_gemv_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                         group_size: int) -> torch.Tensor:
    """What `gemv_h2` computes, in PyTorch, rounding where its PTX rounds: x * 2**-6 to fp16; per word and
    half, 4 fused (q - z) * x + acc rounded once to fp16 each; the two halves to fp32; fp32 from there on.
    fp32 [M, N] (no bias). The CPU tests check this numerics against float64 (the PTX itself runs only on
    CUDA, where bench_kernels.py --check compares it with float64)."""
    k = qweight.shape[0] * 8
    group = torch.arange(0, k, 8, device=x.device) // group_size
    zero = zeros[group].float()[:, None, :] if zeros is not None else 8.0
    xs = (x.half() * 2.0**-6).float().reshape(x.shape[0], k // 8, 8)
    words = half2_word_sums(xs, unpacked_codes(qweight) - zero) * scales[group].float()[None]
    return words.sum(dim=1) * 64.0


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               group_size: int) -> torch.Tensor:
    """[K, N] weight in the scales' dtype (the `dequant_mm` path; also a fast dequantizer)."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    w = torch.empty(k, n, dtype=scales.dtype, device=qweight.device)
    block_k = 64 if k % 64 == 0 else 32
    _dequant_kernel[(k // block_k, triton.cdiv(n, 128))](
        qweight, scales, zeros if zeros is not None else scales, w, n, GROUP=group_size,
        HAS_ZEROS=zeros is not None, BLOCK_N=128, BLOCK_K=block_k, num_warps=4)
    return w


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 bias: torch.Tensor | None, group_size: int, config: TileConfig) -> torch.Tensor:
    """x [M, K] contiguous (scales' dtype) -> [M, N] with the given path/tile config (see autotune)."""
    m, k = x.shape
    n = qweight.shape[1]
    if config.kernel == "dequant_mm":
        w = dequantize(qweight, scales, zeros, group_size)
        return torch.addmm(bias, x, w) if bias is not None else torch.mm(x, w)
    split = config.split_k
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    gemv = config.kernel in GEMV_KERNELS
    grid = ((m, triton.cdiv(n, config.block_n), split) if gemv else
            (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), split))
    part, counters = split_buffers(split, m, n, math.prod(grid[:-1]), x.device) if split > 1 else (out, out)
    args = (x, qweight, scales, zeros if zeros is not None else scales, bias if bias is not None else scales,
            out, part, counters, m, n, k)
    flags = dict(GROUP=group_size, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None,
                 BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                 num_warps=config.num_warps, num_stages=config.num_stages)
    if gemv:
        half2 = config.kernel == "gemv_h2" and x.dtype == torch.float16 and not interpreting()
        _w4a16_gemv_kernel[grid](*args, SPLIT_K=split, IS_SPLIT=split > 1, HALF2=half2, **flags)
    else:
        # Triton's CPU interpreter gets bf16 tl.dot wrong (3.9): there, and only there, multiply in fp32.
        upcast = x.dtype == torch.bfloat16 and interpreting()
        half2 = config.kernel == "gemm_h2" and x.dtype == torch.float16 and not interpreting()
        _w4a16_gemm_kernel[grid](*args, BLOCK_M=config.block_m, SPLIT_K=split, UPCAST_DOT=upcast,
                                 SLICED=config.kernel in ("gemm_sliced", "gemm_h2"), HALF2=half2, **flags)
    return out


SLICED_LEAST_BLOCK_K = 8 * 16  # each of the 8 nibble slices is one dot of K = BLOCK_K / 8 >= 16
SPECS = (
    KernelSpec("gemv_h2", "w4a16", "plain", gemv_candidates("gemv_h2"), w4a16_matmul, buckets=(1, 4)),
    KernelSpec("gemv", "w4a16", "plain", gemv_candidates("gemv"), w4a16_matmul, buckets=(1, 4)),
    KernelSpec("gemm", "w4a16", "plain", tiled_candidates("gemm", 32), w4a16_matmul),
    KernelSpec("gemm_sliced", "w4a16", "plain", tiled_candidates("gemm_sliced", SLICED_LEAST_BLOCK_K), w4a16_matmul),
    KernelSpec("gemm_h2", "w4a16", "plain", tiled_candidates("gemm_h2", SLICED_LEAST_BLOCK_K), w4a16_matmul, buckets=(1, 64)),
    KernelSpec("dequant_mm", "w4a16", "plain", lambda p: [TileConfig("dequant_mm")], w4a16_matmul,
               buckets=(256, M_BUCKETS[-1]), tiled=False),
)
