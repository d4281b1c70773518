"""The grouped MoE kernels (kernels/moe_w4a16.py, moe_w4a8.py) against per-expert loops, on MoE expert shapes.

    source benchmarks/device_env.sh; QUANTKIT_COMMIT=<commit> python benchmarks/bench_moe.py --out DIR
    python benchmarks/bench_moe.py --tiny --out /tmp/moe   # CPU: Triton's interpreter, a tiny shape, no timings worth reading

A cell is one MoE layer's experts (gate/up, SiLU, down, weighted sum over the top-k slots) on `tokens` tokens,
Qwen3-30B-A3B's (128 experts, top-8, hidden 2048, moe_intermediate 768), Mixtral-8x7B's (8 experts, top-2,
hidden 4096, intermediate 14336) or DeepSeek-V3's (256 routed experts, top-8, hidden 7168, moe_intermediate 2048), int4 g128 symmetric, fp16 activations. Timed, each the median replay of one CUDA
graph of CALLS calls, each on its own random routing and input (the layer's packed experts are larger than L2, so
a call seldom finds its experts cached), divided by CALLS:
  grouped        moe_w4a16_forward: token alignment + 2 grouped launches + SiLU, K unsplit; the best of a few
                 BLOCK_M/N/K configs for the cell (every candidate's time is in the JSON);
  grouped_splitk the same configs with K split (common.with_moe_split's rule, at least 2 where K has the tiles;
                 configs neither projection can split are left out);
  grouped_w4a8   moe_w4a8_forward on the same codes as QQQ's two-level W4A8 (integer group scales, fp32 channel
                 scales; per-token int8 activations), its configs at the rule's split;
  dequant_loop   per routed expert: dequantize (kernels.w4a16.dequantize) + cuBLAS, gate/up then down;
  fp16_loop      per routed expert: F.linear on the fp16 experts (the dequantized weights);
  grouped_mm     torch._grouped_mm on the experts in bf16 (one CUTLASS launch per projection; the grouped 16-bit
                 baseline), rows sorted by expert in the call, where this torch and GPU have it;
  vllm           vLLM's fused_experts (Triton fused_moe) on the fp16 experts, where vllm is importable.
The loops get each call's routing split per expert on the host beforehand (no routing cost in their time). Every
method's output is checked first against a float32 reference: the per-expert loop in fp32 on the same weights (for
W4A8, its int8 weights times the channel scales, on the per-token int8 activations).
Writes results.json and results.md (date, device, command, commit) into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

if "--tiny" in sys.argv and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels are decorated at import

from quantkit.kernels.common import StackedExperts, moe_candidates, with_moe_split  # noqa: E402
from quantkit.kernels.layout import int8_tokens  # noqa: E402
from quantkit.kernels.moe_w4a8 import moe_w4a8_forward  # noqa: E402
from quantkit.kernels.moe_w4a16 import moe_w4a16_forward  # noqa: E402
from quantkit.kernels.spec import TileConfig  # noqa: E402
from quantkit.kernels.w4a8 import int8_weight  # noqa: E402
from quantkit.kernels.w4a16 import dequantize  # noqa: E402


@dataclass(frozen=True)
class MoeShape:
    experts: int
    top_k: int
    hidden: int
    inter: int


SHAPES = {"Qwen3-30B-A3B": MoeShape(128, 8, 2048, 768), "Mixtral-8x7B": MoeShape(8, 2, 4096, 14336),
          "DeepSeek-V3": MoeShape(256, 8, 7168, 2048)}
TOKENS = (1, 16, 64, 256)
TINY_SHAPES, TINY_TOKENS = {"tiny": MoeShape(4, 2, 64, 128)}, (1, 5)  # down: two K tiles of 64 to split
CALLS = 8
TOLERANCE = 1e-2  # fp16 rounding of the gate/up output and of the result
DTYPE = torch.float16


@dataclass
class Layer:
    """One MoE layer's experts: packed (gate and up stacked along N, gate first), the same weights in fp16, [E, N, K]
    as F.linear and vLLM's fused_moe take them, and W4A8 experts on the same codes."""

    gate_up: StackedExperts
    down: StackedExperts
    gate_up_w: torch.Tensor
    down_w: torch.Tensor
    w4a8: tuple[StackedExperts, StackedExperts]
    bf16: tuple[torch.Tensor, torch.Tensor] | None = None  # for torch._grouped_mm, made on first use


