"""quantkit against llm-compressor (and AutoRound) end to end: one protocol, the same calibration token ids,
the same evaluator for every row. The results page is benchmarks/accuracy/VS_LLMCOMPRESSOR.md.

One command per step; each MODEL is `smollm2` (the embedded SmolLM2-135M GGUF, W4 g64), `gemma3`
(models/gemma-3-270m-q4_k_m.gguf, W4 g128) or `outlier` (a random-weight Qwen2-family model with outlier input
channels, W4 g128, that `prepare` builds; scored by KL divergence to its fp32 self, as its perplexity means
nothing). llm-compressor runs in its own venv
(scripts/setup_llmcompressor_venv.sh), without quantkit; everything else in quantkit's venv:

    L="env PYTHONSAFEPATH=1 /work/venv-llmc/bin/python"; Q="env PYTHONSAFEPATH=1 .venv/bin/python"
    $Q benchmarks/bench_vs_llmcompressor.py prepare MODEL          # calibration ids + a safetensors HF copy
    $L benchmarks/bench_vs_llmcompressor.py llmc MODEL gptq awq    # llm-compressor's oneshot; its exports
    $L benchmarks/bench_vs_llmcompressor.py llmc MODEL autoround --iters 20
    $Q benchmarks/bench_vs_llmcompressor.py score MODEL fp fp-hf rtn gptq awq qqq awq-gptq llmc-gptq llmc-awq
    $Q benchmarks/bench_vs_llmcompressor.py score MODEL fp gptq llmc-gptq --no-ppl --tasks arc_easy,piqa
    $Q benchmarks/bench_vs_llmcompressor.py tables MODEL           # the page's Markdown tables from the JSON

Work files (calibration ids, the HF copy, llm-compressor's exports) go under --work (never the repo); each
row's measurements are merged into benchmarks/accuracy/vs_llmcompressor_MODEL.json with the command that
made them. quantkit's rows are quantized by `score` itself, on the saved ids. Scoring: held-out mean NLL by
quantkit.eval.perplexity on the first --windows 512-token windows of the held-out English and Korean texts,
and zero-shot task accuracy by quantkit's native evaluator, every model in fp32 on the CPU; llm-compressor's
exports are read by quantkit's compressed-tensors loader (quantkit.reload), so all rows go through one code path.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import torch
from torch import nn

# quantkit is imported inside the steps that run in its venv: the llmc step runs where it does not install.
REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "accuracy"


def embedded_smollm2() -> Path:
    from quantkit.models.loading import default_model_path

    return default_model_path()


@dataclass(frozen=True)
class Protocol:
    group_size: int
    gguf: Callable[[], Path] | None = None  # None: a random-weight model, built by prepare into WORK/MODEL/hf


MODELS = {
    "smollm2": Protocol(64, embedded_smollm2),  # 576 inputs: no g128
    "gemma3": Protocol(128, lambda: REPO / "models" / "gemma-3-270m-q4_k_m.gguf"),
    "outlier": Protocol(128),
}
# The random model: Qwen2-shaped (q/k/v biases), SmolLM2's tokenizer. Outlier input channels as LLMs have them
# (LLM.int8(), SmoothQuant): the same few hidden channels OUTLIER_GAIN times larger after every RMSNorm, so each
# attention and MLP input carries them.
OUTLIER_MODEL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=4096)
OUTLIER_CHANNELS, OUTLIER_GAIN = 8, 30.0

# quantkit's rows: GPTQ with act-order (static groups, llm-compressor's default too), AWQ asymmetric (the
# scheme of llm-compressor's AWQ; with its defaults, and without duo scaling, then also without the clip search),
# QQQ W4A8 with its own required act-order, awq-gptq with its defaults.
QUANTKIT_ROWS = {
    "rtn": {"method": "rtn"},
    "rtn-asym": {"method": "rtn", "sym": False},  # the baseline of the asymmetric AWQ rows
    "gptq": {"method": "gptq", "act_order": True},
    "awq": {"method": "awq", "sym": False},  # duo scaling and the clip search
    "awq-noduo": {"method": "awq", "sym": False, "duo_scaling": False},  # activation-only scales
    "awq-noduo-noclip": {"method": "awq", "sym": False, "duo_scaling": False, "clip": False},
    "awq-sym": {"method": "awq"},  # AWQ's defaults, symmetric: against symmetric RTN
    "qqq": {"method": "qqq", "act_bits": 8, "act_order": True},
    "awq-gptq": {"method": "awq-gptq"},
}


def work_dir(args: argparse.Namespace) -> Path:
    return Path(args.work) / args.model


def model_source(args: argparse.Namespace) -> Path:
    """The fp32 model every row starts from: the GGUF, or the random model's folder."""
    gguf = MODELS[args.model].gguf
    return work_dir(args) / "hf" if gguf is None else gguf()


