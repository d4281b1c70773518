"""AWQ, activation-aware weight quantization (Lin et al., 2023, arXiv:2306.00978).

Per decoder layer, before any linear is quantized (Method.smooth_layer):

1. Scale search, for each scaling group of the architecture adapter (input norm -> q/k/v, v -> o
   without grouped-query attention, post-attention norm -> gate/up, up -> down; OPT alike):
   x̄ = mean |x| per input channel of the group's linears over the calibration tokens; for
   r = 0, 1/20, ..., 19/20, s = x̄^r (duo scaling: x̄^r / w̄^(1-r), w̄ the mean |W| normalised by each
   quantization group's max), normalised by sqrt(max s * min s). The loss of r is the MSE of the
   inspected block's output (attention, MLP, or the linears themselves) when the linears hold
   Q(W s) / s instead of W, on the same inputs. By default ("refine") every 4th ratio is scored, then
   the two neighbours at half the step around the best so far down to single steps: 9 of 20 ratios,
   exactly the full grid's minimum where the loss is unimodal in r (`--awq-search grid` scores all 20).
   s = 1 is always a candidate (duo scaling's grid does not hold it): a group whose best ratio does not
   score strictly below it stays unscaled, so the search never ends worse than no scaling on its own
   objective. The best s is folded (quantkit.smoothing): prev's outputs / s and the linears' input
   columns * s, which leaves the layer's function unchanged.
2. Clip search on every linear but q and k (their errors meet in the q·k product, which a per-linear
   output error does not see): per quantization group, the max |w| shrunk by 5% steps down to 0.55
   that minimises the group's partial-output MSE on ~512 sampled tokens (no clip is the first step).
   The groups' errors add up to a row's whole output error only on average, so a row whose chosen clips
   raise that error on the same tokens keeps every group unclipped. The weights are clamped to the
   result, so the min-max RTN that follows sees exactly the searched range.
3. Every linear is quantized by RTN, as `rtn` does. The engine's guard (quantkit.layer_guard) then
   compares the layer's output error with plain RTN's and keeps the lower.

Q in both searches is that same RTN (rtn_fake_quantize, rtn_quantize's values: min-max grid containing zero, fp16-rounded
scales), so the searched losses are those of the weights that are exported.

Follows AutoAWQ (awq/quantize/quantizer.py: _search_best_scale, _compute_best_scale,
_search_best_clip, _compute_best_clip) and llm-compressor's AWQModifier (modifiers/awq/base.py:
_compute_best_scale; the same grid and scale formula, no clip search). Differences: padding tokens never
enter the statistics or the losses; x̄ stays in fp32 (AutoAWQ casts it back to fp16); s = 1 is always
scored, and the ratio search refines instead of scoring every ratio; groups without an inspected block
compute their output error directly as X (Q(W s)/s - W)^T; clip errors come from per-group batched matrix
products instead of a broadcast [out, tokens, groups, group] product, and a clip is checked against the
whole row; a ratio with a non-finite loss is passed over and a group with non-finite activations, or none
at all, keeps s = 1 (AutoAWQ raises).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from quantkit.config import QuantConfig, option
from quantkit.models.adapters import ScalingGroup
from quantkit.qtensor import QuantizationError, check_group_size
from quantkit.quantizers.base import LinearQuantizer, Method, register
from quantkit.quantizers.context import LayerContext, first_output
from quantkit.quantizers.rtn import RTNOptions, RTNQuantizer, rtn_fake_quantize
from quantkit.smoothing import active_scaling_groups, fold_scales

log = logging.getLogger("quantkit")

SCALE_FLOOR = 1e-4  # AutoAWQ clamps x̄^r (and adds to w̄^(1-r)) here, so dead channels keep a scale
WEIGHT_EPS = 1e-6  # AutoAWQ's guard when normalising |W| by its group max
# AutoAWQ's clip grid: n_grid 20, max_shrink 0.5, i.e. maxima 1.0, 0.95, ..., 0.55 of the group's |w| max.
CLIP_GRID = 20
CLIP_STEPS = 10
CLIP_TOKENS = 512  # AutoAWQ n_sample_token: every (tokens // 512)-th token
CLIP_ELEMENTS = 2**26  # bound on one output-channel batch's temporaries in the clip search
UNCLIPPED = ("q_proj", "k_proj")
# Tokens each scale candidate is scored on (the first whole batches; the mean |x| still comes from every token). Each
# candidate reruns the inspected block on them, so the search's time grows with them. AutoAWQ scores on all of its
# 128 x 512. 8192 took AWQ on a Qwen2-0.5B layer (32 x 512 tokens, one thread) from 2.5x GPTQ's CPU time to 1.7x,
# and Gemma-3 AWQ (32 x 512) from 899 s to 607 s at the same held-out NLL (benchmarks/accuracy/VS_LLMCOMPRESSOR.md).
SEARCH_TOKENS = 8192
TrialWeight = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (W, candidate s) -> quantized W s, / s


@dataclass(frozen=True)
class AWQOptions(RTNOptions):
    """AWQ's searches; the linears are then RTN-quantized with RTN's options."""

    grid: int = option(20, "scale ratios searched (0, 1/grid, ...)", flag="--awq-grid", legacy="awq_grid",
                       minimum=1)
    duo_scaling: bool = option(True, "s = mean|x|^r / mean|w|^(1-r) (off: mean|x|^r)",
                               flag="--duo-scaling/--no-duo-scaling", legacy="awq_duo_scaling")
    clip: bool = option(True, "search clipping ranges", flag="--clip/--no-clip", legacy="awq_clip")
    search: str = option("refine", "ratios scored: every one (grid), or every 4th then halving steps around the best "
                         "(refine)", flag="--awq-search", choices=("refine", "grid"))
    search_tokens: int = option(SEARCH_TOKENS, "calibration tokens each scale candidate is scored on (whole "
                                "batches, at least one; 0: all)", flag="--awq-search-tokens", minimum=0)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """At least fp32 arithmetic (bf16 models), float64 kept: the same rule as fold_scales."""
    return torch.promote_types(dtype, torch.float32)


def grid_scales(x_mean: torch.Tensor, w_mean: torch.Tensor | None, grid: int) -> torch.Tensor:
    """Candidate scales [grid, channels] for the ratios 0, 1/grid, ..., (grid-1)/grid."""
    ratios = torch.arange(grid, dtype=x_mean.dtype, device=x_mean.device)[:, None] / grid
    scales = x_mean[None].pow(ratios)
    if w_mean is not None:  # duo scaling
        scales = scales / (w_mean[None].pow(1 - ratios) + SCALE_FLOOR)
    scales = scales.clamp(min=SCALE_FLOOR)
    scales = scales / (scales.amax(1, keepdim=True) * scales.amin(1, keepdim=True)).sqrt()
    return torch.where(torch.isfinite(scales), scales, torch.ones_like(scales))


def weight_mean(weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """Per input channel: the mean over all output rows of |W| divided by its group's max |w|."""
    total, rows = None, 0
    for weight in weights:
        out_features, in_features = weight.shape
        group = check_group_size(in_features, group_size)
        grouped = weight.to(_wide(weight.dtype)).abs().reshape(out_features, -1, group)
        normalised = grouped / (grouped.amax(-1, keepdim=True) + WEIGHT_EPS)
        column_sum = normalised.reshape(out_features, in_features).sum(0)
        total = column_sum if total is None else total + column_sum
        rows += out_features
    return total / rows