def random_stacked(experts: int, k: int, n: int, group: int, device: str) -> StackedExperts:
    """Random int32 words are random nibbles; scales keep the products of a random input near unit size."""
    qweight = torch.randint(-2**31, 2**31, (experts, k // 8, n), dtype=torch.int32, device=device)
    scales = (0.002 + 0.01 * torch.rand(experts, k // group, n, device=device)).to(DTYPE)
    return StackedExperts(qweight, scales, None, group)


def two_level(experts: StackedExperts) -> StackedExperts:
    """The same codes as QQQ's two-level W4A8, symmetric: integer group scales 1..8 ((q - 8) * s stays in int8) and
    fp32 channel scales that keep the weights near the W4A16 ones' size."""
    e, _, n = experts.shape
    device = experts.qweight.device
    group_scales = torch.randint(1, 9, experts.scales.shape, device=device).to(DTYPE)
    channel = 0.0005 + 0.002 * torch.rand(e, n, device=device)
    return StackedExperts(experts.qweight, group_scales, None, experts.group_size, channel)


def dequantized(experts: StackedExperts) -> torch.Tensor:
    """[E, N, K] fp16, expert by expert."""
    return torch.stack([dequantize(experts.qweight[e], experts.scales[e], None, experts.group_size).t().contiguous()
                        for e in range(experts.qweight.shape[0])])


def random_layer(shape: MoeShape, group: int, device: str) -> Layer:
    gate_up = random_stacked(shape.experts, shape.hidden, 2 * shape.inter, group, device)
    down = random_stacked(shape.experts, shape.inter, shape.hidden, group, device)
    return Layer(gate_up, down, dequantized(gate_up), dequantized(down), (two_level(gate_up), two_level(down)))


def routing(tokens: int, shape: MoeShape, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [tokens, hidden], topk_ids [tokens, top_k] (distinct experts, as a router's top-k), renormalised weights."""
    x = torch.randn(tokens, shape.hidden, device=device).to(DTYPE)
    weights, ids = torch.softmax(torch.randn(tokens, shape.experts, device=device), dim=-1).topk(shape.top_k, dim=-1)
    return x, ids, weights / weights.sum(dim=-1, keepdim=True)


def expert_loop(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                linear: Callable[[int, int, torch.Tensor], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """The per-expert loop as a call, its routing split per expert now (on the host): linear(e, 0 gate/up or
    1 down, rows)."""
    plan = [(e, *torch.where(ids == e)) for e in ids.unique().tolist()]

    def call() -> torch.Tensor:
        out = torch.zeros(x.shape, dtype=torch.float32 if x.dtype == torch.float32 else x.dtype, device=x.device)
        for e, rows, slot in plan:
            gate, up = linear(e, 0, x[rows]).chunk(2, dim=1)
            y = linear(e, 1, F.silu(gate) * up)
            out.index_add_(0, rows, (y * weights[rows, slot, None].to(y.dtype)).to(out.dtype))
        return out

    return call


def method_calls(layer: Layer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                 ) -> dict[str, Callable[[], torch.Tensor]]:
    """Each baseline method as a call on this routing (the grouped kernel's are built per config)."""
    stacks, dense = (layer.gate_up, layer.down), (layer.gate_up_w, layer.down_w)

    def dequant_linear(e: int, proj: int, rows: torch.Tensor) -> torch.Tensor:
        s = stacks[proj]
        return torch.mm(rows, dequantize(s.qweight[e], s.scales[e], None, s.group_size))

    calls = {"dequant_loop": expert_loop(x, ids, weights, dequant_linear),
             "fp16_loop": expert_loop(x, ids, weights, lambda e, proj, rows: F.linear(rows, dense[proj][e]))}
    if hasattr(torch, "_grouped_mm"):
        calls["grouped_mm"] = grouped_mm_call(layer, x, ids, weights)
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts

        calls["vllm"] = lambda: fused_experts(x, layer.gate_up_w, layer.down_w, weights, ids.to(torch.int32))
    except Exception:  # noqa: BLE001 (not installed, or an API of another version: the cell goes without it)
        pass
    return calls


def grouped_mm_call(layer: Layer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                    ) -> Callable[[], torch.Tensor]:
    """torch._grouped_mm over the rows sorted by expert, in bf16 (its one-launch CUTLASS path: other dtypes fall back
    to a loop over groups that reads the offsets on the host), its B operand [E, K, N] as the transpose of [E, N, K]."""
    tokens, top_k = ids.shape
    experts = layer.gate_up_w.shape[0]
    gate_up_w, down_w = bf16_experts(layer)
    x = x.to(torch.bfloat16)

    def call() -> torch.Tensor:
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(experts, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = torch._grouped_mm(x[order // top_k], gate_up_w.transpose(1, 2), offs=offs)
        gate, up = h.chunk(2, dim=1)
        y = torch._grouped_mm((F.silu(gate) * up).contiguous(), down_w.transpose(1, 2), offs=offs)
        unsorted = torch.empty_like(y).index_copy_(0, order, y)
        out = (unsorted.view(tokens, top_k, -1) * weights[..., None].to(y.dtype)).sum(dim=1)
        return out.to(DTYPE)

    return call


def bf16_experts(layer: Layer) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's fp16 experts in bf16, made once per layer."""
    if layer.bf16 is None:
        layer.bf16 = (layer.gate_up_w.to(torch.bfloat16), layer.down_w.to(torch.bfloat16))
    return layer.bf16


def reference(layer: Layer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The per-expert loop in fp32 on the fp16 experts."""
    dense = (layer.gate_up_w, layer.down_w)
    return expert_loop(x.float(), ids, weights.float(), lambda e, proj, rows: rows @ dense[proj][e].float().t())()


def w4a8_reference(layer: Layer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The per-expert loop in fp32 of the W4A8 experts: each row's int8 codes times its scale (layout.int8_tokens),
    times the expert's int8 weight (kernels.w4a8.int8_weight) times its channel scales. The gate/up output and the
    down input are rounded to fp16 as the kernel's are: the down input's int8 codes are then the kernel's but for
    rare ties, not a share of codes one off that grows the error with the shape."""

    def linear(e: int, proj: int, rows: torch.Tensor) -> torch.Tensor:
        s = layer.w4a8[proj]
        codes, scale = int8_tokens(rows.to(DTYPE))
        w = int8_weight(s.qweight[e], s.scales[e], None, s.group_size).float() * s.channel_scales[e][:, None]
        out = (codes.float() * scale) @ w.t()
        return out.to(DTYPE).float() if proj == 0 else out

    return expert_loop(x.float(), ids, weights.float(), linear)()


def timer(calls: list[Callable[[], torch.Tensor]]) -> float:
    """Seconds per call: CUDA-graph replays on a GPU; on the CPU (--tiny) a wall-clock median, only a smoke test."""
    if torch.cuda.is_available():
        from bench_kernels import graph_time

        return graph_time(calls)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for call in calls:
            call()
        times.append((time.perf_counter() - t0) / len(calls))
    return statistics.median(times)


@contextmanager
def no_host_sync() -> Iterator[None]:
    """On a GPU, any host sync inside raises (torch's sync debug mode), where it would later break a capture."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")


def grouped_configs(shape: MoeShape, tokens: int, group: int) -> list[tuple[TileConfig, TileConfig]]:
    """(gate/up, down) configs to try, unsplit: gate/up's candidates for this many rows per expert that fit down too."""
    per_expert = tokens * shape.top_k / shape.experts
    fits_down = moe_candidates(per_expert, shape.inter, shape.hidden, group)
    return [(c, replace(c, block_n=min(c.block_n, shape.hidden)))
            for c in moe_candidates(per_expert, shape.hidden, 2 * shape.inter, group)
            if replace(c, block_n=min(c.block_n, shape.hidden)) in fits_down]


def split_configs(shape: MoeShape, tokens: int, configs: tuple[TileConfig, TileConfig], least: int = 1
                  ) -> tuple[TileConfig, TileConfig]:
    """The configs at with_moe_split's K split, raised to `least` where K has a tile per split for it."""
    rows = tokens * shape.top_k
    split = []
    for config, (k, n) in zip(configs, ((shape.hidden, 2 * shape.inter), (shape.inter, shape.hidden)), strict=True):
        config = with_moe_split(config, rows, shape.experts, k, n)
        split.append(config.with_split(least) if config.split_k < least <= k // config.block_k else config)
    return split[0], split[1]


GroupedForward = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class GroupedMethod:
    """A grouped kernel as a benchmark method: its block forward, its experts and the configs it is timed at."""

    forward: GroupedForward
    experts: tuple[StackedExperts, StackedExperts]
    configs: list[tuple[TileConfig, TileConfig]]


def grouped_methods(layer: Layer, shape: MoeShape, tokens: int) -> dict[str, GroupedMethod]:
    base = grouped_configs(shape, tokens, layer.gate_up.group_size)
    split = [split_configs(shape, tokens, configs, least=2) for configs in base]
    methods = {"grouped": GroupedMethod(moe_w4a16_forward, (layer.gate_up, layer.down), base),
               "grouped_splitk": GroupedMethod(moe_w4a16_forward, (layer.gate_up, layer.down),
                                               [c for c in split if c not in base]),
               "grouped_w4a8": GroupedMethod(moe_w4a8_forward, layer.w4a8,
                                             [split_configs(shape, tokens, configs) for configs in base])}
    return {name: method for name, method in methods.items() if method.configs}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def bench_cell(name: str, shape: MoeShape, tokens: int, layer: Layer, device: str, log) -> dict:
    inputs = [routing(tokens, shape, device) for _ in range(CALLS if device == "cuda" else 1)]
    refs = {"fp16": reference(layer, *inputs[0]), "w4a8": w4a8_reference(layer, *inputs[0])}
    row: dict = dict(shape=name, tokens=tokens, experts=shape.experts, top_k=shape.top_k, hidden=shape.hidden,
                     inter=shape.inter, errors={}, times_us={}, configs={}, best_config={})
    per_input = [method_calls(layer, *args) for args in inputs]
    for method in per_input[0]:
        try:
            with no_host_sync():  # a method that syncs would break the CUDA-graph capture: it is reported instead
                out = per_input[0][method]()
            row["errors"][method] = relative_error(out, refs["fp16"])
            row["times_us"][method] = 1e6 * timer([calls[method] for calls in per_input])
        except Exception as error:  # noqa: BLE001 (an optional baseline that this torch / GPU lacks)
            row["errors"][method] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    for method, grouped in grouped_methods(layer, shape, tokens).items():
        ref = refs["w4a8" if grouped.forward is moe_w4a8_forward else "fp16"]
        times = time_grouped(grouped, inputs, ref, row["errors"], method, log, f"{name} tokens={tokens}")
        row["configs"][method] = times
        if times:
            row["best_config"][method] = best = min(times, key=times.get)
            row["times_us"][method] = times[best]
    return row


def time_grouped(grouped: GroupedMethod, inputs: list, ref: torch.Tensor, errors: dict, method: str, log,
                 cell: str) -> dict[str, float]:
    """Microseconds per call of each of the method's configs whose output passes the check (a failing one is
    logged and its error recorded under "method config"); the largest passing error recorded under `method`."""
    times = {}
    for configs in grouped.configs:
        key = "/".join(json.dumps(c.as_dict()).replace('"', "") if i == 0 else f"down SPLIT_K: {c.split_k}"
                       for i, c in enumerate(configs))

        def call(args, configs=configs):
            return lambda: grouped.forward(*args, *grouped.experts, F.silu, configs)

        with no_host_sync():
            out = call(inputs[0])()
        err = relative_error(out, ref)
        if err > TOLERANCE:
            log(f"FAIL {cell} {method} {key}: relative error {err:.2e}")
            errors[f"{method} {key}"] = err
            continue
        times[key] = 1e6 * timer([call(args) for args in inputs])
        errors[method] = max(err, errors.get(method, 0.0))
    return times


OURS = ("grouped", "grouped_splitk", "grouped_w4a8")
BASELINES = ("dequant_loop", "fp16_loop", "grouped_mm", "vllm")


def speedups(row: dict) -> dict[str, float]:
    """Each grouped method's speedup over the per-expert loops, and split K's over the unsplit kernel."""
    times = row["times_us"]
    pairs = [(ours, base) for ours in OURS for base in ("dequant_loop", "fp16_loop", "grouped_mm")] + [
        ("grouped_splitk", "grouped")]
    return {f"{ours} vs {base}": times[base] / times[ours] for ours, base in pairs if ours in times and base in times}


def markdown(meta: dict, rows: list[dict]) -> str:
    methods = OURS + BASELINES
    ratios = ["grouped_splitk vs grouped", "grouped vs fp16_loop", "grouped_splitk vs fp16_loop", "grouped vs grouped_mm",
              "grouped_splitk vs grouped_mm",
              "grouped_w4a8 vs fp16_loop", "grouped_w4a8 vs dequant_loop"]
    lines = [f"# Grouped MoE kernels: {meta['device']}", "",
             f"{meta['date']}, commit {meta['commit']}, `{meta['command']}`, int4 g{meta['group']} sym, fp16, "
             f"median of CUDA-graph replays of {CALLS} calls each on its own routing.", "",
             "| shape | tokens | " + " | ".join(f"{m} us" for m in methods) + " | " + " | ".join(ratios)
             + " | best configs | failures |", "|" + "---|" * (len(methods) + len(ratios) + 4)]
    for r in rows:
        times, up = r["times_us"], speedups(r)
        failed = [m for m, e in r["errors"].items() if isinstance(e, str) or e > TOLERANCE]
        best = "; ".join(f"{m}: {c}" for m, c in r["best_config"].items())
        lines.append(f"| {r['shape']} | {r['tokens']} | "
                     + " | ".join(f"{times[m]:.1f}" if m in times else "-" for m in methods) + " | "
                     + " | ".join(f"{up[ratio]:.2f}x" if ratio in up else "-" for ratio in ratios)
                     + f" | {best or '-'} | {', '.join(failed) or '-'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/moe"))
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (on the CPU: Triton's interpreter)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help=f"default: {TOKENS}")
    parser.add_argument("--group", type=int, default=128)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from bench_kernels import printing_log, run_meta

    log = printing_log(args.out / "log.txt")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    group = min(args.group, 32) if args.tiny else args.group
    meta = run_meta(group=group) if device == "cuda" else dict(
        device="cpu (Triton interpreter)", date=time.strftime("%Y-%m-%dT%H:%M:%S"), command=" ".join(sys.argv),
        commit=os.environ.get("QUANTKIT_COMMIT", "uncommitted"), group=group)
    shapes = TINY_SHAPES if args.tiny else {s: SHAPES[s] for s in args.shapes}
    torch.manual_seed(0)
    rows, t_start = [], time.time()
    for name, shape in shapes.items():
        layer = random_layer(shape, group, device)
        for tokens in args.tokens or (TINY_TOKENS if args.tiny else TOKENS):
            row = bench_cell(name, shape, tokens, layer, device, log)
            rows.append(row)
            times = ", ".join(f"{m} {t:.1f}us" for m, t in row["times_us"].items())
            log(f"{name} tokens={tokens}: {times} [{time.time() - t_start:.0f}s]")
            # both after every cell: a run cut off by its time limit keeps its table so far
            (args.out / "results.json").write_text(json.dumps(dict(meta=meta, results=rows), indent=1))
            (args.out / "results.md").write_text(markdown(meta, rows))
        del layer
    failures = sum(isinstance(e, float) and e > TOLERANCE for r in rows for e in r["errors"].values())
    failures += sum(m not in r["times_us"] for r in rows for m in ("grouped", "grouped_w4a8"))
    log(f"{failures} failures")
    return int(failures > 0)


if __name__ == "__main__":
    sys.exit(main())
