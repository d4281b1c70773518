"""Batched log-likelihood of continuations given contexts, computed the way lm-evaluation-harness does.

Tokenization follows lm-eval: trailing whitespace of the context moves to the front of the continuation,
the continuation's tokens are those of tokenize(context + continuation) past the context's tokens, and no
special tokens are added (except BOS for Gemma, whose outputs degrade without it, as lm-eval also does).
Requests with the same model input share one row, which covers choices that differ only in their final
token (MMLU's " A".." D", BoolQ's " yes"/" no"): one forward scores them all. Rows are sorted by length,
padded on the right and run `batch_size` at a time; only the positions that predict continuation tokens
are projected to the vocabulary (`logits_to_keep`), which keeps the logits small.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch


def adds_bos(model) -> bool:
    return "gemma" in str(getattr(model.config, "model_type", ""))


def max_length(model, default: int = 2048) -> int:
    for attribute in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(model.config, attribute, None)
        if isinstance(value, int) and value > 0:
            return value
    return default


def encode_requests(
    tokenizer, requests: Sequence[tuple[str, str]], bos_token_id: int | None = None
) -> list[tuple[list[int], list[int]]]:
    """(context tokens, continuation tokens) per (context, continuation) string pair."""
    contexts, wholes = [], []
    for context, continuation in requests:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        contexts.append(context)
        wholes.append(context + continuation)
    unique_contexts = list(dict.fromkeys(contexts))  # few-shot prompts repeat once per choice
    context_ids = dict(zip(unique_contexts, _token_ids(tokenizer, unique_contexts), strict=True))
    prefix = [] if bos_token_id is None else [bos_token_id]
    encoded = []
    for context, whole_ids in zip(contexts, _token_ids(tokenizer, wholes), strict=True):
        ctx = context_ids[context]
        continuation = whole_ids[len(ctx) :]
        if not continuation:
            raise ValueError(f"empty continuation after tokenization (context ends {context[-40:]!r})")
        encoded.append((prefix + ctx, continuation))
    return encoded


def _token_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def loglikelihoods(
    model,
    tokenizer,
    requests: Sequence[tuple[str, str]],
    batch_size: int = 16,
    progress: Callable[[int], None] | None = None,
) -> list[float]:
    """Sum of log P(continuation token | everything before it) for each (context, continuation)."""
    bos = tokenizer.bos_token_id if adds_bos(model) else None
    limit = max_length(model)
    # The model input is (context + continuation)[:-1], cut from the left to the model's length.
    rows: dict[tuple[int, ...], list[tuple[int, list[int]]]] = {}
    for index, (context, continuation) in enumerate(encode_requests(tokenizer, requests, bos)):
        row = tuple((context + continuation)[:-1][-limit:])
        rows.setdefault(row, []).append((index, continuation))
    results = [0.0] * len(requests)
    ordered = sorted(rows, key=len, reverse=True)  # longest first: an out-of-memory shows up at once
    for start in range(0, len(ordered), batch_size):
        batch = ordered[start : start + batch_size]
        needed = [max(len(cont) for _, cont in rows[row]) for row in batch]
        logprobs, first_kept = _batch_logprobs(model, batch, needed)
        for b, row in enumerate(batch):
            for index, continuation in rows[row]:
                begin = len(row) - len(continuation) - first_kept
                positions = torch.arange(begin, begin + len(continuation), device=logprobs.device)
                targets = torch.tensor(continuation, device=logprobs.device)
                results[index] = logprobs[b, positions, targets].sum().item()
        if progress is not None:
            progress(sum(len(rows[row]) for row in batch))
    return results


def _accepts_logits_to_keep(model) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


@torch.no_grad()
def _batch_logprobs(model, batch: list[tuple[int, ...]], needed: list[int]) -> tuple[torch.Tensor, int]:
    """Log-softmax over the vocabulary at the kept positions of right-padded rows; the first kept position."""
    device = next(model.parameters()).device
    width = max(map(len, batch))
    input_ids = torch.zeros((len(batch), width), dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for b, row in enumerate(batch):
        input_ids[b, : len(row)] = torch.tensor(row)
        attention_mask[b, : len(row)] = 1
    first_kept = min(len(row) - need for row, need in zip(batch, needed, strict=True))
    kwargs = {"logits_to_keep": width - first_kept} if _accepts_logits_to_keep(model) else {}
    logits = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **kwargs).logits
    if not kwargs:
        logits = logits[:, first_kept:]
    return logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(dim=-1), first_kept
