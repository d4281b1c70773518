"""Quantization conventions pinned against hand-computed or brute-force references (issue #31)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_adapters import tiny_model
from test_engine import random_calibration
from torch import nn

from quantkit.config import QuantConfig
from quantkit.data import CalibrationSet
from quantkit.engine import quantize_model
from quantkit.export import export_checkpoint, quantized_modules
from quantkit.models import get_adapter
from quantkit.qtensor import compute_qparams, quantize_codes
from quantkit.quantizers.qqq_grids import Int8Weight
from quantkit.quantizers.qqq_probe import SmoothingProbe
from quantkit.quantizers.rtn import rtn_quantize
from quantkit.reload import load_quantized


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


def test_symmetric_scale_is_compressed_tensors_formula() -> None:
    # compressed-tensors calculate_qparams, int4 symmetric: scale = absmax / ((7 - (-8)) / 2), zero point 0,
    # signed codes clamp(round(w / scale), -8, 7); ours are those codes + 8 with zero 8, the scale rounded to
    # fp16 first (0.2 -> 0.199951171875). By hand: -1.5 / s = -7.502 -> -8, 0.25 / s = 1.25 -> 1,
    # 0.65 / s = 3.25 -> 3, -0.05 / s = -0.25 -> 0.
    w = torch.tensor([[-1.5, 0.25, 0.65, -0.05]])
    scale, zero = compute_qparams(w.amin(-1), w.amax(-1), bits=4, sym=True)
    assert scale.item() == 0.199951171875 and zero.item() == 8
    assert quantize_codes(w, scale[:, None], zero[:, None], 4).tolist() == [[0.0, 9.0, 11.0, 8.0]]


def test_asymmetric_zero_point_is_compressed_tensors_formula() -> None:
    # compressed-tensors, int4 asymmetric: scale = (max - min) / 15 with 0 inside the range,
    # zp = round(-8 - min / scale) in [-8, 7]; ours is the unsigned zero = zp + 8 = round(-min / scale).
    # By hand: s = fp16(0.1) = 0.0999755859375, zero = round(3.0007) = 3; codes round(w / s) + 3.
    w = torch.tensor([[-0.3, 1.2, 0.5, 0.0]])
    scale, zero = compute_qparams(w.amin(-1), w.amax(-1), bits=4, sym=False)
    assert scale.item() == 0.0999755859375 and zero.item() == 3
    assert quantize_codes(w, scale[:, None], zero[:, None], 4).tolist() == [[0.0, 15.0, 8.0, 3.0]]


def test_bf16_scale_is_rounded_to_bf16_and_exact_in_fp16() -> None:
    # 0.2 in bf16 (8 significant bits): round(1.6 * 128) / 128 / 8 = 205 / 1024 = 0.2001953125, an fp16 value too
    w = torch.tensor([[-1.5, 0.25, 0.65, -0.05]])
    scale, _ = compute_qparams(w.amin(-1), w.amax(-1), bits=4, sym=True, scale_dtype=torch.bfloat16)
    assert scale.item() == 0.2001953125 == scale.half().item()


@pytest.mark.parametrize("method", ["gptq", "awq-gptq", "rtn"])
def test_bf16_export_holds_the_scales_the_method_compensated_for(method, tmp_path, caplog) -> None:
    """Quantized for bf16 serving, the export's weights are the in-memory ones bit for bit; quantized for fp16
    and exported in bf16, they are not (the scales are rounded again, after GPTQ), and the export says so."""
    calib = random_calibration(n=4)
    weights = {}
    for scale_dtype in ("bfloat16", "float16"):
        model = tiny_model("llama")
        quantize_model(model, get_adapter(model), calib, QuantConfig(method=method, group_size=32,
                       scale_dtype=scale_dtype), device="cpu", show_progress=False)
        caplog.clear()
        out = export_checkpoint(model, None, tmp_path / scale_dtype, QuantConfig(method=method, group_size=32,
                                scale_dtype=scale_dtype), "compressed-tensors", dtype="bfloat16")
        assert ("rounds them again" in caplog.text) == (scale_dtype == "float16")
        reloaded, _ = load_quantized(out, dtype=torch.float32)
        weights[scale_dtype] = [(m.dequantized_weight(), quantized_modules(reloaded)[n].dequantized_weight())
                                for n, m in quantized_modules(model).items()]
    assert all(torch.equal(mine, exported) for mine, exported in weights["bfloat16"])
    assert not all(torch.equal(mine, exported) for mine, exported in weights["float16"])


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_qqq_smoothing_scores_on_the_served_per_channel_grid(scale_dtype: torch.dtype) -> None:
    """QQQ's smoothing search rounds each candidate on the grid the export will hold: per channel, absmax / 7
    rounded to the served dtype (bf16 keeps 8 significant bits, fp16 11: different codes and losses)."""
    w = torch.randn(16, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x = torch.randn(256, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    rounded = Int8Weight.round_to_nearest(w, -1, scale_dtype)
    expected_scale = (w.abs().amax(dim=1) / 7).to(scale_dtype).double()
    assert torch.equal(rounded.scales, expected_scale)
    assert torch.equal(rounded.values.double(), torch.round(w / expected_scale[:, None]).clamp(-7, 7))
    probe = SmoothingProbe.for_matmul([x], [w], group_size=-1, scale_dtype=scale_dtype)
    ones = torch.ones(64, dtype=torch.float64)
    assert probe.loss(ones) == probe.loss_with(ones, [rounded])
