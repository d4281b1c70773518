"""quantkit next to llm-compressor on one model: per-layer output error and held-out perplexity.

Runs in an llm-compressor virtualenv (scripts/setup_llmcompressor_venv.sh) into which quantkit is installed
(`VENV/bin/pip install --no-deps -e .`: quantkit.kernels comes from kernels/ through the install):

    PYTHONSAFEPATH=1 VENV/bin/python benchmarks/compare_llmcompressor.py \
        --model models/gemma-3-270m-q4_k_m.gguf --out /tmp/gemma.json

llm-compressor's own pipeline end to end, against every quantkit method: bench_vs_llmcompressor.py; both
pages are benchmarks/accuracy/VS_LLMCOMPRESSOR.md.

Both tools quantize inside quantkit's layer-sequential engine, so they see the same calibration tokens, the
same layer inputs and the same Hessian; only the numerics differ. llm-compressor's side calls its own code:
compressed-tensors' `calculate_qparams` on the group min/max of the *original* weight (its default
min-max weight observer), then `llmcompressor.modifiers.gptq.gptq_quantize.quantize_weight` (GPTQ with those
static parameters; `actorder=static` is its GPTQModifier default) or compressed-tensors' `fake_quantize`
(RTN, what its QuantizationModifier does). Each linear's output error is measured for every variant on the
same Hessian (the variant named by --propagate feeds the next layer), so the per-layer table is a like-for-like
comparison of the conventions, free of drift (scored for every variant along the first --propagate run).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from collections.abc import Callable

import torch
from compressed_tensors.quantization import ActivationOrdering, QuantizationArgs, fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams
from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight
from torch import nn

from quantkit.config import QuantConfig
from quantkit.data import build_calibration_set, default_heldout_texts, load_passages, load_text
from quantkit.engine import quantize_model
from quantkit.eval.perplexity import perplexity
from quantkit.models import get_adapter, load_model
from quantkit.qtensor import QuantizedWeight
from quantkit.quantizers.base import LinearQuantizer, Method, register
from quantkit.quantizers.gptq import GPTQQuantizer, gptq_quantize
from quantkit.quantizers.rtn import rtn_quantize

BITS = 4


def llmc_args(group_size: int, act_order: bool) -> QuantizationArgs:
    strategy = {"strategy": "channel"} if group_size == -1 else {"strategy": "group", "group_size": group_size}
    return QuantizationArgs(num_bits=BITS, type="int", symmetric=True,
                            actorder=ActivationOrdering.STATIC if act_order else None, **strategy)


def llmc_qparams(weight: torch.Tensor, args: QuantizationArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """The min-max observer's scale and zero point [out, groups] of weight [out, in], in weight's dtype."""
    group = weight.shape[1] if args.group_size is None else args.group_size
    grouped = weight.reshape(weight.shape[0], -1, group)
    return calculate_qparams(grouped.amin(dim=-1), grouped.amax(dim=-1), args)


def as_quantized_weight(dequantized: torch.Tensor, scale: torch.Tensor, group_size: int) -> QuantizedWeight:
    """quantkit's unsigned-code form of a symmetric fake-quantized weight (zero 8, the same values)."""
    group = dequantized.shape[1] if group_size == -1 else group_size
    scale = scale.to(torch.float32)
    per_column = scale.repeat_interleave(group, dim=1)
    codes = torch.round(dequantized.to(torch.float32) / per_column) + 2 ** (BITS - 1)
    return QuantizedWeight(codes=codes.clamp(0, 2**BITS - 1).to(torch.uint8), scales=scale,
                           zeros=torch.full_like(scale, 2 ** (BITS - 1)).to(torch.uint8), bits=BITS,
                           group_size=group_size, sym=True)


def llmc_rtn(weight: torch.Tensor, _h: torch.Tensor, group_size: int) -> QuantizedWeight:
    args = llmc_args(group_size, act_order=False)
    scale, zero = llmc_qparams(weight, args)
    group = weight.shape[1] if group_size == -1 else group_size
    grouped = weight.reshape(weight.shape[0], -1, group)
    deq = fake_quantize(grouped, scale.unsqueeze(-1), zero.unsqueeze(-1), llmc_args(group, False))
    return as_quantized_weight(deq.reshape(weight.shape), scale, group_size)


