"""The layer-sequential calibration engine (GPTQModel's looper, llm-compressor's sequential pipeline).

1. Run the model's embeddings on the calibration set and capture, for every decoder layer, the
   keyword arguments it is called with (masks, rotary embeddings: they differ per layer type in
   Gemma3) and the hidden states entering layer 0.
2. Per layer, on the work device: the method's smoothing step; then for each sequential step,
   hook the step's linears, run the layer over the calibration batches feeding each hook the
   non-padding tokens, quantize those linears and write their dequantized weights back; finally
   recompute the layer's outputs (the next layer's inputs) with every linear quantized; the no-harm guard
   (quantkit.layer_guard) compares their error with plain RTN's of the untouched layer and falls back to RTN
   where RTN's is lower; swap the linears for QuantLinear modules and move the layer back to the CPU.
Only the layer being worked on, its statistics and the hidden states live on the work device.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Protocol

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn

from quantkit.config import QuantConfig
from quantkit.data import CalibrationSet
from quantkit.distributed import SINGLE, Ranks, batch_share
from quantkit.layer_guard import Snapshot, guard_layer
from quantkit.models.adapters import ArchAdapter
from quantkit.models.moe import (
    LayerCalibration,
    layer_calibration,
)
from quantkit.nn.qlinear import QuantLinear
from quantkit.qtensor import QuantizationError, QuantizedWeight
from quantkit.quantizers.base import LinearQuantizer, Method, get_method
from quantkit.quantizers.context import LayerContext, StopForward

log = logging.getLogger("quantkit")

# at most this share of the device's free memory holds a step's statistics (GPTQ's Hessians); the rest is the
# solves' working copies and the forwards'
STATISTICS_FRACTION = 0.4


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
            raise StopForward
        return hidden_states


@dataclass
class QuantReport:
    scheme: QuantConfig  # as resolved for the model: what export_checkpoint takes
    layers: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase, summed over layers
    calibration_tokens: int = 0
    head: dict | None = None  # quantize_head's entry, where the scheme quantizes lm_head

    @property
    def fallbacks(self) -> list[str]:
        """One line per linear that fell back (to RTN, or to stronger dampening), from the layer entries."""
        return [f"layer {e['layer']} {name}: {info['fallback']}" for e in self.layers
                for name, info in e["linears"].items() if info.get("fallback")]

    def to_dict(self) -> dict:
        return {"config": self.scheme.to_dict(), "layers": self.layers, "fallbacks": self.fallbacks,
                "seconds": self.seconds, "timings": self.timings, "calibration_tokens": self.calibration_tokens,
                **({"head": self.head} if self.head is not None else {})}


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
    model: nn.Module, adapter: ArchAdapter, calib: CalibrationSet, device: torch.device, batch_size: int,
    batches: list[int] | None = None,
) -> tuple[list[torch.Tensor], list[list[dict]], list[torch.Tensor]]:
    """Hidden states entering layer 0, each layer's call kwargs, and token masks, per batch (every one, or those
    whose indices `batches` lists)."""
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
        for index, (ids, mask) in enumerate(_batches(calib, batch_size)):
            if batches is not None and index not in batches:
                continue
            masks.append(mask.to(device).bool())
            try:
                base(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
            except StopForward:
                pass
    finally:
        hook.remove()
        base.to(base_device)  # before the layers return: streamed ones are on the meta device
        for i, layer in enumerate(originals):
            layers[i] = layer
    return first_inputs, sinks, masks


class LayerSource(Protocol):
    """Where a decoder layer's weights come from: loaded onto the work device before its step, released after it."""

    def load(self, index: int, layer: nn.Module, device: torch.device) -> None: ...

    def release(self, index: int, layer: nn.Module) -> None: ...


class _ResidentLayers:
    """The in-memory path: every layer is already loaded and stays in the model."""

    def load(self, index: int, layer: nn.Module, device: torch.device) -> None:
        layer.to(device)

    def release(self, index: int, layer: nn.Module) -> None:
        layer.to("cpu")


