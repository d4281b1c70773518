"""The grouped W4A8 MoE kernel against float64 (int8 tokens x int8 expert weights, per expert), under Triton's CPU
interpreter; its wiring into the quantized MoE block (the per-expert loop's logits, the dispatch decision)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels are decorated at import

import pytest
import torch
from quantkit.kernels.common import StackedExperts, align_tokens
from quantkit.kernels.layout import int8_tokens, pack_along_rows
from quantkit.kernels.moe_w4a8 import int8_expert, moe_w4a8_forward, moe_w4a8_matmul, moe_w4a8_reference
from quantkit.kernels.spec import TileConfig
from test_kernels_moe_w4a16 import EXPERTS, TOP_K, quantized_tiny_moe, routing
from test_kernels_w4a16 import (  # noqa: F401  (poisoned_outputs: a fixture)
    TOLERANCE,
    compile_for_sm90,
    poisoned_outputs,
    relative_error,
)


def random_w4a8_experts(k: int, n: int, two_level: bool, sym: bool, seed: int = 0) -> StackedExperts:
    """Per channel (group K) or QQQ's two-level groups of 32 with group scales in halves up to 8 (ties in
    (q - z) * s: round half to even is tested), which keep every weight in int8."""
    gen = torch.Generator().manual_seed(seed)
    group = 32 if two_level else k
    codes = torch.randint(0, 16, (EXPERTS, k, n), generator=gen, dtype=torch.uint8)
    qweight = torch.stack([pack_along_rows(c, 4) for c in codes])
    zeros = None if sym else torch.randint(0, 16, (EXPERTS, k // group, n), generator=gen, dtype=torch.uint8)
    scales = torch.randint(1, 17, (EXPERTS, k // group, n), generator=gen).half() / 2 if two_level else None
    channel = 1e-3 + 1e-2 * torch.rand(EXPERTS, n, generator=gen)
    return StackedExperts(qweight, scales, zeros, group, channel)


def test_int8_expert_is_qqq_rounding() -> None:
    """The reference's weight: round half to even of (q - z) * s, within int8."""
    experts = random_w4a8_experts(64, 16, two_level=True, sym=False)
    w = int8_expert(experts, 1)
    codes = torch.stack([(experts.qweight[1] >> (4 * j)) & 0xF for j in range(8)], dim=1).reshape(64, 16)
    group = torch.arange(64) // 32
    exact = (codes.double() - experts.zeros[1].double()[group]) * experts.scales[1].double()[group]
    assert torch.equal(w, torch.round(exact)) and w.abs().max() <= 127
    ties = exact.frac().abs() == 0.5
    assert ties.any() and torch.equal(w[ties] % 2, torch.zeros_like(w[ties]))


@pytest.mark.usefixtures("poisoned_outputs")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("two_level", "sym"), [(False, True), (False, False), (True, True), (True, False)])
@pytest.mark.parametrize(("tokens", "k", "block_m", "block_k", "split"), [(1, 64, 16, 32, 1), (9, 160, 16, 32, 3),
                                                                         (20, 128, 32, 64, 2)])
def test_grouped_matmul_matches_float64(dtype, two_level, sym, tokens, k, block_m, block_k, split) -> None:
    """gate/up (one input row per token) and down (one per slot, routing weights) against float64; expert SILENT
    has no token; K = 160 in five tiles of 32 split 3 ways: uneven shares."""
    experts = random_w4a8_experts(k, 48, two_level, sym)
    ids, weights = routing(tokens)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    down_x = torch.randn(tokens * TOP_K, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    aligned = align_tokens(ids, EXPERTS, block_m)
    config = TileConfig("moe_gemm", block_m, 32, block_k, split, 4, 2)
    for inputs, routed in ((x, None), (down_x, weights)):
        out = moe_w4a8_matmul(inputs, experts, aligned, config, routed)
        assert out.shape == (tokens * TOP_K, 48) and out.dtype == dtype
        assert not out.isnan().any(), "an output row left unwritten"
        # int32 sums are exact: only the fp32 epilogue and the final rounding to dtype differ from float64
        assert relative_error(out, moe_w4a8_reference(inputs, ids, experts, routed)) < TOLERANCE[dtype] / 2


def test_block_forward_matches_float64() -> None:
    """gate/up stacked along N, SiLU, down with the routing weights, summed over slots (the down input quantized
    from the fp16 activations, as the kernel's)."""
    hidden, inter, tokens = 64, 32, 9
    gate_up = random_w4a8_experts(hidden, 2 * inter, two_level=True, sym=False, seed=3)
    down = random_w4a8_experts(inter, hidden, two_level=False, sym=True, seed=4)
    ids, weights = routing(tokens, seed=5)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(6)).half()
    out = moe_w4a8_forward(x, ids, weights, gate_up, down, torch.nn.functional.silu)
    h = moe_w4a8_reference(x, ids, gate_up).half()
    a = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
    ref = moe_w4a8_reference(a, ids, down, weights).view(tokens, TOP_K, hidden).sum(dim=1)
    assert out.shape == (tokens, hidden) and out.dtype == torch.float16
    assert relative_error(out, ref) < 2 * TOLERANCE[torch.float16]


