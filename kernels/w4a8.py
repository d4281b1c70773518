"""W4A8 GEMM: per-token dynamic int8 activations x int4 weights, int32 accumulation on int8 tensor cores.

Step 1 (`quantize_rows`, one small kernel): per token s = max|x| / 127 (fp32, at least 1e-8 / 127),
x_int8 = round_half_even(x / s) clamped to [-127, 127], plus the token's sum of x_int8 (for zero points, when
asked; without them a few tokens' rows are quantized by several programs each).
This is exactly QuantLinear's quantize_activations_per_token, before its rounding back to fp16.

Step 2 (GEMM, int8 x int8 -> int32 over all of K), weights widened from the K-packed int4 codes q:
  per-channel  w = q (0..15 as int8); the zero point comes out in the epilogue as z * sum(x_int8), and
               out = acc * token_scale * scale[n].
  two-level    QQQ's scheme: w_int8 = round_half_even((q - z) * group_scale) with the fp16 group scale
               (QQQ's qqq_gemm.cu does this with one fp16 FMA onto 1152, i.e. rounds the exact product
               once to nearest-even; it wraps out-of-range values, we refuse such layers up front), then
               out = acc * token_scale * channel_scale[n].
The product of a 4-bit integer and an fp16 scale is exact in fp32, so adding and subtracting 1.5 * 2**23
rounds it once, to nearest-even. (Reading the int8 straight from the low mantissa bits by a bitcast gave
wrong results inside the tl.dot operand on an H200 with Triton 3.6, though right elsewhere: not used.)

Paths (chosen by quantkit.kernels.autotune): `gemv_h2` / `gemv` for a few tokens (CUDA cores: w4a16's
half2 word dots on the int8 values, which fp16 holds exactly, with the two-level weights rounded as QQQ
rounds them; fp32 FMAs under the interpreter), `gemm` (Triton tl.dot on int8, split-K for small grids) and,
for large M, `int_mm` (widen the weight to int8 once per call, cuBLAS int8 GEMM via torch._int_mm, then a
scaling epilogue kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (
    GEMV_KERNELS,
    MAGIC_F32,
    ROUND_F32,
    fp16_bits,
    gemv_candidates,
    gemv_program,
    gemv_weights,
    gemv_words,
    group_rows,
    half2_word_dots,
    half2_word_sums,
    int8_tile,
    interpreting,
    quantize_rows,
    split_buffers,
    store_output,
    tiled_candidates,
    unpacked_codes,
    without_zero_points,
)
from .spec import M_BUCKETS, KernelSpec, TileConfig


@triton.jit
def _int8_slice(words, s, z, j: tl.constexpr, TWO_LEVEL: tl.constexpr):
    """Nibble j of every word [R, BN] as int8: the raw code, or QQQ's rne((q - z) * group_scale)."""
    codes = (words >> (4 * j)) & 0xF
    if TWO_LEVEL:
        q = (codes | 0x4B000000).to(tl.float32, bitcast=True) - (MAGIC_F32 + z)
        return ((q * s + ROUND_F32) - ROUND_F32).to(tl.int8)
    return codes.to(tl.int8)