@dataclass(frozen=True)
class LayerHooks:
    """How a run reaches its layers and what it does around them (quantkit.streaming sets them; the defaults are the
    in-memory path): `source` loads layer i's weights before its step and releases them after;
    `on_layer_done(i, layer, all_outputs, entry)` sees each finished layer, still on the device, before its release
    (`all_outputs()`: the layer's outputs of every batch on the writer, None on the other ranks; every rank calls it
    or none does);
    a resumed run starts at `start_layer` with `hidden_states` (the inputs of that layer per batch) instead of the
    captured layer-0 inputs; `on_inputs_captured()` runs once the model outside the decoder layers has done its
    part; with several `ranks` (quantkit.distributed), each solves its share of every step; `read_outside(name)`
    reads a tensor outside the layers that on_inputs_captured released (a quantized head's weight)."""

    source: LayerSource = field(default_factory=_ResidentLayers)
    on_layer_done: Callable[[int, nn.Module, Callable[[], list[torch.Tensor] | None], dict], None] | None = None
    start_layer: int = 0
    hidden_states: list[torch.Tensor] | None = None
    on_inputs_captured: Callable[[], None] | None = None
    ranks: Ranks = SINGLE
    read_outside: Callable[[str], torch.Tensor] | None = None


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
    ctx: LayerContext, method: Method, names: list[str], timer: _PhaseTimer, calibration: LayerCalibration,
) -> dict[str, QuantizedWeight]:
    """Quantize one sequential step's linears: their statistics, then their solves, a part of the step at a time
    where the statistics of all of it would not fit (an MoE layer's experts: 256 Hessians of 7168^2 are 52 GB).
    The parts' results equal the whole step's: the step's linears read inputs none of them writes. With several
    ranks, each gathers and solves its share of a part's groups, then all take every result."""
    ranks = ctx.share.ranks
    linears = {n: ctx.module(n) for n in names}
    quantizers = {n: calibration.quantizer(method, lin, n, ctx.index) for n, lin in linears.items()}
    shared = _same_input_sharers(ctx.adapter, quantizers)
    groups = [[owner, *(sharer for sharer, its_owner in shared.items() if its_owner == owner)]
              for owner in quantizers if owner not in shared]  # an owner, then the linears taking its statistics
    cost = {group[0]: sum(linears[n].weight.numel() for n in group) for group in groups}
    results: dict[str, QuantizedWeight] = {}
    for part in _statistics_parts(groups, quantizers, ctx.device):
        owners = ranks.owners(part, cost)
        mine = [group for group, owner in zip(part, owners, strict=True) if owner == ranks.rank]
        if method.needs_activations and ctx.share.split:
            _gather_shared_statistics(ctx, {group[0]: owner for group, owner in zip(part, owners, strict=True)},
                                      linears, quantizers, timer)
        elif method.needs_activations and mine:
            _gather_statistics(ctx, [group[0] for group in mine], linears, quantizers, timer)
        for group in mine:
            for sharer in group[1:]:
                quantizers[sharer].take_statistics(quantizers[group[0]])
        with timer("solve"):
            solved = ranks.exchange(_solve(ctx, mine, quantizers), ctx.device)
        for n in (n for group in part for n in group):
            quantizers[n].free()
            linears[n].weight.data.copy_(solved[n].dequantize(linears[n].weight.dtype))
        results |= solved
    return {n: results[n] for n in quantizers}


def _statistics_parts(groups: list[list[str]], quantizers: dict[str, LinearQuantizer],
                      device: torch.device) -> list[list[list[str]]]:
    """The step's groups cut into parts whose statistics fit STATISTICS_FRACTION of the device's free memory."""
    from quantkit.streaming.hidden import device_available  # quantkit.streaming imports this module

    budget = STATISTICS_FRACTION * device_available(device)
    parts: list[list[list[str]]] = [[]]
    used = 0
    for group in groups:
        size = quantizers[group[0]].statistics_bytes()
        if parts[-1] and used + size > budget:
            parts.append([])
            used = 0
        parts[-1].append(group)
        used += size
    if len(parts) > 1:
        log.info("a step's statistics exceed %.1f GiB: gathered and solved in %d parts", budget / 2**30, len(parts))
    return parts


def _gather_statistics(ctx: LayerContext, owners: list[str], linears: dict[str, nn.Module],
                       quantizers: dict[str, LinearQuantizer], timer: _PhaseTimer) -> None:
    handles = [linears[n].register_forward_hook(
        lambda _m, args, _o, n=n: quantizers[n].add_batch(ctx.real_tokens(args[0]))) for n in owners]
    try:
        with timer("forward+statistics"):
            ctx.run_until(owners)  # hooks registered first run first: statistics before the stop
    finally:
        for h in handles:
            h.remove()


