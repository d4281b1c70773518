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
from dataclasses import dataclass, replace
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
LOW_TOKEN_DAMP_GROWTH = 10.0  # an MoE expert's Hessian from fewer tokens than its width (few_tokens)
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


def _cholesky_in_place(matrices: torch.Tensor, upper: bool = False) -> torch.Tensor:
    """Factor each [n, n] matrix of `matrices` [E, n, n] into its own storage (LAPACK's potrf works in place: no
    second buffer). Returns which succeeded [E] (a matrix that is not positive definite holds a partial factor)."""
    info = torch.empty(matrices.shape[0], dtype=torch.int32, device=matrices.device)
    torch.linalg.cholesky_ex(matrices, upper=upper, out=(matrices, info))
    return info == 0


def inverse_hessian_factors(
    working_hessians: Callable[[list[int]], torch.Tensor], count: int, damp_percent: float, labels: list[str]
) -> tuple[torch.Tensor, list[float], list[bool]]:
    """Upper Cholesky factors U of (H_e + damp * mean(diag H_e) * I)^-1 (so U^T U is that inverse), e < count.

    `working_hessians(members)` gives fresh copies [len(members), n, n] of those H_e for each try, which are damped,
    factored, inverted and factored again in place. Those whose factorisation fails are retried with x10 damping;
    returns U [count, n, n] (the identity where every try failed), the damping each ended with, and whether it was
    factored at all.
    """
    damps, factored = [damp_percent] * count, [False] * count
    members, U = list(range(count)), None
    for attempt in range(MAX_DAMP_ATTEMPTS):
        damp = damp_percent * DAMP_GROWTH**attempt
        work = working_hessians(members)
        diagonals = work.diagonal(dim1=-2, dim2=-1)
        diagonals.add_(damp * diagonals.mean(-1, keepdim=True))
        ok = _cholesky_in_place(work)
        ok &= _cholesky_in_place(torch.cholesky_inverse(work, out=work), upper=True)
        ok = ok.tolist()
        if U is None:
            U = work  # the first try's buffer: no copy when every factor succeeds, as is usual
        else:
            for k, e in enumerate(members):
                if ok[k]:
                    U[e] = work[k]
        for k, e in enumerate(members):
            damps[e], factored[e] = damp, ok[k]
            if not ok[k]:
                U[e] = torch.eye(U.shape[-1], dtype=U.dtype, device=U.device)
                retry = attempt + 1 < MAX_DAMP_ATTEMPTS
                log.warning("GPTQ: the Hessian of %s is not positive definite with damp_percent=%g%s", labels[e],
                            damp, f"; retrying with damp_percent={damp * DAMP_GROWTH:g}" if retry else "")
        members = [e for k, e in enumerate(members) if not ok[k]]
        del work
        if not members:
            break
    assert U is not None
    return U, damps, factored


@dataclass
class _Block:
    """The tensors one block of n columns reads and writes, for E problems side by side; a CUDA-graph replay
    reuses exactly these."""

    weights: torch.Tensor  # [E, rows, n] current weights, updated in place by the column loop
    hinv: torch.Tensor  # [E, n, n] the block's square of U
    scales: torch.Tensor  # [E, rows, n] per column: given when static, found at each group start otherwise
    zeros: torch.Tensor
    codes: torch.Tensor  # [E, rows, n] out
    errors: torch.Tensor  # [E, rows, n] out: (w - q) / U_jj, what the reference spreads over later columns


def _quantize_block(
    b: _Block, dynamic_group: int | None, config: QuantConfig, code_range: tuple[int, int]
) -> None:
    """The reference's inner loop: quantize column i, spread its error over the block's later columns."""
    for i in range(b.weights.shape[-1]):
        if dynamic_group is not None and i % dynamic_group == 0:
            scale, zero = find_qparams(b.weights[..., i : i + dynamic_group], config.bits, config.sym,
                                       config.options_as(RTNOptions).mse, config.scale_torch_dtype)
            b.scales[..., i : i + dynamic_group] = scale.unsqueeze(-1)
            b.zeros[..., i : i + dynamic_group] = zero.unsqueeze(-1)
        w, scale, zero = b.weights[..., i], b.scales[..., i], b.zeros[..., i]
        q = quantize_codes(w, scale, zero, config.bits).clamp_(*code_range)
        b.codes[..., i] = q
        b.errors[..., i] = (w - (q - zero) * scale) / b.hinv[:, i, i, None]
        b.weights[..., i + 1 :].addcmul_(b.errors[..., i, None], b.hinv[:, None, i, i + 1 :], value=-1)