@triton.jit
def _w4a8_gemm_kernel(xq_ptr, ts_ptr, xsum_ptr, qw_ptr, cs_ptr, gs_ptr, z_ptr, bias_ptr, out_ptr, part_ptr,
                      count_ptr, M, N, K, GROUP: tl.constexpr, TWO_LEVEL: tl.constexpr, HAS_ZEROS: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, SLICED: tl.constexpr):
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    grid_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = pid % grid_m, pid // grid_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    ROWS: tl.constexpr = BLOCK_K // 8
    rows = tl.arange(0, ROWS)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for t in range(pid_k, K // BLOCK_K, SPLIT_K):
        k0 = t * BLOCK_K
        words = tl.load(qw_ptr + (k0 // 8 + rows)[:, None] * N + offs_n[None, :], mask=n_mask[None, :], other=0)
        if TWO_LEVEL:
            s, z = group_rows(gs_ptr, z_ptr, k0, N, offs_n, n_mask, ROWS, GROUP, BLOCK_K, HAS_ZEROS, SLICED)
        else:
            s, z = 1.0, 0.0
        if SLICED:  # 8 dots of K = ROWS on nibble slices (see w4a16's _sliced_tile): no reshape per tile
            for j in tl.static_range(8):
                x = tl.load(xq_ptr + offs_m[:, None] * K + (k0 + 8 * rows + j)[None, :], mask=m_mask[:, None],
                            other=0)
                acc = tl.dot(x, _int8_slice(words, s, z, j, TWO_LEVEL), acc, out_dtype=tl.int32)
        else:
            x = tl.load(xq_ptr + offs_m[:, None] * K + (k0 + tl.arange(0, BLOCK_K))[None, :],
                        mask=m_mask[:, None], other=0)
            acc = tl.dot(x, int8_tile(words, s, z, TWO_LEVEL), acc, out_dtype=tl.int32)
    if not TWO_LEVEL:
        acc = without_zero_points(acc, z_ptr, xsum_ptr, offs_m, m_mask, offs_n, n_mask, pid_k == 0, HAS_ZEROS)
    ts = tl.load(ts_ptr + offs_m, mask=m_mask, other=0.0)
    cs = tl.load(cs_ptr + offs_n, mask=n_mask, other=0.0)
    out = acc.to(tl.float32) * ts[:, None] * cs[None, :]
    store_output(out, out_ptr, part_ptr, count_ptr, bias_ptr, offs_m, offs_n, M, N, pid_k, pid, SPLIT_K,
                 SPLIT_K > 1, HAS_BIAS)


@triton.jit
def _fp16_pair(xq_ptr, offs, j: tl.constexpr):
    """int8 x[offs + j] and x[offs + j + 4] as one fp16x2 word (int8 values are exact in fp16)."""
    return fp16_bits(tl.load(xq_ptr + offs + j)) | (fp16_bits(tl.load(xq_ptr + offs + j + 4)) << 16)


@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def _w4a8_gemv_kernel(xq_ptr, ts_ptr, qw_ptr, cs_ptr, gs_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
                      M, N, K, GROUP: tl.constexpr, TWO_LEVEL: tl.constexpr, HAS_ZEROS: tl.constexpr,
                      HAS_BIAS: tl.constexpr, SPLIT_K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      IS_SPLIT: tl.constexpr, HALF2: tl.constexpr):
    """Decode GEMV on int8 activations, grid and split as w4a16's gemv. HALF2 (CUDA): w4a16's packed half2
    word dots on the int8 values (exact in fp16; each word's 4 + 4 products summed in fp16, |sum| < 2**16),
    with QQQ's fp16 rounding of the two-level weights; else fp32 FMAs on the exact int8 products."""
    m, pid_k, tile, offs_n, n_mask, rows = gemv_program(N, BLOCK_N, BLOCK_K)
    ROWS: tl.constexpr = BLOCK_K // 8
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    last = K // BLOCK_K - 1
    # per channel (GROUP = K): one zero point for all of K, scale in the epilogue; two-level: the group scales
    # per tile. Register prefetch of the next K tile's weights and scales, as in w4a16's gemv.
    words, s, z = gemv_weights(qw_ptr, gs_ptr if TWO_LEVEL else cs_ptr, z_ptr, pid_k * BLOCK_K, N, offs_n, n_mask,
                               rows, ROWS, GROUP, BLOCK_K, HAS_ZEROS)
    for t in range(pid_k, K // BLOCK_K, SPLIT_K):
        k0, k_next = t * BLOCK_K, tl.minimum(t + SPLIT_K, last) * BLOCK_K  # the last tile re-reads itself
        words_next = gemv_words(qw_ptr, k_next, N, offs_n, n_mask, rows)  # per channel: s, z stay
        if TWO_LEVEL:
            s_next, z_next = group_rows(gs_ptr, z_ptr, k_next, N, offs_n, n_mask, ROWS, GROUP, BLOCK_K, HAS_ZEROS,
                                        True)
        x_offs = m * K + k0 + 8 * rows
        if HALF2:
            acc += half2_word_dots(_fp16_pair(xq_ptr, x_offs, 0), _fp16_pair(xq_ptr, x_offs, 1),
                                   _fp16_pair(xq_ptr, x_offs, 2), _fp16_pair(xq_ptr, x_offs, 3), words, z, s,
                                   HAS_ZEROS, TWO_LEVEL)
        else:
            for j in tl.static_range(8):
                x = tl.load(xq_ptr + x_offs + j).to(tl.float32)
                w = (((words >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - (MAGIC_F32 + z)
                if TWO_LEVEL:
                    w = (w * s + ROUND_F32) - ROUND_F32
                acc += w * x[:, None]
        words = words_next
        if TWO_LEVEL:
            s, z = s_next, z_next
    out = tl.sum(acc, axis=0) * tl.load(ts_ptr + m) * tl.load(cs_ptr + offs_n, mask=n_mask, other=0.0)
    store_output(out[None, :], out_ptr, part_ptr, count_ptr, bias_ptr, m + tl.arange(0, 1), offs_n, M, N, pid_k,
                 tile, SPLIT_K, IS_SPLIT, HAS_BIAS)


@triton.jit
def _int8_weight_kernel(qw_ptr, gs_ptr, z_ptr, w_ptr, N, K, GROUP: tl.constexpr, TWO_LEVEL: tl.constexpr,
                        HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Writes the int8 weight transposed, [N, K] (K-major, what cuBLAS' int8 GEMM wants)."""
    pid_k, pid_n = tl.program_id(0), tl.program_id(1)
    k0 = pid_k * BLOCK_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    ROWS: tl.constexpr = BLOCK_K // 8
    words = tl.load(qw_ptr + (k0 // 8 + tl.arange(0, ROWS))[:, None] * N + offs_n[None, :],
                    mask=n_mask[None, :], other=0)
    s, z = group_rows(gs_ptr, z_ptr, k0, N, offs_n, n_mask, ROWS, GROUP, BLOCK_K, HAS_ZEROS)
    if TWO_LEVEL:
        w = int8_tile(words, s, z, True)
    else:  # per-channel: fold the zero point in (q - z fits int8)
        w = (int8_tile(words, s, z, False).to(tl.int32) - z.to(tl.int32)).to(tl.int8)
    tl.store(w_ptr + offs_n[:, None] * K + (k0 + tl.arange(0, BLOCK_K))[None, :], tl.trans(w),
             mask=n_mask[:, None])


@triton.jit
def _scale_epilogue_kernel(acc_ptr, ts_ptr, cs_ptr, bias_ptr, out_ptr, M, N, HAS_BIAS: tl.constexpr,
                           BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    out = tl.load(acc_ptr + offs, mask=mask, other=0).to(tl.float32)
    out *= tl.load(ts_ptr + offs // N, mask=mask, other=0.0) * tl.load(cs_ptr + offs % N, mask=mask, other=0.0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def half2_w4a8_gemv_reference(xq: torch.Tensor, token_scales: torch.Tensor, qweight: torch.Tensor,
                              channel_scales: torch.Tensor, group_scales: torch.Tensor | None,
                              zeros: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """What the W4A8 `gemv_h2` computes, in PyTorch: the int8 weights (q - z, or QQQ's two-level
    rne((q - z) * group_scale), both exact), the half2 word sums of their products with the int8 activations
    (fp16 rounding as the PTX rounds), fp32 over K, then token and channel scales. fp32 [M, N], no bias."""
    k = qweight.shape[0] * 8
    rows = torch.arange(0, k, 8, device=xq.device)
    index = rows // group_size if group_scales is not None else torch.zeros_like(rows)
    zero = zeros.reshape(-1, qweight.shape[1])[index].float()[:, None, :] if zeros is not None else 8.0
    w = unpacked_codes(qweight) - zero
    if group_scales is not None:
        w = torch.round(w * group_scales[index].float()[:, None, :])
    words = half2_word_sums(xq.float().reshape(xq.shape[0], k // 8, 8), w)
    return words.sum(dim=1) * token_scales[:, None] * channel_scales[None, :]


def int8_weight(qweight: torch.Tensor, group_scales: torch.Tensor | None, zeros: torch.Tensor | None,
                group_size: int) -> torch.Tensor:
    """[N, K] int8 weight (zero point and group scale applied), for the int_mm path and for checks."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    w = torch.empty(n, k, dtype=torch.int8, device=qweight.device)
    block_k = 64 if k % 64 == 0 else 32
    dummy = qweight
    _int8_weight_kernel[(k // block_k, triton.cdiv(n, 64))](
        qweight, group_scales if group_scales is not None else dummy, zeros if zeros is not None else dummy,
        w, n, k, GROUP=group_size, TWO_LEVEL=group_scales is not None, HAS_ZEROS=zeros is not None,
        BLOCK_N=64, BLOCK_K=block_k, num_warps=4)
    return w


def w4a8_matmul(x: torch.Tensor, qweight: torch.Tensor, channel_scales: torch.Tensor,
                group_scales: torch.Tensor | None, zeros: torch.Tensor | None, bias: torch.Tensor | None,
                group_size: int, config: TileConfig) -> torch.Tensor:
    """x [M, K] fp16/bf16 contiguous -> [M, N] in x's dtype.

    channel_scales fp32 [N]; group_scales [G, N] (two-level) or None (per-channel, G == 1); zeros uint8
    [G, N] or None (symmetric, zero 8).
    """
    m, k = x.shape
    n = qweight.shape[1]
    xq, ts, xsum = quantize_rows(x, sums=config.kernel in ("gemm", "gemm_sliced") and group_scales is None)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if config.kernel == "int_mm":
        acc = torch._int_mm(xq, int8_weight(qweight, group_scales, zeros, group_size).t())
        block = 1024
        _scale_epilogue_kernel[(triton.cdiv(m * n, block),)](
            acc, ts, channel_scales, bias if bias is not None else ts, out, m, n, HAS_BIAS=bias is not None,
            BLOCK=block, num_warps=4)
        return out
    split = config.split_k
    zeros_arg = zeros if zeros is not None else qweight
    bias_arg = bias if bias is not None else channel_scales
    flags = dict(GROUP=group_size, TWO_LEVEL=group_scales is not None, HAS_ZEROS=zeros is not None,
                 HAS_BIAS=bias is not None, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                 num_warps=config.num_warps, num_stages=config.num_stages)
    if config.kernel in GEMV_KERNELS:
        grid = (m, triton.cdiv(n, config.block_n), split)
        part, counters = split_buffers(split, m, n, m * grid[1], x.device) if split > 1 else (out, out)
        _w4a8_gemv_kernel[grid](
            xq, ts, qweight, channel_scales, group_scales if group_scales is not None else channel_scales,
            zeros_arg, bias_arg, out, part, counters, m, n, k, SPLIT_K=split, IS_SPLIT=split > 1,
            HALF2=config.kernel == "gemv_h2" and not interpreting(), **flags)
        return out
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), split)
    part, counters = split_buffers(split, m, n, grid[0], x.device) if split > 1 else (out, out)
    _w4a8_gemm_kernel[grid](
        xq, ts, xsum if xsum is not None else ts, qweight, channel_scales,
        group_scales if group_scales is not None else channel_scales,
        zeros_arg, bias_arg, out, part, counters, m, n, k, BLOCK_M=config.block_m, SPLIT_K=split,
        SLICED=config.kernel == "gemm_sliced", **flags)
    return out


SLICED_LEAST_BLOCK_K = 8 * 32  # each of the 8 nibble slices is one int8 dot of K = BLOCK_K / 8 >= 32
SPECS = (
    KernelSpec("gemv_h2", "w4a8", "plain", gemv_candidates("gemv_h2"), w4a8_matmul, buckets=(1, 4)),
    KernelSpec("gemv", "w4a8", "plain", gemv_candidates("gemv"), w4a8_matmul, buckets=(1, 4)),
    KernelSpec("gemm", "w4a8", "plain", tiled_candidates("gemm", 64), w4a8_matmul),  # int8 dots take K 32; 64 keeps them fed
    KernelSpec("gemm_sliced", "w4a8", "plain", tiled_candidates("gemm_sliced", SLICED_LEAST_BLOCK_K), w4a8_matmul),
    KernelSpec("int_mm", "w4a8", "plain", lambda p: [TileConfig("int_mm")], w4a8_matmul,
               buckets=(256, M_BUCKETS[-1]), tiled=False),
)
