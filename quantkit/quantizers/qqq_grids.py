"""QQQ's weight grids (quantkit.quantizers.qqq's docstring): per channel, signed codes in [-7, 7]; per group, the
two-level scheme whose group scales are integer multiples of a per-channel scale; and a weight on them as the W4A8
kernel holds it (int8 values times a per-output-channel scale)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.qtensor import QuantizedWeight, check_group_size, quantize_codes, round_scale

BITS = 4
ZERO = 8  # symmetric 4-bit: unsigned code 8 is 0
MAX_GROUP_MULTIPLE = 16  # (0 - 8) * 16 = -128 is the lowest int8
CHANNEL_SCALE_BITS = 4  # k (<= 16) * s_ch then has <= 8 significant bits: exact in bf16 and fp16
MIN_CHANNEL_SCALE = 2.0**-21  # 8 * 2**-24: k * s_ch stays a multiple of 2**-24, exact as an fp16 subnormal


class PerChannelGrid:
    """QQQ's per-channel grid: signed codes in [-7, 7] (unsigned 1..15), scale = absmax / 7."""

    lowest, highest = ZERO - 7, ZERO + 7

    def __init__(self, scale_dtype: torch.dtype = torch.float16) -> None:
        self.scale_dtype = scale_dtype  # the served dtype: GPTQ must see the scales the export holds

    def qparams(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        absmax = w.abs().amax(dim=-1)
        scale = round_scale(torch.where(absmax == 0, 1.0, absmax / 7), self.scale_dtype).to(w.dtype)
        return scale, torch.full_like(scale, ZERO)


def _round_up_to_bits(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The smallest value >= x with `bits` significant bits."""
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2**exponent, mantissa in [0.5, 1)
    return torch.ldexp(torch.ceil(mantissa * 2**bits), exponent - bits)


class TwoLevelGrid:
    """QQQ's per-group grid with group scales that are integer multiples of a per-channel scale."""

    lowest, highest = 0, 2**BITS - 1

    def __init__(self) -> None:
        self.channel_scales: torch.Tensor | None = None  # [rows], set by qparams

    def qparams(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ideal = 2 * w.abs().amax(dim=-1) / self.highest  # GPTQ's symmetric min-max group scale
        channel = _round_up_to_bits(ideal.amax(dim=-1) / MAX_GROUP_MULTIPLE, CHANNEL_SCALE_BITS)
        channel = channel.clamp(min=MIN_CHANNEL_SCALE)
        multiple = torch.ceil(ideal / channel[:, None]).clamp(1, MAX_GROUP_MULTIPLE)
        self.channel_scales = channel
        return multiple * channel[:, None], torch.full_like(multiple, ZERO)


def recover_channel_scales(group_scales: torch.Tensor) -> torch.Tensor | None:
    """The per-channel scales of two-level group scales [rows, groups] as TwoLevelGrid makes them (s_g = k * s_ch,
    k an integer in [1, 16], s_ch with CHANNEL_SCALE_BITS significant bits, the row's largest k 15 or 16), read back
    from the s_g an export stores; None if some row has no such s_ch (the scales were not made that way).

    Per row the largest k first: s_ch = max s_g / k, kept when every s_g is exactly an integer multiple of it."""
    scales = group_scales.float()
    top = scales.amax(dim=1)
    found = torch.zeros_like(top)
    for k in range(MAX_GROUP_MULTIPLE, 0, -1):
        channel = top / k
        multiple = (scales / channel[:, None]).round()
        exact = (multiple * channel[:, None] == scales) & (multiple >= 1) & (multiple <= MAX_GROUP_MULTIPLE)
        valid = exact.all(dim=1) & (_round_up_to_bits(channel, CHANNEL_SCALE_BITS) == channel) & (found == 0)
        found = torch.where(valid, channel, found)
    return found if bool((found > 0).all()) else None


def make_grid(group_size: int, scale_dtype: torch.dtype = torch.float16) -> PerChannelGrid | TwoLevelGrid:
    """Two-level scales are exact in fp16 and bf16 alike; per-channel ones are rounded to scale_dtype."""
    return PerChannelGrid(scale_dtype) if group_size == -1 else TwoLevelGrid()


@dataclass
class Int8Weight:
    """A weight on QQQ's grid as the W4A8 kernel holds it: int8 values times a per-output-channel scale
    (per channel: codes - 8 in [-7, 7] times absmax / 7; two-level: (codes - 8) * k in [-128, 112] times s_ch)."""

    values: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # [out], fp32 or wider

    @classmethod
    def round_to_nearest(cls, weight: torch.Tensor, group_size: int,
                         scale_dtype: torch.dtype = torch.float16) -> Int8Weight:
        """Round-to-nearest on QQQ's grid (scales in the served dtype): what the smoothing search scores scales with."""
        rows, cols = weight.shape
        group = check_group_size(cols, group_size)
        w = weight.to(torch.promote_types(weight.dtype, torch.float32)).reshape(rows, cols // group, group)
        grid = make_grid(group_size, scale_dtype)
        scale, zero = grid.qparams(w)
        codes = quantize_codes(w, scale.unsqueeze(-1), zero.unsqueeze(-1), BITS).clamp_(grid.lowest, grid.highest)
        return cls._from_codes(codes, scale, zero, grid)

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, grid: PerChannelGrid | TwoLevelGrid) -> Int8Weight:
        """qw as quantized on `grid` (its two-level channel scales are the grid's last qparams)."""
        codes = qw.codes.reshape(qw.shape[0], qw.n_groups, -1).to(qw.scales.dtype)
        return cls._from_codes(codes, qw.scales, qw.zeros.to(qw.scales.dtype), grid)

    @classmethod
    def _from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    grid: PerChannelGrid | TwoLevelGrid) -> Int8Weight:
        """codes [rows, groups, group], scale and zero [rows, groups], all floating point."""
        rows = scale[:, 0] if isinstance(grid, PerChannelGrid) else grid.channel_scales.to(scale)
        multiple = (scale / rows[:, None]).round_()  # the integer k of each group (1 per channel)
        values = (codes - zero.unsqueeze(-1)).mul_(multiple.unsqueeze(-1))
        return cls(values.reshape(codes.shape[0], -1).to(torch.int8), rows)

    def dequantize(self) -> torch.Tensor:
        return self.values * self.scales[:, None]
