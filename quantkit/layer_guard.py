"""The no-harm guard: a decoder layer whose quantized output error on the calibration batches exceeds plain RTN's
falls back to RTN.

A method's searches each minimise a proxy (AWQ a block's output under RTN, GPTQ each linear's output on its own
inputs) and each is only as good as that proxy on the model at hand. What the next layer sees is the whole layer's
output, so that is what the guard measures: the summed squared error of the layer's output against the unquantized
layer's, on the same inputs (the calibration batches as the quantized layers before it left them, real tokens
only), for the method's weights and for RTN's weights of the unsmoothed layer on the same grid. Both errors go to
the report; where RTN's is lower the layer is put back as it was before the method touched it and RTN-quantized,
and the log says so.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn
from torch.func import functional_call

from quantkit.config import QuantConfig
from quantkit.qtensor import QuantizedWeight
from quantkit.quantizers.context import LayerContext, first_output
from quantkit.quantizers.rtn import rtn_quantize

log = logging.getLogger("quantkit")


def snapshot(layer: nn.Module) -> dict[str, torch.Tensor]:
    """The layer's parameters and buffers as they are now (before smoothing moves scales between them)."""
    return {name: t.detach().clone() for name, t in layer.state_dict().items()}


def rtn_weights(original: dict[str, torch.Tensor], names: Iterable[str], config: QuantConfig) -> dict[str, QuantizedWeight]:
    """RTN of each named linear's original weight on the method's grid (bits, group size, symmetry, scale dtype)."""
    return {name: rtn_quantize(original[f"{name}.weight"], config.bits, config.group_size, config.sym, False,
                               config.scale_torch_dtype) for name in names}


@torch.no_grad()
def output_errors(ctx: LayerContext, quantized: Iterable[torch.Tensor], original: dict[str, torch.Tensor],
                  rtn: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Summed squared output error over real tokens of the quantized outputs and of RTN's, against the original;
    with split batches, every rank's batches summed in batch order."""
    errors = []
    for batch, (x, kwargs, mask, out) in enumerate(zip(ctx.inputs, ctx.kwargs, ctx.token_masks, quantized,
                                                        strict=True)):
        ctx.current_mask, ctx.current_batch = mask, batch  # MoE blocks route the real tokens only
        reference = first_output(functional_call(ctx.layer, original, (x,), kwargs))
        with_rtn = first_output(functional_call(ctx.layer, {**original, **rtn}, (x,), kwargs))
        reference = ctx.real_tokens(reference).double()
        errors.append((float((ctx.real_tokens(out).double() - reference).pow(2).sum()),
                       float((ctx.real_tokens(with_rtn).double() - reference).pow(2).sum())))
    ctx.current_mask = ctx.current_batch = None
    method_error = rtn_error = 0.0
    for method_batch, rtn_batch in ctx.in_batch_order(errors):  # += in order (not sum(): 3.12 compensates)
        method_error += method_batch
        rtn_error += rtn_batch
    return method_error, rtn_error


@torch.no_grad()
def guard_layer(ctx: LayerContext, original: dict[str, torch.Tensor], results: dict[str, QuantizedWeight],
                outputs: Iterable[torch.Tensor], config: QuantConfig) -> tuple[dict, dict[str, QuantizedWeight] | None]:
    """(report entry, RTN's weights if the layer must fall back to them, else None). On a fallback the layer holds
    its original state with RTN's dequantized weights."""
    rtn = rtn_weights(original, results, config)
    dequantized = {f"{n}.weight": qw.dequantize(original[f"{n}.weight"].dtype) for n, qw in rtn.items()}
    method_error, rtn_error = output_errors(ctx, outputs, original, dequantized)
    entry = {"output_error": method_error, "rtn_output_error": rtn_error}
    if not method_error > rtn_error:
        return entry, None
    log.warning("layer %d: output error %.4g above RTN's %.4g on the calibration batches; the layer falls back to "
                "RTN", ctx.index, method_error, rtn_error)
    ctx.layer.load_state_dict({**original, **dequantized})
    return {**entry, "fallback": "rtn"}, rtn