def build_outlier_model(vocab_size: int) -> nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(vocab_size=vocab_size, **OUTLIER_MODEL))
    channels = torch.randperm(OUTLIER_MODEL["hidden_size"])[:OUTLIER_CHANNELS]
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[channels] *= OUTLIER_GAIN
    return model


def load_calibration(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """input_ids and attention_mask, long [nsamples, seqlen]: what prepare saved."""
    return torch.load(work_dir(args) / "calib.pt")


def prepare(args: argparse.Namespace) -> None:
    """The calibration token ids every tool gets, and the GGUF's weights (or the random model) as a safetensors
    folder."""
    from quantkit.data import build_calibration_set, load_passages
    from quantkit.models.loading import load_model, load_tokenizer

    out = work_dir(args)
    if MODELS[args.model].gguf is None:
        tokenizer = load_tokenizer(str(embedded_smollm2()))
        model = build_outlier_model(len(tokenizer))
    else:
        model, tokenizer = load_model(MODELS[args.model].gguf())
    calib = build_calibration_set(tokenizer, load_passages(None), args.nsamples, args.seqlen, seed=0)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"input_ids": calib.input_ids, "attention_mask": calib.attention_mask}, out / "calib.pt")
    model.hf_quantizer = None  # the GGUF loader's marker; the weights in memory are plain fp32
    model.save_pretrained(out / "hf")
    tokenizer.save_pretrained(out / "hf")
    print(f"{len(calib)} x {args.seqlen} calibration tokens ({calib.n_tokens} real) and the HF copy in {out}")


def heldout_scores(model: nn.Module, tokenizer, windows: int, reference: nn.Module | None) -> dict[str, dict]:
    """Perplexity and mean NLL per held-out text; with a reference (the fp32 model), the mean KL divergence of
    the model's next-token distributions from its."""
    from quantkit.data import default_heldout_texts, load_text
    from quantkit.eval.perplexity import perplexity

    scores = {}
    for name, path in default_heldout_texts().items():
        measured = perplexity(model, tokenizer, load_text(path), 512, max_windows=windows, reference=reference)
        scores[name] = {key: measured[key] for key in ("ppl", "nll", "tokens", "kl") if key in measured}
    return scores


def commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=REPO).stdout.strip()


def record(args: argparse.Namespace, row: str, entry: dict) -> None:
    """Merge one row's measurements into the model's JSON, each with the command that produced it. The row's
    commit, date and quantize time stay its held-out run's; a tasks pass adds its own commit and date."""
    path = RESULTS / f"vs_llmcompressor_{args.model}.json"
    results = json.loads(path.read_text()) if path.exists() else {"rows": {}}
    samples, seqlen = load_calibration(args)["input_ids"].shape
    results["protocol"] = {"group_size": MODELS[args.model].group_size, "windows": args.windows,
                           "calibration": f"{samples} x {seqlen} tokens, seed 0"}
    command = "python benchmarks/bench_vs_llmcompressor.py " + shlex.join(sys.argv[1:])
    stamp = {"commit": commit(), "date": date.today().isoformat()}
    merged = results["rows"].setdefault(row, {})
    if "heldout" in entry or not merged:
        merged.update(entry, **stamp)
    else:
        merged.update({key: value for key, value in entry.items() if key != "quantize_s"})
    if "tasks" in entry:
        merged.update(tasks_commit=stamp["commit"], tasks_date=stamp["date"])
    commands = merged.setdefault("commands", {})
    commands.update({key: command for key in ("heldout", "tasks") if key in entry})
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(row, json.dumps(entry), flush=True)


