"""Evaluation results as JSON, a Markdown report with deltas against the first model, PNG plots, rich tables.

`results` is what `run_eval` returns: {"date", "config", "prompts", "models": [{"label", "model",
"tasks": {task: {"metrics": {metric: {"value", "stderr"}}, "n", "num_fewshot", "primary_metric",
"seconds"}}, "perplexity": {text: {"ppl", ...}}, "generations": [str, ...], and for every model after the first
when speculative decoding was measured "speculative": quantkit.eval.speculative.acceptance's dict, and when timed
"speed": quantkit.eval.speed.measure_speed's dict}, ...]}.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

from rich.table import Table

PPL_KEY = "ppl"


def _percent(entry: dict) -> str:
    value, stderr = entry["value"], entry["stderr"]
    text = f"{100 * value:.1f}"
    return text if stderr is None else f"{text} ± {100 * stderr:.1f}"


def _delta_points(value: float, base: float) -> str:
    return f"{100 * (value - base):+.1f}"


def _delta_relative(value: float, base: float) -> str:
    return f"{100 * (value / base - 1):+.1f}%" if base else "n/a"


def task_rows(results: dict) -> list[list[str]]:
    """[task, metric, n, shots, value per model..., delta per model after the first...] for every metric."""
    models = results["models"]
    base = models[0]["tasks"]
    rows = []
    for task, first in base.items():
        for metric, base_entry in first["metrics"].items():
            values = [m["tasks"][task]["metrics"][metric] for m in models]
            deltas = [_delta_points(v["value"], base_entry["value"]) for v in values[1:]]
            rows.append(
                [task, metric, str(first["n"]), str(first["num_fewshot"])]
                + [_percent(v) for v in values]
                + deltas
            )
    return rows


def perplexity_rows(results: dict) -> list[list[str]]:
    models = results["models"]
    rows = []
    for text, base_entry in models[0]["perplexity"].items():
        values = [m["perplexity"][text][PPL_KEY] for m in models]
        deltas = [_delta_relative(v, base_entry[PPL_KEY]) for v in values[1:]]
        rows.append([text] + [f"{v:.3f}" for v in values] + deltas)
    return rows


def kl_rows(results: dict) -> list[list[str]]:
    """Per text, each model's mean KL(first || model) of the next-token distributions, where it was measured."""
    models = results["models"]
    if len(models) < 2:
        return []
    return [[text, "-", *[f"{m['perplexity'][text]['kl']:.4f}" for m in models[1:]], *[""] * (len(models) - 1)]
            for text in models[0]["perplexity"] if all("kl" in m["perplexity"][text] for m in models[1:])]


def speculative_headers(results: dict) -> list[str]:
    return ["draft", "tokens", "greedy match", "alpha (T=1)", *[f"k={k}" for k in results["config"]["draft_tokens"]]]


def speculative_rows(results: dict) -> list[list[str]]:
    """Per draft model: greedy match rate, alpha at temperature 1, then per draft length k the tokens per target
    pass, greedy (exact) / at T=1 (i.i.d. estimate)."""
    rows = []
    for model in results["models"][1:]:
        found = model["speculative"]
        per_pass = [f"{greedy:.2f} / {sampled:.2f}" for greedy, sampled in
                    zip(found["greedy_tokens_per_pass"].values(), found["expected_tokens_per_pass_t1"].values(),
                        strict=True)]
        rows.append([model["label"], str(found["tokens"]), f"{100 * found['greedy_match']:.1f}%",
                     f"{100 * found['alpha_t1']:.1f}%", *per_pass])
    return rows


def speed_summary(measured: dict) -> str:
    """One line: tokens/s of each timed cell, or why none was timed."""
    if "skipped" in measured:
        return f"not timed ({measured['skipped']})"
    return ", ".join(f"{cell} {entry['tokens_per_s']:.0f} tokens/s" for cell, entry in measured.items()
                     if isinstance(entry, dict))


def speed_headers(results: dict) -> list[str]:
    return ["step", *_labels(results), *[f"speedup {label}" for label in _labels(results)[1:]]]


