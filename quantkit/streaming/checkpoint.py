"""Read a local safetensors checkpoint (one file, or shards with an index) a few tensors at a time.

Each read opens the shards it needs memory-mapped, copies out only the requested tensors and closes
them again, so the mapped pages of other layers never count towards the process's resident memory.

FP8 sources in DeepSeek's form (DeepSeek-V3/R1, Kimi-K2: float8_e4m3fn weights, each with a `weight_scale_inv` of one
fp32 factor per 128 x 128 block, config.json's quantization_config.weight_block_size) are dequantized to fp32 as each
weight is read, or (a streamed layer: `read_stored`) kept as codes and scales until the layer is placed on its work
device and widened there: nothing but the tensors at hand is ever held in a wider dtype.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from quantkit.qtensor import QuantizationError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIX = "_scale_inv"  # DeepSeek's name for the block scales of X.weight: X.weight_scale_inv
DEFAULT_FP8_BLOCK = (128, 128)
# The dtype names of safetensors headers ("dtype" of each tensor's entry, as get_slice().get_dtype() reads them) and
# the torch dtypes they hold
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "U16": torch.uint16, "I16": torch.int16,
    "U32": torch.uint32, "I32": torch.int32, "U64": torch.uint64, "I64": torch.int64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64, "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
}
SAFETENSORS_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 weight [out, in] from float8 codes and one factor per block [ceil(out / b0), ceil(in / b1)]."""
    rows, cols = weight.shape
    if scale_inv.shape != (-(-rows // block[0]), -(-cols // block[1])):
        raise QuantizationError(f"an FP8 weight [{rows}, {cols}] has block scales {list(scale_inv.shape)}, not one per "
                                f"{block[0]} x {block[1]} block (config.json's weight_block_size)")
    factors = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * factors


@dataclass
class BlockScaledFp8:
    """An FP8 weight as stored, with its block scales: widened where it is used."""

    codes: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]

    def widen(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        return dequantize_fp8_blocks(self.codes.to(device), self.scale_inv.to(device), self.block).to(dtype)


StoredTensor = torch.Tensor | BlockScaledFp8


def streamable_reason(source: str | None, trust_remote_code: bool) -> str | None:
    """None when `source` can be streamed; else why the whole model is loaded in memory instead."""
    if source is None:
        return "the embedded default model is a GGUF file"
    folder = Path(source).expanduser()
    if folder.suffix == ".gguf":
        return "GGUF sources are dequantized as a whole by transformers"
    if not folder.is_dir():
        return "the source is not a local folder"
    if trust_remote_code:
        return "remote-code models are built by their own code"
    if not ((folder / INDEX_NAME).is_file() or (folder / SINGLE_NAME).is_file()):
        return "the folder holds no model.safetensors or safetensors index"
    return None


class SafetensorsCheckpoint:
    """The tensor names of a local checkpoint, which shard holds each, and reads by name or prefix."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder).expanduser().resolve()
        index = self.folder / INDEX_NAME
        if index.is_file():
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:  # one file, or (other tools' exports) shards without an index
            files = [SINGLE_NAME] if (self.folder / SINGLE_NAME).is_file() else \
                sorted(p.name for p in self.folder.glob("*.safetensors"))
            if not files:
                raise QuantizationError(f"{self.folder} holds no .safetensors files")
            self.weight_map = {}
            for fname in files:
                with safe_open(self.folder / fname, "pt") as f:
                    self.weight_map.update(dict.fromkeys(f.keys(), fname))
        config = self.folder / "config.json"
        quantization = json.loads(config.read_text()).get("quantization_config") or {} if config.is_file() else {}
        self.fp8_block = tuple(quantization.get("weight_block_size") or DEFAULT_FP8_BLOCK)

    def check_index(self) -> None:
        """Every shard the index names exists and holds the tensors the index places in it (headers only)."""
        by_file: dict[str, set[str]] = defaultdict(set)
        for name, fname in self.weight_map.items():
            by_file[fname].add(name)
        for fname, names in sorted(by_file.items()):
            path = self.folder / fname
            if not path.is_file():
                raise QuantizationError(f"{self.folder}: the index names {fname}, which is missing")
            with safe_open(path, "pt") as f:
                absent = sorted(names - set(f.keys()))
            if absent:
                raise QuantizationError(f"{path} lacks {len(absent)} tensor(s) the index places there, "
                                        f"e.g. {absent[0]!r}: the shards and the index disagree")

    def names(self, prefix: str = "") -> list[str]:
        return [name for name in self.weight_map if name.startswith(prefix)]

    def read(self, names: list[str], widen_to: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Copies of the named tensors, FP8 block-scaled weights dequantized into `widen_to` on the host one at a time
        (a layer is never held in fp32 for it)."""
        return {name: value.widen(widen_to) if isinstance(value, BlockScaledFp8) else value
                for name, value in self.read_stored(names).items()}

    def read_stored(self, names: list[str]) -> dict[str, StoredTensor]:
        """Copies of the named tensors as stored, FP8 block-scaled weights with their scales, each shard mapped only
        while its tensors are copied out."""
        tensors: dict[str, StoredTensor] = dict(self.read_raw(names))
        fp8 = [name for name, tensor in tensors.items() if tensor.dtype in FP8_DTYPES]
        absent = [name for name in fp8 if name + SCALE_SUFFIX not in self.weight_map]
        if absent:
            raise QuantizationError(f"{self.folder}: the FP8 tensor {absent[0]!r} has no {absent[0] + SCALE_SUFFIX!r}; "
                                    "only block-scaled FP8 in DeepSeek's form is read")
        scales = self.read_raw([name + SCALE_SUFFIX for name in fp8])
        for name in fp8:
            tensors[name] = BlockScaledFp8(tensors[name], scales[name + SCALE_SUFFIX], self.fp8_block)
        return tensors

    def read_raw(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Copies of the named tensors exactly as stored (an export's FP8 weights: their e4m3 bytes)."""
        missing = [n for n in names if n not in self.weight_map]
        if missing:
            raise QuantizationError(f"{self.folder}: the checkpoint has no tensor {missing[0]!r}")
        by_file: dict[str, list[str]] = defaultdict(list)
        for name in names:
            by_file[self.weight_map[name]].append(name)
        tensors: dict[str, torch.Tensor] = {}
        for fname, keys in by_file.items():
            with safe_open(self.folder / fname, "pt") as f:
                tensors.update({k: f.get_tensor(k).clone() for k in keys})
        return tensors

    def stored_spec(self, name: str) -> tuple[str, list[int]]:
        """The tensor's dtype as its header names it ("BF16", "F8_E4M3", "I64", ...) and its shape, unread."""
        with safe_open(self.folder / self.weight_map[name], "pt") as f:
            stored = f.get_slice(name)
            return stored.get_dtype(), list(stored.get_shape())

    def fingerprint(self) -> str:
        """Identifies the source without reading its weights: config and index bytes, each shard's
        name, size and modification time (a rewritten shard changes them)."""
        digest = hashlib.sha256()
        for name in ("config.json", INDEX_NAME):
            path = self.folder / name
            if path.is_file():
                digest.update(name.encode() + path.read_bytes())
        for fname in sorted(set(self.weight_map.values())):
            stat = (self.folder / fname).stat()
            digest.update(f"{fname}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        return digest.hexdigest()
