"""The layer-sequential calibration engine (GPTQModel's looper, llm-compressor's sequential pipeline).

1. Run the model's embeddings on the calibration set and capture, for every decoder layer, the
   keyword arguments it is called with (masks, rotary embeddings: they differ per layer type in
   Gemma3) and the hidden states entering layer 0.
2. Per layer, on the work device: the method's smoothing step; then for each sequential step,
   hook the step's linears, run the layer over the calibration batches feeding each hook the
   non-padding tokens, quantize those linears and write their dequantized weights back; finally
   recompute the layer's outputs (the next layer's inputs) with every linear quantized, swap the
   linears for QuantLinear modules and move the layer back to the CPU.
Only the layer being worked on, its statistics and the hidden states live on the work device.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn

from quantkit.config import QuantConfig
from quantkit.data import CalibrationSet
from quantkit.models.adapters import ArchAdapter
from quantkit.nn.qlinear import QuantLinear
from quantkit.qtensor import QuantizationError, QuantizedWeight
from quantkit.quantizers.base import Method, get_method

log = logging.getLogger("quantkit")


class _StopForward(Exception):
    pass


class _LayerRecorder(nn.Module):
    """Stands in for a decoder layer during capture: records its call and passes hidden states on."""

    def __init__(self, index: int, sink: list[dict], stop: bool) -> None:
        super().__init__()
        self.index, self.sink, self.stop = index, sink, stop

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        if args:
            raise QuantizationError("decoder layers called with positional extras are not supported")
        kwargs = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value", "use_cache")}
        self.sink.append(kwargs)
        if self.stop:
            raise _StopForward
        return hidden_states


@dataclass
class LayerContext:
    """One decoder layer and its calibration batches, handed to quantizers' smoothing step."""

    index: int
    layer: nn.Module
    adapter: ArchAdapter
    inputs: list[torch.Tensor]  # hidden states per batch [B, T, H]
    kwargs: list[dict]  # this layer's call kwargs per batch
    token_masks: list[torch.Tensor]  # bool [B, T] per batch, False on padding
    device: torch.device
    current_mask: torch.Tensor | None = None  # the batch being run, for hooks that drop padding

    def module(self, name: str) -> nn.Module:
        return self.layer.get_submodule(name)

    @torch.no_grad()
    def forward(self) -> list[torch.Tensor]:
        outputs = []
        for x, kwargs, mask in zip(self.inputs, self.kwargs, self.token_masks, strict=True):
            self.current_mask = mask
            out = self.layer(x, **kwargs)
            outputs.append(out[0] if isinstance(out, tuple) else out)
        self.current_mask = None
        return outputs

    @torch.no_grad()
    def run_until(self, names: list[str]) -> None:
        """Run every batch only until each named module has run: statistics for the first linears
        of a layer need none of the layer's later (attention, MLP) work."""
        pending: set[str] = set()

        def done(_m, _args, _out, name: str) -> None:
            pending.discard(name)
            if not pending:
                raise _StopForward

        handles = [self.module(n).register_forward_hook(lambda m, a, o, n=n: done(m, a, o, n)) for n in names]
        try:
            for x, kwargs, mask in zip(self.inputs, self.kwargs, self.token_masks, strict=True):
                self.current_mask = mask
                pending.update(names)
                try:
                    self.layer(x, **kwargs)
                except _StopForward:
                    pass
        finally:
            self.current_mask = None
            for h in handles:
                h.remove()

    def real_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of x ([B, T, ...] or [B*T, ...]) for non-padding tokens of the running batch, flattened."""
        assert self.current_mask is not None, "real_tokens() is only valid inside forward()"
        flat = x.reshape(-1, x.shape[-1])
        return flat[self.current_mask.reshape(-1)]

    @contextmanager
    def capture_inputs(self, names: list[str]) -> Iterator[dict[str, list[torch.Tensor]]]:
        """While active, each forward() appends the non-padding inputs of the named modules."""
        captured: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        handles = [
            self.module(n).register_forward_hook(
                lambda _m, args, _out, n=n: captured[n].append(self.real_tokens(args[0]))
            )
            for n in names
        ]
        try:
            yield captured
        finally:
            for h in handles:
                h.remove()


@dataclass
class QuantReport:
    config: dict
    layers: list[dict] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase, summed over layers
    calibration_tokens: int = 0

    def to_dict(self) -> dict:
        return {"config": self.config, "layers": self.layers, "fallbacks": self.fallbacks,
                "seconds": self.seconds, "timings": self.timings, "calibration_tokens": self.calibration_tokens}


def _batches(calib: CalibrationSet, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for start in range(0, len(calib), batch_size):
        yield calib.input_ids[start:start + batch_size], calib.attention_mask[start:start + batch_size]


def _move(obj, device: torch.device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple | list):
        return type(obj)(_move(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _move(v, device) for k, v in obj.items()}
    return obj


@torch.no_grad()
def capture_layer_inputs(
    model: nn.Module, adapter: ArchAdapter, calib: CalibrationSet, device: torch.device, batch_size: int
) -> tuple[list[torch.Tensor], list[list[dict]], list[torch.Tensor]]:
    """Hidden states entering layer 0, each layer's call kwargs, and token masks, per batch."""
    layers = adapter.get_layers(model)
    originals = list(layers)
    sinks: list[list[dict]] = [[] for _ in originals]
    for i in range(len(originals)):
        layers[i] = _LayerRecorder(i, sinks[i], stop=i == len(originals) - 1)
    first_inputs: list[torch.Tensor] = []
    hook = layers[0].register_forward_pre_hook(lambda _m, args: first_inputs.append(args[0]))
    base = model.get_submodule(adapter.layers.rsplit(".", 1)[0])  # e.g. model.model
    base_device = next(model.parameters()).device
    base.to(device)  # embeddings and rotary tables; the decoder layers are recorders now
    masks = []
    try:
        for ids, mask in _batches(calib, batch_size):
            masks.append(mask.to(device).bool())
            try:
                base(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
            except _StopForward:
                pass
    finally:
        hook.remove()
        for i, layer in enumerate(originals):
            layers[i] = layer
        base.to(base_device)
    return first_inputs, sinks, masks


def _replace_module(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)


class _PhaseTimer:
    """Wall time per phase; synchronizes the device at phase boundaries so GPU work is attributed."""

    def __init__(self, device: torch.device, totals: dict[str, float]) -> None:
        self.device, self.totals = device, totals

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.totals[phase] = self.totals.get(phase, 0.0) + time.perf_counter() - start


def _quantize_step(
    ctx: LayerContext, method: Method, names: list[str], timer: _PhaseTimer
) -> dict[str, QuantizedWeight]:
    linears = {n: ctx.module(n) for n in names}
    quantizers = {n: method.linear_quantizer(lin) for n, lin in linears.items()}
    if method.needs_activations:
        handles = [
            lin.register_forward_hook(lambda _m, args, _o, n=n: quantizers[n].add_batch(ctx.real_tokens(args[0])))
            for n, lin in linears.items()
        ]
        try:
            with timer("forward+statistics"):
                ctx.run_until(names)  # hooks registered first run first: statistics before the stop
        finally:
            for h in handles:
                h.remove()
    results = {}
    with timer("solve"):
        for n, q in quantizers.items():
            try:
                qw = q.quantize()
            except QuantizationError as err:
                raise QuantizationError(f"layer {ctx.index} {n}: {err}") from err
            q.free()
            linears[n].weight.data.copy_(qw.dequantize(linears[n].weight.dtype))
            results[n] = qw
    return results


def _memory_note(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB peak GPU"
    import resource

    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB peak RSS"


def quantize_model(
    model: nn.Module,
    adapter: ArchAdapter,
    calib: CalibrationSet,
    config: QuantConfig,
    device: torch.device | str | None = None,
    batch_size: int = 8,
    show_progress: bool = True,
) -> QuantReport:
    """Quantize every decoder-layer linear of `model` in place, layer by layer; returns the report."""
    config.validate()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    method = get_method(config)
    report = QuantReport(config=config.to_dict(), calibration_tokens=calib.n_tokens if method.needs_calibration else 0)
    start = time.perf_counter()
    timer = _PhaseTimer(device, report.timings)
    layers = adapter.get_layers(model)
    # No batches for a method that reads no calibration data: every per-layer forward is then empty.
    inputs, layer_kwargs, masks = [], [[] for _ in layers], []
    if method.needs_calibration:
        with timer("capture"):
            inputs, layer_kwargs, masks = capture_layer_inputs(model, adapter, calib, device, batch_size)
    progress = Progress(TextColumn("[bold]quantizing {task.fields[method]}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TextColumn("{task.fields[note]}"), disable=not show_progress)
    with progress:
        task = progress.add_task("layers", total=len(layers), method=config.method, note="")
        for i, layer in enumerate(layers):
            t0 = time.perf_counter()
            with timer("transfer"):
                layer.to(device)
            ctx = LayerContext(i, layer, adapter, inputs, _move(layer_kwargs[i], device), masks, device)
            with timer("smooth"):
                entry: dict = {"layer": i, "smoothing": method.smooth_layer(ctx), "linears": {}}
            results: dict[str, QuantizedWeight] = {}
            for step in adapter.sequential:
                results.update(_quantize_step(ctx, method, [n for n in step if _has(layer, n)], timer))
            with timer("forward (layer outputs)"):
                inputs = ctx.forward()
            if not all(torch.isfinite(x).all() for x in inputs):
                raise QuantizationError(f"layer {i} produced non-finite outputs after quantization")
            for name, qw in results.items():
                linear = layer.get_submodule(name)
                # packed on the work device (fast), moved to the CPU with the layer below
                qlinear = QuantLinear.from_quantized(
                    qw, None if linear.bias is None else linear.bias.detach(), linear.weight.dtype,
                    act_bits=config.act_bits).to(device)
                _replace_module(layer, name, qlinear)
                entry["linears"][name] = qw.info
                if qw.info.get("fallback"):
                    report.fallbacks.append(f"layer {i} {name}: {qw.info['fallback']}")
            with timer("transfer"):
                layer.to("cpu")
            entry["seconds"] = time.perf_counter() - t0
            report.layers.append(entry)
            progress.update(task, advance=1, note=f"{entry['seconds']:.1f}s/layer, {_memory_note(device)}")
    model.config.use_cache = True
    report.seconds = time.perf_counter() - start
    return report


def _has(layer: nn.Module, name: str) -> bool:
    try:
        return isinstance(layer.get_submodule(name), nn.Linear)
    except AttributeError:
        return False