def scaled_fake_quant(weight: torch.Tensor, scales: torch.Tensor, config: QuantConfig) -> torch.Tensor:
    """Q(W s) / s in W's dtype: what the linear computes once s is folded into it and it is quantized."""
    wide = _wide(weight.dtype)
    scaled = (weight.to(wide) * scales).to(weight.dtype)  # as fold_scales stores it
    mse = config.options_as(RTNOptions).mse
    deq = rtn_fake_quantize(scaled, config.bits, config.group_size, config.sym, mse, config.scale_torch_dtype).to(wide)
    return (deq / scales).to(weight.dtype)


@dataclass
class _GroupData:
    """One capture pass for a scaling group: x̄'s sum over every batch (every rank's), and what its loss needs of
    this rank's batches among the run's first `scored_batches`, per batch of this rank (empty when not scored)."""

    scored_batches: int
    abs_sum: torch.Tensor | None = None
    tokens: int = 0
    scored_tokens: int = 0
    inputs: list[list[torch.Tensor]] = field(default_factory=list)  # no inspected block: the linears' input
    calls: list[list[tuple[tuple, dict]]] = field(default_factory=list)  # the inspected block's calls
    outputs: list[list[torch.Tensor]] = field(default_factory=list)  # its unquantized outputs, real tokens