def test_quantize_rows_is_int8_tokens() -> None:
    """The kernel's activation codes and scales are layout.int8_tokens' (which the reference uses), bit for bit."""
    from quantkit.kernels.common import quantize_rows

    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(0)).half()
    codes, scales = int8_tokens(x)
    xq, ts, sums = quantize_rows(x)
    assert torch.equal(xq, codes) and torch.equal(ts, scales.reshape(-1))
    assert torch.equal(sums, codes.int().sum(dim=1, dtype=torch.int32))


@pytest.mark.parametrize(("method", "group", "dtype"), [("rtn", -1, torch.float16), ("qqq", 32, torch.bfloat16)])
def test_quantized_w4a8_moe_logits_through_the_grouped_kernel(monkeypatch, method, group, dtype) -> None:
    """W4A8 experts (per channel from RTN, two-level from QQQ) dispatch to the grouped W4A8 kernel (forced here on
    the CPU, interpreted), whose logits are the per-expert loop's; the W4A16 kernel is never called."""
    from quantkit.kernels import registry

    from quantkit.models.moe import UnfusedMoe

    model = quantized_tiny_moe("mixtral", sym=True, act_bits=8, method=method, group_size=group).to(dtype)
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    calls: list[str] = []
    for scheme, real in list(registry.MOE_FORWARDS.items()):
        monkeypatch.setitem(registry.MOE_FORWARDS, scheme,
                            lambda *args, scheme=scheme, real=real: calls.append(scheme) or real(*args))
    with torch.no_grad():
        loop = model(ids).logits.double()
        assert not calls  # on the CPU the block keeps its loop
        monkeypatch.setattr(UnfusedMoe, "_wants_grouped", lambda self, x: True)
        grouped = model(ids).logits.double()
    assert calls == ["w4a8"] * len(model.model.layers)
    assert relative_error(grouped, loop) < 2 * TOLERANCE[dtype]


def test_one_level_group_scales_keep_the_loop() -> None:
    """int8 activations with one-level group scales (RTN, group 32) have no W4A8 kernel, dense or grouped."""
    model = quantized_tiny_moe("mixtral", sym=True, act_bits=8).to(torch.float16)
    assert model.model.layers[0].mlp.grouped_experts() is None


def test_two_level_weights_outside_int8_keep_the_loop() -> None:
    """A QQQ expert whose (q - z) * group_scale leaves int8 (QQQ's kernel would wrap it) sends the block to its loop."""
    model = quantized_tiny_moe("mixtral", sym=True, act_bits=8, method="qqq", group_size=32).to(torch.float16)
    block = model.model.layers[0].mlp
    assert block.grouped_experts() is not None
    block.release_grouped()
    block.experts[1].down_proj.scales.fill_(20)  # (0 - 8) * 20 = -160
    assert block.grouped_experts() is None


MOE_W4A8_COMPILE = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from quantkit.kernels.common import MOE_TILES
from quantkit.kernels.moe_w4a8 import _moe_w4a8_kernel

tiles = [group[0] for group in MOE_TILES.values()]
builds = [(tile, two_level, zeros, 1) for tile in tiles for two_level in (False, True) for zeros in (False, True)]
builds.append((tiles[0], True, False, 4))
for (bm, bn, bk, warps, stages), two_level, zeros, split in builds:
    sig = {"xq_ptr": "*i8", "ts_ptr": "*fp32", "xsum_ptr": "*i32", "qw_ptr": "*i32", "cs_ptr": "*fp32",
           "gs_ptr": "*fp16", "z_ptr": "*u8", "route_w_ptr": "*fp32", "out_ptr": "*fp16", "part_ptr": "*fp32",
           "count_ptr": "*i32", "sorted_rows_ptr": "*i32", "block_expert_ptr": "*i32", "N": "i32", "K": "i32",
           "rows": "i32", "X_ROW_DIV": "constexpr", "GROUP": "constexpr", "TWO_LEVEL": "constexpr",
           "HAS_ZEROS": "constexpr", "MUL_ROUTED": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
           "BLOCK_K": "constexpr", "SPLIT_K": "i32", "IS_SPLIT": "constexpr"}
    consts = {"X_ROW_DIV": 8, "GROUP": 128 if two_level else 4096, "TWO_LEVEL": two_level, "HAS_ZEROS": zeros,
              "MUL_ROUTED": split > 1, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "IS_SPLIT": split > 1}
    kernel = compile(ASTSource(fn=_moe_w4a8_kernel, signature=sig, constexprs=consts),
                     target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    ptx = kernel.asm["ptx"]
    assert ("mma.sync" in ptx and ".s8" in ptx or "wgmma" in ptx) and kernel.asm["cubin"], (bm, bn, bk, two_level)
print("compiled")
"""


def test_candidate_tiles_compile_for_sm90_on_int8_tensor_cores() -> None:
    """The interpreter runs none of the compiled path: compile each token bucket's first tile, per channel and
    two-level, symmetric and not, and a split one, for sm_90 with Triton's bundled ptxas."""
    compile_for_sm90(MOE_W4A8_COMPILE)
