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
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from quantkit.config import QuantConfig
from quantkit.qtensor import QuantizedWeight
from quantkit.quantizers.context import LayerContext, first_output
from quantkit.quantizers.rtn import rtn_quantize

log = logging.getLogger("quantkit")
NARROWER = (torch.bfloat16, torch.float16, torch.float32)  # tried in this order for a snapshot's float tensors


def _narrowest(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in the narrowest float dtype that holds every value exactly (else its own dtype)."""
    if tensor.is_floating_point():
        for dtype in NARROWER:
            if dtype.itemsize < tensor.element_size():
                narrow = tensor.to(dtype)
                if torch.equal(narrow.to(tensor.dtype), tensor):
                    return narrow
    return tensor.clone()


class Snapshot:
    """The layer's parameters and buffers as they are now (before smoothing moves scales between them), each kept in
    the narrowest float dtype that holds it exactly: a CPU run widens a bf16 checkpoint's layer to fp32, whose copy
    then takes half its bytes. `snapshot[name]` gives a tensor back in the layer's dtype."""

    def __init__(self, layer: nn.Module) -> None:
        state = layer.state_dict()
        self.dtypes = {name: t.dtype for name, t in state.items()}
        self.tensors = {name: _narrowest(t.detach()) for name, t in state.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name].to(self.dtypes[name])

    def state(self, without: Iterable[str] = ()) -> dict[str, torch.Tensor]:
        skip = set(without)
        return {name: self[name] for name in self.tensors if name not in skip}


def rtn_weights(original: Snapshot, names: Iterable[str], config: QuantConfig) -> dict[str, QuantizedWeight]:
    """RTN of each named linear's original weight on the method's grid (bits, group size, symmetry, scale dtype)."""
    return {name: rtn_quantize(original[f"{name}.weight"], config.bits, config.group_size, config.sym, False,
                               config.scale_torch_dtype) for name in names}


def _linear_with(module: nn.Module, weight: Callable[[], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight(), module.bias)


@contextmanager
def _weights_made_per_call(layer: nn.Module, weight: Callable[[str], torch.Tensor], names: Iterable[str]) -> Iterator[None]:
    """Each named linear runs on `weight(name)`, made when it runs and dropped after: the layer's other weights
    (the original, RTN's) never exist whole beside it, one linear's at a time."""
    modules = [layer.get_submodule(name) for name in names]
    before = [module.__dict__.get("forward") for module in modules]  # a forward set on the instance (hooks) returns
    for name, module in zip(names, modules, strict=True):
        module.forward = partial(_linear_with, module, partial(weight, name))
    try:
        yield
    finally:
        for module, forward in zip(modules, before, strict=True):
            if forward is None:
                del module.forward
            else:
                module.forward = forward


@torch.no_grad()
def output_errors(ctx: LayerContext, quantized: Iterable[torch.Tensor], original: Snapshot,
                  rtn: dict[str, QuantizedWeight]) -> tuple[float, float]:
    """Summed squared output error over real tokens of the quantized outputs and of RTN's, against the original;
    with split batches, every rank's batches summed in batch order."""
    names = list(rtn)
    weights = [f"{name}.weight" for name in names]
    rest = original.state(without=weights)  # norms, biases, routers: small
    errors = []
    for batch, (x, kwargs, mask, out) in enumerate(zip(ctx.inputs, ctx.kwargs, ctx.token_masks, quantized,
                                                        strict=True)):
        ctx.current_mask, ctx.current_batch = mask, batch  # MoE blocks route the real tokens only
        with _weights_made_per_call(ctx.layer, lambda name: original[f"{name}.weight"], names):
            reference = first_output(functional_call(ctx.layer, rest, (x,), kwargs))
        with _weights_made_per_call(ctx.layer, lambda name: rtn[name].dequantize(original.dtypes[f"{name}.weight"]),
                                    names):
            with_rtn = first_output(functional_call(ctx.layer, rest, (x,), kwargs))
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
def restore_with_rtn(layer: nn.Module, original: Snapshot, rtn: dict[str, QuantizedWeight]) -> None:
    """The layer back to its original state with RTN's dequantized weights, copied in place one tensor at a time."""
    state = layer.state_dict()
    weights = {f"{name}.weight": qw for name, qw in rtn.items()}
    for name, tensor in state.items():
        tensor.copy_(weights[name].dequantize(tensor.dtype) if name in weights else original.tensors[name])


@torch.no_grad()
def guard_layer(ctx: LayerContext, original: Snapshot, results: dict[str, QuantizedWeight],
                outputs: Iterable[torch.Tensor], config: QuantConfig) -> tuple[dict, dict[str, QuantizedWeight] | None]:
    """(report entry, RTN's weights if the layer must fall back to them, else None). On a fallback the layer holds
    its original state with RTN's dequantized weights."""
    rtn = rtn_weights(original, results, config)
    method_error, rtn_error = output_errors(ctx, outputs, original, rtn)
    entry = {"output_error": method_error, "rtn_output_error": rtn_error}
    if not method_error > rtn_error:
        return entry, None
    log.warning("layer %d: output error %.4g above RTN's %.4g on the calibration batches; the layer falls back to "
                "RTN", ctx.index, method_error, rtn_error)
    restore_with_rtn(ctx.layer, original, rtn)
    return {**entry, "fallback": "rtn"}, rtn
