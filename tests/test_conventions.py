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
