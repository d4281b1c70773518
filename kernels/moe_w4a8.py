"""Grouped W4A8 GEMM over routed tokens: every expert of an MoE layer in one launch, on int8 tensor cores.

The grouped layout of moe_w4a16.py (common.align_tokens: (token, slot) rows sorted by expert, each expert's run
padded to BLOCK_M; a program takes one BLOCK_M tile of one expert's rows and a BLOCK_N slice of its outputs; split
K by common.with_moe_split) with the math of the dense W4A8 GEMM (w4a8.py), expert by expert:

- the input rows are quantized per row to int8 first (common.quantize_rows: s = max|x| / 127, round half even,
  the kernel form of layout.int8_tokens), each row once: the gate/up input per token, the down input per slot;
- the experts' int4 weights in QuantLinear's K-packed layout, stacked (common.StackedExperts), widened to int8 in
  registers (common.int8_tile): per channel, the raw codes q with the zero point taken out in the epilogue as
  z * sum(x_int8); QQQ's two-level scheme, rne((q - z) * group_scale) (its int8 range checked when the layer is
  wired, as for the dense kernel);
- int8 x int8 dots accumulated in int32 over K (the split partials in fp32), then out = acc * token_scale *
  channel_scale[n] (times the routing weight for the down projection), cast to x's dtype.

Per-channel experts have group = K and scales None; zeros, where not symmetric, [E, 1, N].
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
    int8_tile,
    moe_block_forward,
    moe_launch,
    moe_program,
    quantize_rows,
    routed_reference,
    store_output,
    without_zero_points,
)
from .layout import int8_tokens, unpack_along_rows
from .spec import TileConfig


# rows and SPLIT_K unspecialized: one compile serves every token count and split (IS_SPLIT picks the store; unsplit
# loops step by a constant)
@triton.jit(do_not_specialize=["rows", "SPLIT_K"])
def _moe_w4a8_kernel(xq_ptr, ts_ptr, xsum_ptr, qw_ptr, cs_ptr, gs_ptr, z_ptr, route_w_ptr, out_ptr, part_ptr,
                     count_ptr, sorted_rows_ptr, block_expert_ptr, N, K, rows, X_ROW_DIV: tl.constexpr,
                     GROUP: tl.constexpr, TWO_LEVEL: tl.constexpr, HAS_ZEROS: tl.constexpr,
                     MUL_ROUTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, SPLIT_K, IS_SPLIT: tl.constexpr):
    expert, tile, offs_row, row_mask, x_rows, offs_n, n_mask = moe_program(
        block_expert_ptr, sorted_rows_ptr, N, rows, X_ROW_DIV, BLOCK_M, BLOCK_N)
    if expert < 0:
        return
    ROWS: tl.constexpr = BLOCK_K // 8
    pid_k = tl.program_id(1)
    qw_ptr, gs_ptr, z_ptr = expert_weights(expert, qw_ptr, gs_ptr, z_ptr, N, K, GROUP)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for t in range(pid_k, K // BLOCK_K, SPLIT_K if IS_SPLIT else 1):
        k0 = t * BLOCK_K
        x = tl.load(xq_ptr + x_rows[:, None] * K + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=row_mask[:, None],
                    other=0)
        words = tl.load(qw_ptr + (k0 // 8 + tl.arange(0, ROWS))[:, None] * N + offs_n[None, :],
                        mask=n_mask[None, :], other=0)
        if TWO_LEVEL:
            s, z = group_rows(gs_ptr, z_ptr, k0, N, offs_n, n_mask, ROWS, GROUP, BLOCK_K, HAS_ZEROS)
        else:
            s, z = 1.0, 0.0
        acc = tl.dot(x, int8_tile(words, s, z, TWO_LEVEL), acc, out_dtype=tl.int32)
    if not TWO_LEVEL:
        acc = without_zero_points(acc, z_ptr, xsum_ptr, x_rows, row_mask, offs_n, n_mask, pid_k == 0, HAS_ZEROS)
    scale = tl.load(ts_ptr + x_rows, mask=row_mask, other=0.0)
    if MUL_ROUTED:
        scale *= tl.load(route_w_ptr + offs_row, mask=row_mask, other=0.0).to(tl.float32)
    cs = tl.load(cs_ptr + expert * N + offs_n, mask=n_mask, other=0.0)
    store_output(acc.to(tl.float32) * scale[:, None] * cs[None, :], out_ptr, part_ptr, count_ptr, out_ptr, offs_row,
                 offs_n, rows, N, pid_k, tile, SPLIT_K, IS_SPLIT, False)


def moe_w4a8_matmul(x: torch.Tensor, experts: StackedExperts, aligned: AlignedTokens, config: TileConfig,
                    routing_weights: torch.Tensor | None = None) -> torch.Tensor:
    """x [tokens, K] (gate/up: each row feeds its top_k slots) or [tokens * top_k, K] (down: one row per slot),
    fp16/bf16, quantized per row to int8 here -> [tokens * top_k, N] in x's dtype, row t * top_k + s through expert
    topk_ids[t, s]; times routing_weights [tokens, top_k] where given. config.block_m must be the aligned tokens'."""
    _, k, n = experts.shape
    two_level = experts.scales is not None
    xq, token_scales, sums = quantize_rows(x, sums=not two_level)
    out = torch.empty(aligned.rows, n, dtype=x.dtype, device=x.device)
    grid, part, counters = moe_launch(aligned, n, config, out)
    channel = experts.channel_scales
    _moe_w4a8_kernel[grid](
        xq, token_scales, sums if sums is not None else token_scales, experts.qweight, channel,
        experts.scales if two_level else channel, experts.zeros if experts.zeros is not None else experts.qweight,
        routing_weights if routing_weights is not None else channel, out, part, counters, aligned.sorted_rows,
        aligned.block_expert, n, k, aligned.rows, X_ROW_DIV=aligned.rows // x.shape[0], GROUP=experts.group_size,
        TWO_LEVEL=two_level, HAS_ZEROS=experts.zeros is not None, MUL_ROUTED=routing_weights is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=config.split_k,
        IS_SPLIT=config.split_k > 1, num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def moe_w4a8_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     gate_up: StackedExperts, down: StackedExperts, act: Callable[[torch.Tensor], torch.Tensor],
                     configs: tuple[TileConfig, TileConfig] | None = None) -> torch.Tensor:
    """An MoE block's W4A8 experts on x [tokens, hidden] (common.moe_block_forward); both projections' K and
    groups must pass common.supports, two-level weights must fit int8."""
    return moe_block_forward(moe_w4a8_matmul, x, topk_ids, topk_weights, gate_up, down, act, configs)


