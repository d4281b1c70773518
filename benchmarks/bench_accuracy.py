"""Held-out NLL of a model and its quantized versions over several calibration seeds: fp next to each method,
same text, same windows; the spread across seeds says which orderings of methods are real.

    python benchmarks/bench_accuracy.py --out benchmarks/accuracy/SEEDS_SMOLLM2.md --nsamples 16 --seqlen 256 \
        --windows 4 --seeds 0 1 2 --runs rtn:64 gptq:64 awq-gptq:64 --compare awq-gptq:64<gptq:64 gptq:64<rtn:64

A run is METHOD:GROUP[:a8][:asym][:noao][:head] (noao: GPTQ without act-order; head: lm_head quantized too); every
other option is the method's default. RTN's and GPTQ's W4A8 runs evaluate their W4A16 run's weights where it is listed first (they do not
depend on act_bits). Calibration: the shipped English+Korean set, --nsamples x --seqlen, shuffled by each seed. `--compare A<B`
reports, per seed, B's mean NLL (over both texts) minus A's: the margin by which A beats B, and how it compares
with the spread of A and B across seeds.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import subprocess
import time
from datetime import date
from pathlib import Path

import torch

from quantkit.config import QuantConfig
from quantkit.data import build_calibration_set, default_heldout_texts, load_passages, load_text
from quantkit.engine import quantize_model
from quantkit.eval.perplexity import perplexity
from quantkit.models import get_adapter, load_model
from quantkit.nn.qlinear import with_act_bits


def parse_run(spec: str, smooth_samples: int | None = None) -> QuantConfig:
    """METHOD:GROUP[:a8][:asym][:noao][:head] -> its QuantConfig; smooth_samples bounds QQQ's smoothing loss."""
    method, group, *flags = spec.split(":")
    unknown = set(flags) - {"a8", "asym", "noao", "head"}
    if unknown:
        raise ValueError(f"{spec}: unknown flags {sorted(unknown)} (a8, asym, noao, head)")
    values = dict(method=method, group_size=int(group), sym="asym" not in flags, act_bits=8 if "a8" in flags else 16,
                  quantize_head="head" in flags)
    if "noao" in flags:
        values["act_order"] = False
    if smooth_samples is not None:
        values["smooth_samples"] = smooth_samples
    return QuantConfig.from_dict(values).validate()


def spread(values: list[float]) -> float:
    return max(values) - min(values)


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def settings(args) -> dict:
    return {"model": args.model, "nsamples": args.nsamples, "seqlen": args.seqlen, "windows": args.windows,
            "batch_size": args.batch_size}


def measure(args, model, tokenizer, texts: dict[str, str], runs: dict, save) -> None:
    """Fills runs[spec][seed] = {"nll": {text: mean NLL}, "seconds": s} for every seed and run not in it yet
    (runs["fp"] for each seed too: its NLL does not depend on the seed), calling save() after each."""
    def nll(m) -> dict[str, float]:
        m.to(args.device)
        try:
            return {n: perplexity(m, tokenizer, t, 512, max_windows=args.windows)["nll"] for n, t in texts.items()}
        finally:
            m.cpu()

    for seed in map(str, args.seeds):
        if seed not in runs.setdefault("fp", {}):
            runs["fp"][seed] = next(iter(runs["fp"].values()), None) or {"nll": nll(model), "seconds": 0.0}
        calib = build_calibration_set(tokenizer, load_passages(None), args.nsamples, args.seqlen, seed=int(seed))
        weight_only: dict[str, torch.nn.Module] = {}  # RTN's and GPTQ's W4A16 models, whose W4A8 runs reuse them
        for spec in args.runs:
            if seed in runs.get(spec, {}):
                continue
            config, start = parse_run(spec), time.perf_counter()
            w4a16 = spec.replace(":a8", "")
            if config.method in ("rtn", "gptq") and w4a16 in weight_only:
                quantized = with_act_bits(weight_only[w4a16], config.act_bits)
            else:
                quantized = copy.deepcopy(model)
                quantize_model(quantized, get_adapter(quantized), calib, config, device=args.device,
                               batch_size=args.batch_size, show_progress=False)
                if config.method in ("rtn", "gptq") and config.act_bits == 16:
                    weight_only[spec] = quantized
            runs.setdefault(spec, {})[seed] = {"seconds": time.perf_counter() - start, "nll": nll(quantized)}
            print(spec, seed, runs[spec][seed], flush=True)
            save()


