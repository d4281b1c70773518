"""The canonical quantized-weight representation and the integer grid math every quantizer shares.

Convention (all quantizers, all formats): unsigned codes q in [0, 2**bits - 1], one scale and one
unsigned zero point per (output channel, input group), and

    W[o, i] ~= (q[o, i] - zero[o, i // group]) * scale[o, i // group]

Symmetric quantization is the special case zero = 2**(bits - 1) (8 for 4-bit), which is what GPTQ's
and compressed-tensors' signed int4 [-8, 7] mean once 8 is added. Groups are contiguous runs of
`group_size` input channels in the original (unpermuted) order, so g_idx is always i // group_size.

FP8 (fp8=True, W8A8-FP8): codes hold the bytes of float8 e4m3 values (torch.float8_e4m3fn), one fp32 scale per
output channel, no zero point (zeros all 0): W[o, i] ~= float(codes[o, i] as e4m3) * scale[o].
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from quantkit.errors import QuantizationError  # also importable from here
from quantkit.kernels.layout import fp8_row_scales, to_fp8


@dataclass
class QuantizedWeight:
    codes: torch.Tensor  # uint8 [out, in], values in [0, 2**bits - 1]
    scales: torch.Tensor  # float32 [out, n_groups]
    zeros: torch.Tensor  # uint8 [out, n_groups], values in [0, 2**bits - 1]
    bits: int
    group_size: int  # -1: one group spanning all inputs (per-channel)
    sym: bool
    # W4A8 two-level scheme (QQQ): scales = group_scales * channel_scales[:, None]; None otherwise.
    channel_scales: torch.Tensor | None = None  # float32 [out]
    fp8: bool = False  # codes are float8 e4m3 bytes (see the module's docstring)
    info: dict = field(default_factory=dict)  # loss, damping used, fallbacks: for reports only

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    @property
    def n_groups(self) -> int:
        return self.scales.shape[1]

    def group_index(self) -> torch.Tensor:
        """g_idx[i]: the group of input channel i."""
        in_features = self.codes.shape[1]
        size = in_features if self.group_size == -1 else self.group_size
        return torch.arange(in_features, device=self.codes.device) // size

    def to(self, device: torch.device | str) -> QuantizedWeight:
        """The same weight with its tensors on `device`."""
        channel = None if self.channel_scales is None else self.channel_scales.to(device)
        return replace(self, codes=self.codes.to(device), scales=self.scales.to(device), zeros=self.zeros.to(device),
                       channel_scales=channel)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.fp8:
            return (fp8_values(self.codes) * self.scales).to(dtype)
        out, k = self.codes.shape  # groups are runs of inputs: a view, not a gather of each column's group
        q = self.codes.reshape(out, self.n_groups, k // self.n_groups).to(torch.float32)
        w = (q - self.zeros.to(torch.float32)[:, :, None]) * self.scales.to(torch.float32)[:, :, None]
        return w.reshape(out, k).to(dtype)


def check_group_size(in_features: int, group_size: int) -> int:
    """Return the effective group size, or raise a clear error when it cannot tile the input."""
    if group_size == -1:
        return in_features
    if group_size <= 0:
        raise QuantizationError(f"group size must be -1 (per-channel) or positive, got {group_size}")
    if in_features % group_size:
        raise QuantizationError(
            f"group size {group_size} does not divide the input size {in_features}; "
            f"choose a divisor of {in_features} (e.g. 32 or 64) or -1 for per-channel"
        )
    return group_size


# The largest scale each scale dtype holds that fp16 holds too (the GPTQ and AWQ formats store fp16 scales).
SCALE_MAX = {torch.float16: 65504.0, torch.bfloat16: 65280.0, torch.float32: 3.0e38}


def round_scale(scale: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """scale in scale_dtype, the dtype the model is served in: tiny groups would round to a zero fp16 scale (NaN
    codes), huge ones overflow it."""
    return scale.clamp(2**-24, SCALE_MAX[scale_dtype]).to(scale_dtype)


def compute_qparams(
    wmin: torch.Tensor, wmax: torch.Tensor, bits: int, sym: bool, scale_dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and unsigned zero point from per-group min/max (any shape), GPTQ's min-max rule.

    Symmetric: scale = 2*absmax / (2**bits - 1), zero = 2**(bits-1). Asymmetric: the range always
    contains 0, scale = (max - min) / (2**bits - 1), zero = round(-min / scale). Scales are rounded to
    `scale_dtype`, the dtype the model is served in: error compensation must see the scales the export holds.
    """
    maxq = 2**bits - 1
    wmin = torch.minimum(wmin, torch.zeros_like(wmin))
    wmax = torch.maximum(wmax, torch.zeros_like(wmax))
    if sym:
        absmax = torch.maximum(wmin.abs(), wmax)
        scale = 2 * absmax / maxq
        zero = torch.full_like(scale, 2 ** (bits - 1))
    else:
        scale = (wmax - wmin) / maxq
        zero = None
    dead = scale == 0
    scale = torch.where(dead, torch.ones_like(scale), scale)
    scale = round_scale(scale, scale_dtype).to(torch.float32)
    if zero is None:
        zero = torch.round(-wmin / scale).clamp(0, maxq)
    return scale, zero


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Round w (broadcastable against scale/zero) to unsigned codes."""
    return torch.clamp(torch.round(w / scale) + zero, 0, 2**bits - 1)


def fake_quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    return (quantize_codes(w, scale, zero, bits) - zero) * scale


def fp8_values(codes: torch.Tensor) -> torch.Tensor:
    """float8 e4m3 bytes (uint8) -> their values in fp32 (exact)."""
    return codes.view(torch.float8_e4m3fn).to(torch.float32)


def fp8_quantize(weight: torch.Tensor) -> QuantizedWeight:
    """weight [out, in] as float8 e4m3 with one fp32 scale per output channel (max |w| / 448): the W8A8-FP8
    weights vLLM serves (compressed-tensors' float-quantized channel strategy)."""
    scales = fp8_row_scales(weight)
    return fp8_weight(to_fp8(weight, scales).view(torch.uint8), scales)


def fp8_weight(codes: torch.Tensor, scales: torch.Tensor) -> QuantizedWeight:
    """The FP8 QuantizedWeight of e4m3 bytes (uint8 [out, in]) and their fp32 scales [out, 1]."""
    return QuantizedWeight(codes=codes, scales=scales, zeros=torch.zeros_like(scales, dtype=torch.uint8), bits=8,
                           group_size=-1, sym=True, fp8=True)