def speed_rows(results: dict) -> list[list[str]]:
    """Per timed step (decode at each batch size, prefill): ms and tokens/s per model, then each later model's
    speedup over the first ("n/a" where a model was not timed)."""
    measured = [m["speed"] for m in results["models"]]
    cells = list(dict.fromkeys(c for m in measured for c, e in m.items() if isinstance(e, dict)))
    rows = []
    for cell in cells:
        found = [m.get(cell) for m in measured]
        values = [f"{e['ms']:.2f} ms, {e['tokens_per_s']:.0f} tok/s" if e else "n/a" for e in found]
        speedups = [f"{found[0]['ms'] / e['ms']:.2f}x" if e and found[0] else "n/a" for e in found[1:]]
        rows.append([cell, *values, *speedups])
    return rows


def decode_curve(speed: dict, suffix: str = "") -> list[tuple[int, float, float]]:
    """(batch, ms per step, tokens/s) of each timed decode step (cells decode_b{B}{suffix}), by batch size."""
    cell_name = re.compile(rf"decode_b(\d+){re.escape(suffix)}")
    return sorted((int(found.group(1)), entry["ms"], entry["tokens_per_s"]) for cell, entry in speed.items()
                  if (found := cell_name.fullmatch(cell)) and isinstance(entry, dict))


def throughput_at(curve: list[tuple[int, float, float]], ms: float) -> float | None:
    """Tokens/s the model serves at a step time of `ms`: interpolated linearly in step time between two consecutive
    timed batch sizes whose step times bracket it (the best such pair); None where no pair does: every timed step
    is slower than `ms`, or every one faster (the sweep ends before that latency)."""
    candidates = [tps for _, step_ms, tps in curve if step_ms == ms]
    for (_, ms0, tps0), (_, ms1, tps1) in itertools.pairwise(curve):
        if ms0 != ms1 and min(ms0, ms1) <= ms <= max(ms0, ms1):
            candidates.append(tps0 + (tps1 - tps0) * (ms - ms0) / (ms1 - ms0))
    return max(candidates, default=None)


def equal_latency_rows(results: dict) -> list[list[str]]:
    """Per decode batch of the first model: its step time and tokens/s, then each later model's tokens/s at that
    step time (throughput_at) and the ratio to the first's: the speedup a server gets at equal latency."""
    curves = [decode_curve(m["speed"]) for m in results["models"]]
    rows = []
    for batch, ms, tps in curves[0]:
        others = [throughput_at(curve, ms) for curve in curves[1:]]
        rows.append([f"{ms:.2f} ms (batch {batch})", f"{tps:.0f}",
                     *[f"{o:.0f}" if o is not None else "n/a" for o in others],
                     *[f"{o / tps:.2f}x" if o is not None else "n/a" for o in others]])
    return rows


def fastest_rows(results: dict) -> list[list[str]]:
    """Per timed decode batch and the prefill: the model with the shortest step and its speedup over the first."""
    measured = [m["speed"] for m in results["models"]]
    cells = list(dict.fromkeys(c for m in measured for c, e in m.items() if isinstance(e, dict)))
    rows = []
    for cell in cells:
        timed = [(m[cell]["ms"], label) for m, label in zip(measured, _labels(results), strict=True) if cell in m]
        ms, label = min(timed)
        base = measured[0].get(cell)
        rows.append([cell, label, f"{base['ms'] / ms:.2f}x" if base else "n/a"])
    return rows


def has_equal_latency(results: dict) -> bool:
    """Several models, and the first timed at two decode batch sizes or more (a curve to compare along)."""
    return len(results["models"]) > 1 and len(decode_curve(results["models"][0].get("speed", {}))) > 1


def equal_latency_headers(results: dict) -> list[str]:
    return ["step time", *_labels(results), *[f"speedup {label}" for label in _labels(results)[1:]]]


def equal_latency_table(results: dict) -> Table:
    return _rich_table("Tokens/s within the first model's step time (speedup at equal latency)",
                       equal_latency_headers(results), equal_latency_rows(results))


def speed_table(results: dict) -> Table:
    devices = sorted({m["speed"].get("device", "") for m in results["models"]} - {""})
    return _rich_table(f"Speed ({', '.join(devices) or 'not timed'}): static-cache steps, CUDA-graph replays on a GPU",
                       speed_headers(results), speed_rows(results))


def _rich_table(title: str, headers: list[str], rows: list[list[str]]) -> Table:
    """The first column (the row's name) left-aligned, the figures right-aligned."""
    table = Table(title=title)
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    return table


def _labels(results: dict) -> list[str]:
    return [m["label"] for m in results["models"]]


def _delta_headers(results: dict) -> list[str]:
    return [f"Δ {label}" for label in _labels(results)[1:]]


