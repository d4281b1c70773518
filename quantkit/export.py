"""Write a quantized model as a checkpoint vLLM and transformers load: atomically, safetensors only."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from quantkit.config import QuantConfig
from quantkit.formats import get_format
from quantkit.models.moe import checkpoint_name
from quantkit.nn.qlinear import QuantLinear
from quantkit.outputs import check_free_space, check_output_target, staged_output
from quantkit.qtensor import QuantizationError

SHARD_BYTES = 4 * 2**30


EXPORT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def export_dtype(model: nn.Module, requested: str = "auto") -> torch.dtype:
    """fp16 by default (what GPTQ/AWQ kernels expect); bf16 for Gemma, whose activations overflow fp16."""
    if requested != "auto":
        if requested not in EXPORT_DTYPES:
            raise QuantizationError(f"export dtype must be auto or one of {sorted(EXPORT_DTYPES)}, got {requested!r}")
        return EXPORT_DTYPES[requested]
    return torch.bfloat16 if model.config.model_type.startswith("gemma") else torch.float16


def quantized_modules(model: nn.Module) -> dict[str, QuantLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}


def build_state_dict(model: nn.Module, fmt_name: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    fmt = get_format(fmt_name)
    qmodules = quantized_modules(model)
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()  # tied weights (lm_head = embed_tokens) are written once
    for name, tensor in model.state_dict().items():
        owner = name.rsplit(".", 1)[0]
        if owner in qmodules or tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        tensors[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    for name, qlinear in qmodules.items():
        for key, value in fmt.pack(qlinear.to_quantized(), dtype).items():
            tensors[f"{name}.{key}"] = value
        if qlinear.bias is not None:
            tensors[f"{name}.bias"] = qlinear.bias.to(dtype)
    return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}


def _write_shards(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, value in tensors.items():
        nbytes = value.numel() * value.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][key] = value
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], folder / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


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
    checkpoint, and `overwrite` replaces only a previous export or an empty folder."""
    fmt = get_format(fmt_name)
    fmt.check(config)
    output = Path(output).expanduser().resolve()
    check_output_target(output, overwrite)
    if not quantized_modules(model):
        raise QuantizationError("the model has no quantized layers to export")
    torch_dtype = export_dtype(model, dtype)
    tensors = build_state_dict(model, fmt_name, torch_dtype)
    output.parent.mkdir(parents=True, exist_ok=True)
    check_free_space(output.parent, sum(v.numel() * v.element_size() for v in tensors.values()), "the export")
    try:
        with staged_output(output) as folder:
            _write_folder(model, tokenizer, tensors, folder, config, fmt_name, torch_dtype, report)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise QuantizationError(f"disk full while writing {output}; nothing was replaced: free space and rerun") from err
        raise
    return output


def _write_folder(model: nn.Module, tokenizer, tensors: dict[str, torch.Tensor], folder: Path,
                  config: QuantConfig, fmt_name: str, torch_dtype: torch.dtype, report: dict | None) -> None:
    _write_shards({checkpoint_name(model, k): v for k, v in tensors.items()}, folder)
    hf_config = model.config.to_dict()
    hf_config.pop("quantization_config", None)
    hf_config["dtype"] = hf_config["torch_dtype"] = str(torch_dtype).removeprefix("torch.")
    hf_config["use_cache"] = True
    # every linear left in full precision: lm_head, and MoE routers / shared-expert gates, which loaders would
    # otherwise expect packed
    unquantized = [checkpoint_name(model, name) for name, module in model.named_modules()
                   if isinstance(module, nn.Linear)]
    hf_config["quantization_config"] = get_format(fmt_name).quantization_config(config, ignored_modules=unquantized)
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2, default=str))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    quantkit_meta = {"format": fmt_name, "quant_config": config.to_dict(), "report": report or {}}
    (folder / "quantkit.json").write_text(json.dumps(quantkit_meta, indent=2, default=str))
