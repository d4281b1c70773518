"""The quantizer interface and registry.

A method is two pieces:
  * a LinearQuantizer per linear layer: it sees the (non-padding) input activations of that layer
    through add_batch, then returns a QuantizedWeight. RTN ignores the activations; GPTQ builds
    its Hessian from them.
  * optionally a smooth_layer step, run once per decoder layer before any linear is quantized:
    AWQ and QQQ search per-channel scales there and fold them into the layer's weights.

The engine (quantkit.engine) drives both; a new method registers itself here and touches nothing else.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from quantkit.config import QuantConfig
from quantkit.qtensor import QuantizationError, QuantizedWeight

if TYPE_CHECKING:
    from quantkit.engine import LayerContext


class LinearQuantizer(ABC):
    """Quantizes one nn.Linear, optionally from the activations it receives."""

    def __init__(self, linear: nn.Linear, config: QuantConfig) -> None:
        self.linear = linear
        self.config = config

    def add_batch(self, x: torch.Tensor) -> None:  # noqa: B027 - optional hook
        """x: [tokens, in_features], padding tokens already removed."""

    @abstractmethod
    def quantize(self) -> QuantizedWeight: ...

    def free(self) -> None:  # noqa: B027 - optional hook
        """Release statistics (called after quantize)."""


class Method(ABC):
    name: ClassVar[str]
    needs_activations: ClassVar[bool] = True
    # False: neither smoothing nor the linears read the calibration set, so the engine runs no
    # calibration forward pass (RTN); a False here implies needs_activations is False too.
    needs_calibration: ClassVar[bool] = True

    def __init__(self, config: QuantConfig) -> None:
        self.config = config

    @abstractmethod
    def linear_quantizer(self, linear: nn.Linear) -> LinearQuantizer: ...

    def smooth_layer(self, ctx: LayerContext) -> dict:
        """Per-decoder-layer transform before quantization; returns report entries."""
        return {}


METHODS: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    METHODS[cls.name] = cls
    return cls


def get_method(config: QuantConfig) -> Method:
    import quantkit.quantizers  # noqa: F401  (registers the built-in methods)

    if config.method not in METHODS:
        raise QuantizationError(f"unknown method {config.method!r}; available: {', '.join(sorted(METHODS))}")
    return METHODS[config.method](config)
