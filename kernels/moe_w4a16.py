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

Numerics: w = (q - z) * s rounded once to the activation dtype, fp32 accumulation (as QuantLinear.reference_forward).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .common import group_rows, interpreting
from .layout import unpack_along_rows
from .spec import TileConfig

MOE_KERNEL = "moe_gemm"
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) by the largest average rows per expert they serve: decode-sized runs
# want short M tiles (a padded row costs as much as a real one), prefill-sized ones the tensor cores' wide tiles.
MOE_TILES = {
    # BLOCK_N 32: decode on a long-K projection (Mixtral's down: K 14336, 2 experts) has few N tiles to spread
    16: ((16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (16, 64, 64, 4, 4), (16, 32, 128, 4, 4)),
    64: ((32, 64, 128, 4, 4), (32, 128, 64, 4, 4), (64, 64, 64, 4, 4), (16, 128, 128, 4, 3)),
    1 << 30: ((64, 128, 64, 4, 4), (64, 64, 128, 4, 3), (128, 128, 64, 8, 3), (32, 128, 64, 4, 4)),
}


@dataclass(frozen=True)
class StackedExperts:
    """One projection of every expert, stacked: qweight int32 [E, K/8, N], scales [E, K/group, N], zeros uint8
    [E, K/group, N] or None (symmetric)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int

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


LEAST_BLOCK_K = 32  # the fallback tile's K: the kernel has no K mask, so K and the group must be multiples of it


def supports(k: int, group: int) -> bool:
    """Whether a projection of K inputs quantized in groups of `group` (K when per channel) has a tile here."""
    return k % LEAST_BLOCK_K == 0 and group % LEAST_BLOCK_K == 0


def moe_candidates(rows_per_expert: float, k: int, n: int, group: int) -> list[TileConfig]:
    """The launch configs worth timing at this many routed rows per expert: BLOCK_K dividing K, and a K tile within
    one group or a whole number of groups (group_rows' two cases); BLOCK_N <= N."""
    tiles = MOE_TILES[next(bound for bound in MOE_TILES if rows_per_expert <= bound)]
    return [TileConfig(MOE_KERNEL, bm, min(bn, triton.next_power_of_2(n)), bk, 1, warps, stages)
            for bm, bn, bk, warps, stages in tiles if k % bk == 0 and (group % bk == 0 or bk % group == 0)]


def default_config(rows_per_expert: float, k: int, n: int, group: int) -> TileConfig:
    """The first candidate (the fallback tile where none fits): the config used when nothing was tuned."""
    configs = moe_candidates(rows_per_expert, k, n, group) or [TileConfig(MOE_KERNEL, 16, 64, LEAST_BLOCK_K, 1, 4, 2)]
    return configs[0]


def align_tokens(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedTokens:
    """Sort the (token, slot) rows of topk_ids [tokens, top_k] by expert, each expert's run padded to block_m.
    All on the device, shapes known in advance (capacity: rows + min(rows, E) * (block_m - 1), rounded up)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    rows = flat.numel()
    # At most min(rows, E) experts have rows, each padding fewer than block_m: a decode step's grid stays small.
    capacity = triton.cdiv(rows + min(rows, num_experts) * (block_m - 1), block_m) * block_m
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
def _dequant_codes(words, s, z, DTYPE: tl.constexpr):
    """Packed words [R, BN] with the scale / zero point of each word row ([R or 1, BN], fp32) -> weights [8R, BN]
    in DTYPE: (q - z) * s exact in fp32, rounded once."""
    codes = (words[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF
    w = ((codes.to(tl.float32) - z[:, None, :]) * s[:, None, :]).to(DTYPE)
    return tl.reshape(w, (words.shape[0] * 8, words.shape[1]))


@triton.jit
def _moe_w4a16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, route_w_ptr, out_ptr, sorted_rows_ptr, block_expert_ptr,
                      N, K, rows, X_ROW_DIV: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                      MUL_ROUTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    grid_n = tl.cdiv(N, BLOCK_N)
    # The N slices of one M block are neighbours in launch order: the block's x rows stay in L2.
    pid_m, pid_n = pid // grid_n, pid % grid_n
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_row = tl.load(sorted_rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = offs_row < rows
    x_rows = (offs_row // X_ROW_DIV).to(tl.int64)  # a prefill's rows * N passes 2**31 on Mixtral's gate/up
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    ROWS: tl.constexpr = BLOCK_K // 8
    expert = expert.to(tl.int64)  # E * K/8 * N words overflow int32 on the largest MoE layers
    qw_ptr += expert * (K // 8) * N
    s_ptr += expert * (K // GROUP) * N
    z_ptr += expert * (K // GROUP) * N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
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
    tl.store(out_ptr + offs_row.to(tl.int64)[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & n_mask[None, :])


def moe_w4a16_matmul(x: torch.Tensor, experts: StackedExperts, aligned: AlignedTokens, config: TileConfig,
                     routing_weights: torch.Tensor | None = None) -> torch.Tensor:
    """x [tokens, K] (gate/up: each row feeds its top_k slots) or [tokens * top_k, K] (down: one row per slot) ->
    [tokens * top_k, N], row t * top_k + s through expert topk_ids[t, s]; times routing_weights [tokens, top_k]
    where given. config.block_m must be the aligned tokens' block_m."""
    if config.block_m != aligned.block_m:
        raise ValueError(f"config BLOCK_M {config.block_m} != the tokens' alignment {aligned.block_m}")
    _, k, n = experts.shape
    out = torch.empty(aligned.rows, n, dtype=x.dtype, device=x.device)
    upcast = x.dtype == torch.bfloat16 and interpreting()  # the interpreter's bf16 tl.dot is wrong: fp32 there
    grid = (aligned.block_expert.numel() * triton.cdiv(n, config.block_n),)
    _moe_w4a16_kernel[grid](
        x, experts.qweight, experts.scales, experts.zeros if experts.zeros is not None else experts.scales,
        routing_weights if routing_weights is not None else experts.scales, out, aligned.sorted_rows,
        aligned.block_expert, n, k, aligned.rows, X_ROW_DIV=aligned.rows // x.shape[0], GROUP=experts.group_size,
        HAS_ZEROS=experts.zeros is not None, MUL_ROUTED=routing_weights is not None, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        UPCAST_DOT=upcast, DOT_PRECISION="ieee" if upcast else "tf32",  # tf32: the default, moot for 16-bit x
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def moe_w4a16_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      gate_up: StackedExperts, down: StackedExperts, act: Callable[[torch.Tensor], torch.Tensor],
                      configs: tuple[TileConfig, TileConfig] | None = None) -> torch.Tensor:
    """An MoE block's experts on x [tokens, hidden]: down(act(gate(x)) * up(x)) of each routed expert times its
    routing weight, summed over the top_k slots -> [tokens, hidden]. gate_up stacks each expert's gate and up
    projections along N (gate first); both K and groups must pass `supports`. configs: (gate_up's, down's), the
    same BLOCK_M; default by rows per expert."""
    tokens, top_k = topk_ids.shape
    num_experts, hidden, _ = gate_up.shape
    if tokens == 0:
        return x.new_empty(0, hidden)
    if configs is None:
        per_expert = tokens * top_k / num_experts
        configs = (default_config(per_expert, hidden, gate_up.shape[2], gate_up.group_size),
                   default_config(per_expert, down.shape[1], hidden, down.group_size))
        configs = (configs[0], replace(configs[1], block_m=configs[0].block_m))  # one alignment serves both
    aligned = align_tokens(topk_ids, num_experts, configs[0].block_m)
    h = moe_w4a16_matmul(x.contiguous(), gate_up, aligned, configs[0])
    gate, up = h.chunk(2, dim=1)
    return (moe_w4a16_matmul((act(gate) * up).contiguous(), down, aligned, configs[1], topk_weights)
            .view(tokens, top_k, hidden).sum(dim=1))


def moe_w4a16_reference(x: torch.Tensor, topk_ids: torch.Tensor, experts: StackedExperts,
                        routing_weights: torch.Tensor | None = None) -> torch.Tensor:
    """What moe_w4a16_matmul computes, in float64: each (token, slot) row times its expert's dequantized weight
    (unpacked codes, (q - z) * s), times its routing weight where given -> [tokens * top_k, N]."""
    tokens, top_k = topk_ids.shape
    rows = x.double() if x.shape[0] == tokens * top_k else x.double().repeat_interleave(top_k, dim=0)
    out = torch.zeros(tokens * top_k, experts.shape[2], dtype=torch.float64)
    flat = topk_ids.reshape(-1)
    for e in flat.unique().tolist():
        mask = flat == e
        out[mask] = rows[mask] @ dequantized_expert(experts, e)
    return out if routing_weights is None else out * routing_weights.reshape(-1, 1).double()


def dequantized_expert(experts: StackedExperts, e: int) -> torch.Tensor:
    """Expert e's weight [K, N] in float64 from its unpacked codes."""
    codes = unpack_along_rows(experts.qweight[e].cpu(), 4).double()
    group = torch.arange(codes.shape[0]) // experts.group_size
    zero = 8.0 if experts.zeros is None else experts.zeros[e].cpu().double()[group]
    return (codes - zero) * experts.scales[e].cpu().double()[group]
