"""Streamed GPTQ W4 g128 of a Llama-3-70B-shaped or Qwen3-235B-A22B-shaped random checkpoint on one GPU.

Writes N random bf16 decoder layers (70B: hidden 8192, FFN 28672, GQA 64/8, vocab 128256; 235B-A22B: hidden 4096,
128 experts of 1536 stored per expert as its checkpoints are, top-8, GQA 64/4, vocab 151936) straight to
safetensors shards on local disk, generated on the GPU one layer at a time; then quantizes them through
quantkit.streaming (not the CLI) with 128 x 2048 random calibration tokens and writes the GPTQ export.
Reports seconds per layer (the layer step, and the wall time with work files and export), peak host RSS,
peak GPU memory, disk used and the time extrapolated to the full depth, as JSON and Markdown in --out. Targets:
70B in at most 20 minutes with at most 32 GiB of host memory and 40 GiB of GPU memory; 235B-A22B in at most 90
minutes, 32 GiB of host and 60 GiB of GPU memory. `--shape tiny` / `tiny-moe` check the script (also on the CPU)
before spending device time.

    python benchmarks/bench_streaming_device.py --shape 70b --layers 6 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import resource
import shutil
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig, PretrainedConfig, Qwen3MoeConfig

from quantkit.config import QuantConfig
from quantkit.data import CalibrationSet
from quantkit.distributed import ranks_from_environment
from quantkit.streaming import StreamedRun, open_streamed_model, quantize_streaming

GIB = 2**30
SHAPES = {  # name: (hidden, FFN (per expert), heads, kv heads, vocab, experts, samples, seqlen, full depth)
    "70b": (8192, 28672, 64, 8, 128256, 0, 128, 2048, 80),
    "qwen3-235b-a22b": (4096, 1536, 64, 4, 151936, 128, 128, 2048, 94),
    "tiny": (256, 512, 4, 2, 1024, 0, 8, 64, 80),
    "tiny-moe": (256, 128, 4, 2, 1024, 8, 8, 64, 94),
    # DeepSeek-V3-671B (MLA, q_lora 1536, kv_lora 512; 256 experts of 2048, top-8 of 8 groups, one shared expert),
    # every layer an MoE layer (the real model's first 3 are dense), stored in DeepSeek's FP8 block-scaled form
    "deepseek": (7168, 2048, 128, 128, 129280, 256, 128, 2048, 61),
    "tiny-deepseek": (256, 128, 4, 4, 1024, 16, 8, 64, 61),
}
FP8_BLOCK = 128


def model_config(shape: str, layers: int) -> PretrainedConfig:
    hidden, ffn, heads, kv_heads, vocab, experts, *_ = SHAPES[shape]
    common = dict(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                  num_hidden_layers=layers, tie_word_embeddings=False, dtype="bfloat16")
    if shape.endswith("deepseek"):
        tiny = shape.startswith("tiny")
        return DeepseekV3Config(
            **common, n_routed_experts=experts, num_experts_per_tok=8, moe_intermediate_size=ffn, n_shared_experts=1,
            n_group=8, topk_group=4, first_k_dense_replace=0, intermediate_size=4 * ffn, routed_scaling_factor=2.5,
            q_lora_rank=128 if tiny else 1536, kv_lora_rank=128 if tiny else 512, qk_nope_head_dim=32 if tiny else 128,
            qk_rope_head_dim=32 if tiny else 64, v_head_dim=32 if tiny else 128, max_position_embeddings=163840,
            quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                 "weight_block_size": [FP8_BLOCK, FP8_BLOCK]})
    if experts:
        return Qwen3MoeConfig(**common, head_dim=128, num_experts=experts, num_experts_per_tok=8,
                              moe_intermediate_size=ffn, norm_topk_prob=True, max_position_embeddings=40960,
                              rope_theta=1000000.0)
    return LlamaConfig(**common, intermediate_size=ffn, max_position_embeddings=8192, rope_theta=500000.0)


def checkpoint_shapes(config: PretrainedConfig) -> dict[str, torch.Size]:
    """Every tensor's shape as the architecture's checkpoints store it: MoE experts one tensor per expert
    and projection (transformers holds them fused in 3-D)."""
    with torch.device("meta"):
        fused = {n: t.shape for n, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    shapes: dict[str, torch.Size] = {}
    for name, shape in fused.items():
        if name.endswith("experts.gate_up_proj"):
            for e in range(shape[0]):
                for projection in ("gate_proj", "up_proj"):
                    shapes[f"{name[:-len('gate_up_proj')]}{e}.{projection}.weight"] = torch.Size(
                        [shape[1] // 2, shape[2]])
        elif name.endswith("experts.down_proj"):
            for e in range(shape[0]):
                shapes[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = torch.Size(shape[1:])
        else:
            shapes[name] = shape
    return shapes


def write_checkpoint(folder: Path, config: PretrainedConfig, device: torch.device) -> int:
    """One shard per decoder layer (and one for the rest), random bf16 made on `device` (FP8 block-scaled layer
    projections where the config says quant_method fp8, as DeepSeek ships them); returns the bytes."""
    folder.mkdir(parents=True)
    shapes = checkpoint_shapes(config)
    fp8 = (getattr(config, "quantization_config", None) or {}).get("quant_method") == "fp8"
    groups: dict[str, list[str]] = {}
    for name in shapes:
        match = re.match(r"model\.layers\.(\d+)\.", name)
        groups.setdefault(match.group(1) if match else "rest", []).append(name)
    weight_map, total, gen = {}, 0, torch.Generator(device).manual_seed(0)
    for i, names in enumerate(groups.values(), 1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for n in names:
            tensors |= _random_fp8(shapes[n], n, gen, device) if fp8 and _is_projection(n) else \
                {n: _random(shapes[n], n, gen, device)}
        save_file(tensors, folder / fname, metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config.save_pretrained(folder)
    return total


def _random(shape: torch.Size, name: str, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()


def _is_projection(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith("proj.weight")


def _random_fp8(shape: torch.Size, name: str, gen: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
    """Random float8_e4m3fn codes and one scale per 128 x 128 block (values about 0.02, as _random's)."""
    codes = torch.randn(shape, generator=gen, device=device).to(torch.float8_e4m3fn).cpu()
    blocks = (-(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK))
    return {name: codes, f"{name}_scale_inv": torch.full(blocks, 0.02, dtype=torch.float32)}


def drop_page_cache() -> bool:
    """Reads come from the disk, not from the page cache the checkpoint's writing filled (needs root)."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def layer_bytes(export: Path) -> tuple[int, int]:
    """The export's tensor bytes inside decoder layers and outside them (embeddings, norm, head), from the
    safetensors headers."""
    inside = outside = 0
    for shard in export.glob("*.safetensors"):
        with shard.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                size = entry["data_offsets"][1] - entry["data_offsets"][0]
                inside, outside = (inside + size, outside) if ".layers." in name else (inside, outside + size)
    return inside, outside


def summarize(layer_seconds: list[float], phases: dict[str, float], total_seconds: float, layers: int,
              depth: int, export_split: tuple[int, int]) -> dict:
    """The layer step's own time (load, statistics, solve, next inputs), the wall time per layer (the step plus
    what it does not overlap: packing, work files), and the full-depth time: the capture once, the wall time per
    layer times the depth, and the final assembly of the export grown by the bytes the missing layers add."""
    capture, assembly = phases.get("capture", 0.0), phases.get("export assembly", 0.0)
    wall_per_layer = (total_seconds - capture - assembly) / layers
    inside, outside = export_split
    full_assembly = assembly * (outside + inside * depth / layers) / max(outside + inside, 1)
    return {"seconds_per_layer": statistics.mean(layer_seconds[1:]) if len(layer_seconds) > 1 else layer_seconds[0],
            "first_layer_seconds": layer_seconds[0], "wall_seconds_per_layer": wall_per_layer,
            "assembly_seconds": assembly, "full_depth": depth,
            "extrapolated_full_depth_seconds": capture + wall_per_layer * depth + full_assembly}


def markdown(result: dict) -> str:
    rows = [("device", result["device"]), ("layers run", result["layers"]),
            ("calibration", f"{result['nsamples']} x {result['seqlen']} tokens"),
            ("checkpoint on disk", f"{result['checkpoint_bytes'] / GIB:.1f} GiB"),
            ("checkpoint written in", f"{result['write_seconds']:.0f} s"),
            ("page cache dropped before reading", str(result["page_cache_dropped"])),
            ("layer step, seconds (excl. first)", f"{result['seconds_per_layer']:.1f}"),
            ("wall seconds per layer (step + packing + work files)", f"{result['wall_seconds_per_layer']:.1f}"),
            ("final export assembly", f"{result['assembly_seconds']:.0f} s"),
            ("first layer", f"{result['first_layer_seconds']:.1f} s"),
            ("streamed quantization + export", f"{result['total_seconds']:.0f} s"),
            (f"extrapolated {result['full_depth']} layers",
             f"{result['extrapolated_full_depth_seconds'] / 60:.1f} min (target {result['targets'][0]})"),
            ("peak host RSS", f"{result['peak_rss_bytes'] / GIB:.1f} GiB (target {result['targets'][1]})"),
            ("peak GPU memory", f"{result['peak_gpu_bytes'] / GIB:.1f} GiB (target {result['targets'][2]})"),
            ("export on disk", f"{result['export_bytes'] / GIB:.1f} GiB"),
            ("disk free after", f"{result['disk_free_bytes'] / GIB:.1f} GiB")]
    lines = ["| quantity | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in result["phase_seconds"].items())
    return "\n".join([*lines, "", f"Engine phases (summed over layers): {phases}", ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6, help="decoder layers written and quantized")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/quantkit-bench-70b"),
                        help="checkpoint and export (local disk; removed at the end)")
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="JSON and Markdown results")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--offload-dir", type=Path, help="hidden states on disk if neither GPU nor host holds them")
    parser.add_argument("--shape", choices=list(SHAPES), default="70b", help="tiny ones check the script (CPU too)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and the export")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = args.shape
    *_, vocab, experts, nsamples, seqlen, depth = SHAPES[shape]
    source, output = args.work_dir / "checkpoint", args.work_dir / "export"
    ranks = ranks_from_environment()  # under torchrun: rank 0 writes the checkpoint, every rank quantizes
    start = time.perf_counter()
    if ranks.writer:
        shutil.rmtree(args.work_dir, ignore_errors=True)
        write_checkpoint(source, model_config(shape, args.layers), device)
    ranks.barrier()
    size = folder_bytes(source)
    write_seconds = time.perf_counter() - start
    logging.info("wrote %d layers, %.1f GiB in %.0f s", args.layers, size / GIB, write_seconds)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ids = torch.randint(0, vocab, (nsamples, seqlen), generator=torch.Generator().manual_seed(0))
    calib = CalibrationSet(ids, torch.ones_like(ids))
    config = QuantConfig(method="gptq", bits=4, group_size=128)  # act-order, as `quantkit quantize` runs it
    cold = drop_page_cache() if ranks.writer else False
    ranks.barrier()
    start = time.perf_counter()
    model, ckpt = open_streamed_model(str(source), torch.bfloat16 if device.type == "cuda" else torch.float32)
    run = StreamedRun(config, "gptq", output, device=device, batch_size=args.batch_size, show_progress=False,
                      offload_dir=args.offload_dir, ranks=ranks)
    _, report = quantize_streaming(model, ckpt, None, calib, run)
    total = time.perf_counter() - start
    if not ranks.writer:
        return
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "shape": shape,
        "layers": args.layers, "ranks": ranks.world, "nsamples": nsamples, "seqlen": seqlen, "batch_size": args.batch_size,
        "checkpoint_bytes": size, "write_seconds": write_seconds, "total_seconds": total,
        "engine_seconds": report.seconds, "layer_seconds": [e["seconds"] for e in report.layers],
        "phase_seconds": report.timings,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0,
        "export_bytes": folder_bytes(output), "disk_free_bytes": shutil.disk_usage(args.work_dir).free,
        "torch": torch.__version__, "act_order": True, "page_cache_dropped": cold,
        "targets": (180, 64, 80) if shape.endswith("deepseek") else (90, 32, 60) if experts else (20, 32, 40),
        **summarize([e["seconds"] for e in report.layers], report.timings, total, args.layers, depth,
                    layer_bytes(output)),
    }
    if not args.keep:
        shutil.rmtree(args.work_dir, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "streaming_device.json").write_text(json.dumps(result, indent=1))
    (args.out / "streaming_device.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
