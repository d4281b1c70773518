"""backend="lm-eval": lm-evaluation-harness's own tasks on an already-loaded quantkit model.

Needs `pip install lm-eval` and the Hugging Face hub (lm-eval downloads its datasets). The model is
wrapped in lm-eval's HFLM as is, so quantized modules (W4A16, W4A8 simulation) run inside lm-eval.
"""

from __future__ import annotations

from quantkit.eval.tasks import Task

# lm-eval metric keys ("metric,filter") -> quantkit's metric names
_METRIC_NAMES = {
    "acc,none": "acc",
    "acc_norm,none": "acc_norm",
    "exact_match,strict-match": "exact_match_strict",
    "exact_match,flexible-extract": "exact_match_flexible",
}


def check_available() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError as err:
        raise RuntimeError(
            "backend 'lm-eval' needs lm-evaluation-harness: pip install lm-eval (and hub access for its "
            "datasets); the native backend needs neither"
        ) from err


def evaluate_task(
    model, tokenizer, task: Task, *, limit: int | None, num_fewshot: int | None, batch_size: int
) -> tuple[dict[str, dict[str, float | None]], int | None]:
    """({metric: {"value", "stderr"}}, number of questions) from lm-eval's run of the matching task."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    shots = task.default_fewshot if num_fewshot is None else num_fewshot
    output = lm_eval.simple_evaluate(model=lm, tasks=[task.lm_eval_name], num_fewshot=shots, limit=limit)
    found = output["results"][task.lm_eval_name]
    metrics = {}
    for key, name in _METRIC_NAMES.items():
        if key in found:
            metric, selector = key.split(",")
            stderr = found.get(f"{metric}_stderr,{selector}")
            metrics[name] = {"value": float(found[key]), "stderr": _number_or_none(stderr)}
    # One task (or group: MMLU's subjects) per run, so the run's sample counts add up to this task's.
    questions = sum(counts.get("effective", 0) for counts in output.get("n-samples", {}).values())
    return metrics, questions or None


def _number_or_none(value) -> float | None:
    # lm-eval writes "N/A" where it has no stderr
    return float(value) if isinstance(value, int | float) else None
