"""Perplexity over fixed, non-overlapping windows: the same tokens for every model compared."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

# logits per slice in summed_nll and summed_kl: the fp32 copy and log-softmax temporaries (16 MiB) stay in cache
NLL_CHUNK_ELEMENTS = 2**22


def _sum_by_slices(logits: torch.Tensor, other: torch.Tensor, term: Callable[..., torch.Tensor]) -> float:
    """Sum of term(logits slice, other slice) over a few rows of each window at a time: one call over all of them
    would first copy the sliced logits into one contiguous [B*T, V] fp32 tensor and then its log-softmax, each
    2 GiB for Gemma-3's 262k vocabulary on 4 windows of 512 tokens; by slices, perplexity ran ~3x faster past
    the model's forward on a CPU."""
    rows = max(1, NLL_CHUNK_ELEMENTS // logits.shape[-1])
    return sum(term(window[start:start + rows].float(), window_other[start:start + rows]).item()
               for window, window_other in zip(logits, other, strict=True)
               for start in range(0, window.shape[0], rows))


def summed_nll(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Sum over positions of -log softmax(logits)[target], logits [B, T, V], targets [B, T]."""
    return _sum_by_slices(logits, targets, lambda x, t: nn.functional.cross_entropy(x, t, reduction="sum"))


def summed_kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    """Sum over positions of KL(softmax(reference) || softmax(logits)), both [B, T, V], in fp32."""
    return _sum_by_slices(reference, logits, lambda ref, x: nn.functional.kl_div(
        x.float().log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="sum"))


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
    reference: nn.Module | None = None,
) -> dict:
    """exp(mean NLL) over every predicted token of the first max_windows windows of `text`. With a reference
    model (the unquantized one), also "kl": the mean KL(reference || model) of the next-token distributions, how
    far the predictions moved (0 = identical), which unlike perplexity also measures a model whose predictions
    mean nothing (random weights)."""
    windows = heldout_windows(tokenizer, text, seqlen, max_windows)
    nll, kl, count = 0.0, 0.0, 0
    for batch in windows.split(batch_size):
        logits = _logits(model, batch)
        nll += summed_nll(logits, batch[:, 1:].to(logits.device))
        if reference is not None:
            reference_logits = _logits(reference, batch)
            kl += summed_kl(reference_logits, logits.to(reference_logits.device))
        count += batch[:, 1:].numel()
    scores = {"ppl": math.exp(nll / count), "nll": nll / count, "tokens": count, "windows": len(windows),
              "seqlen": seqlen}
    return scores if reference is None else scores | {"kl": kl / count}
