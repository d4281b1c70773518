"""Several processes quantizing one model (torchrun): each rank solves its share of every step's linears (an MoE
layer's experts spread over the ranks); the results are exchanged, so every rank goes on with the same quantized
layer; rank 0 alone writes the work folder and the export.

The calibration batches are split over the ranks (batch b on rank b % world): each rank runs the layer's forwards
on its batches only. The export still has one process's bytes: a linear's statistics are accumulated by the one
rank that solves it, from every batch's inputs in batch order (each batch's rank sends them), exactly as one
process does; every per-batch figure (the guard's errors, AWQ's mean |x|, each scale candidate's loss, the clip
search's sampled rows) is gathered and added up in batch order. (All-reducing per-rank Hessians, as llm-compressor
does, sums them in another order: close, not the same bytes.) QQQ, whose smoothing reads the batches its own way,
runs every batch on every rank and shares only the solves.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from quantkit.qtensor import QuantizationError, QuantizedWeight

COLLECTIVE_TIMEOUT = timedelta(minutes=30)  # a rank's slowest solve (a 235B layer's share) stays far below


@dataclass(frozen=True)
class Ranks:
    """This process's place among the ranks of the run (one process: rank 0 of 1)."""

    rank: int = 0
    world: int = 1

    @property
    def writer(self) -> bool:
        return self.rank == 0

    def owners(self, groups: list[list[str]], cost: dict[str, int]) -> list[int]:
        """The rank solving each group: largest first, each to the rank with the least work so far (ties: lowest
        rank), so that every rank computes the same assignment."""
        load, owner = [0] * self.world, [0] * len(groups)
        for index in sorted(range(len(groups)), key=lambda i: (-cost[groups[i][0]], i)):
            owner[index] = min(range(self.world), key=lambda r: (load[r], r))
            load[owner[index]] += cost[groups[index][0]]
        return owner

    def share(self, groups: list[list[str]], cost: dict[str, int]) -> list[list[str]]:
        """This rank's groups (owners())."""
        if self.world == 1:
            return groups
        return [group for group, owner in zip(groups, self.owners(groups, cost), strict=True) if owner == self.rank]

    def deliver(self, produced: dict[str, list[torch.Tensor]], owners: dict[str, int | None], share: BatchShare,
                device: torch.device, feed: Callable[[str, torch.Tensor], None]) -> None:
        """One step of the batches (each rank ran its batch of the step, or none): every group's inputs, as each
        rank's batch produced them (name -> tensors in call order), fed to the group's owner (None: every rank) in
        the batches' order (rank order within a step). Every rank calls it with the same `owners`, in the same
        order. Unsplit, this rank's own inputs go to the groups it owns."""
        if not share.split:
            for name, owner in owners.items():
                for x in produced[name] if owner in (None, self.rank) else []:
                    feed(name, x)
            return
        shapes: list[dict | None] = [None] * self.world
        dist.all_gather_object(shapes, {n: [(tuple(x.shape), x.dtype) for x in xs] for n, xs in produced.items()})
        for name, owner in owners.items():
            for source, theirs in enumerate(shapes):
                for position, (shape, dtype) in enumerate((theirs or {}).get(name, [])):
                    x = produced[name][position] if source == self.rank else None
                    if owner is None:  # every rank
                        x = x.contiguous() if x is not None else torch.empty(shape, dtype=dtype, device=device)
                        if x.numel():
                            dist.broadcast(x, source)
                        feed(name, x)
                    elif x is not None:
                        if owner == self.rank:
                            feed(name, x)
                        elif x.numel():
                            dist.send(x.contiguous(), owner)
                    elif owner == self.rank:
                        x = torch.empty(shape, dtype=dtype, device=device)
                        if x.numel():
                            dist.recv(x, source)
                        feed(name, x)

    def in_batch_order(self, values: list, share: BatchShare) -> list:
        """Every rank's per-batch values (this rank's: `values`, for share.ids), in batch order, on every rank."""
        if not share.split:
            return values
        gathered: list[list | None] = [None] * self.world
        dist.all_gather_object(gathered, values)
        return _interleaved(gathered, share.total)

    def step_values(self, value, share: BatchShare) -> list:
        """Every rank's `value` for one step of split batches (rank order is the batches' order); unsplit,
        [value]."""
        if not share.split:
            return [value]
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, value)
        return gathered

    def gather_batches(self, tensors: list[torch.Tensor], share: BatchShare) -> list[torch.Tensor] | None:
        """Every batch's tensor (this rank's: `tensors`, for share.ids) in batch order on the writer (on the host),
        None on the others."""
        if not share.split:
            return tensors
        gathered: list[list | None] | None = [None] * self.world if self.writer else None
        dist.gather_object([t.to("cpu") for t in tensors], gathered, dst=0)
        return None if gathered is None else _interleaved(gathered, share.total)

    def summed(self, counts: dict, share: BatchShare) -> dict:
        """Nested dicts of integer lists counted over this rank's batches, added up over the ranks (exact)."""
        if not share.split:
            return counts
        gathered: list[dict | None] = [None] * self.world
        dist.all_gather_object(gathered, counts)
        return _add_up([g for g in gathered if g is not None])

    def exchange(self, results: dict[str, QuantizedWeight], device: torch.device) -> dict[str, QuantizedWeight]:
        """Every rank's results, on `device`, in this rank's order then the others'."""
        if self.world == 1:
            return results
        gathered: list[dict[str, QuantizedWeight] | None] = [None] * self.world
        dist.all_gather_object(gathered, {name: qw.to("cpu") for name, qw in results.items()})
        merged = dict(results)
        for rank, theirs in enumerate(gathered):
            if rank != self.rank:
                merged |= {name: qw.to(device) for name, qw in (theirs or {}).items()}
        return merged

    def from_writer(self, value):
        """Rank 0's `value` on every rank (a resume's first layer, say)."""
        if self.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


