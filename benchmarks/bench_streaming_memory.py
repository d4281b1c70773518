"""Peak host memory of a streamed GPTQ quantization on the CPU, against the checkpoint's size and depth.

Writes a random-weight Llama-shaped bf16 checkpoint of at least --size-gb (sharded, with an index and the
SmolLM2 tokenizer) into --dir, one layer at a time so that writing it needs little memory itself; runs
`quantkit quantize` on it under /usr/bin/time -v; then does the same with twice the layers. Pass: the
peak RSS is at most 30% of the checkpoint's size, and doubling the layers raises it by at most 10%.
`--pair-method rtn` runs the doubled pair with RTN (the same streaming path without the Hessians) when
GPTQ on twice the layers would take too long: --method then runs on the first checkpoint only.
`--experts N` writes a Qwen3-MoE-shaped checkpoint instead (N experts of --intermediate each, stored per
expert as such checkpoints are). `--eval` also runs `quantkit eval CHECKPOINT EXPORT --layerwise` on the first
checkpoint and its --method export, and reports that peak too (target: at most 35% of the checkpoint).

    OMP_NUM_THREADS=1 python benchmarks/bench_streaming_memory.py --dir /work/bench-tmp --size-gb 3 --json r.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, PretrainedConfig, Qwen3MoeConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_streaming_device import checkpoint_shapes  # noqa: E402

from quantkit.models.loading import default_model_path, load_tokenizer  # noqa: E402


def _config(layers: int, args: argparse.Namespace, vocab: int) -> PretrainedConfig:
    common = dict(hidden_size=args.hidden, num_hidden_layers=layers, num_attention_heads=args.hidden // 64,
                  num_key_value_heads=args.hidden // 256, vocab_size=vocab, tie_word_embeddings=True,
                  max_position_embeddings=4096, dtype="bfloat16")
    if args.experts:
        return Qwen3MoeConfig(**common, head_dim=64, num_experts=args.experts, num_experts_per_tok=8,
                              moe_intermediate_size=args.intermediate, norm_topk_prob=True)
    return LlamaConfig(**common, intermediate_size=args.intermediate)


def _shapes(config: PretrainedConfig) -> dict[str, torch.Size]:
    return {name: shape for name, shape in checkpoint_shapes(config).items() if name != "lm_head.weight"}


def write_checkpoint(folder: Path, config: LlamaConfig, tokenizer) -> int:
    """One shard per decoder layer (and one for the rest), each filled with random bf16 and written at once."""
    folder.mkdir(parents=True)
    shapes = _shapes(config)
    groups: dict[str, list[str]] = {}
    for name in shapes:
        match = re.match(r"model\.layers\.(\d+)\.", name)
        groups.setdefault(f"layer{int(match.group(1)):05d}" if match else "rest", []).append(name)
    weight_map, total, gen = {}, 0, torch.Generator().manual_seed(0)
    for i, names in enumerate(groups.values(), 1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: (torch.randn(shapes[n], generator=gen) * 0.02).to(torch.bfloat16) for n in names}
        for n in names:
            if n.endswith("norm.weight"):
                tensors[n] = torch.ones(shapes[n], dtype=torch.bfloat16)
        save_file(tensors, folder / fname, metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map.update(dict.fromkeys(names, fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return total


def peak_rss_quantizing(source: Path, method: str, args: argparse.Namespace, evaluate: bool = False) -> dict:
    """Peak RSS in bytes of the quantkit process and its seconds; with `evaluate`, also those of
    `quantkit eval SOURCE EXPORT --layerwise` on the export."""
    output = source.with_name(source.name + "-q")
    shutil.rmtree(output, ignore_errors=True)
    found = _peak([sys.executable, "-m", "quantkit", "quantize", str(source), "--method", method, "--nsamples",
                   str(args.nsamples), "--seqlen", str(args.seqlen), "--device", "cpu", "--no-eval", "--output",
                   str(output)], "")
    if evaluate:
        found |= _peak([sys.executable, "-m", "quantkit", "eval", str(source), str(output), "--layerwise",
                        "--device", "cpu", "--max-windows", "4", "--seqlen", "256"], "eval_")
    shutil.rmtree(output, ignore_errors=True)
    return found


def _peak(command: list[str], prefix: str) -> dict:
    start = time.perf_counter()
    result = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True,
                            env={**os.environ, "PYTHONSAFEPATH": "1"})
    seconds = time.perf_counter() - start
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    kbytes = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", result.stderr).group(1))
    return {f"{prefix}peak_rss_bytes": kbytes * 1024, f"{prefix}seconds": seconds}


def _layers_for(size_gb: float, args: argparse.Namespace, vocab: int) -> int:
    probe = _shapes(_config(1, args, vocab))
    per_layer = sum(math.prod(s) * 2 for n, s in probe.items() if n.startswith("model.layers."))
    rest = sum(math.prod(s) * 2 for n, s in probe.items() if not n.startswith("model.layers."))
    return math.ceil((size_gb * 1e9 - rest) / per_layer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("/work/bench-tmp"))
    parser.add_argument("--size-gb", type=float, default=3.0, help="checkpoint size on disk (bf16), at least")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--method", default="gptq", help="the method whose peak is held to 30%% of the checkpoint")
    parser.add_argument("--pair-method", help="the method run on both depths (default: --method)")
    parser.add_argument("--nsamples", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=64)
    parser.add_argument("--experts", type=int, default=0, help="a Qwen3-MoE shape with this many experts")
    parser.add_argument("--eval", action="store_true", help="also the layer-wise eval of the first export")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    pair_method = args.pair_method or args.method
    tokenizer = load_tokenizer(str(default_model_path()))
    layers = _layers_for(args.size_gb, args, len(tokenizer))
    plan = [(layers, list(dict.fromkeys([args.method, pair_method]))), (2 * layers, [pair_method])]
    rows = []
    for depth, methods in plan:
        folder = args.dir / f"{'moe' if args.experts else 'llama'}-{depth}l"
        shutil.rmtree(folder, ignore_errors=True)
        size = write_checkpoint(folder, _config(depth, args, len(tokenizer)), tokenizer)
        for method in methods:
            found = peak_rss_quantizing(folder, method, args, evaluate=args.eval and depth == layers)
            peak = found["peak_rss_bytes"]
            rows.append({"method": method, "layers": depth, "checkpoint_bytes": size, **found,
                         "peak_over_size": peak / size})
            print(f"{method}, {depth} layers, {size / 1e9:.2f} GB: peak RSS {peak / 1e9:.3f} GB "
                  f"({100 * peak / size:.1f}% of the checkpoint), {found['seconds']:.0f} s", flush=True)
            if "eval_peak_rss_bytes" in found:
                print(f"  quantkit eval --layerwise: peak RSS {found['eval_peak_rss_bytes'] / 1e9:.3f} GB "
                      f"({100 * found['eval_peak_rss_bytes'] / size:.1f}%), {found['eval_seconds']:.0f} s", flush=True)
        shutil.rmtree(folder, ignore_errors=True)
    ratio = rows[0]["peak_over_size"]
    pair = [r["peak_rss_bytes"] for r in rows if r["method"] == pair_method]
    growth = pair[1] / pair[0] - 1
    print(f"{args.method} peak / checkpoint: {100 * ratio:.1f}% (target <= 30%); {pair_method} peak growth when "
          f"the layers double: {100 * growth:+.1f}% (target <= +10%)")
    verdict = {"peak_at_most_30_percent": ratio <= 0.30, "doubling_layers_at_most_10_percent": growth <= 0.10,
               "peak_over_size": ratio, "growth_when_doubling": growth}
    print(json.dumps(verdict))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": rows,
                                         **verdict}, indent=1))


if __name__ == "__main__":
    main()