def scored_batch_count(token_counts: list[int], search_tokens: int) -> int:
    """How many leading batches hold at most search_tokens real tokens (at least one; 0 tokens: all)."""
    if search_tokens == 0:
        return len(token_counts)
    total = 0
    for count, tokens in enumerate(token_counts):
        total += tokens
        if total > search_tokens:
            return max(count, 1)
    return len(token_counts)


def batch_tokens(ctx: LayerContext) -> list[int]:
    """The real tokens of each of the run's batches (every rank's)."""
    return ctx.in_batch_order([int(mask.sum()) for mask in ctx.token_masks])


def _capture(ctx: LayerContext, group: ScalingGroup, search_tokens: int) -> _GroupData:
    data = _GroupData(scored_batches=scored_batch_count(batch_tokens(ctx), search_tokens))
    data.inputs, data.calls, data.outputs = ([[] for _ in ctx.inputs] for _ in range(3))
    sums: list[list[tuple[torch.Tensor, int]]] = [[] for _ in ctx.inputs]  # per batch: (sum of |x|, rows) per call

    def scored() -> bool:
        return ctx.batch_id(ctx.current_batch) < data.scored_batches

    def on_linear(_m, args, _out) -> None:
        x = ctx.real_tokens(args[0])
        sums[ctx.current_batch].append((ctx.portable(x.abs().sum(0, dtype=_wide(x.dtype))), x.shape[0]))
        if scored() and group.inspect is None:
            data.inputs[ctx.current_batch].append(x)

    def keep_call(_m, args, kwargs) -> None:
        if scored():
            data.calls[ctx.current_batch].append((args, kwargs))

    def keep_output(_m, _args, out) -> None:
        if scored():
            data.outputs[ctx.current_batch].append(ctx.real_tokens(first_output(out)))

    handles = [ctx.module(group.input_of).register_forward_hook(on_linear)]  # the group shares its input
    if group.inspect is not None:
        block = ctx.module(group.inspect)
        handles.append(block.register_forward_pre_hook(keep_call, with_kwargs=True))
        handles.append(block.register_forward_hook(keep_output))
    try:
        ctx.run_until([group.inspect or group.linears[0]])
    finally:
        for h in handles:
            h.remove()
    for batch, batch_sums in enumerate(ctx.in_batch_order(sums)):  # every rank's batches, in batch order
        for column_sum, rows in batch_sums:
            column_sum = column_sum.to(ctx.device)
            data.abs_sum = column_sum if data.abs_sum is None else data.abs_sum + column_sum
            data.tokens += rows
            data.scored_tokens += rows if batch < data.scored_batches else 0
    return data


def _real_index(ctx: LayerContext) -> list[torch.Tensor]:
    """Flat positions of each batch's real tokens: selecting by index needs no host sync per use."""
    return [mask.reshape(-1).nonzero().squeeze(1) for mask in ctx.token_masks]


def _floats(sums: list[list[list[torch.Tensor]]]) -> list[list[list[float]]]:
    """Nested per-batch lists of 0-d sums as Python floats, read from the device once (no sync per batch)."""
    flat = [t.to(torch.float64) for batch in sums for call in batch for t in call]
    values = iter(torch.stack(flat).tolist() if flat else [])
    return [[[next(values) for _ in call] for call in batch] for batch in sums]


def _block_errors(block: nn.Module, data: _GroupData, index: list[torch.Tensor]) -> list[list[tuple[float, int]]]:
    """Per batch of this rank, per scored call: the squared output error summed, and its element count."""
    sums = []
    for calls, references, rows in zip(data.calls, data.outputs, index, strict=True):
        sums.append([])
        for (args, kwargs), reference in zip(calls, references, strict=True):
            out = first_output(block(*args, **kwargs))
            out = out.reshape(-1, out.shape[-1]).index_select(0, rows)
            wide = _wide(out.dtype)
            sums[-1].append([(out.to(wide) - reference.to(wide)).pow(2).sum()])
    return [[(error, reference.numel()) for [error], reference in zip(batch, references, strict=True)]
            for batch, references in zip(_floats(sums), data.outputs, strict=True)]