def _gather_shared_statistics(ctx: LayerContext, owners: dict[str, int], linears: dict[str, nn.Module],
                              quantizers: dict[str, LinearQuantizer], timer: _PhaseTimer) -> None:
    """Split batches: at each step this rank runs its batch (if it has one left) and keeps every group's inputs;
    each group's owner is then fed every rank's, in batch order (Ranks.deliver)."""
    produced: dict[str, list[torch.Tensor]] = {}
    handles = [linears[n].register_forward_hook(
        lambda _m, args, _o, n=n: produced[n].append(ctx.real_tokens(args[0]))) for n in owners]
    try:
        with timer("forward+statistics"):
            for position in ctx.stepwise():
                produced.update({n: [] for n in owners})
                if position is not None:
                    ctx.run_until(list(owners), [position])
                ctx.share.ranks.deliver(produced, owners, ctx.share, ctx.device,
                                        lambda n, x: quantizers[n].add_batch(x))
    finally:
        for h in handles:
            h.remove()


def _solve(ctx: LayerContext, groups: list[list[str]],
           quantizers: dict[str, LinearQuantizer]) -> dict[str, QuantizedWeight]:
    """Each quantizer class's groups solved together (GPTQ: side by side). The caller puts the dequantized weights
    into the linears, which later steps' inputs are computed with."""
    by_class: dict[type[LinearQuantizer], list[list[str]]] = {}
    for group in groups:
        by_class.setdefault(type(quantizers[group[0]]), []).append(group)
    results = {}
    for cls, members in by_class.items():
        try:
            solved = cls.quantize_groups([[quantizers[n] for n in group] for group in members])
        except QuantizationError as err:
            raise QuantizationError(f"layer {ctx.index}: {err}") from err
        results |= zip((n for group in members for n in group), (r for rs in solved for r in rs), strict=True)
    return results


def _guard_fits(layer: nn.Module, device: torch.device, index: int) -> bool:
    """Whether the no-harm guard's copies fit beside the layer: its snapshot (at most the layer's bytes), RTN's codes
    and scales, and one linear's weight made at a time (layer_guard). Where they do not, the guard is skipped, logged
    and in the report."""
    from quantkit.streaming.hidden import device_available  # quantkit.streaming imports this module

    sizes = [t.numel() * t.element_size() for t in layer.state_dict().values()]
    need = sum(sizes) * 5 // 4 + 2 * max(sizes)
    if need <= device_available(device):
        return True
    log.warning("layer %d: the no-harm guard needs %.1f GiB beside the layer, more than %s has free: skipped",
                index, need / 2**30, device)
    return False


def _same_input_sharers(adapter: ArchAdapter, quantizers: dict[str, LinearQuantizer]) -> dict[str, str]:
    """Linear -> the linear of the same step whose statistics it takes: the adapter's fused groups read one input
    (q/k/v, gate/up, per expert), so one accumulation (GPTQ: one Hessian) serves the group."""
    shared = {}
    for group in adapter.fused:
        present = [n for n in group if n in quantizers]
        for name in present[1:]:
            if quantizers[name].shares_statistics_with(quantizers[present[0]]):
                shared[name] = present[0]
    return shared


def _memory_note(device: torch.device) -> str:
    """Peak host RSS always (streaming bounds it), and peak GPU memory on a GPU."""
    import resource

    note = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB peak RSS"
    if device.type == "cuda":
        note += f", {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB peak GPU"
    return note


