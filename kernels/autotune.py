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

import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from . import registry
from .spec import M_BUCKETS, REFERENCE_KERNEL, Problem, Scheme, TileConfig, fits_k, hopper_gluon, m_bucket

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Preference:
    """The order the tuner tries the kernels in (its first config is the untuned default) on layers with a swap-layout
    copy or without one (None: either), from M bucket buckets[0] to buckets[1] (fp16 activations or not, a layer of
    2**26 weights or more or not: None for either). An entry of `order` is a kernel's name (all its configs) or the
    name sliced, "gemm[:2]": its first two. Kernels that do not serve the problem (KernelSpec.serves) drop out; a
    registered kernel the row does not name comes after it (a new kernel is timed before it has a place here)."""

    swap: bool | None
    buckets: tuple[int, int]
    order: tuple[str, ...]
    why: str
    fp16: bool | None = None
    large: bool | None = None


TILED_FALLBACKS = ("gemm_sliced[:2]", "gemm[:2]", "gemm_h2[:2]")
PREFERENCES = (
    Preference(False, (1, 1), ("gemv_h2", "gemv", "gemm_sliced", "gemm", "gemm_h2"),
               "one token: the FMA gemvs (half2 PTX first), then the sliced dots (1.1-1.4x gemm's at M <= 4)"),
    Preference(False, (2, 4), ("gemm_sliced", "gemm", "gemm_h2", "gemv_h2", "gemv"),
               "the sliced dots win at M <= 4 (1.1-1.4x over gemm), the gemvs are the fallback"),
    Preference(False, (8, 64), ("gemm", "gemm_sliced", "gemm_h2"), "the reshaped tile (gemm) wins from M = 16 on"),
    Preference(True, (1, 1), ("tma_gemv", "swap_gemv", "gemv_h2[:1]", "swap", "gemv_h2[1:]", "gemv")
               + TILED_FALLBACKS, "H200: the TMA gemv +5-15% on the 70B shapes (a tie on 8B gate_up)",
               fp16=True, large=True),
    Preference(True, (1, 1), ("swap_gemv", "gemv_h2[:1]", "tma_gemv", "swap", "gemv_h2[1:]", "gemv")
               + TILED_FALLBACKS, "H200, 8B qkv / o: the TMA gemv 11-14% slower; gemv_h2 behind on 5 of 6 shapes",
               fp16=True, large=False),
    Preference(True, (1, 1), ("gemv_h2[:1]", "swap_gemv", "swap", "gemv_h2[1:]", "gemv") + TILED_FALLBACKS,
               "bf16: no half2 PTX in either gemv, gemv_h2's fp32 gemv first", fp16=False),
    Preference(True, (2, 4), ("swap", "tma_gemv", "swap_gemv") + TILED_FALLBACKS + ("gemv_h2", "gemv"),
               "the swap kernel beat every other tiled one up to M = 64; the TMA gemv both gemvs at 2-4 tokens"),
    Preference(True, (8, 64), ("swap", "gemm[:2]", "gemm_sliced[:2]", "gemm_h2[:2]"),
               "H200: the swap kernel won every cell but one (8B o at 64: gemm); the rest keep two fallbacks"),
    Preference(None, (128, 512), ("gemm", "gemm_sliced", "swap", "dequant_mm", "int_mm"),
               "W4A8's 128-token swap tile beat int8 cuBLAS on 4 of 6 shapes at M = 256; cuBLAS last"),
    Preference(None, (1024, M_BUCKETS[-1]), ("dequant_mm", "int_mm", "gemm", "gemm_sliced"),
               "compute bound: dequantize once, then cuBLAS (vLLM does the same for AWQ above a token threshold)"),
)
# On Hopper with Gluon the wgmma kernels' configs lead in these M buckets and trail elsewhere. W4A16: they won every
# H200 M = 64 / 256 cell but three (the swap kernel 4 of 6 at 16); W4A8: every cell from 256 tokens on, int8 cuBLAS
# included.
WGMMA_LEADS = {"w4a16": (32, 512), "w4a8": (256, M_BUCKETS[-1])}


def preference(p: Problem, swap: bool, fp16: bool) -> Preference:
    """The table's row for this problem."""
    large = p.n * p.k >= 2**26
    return next(r for r in PREFERENCES if r.swap in (None, swap) and r.buckets[0] <= p.bucket <= r.buckets[1]
                and r.fp16 in (None, fp16) and r.large in (None, large))


def _entry_configs(entry: str, p: Problem, swap: bool, hopper: bool, fp16: bool) -> list[TileConfig]:
    """The configs of one entry of a Preference's order (none where its kernel does not serve the problem)."""
    name, _, cut = entry.partition("[")
    spec = registry.registered(p.scheme, name)
    if spec is None or not spec.serves(p.bucket, swap, hopper, fp16):
        return []
    configs = spec.candidates(p)
    if not cut:
        return configs
    start, stop = (int(i) if i else None for i in cut.rstrip("]").split(":"))
    return configs[start:stop]


