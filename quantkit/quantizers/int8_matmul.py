"""Linears computed as the W4A8 kernel computes them (per-token int8 activations times int8 weights, accumulated
exactly by quantkit.kernels.layout's int8 matmuls, then both scales)."""

from __future__ import annotations

import torch

from quantkit.kernels.layout import int8_matmul, int8_tokens, int_valued_matmul
from quantkit.quantizers.qqq_grids import Int8Weight


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
            out = int_valued_matmul(codes, self._float_values[index]).to(x.dtype)
        else:
            out = int8_matmul(codes, weight.values.t()).to(x.dtype)
        out = out.mul_(token_scales.to(x.dtype)).mul_(weight.scales.to(x.dtype))
        return out.reshape(*x.shape[:-1], out.shape[-1])  # x may hold no token (an MoE expert)
