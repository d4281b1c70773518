"""A Llama-3-70B-shaped original against its W4A16 export, perplexity and KL one layer at a time on one GPU.

Writes N random bf16 decoder layers of the 70B shape (bench_streaming_device.py's writer), quantizes them
streamed with RTN g128 into a compressed-tensors export, drops the page cache, then times
`quantkit.eval.layerwise.layerwise_scores([original, export], windows)` on 32 x 2048 random tokens (what
`quantkit eval ORIGINAL EXPORT` runs when the 70B does not fit). Reports the wall time, each decoder layer's
time (read, moved to the GPU, every window through it), the extrapolation to 80 layers as STREAMING.md does it
(the run as measured plus the missing layers at the mean time of each model's layers after its first), peak host
RSS and peak GPU memory. Targets (issue #40): 80 layers in at most 10 minutes, at most 32 GiB of host.

    python benchmarks/bench_layerwise_device.py --layers 4 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_streaming_device import GIB, drop_page_cache, model_config, write_checkpoint  # noqa: E402

from quantkit.config import QuantConfig  # noqa: E402
from quantkit.data import CalibrationSet  # noqa: E402
from quantkit.eval import layerwise  # noqa: E402
from quantkit.streaming import StreamedRun, open_streamed_model, quantize_streaming  # noqa: E402

FULL_DEPTH = 80


def time_layers(device: torch.device) -> list[list[float]]:
    """Per model, the seconds each decoder layer took (filled as the evaluation runs)."""
    seconds: list[list[float]] = []
    timed = layerwise._Model.layer

    @contextmanager
    def layer(self, index, module):
        if index == 0:
            seconds.append([])
        start = time.perf_counter()
        with timed(self, index, module) as on_device:
            yield on_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds[-1].append(time.perf_counter() - start)

    layerwise._Model.layer = layer
    return seconds


def extrapolate(seconds: float, layer_seconds: list[list[float]], layers: int) -> float:
    """The measured run plus the layers it lacks, each at its model's mean time per layer after the first."""
    steady = sum(sum(model[1:]) / (len(model) - 1) for model in layer_seconds)
    return seconds + (FULL_DEPTH - layers) * steady


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--shape", default="70b", choices=["70b", "tiny"])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/quantkit-layerwise-70b"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shutil.rmtree(args.work_dir, ignore_errors=True)
    source, export = args.work_dir / "original", args.work_dir / "export"
    config = model_config(args.shape, args.layers)
    write_checkpoint(source, config, device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, ckpt = open_streamed_model(str(source), dtype)
    one = torch.zeros(1, 8, dtype=torch.long)
    run = StreamedRun(QuantConfig(method="rtn", group_size=128), "compressed-tensors", export, device=device,
                      show_progress=False)
    quantize_streaming(model, ckpt, None, CalibrationSet(one, torch.ones_like(one)), run)
    del model
    cold = drop_page_cache()
    windows = torch.randint(0, config.vocab_size, (args.windows, args.seqlen),
                            generator=torch.Generator().manual_seed(0))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    layer_seconds = time_layers(device)
    start = time.perf_counter()
    scores = layerwise.layerwise_scores([source, export], {"random": windows}, batch_size=args.batch_size, device=str(device),
                              dtype=dtype)["random"]
    seconds = time.perf_counter() - start
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "shape": args.shape,
        "layers": args.layers, "windows": args.windows, "seqlen": args.seqlen, "batch_size": args.batch_size,
        "seconds": seconds, "layer_seconds": layer_seconds,
        "extrapolated_80_layer_seconds": extrapolate(seconds, layer_seconds, args.layers),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "peak_gpu_gib": torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else 0.0,
        "page_cache_dropped": cold, "scores": scores, "torch": torch.__version__,
    }
    shutil.rmtree(args.work_dir, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "layerwise.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