def fits_swap_block(cfg: TileConfig, swap_block: int | None) -> bool:
    """Whether a config's K tile fits the K blocks of the layer's swap-layout copy (None: plain, all of K); the
    kernels that do not read that copy always fit."""
    return cfg.kernel not in registry.SWAP_LAYOUT_KERNELS or not swap_block or swap_block % cfg.block_k == 0


def _fitting(p: Problem, configs: list[TileConfig], swap_block: int | None) -> list[TileConfig]:
    return [c for c in configs if not registry.kernel(p.scheme, c.kernel).tiled
            or (fits_k(c, p.k, p.group) and fits_swap_block(c, swap_block))]


def candidates(scheme: Scheme, m: int, n: int, k: int, group: int, swap: bool = False, hopper: bool = False,
               fp16: bool = True, swap_block: int | None = None, plain: bool = True) -> list[TileConfig]:
    """Configs worth timing for this problem, the heuristic default first, in PREFERENCES' order. swap: the layer has
    a swap-layout copy (kernels/layout.py; W4A8's for symmetric weights only). hopper: the Gluon kernels can run
    (hopper_gluon). swap_block: the K block of the swap layout (kernels/__init__.SWAP_BLOCK; None: plain): the
    swap-layout kernels' K tiles must fit in it. plain: the plain-layout weight is on the GPU
    (kernels/__init__.keeps_plain_copy); without it only the swap-layout kernels are candidates."""
    p = Problem(scheme, m, n, k, group)
    order = preference(p, swap, fp16).order
    named = {entry.partition("[")[0] for entry in order} | {"wgmma"}
    unranked = tuple(spec.name for spec in registry.KERNELS if spec.scheme == scheme and spec.name not in named)
    out = [c for entry in order + unranked for c in _entry_configs(entry, p, swap, hopper, fp16)]
    wgmma = _entry_configs("wgmma", p, swap, hopper, fp16)
    lead = scheme in WGMMA_LEADS and WGMMA_LEADS[scheme][0] <= p.bucket <= WGMMA_LEADS[scheme][1]
    out = _fitting(p, wgmma + out if lead else out + wgmma, swap_block)
    if plain or not swap:
        return out
    only = [c for c in out if c.kernel in registry.SWAP_LAYOUT_KERNELS]
    if only:
        return only
    # none (many tokens, no Gluon): the swap kernel's largest token tiles, which take any M
    swap_kernel = registry.kernel(scheme, "swap")
    largest = (swap_kernel.candidates(Problem(scheme, min(m, 512), n, k, group))
               or swap_kernel.candidates(Problem(scheme, min(m, 64), n, k, group)))
    return _fitting(p, largest, swap_block)


def swap_layout_serves(scheme: Scheme, n: int, k: int, group: int, hopper: bool, fp16: bool, swap_block: int | None
                       ) -> bool:
    """Whether some swap-layout kernel takes this layer at every token count (its plain copy can then leave the GPU)."""
    return all(candidates(scheme, m, n, k, group, True, hopper, fp16, swap_block, plain=False)
               for m in (1, 2, 8, 16, 64, 256, 1024, 4096))


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

    def get(self, key: str) -> TileConfig | None:
        entry = self._load().get(key)
        return None if entry is None else TileConfig.from_dict(entry)

    def put(self, key: str, config: TileConfig) -> None:
        entries = self._load()
        entries[key] = config.as_dict()
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


def tuning_cache() -> TuningCache:
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
REFERENCE = TileConfig(REFERENCE_KERNEL)  # the ops' plain-torch path, when no candidate gives the right result


def _relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    err = ((out.float() - expected).norm() / expected.norm().clamp(min=1e-30)).item()
    return err if err == err else float("inf")  # NaN: wrong


def _right_results(options: list[TileConfig], run: Callable[[TileConfig], object], expected: torch.Tensor, key: str) -> list[TileConfig]:
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


def pick_config(scheme: Scheme, x: torch.Tensor, n: int, k: int, group: int, run: Callable[[TileConfig], object],
                zeros: bool = False, two_level: bool | None = None, swap: bool = False,
                reference: Callable[[], torch.Tensor] | None = None, swap_block: int | None = None,
                plain: bool = True, dtype: torch.dtype | None = None) -> TileConfig:
    """The config for this call: cached, else tuned (timing run(config) for each candidate whose output matches
    reference(), when given and finite; REFERENCE if none does), else default. dtype: the output's, when it is not
    x's (FP8's activations are float8)."""
    m = x.shape[0]
    dtype = dtype or x.dtype
    tuned = x.is_cuda and tuning_enabled()
    if tuned:  # the cache first: every eager call of a layer comes here, the candidates are needed only to tune
        key = tuning_key(torch.cuda.get_device_name(x.device), scheme, dtype, n, k, group, m, zeros, two_level,
                         swap, swap_block, plain)
        cached = tuning_cache().get(key)
        if cached is not None:
            return cached
    options = candidates(scheme, m, n, k, group, swap, hopper_gluon(x.device), dtype == torch.float16, swap_block,
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
    tuning_cache().put(key, best)
    return best