class _BlockLoop:
    """Runs _quantize_block on blocks of one width. On CUDA the second block captures the column loop as
    a CUDA graph and later blocks replay it: the loop is ~10 tiny kernels per column, so Python and launch
    overhead would otherwise dominate (the first block runs eagerly on a side stream: graph warm-up)."""

    def __init__(
        self, like: torch.Tensor, n: int, dynamic_group: int | None, config: QuantConfig,
        code_range: tuple[int, int],
    ) -> None:
        count, rows = like.shape[:2]
        shapes = [(count, rows, n), (count, n, n)] + [(count, rows, n)] * 4
        self.b = _Block(*(like.new_empty(shape) for shape in shapes))
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
    """The reference's lazy-batch loop for E problems side by side. W [E, rows, cols] (processing order) is
    overwritten; U [E, cols, cols]; scales, zeros [E, rows, groups].

    column_groups[e, j]: the group of problem e's j-th processed column. dynamic_group: the group size when group
    parameters are computed on reaching a group's first column (written into scales/zeros; the column order is
    then the identity), None when they are all given. Returns uint8 codes in processing order and each row's loss.

    Deviation from the references: they compute a dynamic group's parameters from the block-level W,
    which for a group starting inside a block misses the in-block updates of the columns before it.
    Here blocks hold whole groups and the parameters come from the fully updated in-block weights, so
    the result does not depend on block_size (it equals the column-by-column algorithm).
    """
    count, rows, cols = W.shape
    block = config.options_as(GPTQOptions).block_size
    if dynamic_group is not None:
        block = max(dynamic_group, block - block % dynamic_group)
    loops = {
        n: _BlockLoop(W, n, dynamic_group, config, code_range) for n in {min(block, cols), cols % block} if n
    }
    codes = torch.empty(count, rows, cols, dtype=torch.uint8, device=W.device)
    row_loss = W.new_zeros(count, rows)
    for start in range(0, cols, block):
        end = min(start + block, cols)
        groups = column_groups[:, None, start:end]
        b = loops[end - start].run(W[..., start:end], U[:, start:end, start:end],
                                   scales.take_along_dim(groups, -1), zeros.take_along_dim(groups, -1))
        if dynamic_group is not None:
            firsts = groups[0, 0, ::dynamic_group]
            scales[..., firsts] = b.scales[..., ::dynamic_group]
            zeros[..., firsts] = b.zeros[..., ::dynamic_group]
        codes[..., start:end] = b.codes
        row_loss += b.errors.square().sum(-1) / 2
        W[..., end:].baddbmm_(b.errors, U[:, start:end, end:], alpha=-1)
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


@dataclass(frozen=True)
class SharedInput:
    """Weights [out_i, in] that read one input, and that input's Hessian H [in, in]: one GPTQ problem (rows are
    independent given H: a column's error is spread along its own row, so each weight's result is what it gets
    alone). `grid` replaces the min-max grid of the scheme; its parameters are static, as with act-order."""

    weights: list[torch.Tensor]
    hessian: torch.Tensor
    grid: WeightGrid | None = None


def gptq_quantize(
    weight: torch.Tensor, hessian: torch.Tensor, config: QuantConfig, grid: WeightGrid | None = None
) -> QuantizedWeight:
    """GPTQ-quantize weight [out, in] (untouched) given H [in, in], on weight's device.

    The math runs in fp32 (fp64 for a float64 weight, which the reference tests use to compare exactly).
    """
    return gptq_solve([SharedInput([weight], hessian, grid)], config)[0][0]


def _stacked_weights(problems: list[SharedInput], rows: int, dtype: torch.dtype) -> torch.Tensor:
    """[E, rows, cols]: each problem's weights stacked. A function of its own so that no loop variable keeps a view
    of it alive after act-order replaces it with its permuted copy (a weight's worth of host memory at the peak)."""
    first = problems[0].weights[0]
    W = first.new_empty(len(problems), rows, first.shape[1], dtype=dtype)
    for stacked, problem in zip(W, problems, strict=True):
        for part, weight in zip(stacked.split([w.shape[0] for w in problem.weights]), problem.weights, strict=True):
            part.copy_(weight.detach())
    return W