def quantkit_code() -> str:
    """The last commit that changed quantkit's code: a cached quantized model is valid while it is unchanged."""
    return subprocess.run(["git", "log", "-1", "--format=%h", "--", "quantkit", "kernels"], capture_output=True,
                          text=True, cwd=REPO).stdout.strip()


def quantize_row(args: argparse.Namespace, name: str) -> tuple[nn.Module, dict]:
    """quantkit's row `name` of QUANTKIT_ROWS, quantized on the saved calibration ids. The quantized model is
    kept under --work, so scoring the same row again (tasks after perplexity) does not quantize it again
    unless quantkit's code or the row's config changed."""
    from quantkit.config import QuantConfig
    from quantkit.data import CalibrationSet
    from quantkit.engine import quantize_model
    from quantkit.models import get_adapter, load_model

    config = QuantConfig.from_dict({"group_size": MODELS[args.model].group_size, **QUANTKIT_ROWS[name]}).validate()
    key = {"code": quantkit_code(), "config": config.to_dict()}
    cache = work_dir(args) / f"quantkit-{name}.pt"
    if cache.exists() and (cached := torch.load(cache, weights_only=False))["key"] == key:
        return cached["model"], cached["entry"]
    model = load_model(model_source(args))[0]
    start = time.perf_counter()
    report = quantize_model(model, get_adapter(model), CalibrationSet(**load_calibration(args)), config,
                            device="cpu", show_progress=False)
    entry = {"scheme": config.label(), "quantize_s": round(time.perf_counter() - start), **guard_counts(report)}
    torch.save({"key": key, "model": model, "entry": entry}, cache)
    return model, entry


def guard_counts(report) -> dict:
    """What the no-harm rules did: layers that fell back to RTN, AWQ groups left unscaled (no ratio scored below
    s = 1) out of all, clipped rows put back unclipped."""
    smoothing = [layer.get("smoothing", {}) for layer in report.layers]
    groups = [g for s in smoothing for g in s.get("scales", {}).values()]
    return {"rtn_fallback_layers": [layer["layer"] for layer in report.layers if layer.get("guard", {}).get("fallback")],
            "unscaled_groups": sum(s.get("unscaled_groups", 0) for s in smoothing), "awq_groups": len(groups),
            "unclipped_rows": sum(c.get("unclipped_rows", 0) for s in smoothing for c in s.get("clip", {}).values())}


def load_row(args: argparse.Namespace, name: str) -> tuple[nn.Module, dict]:
    """fp: the GGUF (the random model); fp-hf: the safetensors copy llm-compressor starts from; llmc-TOOL: its
    export, read by quantkit's compressed-tensors loader; else quantkit's row, quantized now."""
    from quantkit.models.loading import load_model
    from quantkit.reload import load_quantized

    if name in QUANTKIT_ROWS:
        return quantize_row(args, name)
    if name == "fp":
        return load_model(model_source(args))[0], {}
    if name == "fp-hf":
        return load_model(work_dir(args) / "hf")[0], {}
    base, _, served = name.partition(SERVED)
    folder = work_dir(args) / base
    model = load_quantized(folder, dtype=torch.float32)[0]
    if served:
        round_scales(model, getattr(torch, served))
    return model, {"scheme": export_scheme(folder), "quantize_s": int((folder / "quantize_s.txt").read_text())}


# llmc-TOOL@float16: llm-compressor's export with its scales as vLLM serves them in fp16. On these fp32 models its
# exports hold fp32 scales, which no fp16/bf16 serving engine keeps; quantkit rounds its scales to the served dtype
# before any error compensation (QuantConfig.scale_dtype), so this row is the like-for-like one.
SERVED = "@"


def round_scales(model: nn.Module, dtype: torch.dtype) -> None:
    from quantkit.nn.qlinear import QuantLinear

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, QuantLinear):
                module.scales.copy_(module.scales.to(dtype).float())


def export_scheme(folder: Path) -> str:
    """The weight scheme a compressed-tensors export declares, e.g. 'W4A16 g64 sym actorder static'."""
    groups = json.loads((folder / "config.json").read_text())["quantization_config"]["config_groups"]
    weights = next(iter(groups.values()))["weights"]
    return (f"W{weights['num_bits']}A16 g{weights['group_size']} {'sym' if weights['symmetric'] else 'asym'}"
            f" actorder {weights['actorder']}")


