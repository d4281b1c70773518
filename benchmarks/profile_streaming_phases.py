"""Where a streamed quantization's host memory goes, phase by phase (issue #29; CPU).

Writes a small random Llama-shaped bf16 checkpoint (bench_streaming_memory's, --layers deep), then runs
`quantkit quantize` on it in a fresh process that samples its own VmRSS every 20 ms, each sample tagged
with the innermost phase running (the functions wrapped below); prints each phase's peak, the resident
set after each layer's release (RssAnon / RssFile), and the process's peak (VmHWM). tracemalloc is blind to
torch's storage, hence the sampling. The peaks are per phase, not additive: each includes the floor.

    OMP_NUM_THREADS=1 python benchmarks/profile_streaming_phases.py --layers 4 --method gptq
"""

from __future__ import annotations

import argparse
import functools
import importlib
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

PHASES = [  # (module, function, label): the innermost one running tags a sample
    ("quantkit.streaming", "open_streamed_model", "skeleton and outside tensors (embeddings) loaded"),
    ("quantkit.models.loading", "load_tokenizer", "tokenizer"),
    ("quantkit.data", "build_calibration_set", "calibration set"),
    ("quantkit.engine", "capture_layer_inputs", "capture of layer 0's inputs"),
    ("quantkit.streaming.skeleton", "StreamedLayers.load", "layer load (bf16 read, fp32 copy)"),
    ("quantkit.quantizers.context", "LayerContext.run_until", "statistics forward"),
    ("quantkit.quantizers.gptq", "GPTQQuantizer.add_batch", "GPTQ Hessian accumulation"),
    ("quantkit.engine", "_quantize_step", "quantize step (GPTQ: Hessian copy, act-order permutation)"),
    ("quantkit.quantizers.gptq", "inverse_hessian_factors", "GPTQ inverse Hessian factor"),
    ("quantkit.quantizers.gptq", "_quantize_columns", "GPTQ column loop"),
    ("quantkit.quantizers.context", "LayerContext.forward", "layer outputs forward"),
    ("quantkit.nn.qlinear", "QuantLinear.from_quantized", "QuantLinear packing"),
    ("quantkit.streaming.run", "layer_export_tensors", "layer's export tensors"),
    ("quantkit.streaming.workdir", "WorkDir.save_layer", "work files written"),
    ("quantkit.streaming.skeleton", "StreamedLayers.release", "layer release"),
    ("quantkit.streaming.run", "_write_export", "export assembly"),
]


def _status(*keys: str) -> list[int]:
    with open("/proc/self/status") as status:
        values = {key: int(value.split()[0]) * 1024 for key, _, value in (line.partition(":") for line in status)
                  if key in keys}
    return [values[k] for k in keys]


def _owner_and_name(module: str, qualname: str) -> tuple[object, str]:
    owner = importlib.import_module(module)
    *path, name = qualname.split(".")
    for attr in path:
        owner = getattr(owner, attr)
    return owner, name


def _child(quantize_args: list[str]) -> None:
    """Run the CLI in this process with the sampler; print the per-phase peaks."""
    running = ["startup, imports and everything not listed"]
    peaks: dict[str, int] = {}

    def sample() -> None:
        while True:
            rss, label = _status("VmRSS")[0], running[-1]
            peaks[label] = max(peaks.get(label, 0), rss)
            time.sleep(0.02)

    def tag(module: str, qualname: str, label: str) -> None:
        owner, name = _owner_and_name(module, qualname)
        function = getattr(owner, name)

        @functools.wraps(function)
        def tagged(*args, **kwargs):
            running.append(label)
            try:
                return function(*args, **kwargs)
            finally:
                running.pop()
                if label == "layer release":
                    anon, file = _status("RssAnon", "RssFile")
                    print(f"after a layer's release: RSS {(anon + file) / 1e9:.3f} GB "
                          f"(anonymous {anon / 1e9:.3f}, files {file / 1e9:.3f})", file=sys.stderr, flush=True)

        setattr(owner, name, tagged)

    for phase in PHASES:
        tag(*phase)
    threading.Thread(target=sample, daemon=True).start()
    from quantkit.cli import app

    try:
        app(["quantize", *quantize_args])
    except SystemExit as done:
        if done.code:
            raise
    # VmHWM, not ru_maxrss: after exec, ru_maxrss still counts the parent this process was forked from
    print(f"peak RSS (VmHWM): {_status('VmHWM')[0] / 1e9:.3f} GB")
    for label, peak in peaks.items():
        print(f"  peak during {label:58s} {peak / 1e9:.3f} GB")


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        _child(sys.argv[2:])
        return
    from bench_streaming_memory import _config, write_checkpoint

    from quantkit.models.loading import default_model_path, load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("/work/bench-tmp"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--method", default="gptq")
    parser.add_argument("--experts", type=int, default=0, help="a Qwen3-MoE shape with this many experts")
    args = parser.parse_args()
    tokenizer = load_tokenizer(str(default_model_path()))
    source = args.dir / f"profile-{args.layers}l"
    shutil.rmtree(source, ignore_errors=True)
    size = write_checkpoint(source, _config(args.layers, args, len(tokenizer)), tokenizer)
    print(f"{args.layers} layers, {size / 1e9:.3f} GB of bf16", flush=True)
    quantize = [str(source), "--method", args.method, "--nsamples", "4", "--seqlen", "64", "--device", "cpu",
                "--no-eval", "--output", str(source) + "-q", "--overwrite"]
    try:
        subprocess.run([sys.executable, __file__, "--child", *quantize], check=True)
    finally:
        shutil.rmtree(source, ignore_errors=True)
        shutil.rmtree(str(source) + "-q", ignore_errors=True)


if __name__ == "__main__":
    main()
