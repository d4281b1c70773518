"""QQQ (Zhang et al. 2024, "QQQ: Quality Quattuor-Bit Quantization for Large Language Models",
arXiv:2406.09904): 4-bit weights and per-token dynamic int8 activations (W4A8), in two steps per layer.

1. Adaptive smoothing (reference: HandH1998/QQQ, QQQ/smooth/migration/migration_llama.py,
   Migrator1DRangeSearch). On each scaling group of quantkit.smoothing (norm -> q/k/v, v -> o,
   norm -> gate/up, up -> down) take per input channel j the max cmx_j and min cmn_j of the activations
   over real tokens. For thresholds t from max|x| down to 0.1 in max(100, max|x| / 0.5) steps (or exactly
   config.smooth_steps),
   channels reaching past +-t get s_j = max(cmx_j / t, cmn_j / -t), the others 1. The loss is the squared
   error (summed over features, averaged over real tokens) of the group's block output computed from
   per-token int8 x / s and 4-bit W * s, against the unquantized output; the linears compute as the W4A8
   kernel does (int8 x int8 products summed exactly, then both scales: `int8_matmul`), not in fp32 on
   fake-quantized values, which differs only in fp32 rounding.
   Block outputs: for q/k/v the attention output before o_proj (the model's own attention module runs,
   rotary embedding and mask included), for gate/up SiLU(gate) * up (the input of down_proj), for o and
   down the matmul. The best s is folded into the previous op (1/s) and the linears (s). The first
   candidate, t = max|x|, is s = 1: smoothing never raises the loss on the calibration set.
   The reference evaluates every candidate (config.smooth_search = "grid"); by default ("refine", not in
   the reference) a coarse pass over every ~count/24-th threshold and local searches from its 3 best: on
   SmolLM2's first 6 layers its loss was 0.36% (g64) and 0.03% (per channel) above the full grid's minimum on
   average, closer than a grid of half the steps (0.49%, 0.18%), from 34 evaluations per group instead of 107
   (benchmarks/accuracy/qqq_threshold_search_*.md); its count grows with log(max|x|), not max|x| (massive
   activations of 1000 make the reference rule's grid 2001 candidates, the refined search <= 67 evaluations).
   With config.smooth_check (default; not in the reference) the searched s is kept only if it also lowers
   the loss when GPTQ, not rounding, quantizes the group's weights (Hessian of x / s on the loss tokens):
   GPTQ's compensation can undo what smoothing gains under rounding. On Gemma-3-270M g128 this turns QQQ
   from worse than plain GPTQ W4A8 (mean held-out NLL 3.184 vs 3.167) to better (3.152).
2. GPTQ with symmetric weights and act-order with static groups (QQQ/gptq/gptq.py, quant.py) on QQQ's
   grids, through quantkit.quantizers.gptq with a WeightGrid:
     per-channel  signed codes [-7, 7] (unsigned 1..15, zero 8), scale = absmax / 7 (QQQ's maxq = 7);
     per-group    the two-level scheme: unsigned codes 0..15, zero 8, an fp32 per-output-channel scale
                  s_ch and group scales s_g = k * s_ch with integers k in [1, 16]. QuantizedWeight.scales
                  holds s_g, channel_scales s_ch; the int8 weight (q - 8) * k lies in [-128, 112].

Deviations from the reference, on purpose:
  * Two-level scales. QQQ takes GPTQ's group scales s_g = 2 absmax / 15, then after GPTQ
    s_ch = max|W_hat_row| / 127 and fp16 group scales s_g / s_ch; its kernel (csrc/qqq_gemm.cu,
    dequant_per_group) rounds (q - 8) * s_g / s_ch to int8, so the served weights differ from the ones
    GPTQ compensated for by up to s_ch / 2. Here s_ch comes first (the row's largest GPTQ group scale
    / 16, rounded up to 4 significant bits) and each group scale is the smallest integer multiple of it
    covering the group, so the int8 weights are exact: GPTQ sees what the W4A8 kernel computes, and
    s_g = k * s_ch has at most 8 significant bits, exact in the fp16/bf16 scales that exports store.
  * The smoothing search runs on the unquantized layer (QQQ runs it inside a fake-quantized forward, so
    its o_proj inputs went through quantized q/k/v), and on the per-channel / two-level grids GPTQ then
    uses (QQQ's loss quantizes weights on a [-7, 7] grid per channel or group).
  * The grids are min-max: config.mse is not used (QQQ's per-group recipe searches an MSE grid).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from quantkit.config import QuantConfig
from quantkit.models.adapters import ArchAdapter, ScalingGroup
from quantkit.nn.qlinear import int8_tokens
from quantkit.qtensor import QuantizationError, QuantizedWeight, check_group_size, quantize_codes
from quantkit.quantizers.base import LinearQuantizer, Method, register
from quantkit.quantizers.gptq import GPTQQuantizer, gptq_quantize
from quantkit.smoothing import active_scaling_groups, fold_scales

if TYPE_CHECKING:
    from quantkit.engine import LayerContext

log = logging.getLogger("quantkit")

BITS = 4
ZERO = 8  # symmetric 4-bit: unsigned code 8 is 0
MAX_GROUP_MULTIPLE = 16  # (0 - 8) * 16 = -128 is the lowest int8
CHANNEL_SCALE_BITS = 4  # k (<= 16) * s_ch then has <= 8 significant bits: exact in bf16 and fp16
MIN_CHANNEL_SCALE = 2.0**-21  # 8 * 2**-24: k * s_ch stays a multiple of 2**-24, exact as an fp16 subnormal
THRESHOLD_FLOOR = 0.1  # the reference's smallest threshold...
THRESHOLD_SPACING = 0.5  # ...and its max(100, max|x| / 0.5) candidates
THRESHOLD_MIN_STEPS = 100
REQUIRED_OPTIONS = {"act_order": True, "sym": True, "act_bits": 8}
# int8 products are at most 127 * 128 in magnitude: any 1024 of them, summed in any order, stay below 2**24,
# where fp32 holds every integer
EXACT_FP32_PRODUCTS = 1024
# the refined threshold search: a first pass over every ceil(count / 24)-th candidate, then local searches from
# its 3 best (measured against every candidate: the module docstring)
COARSE_PASS = 24
REFINED_STARTS = 3


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a int8 [M, K] @ b int8 [K, N] -> int32 [M, N], exactly. torch._int_mm on CUDA; elsewhere (and for shapes
    CUDA's _int_mm refuses) fp32 matmuls over K slices short enough to be exact, summed in int32: CPU _int_mm ran
    25-40x slower than an fp32 matmul of the same shape on an AVX2 machine without VNNI (AMD EPYC, torch 2.13)."""
    if a.is_cuda and a.shape[0] > 16 and a.shape[1] % 8 == 0 and b.shape[1] % 8 == 0:  # what CUDA _int_mm takes
        return torch._int_mm(a, b)
    wide = torch.float32 if a.device.type == "cpu" else torch.float64  # CUDA fp32 matmuls may round to TF32
    return _int_valued_matmul(a.to(wide), b.to(wide)).to(torch.int32)