def task_scores(model: nn.Module, tokenizer, args: argparse.Namespace) -> dict[str, dict]:
    """Zero-shot accuracy (and its standard error) of each --tasks task on its first --limit items."""
    from quantkit.eval.runner import run_eval

    results = run_eval([args.model], texts=[], tasks=args.tasks.split(","), limit=args.limit, num_fewshot=0,
                       generations=False, report_dir=None, json_path=None, batch_size=8, device="cpu",
                       loader=lambda label: (model, tokenizer, label))
    return {name: {"n": task["n"], **task["metrics"][task["primary_metric"]]}
            for name, task in results["models"][0]["tasks"].items()}


def score(args: argparse.Namespace) -> None:
    """Held-out NLL (the random model: and KL divergence to fp32; with --tasks, task accuracy) of each row, every
    model in fp32 on the CPU."""
    from quantkit.models.loading import load_model, load_tokenizer

    tokenizer = load_tokenizer(str(model_source(args)))
    reference = load_model(model_source(args))[0] if MODELS[args.model].gguf is None else None
    for name in args.rows:
        model, entry = load_row(args, name)
        if args.ppl:
            entry["heldout"] = heldout_scores(model, tokenizer, args.windows, reference)
        if args.tasks:
            entry["tasks"] = task_scores(model, tokenizer, args)
        record(args, name, entry)
        del model


def llmc_recipe(tool: str, group_size: int, iters: int) -> list:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.autoround import AutoRoundModifier
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    weights = QuantizationArgs(num_bits=4, type="int", symmetric=tool != "awq", strategy="group",
                               group_size=group_size)
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
    if tool == "rtn":  # min-max round to nearest, as its W4A16 preset
        return [QuantizationModifier(config_groups=groups, ignore=["lm_head"])]
    if tool == "gptq":  # actorder left to GPTQModifier's default: static
        return [GPTQModifier(config_groups=groups, ignore=["lm_head"])]
    if tool == "awq":  # the model's own mappings (AWQ_MAPPING_REGISTRY), default duo-scaling and grid
        return [AWQModifier(), QuantizationModifier(config_groups=groups, ignore=["lm_head"])]
    return [AutoRoundModifier(config_groups=groups, ignore=["lm_head"], iters=iters, enable_torch_compile=False)]


AUTOROUND_PAGE_ITERS = 20  # the page's first AutoRound rows: a tenth of its default 200, for CPU time


def llmc_row(tool: str, iters: int) -> str:
    """The row (and export folder) name of an llm-compressor run: AutoRound at other than 20 iterations says how
    many."""
    return f"llmc-autoround-{iters}" if tool == "autoround" and iters != AUTOROUND_PAGE_ITERS else f"llmc-{tool}"


