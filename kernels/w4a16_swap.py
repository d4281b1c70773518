"""W4A16 GEMM for M = 1..64 on Hopper: out^T = W x^T, with the dequantized weight as wgmma's register operand.

Hopper's wgmma takes its A operand from registers or shared memory and its B operand from shared memory only.
The tiled kernels of w4a16.py put x in A and the weight in B, so every dequantized weight tile is written to
shared memory, synchronised and read back before its mma: a serial chain per K tile. Swapping the operands
(out^T [N, M] = W [N, K] @ x^T [K, M]; N fills wgmma's 64-row M side, the few tokens its N = 16..64 side)
lets the weight stay in registers from dequantization to the mma, and leaves shared memory to what Triton
pipelines well: cp.async copies of the packed weight and of x, several K tiles ahead.

Triton builds the register operand by hoisting the layout conversion up to the weight's load
(OptimizeDotOperands, MMAV3HoistLayoutConversion) only through elementwise ops of non-narrowing types, from
a load or a constant: no broadcast, no int32 -> int16. Hence this kernel's own weight layout, repacked once
from QuantLinear's K-packed int32 (`repack_for_swap`): int16 [N, K/4], element (n, t) holding in nibble j
the input k = 64 (t // 16) + 16 j + t % 16. A K tile of the weight is then a contiguous [BLOCK_N, BLOCK_K/4]
load, nibble slice j of it (shift, mask, OR into the fp16 1024 / bf16 128 mantissa, bitcast, subtract the
zero) is the weight for the contiguous x columns 16 j + [0, 16) of each 64-input chunk, and all of that is
elementwise. The slices are q - 8; a zero point z (asymmetric layers) would be a broadcast inside that chain,
which stops the hoist, so it is applied to the dot result instead: sum x (q - z) = sum x (q - 8) + (8 - z)
sum x, with each K tile's x sum taken from the x slices already loaded. Groups of 64 or more (each K tile
inside one group: its fp32 dot result is corrected and scaled once) or per channel (at the end).
Split-K as in w4a16.py (fused, deterministic).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from quantkit.nn.qlinear import unpack_along_rows

from .w4a16 import _interpreting, _store_output, split_buffers

CHUNK = 64  # inputs per 16 int16 of a weight row: 4 nibble slices of 16 contiguous inputs each
_CHUNK = tl.constexpr(CHUNK)


def pack_nibble_slices(qweight: torch.Tensor, shifts: tuple[int, ...], dtype: torch.dtype, xor: int = 0,
                       columns: int = 1024) -> torch.Tensor:
    """QuantLinear's int32 [K/8, N] (nibble j of row r is input 8r + j) -> `dtype` [N, K / len(shifts)]
    whose element (n, t) holds, at bit shifts[j], the code (xor `xor`) of input 64 (t // r) + r j + t % r with
    r = 64 / len(shifts): slice j of a row is r contiguous inputs of each 64-input chunk. Done `columns`
    outputs at a time: the int32 temporaries are ~12 bytes per weight of the chunk, which for a 70B layer at
    once would be gigabytes of GPU memory."""
    k, n, slices = qweight.shape[0] * 8, qweight.shape[1], len(shifts)
    if k % CHUNK:
        raise ValueError(f"the swap layout needs K a multiple of {CHUNK}, got {k}")
    bits, run = 4 * slices, CHUNK // slices
    out = torch.empty(n, k // slices, dtype=dtype, device=qweight.device)
    for n0 in range(0, n, columns):
        codes = unpack_along_rows(qweight[:, n0:n0 + columns], 4).to(torch.int32) ^ xor  # [K, cols]
        by_slice = codes.t().reshape(-1, k // CHUNK, slices, run)  # input k = 64 c + r j + i -> [cols, c, j, i]
        packed = sum(by_slice[:, :, j, :] << shift for j, shift in enumerate(shifts))  # [cols, c, i]
        out[n0:n0 + columns] = torch.where(packed >= 2**(bits - 1), packed - 2**bits, packed).reshape(-1, k // slices)
    return out


def repack_for_swap(qweight: torch.Tensor, columns: int = 1024) -> torch.Tensor:
    """QuantLinear's int32 [K/8, N] -> this kernel's int16 [N, K/4] (see module doc)."""
    return pack_nibble_slices(qweight, (0, 4, 8, 12), torch.int16, columns=columns)


def swap_layout_codes(packed: torch.Tensor) -> torch.Tensor:
    """The inverse, for tests: int16 [N, K/4] -> codes [K, N] from the layout's definition, element by element."""
    n, quarter = packed.shape
    words = packed.to(torch.int32) & 0xFFFF
    codes = torch.empty(quarter * 4, n, dtype=torch.int32, device=packed.device)
    for t in range(quarter):
        for j in range(4):
            codes[CHUNK * (t // 16) + 16 * j + t % 16] = (words[:, t] >> (4 * j)) & 0xF
    return codes


def _slice_ptx(j: int, dtype: str) -> str:
    """Nibble slice j of two packed int16 ($1) as the pair q - 8 in fp16x2 / bf16x2 ($0), Marlin-style: lop3
    ORs the nibbles into the mantissa of 1024 (fp16) or 128 (bf16), where the spacing is 1, and one half2
    op removes it. fp16's odd slices are masked in place at 16 q (1024 + 16 q, still exact) and scaled back
    by the fma (1/16, -72), which saves their shift."""
    if dtype == "fp16":
        shift, mask, base = 8 * (j // 2), ("0x00F000F0" if j % 2 else "0x000F000F"), "0x64006400"
        fix = ("mov.b32 a, 0x2C002C00;\nmov.b32 b, 0xD480D480;\nfma.rn.f16x2 $0, t, a, b;" if j % 2 else
               "mov.b32 b, 0x64086408;\nsub.f16x2 $0, t, b;")  # odd: t / 16 - 72; even: t - 1032
    else:
        shift, mask, base = 4 * j, "0x000F000F", "0x43004300"
        fix = "mov.b32 a, 0x3F803F80;\nmov.b32 b, 0xC308C308;\nfma.rn.bf16x2 $0, t, a, b;"  # t * 1 - 136
    shr = f"shr.b32 t, $1, {shift};\n" if shift else "mov.b32 t, $1;\n"
    return ("{\n.reg .b32 t, a, b;\n" + shr + f"lop3.b32 t, t, {mask}, {base}, 0xEA;\n" + fix + "\n}")


_F0, _F1, _F2, _F3 = (tl.constexpr(_slice_ptx(j, "fp16")) for j in range(4))
_B0, _B1, _B2, _B3 = (tl.constexpr(_slice_ptx(j, "bf16")) for j in range(4))


@triton.jit
def _slice(h, j: tl.constexpr, DTYPE: tl.constexpr, PTX: tl.constexpr):
    """Nibble slice j of the int16 weight tile as q - 8 in DTYPE: elementwise, so Triton keeps it (and the
    weight's load) in wgmma's register-operand layout."""
    if PTX:
        fp16: tl.constexpr = DTYPE == tl.float16
        if j == 0:
            asm: tl.constexpr = _F0 if fp16 else _B0
        elif j == 1:
            asm: tl.constexpr = _F1 if fp16 else _B1
        elif j == 2:
            asm: tl.constexpr = _F2 if fp16 else _B2
        else:
            asm: tl.constexpr = _F3 if fp16 else _B3
        w = tl.inline_asm_elementwise(asm, "=r,r", [h], dtype=tl.float16 if fp16 else tl.bfloat16, is_pure=True,
                                      pack=2)
    elif DTYPE == tl.float16:  # 0x6400 | q is fp16 1024 + q; minus 1032 leaves q - 8 exactly
        w = (((h >> (4 * j)) & 0xF) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
    else:  # the interpreter (bf16 there: no int16 -> bf16 bitcast, no bf16 dot)
        w = ((h >> (4 * j)) & 0xF).to(tl.float32) - 8.0
    return w


@triton.jit
def _swap_program(M, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(pid, pid_k, offs_m, offs_n) of a swap kernel program; the M blocks of one weight tile run together
    (L2 reuse)."""
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    grid_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = pid % grid_m, pid // grid_m
    return pid, pid_k, pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _w4a16_swap_kernel(x_ptr, h_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K,
                       GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_ZEROS: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, UPCAST_DOT: tl.constexpr, PTX: tl.constexpr):
    pid, pid_k, offs_m, offs_n = _swap_program(M, BLOCK_M, BLOCK_N)
    offs_t = tl.arange(0, BLOCK_K // 4)
    h_ptrs = h_ptr + offs_n[:, None] * (K // 4) + offs_t[None, :]
    x_ptrs = x_ptr + offs_m[None, :] * K + ((offs_t // 16) * _CHUNK + offs_t % 16)[:, None]  # slice 0, [BK/4, BM]
    m_mask = offs_m[None, :] < M
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # zero points: x summed elementwise over the slices (a reduction per slice cost more than the dots), reduced
    # once per K tile (groups) or once at the end (per channel)
    x_run = tl.zeros((BLOCK_K // 4, BLOCK_M), dtype=tl.float32)
    for kt in range(pid_k, K // BLOCK_K, SPLIT_K):
        k0 = kt * BLOCK_K
        h = tl.load(h_ptrs + k0 // 4)
        tile = acc if PER_CHANNEL else tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if not PER_CHANNEL:
            x_run = tl.zeros((BLOCK_K // 4, BLOCK_M), dtype=tl.float32)
        for j in tl.static_range(4):
            w = _slice(h, j, dtype, PTX)
            xt = tl.load(x_ptrs + k0 + 16 * j, mask=m_mask, other=0.0)
            if HAS_ZEROS:
                x_run += xt.to(tl.float32)
            if UPCAST_DOT:
                tile = tl.dot(w.to(tl.float32), xt.to(tl.float32), tile, input_precision="ieee")
            else:
                tile = tl.dot(w, xt, tile)
        if PER_CHANNEL:
            acc = tile
        else:
            if HAS_ZEROS:  # sum x (q - z) = sum x (q - 8) + (8 - z) sum x: the zero stays out of the operand
                z = tl.load(z_ptr + (k0 // GROUP) * N + offs_n).to(tl.float32)
                tile += (8.0 - z)[:, None] * tl.sum(x_run, axis=0)[None, :]
            acc += tile * tl.load(s_ptr + (k0 // GROUP) * N + offs_n).to(tl.float32)[:, None]
    if PER_CHANNEL:
        if HAS_ZEROS:
            acc += (8.0 - tl.load(z_ptr + offs_n).to(tl.float32))[:, None] * tl.sum(x_run, axis=0)[None, :]
        acc *= tl.load(s_ptr + offs_n).to(tl.float32)[:, None]
    _store_output(tl.trans(acc), out_ptr, part_ptr, count_ptr, bias_ptr, offs_m, offs_n, M, N, pid_k, pid,
                  SPLIT_K, SPLIT_K > 1, HAS_BIAS)


def swap_supported(k: int, n: int, group_size: int) -> bool:
    """Whether `w4a16_swap_matmul` takes this layer (with tiles of 64: BLOCK_K, BLOCK_N dividing group, N)."""
    return k % CHUNK == 0 and n % 64 == 0 and (group_size == k or group_size % CHUNK == 0)


def w4a16_swap_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                      bias: torch.Tensor | None, group_size: int, config: dict) -> torch.Tensor:
    """x [M, K] contiguous (scales' dtype), packed = repack_for_swap(qweight), zeros [G, N] (uint8) or None
    (symmetric: 8) -> [M, N]."""
    m, k = x.shape
    n = packed.shape[0]
    split, block_m, block_n, block_k = config["SPLIT_K"], config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    if k % block_k or n % block_n or (group_size != k and group_size % block_k):
        raise ValueError(f"swap kernel: K tile {block_k} / N tile {block_n} must divide K {k} / N {n} and "
                         f"the group {group_size}")
    grid = (triton.cdiv(m, block_m) * (n // block_n), split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part, counters = split_buffers(split, m, n, math.prod(grid[:-1]), x.device) if split > 1 else (out, out)
    _w4a16_swap_kernel[grid](
        x, packed, scales, zeros if zeros is not None else packed, bias if bias is not None else scales, out, part,
        counters, m, n, k, GROUP=group_size, PER_CHANNEL=group_size == k, HAS_ZEROS=zeros is not None,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
        UPCAST_DOT=x.dtype == torch.bfloat16 and _interpreting(),  # the interpreter's bf16 is wrong (3.9)
        PTX=not _interpreting(),
        num_warps=config["num_warps"], num_stages=config["num_stages"])
    return out