def _int_valued_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int8_matmul's sums for int8 values held in fp32 or float64 (a [M, K], b [K, N]), exactly: one matmul when
    K <= EXACT_FP32_PRODUCTS, else K slices that short summed in float64. On the CPU the smoothing loss keeps its
    int8 values in fp32 and converts the result to a floating dtype (one rounding, as converting int8_matmul's
    would): int8 -> fp32 -> int32 round trips per call cost a third of a loss evaluation's time there."""
    if a.shape[1] <= EXACT_FP32_PRODUCTS:
        return a @ b
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64, device=a.device)
    for start in range(0, a.shape[1], EXACT_FP32_PRODUCTS):
        end = start + EXACT_FP32_PRODUCTS
        out += a[:, start:end] @ b[start:end]
    return out


def _squared_error(out: torch.Tensor, target: torch.Tensor, rows: int = 128) -> torch.Tensor:
    """sum((out - target)^2) in float64 (exact differences and squares of fp32 values), over slices of rows: a
    float64 copy of a whole [tokens, features] output, made and reduced in one piece, ran ~3x slower (memory
    traffic) than slices that stay in cache."""
    total = torch.zeros((), dtype=torch.float64, device=out.device)
    for start in range(0, out.shape[0], rows):
        total += out[start:start + rows].double().sub_(target[start:start + rows]).square_().sum()
    return total


