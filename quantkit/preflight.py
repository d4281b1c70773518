"""Checks that run before any model is loaded: option ranges, paths, the device, free space, optional
dependencies. Each failure is one QuantizationError line naming the option or file and what to do; valid
but suspicious values get a warning saying what the user will get."""

from __future__ import annotations

import importlib
import json
import logging
import os
import socket
from pathlib import Path
from urllib.parse import urlsplit

import torch

from quantkit.outputs import check_free_space, existing_ancestor
from quantkit.qtensor import QuantizationError

log = logging.getLogger("quantkit")

MIN_SEQLEN = 16  # shorter windows carry almost no context: calibration and perplexity mean little
SHORT_SEQLEN = 128
FEW_CALIBRATION_TOKENS = 8192  # below this, GPTQ's Hessians and AWQ's activation means are noisy


def check_min(option: str, value: float | None, minimum: float, hint: str = "") -> None:
    """value >= minimum (None: the option was left at its default)."""
    if value is not None and value < minimum:
        raise QuantizationError(f"{option} must be at least {minimum}, got {value}{hint}")


def check_seqlen(option: str, seqlen: int) -> None:
    check_min(option, seqlen, MIN_SEQLEN, f" (a window of {seqlen} tokens has no context; 512 is usual)")


def warn_short_seqlen(option: str, seqlen: int) -> None:
    if seqlen < SHORT_SEQLEN:
        log.warning("%s %d is short: each window sees at most %d tokens of context, so results will "
                    "not reflect how the model is used (512 is usual)", option, seqlen, seqlen)


def warn_few_calibration_tokens(nsamples: int, seqlen: int) -> None:
    tokens = nsamples * seqlen
    if tokens < FEW_CALIBRATION_TOKENS:
        log.warning("calibration will see at most %d tokens (%d x %d): the quantized model may be noticeably "
                    "worse than with 32 x 512 or more", tokens, nsamples, seqlen)


def resolve_device(device: str | None) -> str:
    """The work device: the one asked for (refused if this machine lacks it), else cuda if available, else cpu."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except RuntimeError as err:
        raise QuantizationError(f"--device {device!r} is not a device: use cpu or cuda (cuda:N)") from err
    if parsed.type not in ("cpu", "cuda"):
        raise QuantizationError(f"--device {device!r}: quantkit runs on cpu or cuda")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise QuantizationError(f"--device {device}: this machine has no usable CUDA GPU; use --device cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise QuantizationError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here")
    return device


def check_choice(option: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise QuantizationError(f"{option} {value!r} is not one of: {', '.join(choices)}")


def require_module(module: str, feature: str, install: str) -> None:
    """Fail now, not after the work, when a requested feature's optional dependency is missing."""
    try:
        importlib.import_module(module)  # an import, not a lookup: a broken install fails here, not after the work
    except ImportError as err:
        raise QuantizationError(f"{feature} needs {module}, which cannot be imported ({err}): {install}") from err


def check_writable_folder(option: str, folder: Path) -> None:
    """folder can be created (or is) and written to."""
    if folder.expanduser().exists() and not folder.expanduser().is_dir():
        raise QuantizationError(f"{option} {folder} is an existing file, not a folder")
    base = existing_ancestor(folder)
    if not base.is_dir():
        raise QuantizationError(f"{option} {folder}: {base} is a file, so the folder cannot be created")
    probe = base / f".quantkit-probe-{os.getpid()}"
    try:  # a real write: permission bits say nothing for root or on a read-only mount
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise QuantizationError(f"{option} {folder}: cannot write in {base} ({err.strerror}); "
                                "choose another place") from err


def check_writable_file(option: str, path: Path) -> None:
    if path.expanduser().is_dir():
        raise QuantizationError(f"{option} {path} is a folder; give a file name")
    check_writable_folder(option, path.expanduser().absolute().parent)


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def estimate_export_bytes(source: Path | None, bits: int) -> int:
    """A rough lower bound of the export's size from the source's weight files (taken as 16-bit); the exact
    size is checked again just before writing."""
    if source is None or not source.exists():
        return 0
    files = [source] if source.is_file() else [f for f in source.iterdir() if f.suffix in WEIGHT_SUFFIXES]
    return sum(f.stat().st_size for f in files) * bits // 16


