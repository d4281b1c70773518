"""Several processes quantizing one model (torchrun): each rank gathers the statistics of, and solves, its share of
every step's linears (an MoE layer's experts spread over the ranks); the results are exchanged, so every rank goes
on with the same quantized layer; rank 0 alone writes the work folder and the export.

Every rank runs the layer's forwards on every calibration batch: a linear's statistics are accumulated by one
process over the batches in their order, exactly as one process does, so the export has one process's bytes.
(Splitting the batches over the ranks and all-reducing the statistics, as llm-compressor does, sums each Hessian
in another order: close, not the same bytes.)
"""

from __future__ import annotations

import os
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

    def share(self, groups: list[list[str]], cost: dict[str, int]) -> list[list[str]]:
        """This rank's groups: largest first, each to the rank with the least work so far (ties: lowest rank), so
        that every rank computes the same assignment."""
        if self.world == 1:
            return groups
        load = [0] * self.world
        mine = set()
        for index in sorted(range(len(groups)), key=lambda i: (-cost[groups[i][0]], i)):
            owner = min(range(self.world), key=lambda r: (load[r], r))
            load[owner] += cost[groups[index][0]]
            if owner == self.rank:
                mine.add(index)
        return [group for i, group in enumerate(groups) if i in mine]

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
