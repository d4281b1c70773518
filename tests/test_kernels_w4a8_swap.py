"""The swap-AB W4A8 kernel (int8 register-operand wgmma) and its weight layout, under Triton's CPU interpreter."""

from __future__ import annotations

import os
from dataclasses import replace

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels are decorated at import

import pytest
import torch
from quantkit.kernels import SWAP_BLOCK, swap_weight_for
from quantkit.kernels.autotune import candidates
from quantkit.kernels.common import HIGH_SLICE_K_PTX, HIGH_SLICE_PTX, LOW_SLICE_K_PTX, LOW_SLICE_PTX
from quantkit.kernels.layout import (
    k_blocked,
    layout_shape,
    repack_for_swap,
    repack_for_w4a8_swap,
    unpack_along_rows,
)
from quantkit.kernels.w4a8_swap import w4a8_swap_matmul, w4a8_swap_supported
from quantkit.kernels.w4a16_swap import (
    w4a16_swap_gemv,
    w4a16_swap_matmul,
)
from test_kernels_w4a8 import TOLERANCE, reference_w4a8
from test_kernels_w4a16 import compile_for_sm90, poisoned_outputs, random_layer, relative_error  # noqa: F401
from test_kernels_w4a16_swap import REGISTER_OPERAND_CHECK, run_ptx, swap_config, swap_gemv_config

from quantkit.nn.qlinear import QuantLinear


