"""W8A8-FP8 GEMM: float8 e4m3 activations (one scale per token) times float8 e4m3 weights (one scale per output
channel) on the fp8 tensor cores (sm_89 and later: wgmma on Hopper), fp32 accumulation, both scales and the bias in
the epilogue:

    out[m, n] = (sum_k a[m, k] * w[n, k]) * a_scale[m] * w_scale[n] + bias[n]

The weight is the layer's e4m3 bytes as [N, K] (K contiguous: the operand layout the fp8 MMAs read). The activations
arrive quantized: by `fp8_rows` (one launch, each row's scale and codes bit for bit layout.fp8_tokens'), or under
torch.compile by fp8_tokens' torch ops, which Inductor fuses into the norm before.

Kernels (scheme "fp8" of the registry; the tuner times them per shape and M bucket):
  gemm          Triton: a BLOCK_M x BLOCK_N tile, tl.dot on the fp8 operands; K split over SPLIT_K programs where
                the tiles alone leave SMs idle (a narrow layer at few tokens), their partials summed in
                split order by the last to finish (common.store_output: one launch, deterministic).
  scaled_mm     torch._scaled_mm: cuBLASLt's fp8 GEMM with row-wise scales, into the output dtype.
  scaled_mm_f32 the same into fp32, then cast (for a torch whose row-wise scaling refuses the output dtype).
reference.fp8_reference is the function in fp32 from the exact e4m3 values (products exact; only the order in which the sums
are rounded differs from the tensor cores').
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import row_segments, split_buffers, store_output
from .layout import FP8_MAX, FP8_MIN_SCALE
from .spec import KernelSpec, Problem, TileConfig, split_k_for


@triton.jit(do_not_specialize=["M", "SPLIT_K"])  # one compile serves every M and split
def _fp8_gemm_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K,
                     SPLIT_K, HAS_BIAS: tl.constexpr, IS_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    # GROUP_M row tiles side by side in launch order share their weight tiles in L2
    width = GROUP_M * grid_n
    first_m = pid // width * GROUP_M
    rows = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows
    pid_n = (pid % width) // rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]  # [BLOCK_K, BLOCK_N], K contiguous
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(pid_k, K // BLOCK_K, SPLIT_K):
        a = tl.load(a_ptrs + t * BLOCK_K, mask=m_mask[:, None], other=0.0)
        w = tl.load(w_ptrs + t * BLOCK_K, mask=n_mask[None, :], other=0.0)
        acc = tl.dot(a, w, acc)
    acc *= tl.load(a_scale_ptr + offs_m, mask=m_mask, other=0.0)[:, None]
    acc *= tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    store_output(acc, out_ptr, part_ptr, count_ptr, bias_ptr, offs_m, offs_n, M, N, pid_k, pid, SPLIT_K, IS_SPLIT,
                 HAS_BIAS)


def fp8_gemm(x8: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor,
             bias: torch.Tensor | None, out_dtype: torch.dtype, config: TileConfig) -> torch.Tensor:
    m, k = x8.shape
    n = weight.shape[0]
    split = config.split_k or 1
    out = torch.empty(m, n, dtype=out_dtype, device=x8.device)
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    part, counters = split_buffers(split, m, n, tiles, x8.device) if split > 1 else (out, out)
    _fp8_gemm_kernel[(tiles, split)](x8, x_scales, weight, weight_scales, bias if bias is not None else weight_scales,
                                     out, part, counters, m, n, k, split, HAS_BIAS=bias is not None,
                                     IS_SPLIT=split > 1, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                                     BLOCK_K=config.block_k, GROUP_M=8, num_warps=config.num_warps,
                                     num_stages=config.num_stages)
    return out


@triton.jit
def _e4m3_grid(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, still fp32: the conversion after it is then
    exact, whatever rounding a backend's cast does (Triton's CPU interpreter truncates a mantissa that rounds up into
    the next binade). Adding c = 1.5 * 2**(e + 20) rounds v at e4m3's spacing 2**(e - 3) in v's binade 2**e (at least
    2**-6: below it the subnormals' fixed 2**-9)."""
    e = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    c = (((e + 147) << 23) | 0x400000).to(tl.float32, bitcast=True)
    return tl.where(v == 0.0, v, (v + c) - c)  # -0 stays -0