def quantize_model(
    model: nn.Module,
    adapter: ArchAdapter,
    calib: CalibrationSet,
    config: QuantConfig,
    device: torch.device | str | None = None,
    batch_size: int = 8,
    show_progress: bool = True,
    offload_dir: Path | None = None,
    hooks: LayerHooks = LayerHooks(),
) -> QuantReport:
    """Quantize every decoder-layer linear of `model` in place, layer by layer; returns the report.

    The hidden states wait between layers on the device, in host memory or under `offload_dir`
    (quantkit.streaming.hidden picks the first that fits); `hooks` (LayerHooks) stream the layers.
    """
    from quantkit.streaming.hidden import open_store  # quantkit.streaming imports this module

    adapter = adapter.for_config(model.config)  # MoE: one name per expert (get_adapter(model) did it already)
    config = config.validate().for_model(model, adapter)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    method = get_method(config)
    report = QuantReport(scheme=config, calibration_tokens=calib.n_tokens if method.needs_calibration else 0)
    start = time.perf_counter()
    timer = _PhaseTimer(device, report.timings)
    calibration = layer_calibration(adapter, config.moe_all_tokens)
    calibration.prepare(model)
    layers = adapter.get_layers(model)
    ranks = hooks.ranks
    # No batches for a method that reads no calibration data: every per-layer forward is then empty.
    share = batch_share(ranks, -(-len(calib) // batch_size) if method.needs_calibration else 0,
                        method.splits_batches)
    if share.split:
        log.info("rank %d of %d: calibration batches %s of %d", ranks.rank, ranks.world, share.ids, share.total)
    inputs, layer_kwargs, masks = [], [[] for _ in layers], []
    if method.needs_calibration:
        log.info("capturing the first layer's inputs (%d calibration samples)", len(calib))
        with timer("capture"):
            inputs, layer_kwargs, masks = capture_layer_inputs(model, adapter, calib, device, batch_size, share.ids)
    if hooks.hidden_states is not None:
        inputs = [hooks.hidden_states[j] for j in share.ids]
    if hooks.on_inputs_captured is not None:
        hooks.on_inputs_captured()
    store = open_store(inputs, layers, device, offload_dir)
    inputs = store.hold(inputs)
    guarded = method.needs_calibration and method.rtn_guard
    layers_start = time.perf_counter()
    progress = Progress(TextColumn("[bold]quantizing {task.fields[method]}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TextColumn("{task.fields[note]}"),
                        disable=not (show_progress and ranks.writer))
    with progress, store:
        task = progress.add_task("layers", total=len(layers), completed=hooks.start_layer, method=config.method,
                                 note="")
        for i, layer in enumerate(layers):
            if i < hooks.start_layer:
                continue
            t0 = time.perf_counter()
            with timer("transfer"):
                hooks.source.load(i, layer, device)
            ctx = LayerContext(i, layer, adapter, inputs, _move(layer_kwargs[i], device), masks, device, share=share)
            calibration.attach(layer, ctx)
            original = Snapshot(layer) if guarded and _guard_fits(layer, device, i) else None
            with timer("smooth"):
                entry: dict = {"layer": i, "smoothing": method.smooth_layer(ctx), "linears": {}}
            if guarded and original is None:
                entry["guard"] = "skipped: the layer's copies do not fit"
            results: dict[str, QuantizedWeight] = {}
            for step in adapter.sequential:
                results.update(_quantize_step(ctx, method, [n for n in step if _has(layer, n)], timer, calibration))
            outputs, routing = _layer_outputs(ctx, store, timer, calibration)
            if original is not None:
                with timer("guard"):
                    entry["guard"], fallback = guard_layer(ctx, original, results, outputs, config)
                del original
                if fallback is not None:
                    results = fallback
                    outputs.release()
                    outputs, routing = _layer_outputs(ctx, store, timer, calibration)
            inputs.release()
            inputs = outputs
            entry |= ranks.summed(routing, share)
            if not all(ranks.in_batch_order([bool(torch.isfinite(x).all()) for x in inputs], share)):
                raise QuantizationError(f"layer {i} produced non-finite outputs after quantization")
            _swap_in_quantlinears(layer, results, config.act_bits, device)
            entry["linears"] = {name: qw.info for name, qw in results.items()}
            calibration.check(layer, i)
            entry["seconds"] = time.perf_counter() - t0
            report.layers.append(entry)
            if hooks.on_layer_done is not None:  # the layer still on the device: packing is fast there
                hooks.on_layer_done(i, layer, partial(ranks.gather_batches, inputs, share), entry)
            with timer("transfer"):
                hooks.source.release(i, layer)
            done = i + 1 - hooks.start_layer
            note = f"{entry['seconds']:.1f}s/layer, ETA {_eta(layers_start, done, len(layers) - hooks.start_layer)}, " \
                   f"{_memory_note(device)}"
            progress.update(task, advance=1, note=note)
            if ranks.writer and not progress.console.is_terminal:  # a log file: one line per layer instead of a bar
                log.info("layer %d/%d quantized: %s", i + 1, len(layers), note)
        if config.quantize_head:
            with timer("head"):
                ctx = LayerContext(len(layers), _HeadStep(model, adapter, device, hooks.read_outside), adapter,
                                   inputs, [{} for _ in masks], masks, device, share=share)
                report.head = quantize_head(model, adapter, ctx, method, timer, calibration)
    model.config.use_cache = True
    report.seconds = time.perf_counter() - start
    return report


class _StatisticsOnly(nn.Linear):
    """lm_head's weight for its quantizer, on the work device. Its forward passes its input on: the statistics hooks
    read the input, and a 70B head's logits of one calibration batch would be gigabytes nobody reads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _HeadStep(nn.Module):
    """The final norm and lm_head as one more step of the engine (its own LayerContext): the head calibrates on the
    normed hidden states after the last layer, gathered as any layer's linears are (several ranks included).
    Tensors the model no longer holds (a streamed run releases them after the capture) come from `read_outside`."""

    def __init__(self, model: nn.Module, adapter: ArchAdapter, device: torch.device,
                 read_outside: Callable[[str], torch.Tensor] | None) -> None:
        super().__init__()

        def real(name: str, tensor: torch.Tensor) -> torch.Tensor:
            return read_outside(name) if tensor.is_meta else tensor.detach()

        self.norm = copy.deepcopy(model.get_submodule(adapter.outer.final_norm))
        for name, parameter in list(self.norm.named_parameters()):
            owner, _, leaf = name.rpartition(".")
            value = real(f"{adapter.outer.final_norm}.{name}", parameter)
            setattr(self.norm.get_submodule(owner) if owner else self.norm, leaf, nn.Parameter(value, False))
        self.norm.to(device)
        head = model.get_submodule(adapter.outer.lm_head)
        # a copy: the solve writes its dequantized weight here, and the model's may be the (tied) embeddings
        weight = real(f"{adapter.outer.lm_head}.weight", head.weight).to(device, torch.float32, copy=True)
        self.head = _StatisticsOnly(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.head.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if head.bias is None else real(f"{adapter.outer.lm_head}.bias", head.bias)
        self.dtype, self.on_meta = head.weight.dtype, head.weight.is_meta

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(hidden_states))


def quantize_head(model: nn.Module, adapter: ArchAdapter, ctx: LayerContext, method: Method, timer: _PhaseTimer,
                  calibration: LayerCalibration) -> dict:
    """lm_head replaced by a QuantLinear of the scheme: the method's quantizer on the normed hidden states after the
    last layer (GPTQ's Hessian; RTN and FP8 need none), on the work device; a head tied to the embeddings is untied
    (they stay 16-bit). Returns the report's entry."""
    step: _HeadStep = ctx.layer
    qw = _quantize_step(ctx, method, ["head"], timer, calibration)["head"]
    quantized = QuantLinear.from_quantized(qw.to("cpu"), step.bias, step.dtype, act_bits=method.config.act_bits)
    device = model.get_submodule(adapter.outer.lm_head).weight.device
    _replace_module(model, adapter.outer.lm_head, quantized if step.on_meta else quantized.to(device))
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    model.config.tie_word_embeddings = False  # the export's config: the head is its own tensors now
    log.info("lm_head [%d x %d] quantized by %s%s", *qw.shape, method.name,
             ", untied from the embeddings" if tied else "")
    return {"shape": list(qw.shape), "method": method.name, "untied": tied, **qw.info}


def _layer_outputs(ctx: LayerContext, store, timer: _PhaseTimer,
                   calibration: LayerCalibration) -> tuple[list[torch.Tensor], dict]:
    """The layer's outputs per batch (the next layer's inputs) and the report's routing entries (MoE: the tokens
    its router sent each expert)."""
    with timer("forward (layer outputs)"), calibration.counting(ctx.layer) as routing:
        outputs = ctx.forward(store.empty())
    return outputs, routing


def _swap_in_quantlinears(layer: nn.Module, results: dict[str, QuantizedWeight], act_bits: int,
                          device: torch.device) -> None:
    """Replace each quantized linear by its QuantLinear, packed on the work device (fast) and moved to the CPU
    with the layer. A function of its own so that no loop variable keeps the last replaced linear (its fp32
    weight: 16 MB for a 1024 x 4096 down_proj) alive through the next layer's step."""
    for name, qw in results.items():
        linear = layer.get_submodule(name)
        qlinear = QuantLinear.from_quantized(qw, None if linear.bias is None else linear.bias.detach(),
                                             linear.weight.dtype, act_bits=act_bits).to(device)
        _replace_module(layer, name, qlinear)


def _eta(start: float, done: int, total: int) -> str:
    seconds = (time.perf_counter() - start) / done * (total - done)
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def _has(layer: nn.Module, name: str) -> bool:
    try:
        return isinstance(layer.get_submodule(name), nn.Linear)
    except AttributeError:
        return False
