"""What ptxas makes of every Gluon tile the tuner times (kernels/autotune.py WGMMA_TILES, TMA_GEMV_TILES), compiled for
sm_90 on any machine (no GPU): wgmma instructions per K tile, registers, spill bytes, and whether ptxas serialized the
wgmmas; for the TMA gemv registers and spills (they set how many programs share an SM).

    python benchmarks/gluon_ptxas.py --out benchmarks/kernels/gluon_ptxas.md

W4A16: fp16, g128, symmetric; W4A8: QQQ two-level g128 (PDL on); no split. Compiled as a launch specializes them
(pointers 16-byte aligned, N and K multiples of 16).
"""

from __future__ import annotations

import argparse
import datetime
import re
import subprocess
from pathlib import Path

import triton
from quantkit.kernels.autotune import TMA_GEMV_TILES, WGMMA_TILES
from quantkit.kernels.sm90 import ptxas_report, w4a8_wgmma_ptx, w4a16_tma_gemv_ptx, w4a16_wgmma_ptx
from triton.backends.nvidia.compiler import get_ptxas


def tile_row(scheme: str, tile: tuple[int, ...]) -> dict:
    bm, bn, bk, warps, stages = tile
    row = dict(scheme=scheme, tile=f"{bm} x {bn} x {bk}, {warps} warps, {stages} stages")
    for variant, bias, band in (("plain", False, 1), ("bias", True, 1), ("bands", False, 8)):
        if scheme == "w4a16":
            ptx = w4a16_wgmma_ptx(bm, bn, bk, warps, stages, bias=bias, band=band)
        else:
            ptx = w4a8_wgmma_ptx(bm, bn, warps, stages, bias=bias, band=band)
        report = ptxas_report(ptx)
        row[variant] = f"{report['registers']} / {report['spill_bytes']}"
        row["serialized"] = row.get("serialized", False) or report["serialized"]
    row["wgmma"] = len(re.findall(r"wgmma\.mma_async\.sync\.aligned", ptx))
    return row


def tma_gemv_row(tile: tuple[int, ...]) -> dict:
    bn, bk, warps, stages = tile
    row = dict(tile=f"{bn} x {bk}, {warps} warps, {stages} stages")
    for variant, options in (("plain", {}), ("bias", dict(bias=True)), ("zeros_split", dict(zeros=True, split=True))):
        report = ptxas_report(w4a16_tma_gemv_ptx(bn, bk, warps, stages, **{"bias": False, **options}))
        row[variant] = f"{report['registers']} / {report['spill_bytes']}"
    return row


def markdown(rows: list[dict], gemv_rows: list[dict], command: str) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    ptxas = get_ptxas(90).path
    version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    lines = [f"# Gluon tiles on sm_90: ptxas's view ({datetime.date.today()})", "",
             f"- command: `{command}`", f"- commit: {commit}; Triton {triton.__version__}; ptxas: {version}",
             "- wgmma: instructions in the kernel (one K tile's worth; the loop is not unrolled)",
             "- registers / spill bytes without a bias and units n fastest (as the benchmark grids run all but the "
             "gate_up shapes), with a bias, and in bands of 8 token tiles (the gate_up shapes, `unit_band`)", "",
             "| scheme | tile (tokens x weight rows x inputs) | wgmma | registers / spills | with bias | in bands | "
             "wgmma serialized |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['scheme']} | {r['tile']} | {r['wgmma']} | {r['plain']} | {r['bias']} | {r['bands']} | "
              f"{'yes (C7515)' if r['serialized'] else 'no'} |" for r in rows]
    lines += ["", "W4A16 TMA gemv (one token per program; registers / spill bytes):", "",
              "| tile (weight rows x inputs) | plain | with bias | zero points, split K |", "|---|---|---|---|"]
    lines += [f"| {r['tile']} | {r['plain']} | {r['bias']} | {r['zeros_split']} |" for r in gemv_rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/kernels/gluon_ptxas.md"))
    args = parser.parse_args()
    rows = []
    for scheme, buckets in WGMMA_TILES.items():
        for tile in dict.fromkeys(t for tiles in buckets.values() for t in tiles):
            rows.append(tile_row(scheme, tile))
            print(rows[-1], flush=True)
    gemv_rows = [tma_gemv_row(tile) for tile in TMA_GEMV_TILES]
    print(gemv_rows, flush=True)
    args.out.write_text(markdown(rows, gemv_rows, f"python benchmarks/gluon_ptxas.py --out {args.out}"))


if __name__ == "__main__":
    main()
