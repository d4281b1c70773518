"""Perplexity and KL divergence of models that do not fit, computed one decoder layer at a time.

The windows' hidden states go through one layer at a time: an original safetensors checkpoint is streamed as
quantization streams it (quantkit.streaming), an export is built a layer at a time from its shards
(quantkit.reload.ExportReader), so memory holds one layer, the embeddings and head, and the hidden states of every
window. The numbers are those of quantkit.eval.perplexity on the whole models (the same windows, targets and
KL(original || model)), which the tests check.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from quantkit.data import CalibrationSet
from quantkit.engine import _move, capture_layer_inputs
from quantkit.eval.perplexity import NLL_CHUNK_ELEMENTS, heldout_windows, summed_kl, summed_nll
from quantkit.models import get_adapter
from quantkit.models.loading import is_quantkit_export
from quantkit.models.moe import unfuse_experts
from quantkit.nn.qlinear import QuantLinear
from quantkit.quantizers.context import LayerContext
from quantkit.reload import ExportReader
from quantkit.streaming import open_streamed_model
from quantkit.streaming.resident import ResidentCheckpoint
from quantkit.streaming.skeleton import StreamedLayers, large_allocations_mapped, return_freed_memory

log = logging.getLogger("quantkit")


class _Model:
    """One model of the comparison: its skeleton and where each of its layers comes from."""

    def __init__(self, source: str | Path | ResidentCheckpoint, dtype: torch.dtype, device: torch.device) -> None:
        self.source, self.device = str(source), device
        if not isinstance(source, ResidentCheckpoint) and is_quantkit_export(source):
            self.reader: ExportReader | None = ExportReader(source, dtype)
            self.model = self.reader.model
            self.adapter = get_adapter(self.model)
            self.reader.materialize(device, outside=self.adapter.layers + ".")
        else:
            self.reader = None
            if isinstance(source, ResidentCheckpoint):
                self.model, ckpt = source.skeleton(dtype), source
            else:
                self.model, ckpt = open_streamed_model(self.source, dtype)
            self.adapter = get_adapter(self.model)
            unfuse_experts(self.model, self.adapter)  # experts read per expert, as quantization reads them
            self.layers = StreamedLayers(ckpt, self.adapter, dtype)

    @contextmanager
    def layer(self, index: int, layer: nn.Module) -> Iterator[nn.Module]:
        """Layer `index` on the device for the duration, then back on the meta device."""
        if self.reader is not None:
            self.reader.materialize(self.device, within=f"{self.adapter.layers}.{index}.")
            layer.to(self.device)
        else:
            self.layers.load(index, layer, self.device)
        try:
            yield layer
        finally:
            if self.reader is None:
                self.layers.release(index, layer)
            else:
                layer.to("meta")
                return_freed_memory()  # as StreamedLayers.release: freed layers otherwise stay in glibc's arenas

    @torch.no_grad()
    def final_hidden_states(self, calib: CalibrationSet, batch_size: int) -> list[torch.Tensor]:
        """The hidden states after the last layer, per batch of windows."""
        inputs, kwargs, masks = capture_layer_inputs(self.model, self.adapter, calib, self.device, batch_size)
        self.head = self._narrow_head()
        for i, layer in enumerate(self.adapter.get_layers(self.model)):
            with self.layer(i, layer):
                ctx = LayerContext(i, layer, self.adapter, inputs, _move(kwargs[i], self.device), masks, self.device)
                inputs = ctx.forward()
        self.model.get_submodule(self.adapter.outer.final_norm).to(self.device)
        self.head = self.head.to(self.device)
        return inputs

    def _narrow_head(self) -> torch.Tensor | QuantLinear:
        """The head's weight in the 16-bit dtype that holds its values exactly (a bf16 checkpoint's, an fp16 export's:
        half the bytes of the CPU's fp32 copy), else as it is; a quantized head as itself (it rounds its activations
        too, with FP8). The embeddings, needed no more, go to the meta device (tied ones too: the head keeps its own
        copy)."""
        outer = self.adapter.outer
        module = self.model.get_submodule(outer.lm_head)
        if isinstance(module, QuantLinear):
            self.model.get_submodule(outer.embeddings[0]).to("meta")
            return module
        head = module.weight.detach()
        for dtype in (torch.bfloat16, torch.float16) if head.dtype == torch.float32 else ():
            narrow = _exactly_in(head, dtype)
            if narrow is not None:
                head = narrow
                break
        for name in (outer.embeddings[0], outer.lm_head):
            self.model.get_submodule(name).to("meta")
        return head

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits of the given positions [B, T, H] as the model's forward computes them, the head widened
        a block of its rows at a time."""
        x = self.model.get_submodule(self.adapter.outer.final_norm)(hidden)
        if isinstance(self.head, QuantLinear):
            return self._capped(self.head(x))
        rows = max(1, NLL_CHUNK_ELEMENTS // x.shape[-1])
        logits = torch.cat([x @ self.head[start:start + rows].to(x.dtype).t()
                            for start in range(0, self.head.shape[0], rows)], dim=-1)
        return self._capped(logits)

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @property
    def vocab(self) -> int:
        return self.head.out_features if isinstance(self.head, QuantLinear) else self.head.shape[0]


@torch.no_grad()
def layerwise_perplexity(sources: list[str | Path | ResidentCheckpoint], tokenizer, texts: dict[str, str], seqlen: int = 512,
                         max_windows: int | None = None, batch_size: int = 4, device: str | None = None,
                         dtype: torch.dtype | None = None) -> dict[str, list[dict]]:
    """quantkit.eval.perplexity's scores per text (by label) for each source (safetensors checkpoints streamed,
    quantkit exports built a layer at a time, a model loaded whole read from memory a layer at a time), every model after the first with "kl" against the first, which
    stays the reference. Each model is read once for all the texts."""
    windows = {label: heldout_windows(tokenizer, text, seqlen, max_windows) for label, text in texts.items()}
    return {label: [entry | {"seqlen": seqlen} for entry in entries]
            for label, entries in layerwise_scores(sources, windows, batch_size, device, dtype).items()}


@torch.no_grad()
def layerwise_scores(sources: list[str | Path | ResidentCheckpoint], windows: dict[str, torch.Tensor], batch_size: int = 4,
                     device: str | None = None, dtype: torch.dtype | None = None) -> dict[str, list[dict]]:
    """layerwise_perplexity's scores on token windows [windows, T] per label (each window predicting its tokens
    1..T-1; every label's windows of one length T)."""
    with large_allocations_mapped():  # each layer's weights go back to the OS when released
        return _layerwise_scores(sources, windows, batch_size, device, dtype)


def _layerwise_scores(sources: list[str | Path | ResidentCheckpoint], windows: dict[str, torch.Tensor], batch_size: int,
                      device: str | None, dtype: torch.dtype | None) -> dict[str, list[dict]]:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.float16 if device.type == "cuda" else torch.float32)
    every = torch.cat(list(windows.values()))  # all texts in one pass through each model
    calib = CalibrationSet(every, torch.ones_like(every))
    targets = [batch[:, 1:].to(device) for batch in every.split(batch_size)]
    reference: tuple[_Model, list[torch.Tensor]] | None = None
    sums: list[tuple[list[float], list[float]]] = []  # per source: the NLL and KL sums of each window
    for source in sources:
        model = _Model(source, dtype, device)
        log.info("%s: %d windows through %d layers, one layer at a time", source, len(every),
                 len(model.adapter.get_layers(model.model)))
        hidden = model.final_hidden_states(calib, batch_size)
        nll, kl = [], []
        for b, target in enumerate(targets):
            for row in range(len(target)):  # a window at a time, a slice of its positions' logits at a time
                nll.append(0.0)
                if reference is not None:
                    kl.append(0.0)
                for positions in _position_slices(target.shape[1], model.vocab):
                    logits = model.logits(hidden[b][row:row + 1, positions])
                    nll[-1] += summed_nll(logits, target[row:row + 1, positions])
                    if reference is not None:
                        kl[-1] += summed_kl(reference[0].logits(reference[1][b][row:row + 1, positions]), logits)
        sums.append((nll, kl))
        if reference is None:
            reference = (model, hidden)
    return _scores_per_label(windows, sums)


