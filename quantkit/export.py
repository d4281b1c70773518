"""Write a quantized model as a checkpoint vLLM and transformers load: atomically, safetensors only."""

from __future__ import annotations

import errno
import json
import logging
import math
import struct
from collections.abc import Callable, Collection, Iterable
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save
from torch import nn

from quantkit.config import QuantConfig
from quantkit.formats import get_format
from quantkit.formats.base import CheckpointFormat
from quantkit.models import get_adapter
from quantkit.models.adapters import ArchAdapter
from quantkit.models.moe import checkpoint_name
from quantkit.nn.qlinear import QuantLinear
from quantkit.outputs import check_free_space, check_output_target, staged_output
from quantkit.qtensor import QuantizationError

log = logging.getLogger("quantkit")

SHARD_BYTES = 4 * 2**30


EXPORT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def export_dtype(model: nn.Module, requested: str = "auto") -> torch.dtype:
    """fp16 by default (what GPTQ/AWQ kernels expect); bf16 for Gemma, whose activations overflow fp16."""
    if requested != "auto":
        if requested not in EXPORT_DTYPES:
            raise QuantizationError(f"export dtype must be auto or one of {sorted(EXPORT_DTYPES)}, got {requested!r}")
        return EXPORT_DTYPES[requested]
    return torch.bfloat16 if model.config.model_type.startswith("gemma") else torch.float16


def scale_dtype_for(torch_dtype: torch.dtype) -> str:
    """QuantConfig.scale_dtype for an export in torch_dtype (an fp32 export keeps fp16 scales, exact in it)."""
    return "bfloat16" if torch_dtype == torch.bfloat16 else "float16"


def warn_on_scale_rounding(config: QuantConfig, torch_dtype: torch.dtype) -> None:
    """An export in another dtype than the scales were rounded to rounds them again, after GPTQ's compensation."""
    wanted = scale_dtype_for(torch_dtype)
    if config.scale_dtype != wanted:
        log.warning("the scales were rounded to %s while quantizing; this %s export rounds them again "
                    "(QuantConfig(scale_dtype=%r) quantizes for it)", config.scale_dtype, wanted, wanted)


def quantized_modules(model: nn.Module) -> dict[str, QuantLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}


def dense_tensor_names(model: nn.Module, quantized: Collection[str]) -> list[str]:
    """State-dict names written as they are, in state-dict order: those not owned by a quantized linear,
    tied weights (lm_head = embed_tokens) once. Works on a meta-device skeleton too (ties by identity)."""
    names: list[str] = []
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name.rsplit(".", 1)[0] in quantized or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        names.append(name)
    return names


