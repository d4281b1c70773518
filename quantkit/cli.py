"""The quantkit command line: `quantkit quantize` and `quantkit eval`."""

from __future__ import annotations

import dataclasses
import errno
import inspect
import logging
import os
import sys
import typing
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import Field, dataclass, fields
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from quantkit.config import AUTO_GROUP, QuantConfig, check_option_value, option_spec
from quantkit.distributed import Ranks
from quantkit.qtensor import QuantizationError
from quantkit.streaming.workdir import RESUME_INTERVAL_S

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Post-training 4-bit quantization of Hugging Face causal LMs.")
console = Console(stderr=True)
log = logging.getLogger("quantkit")


def _setup_logging(verbose: bool) -> None:
    # a log file gets whole timestamped lines, not rich's 80-column wrapped panels
    handler = RichHandler(console=console, show_path=False) if console.is_terminal else logging.StreamHandler()
    plain = "%(message)s" if console.is_terminal else "%(asctime)s %(levelname)s %(message)s"
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format=plain, handlers=[handler],
                        force=True)
    logging.getLogger("quantkit").setLevel(logging.INFO)


DEBUG_ENV = "QUANTKIT_DEBUG"
USER_ERRORS = (QuantizationError, ValueError, OSError)  # FileNotFoundError, PermissionError, a full disk
GPU_SPEED_SWEEP = (1, 2, 4, 8, 16, 32, 64, 128)  # `quantkit eval --speed` on a GPU: the throughput-latency curve


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _fail(err: Exception) -> None:
    """One line on stderr: exit 2 for what the user can fix, 1 for anything else (a bug: --debug shows it)."""
    from quantkit.eval.task_data import TaskDataError

    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        message, code = f"disk full: {err}; free space and rerun", 2
    elif isinstance(err, (*USER_ERRORS, TaskDataError)):
        message, code = str(err), 2
    else:
        message, code = f"unexpected {type(err).__name__}: {err} (rerun with --debug for the trace)", 1
    print(f"error: {_one_line(message)}", file=sys.stderr)
    raise typer.Exit(code=code)


def _guarded(work: Callable[[], None], debug: bool) -> None:
    """Run a command's body; errors become one line unless --debug (or QUANTKIT_DEBUG=1) asks for the trace."""
    try:
        work()
    except typer.Exit:
        raise
    except KeyboardInterrupt:
        print("interrupted (an unfinished export is removed, never left half-written)", file=sys.stderr)
        raise typer.Exit(code=130) from None
    except Exception as err:
        if debug or os.environ.get(DEBUG_ENV, "0") not in ("", "0"):
            raise
        _fail(err)


def _phase(message: str) -> None:
    """Say what starts now (a line in a log file too)."""
    console.print(f"[dim]{message}...[/]", soft_wrap=True)


def default_output(model: str | None, method: str, bits: int, act_bits: int, group_size: str) -> Path:
    """out/NAME-METHOD-wBITSaACT-gGROUP, NAME the model's file or folder name (smollm2-135m by default)."""
    name = Path(model).expanduser().resolve().stem if model else "smollm2-135m"
    return Path("out") / f"{name}-{method}-w{bits}a{act_bits}-g{group_size}"


def parse_group_size(requested: str) -> int | str:
    """--group-size: an integer, or auto (resolved against the model once it is read)."""
    if requested == AUTO_GROUP:
        return AUTO_GROUP
    try:
        return int(requested)
    except ValueError as err:
        raise QuantizationError(f"--group-size must be an integer or auto, got {requested!r}") from err


def default_nsamples(device: str) -> int:
    """128 calibration samples (the GPTQ/AWQ papers' count) on a GPU; 32 on the CPU, where the
    statistics forward passes dominate (SmolLM2-135M on 2 cores: ~9.5 min for 128, ~2.5 min for 32;
    with act-order, 32 samples still reach a lower held-out perplexity than 128 without it)."""
    return 128 if torch.device(device).type == "cuda" else 32


