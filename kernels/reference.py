"""What the W4A16 / W4A8 custom ops compute, in plain torch (fp32): the tuner checks every candidate config's output
against it before timing it (autotune.pick_config), and it is the ops' last resort when no config gives it.

The weight is dequantized a block of output columns at a time, so a 70B layer never needs its whole fp32 copy."""

from __future__ import annotations

import torch

from .layout import int8_tokens, unpack_along_rows

COLUMNS = 2048  # output columns dequantized at a time


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


def w4a8_reference(x: torch.Tensor, qweight: torch.Tensor, channel_scales: torch.Tensor,
                   group_scales: torch.Tensor | None, zeros: torch.Tensor | None, bias: torch.Tensor | None,
                   group_size: int) -> torch.Tensor:
    """Per-token int8 x times the int8 weight (two-level: round((q - z) * k) with integer group multipliers k, then
    the channel scale; per channel: q - z, zeros [N]) in fp32, cast to x's dtype; the w4a8_linear op's arguments."""
    codes, token_scales = int8_tokens(x)
    xq, blocks = codes.float(), []
    for cols in _column_blocks(qweight.shape[1]):
        w, group = _dequantized(qweight, zeros, group_size, cols, x.device)
        if group_scales is not None:
            w = torch.round(w * group_scales[:, cols].float()[group]).clamp(-128, 127)  # as QuantLinear's
        blocks.append(xq @ (w * channel_scales[cols].float()))
    out = torch.cat(blocks, dim=1) * token_scales.reshape(-1, 1)
    return (out if bias is None else out + bias.float()).to(x.dtype)
