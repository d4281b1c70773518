"""Decode and prefill speed of a model as a serving engine runs it: static_decoder.StaticDecoder's fixed-shape steps
(q/k/v and gate/up fused, static KV cache), replayed from a CUDA graph on a GPU, so that Python's launch overhead
is not counted as the model's time (eager, wall-clock, on a CPU)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from quantkit.eval.static_decoder import StaticDecoder

PROMPT_TOKENS = 512
REPS = 30


def replay_seconds(graph: torch.cuda.CUDAGraph, reps: int = REPS) -> float:
    """Median seconds of a replay of `graph` (CUDA events around each, after one untimed replay)."""
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def median_seconds(step: Callable[[], object], device: torch.device, reps: int = REPS) -> float:
    """Median seconds of one step() after two warm-up calls (kernel tuning, library handles: never in a capture);
    on CUDA each timed call is a replay of one captured step()."""
    step()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return replay_seconds(graph, reps)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def compiled_step(decoder: StaticDecoder, backend: str = "inductor") -> Callable:
    """decoder's step through torch.compile(fullgraph, static shapes). Dynamo's compiled code is cleared first: each
    decoder and batch size compiles the same method again, and past Dynamo's recompile limit it would quietly run
    eager."""
    torch._dynamo.reset()
    return torch.compile(decoder.__call__, fullgraph=True, dynamic=False, backend=backend)


def measure_speed(model: nn.Module, batch_sizes: tuple[int, ...] = (1,), prompt: int = PROMPT_TOKENS,
                  reps: int = REPS, compile_backend: str | None = None) -> dict:
    """{"decode_b{B}": {"ms", "tokens_per_s"} per batch size (one step of B tokens after a prompt of `prompt`),
    "prefill_{prompt}": {"ms", "tokens_per_s"} (one sequence), "device", "compiled", "prompt", "attention" (what
    the decode steps attend with)}, or {"skipped": why}
    for a model StaticDecoder does not run. Random token ids: the speed does not depend on them. compile_backend:
    decode steps through torch.compile(fullgraph) with that backend ("inductor" fuses the small ops around the
    linears; on an H100 it made an 8B-shaped W4A16 step 1.56x faster, benchmarks/README.md), once per batch size."""
    device = model.get_input_embeddings().weight.device
    try:
        decoder = StaticDecoder(model, batch_sizes[0], prompt + 1)
    except ValueError as err:
        return {"skipped": str(err)}
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    result: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "compiled": compile_backend, "prompt": prompt,
                    "attention": "SDPA" if decoder.decode_attention is None else "quantkit decode attention kernel"}
    position = torch.tensor([prompt], device=device)
    for batch in batch_sizes:
        decoder.new_cache(batch)
        ids = torch.randint(0, vocab, (batch, 1), generator=generator).to(device)
        step = decoder if compile_backend is None else compiled_step(decoder, compile_backend)
        seconds = median_seconds(lambda ids=ids, step=step: step(ids, position), device, reps)
        result[f"decode_b{batch}"] = {"ms": 1e3 * seconds, "tokens_per_s": batch / seconds}
    decoder.new_cache(1)
    ids = torch.randint(0, vocab, (1, prompt), generator=generator).to(device)
    positions = torch.arange(prompt, device=device)
    seconds = median_seconds(lambda: decoder(ids, positions, last_only=True), device, max(3, reps // 5))
    result[f"prefill_{prompt}"] = {"ms": 1e3 * seconds, "tokens_per_s": prompt / seconds}
    return result
