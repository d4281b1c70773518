"""The quantizer interface and registry.

A method is two pieces:
  * a LinearQuantizer per linear layer: it sees the (non-padding) input activations of that layer
    through add_batch, then returns a QuantizedWeight. RTN ignores the activations; GPTQ builds
    its Hessian from them.
  * optionally a smooth_layer step, run once per decoder layer before any linear is quantized:
    AWQ and QQQ search per-channel scales there and fold them into the layer's weights.
Its options are a MethodOptions dataclass (Method.options_class, quantkit.config): QuantConfig.options holds
them and `quantkit quantize` offers each field as a flag.

The engine (quantkit.engine) drives both, handing smooth_layer a LayerContext (quantizers.context); methods
never import the engine. A new method registers itself here and touches nothing else.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from torch import nn

from quantkit.config import METHOD_OPTIONS, METHOD_SCHEMES, MethodOptions, QuantConfig
from quantkit.qtensor import QuantizationError, QuantizedWeight
from quantkit.quantizers.context import LayerContext


class LinearQuantizer(ABC):
    """Quantizes one nn.Linear, optionally from the activations it receives."""

    def __init__(self, linear: nn.Linear, config: QuantConfig) -> None:
        if not config.resolved:
            raise QuantizationError("the group size is still 'auto': resolve the scheme for the model first "
                                    "(QuantConfig.for_model, as quantize_model does)")
        self.linear = linear
        self.config = config

    def add_batch(self, x: torch.Tensor) -> None:  # noqa: B027 - optional hook
        """x: [tokens, in_features], padding tokens already removed."""

    @abstractmethod
    def quantize(self) -> QuantizedWeight: ...

    @classmethod
    def quantize_groups(cls, groups: list[list[LinearQuantizer]]) -> list[list[QuantizedWeight]]:
        """The results of groups of this class's quantizers, each group a linear then those that took its
        statistics. A method may solve them together (GPTQ: a group as one stack of rows, groups of one shape side
        by side); by default each is quantized alone."""
        return [[q.quantize() for q in group] for group in groups]

    def free(self) -> None:  # noqa: B027 - optional hook
        """Release statistics (called after quantize)."""

    def few_tokens(self) -> str | None:
        """Adjust to statistics from fewer tokens than the input width (an MoE expert's); what was done, for the
        log and the report, or None where the method needs nothing."""
        return None

    def statistics_bytes(self) -> int:
        """What this quantizer's statistics will occupy on the device (the engine gathers a step in parts that fit)."""
        return 0

    def shares_statistics_with(self, owner: LinearQuantizer) -> bool:
        """Whether this quantizer can take `owner`'s statistics instead of gathering its own, for a linear that
        reads the same input (q/k/v, gate/up): no second accumulation, one copy in memory."""
        return False

    def take_statistics(self, owner: LinearQuantizer) -> None:
        """Take `owner`'s statistics, gathered now (only where shares_statistics_with said yes)."""
        raise NotImplementedError


class Method(ABC):
    name: ClassVar[str]
    needs_activations: ClassVar[bool] = True
    options_class: ClassVar[type[MethodOptions]] = MethodOptions  # what QuantConfig.options holds for it
    # the engine compares each quantized layer's output error with RTN's on the same grid and keeps the better
    # (quantkit.layer_guard); off for a method whose weights RTN cannot express
    rtn_guard: ClassVar[bool] = True
    # scheme fields the method fixes (QuantConfig applies them at construction, refusing a contradiction)
    required_scheme: ClassVar[dict[str, Any]] = {}
    # a smoothing step that reads the batches only through LayerContext's batch-order helpers (stepwise,
    # in_batch_order, Ranks.deliver), so that several ranks can each run a share of them
    smoothing_splits_batches: ClassVar[bool] = False

    def __init__(self, config: QuantConfig) -> None:
        self.config = config

    @abstractmethod
    def linear_quantizer(self, linear: nn.Linear) -> LinearQuantizer: ...

    def smooth_layer(self, ctx: LayerContext) -> dict:
        """Per-decoder-layer transform before quantization; returns report entries."""
        return {}

    @property
    def needs_calibration(self) -> bool:
        """Whether the engine runs the calibration set through the layers at all: the linears read activations,
        or the method smooths. RTN does neither, so it runs no calibration forward pass."""
        return self.needs_activations or self.smooths

    @property
    def smooths(self) -> bool:
        return type(self).smooth_layer is not Method.smooth_layer

    @property
    def splits_batches(self) -> bool:
        """Whether several ranks may each run only their share of the calibration batches: what the method reads
        of them comes through its quantizers' add_batch (the engine feeds them in batch order) and its smoothing
        step, if any, says it can."""
        return not self.smooths or self.smoothing_splits_batches


# Filled by the built-in methods' modules, which the package's __init__ imports (Python runs it before this module)
METHODS: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    METHODS[cls.name] = cls
    METHOD_OPTIONS[cls.name] = cls.options_class
    METHOD_SCHEMES[cls.name] = cls.required_scheme
    return cls


def registered_methods() -> dict[str, type[Method]]:
    """Every method by name (importing quantkit registers the built-in ones)."""
    return METHODS


def method_class(name: str) -> type[Method]:
    methods = registered_methods()
    if name not in methods:
        raise QuantizationError(f"unknown method {name!r}; available: {', '.join(sorted(methods))}")
    return methods[name]


def get_method(config: QuantConfig) -> Method:
    return method_class(config.method)(config)
