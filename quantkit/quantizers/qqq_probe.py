"""The smoothing probe of QQQ (quantkit.quantizers.qqq's docstring, step 1): one scaling group on the calibration
batches, its channel ranges and the loss of a scale vector, measured at the group's block output."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from functools import partial

import torch
from torch import nn

from quantkit.config import QuantConfig
from quantkit.models.adapters import ArchAdapter, ScalingGroup
from quantkit.qtensor import QuantizationError
from quantkit.quantizers.context import LayerContext, StopForward, first_output
from quantkit.quantizers.gptq import gptq_quantize
from quantkit.quantizers.int8_matmul import Int8Linears
from quantkit.quantizers.qqq_grids import Int8Weight, make_grid


def _squared_error(out: torch.Tensor, target: torch.Tensor, rows: int = 128) -> torch.Tensor:
    """sum((out - target)^2) in float64 (exact differences and squares of fp32 values), over slices of rows: a
    float64 copy of a whole [tokens, features] output, made and reduced in one piece, ran ~3x slower (memory
    traffic) than slices that stay in cache."""
    total = torch.zeros((), dtype=torch.float64, device=out.device)
    for start in range(0, out.shape[0], rows):
        total += out[start:start + rows].double().sub_(target[start:start + rows]).square_().sum()
    return total


# (batch index, the linears' input, the quantized linears or None for the unquantized ones) -> block output on
# that batch's real tokens
BlockFn = Callable[[int, torch.Tensor, Int8Linears | None], torch.Tensor]


def _real_rows(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if mask is None else rows[mask.reshape(-1)]


class MatmulBlock:
    """The block output of groups that feed linears straight (v -> o, up -> down): x W^T."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        self.weights = weights

    def __call__(self, _batch: int, x: torch.Tensor, linears: Int8Linears | None) -> torch.Tensor:
        if linears is None:
            return torch.cat([x @ w.t() for w in self.weights], dim=-1)
        return torch.cat([linears(i, x) for i in range(len(linears))], dim=-1)


class SmoothingProbe:
    """One scaling group on the calibration batches: its channel ranges, and the loss of a scale vector."""

    def __init__(self, inputs: list[torch.Tensor], masks: list[torch.Tensor | None],
                 weights: list[torch.Tensor], block: BlockFn, group_size: int,
                 loss_batches: int | None = None, scale_dtype: torch.dtype = torch.float16) -> None:
        """Channel ranges come from every batch; the loss from the first `loss_batches` (None: all); weights are
        scored on QQQ's grid with scales in the served `scale_dtype`."""
        self.masks, self.weights = masks, weights
        self.block, self.group_size, self.scale_dtype = block, group_size, scale_dtype
        real = [_real_rows(x, m) for x, m in zip(inputs, masks, strict=True)]
        self.tokens = sum(r.shape[0] for r in real[:loss_batches])
        seen = [r for r in real if r.shape[0]] or [weights[0].new_zeros(1, weights[0].shape[1])]  # MoE experts
        self.channel_max = torch.stack([r.amax(dim=0) for r in seen]).amax(dim=0).float()
        self.channel_min = torch.stack([r.amin(dim=0) for r in seen]).amin(dim=0).float()
        self.inputs = inputs[:loss_batches]
        self.targets = [block(i, x, None) for i, x in enumerate(self.inputs)]

    @classmethod
    def for_matmul(cls, inputs: list[torch.Tensor], weights: list[torch.Tensor], group_size: int,
                   loss_batches: int | None = None, scale_dtype: torch.dtype = torch.float16) -> SmoothingProbe:
        """Inputs are real-token rows [tokens, in_features]."""
        return cls(inputs, [None] * len(inputs), weights, MatmulBlock(weights), group_size, loss_batches,
                   scale_dtype)

    def bound(self) -> float:
        """The largest |activation|: the first threshold, at which no channel is scaled."""
        return max(self.channel_max.max().item(), -self.channel_min.min().item(), 0.0)

    def loss(self, scales: torch.Tensor) -> float:
        """The loss with the smoothed weights rounded to nearest (the search's loss)."""
        return self.loss_with(scales, [Int8Weight.round_to_nearest(w * scales.to(w), self.group_size, self.scale_dtype)
                                       for w in self.weights])

    def loss_with(self, scales: torch.Tensor, weights: list[Int8Weight]) -> float:
        """The loss of int8 per-token activations x / scales through the given (smoothed, quantized) weights."""
        linears = Int8Linears(weights)
        total = torch.zeros((), dtype=torch.float64, device=scales.device)
        for i, (x, target) in enumerate(zip(self.inputs, self.targets, strict=True)):
            total += _squared_error(self.block(i, x / scales.to(x), linears), target)
        return total.item() / self.tokens

    def gptq_loss(self, scales: torch.Tensor, config: QuantConfig) -> float:
        """The loss after QQQ's GPTQ of the smoothed weights, its Hessian from the loss tokens' x / scales."""
        rows = [_real_rows(x, m).float() / scales.float() for x, m in
                zip(self.inputs, self.masks[:len(self.inputs)], strict=True)]
        x = torch.cat(rows)
        hessian = 2 * x.t() @ x / max(x.shape[0], 1)
        weights = []
        for w in self.weights:
            grid = make_grid(config.group_size, config.scale_torch_dtype)
            weights.append(Int8Weight.from_quantized(gptq_quantize(w * scales.to(w), hessian, config, grid), grid))
        return self.loss_with(scales, weights)


