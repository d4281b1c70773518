"""Checkpoint formats (GPTQ v1, compressed-tensors pack-quantized, AWQ GEMM); importing registers them."""

from quantkit.formats import awq, compressed_tensors, gptq  # noqa: F401
from quantkit.formats.base import (
    FORMATS,
    CheckpointFormat,
    CheckpointScheme,
    detect_format,
    get_format,
)

__all__ = ["FORMATS", "CheckpointFormat", "CheckpointScheme", "detect_format", "get_format"]
