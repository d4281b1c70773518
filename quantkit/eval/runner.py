"""`run_eval`: tasks, perplexity, side-by-side generations and speculative-decoding acceptance for several models,
then the report."""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from quantkit import __version__
from quantkit.eval import lm_eval_backend, native, report, speculative, speed
from quantkit.eval.generation import generate
from quantkit.eval.tasks import Task, build_prompts, get_task
from quantkit.qtensor import QuantizationError
from quantkit.streaming.hidden import device_available

BACKENDS = ("native", "lm-eval")
DEFAULT_MAX_NEW_TOKENS = 128

Loader = Callable[[str], tuple]  # path or name -> (model, tokenizer, label)


def load_prompts(path: Path | None = None) -> list[str]:
    """Generation prompts from a JSON file: a list of strings or of {"prompt": ...} objects."""
    if path is None:
        from quantkit.data import shipped_file

        path = shipped_file("eval_prompts.json")
    entries = json.loads(Path(path).read_text(encoding="utf-8"))
    entries = entries["prompts"] if isinstance(entries, dict) else entries
    return [e if isinstance(e, str) else e["prompt"] for e in entries]


def _text_sources(texts: list[str] | None) -> dict[str, str]:
    """label -> source (a file or a hub dataset name); None means the shipped held-out texts."""
    if texts is None:
        from quantkit.data import default_heldout_texts

        return {label: str(path) for label, path in default_heldout_texts().items()}
    return {Path(t).stem if Path(t).suffix else t: t for t in texts}


def task_limits(specs: list[str], limit: int | None) -> dict[str, int | None]:
    """Task name -> items to run, from specs 'name' (all, or `limit`) or 'name:N' (N, overriding `limit`)."""
    limits: dict[str, int | None] = {}
    for spec in specs:
        name, _, count = spec.partition(":")
        if count and not (count.isdigit() and int(count) > 0):
            raise ValueError(f"task {spec!r}: the item count after ':' must be a positive integer")
        limits[name] = int(count) if count else limit
    return limits


def _default_loader(device: str) -> Loader:
    from quantkit.models import load_for_eval

    return lambda name: load_for_eval(name, device=device)


def _resolve_device(device: str | None) -> str:
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def _place(model, device: str):
    if getattr(model, "hf_device_map", None) is None:  # a model dispatched by accelerate stays put
        model = model.to(device)
    return model.eval()


def _unique_label(label: str, taken: list[str]) -> str:
    candidate, k = label, 2
    while candidate in taken:
        candidate, k = f"{label} ({k})", k + 1
    return candidate