def _int8_forward(int8: Int8Linears, index: int, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    out = int8(index, x)
    return out if bias is None else out + bias.to(out)


@contextmanager
def _computed_by(linears: list[nn.Linear], int8: Int8Linears) -> Iterator[None]:
    """While active, the linears compute as `int8` does (plus their bias) instead of with their weights."""
    for index, linear in enumerate(linears):
        linear.forward = partial(_int8_forward, int8, index, linear.bias)  # an instance attribute, deleted below
    try:
        yield
    finally:
        for linear in linears:
            del linear.forward


class ModuleBlock:
    """Runs `module` (attention, MLP) on its recorded calls with the group's linears quantized (or not) and
    other inputs; the block output is the input of `measured` (o_proj, down_proj) on real tokens."""

    def __init__(self, module: nn.Module, measured: nn.Module | None, linears: list[nn.Linear],
                 calls: list[tuple[tuple, dict]], masks: list[torch.Tensor | None]) -> None:
        self.module, self.measured, self.linears = module, measured, linears
        self.calls, self.masks = calls, masks

    def input_of(self, batch: int) -> torch.Tensor:
        args, kwargs = self.calls[batch]
        return args[0] if args else kwargs["hidden_states"]

    def __call__(self, batch: int, x: torch.Tensor, linears: Int8Linears | None) -> torch.Tensor:
        args, kwargs = self.calls[batch]
        args, kwargs = ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})
        measured: list[torch.Tensor] = []

        def grab(_module: nn.Module, inputs: tuple) -> None:
            measured.append(inputs[0])
            raise StopForward

        handle = None if self.measured is None else self.measured.register_forward_pre_hook(grab)
        try:
            with nullcontext() if linears is None else _computed_by(self.linears, linears):
                out = self.module(*args, **kwargs)
            measured.append(first_output(out))
        except StopForward:
            pass
        finally:
            if handle is not None:
                handle.remove()
        return _real_rows(measured[0], self.masks[batch])


def measured_linear(adapter: ArchAdapter, group: ScalingGroup) -> str | None:
    """The linear whose input is the block output of an inspected group: the next sequential step's (None: the
    module's own output, for an MoE block, whose experts' down_proj each see only their routed tokens)."""
    if group.passengers:
        return None
    steps = adapter.sequential
    index = next(i for i, step in enumerate(steps) if group.linears[0] in step)
    name = steps[index + 1][0] if index + 1 < len(steps) else ""
    if not name.startswith(f"{group.inspect}."):
        raise QuantizationError(f"{adapter.name}: no linear inside {group.inspect!r} follows "
                                f"{group.linears}; QQQ measures the smoothing loss at its input")
    return name


def module_probe(ctx: LayerContext, group: ScalingGroup, group_size: int, loss_batches: int | None,
                 scale_dtype: torch.dtype = torch.float16) -> SmoothingProbe:
    """Records the inspected module's calls (inputs, rotary embeddings, masks) up to its first linear."""
    calls: list[tuple[tuple, dict]] = []
    masks: list[torch.Tensor | None] = []

    def record(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        calls.append((args, kwargs))
        masks.append(ctx.current_mask)

    handle = ctx.module(group.inspect).register_forward_pre_hook(record, with_kwargs=True)
    try:
        ctx.run_until([group.linears[0]])
    finally:
        handle.remove()
    linears = [ctx.module(name) for name in group.linears]
    measured = measured_linear(ctx.adapter, group)
    block = ModuleBlock(ctx.module(group.inspect), None if measured is None else ctx.module(measured), linears,
                        calls, masks)
    inputs = [block.input_of(i) for i in range(len(calls))]
    return SmoothingProbe(inputs, masks, [lin.weight.data for lin in linears], block, group_size, loss_batches,
                          scale_dtype)


def matmul_probe(ctx: LayerContext, group: ScalingGroup, group_size: int, loss_batches: int | None,
                 scale_dtype: torch.dtype = torch.float16) -> SmoothingProbe:
    first = group.linears[0]
    with ctx.capture_inputs([first]) as captured:
        ctx.run_until([first])
    return SmoothingProbe.for_matmul(captured[first], [ctx.module(n).weight.data for n in group.linears],
                                     group_size, loss_batches, scale_dtype)
