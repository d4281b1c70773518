"""Load a quantized checkpoint (quantkit's exports; GPTQ, AWQ and compressed-tensors layouts) into a
PyTorch model whose quantized linears are QuantLinear modules computing with the packed weights."""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import torch
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_utils import PreTrainedModel

from quantkit.formats import detect_format
from quantkit.models.adapters import find_adapter
from quantkit.models.moe import checkpoint_name, unfuse_experts
from quantkit.nn.qlinear import QuantLinear
from quantkit.qtensor import QuantizationError, QuantizedWeight
from quantkit.quantizers.qqq_grids import recover_channel_scales
from quantkit.streaming.checkpoint import SafetensorsCheckpoint
from quantkit.streaming.skeleton import map_large_allocations, set_tensor


def _module_keys(names: Iterable[str], marker: str) -> dict[str, list[str]]:
    """Quantized module prefix -> the leaf names of its tensors (a module is quantized iff it holds `marker`)."""
    leaves: dict[str, list[str]] = defaultdict(list)
    for name in names:
        prefix, _, leaf = name.rpartition(".")
        leaves[prefix].append(leaf)
    return {prefix: keys for prefix, keys in leaves.items() if marker in keys}


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
    folder: str | Path, dtype: torch.dtype = torch.float16, device: torch.device | str = "cpu"
) -> tuple[PreTrainedModel, object]:
    """The export as a model whose quantized linears are QuantLinear modules, built on `device` directly.

    The skeleton is made on the meta device; each quantized module is read, unpacked and placed on `device` one
    at a time, and every other tensor likewise: host memory holds one module's tensors (or one embedding), never
    the model, and no fp weight of a quantized linear is ever made (a 70B W4A16 export loads onto one GPU)."""
    folder = Path(folder).expanduser()
    map_large_allocations()  # each module's transient copies go back to the OS when freed, not to the heap
    raw_config = json.loads((folder / "config.json").read_text())
    fmt, scheme = detect_format(raw_config)
    qconfig = raw_config["quantization_config"]
    config = AutoConfig.from_pretrained(folder)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with init_empty_weights(include_buffers=False):  # rotary tables and other computed buffers stay real
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    adapter = find_adapter(config.model_type)
    if adapter is not None:  # per-expert tensors load into the per-expert form quantization wrote
        unfuse_experts(model, adapter)
    ckpt = SafetensorsCheckpoint(folder)
    stored = {checkpoint_name(model, k, reverse=True): k for k in ckpt.weight_map}  # our name -> the file's
    two_level = scheme.act_bits == 8 and _quantkit_method(folder) == "qqq"
    expected = set(model.state_dict(keep_vars=True))
    for prefix, leaves in _module_keys(stored, fmt.marker_tensor).items():
        read = ckpt.read([stored[f"{prefix}.{leaf}"] for leaf in leaves])
        module_tensors = {leaf: read[stored[f"{prefix}.{leaf}"]].to(device) for leaf in leaves}
        with torch.device(device):  # unpacked and repacked where the layer will run (a GPU's is quick)
            qw = fmt.unpack(module_tensors, qconfig)
            if two_level and qw.group_size != -1:
                qw = _with_channel_scales(qw, f"{folder}: {prefix}")
            qlinear = QuantLinear.from_quantized(qw, module_tensors.get("bias"), dtype, act_bits=scheme.act_bits)
        parent, _, child = prefix.rpartition(".")
        setattr(model.get_submodule(parent), child, qlinear)
        for leaf in leaves:
            del stored[f"{prefix}.{leaf}"]
        expected -= {f"{prefix}.{leaf}" for leaf in ("weight", "bias")}
    unexpected = sorted(set(stored) - expected)
    for name in sorted(set(stored) & expected):
        value = ckpt.read([stored[name]])[stored[name]]
        set_tensor(model, name, value.to(device, dtype) if value.is_floating_point() else value.to(device))
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, t in model.state_dict(keep_vars=True).items() if t.is_meta]
    if missing or unexpected:
        raise QuantizationError(f"checkpoint {folder} does not match its config: missing {missing[:5]}, "
                                f"unexpected {unexpected[:5]}")
    model.to(device).eval()  # the computed buffers (rotary tables); every weight is there already
    has_tokenizer = (folder / "tokenizer_config.json").is_file()
    return model, AutoTokenizer.from_pretrained(folder) if has_tokenizer else None
