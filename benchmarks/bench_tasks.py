"""Task accuracy (and perplexity, side-by-side generations) of SmolLM2-135M quantized by each method:
one `quantkit eval` report with fp and every quantized model, same items, same prompts.

    python benchmarks/bench_tasks.py --report benchmarks/accuracy/smollm2_tasks \
        --runs rtn:64 gptq:64 awq:64:asym qqq:64:a8 --tasks arc_easy,arc_challenge,hellaswag,...,gsm8k:250

Runs are bench_accuracy.py's METHOD:GROUP[:a8][:asym][:noao]; each model is quantized (calibration: the
shipped English+Korean set) when its turn comes, so only one quantized model lives at a time; each model's
results are written as soon as it is done (REPORT/models/N.json), and `--merge REPORT` rebuilds the
report from whatever is there. On a machine
without `datasets` or the task packages, point QUANTKIT_TASK_DATA at a mirror written by
`python -m quantkit.eval.task_data DIR`.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from bench_accuracy import parse_run
from rich.console import Console

from quantkit.data import build_calibration_set, load_passages
from quantkit.engine import quantize_model
from quantkit.eval import report
from quantkit.eval.runner import run_eval
from quantkit.models import get_adapter, load_model
from quantkit.nn.qlinear import QuantLinear

ALL_TASKS = "arc_easy,arc_challenge,hellaswag,winogrande,piqa,boolq,mmlu,gsm8k"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    parser.add_argument("--runs", nargs="+", default=["fp", "rtn:64", "gptq:64", "awq:64:asym", "qqq:64:a8"],
                        help="fp (unquantized) or METHOD:GROUP[:a8][:asym][:noao]")
    parser.add_argument("--first-index", type=int, default=0, help="REPORT/models/N.json numbering (to add runs)")
    parser.add_argument("--tasks", default=ALL_TASKS, help="comma-separated, NAME or NAME:ITEMS")
    parser.add_argument("--limit", type=int, default=None, help="items per task without its own count")
    parser.add_argument("--windows", type=int, default=None, help="perplexity windows per text (default: all)")
    parser.add_argument("--nsamples", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--smooth-samples", type=int, default=16, help="QQQ loss samples")
    parser.add_argument("--eval-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--batch-size", type=int, default=32, help="evaluation batch size")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--merge", action="store_true", help="only rebuild REPORT from REPORT/models/*.json")
    args = parser.parse_args()
    if not args.merge:
        evaluate_each(args)
    merge(args.report)


def merge(report_dir: Path) -> None:
    """One report (JSON, Markdown, plots) from the per-model results, fp first."""
    files = sorted((report_dir / "models").glob("*.json"), key=lambda p: int(p.stem))
    parts = [json.loads(p.read_text(encoding="utf-8")) for p in files]
    merged = {**parts[0], "models": [entry for part in parts for entry in part["models"]]}
    merged["config"]["models"] = [entry["model"] for entry in merged["models"]]
    report.write_report(merged, report_dir)
    Console().print(report.summary_table(merged))


def evaluate_each(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model, tokenizer = load_model(args.model)
    calib = build_calibration_set(tokenizer, load_passages(None), args.nsamples, args.seqlen, seed=0)
    eval_dtype = getattr(torch, args.eval_dtype)
    console = Console()

    def loader(name: str):
        if name == "fp":
            return copy.deepcopy(model).to(eval_dtype), tokenizer, f"fp ({args.eval_dtype})"
        config = parse_run(name, smooth_samples=args.smooth_samples)
        quantized = copy.deepcopy(model)
        start = time.perf_counter()
        quantize_model(quantized, get_adapter(quantized), calib, config, device=args.device, show_progress=False)
        console.print(f"{config.label()}: quantized in {time.perf_counter() - start:.1f} s")
        quantized.to(device=args.device, dtype=eval_dtype)
        for module in quantized.modules():
            if isinstance(module, QuantLinear):
                module.cache_dense_weight()
        return quantized, tokenizer, config.label()

    for index, name in enumerate(args.runs, start=args.first_index):
        run_eval([name], texts=None, tasks=args.tasks.split(","), limit=args.limit, num_fewshot=None,
                 generations=True, report_dir=None, json_path=args.report / "models" / f"{index}.json",
                 batch_size=args.batch_size, device=args.device, console=console, loader=loader,
                 max_windows=args.windows)


if __name__ == "__main__":
    main()
