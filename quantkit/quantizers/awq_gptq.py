"""AWQ's scales, then GPTQ: per decoder layer, AWQ's scale search (quantkit.quantizers.awq) picks a per-channel
scale for each scaling group and folds it into the layer (the layer's function is unchanged), then every
linear of the smoothed layer is quantized by GPTQ (quantkit.quantizers.gptq, act-order with static groups by
default) from the inputs it receives after the fold.

The two steps are AWQ's and GPTQ's own code, called, with their options side by side (AWQGPTQOptions).
AWQ's scale search scores each candidate by the output error of RTN on the scaled weights, not of GPTQ: the
scales that help rounding the most are taken as a proxy for the ones that help GPTQ (an exact score would run
GPTQ per candidate and per group, 20x its cost).

AWQ's clipping (AWQOptions.clip) clamps each group's weights to the range whose *rounding* error is smallest,
while GPTQ spreads each column's error over the columns still to come: the range RTN prefers is not the one
GPTQ's compensation does, and clamping discards weight mass GPTQ could have compensated for. The measured runs
(benchmarks/accuracy/NEW_METHOD.md) use --no-clip; the default stays AWQ's (on) because `quantkit quantize`
shares one flag, and so one default, between every method that declares the field (cli._declared_options).

W4A16 and W4A8 (per-token int8 activations, symmetric weights): GPTQ's weights do not depend on act_bits.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from quantkit.config import option
from quantkit.quantizers.awq import AWQ, AWQOptions
from quantkit.quantizers.base import LinearQuantizer, Method, register
from quantkit.quantizers.context import LayerContext
from quantkit.quantizers.gptq import GPTQOptions, GPTQQuantizer


@dataclass(frozen=True)
class AWQGPTQOptions(GPTQOptions, AWQOptions):
    """GPTQ's options and AWQ's scale search's; act-order on by default, as the CLI has it for GPTQ."""

    act_order: bool = option(True, "act-order with static groups (no inference cost)",
                             flag="--act-order/--no-act-order")


@register
class AWQGPTQ(Method):
    name = "awq-gptq"
    options_class = AWQGPTQOptions

    def linear_quantizer(self, linear: nn.Linear) -> LinearQuantizer:
        return GPTQQuantizer(linear, self.config)

    def smooth_layer(self, ctx: LayerContext) -> dict:
        return AWQ(self.config).smooth_layer(ctx)
