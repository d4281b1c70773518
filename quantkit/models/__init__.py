"""Model loading and the per-architecture adapters."""

from quantkit.models.adapters import (
    ADAPTERS,
    ArchAdapter,
    DecoderTraits,
    OuterModules,
    ScalingGroup,
    get_adapter,
)
from quantkit.models.loading import load_for_eval, load_model

__all__ = ["ADAPTERS", "ArchAdapter", "DecoderTraits", "OuterModules", "ScalingGroup", "get_adapter", "load_for_eval",
           "load_model"]
