"""Streaming quantization: layers from the checkpoint's shards, through the engine, into resumable work
files, then into the export's shards; host memory holds about one layer plus the calibration states."""

from __future__ import annotations

import errno
import logging
import math
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import PreTrainedModel

from quantkit.config import QuantConfig
from quantkit.data import CalibrationSet
from quantkit.distributed import SINGLE, Ranks
from quantkit.engine import LayerHooks, QuantReport, quantize_model
from quantkit.export import (
    ExportPlan,
    cast_dense,
    export_dtype,
    export_plan,
    layer_export_tensors,
    warn_on_scale_rounding,
    write_metadata,
    write_shards,
)
from quantkit.formats import get_format
from quantkit.formats.base import CheckpointFormat
from quantkit.models import get_adapter
from quantkit.models.adapters import ArchAdapter
from quantkit.models.loading import load_failure
from quantkit.models.moe import unfuse_experts
from quantkit.outputs import apply_umask, check_output_target, replace_atomically
from quantkit.qtensor import QuantizationError
from quantkit.streaming.checkpoint import SAFETENSORS_DTYPES, SCALE_SUFFIX, SafetensorsCheckpoint
from quantkit.streaming.skeleton import (
    StreamedLayers,
    build_skeleton,
    load_outside_layers,
    map_large_allocations,
    read_outside_tensor,
    release_outside_layers,
    unbuilt_layers,
)
from quantkit.streaming.workdir import RESUME_INTERVAL_S, WorkDir, pause_between_phases, run_key, work_dir_for

log = logging.getLogger("quantkit")

def open_streamed_model(source: str, dtype: torch.dtype) -> tuple[PreTrainedModel, SafetensorsCheckpoint]:
    """The meta skeleton of `source` with its tensors outside the decoder layers loaded."""
    map_large_allocations()
    try:
        ckpt = SafetensorsCheckpoint(source)
        ckpt.check_index()
        model = build_skeleton(source, dtype)
        load_outside_layers(model, ckpt, get_adapter(model))
    except QuantizationError:
        raise
    except Exception as err:  # safetensors/transformers errors on damaged files: the user needs one line
        raise load_failure(source, err) from err
    return model, ckpt


@contextmanager
def _disk_errors(work: Path) -> Iterator[None]:
    """A full, read-only or forbidden disk is one line; the finished layers stay for the resume."""
    try:
        yield
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT, errno.EPERM):
            raise
        raise QuantizationError(f"cannot write {err.filename or work}: {err.strerror}; finished layers are kept "
                                f"in {work}, rerun the same command to resume") from err


def _export_plan(model: nn.Module, adapter: ArchAdapter, ckpt: SafetensorsCheckpoint, work: WorkDir,
                 fmt: CheckpointFormat, dtype: torch.dtype, unbuilt: list[str]) -> ExportPlan:
    """export_plan with each layer's tensors read one at a time from the work files, those outside the layers
    from the checkpoint, then `unbuilt` (unbuilt_layer_tensors: already under the checkpoint's names)."""
    per_layer = work.tensor_sizes()
    owner = {key: i for i, sizes in enumerate(per_layer) for key, _ in sizes}

    def load_layer(key: str) -> torch.Tensor:
        with safe_open(work.layer_file(owner[key]), "pt") as f:
            return f.get_tensor(key)

    sizes, spec, load = export_plan(model, adapter, fmt, dtype, [[k for k, _ in sizes] for sizes in per_layer],
                                    work.tensor_specs(), load_layer,
                                    lambda key: cast_dense(read_outside_tensor(model, ckpt, key), dtype))
    if not unbuilt:
        return sizes, spec, load
    log.info("the export carries %d tensors of layers the model does not build (multi-token prediction), "
             "unquantized and left out of its quantization scheme", len(unbuilt))
    extra = {}
    for key in unbuilt:
        stored, shape = ckpt.stored_spec(key)
        kept = SAFETENSORS_DTYPES[stored]  # as cast_dense writes it: floats in the export dtype, the rest as stored
        extra[key] = (dtype if kept.is_floating_point else kept, shape)
        sizes.append((key, math.prod(shape) * extra[key][0].itemsize))
    return (sizes, lambda name: extra[name] if name in extra else spec(name),
            lambda name: cast_dense(ckpt.read([name], widen_to=dtype)[name], dtype) if name in extra else load(name))


def unbuilt_layer_tensors(model: nn.Module, adapter: ArchAdapter, ckpt: SafetensorsCheckpoint) -> list[str]:
    """The checkpoint's tensors of decoder layers past the model's depth: DeepSeek-V3's multi-token-prediction
    layer (config.num_nextn_predict_layers; transformers does not build it). The export carries them unquantized in
    its dtype (FP8 dequantized) and its quantization_config leaves their linears out, as vLLM's MTP drafter, built
    with the export's quantization scheme, then reads them."""
    unbuilt = unbuilt_layers(list(ckpt.weight_map), adapter.layers, len(adapter.get_layers(model)))
    return [name for name in unbuilt if not name.endswith(SCALE_SUFFIX)]


def unbuilt_linears(names: list[str]) -> list[str]:
    """The module names of those tensors' weights that are not norms (the ignore list's entries)."""
    return [name.removesuffix(".weight") for name in names if name.endswith(".weight") and "norm" not in name]


