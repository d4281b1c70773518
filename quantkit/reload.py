"""Load a quantized checkpoint (quantkit's exports; GPTQ, AWQ and compressed-tensors layouts) into a
PyTorch model whose quantized linears are QuantLinear modules computing with the packed weights."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_utils import PreTrainedModel

from quantkit.formats import detect_format
from quantkit.models.adapters import find_adapter
from quantkit.models.moe import checkpoint_name, unfuse_experts
from quantkit.nn.qlinear import QuantLinear
from quantkit.qtensor import QuantizationError, QuantizedWeight
from quantkit.quantizers.qqq_grids import recover_channel_scales


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise QuantizationError(f"{folder} holds no .safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                tensors[key] = handle.get_tensor(key)
    return tensors


def _group_by_module(tensors: dict[str, torch.Tensor], marker: str) -> dict[str, dict[str, torch.Tensor]]:
    prefixes = [k[: -len(marker) - 1] for k in tensors if k.endswith("." + marker)]
    return {p: {k[len(p) + 1:]: v for k, v in tensors.items() if k.startswith(p + ".")} for p in prefixes}


def _quantkit_method(folder: Path) -> str | None:
    """The method that wrote the export (its quantkit.json), None for another tool's export."""
    meta = folder / "quantkit.json"
    return json.loads(meta.read_text()).get("quant_config", {}).get("method") if meta.is_file() else None


def _with_channel_scales(qw: QuantizedWeight, where: str) -> QuantizedWeight:
    """QQQ's two-level W4A8 weight rebuilt from its stored group scales (exact: they are k * s_ch), so the layer
    runs the two-level W4A8 kernels with the int8 weights the quantizer produced."""
    channel = recover_channel_scales(qw.scales)
    if channel is None:
        raise QuantizationError(f"{where}: a QQQ export whose group scales are not integer multiples of a per-channel "
                                "scale: it was not written by quantkit's QQQ, or was modified")
    return dataclasses.replace(qw, channel_scales=channel)


def load_quantized(
    folder: str | Path, dtype: torch.dtype = torch.float16
) -> tuple[PreTrainedModel, object]:
    folder = Path(folder).expanduser()
    raw_config = json.loads((folder / "config.json").read_text())
    fmt, scheme = detect_format(raw_config)
    qconfig = raw_config["quantization_config"]
    config = AutoConfig.from_pretrained(folder)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    adapter = find_adapter(config.model_type)
    if adapter is not None:  # per-expert tensors load into the per-expert form quantization wrote
        unfuse_experts(model, adapter)
    tensors = {checkpoint_name(model, k, reverse=True): v for k, v in _read_tensors(folder).items()}
    two_level = scheme.act_bits == 8 and _quantkit_method(folder) == "qqq"
    for prefix, module_tensors in _group_by_module(tensors, fmt.marker_tensor).items():
        qw = fmt.unpack(module_tensors, qconfig)
        if two_level and qw.group_size != -1:
            qw = _with_channel_scales(qw, f"{folder}: {prefix}")
        bias = module_tensors.get("bias")
        qlinear = QuantLinear.from_quantized(qw, bias, dtype, act_bits=scheme.act_bits)
        parent, _, child = prefix.rpartition(".")
        setattr(model.get_submodule(parent), child, qlinear)
        for key in module_tensors:
            del tensors[f"{prefix}.{key}"]
    missing, unexpected = model.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v
                                                 for k, v in tensors.items()}, strict=False)
    qbuffers = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    missing = [k for k in missing if k.rsplit(".", 1)[0] not in qbuffers]
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise QuantizationError(f"checkpoint {folder} does not match its config: missing {missing[:5]}, "
                                f"unexpected {unexpected[:5]}")
    model.eval()
    has_tokenizer = (folder / "tokenizer_config.json").is_file()
    return model, AutoTokenizer.from_pretrained(folder) if has_tokenizer else None