@app.command()
def quantize(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Argument(help="HF folder, .gguf file or hub name; default: embedded SmolLM2-135M")] = None,
    method: Annotated[str, typer.Option(help="quantization method")] = QuantConfig.method,  # choices: quantize_signature
    bits: Annotated[int, typer.Option(help="weight bits: 4 or 8")] = 4,
    group_size: Annotated[str, typer.Option(help="-1 (per channel), 32, 64, 128 or auto")] = "auto",
    asym: Annotated[bool, typer.Option("--asym", help="asymmetric (zero-point) weights")] = False,
    act_bits: Annotated[int, typer.Option(help="16 (W4A16) or 8 (W4A8, per-token int8 activations)")] = 16,
    format: Annotated[str, typer.Option("--format", help="checkpoint format")] = "compressed-tensors",
    calib: Annotated[str | None, typer.Option(help="calibration .txt/.jsonl or wikitext2/c4/pileval")] = None,
    nsamples: Annotated[int | None, typer.Option(help="calibration samples (default 128; 32 on the CPU)")] = None,
    seqlen: Annotated[int, typer.Option(help="tokens per calibration sample")] = 512,
    seed: Annotated[int, typer.Option(help="calibration sampling seed")] = 0,
    chat_template: Annotated[bool, typer.Option(help="wrap calibration text in the chat template")] = False,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="output folder")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace an existing output folder")] = False,
    dtype: Annotated[str, typer.Option(help="checkpoint dtype: auto (fp16; bf16 for Gemma), float16, bfloat16, float32")] = "auto",
    device: Annotated[str | None, typer.Option(help="work device (default: cuda if available)")] = None,
    batch_size: Annotated[int, typer.Option(help="calibration batch size")] = 8,
    evaluate: Annotated[bool, typer.Option("--eval/--no-eval", help="held-out perplexity before and after")] = True,
    eval_windows: Annotated[int, typer.Option(help="512-token windows per held-out text")] = 16,
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code")] = False,
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="allow .bin pickle weights")] = False,
    moe_all_tokens: Annotated[bool, typer.Option(
        "--moe-all-tokens", help="MoE: every expert's statistics from every calibration token (the layer's output "
        "still follows the routing); default: each expert's routed tokens, too few handled by the documented "
        "fallback")] = False,
    quantize_head: Annotated[bool, typer.Option(
        "--quantize-head", help="quantize lm_head too, with the method's quantizer on the normed last hidden states "
        "(weight-only schemes and FP8); default: kept in 16 bits")] = False,
    resume: Annotated[bool, typer.Option("--resume/--no-resume", help="continue an interrupted streaming run of the same command")] = True,
    resume_interval: Annotated[float, typer.Option(
        "--resume-interval", help="streaming: seconds between saves of the hidden states a resume starts from "
        "(0: after every layer; each save writes nsamples x seqlen x hidden x 2 bytes)")] = RESUME_INTERVAL_S,
    offload_dir: Annotated[Path | None, typer.Option(
        "--offload-dir", help="keep the calibration hidden states in memory-mapped files here when neither the "
        "work device nor host memory holds them")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="show the full trace of an error (or QUANTKIT_DEBUG=1)")] = False,
    **method_options: Any,  # every registered method's options, as quantize_signature declares them
) -> None:
    """Calibrate and quantize MODEL, then write a checkpoint vLLM and transformers load.

    A local safetensors folder is streamed: one decoder layer in memory at a time. Other sources (GGUF, hub
    names, remote code) load whole, then go layer by layer the same way. Each finished layer is kept beside the
    output so that rerunning an interrupted command resumes after the last one."""
    _setup_logging(verbose)
    options = {name: value for name, value in ctx.params.items() if name != "debug"}
    _guarded(lambda: _quantize(**options), debug)


_DECLARED = inspect.signature(quantize, eval_str=True)  # before quantize.__signature__ replaces it below


@dataclass(frozen=True)
class _DeclaredOption:
    field: Field
    annotation: Any
    defaults: dict[str, Any]  # per registered method that takes it, its command-line default

    @property
    def methods(self) -> tuple[str, ...]:
        return tuple(self.defaults)

    @property
    def flag(self) -> str:
        return option_spec(self.field).flag_for(self.field.name, self.annotation is bool)

    @property
    def default(self) -> Any:
        """The flag's default: the methods' common one, or None (each method's own) where they differ."""
        values = list(self.defaults.values())
        return values[0] if all(v == values[0] for v in values) else None

    def value_for(self, method: str, given: Any) -> Any:
        return self.defaults[method] if given is None else given


def _declared_options() -> dict[str, _DeclaredOption]:
    """Every option field of the registered methods, once (a field several methods share, e.g. GPTQ's inside
    QQQ's, names all of them, each with its own default: awq-gptq searches fewer AWQ ratios than AWQ)."""
    from quantkit.quantizers.base import registered_methods

    found: dict[str, tuple[Field, Any]] = {}
    defaults: dict[str, dict[str, Any]] = {}
    for name, method_cls in sorted(registered_methods().items()):
        types = typing.get_type_hints(method_cls.options_class)
        for f in fields(method_cls.options_class):
            found.setdefault(f.name, (f, types[f.name]))
            defaults.setdefault(f.name, {})[name] = f.default
    return {name: _DeclaredOption(f, annotation, defaults[name]) for name, (f, annotation) in found.items()}


