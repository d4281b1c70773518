"""W4A8's two conventions on a real model: the kernels' integer function against a fake-quantized matmul.

The W4A8 kernels compute int8 activations times int8 weights exactly (int32 sums), then scale in fp32
(`kernels/reference.py: w4a8_reference`); QuantLinear's reference path (the CPU's) computes the same. A fake-quantized
matmul, the usual simulation of W4A8 (and quantkit's reference path before), multiplies the dequantized activations
and weights after rounding both to the model's dtype. Each layer's two outputs differ by about an ulp of that dtype,
and every next layer's per-token int8 rounding turns some of those ulps into whole int8 steps. This script measures
what that does to a real model's logits and held-out NLL: SmolLM2-135M quantized with QQQ (W4A8 two-level g64), run
in float16 both ways, beside the unquantized model.

    python benchmarks/bench_w4a8_paths.py --out benchmarks/accuracy/w4a8_paths.json
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from quantkit.config import QuantConfig
from quantkit.data import build_calibration_set, default_heldout_texts, load_passages, load_text
from quantkit.engine import quantize_model
from quantkit.eval.perplexity import heldout_windows
from quantkit.models import get_adapter, load_model
from quantkit.models.loading import default_model_path
from quantkit.nn.qlinear import QuantLinear


def cast(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every floating tensor in `dtype` but the W4A8 layers' fp32 channel scales, as a GPU model holds them
    (transformers refuses .to(dtype) on a model read from a GGUF file)."""
    for module in model.modules():
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if tensor is not None and tensor.is_floating_point() and name != "channel_scales":
                tensor.data = tensor.data.to(dtype)


@torch.no_grad()
def logits_per_window(model, windows: torch.Tensor) -> list[torch.Tensor]:
    return [model(w[None]).logits[0].float() for w in windows]


def nll(logits: list[torch.Tensor], windows: torch.Tensor) -> float:
    losses = [torch.nn.functional.cross_entropy(lg[:-1], w[1:].to(lg.device)) for lg, w in zip(logits, windows, strict=True)]
    return float(torch.stack(losses).mean())


def compare(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict:
    """Relative Frobenius difference of the logits and the share of positions with the same top token."""
    diff = sum(float((x - y).pow(2).sum()) for x, y in zip(a, b, strict=True)) ** 0.5
    norm = sum(float(y.pow(2).sum()) for y in b) ** 0.5
    same = sum(int((x.argmax(-1) == y.argmax(-1)).sum()) for x, y in zip(a, b, strict=True))
    return {"rel_err": diff / norm, "same_top_token": same / sum(y.shape[0] for y in b)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF or folder; default: the embedded default (SmolLM2)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--dtype", default="float16")
    args = parser.parse_args()
    args.model = args.model or str(default_model_path())
    model, tokenizer = load_model(args.model)
    calib = build_calibration_set(tokenizer, load_passages(None), nsamples=16, seqlen=256, seed=0)
    texts = {name: load_text(path) for name, path in default_heldout_texts().items()}
    windows = {name: heldout_windows(tokenizer, text, 512, args.windows) for name, text in texts.items()}
    dtype = getattr(torch, args.dtype)
    unquantized = copy.deepcopy(model)
    cast(unquantized, dtype)
    fp_logits = {name: logits_per_window(unquantized, w) for name, w in windows.items()}
    del unquantized
    start = time.perf_counter()
    config = QuantConfig(method="qqq", group_size=64)
    report = quantize_model(model, get_adapter(model), calib, config, device="cpu", show_progress=False)
    seconds = time.perf_counter() - start
    cast(model, dtype)
    integer = {name: logits_per_window(model, w) for name, w in windows.items()}
    integer_forward = QuantLinear.forward
    QuantLinear.forward = QuantLinear.fake_quantized_forward  # the dequantized weight, never a cached one
    try:
        fake = {name: logits_per_window(model, w) for name, w in windows.items()}
    finally:
        QuantLinear.forward = integer_forward
    results = {"model": args.model, "dtype": args.dtype, "scheme": report.scheme.label(),
               "quantize_seconds": round(seconds, 1), "windows": args.windows, "texts": {}}
    for name, w in windows.items():
        results["texts"][name] = {
            "nll": {"fp": nll(fp_logits[name], w), "w4a8_integer": nll(integer[name], w),
                    "w4a8_fake_quantized": nll(fake[name], w)},
            "fake_quantized_vs_integer": compare(fake[name], integer[name]),
            "integer_vs_fp": compare(integer[name], fp_logits[name]),
            "fake_quantized_vs_fp": compare(fake[name], fp_logits[name]),
        }
    results["date"] = time.strftime("%Y-%m-%d")
    args.out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