def summary_table(results: dict) -> Table:
    """Accuracy (%) ± stderr per task and metric, then perplexity per text, one column per model."""
    table = Table(title="quantkit evaluation (accuracy in %, Δ against the first model)")
    for header in ["task / text", "metric", "n", *_labels(results), *_delta_headers(results)]:
        table.add_column(header, justify="left" if header in ("task / text", "metric") else "right")
    for row in task_rows(results):
        table.add_row(row[0], row[1], row[2], *row[4:])
    for row in perplexity_rows(results):
        table.add_row(row[0], "perplexity", "", *row[1:])
    for row in kl_rows(results):
        table.add_row(row[0], "KL vs first", "", *row[1:])
    return table


def speculative_table(results: dict) -> Table:
    return _rich_table(f"Speculative decoding, target {results['models'][0]['label']}: tokens per target pass "
                       "with k drafted, greedy / T=1", speculative_headers(results), speculative_rows(results))


def generations_table(results: dict) -> Table:
    table = Table(title="Generations (greedy)", show_lines=True)
    table.add_column("prompt")
    for label in _labels(results):
        table.add_column(label)
    for i, prompt in enumerate(results["prompts"]):
        table.add_row(prompt, *[m["generations"][i] for m in results["models"]])
    return table


def _markdown_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"

    return [line(headers), line(["---"] * len(headers)), *map(line, rows), ""]


def _fenced(text: str) -> list[str]:
    return ["~~~~text", text.replace("~~~~", "~ ~ ~ ~"), "~~~~", ""]


def markdown_report(results: dict, plots: list[str]) -> str:
    config = results["config"]
    lines = [
        "# quantkit evaluation",
        "",
        f"Date: {results['date']}. Backend: {config['backend']}; limit: {config['limit']}; "
        f"few-shot: {config['num_fewshot'] if config['num_fewshot'] is not None else 'task default'}; "
        f"device: {config['device']}. Accuracy in %, ± the standard error of the mean; "
        "Δ in points (accuracy) or % (perplexity) against the first model.",
        "",
        "## Models",
        "",
        *_markdown_table(
            ["label", "model", "load (s)"],
            [[m["label"], m["model"], f"{m['load_seconds']:.1f}" if "load_seconds" in m else "layer by layer"]
             for m in results["models"]],
        ),
    ]
    if results["models"][0]["tasks"]:
        headers = ["task", "metric", "n", "shots", *_labels(results), *_delta_headers(results)]
        lines += ["## Tasks", "", *_markdown_table(headers, task_rows(results))]
    if results["models"][0]["perplexity"]:
        headers = ["text", *_labels(results), *_delta_headers(results)]
        lines += [
            f"## Perplexity (seqlen {config['seqlen']})",
            "",
            *_markdown_table(headers, perplexity_rows(results)),
        ]
        if kl_rows(results):
            lines += ["", "Mean KL(first || model) of the next-token distributions:", "",
                      *_markdown_table(headers, kl_rows(results))]
    lines += [f"![{Path(p).stem}]({p})\n" for p in plots]
    if config.get("draft_tokens"):
        lines += [
            f"## Speculative decoding (target: {results['models'][0]['label']})",
            "",
            "Each model after the first drafts for the first on the evaluation prompts (the first's greedy "
            f"continuations, up to {config['max_new_tokens']} tokens each). Greedy: the share of positions where "
            "the draft's greedy token is the target's; alpha (T=1): the probability that a token sampled from the "
            "draft is accepted (sum of min(p, q) over the vocabulary). Columns k: tokens per target forward pass "
            "with k drafted tokens per pass, greedy (exact) / T=1 (if acceptances are independent, "
            "(1 - alpha^(k+1)) / (1 - alpha)).",
            "",
            *_markdown_table(speculative_headers(results), speculative_rows(results)),
        ]
    if config.get("speed_batches") is not None:
        skipped = [f"{m['label']}: {m['speed']['skipped']}" for m in results["models"] if "skipped" in m["speed"]]
        timed = next((m["speed"] for m in results["models"] if "prompt" in m["speed"]), {})
        prompt, attention = timed.get("prompt", "P"), timed.get("attention", "SDPA")
        lines += [
            "## Speed",
            "",
            "quantkit.eval.static_decoder.StaticDecoder's steps (q/k/v and gate/up fused, a static KV cache of "
            f"{prompt} + 1 positions; decode steps attend with {attention}): one decode step of B tokens "
            f"(decode_bB) and the prefill of one {prompt}-token prompt, median of CUDA-graph replays on a "
            "GPU (wall clock on a CPU)"
            + (f"; decode steps through torch.compile ({config['speed_compile']})." if config.get("speed_compile")
               else "."),
            "",
            *_markdown_table(speed_headers(results), speed_rows(results)),
            *[f"Not timed: {line}\n" for line in skipped],
        ]
        if has_equal_latency(results):
            lines += [
                "At equal latency: at each of the first model's decode step times, the tokens/s each model serves "
                "within that step time (interpolated between its two timed batch sizes that bracket it; n/a outside "
                "its sweep) and the ratio to the first's.",
                "",
                *_markdown_table(equal_latency_headers(results), equal_latency_rows(results)),
            ]
        fastest = fastest_rows(results)
        if fastest:
            lines += ["Fastest at each step:", "",
                      *_markdown_table(["step", "fastest", "speedup over the first"], fastest)]
    if results["models"][0]["generations"]:
        lines += ["## Generations", ""]
        for i, prompt in enumerate(results["prompts"]):
            lines += [f"### Prompt {i + 1}", "", *_fenced(prompt)]
            for model in results["models"]:
                lines += [f"**{model['label']}**", "", *_fenced(model["generations"][i])]
    return "\n".join(lines)


