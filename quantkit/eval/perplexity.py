"""Perplexity over fixed, non-overlapping windows: the same tokens for every model compared."""

from __future__ import annotations

import math

import torch
from torch import nn


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
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    n_windows = len(ids) // seqlen
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    if n_windows == 0:
        raise ValueError(f"text has {len(ids)} tokens, fewer than one window of {seqlen}")
    windows = ids[: n_windows * seqlen].view(n_windows, seqlen)
    bos = getattr(tokenizer, "bos_token_id", None)
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    for start in range(0, n_windows, batch_size):
        batch = windows[start:start + batch_size].to(device)
        if bos is not None:  # every window starts like a document, as the model was trained
            batch = torch.cat([torch.full_like(batch[:, :1], bos), batch], dim=1)
        logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
        targets = batch[:, 1:]
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                           reduction="sum")
        nll += loss.item()
        count += targets.numel()
    return {"ppl": math.exp(nll / count), "nll": nll / count, "tokens": count, "windows": n_windows,
            "seqlen": seqlen}
