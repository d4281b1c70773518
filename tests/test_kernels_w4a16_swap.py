"""The swap-AB W4A16 kernel (register-operand wgmma) and its weight layout, under Triton's CPU interpreter."""

from __future__ import annotations

import functools
import operator
import os
from collections import Counter
from dataclasses import replace

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels are decorated at import

import pytest
import torch
from quantkit.kernels.layout import (
    k_blocked,
    layout_shape,
    repack_for_swap,
    repack_for_w4a8_swap,
    swap_layout_codes,
    unpack_along_rows,
)
from quantkit.kernels.spec import TileConfig
from quantkit.kernels.w4a16_swap import (
    swap_supported,
    w4a16_swap_gemv,
    w4a16_swap_matmul,
)
from test_kernels_w4a16 import (  # noqa: F401  (poisoned_outputs: a fixture)
    TOLERANCE,
    compile_for_sm90,
    poisoned_outputs,
    random_layer,
    reference_w4a16,
    relative_error,
)


def test_k_blocked_layout_moves_every_element_to_its_block_row() -> None:
    gen = torch.Generator().manual_seed(1)
    k, n = 512, 24
    qweight = torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=gen, dtype=torch.int32)
    for packed in (repack_for_swap(qweight), repack_for_w4a8_swap(qweight)):  # 4 / 2 inputs per element
        per_element = k // packed.shape[1]
        assert layout_shape(packed, k) == (n, k)  # the plain layout: one block of all of K
        for block in (64, 128, 512):
            blocked = k_blocked(packed, k, block)
            width = block // per_element
            assert blocked.shape == (k // block * n, width) and blocked.is_contiguous()
            assert layout_shape(blocked, k) == (n, block)
            for row in range(n):
                for col in range(packed.shape[1]):  # column col of row n at row (col // width) N + n
                    assert blocked[col // width * n + row, col % width] == packed[row, col]
    with pytest.raises(ValueError, match="whole blocks of 96 inputs"):
        k_blocked(repack_for_swap(qweight), k, 96)


def test_repack_follows_the_layout_definition() -> None:
    gen = torch.Generator().manual_seed(0)
    qweight = torch.randint(-2**31, 2**31 - 1, (192 // 8, 24), generator=gen, dtype=torch.int32)
    packed = repack_for_swap(qweight)
    assert packed.shape == (24, 192 // 4) and packed.dtype == torch.int16
    assert torch.equal(swap_layout_codes(packed), unpack_along_rows(qweight, 4).to(torch.int32))
    assert torch.equal(repack_for_swap(qweight, columns=5), packed)  # chunked: the same layout
    with pytest.raises(ValueError, match="multiple of 64"):
        repack_for_swap(qweight[:4])


def test_supported_shapes() -> None:
    assert swap_supported(4096, 6144, 128) and swap_supported(4096, 4096, 4096)
    assert not swap_supported(4096, 4096, 32) and not swap_supported(4096, 4100, 128)


def swap_config(block_m: int, block_n: int, block_k: int, split_k: int) -> TileConfig:
    return TileConfig("swap", block_m, block_n, block_k, split_k, num_warps=4, num_stages=2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [64, 128, -1])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.usefixtures("poisoned_outputs")
def test_matches_float64(dtype: torch.dtype, group: int, sym: bool) -> None:
    layer = random_layer(256, 128, group, dtype, sym=sym, seed=group + 3)
    packed = repack_for_swap(layer.qweight)
    zeros = None if sym else layer.zeros
    for m, config in [(1, swap_config(16, 64, 64, 1)), (19, swap_config(16, 64, 128, 2)),  # two M blocks, split K
                      (5, swap_config(32, 128, 64, 4))]:
        if group != -1:  # a K tile never spans two groups
            config = replace(config, block_k=min(config.block_k, group))
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(dtype)
        out = w4a16_swap_matmul(x, packed, layer.scales, zeros, layer.bias, layer.group_size, config)
        assert out.shape == (m, 128) and out.dtype == dtype and not out.isnan().any(), config
        assert relative_error(out, reference_w4a16(layer, x)) < TOLERANCE[dtype], config
    with pytest.raises(ValueError, match="K tile"):
        w4a16_swap_matmul(x, packed, layer.scales, zeros, None, 64, replace(config, block_k=128))


def halves(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int32 bits -> [.., 2] float64 values of the two 16-bit `dtype` halves."""
    pair = torch.stack([v & 0xFFFF, v >> 16], dim=-1).to(torch.int32)
    return torch.where(pair >= 2**15, pair - 2**16, pair).to(torch.int16).view(dtype).double()


def pair_bits(values: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """[..., 2] values rounded to `dtype` -> int64 holding them as one 16x2 register (element 0 in the low half)."""
    h = values.to(dtype).view(torch.int16).to(torch.int64) & 0xFFFF
    return h[..., 0] | (h[..., 1] << 16)


def run_ptx(asm: str, words: torch.Tensor, dtype: torch.dtype = torch.float16,
            inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Executes one of the kernels' PTX blocks on every int32 of `words` ($1; more input registers in `inputs`)
    and returns $0: its 32 bits, or its value for an f32 result. A tiny interpreter of the instructions the
    blocks use: half2 arithmetic on `dtype` computed exactly in float64 and rounded once, as the GPU's is."""
    regs = {"$1": words.to(torch.int64) & 0xFFFFFFFF, **(inputs or {})}

    def value(operand: str) -> torch.Tensor:
        return regs[operand] if operand in regs else torch.full_like(words, int(operand, 0), dtype=torch.int64)

    for line in asm.splitlines():
        parts = line.strip().rstrip(";").replace(",", " ").split()
        if not parts or parts[0].startswith((".reg", "{", "}")):
            continue
        op, dst, *src = parts
        if op == "mov.b32" and dst.startswith("{"):  # mov.b32 {lo, hi}, a: split into 16-bit halves
            whole = value(src[1])
            regs[dst[1:]], regs[src[0][:-1]] = whole & 0xFFFF, whole >> 16
            continue
        a = [value(s) for s in src]
        if op == "cvt.f32.f16":
            regs[dst] = halves(a[0], dtype)[..., 0].float()
        elif op == "add.f32":
            regs[dst] = a[0] + a[1]
        elif op == "mov.b32":
            regs[dst] = a[0]
        elif op == "shr.b32":
            regs[dst] = a[0] >> a[1]
        elif op == "shl.b32":
            regs[dst] = (a[0] << a[1]) & 0xFFFFFFFF
        elif op == "and.b32":
            regs[dst] = a[0] & a[1]
        elif op == "lop3.b32":  # any function of three inputs, given by its truth table on 0xF0, 0xCC, 0xAA
            full, lut = 0xFFFFFFFF, int(src[3], 0)
            terms = [(a[0] if i & 4 else full ^ a[0]) & (a[1] if i & 2 else full ^ a[1]) & (a[2] if i & 1 else full ^ a[2])
                     for i in range(8) if lut >> i & 1]
            regs[dst] = functools.reduce(operator.or_, terms, torch.zeros_like(a[0]))
        elif op == "xor.b32":
            regs[dst] = a[0] ^ a[1]
        elif op == "mad.lo.u32":
            regs[dst] = (a[0] * a[1] + a[2]) & 0xFFFFFFFF
        elif op in ("sub.f16x2", "mul.rn.f16x2", "fma.rn.f16x2", "fma.rn.bf16x2"):
            h = [halves(v, dtype) for v in a]
            regs[dst] = pair_bits(h[0] - h[1] if op.startswith("sub") else h[0] * h[1] if op.startswith("mul")
                                  else h[0] * h[1] + h[2], dtype)
        else:
            raise AssertionError(f"unknown instruction {line!r}")
    return regs["$0"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_slice_ptx_gives_codes_minus_eight(dtype: torch.dtype) -> None:
    """Every pair of int16 (all nibble values in both halves): slice j of the PTX is nibble j minus 8."""
    from quantkit.kernels.common import slice_ptx

    values = torch.arange(-2**15, 2**15, 7, dtype=torch.int64)
    packed = (values & 0xFFFF) | (values.flip(0) & 0xFFFF) << 16
    pair = torch.stack([values, values.flip(0)], dim=-1) & 0xFFFF
    for j in range(4):
        out = halves(run_ptx(slice_ptx(j, "fp16" if dtype == torch.float16 else "bf16"), packed, dtype), dtype)
        assert torch.equal(out, ((pair >> (4 * j)) & 0xF).double() - 8), j


REGISTER_OPERAND_CHECK = """
import re
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile


def check_register_operand(fn, sig, consts, mma, marker, warps=4):
    \"\"\"Compiles fn for sm_90 (pointers, N and K 16-aligned, as the launches see them) and checks that the mma
    (wgmma, or mma.sync for 2-warp tiles) takes A from registers (a {...} register list, not a descriptor), that
    nothing but the pipelined cp.async copies goes through shared memory inside the K loop, and that `marker`
    (the slice PTX) assembled.\"\"\"
    aligned = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig if a != "M"}
    sig = {**sig, **{name: "constexpr" for name in fn.arg_names if name not in sig}}
    kernel = compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=aligned),
                     target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 4})
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    loop = ttgir[ttgir.index("scf.for"):]
    assert re.search(mma + r" [{][^}]*[}], [{]", ptx), "no register-operand mma"
    assert warps % 4 == 0 or "wgmma" not in ptx
    assert marker in ptx and kernel.asm["cubin"]
    assert not re.search(r"local_alloc %", loop), "a tensor goes through shared memory inside the K loop"
    assert "async_copy_global_to_local" in ttgir, "weight and x loads are not pipelined (cp.async)"
    return ptx
"""

SWAP_COMPILE = REGISTER_OPERAND_CHECK + """
from quantkit.kernels.w4a16_swap import _w4a16_swap_kernel as fn
for dtype in ("fp16", "bf16"):
    for per_channel, split, zeros in ((False, 4, False), (True, 1, False), (False, 4, True), (True, 1, True)):
        sig = {"x_ptr": "*" + dtype, "h_ptr": "*i16", "s_ptr": "*" + dtype, "z_ptr": "*u8", "bias_ptr": "*" + dtype,
               "out_ptr": "*" + dtype, "part_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
               "W": "i32"}
        consts = dict(GROUP=128, PER_CHANNEL=per_channel, HAS_ZEROS=zeros, HAS_BIAS=True, BLOCK_M=16,
                      BLOCK_N=128, BLOCK_K=128, SPLIT_K=split, UPCAST_DOT=False, PTX=True)
        check_register_operand(fn, sig, consts, r"wgmma.mma_async.sync.aligned.m64n16k16.f32.[bf0-9]+.[bf0-9]+",
                               "lop3.b32")
        # the tuner's 2-warp tiles: mma.sync (no warpgroup-wide wait), the same register path
        check_register_operand(fn, sig, consts, r"mma.sync.aligned.m16n8k16.row.col.f32.[bf0-9]+.[bf0-9]+.f32",
                               "lop3.b32", warps=2)
print("compiled")
"""


def test_swap_kernel_compiles_to_register_operand_wgmma_for_sm90() -> None:
    """What the kernel exists for, checked on its sm_90 compile (Triton's bundled ptxas, no GPU needed):
    wgmma takes the dequantized weight from registers, nothing goes through shared memory inside the K loop
    but the cp.async copies of the packed weight and x, and the PTX slices assemble."""
    compile_for_sm90(SWAP_COMPILE)


@pytest.mark.parametrize("scheme", ["w4a16", "w4a8"])
def test_swap_configs_lead_the_tuner_from_two_tokens_to_64(scheme: str) -> None:
    from quantkit.kernels.autotune import candidates

    # one token: a gemv; fp16 W4A16 the one on the swap layout (faster than gemv_h2 on 5 of 6 H200 shapes), bf16
    # gemv_h2's fp32 one (neither has half2 PTX for bf16)
    first = "swap_gemv" if scheme == "w4a16" else "gemv_h2"
    assert candidates(scheme, 1, 4096, 4096, 128, swap=True)[0].kernel == first
    assert candidates(scheme, 1, 4096, 4096, 128, swap=True, fp16=False)[0].kernel == "gemv_h2"
    for m in (1, 4):  # W4A16 also times the gemv on the swap layout
        gemvs = [c for c in candidates(scheme, m, 4096, 4096, 128, swap=True) if c.kernel == "swap_gemv"]
        assert bool(gemvs) == (scheme == "w4a16") and all(c.num_stages == 1 for c in gemvs)
    for m in (2, 16, 64):
        first = candidates(scheme, m, 4096, 4096, 128, swap=True)[0]
        assert first.kernel == "swap" and first.block_m == max(16, m) and first.block_k == 128
    assert all(c.kernel != "swap" for c in candidates(scheme, 16, 4096, 4096, 128))  # no swap layout
    for m in (1, 16):  # with one, the other tiled kinds keep two fallback configs each; the gemvs all stay
        kinds = Counter(c.kernel for c in candidates(scheme, m, 4096, 4096, 128, swap=True))
        plain = Counter(c.kernel for c in candidates(scheme, m, 4096, 4096, 128))
        assert all(kinds[k] == min(2, n) for k, n in plain.items() if k not in ("gemv", "gemv_h2"))
        assert all(kinds[k] == n for k, n in plain.items() if k in ("gemv", "gemv_h2"))
    for m in (256, 1024):  # W4A8 at M = 128..512: 128-token tiles join the timed candidates, not the default
        large = candidates(scheme, m, 4096, 4096, 128, swap=True)
        swapped = {c.block_m for c in large if c.kernel == "swap"}
        assert large[0].kernel != "swap" and swapped == ({128} if (scheme, m) == ("w4a8", 256) else set())
    swapped = [c for c in candidates(scheme, 16, 4160, 4096, 64, swap=True) if c.kernel == "swap"]
    assert swapped and all(c.block_k == 64 and 4160 % c.block_n == 0 for c in swapped)  # g64: K tile 64


def swap_gemv_config(block_n: int, block_k: int, split_k: int) -> TileConfig:
    return TileConfig("swap_gemv", 1, block_n, block_k, split_k, num_warps=4, num_stages=1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [64, 128, -1])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.usefixtures("poisoned_outputs")
def test_swap_gemv_matches_float64(dtype: torch.dtype, group: int, sym: bool) -> None:
    """The gemv on the swap layout (its fp32 loop: the interpreter runs no PTX) for one and several tokens,
    K tiles holding several groups, one group, or inside one, split K."""
    layer = random_layer(512, 128, group, dtype, sym=sym, seed=group + 11)
    packed = repack_for_swap(layer.qweight)
    zeros = None if sym else layer.zeros
    for m, config in [(1, swap_gemv_config(64, 256, 1)), (3, swap_gemv_config(32, 128, 2)), (2, swap_gemv_config(128, 64, 4))]:
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).to(dtype)
        out = w4a16_swap_gemv(x, packed, layer.scales, zeros, layer.bias, layer.group_size, config)
        assert out.shape == (m, 128) and out.dtype == dtype and not out.isnan().any(), config
        assert relative_error(out, reference_w4a16(layer, x)) < TOLERANCE[dtype], config
    with pytest.raises(ValueError, match="does not fit"):
        w4a16_swap_gemv(x, packed, layer.scales, zeros, None, layer.group_size, replace(config, block_k=96))


@pytest.mark.parametrize("x_scale", [1.0, 6e4])
@pytest.mark.parametrize("zeros", [False, True])
def test_swap_gemv_word_dot_ptx(x_scale: float, zeros: bool) -> None:
    """The gemv's PTX word dot, executed instruction by instruction: every weight becomes (q - z) / 64 exactly,
    each lane sums its 4 products with one fp16 rounding per step, the lanes meet in fp32; that stays within
    fp16 rounding of the exact dot / 64 and finite for activations up to the top of the fp16 range."""
    from quantkit.kernels.common import gemv_word_dot_ptx

    gen = torch.Generator().manual_seed(7)
    words = torch.randint(-2**31, 2**31 - 1, (4096,), generator=gen, dtype=torch.int64)
    x = (torch.randn(4096, 4, 2, generator=gen) * x_scale).clamp(-65504, 65504).half()  # [word, slice j, lane b]
    z = torch.randint(0, 16, (4096,), generator=gen) if zeros else torch.full((4096,), 8)
    inputs = {f"${2 + j}": pair_bits(x[:, j]) for j in range(4)}
    if zeros:
        inputs["$6"] = pair_bits(torch.stack([-(16 + z / 64)] * 2, dim=-1))
        inputs["$7"] = pair_bits(torch.stack([-(1 + z / 64)] * 2, dim=-1))
    got = run_ptx(gemv_word_dot_ptx(zeros), words, inputs=inputs)
    codes = torch.stack([torch.stack([(words >> (16 * b + 4 * j)) & 0xF for b in range(2)], -1) for j in range(4)], 1)
    w = (codes - z[:, None, None]).double() / 64  # [word, j, b]
    lanes = torch.zeros(4096, 2, dtype=torch.float16)
    for j in range(4):  # one fused multiply-add per step, rounded once (exact in float64 before it)
        lanes = (w[:, j] * x[:, j].double() + lanes.double()).half()
    assert torch.equal(got, lanes[:, 0].float() + lanes[:, 1].float())
    exact = (w * x.double()).sum(dim=(1, 2))
    assert got.isfinite().all()
    assert ((got.double() - exact).abs() <= 2e-3 * (w.abs() * x.double().abs()).sum(dim=(1, 2)) + 1e-30).all()


SWAP_GEMV_COMPILE = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from quantkit.kernels.w4a16_swap import _w4a16_swap_gemv_kernel as fn
sig = {"x_ptr": "*fp16", "h_ptr": "*i16", "s_ptr": "*fp16", "z_ptr": "*u8", "bias_ptr": "*fp16", "out_ptr": "*fp16",
       "part_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "W": "i32", "SPLIT_K": "i32"}
sig = {**sig, **{name: "constexpr" for name in fn.arg_names if name not in sig}}
for group, words, zeros, split in ((128, 16, False, True), (128, 16, True, False), (4096, 64, True, True),
                                   (64, 8, False, True)):
    consts = dict(GROUP=group, PER_CHANNEL=group == 4096, HAS_ZEROS=zeros, HAS_BIAS=True, BLOCK_N=32,
                  BLOCK_K=512, GROUP_WORDS=words, IS_SPLIT=split, PTX=True)
    kernel = compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                     options={"num_warps": 4})
    ptx = kernel.asm["ptx"]
    assert ptx.count("lop3.b32") >= 4 and "prmt" not in ptx and kernel.asm["cubin"], consts
    assert ("atom" in ptx) == split, "split-K counter"
print("compiled")
"""


def test_swap_gemv_compiles_for_sm90() -> None:
    """The PTX word dots assemble for sm_90 (every zero / group / split variant; no x shuffles)."""
    compile_for_sm90(SWAP_GEMV_COMPILE)
