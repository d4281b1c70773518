"""AWQ's scales, then GPTQ: per decoder layer, AWQ's scale search (quantkit.quantizers.awq) picks a per-channel
scale for each scaling group and folds it into the layer (the layer's function is unchanged), then every
linear of the smoothed layer is quantized by GPTQ (quantkit.quantizers.gptq, act-order with static groups by
default) from the inputs it receives after the fold. On top of the two steps (measured in
benchmarks/accuracy/NEW_METHOD.md):

* scale_score="gptq" (an option; "rtn", AWQ's own score, is the default): each candidate scale is scored by
  the block output error after *GPTQ* quantizes the scaled linears. Folding s divides the group's inputs by s,
  so GPTQ runs on W diag(s) with diag(1/s) H diag(1/s), H captured once per group: one GPTQ per candidate and
  searched linear. Ratio 0 is s = 1, so the chosen scales never score worse than plain GPTQ. Measured, it
  helps SmolLM2 (English most) but costs Gemma-3 Korean; on SmolLM2 either score quantizes in ~2.2x GPTQ's time.
* range_steps: GPTQ's static group grids (act-order fixes them up front) are each shrunk by the factor, of
  1, 0.98, ..., that minimises sum_j H_jj (w_j - q_j)^2 over the group (HessianWeightedGrid): the MSE range
  search of GPTQModel's `mse` option and llm-compressor's MSE observer, weighted by the diagonal of the
  Hessian as the layer's output error weights each input channel. It goes through GPTQ's WeightGrid hook.
* post_norm_loss: with sandwich norms (Gemma 3), a block's output reaches the residual stream through an RMSNorm of
  its own, which divides each token by its RMS and multiplies each channel by a gain (Gemma-3-270M's span ~0 to
  over 1000 within a layer). Scored at the block's raw output, AWQ's loss weights every channel and token alike;
  with this option the candidates are scored after that norm (up -> down through the whole MLP). Measured on
  Gemma-3 it moves the share of GPTQ's gap closed from 0.217 to 0.226 only: an option, not the default.

AWQ's clipping (AWQOptions.clip) clamps each group's weights to the range whose *rounding* error is smallest,
while GPTQ spreads each column's error over the columns still to come: clamping discards weight mass GPTQ could
have compensated for: awq-gptq's defaults are no clipping and 5 ratios (the measured setting), on the command
line too (a flag that methods share takes each method's own default).

W4A16 and W4A8 (per-token int8 activations, symmetric weights): GPTQ's weights do not depend on act_bits.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import nn

from quantkit.config import QuantConfig, option, redefault
from quantkit.models.adapters import ScalingGroup
from quantkit.qtensor import QuantizationError
from quantkit.quantizers.awq import AWQ, AWQOptions, ScaleSearch, TrialWeight
from quantkit.quantizers.base import LinearQuantizer, register
from quantkit.quantizers.context import LayerContext
from quantkit.quantizers.gptq import GPTQOptions, GPTQQuantizer, gptq_quantize
from quantkit.quantizers.rtn import shrink_search

SHRINK_STEP = 0.02  # the group range search: max |w| x 1, 0.98, ..., down to 1 - (steps - 1) * SHRINK_STEP
MAX_RANGE_STEPS = 40  # down to 0.22 of the range
# sandwich norms (DecoderTraits.sandwich_norms): the norm each block's output passes before the residual add
POST_NORMS = {"self_attn": "post_attention_layernorm", "mlp": "post_feedforward_layernorm"}


@dataclass(frozen=True)
class AWQGPTQOptions(GPTQOptions, AWQOptions):
    """GPTQ's options (act-order on, as GPTQ's) and AWQ's scale search's. grid, clip, damp_percent, duo_scaling and
    search_tokens default to the measured setting (5 ratios, AWQ's clipping off, 5% dampening: GPTQModel's default;
    on the searched grids it beat 1% on SmolLM2 and Gemma-3, where GPTQ's own min-max grids do not gain from it;
    activation-only scales: with duo scaling, AWQ's default, awq-gptq's Gemma-3 gain over GPTQ was gone in
    English and halved in Korean)."""

    damp_percent: float = redefault(GPTQOptions, "damp_percent", 0.05)
    duo_scaling: bool = redefault(AWQOptions, "duo_scaling", False)
    grid: int = redefault(AWQOptions, "grid", 5)
    clip: bool = redefault(AWQOptions, "clip", False)
    # every token up to 128 x 512: with 5 ratios the search is a smaller share of the time, and AWQ's 8192 cost
    # SmolLM2 0.022 mean NLL for 14% of the time (32 x 512 tokens; benchmarks/accuracy/VS_LLMCOMPRESSOR.md)
    search_tokens: int = redefault(AWQOptions, "search_tokens", 128 * 512)
    scale_score: str = option("rtn", "score AWQ's candidate scales by the output error after RTN or GPTQ",
                              choices=("rtn", "gptq"))
    range_steps: int = option(16, "group ranges searched by diag(H)-weighted error (1: min-max)",
                              flag="--range-steps", minimum=1)
    post_norm_loss: bool = option(False, "score scales after the block's post-norm (sandwich norms, Gemma 3)",
                                  flag="--post-norm-loss/--no-post-norm-loss")

    def check(self) -> None:
        super().check()
        if self.range_steps > MAX_RANGE_STEPS:
            raise QuantizationError(f"range_steps must be at most {MAX_RANGE_STEPS}, got {self.range_steps}")


class HessianWeightedGrid:
    """GPTQ's static group grids, each group's range shrunk by the factor minimising sum_j H_jj (w_j - q_j)^2:
    the error GPTQ starts from, weighted by how much each input channel's error costs at the layer's output."""

    def __init__(self, hessian_diagonal: torch.Tensor, config: QuantConfig, steps: int) -> None:
        self.importance, self.bits, self.sym, self.steps = hessian_diagonal, config.bits, config.sym, steps
        self.scale_dtype = config.scale_torch_dtype
        self.lowest, self.highest = 0, 2**config.bits - 1

    def qparams(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        importance = self.importance.to(w).view(1, *w.shape[1:])
        shrinks = (1 - step * SHRINK_STEP for step in range(self.steps))  # 1 first: the min-max grid
        return shrink_search(w, self.bits, self.sym, shrinks, lambda delta: (delta.square_() * importance).sum(-1),
                             self.scale_dtype)


def hessian_grid(hessian: torch.Tensor, config: QuantConfig) -> HessianWeightedGrid | None:
    steps = config.options_as(AWQGPTQOptions).range_steps
    return HessianWeightedGrid(hessian.diagonal().clone(), config, steps) if steps > 1 else None


class AWQGPTQQuantizer(GPTQQuantizer):
    """GPTQ whose static group grids come from HessianWeightedGrid (range_steps > 1)."""

    def prepare(self) -> None:
        self.grid = hessian_grid(self.H, self.config)


def input_hessian(ctx: LayerContext, name: str, config: QuantConfig) -> torch.Tensor | None:
    """GPTQ's Hessian of the named linear's inputs in the layer as it stands (None: no token reached it), on every
    rank: each step's inputs go to every rank, in batch order."""
    accumulator = GPTQQuantizer(ctx.module(name), config)
    with ctx.capture_inputs([name]) as captured:
        for position in ctx.stepwise():
            captured[name].clear()
            if position is not None:
                ctx.run_until([name], [position])
            ctx.share.ranks.deliver(captured, {name: None}, ctx.share, ctx.device, lambda _n, x: accumulator.add_batch(x))
    return accumulator.H


