"""The checkpoint-format interface and registry.

A format turns one layer's QuantizedWeight into the tensors a serving stack expects (pack), reads them
back (unpack), and writes the `quantization_config` entry of config.json. Tensor names are relative
to the linear module ("qweight", not "model.layers.0.mlp.up_proj.qweight"); the exporter adds the
prefix and the module's bias. A module holds quantized weights iff its `marker_tensor` is present.

Bit-level convention shared by all three formats: an int32 word holds 32/bits codes, code k of a
word in bits [k*bits, (k+1)*bits) (k = 0 least significant), consecutive along one tensor dimension
(AWQ additionally interleaves the 8 codes of a word, see awq.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from quantkit.config import QuantConfig
from quantkit.kernels.layout import pack_along_rows, unpack_along_rows
from quantkit.qtensor import QuantizationError, QuantizedWeight


@dataclass(frozen=True)
class CheckpointScheme:
    """What a checkpoint's quantization_config says about its quantized linears."""

    bits: int
    group_size: int  # -1: per output channel
    sym: bool
    act_bits: int = 16  # 8: dynamic per-token int8 activations (W4A8), or float8 ones with fp8
    fp8: bool = False  # float8 e4m3 weights per channel (W8A8-FP8)


class CheckpointFormat(ABC):
    name: ClassVar[str]  # the --format value: "gptq", "compressed-tensors", "awq"
    quant_method: ClassVar[str]  # quantization_config["quant_method"] in config.json
    marker_tensor: ClassVar[str]  # present exactly in the modules this format quantized

    def check(self, config: QuantConfig) -> None:  # noqa: B027 - a format holding every valid scheme keeps it
        """Raise QuantizationError when this format cannot hold the scheme `config` describes (by default it holds
        every scheme QuantConfig.validate accepts)."""

    @abstractmethod
    def pack(self, qw: QuantizedWeight, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Tensors of one quantized linear; `dtype` is the model dtype (used where the format stores it)."""

    @abstractmethod
    def unpack(self, tensors: Mapping[str, torch.Tensor], qconfig: dict) -> QuantizedWeight:
        """Inverse of pack; `qconfig` is config.json's quantization_config. Extra tensors are ignored."""

    @abstractmethod
    def quantization_config(self, config: QuantConfig, ignored_modules: list[str]) -> dict:
        """config.json's quantization_config. `ignored_modules`: full names of the nn.Linear modules left
        unquantized (lm_head included), so that loaders keep them dense."""

    @abstractmethod
    def scheme(self, qconfig: dict) -> CheckpointScheme:
        """Read a quantization_config written by this format (or by the tools it is compatible with)."""


# Filled by the built-in formats' modules, which the package's __init__ imports (Python runs it before this module)
FORMATS: dict[str, type[CheckpointFormat]] = {}


def register(cls: type[CheckpointFormat]) -> type[CheckpointFormat]:
    FORMATS[cls.name] = cls
    return cls


def get_format(name: str) -> CheckpointFormat:
    if name not in FORMATS:
        available = ", ".join(sorted(FORMATS))
        raise QuantizationError(f"unknown checkpoint format {name!r}; available: {available}")
    return FORMATS[name]()


def detect_format(hf_config: dict) -> tuple[CheckpointFormat, CheckpointScheme]:
    """The format of a saved model from its config.json dict, and the scheme its quantized linears use."""
    qconfig = hf_config.get("quantization_config")
    if not qconfig:
        raise QuantizationError("config.json has no quantization_config: this is not a quantized checkpoint")
    method = qconfig.get("quant_method")
    for cls in FORMATS.values():
        if cls.quant_method == method:
            fmt = cls()
            return fmt, fmt.scheme(qconfig)
    known = ", ".join(sorted(cls.quant_method for cls in FORMATS.values()))
    raise QuantizationError(f"unsupported quant_method {method!r} in config.json; quantkit reads {known}")


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """uint8 [R, C] -> int32 words packing consecutive entries along `dim` (zero-padded to whole words)."""
    along_rows = values if dim == 0 else values.t()
    pad = -along_rows.shape[0] % (32 // bits)
    if pad:
        along_rows = torch.cat([along_rows, along_rows.new_zeros(pad, along_rows.shape[1])])
    packed = pack_along_rows(along_rows, bits)
    return packed if dim == 0 else packed.t().contiguous()


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, size: int) -> torch.Tensor:
    """Inverse of pack_int32: the first `size` entries along `dim`, as uint8."""
    along_rows = packed if dim == 0 else packed.t()
    values = unpack_along_rows(along_rows, bits)[:size]
    return values if dim == 0 else values.t().contiguous()


def require_multiple(size: int, multiple: int, what: str, fmt: str) -> None:
    if size % multiple:
        raise QuantizationError(f"{fmt} packs {what} in words of {multiple}, but it is {size}; "
                                "use the compressed-tensors format for this model")