def page(args, runs: dict, texts: list[str], command: str, commit: str) -> str:
    seeds = sorted(set.intersection(*(set(by_seed) for by_seed in runs.values())), key=int)
    runs = {spec: {seed: by_seed[seed] for seed in seeds} for spec, by_seed in runs.items()}
    lines = [f"# Held-out NLL across calibration seeds: {args.model or 'SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)'}",
             "", f"- date: {date.today().isoformat()}; machine: {args.device}, {torch.get_num_threads()} CPU threads; "
             f"commit: {commit}", f"- command: `{command}`",
             f"- calibration: shipped English+Korean set, {args.nsamples} x {args.seqlen} tokens, seeds "
             f"{', '.join(seeds)}; evaluation: first {args.windows} windows of 512 tokens of each "
             "held-out text (calib_data/heldout_en.txt, heldout_ko.txt), the same for every run",
             "- mean NLL (nats per token) over the seeds, perplexity = exp(NLL); spread: max - min over the seeds of "
             "the mean of both texts", "",
             "| run | " + " | ".join(f"{t} NLL (ppl)" for t in texts) + " | both texts | spread | quantize s |",
             "|---" * (len(texts) + 4) + "|"]
    for spec, by_seed in runs.items():
        label = "fp32" if spec == "fp" else f"{parse_run(spec).label()} (`{spec}`)"
        per_text = {t: mean(r["nll"][t] for r in by_seed.values()) for t in texts}
        both = [mean(r["nll"].values()) for r in by_seed.values()]
        lines.append(f"| {label} | " + " | ".join(f"{v:.4f} ({math.exp(v):.2f})" for v in per_text.values())
                     + f" | {mean(both):.4f} | {spread(both):.4f} | {mean(r['seconds'] for r in by_seed.values()):.0f} |")
    if args.compare:
        lines += ["", "Orderings: margin = the second run's mean NLL minus the first's, per seed (positive: the first "
                  "wins); ratio = the smallest margin over the larger of the two runs' spreads.", "",
                  "| ordering | margin per seed | smallest | ratio |", "|---|---|---|---|"]
        for pair in args.compare:
            a, b = pair.split("<")
            margins = [mean(runs[b][s]["nll"].values()) - mean(runs[a][s]["nll"].values()) for s in seeds]
            noise = max(spread([mean(runs[r][s]["nll"].values()) for s in seeds]) for r in (a, b))
            ratio = f"{min(margins) / noise:.1f}" if noise > 0 else "inf"
            lines.append(f"| `{a}` < `{b}` | {', '.join(f'{m:.4f}' for m in margins)} | {min(margins):.4f} | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    parser.add_argument("--runs", nargs="+", default=["rtn:64", "gptq:64", "awq-gptq:64"])
    parser.add_argument("--compare", nargs="*", default=[], help="A<B: does run A beat run B on every seed?")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--nsamples", type=int, default=64)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--windows", type=int, default=16, help="512-token windows per held-out text")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-size", type=int, default=8, help="calibration batch size")
    parser.add_argument("--merge", nargs="*", type=Path, default=[],
                        help="also take the runs of these JSON files (made with the same settings)")
    parser.add_argument("--out", type=Path, required=True, help="the page; its .json holds every run, and a rerun "
                        "with the same settings measures only what it lacks")
    args = parser.parse_args()
    for pair in args.compare:
        if set(pair.split("<")) - set(args.runs):
            parser.error(f"--compare {pair}: both sides must be among --runs")
    record = args.out.with_suffix(".json")
    runs: dict = {}
    for path in [*args.merge, record]:
        if path.exists():
            saved = json.loads(path.read_text())
            if saved["settings"] != settings(args):
                parser.error(f"{path} was measured with {saved['settings']}, not {settings(args)}")
            for spec, by_seed in saved["runs"].items():
                runs.setdefault(spec, {}).update(by_seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        record.write_text(json.dumps({"settings": settings(args), "runs": runs}, indent=1))

    torch.manual_seed(0)
    model, tokenizer = load_model(args.model)
    texts = {name: load_text(path) for name, path in default_heldout_texts().items()}
    measure(args, model, tokenizer, texts, runs, save)
    save()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    model_arg = f"--model {args.model} " if args.model else ""
    command = (f"python benchmarks/bench_accuracy.py {model_arg}--nsamples {args.nsamples} --seqlen {args.seqlen} "
               f"--windows {args.windows} --batch-size {args.batch_size} --seeds {' '.join(map(str, args.seeds))} "
               f"--runs {' '.join(args.runs)}" + (f" --compare {' '.join(args.compare)}" if args.compare else "")
               + f" --out {args.out}")
    shown = {spec: runs[spec] for spec in ["fp", *args.runs]}
    args.out.write_text(page(args, shown, list(texts), command, commit))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
