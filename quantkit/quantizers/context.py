"""What a method sees of the decoder layer it works on: LayerContext, handed to Method.smooth_layer by the
engine (quantkit.engine), which owns the layer loop. Methods import this module, never the engine."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from quantkit.models.adapters import ArchAdapter


def first_output(output):
    """A decoder layer's or block's hidden states: transformers modules return them alone or first in a tuple."""
    return output[0] if isinstance(output, tuple) else output


class StopForward(Exception):
    """Raised by a hook once what it waits for has run: the rest of the forward pass need not."""


@dataclass
class LayerContext:
    """One decoder layer and its calibration batches, handed to quantizers' smoothing step."""

    index: int
    layer: nn.Module
    adapter: ArchAdapter
    inputs: list[torch.Tensor]  # hidden states per batch [B, T, H]
    kwargs: list[dict]  # this layer's call kwargs per batch
    token_masks: list[torch.Tensor]  # bool [B, T] per batch, False on padding
    device: torch.device
    current_mask: torch.Tensor | None = None  # the batch being run, for hooks that drop padding
    current_batch: int | None = None  # its index in inputs

    def module(self, name: str) -> nn.Module:
        return self.layer.get_submodule(name)

    @torch.no_grad()
    def forward(self, outputs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The layer's outputs per batch, appended to `outputs` if given (the
        engine passes its hidden-state store: anything with append)."""
        outputs = [] if outputs is None else outputs
        for batch, (x, kwargs, mask) in enumerate(zip(self.inputs, self.kwargs, self.token_masks, strict=True)):
            self.current_mask, self.current_batch = mask, batch
            out = self.layer(x, **kwargs)
            outputs.append(first_output(out))
        self.current_mask = self.current_batch = None
        return outputs

    @torch.no_grad()
    def run_until(self, names: list[str], batches: list[int] | None = None) -> None:
        """Run every batch (or those at the `batches` positions) only until each named module has run: statistics
        for the first linears of a layer need none of the layer's later (attention, MLP) work."""
        pending: set[str] = set()

        def done(_m, _args, _out, name: str) -> None:
            pending.discard(name)
            if not pending:
                raise StopForward

        handles = [self.module(n).register_forward_hook(lambda m, a, o, n=n: done(m, a, o, n)) for n in names]
        try:
            for batch in range(len(self.inputs)) if batches is None else batches:
                x, kwargs = self.inputs[batch], self.kwargs[batch]
                self.current_mask, self.current_batch = self.token_masks[batch], batch
                pending.update(names)
                try:
                    self.layer(x, **kwargs)
                except StopForward:
                    pass
        finally:
            self.current_mask = self.current_batch = None
            for h in handles:
                h.remove()

    def real_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of x ([B, T, ...] or [B*T, ...]) for non-padding tokens of the running batch, flattened."""
        assert self.current_mask is not None, "real_tokens() is only valid inside forward()"
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] != self.current_mask.numel():  # an expert's tokens: its MoE block sent only real ones
            return flat
        return flat[self.current_mask.reshape(-1)]

    @contextmanager
    def capture_inputs(self, names: list[str]) -> Iterator[dict[str, list[torch.Tensor]]]:
        """While active, each forward() appends the non-padding inputs of the named modules."""
        captured: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        handles = [
            self.module(n).register_forward_hook(
                lambda _m, args, _out, n=n: captured[n].append(self.real_tokens(args[0]))
            )
            for n in names
        ]
        try:
            yield captured
        finally:
            for h in handles:
                h.remove()
