"""End-to-end speed of a Llama-3-8B- or 70B-shaped model: fp16 against quantkit's W4A16 / W4A8 / FP8 layers on their
kernels.

    source benchmarks/device_env.sh; QUANTKIT_COMMIT=<commit> python benchmarks/bench_e2e.py --out DIR \
        [--shape 8b] [--schemes w4a16 w4a8 fp8] [--batches 1 16] [--compiled-batches 1] [--profile] \
        [--compare-attention] [--prompt 512] [--layers 32]

Random weights (speed does not depend on their values): the fp16 model from Llama-3's config (the 70B with as many
layers as fit in fp16 on the card, --layers: ms per layer is the figure to compare), then each scheme's
random QuantLinears (g128 symmetric; W4A8 with QQQ's two-level scales, bench_kernels.random_layer; FP8 random
weights of the fp16 spread in e4m3 per channel) in place of every decoder linear; embeddings and lm_head stay fp16
in all (--quantize-head: lm_head in W4A16 / FP8 as `quantkit quantize --quantize-head` writes it).
quantkit.eval.static_decoder.StaticDecoder runs each model (q/k/v and gate/up fused, as serving engines fuse them; a
static KV cache of prompt + 64 positions).
- decode: one step of `batch` tokens at position `prompt`, captured in a CUDA graph and replayed (median ms per
  step), tokens/s, and the bytes a step must read (linear weights and scales, lm_head, the whole cache) per second
  (on an H200 against its 4.25 TB/s copy roof); for --compiled-batches also through torch.compile (fullgraph), whose
  fused kernels replace the small ones around the linears (--profile: their GPU time by kind of kernel;
  --compare-attention: the compiled step again with SDPA in place of quantkit's decode attention kernel);
- prefill: `prompt` tokens of one sequence, graph-replayed the same way (lm_head on the last token only);
- check: the decode attention kernel against float64 at this model's decode shapes (the run fails above
  ATTENTION_TOLERANCE); the first layer's linears alone at each token count, kernels against their reference path
  (dequantized weights, F.linear; the run fails above LAYER_TOLERANCE), and the whole model's logits of a prefill and a decode step
  on each path (relative errors, top token, non-finite logits: reported).
The fp16 model runs first in the same process: every speedup is against it. Kernels tune on their first (eager) call
per shape and token count, outside the graphs; QUANTKIT_CACHE_DIR keeps the tuned configs for the next run.
Writes e2e.json and e2e.md (date, device, command, commit) into --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sys
import time
from pathlib import Path

import torch
from bench_kernels import printing_log, random_layer, relative_error, run_meta
from quantkit.kernels.layout import pack_along_rows
from transformers import AutoModelForCausalLM, LlamaConfig

from quantkit.eval.report import decode_curve, throughput_at
from quantkit.eval.speed import compiled_step, median_seconds
from quantkit.eval.static_decoder import StaticDecoder
from quantkit.models import get_adapter
from quantkit.nn.qlinear import QuantLinear
from quantkit.qtensor import fp8_quantize
from quantkit.quantizers.rtn import rtn_quantize

COPY_ROOF = {"H200": 4.25e12}  # bytes/s, measured copy rate by device (issue #4); others: GB/s alone
DECODE_SLACK = 64  # cache positions after the prompt
# a layer's output on the kernels this far (relative Frobenius error) from its reference path's fails the run. The
# whole model's logits are only reported: through 32 random layers W4A8's per-token int8 roundings flip where the two
# paths differ by an fp16 ulp, and the flips compound (H100: 29% at the logits from 4e-4 per layer; W4A16 1%)
LAYER_TOLERANCE = 2e-3
ATTENTION_TOLERANCE = 2e-3  # relative error of the decode attention kernel's output against float64
WEIGHT_STD = 0.02  # transformers' initializer_range for Llama: the fp16 model's weights


LLAMA3 = {"8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32),
          "70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64)}


def llama3(shape: str, layers: int) -> LlamaConfig:
    return LlamaConfig(**LLAMA3[shape], num_hidden_layers=layers, num_key_value_heads=8, vocab_size=128256,
                       max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)


def quantize_randomly(model: torch.nn.Module, scheme: str, group: int) -> None:
    """Every decoder linear replaced by a random QuantLinear of the scheme (the fp16 weights freed); FP8 rounds random
    weights of the fp16 model's spread."""
    adapter = get_adapter(model)
    device = model.get_input_embeddings().weight.device
    for layer in adapter.get_layers(model):
        for name in adapter.linear_names():
            parent, leaf = name.rsplit(".", 1)
            linear = layer.get_submodule(name)
            if scheme == "fp8":
                weight = torch.randn(linear.out_features, linear.in_features, device=device) * WEIGHT_STD
                fp8 = QuantLinear.from_quantized(fp8_quantize(weight), None, torch.float16, act_bits=8)
                setattr(layer.get_submodule(parent), leaf, fp8.to(device))
                continue
            quantized = random_layer(linear.in_features, linear.out_features, group, scheme, device=device)
            # codes 1..15 (q - 8 in [-7, 7]): random_layer's 0..15 have mean -0.5, a rank-one part of every weight
            # that grows the activations along one direction layer after layer until fp16 overflows
            codes = torch.randint(1, 16, (linear.in_features, linear.out_features), device=device, dtype=torch.uint8)
            quantized.qweight.copy_(pack_along_rows(codes, 4))
            # the fp16 model's weight spread (random_layer's is larger: 32 such layers overflow fp16 activations)
            spread = WEIGHT_STD / quantized.dequantized_weight().float().std().item()
            scales = quantized.scales if quantized.channel_scales is None else quantized.channel_scales
            scales.mul_(spread)
            quantized.prepare_kernels()  # random_layer filled the buffers after the layer moved to the GPU
            setattr(layer.get_submodule(parent), leaf, quantized)