def moe_w4a8_reference(x: torch.Tensor, topk_ids: torch.Tensor, experts: StackedExperts,
                       routing_weights: torch.Tensor | None = None) -> torch.Tensor:
    """What moe_w4a8_matmul computes, in float64: each input row's int8 codes times its token scale
    (layout.int8_tokens), times its expert's int8 weight (int8_expert) times the channel scales, times its routing
    weight where given -> [tokens * top_k, N]."""
    codes, token_scales = int8_tokens(x.cpu())
    rows = codes.double() * token_scales.double()

    def weight(e: int) -> torch.Tensor:
        return int8_expert(experts, e) * experts.channel_scales[e].cpu().double()

    return routed_reference(rows, topk_ids.cpu(), weight, routing_weights)


def int8_expert(experts: StackedExperts, e: int) -> torch.Tensor:
    """Expert e's int8 weight [K, N] in float64 from its unpacked codes: q - z per channel, QQQ's
    round_half_even((q - z) * group_scale) two-level (torch.round rounds half to even)."""
    codes = unpack_along_rows(experts.qweight[e].cpu(), 4).double()
    group = torch.arange(codes.shape[0]) // experts.group_size
    w = codes - (8.0 if experts.zeros is None else experts.zeros[e].cpu().double()[group])
    return w if experts.scales is None else torch.round(w * experts.scales[e].cpu().double()[group])