def cast_dense(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (tensor.to(dtype) if tensor.is_floating_point() else tensor).detach().cpu().contiguous()


def pack_linear(name: str, qlinear: QuantLinear, fmt: CheckpointFormat, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The export tensors of one quantized linear, full names, in the format's order then the bias."""
    tensors = {f"{name}.{key}": value for key, value in fmt.pack(qlinear.to_quantized(), dtype).items()}
    if qlinear.bias is not None:
        tensors[f"{name}.bias"] = qlinear.bias.to(dtype)
    return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}


def layer_export_tensors(index: int, layer: nn.Module, adapter: ArchAdapter, fmt: CheckpointFormat,
                         dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Decoder layer `index`'s export tensors, full names: its non-quantized ones (norms) in state-dict order, then
    each quantized linear's. The one definition both the whole-model and the streamed export use."""
    prefix = f"{adapter.layers}.{index}."
    qlinears = {name: m for name, m in layer.named_modules() if isinstance(m, QuantLinear)}
    state = layer.state_dict()
    tensors = {prefix + n: cast_dense(state[n], dtype) for n in dense_tensor_names(layer, qlinears)}
    for name, qlinear in qlinears.items():
        tensors.update(pack_linear(prefix + name, qlinear, fmt, dtype))
    return tensors


def quantized_linear_names(model: nn.Module, adapter: ArchAdapter) -> set[str]:
    """Full names of the linears the engine quantizes, known before any layer is loaded (a streamed skeleton), and
    the quantized ones outside the layers (a quantized lm_head)."""
    names = set(quantized_outside_layers(model, adapter))
    for i, layer in enumerate(adapter.get_layers(model)):
        modules = dict(layer.named_modules())
        names.update(f"{adapter.layers}.{i}.{n}" for n in adapter.linear_names()
                     if isinstance(modules.get(n), nn.Linear | QuantLinear))
    return names


def quantized_outside_layers(model: nn.Module, adapter: ArchAdapter) -> dict[str, QuantLinear]:
    """The QuantLinears outside the decoder layers (lm_head, where the scheme quantizes it), by full name."""
    prefix = adapter.layers + "."
    return {name: module for name, module in model.named_modules()
            if isinstance(module, QuantLinear) and not name.startswith(prefix)}


ExportPlan = tuple[list[tuple[str, int]], "TensorSpec", Callable[[str], torch.Tensor]]


def export_plan(model: nn.Module, adapter: ArchAdapter, fmt: CheckpointFormat, dtype: torch.dtype,
                layers: list[list[str]], layer_specs: dict[str, tuple[torch.dtype, list[int]]],
                load_layer: Callable[[str], torch.Tensor], load_outside: Callable[[str], torch.Tensor]) -> ExportPlan:
    """What an export writes, in its order, for write_shards: the model's non-quantized tensors in state-dict order
    (tied ones once), then each layer's packed linears in order (`layers`: each layer's layer_export_tensors names,
    `layer_specs` their dtypes and shapes, `load_layer` one of them), then a quantized lm_head's, packed from memory;
    every name as the architecture's checkpoints write it (Mixtral's). The whole-model and the streamed export both
    write this plan: the same bytes."""
    head = {key: value for name, module in quantized_outside_layers(model, adapter).items()
            for key, value in pack_linear(name, module, fmt, dtype).items()}
    if head:
        layers = [*layers, list(head)]
        layer_specs = {**layer_specs, **{key: (value.dtype, list(value.shape)) for key, value in head.items()}}
        load_layer = partial(_from_memory_or, head, load_layer)
    state = model.state_dict(keep_vars=True)
    in_layers = {key for names in layers for key in names}
    dense = dense_tensor_names(model, quantized_linear_names(model, adapter))
    specs = dict(layer_specs)
    for key in dense:
        if key not in in_layers:
            specs[key] = (dtype if state[key].is_floating_point() else state[key].dtype, list(state[key].shape))
    dense_set = set(dense)
    order = dense + [key for names in layers for key in names if key not in dense_set]
    ours = {adapter.checkpoint_name(k): k for k in order}
    sizes = [(adapter.checkpoint_name(k), math.prod(specs[k][1]) * specs[k][0].itemsize) for k in order]

    def load(name: str) -> torch.Tensor:
        key = ours[name]
        return load_layer(key) if key in in_layers else load_outside(key)

    return sizes, lambda name: specs[ours[name]], load


def _from_memory_or(tensors: dict[str, torch.Tensor], load: Callable[[str], torch.Tensor], key: str) -> torch.Tensor:
    return tensors[key] if key in tensors else load(key)


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def plan_shards(sizes: Iterable[tuple[str, int]], shard_bytes: int | None = None) -> list[list[str]]:
    """Tensor names per shard, in the given order, each shard at most shard_bytes (or one tensor)."""
    shard_bytes = shard_bytes or SHARD_BYTES
    shards: list[list[str]] = [[]]
    size = 0
    for key, n in sizes:
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += n
    return shards


TensorSpec = Callable[[str], tuple[torch.dtype, list[int]]]


def _safetensors_layout(names: list[str], spec: TensorSpec) -> tuple[list[str], dict[str, str]]:
    """The order in which safetensors lays tensors out in a file (it sorts them itself) and their dtype
    names, read from the header it writes for one-element stand-ins: no tensor data needed."""
    blob = save({name: torch.zeros(1, dtype=spec(name)[0]) for name in names})
    header = json.loads(blob[8:8 + struct.unpack("<Q", blob[:8])[0]])
    return sorted(names, key=lambda n: header[n]["data_offsets"][0]), {n: header[n]["dtype"] for n in names}


def write_safetensors(path: Path, names: list[str], spec: TensorSpec, load: Callable[[str], torch.Tensor]) -> None:
    """The bytes safetensors' save_file writes (header, then the data in its order), fetching and
    writing one tensor at a time: a streamed export never holds a whole shard in memory."""
    order, dtype_names = _safetensors_layout(names, spec)
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in order:
        dtype, shape = spec(name)
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": dtype_names[name], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name in order:
            f.write(load(name).contiguous().reshape(-1).view(torch.uint8).numpy())  # its buffer: no bytes copy


def write_shards(folder: Path, sizes: list[tuple[str, int]], spec: TensorSpec, load: Callable[[str], torch.Tensor],
                 shard_bytes: int | None = None) -> None:
    """Write the named tensors as safetensors shards (and their index when more than one). Within a
    file safetensors orders tensors itself (by dtype, then name): the bytes depend on the shard plan only."""
    shards = plan_shards(sizes, shard_bytes)
    if len(shards) == 1:
        write_safetensors(folder / "model.safetensors", shards[0], spec, load)
        return
    weight_map = {}
    for i, keys in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(folder / fname, keys, spec, load)
        weight_map.update(dict.fromkeys(keys, fname))
    index = {"metadata": {"total_size": sum(n for _, n in sizes)}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def unquantized_linears(model: nn.Module) -> list[str]:
    """Every linear the architecture entry does not quantize, as checkpoints name it: lm_head, and MoE routers /
    shared-expert gates, which loaders would otherwise expect packed. From the entry, not the module types: a
    resumed streaming run never rebuilds the layers it had finished."""
    adapter = get_adapter(model)
    quantized = set(adapter.linear_names())
    prefix = adapter.layers + "."

    def in_a_layer(name: str) -> bool:
        return name.startswith(prefix) and name[len(prefix):].partition(".")[2] in quantized

    return [checkpoint_name(model, name) for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and not in_a_layer(name)]


def write_metadata(folder: Path, model: nn.Module, tokenizer, config: QuantConfig, fmt_name: str,
                   torch_dtype: torch.dtype, report: dict | None, also_ignored: Collection[str] = ()) -> None:
    """config.json (with quantization_config), generation config, tokenizer and quantkit.json. `also_ignored`:
    linears the export carries unquantized beyond the model's own (a streamed checkpoint's unbuilt layers)."""
    hf_config = model.config.to_dict()
    hf_config.pop("quantization_config", None)
    hf_config["dtype"] = hf_config["torch_dtype"] = str(torch_dtype).removeprefix("torch.")
    hf_config["use_cache"] = True
    hf_config["quantization_config"] = get_format(fmt_name).quantization_config(
        config, ignored_modules=[*unquantized_linears(model), *also_ignored])
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2, default=str))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    quantkit_meta = {"format": fmt_name, "quant_config": config.to_dict(), "report": report or {}}
    (folder / "quantkit.json").write_text(json.dumps(quantkit_meta, indent=2, default=str))


def export_checkpoint(
    model: nn.Module,
    tokenizer,
    output: str | Path,
    config: QuantConfig,
    fmt_name: str,
    report: dict | None = None,
    dtype: str = "auto",
    overwrite: bool = False,
) -> Path:
    """Write to a staging folder beside `output`, then move it in (quantkit.outputs): never a half-written
    checkpoint, and `overwrite` replaces only a previous export or an empty folder. `config` is the scheme the
    model was quantized with (QuantReport.scheme; an unresolved group size resolves as quantize_model did)."""
    fmt = get_format(fmt_name)
    fmt.check(config)
    config = config.for_model(model, get_adapter(model))
    output = Path(output).expanduser().resolve()
    check_output_target(output, overwrite)
    if not quantized_modules(model):
        raise QuantizationError("the model has no quantized layers to export")
    torch_dtype = export_dtype(model, dtype)
    warn_on_scale_rounding(config, torch_dtype)
    adapter = get_adapter(model)
    per_layer = [layer_export_tensors(i, layer, adapter, fmt, torch_dtype)
                 for i, layer in enumerate(adapter.get_layers(model))]
    in_layers = {k: v for tensors in per_layer for k, v in tensors.items()}
    state = model.state_dict()
    plan = export_plan(model, adapter, fmt, torch_dtype, [list(tensors) for tensors in per_layer],
                       {k: (v.dtype, list(v.shape)) for k, v in in_layers.items()}, in_layers.__getitem__,
                       lambda key: cast_dense(state[key], torch_dtype))
    output.parent.mkdir(parents=True, exist_ok=True)
    check_free_space(output.parent, sum(n for _, n in plan[0]), "the export")
    try:
        with staged_output(output) as folder:
            write_shards(folder, *plan)
            write_metadata(folder, model, tokenizer, config, fmt_name, torch_dtype, report)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise QuantizationError(f"disk full while writing {output}; nothing was replaced: free space and rerun") from err
        raise
    return output