def run_eval(
    models: list[str],
    *,
    texts: list[str] | None,
    tasks: list[str],
    limit: int | None,
    num_fewshot: int | None,
    generations: bool,
    report_dir: Path | None,
    json_path: Path | None,
    batch_size: int,
    device: str | None,
    backend: str = "native",
    seqlen: int = 512,
    console: Console | None = None,
    loader: Loader | None = None,
    prompts: list[str] | None = None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    max_windows: int | None = None,
    draft_tokens: list[int] | None = None,
    speed_batches: list[int] | None = None,
    speed_compile: str | None = None,
    layerwise: bool | None = None,
) -> dict:
    """Evaluate each model (the first is the baseline for deltas) and write the requested outputs.

    texts: perplexity sources (files or hub names); None = the shipped English and Korean held-out
    text, [] = no perplexity. prompts: for generations and speculative decoding; None =
    calib_data/eval_prompts.json. draft_tokens: draft lengths at which every model after the first is
    measured as a speculative-decoding draft for the first (quantkit.eval.speculative); None = not measured.
    speed_batches: batch sizes at which each model's decode step (and its prefill) is timed
    (quantkit.eval.speed); None = not timed. speed_compile: the torch.compile backend of the timed decode steps
    (None: not compiled). layerwise: perplexity and KL one decoder layer at a time (quantkit.eval.layerwise);
    None: when a model does not fit in the device's free memory, said on the console.
    """
    console = console or Console()
    device = _resolve_device(device)
    _check_request(models, backend, draft_tokens)
    if layerwise is None:
        too_big = [m for m in models if not fits(m, device)]
        layerwise = bool(too_big)
        if too_big:
            console.print(f"{too_big[0]} does not fit in the free memory of {device}: perplexity and KL are "
                          "computed one layer at a time (--layerwise); nothing else is measured")
    if layerwise:
        check_layerwise_request(models, tasks, generations, draft_tokens, speed_batches)
    limits = task_limits(tasks, limit)
    task_list = [get_task(name) for name in limits]
    sources = _text_sources(texts)
    wants_prompts = generations or draft_tokens is not None
    prompt_list = (prompts if prompts is not None else load_prompts()) if wants_prompts else []
    # task data is read (and a missing package reported) before any model is loaded
    prepared = (
        {t.name: build_prompts(t, limits[t.name], num_fewshot) for t in task_list} if backend == "native" else {}
    )
    config = {
        "models": list(models),
        "tasks": list(limits),
        "limit": limit,
        "limits": limits,
        "num_fewshot": num_fewshot,
        "backend": backend,
        "texts": sources,
        "seqlen": seqlen,
        "max_windows": max_windows,
        "batch_size": batch_size,
        "device": device,
        "generations": generations,
        "max_new_tokens": max_new_tokens,
        "draft_tokens": draft_tokens,
        "speed_batches": speed_batches,
        "speed_compile": speed_compile,
        "layerwise": layerwise,
        "versions": _versions(),
    }
    results = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "config": config,
               "prompts": prompt_list, "models": []}

    def keep(entries: list[dict]) -> None:  # each finished model's metrics are on disk before the next one loads
        if json_path is not None:
            report.write_json({**results, "models": entries}, Path(json_path))

    if layerwise:
        results["models"] = _evaluate_layerwise(sources, config, console)
        keep(results["models"])
    else:
        results["models"] = _evaluate_all(loader or _default_loader(device), task_list, prepared, sources,
                                          prompt_list, config, console, keep)
    write_outputs(results, json_path, report_dir, console)
    _print_tables(results, console)
    return results


def _evaluate_all(loader: Loader, task_list: list[Task], prepared: dict, sources: dict[str, str],
                  prompt_list: list[str], config: dict, console: Console,
                  keep: Callable[[list[dict]], None]) -> list[dict]:
    entries: list[dict] = []
    target = None
    for name in config["models"]:
        entry, target = _evaluate_model(name, loader, task_list, prepared, sources, prompt_list, config, console, target)
        entry["label"] = _unique_label(entry["label"], [m["label"] for m in entries])
        entries.append(entry)
        keep(entries)
    return entries


