"""Grouped W4A16 GEMM over routed tokens: every expert of an MoE layer in one launch.

The layout of vLLM's `fused_moe` Triton kernel (and its `moe_wna16` variant for packed int4 weights): the
(token, slot) pairs are sorted by expert and each expert's run is padded to a multiple of BLOCK_M (`align_tokens`,
vLLM's `moe_align_block_size`, here in torch); a program takes one BLOCK_M tile of one expert's rows and a BLOCK_N
slice of its output, loads that expert's packed weight tile, dequantizes it in registers and runs tl.dot. The
experts' weights are QuantLinear's K-packed layout stacked: qweight int32 [E, K/8, N], scales [E, K/group, N],
zero points uint8 [E, K/group, N] (None: symmetric, the implicit 8).

Rows of the output are the (token, slot) pairs, [tokens * top_k, N]; row t * top_k + s reads input row t (the
gate/up projection, input [tokens, K]) or row t * top_k + s itself (the down projection, input [tokens * top_k, K]),
and the down projection multiplies each row by its routing weight in the epilogue (fp32, before the cast).
Padding rows hold the sentinel tokens * top_k and are neither read nor written; blocks past the last expert's
run have expert -1 and exit at once (the grid is sized for the worst case, so nothing needs a host sync and the
launch can be captured in a CUDA graph).

Split K (config.split_k > 1, by common.with_moe_split where few rows per expert leave the GPU idle): program k of a
tile takes K tiles k, k + split, ...; the fp32 partials are summed by the tile's last program to arrive, in split
order (common.store_output, the dense kernels' reduction); the routing weight multiplies each partial (a linear map).

Numerics: w = (q - z) * s rounded once to the activation dtype, fp32 accumulation (as QuantLinear.reference_forward).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from .common import (
    AlignedTokens,
    StackedExperts,
    expert_weights,
    group_rows,
    interpreting,
    moe_block_forward,
    moe_launch,
    moe_program,
    routed_reference,
    store_output,
)
from .layout import unpack_along_rows
from .spec import TileConfig


@triton.jit
def _dequant_codes(words, s, z, DTYPE: tl.constexpr):
    """Packed words [R, BN] with the scale / zero point of each word row ([R or 1, BN], fp32) -> weights [8R, BN]
    in DTYPE: (q - z) * s exact in fp32, rounded once."""
    codes = (words[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF
    w = ((codes.to(tl.float32) - z[:, None, :]) * s[:, None, :]).to(DTYPE)
    return tl.reshape(w, (words.shape[0] * 8, words.shape[1]))


# rows and SPLIT_K unspecialized: one compile serves every token count and split (IS_SPLIT picks the store; unsplit
# loops step by a constant)
@triton.jit(do_not_specialize=["rows", "SPLIT_K"])
def _moe_w4a16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, route_w_ptr, out_ptr, part_ptr, count_ptr, sorted_rows_ptr,
                      block_expert_ptr, N, K, rows, X_ROW_DIV: tl.constexpr, GROUP: tl.constexpr,
                      HAS_ZEROS: tl.constexpr, MUL_ROUTED: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K, IS_SPLIT: tl.constexpr,
                      UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    expert, tile, offs_row, row_mask, x_rows, offs_n, n_mask = moe_program(
        block_expert_ptr, sorted_rows_ptr, N, rows, X_ROW_DIV, BLOCK_M, BLOCK_N)
    if expert < 0:
        return
    ROWS: tl.constexpr = BLOCK_K // 8
    qw_ptr, s_ptr, z_ptr = expert_weights(expert, qw_ptr, s_ptr, z_ptr, N, K, GROUP)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    pid_k = tl.program_id(1)
    for t in range(pid_k, K // BLOCK_K, SPLIT_K if IS_SPLIT else 1):
        k0 = t * BLOCK_K
        x = tl.load(x_ptr + x_rows[:, None] * K + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=row_mask[:, None],
                    other=0.0)
        words = tl.load(qw_ptr + (k0 // 8 + tl.arange(0, ROWS))[:, None] * N + offs_n[None, :],
                        mask=n_mask[None, :], other=0)
        s, z = group_rows(s_ptr, z_ptr, k0, N, offs_n, n_mask, ROWS, GROUP, BLOCK_K, HAS_ZEROS)
        w = _dequant_codes(words, s, z, x_ptr.dtype.element_ty)
        if UPCAST_DOT:  # a static branch: the operands' dtype may change
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if MUL_ROUTED:
        acc *= tl.load(route_w_ptr + offs_row, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    store_output(acc, out_ptr, part_ptr, count_ptr, out_ptr, offs_row, offs_n, rows, N, pid_k, tile, SPLIT_K,
                 IS_SPLIT, False)


def moe_w4a16_matmul(x: torch.Tensor, experts: StackedExperts, aligned: AlignedTokens, config: TileConfig,
                     routing_weights: torch.Tensor | None = None) -> torch.Tensor:
    """x [tokens, K] (gate/up: each row feeds its top_k slots) or [tokens * top_k, K] (down: one row per slot) ->
    [tokens * top_k, N], row t * top_k + s through expert topk_ids[t, s]; times routing_weights [tokens, top_k]
    where given. config.block_m must be the aligned tokens' block_m."""
    _, k, n = experts.shape
    out = torch.empty(aligned.rows, n, dtype=x.dtype, device=x.device)
    grid, part, counters = moe_launch(aligned, n, config, out)
    upcast = x.dtype == torch.bfloat16 and interpreting()  # the interpreter's bf16 tl.dot is wrong: fp32 there
    _moe_w4a16_kernel[grid](
        x, experts.qweight, experts.scales, experts.zeros if experts.zeros is not None else experts.scales,
        routing_weights if routing_weights is not None else experts.scales, out, part, counters,
        aligned.sorted_rows, aligned.block_expert, n, k, aligned.rows, X_ROW_DIV=aligned.rows // x.shape[0],
        GROUP=experts.group_size, HAS_ZEROS=experts.zeros is not None, MUL_ROUTED=routing_weights is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=config.split_k,
        IS_SPLIT=config.split_k > 1, UPCAST_DOT=upcast,
        DOT_PRECISION="ieee" if upcast else "tf32",  # tf32: the default, moot for 16-bit x
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def moe_w4a16_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      gate_up: StackedExperts, down: StackedExperts, act: Callable[[torch.Tensor], torch.Tensor],
                      configs: tuple[TileConfig, TileConfig] | None = None) -> torch.Tensor:
    """An MoE block's W4A16 experts on x [tokens, hidden] (common.moe_block_forward); both projections' K and
    groups must pass common.supports."""
    return moe_block_forward(moe_w4a16_matmul, x, topk_ids, topk_weights, gate_up, down, act, configs)


def moe_w4a16_reference(x: torch.Tensor, topk_ids: torch.Tensor, experts: StackedExperts,
                        routing_weights: torch.Tensor | None = None) -> torch.Tensor:
    """What moe_w4a16_matmul computes, in float64: each (token, slot) row times its expert's dequantized weight
    (unpacked codes, (q - z) * s), times its routing weight where given -> [tokens * top_k, N]."""
    return routed_reference(x.double(), topk_ids, lambda e: dequantized_expert(experts, e), routing_weights)


def dequantized_expert(experts: StackedExperts, e: int) -> torch.Tensor:
    """Expert e's weight [K, N] in float64 from its unpacked codes."""
    codes = unpack_along_rows(experts.qweight[e].cpu(), 4).double()
    group = torch.arange(codes.shape[0]) // experts.group_size
    zero = 8.0 if experts.zeros is None else experts.zeros[e].cpu().double()[group]
    return (codes - zero) * experts.scales[e].cpu().double()[group]