def _method_option_parameters() -> list[inspect.Parameter]:
    """One keyword parameter per declared option, its help prefixed with the methods that take it (and their
    defaults where they differ)."""
    parameters = []
    for name, declared in _declared_options().items():
        spec = option_spec(declared.field)
        annotation = declared.annotation if spec.choices is None else Literal[spec.choices]
        text = f"{', '.join(declared.methods)}: {spec.help}"
        if declared.default is None:
            annotation = annotation | None
            text += " (default: " + ", ".join(f"{m} {_shown(v)}" for m, v in declared.defaults.items()) + ")"
        info = typer.Option(declared.flag, help=text)
        parameters.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=declared.default,
                                            annotation=Annotated[annotation, info]))
    return parameters


def _shown(value: Any) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def method_options_for(method: str, given: dict[str, Any]) -> dict[str, Any]:
    """The chosen method's options from the command line: each one given, else that method's default; every
    option's declared range is checked whichever method takes it (a bad value is a mistake either way), and
    one given that the method does not take is a warning, not silently dropped."""
    options = {}
    for name, declared in _declared_options().items():
        value = given.get(name)
        if value is not None:
            check_option_value(declared.field, value)
        if method in declared.defaults:
            options[name] = declared.value_for(method, value)
        elif value is not None and value != declared.default:
            log.warning(f"{declared.flag.split('/')[0]} is an option of {', '.join(declared.methods)}: "
                        f"--method {method} ignores it")
    return options


def quantize_signature() -> inspect.Signature:
    """quantize's signature as Typer reads it: --method and --format offer what the registries hold, and each
    registered method's options follow the declared parameters (in place of **method_options)."""
    from quantkit.formats import FORMATS
    from quantkit.quantizers.base import registered_methods

    choices = {"method": Literal[tuple(sorted(registered_methods()))], "format": Literal[tuple(FORMATS)]}
    declared = []
    for parameter in _DECLARED.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            continue
        if parameter.name in choices:
            info = typing.get_args(parameter.annotation)[1]
            parameter = parameter.replace(annotation=Annotated[choices[parameter.name], info])
        declared.append(parameter)
    options = _method_option_parameters()
    clashes = {p.name for p in declared} & {p.name for p in options}
    if clashes:
        raise TypeError(f"method options named like quantize's own parameters: {sorted(clashes)}")
    return inspect.Signature(declared + options)


quantize.__signature__ = quantize_signature()  # type: ignore[attr-defined]


@dataclass(frozen=True)
class QuantizeJob:
    """`quantkit quantize` as asked: the flags, each once, read by the steps below."""

    model: str | None
    method: str
    bits: int
    group_size: str
    asym: bool
    act_bits: int
    format: str
    calib: str | None
    nsamples: int | None
    seqlen: int
    seed: int
    chat_template: bool
    output: Path | None
    overwrite: bool
    dtype: str
    device: str | None
    batch_size: int
    evaluate: bool
    eval_windows: int
    trust_remote_code: bool
    allow_pickle: bool
    verbose: bool
    moe_all_tokens: bool
    quantize_head: bool
    resume: bool
    resume_interval: float
    offload_dir: Path | None
    method_options: dict[str, Any]

    @classmethod
    def from_flags(cls, flags: dict[str, Any]) -> QuantizeJob:
        own = {f.name for f in fields(cls)} - {"method_options"}
        return cls(**{k: v for k, v in flags.items() if k in own},
                   method_options={k: v for k, v in flags.items() if k not in own})

    def planned_scheme(self) -> QuantConfig:
        """The scheme before the model is read: the method, its options and the flags, checked together."""
        from quantkit.quantizers.base import method_class

        options = method_class(self.method).options_class.from_dict(
            method_options_for(self.method, self.method_options))
        return QuantConfig(method=self.method, bits=self.bits, group_size=parse_group_size(self.group_size),
                           sym=not self.asym, act_bits=self.act_bits, moe_all_tokens=self.moe_all_tokens,
                           quantize_head=self.quantize_head,
                           options=options).validate()


