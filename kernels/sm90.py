"""The Gluon kernels compiled for sm_90 without a GPU, with Triton's bundled ptxas: their PTX and what ptxas says of
it (registers, spills, whether it serialized the wgmmas). For the compile tests; the
signatures are those the launches pass (TMA descriptors, pointers, M / N / K / SPLIT_K as i32)."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import compile
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

_SM90 = GPUTarget("cuda", 90, 32)
_SCALARS = {"M": "i32", "N": "i32", "K": "i32", "SPLIT_K": "i32"}


def _descriptor(dtype: str, block: list[int]) -> str:
    gdt = {"fp16": gl.float16, "bf16": gl.bfloat16, "i16": gl.int16, "i8": gl.int8}[dtype]
    return f"tensordesc<{dtype}[{block[0]}, {block[1]}],{gl.NVMMASharedLayout.get_default_for(block, gdt)!r}>"


def _compile(fn, sig: dict, consts: dict) -> str:
    scalars = {name: ty for name, ty in _SCALARS.items() if name in fn.arg_names}
    sig = {**sig, **scalars, **{name: "constexpr" for name in fn.arg_names if name not in sig and name not in scalars}}
    # as a launch specializes them: pointers 16-byte aligned, N and K multiples of 16 (M and SPLIT_K never are)
    aligned = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name, ty in sig.items()
               if ty.startswith("*") or name in ("N", "K")}
    kernel = compile(GluonASTSource(fn, sig, consts, aligned), target=_SM90, options={"num_warps": consts["num_warps"]})
    assert kernel.asm["cubin"], "ptxas produced no cubin"
    return kernel.asm["ptx"]


def w4a16_wgmma_ptx(bm: int, bn: int, bk: int, warps: int, stages: int = 4, dtype: str = "fp16",
                    per_channel: bool = False, zeros: bool = False, split: bool = False, band: int = 1,
                    bias: bool = True, pdl: bool = True) -> str:
    """PTX of w4a16_wgmma's kernel for one tile (BLOCK_M tokens x BLOCK_N weight rows x BLOCK_K inputs), g128 or per
    channel (K 4096)."""
    from .w4a16_wgmma import _w4a16_wgmma_kernel as fn

    sig = {"x_desc": _descriptor(dtype, [bm, 64]), "w_desc": _descriptor("i16", [bn, bk // 4]), "s_ptr": "*" + dtype,
           "z_ptr": "*u8", "bias_ptr": "*" + dtype, "out_ptr": "*" + dtype, "part_ptr": "*fp32", "count_ptr": "*i32"}
    return _compile(fn, sig, dict(GROUP=4096 if per_channel else 128, PER_CHANNEL=per_channel, HAS_ZEROS=zeros,
                                  HAS_BIAS=bias, IS_SPLIT=split, STAGES=stages, BAND=band, PDL=pdl, num_warps=warps))


def w4a16_tma_gemv_ptx(bn: int, bk: int, warps: int, stages: int = 4, per_channel: bool = False,
                       zeros: bool = False, split: bool = False, bias: bool = True, pdl: bool = True) -> str:
    """PTX of w4a16_tma_gemv's kernel for one tile (BLOCK_N weight rows x BLOCK_K inputs), fp16, g128 or per channel
    (K 4096)."""
    from .w4a16_tma_gemv import WORDS_SMEM_LAYOUT
    from .w4a16_tma_gemv import _w4a16_tma_gemv_kernel as fn

    sig = {"w_desc": f"tensordesc<i32[{bn}, {bk // 8}],{WORDS_SMEM_LAYOUT!r}>", "x_ptr": "*fp16", "s_ptr": "*fp16",
           "z_ptr": "*u8", "bias_ptr": "*fp16", "out_ptr": "*fp16", "part_ptr": "*fp32", "count_ptr": "*i32"}
    return _compile(fn, sig, dict(GROUP=4096 if per_channel else 128, PER_CHANNEL=per_channel, HAS_ZEROS=zeros,
                                  HAS_BIAS=bias, IS_SPLIT=split, STAGES=stages, PDL=pdl, num_warps=warps))


def w4a8_wgmma_ptx(bm: int, bn: int, warps: int, stages: int = 4, two_level: bool = True, split: bool = False,
                   band: int = 1, pdl: bool = True, bias: bool = True) -> str:
    """PTX of w4a8_wgmma's kernel for one tile (BLOCK_K 128), two-level g128 or per channel."""
    from .w4a8_wgmma import _w4a8_wgmma_kernel as fn

    sig = {"x_desc": _descriptor("i8", [bm, 64]), "w_desc": _descriptor("i8", [bn, 64]), "ts_ptr": "*fp32",
           "cs_ptr": "*fp32", "gs_ptr": "*fp16", "bias_ptr": "*fp16", "out_ptr": "*fp16", "part_ptr": "*fp32",
           "count_ptr": "*i32"}
    return _compile(fn, sig, dict(GROUP=128, TWO_LEVEL=two_level, HAS_BIAS=bias, IS_SPLIT=split, STAGES=stages,
                                  BAND=band, PDL=pdl, num_warps=warps))


def ptxas_report(ptx: str) -> dict:
    """ptxas -v on the PTX: registers, spill bytes stored, and whether it serialized the kernel's wgmmas (its warning
    C7515: another instruction writes a wgmma's accumulator between the wgmma and its wait)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        run = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    registers = re.search(r"Used (\d+) registers", run.stderr)
    spills = re.search(r"(\d+) bytes spill stores", run.stderr)
    if registers is None or spills is None:
        raise RuntimeError(f"unexpected ptxas report: {run.stderr[-2000:]}")
    return dict(registers=int(registers.group(1)), spill_bytes=int(spills.group(1)), serialized="C7515" in run.stderr,
                text=run.stderr)
