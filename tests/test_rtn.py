"""RTN against a brute-force nearest-grid-point search and GPTQ's published min-max rule."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quantkit.config import QuantConfig
from quantkit.qtensor import QuantizationError, compute_qparams, fake_quantize
from quantkit.quantizers.base import get_method
from quantkit.quantizers.rtn import (
    MSE_GRID,
    MSE_MAX_SHRINK,
    MSE_NORM,
    RTNOptions,
    find_qparams,
    rtn_fake_quantize,
    rtn_quantize,
)

SHAPES = [(-1, 1), (32, 8), (64, 4), (128, 2)]  # group size, groups of a 256-input layer


def random_weight(seed: int, out_features: int = 24, in_features: int = 256) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen) * 0.02
    w[:, 7] *= 20  # outlier input channel
    w[3, :40] = w[3, :40].abs()  # groups with only positive weights: asym range must still contain 0
    w[5, 96:160] = 0.0  # exact zeros: all-zero groups at group size 32
    return w


def minmax_grid(group: torch.Tensor, bits: int, sym: bool) -> tuple[float, int]:
    """GPTQ's min-max rule for one group (IST-DASLab/gptq quant.py) in fp32: the grid the codes are rounded on."""
    maxq = 2**bits - 1
    lo, hi = torch.clamp(group.min(), max=0.0), torch.clamp(group.max(), min=0.0)  # fp32, as rtn_quantize
    scale = 2 * torch.maximum(-lo, hi) / maxq if sym else (hi - lo) / maxq
    scale = float(scale) or 1.0
    zero = 2 ** (bits - 1) if sym else int(min(max(round(-float(lo) / scale), 0), maxq))
    return scale, zero


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size,n_groups", SHAPES)
def test_rtn_is_nearest_point_of_minmax_grid(bits, sym, group_size, n_groups):
    """Codes: the nearest point of the fp32 min-max grid; the stored scale: that grid's, rounded to fp16."""
    w = random_weight(seed=bits + 10 * sym + group_size)
    result = rtn_quantize(w, bits, group_size, sym, mse=False)
    maxq = 2**bits - 1
    assert result.codes.dtype == torch.uint8 and result.zeros.dtype == torch.uint8
    assert result.scales.dtype == torch.float32 and result.scales.shape == (24, n_groups)
    assert result.group_size == group_size and result.bits == bits and result.sym == sym
    size = 256 // n_groups
    for o in range(w.shape[0]):
        for g in range(n_groups):
            chunk = w[o, g * size : (g + 1) * size]
            scale, zero = minmax_grid(chunk, bits, sym)
            assert result.scales[o, g] == float(torch.tensor(scale).half()) and result.zeros[o, g] == zero
            levels = (torch.arange(maxq + 1, dtype=torch.float64) - zero) * scale
            distance = (chunk.double()[:, None] - levels[None]).abs()
            chosen = distance.gather(1, result.codes[o, g * size : (g + 1) * size].long()[:, None])[:, 0]
            tie = maxq * 2**-22 * scale  # w / scale is divided in fp32: a tie may go either way
            assert torch.all(chosen <= distance.min(dim=1).values + tie)


@pytest.mark.parametrize("mse", [False, True])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size", [-1, 32])
def test_fake_quantize_is_the_dequantized_rtn_bit_for_bit(group_size: int, sym: bool, mse: bool) -> None:
    """AWQ's searches use rtn_fake_quantize for the values rtn_quantize exports."""
    w = random_weight(seed=7 + group_size)
    expected = rtn_quantize(w, 4, group_size, sym, mse).dequantize()
    assert torch.equal(rtn_fake_quantize(w, 4, group_size, sym, mse), expected)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size", [-1, 32, 128])