def _linear_errors(inputs: list[list[torch.Tensor]], weights: list[torch.Tensor],
                   trials: list[torch.Tensor]) -> list[list[list[float]]]:
    """Per batch of this rank, per scored input, per weight: the squared output error X (W' - W)^T summed (the
    biases cancel, no reference output is kept)."""
    deltas = []
    for weight, trial in zip(weights, trials, strict=True):
        wide = _wide(weight.dtype)
        deltas.append(((trial.to(wide) - weight.to(wide)).to(weight.dtype), wide))
    return _floats([[[(x @ delta.T).to(wide).pow(2).sum() for delta, wide in deltas] for x in batch] for batch in inputs])


class _Scorer:
    """The group's output MSE of one candidate scale vector at a time; the layer's weights are restored on exit."""

    def __init__(self, ctx: LayerContext, group: ScalingGroup, data: _GroupData, trial_weight: TrialWeight) -> None:
        self.group, self.data, self.trial_weight = group, data, trial_weight
        self.linears = [ctx.module(n) for n in group.linears]
        self.weights = [lin.weight.detach().clone() for lin in self.linears]
        self.ctx = ctx
        if group.inspect is None:
            self.count = data.scored_tokens * sum(w.shape[0] for w in self.weights)
        else:
            self.block, self.index = ctx.module(group.inspect), _real_index(ctx)

    def __enter__(self) -> _Scorer:
        return self

    def __exit__(self, *_exc) -> None:
        for lin, weight in zip(self.linears, self.weights, strict=True):
            lin.weight.copy_(weight)

    def __call__(self, scales: torch.Tensor) -> float:
        """Every rank's scored batches' errors summed in batch order (one process's order: the weights outermost)."""
        trials = [self.trial_weight(w, scales) for w in self.weights]
        total = 0.0
        if self.group.inspect is None:
            batches = self.ctx.in_batch_order(_linear_errors(self.data.inputs, self.weights, trials))
            for w in range(len(self.weights)):
                for errors in (per_input[w] for batch in batches for per_input in batch):
                    total += errors
            return total / self.count
        for lin, trial in zip(self.linears, trials, strict=True):
            lin.weight.copy_(trial)
        count = 0
        for batch in self.ctx.in_batch_order(_block_errors(self.block, self.data, self.index)):
            for error, elements in batch:
                total += error
                count += elements
        return total / count


def search_order(grid: int, search: str, loss: Callable[[int], float]) -> dict[int, float]:
    """Losses of the grid indices scored: every one ("grid"), or ("refine") every step-th, step the largest power
    of two up to grid / 4, then the two neighbours at half the step around the best so far until the step is 1
    (grid 20: 9 of 20; exact where the loss is unimodal in the ratio)."""
    losses: dict[int, float] = {}

    def score(k: int) -> None:
        if 0 <= k < grid and k not in losses:
            losses[k] = loss(k)

    def best() -> int:
        return min(losses, key=lambda k: losses[k] if math.isfinite(losses[k]) else math.inf)

    step = 1
    while search == "refine" and step * 8 <= grid:
        step *= 2
    for k in range(0, grid, step):
        score(k)
    while step > 1:
        step //= 2
        center = best()
        score(center - step)
        score(center + step)
    return losses


def _finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None  # JSON has no NaN


@dataclass
class ScaleSearch:
    """The outcome of one group's scale search; scales None = left at s = 1 (see `skipped`)."""

    group: ScalingGroup
    tokens: int
    scored_tokens: int
    scales: torch.Tensor | None = None
    ratio: float | None = None
    losses: dict[int, float] = field(default_factory=dict)  # per scored grid index; NaN where non-finite
    rtn_loss: float | None = None  # s = 1
    loss: float | None = None  # of the scales kept: the best scored candidate or s = 1, whichever is lower
    skipped: str | None = None  # why the search did not run (s = 1)

    def report(self) -> dict:
        entry: dict = {"linears": list(self.group.linears), "tokens": self.tokens, "scored_tokens": self.scored_tokens}
        if self.skipped is not None:
            entry["skipped"] = self.skipped
        if self.losses:
            finite = [loss for loss in self.losses.values() if math.isfinite(loss)]
            entry.update(ratio=self.ratio, loss_rtn=_finite_or_none(self.rtn_loss), loss_awq=_finite_or_none(self.loss),
                         scored_ratios=len(self.losses), nonfinite_losses=len(self.losses) - len(finite))
        return entry