def layout_codes(packed: torch.Tensor) -> torch.Tensor:
    """The layout's definition, element by element: int8 [N, K/2] -> codes [K, N]."""
    n, half = packed.shape
    byte = packed.to(torch.int32) & 0xFF
    codes = torch.empty(half * 2, n, dtype=torch.int32)
    for t in range(half):
        codes[64 * (t // 32) + t % 32] = (byte[:, t] >> 4) ^ 8
        codes[64 * (t // 32) + 32 + t % 32] = (byte[:, t] & 0xF) ^ 8
    return codes


def qqq_layer(k: int, n: int, group: int, dtype: torch.dtype, seed: int = 0,
              two_level: bool | None = None) -> QuantLinear:
    """Symmetric W4A8 layer as quantkit's QQQ writes it: two-level (default: with groups) group scales are
    integers 1..16."""
    two_level = group != -1 if two_level is None else two_level
    layer = random_layer(k, n, group, dtype, sym=True, act_bits=8, two_level=two_level, seed=seed)
    if two_level:
        gen = torch.Generator().manual_seed(seed)
        layer.scales.copy_(torch.randint(1, 17, layer.scales.shape, generator=gen).to(dtype))
    return layer


def test_repack_follows_the_layout_definition() -> None:
    gen = torch.Generator().manual_seed(0)
    qweight = torch.randint(-2**31, 2**31 - 1, (192 // 8, 24), generator=gen, dtype=torch.int32)
    packed = repack_for_w4a8_swap(qweight)
    assert packed.shape == (24, 192 // 2) and packed.dtype == torch.int8
    assert torch.equal(layout_codes(packed), unpack_along_rows(qweight, 4).to(torch.int32))
    assert torch.equal(repack_for_w4a8_swap(qweight, columns=7), packed)


def test_slices_are_sixteen_times_code_minus_eight() -> None:
    """Both PTX slices on every byte value in every byte position: 16 (q - 8) of the high / low nibble."""
    values = torch.arange(256, dtype=torch.int64)
    for position in range(4):
        words = values << (8 * position) | (values.flip(0) << (8 * ((position + 1) % 4)))
        for asm, nibble in ((HIGH_SLICE_PTX.value, values >> 4), (LOW_SLICE_PTX.value, values & 0xF)):
            byte = (run_ptx(asm, words) >> (8 * position)) & 0xFF
            signed = torch.where(byte >= 128, byte - 256, byte)
            assert torch.equal(signed, 16 * ((nibble ^ 8) - 8)), asm


def test_two_level_slices_are_qqq_int8_weights() -> None:
    """Both two-level PTX slices on every byte value in every byte position, for every multiplier k in 0..16 (with
    the byte offsets the kernels pass): the int8 (q - 8) k of the high / low nibble, no carry between bytes."""
    values = torch.arange(256, dtype=torch.int64)
    for k in range(17):
        regs = {"$2": torch.full_like(values, k), "$6": torch.full_like(values, (128 - 8 * k) * 0x01010101)}
        for position in range(4):
            words = values << (8 * position) | (values.flip(0) << (8 * ((position + 1) % 4)))
            for asm, nibble in ((HIGH_SLICE_K_PTX.value, values >> 4), (LOW_SLICE_K_PTX.value, values & 0xF)):
                out = run_ptx(asm, words, inputs=regs)
                for shift, codes in ((8 * position, nibble), (8 * ((position + 1) % 4), nibble.flip(0))):
                    byte = (out >> shift) & 0xFF
                    assert torch.equal(torch.where(byte >= 128, byte - 256, byte), ((codes ^ 8) - 8) * k), (k, asm)


def test_supported_layers() -> None:
    integer = torch.randint(1, 17, (32, 4096)).half()
    assert w4a8_swap_supported(4096, 4096, 128, True, integer) and w4a8_swap_supported(4096, 4096, 4096, True, None)
    assert not w4a8_swap_supported(4096, 4096, 128, True, integer + 0.5)  # QQQ-reference fractional scales
    assert not w4a8_swap_supported(4096, 4096, 128, True, integer + 1)  # 17: (q - 8) k leaves int8
    assert not w4a8_swap_supported(4096, 4096, 128, True, -integer)  # negative: the slices' bytes would borrow
    assert not w4a8_swap_supported(4096, 4096, 128, False, integer)  # zero points
    assert not w4a8_swap_supported(4096, 4096, 32, True, integer)  # a group inside a 64-input chunk
    assert not w4a8_swap_supported(4096, 4160 + 8, 128, True, integer)
    assert not w4a8_swap_supported(2**18, 4096, -1, True, None)  # int32 accumulator overflow




@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [64, 128, -1])
@pytest.mark.usefixtures("poisoned_outputs")
def test_matches_int8_reference(dtype: torch.dtype, group: int) -> None:
    layer = qqq_layer(256, 128, group, dtype, seed=group + 5)
    packed = repack_for_w4a8_swap(layer.qweight)
    two_level = group != -1
    channel = layer.channel_scales if two_level else layer.scales[0].float()
    for m, config in [(1, swap_config(16, 64, 64, 1)), (19, swap_config(16, 64, 128, 2)),  # two M blocks, split K
                      (5, swap_config(32, 128, 64, 4)),
                      (3, swap_config(64, 64, 64, 2))]:  # two-level: exact int8 slices
        if two_level:
            config = replace(config, block_k=min(config.block_k, group))
        x = (3 * torch.randn(m, 256, generator=torch.Generator().manual_seed(m))).to(dtype)
        out = w4a8_swap_matmul(x, packed, channel, layer.scales if two_level else None, None, layer.bias,
                               layer.group_size, config)
        assert out.shape == (m, 128) and out.dtype == dtype and not out.isnan().any(), config
        assert relative_error(out, reference_w4a8(layer, x)) < TOLERANCE[dtype], config
    with pytest.raises(ValueError, match="K tile"):
        w4a8_swap_matmul(x, packed, channel, layer.scales, None, None, 64, replace(config, block_k=128))


@pytest.mark.usefixtures("poisoned_outputs")
def test_one_group_over_all_of_k_folds_its_multiplier_into_the_channel_scale() -> None:
    layer = qqq_layer(256, 64, -1, torch.float16, seed=3, two_level=True)
    assert layer.group_size == 256 and layer.scales.shape == (1, 64)
    x = (3 * torch.randn(4, 256, generator=torch.Generator().manual_seed(4))).half()
    out = w4a8_swap_matmul(x, repack_for_w4a8_swap(layer.qweight), layer.channel_scales, layer.scales, None, layer.bias,
                           256, swap_config(16, 64, 128, 2))
    assert relative_error(out, reference_w4a8(layer, x)) < TOLERANCE[torch.float16]


@pytest.mark.parametrize("block_m", [16, 64])
def test_int32_result_is_exact(block_m: int) -> None:
    """Before the float epilogue the kernel's sum is QQQ's int8 dot product exactly: with a unit token scale,
    a power-of-two channel scale and integer activations, the output is the integer reference rounded once
    (16-token tiles: drained per K tile and scaled by k; 64: QQQ's int8 weights made in registers)."""
    layer = qqq_layer(512, 64, 128, torch.float16, seed=1)
    packed = repack_for_w4a8_swap(layer.qweight)
    x = torch.randint(-127, 128, (3, 512)).float()
    x[:, 0] = 127  # every token's absmax 127: its scale is exactly 1 and x_int8 = x
    q = unpack_along_rows(layer.qweight, 4).to(torch.int64) - 8
    w = q * layer.scales.to(torch.int64).repeat_interleave(128, dim=0)
    exact = x.to(torch.int64) @ w
    out = w4a8_swap_matmul(x.half(), packed, torch.full((64,), 2.0**-10), layer.scales, None, None, 128,
                           swap_config(block_m, 64, 128, 1))
    assert exact.abs().max() > 2**17 and out.isfinite().all()  # far beyond fp16 integers (2**11), fp32-exact
    assert torch.equal(out, (exact.double() * 2.0**-10).half())


SWAP_COMPILE = REGISTER_OPERAND_CHECK + """
from quantkit.kernels.w4a8_swap import _w4a8_swap_kernel as fn
for two_level, split, bm in ((True, 4, 16), (True, 1, 64), (False, 1, 16)):
    sig = {"xq_ptr": "*i8", "ts_ptr": "*fp32", "b_ptr": "*i8", "cs_ptr": "*fp32", "gs_ptr": "*fp16",
           "bias_ptr": "*fp16", "out_ptr": "*fp16", "part_ptr": "*fp32", "count_ptr": "*i32", "M": "i32",
           "N": "i32", "K": "i32", "W": "i32"}
    consts = dict(GROUP=128, TWO_LEVEL=two_level, HAS_BIAS=True, BLOCK_M=bm, BLOCK_N=128, BLOCK_K=128,
                  SPLIT_K=split, PTX=True, PDL=two_level)
    # the slices: 16 (q - 8) by a mask, or (two-level, 64 tokens) QQQ's (q - 8) k by a multiply-add per four weights
    exact = two_level and bm >= 64
    marker = "mad.lo.u32 t, u," if exact else "0xF0F0F0F0"
    ptx = check_register_operand(fn, sig, consts, rf"wgmma.mma_async.sync.aligned.m64n{bm}k32.s32.s8.s8", marker)
    assert ("griddepcontrol.wait" in ptx) == two_level  # PDL: waits for the quantization kernel's x
    assert ("mad.lo.u32 t, u," in ptx) == exact

from quantkit.kernels.common import _quantize_rows_kernel as quantize
sig = {"x_ptr": "*fp16", "xq_ptr": "*i8", "scale_ptr": "*fp32", "sum_ptr": "*i32", "K": "i32", "SEGMENT": "i32"}
consts = dict(BLOCK=16384, SEG_BLOCK=1024, ONE_PASS=True, SEGMENTED=True, PDL=True)
kernel = compile(ASTSource(fn=quantize, signature={**sig, **{c: "constexpr" for c in consts}}, constexprs=consts),
                 target=GPUTarget("cuda", 90, 32), options={"num_warps": 16})
assert "griddepcontrol.launch_dependents" in kernel.asm["ptx"] and "div.rn.f32" in kernel.asm["ptx"]
print("compiled")
"""


def test_swap_kernel_compiles_to_register_operand_int8_wgmma_for_sm90() -> None:
    """On its sm_90 compile (Triton's bundled ptxas, no GPU needed): int8 wgmma takes the weight slices from
    registers, nothing but the cp.async copies goes through shared memory in the K loop, the PTX assembles; under
    programmatic dependent launch it waits for the quantization kernel, which lets it launch early."""
    compile_for_sm90(SWAP_COMPILE)


@pytest.mark.usefixtures("poisoned_outputs")
def test_triton_swap_kernels_read_k_blocked_weights_alike() -> None:
    """The swap kernel, the swap gemv and the W4A8 swap kernel on a weight in K blocks of 128 give the plain
    layout's outputs bit for bit (the same arithmetic at other addresses): K tiles in every block, split K; a K
    tile across two blocks is refused."""
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(7)).half()
    layer = random_layer(512, 128, 128, torch.float16, sym=False, seed=5)
    plain = repack_for_swap(layer.qweight)
    blocked = k_blocked(plain, 512, 128)
    swap, gemv = swap_config(16, 64, 128, 2), swap_gemv_config(32, 128, 2)
    for run, config in [(w4a16_swap_matmul, swap), (w4a16_swap_gemv, gemv)]:
        expected = run(x, plain, layer.scales, layer.zeros, layer.bias, 128, config)
        assert torch.equal(run(x, blocked, layer.scales, layer.zeros, layer.bias, 128, config), expected), run
    with pytest.raises(ValueError, match="does not fit the weight's K blocks of 128"):
        w4a16_swap_gemv(x, blocked, layer.scales, layer.zeros, None, 512, replace(gemv, block_k=256))
    qqq = qqq_layer(512, 128, 128, torch.float16, seed=6)
    plain = repack_for_w4a8_swap(qqq.qweight)
    expected = w4a8_swap_matmul(x, plain, qqq.channel_scales, qqq.scales, None, qqq.bias, 128, swap)
    out = w4a8_swap_matmul(x, k_blocked(plain, 512, 128), qqq.channel_scales, qqq.scales, None, qqq.bias, 128, swap)
    assert torch.equal(out, expected)


def test_layers_get_their_swap_copy_in_k_blocks_and_configs_that_fit_them() -> None:
    for act_bits, layer in [(16, random_layer(1024, 128, 128, torch.float16, sym=True)),
                            (8, qqq_layer(1024, 128, 128, torch.float16))]:
        assert layout_shape(swap_weight_for(layer, True), 1024) == (128, SWAP_BLOCK[act_bits]) != (128, 1024)
    odd = random_layer(320, 128, 64, torch.float16, sym=True)  # K not a multiple of 256: the plain layout
    assert layout_shape(swap_weight_for(odd, True), 320) == (128, 320)
    plain = candidates("w4a16", 1, 4096, 4096, 128, swap=True, hopper=True)
    blocked = candidates("w4a16", 1, 4096, 4096, 128, swap=True, hopper=True, swap_block=256)
    swap_kinds = ("swap", "swap_gemv", "tma_gemv", "wgmma")
    assert any(c.kernel in swap_kinds and c.block_k == 512 for c in plain)
    assert blocked == [c for c in plain if c.kernel not in swap_kinds or 256 % c.block_k == 0]
