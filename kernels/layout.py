"""The weight and activation layouts every part of quantkit shares: kernels, formats, quantizers and QuantLinear.

The ground floor of the package: torch only (no Triton, nothing of quantkit), so that anything may import it.

- K-packed (QuantLinear's `qweight`, GPTQ's): int32 [K * bits / 32, N], element k of row r holding (bits k*b ..
  k*b+b-1) the unsigned code of input (32/b) r + k (`pack_along_rows` / `unpack_along_rows`).
- Swap layouts (the kernels that put the weight on wgmma's register side, see kernels/w4a16_swap.py): one weight row
  per output, 64-input chunks cut into nibble slices of contiguous inputs (`pack_nibble_slices`): int16 [N, K/4] with
  four slices of 16 for W4A16 (`repack_for_swap`), int8 [N, K/2] with two slices of 32, codes xor 8, for W4A8
  (`repack_for_w4a8_swap`); either optionally in K blocks (`k_blocked`, `layout_shape`).
- Per-token symmetric int8 activations (`int8_tokens`), what the W4A8 kernels and QQQ compute.
- float8 e4m3 rows (`fp8_row_scales`, `to_fp8`, `fp8_tokens`): FP8's weights per output channel and activations per
  token.
"""

from __future__ import annotations

import torch

CHUNK = 64  # inputs per chunk of a swap-layout row: the nibble slices of a chunk hold its inputs in contiguous runs


def pack_along_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [K, N] -> int32 [K * bits / 32, N], element k of row r = code of row (32/bits)*r + k."""
    per_word = 32 // bits
    k, n = codes.shape
    if k % per_word:
        raise ValueError(f"input size {k} is not a multiple of {per_word} ({bits}-bit codes per int32)")
    rows = codes.reshape(k // per_word, per_word, n)
    packed = torch.zeros(k // per_word, n, dtype=torch.int32, device=codes.device)
    for i in range(per_word):  # one int32 slice at a time: no int64 copy of the whole matrix (70B: GBs)
        packed |= rows[:, i].to(torch.int32) << (i * bits)  # the top code wraps into the sign bit, as stored
    return packed


def unpack_along_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_along_rows: int32 [K * bits / 32, N] -> uint8 codes [K, N]."""
    per_word = 32 // bits
    rows, n = packed.shape
    shifts = (torch.arange(per_word, device=packed.device, dtype=torch.int32) * bits).view(1, -1, 1)
    c = (packed.unsqueeze(1) >> shifts) & (2**bits - 1)
    return c.reshape(rows * per_word, n).to(torch.uint8)


# int8 products are at most 127 * 128 in magnitude: any 1024 of them, summed in any order, stay below 2**24,
# where fp32 holds every integer
EXACT_FP32_PRODUCTS = 1024


def int_valued_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The exact sums of a [M, K] @ b [K, N] for int8 values held in fp32 or float64: one matmul when
    K <= EXACT_FP32_PRODUCTS, else K slices that short summed in float64 (int8_matmul's path on the CPU; on CUDA
    fp32 matmuls may round to TF32: give float64 there)."""
    if a.shape[1] <= EXACT_FP32_PRODUCTS:
        return a @ b
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64, device=a.device)
    for start in range(0, a.shape[1], EXACT_FP32_PRODUCTS):
        end = start + EXACT_FP32_PRODUCTS
        out += a[:, start:end] @ b[start:end]
    return out


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a int8 [M, K] @ b int8 [K, N] -> int32 [M, N], exactly. torch._int_mm on CUDA; elsewhere (and for shapes
    CUDA's _int_mm refuses) fp32 matmuls over K slices short enough to be exact, summed in int32: CPU _int_mm ran
    25-40x slower than an fp32 matmul of the same shape on an AVX2 machine without VNNI (AMD EPYC, torch 2.13)."""
    if a.is_cuda and a.shape[0] > 16 and a.shape[1] % 8 == 0 and b.shape[1] % 8 == 0:  # what CUDA _int_mm takes
        return torch._int_mm(a, b)
    wide = torch.float32 if a.device.type == "cpu" else torch.float64  # CUDA fp32 matmuls may round to TF32
    return int_valued_matmul(a.to(wide), b.to(wide)).to(torch.int32)


