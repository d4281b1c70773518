"""Where the calibration hidden states wait between decoder layers (issue #29).

On the work device when a layer's inputs and outputs fit beside the layer's own needs; else in host
memory (pinned on a GPU run, for fast copies); else in memory-mapped files under --offload-dir. Each
batch goes to the work device only while the layer runs it. Buffers are recycled from one layer to
the next: every layer's states have the same shapes, so a run allocates its pinned memory or files once.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger("quantkit")

PLACEMENTS = ("device", "host", "disk")
# Work-device memory a layer needs besides the hidden states, per byte of its weights: the weights,
# their GPTQ/AWQ statistics and the dequantized copies written back (a rough bound, not a measurement).
LAYER_HEADROOM = 3
FORWARD_RESERVE = 2 * 2**30  # the layer's activations on one calibration batch, and allocator slack
HOST_FRACTION = 0.8  # of the available host memory, the rest left to the layer and the export writer

_DiskSlot = tuple[Path, torch.Size, torch.dtype]
_Slot = torch.Tensor | _DiskSlot


def states_bytes(states: Iterable[torch.Tensor]) -> int:
    return sum(x.numel() * x.element_size() for x in states)


def layer_bytes(layers: Iterable[nn.Module]) -> int:
    """The largest decoder layer's weight bytes (meta tensors count too: streamed layers are not loaded yet)."""
    return max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers)


def host_available() -> int:
    """MemAvailable (free plus reclaimable page cache) on Linux; free pages elsewhere."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_available(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return host_available()


def choose_placement(state_bytes: int, layer_weight_bytes: int, device: torch.device,
                     offload_dir: Path | None) -> str:
    """Device if a layer's inputs and outputs fit there beside the layer, else host, else disk (if allowed)."""
    both = 2 * state_bytes  # a layer's inputs and its outputs are held at once
    if both + LAYER_HEADROOM * layer_weight_bytes + FORWARD_RESERVE <= device_available(device):
        return "device"
    if offload_dir is None:
        return "device" if device.type == "cpu" else "host"
    if device.type != "cpu" and both <= HOST_FRACTION * host_available():
        return "host"
    return "disk"


class HiddenStates:
    """One layer's hidden states per calibration batch; iterating or indexing yields them on the work device."""

    def __init__(self, store: HiddenStore) -> None:
        self._store = store
        self._slots: list[_Slot] = []

    def append(self, x: torch.Tensor) -> None:
        self._slots.append(self._store.keep(x))

    def __len__(self) -> int:
        return len(self._slots)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self._store.fetch(slot) for slot in self._slots)

    def __getitem__(self, index: int | slice) -> torch.Tensor | list[torch.Tensor]:
        if isinstance(index, slice):
            return [self._store.fetch(slot) for slot in self._slots[index]]
        return self._store.fetch(self._slots[index])

    def release(self) -> None:
        """Hand the buffers back for the next layer's outputs."""
        self._store.recycle(self._slots)
        self._slots = []


class HiddenStore:
    """Keeps hidden states at one placement; a context manager that removes its offload files on exit."""

    def __init__(self, placement: str, device: torch.device, offload_dir: Path | None = None) -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"unknown placement {placement!r}")
        if placement == "disk" and offload_dir is None:
            raise ValueError("the disk placement needs an offload folder")
        self.placement, self.device = placement, device
        self._free: list[_Slot] = []
        self._folder: Path | None = None
        self._files = 0
        if placement == "disk":
            Path(offload_dir).mkdir(parents=True, exist_ok=True)
            self._folder = Path(tempfile.mkdtemp(prefix="quantkit-hidden-", dir=offload_dir))

    def empty(self) -> HiddenStates:
        return HiddenStates(self)

    def hold(self, states: Iterable[torch.Tensor]) -> HiddenStates:
        held = self.empty()
        for x in states:
            held.append(x)
        return held

    def keep(self, x: torch.Tensor) -> _Slot:
        if self.placement == "device":
            return x.to(self.device)
        slot = self._reuse(x.shape, x.dtype)
        if self.placement == "host":
            slot = slot if slot is not None else torch.empty(
                x.shape, dtype=x.dtype, pin_memory=self.device.type == "cuda")
            return slot.copy_(x)
        slot = slot if slot is not None else self._new_file(x.shape, x.dtype)
        _mapped(slot, shared=True).copy_(x)
        return slot

    def fetch(self, slot: _Slot) -> torch.Tensor:
        if isinstance(slot, torch.Tensor):
            return slot.to(self.device)
        return _mapped(slot, shared=False).to(self.device)

    def recycle(self, slots: list[_Slot]) -> None:
        if self.placement != "device":
            self._free.extend(slots)

    def _reuse(self, shape: torch.Size, dtype: torch.dtype) -> _Slot | None:
        for j, slot in enumerate(self._free):
            if _layout(slot) == (shape, dtype):
                return self._free.pop(j)
        return None

    def _new_file(self, shape: torch.Size, dtype: torch.dtype) -> _DiskSlot:
        self._files += 1
        return self._folder / f"batch-{self._files:05d}.bin", shape, dtype

    def __enter__(self) -> HiddenStore:
        return self

    def __exit__(self, *exc) -> None:
        self._free.clear()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)


def _layout(slot: _Slot) -> tuple[torch.Size, torch.dtype]:
    return (slot.shape, slot.dtype) if isinstance(slot, torch.Tensor) else (slot[1], slot[2])


def _mapped(slot: _DiskSlot, shared: bool) -> torch.Tensor:
    """The file's bytes as a tensor, memory-mapped (shared: writes go to the file, which is created if need be)."""
    path, shape, dtype = slot
    return torch.from_file(str(path), shared=shared, size=shape.numel(), dtype=dtype).view(shape)


def open_store(states: list[torch.Tensor], layers: Iterable[nn.Module], device: torch.device,
               offload_dir: Path | None) -> HiddenStore:
    """The store for this run, its placement chosen from the sizes and the free memory, and logged."""
    size = states_bytes(states)
    placement = choose_placement(size, layer_bytes(layers), device, offload_dir)
    where = {"device": str(device), "host": "host memory", "disk": str(offload_dir)}[placement]
    log.info("calibration hidden states: %.2f GiB per layer (inputs and outputs: twice that) on %s",
             size / 2**30, where)
    return HiddenStore(placement, device, offload_dir)
