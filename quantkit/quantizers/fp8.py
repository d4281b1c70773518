"""FP8 (W8A8-FP8): float8 e4m3 weights, one scale per output channel, and dynamic per-token float8 activations.

Calibration-free, as llm-compressor's FP8_DYNAMIC scheme: each weight row is scaled to the whole e4m3 range (max |w|
/ 448) and rounded to the nearest e4m3 value; the activations are scaled per token at run time. On Hopper (and Ada)
the matmul runs on the fp8 tensor cores: a large-batch scheme, where 4-bit weight-only kernels spend more time
dequantizing than they save in bytes. Exported as compressed-tensors float-quantized, which vLLM serves natively.
"""

from __future__ import annotations

from torch import nn

from quantkit.qtensor import QuantizedWeight, fp8_quantize
from quantkit.quantizers.base import LinearQuantizer, Method, register
from quantkit.quantizers.rtn import check_finite_weights


class FP8Quantizer(LinearQuantizer):
    def quantize(self) -> QuantizedWeight:
        check_finite_weights(self.linear.weight)
        return fp8_quantize(self.linear.weight)


@register
class FP8(Method):
    name = "fp8"
    needs_activations = False
    rtn_guard = False  # RTN's integer grid is another scheme
    required_scheme = {"fp8": True, "bits": 8, "act_bits": 8, "group_size": -1}

    def linear_quantizer(self, linear: nn.Linear) -> LinearQuantizer:
        return FP8Quantizer(linear, self.config)
