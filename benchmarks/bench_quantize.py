"""End-to-end quantization speed and memory on a Llama-3-8B-shaped random-weight model.

    python benchmarks/bench_quantize.py --method gptq --nsamples 128 --seqlen 2048 --out results.json
    python benchmarks/bench_quantize.py --method awq --asym --nsamples 128 --seqlen 512 --out results.json
    python benchmarks/bench_quantize.py --method awq-gptq --act-order --nsamples 128 --seqlen 512 --out results.json

Random weights (Llama-3-8B shapes: 32 layers, hidden 4096, FFN 14336, GQA 32/8, vocab 128256) and
random token ids: speed does not depend on the values. Layers live on the CPU and move to the GPU one
at a time (quantkit's engine); the report splits the time by phase.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from datetime import date
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from quantkit.config import QuantConfig
from quantkit.data import CalibrationSet
from quantkit.engine import quantize_model
from quantkit.models import get_adapter
from quantkit.quantizers.gptq import GPTQOptions

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)


def random_llama(layers: int, dtype: torch.dtype) -> LlamaForCausalLM:
    """Allocate without initialisers, then fill from one random pool (seconds instead of minutes)."""
    config = LlamaConfig(**{**LLAMA3_8B, "num_hidden_layers": layers})
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model = model.to_empty(device="cpu")
    model.model.rotary_emb = type(model.model.rotary_emb)(config)  # non-persistent buffers
    gen = torch.Generator().manual_seed(0)
    pool = (torch.randn(1 << 24, generator=gen) * 0.02).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
                continue
            flat = p.view(-1)
            shifted = pool.roll(int(torch.randint(0, pool.numel(), (1,), generator=gen)))
            for start in range(0, flat.numel(), pool.numel()):
                chunk = flat[start:start + pool.numel()]
                chunk.copy_(shifted[: chunk.numel()])
    return model.eval()


def hessian_seconds(tokens: int, widths: list[int], device: str, batch: int) -> float:
    """Time GPTQ's Hessian accumulation alone for one layer's linears (bf16 inputs, TF32-exact)."""
    from quantkit.quantizers.gptq import _tf32_matmul

    total = 0.0
    for width in widths:
        x = torch.randn(batch, width, device=device, dtype=torch.bfloat16)
        h = torch.zeros(width, width, device=device)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with _tf32_matmul(True):
            for _ in range(tokens // batch):
                xf = x.float()
                h.addmm_(xf.T, xf, beta=0.5, alpha=0.5)
        torch.cuda.synchronize()
        total += time.perf_counter() - start
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", default="gptq")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--asym", action="store_true")
    parser.add_argument("--act-order", action="store_true", help="GPTQ-based methods: act-order (static groups)")
    parser.add_argument("--nsamples", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    t0 = time.perf_counter()
    model = random_llama(args.layers, torch.bfloat16)
    build_s = time.perf_counter() - t0
    ids = torch.randint(0, LLAMA3_8B["vocab_size"], (args.nsamples, args.seqlen),
                        generator=torch.Generator().manual_seed(1))
    calib = CalibrationSet(ids, torch.ones_like(ids))
    # a flat dict: act_order is ignored by methods without it; given either way, it times what the flag says
    config = QuantConfig.from_dict(dict(method=args.method, group_size=args.group_size, sym=not args.asym,
                                        act_order=args.act_order)).validate()
    torch.cuda.reset_peak_memory_stats()
    report = quantize_model(model, get_adapter(model), calib, config, device="cuda",
                            batch_size=args.batch_size, show_progress=False)
    per_layer = [layer["seconds"] for layer in report.layers]
    result = {
        "date": date.today().isoformat(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": "python benchmarks/bench_quantize.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "asym", "act_order")
        ) + (" --asym" if args.asym else "") + (" --act-order" if args.act_order else ""),
        "commit": os.environ.get("QUANTKIT_COMMIT") or subprocess.run(  # the device's copy has no history
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown",
        "method": args.method, "group_size": args.group_size, "sym": not args.asym, "label": config.label(),
        "calibration_tokens": calib.n_tokens,
        "model_build_seconds": round(build_s, 1),
        "total_seconds": round(report.seconds, 1),
        "seconds_per_layer_median": round(sorted(per_layer)[len(per_layer) // 2], 2),
        "seconds_per_layer": [round(s, 2) for s in per_layer],
        "phases_seconds": {k: round(v, 1) for k, v in report.timings.items()},
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "fallbacks": report.fallbacks,
    }
    if isinstance(config.options, GPTQOptions):  # gptq, qqq, awq-gptq: every linear builds a Hessian
        widths = [4096] * 6 + [14336]  # q k v o gate up down
        one_layer = hessian_seconds(calib.n_tokens, widths, "cuda", args.batch_size * args.seqlen)
        result["hessian_seconds_estimate"] = round(one_layer * args.layers, 1)
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
