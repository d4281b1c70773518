"""Exact int8 matmuls, and linears computed as the W4A8 kernel computes them (per-token int8 activations times
int8 weights, accumulated exactly, then both scales)."""

from __future__ import annotations

import torch

from quantkit.kernels.layout import int8_tokens
from quantkit.quantizers.qqq_grids import Int8Weight

# int8 products are at most 127 * 128 in magnitude: any 1024 of them, summed in any order, stay below 2**24,
# where fp32 holds every integer
EXACT_FP32_PRODUCTS = 1024


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a int8 [M, K] @ b int8 [K, N] -> int32 [M, N], exactly. torch._int_mm on CUDA; elsewhere (and for shapes
    CUDA's _int_mm refuses) fp32 matmuls over K slices short enough to be exact, summed in int32: CPU _int_mm ran
    25-40x slower than an fp32 matmul of the same shape on an AVX2 machine without VNNI (AMD EPYC, torch 2.13)."""
    if a.is_cuda and a.shape[0] > 16 and a.shape[1] % 8 == 0 and b.shape[1] % 8 == 0:  # what CUDA _int_mm takes
        return torch._int_mm(a, b)
    wide = torch.float32 if a.device.type == "cpu" else torch.float64  # CUDA fp32 matmuls may round to TF32
    return _int_valued_matmul(a.to(wide), b.to(wide)).to(torch.int32)


def _int_valued_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int8_matmul's sums for int8 values held in fp32 or float64 (a [M, K], b [K, N]), exactly: one matmul when
    K <= EXACT_FP32_PRODUCTS, else K slices that short summed in float64. On the CPU the smoothing loss keeps its
    int8 values in fp32 and converts the result to a floating dtype (one rounding, as converting int8_matmul's
    would): int8 -> fp32 -> int32 round trips per call cost a third of a loss evaluation's time there."""
    if a.shape[1] <= EXACT_FP32_PRODUCTS:
        return a @ b
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64, device=a.device)
    for start in range(0, a.shape[1], EXACT_FP32_PRODUCTS):
        end = start + EXACT_FP32_PRODUCTS
        out += a[:, start:end] @ b[start:end]
    return out


class Int8Linears:
    """The group's linears as the W4A8 kernel computes them: per-token int8 inputs times int8 weights,
    accumulated exactly (int8_matmul), then both scales. An input the linears share (q/k/v,
    gate/up) is quantized once."""

    def __init__(self, weights: list[Int8Weight]) -> None:
        self.weights = weights
        self._input: torch.Tensor | None = None
        self._codes: tuple[torch.Tensor, torch.Tensor] | None = None
        # on the CPU the int8 values in fp32, converted once per input / weight (not per call and batch)
        self._float_values: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.weights)

    def __call__(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Linear `index` of the group on x [..., in] (no bias)."""
        on_cpu = x.device.type == "cpu"
        if x is not self._input:
            codes, token_scales = int8_tokens(x.reshape(-1, x.shape[-1]))
            self._input, self._codes = x, (codes.float() if on_cpu else codes, token_scales)
        codes, token_scales = self._codes
        weight = self.weights[index]
        if on_cpu:
            if index not in self._float_values:
                self._float_values[index] = weight.values.t().float()
            out = _int_valued_matmul(codes, self._float_values[index]).to(x.dtype)
        else:
            out = int8_matmul(codes, weight.values.t()).to(x.dtype)
        out = out.mul_(token_scales.to(x.dtype)).mul_(weight.scales.to(x.dtype))
        return out.reshape(*x.shape[:-1], out.shape[-1])  # x may hold no token (an MoE expert)