def _exactly_in(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """`weight` in `dtype` if that holds every value exactly, else None; a block of rows at a time (no full-size
    temporaries)."""
    narrow = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    rows = max(1, NLL_CHUNK_ELEMENTS // weight.shape[-1])
    for start in range(0, weight.shape[0], rows):
        block = weight[start:start + rows]
        narrow[start:start + rows] = block
        if not torch.equal(narrow[start:start + rows].float(), block):
            return None
    return narrow


def _position_slices(positions: int, vocab: int) -> list[slice]:
    """The predicting positions 0..positions-1 in slices whose logits hold about NLL_CHUNK_ELEMENTS values."""
    rows = max(1, NLL_CHUNK_ELEMENTS // vocab)
    return [slice(start, min(start + rows, positions)) for start in range(0, positions, rows)]


def _scores_per_label(windows: dict[str, torch.Tensor],
                      sums: list[tuple[list[float], list[float]]]) -> dict[str, list[dict]]:
    scores, start = {}, 0
    for label, chunk in windows.items():
        rows, count = slice(start, start + len(chunk)), chunk[:, 1:].numel()
        start += len(chunk)
        scores[label] = []
        for nll, kl in sums:
            entry = {"ppl": math.exp(sum(nll[rows]) / count), "nll": sum(nll[rows]) / count, "tokens": count,
                     "windows": len(chunk), "layerwise": True}
            scores[label].append(entry | {"kl": sum(kl[rows]) / count} if kl else entry)
    return scores