def int8_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8: codes round(x / s) (int8, x's shape) and s = max|x_token| / 127 (fp32 [..., 1])."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-8) / 127.0
    codes = x.float() / scale  # a new tensor: round and clamp in place
    return codes.round_().clamp_(-127, 127).to(torch.int8), scale


FP8_MAX = 448.0  # the largest float8 e4m3 (fn) value
# The smallest per-row scale: an all-zero row quantizes to zeros instead of 0 / 0 (vLLM's dynamic per-token
# quantization bounds its scales the same way).
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def fp8_row_scales(x: torch.Tensor) -> torch.Tensor:
    """One fp32 scale per row of x [..., K]: max |x| / 448 (the whole e4m3 range), at least FP8_MIN_SCALE."""
    return (x.detach().abs().amax(dim=-1, keepdim=True).to(torch.float32) / FP8_MAX).clamp(min=FP8_MIN_SCALE)


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to the nearest float8 e4m3 (ties to even), saturated at +-448 (a CUDA cast would give NaN
    past it); scale broadcasts against x."""
    return (x.detach().to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, 1]), each token on the whole e4m3 range: FP8's activations."""
    scales = fp8_row_scales(x)
    return to_fp8(x, scales), scales


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
    """QuantLinear's int32 [K/8, N] -> the W4A16 swap layout, int16 [N, K/4]: element (n, t) holds in nibble j
    the input 64 (t // 16) + 16 j + t % 16."""
    return pack_nibble_slices(qweight, (0, 4, 8, 12), torch.int16, columns=columns)


def repack_for_w4a8_swap(qweight: torch.Tensor, columns: int = 1024) -> torch.Tensor:
    """QuantLinear's int32 [K/8, N] -> the W4A8 swap layout, int8 [N, K/2]: byte (n, t) holds input
    64 (t // 32) + t % 32 in its high nibble and input 64 (t // 32) + 32 + t % 32 in its low one, each as q - 8 in
    4-bit two's complement (q xor 8)."""
    return pack_nibble_slices(qweight, (4, 0), torch.int8, xor=8, columns=columns)


def swap_layout_codes(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of repack_for_swap, for tests: int16 [N, K/4] -> codes [K, N] from the layout's definition,
    element by element."""
    n, quarter = packed.shape
    words = packed.to(torch.int32) & 0xFFFF
    codes = torch.empty(quarter * 4, n, dtype=torch.int32, device=packed.device)
    for t in range(quarter):
        for j in range(4):
            codes[CHUNK * (t // 16) + 16 * j + t % 16] = (words[:, t] >> (4 * j)) & 0xF
    return codes


def k_blocked(packed: torch.Tensor, k: int, block: int) -> torch.Tensor:
    """A swap-layout weight [N, K / p] (p inputs per element) in K blocks of `block` inputs: [K / block * N,
    block / p], block b of row n at row b N + n. A K tile of BLOCK_N rows inside one block is then one contiguous
    run of memory (one DRAM page run) instead of BLOCK_N runs a weight row apart; the swap kernels read either form
    (`layout_shape`). The plain layout is the case block = K."""
    n, width = packed.shape
    if k % block or width * block % k:
        raise ValueError(f"K {k} does not split into whole blocks of {block} inputs ({width} elements a row)")
    blocks = k // block
    return packed.view(n, blocks, width // blocks).transpose(0, 1).reshape(blocks * n, width // blocks)


def layout_shape(packed: torch.Tensor, k: int) -> tuple[int, int]:
    """(N, inputs per K block) of a 4-bit swap-layout weight, plain [N, K / p] or k_blocked (p = 2 inputs per byte)."""
    per_element = 2 * packed.element_size()
    return packed.numel() * per_element // k, packed.shape[1] * per_element


def checked_layout(packed: torch.Tensor, k: int, block_k: int, kernel: str) -> int:
    """N of a swap-layout weight whose K blocks hold whole K tiles of block_k inputs, else a ValueError."""
    n, block = layout_shape(packed, k)
    if block % block_k:
        raise ValueError(f"{kernel}: K tile {block_k} does not fit the weight's K blocks of {block} inputs")
    return n
