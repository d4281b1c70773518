"""GPTQ v1 checkpoints (AutoGPTQ / GPTQModel `checkpoint_format: gptq`), symmetric only.

Per linear [out, in], with b bits and p = 32 / b codes per int32:
  qweight  int32 [in/p, out]      code k of word (r, o) = code of input p*r + k, output o
  qzeros   int32 [groups, out/p]  code k of word (g, c) = zero - 1 of output p*c + k (the v1 quirk:
                                  AutoGPTQ stores zero - 1 and its kernels add the 1 back)
  scales   fp16  [groups, out]
  g_idx    int32 [in]             i // group_size (no act-order permutation)
Loaders: vLLM's gptq / gptq_marlin (needs bits, group_size, desc_act, sym; optional lm_head, dynamic,
checkpoint_format), transformers' GPTQConfig and GPTQModel (which also understand `dynamic`).
Asymmetric weights are refused: v1's zero - 1 cannot represent zero = 0, and Marlin ignores v1 zeros.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from quantkit import __version__
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
from quantkit.quantizers.gptq import GPTQOptions


@register
class GPTQFormat(CheckpointFormat):
    name = "gptq"
    quant_method = "gptq"
    marker_tensor = "qweight"

    def check(self, config: QuantConfig) -> None:
        if not config.sym:
            raise QuantizationError(
                "the GPTQ (v1) format cannot hold asymmetric weights; use --format compressed-tensors or awq"
            )
        if config.act_bits != 16:
            raise QuantizationError("8-bit activations (W4A8, FP8) can only be exported as compressed-tensors")

    def pack(self, qw: QuantizedWeight, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        if not qw.sym:
            raise QuantizationError("the GPTQ (v1) format stores symmetric weights only")
        out_features, in_features = qw.shape
        per_word = 32 // qw.bits
        require_multiple(in_features, per_word, "the input size", "GPTQ")
        require_multiple(out_features, per_word, "the output size", "GPTQ")
        return {
            "qweight": pack_int32(qw.codes.t(), qw.bits, dim=0),
            "qzeros": pack_int32((qw.zeros - 1).t(), qw.bits, dim=1),
            "scales": qw.scales.t().to(torch.float16).contiguous(),
            "g_idx": qw.group_index().to(torch.int32),
        }

    def unpack(self, tensors: Mapping[str, torch.Tensor], qconfig: dict) -> QuantizedWeight:
        scheme = self.scheme(qconfig)
        qweight = tensors["qweight"]
        in_features, out_features = qweight.shape[0] * 32 // scheme.bits, qweight.shape[1]
        group_size = in_features if scheme.group_size == -1 else scheme.group_size
        static_g_idx = torch.arange(in_features) // group_size
        if "g_idx" in tensors and not torch.equal(tensors["g_idx"].cpu().long(), static_g_idx):
            raise QuantizationError(
                "act-order (desc_act) GPTQ checkpoints are not supported: g_idx is permuted"
            )
        # v2 checkpoints (GPTQModel's internal format) store the zero itself; the mask maps v1's
        # wrapped zero - 1 = -1 back to 0.
        zero_offset = 0 if qconfig.get("checkpoint_format") == "gptq_v2" else 1
        stored_zeros = unpack_int32(tensors["qzeros"], scheme.bits, dim=1, size=out_features).t().int()
        zeros = ((stored_zeros + zero_offset) & (2**scheme.bits - 1)).to(torch.uint8)
        return QuantizedWeight(
            codes=unpack_int32(qweight, scheme.bits, dim=0, size=in_features).t().contiguous(),
            scales=tensors["scales"].t().float().contiguous(),
            zeros=zeros.contiguous(),
            bits=scheme.bits,
            group_size=scheme.group_size,
            sym=scheme.sym,
        )

    def quantization_config(self, config: QuantConfig, ignored_modules: list[str]) -> dict:
        # methods without GPTQ's options (RTN, AWQ) record its defaults, as GPTQModel's config always holds them,
        # but no static groups: they order nothing
        gptq = config.options if isinstance(config.options, GPTQOptions) else GPTQOptions(act_order=False)
        qconfig = {
            "quant_method": self.quant_method,
            "checkpoint_format": "gptq",
            "bits": config.bits,
            "group_size": config.group_size,
            "sym": True,
            "desc_act": False,
            "static_groups": gptq.act_order,
            "damp_percent": gptq.damp_percent,
            "lm_head": config.quantize_head,  # GPTQModel's key, which vLLM reads
            "pack_dtype": "int32",
            "meta": {"quantizer": [f"quantkit:{__version__}"]},
        }
        if ignored_modules:
            # GPTQModel / vLLM "dynamic" rules: "-:" + regex (re.match on the module name) = not quantized.
            qconfig["dynamic"] = {f"-:{re.escape(name)}$": {} for name in ignored_modules}
        return qconfig

    def scheme(self, qconfig: dict) -> CheckpointScheme:
        return CheckpointScheme(qconfig["bits"], qconfig["group_size"], sym=qconfig.get("sym", True))
