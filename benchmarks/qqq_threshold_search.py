"""How close QQQ's refined threshold search comes to evaluating every threshold (the reference), on a real model.

For the first --layers decoder layers, every smoothing group's loss is computed at every threshold of the grid
(--steps, default the reference rule max(100, max|x| / 0.5)); the model proceeds with the grid's choice, as the
reference would. On those recorded losses the script then replays `refine_on_grid` (the default search visits
exactly these indices and gets exactly these losses) and a grid of half the steps, and reports each one's
regret (its minimum over the full grid's, minus one) and its number of loss evaluations.

    python benchmarks/qqq_threshold_search.py --group 64 --layers 6 --steps 200 --out benchmarks/accuracy/x.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from datetime import date
from pathlib import Path

import torch

import quantkit.quantizers.qqq as qqq
import quantkit.quantizers.qqq_search as qqq_search
from quantkit.config import QuantConfig
from quantkit.data import build_calibration_set, load_passages
from quantkit.engine import quantize_model
from quantkit.models import get_adapter, load_model


class _Recorded(Exception):
    """Raised once the requested layers' groups are recorded: the rest of the model need not be quantized."""


def record_losses(model_path: str | None, group: int, layers: int, steps: int | None, samples: int) -> list[dict]:
    """Per smoothing group of the first `layers` layers: the group, its bound and the loss at each threshold."""
    model, tokenizer = load_model(model_path)
    calib = build_calibration_set(tokenizer, load_passages(None), nsamples=16, seqlen=256, seed=0)
    curves: list[dict] = []
    search, smooth_layer = qqq.search_smoothing, qqq.QQQ.smooth_layer

    def full_grid(probe: qqq_search.SmoothingProbe, _steps: int | None, _search: str) -> qqq_search.SmoothingChoice:
        losses: list[float] = []
        loss = probe.loss
        probe.loss = lambda scales: losses.append(loss(scales)) or losses[-1]  # the grid goes in index order
        start = time.perf_counter()
        choice = search(probe, steps, "grid")
        curves.append({"bound": probe.bound(), "losses": losses, "seconds": time.perf_counter() - start})
        return choice

    def first_layers(method: qqq.QQQ, ctx) -> dict:
        if ctx.index == layers:
            raise _Recorded
        return smooth_layer(method, ctx)

    qqq.search_smoothing, qqq.QQQ.smooth_layer = full_grid, first_layers
    config = QuantConfig(method="qqq", group_size=group, act_bits=8,
                         options=qqq.QQQOptions(smooth_samples=samples, smooth_steps=steps))
    try:
        quantize_model(model, get_adapter(model), calib, config, device="cpu", batch_size=8, show_progress=False)
    except _Recorded:
        pass
    finally:
        qqq.search_smoothing, qqq.QQQ.smooth_layer = search, smooth_layer
    return curves


def refined(losses: list[float]) -> tuple[float, int]:
    """(minimum, evaluations) of the default search on these losses."""
    seen: dict[int, float] = {}

    def loss(index: int) -> float:
        seen[index] = losses[index]
        return losses[index]

    qqq_search.refine_on_grid(loss, len(losses))
    return min(seen.values()), len(seen)


def summarize(curves: list[dict]) -> dict[str, dict[str, float]]:
    """Per search: mean and worst regret (%), mean evaluations."""
    searches = {"grid (reference)": lambda losses: (min(losses), len(losses)),
                "grid, half the steps": lambda losses: (min(losses[::2]), len(losses[::2])),
                "refine (default)": refined}
    table = {}
    for name, search in searches.items():
        found = [search(c["losses"]) for c in curves]
        regrets = [100 * (value / min(c["losses"]) - 1) for (value, _), c in zip(found, curves, strict=True)]
        table[name] = {"mean_regret_pct": sum(regrets) / len(regrets), "worst_regret_pct": max(regrets),
                       "mean_evaluations": sum(n for _, n in found) / len(found)}
    return table


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    parser.add_argument("--group", type=int, default=64, help="QQQ group size (-1: per channel)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=None, help="grid steps (default: the reference rule)")
    parser.add_argument("--samples", type=int, default=8, help="calibration sequences of the loss")
    parser.add_argument("--out", type=Path, required=True, help="markdown file; the curves go beside it (.json)")
    args = parser.parse_args()
    curves = record_losses(args.model, args.group, args.layers, args.steps, args.samples)
    table = summarize(curves)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    command = "python benchmarks/qqq_threshold_search.py " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items() if v is not None and k != "out")
    seconds = sum(c["seconds"] for c in curves) / sum(len(c["losses"]) for c in curves)
    lines = [f"# QQQ threshold search: refined vs every threshold, {args.model or 'SmolLM2-135M'}", "",
             f"- date: {date.today().isoformat()}; CPU, {torch.get_num_threads()} threads; commit {commit}",
             f"- command: `{command}`",
             f"- {len(curves)} smoothing groups (first {args.layers} layers), grids of "
             f"{min(len(c['losses']) for c in curves)}-{max(len(c['losses']) for c in curves)} thresholds; "
             f"one loss evaluation {1000 * seconds:.0f} ms on average",
             "- regret: the search's lowest loss over the full grid's lowest, minus one", "",
             "| search | mean regret | worst regret | loss evaluations per group |", "|---|---|---|---|"]
    lines += [f"| {name} | {row['mean_regret_pct']:.3f}% | {row['worst_regret_pct']:.2f}% | "
              f"{row['mean_evaluations']:.1f} |" for name, row in table.items()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps({"command": command, "commit": commit, "table": table,
                                                         "curves": curves}))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
