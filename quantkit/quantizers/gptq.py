"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", arXiv:2210.17323, Algorithm 1).

Columns of W [out, in] are quantized one at a time; the rounding error of column j is spread over the
columns not yet quantized so as to minimise the layer-output error ||W X - Q X||^2, using row j of U,
the upper Cholesky factor of the inverse (dampened) Hessian H = 2/n sum x x^T. Follows the reference
`GPTQ.fasterquant` (IST-DASLab/gptq, gptq.py) and GPTQModel (gptqmodel/quantization/gptq.py):
  * lazy batches: inside a block of `block_size` columns the updates are rank-1, the columns after the
    block get the block's accumulated errors in one matmul;
  * dead inputs (diag(H) == 0) get H_ii = 1 and a zero weight column;
  * act-order quantizes columns by decreasing diag(H) with *static* groups (GPTQModel's
    static_groups=True): group scales/zeros are computed up front from the dead-fixed, unpermuted,
    not yet error-updated W, exactly as both references do, so codes keep the original column order and
    g_idx = i // group_size;
  * without act-order, a group's scales/zeros are computed when its first column is reached, from the
    weights as updated by all the errors spread so far (see `_quantize_columns` for one deviation);
  * when the Cholesky factorisation fails the dampening is raised x10 (GPTQModel raises it in steps too)
    and, as a last resort, the layer is RTN-quantized; both are logged and recorded in `info`.

