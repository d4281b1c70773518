"""QQQ (Zhang et al. 2024, "QQQ: Quality Quattuor-Bit Quantization for Large Language Models",
arXiv:2406.09904): 4-bit weights and per-token dynamic int8 activations (W4A8), in two steps per layer.

1. Adaptive smoothing (reference: HandH1998/QQQ, QQQ/smooth/migration/migration_llama.py,
   Migrator1DRangeSearch). On each scaling group of quantkit.smoothing (norm -> q/k/v, v -> o,
   norm -> gate/up, up -> down) take per input channel j the max cmx_j and min cmn_j of the activations
   over real tokens. For thresholds t from max|x| down to 0.1 in max(100, max|x| / 0.5) steps (or exactly
   options.smooth_steps),
   channels reaching past +-t get s_j = max(cmx_j / t, cmn_j / -t), the others 1. The loss is the squared
   error (summed over features, averaged over real tokens) of the group's block output computed from
   per-token int8 x / s and 4-bit W * s, against the unquantized output; the linears compute as the W4A8
   kernel does (int8 x int8 products summed exactly, then both scales: `int8_matmul`), not in fp32 on
   fake-quantized values, which differs only in fp32 rounding.
   Block outputs: for q/k/v the attention output before o_proj (the model's own attention module runs,
   rotary embedding and mask included), for gate/up SiLU(gate) * up (the input of down_proj), for o and
   down the matmul. The best s is folded into the previous op (1/s) and the linears (s). The first
   candidate, t = max|x|, is s = 1: smoothing never raises the loss on the calibration set.
   The reference evaluates every candidate (options.smooth_search = "grid"); by default ("refine", not in
   the reference) a coarse pass over every ~count/24-th threshold and local searches from its 3 best: on
   SmolLM2's first 6 layers its loss was 0.36% (g64) and 0.03% (per channel) above the full grid's minimum on
   average, closer than a grid of half the steps (0.49%, 0.18%), from 34 evaluations per group instead of 107
   (benchmarks/accuracy/RESULTS.md, "QQQ's threshold search"); its count grows with log(max|x|), not max|x| (massive
   activations of 1000 make the reference rule's grid 2001 candidates, the refined search <= 67 evaluations).
   With options.smooth_check (default; not in the reference) the searched s is kept only if it also lowers
   the loss when GPTQ, not rounding, quantizes the group's weights (Hessian of x / s on the loss tokens):
   GPTQ's compensation can undo what smoothing gains under rounding. On Gemma-3-270M g128 this turns QQQ
   from worse than plain GPTQ W4A8 (mean held-out NLL 3.184 vs 3.167) to better (3.152).
2. GPTQ with symmetric weights and act-order with static groups (QQQ/gptq/gptq.py, quant.py) on QQQ's
   grids, through quantkit.quantizers.gptq with a WeightGrid:
     per-channel  signed codes [-7, 7] (unsigned 1..15, zero 8), scale = absmax / 7 (QQQ's maxq = 7);
     per-group    the two-level scheme: unsigned codes 0..15, zero 8, an fp32 per-output-channel scale
                  s_ch and group scales s_g = k * s_ch with integers k in [1, 16]. QuantizedWeight.scales
                  holds s_g, channel_scales s_ch; the int8 weight (q - 8) * k lies in [-128, 112].

Deviations from the reference, on purpose:
  * Two-level scales. QQQ takes GPTQ's group scales s_g = 2 absmax / 15, then after GPTQ
    s_ch = max|W_hat_row| / 127 and fp16 group scales s_g / s_ch; its kernel (csrc/qqq_gemm.cu,
    dequant_per_group) rounds (q - 8) * s_g / s_ch to int8, so the served weights differ from the ones
    GPTQ compensated for by up to s_ch / 2. Here s_ch comes first (the row's largest GPTQ group scale
    / 16, rounded up to 4 significant bits) and each group scale is the smallest integer multiple of it
    covering the group, so the int8 weights are exact: GPTQ sees what the W4A8 kernel computes, and
    s_g = k * s_ch has at most 8 significant bits, exact in the fp16/bf16 scales that exports store.
  * The smoothing search runs on the unquantized layer (QQQ runs it inside a fake-quantized forward, so
    its o_proj inputs went through quantized q/k/v), and on the per-channel / two-level grids GPTQ then
    uses (QQQ's loss quantizes weights on a [-7, 7] grid per channel or group).
  * The grids are min-max: options.mse is not used (QQQ's per-group recipe searches an MSE grid).

The pieces: qqq_grids (the weight grids, Int8Weight), int8_matmul (the W4A8 kernel's linears, on
quantkit.kernels.layout's exact int8 matmuls), qqq_probe (a scaling group and its loss), qqq_search (thresholds,
the search, the GPTQ check); here the options and the method.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from quantkit.config import QuantConfig, option
from quantkit.qtensor import QuantizationError
from quantkit.quantizers.base import LinearQuantizer, Method, register
from quantkit.quantizers.context import LayerContext
from quantkit.quantizers.gptq import GPTQOptions, GPTQQuantizer
from quantkit.quantizers.qqq_grids import make_grid
from quantkit.quantizers.qqq_probe import matmul_probe, module_probe
from quantkit.quantizers.qqq_search import confirm_after_gptq, search_smoothing
from quantkit.smoothing import active_scaling_groups, fold_scales

log = logging.getLogger("quantkit")



@dataclass(frozen=True)
class QQQOptions(GPTQOptions):
    """GPTQ's options (act-order is always on) plus the smoothing search's."""

    smooth_steps: int | None = option(None, "thresholds searched (default max(100, max|x|/0.5))", minimum=1)
    smooth_search: str = option("refine", "refine (coarse-to-fine) or grid (every threshold, the reference)",
                                choices=("refine", "grid"))
    smooth_samples: int | None = option(
        None, "calibration samples of the smoothing loss, rounded up to whole batches (default all)", minimum=1)
    smooth_check: bool = option(True, "keep a group's smoothing only if it also helps after GPTQ",
                                flag="--smooth-check/--no-smooth-check")

    def label(self) -> str:
        return ""  # act-order is part of QQQ

    def check(self) -> None:
        super().check()
        if not self.act_order:
            raise QuantizationError("qqq runs GPTQ with act-order: --no-act-order contradicts it")
        if self.mse:
            raise QuantizationError("qqq's weight grids are min-max: --mse does not apply to it")


class QQQQuantizer(GPTQQuantizer):
    """GPTQ on QQQ's grid; per-group results carry the per-channel scales of the two-level scheme."""

    def __init__(self, linear: nn.Linear, config: QuantConfig) -> None:
        super().__init__(linear, config)
        self.grid = make_grid(config.group_size, config.scale_torch_dtype)


