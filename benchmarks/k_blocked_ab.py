"""The swap layout against its k_blocked forms (kernels/w4a16_swap.py) in the TMA kernels, on the GPU.

A K tile of BLOCK_N weight rows is BLOCK_N runs of BLOCK_K / 2 bytes a weight row apart (2-14 KB) in the plain
swap layout, one contiguous run in K blocks of BLOCK_K inputs. For each benchmark shape, every config below runs on
the plain layout and on K blocks of LAYOUT_BLOCKS inputs (those a K tile fits in), in one process next to cuBLAS
fp16 (CUDA-graph replay, L2 defeated by rotating copies): the TMA gemv (W4A16, 1 / 2 / 4 tokens) with its ring
without arithmetic (tma_ring_ceiling.py's copy) at one token, and the Gluon wgmma kernels (W4A16 and W4A8
two-level) at 16 and 64 tokens. A blocked output must equal the plain one bit for bit (the same arithmetic on other
addresses) and the plain one the float64 reference.
Also the 8B gate_up cell at 1024 tokens that took 399 us in the tuned grid and 359 us in a sweep (KERNELS.md): one
config through QuantLinear's forward (the config cached) and through the config runner, interleaved.

    source benchmarks/device_env.sh; python benchmarks/k_blocked_ab.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from bench_kernels import (
    DTYPE,
    SHAPES,
    config_runner,
    copies_for,
    cublas_time,
    graph_time,
    printing_log,
    random_layer,
    reference,
    relative_error,
    run_meta,
)
from quantkit.kernels import SWAP_BLOCK, make_kernel_forward
from quantkit.kernels.autotune import (
    TMA_GEMV_TILES,
    _cache,
    tma_gemv_candidates,
    tuning_key,
    wgmma_candidates,
)
from quantkit.kernels.w4a8_swap import repack_for_w4a8_swap
from quantkit.kernels.w4a8_wgmma import w4a8_wgmma_matmul
from quantkit.kernels.w4a16_swap import k_blocked, repack_for_swap
from quantkit.kernels.w4a16_tma_gemv import w4a16_tma_gemv
from quantkit.kernels.w4a16_wgmma import w4a16_wgmma_matmul
from tma_ring_ceiling import ring_copy

GROUP = 128
LAYOUT_BLOCKS = (128, 256, 512)
GEMV_MS, WGMMA_MS = (1, 2, 4), (16, 64)
# beside the tuner's two: more warps, more rows, fewer rows, longer K tiles (all two stages, the sweep's winners),
# and 128-input tiles (the only ones K blocks of 128 take) at ring depths of 16-64 KB
TMA_TILES = TMA_GEMV_TILES + ((128, 256, 8, 2), (256, 256, 8, 2), (64, 256, 4, 2), (128, 512, 4, 2),
                              (128, 128, 4, 4), (128, 128, 4, 6), (256, 128, 8, 2),
                              (256, 128, 8, 4), (64, 128, 4, 4))


def caller(scheme: str, layer, cfg: dict):
    """call(x, packed): this config on a given copy of the layer's weight (plain or k_blocked)."""
    if cfg["kernel"] == "tma_gemv":
        return lambda x, p: w4a16_tma_gemv(x, p, layer.scales, None, None, GROUP, cfg)
    if scheme == "w4a16":
        return lambda x, p: w4a16_wgmma_matmul(x, p, layer.scales, None, None, GROUP, cfg)
    return lambda x, p: w4a8_wgmma_matmul(x, p, layer.channel_scales, layer.scales, None, GROUP, cfg)


def time_config(scheme: str, cfg: dict, layers: list, packs: dict[str, list], xs: list, ref: torch.Tensor,
                weight_bytes: int) -> list[dict]:
    """cfg on every layout its K tile fits: time, weight TB/s, and (M = 1, TMA gemv) its ring copy's."""
    calls = [caller(scheme, la, cfg) for la in layers]
    plain = calls[0](xs[0], packs["plain"][0])
    err = relative_error(plain, ref)
    rows = []
    for name, copies in packs.items():
        if name != "plain" and int(name[1:]) % cfg["BLOCK_K"]:
            continue
        same = bool(torch.equal(calls[0](xs[0], copies[0]), plain))
        t = graph_time([lambda c=c, x=x, p=p: c(x, p) for c, x, p in zip(calls, xs, copies, strict=True)])
        row = dict(layout=name, t_us=t * 1e6, TBps=weight_bytes / t / 1e12, equal_to_plain=same)
        if cfg["kernel"] == "tma_gemv" and xs[0].shape[0] == 1:
            k = xs[0].shape[1]
            sink = torch.empty(copies[0].numel() * 4 // k // cfg["BLOCK_N"] * cfg["SPLIT_K"], dtype=torch.int32,
                               device="cuda")
            t_copy = graph_time([lambda p=p, k=k, s=sink: ring_copy(p, k, cfg, s) for p in copies])
            row.update(t_copy_us=t_copy * 1e6, copy_TBps=copies[0].numel() * 2 / t_copy / 1e12)
        rows.append(dict(config=cfg, rel_err=err, **row))
    return rows