def estimate_hidden_state_bytes(source: Path, nsamples: int, seqlen: int) -> int:
    """A layer's calibration inputs and outputs in fp32 (the widest work dtype), from the width in the
    source's config.json; 0 when there is none to read (a GGUF file, a hub name not cached)."""
    config = source / "config.json"
    if not config.is_file():
        return 0
    text = json.loads(config.read_text())
    width = text.get("hidden_size") or text.get("text_config", {}).get("hidden_size") or 0
    return 2 * nsamples * seqlen * width * 4


def check_architecture(source: Path) -> None:
    """A local model folder's architecture has an entry, and its router settings are ones the entry covers: from
    config.json alone, before any weight is read."""
    from types import SimpleNamespace

    from quantkit.models import get_adapter

    config = source / "config.json"
    if not (source.is_dir() and config.is_file()):
        return
    values = json.loads(config.read_text())
    if "model_type" in values:
        get_adapter(values["model_type"]).check_router(SimpleNamespace(**values))


HUB_TIMEOUT_S = 3.0


def check_hub_reachable(source: str) -> None:
    """A hub name that is not cached needs the hub: find out in seconds, not after the hub client's retries."""
    from huggingface_hub import constants, try_to_load_from_cache

    from quantkit.models.loading import is_default_name

    if is_default_name(source) or Path(source).expanduser().exists() or constants.HF_HUB_OFFLINE:
        return  # offline mode: transformers itself fails at once on what is not cached
    if isinstance(try_to_load_from_cache(source, "config.json"), str):
        return
    url = urlsplit(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=HUB_TIMEOUT_S).close()
    except OSError as err:
        raise QuantizationError(f"{source!r} is not a local path and the hub ({constants.ENDPOINT}) cannot be "
                                f"reached ({err.strerror or err}): give a local folder or .gguf file") from err


def check_quantize_request(*, source: str | None, calib: str | None, output: Path, overwrite: bool,
                           nsamples: int, seqlen: int, batch_size: int, eval_windows: int | None,
                           dtype: str, bits: int, offload_dir: Path | None = None,
                           resume_interval: float = 0.0) -> None:
    """Everything `quantkit quantize` can check before loading the model."""
    from quantkit.data import check_text_source
    from quantkit.export import EXPORT_DTYPES
    from quantkit.models.loading import check_model_source, default_model_path, is_default_name
    from quantkit.outputs import check_output_target, clean_stale, protected_folder

    check_min("--nsamples", nsamples, 1)
    check_seqlen("--seqlen", seqlen)
    check_min("--batch-size", batch_size, 1)
    check_min("--eval-windows", eval_windows, 1)
    check_min("--resume-interval", resume_interval, 0)
    check_choice("--dtype", dtype, ("auto", *EXPORT_DTYPES))
    source_path = default_model_path() if is_default_name(source) else Path(str(source)).expanduser()
    check_model_source(str(source_path))
    check_architecture(source_path)
    check_hub_reachable(str(source_path))
    check_text_source(calib)
    check_writable_folder("--output", output)
    clean_stale(output)
    check_output_target(output, overwrite, protected_folder(source_path))
    check_free_space(output, estimate_export_bytes(source_path, bits), f"the export to {output}")
    if offload_dir is not None:
        check_writable_folder("--offload-dir", offload_dir)
        check_free_space(offload_dir, estimate_hidden_state_bytes(source_path, nsamples, seqlen),
                         f"the calibration hidden states in {offload_dir}")
    warn_short_seqlen("--seqlen", seqlen)
    warn_few_calibration_tokens(nsamples, seqlen)


def check_eval_request(*, models: list[str], texts: list[str] | None, report_dir: Path | None,
                       json_path: Path | None, seqlen: int, max_windows: int | None, batch_size: int,
                       max_new_tokens: int, limit: int | None, num_fewshot: int | None) -> None:
    """Everything `quantkit eval` can check before loading the first model (tasks are checked by run_eval)."""
    from quantkit.data import check_text_source
    from quantkit.models.loading import check_model_source

    check_seqlen("--seqlen", seqlen)
    check_min("--max-windows", max_windows, 1)
    check_min("--batch-size", batch_size, 1)
    check_min("--max-new-tokens", max_new_tokens, 1)
    check_min("--limit", limit, 1)
    check_min("--num-fewshot", num_fewshot, 0)
    for model in models:
        check_model_source(model)
        check_hub_reachable(model)
    for text in texts or []:
        check_text_source(text, "--text")
    if json_path is not None:
        check_writable_file("--json", json_path)
    if report_dir is not None:
        check_writable_folder("--report", report_dir)
        require_module("matplotlib", "--report (its plots)", "pip install 'quantkit[plot]' (or pip install matplotlib)")
    warn_short_seqlen("--seqlen", seqlen)