@torch.no_grad()
def search_scales(ctx: LayerContext, group: ScalingGroup, config: QuantConfig,
                  trial_weight: TrialWeight | None = None) -> ScaleSearch:
    """AutoAWQ's _search_best_scale for one scaling group of ctx's layer; the layer is left as it was.

    trial_weight(W, s): what a linear computes once s is folded and it is quantized; RTN's by default."""
    options = config.options_as(AWQOptions)
    data = _capture(ctx, group, options.search_tokens)
    result = ScaleSearch(group, data.tokens, data.scored_tokens)
    if data.scored_tokens == 0:  # e.g. an expert no scored token was routed to
        result.skipped = "no calibration tokens" + (" in the scored batches (--awq-search-tokens)" if data.tokens else "")
        return result
    x_mean = data.abs_sum / data.tokens  # fp32, or float64 for a float64 model
    if not torch.isfinite(x_mean).all():
        result.skipped = "non-finite activations"
        return result
    weights = [ctx.module(n).weight for n in group.linears]
    w_mean = weight_mean(weights, config.group_size) if options.duo_scaling else None
    candidates = grid_scales(x_mean, w_mean, options.grid)
    if trial_weight is None:
        trial_weight = partial(scaled_fake_quant, config=config)
    with _Scorer(ctx, group, data, trial_weight) as scorer:
        # s = 1 is always a candidate, so the search never ends worse than no scaling on its own objective; the
        # plain grid's ratio 0 is s = 1, duo scaling's grid does not contain it.
        result.losses = search_order(options.grid, options.search, lambda k: scorer(candidates[k]))
        result.rtn_loss = result.losses[0] if not options.duo_scaling else scorer(torch.ones_like(x_mean))
    scored = {k: loss for k, loss in result.losses.items() if math.isfinite(loss)}
    if not scored and not math.isfinite(result.rtn_loss):
        result.skipped = "non-finite losses"
        return result
    best = min(scored, key=scored.__getitem__, default=None)
    unscaled = result.rtn_loss if math.isfinite(result.rtn_loss) else math.inf
    if best is None or scored[best] >= unscaled:  # a tie keeps the layer as it is
        result.loss = result.rtn_loss
        return result
    result.ratio, result.scales, result.loss = best / options.grid, candidates[best], scored[best]
    return result


@dataclass
class ClipSearch:
    """Per (output channel, quantization group): the chosen max |w|, its shrink factor and errors."""

    max_abs: torch.Tensor
    shrink: torch.Tensor
    error: torch.Tensor
    unclipped_error: torch.Tensor
    kept_rows: int = 0  # rows whose per-group choices raised the row's whole output error: left unclipped

    def report(self) -> dict:
        unclipped = float(self.unclipped_error.sum())
        return {
            "shrunk_groups": float((self.shrink < 1).float().mean()),
            "mean_shrink": float(self.shrink.float().mean()),
            "error_ratio": float(self.error.sum()) / unclipped if unclipped > 0 else 1.0,
            "unclipped_rows": self.kept_rows,
        }


def _clamp(grouped: torch.Tensor, max_abs: torch.Tensor) -> torch.Tensor:
    return torch.clamp(grouped, -max_abs[..., None], max_abs[..., None])


def _group_outputs(x_grouped: torch.Tensor, w_grouped: torch.Tensor) -> torch.Tensor:
    """x [groups, tokens, size], w [rows, groups, size] -> partial outputs [groups, tokens, rows]."""
    return torch.bmm(x_grouped, w_grouped.permute(1, 2, 0))


def _row_errors(x: torch.Tensor, weight: torch.Tensor, deq: torch.Tensor) -> torch.Tensor:
    """Mean squared output error per row of the whole linear, every group at once: [rows]."""
    return (x @ (deq - weight).T).pow(2).mean(0)