class PerChannelGrid:
    """QQQ's per-channel grid: signed codes in [-7, 7] (unsigned 1..15), scale = absmax / 7."""

    lowest, highest = ZERO - 7, ZERO + 7

    def qparams(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        absmax = w.abs().amax(dim=-1)
        scale = torch.where(absmax == 0, 1.0, absmax / 7).clamp(2**-24, 65504)
        scale = scale.to(torch.float16).to(w.dtype)  # exports store fp16 scales: GPTQ must see those
        return scale, torch.full_like(scale, ZERO)


def _round_up_to_bits(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The smallest value >= x with `bits` significant bits."""
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2**exponent, mantissa in [0.5, 1)
    return torch.ldexp(torch.ceil(mantissa * 2**bits), exponent - bits)


class TwoLevelGrid:
    """QQQ's per-group grid with group scales that are integer multiples of a per-channel scale."""

    lowest, highest = 0, 2**BITS - 1

    def __init__(self) -> None:
        self.channel_scales: torch.Tensor | None = None  # [rows], set by qparams

    def qparams(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ideal = 2 * w.abs().amax(dim=-1) / self.highest  # GPTQ's symmetric min-max group scale
        channel = _round_up_to_bits(ideal.amax(dim=-1) / MAX_GROUP_MULTIPLE, CHANNEL_SCALE_BITS)
        channel = channel.clamp(min=MIN_CHANNEL_SCALE)
        multiple = torch.ceil(ideal / channel[:, None]).clamp(1, MAX_GROUP_MULTIPLE)
        self.channel_scales = channel
        return multiple * channel[:, None], torch.full_like(multiple, ZERO)


def make_grid(group_size: int) -> PerChannelGrid | TwoLevelGrid:
    return PerChannelGrid() if group_size == -1 else TwoLevelGrid()


@dataclass
class Int8Weight:
    """A weight on QQQ's grid as the W4A8 kernel holds it: int8 values times a per-output-channel scale
    (per channel: codes - 8 in [-7, 7] times absmax / 7; two-level: (codes - 8) * k in [-128, 112] times s_ch)."""

    values: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # [out], fp32 or wider

    @classmethod
    def round_to_nearest(cls, weight: torch.Tensor, group_size: int) -> Int8Weight:
        """Round-to-nearest on QQQ's grid: what the smoothing search scores scales with."""
        rows, cols = weight.shape
        group = check_group_size(cols, group_size)
        w = weight.to(torch.promote_types(weight.dtype, torch.float32)).reshape(rows, cols // group, group)
        grid = make_grid(group_size)
        scale, zero = grid.qparams(w)
        codes = quantize_codes(w, scale.unsqueeze(-1), zero.unsqueeze(-1), BITS).clamp_(grid.lowest, grid.highest)
        return cls._from_codes(codes, scale, zero, grid)

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, grid: PerChannelGrid | TwoLevelGrid) -> Int8Weight:
        """qw as quantized on `grid` (its two-level channel scales are the grid's last qparams)."""
        codes = qw.codes.reshape(qw.shape[0], qw.n_groups, -1).to(qw.scales.dtype)
        return cls._from_codes(codes, qw.scales, qw.zeros.to(qw.scales.dtype), grid)

    @classmethod
    def _from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    grid: PerChannelGrid | TwoLevelGrid) -> Int8Weight:
        """codes [rows, groups, group], scale and zero [rows, groups], all floating point."""
        rows = scale[:, 0] if isinstance(grid, PerChannelGrid) else grid.channel_scales.to(scale)
        multiple = (scale / rows[:, None]).round_()  # the integer k of each group (1 per channel)
        values = (codes - zero.unsqueeze(-1)).mul_(multiple.unsqueeze(-1))
        return cls(values.reshape(codes.shape[0], -1).to(torch.int8), rows)

    def dequantize(self) -> torch.Tensor:
        return self.values * self.scales[:, None]


class QQQQuantizer(GPTQQuantizer):
    """GPTQ on QQQ's grid; per-group results carry the per-channel scales of the two-level scheme."""

    def __init__(self, linear: nn.Linear, config: QuantConfig) -> None:
        super().__init__(linear, config)
        self.grid = make_grid(config.group_size)

    def quantize(self) -> QuantizedWeight:
        result = super().quantize()
        if isinstance(self.grid, TwoLevelGrid):
            result.channel_scales = self.grid.channel_scales.to(torch.float32)
        return result


class Int8Linears:
    """The group's linears as the W4A8 kernel computes them: per-token int8 inputs times int8 weights,
    accumulated exactly (int8_matmul), then both scales. An input the linears share (q/k/v,
    gate/up) is quantized once."""

    def __init__(self, weights: list[Int8Weight]) -> None:
        self.weights = weights
        self._input: torch.Tensor | None = None
        self._codes: tuple[torch.Tensor, torch.Tensor] | None = None
        # on the CPU the int8 values in fp32, converted once per input / weight (not per call and batch)
        self._float_values: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.weights)

    def __call__(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Linear `index` of the group on x [..., in] (no bias)."""
        on_cpu = x.device.type == "cpu"
        if x is not self._input:
            codes, token_scales = int8_tokens(x.reshape(-1, x.shape[-1]))
            self._input, self._codes = x, (codes.float() if on_cpu else codes, token_scales)
        codes, token_scales = self._codes
        weight = self.weights[index]
        if on_cpu:
            if index not in self._float_values:
                self._float_values[index] = weight.values.t().float()
            out = _int_valued_matmul(codes, self._float_values[index]).to(x.dtype)
        else:
            out = int8_matmul(codes, weight.values.t()).to(x.dtype)
        out = out.mul_(token_scales.to(x.dtype)).mul_(weight.scales.to(x.dtype))
        return out.reshape(*x.shape[:-1], out.shape[-1])  # x may hold no token (an MoE expert)


# (batch index, the linears' input, the quantized linears or None for the unquantized ones) -> block output on
# that batch's real tokens
BlockFn = Callable[[int, torch.Tensor, Int8Linears | None], torch.Tensor]


def _real_rows(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if mask is None else rows[mask.reshape(-1)]


class MatmulBlock:
    """The block output of groups that feed linears straight (v -> o, up -> down): x W^T."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        self.weights = weights

    def __call__(self, _batch: int, x: torch.Tensor, linears: Int8Linears | None) -> torch.Tensor:
        if linears is None:
            return torch.cat([x @ w.t() for w in self.weights], dim=-1)
        return torch.cat([linears(i, x) for i in range(len(linears))], dim=-1)


class SmoothingProbe:
    """One scaling group on the calibration batches: its channel ranges, and the loss of a scale vector."""

    def __init__(self, inputs: list[torch.Tensor], masks: list[torch.Tensor | None],
                 weights: list[torch.Tensor], block: BlockFn, group_size: int,
                 loss_batches: int | None = None) -> None:
        """Channel ranges come from every batch; the loss from the first `loss_batches` (None: all)."""
        self.masks, self.weights = masks, weights
        self.block, self.group_size = block, group_size
        real = [_real_rows(x, m) for x, m in zip(inputs, masks, strict=True)]
        self.tokens = sum(r.shape[0] for r in real[:loss_batches])
        seen = [r for r in real if r.shape[0]] or [weights[0].new_zeros(1, weights[0].shape[1])]  # MoE experts
        self.channel_max = torch.stack([r.amax(dim=0) for r in seen]).amax(dim=0).float()
        self.channel_min = torch.stack([r.amin(dim=0) for r in seen]).amin(dim=0).float()
        self.inputs = inputs[:loss_batches]
        self.targets = [block(i, x, None) for i, x in enumerate(self.inputs)]

    @classmethod
    def for_matmul(cls, inputs: list[torch.Tensor], weights: list[torch.Tensor], group_size: int,
                   loss_batches: int | None = None) -> SmoothingProbe:
        """Inputs are real-token rows [tokens, in_features]."""
        return cls(inputs, [None] * len(inputs), weights, MatmulBlock(weights), group_size, loss_batches)

    def bound(self) -> float:
        """The largest |activation|: the first threshold, at which no channel is scaled."""
        return max(self.channel_max.max().item(), -self.channel_min.min().item(), 0.0)

    def loss(self, scales: torch.Tensor) -> float:
        """The loss with the smoothed weights rounded to nearest (the search's loss)."""
        return self.loss_with(scales, [Int8Weight.round_to_nearest(w * scales.to(w), self.group_size)
                                       for w in self.weights])

    def loss_with(self, scales: torch.Tensor, weights: list[Int8Weight]) -> float:
        """The loss of int8 per-token activations x / scales through the given (smoothed, quantized) weights."""
        linears = Int8Linears(weights)
        total = torch.zeros((), dtype=torch.float64, device=scales.device)
        for i, (x, target) in enumerate(zip(self.inputs, self.targets, strict=True)):
            total += _squared_error(self.block(i, x / scales.to(x), linears), target)
        return total.item() / self.tokens

    def gptq_loss(self, scales: torch.Tensor, config: QuantConfig) -> float:
        """The loss after QQQ's GPTQ of the smoothed weights, its Hessian from the loss tokens' x / scales."""
        rows = [_real_rows(x, m).float() / scales.float() for x, m in
                zip(self.inputs, self.masks[:len(self.inputs)], strict=True)]
        x = torch.cat(rows)
        hessian = 2 * x.t() @ x / max(x.shape[0], 1)
        weights = []
        for w in self.weights:
            grid = make_grid(config.group_size)
            weights.append(Int8Weight.from_quantized(gptq_quantize(w * scales.to(w), hessian, config, grid), grid))
        return self.loss_with(scales, weights)


def threshold_scales(channel_max: torch.Tensor, channel_min: torch.Tensor, threshold: float) -> torch.Tensor:
    """s_j = max(cmx_j / t, cmn_j / -t) for the channels reaching past +-t, 1 for the others."""
    one = torch.ones_like(channel_max)
    above = torch.where(channel_max > threshold, channel_max / threshold, one)
    below = torch.where(channel_min < -threshold, channel_min / -threshold, one)
    return torch.maximum(above, below)


def candidate_thresholds(bound: float, steps: int | None) -> list[float]:
    """From the largest |activation| down to 0.1 (the reference's range); just `bound` (no smoothing) when
    nothing exceeds 0.1."""
    if bound <= THRESHOLD_FLOOR:
        return [bound]
    count = steps if steps is not None else max(THRESHOLD_MIN_STEPS, int(bound / THRESHOLD_SPACING))
    return torch.linspace(bound, THRESHOLD_FLOOR, count + 1, dtype=torch.float64).tolist()


@dataclass
class SmoothingChoice:
    threshold: float
    scales: torch.Tensor
    loss: float
    loss_unsmoothed: float  # the loss at the first candidate, s = 1
    gptq_losses: tuple[float, float] | None = None  # (smoothed, unsmoothed) after GPTQ, when checked
    rejected: float | None = None  # the searched threshold the GPTQ check turned down
    evaluated: int = 1  # thresholds whose loss the search computed

    def summary(self) -> dict:
        return {"threshold": self.threshold, "scaled_channels": int((self.scales != 1).sum()),
                "max_scale": float(self.scales.max()), "loss": self.loss,
                "loss_unsmoothed": self.loss_unsmoothed, "gptq_losses": self.gptq_losses,
                "rejected_threshold": self.rejected, "thresholds_evaluated": self.evaluated}


def refine_on_grid(loss: Callable[[int], float], count: int, coarse: int = COARSE_PASS,
                   starts: int = REFINED_STARTS) -> None:
    """Calls `loss` (memoised by the caller) on the grid indices 0..count-1 a coarse-to-fine search visits: every
    stride-th index (stride = ceil((count - 1) / coarse); the first and last always), then from each of the
    `starts` best of them a local search that halves the spacing down to neighbouring indices. The loss is rugged
    at the grid's spacing (integer roundings), so one descent alone can end in the wrong valley."""
    stride = max(1, -(-(count - 1) // coarse))
    visited = sorted({*range(0, count, stride), count - 1})
    for best in sorted(visited, key=lambda i: (loss(i), i))[:starts]:
        step = stride
        while step > 1:
            step = (step + 1) // 2
            around = [i for i in (best - step, best, best + step) if 0 <= i < count]
            best = min(around, key=lambda i: (loss(i), i))


def search_smoothing(probe: SmoothingProbe, steps: int | None, search: str = "refine") -> SmoothingChoice:
    """The threshold whose scales minimise probe.loss among those `search` visits ("grid": every candidate, as
    the reference; "refine": refine_on_grid); the first (largest) of equal losses wins."""
    thresholds = candidate_thresholds(probe.bound(), steps)
    losses: dict[int, float] = {}

    def scales(index: int) -> torch.Tensor:
        return threshold_scales(probe.channel_max, probe.channel_min, thresholds[index])

    def loss(index: int) -> float:
        if index not in losses:
            losses[index] = probe.loss(scales(index))
        return losses[index]

    if search == "grid":
        for index in range(len(thresholds)):
            loss(index)
    else:
        refine_on_grid(loss, len(thresholds))
    best = min(losses, key=lambda i: (losses[i], i))
    return SmoothingChoice(thresholds[best], scales(best), losses[best], loss(0), evaluated=len(losses))


def confirm_after_gptq(probe: SmoothingProbe, choice: SmoothingChoice, config: QuantConfig) -> SmoothingChoice:
    """Keeps the searched scales only if they also lower the loss once GPTQ (not round-to-nearest) quantizes
    the weights, as it will: GPTQ's error compensation can undo what smoothing gained under rounding."""
    if bool((choice.scales == 1).all()):
        return choice
    ones = torch.ones_like(choice.scales)
    smoothed, unsmoothed = probe.gptq_loss(choice.scales, config), probe.gptq_loss(ones, config)
    choice.gptq_losses = (smoothed, unsmoothed)
    if smoothed < unsmoothed:
        return choice
    return SmoothingChoice(probe.bound(), ones, choice.loss_unsmoothed,
                           choice.loss_unsmoothed, gptq_losses=choice.gptq_losses, rejected=choice.threshold,
                           evaluated=choice.evaluated)


class _Stop(Exception):
    """Raised by a hook once the measured tensor is in hand: the rest of the module need not run."""


def _int8_forward(int8: Int8Linears, index: int, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    out = int8(index, x)
    return out if bias is None else out + bias.to(out)


@contextmanager
def _computed_by(linears: list[nn.Linear], int8: Int8Linears) -> Iterator[None]:
    """While active, the linears compute as `int8` does (plus their bias) instead of with their weights."""
    for index, linear in enumerate(linears):
        linear.forward = partial(_int8_forward, int8, index, linear.bias)  # an instance attribute, deleted below
    try:
        yield
    finally:
        for linear in linears:
            del linear.forward


class ModuleBlock:
    """Runs `module` (attention, MLP) on its recorded calls with the group's linears quantized (or not) and
    other inputs; the block output is the input of `measured` (o_proj, down_proj) on real tokens."""

    def __init__(self, module: nn.Module, measured: nn.Module | None, linears: list[nn.Linear],
                 calls: list[tuple[tuple, dict]], masks: list[torch.Tensor | None]) -> None:
        self.module, self.measured, self.linears = module, measured, linears
        self.calls, self.masks = calls, masks

    def input_of(self, batch: int) -> torch.Tensor:
        args, kwargs = self.calls[batch]
        return args[0] if args else kwargs["hidden_states"]

    def __call__(self, batch: int, x: torch.Tensor, linears: Int8Linears | None) -> torch.Tensor:
        args, kwargs = self.calls[batch]
        args, kwargs = ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})
        measured: list[torch.Tensor] = []

        def grab(_module: nn.Module, inputs: tuple) -> None:
            measured.append(inputs[0])
            raise _Stop

        handle = None if self.measured is None else self.measured.register_forward_pre_hook(grab)
        try:
            with nullcontext() if linears is None else _computed_by(self.linears, linears):
                out = self.module(*args, **kwargs)
            measured.append(out[0] if isinstance(out, tuple) else out)
        except _Stop:
            pass
        finally:
            if handle is not None:
                handle.remove()
        return _real_rows(measured[0], self.masks[batch])


def measured_linear(adapter: ArchAdapter, group: ScalingGroup) -> str | None:
    """The linear whose input is the block output of an inspected group: the next sequential step's (None: the
    module's own output, for an MoE block, whose experts' down_proj each see only their routed tokens)."""
    if group.passengers:
        return None
    steps = adapter.sequential
    index = next(i for i, step in enumerate(steps) if group.linears[0] in step)
    name = steps[index + 1][0] if index + 1 < len(steps) else ""
    if not name.startswith(f"{group.inspect}."):
        raise QuantizationError(f"{adapter.name}: no linear inside {group.inspect!r} follows "
                                f"{group.linears}; QQQ measures the smoothing loss at its input")
    return name


def _module_probe(ctx: LayerContext, group: ScalingGroup, group_size: int,
                  loss_batches: int | None) -> SmoothingProbe:
    """Records the inspected module's calls (inputs, rotary embeddings, masks) up to its first linear."""
    calls: list[tuple[tuple, dict]] = []
    masks: list[torch.Tensor | None] = []

    def record(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        calls.append((args, kwargs))
        masks.append(ctx.current_mask)

    handle = ctx.module(group.inspect).register_forward_pre_hook(record, with_kwargs=True)
    try:
        ctx.run_until([group.linears[0]])
    finally:
        handle.remove()
    linears = [ctx.module(name) for name in group.linears]
    measured = measured_linear(ctx.adapter, group)
    block = ModuleBlock(ctx.module(group.inspect), None if measured is None else ctx.module(measured), linears,
                        calls, masks)
    inputs = [block.input_of(i) for i in range(len(calls))]
    return SmoothingProbe(inputs, masks, [lin.weight.data for lin in linears], block, group_size, loss_batches)


def _matmul_probe(ctx: LayerContext, group: ScalingGroup, group_size: int,
                  loss_batches: int | None) -> SmoothingProbe:
    first = group.linears[0]
    with ctx.capture_inputs([first]) as captured:
        ctx.run_until([first])
    return SmoothingProbe.for_matmul(captured[first], [ctx.module(n).weight.data for n in group.linears],
                                     group_size, loss_batches)


@register
class QQQ(Method):
    name = "qqq"

    def __init__(self, config: QuantConfig) -> None:
        overridden = {k: getattr(config, k) for k, v in REQUIRED_OPTIONS.items() if getattr(config, k) != v}
        if overridden:
            log.warning("QQQ is W4A8 with symmetric weights and act-order GPTQ: running with %s "
                        "instead of %s", REQUIRED_OPTIONS, overridden)
        for option, value in REQUIRED_OPTIONS.items():
            setattr(config, option, value)  # in place: the engine and the export read this config
        if config.mse:
            log.warning("QQQ's weight grids are min-max: --mse is ignored")
        super().__init__(config.validate())

    def linear_quantizer(self, linear: nn.Linear) -> LinearQuantizer:
        return QQQQuantizer(linear, self.config)

    def _loss_batches(self, ctx: LayerContext) -> int | None:
        """Batches holding the first config.smooth_samples calibration sequences (None: all)."""
        samples = self.config.smooth_samples
        return None if samples is None else -(-samples // ctx.inputs[0].shape[0])

    @torch.no_grad()
    def smooth_layer(self, ctx: LayerContext) -> dict:
        report = {}
        for group in active_scaling_groups(ctx.layer, ctx.adapter):
            make_probe = _module_probe if group.inspect else _matmul_probe
            probe = make_probe(ctx, group, self.config.group_size, self._loss_batches(ctx))
            if probe.tokens == 0:  # an MoE expert no calibration token was routed to
                log.warning("layer %d %s: QQQ smoothing skipped (no calibration tokens)", ctx.index, group.prev)
                report[group.prev] = {"skipped": "no calibration tokens"}
                continue
            choice = search_smoothing(probe, self.config.smooth_steps, self.config.smooth_search)
            if self.config.smooth_check:
                choice = confirm_after_gptq(probe, choice, self.config)
            fold_scales(ctx.layer, ctx.adapter, group, choice.scales)
            report[group.prev] = choice.summary()
        return report
