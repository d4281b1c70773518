"""A Llama-3-70B-shaped W4A16 g128 export loaded onto one GPU by quantkit's reload, in a fresh process.

The export (compressed-tensors, random codes and scales, ~37 GiB for 80 layers) is written tensor by tensor with
quantkit's shard writer and metadata writer, as a real export would be; then a new process runs
`quantkit.reload.load_quantized(folder, device=...)` and reports the load time, how far its peak resident host
memory grew, the GPU memory it holds, and one forward pass of 512 tokens through the loaded model.

    python benchmarks/bench_reload_device.py --work /tmp/r70b --out DIR [--layers 80] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch
from accelerate import init_empty_weights
from transformers import AutoModelForCausalLM, LlamaConfig

from quantkit.config import QuantConfig
from quantkit.export import write_metadata, write_shards
from quantkit.models import get_adapter

LLAMA3_70B = dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                  head_dim=128, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                  rms_norm_eps=1e-5, tie_word_embeddings=False)
SCHEME = QuantConfig(method="rtn", group_size=128)
SHARD_BYTES = 5 * 2**30

PROBE = """
import json, sys, time, torch
from pathlib import Path
from quantkit.reload import load_quantized

def status(key):  # kB
    return int(next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key)).split()[1])

folder, device, dtype = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3])
Path("/proc/self/clear_refs").write_text("5")
before = status("VmRSS:")
start = time.perf_counter()
model, _ = load_quantized(folder, dtype=dtype, device=device)
if device == "cuda":
    torch.cuda.synchronize()
loaded = time.perf_counter() - start
result = {"load_s": loaded, "host_peak_growth_gib": (status("VmHWM:") - before) / 2**20,
          "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
if device == "cuda":
    result["gpu_allocated_gib"] = torch.cuda.memory_allocated() / 2**30
ids = torch.randint(0, model.config.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0)).to(device)
with torch.no_grad():
    for attempt in ("first", "second"):
        start = time.perf_counter()
        logits = model(ids).logits
        if device == "cuda":
            torch.cuda.synchronize()
        result[f"forward_512_{attempt}_s"] = time.perf_counter() - start
result["logits_finite"] = bool(logits.isfinite().all())
if device == "cuda":
    result["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
print(json.dumps(result))
"""


def linear_shapes(config: LlamaConfig) -> dict[str, tuple[int, int]]:
    h, i = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * config.head_dim
    q = config.num_attention_heads * config.head_dim
    return {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}


def tensor_specs(config: LlamaConfig) -> dict[str, tuple[torch.dtype, list[int]]]:
    """Every tensor of the compressed-tensors W4A16 g128 export (pack-quantized, symmetric: no zero points)."""
    h = config.hidden_size
    specs = {"model.embed_tokens.weight": (torch.float16, [config.vocab_size, h]),
             "lm_head.weight": (torch.float16, [config.vocab_size, h]), "model.norm.weight": (torch.float16, [h])}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            specs[f"{prefix}{norm}.weight"] = (torch.float16, [h])
        for name, (out_f, in_f) in linear_shapes(config).items():
            specs[f"{prefix}{name}.weight_packed"] = (torch.int32, [out_f, in_f // 8])
            specs[f"{prefix}{name}.weight_scale"] = (torch.float16, [out_f, in_f // SCHEME.group_size])
            specs[f"{prefix}{name}.weight_shape"] = (torch.int64, [2])
    return specs


def random_tensor(name: str, dtype: torch.dtype, shape: list[int], config: LlamaConfig, device: str) -> torch.Tensor:
    """Values a real export could hold: any code words, scales about what a 0.02-std weight gives, unit norms."""
    generator = torch.Generator(device).manual_seed(zlib.crc32(name.encode()))
    if name.endswith("weight_packed"):
        return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, device=device, generator=generator).cpu()
    if name.endswith("weight_shape"):
        return torch.tensor(shape_of(name, config), dtype=torch.int64)
    if name.endswith("weight_scale"):
        return (torch.rand(shape, device=device, generator=generator) * 0.004 + 0.004).half().cpu()
    if "norm" in name:
        return torch.ones(shape, dtype=dtype)
    return (torch.randn(shape, device=device, generator=generator) * 0.02).to(dtype).cpu()


def shape_of(name: str, config: LlamaConfig) -> tuple[int, int]:
    module = name.rsplit(".", 1)[0].split(".", 3)[3]  # model.layers.N.<module>
    return linear_shapes(config)[module]


def write_export(folder: Path, config: LlamaConfig, device: str) -> float:
    folder.mkdir(parents=True)
    specs = tensor_specs(config)
    start = time.perf_counter()
    write_shards(folder, [(k, _nbytes(*v)) for k, v in specs.items()], specs.__getitem__,
                 lambda k: random_tensor(k, *specs[k], config, device), shard_bytes=SHARD_BYTES)
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    skeleton.config.architectures = ["LlamaForCausalLM"]
    get_adapter(skeleton)  # a supported architecture, as the real writer checks
    write_metadata(folder, skeleton, None, SCHEME, "compressed-tensors", torch.float16, None)
    return time.perf_counter() - start


def _nbytes(dtype: torch.dtype, shape: list[int]) -> int:
    return torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="where the export is written (~37 GiB at 80 layers)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", default="llama3-70b", choices=["llama3-70b", "tiny"])
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"],
                        help="the loaded model's (random weights overflow fp16 activations over 80 layers)")
    args = parser.parse_args()
    shape = LLAMA3_70B if args.shape == "llama3-70b" else dict(
        hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        vocab_size=512, max_position_embeddings=1024)
    config = LlamaConfig(**shape, num_hidden_layers=args.layers)
    folder = args.work / "export"
    reused = (folder / "config.json").is_file()  # an earlier run's whole export (its metadata is written last)
    write_s = None if reused else write_export(folder, config, args.device)
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    run = subprocess.run([sys.executable, "-P", "-c", PROBE, str(folder), args.device, args.dtype], capture_output=True,
                         text=True)  # -P: the checkout's kernels/ folder must not shadow the PyPI package
    if run.returncode:
        sys.exit(run.stderr[-3000:])
    result = {"shape": args.shape, "layers": args.layers, "export_gib": size / 2**30, "write_s": write_s,
              "dtype": args.dtype, "plain_copy_env": os.environ.get("QUANTKIT_PLAIN_COPY"),
              **json.loads(run.stdout.strip().splitlines()[-1]), "torch": torch.__version__}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"reload_{args.dtype}_plain{result['plain_copy_env']}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