@torch.no_grad()
def search_clip(weight: torch.Tensor, x: torch.Tensor, config: QuantConfig) -> ClipSearch:
    """AutoAWQ's _compute_best_clip: per group, the shrunk max minimising the mean squared partial output
    error over the tokens of x, in output-channel batches (the search is independent per row). The groups' errors
    add up to a row's only on average, so a row whose chosen clips raise its whole output error stays unclipped."""
    out_features, in_features = weight.shape
    group = check_group_size(in_features, config.group_size)
    n_groups, wide = in_features // group, _wide(weight.dtype)
    mse = config.options_as(RTNOptions).mse
    x_wide = x.to(wide)
    x_grouped = x_wide.reshape(-1, n_groups, group).transpose(0, 1)
    batch = max(1, CLIP_ELEMENTS // (x.shape[0] * n_groups + 4 * in_features))

    def quantized(w: torch.Tensor, max_abs: torch.Tensor) -> torch.Tensor:
        clipped = _clamp(w, max_abs).to(weight.dtype).reshape(-1, in_features)
        return rtn_fake_quantize(clipped, config.bits, group, config.sym, mse, config.scale_torch_dtype).to(wide)

    parts: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, out_features, batch):
        w = weight[start:start + batch].to(wide).reshape(-1, n_groups, group)
        reference = _group_outputs(x_grouped, w)
        amax = w.abs().amax(-1)
        best_err = torch.full_like(amax, torch.inf)
        best_shrink = torch.ones_like(amax)
        for step in range(CLIP_STEPS):
            shrink = 1 - step / CLIP_GRID
            deq = quantized(w, amax * shrink)
            err = (_group_outputs(x_grouped, deq.reshape(w.shape)) - reference).pow(2).mean(1).T  # [rows, groups]
            if step == 0:
                unclipped, unclipped_deq = err, deq
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_shrink = torch.where(better, torch.full_like(best_shrink, shrink), best_shrink)
        flat = w.reshape(-1, in_features)
        worse = _row_errors(x_wide, flat, quantized(w, amax * best_shrink)) > _row_errors(x_wide, flat, unclipped_deq)
        best_shrink[worse], best_err[worse] = 1.0, unclipped[worse]
        parts.append((amax * best_shrink, best_shrink, best_err, unclipped, worse))
    max_abs, shrink, error, unclipped_error, worse = (torch.cat(p) for p in zip(*parts, strict=True))
    return ClipSearch(max_abs, shrink, error, unclipped_error, int(worse.sum()))


@torch.no_grad()
def apply_clip(linear: nn.Linear, max_abs: torch.Tensor) -> None:
    """Clamp each quantization group of the weight to [-max, max], exactly as search_clip evaluated it."""
    weight = linear.weight
    grouped = weight.to(_wide(weight.dtype)).reshape(weight.shape[0], max_abs.shape[1], -1)
    weight.copy_(_clamp(grouped, max_abs).reshape(weight.shape))


def clip_targets(ctx: LayerContext) -> list[str]:
    modules = dict(ctx.layer.named_modules())
    return [n for n in ctx.adapter.linear_names()
            if isinstance(modules.get(n), nn.Linear) and n.rsplit(".", 1)[-1] not in UNCLIPPED]