def quantize_head(model: torch.nn.Module, scheme: str, group: int) -> None:
    """--quantize-head: lm_head as a W4A16 (round to nearest, symmetric) or FP8 QuantLinear of its own weight; the
    speed is that of `quantkit quantize --quantize-head`'s head, whatever its calibration chose."""
    weight = model.lm_head.weight.detach()
    qw = fp8_quantize(weight) if scheme == "fp8" else rtn_quantize(weight, 4, group, True, False)
    head = QuantLinear.from_quantized(qw, None, weight.dtype, act_bits=8 if scheme == "fp8" else 16)
    model.lm_head = head.to(weight.device)


HEAD_SCHEMES = ("w4a16", "fp8")  # W4A8's head stays fp16 (--quantize-head takes weight-only schemes and FP8)


def step_bytes(decoder: StaticDecoder) -> int:
    """What one decode step must read: the linears' weights (packed codes and scales), lm_head, the whole cache."""
    total = sum(k.nbytes + v.nbytes for k, v in decoder.cache)
    for linear in [*decoder.linears(), decoder.lm_head]:
        if isinstance(linear, QuantLinear):
            total += linear.qweight.nbytes + linear.scales.nbytes
            total += 0 if linear.channel_scales is None else linear.channel_scales.nbytes
        else:
            total += linear.weight.nbytes
    return total