def run_llmc(args: argparse.Namespace) -> None:
    """llm-compressor's oneshot on the HF copy with the saved ids; its compressed-tensors export per tool."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.pipelines.cache import IntermediatesCache
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not torch.cuda.is_available():  # AWQ pins its cache for faster copies to a GPU, which fails without one
        IntermediatesCache.pin_memory = lambda *_args, **_kwargs: None
    calib = load_calibration(args)
    dataset = Dataset.from_dict({name: ids.tolist() for name, ids in calib.items()})
    hf = work_dir(args) / "hf"
    for tool in args.rows:
        model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
        start = time.perf_counter()
        oneshot(model=model, processor=AutoTokenizer.from_pretrained(hf), dataset=dataset,
                recipe=llmc_recipe(tool, MODELS[args.model].group_size, args.iters),
                num_calibration_samples=len(dataset), max_seq_length=calib["input_ids"].shape[1],
                shuffle_calibration_samples=False)
        out = work_dir(args) / llmc_row(tool, args.iters)
        model.save_pretrained(out, save_compressed=True)
        AutoTokenizer.from_pretrained(hf).save_pretrained(out)
        (out / "quantize_s.txt").write_text(f"{time.perf_counter() - start:.0f}\n")
        print(f"{tool}: exported to {out}", flush=True)


ROW_LABELS = {"fp": "fp32 (the GGUF, dequantized)", "fp-hf": "fp32 (its safetensors copy, llm-compressor's input)",
              "llmc-rtn": "llm-compressor RTN", "llmc-gptq": "llm-compressor GPTQ", "llmc-awq": "llm-compressor AWQ",
              "rtn-asym": "quantkit rtn, asymmetric", "awq-sym": "quantkit awq, symmetric",
              "llmc-rtn@float16": "llm-compressor RTN, scales served in fp16",
              "llmc-gptq@float16": "llm-compressor GPTQ, scales served in fp16",
              "llmc-awq@float16": "llm-compressor AWQ, scales served in fp16",
              "llmc-autoround": f"AutoRound, {AUTOROUND_PAGE_ITERS} iterations (via llm-compressor)",
              "llmc-autoround-200": "AutoRound, 200 iterations (via llm-compressor)",
              "awq-noduo": "quantkit awq, activation-only scales",
              "awq-noduo-noclip": "quantkit awq, activation-only scales, no clip search"}
ROW_ORDER = ["fp", "fp-hf", "rtn", "llmc-rtn", "llmc-rtn@float16", "rtn-asym", "gptq", "llmc-gptq",
             "llmc-gptq@float16", "awq-sym", "awq", "awq-noduo", "awq-noduo-noclip", "llmc-awq", "llmc-awq@float16", "qqq",
             "awq-gptq", "llmc-autoround", "llmc-autoround-200"]  # the tables' order; rows not named here come last


def tables(args: argparse.Namespace) -> None:
    """The results page's tables, from the model's JSON: held-out perplexity (NLL) and task accuracy."""
    rows = json.loads((RESULTS / f"vs_llmcompressor_{args.model}.json").read_text())["rows"]
    rows = dict(sorted(rows.items(), key=lambda item: ROW_ORDER.index(item[0]) if item[0] in ROW_ORDER else 99))
    kl = MODELS[args.model].gguf is None
    label = {name: ROW_LABELS.get(name, f"quantkit {name}") for name in rows} | ({"fp": "fp32"} if kl else {})
    scored = [name for name in rows if "heldout" in rows[name]]
    print(f"| row | scheme | English {'KL' if kl else 'ppl (NLL)'} | Korean {'KL' if kl else 'ppl (NLL)'} | quantize s |"
          "\n| --- | --- | --- | --- | --- |")
    for name in scored:
        cells = [f"{v['kl']:.5f}" if kl else f"{v['ppl']:.3f} ({v['nll']:.4f})" for v in rows[name]["heldout"].values()]
        print(f"| {label[name]} | {rows[name].get('scheme', '')} | {' | '.join(cells)} | "
              f"{rows[name].get('quantize_s', '')} |")
    with_tasks = [name for name in rows if "tasks" in rows[name]]
    if with_tasks:
        tasks = list(rows[with_tasks[0]]["tasks"])
        print("\n| row | " + " | ".join(tasks) + " |\n|" + " --- |" * (len(tasks) + 1))
        for name in with_tasks:
            cells = [f"{100 * t['value']:.1f} ± {100 * t['stderr']:.1f}" for t in rows[name]["tasks"].values()]
            print(f"| {label[name]} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=["prepare", "llmc", "score", "tables"])
    parser.add_argument("model", choices=list(MODELS))
    parser.add_argument("rows", nargs="*", help="llmc: gptq, awq, autoround; score: fp, fp-hf, "
                        + ", ".join(QUANTKIT_ROWS) + " (quantkit's), llmc-TOOL (llm-compressor's exports)")
    parser.add_argument("--work", default="/work/acc3", help="calibration ids, HF copy, exports (not the repo)")
    parser.add_argument("--nsamples", type=int, default=16, help="calibration sequences (prepare)")
    parser.add_argument("--seqlen", type=int, default=256, help="calibration sequence length (prepare)")
    parser.add_argument("--windows", type=int, default=8, help="512-token windows per held-out text")
    parser.add_argument("--ppl", action=argparse.BooleanOptionalAction, default=True, help="score held-out NLL")
    parser.add_argument("--tasks", default=None, help="comma-separated tasks, zero-shot (e.g. arc_easy,piqa)")
    parser.add_argument("--limit", type=int, default=200, help="items per task")
    parser.add_argument("--iters", type=int, default=AUTOROUND_PAGE_ITERS, help="AutoRound's iterations per block")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    steps = {"prepare": prepare, "llmc": run_llmc, "score": score, "tables": tables}
    steps[args.step](args)


if __name__ == "__main__":
    main()