def gptq_solve(problems: list[SharedInput], config: QuantConfig) -> list[list[QuantizedWeight]]:
    """GPTQ of problems of one shape (the same weight shapes; an MoE layer's experts) side by side: one batched
    factorisation and one column loop for all of them. On a GPU the loop's kernel launches, not its arithmetic,
    are what a small weight costs; batched, E experts cost about what one does. Each result equals its own solve.
    """
    options = config.options_as(GPTQOptions)
    first = problems[0].weights
    dtype = torch.promote_types(first[0].dtype, torch.float32)
    sizes, cols, count = [w.shape[0] for w in first], first[0].shape[1], len(problems)
    rows = sum(sizes)
    W = _stacked_weights(problems, rows, dtype)
    group = check_group_size(cols, config.group_size)
    diagonals = torch.stack([p.hessian.diagonal() for p in problems]).to(W.device, dtype)
    dead = diagonals == 0
    W.masked_fill_(dead[:, None, :], 0)

    # Per-channel parameters are static in the reference as well (found once, before any update).
    grids = [p.grid for p in problems]
    static = options.act_order or group == cols or grids[0] is not None
    shape = (count, rows, cols // group, group)
    channel_scales: list[torch.Tensor | None] = [None] * count  # two-level grids' (QQQ), set by their qparams
    if grids[0] is not None:
        found = []
        for e, (grid, w) in enumerate(zip(grids, W, strict=True)):  # problems may share one grid object
            found.append(grid.qparams(w.view(*shape[1:])))
            channel_scales[e] = getattr(grid, "channel_scales", None)
        scales, zeros = torch.stack([s for s, _ in found]), torch.stack([z for _, z in found])
    elif static:
        scales, zeros = find_qparams(W.view(shape), config.bits, config.sym, options.mse, config.scale_torch_dtype)
    else:
        scales, zeros = W.new_empty(shape[:3]), W.new_empty(shape[:3])
    order = torch.arange(cols, device=W.device).expand(count, cols)
    if options.act_order:
        order = torch.argsort(diagonals.masked_fill(dead, 1), dim=-1, descending=True, stable=True)
        W = W.take_along_dim(order[:, None, :], -1)

    def working_hessian(e: int) -> torch.Tensor:
        """A copy of problem e's H in the work dtype, act-order applied, dead inputs' diagonal set to 1."""
        hessian = problems[e].hessian.to(W.device, dtype)
        work = permute_symmetric(hessian, order[e]) if options.act_order else hessian.clone()
        work.diagonal()[dead[e, order[e]]] = 1  # order is the identity without act-order
        return work

    def working_hessians(members: list[int]) -> torch.Tensor:
        """The members' working copies [len(members), n, n]; one member's is its own buffer (no second copy:
        beside the quantizer's H it is the peak of a streamed run on a CPU)."""
        if len(members) == 1:
            return working_hessian(members[0])[None]
        work = W.new_empty(len(members), cols, cols)
        for k, e in enumerate(members):
            work[k] = working_hessian(e)
        return work

    labels = [layer_label(p.weights[0]) for p in problems]
    U, damps, factored = inverse_hessian_factors(working_hessians, count, options.damp_percent, labels)
    code_range = (0, 2**config.bits - 1) if grids[0] is None else (grids[0].lowest, grids[0].highest)
    codes, row_loss = _quantize_columns(W, U, scales, zeros, order // group, None if static else group, config,
                                        code_range)
    if options.act_order:
        codes = codes.take_along_dim(torch.argsort(order)[:, None, :], -1)
    bounds = list(accumulate(sizes, initial=0))
    return [[_result(codes[e, lo:hi], scales[e, lo:hi], zeros[e, lo:hi],
                     None if channel_scales[e] is None else channel_scales[e][lo:hi], row_loss[e, lo:hi],
                     weight, problem, damps[e], factored[e], config)
             for weight, lo, hi in zip(problem.weights, bounds, bounds[1:], strict=False)]
            for e, problem in enumerate(problems)]


def _result(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, channel_scales: torch.Tensor | None,
            row_loss: torch.Tensor, weight: torch.Tensor, problem: SharedInput, damp_percent: float, factored: bool,
            config: QuantConfig) -> QuantizedWeight:
    """One weight's rows of a solve, or its RTN fallback where the solve failed."""
    loss = row_loss.sum().item()
    reason = None if factored else "Cholesky failed at every damping"
    if reason is None and not math.isfinite(loss):
        reason = "GPTQ produced a non-finite loss"
    if reason is not None:
        return _rtn_fallback(weight, problem.hessian, config, reason, problem.grid, damp_percent=damp_percent)
    return QuantizedWeight(
        codes=codes,
        scales=scales.to(torch.float32),  # fp16-rounded by compute_qparams: exact in fp32
        zeros=zeros.to(torch.uint8),
        bits=config.bits,
        group_size=config.group_size,
        sym=config.sym,
        channel_scales=None if channel_scales is None else channel_scales.to(torch.float32),
        info={"loss": loss, "damp_percent": damp_percent},
    )


@contextmanager
def _tf32_matmul(enabled: bool) -> Iterator[None]:
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled or previous
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


# Problems solved side by side at most this many bytes at a time (weights and Hessian copies): on a GPU batching
# saves the column loop's launches, on a CPU only Python's overhead, and host memory is what streaming bounds.
GPTQ_BATCH_BYTES = {"cuda": 4 << 30, "cpu": 64 << 20}


def _problems(group: list[LinearQuantizer]) -> list[list[int]]:
    """The group's weights (by position) solved as one problem each. On a GPU the whole group is one stack of rows
    (its column loop's launches are the cost); on a CPU each weight is solved alone, the same result with the column
    loop's buffers of one weight (host memory is what streaming bounds)."""
    assert isinstance(group[0], GPTQQuantizer) and group[0].H is not None
    if group[0].H.device.type == "cpu":
        return [[m] for m in range(len(group))]
    return [list(range(len(group)))]


def _chunks(members: list[tuple[int, list[int]]], groups: list[list[LinearQuantizer]]) -> Iterator[list[tuple]]:
    """`members` (group, weight positions) cut into runs whose solve fits GPTQ_BATCH_BYTES (one problem at least)."""
    first, part = members[0]
    rows = sum(groups[first][m].linear.out_features for m in part)
    cols = groups[first][0].linear.in_features
    per_problem = 4 * (3 * rows * cols + 2 * cols * cols)  # fp32: weights, permuted copy, block buffers; H copies
    device = groups[first][0].linear.weight.device.type
    size = max(1, GPTQ_BATCH_BYTES.get(device, GPTQ_BATCH_BYTES["cuda"]) // per_problem)
    for start in range(0, len(members), size):
        yield members[start : start + size]


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
        return self.quantize_groups([[self]])[0][0]

    def prepare(self) -> None:  # noqa: B027 - optional hook
        """Set up what the solve needs from the statistics (AWQ-GPTQ: its grid from H)."""

    @classmethod
    def quantize_groups(cls, groups: list[list[LinearQuantizer]]) -> list[list[QuantizedWeight]]:
        """Each group (a linear and those that took its Hessian) is one GPTQ problem; problems of one shape are
        solved side by side (gptq_solve), as many at a time as GPTQ_BATCH_BYTES allows."""
        results: dict[int, list[QuantizedWeight]] = {}
        batches: dict[tuple, list[int]] = {}
        for i, group in enumerate(groups):
            owner = group[0]
            if not all(isinstance(q, GPTQQuantizer) and type(q) is type(owner) and q.config == owner.config
                       and q.H is owner.H for q in group):
                results[i] = [q.quantize() for q in group]
                continue
            solved = owner._without_statistics(group)
            if solved is not None:
                results[i] = solved
                continue
            owner.prepare()
            results[i] = [None] * len(group)  # type: ignore[list-item]
            for part in _problems(group):
                key = (type(owner), owner.config, tuple(group[m].linear.weight.shape for m in part), owner.H.device,
                       owner.grid is None)
                batches.setdefault(key, []).append((i, part))
        for members in batches.values():
            for chunk in _chunks(members, groups):
                problems = [SharedInput([groups[i][m].linear.weight for m in part], groups[i][0].H, groups[i][0].grid)
                            for i, part in chunk]
                config = groups[chunk[0][0]][0].config
                for (i, part), solved in zip(chunk, gptq_solve(problems, config), strict=True):
                    for m, result in zip(part, solved, strict=True):
                        result.info["nsamples"] = groups[i][0].nsamples
                        results[i][m] = result
        return [results[i] for i in range(len(groups))]

    def _without_statistics(self, group: list[LinearQuantizer]) -> list[QuantizedWeight] | None:
        """The group's results when its Hessian cannot be used (RTN where no token reached it); raises on
        non-finite weights or inputs; None when the solve can go ahead."""
        for q in group:
            check_finite_weights(q.linear.weight)
        if self.H is None:
            return [_rtn_fallback(q.linear.weight, None, self.config, "no calibration tokens reached this layer",
                                  self.grid, nsamples=0) for q in group]
        if not torch.isfinite(self.H).all():
            raise QuantizationError(
                f"the calibration inputs of {layer_label(self.linear.weight)} contain NaN/Inf; "
                "the model overflows in its dtype on the calibration data (try a float32 or bfloat16 load)"
            )
        return None

    def free(self) -> None:
        self.H = None
        self.nsamples = 0

    def statistics_bytes(self) -> int:
        return 4 * self.linear.in_features**2  # fp32 H

    def few_tokens(self) -> str:
        """A Hessian from fewer tokens than its width is singular: LOW_TOKEN_DAMP_GROWTH x the dampening."""
        options = self.config.options_as(GPTQOptions)
        damp = min(0.5, options.damp_percent * LOW_TOKEN_DAMP_GROWTH)
        self.config = replace(self.config, options=replace(options, damp_percent=damp))
        return f"damp_percent {damp:g}"

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