def _grouped_bars(
    ax, groups: list[str], series: dict[str, list[float]], errors: dict[str, list[float]] | None
):
    width = 0.8 / max(len(series), 1)
    for k, (label, values) in enumerate(series.items()):
        positions = [i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))]
        yerr = errors[label] if errors else None
        ax.bar(positions, values, width, yerr=yerr, capsize=3, label=label)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    ax.legend()


def write_plots(results: dict, report_dir: Path) -> list[str]:
    """accuracy.png (primary metric per task per model), perplexity.png (per text) and speed.png (tokens/s against
    ms per decode step, one line per model over its batch sizes), where there is data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = results["models"]
    written = []
    tasks = list(models[0]["tasks"])
    if tasks:
        fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(tasks)), 4))
        primary = {t: models[0]["tasks"][t]["primary_metric"] for t in tasks}
        entries = {m["label"]: [m["tasks"][t]["metrics"][primary[t]] for t in tasks] for m in models}
        values = {label: [100 * e["value"] for e in es] for label, es in entries.items()}
        errors = {label: [100 * (e["stderr"] or 0.0) for e in es] for label, es in entries.items()}
        _grouped_bars(ax, [f"{t}\n{primary[t]}" for t in tasks], values, errors)
        ax.set_ylabel("accuracy (%)")
        ax.set_title("Accuracy per task")
        written.append(_save(fig, report_dir / "accuracy.png"))
    texts = list(models[0]["perplexity"])
    if texts:
        fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(texts)), 4))
        values = {m["label"]: [m["perplexity"][t][PPL_KEY] for t in texts] for m in models}
        _grouped_bars(ax, texts, values, None)
        ax.set_ylabel("perplexity")
        ax.set_title("Perplexity per text (lower is better)")
        written.append(_save(fig, report_dir / "perplexity.png"))
    curves = {m["label"]: decode_curve(m["speed"]) for m in models if "speed" in m}
    if any(len(curve) > 1 for curve in curves.values()):
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for label, curve in curves.items():
            ax.plot([ms for _, ms, _ in curve], [tps for _, _, tps in curve], marker="o", label=label)
            for batch, ms, tps in curve:
                ax.annotate(str(batch), (ms, tps), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xlabel("ms per decode step (latency per token)")
        ax.set_ylabel("tokens/s")
        ax.set_title("Throughput against latency (points: batch sizes)")
        ax.legend()
        written.append(_save(fig, report_dir / "speed.png"))
    plt.close("all")
    return written


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path.name


def _jsonable(value):
    """NaN and infinity become null: strict JSON has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def write_json(results: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(results), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


RESULTS_JSON = "results.json"


def write_report(results: dict, report_dir: Path) -> dict[str, Path]:
    """results.json (first: the plots need matplotlib and may fail), report.md and the plots in report_dir."""
    written = {"json": write_json(results, report_dir / RESULTS_JSON)}
    plots = write_plots(results, report_dir)
    markdown = report_dir / "report.md"
    markdown.write_text(markdown_report(results, plots) + "\n", encoding="utf-8")
    written["markdown"] = markdown
    written.update({Path(p).stem: report_dir / p for p in plots})
    return written