def _quantize(**flags: Any) -> None:
    from quantkit.data import build_calibration_set, load_passages
    from quantkit.distributed import ranks_from_environment
    from quantkit.export import export_dtype, scale_dtype_for
    from quantkit.formats import get_format
    from quantkit.models import get_adapter, load_model
    from quantkit.models.loading import default_dtype, hub_snapshot, load_tokenizer
    from quantkit.outputs import output_lock
    from quantkit.preflight import check_quantize_request, check_writable_folder, resolve_device
    from quantkit.streaming import open_streamed_model, streamable_reason
    from quantkit.streaming.resident import ResidentCheckpoint

    job = QuantizeJob.from_flags(flags)
    ranks = ranks_from_environment()  # torchrun: this process's rank; otherwise one process
    console.quiet = not ranks.writer
    work_device = resolve_device(job.device)
    nsamples = default_nsamples(work_device) if job.nsamples is None else job.nsamples
    planned = job.planned_scheme()
    get_format(job.format).check(planned)  # the scheme, before any loading
    if planned.method_fixes():
        console.print(f"{job.method} fixes " + ", ".join(f"{k}={v}" for k, v in planned.method_fixes().items()))
    output = job.output or default_output(job.model, job.method, planned.bits, planned.act_bits,
                                          str(planned.group_size))
    check_writable_folder("--output", output)  # before the lock beside it is made
    with output_lock(output) if ranks.writer else nullcontext():  # one run per output, from its checks to its export
        check_quantize_request(source=job.model, calib=job.calib, output=output, overwrite=job.overwrite,
                               nsamples=nsamples, seqlen=job.seqlen, batch_size=job.batch_size,
                               eval_windows=job.eval_windows if job.evaluate else None, dtype=job.dtype,
                               bits=planned.bits, offload_dir=job.offload_dir, resume_interval=job.resume_interval)
        _phase("reading the calibration text")
        passages = load_passages(job.calib)
        snapshot = None if job.trust_remote_code else hub_snapshot(job.model)  # a hub name streams from its files
        source = job.model if snapshot is None else str(snapshot)
        not_streamed = streamable_reason(source, job.trust_remote_code)
        if not_streamed is not None and ranks.world > 1:
            raise QuantizationError(f"several processes (torchrun) quantize a streamed source only: {not_streamed}")
        if not_streamed is None:
            _phase(f"loading {source} layer by layer (streaming)")
            lm, ckpt = open_streamed_model(source, default_dtype(work_device))
            tokenizer = load_tokenizer(source)
        else:
            _phase(f"loading {job.model or 'the embedded default model'} whole: {not_streamed}")
            lm, tokenizer = load_model(job.model, dtype=default_dtype(work_device),
                                       trust_remote_code=job.trust_remote_code, allow_pickle=job.allow_pickle)
            ckpt = ResidentCheckpoint.take(lm, job.model)  # then quantized layer by layer as a checkpoint is
        adapter = get_adapter(lm)
        # scales rounded to the dtype the export serves in (bf16 for Gemma or --dtype bfloat16)
        serving = scale_dtype_for(export_dtype(lm, job.dtype))
        config = dataclasses.replace(planned, scale_dtype=serving).for_model(lm, adapter)
        console.print(f"[bold]{lm.config.model_type}[/] {config.method} W{config.bits}A{config.act_bits} "
                      f"group {config.group_size} {'sym' if config.sym else 'asym'} -> {job.format}, "
                      f"{nsamples} x {job.seqlen} calibration tokens on {work_device}")
        calib_set = build_calibration_set(tokenizer, passages, nsamples, job.seqlen, job.seed, job.chat_template)
        _quantize_streamed(job, lm, ckpt, tokenizer, calib_set, config, output, work_device, ranks)


def _quantize_streamed(job: QuantizeJob, lm, ckpt, tokenizer, calib_set, config: QuantConfig, output: Path,
                       work_device: str, ranks: Ranks) -> None:
    from quantkit.streaming import SafetensorsCheckpoint, StreamedRun, quantize_streaming

    _phase(f"quantizing layer by layer, exporting to {output}")
    run = StreamedRun(config, job.format, output, dtype=job.dtype, device=work_device, batch_size=job.batch_size,
                      overwrite=job.overwrite, resume=job.resume, offload_dir=job.offload_dir,
                      resume_interval=job.resume_interval, ranks=ranks)
    out, report = quantize_streaming(lm, ckpt, tokenizer, calib_set, run)
    if not ranks.writer:  # rank 0 reports and evaluates
        return
    if report is None:
        console.print(f"the export of this command was already complete -> [bold]{out}[/]")
        return
    _print_summary(report, out)
    if job.evaluate:
        _phase("held-out perplexity and KL of the original and the export, one layer at a time")
        original = str(ckpt.folder) if isinstance(ckpt, SafetensorsCheckpoint) else ckpt  # in memory: from there
        _print_heldout(_layerwise_heldout(original, out, tokenizer, job.eval_windows, work_device))


