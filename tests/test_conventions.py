"""Quantization conventions pinned against hand-computed or brute-force references (issue #31)."""

from __future__ import annotations

import copy

import torch
from test_adapters import tiny_model
from test_engine import random_calibration
from torch import nn

from quantkit.config import QuantConfig
from quantkit.data import CalibrationSet
from quantkit.engine import quantize_model
from quantkit.export import quantized_modules
from quantkit.models import get_adapter
from quantkit.qtensor import EXPORT_EXACT_SCALES, compute_qparams, quantize_codes, round_scale
from quantkit.quantizers.gptq import gptq_quantize
from quantkit.quantizers.rtn import rtn_quantize


def _count_decoder_layer_calls(model: nn.Module) -> list[int]:
    calls: list[int] = []
    for layer in get_adapter(model).get_layers(model):
        calls.append(0)
        index = len(calls) - 1
        layer.register_forward_pre_hook(lambda *_a, i=index: calls.__setitem__(i, calls[i] + 1))
    return calls


def test_rtn_runs_no_calibration_forward_pass() -> None:
    model = tiny_model("llama")
    original = copy.deepcopy(model)
    calls = _count_decoder_layer_calls(model)
    # Token ids far outside the vocabulary: any embedding lookup on them raises.
    poisoned = CalibrationSet(torch.full((2, 8), 10**9), torch.ones(2, 8, dtype=torch.long))
    report = quantize_model(model, get_adapter(model), poisoned, QuantConfig(method="rtn", group_size=32),
                            device="cpu", show_progress=False)
    assert calls == [0] * len(calls)
    assert report.calibration_tokens == 0 and "capture" not in report.timings
    for name, q in quantized_modules(model).items():
        expected = rtn_quantize(original.get_submodule(name).weight, 4, 32, sym=True, mse=False)
        assert torch.equal(q.dequantized_weight().float(), expected.dequantize())


def test_gptq_still_runs_every_layer_over_the_calibration_set() -> None:
    model = tiny_model("llama")
    calls = _count_decoder_layer_calls(model)
    quantize_model(model, get_adapter(model), random_calibration(n=6), QuantConfig(method="gptq", group_size=32),
                   device="cpu", batch_size=3, show_progress=False)
    assert all(c > 0 for c in calls)


def test_4bit_scales_are_exact_in_every_export_dtype() -> None:
    # Every fp32 around the range ends (and a dense log-spaced sweep between them).
    values = torch.cat([torch.logspace(-30, 20, 20001, base=2.0), torch.tensor([2.0**-17, 65280.0, 65400.0, 1e9])])
    rounded = round_scale(values, bits=4)
    for dtype in (torch.float16, torch.bfloat16):
        assert torch.equal(rounded.to(dtype).to(torch.float32), rounded), dtype
    _, smallest, largest = EXPORT_EXACT_SCALES
    inside = (values >= smallest) & (values <= largest)
    # Inside the range: the nearest bf16 value (relative error at most 2**-9), never a coarser one.
    assert torch.equal(rounded[inside], values[inside].to(torch.bfloat16).float())
    assert rounded.min() == smallest and rounded.max() == largest


def test_8bit_scales_keep_fp16_precision() -> None:
    values = torch.logspace(-20, 15, 5001, base=2.0)
    assert torch.equal(round_scale(values, bits=8), values.half().float())


def test_symmetric_scale_is_compressed_tensors_formula() -> None:
    # compressed-tensors calculate_qparams, int4 symmetric: scale = absmax / ((7 - (-8)) / 2), zero point 0,
    # signed codes clamp(round(w / scale), -8, 7); ours are those codes + 8 with zero 8. By hand:
    w = torch.tensor([[-1.5, 0.3, 0.75, -0.1]])
    scale, zero = compute_qparams(w.amin(-1), w.amax(-1), bits=4, sym=True)
    assert scale.item() == torch.tensor(1.5 / 7.5).to(torch.bfloat16).item() == 0.2001953125
    assert zero.item() == 8
    codes = quantize_codes(w, scale[:, None], zero[:, None], 4)
    assert codes.tolist() == [[1.0, 9.0, 12.0, 8.0]]  # signed round(-7.49) = -7, 1, round(3.75) = 4, 0


def test_asymmetric_zero_point_is_compressed_tensors_formula() -> None:
    # compressed-tensors, int4 asymmetric: scale = (max - min) / 15 with 0 inside the range,
    # zp = round(-8 - min / scale) in [-8, 7]; ours is the unsigned zero = zp + 8 = round(-min / scale).
    w = torch.tensor([[-0.3, 1.2, 0.5, 0.0]])
    scale, zero = compute_qparams(w.amin(-1), w.amax(-1), bits=4, sym=False)
    expected_scale = torch.tensor(1.5 / 15).to(torch.bfloat16).item()
    assert scale.item() == expected_scale
    assert zero.item() == round(0.3 / expected_scale) == 3
    codes = quantize_codes(w, scale[:, None], zero[:, None], 4)
    assert codes.tolist() == [[0.0, 15.0, 8.0, 3.0]]  # 1.2 / 0.1 + 3 clamps at 15; zero stays exact


def test_gptq_codes_are_those_of_the_scale_every_export_stores() -> None:
    # The scales GPTQ compensated for survive an fp16 and a bf16 export unchanged, so every format
    # dequantizes to the weights whose error GPTQ spread.
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(16, 64, generator=gen) * torch.logspace(-3, 1, 64)
    x = torch.randn(256, 64, generator=gen)
    qw = gptq_quantize(weight, 2 * x.T @ x / 256, QuantConfig(method="gptq", group_size=32))
    for dtype in (torch.float16, torch.bfloat16):
        assert torch.equal(qw.scales.to(dtype).float(), qw.scales)