def fits(source: str, device: str) -> bool:
    """Whether `source` loaded whole for evaluation fits in 90% of the device's free memory, judged by its
    safetensors bytes (a full-precision checkpoint at the evaluation dtype; an export as packed). Sources that
    are not local folders (GGUF, hub names) are taken to fit."""
    from quantkit.models.loading import default_dtype, is_quantkit_export

    folder = Path(source).expanduser()
    files = list(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return True
    size = sum(f.stat().st_size for f in files)
    if not is_quantkit_export(folder):
        size = size * default_dtype(device).itemsize // 2  # bf16 on disk
    return size <= 0.9 * device_available(torch.device(device))


def check_layerwise_request(models: list[str], tasks: list[str], generations: bool, draft_tokens: list[int] | None,
                            speed_batches: list[int] | None) -> None:
    """Layer-wise evaluation measures perplexity and KL of local safetensors folders and quantkit exports only."""
    from quantkit.models.loading import is_quantkit_export

    wanted = [name for name, asked in (("--tasks", tasks), ("--generations", generations),
                                       ("--speculative", draft_tokens is not None),
                                       ("--speed", speed_batches is not None)) if asked]
    if wanted:
        raise QuantizationError(f"{wanted[0]} needs the whole model in memory; layer-wise evaluation measures "
                                "perplexity and KL only")
    for model in models:
        folder = Path(model).expanduser()
        if not (is_quantkit_export(folder) or list(folder.glob("*.safetensors"))):
            raise QuantizationError(f"{model}: layer-wise evaluation reads local safetensors folders and quantkit "
                                    "exports only")


def _evaluate_layerwise(sources: dict[str, str], config: dict, console: Console) -> list[dict]:
    """Every model's perplexity per text, those after the first with their KL against it, a layer at a time."""
    from quantkit.data import load_text
    from quantkit.eval.layerwise import layerwise_perplexity
    from quantkit.models.loading import load_tokenizer

    models = config["models"]
    entries = [{"model": m, "label": Path(m).name or m, "tasks": {}, "perplexity": {}, "generations": []}
               for m in models]
    start = time.perf_counter()
    per_text = layerwise_perplexity(models, load_tokenizer(models[0]),
                                    {label: load_text(source) for label, source in sources.items()},
                                    seqlen=config["seqlen"], max_windows=config["max_windows"],
                                    batch_size=config["batch_size"], device=config["device"])
    console.print(f"  every text through each model, layer by layer: {time.perf_counter() - start:.1f} s")
    for label, scores in per_text.items():
        for entry, score in zip(entries, scores, strict=True):
            entry["perplexity"][label] = score
        console.print(f"  perplexity {label}: " + ", ".join(
            f"{e['label']} {s[report.PPL_KEY]:.3f}" + (f" (KL {s['kl']:.4f})" if "kl" in s else "")
            for e, s in zip(entries, scores, strict=True)))
    for i, entry in enumerate(entries):
        entry["label"] = _unique_label(entry["label"], [e["label"] for e in entries[:i]])
    return entries


def _check_request(models: list[str], backend: str, draft_tokens: list[int] | None) -> None:
    if not models:
        raise ValueError("give at least one model to evaluate")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
    if backend == "lm-eval":
        lm_eval_backend.check_available()
    if draft_tokens is not None and (len(models) < 2 or not draft_tokens or min(draft_tokens) < 1):
        raise ValueError("speculative decoding needs a target and at least one draft model, and draft lengths >= 1")


def write_outputs(results: dict, json_path: Path | None, report_dir: Path | None, console: Console) -> None:
    """The JSON first (nothing in it can fail but the disk), then the report: a failing report never loses
    the metrics; its error says where they are."""
    saved = []
    if json_path is not None:
        saved.append(report.write_json(results, Path(json_path)))
        console.print(f"metrics: {saved[-1]}")
    if report_dir is None:
        return
    try:
        written = report.write_report(results, Path(report_dir))
    except Exception as err:  # plotting can fail in many ways (a backend, a font, the disk): keep the metrics
        saved.append(Path(report_dir) / report.RESULTS_JSON)
        kept = ", ".join(str(path) for path in saved if path.is_file()) or "nowhere (rerun with --json FILE)"
        raise QuantizationError(f"the report in {report_dir} failed ({type(err).__name__}: {err}); "
                                f"the metrics are saved in {kept}") from err
    console.print(f"report: {written['markdown']}")


def _print_tables(results: dict, console: Console) -> None:
    config = results["config"]
    console.print(report.summary_table(results))
    if config["draft_tokens"] is not None:
        console.print(report.speculative_table(results))
    if config["speed_batches"] is not None:
        console.print(report.speed_table(results))
        if report.has_equal_latency(results):
            console.print(report.equal_latency_table(results))
    if config["generations"]:
        console.print(report.generations_table(results))


def _evaluate_model(
    name: str,
    loader: Loader,
    task_list: list[Task],
    prepared: dict,
    sources: dict[str, str],
    prompt_list: list[str],
    config: dict,
    console: Console,
    target: speculative.TargetRun | None,
) -> tuple[dict, speculative.TargetRun | None]:
    """The model's entry, and the speculative-decoding target run (made from the first model, when asked for)."""
    console.print(f"loading {name}...", soft_wrap=True)
    start = time.perf_counter()
    model, tokenizer, label = loader(name)
    model = _place(model, config["device"])
    entry = {"model": name, "label": label, "load_seconds": time.perf_counter() - start}
    console.print(f"[bold]{label}[/bold] loaded in {entry['load_seconds']:.1f} s; evaluating")
    entry["tasks"] = {
        task.name: _run_task(model, tokenizer, task, prepared, config, console) for task in task_list
    }
    entry["perplexity"] = _perplexities(model, tokenizer, sources, config, console)
    entry["generations"] = _generations(model, tokenizer, prompt_list, config) if config["generations"] else []
    if config["draft_tokens"] is not None:
        start = time.perf_counter()
        if target is None:
            target = speculative.run_target(model, tokenizer, prompt_list, config["max_new_tokens"])
        else:
            entry["speculative"] = speculative.acceptance(model, tokenizer, target, config["draft_tokens"])
            console.print(f"  speculative draft: greedy match {100 * entry['speculative']['greedy_match']:.1f}%, "
                          f"alpha (T=1) {100 * entry['speculative']['alpha_t1']:.1f}% "
                          f"({time.perf_counter() - start:.1f} s)")
    if config["speed_batches"] is not None:  # last: its decoder fuses the model's q/k/v and gate/up
        entry["speed"] = speed.measure_speed(model, tuple(config["speed_batches"]),
                                             compile_backend=config["speed_compile"])
        console.print(f"  speed: {report.speed_summary(entry['speed'])}")
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return entry, target


def _run_task(model, tokenizer, task: Task, prepared: dict, config: dict, console: Console) -> dict:
    start = time.perf_counter()
    shots = task.default_fewshot if config["num_fewshot"] is None else config["num_fewshot"]
    if config["backend"] == "native":
        items = prepared[task.name]
        with _progress(console) as progress:
            bar = progress.add_task(task.name, total=native.request_count(task, items))
            metrics = native.evaluate_task(
                model,
                tokenizer,
                task,
                items,
                batch_size=config["batch_size"],
                progress=lambda n: progress.advance(bar, n),
            )
        n = len(items)
    else:
        metrics, n = lm_eval_backend.evaluate_task(
            model,
            tokenizer,
            task,
            limit=config["limits"][task.name],
            num_fewshot=config["num_fewshot"],
            batch_size=config["batch_size"],
        )
    seconds = time.perf_counter() - start
    primary = metrics[task.primary_metric]
    console.print(
        f"  {task.name}: {task.primary_metric} {100 * primary['value']:.1f} ({n} questions, {seconds:.1f} s)"
    )
    return {
        "metrics": metrics,
        "n": n,
        "num_fewshot": shots,
        "primary_metric": task.primary_metric,
        "seconds": seconds,
    }


def _perplexities(model, tokenizer, sources: dict[str, str], config: dict, console: Console) -> dict:
    if not sources:
        return {}
    from quantkit.data import load_text
    from quantkit.eval.perplexity import perplexity

    found = {}
    for label, source in sources.items():
        start = time.perf_counter()
        found[label] = perplexity(
            model,
            tokenizer,
            load_text(source),
            seqlen=config["seqlen"],
            max_windows=config["max_windows"],
            batch_size=config["batch_size"],
        )
        console.print(
            f"  perplexity {label}: {found[label][report.PPL_KEY]:.3f} ({time.perf_counter() - start:.1f} s)"
        )
    return found


def _generations(model, tokenizer, prompt_list: list[str], config: dict) -> list[str]:
    if not prompt_list:
        return []
    return generate(
        model,
        tokenizer,
        prompt_list,
        max_new_tokens=config["max_new_tokens"],
        batch_size=config["batch_size"],
        chat=True,
    )


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("  {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


def _versions() -> dict[str, str]:
    import transformers

    return {"quantkit": __version__, "torch": torch.__version__, "transformers": transformers.__version__}
