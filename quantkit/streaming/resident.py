"""A model loaded whole (a GGUF file, a hub name, remote code) as a source of the streaming engine: its tensors by
their checkpoint names, read as a SafetensorsCheckpoint reads a folder's. Such runs then go through the one
pipeline (quantkit.streaming.run): the work folder, its resume after a kill, the one export writer and the
layer-by-layer evaluation."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import torch
from accelerate import init_empty_weights
from transformers import PreTrainedModel

from quantkit.models import get_adapter
from quantkit.qtensor import QuantizationError
from quantkit.streaming.checkpoint import SAFETENSORS_DTYPE_NAMES, StoredTensor
from quantkit.streaming.skeleton import load_outside_layers


class ResidentCheckpoint:
    """The tensors of a model in memory under its state dict's names (a checkpoint's). `take` leaves the model a
    skeleton whose decoder layers are on the meta device, as open_streamed_model's are: the engine loads each layer
    from here before its step and releases it after; these tensors are only ever read."""

    def __init__(self, model: PreTrainedModel, source: str | Path | None) -> None:
        adapter = get_adapter(model)
        self.tensors: dict[str, torch.Tensor] = {}
        for name, tensor in model.state_dict().items():  # also under the name the architecture's checkpoints use
            self.tensors[name] = self.tensors[adapter.checkpoint_name(name)] = tensor.detach()
        self.weight_map = dict.fromkeys(self.tensors, "memory")
        self.folder = source or "the embedded default model"  # for messages, as a checkpoint's folder
        self.source, self.config, self.model_class = source, copy.deepcopy(model.config), type(model)

    @classmethod
    def take(cls, model: PreTrainedModel, source: str | Path | None) -> ResidentCheckpoint:
        resident = cls(model, source)
        get_adapter(model).get_layers(model).to("meta")
        return resident

    def __str__(self) -> str:
        return str(self.folder)

    def check_index(self) -> None:
        """Nothing to check: the tensors are in memory."""

    def names(self, prefix: str = "") -> list[str]:
        return [name for name in self.weight_map if name.startswith(prefix)]

    def read(self, names: list[str], widen_to: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        return dict(self.read_stored(names))  # type: ignore[arg-type]  # no FP8 in memory

    def read_stored(self, names: list[str]) -> dict[str, StoredTensor]:
        """The named tensors themselves (not copies: every reader copies or only reads them)."""
        missing = [n for n in names if n not in self.tensors]
        if missing:
            raise QuantizationError(f"{self.folder}: the model has no tensor {missing[0]!r}")
        return {name: self.tensors[name] for name in names}

    def stored_spec(self, name: str) -> tuple[str, list[int]]:
        """The tensor's dtype as a safetensors header would name it and its shape, as SafetensorsCheckpoint's."""
        return SAFETENSORS_DTYPE_NAMES[self.tensors[name].dtype], list(self.tensors[name].shape)

    def fingerprint(self) -> str:
        """Identifies the source without hashing its weights: its file's name, size and modification time (a GGUF
        file) or its hub revision, the config, and every tensor's name, dtype and shape."""
        digest = hashlib.sha256(json.dumps(self.config.to_dict(), sort_keys=True, default=str).encode())
        path = Path(str(self.source)).expanduser() if self.source is not None else _embedded_default()
        if path.is_file():
            stat = path.stat()
            digest.update(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        else:
            digest.update(f"{self.source}@{getattr(self.config, '_commit_hash', None)}".encode())
        for name, tensor in self.tensors.items():
            digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}".encode())
        return digest.hexdigest()

    def skeleton(self, dtype: torch.dtype) -> PreTrainedModel:
        """A new skeleton of the model in `dtype`, its tensors outside the layers loaded from here (the layer-by-layer
        evaluation's original)."""
        with init_empty_weights(include_buffers=False):
            model = self.model_class._from_config(copy.deepcopy(self.config), dtype=dtype)
        load_outside_layers(model, self, get_adapter(model))  # type: ignore[arg-type]
        return model.eval()


def _embedded_default() -> Path:
    from quantkit.models.loading import default_model_path

    return default_model_path()
