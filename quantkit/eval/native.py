"""Runs one task on one model with quantkit's own batched scorer and aggregates it like lm-eval."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from quantkit.eval import gsm8k
from quantkit.eval.generation import generate
from quantkit.eval.scoring import loglikelihoods
from quantkit.eval.tasks import Prompted, Task, choice_requests, generation_prompt


def mean_with_stderr(values: list[float]) -> dict[str, float | None]:
    """Mean and the standard error of the mean from the sample standard deviation (lm-eval's stderr)."""
    n = len(values)
    mean = float(np.mean(values)) if n else math.nan
    stderr = float(np.std(values, ddof=1) / math.sqrt(n)) if n > 1 else None
    return {"value": mean, "stderr": stderr}


def choice_scores(lls: list[float], continuations: tuple[str, ...], gold: int) -> dict[str, float]:
    """acc: the most likely choice is gold; acc_norm: the same after dividing by the choice's length.

    lm-eval divides by len(choice) of the choice string without the delimiter: characters, which are
    bytes for the English tasks here. np.argmax keeps the first of tied choices, as lm-eval's does.
    """
    lengths = np.array([float(len(c)) for c in continuations])
    return {
        "acc": float(np.argmax(lls) == gold),
        "acc_norm": float(np.argmax(np.array(lls) / lengths) == gold),
    }


def _score_choices(
    model, tokenizer, items: list[Prompted], batch_size: int, progress
) -> list[dict[str, float]]:
    per_item = [choice_requests(item) for item in items]
    flat = [request for requests in per_item for request in requests]
    lls = loglikelihoods(model, tokenizer, flat, batch_size=batch_size, progress=progress)
    scores, offset = [], 0
    for item, requests in zip(items, per_item, strict=True):
        scores.append(
            choice_scores(lls[offset : offset + len(requests)], item.doc.continuations, item.doc.gold)
        )
        offset += len(requests)
    return scores


def _score_generations(
    model, tokenizer, items: list[Prompted], batch_size: int, progress
) -> list[dict[str, float]]:
    prompts = [generation_prompt(item) for item in items]
    outputs = generate(
        model,
        tokenizer,
        prompts,
        max_new_tokens=gsm8k.MAX_NEW_TOKENS,
        stop=gsm8k.STOP_SEQUENCES,
        batch_size=batch_size,
        progress=progress,
    )
    return [
        {
            "exact_match_strict": float(gsm8k.is_correct(gsm8k.extract_strict(out), item.doc.target)),
            "exact_match_flexible": float(gsm8k.is_correct(gsm8k.extract_flexible(out), item.doc.target)),
        }
        for item, out in zip(items, outputs, strict=True)
    ]


def request_count(task: Task, items: list[Prompted]) -> int:
    """Units of progress a task reports: one per choice, or one per generated answer."""
    return sum(len(item.doc.contexts) for item in items) if task.kind == "choice" else len(items)


def evaluate_task(
    model,
    tokenizer,
    task: Task,
    items: list[Prompted],
    *,
    batch_size: int,
    progress: Callable[[int], None] | None = None,
) -> dict[str, dict[str, float | None]]:
    """{metric: {"value", "stderr"}} for the prepared questions of one task."""
    score = _score_choices if task.kind == "choice" else _score_generations
    per_item = score(model, tokenizer, items, batch_size, progress)
    return {metric: mean_with_stderr([s[metric] for s in per_item]) for metric in task.metrics}