def gptq_trial(hessian: torch.Tensor, config: QuantConfig) -> TrialWeight:
    """What a linear with input Hessian H computes once s is folded and GPTQ quantizes it: folding divides the
    inputs by s, so GPTQ sees W diag(s) and diag(1/s) H diag(1/s)."""

    def trial(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        wide = torch.promote_types(weight.dtype, torch.float32)
        scaled = (weight.to(wide) * scales).to(weight.dtype)  # as fold_scales stores it
        inverse = 1 / scales.to(hessian)
        folded = hessian * inverse[:, None] * inverse[None, :]
        result = gptq_quantize(scaled, folded, config, hessian_grid(folded, config))
        return (result.dequantize(wide) / scales).to(weight.dtype)

    return trial


@register
class AWQGPTQ(AWQ):
    name = "awq-gptq"
    needs_activations = True
    options_class = AWQGPTQOptions

    def linear_quantizer(self, linear: nn.Linear) -> LinearQuantizer:
        return AWQGPTQQuantizer(linear, self.config)

    def trial_weight(self, ctx: LayerContext, group: ScalingGroup) -> TrialWeight | None:
        if self.config.options_as(AWQGPTQOptions).scale_score == "rtn":
            return None
        hessian = input_hessian(ctx, group.input_of, self.config)
        return None if hessian is None else gptq_trial(hessian, self.config)

    def search_group(self, ctx: LayerContext, group: ScalingGroup) -> ScaleSearch:
        post_norm = post_norm_scoring(ctx, group) if self.config.options_as(AWQGPTQOptions).post_norm_loss else None
        if post_norm is None:
            return super().search_group(ctx, group)
        scored, norm = post_norm
        with outputs_through(ctx.module(scored.inspect), norm):
            return super().search_group(ctx, scored)


def post_norm_scoring(ctx: LayerContext, group: ScalingGroup) -> tuple[ScalingGroup, nn.Module] | None:
    """The group inspected at its block (attention or MLP) and the block's post-norm; None: no sandwich norms."""
    if ctx.adapter.decoder is None or not ctx.adapter.decoder.sandwich_norms:
        return None
    block = group.inspect or group.linears[0].split(".", 1)[0]  # up -> down: the MLP holding down_proj
    if block not in POST_NORMS:
        return None
    return replace(group, inspect=block), ctx.module(POST_NORMS[block])


@contextmanager
def outputs_through(block: nn.Module, norm: nn.Module) -> Iterator[None]:
    """While open, the block's output (the first element of a tuple) comes out passed through norm."""

    def normed(_module: nn.Module, _args: tuple, out):
        return (norm(out[0]), *out[1:]) if isinstance(out, tuple) else norm(out)

    handle = block.register_forward_hook(normed)
    try:
        yield
    finally:
        handle.remove()
