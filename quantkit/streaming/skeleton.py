"""A model whose decoder layers hold no weights until their step: a meta-device skeleton, the tensors
calibration needs outside the layers (embeddings, final norm, head), and one layer at a time."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from quantkit.models.adapters import ArchAdapter
from quantkit.qtensor import QuantizationError
from quantkit.streaming.checkpoint import BlockScaledFp8, SafetensorsCheckpoint, StoredTensor

log = logging.getLogger("quantkit")


def build_skeleton(source: str, dtype: torch.dtype) -> PreTrainedModel:
    """The model with every parameter on the meta device (buffers such as rotary tables are real), its
    config and generation config read as from_pretrained reads them (config.json comes out the same)."""
    config = AutoConfig.from_pretrained(source)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    try:
        model.generation_config = GenerationConfig.from_pretrained(source)
    except OSError:
        pass  # no generation_config.json: keep the one derived from the model config
    return model.eval()


def set_tensor(root: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = root.get_submodule(owner)
    if leaf in module._parameters:
        module._parameters[leaf] = value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value


def load_outside_layers(model: PreTrainedModel, ckpt: SafetensorsCheckpoint, adapter: ArchAdapter) -> None:
    """Materialize the tensors outside the decoder layers (embeddings, final norm, head), then tie."""
    dtype = next(model.parameters()).dtype
    layer_prefix = adapter.layers + "."
    wanted = [n for n in model.state_dict(keep_vars=True) if not n.startswith(layer_prefix)]
    present = [n for n in wanted if n in ckpt.weight_map]
    for name, value in ckpt.read(present).items():
        set_tensor(model, name, value.to(dtype) if value.is_floating_point() else value)
    model.tie_weights()
    still_meta = [n for n, t in model.state_dict(keep_vars=True).items()
                  if t.is_meta and not n.startswith(layer_prefix)]
    if still_meta:
        raise QuantizationError(f"{ckpt.folder}: the checkpoint has no tensor {still_meta[0]!r}")


def release_outside_layers(model: PreTrainedModel, adapter: ArchAdapter, ckpt: SafetensorsCheckpoint) -> None:
    """Put the tensors load_outside_layers read back on the meta device once the calibration inputs are
    captured: the layers never use them, and the export reads them again one at a time
    (read_outside_tensor). Those the checkpoint lacks (buffers the model computes) stay; tied tensors stay
    tied: each distinct tensor gets one meta stand-in."""
    layer_prefix = adapter.layers + "."
    state = {n: t for n, t in model.state_dict(keep_vars=True).items() if not n.startswith(layer_prefix)}
    stored = {id(t) for n, t in state.items() if n in ckpt.weight_map and not t.is_meta}
    stand_ins: dict[int, torch.Tensor] = {}
    for name, tensor in state.items():
        if id(tensor) not in stored:
            continue
        if id(tensor) not in stand_ins:
            meta = tensor.detach().to("meta")
            stand_ins[id(tensor)] = nn.Parameter(meta, False) if isinstance(tensor, nn.Parameter) else meta
        set_tensor(model, name, stand_ins[id(tensor)])
    return_freed_memory()


def unbuilt_layers(names: list[str], layers: str, depth: int) -> list[str]:
    """Those of `names` that belong to decoder layers at or past `depth` under the `layers` module list."""
    prefix = layers + "."

    def index(name: str) -> int:
        part = name[len(prefix):].partition(".")[0]
        return int(part) if part.isdigit() else -1

    return [name for name in names if name.startswith(prefix) and index(name) >= depth]


def read_outside_tensor(model: PreTrainedModel, ckpt: SafetensorsCheckpoint, name: str) -> torch.Tensor:
    """Tensor `name` outside the layers, from the model if real, else as load_outside_layers loaded it
    (in the model's dtype) from the checkpoint, under whichever of its tied names the checkpoint uses."""
    state = model.state_dict(keep_vars=True)
    if not state[name].is_meta:
        return state[name]
    stored = next(n for n, t in state.items() if t is state[name] and n in ckpt.weight_map)
    value = ckpt.read([stored])[stored]
    return value.to(state[name].dtype) if value.is_floating_point() else value


class StreamedLayers:
    """Loads decoder layer i from the checkpoint just before its step and frees it after. With `read_ahead`
    (a GPU run, where host memory is not the limit), layer i+1's tensors are read from disk by a background
    thread while layer i computes: one more layer in host memory.

    For the memory-bound tests: `live` / `peak_live` count the layers holding real weights, `held` /
    `peak_held` the layers in host memory (those and the one read ahead)."""

    def __init__(self, ckpt: SafetensorsCheckpoint, adapter: ArchAdapter, dtype: torch.dtype,
                 read_ahead: bool = False) -> None:
        self.ckpt, self.adapter, self.dtype, self.read_ahead = ckpt, adapter, dtype, read_ahead
        self.live = self.peak_live = self.held = self.peak_held = 0
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quantkit-prefetch")
        self._prefetched: tuple[int, Future] | None = None

    def load(self, index: int, layer: nn.Module, device: torch.device) -> None:
        """Layer `index` onto `device`, straight from the tensors read (FP8 sources widened there)."""
        names = list(layer.state_dict(keep_vars=True))
        tensors = self._read(index, names)
        self._prefetch(index + 1, names)
        layer.to_empty(device=device)
        with torch.no_grad():
            for name, tensor in layer.state_dict(keep_vars=True).items():
                value = tensors.pop(name)
                # copy_ casts as from_pretrained(dtype=...) does
                tensor.copy_(value.widen(self.dtype, device) if isinstance(value, BlockScaledFp8) else value)
        self.live += 1
        self.peak_live = max(self.peak_live, self.live)

    def release(self, index: int, layer: nn.Module) -> None:
        layer.to("meta")
        self.live -= 1
        self.held -= 1
        return_freed_memory()

    def check_complete(self, layers: nn.ModuleList) -> None:
        """Every tensor of every layer is in the checkpoint (per expert, or in fused experts), said before any work:
        a missing expert would otherwise stop the run at its layer."""
        for index, layer in enumerate(layers):
            missing = [n for n in layer.state_dict(keep_vars=True) if not self._available(index, n)]
            if missing:
                raise QuantizationError(f"{self.ckpt.folder}: the checkpoint has no tensor "
                                        f"{self._on_disk(index, missing[0])!r} ({len(missing)} missing in layer {index})")

    def _on_disk(self, index: int, name: str) -> str:
        """The checkpoint's name of the layer's tensor `name` (MoE experts: quantkit's per-expert names, which
        the architecture's checkpoints write per expert too, Mixtral's under its own names)."""
        return self.adapter.checkpoint_name(f"{self.adapter.layers}.{index}.{name}")

    def _fused_source(self, index: int, name: str) -> tuple[str, int, int | None] | None:
        """Where a per-expert tensor lies in a checkpoint holding transformers 5's fused 3-D experts: the fused
        tensor's name, the expert, and which half of gate_up_proj's rows (0: the gate's, 1: up's; None for
        down_proj); None if it is not there."""
        spec = self.adapter.experts
        parts = name.split(".")
        if spec is None or not name.startswith(f"{spec.block}.experts.") or len(parts) != len(
                spec.block.split(".")) + 4 or not parts[-3].isdigit():
            return None
        expert, projection = int(parts[-3]), parts[-2]
        fused = f"{self.adapter.layers}.{index}.{spec.block}.experts."
        if projection == "down_proj":
            key, half = fused + "down_proj", None
        else:
            key, half = fused + "gate_up_proj", 0 if projection == "gate_proj" else 1
        return (key, expert, half) if key in self.ckpt.weight_map else None

    def _available(self, index: int, name: str) -> bool:
        return self._on_disk(index, name) in self.ckpt.weight_map or self._fused_source(index, name) is not None

    def _read_layer(self, index: int, names: list[str]) -> dict[str, StoredTensor]:
        """The layer's tensors by the layer's own names as stored (FP8 ones are widened on the work device), per-expert
        ones cut from fused experts where need be."""
        direct = {n: self._on_disk(index, n) for n in names if self._on_disk(index, n) in self.ckpt.weight_map}
        read = self.ckpt.read_stored(list(direct.values()))
        tensors = {n: read[disk] for n, disk in direct.items()}
        cut = {n: self._fused_source(index, n) for n in names if n not in direct}
        missing = [n for n, source in cut.items() if source is None]
        if missing:
            raise QuantizationError(f"{self.ckpt.folder}: the checkpoint has no tensor "
                                    f"{self._on_disk(index, missing[0])!r}")
        fused = self.ckpt.read(sorted({source[0] for source in cut.values()}))
        for name, (key, expert, half) in cut.items():
            tensors[name] = fused[key][expert] if half is None else fused[key][expert].chunk(2, dim=0)[half]
        return tensors

    def _read(self, index: int, names: list[str]) -> dict[str, StoredTensor]:
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None and prefetched[0] == index:
            return prefetched[1].result()
        self._count_held()
        return self._read_layer(index, names)

    def _count_held(self) -> None:
        self.held += 1
        self.peak_held = max(self.peak_held, self.held)

    def _prefetch(self, index: int, names: list[str]) -> None:
        """Layer `index`'s tensors, if it has the same names as this one (the last layer's next has none)."""
        if self.read_ahead and all(self._available(index, n) for n in names):
            self._count_held()
            self._prefetched = (index, self._reader.submit(self._read_layer, index, names))


# glibc's mmap threshold (M_MMAP_THRESHOLD), the size it is set to while streaming, and the most its dynamic
# adjustment raises it to on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX), where a long-running process settles
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 2**20
_DYNAMIC_THRESHOLD_MAX_BYTES = 32 * 2**20


def map_large_allocations() -> None:
    """Serve every allocation of 1 MiB or more with its own mapping, given back to the OS when freed.

    By default glibc raises this threshold to the largest block freed so far (up to 32 MiB), after which
    such tensors (a layer's weights, GPTQ's Hessians and factors) come from the heap, whose freed blocks
    stay resident until a trim; a fixed threshold also turns the dynamic raise off (mallopt(3)).
    Process-wide: set by open_streamed_model, whose whole point is a bounded resident set."""
    _set_mmap_threshold(_MMAP_THRESHOLD_BYTES)


@contextmanager
def large_allocations_mapped() -> Iterator[None]:
    """map_large_allocations for the block only: after it, blocks under 32 MiB come from the heap again, as glibc's
    dynamic threshold would have it (a mapping per tensor slowed the compute of a whole test worker by a quarter)."""
    map_large_allocations()
    try:
        yield
    finally:
        _set_mmap_threshold(_DYNAMIC_THRESHOLD_MAX_BYTES)
        return_freed_memory()


def _set_mmap_threshold(size: int) -> None:
    try:
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, size)
    except (OSError, AttributeError):  # not glibc: its own policy applies
        pass


def return_freed_memory() -> None:
    """Hand the freed layer back to the OS: with several threads allocating, glibc keeps freed blocks in
    per-thread arenas, and the resident set grew by about a layer per layer without this."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass
