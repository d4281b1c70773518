"""The quantkit command line: `quantkit quantize` and `quantkit eval`."""

from __future__ import annotations

import logging
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from quantkit.qtensor import QuantizationError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Post-training 4-bit quantization of Hugging Face causal LMs.")
console = Console(stderr=True)


class Format(str, Enum):
    compressed_tensors = "compressed-tensors"
    gptq = "gptq"
    awq = "awq"


class SmoothSearch(str, Enum):
    refine = "refine"
    grid = "grid"


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s",
                        handlers=[RichHandler(console=console, show_path=False)], force=True)
    logging.getLogger("quantkit").setLevel(logging.INFO)


def _fail(err: Exception) -> None:
    console.print(f"[bold red]error:[/] {err}")
    raise typer.Exit(code=2)


def resolve_group_size(model, adapter, requested: str) -> int:
    """'auto': the largest of 128/64/32 dividing every quantized input size (576 -> 64 for SmolLM2).

    An explicit size is checked against every input size now, before any calibration work."""
    from quantkit.qtensor import check_group_size

    layer = adapter.get_layers(model)[0]
    sizes = {layer.get_submodule(n).in_features for n in adapter.linear_names() if _has_module(layer, n)}
    if requested != "auto":
        try:
            group = int(requested)
        except ValueError as err:
            raise QuantizationError(f"group size must be an integer or auto, got {requested!r}") from err
        if group in (32, 64, 128):
            for size in sorted(sizes):
                check_group_size(size, group)
        return group
    for group in (128, 64, 32):
        if all(s % group == 0 for s in sizes):
            return group
    return -1


def default_nsamples(device: str) -> int:
    """128 calibration samples (the GPTQ/AWQ papers' count) on a GPU; 32 on the CPU, where the
    statistics forward passes dominate (SmolLM2-135M on 2 cores: ~9.5 min for 128, ~2.5 min for 32;
    with act-order, 32 samples still reach a lower held-out perplexity than 128 without it)."""
    return 128 if torch.device(device).type == "cuda" else 32


def _has_module(layer, name: str) -> bool:
    try:
        layer.get_submodule(name)
        return True
    except AttributeError:
        return False


def _heldout_ppl(model, tokenizer, windows: int, seqlen: int) -> dict[str, float]:
    from quantkit.data import default_heldout_texts, load_text
    from quantkit.eval.perplexity import perplexity

    return {name: perplexity(model, tokenizer, load_text(path), seqlen=seqlen, max_windows=windows)["ppl"]
            for name, path in default_heldout_texts().items()}


@app.command()
def quantize(
    model: Annotated[str | None, typer.Argument(help="HF folder, .gguf file or hub name; default: embedded SmolLM2-135M")] = None,
    method: Annotated[str, typer.Option(help="rtn, gptq, awq or qqq")] = "gptq",
    bits: Annotated[int, typer.Option(help="weight bits: 4 or 8")] = 4,
    group_size: Annotated[str, typer.Option(help="-1 (per channel), 32, 64, 128 or auto")] = "auto",
    asym: Annotated[bool, typer.Option("--asym", help="asymmetric (zero-point) weights")] = False,
    act_order: Annotated[bool, typer.Option("--act-order/--no-act-order",
                                            help="GPTQ act-order with static groups (no inference cost)")] = True,
    act_bits: Annotated[int, typer.Option(help="16 (W4A16) or 8 (W4A8, per-token int8 activations)")] = 16,
    format: Annotated[Format, typer.Option("--format", help="checkpoint format")] = Format.compressed_tensors,
    calib: Annotated[str | None, typer.Option(help="calibration .txt/.jsonl or wikitext2/c4/pileval")] = None,
    nsamples: Annotated[int | None, typer.Option(help="calibration samples (default 128; 32 on the CPU)")] = None,
    seqlen: Annotated[int, typer.Option(help="tokens per calibration sample")] = 512,
    seed: Annotated[int, typer.Option(help="calibration sampling seed")] = 0,
    chat_template: Annotated[bool, typer.Option(help="wrap calibration text in the chat template")] = False,
    damp: Annotated[float, typer.Option(help="GPTQ relative dampening")] = 0.01,
    mse: Annotated[bool, typer.Option("--mse", help="search clipped scales by MSE")] = False,
    duo_scaling: Annotated[bool, typer.Option("--duo-scaling", help="AWQ: s = mean|x|^r / mean|w|^(1-r)")] = False,
    clip: Annotated[bool, typer.Option("--clip/--no-clip", help="AWQ: search clipping ranges")] = True,
    smooth_steps: Annotated[int | None, typer.Option(help="QQQ: thresholds searched (default max(100, max|x|/0.5))")] = None,
    smooth_search: Annotated[SmoothSearch, typer.Option(help="QQQ: refine (coarse-to-fine) or grid (every threshold, the reference)")] = SmoothSearch.refine,
    smooth_samples: Annotated[int | None, typer.Option(help="QQQ: calibration samples of the smoothing loss, rounded up to whole batches (default all)")] = None,
    smooth_check: Annotated[bool, typer.Option("--smooth-check/--no-smooth-check", help="QQQ: keep a group's smoothing only if it also helps after GPTQ")] = True,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="output folder")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace an existing output folder")] = False,
    dtype: Annotated[str, typer.Option(help="checkpoint dtype: auto (fp16; bf16 for Gemma), float16, bfloat16, float32")] = "auto",
    device: Annotated[str | None, typer.Option(help="work device (default: cuda if available)")] = None,
    batch_size: Annotated[int, typer.Option(help="calibration batch size")] = 8,
    evaluate: Annotated[bool, typer.Option("--eval/--no-eval", help="held-out perplexity before and after")] = True,
    eval_windows: Annotated[int, typer.Option(help="512-token windows per held-out text")] = 16,
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code")] = False,
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="allow .bin pickle weights")] = False,
    resume: Annotated[bool, typer.Option("--resume/--no-resume", help="continue an interrupted streaming run of the same command")] = True,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Calibrate and quantize MODEL, then write a checkpoint vLLM and transformers load.

    A local safetensors folder is streamed: one decoder layer in memory at a time, each finished layer
    kept beside the output so that rerunning an interrupted command resumes after the last one."""
    _setup_logging(verbose)
    try:
        _quantize(**locals())
    except (QuantizationError, FileNotFoundError, ValueError) as err:
        _fail(err)


def _quantize(model, method, bits, group_size, asym, act_order, act_bits, format, calib, nsamples, seqlen,
              seed, chat_template, damp, mse, duo_scaling, clip, smooth_steps, smooth_search, smooth_samples, smooth_check,
              output, overwrite, dtype, device, batch_size, evaluate,
              eval_windows, trust_remote_code, allow_pickle, resume, verbose) -> None:
    from quantkit.config import QuantConfig
    from quantkit.data import build_calibration_set, load_passages
    from quantkit.engine import quantize_model
    from quantkit.export import export_checkpoint
    from quantkit.formats import get_format
    from quantkit.models import get_adapter, load_model
    from quantkit.models.loading import default_dtype, load_tokenizer
    from quantkit.streaming import open_streamed_model, streamable_reason

    work_device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if nsamples is None:
        nsamples = default_nsamples(work_device)
    if output is None:
        name = Path(model).stem if model else "smollm2-135m"
        output = Path("out") / f"{name}-{method}-w{bits}a{act_bits}-g{group_size}"
    not_streamed = streamable_reason(model, trust_remote_code)
    if not_streamed is None:  # the streamed run checks the output itself: it may be its own finished export
        lm, ckpt = open_streamed_model(model, default_dtype(work_device))
        tokenizer = load_tokenizer(model)
    else:
        logging.getLogger("quantkit").info("loading the whole model in memory: %s", not_streamed)
        if output.exists() and not overwrite:
            raise QuantizationError(f"output folder {output} already exists (pass --overwrite to replace it)")
        lm, tokenizer = load_model(model, dtype=default_dtype(work_device), trust_remote_code=trust_remote_code,
                                   allow_pickle=allow_pickle)
    adapter = get_adapter(lm)
    config = QuantConfig(method=method, bits=bits, group_size=resolve_group_size(lm, adapter, group_size),
                         sym=not asym, act_order=act_order and method in ("gptq", "qqq"), act_bits=act_bits,
                         damp_percent=damp, mse=mse, awq_duo_scaling=duo_scaling, awq_clip=clip, smooth_steps=smooth_steps,
                         smooth_search=smooth_search.value, smooth_samples=smooth_samples, smooth_check=smooth_check).validate()
    get_format(format.value).check(config)
    console.print(f"[bold]{lm.config.model_type}[/] {config.method} W{config.bits}A{config.act_bits} "
                  f"group {config.group_size} {'sym' if config.sym else 'asym'} -> {format.value}, "
                  f"{nsamples} x {seqlen} calibration tokens on {work_device}")
    calib_set = build_calibration_set(tokenizer, load_passages(calib), nsamples, seqlen, seed, chat_template)
    if not_streamed is None:
        _quantize_streamed(lm, ckpt, tokenizer, calib_set, config, format.value, output, dtype, work_device,
                           batch_size, overwrite, resume, evaluate)
        return
    before = _heldout_ppl(lm.to(work_device), tokenizer, eval_windows, 512) if evaluate else {}
    report = quantize_model(lm.cpu(), adapter, calib_set, config, device=work_device, batch_size=batch_size)
    after = _heldout_ppl(lm.to(work_device), tokenizer, eval_windows, 512) if evaluate else {}
    out = export_checkpoint(lm.cpu(), tokenizer, output, config, format.value, report=report.to_dict(),
                            dtype=dtype, overwrite=overwrite)
    _print_summary(report, out)
    if evaluate:
        table = Table(title="held-out perplexity")
        table.add_column("text")
        table.add_column("original", justify="right")
        table.add_column("quantized", justify="right")
        table.add_column("delta", justify="right")
        for name in before:
            table.add_row(name, f"{before[name]:.3f}", f"{after[name]:.3f}", f"{after[name] - before[name]:+.3f}")
        Console().print(table)


def _quantize_streamed(lm, ckpt, tokenizer, calib_set, config, fmt_name: str, output: Path, dtype: str,
                       work_device: str, batch_size: int, overwrite: bool, resume: bool, evaluate: bool) -> None:
    from quantkit.streaming import quantize_streaming

    if evaluate:
        console.print("held-out perplexity needs the whole model in memory: skipped while streaming "
                      "(run `quantkit eval` on the export)")
    out, report = quantize_streaming(lm, ckpt, tokenizer, calib_set, config, fmt_name, output, dtype=dtype,
                                     device=work_device, batch_size=batch_size, overwrite=overwrite, resume=resume)
    if report is None:
        console.print(f"the export of this command was already complete -> [bold]{out}[/]")
        return
    _print_summary(report, out)


def _print_summary(report, out: Path) -> None:
    if report.fallbacks:
        console.print(f"[yellow]{len(report.fallbacks)} fallback(s):[/] " + "; ".join(report.fallbacks))
    console.print(f"quantized {len(report.layers)} layers in {report.seconds:.1f}s -> [bold]{out}[/]")


@app.command("eval")
def evaluate_cmd(
    models: Annotated[list[str], typer.Argument(help="HF folders, .gguf files, hub names or quantkit exports")],
    text: Annotated[list[str] | None, typer.Option("--text", help="text file or hub name (repeatable)")] = None,
    tasks: Annotated[str, typer.Option(help="comma-separated tasks, e.g. arc_easy,hellaswag,gsm8k:200 (:N = N items)")] = "",
    limit: Annotated[int | None, typer.Option(help="items per task")] = None,
    num_fewshot: Annotated[int | None, typer.Option(help="few-shot examples (task default if unset)")] = None,
    generations: Annotated[bool, typer.Option("--generations", help="side-by-side greedy answers")] = False,
    speculative: Annotated[bool, typer.Option("--speculative", help="each model after the first as a speculative-decoding draft for the first")] = False,
    draft_tokens: Annotated[str, typer.Option(help="with --speculative: comma-separated draft lengths")] = "1,2,4,8",
    speed: Annotated[bool, typer.Option("--speed", help="time decode steps and a prefill (CUDA graphs on a GPU)")] = False,
    speed_batches: Annotated[str, typer.Option(help="with --speed: comma-separated decode batch sizes")] = "1",
    speed_compile: Annotated[bool, typer.Option("--speed-compile", help="with --speed: decode steps through torch.compile")] = False,
    report: Annotated[Path | None, typer.Option("--report", help="folder for JSON, Markdown and plots")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="write all metrics as JSON")] = None,
    seqlen: Annotated[int, typer.Option(help="perplexity window")] = 512,
    max_windows: Annotated[int | None, typer.Option(help="perplexity windows per text (default: all)")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="tokens per side-by-side generation")] = 64,
    batch_size: Annotated[int, typer.Option(help="evaluation batch size")] = 8,
    device: Annotated[str | None, typer.Option(help="cuda or cpu (default: cuda if available)")] = None,
    backend: Annotated[str, typer.Option(help="native or lm-eval")] = "native",
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Perplexity, task accuracy and generations of one or more models, side by side."""
    from quantkit.eval.runner import run_eval

    _setup_logging(verbose)
    try:
        lengths = [int(k) for k in draft_tokens.split(",") if k.strip()] if speculative else None
        batches = [int(b) for b in speed_batches.split(",") if b.strip()] if speed else None
        if batches is not None and (not batches or min(batches) < 1):
            raise ValueError(f"--speed-batches {speed_batches!r}: give batch sizes >= 1")
        run_eval(models, texts=text, tasks=[t for t in tasks.split(",") if t], limit=limit,
                 num_fewshot=num_fewshot, generations=generations, report_dir=report, json_path=json_path,
                 batch_size=batch_size, device=device, backend=backend, seqlen=seqlen, console=Console(),
                 max_windows=max_windows, max_new_tokens=max_new_tokens, draft_tokens=lengths,
                 speed_batches=batches, speed_compile="inductor" if speed_compile else None)
    except (QuantizationError, FileNotFoundError, ValueError) as err:
        _fail(err)


def main() -> None:  # pragma: no cover - `python -m quantkit`
    sys.exit(app())


if __name__ == "__main__":  # pragma: no cover
    main()