def _sample_inputs(ctx: LayerContext, names: list[str]) -> dict[str, torch.Tensor]:
    """Every stride-th real token entering each named linear, stride = tokens // CLIP_TOKENS (AutoAWQ), counted
    over every rank's batches in batch order (a step of the batches at a time: a batch's first sampled row
    depends on the rows before it). The hook samples a call's rows as they enter where the rows before them are
    known (one process; the first rank of a split step); a later rank of a step keeps its batch's inputs until
    the step's row counts are gathered."""
    stride = max(1, sum(batch_tokens(ctx)) // CLIP_TOKENS)
    known = ctx.place_in_step == 0  # no rank's batch comes before this rank's in a step
    seen = dict.fromkeys(names, 0)  # rows that entered each linear in the steps before
    entered: dict[str, list[int]] = {}  # rows per call of this rank's batch of the step
    waiting: dict[str, list[torch.Tensor]] = {}  # that batch's real-token inputs, where not sampled in the hook
    kept: list[dict[str, list[torch.Tensor]]] = []  # per batch of this rank

    def sample(name: str, rows: torch.Tensor, offset: int) -> None:
        kept[-1].setdefault(name, []).append(ctx.portable(rows[(-offset) % stride::stride].clone()))

    def enter(name: str, x: torch.Tensor) -> None:
        rows = ctx.real_tokens(x)
        if known:
            sample(name, rows, seen[name] + sum(entered[name]))
        else:
            waiting[name].append(rows)
        entered[name].append(rows.shape[0])

    handles = [ctx.module(n).register_forward_hook(lambda _m, args, _o, n=n: enter(n, args[0])) for n in names]
    try:
        for position in ctx.stepwise():
            entered.update({n: [] for n in names})
            waiting.update({n: [] for n in names})
            if position is not None:
                kept.append({})
                ctx.run_until(names, [position])
            counts = ctx.step_values(None if position is None else dict(entered))
            for name in names:
                offset = seen[name] + sum(sum(c[name]) for c in counts[:ctx.place_in_step] if c is not None)
                for rows in waiting[name]:
                    sample(name, rows, offset)
                    offset += rows.shape[0]
                seen[name] += sum(sum(c[name]) for c in counts if c is not None)
    finally:
        for h in handles:
            h.remove()
    batches = ctx.in_batch_order(kept)
    return {n: torch.cat([x.to(ctx.device) for batch in batches for x in batch.get(n, [])]) for n in names}


def clip_layer(ctx: LayerContext, config: QuantConfig) -> dict:
    """Search and apply the clipping of every linear but q/k, on inputs after the scales were folded."""
    names = clip_targets(ctx)
    report = {}
    for name, x in _sample_inputs(ctx, names).items():
        reason = "no calibration tokens" if x.shape[0] == 0 else None
        if reason is None and not torch.isfinite(x).all():
            reason = "non-finite activations"
        if reason is not None:
            report[name] = {"skipped": reason}
            log.warning("layer %d %s: AWQ clip skipped (%s)", ctx.index, name, reason)
            continue
        linear = ctx.module(name)
        result = search_clip(linear.weight, x, config)
        apply_clip(linear, result.max_abs)
        report[name] = result.report()
    return report


@register
class AWQ(Method):
    name = "awq"
    needs_activations = False  # every statistic is used in smooth_layer; the linears get plain RTN
    options_class = AWQOptions
    smoothing_splits_batches = True

    def linear_quantizer(self, linear: nn.Linear) -> LinearQuantizer:
        return RTNQuantizer(linear, self.config)

    def trial_weight(self, ctx: LayerContext, group: ScalingGroup) -> TrialWeight | None:
        """How the scale search quantizes a candidate (None: RTN, AWQ's own); subclasses quantize otherwise."""
        return None

    def search_group(self, ctx: LayerContext, group: ScalingGroup) -> ScaleSearch:
        """One scaling group's scale search, the layer left as it was; subclasses score candidates otherwise."""
        return search_scales(ctx, group, self.config, self.trial_weight(ctx, group))

    def smooth_layer(self, ctx: LayerContext) -> dict:
        try:
            return self._smooth(ctx)
        except QuantizationError as err:
            raise QuantizationError(f"layer {ctx.index}: AWQ: {err}") from err

    def _smooth(self, ctx: LayerContext) -> dict:
        scales, skipped, unscaled = {}, 0, 0
        for group in active_scaling_groups(ctx.layer, ctx.adapter):
            result = self.search_group(ctx, group)
            if result.skipped is not None:
                skipped += 1
                log.warning("layer %d %s: AWQ scale left at 1 (%s)", ctx.index, group.prev, result.skipped)
            elif result.scales is None:
                unscaled += 1
                log.debug("layer %d %s: no scale scored below s = 1; left unscaled", ctx.index, group.prev)
            else:
                fold_scales(ctx.layer, ctx.adapter, group, result.scales)
            scales[group.prev] = result.report()
        report: dict = {"scales": scales, "skipped_groups": skipped, "unscaled_groups": unscaled}
        if self.config.options_as(AWQOptions).clip:
            report["clip"] = clip_layer(ctx, self.config)
        return report
