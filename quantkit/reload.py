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
from quantkit.streaming.skeleton import large_allocations_mapped, set_tensor, unbuilt_layers


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


class ExportReader:
    """An export as a meta-device skeleton (quantized linears not yet replaced) whose modules are built on demand,
    one at a time, on the device asked for: the whole model (load_quantized) or one layer at a time
    (quantkit.eval.layerwise). No fp weight of a quantized linear is ever made."""

    def __init__(self, folder: str | Path, dtype: torch.dtype) -> None:
        self.folder, self.dtype = Path(folder).expanduser(), dtype
        raw_config = json.loads((self.folder / "config.json").read_text())
        self.fmt, self.scheme = detect_format(raw_config)
        self.qconfig = raw_config["quantization_config"]
        config = AutoConfig.from_pretrained(self.folder)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        with init_empty_weights(include_buffers=False):  # rotary tables and other computed buffers stay real
            self.model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        adapter = find_adapter(config.model_type)
        if adapter is not None:  # per-expert tensors load into the per-expert form quantization wrote
            unfuse_experts(self.model, adapter)
        self.ckpt = SafetensorsCheckpoint(self.folder)
        layers = None if adapter is None else (adapter.layers, len(adapter.get_layers(self.model)))
        unbuilt = set() if layers is None else set(unbuilt_layers(list(self.ckpt.weight_map), *layers))  # MTP
        self.stored = {checkpoint_name(self.model, k, reverse=True): k for k in self.ckpt.weight_map
                       if k not in unbuilt}  # ours: the file's
        self.modules = _module_keys(self.stored, self.fmt.marker_tensor)
        self.two_level = self.scheme.act_bits == 8 and _quantkit_method(self.folder) == "qqq"
        names = set(self.model.state_dict(keep_vars=True))
        replaced = {f"{prefix}.{leaf}" for prefix in self.modules for leaf in ("weight", "bias")}
        self.dense = sorted((names - replaced) & set(self.stored))
        packed = {f"{prefix}.{leaf}" for prefix, leaves in self.modules.items() for leaf in leaves}
        self.unexpected = sorted(set(self.stored) - packed - names)

    def materialize(self, device: torch.device | str, within: str = "", outside: str | None = None) -> None:
        """Build every module and tensor whose name starts with `within` (and not with `outside`) on `device`."""
        def wanted(name: str) -> bool:
            return name.startswith(within) and (outside is None or not name.startswith(outside))

        for prefix in filter(wanted, self.modules):
            parent, _, child = prefix.rpartition(".")
            setattr(self.model.get_submodule(parent), child, self._quantized_linear(prefix, device))
        for name in filter(wanted, self.dense):
            value = self.ckpt.read([self.stored[name]])[self.stored[name]]
            set_tensor(self.model, name, value.to(device, self.dtype) if value.is_floating_point() else value.to(device))
        if getattr(self.model.config, "tie_word_embeddings", False):
            self.model.tie_weights()

    def check_complete(self) -> None:
        missing = [n for n, t in self.model.state_dict(keep_vars=True).items() if t.is_meta]
        if missing or self.unexpected:
            raise QuantizationError(f"checkpoint {self.folder} does not match its config: missing {missing[:5]}, "
                                    f"unexpected {self.unexpected[:5]}")

    def tokenizer(self):
        has_tokenizer = (self.folder / "tokenizer_config.json").is_file()
        return AutoTokenizer.from_pretrained(self.folder) if has_tokenizer else None

    def _quantized_linear(self, prefix: str, device: torch.device | str) -> QuantLinear:
        leaves = self.modules[prefix]
        read = self.ckpt.read_raw([self.stored[f"{prefix}.{leaf}"] for leaf in leaves])
        tensors = {leaf: read[self.stored[f"{prefix}.{leaf}"]].to(device) for leaf in leaves}
        with torch.device(device):  # unpacked and repacked where the layer will run (a GPU's is quick)
            qw = self.fmt.unpack(tensors, self.qconfig)
            if self.two_level and qw.group_size != -1:
                qw = _with_channel_scales(qw, f"{self.folder}: {prefix}")
            return QuantLinear.from_quantized(qw, tensors.get("bias"), self.dtype, act_bits=self.scheme.act_bits)


def load_quantized(
    folder: str | Path, dtype: torch.dtype = torch.float16, device: torch.device | str = "cpu"
) -> tuple[PreTrainedModel, object]:
    """The export as a model whose quantized linears are QuantLinear modules, built on `device` directly: host
    memory holds one module's tensors (or one embedding), never the model (a 70B W4A16 export loads onto one
    GPU)."""
    with large_allocations_mapped():  # each module's transient copies go back to the OS when freed
        reader = ExportReader(folder, dtype)
        reader.materialize(device)
    reader.check_complete()
    reader.model.to(device).eval()  # the computed buffers (rotary tables); every weight is there already
    return reader.model, reader.tokenizer()
