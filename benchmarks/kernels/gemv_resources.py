"""Registers, spills, shared memory and in-loop layout conversions of the W4A16 gemv kernel for sm_90,
compiled on a machine with no GPU (Triton's bundled ptxas), for the candidate tiles of autotune.

    PTXAS=.../triton/backends/nvidia/bin/ptxas-blackwell python benchmarks/kernels/gemv_resources.py

Needs a ptxas that reads the PTX version Triton emits (Triton 3.9 wheels: ptxas-blackwell). Writes
gemv_resources_sm90.json beside this file. fp16, g128, symmetric, split-K store, N and K multiples of 16
(what the launcher's specialization gives on the benchmark shapes).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from quantkit.kernels import w4a16
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TILES = [(128, 128, 4), (64, 256, 4), (128, 256, 8), (256, 64, 8), (64, 128, 4), (256, 128, 4), (128, 128, 8)]
SIGNATURE = {"x_ptr": "*fp16", "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp16", "bias_ptr": "*fp16",
             "out_ptr": "*fp16", "part_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "GROUP": "constexpr",
             "HAS_ZEROS": "constexpr", "HAS_BIAS": "constexpr", "SPLIT_K": "i32", "BLOCK_N": "constexpr",
             "BLOCK_K": "constexpr", "IS_SPLIT": "constexpr"}
DIVISIBLE_BY_16 = ("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "bias_ptr", "out_ptr", "part_ptr", "N", "K")


def compile_tile(block_n: int, block_k: int, warps: int, stages: int = 3):
    names = list(SIGNATURE)
    constants = dict(GROUP=128, HAS_ZEROS=False, HAS_BIAS=False, BLOCK_N=block_n, BLOCK_K=block_k, IS_SPLIT=True)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in DIVISIBLE_BY_16}
    src = ASTSource(w4a16._w4a16_gemv_kernel, SIGNATURE, constants, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


def ptxas_report(ptx: str) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        info = subprocess.run([os.environ["PTXAS"], "-v", "-arch=sm_90a", f.name, "-o", os.devnull],
                              capture_output=True, text=True, check=True).stderr
    numbers = {key: int(re.search(pattern, info).group(1)) for key, pattern in
               (("registers", r"Used (\d+) registers"), ("spill_stores", r"(\d+) bytes spill stores"))}
    return numbers


def main() -> None:
    rows = []
    for block_n, block_k, warps in TILES:
        kernel = compile_tile(block_n, block_k, warps)
        loop = kernel.asm["ttgir"].split("scf.for", 1)[-1].split("scf.yield", 1)[0]
        rows.append(dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, shared=kernel.metadata.shared,
                         convert_layout_in_loop=loop.count("convert_layout"), **ptxas_report(kernel.asm["ptx"])))
        print(rows[-1])
    (Path(__file__).parent / "gemv_resources_sm90.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