def llmc_gptq(act_order: bool) -> Callable[[torch.Tensor, torch.Tensor, int], QuantizedWeight]:
    def run(weight: torch.Tensor, hessian: torch.Tensor, group_size: int) -> QuantizedWeight:
        args = llmc_args(group_size, act_order)
        scale, zero = llmc_qparams(weight, args)
        deq, _loss, _fallback = quantize_weight(weight[None].clone(), hessian[None].clone(), scale[None],
                                                zero[None], None, args, blocksize=128, percdamp=0.01)
        return as_quantized_weight(deq[0], scale, group_size)
    return run


def quantkit_variant(method: str, act_order: bool = False) -> Callable[..., QuantizedWeight]:
    def run(weight: torch.Tensor, hessian: torch.Tensor, group_size: int) -> QuantizedWeight:
        if method == "rtn":
            return rtn_quantize(weight, BITS, group_size, sym=True, mse=False)
        return gptq_quantize(weight, hessian, QuantConfig(method="gptq", group_size=group_size, act_order=act_order))
    return run


VARIANTS = {
    "quantkit rtn": quantkit_variant("rtn"),
    "quantkit gptq": quantkit_variant("gptq"),
    "quantkit gptq act-order": quantkit_variant("gptq", act_order=True),
    "llm-compressor rtn": llmc_rtn,
    "llm-compressor gptq": llmc_gptq(act_order=False),
    "llm-compressor gptq act-order": llmc_gptq(act_order=True),
}


def output_error(weight: torch.Tensor, qw: QuantizedWeight, hessian: torch.Tensor) -> float:
    """tr((W - Q) H (W - Q)^T) / 2: the mean over calibration tokens of ||(W - Q) x||^2 (H = 2/n X X^T)."""
    delta = weight.to(torch.float64) - qw.dequantize(torch.float64)
    return float(((delta @ hessian.to(torch.float64)) * delta).sum() / 2)


class _Comparing(GPTQQuantizer):
    """Collects GPTQ's Hessian, scores every variant on it, and returns the one that feeds the next layer."""

    log: list[dict] = []
    propagate = "quantkit gptq"
    scored: list[str] = list(VARIANTS)  # the propagated variant and any others to score on the same Hessian

    def quantize(self) -> QuantizedWeight:
        weight = self.linear.weight.detach().to(torch.float32)
        row: dict = {"shape": list(weight.shape)}
        results = {name: VARIANTS[name](weight, self.H, self.config.group_size) for name in self.scored}
        row.update({name: output_error(weight, qw, self.H) for name, qw in results.items()})
        _Comparing.log.append(row)
        return results[self.propagate]


def register_comparing_method() -> None:
    @register
    class Comparing(Method):
        name = "compare-llmc"

        def linear_quantizer(self, linear: nn.Linear) -> LinearQuantizer:
            return _Comparing(linear, self.config)


def heldout_ppl(model: nn.Module, tokenizer, windows: int) -> dict[str, float]:
    texts = {name: load_text(path) for name, path in default_heldout_texts().items()}
    return {n: perplexity(model, tokenizer, t, 512, max_windows=windows)["ppl"] for n, t in texts.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--nsamples", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--windows", type=int, default=8, help="512-token windows per held-out text")
    parser.add_argument("--propagate", nargs="+", default=list(VARIANTS), help="variants to score end to end")
    parser.add_argument("--layer-table", action=argparse.BooleanOptionalAction, default=True,
                        help="score every variant layer by layer along the first run (6 solves per linear)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    register_comparing_method()
    model, tokenizer = load_model(args.model)
    calib = build_calibration_set(tokenizer, load_passages(None), args.nsamples, args.seqlen, seed=0)
    results: dict = {"model": args.model or "SmolLM2-135M", "group_size": args.group_size,
                     "fp": heldout_ppl(model, tokenizer, args.windows), "ppl": {}, "layers": {}}
    print(json.dumps(results["fp"]), flush=True)
    for run, name in enumerate(args.propagate):
        # Every variant is scored layer by layer along the first run's path; later runs only their own.
        _Comparing.log, _Comparing.propagate = [], name
        _Comparing.scored = list(VARIANTS) if run == 0 and args.layer_table else [name]
        quantized = copy.deepcopy(model)
        quantize_model(quantized, get_adapter(quantized), calib,
                       QuantConfig(method="compare-llmc", group_size=args.group_size), device="cpu",
                       show_progress=False)
        results["ppl"][name] = heldout_ppl(quantized, tokenizer, args.windows)
        results["layers"][name] = _Comparing.log
        totals = {v: math.fsum(r[v] for r in _Comparing.log) for v in _Comparing.scored}
        print(name, json.dumps(results["ppl"][name]), json.dumps(totals), flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
