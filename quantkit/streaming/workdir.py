"""The resumable work folder beside the output: finished layers, the hidden states entering the next
one, and a manifest naming the run they belong to.

Layout of `.<output name>.quantkit-partial/`:
  manifest.json            run key (hashes of source, settings, calibration), finished layers with their
                           report entries and export tensor sizes; rewritten (atomically) last
  layer-00007.safetensors  layer 7's export tensors (packed linears, its norms) in the export dtype
  hidden-00008.safetensors the calibration hidden states entering layer 8, exactly as computed, saved at
                           most every `resume_interval` seconds (a 70B layer's are 4 GiB: written after
                           every layer, they made the run disk-bound); a resume starts at the last ones
A layer counts as finished once the manifest says so: its files are renamed into place before the
manifest, so a kill at any moment leaves either the previous or the next consistent state. A background
thread writes each layer's files while the next layer computes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quantkit.data import CalibrationSet
from quantkit.export import nbytes

log = logging.getLogger("quantkit")

MANIFEST = "manifest.json"
VERSION = 1
RESUME_INTERVAL_S = 300.0  # at most this much layer work is redone after a kill
# Test-only (tests/test_streaming.py): at each step that writes the work folder or the export, say so
# on stderr and sleep this many seconds, so that a seeded SIGKILL can land between any two writes.
PAUSE_ENV = "QUANTKIT_TEST_PHASE_PAUSE"
PAUSE_MARK = "quantkit-test-pause"


def pause_between_phases() -> None:
    seconds = float(os.environ.get(PAUSE_ENV, "0"))
    if seconds:
        print(PAUSE_MARK, file=sys.stderr, flush=True)
        time.sleep(seconds)


def work_dir_for(output: Path) -> Path:
    return output.parent / f".{output.name}.quantkit-partial"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def run_key(source_fingerprint: str, settings: dict, calib: CalibrationSet) -> dict[str, str]:
    """What must match for a resume: the source files, every setting that changes the bytes out, and
    the calibration tokens."""
    tokens = calib.input_ids.contiguous().numpy().tobytes() + calib.attention_mask.contiguous().numpy().tobytes()
    return {
        "source": source_fingerprint,
        "settings": _sha256(json.dumps(settings, sort_keys=True, default=str).encode()),
        "calibration": _sha256(tokens),
    }


def _replace_atomically(path: Path, write) -> None:
    partial = path.with_name(path.name + ".partial")
    write(partial)
    os.replace(partial, path)


class WorkDir:
    def __init__(self, path: Path, key: dict[str, str], resume_interval: float = RESUME_INTERVAL_S) -> None:
        self.path, self.key, self.resume_interval = path, key, resume_interval
        self.manifest: dict = {"version": VERSION, "key": key, "layers": [], "hidden_at": 0, "published": False}
        self._hidden_saved = time.monotonic()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quantkit-workdir")
        self._pending: Future | None = None

    def _read_manifest(self) -> dict | None:
        try:
            manifest = json.loads((self.path / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        return manifest if manifest.get("version") == VERSION else None

    def published(self) -> bool:
        """A run with this key already renamed its export into place (and was stopped cleaning up)."""
        manifest = self._read_manifest()
        return manifest is not None and manifest["key"] == self.key and manifest["published"]

    def open(self, resume: bool) -> int:
        """The number of finished layers to skip: 0 when starting over (said why), else resumed (said so)."""
        previous = self._read_manifest() if self.path.exists() else None
        if previous is not None and resume and previous["key"] == self.key:
            self.manifest = previous
            start = previous.setdefault("hidden_at", len(previous["layers"]))  # older runs saved every layer's
            redone = len(previous["layers"]) - start
            del previous["layers"][start:]
            if start:
                log.warning("resuming from %s: layers 0-%d are already quantized%s", self.path, start - 1,
                            f" (the {redone} after them are redone: their inputs were not saved)" if redone else "")
            else:
                log.warning("resuming from %s: no layer's outputs were saved yet, layer 0 is redone", self.path)
            return start
        if previous is not None:
            changed = [k for k in self.key if previous["key"].get(k) != self.key[k]]
            why = "--no-resume" if not resume else f"the {' and '.join(changed)} changed"
            log.warning("starting over (%s): discarding the unfinished run in %s", why, self.path)
        elif self.path.exists():
            log.warning("starting over: %s holds no readable manifest", self.path)
        self.remove()
        self.path.mkdir(parents=True)
        self._write_manifest()
        return 0

    def _write_manifest(self) -> None:
        _replace_atomically(self.path / MANIFEST, lambda p: p.write_text(json.dumps(self.manifest, indent=1, default=str)))

    def hidden_due(self) -> bool:
        """Whether the next layer's outputs are to be saved: `resume_interval` seconds passed since the last."""
        return time.monotonic() - self._hidden_saved >= self.resume_interval

    def save_layer(self, index: int, tensors: dict[str, torch.Tensor], outputs: Iterable[torch.Tensor] | None,
                   entry: dict) -> None:
        """Queues layer `index`'s export tensors (dict order kept in the manifest), and the hidden states it
        produced (every batch's, given when hidden_due()), for the writer thread, once the previous layer's are
        written. The hidden states are copied here: the engine reuses their buffers."""
        hidden = None
        if outputs is not None:
            hidden = {f"batch.{j}": x.detach().to("cpu", copy=True).contiguous() for j, x in enumerate(outputs)}
            self._hidden_saved = time.monotonic()
        self.flush()
        self._pending = self._writer.submit(self._commit_layer, index, tensors, hidden, entry)

    def flush(self, *, raising: bool = True) -> None:
        """Waits until the queued layer is committed; raises what writing it raised (a full disk, say), or
        only logs it when the run failed already (`raising=False`)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except Exception as err:
            if raising:
                raise
            log.warning("the last finished layer could not be saved for a resume: %s", err)

    def _commit_layer(self, index: int, tensors: dict[str, torch.Tensor],
                      hidden: dict[str, torch.Tensor] | None, entry: dict) -> None:
        """The layer file, then the hidden states if any, then the manifest rewrite that commits them; the
        older hidden states go last."""
        _replace_atomically(self.layer_file(index), lambda p: save_file(tensors, p))
        pause_between_phases()
        older = self.manifest["hidden_at"]
        if hidden is not None:
            _replace_atomically(self._hidden_file(index + 1), lambda p: save_file(hidden, p))
            pause_between_phases()
            self.manifest["hidden_at"] = index + 1
        specs = [[k, nbytes(v), str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in tensors.items()]
        self.manifest["layers"].append({"entry": entry, "tensors": specs})
        self._write_manifest()
        pause_between_phases()
        if hidden is not None:
            self._hidden_file(older).unlink(missing_ok=True)

    def layer_file(self, index: int) -> Path:
        return self.path / f"layer-{index:05d}.safetensors"

    def _hidden_file(self, index: int) -> Path:
        return self.path / f"hidden-{index:05d}.safetensors"

    def hidden_states(self, index: int) -> list[torch.Tensor]:
        """The hidden states entering layer `index`, per calibration batch."""
        with safe_open(self._hidden_file(index), "pt") as f:
            return [f.get_tensor(f"batch.{j}") for j in range(len(f.keys()))]

    def entries(self) -> list[dict]:
        return [layer["entry"] for layer in self.manifest["layers"]]

    def tensor_sizes(self) -> list[list[tuple[str, int]]]:
        """Per finished layer, its export tensors' names and sizes in bytes, in the order they were packed."""
        return [[(k, n) for k, n, _, _ in layer["tensors"]] for layer in self.manifest["layers"]]

    def tensor_specs(self) -> dict[str, tuple[torch.dtype, list[int]]]:
        return {k: (getattr(torch, dtype), shape) for layer in self.manifest["layers"]
                for k, _, dtype, shape in layer["tensors"]}

    def mark_published(self) -> None:
        self.manifest["published"] = True
        self._write_manifest()

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
