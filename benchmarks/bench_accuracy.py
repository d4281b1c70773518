"""Held-out perplexity of quantized SmolLM2-135M (or any model): fp next to each method, same text,
same windows, same calibration seed.

    python benchmarks/bench_accuracy.py --out benchmarks/accuracy/smollm2.md \
        --runs rtn:64 gptq:64 rtn:-1 gptq:-1 awq:64 [gptq:64:a8 rtn:64:a8 qqq:-1:a8 qqq:64:a8]

A run is METHOD:GROUP[:a8][:asym][:ao] (ao: GPTQ act-order; QQQ always uses it). Calibration: the shipped
English+Korean set, --nsamples x --seqlen. --smooth-steps / --smooth-samples bound QQQ's search (CPU time).
"""

from __future__ import annotations

import argparse
import copy
import json
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


def parse_run(spec: str, smooth_steps: int | None = None, smooth_samples: int | None = None) -> QuantConfig:
    method, group, *flags = spec.split(":")
    # a flat dict: the options of other methods (act-order for RTN, smoothing for GPTQ) are ignored
    return QuantConfig.from_dict(dict(
        method=method, group_size=int(group), sym="asym" not in flags, act_bits=8 if "a8" in flags else 16,
        act_order=method == "qqq" or "ao" in flags, smooth_steps=smooth_steps, smooth_samples=smooth_samples,
    )).validate()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    parser.add_argument("--runs", nargs="+", default=["rtn:64", "gptq:64", "rtn:-1", "gptq:-1"])
    parser.add_argument("--nsamples", type=int, default=64)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--windows", type=int, default=16, help="512-token windows per held-out text")
    parser.add_argument("--smooth-steps", type=int, default=None, help="QQQ thresholds (default: reference rule)")
    parser.add_argument("--smooth-samples", type=int, default=None, help="QQQ loss samples (default: all)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-size", type=int, default=8, help="calibration batch size")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_model(args.model)
    texts = {name: load_text(path) for name, path in default_heldout_texts().items()}
    calib = build_calibration_set(tokenizer, load_passages(None), args.nsamples, args.seqlen, seed=0)

    def ppl(m) -> dict[str, float]:
        m.to(args.device)
        try:
            return {n: perplexity(m, tokenizer, t, 512, max_windows=args.windows)["ppl"] for n, t in texts.items()}
        finally:
            m.cpu()

    rows = [("fp32 (unquantized)", ppl(model), 0.0)]
    for spec in args.runs:
        config = parse_run(spec, args.smooth_steps, args.smooth_samples)
        quantized = copy.deepcopy(model)
        start = time.perf_counter()
        quantize_model(quantized, get_adapter(quantized), calib, config, device=args.device,
                       batch_size=args.batch_size, show_progress=False)
        rows.append((config.label(), ppl(quantized), time.perf_counter() - start))
        print(rows[-1], flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    smooth = "".join(f" --{k.replace('_', '-')} {v}" for k, v in
                     (("smooth_steps", args.smooth_steps), ("smooth_samples", args.smooth_samples)) if v is not None)
    model_arg = f"--model {args.model} " if args.model else ""
    command = "python benchmarks/bench_accuracy.py " + model_arg + " ".join(
        [f"--nsamples {args.nsamples} --seqlen {args.seqlen} --windows {args.windows} --batch-size {args.batch_size}"
         f"{smooth} --runs"] + args.runs)
    lines = [f"# Held-out perplexity: {args.model or 'SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)'}", "",
             f"- date: {date.today().isoformat()}; machine: {args.device} ({torch.get_num_threads()} CPU threads); "
             f"commit: {commit}", f"- command: `{command}`",
             f"- calibration: shipped English+Korean set, {len(calib)} x {args.seqlen} tokens, seed 0; "
             f"evaluation: first {args.windows} windows of 512 tokens of calib_data/heldout_en.txt and heldout_ko.txt",
             "- the source GGUF was 4-bit already, so int4 error here understates a bf16 original's", "",
             "| model | " + " | ".join(texts) + " | quantize time (s) |", "|---" * (len(texts) + 2) + "|"]
    for name, values, seconds in rows:
        lines.append(f"| {name} | " + " | ".join(f"{values[t]:.3f}" for t in texts) + f" | {seconds:.0f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(
        {"command": command, "commit": commit, "rows": [{"model": n, "ppl": v, "seconds": s} for n, v, s in rows]},
        indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
