"""What the W4A16 / W4A8 custom ops compute, in plain torch (fp32): the tuner checks every candidate config's output
against it before timing it (autotune.pick_config), and it is the ops' last resort when no config gives it.

The weight is dequantized a block of output columns at a time, so a 70B layer never needs its whole fp32 copy."""

from __future__ import annotations

import torch

from .layout import int8_matmul, int8_tokens, int_valued_matmul, unpack_along_rows

COLUMNS = 2048  # output columns dequantized at a time


def fp8_reference(x8: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor,
                  bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The fp8_linear op in fp32 from the e4m3 values (x8 [M, K], x_scales [M, 1], weight [N, K] in e4m3 or their
    fp32 values, weight_scales [N]): the products are exact, only the order the sums round in differs from the fp8
    tensor cores'."""
    out = (x8.float() @ weight.float().t()) * x_scales * weight_scales.float()[None, :]
    return (out if bias is None else out + bias.float()).to(out_dtype)


def _dequantized(qweight: torch.Tensor, zeros: torch.Tensor | None, group_size: int, columns: slice,
                 device: torch.device) -> tuple:
    """(q - zero) [K, C] fp32 on the device for the columns (a weight kept in host memory comes over a block at a
    time), and each input row's group index [K]."""
    codes = unpack_along_rows(qweight[:, columns].to(device), 4).float()
    group = torch.arange(codes.shape[0], device=codes.device) // group_size
    if zeros is None:  # symmetric: the kernels' implicit 8
        z = 8.0
    elif zeros.dim() == 2:  # [G, N]
        z = zeros[:, columns].float()[group]
    else:  # W4A8 per channel: [N]
        z = zeros[columns].float()
    return codes - z, group


def _column_blocks(n: int):
    return (slice(start, min(start + COLUMNS, n)) for start in range(0, n, COLUMNS))


def w4a16_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    bias: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """x [M, K] @ ((q - z) * s) [K, N] (+ bias) in fp32, cast to x's dtype; the w4a16_linear op's arguments."""
    xf, blocks = x.float(), []
    for cols in _column_blocks(qweight.shape[1]):
        w, group = _dequantized(qweight, zeros, group_size, cols, x.device)
        blocks.append(xf @ (w * scales[:, cols].float()[group]))
    out = torch.cat(blocks, dim=1)
    return (out if bias is None else out + bias.float()).to(x.dtype)


def int8_weight_reference(qweight: torch.Tensor, group_scales: torch.Tensor | None, zeros: torch.Tensor | None,
                          group_size: int, columns: slice, device: torch.device) -> torch.Tensor:
    """The W4A8 int8 weight [K, C] of the columns: q - z per channel (zeros [N]); two-level, QuantLinear's and the
    kernels' round((q - z) * k) with integer group multipliers k."""
    w, group = _dequantized(qweight, zeros, group_size, columns, device)
    if group_scales is not None:
        w = torch.round(w * group_scales[:, columns].float()[group]).clamp(-128, 127)
    return w.to(torch.int8)


def int8_products(codes: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """codes [M, K] @ weight [K, C], both int8 values in any dtype, summed exactly and read as fp32 as the kernels'
    epilogue reads its int32 accumulator: exact fp32 matmuls over short K slices on the CPU (int_valued_matmul),
    int8_matmul elsewhere."""
    if codes.device.type == "cpu":  # the weight may be held in fp32 already (a cached one): no int8 round trip
        return int_valued_matmul(codes.float(), weight.float()).float()
    return int8_matmul(codes, weight.to(torch.int8)).float()


def w4a8_epilogue(acc: torch.Tensor, token_scales: torch.Tensor, channel_scales: torch.Tensor,
                  bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """acc * token scale * channel scale (+ bias) in fp32, in the kernels' order, cast to dtype."""
    out = acc * token_scales.reshape(-1, 1) * channel_scales.float()
    return (out if bias is None else out + bias.float()).to(dtype)


def w4a8_reference(x: torch.Tensor, qweight: torch.Tensor, channel_scales: torch.Tensor,
                   group_scales: torch.Tensor | None, zeros: torch.Tensor | None, bias: torch.Tensor | None,
                   group_size: int) -> torch.Tensor:
    """The W4A8 kernels' function: per-token int8 x times the int8 weight (int8_weight_reference) in exact integer
    sums, then the token and channel scales in fp32, cast to x's dtype; the w4a8_linear op's arguments. QuantLinear's
    reference path computes the same (W4A8 layers with integer weights)."""
    codes, token_scales = int8_tokens(x)
    acc = torch.cat([int8_products(codes, int8_weight_reference(qweight, group_scales, zeros, group_size, cols,
                                                                x.device))
                     for cols in _column_blocks(qweight.shape[1])], dim=1)
    return w4a8_epilogue(acc, token_scales, channel_scales, bias, x.dtype)
