"""The memory ceiling of the TMA gemv's access pattern (kernels/w4a16_tma_gemv.py), at one token, on the GPU.

A copy kernel runs the gemv's programs, TMA boxes, ring, barriers and refills with the arithmetic replaced by an XOR
of the landed words (one int32 store per program keeps it live). Timed in one process, CUDA-graph replay, L2 defeated
by rotating copies (bench_kernels.graph_time / copies_for), next to the gemv with the same config and cuBLAS fp16:
what the gemv loses to the copy is its arithmetic and registers; what the copy loses to 4.25 TB/s is the pattern's
(bytes in flight per SM, the CTA barrier per tile). Not part of the library: a diagnostic for KERNELS.md.

    source benchmarks/device_env.sh; python benchmarks/tma_ring_ceiling.py --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_kernels import SHAPES, copies_for, graph_time, tma_gemv_sweep_configs
from quantkit.kernels.w4a16_swap import layout_shape
from quantkit.kernels.w4a16_tma_gemv import _descriptor, _ring_end, _ring_start, _ring_take, w4a16_tma_gemv
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

GROUP = 128


@gluon.jit
def _ring_copy_kernel(w_desc, out_ptr, N, K, SPLIT_K, STAGES: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    KW: gl.constexpr = w_desc.block_type.shape[1]
    Q: gl.constexpr = KW // 4
    TQ: gl.constexpr = 32 if Q > 32 else Q
    words_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // TQ, TQ], [num_warps, 1], [1, 0])  # the gemv's
    pid = gl.program_id(0)
    grid_n = N // BLOCK_N
    pid_n, pid_k = pid % grid_n, pid // grid_n
    tiles = K // (8 * KW) // SPLIT_K
    first_tile = pid_k * tiles
    off_n = pid_n * BLOCK_N
    ring, bars = _ring_start(w_desc, off_n, first_tile, tiles, N, STAGES)
    acc = gl.zeros([BLOCK_N, KW], gl.int32, words_layout)
    for kt in range(tiles):
        acc = acc ^ _ring_take(w_desc, ring, bars, kt, off_n, first_tile, tiles, N, STAGES, words_layout)
    _ring_end(bars, STAGES)
    gl.store(out_ptr + pid, gl.sum(gl.sum(acc, axis=1), axis=0))


def ring_copy(packed: torch.Tensor, k: int, config: dict, out: torch.Tensor) -> None:
    n, bn, bk, split = layout_shape(packed, k)[0], config["BLOCK_N"], config["BLOCK_K"], config["SPLIT_K"]
    _ring_copy_kernel[(n // bn * split,)](_descriptor(packed, bn, bk), out, n, k, split, STAGES=config["num_stages"],
                                          num_warps=config["num_warps"])


def time_shape(k: int, n: int) -> list[dict]:
    """Every TMA gemv sweep config of this shape: gemv and copy times; cuBLAS fp16 once."""
    weight_bytes = n * k // 2 + (k // GROUP) * n * 2
    copies = copies_for(weight_bytes)
    packs = [torch.randint(-2**15, 2**15, (n, k // 4), dtype=torch.int16, device="cuda") for _ in range(copies)]
    scales = [torch.rand(k // GROUP, n, dtype=torch.float16, device="cuda") / 64 + 1e-3 for _ in range(copies)]
    dense = [torch.randn(n, k, dtype=torch.float16, device="cuda") for _ in range(copies_for(n * k * 2))]
    x = torch.randn(1, k, dtype=torch.float16, device="cuda")
    t_cublas = graph_time([lambda w=w: F.linear(x, w) for w in dense])
    rows = []
    for cfg in tma_gemv_sweep_configs(n, k, GROUP):
        sink = torch.empty(n // cfg["BLOCK_N"] * cfg["SPLIT_K"], dtype=torch.int32, device="cuda")
        t_gemv = graph_time([lambda p=p, s=s, cfg=cfg: w4a16_tma_gemv(x, p, s, None, None, GROUP, cfg)
                             for p, s in zip(packs, scales, strict=True)])
        t_copy = graph_time([lambda p=p, cfg=cfg, sink=sink: ring_copy(p, k, cfg, sink) for p in packs])
        rows.append(dict(config=cfg, t_gemv_us=t_gemv * 1e6, t_copy_us=t_copy * 1e6, t_cublas_us=t_cublas * 1e6,
                         gemv_TBps=weight_bytes / t_gemv / 1e12, copy_TBps=n * k / 2 / t_copy / 1e12,
                         speedup_gemv=t_cublas / t_gemv))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), device=torch.cuda.get_device_name(),
                command=" ".join(sys.argv), commit=commit or "uncommitted")
    torch.manual_seed(0)
    results = {}
    for shape in args.shapes:
        k, n = SHAPES[shape]
        rows = results[shape] = time_shape(k, n)
        best_gemv = min(rows, key=lambda r: r["t_gemv_us"])
        best_copy = min(rows, key=lambda r: r["t_copy_us"])
        print(f"{shape}: gemv best {best_gemv['gemv_TBps']:.2f} TB/s ({best_gemv['speedup_gemv']:.2f}x cuBLAS, its "
              f"copy {best_gemv['copy_TBps']:.2f} TB/s) {best_gemv['config']}; copy best {best_copy['copy_TBps']:.2f} "
              f"TB/s {best_copy['config']}", flush=True)
        (args.out / "tma_ring_ceiling.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