info["loss"] is the reference's sum over columns of (w - q)^2 / U_jj^2 / 2, which equals
1/2 tr((W - Q) H_damped (W - Q)^T): the mean over calibration tokens of ||(W - Q) x||^2, plus the damping
term (W with dead columns zeroed; a dead column's input is always 0).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

import torch
from torch import nn

from quantkit.config import QuantConfig, option
from quantkit.qtensor import QuantizationError, QuantizedWeight, check_group_size, quantize_codes
from quantkit.quantizers.base import LinearQuantizer, Method, register
from quantkit.quantizers.rtn import RTNOptions, check_finite_weights, find_qparams, layer_label, rtn_quantize

log = logging.getLogger("quantkit")

DAMP_GROWTH = 10.0
MAX_DAMP_ATTEMPTS = 4  # damp_percent x1, x10, x100, x1000 (0.01 -> up to 10 x mean(diag H))


@dataclass(frozen=True)
class GPTQOptions(RTNOptions):
    """GPTQ's options (RTN's grid options, which its fallback uses, included); QQQ extends these."""

    damp_percent: float = option(0.01, "relative dampening", flag="--damp")
    act_order: bool = option(True, "act-order with static groups (no inference cost)",
                             flag="--act-order/--no-act-order")
    block_size: int = option(128, "columns per lazy-batch block", minimum=1)

    def check(self) -> None:
        if not 0 < self.damp_percent < 1:
            raise QuantizationError(f"damp_percent must be in (0, 1), got {self.damp_percent} (--damp)")

    def label(self) -> str:
        return " act-order" if self.act_order else ""


class WeightGrid(Protocol):
    """A grid other than GPTQ's own (QQQ's): group parameters fixed up front, codes in [lowest, highest]."""

    lowest: int
    highest: int

    def qparams(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """w [rows, groups, group] (dead inputs zeroed) -> scale, zero [rows, groups]."""
        ...


PERMUTE_ROWS = 256


def permute_symmetric(matrix: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """matrix[order][:, order] as one new [n, n] buffer: the columns are permuted in place, a band of rows at a
    time, so a Hessian is never held three times (the caller's, the row-permuted, the fully permuted)."""
    permuted = matrix[order]
    for start in range(0, permuted.shape[0], PERMUTE_ROWS):
        band = permuted[start : start + PERMUTE_ROWS]
        band.copy_(band[:, order])
    return permuted


def _cholesky_in_place(matrix: torch.Tensor, upper: bool = False) -> bool:
    """Factor `matrix` into its own storage (LAPACK's potrf works in place; no second [in, in] buffer).
    False when it is not positive definite (the matrix then holds a partial factor)."""
    info = torch.empty((), dtype=torch.int32, device=matrix.device)
    torch.linalg.cholesky_ex(matrix, upper=upper, out=(matrix, info))
    return info.item() == 0


def inverse_hessian_factor(
    working_hessian: Callable[[], torch.Tensor], damp_percent: float, label: str
) -> tuple[torch.Tensor | None, float]:
    """Upper Cholesky factor U of (H + damp * mean(diag H) * I)^-1 (so U^T U is that inverse).

    `working_hessian()` gives a fresh copy of H for each try, which is damped, factored, inverted and factored
    again in place: one [in, in] buffer beside the caller's H, the peak of a streamed run on a CPU. Retries with
    x10 damping while either factorisation fails; returns (None, last damping tried) when none succeeds.
    """
    for attempt in range(MAX_DAMP_ATTEMPTS):
        damp = damp_percent * DAMP_GROWTH**attempt
        work = working_hessian()
        work.diagonal().add_(damp * work.diagonal().mean())
        if _cholesky_in_place(work) and _cholesky_in_place(torch.cholesky_inverse(work, out=work), upper=True):
            return work, damp
        del work
        retry = attempt + 1 < MAX_DAMP_ATTEMPTS
        log.warning(
            "GPTQ: the Hessian of %s is not positive definite with damp_percent=%g%s",
            label,
            damp,
            f"; retrying with damp_percent={damp * DAMP_GROWTH:g}" if retry else "",
        )
    return None, damp


@dataclass
class _Block:
    """The tensors one block of n columns reads and writes; a CUDA-graph replay reuses exactly these."""

    weights: torch.Tensor  # [rows, n] current weights, updated in place by the column loop
    hinv: torch.Tensor  # [n, n] the block's square of U
    scales: torch.Tensor  # [rows, n] per column: given when static, found at each group start otherwise
    zeros: torch.Tensor
    codes: torch.Tensor  # [rows, n] out
    errors: torch.Tensor  # [rows, n] out: (w - q) / U_jj, what the reference spreads over later columns


def _quantize_block(
    b: _Block, dynamic_group: int | None, config: QuantConfig, code_range: tuple[int, int]
) -> None:
    """The reference's inner loop: quantize column i, spread its error over the block's later columns."""
    for i in range(b.weights.shape[1]):
        if dynamic_group is not None and i % dynamic_group == 0:
            scale, zero = find_qparams(b.weights[:, i : i + dynamic_group], config.bits, config.sym,
                                       config.options_as(RTNOptions).mse, config.scale_torch_dtype)
            b.scales[:, i : i + dynamic_group] = scale.unsqueeze(1)
            b.zeros[:, i : i + dynamic_group] = zero.unsqueeze(1)
        w, scale, zero = b.weights[:, i], b.scales[:, i], b.zeros[:, i]
        q = quantize_codes(w, scale, zero, config.bits).clamp_(*code_range)
        b.codes[:, i] = q
        b.errors[:, i] = (w - (q - zero) * scale) / b.hinv[i, i]
        b.weights[:, i + 1 :].addr_(b.errors[:, i], b.hinv[i, i + 1 :], alpha=-1)


class _BlockLoop:
    """Runs _quantize_block on blocks of one width. On CUDA the second block captures the column loop as
    a CUDA graph and later blocks replay it: the loop is ~10 tiny kernels per column, so Python and launch
    overhead would otherwise dominate (the first block runs eagerly on a side stream: graph warm-up)."""

    def __init__(
        self, like: torch.Tensor, n: int, dynamic_group: int | None, config: QuantConfig,
        code_range: tuple[int, int],
    ) -> None:
        rows = like.shape[0]
        self.b = _Block(*(like.new_empty(shape) for shape in [(rows, n), (n, n)] + [(rows, n)] * 4))
        self.dynamic_group, self.config, self.code_range = dynamic_group, config, code_range
        self.graph: torch.cuda.CUDAGraph | None = None
        self.warm = False

    def run(
        self, weights: torch.Tensor, hinv: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
    ) -> _Block:
        b = self.b
        b.weights.copy_(weights)
        b.hinv.copy_(hinv)
        if self.dynamic_group is None:
            b.scales.copy_(scales)
            b.zeros.copy_(zeros)
        if b.weights.is_cuda:
            with torch.cuda.device(b.weights.device):  # graphs and streams belong to the current device
                self._run_cuda()
        else:
            _quantize_block(b, self.dynamic_group, self.config, self.code_range)
        return b

    def _run_cuda(self) -> None:
        if not self.warm:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                _quantize_block(self.b, self.dynamic_group, self.config, self.code_range)
            torch.cuda.current_stream().wait_stream(side)
            self.warm = True
            return
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                _quantize_block(self.b, self.dynamic_group, self.config, self.code_range)
        self.graph.replay()


def _quantize_columns(
    W: torch.Tensor,
    U: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    column_groups: torch.Tensor,
    dynamic_group: int | None,
    config: QuantConfig,
    code_range: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's lazy-batch loop. W [rows, cols] (processing order) is overwritten.

    column_groups[j]: the group of the j-th processed column. dynamic_group: the group size when group
    parameters are computed on reaching a group's first column (written into scales/zeros), None when
    they are all given. Returns uint8 codes in processing order and the loss of each row.

    Deviation from the references: they compute a dynamic group's parameters from the block-level W,
    which for a group starting inside a block misses the in-block updates of the columns before it.
    Here blocks hold whole groups and the parameters come from the fully updated in-block weights, so
    the result does not depend on block_size (it equals the column-by-column algorithm).
    """
    rows, cols = W.shape
    block = config.options_as(GPTQOptions).block_size
    if dynamic_group is not None:
        block = max(dynamic_group, block - block % dynamic_group)
    loops = {
        n: _BlockLoop(W, n, dynamic_group, config, code_range) for n in {min(block, cols), cols % block} if n
    }
    codes = torch.empty(rows, cols, dtype=torch.uint8, device=W.device)
    row_loss = W.new_zeros(rows)
    for start in range(0, cols, block):
        end = min(start + block, cols)
        groups = column_groups[start:end]
        b = loops[end - start].run(
            W[:, start:end], U[start:end, start:end], scales[:, groups], zeros[:, groups]
        )
        if dynamic_group is not None:
            scales[:, groups[::dynamic_group]] = b.scales[:, ::dynamic_group]
            zeros[:, groups[::dynamic_group]] = b.zeros[:, ::dynamic_group]
        codes[:, start:end] = b.codes
        row_loss += b.errors.square().sum(1) / 2
        W[:, end:].addmm_(b.errors, U[start:end, end:], alpha=-1)
    return codes, row_loss


def _rtn_fallback(
    weight: torch.Tensor,
    hessian: torch.Tensor | None,
    config: QuantConfig,
    reason: str,
    grid: WeightGrid | None = None,
    **info: object,
) -> QuantizedWeight:
    """RTN-quantize the layer; info["loss"] is then the same objective with the undamped Hessian."""
    log.warning("GPTQ: %s for %s; falling back to RTN", reason, layer_label(weight))
    if grid is None:
        result = rtn_quantize(weight, config.bits, config.group_size, config.sym, config.options_as(RTNOptions).mse,
                              config.scale_torch_dtype)
    else:  # with an identity Hessian no error is spread: GPTQ is RTN on the grid
        result = gptq_quantize(weight, torch.eye(weight.shape[1], device=weight.device), config, grid)
    loss = math.nan
    if hessian is not None:
        delta = weight.detach().to(torch.float32) - result.dequantize()
        loss = float(((delta @ hessian.to(delta)) * delta).sum() / 2)
    result.info.update(info, loss=loss, fallback="rtn", fallback_reason=reason)
    return result


def gptq_quantize(
    weight: torch.Tensor, hessian: torch.Tensor, config: QuantConfig, grid: WeightGrid | None = None
) -> QuantizedWeight:
    """GPTQ-quantize weight [out, in] (untouched) given H [in, in], on weight's device.

    The math runs in fp32 (fp64 for a float64 weight, which the reference tests use to compare exactly).
    `grid` replaces the min-max grid of config.bits/sym/mse; its parameters are static, as with act-order.
    """
    return gptq_quantize_rows([weight], hessian, config, grid)[0]


def gptq_quantize_rows(
    weights: list[torch.Tensor], hessian: torch.Tensor, config: QuantConfig, grid: WeightGrid | None = None
) -> list[QuantizedWeight]:
    """GPTQ of weights [out_i, in] that read one input (H [in, in]) as one solve of their stacked rows.

    Rows are independent given H (a column's error is spread along its own row), so each result is what
    gptq_quantize gives that weight alone, from one factorisation and one column loop instead of one each: on a
    GPU the loop's kernel launches, not its arithmetic, are what a small weight (an MoE expert's) costs.
    """
    options = config.options_as(GPTQOptions)
    dtype = torch.promote_types(weights[0].dtype, torch.float32)
    sizes = [w.shape[0] for w in weights]
    W = weights[0].new_empty(sum(sizes), weights[0].shape[1], dtype=dtype)
    for part, weight in zip(W.split(sizes), weights, strict=True):
        part.copy_(weight.detach())
    rows, cols = W.shape
    group = check_group_size(cols, config.group_size)
    diagonal = hessian.diagonal().to(W.device, dtype)
    dead = diagonal == 0
    W[:, dead] = 0

    # Per-channel parameters are static in the reference as well (found once, before any update).
    static = options.act_order or group == cols or grid is not None
    if grid is not None:
        scales, zeros = grid.qparams(W.view(rows, cols // group, group))
    elif static:
        scales, zeros = find_qparams(W.view(rows, cols // group, group), config.bits, config.sym, options.mse,
                                     config.scale_torch_dtype)
    else:
        scales, zeros = W.new_empty(rows, cols // group), W.new_empty(rows, cols // group)
    channel_scales = getattr(grid, "channel_scales", None)  # a two-level grid's (QQQ), set by its qparams
    order = torch.arange(cols, device=W.device)
    if options.act_order:
        order = torch.argsort(diagonal.masked_fill(dead, 1), descending=True, stable=True)
        W = W[:, order]

    def working_hessian() -> torch.Tensor:
        """A copy of H in the work dtype, act-order applied, dead inputs' diagonal set to 1."""
        if options.act_order:
            H = permute_symmetric(hessian.to(W.device, dtype), order)
        else:
            H = hessian.to(W.device, dtype, copy=True)
        H.diagonal()[dead[order]] = 1  # order is the identity without act-order
        return H

    U, damp_percent = inverse_hessian_factor(working_hessian, options.damp_percent, layer_label(weights[0]))
    if U is None:
        return [_rtn_fallback(w, hessian, config, "Cholesky failed at every damping", grid, damp_percent=damp_percent)
                for w in weights]
    column_groups = order // group
    code_range = (0, 2**config.bits - 1) if grid is None else (grid.lowest, grid.highest)
    codes, row_loss = _quantize_columns(
        W, U, scales, zeros, column_groups, None if static else group, config, code_range
    )
    if options.act_order:
        codes = codes[:, torch.argsort(order)]
    results = []
    bounds = list(accumulate(sizes, initial=0))
    for weight, first, end, loss in zip(weights, bounds, bounds[1:], row_loss.split(sizes), strict=False):
        loss = loss.sum().item()
        if not math.isfinite(loss):
            results.append(_rtn_fallback(weight, hessian, config, "GPTQ produced a non-finite loss", grid,
                                         damp_percent=damp_percent))
            continue
        rows_of = slice(first, end)
        results.append(QuantizedWeight(
            codes=codes[rows_of],
            scales=scales[rows_of].to(torch.float32),  # fp16-rounded by compute_qparams: exact in fp32
            zeros=zeros[rows_of].to(torch.uint8),
            bits=config.bits,
            group_size=config.group_size,
            sym=config.sym,
            channel_scales=None if channel_scales is None else channel_scales[rows_of].to(torch.float32),
            info={"loss": loss, "damp_percent": damp_percent},
        ))
    return results


@contextmanager
def _tf32_matmul(enabled: bool) -> Iterator[None]:
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled or previous
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


class GPTQQuantizer(LinearQuantizer):
    def __init__(self, linear: nn.Linear, config: QuantConfig) -> None:
        super().__init__(linear, config)
        self.H: torch.Tensor | None = None  # fp32 [in, in] on the device of the activations
        self.grid: WeightGrid | None = None  # None: GPTQ's min-max grid (QQQ sets its own)
        self.nsamples = 0

    def add_batch(self, x: torch.Tensor) -> None:
        tokens = x.shape[0]
        if tokens == 0:  # e.g. an MoE expert no token was routed to
            return
        half_input = x.dtype in (torch.float16, torch.bfloat16)
        x = x.to(torch.float32)
        if self.H is None:
            self.H = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
        total = self.nsamples + tokens
        # Running mean of 2 x x^T over tokens (reference add_batch; GPTQModel's single addmm_ form).
        # fp16/bf16 inputs have at most TF32's 10-bit mantissa, so TF32 tensor cores multiply them
        # exactly (fp32 accumulation): ~8x the fp32 rate on the down_proj Hessian, same numbers.
        with _tf32_matmul(half_input and x.is_cuda):
            self.H.addmm_(x.T, x, beta=self.nsamples / total, alpha=2 / total)
        self.nsamples = total

    def quantize(self) -> QuantizedWeight:
        return self.quantize_with([])[0]

    def quantize_with(self, sharers: list[LinearQuantizer]) -> list[QuantizedWeight]:
        """One solve for this linear and those that took its Hessian (gptq_quantize_rows)."""
        if not all(type(s) is type(self) and s.config == self.config and s.H is self.H for s in sharers):
            return super().quantize_with(sharers)
        weights = [q.linear.weight for q in (self, *sharers)]
        for weight in weights:
            check_finite_weights(weight)
        if self.H is None:
            return [_rtn_fallback(w, None, self.config, "no calibration tokens reached this layer", self.grid,
                                  nsamples=0) for w in weights]
        if not torch.isfinite(self.H).all():
            raise QuantizationError(
                f"the calibration inputs of {layer_label(weights[0])} contain NaN/Inf; "
                "the model overflows in its dtype on the calibration data (try a float32 or bfloat16 load)"
            )
        results = gptq_quantize_rows(weights, self.H, self.config, self.grid)
        for result in results:
            result.info["nsamples"] = self.nsamples
        return results

    def free(self) -> None:
        self.H = None
        self.nsamples = 0

    def shares_statistics_with(self, owner: LinearQuantizer) -> bool:
        return isinstance(owner, GPTQQuantizer) and owner.linear.in_features == self.linear.in_features

    def take_statistics(self, owner: LinearQuantizer) -> None:
        assert isinstance(owner, GPTQQuantizer)
        self.H, self.nsamples = owner.H, owner.nsamples  # the same tensor: nothing writes to H after statistics


@register
class GPTQ(Method):
    name = "gptq"
    options_class = GPTQOptions

    def linear_quantizer(self, linear: nn.Linear) -> LinearQuantizer:
        return GPTQQuantizer(linear, self.config)
