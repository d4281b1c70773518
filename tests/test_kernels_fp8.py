"""W8A8-FP8 kernels (kernels/w8a8_fp8.py) against float64 from the e4m3 values, and the rounding they are fed
(kernels/layout.py's fp8 rows) against a brute-force search over every e4m3 value; Triton's CPU interpreter runs the
tiled kernel, torch's CPU _scaled_mm the cuBLASLt path."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels are decorated at import

import pytest
import torch
from quantkit.kernels.api import fp8_run, make_kernel_forward
from quantkit.kernels.layout import FP8_MAX, FP8_MIN_SCALE, fp8_tokens
from quantkit.kernels.spec import Problem, TileConfig, split_k_for
from quantkit.kernels.w8a8_fp8 import _gemm_candidates, fp8_rows

from quantkit.nn.qlinear import QuantLinear
from quantkit.qtensor import fp8_quantize

E4M3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
E4M3 = E4M3[E4M3.isfinite()].unique()  # every finite e4m3 value, sorted (+0 and -0 as one)


def nearest_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Each value of x (float64) rounded to the nearest e4m3 value by search, saturated at +-448."""
    x = x.clamp(-FP8_MAX, FP8_MAX)
    return E4M3[(x[..., None] - E4M3).abs().argmin(dim=-1)]


def test_tokens_are_each_rows_nearest_e4m3_on_its_whole_range() -> None:
    torch.manual_seed(0)
    x = torch.randn(7, 96, dtype=torch.float64) * torch.logspace(-3, 2, 7, dtype=torch.float64)[:, None]
    x[3] = 0.0  # an all-zero token: the smallest scale, zero codes
    codes, scales = fp8_tokens(x.float())
    expected_scales = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    assert torch.equal(scales, expected_scales)
    # random values never sit on a tie between two e4m3 neighbours, so the nearest is unique
    torch.testing.assert_close(codes.double(), nearest_e4m3(x.float().double() / scales.double()), rtol=0, atol=0)
    assert codes.double().abs().amax(dim=1)[[0, 1, 2, 4, 5, 6]].eq(FP8_MAX).all()  # each row's largest reaches 448


def test_weight_codes_are_each_channels_nearest_e4m3() -> None:
    torch.manual_seed(1)
    weight = torch.randn(24, 64) * 0.02
    qw = fp8_quantize(weight)
    assert (qw.bits, qw.group_size, qw.sym, qw.fp8, qw.scales.shape) == (8, -1, True, True, (24, 1))
    values = qw.codes.view(torch.float8_e4m3fn).double()
    torch.testing.assert_close(values, nearest_e4m3(weight.double() / qw.scales.double()), rtol=0, atol=0)
    error = (qw.dequantize() - weight).abs() / weight.abs().amax(dim=1, keepdim=True)
    assert error.max() <= 2**-4 * 1.01  # half an e4m3 step at the top binade, relative to the row's largest


@pytest.mark.parametrize(("m", "k"), [(1, 4096), (3, 576), (300, 1088)])
def test_the_rows_kernel_rounds_as_the_torch_ops_do(m, k) -> None:
    """fp8_rows (one launch; a few tokens' rows in segments) gives fp8_tokens' scales and codes bit for bit: an
    all-zero row, rows across five decades, each row's largest at +-448."""
    torch.manual_seed(m)
    x = (torch.randn(m, k) * torch.logspace(-3, 2, m)[:, None]).half()
    x[m // 2] = 0.0
    codes, scales = fp8_rows(x)
    expected_codes, expected_scales = fp8_tokens(x)
    assert torch.equal(scales, expected_scales)
    assert torch.equal(codes.view(torch.uint8), expected_codes.view(torch.uint8))


def test_the_rows_kernel_rounds_ties_to_even_and_subnormals_as_torch() -> None:
    """A row whose max is 448 (scale 1): ties between e4m3 neighbours go to the even one (17 -> 16, 19 -> 20,
    2**-10 -> 0, 3 * 2**-10 -> 2**-8), subnormals keep their 2**-9 steps, -0 stays -0, and 124.3 rounds up into
    the next binade (128)."""
    row = torch.tensor([448.0, 17.0, 19.0, 2**-10, 3 * 2**-10, 5 * 2**-9, -0.0, 124.3, -0.3, 1e-6] * 4)
    codes, scales = fp8_rows(row[None])
    expected_codes, expected_scales = fp8_tokens(row[None])
    assert float(scales) == 1.0 and torch.equal(scales, expected_scales)
    assert torch.equal(codes.view(torch.uint8), expected_codes.view(torch.uint8))
    assert codes[0, :8].float().tolist() == [448.0, 16.0, 20.0, 0.0, 2**-8, 5 * 2**-9, -0.0, 128.0]


def random_fp8_layer(k: int, n: int, dtype: torch.dtype, bias: bool, seed: int) -> QuantLinear:
    torch.manual_seed(seed)
    weight = torch.randn(n, k) * torch.logspace(-2, 0, n)[:, None]  # channels of different ranges
    layer = QuantLinear.from_quantized(fp8_quantize(weight), torch.randn(n) if bias else None, dtype, act_bits=8)
    assert layer.fp8 and layer.scales.dtype == torch.float32
    return layer


def float64_output(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """e4m3 tokens times the e4m3 weight in float64, the token and channel scales, the bias."""
    codes, scales = fp8_tokens(x.reshape(-1, layer.in_features))
    weight = layer.to_quantized().codes.view(torch.float8_e4m3fn).double()
    out = codes.double() @ weight.t() * scales.double() * layer.scales.double()
    return out if layer.bias is None else out + layer.bias.double()


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.double() - expected).norm() / expected.norm())