SINGLE = Ranks()


def _interleaved(per_rank: list, total: int) -> list:
    """Per-rank lists of split batches' values (rank r's: batches r, r + world, ...) in batch order."""
    ordered: list = [None] * total
    for rank, theirs in enumerate(per_rank):
        ordered[rank::len(per_rank)] = theirs
    return ordered


def _add_up(trees: list):
    if isinstance(trees[0], dict):
        return {key: _add_up([t[key] for t in trees]) for key in trees[0]}
    if isinstance(trees[0], list):
        return [sum(values) for values in zip(*trees, strict=True)]
    return sum(trees)


@dataclass(frozen=True)
class BatchShare:
    """Which of a run's `total` calibration batches this rank runs: every world-th from its rank when `split`,
    all of them otherwise. A split run moves in `steps`: at step t each rank runs its t-th batch (or none)."""

    ranks: Ranks
    total: int
    split: bool

    @property
    def ids(self) -> list[int]:
        return list(range(self.ranks.rank, self.total, self.ranks.world)) if self.split else list(range(self.total))

    @property
    def steps(self) -> int:
        return math.ceil(self.total / self.ranks.world) if self.split else self.total


def batch_share(ranks: Ranks, total: int, split: bool) -> BatchShare:
    """Batches split only with several ranks and a method whose per-batch work is the engine's."""
    return BatchShare(ranks, total, split and ranks.world > 1)


def ranks_from_environment() -> Ranks:
    """The ranks torchrun started (WORLD_SIZE > 1): the process group joined, NCCL on GPUs (this rank on its local
    GPU), gloo on CPUs; otherwise one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return SINGLE
    if not dist.is_available():
        raise QuantizationError("WORLD_SIZE is set but this torch has no torch.distributed")
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=COLLECTIVE_TIMEOUT)
    return Ranks(dist.get_rank(), dist.get_world_size())
