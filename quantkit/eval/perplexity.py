"""Perplexity over fixed, non-overlapping windows: the same tokens for every model compared."""

from __future__ import annotations

import math

import torch
from torch import nn

# logits per cross-entropy call in summed_nll: its fp32 copy and log-softmax temporaries (16 MiB) stay in cache
NLL_CHUNK_ELEMENTS = 2**22


def summed_nll(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Sum over positions of -log softmax(logits)[target], logits [B, T, V], targets [B, T]. In slices of a few
    rows per window: one cross-entropy over all of them would first copy the sliced logits into one
    contiguous [B*T, V] fp32 tensor and then its log-softmax, each 2 GiB for Gemma-3's 262k vocabulary on 4
    windows of 512 tokens; by slices, perplexity ran ~3x faster past the model's forward on a CPU."""
    rows = max(1, NLL_CHUNK_ELEMENTS // logits.shape[-1])
    total = 0.0
    for window, window_targets in zip(logits, targets, strict=True):
        for start in range(0, window.shape[0], rows):
            total += nn.functional.cross_entropy(window[start:start + rows].float(),
                                                 window_targets[start:start + rows], reduction="sum").item()
    return total


def heldout_windows(tokenizer, text: str, seqlen: int, max_windows: int | None) -> torch.Tensor:
    """The first max_windows non-overlapping windows of `text`, long [windows, seqlen (+1 with a BOS token: every
    window starts like a document, as the model was trained)]."""
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    n_windows = len(ids) // seqlen
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    if n_windows == 0:
        raise ValueError(f"text has {len(ids)} tokens, fewer than one window of {seqlen}")
    windows = ids[: n_windows * seqlen].view(n_windows, seqlen)
    bos = getattr(tokenizer, "bos_token_id", None)
    return windows if bos is None else torch.cat([torch.full_like(windows[:, :1], bos), windows], dim=1)


def _logits(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token logits for every position but the last, [B, T - 1, V]."""
    device = next(model.parameters()).device
    return model(input_ids=batch.to(device), use_cache=False).logits[:, :-1]


@torch.no_grad()
def perplexity(
    model: nn.Module,
    tokenizer,
    text: str,
    seqlen: int = 512,
    max_windows: int | None = None,
    batch_size: int = 4,
) -> dict:
    """exp(mean NLL) over every predicted token of the first max_windows windows of `text`."""
    windows = heldout_windows(tokenizer, text, seqlen, max_windows)
    nll, count = 0.0, 0
    for batch in windows.split(batch_size):
        logits = _logits(model, batch)
        nll += summed_nll(logits, batch[:, 1:].to(logits.device))
        count += batch[:, 1:].numel()
    return {"ppl": math.exp(nll / count), "nll": nll / count, "tokens": count, "windows": len(windows),
            "seqlen": seqlen}


def summed_kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    """Sum over positions of KL(softmax(reference) || softmax(logits)), both [B, T, V], by slices of rows (as
    summed_nll) in fp32."""
    rows = max(1, NLL_CHUNK_ELEMENTS // logits.shape[-1])
    total = 0.0
    for ref_window, window in zip(reference, logits, strict=True):
        for start in range(0, window.shape[0], rows):
            ref_logp = ref_window[start:start + rows].float().log_softmax(-1)
            logp = window[start:start + rows].to(ref_logp).log_softmax(-1)
            total += nn.functional.kl_div(logp, ref_logp, log_target=True, reduction="sum").item()
    return total


@torch.no_grad()
def kl_divergence(
    model: nn.Module,
    reference: nn.Module,
    tokenizer,
    text: str,
    seqlen: int = 512,
    max_windows: int | None = None,
    batch_size: int = 4,
) -> dict:
    """Mean KL(reference || model) of the next-token distributions over perplexity's windows of `text`: how far
    a quantized model's predictions moved from the unquantized ones (0 = identical), which unlike perplexity
    also measures models whose predictions mean nothing (random weights)."""
    windows = heldout_windows(tokenizer, text, seqlen, max_windows)
    total, count = 0.0, 0
    for batch in windows.split(batch_size):
        reference_logits = _logits(reference, batch)
        total += summed_kl(reference_logits, _logits(model, batch).to(reference_logits.device))
        count += batch[:, 1:].numel()
    return {"kl": total / count, "tokens": count, "windows": len(windows), "seqlen": seqlen}