def _prefill_then_step(decoder: StaticDecoder, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """On a fresh cache: the prefill of all but the last token, then a decode step of the last; both logits."""
    prompt = ids.shape[1] - 1
    decoder.new_cache(1)
    prefill = decoder(ids[:, :prompt], torch.arange(prompt, device=ids.device), last_only=True).float()
    return prefill, decoder(ids[:, prompt:], torch.tensor([prompt], device=ids.device)).float()


def check_layers(decoder: StaticDecoder, token_counts: tuple[int, ...]) -> dict:
    """The first decoder layer's linears alone on random inputs: kernels against the reference path."""
    errors = {}
    for name, linear in zip(("qkv", "o", "gate_up", "down"), decoder.linears()[:4], strict=True):
        if not isinstance(linear, QuantLinear):
            continue
        for m in token_counts:
            x = torch.randn(m, linear.in_features, device=linear.scales.device, dtype=linear.scales.dtype)
            out = linear(x)
            errors[f"{name}_m{m}"] = dict(rel_err=relative_error(out, linear.reference_forward(x)),
                                          nonfinite=int((~out.isfinite()).sum()))
    return errors


def check_step(decoder: StaticDecoder, prompt: int, vocab: int) -> dict:
    """A prefill and a decode step on the kernels against the same on the layers' reference path (dequantized
    weights, F.linear), each on its own fresh cache: relative errors of the logits, non-finite logits per path."""
    quantized = [linear for linear in decoder.linears() if isinstance(linear, QuantLinear)]
    dense, device = sum(2 * linear.in_features * linear.out_features for linear in quantized), decoder.embed.weight.device
    if device.type == "cuda" and dense > 0.8 * torch.cuda.mem_get_info(device)[0]:  # the 70B shape's 32 layers: 55 GB
        return dict(skipped=f"the reference path's dense weights ({dense / 1e9:.0f} GB) do not fit beside the model")
    ids = torch.randint(0, vocab, (1, prompt + 1), device=device)
    on_kernels = _prefill_then_step(decoder, ids)
    for linear in quantized:
        linear.cache_dense_weight()
    reference = _prefill_then_step(decoder, ids)
    for linear in quantized:
        linear.cache_dense_weight(False)
    return dict(rel_err=relative_error(on_kernels[1], reference[1]),
                prefill_rel_err=relative_error(on_kernels[0], reference[0]),
                same_top_token=bool(on_kernels[1].argmax() == reference[1].argmax()),
                nonfinite_kernels=int((~on_kernels[1].isfinite()).sum() + (~on_kernels[0].isfinite()).sum()),
                nonfinite_reference=int((~reference[1].isfinite()).sum() + (~reference[0].isfinite()).sum()))


def time_decode(step, decoder: StaticDecoder, batch: int, prompt: int, vocab: int, label: str, log) -> dict:
    """One decode step of `batch` tokens through step (the decoder or its compiled form), graph-replayed."""
    decoder.new_cache(batch)
    ids = torch.randint(0, vocab, (batch, 1), device="cuda")
    position = torch.tensor([prompt], device="cuda")
    t0 = time.time()
    seconds = median_seconds(lambda: step(ids, position), ids.device)
    moved = step_bytes(decoder)
    roof = next((r for name, r in COPY_ROOF.items() if name in torch.cuda.get_device_name()), None)
    share = moved / seconds / roof if roof else None
    log(f"  {label}: {seconds * 1e3:.3f} ms/step, {batch / seconds:.0f} tokens/s, {moved / seconds / 1e9:.0f} GB/s"
        + (f" ({share:.0%} of the copy roof)" if share is not None else "") + f" [{time.time() - t0:.0f}s]")
    return dict(ms=seconds * 1e3, tokens_per_s=batch / seconds, GBps=moved / seconds / 1e9, roof_fraction=share,
                step_bytes=moved)


# kernel-name patterns, first match wins: quantkit's Triton / Gluon kernels are named after their jit functions
KERNEL_KINDS = (("quantkit linears", r"^_(w4a|quantize)"), ("attention", r"attention|fmha|flash|softmax|efficient"),
                ("cuBLAS", r"gemm|gemv|cutlass|xmma|nvjet|cublas"), ("inductor fused", r"^triton_"))


def kernel_kind(name: str) -> str:
    return next((kind for kind, pattern in KERNEL_KINDS if re.search(pattern, name, re.IGNORECASE)), "other")


def kernel_breakdown(step, steps: int = 5) -> dict:
    """GPU time per step of each kind of kernel and the 12 longest kernels (torch.profiler over eager steps: the
    kernels' own times, without the launch gaps a graph replay removes)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = [(e.key, e.self_device_time_total / steps) for e in prof.key_averages() if e.self_device_time_total > 0]
    kinds: dict[str, float] = {}
    for name, us in kernels:
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + us
    top = sorted(kernels, key=lambda k: -k[1])[:12]
    return {"us_per_step": kinds, "total_us": sum(kinds.values()), "top": [[name[:120], us] for name, us in top]}


def check_decode_attention(decoder: StaticDecoder, batches: list[int], prompt: int) -> dict:
    """The decode attention kernel on random q and caches of the decoder's shapes, a step at position prompt,
    against float64: relative error per batch size (empty when the decoder runs SDPA)."""
    from quantkit.kernels.decode_attention import decode_attention_reference

    if decoder.decode_attention is None:
        return {}
    errors = {}
    rows = decoder.heads // decoder.kv_heads
    for batch in batches:
        q, k, v = (torch.randn(batch, decoder.kv_heads, n, decoder.head_dim, device="cuda", dtype=torch.float16)
                   for n in (rows, decoder.max_len, decoder.max_len))
        positions = torch.tensor([prompt], device="cuda")
        out = decoder.decode_attention(q, k, v, positions, decoder.head_dim ** -0.5, 0)
        errors[f"b{batch}"] = relative_error(out, decode_attention_reference(q, k, v, positions,
                                                                             decoder.head_dim ** -0.5))
    return errors


def time_scheme(decoder: StaticDecoder, batches: list[int], compiled_batches: list[int], prompt: int, vocab: int,
                log, profile: bool = False, compare_attention: bool = False) -> dict:
    """Decode steps at each batch size, the same compiled (torch.compile fuses the norms, rotary and residual adds
    around the linears, gpt-fast's way; the quantized linears stay opaque custom ops), and the prefill."""
    rows = {f"decode_b{batch}": time_decode(decoder, decoder, batch, prompt, vocab, f"decode batch {batch}", log)
            for batch in batches}
    for batch in compiled_batches:
        step = compiled_step(decoder)
        try:
            row = rows[f"decode_b{batch}_compiled"] = time_decode(step, decoder, batch, prompt, vocab,
                                                                  f"decode batch {batch}, compiled", log)
        except Exception as err:  # a compiler failure costs this row, not the run's other rows
            log(f"  decode batch {batch}, compiled: FAILED {type(err).__name__}: {str(err)[:2000]}")
            continue
        if profile:
            ids = torch.randint(0, vocab, (batch, 1), device="cuda")
            position = torch.tensor([prompt], device="cuda")
            row["kernels"] = kernel_breakdown(lambda s=step, i=ids, p=position: s(i, p))
            log(f"  kernels per compiled step (us): {row['kernels']['us_per_step']}; top {row['kernels']['top'][:5]}")
        if compare_attention and decoder.decode_attention is not None:
            kernel, decoder.decode_attention = decoder.decode_attention, None
            rows[f"decode_b{batch}_compiled_sdpa"] = time_decode(
                compiled_step(decoder), decoder, batch, prompt, vocab, f"decode batch {batch}, compiled, SDPA", log)
            decoder.decode_attention = kernel
    decoder.new_cache(1)
    ids = torch.randint(0, vocab, (1, prompt), device="cuda")
    positions = torch.arange(prompt, device="cuda")
    t0 = time.time()
    seconds = median_seconds(lambda: decoder(ids, positions, last_only=True), ids.device, reps=10)
    rows[f"prefill_{prompt}"] = dict(ms=seconds * 1e3, tokens_per_s=prompt / seconds)
    log(f"  prefill {prompt}: {seconds * 1e3:.2f} ms, {prompt / seconds:.0f} tokens/s [{time.time() - t0:.0f}s]")
    return rows


def equal_latency_lines(results: dict) -> list[str]:
    """The compiled decode steps as a throughput-latency curve: at each of fp16's step times, each scheme's tokens/s
    within that time (quantkit.eval.report.throughput_at) over fp16's."""
    base = decode_curve(results.get("fp16", {}), "_compiled")
    schemes = [s for s in results if s != "fp16" and len(decode_curve(results[s], "_compiled")) > 1]
    if len(base) < 2 or not schemes:
        return []
    lines = ["", "At equal latency (compiled steps): each scheme's tokens/s within fp16's step time at each batch, "
             "over fp16's (n/a: outside the scheme's sweep)", "",
             "| fp16 step | fp16 tokens/s | " + " | ".join(f"{s} tokens/s, speedup" for s in schemes) + " |",
             "|---|---|" + "---|" * len(schemes)]
    for batch, ms, tps in base:
        cells = []
        for scheme in schemes:
            found = throughput_at(decode_curve(results[scheme], "_compiled"), ms)
            cells.append("n/a" if found is None else f"{found:.0f}, {found / tps:.2f}x")
        lines.append(f"| {ms:.3f} ms (batch {batch}) | {tps:.0f} | " + " | ".join(cells) + " |")
    return lines


def markdown(meta: dict, results: dict) -> str:
    lines = [f"# End to end, Llama-3-{meta.get('shape', '8b').upper()} shapes ({meta['layers']} layers), {meta['device']}", "",
             f"- date: {meta['date']}", f"- command: `{meta['command']}`", f"- git commit: {meta['commit']}",
             f"- torch {meta['torch']}, triton {meta['triton']}", "",
             "| scheme | cell | ms | ms per layer | tokens/s | speedup over fp16 | GB/s read (share of the copy roof) |",
             "|---|---|---|---|---|---|---|"]
    for scheme, rows in results.items():
        for cell, row in rows.items():
            if not cell.startswith(("decode", "prefill")):
                continue
            speedup = results["fp16"][cell]["ms"] / row["ms"] if cell in results.get("fp16", {}) else float("nan")
            share = f" ({row['roof_fraction']:.0%})" if row.get("roof_fraction") is not None else ""
            read = f"{row['GBps']:.0f}{share}" if "GBps" in row else ""
            lines.append(f"| {scheme} | {cell} | {row['ms']:.3f} | {row['ms'] / meta['layers']:.4f} | "
                         f"{row['tokens_per_s']:.0f} | {speedup:.2f}x | {read} |")
    lines += equal_latency_lines(results)
    lines += ["", "GPU memory once built (weights, the cache of one sequence): " + ", ".join(
        f"{scheme} {rows['gpu_GB']:.2f} GB" for scheme, rows in results.items() if "gpu_GB" in rows)]
    attention = results.get("fp16", {}).get("check_attention")
    if attention:
        lines += ["", "Decode attention kernel against float64 (relative error): "
                  + ", ".join(f"{cell} {err:.1e}" for cell, err in attention.items())]
    checks = {scheme: rows["check"] for scheme, rows in results.items()}
    lines += ["", "Kernels against the reference path (one decode step's logits): "
              + "; ".join(f"{s} {c['skipped']}" if "skipped" in c else
                          f"{s} rel. err {c['rel_err']:.1e} (prefill {c['prefill_rel_err']:.1e}), same top token "
                          f"{c['same_top_token']}, non-finite logits {c['nonfinite_kernels']} / "
                          f"{c['nonfinite_reference']} (kernels / reference)" for s, c in checks.items())]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--schemes", nargs="+", default=["w4a16", "w4a8"], choices=["w4a16", "w4a8", "fp8"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--compiled-batches", type=int, nargs="*", default=[1],
                        help="decode batch sizes also timed through torch.compile (compiles once per scheme each)")
    parser.add_argument("--profile", action="store_true",
                        help="compiled steps: GPU time per kind of kernel (torch.profiler), into the results")
    parser.add_argument("--compare-attention", action="store_true",
                        help="compiled steps: also with SDPA in place of the decode attention kernel")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--shape", default="8b", choices=list(LLAMA3))
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--quantize-head", action="store_true",
                        help="lm_head in the scheme too (W4A16 round to nearest, FP8; W4A8 keeps it fp16)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = printing_log(args.out / "log_e2e.txt")
    meta = run_meta(shape=args.shape, layers=args.layers, prompt=args.prompt, group=args.group,
                    quantize_head=args.quantize_head)
    torch.manual_seed(0)
    config = llama3(args.shape, args.layers)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float16).eval()
    results, failures = {}, 0
    fp16_head = model.lm_head
    for scheme in ["fp16", *args.schemes]:
        t0 = time.time()
        if scheme != "fp16":
            quantize_randomly(model, scheme, args.group)
            model.lm_head = fp16_head
            if args.quantize_head and scheme in HEAD_SCHEMES:
                quantize_head(model, scheme, args.group)
        decoder = StaticDecoder(model, batch_size=1, max_len=args.prompt + DECODE_SLACK)
        gc.collect()
        torch.cuda.empty_cache()
        memory = torch.cuda.memory_allocated() / 1e9
        log(f"{scheme} [{time.time() - t0:.0f}s to build; {memory:.2f} GB on the GPU]")
        results[scheme] = time_scheme(decoder, args.batches, args.compiled_batches, args.prompt, config.vocab_size,
                                      log, args.profile, args.compare_attention)
        results[scheme]["gpu_GB"] = memory
        (args.out / "e2e.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))  # before the checks
        if scheme == "fp16":
            attention = results[scheme]["check_attention"] = check_decode_attention(decoder, args.batches, args.prompt)
            failures += sum(not err < ATTENTION_TOLERANCE for err in attention.values())
            log(f"  decode attention kernel vs float64: {attention}")
        check = results[scheme]["check"] = check_step(decoder, args.prompt, config.vocab_size)
        log(f"  check: {check}")
        layers = results[scheme]["check_layers"] = check_layers(decoder, (*args.batches, args.prompt))
        failures += sum(not entry["rel_err"] < LAYER_TOLERANCE for entry in layers.values())
        log(f"  layers: {layers}")
        del decoder
        torch.cuda.empty_cache()  # the fused copies
        (args.out / "e2e.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    (args.out / "e2e.md").write_text(markdown(meta, results))
    return int(failures > 0)


if __name__ == "__main__":
    sys.exit(main())
