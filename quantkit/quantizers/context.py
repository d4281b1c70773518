"""What a method sees of the decoder layer it works on: LayerContext, handed to Method.smooth_layer by the
engine (quantkit.engine), which owns the layer loop. Methods import this module, never the engine."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from quantkit.distributed import SINGLE, BatchShare, batch_share
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
    # which of the run's batches `inputs` are, with several ranks splitting them (quantkit.distributed); None: all
    share: BatchShare | None = None

    def __post_init__(self) -> None:
        if self.share is None:
            self.share = batch_share(SINGLE, len(self.inputs), False)

    def batch_id(self, position: int) -> int:
        """The run's index of the batch at `position` in inputs."""
        return self.share.ids[position]

    def in_batch_order(self, values: list) -> list:
        """Per-batch values of this rank's batches (in inputs' order) and every other rank's, in batch order."""
        return self.share.ranks.in_batch_order(values, self.share)

    def portable(self, x: torch.Tensor) -> torch.Tensor:
        """x as it can go to the other ranks (on the host) when the batches are split; else x itself."""
        return x.cpu() if self.share.split else x

    def step_values(self, value) -> list:
        """One step of the batches (stepwise()): every rank's `value` (None from a rank without a batch at this
        step), in batch order; unsplit, [value]."""
        return self.share.ranks.step_values(value, self.share)

    @property
    def place_in_step(self) -> int:
        """This rank's index in step_values()' list: its rank when the batches are split, else 0. At place 0 the
        rows before this rank's batch of a step are all in the steps before."""
        return self.share.ranks.rank if self.share.split else 0

    def stepwise(self) -> Iterator[int | None]:
        """The position in inputs of this rank's batch at each step of the run's batches (None once this rank has
        none left): split batches are run a step at a time, in lockstep with the other ranks."""
        for step in range(self.share.steps):
            yield step if step < len(self.inputs) else None

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