def _layerwise_heldout(source, export: Path, tokenizer, windows: int, device: str) -> dict:
    from quantkit.data import default_heldout_texts, load_text
    from quantkit.eval.layerwise import layerwise_perplexity

    texts = {name: load_text(path) for name, path in default_heldout_texts().items()}
    scores = layerwise_perplexity([source, export], tokenizer, texts, seqlen=512, max_windows=windows, device=device)
    return {name: (original["ppl"], quantized["ppl"], quantized["kl"]) for name, (original, quantized) in scores.items()}


def _print_heldout(rows: dict[str, tuple[float, float, float | None]]) -> None:
    """Per held-out text: the original's and the quantized model's perplexity, and the KL where measured."""
    table = Table(title="held-out perplexity")
    for header in ("text", "original", "quantized", "delta", *(["KL"] if any(r[2] is not None for r in rows.values())
                                                                 else [])):
        table.add_column(header, justify="left" if header == "text" else "right")
    for name, (before, after, kl) in rows.items():
        table.add_row(name, f"{before:.3f}", f"{after:.3f}", f"{after - before:+.3f}",
                      *([] if kl is None else [f"{kl:.4f}"]))
    Console().print(table)


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
    speed_batches: Annotated[str, typer.Option(help="with --speed: comma-separated decode batch sizes (auto: 1 to 128 by powers of 2 on a GPU, 1 on a CPU)")] = "auto",
    speed_compile: Annotated[bool, typer.Option("--speed-compile", help="with --speed: decode steps through torch.compile")] = False,
    report: Annotated[Path | None, typer.Option("--report", help="folder for JSON, Markdown and plots")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="write all metrics as JSON")] = None,
    seqlen: Annotated[int, typer.Option(help="perplexity window")] = 512,
    max_windows: Annotated[int | None, typer.Option(help="perplexity windows per text (default: all)")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="tokens per side-by-side generation")] = 64,
    batch_size: Annotated[int, typer.Option(help="evaluation batch size")] = 8,
    device: Annotated[str | None, typer.Option(help="cuda or cpu (default: cuda if available)")] = None,
    backend: Annotated[str, typer.Option(help="native or lm-eval")] = "native",
    layerwise: Annotated[bool, typer.Option("--layerwise", help="perplexity and KL one layer at a time (automatic when a model does not fit)")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="show the full trace of an error (or QUANTKIT_DEBUG=1)")] = False,
) -> None:
    """Perplexity, task accuracy and generations of one or more models, side by side.

    Name the embedded default model (SmolLM2-135M-Instruct) `default`."""
    from quantkit.eval.runner import run_eval
    from quantkit.preflight import check_eval_request, resolve_device

    _setup_logging(verbose)

    def work() -> None:
        lengths = _int_list("--draft-tokens", draft_tokens) if speculative else None
        work_device = resolve_device(device)
        batches = _speed_batches(speed_batches, work_device) if speed else None
        check_eval_request(models=models, texts=text, report_dir=report, json_path=json_path, seqlen=seqlen,
                           max_windows=max_windows, batch_size=batch_size, max_new_tokens=max_new_tokens,
                           limit=limit, num_fewshot=num_fewshot)
        run_eval(models, texts=text, tasks=[t for t in tasks.split(",") if t], limit=limit,
                 num_fewshot=num_fewshot, generations=generations, report_dir=report, json_path=json_path,
                 batch_size=batch_size, device=work_device, backend=backend, seqlen=seqlen, console=Console(),
                 max_windows=max_windows, max_new_tokens=max_new_tokens, draft_tokens=lengths,
                 speed_batches=batches, speed_compile="inductor" if speed_compile else None,
                 layerwise=True if layerwise else None)

    _guarded(work, debug)


def _speed_batches(requested: str, device: str) -> list[int]:
    """--speed-batches: the throughput-latency sweep of a serving GPU (1 to 128) by default, one sequence on a CPU."""
    if requested == "auto":
        return list(GPU_SPEED_SWEEP) if device.startswith("cuda") else [1]
    batches = _int_list("--speed-batches", requested)
    if not batches or min(batches) < 1:
        raise QuantizationError(f"--speed-batches {requested!r}: give batch sizes >= 1")
    return batches


def _int_list(option: str, text: str) -> list[int]:
    try:
        return [int(k) for k in text.split(",") if k.strip()]
    except ValueError as err:
        raise QuantizationError(f"{option} {text!r}: give comma-separated integers, e.g. 1,2,4") from err


def main() -> None:  # pragma: no cover - `python -m quantkit`
    sys.exit(app())


if __name__ == "__main__":  # pragma: no cover
    main()
