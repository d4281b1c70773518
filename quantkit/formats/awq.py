"""AWQ GEMM checkpoints (AutoAWQ `version: gemm`), 4-bit.

Per linear [out, in]:
  qweight  int32 [in, out/8]      packed along the output dimension in AutoAWQ's interleaved order:
                                  nibble j of word (i, c) holds output 8c + AWQ_ORDER[j] (AutoAWQ's
                                  WQLinear_GEMM.from_linear `order_map`; vLLM undoes it with the
                                  reverse order [0, 4, 1, 5, 2, 6, 3, 7])
  qzeros   int32 [groups, out/8]  unsigned zero points as they are (no v1-style -1), same interleave
  scales   fp16  [groups, out]
Symmetric weights are written as zero points of 8 and the config says `zero_point: true` even then:
vLLM's awq_marlin only accepts AWQ with zero points (uint4 + zp), without them it falls back to the
slow fp16-only GEMM kernel, which reads qzeros anyway; the dequantized weights are the same.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from quantkit.config import QuantConfig
from quantkit.formats.base import (
    CheckpointFormat,
    CheckpointScheme,
    pack_int32,
    register,
    require_multiple,
    unpack_int32,
)
from quantkit.qtensor import QuantizationError, QuantizedWeight

AWQ_BITS = 4
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _interleave_index(size: int) -> torch.Tensor:
    """Column permutation p with packed[:, j] = original[:, p[j]] (AWQ order within each word)."""
    return (torch.arange(size).view(-1, len(AWQ_ORDER))[:, list(AWQ_ORDER)]).flatten()


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C] (C a multiple of 8) -> int32 [R, C/8] in AWQ's interleaved nibble order."""
    return pack_int32(values[:, _interleave_index(values.shape[1])], AWQ_BITS, dim=1)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    size = packed.shape[1] * len(AWQ_ORDER)
    interleaved = unpack_int32(packed, AWQ_BITS, dim=1, size=size)
    return interleaved[:, torch.argsort(_interleave_index(size)).to(packed.device)].contiguous()


@register
class AWQFormat(CheckpointFormat):
    name = "awq"
    quant_method = "awq"
    marker_tensor = "qweight"

    def check(self, config: QuantConfig) -> None:
        if config.bits != AWQ_BITS:
            raise QuantizationError(f"the AWQ GEMM format stores 4-bit weights only, not {config.bits}-bit; "
                                    "use --format gptq or compressed-tensors for 8-bit")
        if config.act_bits != 16:
            raise QuantizationError("8-bit activations (W4A8, FP8) can only be exported as compressed-tensors")
        if config.quantize_head:
            raise QuantizationError("the AWQ format has no quantized lm_head; use --format compressed-tensors or gptq")

    def pack(self, qw: QuantizedWeight, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        if qw.bits != AWQ_BITS:
            raise QuantizationError(f"the AWQ GEMM format stores 4-bit weights only, not {qw.bits}-bit")
        require_multiple(qw.shape[0], len(AWQ_ORDER), "the output size", "AWQ")
        return {
            "qweight": pack_awq(qw.codes.t()),
            "qzeros": pack_awq(qw.zeros.t()),
            "scales": qw.scales.t().to(torch.float16).contiguous(),
        }

    def unpack(self, tensors: Mapping[str, torch.Tensor], qconfig: dict) -> QuantizedWeight:
        scheme = self.scheme(qconfig)
        zeros = unpack_awq(tensors["qzeros"]).t().contiguous()
        return QuantizedWeight(
            codes=unpack_awq(tensors["qweight"]).t().contiguous(),
            scales=tensors["scales"].t().float().contiguous(),
            zeros=zeros,
            bits=AWQ_BITS,
            group_size=scheme.group_size,
            sym=bool((zeros == 2 ** (AWQ_BITS - 1)).all()),
        )

    def quantization_config(self, config: QuantConfig, ignored_modules: list[str]) -> dict:
        return {
            "quant_method": self.quant_method,
            "version": "gemm",
            "bits": config.bits,
            "group_size": config.group_size,
            "zero_point": True,
            # vLLM and transformers skip a module when one of these is a substring of its name.
            "modules_to_not_convert": list(ignored_modules),
        }

    def scheme(self, qconfig: dict) -> CheckpointScheme:
        version = str(qconfig.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantizationError(f"AWQ checkpoints of version {version!r} are not supported (only 'gemm')")
        bits = qconfig.get("bits", qconfig.get("w_bit"))
        if bits != AWQ_BITS:
            raise QuantizationError(f"AWQ checkpoints with {bits}-bit weights are not supported (only 4-bit)")
        group_size = qconfig.get("group_size", qconfig.get("q_group_size"))
        return CheckpointScheme(bits=AWQ_BITS, group_size=group_size, sym=not qconfig.get("zero_point", True))
