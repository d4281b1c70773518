"""Kernel configurations: a fixed heuristic default per M bucket, optional timing-based tuning, and a
JSON cache of tuned choices (one file per user, keyed by device, kernel, dtype, shape and M bucket) so a
warm process never re-tunes.

Before timing, every candidate's output is checked against a plain-torch reference of the op on the same input
(kernels/reference.py): a config that computes something else on this GPU is logged and dropped.
QUANTKIT_AUTOTUNE=0 turns tuning off (defaults only). QUANTKIT_CACHE_DIR moves the cache
(default ~/.cache/quantkit). Tuning never runs while a CUDA graph is being captured: a capture that meets
an untuned bucket uses the default for it.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
SMS_TO_FILL = 2 * 132  # two waves of programs on an H100/H200 keep every SM busy when K is split


def m_bucket(m: int) -> int:
    """The smallest bucket holding m (the largest bucket for anything above it)."""
    return next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])


def _split_k(tiles: int, k_tiles: int) -> int:
    """Power-of-two split of K that gets `tiles` output tiles to about two programs per SM."""
    split = 1
    while tiles * split < SMS_TO_FILL and split * 2 <= min(16, k_tiles // 2):
        split *= 2
    return split


def _tile(kernel: str, block_m: int, block_n: int, block_k: int, warps: int, stages: int, m: int, n: int,
          k: int, split: int | None = None) -> dict:
    tiles = -(-m // block_m) * -(-n // block_n)
    split = _split_k(tiles, k // block_k) if split is None else split
    return dict(kernel=kernel, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
                num_warps=warps, num_stages=stages)


GEMV_KERNELS = ("gemv_h2", "gemv")  # half2 PTX (fp16 on CUDA; the fp32 gemv elsewhere), then fp32 FMAs
SWAP_LAYOUT_KERNELS = ("swap", "swap_gemv", "tma_gemv", "wgmma")  # the kernels that read the swap-layout copy
GEMV_PROGRAMS_PER_SM = 4  # decode is bandwidth bound: several resident programs per SM hide DRAM latency


def _gemv(n: int, k: int, block_n: int, block_k: int, warps: int, stages: int = 3, kind: str = "gemv") -> dict:
    """A gemv config whose K split gives about GEMV_PROGRAMS_PER_SM programs per SM (x rows share the
    weight tile through L2, so only weight tiles count), each split keeping at least two K tiles."""
    tiles, split = -(-n // block_n), 1
    while tiles * split < GEMV_PROGRAMS_PER_SM * SMS_TO_FILL // 2 and split * 2 <= min(16, k // block_k // 2):
        split *= 2
    return dict(kernel=kind, BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=warps,
                num_stages=stages)


def _fits(cfg: dict, k: int, group: int) -> bool:
    bk = cfg.get("BLOCK_K", 32)
    return k % bk == 0 and (group % bk == 0 or bk % group == 0)


# H200 sweeps (benchmarks/kernels/sweep_swap_tiles_2026-12-03.md): (16, 128, 128, 4, 4) is within 5% of the best
# in every M <= 16 cell, (64, 128, 128, 8, 3) in 6 of 6 at M = 64; BLOCK_N 256 and BLOCK_K 64 never were.
# W4A8 (sweep_w4a8_swap_2026-12-03.md): BLOCK_K 256 never won; at M = 128..512 a 128-token tile (wgmma N 128)
# beat int8 cuBLAS on 4 of 6 shapes at M = 256, lost at M >= 1024; BLOCK_M 256 always lost (0.1-0.5x), as
# did every W4A16 swap tile from M = 256 on (sweep_w4a16_swap_large_m_2026-12-03.md).
# Two warps and 16 tokens: Triton emits mma.sync (no wgmma, whose register operand it makes synchronous); on the
# H200 these won 8 of 18 M = 1 / 16 cells by up to 19% (70B down) and lost the rest by <= 13%
# (sweep_swap_mma_sync_2026-12-03.md); narrower mma.sync tiles and 64-token ones lost everywhere.
MMA_SYNC_TILES = ((16, 128, 128, 2, 4), (16, 64, 128, 2, 3))
SWAP_TILES = {  # (BM, BN, BK, warps, stages)
    "w4a16": ((16, 128, 128, 4, 4), (16, 64, 128, 4, 4), (32, 128, 128, 4, 4), (32, 128, 128, 8, 3),
              (64, 128, 128, 8, 3), (64, 128, 128, 4, 3), (64, 256, 128, 8, 3)) + MMA_SYNC_TILES,
    "w4a8": ((16, 128, 128, 4, 4), (16, 128, 128, 4, 3), (16, 64, 128, 4, 4), (32, 128, 128, 4, 4),
             (32, 64, 128, 4, 4), (64, 128, 128, 8, 3), (64, 128, 128, 4, 3), (128, 128, 128, 8, 3)) + MMA_SYNC_TILES,
}


# The W4A16 gemv on the swap layout (w4a16_swap.py): (BLOCK_N, BLOCK_K, warps). The H200 sweep's winners
# (sweep_swap_gemv_stages_2026-12-04.md): BK 256 with 32 or 64 rows on every shape, at the heuristic split or half.
SWAP_GEMV_TILES = ((32, 256, 4), (64, 256, 4), (32, 512, 4))


def swap_gemv_candidates(n: int, k: int, group: int) -> list[dict]:
    """The swap-layout gemv's configs that fit the layer, at the heuristic split and at half of it."""
    from .w4a16_swap import swap_gemv_fits

    out = []
    for bn, bk, warps in SWAP_GEMV_TILES:
        if swap_gemv_fits(k, n, group, bn, bk):
            cfg = _gemv(n, k, bn, bk, warps, stages=1, kind="swap_gemv")
            out += [cfg] + ([{**cfg, "SPLIT_K": cfg["SPLIT_K"] // 2}] if cfg["SPLIT_K"] > 1 else [])
    return out


# The Gluon TMA gemv (w4a16_tma_gemv.py; fp16, Hopper): (BLOCK_N, BLOCK_K, warps, stages). The H200 sweep of 41 tiles
# (kernels/log_ab_tma_gemv_2026-12-04.txt, M = 1 on six shapes, 2 and 4 on three): the first is the best in 11 of the
# 12 cells, the second in the other (70B gate_up, 5% ahead). Two stages won: fewer shared-memory bytes per program,
# more programs per SM. The third: 128-input tiles led on 8B qkv / o (2-6%) in the K-blocked layout's A/B
# (kernels/log_k_blocked_ab_gemv_2026-12-05.txt).
TMA_GEMV_TILES = ((128, 256, 4, 2), (64, 256, 4, 3), (128, 128, 4, 2))


def tma_gemv_split(n: int, k: int, block_n: int, block_k: int) -> int:
    """The largest power-of-two K split that divides the K tiles, leaves each split at least two of them and keeps
    a token's programs within about four per SM (2 * SMS_TO_FILL); 1 if none. It picked the best measured split
    for both TMA_GEMV_TILES on all six benchmark shapes but one tie (8B o, 64 rows)."""
    tiles, split = k // block_k, 1
    while tiles % (2 * split) == 0 and tiles // (2 * split) >= 2 and n // block_n * 2 * split <= 2 * SMS_TO_FILL:
        split *= 2
    return split


def tma_gemv_candidates(n: int, k: int, group: int, tiles: tuple = TMA_GEMV_TILES) -> list[dict]:
    """The TMA gemv's configs of these tiles (BLOCK_N, BLOCK_K, warps, stages) that fit the layer, at
    tma_gemv_split and half of it."""
    from .w4a16_tma_gemv import tma_gemv_fits

    out = []
    for bn, bk, warps, stages in tiles:
        split = tma_gemv_split(n, k, bn, bk)
        for s in dict.fromkeys((split, max(1, split // 2))):
            if tma_gemv_fits(k, n, group, bn, bk, s):
                out.append(dict(kernel="tma_gemv", BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=s, num_warps=warps,
                                num_stages=stages))
    return out


def swap_candidates(scheme: str, m: int, n: int, k: int, group: int) -> list[dict]:
    """The swap kernels' configs (their BLOCK_M is wgmma's N: the M bucket up to 64, at least 16; 128 for
    W4A8 at M = 128..512)."""
    b = m_bucket(m)
    block_m = max(16, b) if b <= 64 else 128 if b <= 512 else 0
    out = []
    for bm, bn, bk, warps, stages in SWAP_TILES[scheme]:
        bk = bk if group == k else min(bk, group)  # a K tile stays inside one group
        if bm != block_m or n % bn or k % bk or (group != k and group % bk):
            continue
        cfg = _tile("swap", bm, bn, bk, warps, stages, m, n, k)
        # each register-operand wgmma waits for the one before (Triton's rule for operands computed in the
        # loop), so more resident programs hide that latency: the heuristic split, half and double of it
        for split in (cfg["SPLIT_K"], cfg["SPLIT_K"] // 2, cfg["SPLIT_K"] * 2):
            if 1 <= split <= max(1, k // bk // 2):
                out.append({**cfg, "SPLIT_K": split})
    return list({str(c): c for c in out}.values())


def candidates(scheme: str, m: int, n: int, k: int, group: int, swap: bool = False, hopper: bool = False,
               fp16: bool = True, swap_block: int | None = None, plain: bool = True) -> list[dict]:
    """Configs worth timing for this problem, the heuristic default first. scheme: 'w4a16' or 'w4a8'.
    swap: the layer has a swap kernel's weight layout (w4a16_swap; w4a8_swap for symmetric weights): its
    configs lead from M = 2 to 64 (and join W4A8's timed candidates at M = 128..512). hopper: the Gluon
    kernels (on the swap layouts) can run: the wgmma kernels' configs are timed too (M >= 8; W4A16's lead at
    M = 32..512), and with fp16 activations W4A16's TMA gemv (M <= 4; it leads for one token on large layers).
    swap_block: the K block of the swap layout (kernels/__init__.SWAP_BLOCK; None: plain): the swap-layout
    kernels' K tiles must fit in it. plain: the plain-layout weight is on the GPU (kernels/__init__.keeps_plain_copy);
    without it only the swap-layout kernels are candidates."""
    b = m_bucket(m)
    out: list[dict] = []
    bk_min = 32 if scheme == "w4a16" else 64  # int8 dot needs K >= 32 per instruction; 64 keeps it fed
    if b <= 16:
        tiles = [(16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (16, 64, 256, 4, 3), (16, 128, 256, 8, 3)]
    elif b <= 64:
        tiles = [(b, 64, 128, 4, 4), (b, 128, 128, 4, 3), (b, 128, 64, 4, 4), (b, 64, 256, 4, 3)]
    else:
        tiles = [(128, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3),
                 (64, 256, 64, 8, 4)]
    sliced_bk_min = 8 * (16 if scheme == "w4a16" else 32)  # each nibble slice is one dot of K = BLOCK_K / 8
    # H200 sweep (benchmarks/kernels/sweep_small_m.md): the sliced dots win at M <= 4 (1.1-1.4x over gemm),
    # the reshaped tile from M = 16 on; both stay candidates for the tuner.
    kinds = ("gemm_sliced", "gemm") if b <= 4 else ("gemm", "gemm_sliced")
    if scheme == "w4a16" and b <= 64:  # half2 PTX dequant of the sliced tile (fp16 on CUDA; sliced elsewhere)
        kinds += ("gemm_h2",)
    for kernel in kinds:
        for bm, bn, bk, warps, stages in tiles:
            bk = max(bk, bk_min if kernel == "gemm" else sliced_bk_min)
            cfg = _tile(kernel, bm, bn, bk, warps, stages, m, n, k)
            if cfg in out:
                continue
            out.append(cfg)
            if cfg["SPLIT_K"] > 1:  # the heuristic split and one half as deep
                out.append({**cfg, "SPLIT_K": cfg["SPLIT_K"] // 2})
    if b <= 4:  # FMA gemv, one program per x row: the default for a single token
        # half2 first, then the fp32 one; the H200 sweeps' best tiles first: BK 256 and 512 (W4A8: every
        # shape, sweep_small_m_2026-12-03.md; W4A16 with register prefetch: sweep_gemv_prefetch_2026-12-03.md),
        # the first at the heuristic split and at half of it
        tiles = ((64, 256, 4), (64, 512, 4), (64, 128, 4), (64, 64, 4), (128, 256, 4), (128, 128, 8))
        gemv = []
        for kind in GEMV_KERNELS:
            configs = [_gemv(n, k, bn, bk, warps, kind=kind) for bn, bk, warps in tiles]
            if configs[0]["SPLIT_K"] > 1:
                configs.append({**configs[0], "SPLIT_K": configs[0]["SPLIT_K"] // 2})
            gemv += configs
        out = gemv + out if b == 1 else out + gemv
    if swap and b <= 64:  # it beat every other tiled kernel from M = 1 to 64 on the H200 but one cell (8B o,
        # M = 64: gemm's first tile). The other tiled kinds keep their first two configs as fallbacks (20-39
        # candidates become 8-21).
        swapped = swap_candidates(scheme, m, n, k, group)
        gemv = [c for c in out if c["kernel"] in GEMV_KERNELS]
        tiled = [c for c in out if c["kernel"] not in GEMV_KERNELS]
        firsts = [c for kind in dict.fromkeys(c["kernel"] for c in tiled) for c in
                  [t for t in tiled if t["kernel"] == kind][:2]]
        swap_gemv = swap_gemv_candidates(n, k, group) if scheme == "w4a16" and b <= 4 else []
        tma = tma_gemv_candidates(n, k, group) if scheme == "w4a16" and b <= 4 and hopper and fp16 else []
        # one token, fp16: the TMA gemv leads on layers of 2**26 weights and more (H200: +5-15% on the 70B shapes,
        # a tie on 8B gate_up), the swap gemv below (8B qkv / o: the TMA gemv 11-14% slower; 8B down a tie), then
        # gemv_h2 (slower than the swap gemv on 5 of 6 shapes); bf16 (no half2 PTX in either gemv): gemv_h2's fp32
        # gemv first, as measured before. Two to four tokens: the TMA gemv beat both gemvs on every measured shape
        # (log_ab_tma_gemv_2026-12-04.txt)
        lead = tma if n * k >= 2**26 else []
        gemvs = lead + (swap_gemv + gemv[:1] if fp16 else gemv[:1] + swap_gemv) + [c for c in tma if c not in lead]
        out = gemvs + swapped + gemv[1:] + firsts if b == 1 else swapped + tma + swap_gemv + firsts + gemv
    elif swap:  # W4A8 at M = 128..512
        out += swap_candidates(scheme, m, n, k, group)
    if b >= 256:
        big = "dequant_mm" if scheme == "w4a16" else "int_mm"
        out.insert(0 if b >= 1024 else len(out), dict(kernel=big))
    if swap and hopper:  # W4A16: it won every M = 64 / 256 cell but three (swap: 4 of 6 at 16); W4A8: every cell from
        # 256 tokens on, int8 cuBLAS included (kernels/results_w4a8_exact_2026-12-04.md)
        wgmma = wgmma_candidates(scheme, m, n, k, group)
        lead = 32 <= b <= 512 if scheme == "w4a16" else b >= 256
        out = wgmma + out if lead else out + wgmma
    out = [c for c in out if c["kernel"] in ("dequant_mm", "int_mm")
           or (_fits(c, k, group) and fits_swap_block(c, swap_block))]
    if plain or not swap:
        return out
    only = [c for c in out if c["kernel"] in SWAP_LAYOUT_KERNELS]
    if only:
        return only
    # none (many tokens, no Gluon): the swap kernel's largest token tiles, which take any M
    largest = swap_candidates(scheme, min(m, 512), n, k, group) or swap_candidates(scheme, min(m, 64), n, k, group)
    return [c for c in largest if _fits(c, k, group) and fits_swap_block(c, swap_block)]


def swap_layout_serves(scheme: str, n: int, k: int, group: int, hopper: bool, fp16: bool, swap_block: int | None
                       ) -> bool:
    """Whether some swap-layout kernel takes this layer at every token count (its plain copy can then leave the GPU)."""
    return all(candidates(scheme, m, n, k, group, True, hopper, fp16, swap_block, plain=False)
               for m in (1, 2, 8, 16, 64, 256, 1024, 4096))


def fits_swap_block(cfg: dict, swap_block: int | None) -> bool:
    """Whether a config's K tile fits the K blocks of the layer's swap-layout copy (None: plain, all of K); the
    kernels that do not read that copy always fit."""
    return cfg["kernel"] not in SWAP_LAYOUT_KERNELS or not swap_block or swap_block % cfg["BLOCK_K"] == 0


# The Gluon kernels on the swap layouts with asynchronous wgmma (w4a16_wgmma.py, w4a8_wgmma.py), by M bucket:
# (BM, BN, BK, warps, stages). BM is wgmma's N (the tokens), BN the weight rows (64 per warpgroup), BK <= 256 (TMA's
# 128-byte rows). W4A16: the H200 sweeps' winners (benchmarks/kernels/sweep_wgmma_*_2026-12-04.md; 32 and 128
# interpolated; since the unit loop, 128-input K tiles win at 16 and 256 tokens: sweep_wgmma_bk128_2026-12-04.md);
# W4A8: BK 128 (a K tile inside a QQQ group of 128). 8 tokens (M <= 8): timed after the gemvs and the swap kernel.
# W4A8 from 256 tokens also 8-warp 128 x 128 tiles, which ptxas fits without spills since the kernels stopped
# serializing their wgmmas (log_ab_acc_once_2026-12-04.txt).
WGMMA_TILES = {
    "w4a16": {
        8: ((8, 128, 128, 4, 4), (8, 256, 128, 8, 4), (8, 128, 64, 4, 6), (8, 64, 128, 4, 6)),
        16: ((16, 128, 64, 4, 6), (16, 256, 64, 4, 4), (16, 256, 128, 8, 4), (16, 128, 128, 4, 4), (16, 256, 128, 4, 4)),
        32: ((32, 128, 64, 4, 6), (32, 64, 128, 4, 4), (32, 256, 128, 8, 4)),
        64: ((64, 64, 128, 4, 4), (64, 128, 64, 4, 6), (64, 256, 128, 8, 3), (64, 256, 64, 4, 4)),
        128: ((128, 128, 64, 4, 3), (64, 128, 64, 4, 6), (64, 256, 128, 8, 3)),
        256: ((256, 64, 64, 4, 3), (128, 128, 64, 4, 3), (256, 128, 64, 8, 3), (128, 128, 128, 4, 3),
              (128, 256, 128, 8, 3)),
    },
    "w4a8": {
        8: ((8, 128, 128, 4, 4), (8, 256, 128, 8, 4), (8, 64, 128, 4, 6)),
        16: ((16, 128, 128, 4, 4), (16, 256, 128, 4, 4), (16, 128, 128, 4, 6), (16, 256, 128, 8, 4)),
        32: ((32, 128, 128, 4, 4), (32, 256, 128, 8, 4)),
        64: ((64, 128, 128, 4, 4), (64, 256, 128, 4, 4), (64, 256, 128, 8, 3), (64, 64, 128, 4, 4)),
        128: ((128, 128, 128, 4, 3), (64, 256, 128, 8, 3), (128, 64, 128, 4, 4)),
        256: ((128, 128, 128, 4, 3), (128, 64, 128, 4, 4), (64, 256, 128, 8, 3), (128, 128, 128, 8, 4),
              (128, 256, 128, 8, 3)),  # int8 wgmma: N <= 224
    },
}


def wgmma_candidates(scheme: str, m: int, n: int, k: int, group: int) -> list[dict]:
    """The Gluon wgmma kernels' configs that fit the layer, at the heuristic split, a half and a quarter (each the
    largest that gives every unit the same number of K tiles, see wgmma_split)."""
    from .w4a16_wgmma import wgmma_fits, wgmma_split

    out = []
    for bm, bn, bk, warps, stages in WGMMA_TILES[scheme][min(max(m_bucket(m), 8), 256)]:
        bk = bk if group == k else min(bk, group)
        if wgmma_fits(k, n, group, bn, bk):
            cfg = _tile("wgmma", bm, bn, bk, warps, stages, m, n, k)
            splits = [wgmma_split(k, bk, max(1, cfg["SPLIT_K"] // d), stages) for d in (1, 2, 4)]
            out += [{**cfg, "SPLIT_K": s} for s in splits if s]
    return list({str(c): c for c in out}.values())


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


class TuningCache:
    """Tuned configs by key, loaded lazily from and written through to one JSON file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._entries: dict[str, dict] | None = None

    def _load(self) -> dict[str, dict]:
        if self._entries is None:
            try:
                self._entries = json.loads(self.path.read_text())
            except (OSError, ValueError):
                self._entries = {}
        return self._entries

    def get(self, key: str) -> dict | None:
        return self._load().get(key)

    def put(self, key: str, config: dict) -> None:
        entries = self._load()
        entries[key] = config
        try:  # write-then-rename: concurrent processes never read a half-written file
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False, suffix=".tmp") as f:
                json.dump(entries, f, indent=1, sort_keys=True)
            os.replace(f.name, self.path)
        except OSError as err:
            log.warning("could not save kernel tuning cache %s: %s", self.path, err)


def cache_path() -> Path:
    root = os.environ.get("QUANTKIT_CACHE_DIR") or Path.home() / ".cache" / "quantkit"
    return Path(root) / "kernel_tuning.json"


_CACHE: TuningCache | None = None


def _cache() -> TuningCache:
    global _CACHE
    if _CACHE is None or _CACHE.path != cache_path():
        _CACHE = TuningCache(cache_path())
    return _CACHE


def tuning_enabled() -> bool:
    return os.environ.get("QUANTKIT_AUTOTUNE", "1") != "0"


def _graph_time(fn: Callable[[], object]) -> float:
    """Median GPU time of fn replayed from a CUDA graph (timed one launch at a time, a 10 us kernel's Python
    launch cost ranked the configs: an H200 grid picked 0.9x configs where 1.7x ones existed)."""
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median"))


def _cold_times(calls: list[Callable[[], object]], device: torch.device) -> list[float]:
    """_graph_time of each call with a cold L2: every replay first overwrites a buffer twice the L2's size
    (as a model's other layers evict a layer's weights; hot, an 8B layer's 30 MB sit in the H200's L2 and
    the tuner ranked configs by a speed no model sees), whose own time is subtracted. inf for a call that
    fails (e.g. a config out of shared memory)."""
    flush = torch.empty(2 * torch.cuda.get_device_properties(device).L2_cache_size, dtype=torch.int8,
                        device=device)
    flush_time = _graph_time(flush.zero_)
    times = []
    for call in calls:
        try:
            times.append(_graph_time(lambda call=call: (flush.zero_(), call())) - flush_time)
        except Exception as err:  # a config the compiler rejects just loses
            log.debug("candidate failed: %s", err)
            times.append(float("inf"))
    return times


# Bumped whenever a kernel stops taking configs it took before (2: the Gluon kernels' splits must give every unit
# the same K tiles): entries tuned by an earlier version are then never read back, and the layer is tuned again.
TUNING_VERSION = 2


def tuning_key(device_name: str, scheme: str, dtype: torch.dtype, n: int, k: int, group: int, m: int,
               zeros: bool, two_level: bool | None, swap: bool, swap_block: int | None = None, plain: bool = True) -> str:
    """The cache key of a tuned config: version, device, problem, M bucket and the layer traits configs depend on
    (two_level: None for W4A16; the swap layout's K block when it has one; "only" without the plain layout)."""
    traits = (f"z{int(zeros)}" + ("" if two_level is None else f"two{int(two_level)}") + ("swap" if swap else "")
              + (f"b{swap_block}" if swap and swap_block else "") + ("only" if swap and not plain else ""))
    return f"v{TUNING_VERSION}|{device_name}|{scheme}|{dtype}|N{n}|K{k}|g{group}|{traits}|M{m_bucket(m)}"


# A config whose output is this far (relative Frobenius error) from the torch reference computes something else:
# rounding differences between kernels and the fp32 reference stay under 1e-2 (fp16 / bf16 outputs, int8 ties).
WRONG_RESULT = 0.05
REFERENCE = {"kernel": "reference"}  # the ops' plain-torch path, when no candidate gives the right result


def _relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    err = ((out.float() - expected).norm() / expected.norm().clamp(min=1e-30)).item()
    return err if err == err else float("inf")  # NaN: wrong


def _right_results(options: list[dict], run: Callable[[dict], object], expected: torch.Tensor, key: str) -> list[dict]:
    """The candidates whose output on this call matches `expected` (within WRONG_RESULT): a config that some GPU,
    driver or compiler version gets wrong is logged and never timed or cached. One that fails to run stays (it
    loses the timing)."""
    right = []
    for cfg in options:
        try:
            err = _relative_error(run(cfg), expected)
        except Exception as exc:  # out of shared memory, a compile error: kept, and _cold_times gives it inf
            log.debug("candidate %s failed: %s", cfg, exc)
            right.append(cfg)
            continue
        if err < WRONG_RESULT:
            right.append(cfg)
        else:
            log.warning("kernel config %s gives wrong results for %s (relative error %.3g against the reference): "
                        "not used", cfg, key, err)
    return right


def pick_config(scheme: str, x: torch.Tensor, n: int, k: int, group: int, run: Callable[[dict], object],
                zeros: bool = False, two_level: bool | None = None, swap: bool = False,
                reference: Callable[[], torch.Tensor] | None = None, swap_block: int | None = None,
                plain: bool = True) -> dict:
    """The config for this call: cached, else tuned (timing run(config) for each candidate whose output matches
    reference(), when given and finite; REFERENCE if none does), else default."""
    m = x.shape[0]
    tuned = x.is_cuda and tuning_enabled()
    if tuned:  # the cache first: every eager call of a layer comes here, the candidates are needed only to tune
        key = tuning_key(torch.cuda.get_device_name(x.device), scheme, x.dtype, n, k, group, m, zeros, two_level,
                         swap, swap_block, plain)
        cached = _cache().get(key)
        if cached is not None:
            return cached
    options = candidates(scheme, m, n, k, group, swap, hopper_gluon(x.device), x.dtype == torch.float16, swap_block,
                         plain)
    if not tuned or torch.cuda.is_current_stream_capturing():
        return options[0]
    expected = reference().float() if reference is not None else None
    if expected is not None and bool(torch.isfinite(expected).all()):  # else nothing to judge by
        options = _right_results(options, run, expected, key)
    if not options:
        log.error("no kernel config gives the right result for %s: the plain torch path serves it", key)
        best = REFERENCE
    else:
        times = _cold_times([lambda cfg=cfg: run(cfg) for cfg in options], x.device) if len(options) > 1 else [0.0]
        best = options[min(range(len(options)), key=times.__getitem__)]
    log.info("tuned %s: %s", key, best)
    _cache().put(key, best)
    return best