# fp32 sums of exact products, then one rounding to the output dtype
TOLERANCE = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-6}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_reference_path_is_the_float64_function(dtype, bias) -> None:
    layer = random_fp8_layer(128, 48, dtype, bias, seed=2)
    x = torch.randn(2, 5, 128).to(dtype)
    out = layer(x)
    assert out.dtype == dtype and out.shape == (2, 5, 48)
    assert relative_error(out.reshape(10, 48), float64_output(layer, x)) < TOLERANCE[dtype]
    layer.cache_dense_weight()  # the cached operand: the same function
    torch.testing.assert_close(layer(x), out, rtol=0, atol=0)


CONFIGS = [(1, TileConfig("gemm", 16, 32, 64, 1, 4, 2)), (21, TileConfig("gemm", 16, 64, 128, 1, 4, 2)),
           (40, TileConfig("gemm", 32, 32, 64, 1, 4, 2)), (1, TileConfig("gemm", 16, 32, 64, 4, 4, 2)),
           (21, TileConfig("gemm", 16, 64, 64, 2, 4, 2)), (3, TileConfig("scaled_mm")),
           (33, TileConfig("scaled_mm_f32")), (5, TileConfig("reference"))]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("m", "config"), CONFIGS, ids=lambda c: getattr(c, "kernel", c))
def test_every_kernel_is_the_float64_function(dtype, m, config) -> None:
    layer = random_fp8_layer(256, 80, dtype, bias=m % 2 == 1, seed=m)
    x = torch.randn(m, 256).to(dtype) * 3
    codes, scales = fp8_tokens(x)
    weight = layer.to_quantized().codes.view(torch.float8_e4m3fn)
    out = fp8_run(codes, scales, weight, layer.scales[0], layer.bias, dtype, config)
    assert out.dtype == dtype and out.shape == (m, 80)
    assert relative_error(out, float64_output(layer, x)) < TOLERANCE[dtype]


def test_the_layers_kernel_forward_is_its_reference_path() -> None:
    """make_kernel_forward's FP8 forward (the interpreter stands in for the GPU) computes the reference path's
    function; the layer keeps the K-packed bytes in host memory, the kernel its [N, K] e4m3 copy."""
    layer = random_fp8_layer(128, 32, torch.float16, bias=True, seed=5)
    forward = make_kernel_forward(layer)
    assert forward is not None
    x = torch.randn(3, 4, 128).half()
    out = forward(x)
    assert out.shape == (3, 4, 32) and out.dtype == torch.float16
    torch.testing.assert_close(out, layer.reference_forward(x), rtol=2e-3, atol=2e-3)
    assert torch.equal(forward.plain_qweight, layer.qweight)
    compiled = torch.compile(forward, fullgraph=True, backend="eager")  # the op and the rounding trace as one graph
    torch.testing.assert_close(compiled(x), out, rtol=0, atol=0)


def test_gemm_candidates_tile_k_and_grow_with_m() -> None:
    small, large = _gemm_candidates(Problem("fp8", 1, 4096, 4096, 4096)), _gemm_candidates(
        Problem("fp8", 256, 4096, 4096, 4096))
    assert small and large and all(4096 % c.block_k == 0 for c in small + large)
    assert max(c.block_m for c in small) < max(c.block_m for c in large)
    assert {c.block_k for c in _gemm_candidates(Problem("fp8", 1, 64, 576, 576))} == {64}  # SmolLM2's width
    assert _gemm_candidates(Problem("fp8", 1, 64, 96, 96)) == []  # no K tile divides 96: _scaled_mm alone


def test_narrow_layers_at_few_tokens_also_get_a_k_split_that_fills_the_sms() -> None:
    """Llama-3-8B's o_proj at one token: 4096 / 64 = 64 output tiles for 132 SMs; each tile is also offered split
    over K (at split_k_for's split), while 4096 tokens fill the card unsplit."""
    few = _gemm_candidates(Problem("fp8", 1, 4096, 4096, 4096))
    for config in [c for c in few if c.split_k == 1]:
        tiles = -(-4096 // config.block_n)
        assert any(c.split_k == split_k_for(tiles, 4096 // c.block_k) > 1 and c.block_n == config.block_n
                   and c.block_k == config.block_k for c in few)
    assert {c.split_k for c in _gemm_candidates(Problem("fp8", 4096, 4096, 4096, 4096))} == {1}