def shape_rows(shape: str, k: int, n: int, log, schemes: list[str], ms: list[int]) -> list[dict]:
    rows = []
    weight_bytes = n * k // 2 + 2 * n * (k // GROUP)
    for scheme in schemes:
        layers = [random_layer(k, n, GROUP, scheme) for _ in range(copies_for(weight_bytes))]
        repack = repack_for_swap if scheme == "w4a16" else repack_for_w4a8_swap
        plain = [repack(la.plain_qweight()) for la in layers]
        packs = {"plain": plain} | {f"k{b}": [k_blocked(p, k, b) for p in plain] for b in LAYOUT_BLOCKS}
        for m in [m for m in ms if scheme == "w4a16" or m in WGMMA_MS]:
            t0 = time.time()
            xs = [torch.randn(m, k, device="cuda", dtype=DTYPE) for _ in layers]
            ref = reference(layers[0], xs[0])
            t_cublas = cublas_time(k, n, m)
            configs = (tma_gemv_candidates(n, k, GROUP, TMA_TILES) if m in GEMV_MS
                       else wgmma_candidates(scheme, m, n, k, GROUP))
            cell = []
            for cfg in configs:
                try:
                    cell += time_config(scheme, cfg, layers, packs, xs, ref, weight_bytes)
                except Exception as err:  # a config out of shared memory, a K over W4A8's limit
                    log(f"skip {scheme} {shape} M={m} {cfg}: {type(err).__name__}: {str(err)[:160]}")
            for r in cell:
                r.update(scheme=scheme, shape=shape, K=k, N=n, M=m, t_cublas_us=t_cublas * 1e6,
                         speedup=t_cublas * 1e6 / r["t_us"])
            rows += cell
            bad = [r for r in cell if not (r["equal_to_plain"] and r["rel_err"] < 2e-3)]
            best = {name: min((r for r in cell if r["layout"] == name), key=lambda r: r["t_us"], default=None)
                    for name in packs}
            log(f"{scheme} {shape} M={m} [{time.time() - t0:.0f}s] cuBLAS {t_cublas * 1e6:.1f} us; best "
                + "; ".join(f"{name} {r['speedup']:.2f}x {r['TBps']:.2f} TB/s" + (
                    f" (copy {r['copy_TBps']:.2f})" if "copy_TBps" in r else "")
                    + f" {_short(r['config'])}" for name, r in best.items() if r)
                + (f"; {len(bad)} WRONG: {bad[:2]}" if bad else ""))
        del layers, plain, packs
        torch.cuda.empty_cache()
    return rows


def _short(c: dict) -> str:
    return f"BM{c['BLOCK_M']} BN{c['BLOCK_N']} BK{c['BLOCK_K']} S{c['SPLIT_K']} w{c['num_warps']} s{c['num_stages']}"


def gate_up_cell(log) -> dict:
    """8B gate_up, 1024 tokens, one wgmma config: QuantLinear forward (config cached) vs the config runner."""
    k, n, m = SHAPES["8B gate_up"][0], SHAPES["8B gate_up"][1], 1024
    cfg = dict(kernel="wgmma", BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, SPLIT_K=1, num_warps=8, num_stages=3)
    layers = [random_layer(k, n, GROUP, "w4a16") for _ in range(copies_for(n * k // 2 + 4 * m * (k + n)))]
    xs = [torch.randn(m, k, device="cuda", dtype=DTYPE) for _ in layers]
    _cache().put(tuning_key(torch.cuda.get_device_name(), "w4a16", DTYPE, n, k, GROUP, m, False, None, True,
                            SWAP_BLOCK[16]), cfg)
    forwards = [make_kernel_forward(la) for la in layers]
    runners = [config_runner(la) for la in layers]
    times: dict[str, list[float]] = {"forward": [], "runner": [], "cublas": []}
    for _ in range(3):
        times["forward"].append(graph_time([lambda f=f, x=x: f(x) for f, x in zip(forwards, xs, strict=True)]) * 1e6)
        times["runner"].append(graph_time([lambda r=r, x=x: r(x, cfg) for r, x in zip(runners, xs, strict=True)])
                               * 1e6)
        times["cublas"].append(cublas_time(k, n, m) * 1e6)
    log(f"8B gate_up M=1024 {_short(cfg)}: " + "; ".join(f"{key} " + " / ".join(f"{t:.1f}" for t in ts) + " us"
                                                      for key, ts in times.items()))
    return dict(config=cfg, times_us=times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--schemes", nargs="+", default=["w4a16", "w4a8"])
    parser.add_argument("--ms", type=int, nargs="+", default=list(GEMV_MS + WGMMA_MS))
    parser.add_argument("--skip-gate-up", action="store_true", help="leave out the gate_up cell at 1024 tokens")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = printing_log(args.out / "log_k_blocked_ab.txt")

    meta = run_meta()
    torch.manual_seed(0)
    result: dict = dict(meta=meta, rows=[])
    if not args.skip_gate_up:
        result["gate_up_1024"] = gate_up_cell(log)
    for shape in args.shapes:
        result["rows"] += shape_rows(shape, *SHAPES[shape], log, args.schemes, args.ms)
        (args.out / "k_blocked_ab.json").write_text(json.dumps(result, indent=1))
    wrong = [r for r in result["rows"] if not (r["equal_to_plain"] and r["rel_err"] < 2e-3)]
    log(f"done: {len(result['rows'])} timings, {len(wrong)} wrong")
    return int(bool(wrong))


if __name__ == "__main__":
    sys.exit(main())
