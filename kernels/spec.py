"""The typed records of the kernel registry (kernels/registry.py): a tile config, the problem a kernel is asked to
solve, and the KernelSpec each kernel file declares; with them the facts of where kernels run that need no Triton
(hopper_gluon, decode_attention_rows). Plain Python: the package, the tuner, the dispatch and the kernel files all
import it, and it imports nothing of them."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Literal

import torch

Scheme = Literal["w4a16", "w4a8", "fp8"]
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
REFERENCE_KERNEL = "reference"  # the ops' plain-torch path: no registered kernel, the tuner's last resort
SMS_TO_FILL = 2 * 132  # two waves of programs on an H100/H200 keep every SM busy when K is split
GEMV_PROGRAMS_PER_SM = 4  # decode is bandwidth bound: several resident programs per SM hide DRAM latency


def m_bucket(m: int) -> int:
    """The smallest bucket holding m (the largest bucket for anything above it)."""
    return next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration of a kernel; the tile fields are None for the kernels without tiles (cuBLAS paths,
    the torch reference). Stored in the tuning cache as its `as_dict` (the tile fields in Triton's upper case)."""

    kernel: str
    block_m: int | None = None
    block_n: int | None = None
    block_k: int | None = None
    split_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def as_dict(self) -> dict[str, str | int]:
        return {(key.upper() if key.startswith(("block", "split")) else key): value
                for key, value in asdict(self).items() if value is not None}

    @classmethod
    def from_dict(cls, entry: dict[str, str | int]) -> TileConfig:
        return cls(**{key.lower(): value for key, value in entry.items()})

    def with_split(self, split_k: int) -> TileConfig:
        return replace(self, split_k=split_k)


@dataclass(frozen=True)
class Problem:
    """What the tuner asks configs for: a layer (N outputs, K inputs, group size; K when per channel) at m tokens."""

    scheme: Scheme
    m: int
    n: int
    k: int
    group: int

    @property
    def bucket(self) -> int:
        return m_bucket(self.m)

    @property
    def per_channel(self) -> bool:
        return self.group == self.k


@dataclass(frozen=True)
class KernelSpec:
    """What a kernel is: its name (TileConfig.kernel), scheme, the weight layout it reads ("plain": QuantLinear's
    K-packed int32; "swap": kernels/layout.py's swap layout), where it applies (M buckets, Hopper with Gluon, fp16
    activations), its tile candidates for a problem (in the order the tuner should try them; fit checks included)
    and its launch: launch(x, weight, scales, zeros, bias, group_size, config) for W4A16, launch(x, weight,
    channel_scales, group_scales, zeros, bias, group_size, config) for W4A8, launch(x8, x_scales, weight,
    weight_scales, bias, out_dtype, config) for FP8."""

    name: str
    scheme: Scheme
    layout: Literal["plain", "swap"]
    candidates: Callable[[Problem], list[TileConfig]]
    launch: Callable[..., torch.Tensor]
    buckets: tuple[int, int] = (1, M_BUCKETS[-1])
    hopper: bool = False
    fp16: bool = False
    tiled: bool = True  # False: no K tile (cuBLAS paths), nothing to fit

    def serves(self, bucket: int, swap: bool, hopper: bool, fp16: bool) -> bool:
        """Whether it applies at this M bucket on a layer with (swap) or without a swap-layout copy."""
        return (self.buckets[0] <= bucket <= self.buckets[1] and (swap or self.layout == "plain")
                and (hopper or not self.hopper) and (fp16 or not self.fp16))


def split_k_for(tiles: int, k_tiles: int) -> int:
    """Power-of-two split of K that gets `tiles` output tiles to about two programs per SM."""
    split = 1
    while tiles * split < SMS_TO_FILL and split * 2 <= min(16, k_tiles // 2):
        split *= 2
    return split


def tile_config(kernel: str, block_m: int, block_n: int, block_k: int, warps: int, stages: int, m: int, n: int,
                k: int) -> TileConfig:
    """A tiled kernel's config at the heuristic K split (split_k_for)."""
    tiles = -(-m // block_m) * -(-n // block_n)
    return TileConfig(kernel, block_m, block_n, block_k, split_k_for(tiles, k // block_k), warps, stages)


def gemv_config(n: int, k: int, block_n: int, block_k: int, warps: int, stages: int = 3, kind: str = "gemv"
                ) -> TileConfig:
    """A gemv config whose K split gives about GEMV_PROGRAMS_PER_SM programs per SM (x rows share the
    weight tile through L2, so only weight tiles count), each split keeping at least two K tiles."""
    tiles, split = -(-n // block_n), 1
    while tiles * split < GEMV_PROGRAMS_PER_SM * SMS_TO_FILL // 2 and split * 2 <= min(16, k // block_k // 2):
        split *= 2
    return TileConfig(kind, 1, block_n, block_k, split, warps, stages)


def with_half_split(configs: list[TileConfig]) -> list[TileConfig]:
    """Each config followed by the same at half its K split (when split)."""
    return [c for cfg in configs for c in ([cfg, cfg.with_split(cfg.split_k // 2)] if cfg.split_k > 1 else [cfg])]


def fits_k(config: TileConfig, k: int, group: int) -> bool:
    """Whether the config's K tile divides K and holds whole groups or lies inside one."""
    bk = config.block_k
    return k % bk == 0 and (group % bk == 0 or bk % group == 0)


DECODE_ATTENTION_ROWS = 64  # query rows per kv head (group x tokens) the decode attention kernel takes at most


def decode_attention_rows(head_dim: int) -> int:
    """The most query rows per kv head the decode attention kernel takes at this head size; 0 where it takes none
    (its tiles span the head: a power of two in [16, 256]). Heads of 256 take 32 rows: 64 spilled registers on
    sm_90 with every tile and warp count tried (kernels/decode_attention.py: tile_shape)."""
    if not (16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0):
        return 0
    return DECODE_ATTENTION_ROWS if head_dim <= 128 else DECODE_ATTENTION_ROWS // 2


@functools.cache
def hopper_gluon(device: torch.device) -> bool:
    """Whether the Gluon wgmma kernels can run here: an sm_90 GPU and a Triton with Gluon's Hopper module."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    try:
        import triton.experimental.gluon.language.nvidia.hopper  # noqa: F401
    except ImportError:
        return False
    return True