def test_rtn_zero_points_and_error_bound(bits, sym, group_size):
    w = random_weight(seed=100 + bits)
    result = rtn_quantize(w, bits, group_size, sym, mse=False)
    maxq = 2**bits - 1
    if sym:
        assert torch.all(result.zeros == 2 ** (bits - 1))
    assert int(result.zeros.max()) <= maxq
    g = result.group_index()
    scale, zero = result.scales[:, g], result.zeros[:, g].float()
    deq = result.dequantize()
    assert torch.all(deq[w == 0] == 0)  # zero is a grid point
    error = (w - deq).abs()
    inside = (w >= -zero * scale) & (w <= (maxq - zero) * scale)
    assert (~inside).sum() <= 2 * result.scales.numel()  # at most a group's min and max are clamped
    # Half a step of the fp32 grid the codes are rounded on, plus the fp16 rounding of the stored scale (2**-11
    # relative) over as many steps as the code is from the zero point; outside the clamp range the same bound.
    steps = (result.codes[:, :].float() - zero).abs()
    assert torch.all(error <= scale * (0.5 * (1 + 2**-11) + steps * 2**-11) * (1 + 1e-6))


@pytest.mark.parametrize("sym", [True, False])
def test_mse_search_is_the_best_shrunk_grid(sym):
    w = random_weight(seed=7, out_features=6, in_features=64).reshape(6, 2, 32)
    scale, zero = find_qparams(w, bits=4, sym=sym, mse=True)
    minmax_scale, _ = find_qparams(w, bits=4, sym=sym, mse=False)
    assert torch.all(scale <= minmax_scale)
    for o in range(6):
        for g in range(2):
            chunk = w[o, g]
            candidates = []
            for step in range(int(MSE_MAX_SHRINK * MSE_GRID)):
                shrink = 1 - step / MSE_GRID
                s, z = compute_qparams(shrink * chunk.min(), shrink * chunk.max(), 4, sym)
                candidates.append(
                    (float((fake_quantize(chunk, s, z, 4) - chunk).abs().pow(MSE_NORM).sum()), s, z)
                )
            _, best_scale, best_zero = min(
                candidates, key=lambda c: c[0]
            )  # first of equal errors, as the search
            assert scale[o, g] == best_scale and zero[o, g] == best_zero


def test_rtn_method_leaves_weight_untouched():
    method = get_method(QuantConfig(method="rtn", group_size=32, options=RTNOptions(mse=True)))
    assert not method.needs_activations
    linear = nn.Linear(64, 8, bias=False).to(torch.bfloat16)
    before = linear.weight.detach().clone()
    result = method.linear_quantizer(linear).quantize()
    assert torch.equal(linear.weight, before)
    expected = rtn_quantize(before.float(), 4, 32, sym=True, mse=True)
    assert torch.equal(result.codes, expected.codes) and torch.equal(result.scales, expected.scales)


def test_rtn_bad_inputs_raise():
    w = random_weight(seed=1, in_features=96)
    with pytest.raises(QuantizationError, match="does not divide the input size 96"):
        rtn_quantize(w, 4, 64, sym=True, mse=False)
    for bad in (float("nan"), float("inf")):
        w[2, 3] = bad
        with pytest.raises(QuantizationError, match=r"\[24x96\] has NaN/Inf weights"):
            rtn_quantize(w, 4, 32, sym=True, mse=False)


def test_cached_dense_weight_gives_the_same_outputs():
    from quantkit.nn.qlinear import QuantLinear

    qlinear = QuantLinear.from_quantized(rtn_quantize(random_weight(3, 24, 64), 4, 32, True, False),
                                         torch.randn(24), torch.float32, act_bits=8)
    x = torch.randn(5, 64)
    expected = qlinear(x)
    qlinear.cache_dense_weight()
    assert qlinear.dense_weight is not None and "dense_weight" not in qlinear.state_dict()
    torch.testing.assert_close(qlinear(x), expected, rtol=0, atol=0)
    qlinear.cache_dense_weight(False)
    assert qlinear.dense_weight is None
