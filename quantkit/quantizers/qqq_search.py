"""QQQ's smoothing search (quantkit.quantizers.qqq's docstring, step 1): the thresholds, their scales, the full
grid (the reference) or the refined coarse-to-fine search, and the check of the result after GPTQ."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from quantkit.config import QuantConfig
from quantkit.quantizers.qqq_probe import SmoothingProbe

THRESHOLD_FLOOR = 0.1  # the reference's smallest threshold...
THRESHOLD_SPACING = 0.5  # ...and its max(100, max|x| / 0.5) candidates
THRESHOLD_MIN_STEPS = 100
# the refined threshold search: a first pass over every ceil(count / 24)-th candidate, then local searches from
# its 3 best (measured against every candidate: quantkit.quantizers.qqq's docstring)
COARSE_PASS = 24
REFINED_STARTS = 3


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
