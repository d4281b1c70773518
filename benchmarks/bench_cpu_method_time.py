"""CPU time of each method on one decoder layer of a Qwen2-0.5B-shaped model (hidden 896, MLP 4864, 14 query and 2
key-value heads, q/k/v biases), random weights and token ids, 32 x 512 calibration tokens (the CPU default), fp32:
the per-phase seconds of quantkit's engine (`report.timings`, the guard included).

    OMP_NUM_THREADS=1 python benchmarks/bench_cpu_method_time.py gptq awq awq-gptq [--option search_tokens=8192]

Speed does not depend on the values; one layer stands for all 24 (each layer costs the same).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from quantkit.config import QuantConfig
from quantkit.data import CalibrationSet
from quantkit.engine import quantize_model
from quantkit.models import get_adapter

QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                 vocab_size=2000, max_position_embeddings=1024, tie_word_embeddings=False)


def time_method(method: str, layers: int, nsamples: int, seqlen: int, options: dict | None = None) -> dict:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN2_05B, num_hidden_layers=layers)).eval()
    ids = torch.randint(0, QWEN2_05B["vocab_size"], (nsamples, seqlen), generator=torch.Generator().manual_seed(1))
    start = time.perf_counter()
    report = quantize_model(model, get_adapter(model), CalibrationSet(ids, torch.ones_like(ids)),
                            QuantConfig.from_dict({"method": method, "group_size": 128, **(options or {})}),
                            device="cpu", show_progress=False)
    return {"method": method, "options": options or {}, "seconds": round(time.perf_counter() - start, 1),
            "phases": {k: round(v, 1) for k, v in report.timings.items()}, "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("methods", nargs="+")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--nsamples", type=int, default=32)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--option", action="append", default=[], help="KEY=VALUE, a method option (int values)")
    args = parser.parse_args()
    options = {key: int(value) for key, value in (o.split("=", 1) for o in args.option)}
    for method in args.methods:
        print(json.dumps(time_method(method, args.layers, args.nsamples, args.seqlen, options)), flush=True)


if __name__ == "__main__":
    main()