def _settings(config: QuantConfig, fmt_name: str, torch_dtype: torch.dtype, model: nn.Module,
              device: torch.device, batch_size: int) -> dict:
    work_dtype = next(model.parameters()).dtype
    return {"quant": config.to_dict(), "format": fmt_name, "export_dtype": str(torch_dtype),
            "work_dtype": str(work_dtype), "device": device.type, "batch_size": batch_size}


@dataclass(frozen=True)
class StreamedRun:
    """One streamed `quantkit quantize`: what it writes and how it runs (the CLI builds it from its flags).

    `offload_dir`: where the calibration hidden states go when neither the device nor the host holds them.
    `resume_interval`: seconds between the saves of the hidden states a resume starts from (0: every layer).
    `ranks`: the processes sharing the run (quantkit.distributed); rank 0 alone writes the work folder and the export,
    the others read the resume's hidden states from it."""

    config: QuantConfig
    fmt_name: str
    output: Path
    dtype: str = "auto"
    device: torch.device | str | None = None
    batch_size: int = 8
    overwrite: bool = False
    resume: bool = True
    show_progress: bool = True
    offload_dir: Path | None = None
    resume_interval: float = RESUME_INTERVAL_S
    ranks: Ranks = SINGLE


def quantize_streaming(model: PreTrainedModel, ckpt: SafetensorsCheckpoint, tokenizer, calib: CalibrationSet,
                       run: StreamedRun, layer_source: StreamedLayers | None = None) -> tuple[Path, QuantReport | None]:
    """Quantize the skeleton from open_streamed_model layer by layer and write the export at run.output;
    `layer_source` replaces the checkpoint's layer reader (tests count and crash its reads).
    Returns the output and the report (None when an earlier run of the same command had already
    published the export and was stopped while cleaning up)."""
    config, fmt_name, dtype, batch_size, ranks = run.config, run.fmt_name, run.dtype, run.batch_size, run.ranks
    fmt = get_format(fmt_name)
    fmt.check(config)
    output = Path(run.output).expanduser().resolve()
    adapter = get_adapter(model)
    config = config.for_model(model, adapter)  # the skeleton's shapes are the checkpoint's
    torch_dtype = export_dtype(model, dtype)
    warn_on_scale_rounding(config, torch_dtype)
    device = torch.device(run.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    settings = _settings(config, fmt_name, torch_dtype, model, device, batch_size)
    work = WorkDir(work_dir_for(output), run_key(ckpt.fingerprint(), settings, calib), run.resume_interval)
    if output.exists() and work.published():
        if ranks.writer:
            log.warning("%s already holds this run's export; removing the leftover %s", output, work.path)
            work.remove()
        return output, None
    check_output_target(output, run.overwrite)
    unfuse_experts(model, adapter)  # the layers' per-expert names, which the checkpoint must hold
    layer_source = layer_source or StreamedLayers(ckpt, adapter, next(model.parameters()).dtype,
                                                 read_ahead=device.type == "cuda")
    layer_source.check_complete(adapter.get_layers(model))
    with _disk_errors(work.path):
        if ranks.writer:
            output.parent.mkdir(parents=True, exist_ok=True)
        start = ranks.from_writer(work.open(run.resume) if ranks.writer else None)

        def on_layer_done(index: int, layer: nn.Module, all_outputs: Callable[[], list[torch.Tensor] | None],
                          entry: dict) -> None:
            outputs = all_outputs() if ranks.from_writer(work.hidden_due() if ranks.writer else None) else None
            if ranks.writer:
                pause_between_phases()
                work.save_layer(index, layer_export_tensors(index, layer, adapter, fmt, torch_dtype), outputs, entry)

        try:
            hooks = LayerHooks(layer_source, on_layer_done, start, work.hidden_states(start) if start else None,
                               lambda: release_outside_layers(model, adapter, ckpt), ranks,
                               lambda name: read_outside_tensor(model, ckpt, name))
            report = quantize_model(model, adapter, calib, config, device=device, batch_size=batch_size,
                                    show_progress=run.show_progress, offload_dir=run.offload_dir, hooks=hooks)
        except BaseException:
            work.flush(raising=False)  # what finished before the failure stays for the resume
            raise
        if ranks.writer:
            work.flush()
            report.layers = work.entries()
            assembly = time.perf_counter()
            _write_export(model, adapter, ckpt, tokenizer, config, fmt_name, torch_dtype, report, work, output)
            report.timings["export assembly"] = time.perf_counter() - assembly
        ranks.barrier()  # the export is in place when any rank returns
    return output, report


def _write_export(model: PreTrainedModel, adapter: ArchAdapter, ckpt: SafetensorsCheckpoint, tokenizer,
                  config: QuantConfig, fmt_name: str, torch_dtype: torch.dtype, report: QuantReport, work: WorkDir,
                  output: Path) -> None:
    """Assemble the export inside the work folder, rename it to `output`, then drop the work folder."""
    folder = work.path / "export"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir()
    pause_between_phases()
    unbuilt = unbuilt_layer_tensors(model, adapter, ckpt)
    write_shards(folder, *_export_plan(model, adapter, ckpt, work, get_format(fmt_name), torch_dtype, unbuilt))
    write_metadata(folder, model, tokenizer, config, fmt_name, torch_dtype, report.to_dict(),
                   also_ignored=unbuilt_linears(unbuilt))
    pause_between_phases()
    apply_umask(folder)
    work.mark_published()
    replace_atomically(folder, output)
    work.remove()
