"""compressed-tensors `pack-quantized` checkpoints (the format llm-compressor writes and vLLM serves).

Per linear [out, in], with b bits and p = 32 / b codes per int32 (conventions of compressed-tensors
0.17 `pack_to_int32` / PackedQuantizationCompressor, checked against it in the tests):
  weight_packed      int32 [out, ceil(in/p)]  code k of word (o, c) = q[o, p*c + k] + 2**(b-1), q the
                                              signed code in [-2**(b-1), 2**(b-1)), i.e. our unsigned code
  weight_scale       model dtype [out, groups]
  weight_shape       int64 [2] = [out, in]
  weight_zero_point  int32 [ceil(out/p), groups], asymmetric only: the signed zero point + 2**(b-1)
                     (= our unsigned zero), packed along the output dimension
W = (q - zero_point) * weight_scale, the same function as QuantizedWeight.dequantize.

W4A8 (act_bits 8) adds dynamic per-token symmetric int8 `input_activations` to the scheme; vLLM
serves that combination from pack-quantized weights (CompressedTensorsWNA8Int). The scheme carries its
own `format` because compressed-tensors resolves a module's compressor from the scheme, and would infer
int-quantized (unpacked int8 weights) for a scheme with input activations.

FP8 (W8A8-FP8) is the `float-quantized` format, what llm-compressor's FP8_DYNAMIC writes and vLLM serves as
CompressedTensorsW8A8Fp8:
  weight        float8_e4m3fn [out, in]
  weight_scale  float32 [out, 1]           W = weight * weight_scale
with dynamic per-token float8 `input_activations`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from quantkit.config import QuantConfig
from quantkit.formats.base import CheckpointFormat, CheckpointScheme, pack_int32, register, unpack_int32
from quantkit.qtensor import QuantizationError, QuantizedWeight, fp8_weight

PACK_QUANTIZED = "pack-quantized"
FLOAT_QUANTIZED = "float-quantized"
# The compressed-tensors release whose serialization this module follows (written as "version").
COMPRESSED_TENSORS_VERSION = "0.17.0"
W4A8_INPUT_ACTIVATIONS = {
    "num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "group_size": None,
    "dynamic": True, "actorder": None, "observer": None,
}

FP8_INPUT_ACTIVATIONS = {**W4A8_INPUT_ACTIVATIONS, "type": "float"}


def _weight_args(config: QuantConfig) -> dict:
    # Long-standing QuantizationArgs fields only (it forbids unknown ones): no scale_dtype / zp_dtype,
    # which newer releases add and infer (zp int8) when absent.
    per_channel = config.group_size == -1
    return {
        "num_bits": config.bits,
        "type": "float" if config.fp8 else "int",
        "symmetric": config.sym,
        "strategy": "channel" if per_channel else "group",
        "group_size": None if per_channel else config.group_size,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
    }


def _single_scheme(qconfig: dict) -> tuple[dict, str]:
    groups = list(qconfig.get("config_groups", {}).values())
    if len(groups) != 1:
        raise QuantizationError(f"compressed-tensors checkpoints with {len(groups)} config groups are not "
                                "supported (quantkit reads exactly one)")
    scheme = groups[0]
    fmt = scheme.get("format") or qconfig.get("format")
    if fmt not in (PACK_QUANTIZED, FLOAT_QUANTIZED):
        raise QuantizationError(f"compressed-tensors format {fmt!r} is not supported (only {PACK_QUANTIZED!r} "
                                f"and {FLOAT_QUANTIZED!r})")
    return scheme, fmt


def _activation_bits(input_activations: dict | None, fp8: bool) -> int:
    if not input_activations and not fp8:
        return 16
    keys = ("num_bits", "type", "symmetric", "strategy", "dynamic")
    supported = {key: (FP8_INPUT_ACTIVATIONS if fp8 else W4A8_INPUT_ACTIVATIONS)[key] for key in keys}
    if any((input_activations or {}).get(key) != value for key, value in supported.items()):
        raise QuantizationError(f"compressed-tensors input activations {input_activations} are not "
                                f"supported with these weights; quantkit runs {supported}")
    return 8


@register
class CompressedTensorsFormat(CheckpointFormat):
    name = "compressed-tensors"
    quant_method = "compressed-tensors"
    marker_tensor = "weight_scale"  # both formats' quantized linears have it, no dense module does

    def pack(self, qw: QuantizedWeight, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        if qw.fp8:
            return {"weight": qw.codes.view(torch.float8_e4m3fn).contiguous(),
                    "weight_scale": qw.scales.float().reshape(-1, 1).contiguous()}
        tensors = {
            "weight_packed": pack_int32(qw.codes, qw.bits, dim=1),
            "weight_scale": qw.scales.to(dtype).contiguous(),
            "weight_shape": torch.tensor(qw.shape, dtype=torch.int64),
        }
        if not qw.sym:
            tensors["weight_zero_point"] = pack_int32(qw.zeros, qw.bits, dim=0)
        return tensors

    def unpack(self, tensors: Mapping[str, torch.Tensor], qconfig: dict) -> QuantizedWeight:
        scheme = self.scheme(qconfig)
        if scheme.fp8:
            return fp8_weight(tensors["weight"].view(torch.uint8).contiguous(),
                              tensors["weight_scale"].float().reshape(-1, 1).contiguous())
        out_features, in_features = (int(size) for size in tensors["weight_shape"].tolist())
        scales = tensors["weight_scale"].float().contiguous()
        if scheme.sym:
            zeros = torch.full(scales.shape, 2 ** (scheme.bits - 1), dtype=torch.uint8, device=scales.device)
        else:
            zeros = unpack_int32(tensors["weight_zero_point"], scheme.bits, dim=0, size=out_features)
        return QuantizedWeight(
            codes=unpack_int32(tensors["weight_packed"], scheme.bits, dim=1, size=in_features),
            scales=scales,
            zeros=zeros.contiguous(),
            bits=scheme.bits,
            group_size=scheme.group_size,
            sym=scheme.sym,
        )

    def quantization_config(self, config: QuantConfig, ignored_modules: list[str]) -> dict:
        fmt = FLOAT_QUANTIZED if config.fp8 else PACK_QUANTIZED
        activations = FP8_INPUT_ACTIVATIONS if config.fp8 else W4A8_INPUT_ACTIVATIONS
        scheme = {
            # "Linear" matches lm_head for transformers (an nn.Linear) but not vLLM's ParallelLMHead: named as well
            "targets": ["Linear", "lm_head"] if config.quantize_head else ["Linear"],
            "weights": _weight_args(config),
            "input_activations": dict(activations) if config.act_bits == 8 else None,
            "output_activations": None,
            "format": fmt,
        }
        return {
            "quant_method": self.quant_method,
            "format": fmt,
            "quantization_status": "compressed",
            "config_groups": {"group_0": scheme},
            # Targets "Linear" match every nn.Linear, so the unquantized ones (lm_head too) must be listed.
            "ignore": list(ignored_modules),
            "kv_cache_scheme": None,
            "global_compression_ratio": None,
            "sparsity_config": {},
            "transform_config": {},
            "version": COMPRESSED_TENSORS_VERSION,
        }

    def scheme(self, qconfig: dict) -> CheckpointScheme:
        scheme, fmt = _single_scheme(qconfig)
        weights = scheme["weights"]
        strategy = weights.get("strategy")
        fp8 = fmt == FLOAT_QUANTIZED
        if fp8:
            supported = (weights.get("type"), weights.get("num_bits"), strategy) == ("float", 8, "channel")
        else:
            supported = weights.get("type", "int") == "int" and strategy in ("channel", "group")
        if not supported:
            raise QuantizationError(f"compressed-tensors weights {weights} are not supported (quantkit reads int "
                                    "weights with channel or group strategy, and float8 weights per channel)")
        if weights.get("actorder") in ("group", "dynamic", True):
            raise QuantizationError("compressed-tensors checkpoints with group activation ordering (g_idx) "
                                    "are not supported")
        return CheckpointScheme(
            bits=weights["num_bits"],
            group_size=weights["group_size"] if strategy == "group" else -1,
            sym=weights.get("symmetric", True),
            act_bits=_activation_bits(scheme.get("input_activations"), fp8),
            fp8=fp8,
        )