@triton.jit
def _fp8_rows_kernel(x_ptr, x8_ptr, scale_ptr, K, SEGMENT, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr,
                     MIN_SCALE: tl.constexpr):
    """Program (row, segment): the row's max |x| (the whole row read), then its segment rounded to e4m3."""
    row, seg = tl.program_id(0), tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    row_ptr = x_ptr + row.to(tl.int64) * K
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        amax = tl.maximum(amax, tl.abs(tl.load(row_ptr + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX), MIN_SCALE)  # IEEE division: torch's
    for k0 in range(seg * SEGMENT, tl.minimum(seg * SEGMENT + SEGMENT, K), BLOCK):
        mask = k0 + offs < K
        x = tl.load(row_ptr + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = _e4m3_grid(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX))
        tl.store(x8_ptr + row.to(tl.int64) * K + k0 + offs, q.to(tl.float8e4nv), mask=mask)
    if seg == 0:
        tl.store(scale_ptr + row, scale)


ROWS_BLOCK = 1024


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, 1]): layout.fp8_tokens in one launch, a few tokens' rows cut into
    segments (common.row_segments) so that more SMs share them."""
    m, k = x.shape
    x8 = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    segment = -(-k // row_segments(m, k) // ROWS_BLOCK) * ROWS_BLOCK
    _fp8_rows_kernel[(m, -(-k // segment))](x, x8, scales, k, segment, BLOCK=ROWS_BLOCK, FP8_MAX=FP8_MAX,
                                            MIN_SCALE=FP8_MIN_SCALE, num_warps=4)
    return x8, scales


def scaled_mm(x8: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor,
              bias: torch.Tensor | None, out_dtype: torch.dtype, config: TileConfig) -> torch.Tensor:
    into = torch.float32 if config.kernel == "scaled_mm_f32" else out_dtype
    out = torch._scaled_mm(x8, weight.t(), scale_a=x_scales, scale_b=weight_scales.view(1, -1), out_dtype=into)
    if bias is not None:
        out = out + bias.to(into)
    return out.to(out_dtype)


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) from the smallest M bucket each row serves
# (the last of each row: a K tile of 64, for widths no 128 divides)
_GEMM_TILES = ((1, ((16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (32, 64, 256, 4, 3), (16, 64, 64, 4, 4))),
               (32, ((32, 128, 128, 4, 4), (64, 64, 128, 4, 4), (64, 128, 128, 4, 3), (64, 64, 64, 4, 4))),
               (128, ((64, 128, 128, 4, 4), (128, 128, 128, 8, 3), (128, 256, 128, 8, 3), (64, 256, 128, 8, 3),
                      (128, 128, 64, 8, 4))))


def _gemm_candidates(p: Problem) -> list[TileConfig]:
    """Each tile of the bucket's row unsplit, and at the K split that fills the SMs where that differs."""
    tiles = next(rows for start, rows in reversed(_GEMM_TILES) if p.bucket >= start)
    configs = []
    for bm, bn, bk, warps, stages in [t for t in tiles if p.k % t[2] == 0]:
        split = split_k_for(-(-p.bucket // bm) * -(-p.n // bn), p.k // bk)
        configs += [TileConfig("gemm", bm, bn, bk, s, warps, stages) for s in dict.fromkeys((1, split))]
    return configs


# The Triton kernel first: the untuned default (torch's row-wise scaled_mm may refuse an output dtype on a GPU)
SPECS = (
    KernelSpec("gemm", "fp8", "plain", _gemm_candidates, fp8_gemm),
    KernelSpec("scaled_mm", "fp8", "plain", lambda p: [TileConfig("scaled_mm")], scaled_mm, tiled=False),
    KernelSpec("scaled_mm_f32", "fp8", "plain", lambda p: [TileConfig("scaled_mm_f32")], scaled_mm, tiled=False),
)
