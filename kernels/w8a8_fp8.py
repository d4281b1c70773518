"""W8A8-FP8 GEMM: float8 e4m3 activations (one scale per token) times float8 e4m3 weights (one scale per output
channel) on the fp8 tensor cores (sm_89 and later: wgmma on Hopper), fp32 accumulation, both scales and the bias in
the epilogue:

    out[m, n] = (sum_k a[m, k] * w[n, k]) * a_scale[m] * w_scale[n] + bias[n]

The weight is the layer's e4m3 bytes as [N, K] (K contiguous: the operand layout the fp8 MMAs read). The activations
arrive quantized (layout.fp8_tokens, plain torch ops: under torch.compile Inductor fuses them into the norm before).

Kernels (scheme "fp8" of the registry; the tuner times them per shape and M bucket):
  gemm          Triton: a BLOCK_M x BLOCK_N tile over all of K, tl.dot on the fp8 operands.
  scaled_mm     torch._scaled_mm: cuBLASLt's fp8 GEMM with row-wise scales, into the output dtype.
  scaled_mm_f32 the same into fp32, then cast (for a torch whose row-wise scaling refuses the output dtype).
reference.fp8_reference is the function in fp32 from the exact e4m3 values (products exact; only the order in which the sums
are rounded differs from the tensor cores').
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .spec import KernelSpec, Problem, TileConfig


@triton.jit
def _fp8_gemm_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, K, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
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
    for _ in range(0, K // BLOCK_K):
        a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
        acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc *= tl.load(a_scale_ptr + offs_m, mask=m_mask, other=0.0)[:, None]
    acc *= tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def fp8_gemm(x8: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor,
             bias: torch.Tensor | None, out_dtype: torch.dtype, config: TileConfig) -> torch.Tensor:
    m, k = x8.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=x8.device)
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    _fp8_gemm_kernel[grid](x8, x_scales, weight, weight_scales, bias if bias is not None else weight_scales, out,
                           m, n, k, HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                           BLOCK_K=config.block_k, GROUP_M=8, num_warps=config.num_warps,
                           num_stages=config.num_stages)
    return out


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
    tiles = next(rows for start, rows in reversed(_GEMM_TILES) if p.bucket >= start)
    return [TileConfig("gemm", bm, bn, bk, 1, warps, stages) for bm, bn, bk, warps, stages in tiles if p.k % bk == 0]


# The Triton kernel first: the untuned default (torch's row-wise scaled_mm may refuse an output dtype on a GPU)
SPECS = (
    KernelSpec("gemm", "fp8", "plain", _gemm_candidates, fp8_gemm),
    KernelSpec("scaled_mm", "fp8", "plain", lambda p: [TileConfig("scaled_mm")], scaled_mm, tiled=False),
    KernelSpec("scaled_mm_f32", "fp8", "plain", lambda p: [TileConfig("scaled_mm_f32")], scaled_mm, tiled=False),
)