@register
class QQQ(Method):
    name = "qqq"
    options_class = QQQOptions
    rtn_guard = False  # RTN cannot express its two-level grids; its smooth_check holds smoothing against GPTQ
    required_scheme = {"sym": True, "act_bits": 8}  # W4A8, symmetric weights

    def __init__(self, config: QuantConfig) -> None:
        super().__init__(config.validate())

    def linear_quantizer(self, linear: nn.Linear) -> LinearQuantizer:
        return QQQQuantizer(linear, self.config)

    @property
    def options(self) -> QQQOptions:
        return self.config.options_as(QQQOptions)

    def _loss_batches(self, ctx: LayerContext) -> int | None:
        """Batches holding the first options.smooth_samples calibration sequences (None: all)."""
        samples = self.options.smooth_samples
        return None if samples is None else -(-samples // ctx.inputs[0].shape[0])

    @torch.no_grad()
    def smooth_layer(self, ctx: LayerContext) -> dict:
        report = {}
        for group in active_scaling_groups(ctx.layer, ctx.adapter):
            make_probe = module_probe if group.inspect else matmul_probe
            probe = make_probe(ctx, group, self.config.group_size, self._loss_batches(ctx),
                               self.config.scale_torch_dtype)
            if probe.tokens == 0:  # an MoE expert no calibration token was routed to
                log.warning("layer %d %s: QQQ smoothing skipped (no calibration tokens)", ctx.index, group.prev)
                report[group.prev] = {"skipped": "no calibration tokens"}
                continue
            choice = search_smoothing(probe, self.options.smooth_steps, self.options.smooth_search)
            if self.options.smooth_check:
                choice = confirm_after_gptq(probe, choice, self.config)
            fold_scales(ctx.layer, ctx.adapter, group, choice.scales)
            report[group.prev] = choice.summary()
        return report
