"""The no-harm guard (quantkit.layer_guard): errors against brute force, the RTN fallback end to end."""

from __future__ import annotations

import copy
import logging
import weakref

import pytest
import torch
from test_awq import layer_context, outlier_model
from test_engine import random_calibration

from quantkit import layer_guard
from quantkit.config import QuantConfig
from quantkit.engine import quantize_model
from quantkit.layer_guard import Snapshot, guard_layer
from quantkit.models import get_adapter
from quantkit.quantizers.awq import AWQ, AWQOptions
from quantkit.quantizers.context import first_output
from quantkit.quantizers.rtn import rtn_quantize
from quantkit.smoothing import active_scaling_groups, fold_scales

pytestmark = pytest.mark.usefixtures("single_thread")


def _real(outputs: list[torch.Tensor], masks: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([o.reshape(-1, o.shape[-1])[m.reshape(-1)] for o, m in zip(outputs, masks, strict=True)])


def test_guard_errors_match_brute_force() -> None:
    """Both errors are the summed squared output error over real tokens, against the untouched layer, of the layer
    as the method left it and of a copy holding RTN's weights of the original linears."""
    model = outlier_model("llama", torch.float64)
    ctx = layer_context(model, random_calibration(pad_from={0: 7}), index=1)
    original_layer = copy.deepcopy(ctx.layer)
    original = Snapshot(ctx.layer)
    config = QuantConfig(method="gptq", group_size=32)
    results = {}
    for name in ("self_attn.q_proj", "mlp.down_proj"):  # a "method": RTN of a perturbed weight
        linear = ctx.layer.get_submodule(name)
        results[name] = rtn_quantize(linear.weight * 1.05, 4, 32, True, False)
        linear.weight.data.copy_(results[name].dequantize(torch.float64))
    quantized = ctx.forward()
    entry, fallback = guard_layer(ctx, original, results, quantized, config)

    rtn_layer = copy.deepcopy(original_layer)
    for name in results:
        weight = rtn_layer.get_submodule(name).weight
        weight.data.copy_(rtn_quantize(weight, 4, 32, True, False).dequantize(torch.float64))
    reference = _real(layer_outputs(ctx, original_layer), ctx.token_masks)
    with_rtn = _real(layer_outputs(ctx, rtn_layer), ctx.token_masks)
    assert entry["output_error"] == pytest.approx(float((_real(quantized, ctx.token_masks) - reference).pow(2).sum()),
                                                  rel=1e-9)
    assert entry["rtn_output_error"] == pytest.approx(float((with_rtn - reference).pow(2).sum()), rel=1e-9)
    assert entry["output_error"] > entry["rtn_output_error"] and entry["fallback"] == "rtn"
    for name, qw in fallback.items():  # RTN's weights, in the layer too, with the rest of the original state
        torch.testing.assert_close(qw.dequantize(torch.float64), rtn_layer.get_submodule(name).weight, rtol=0, atol=0)
    for name, tensor in ctx.layer.state_dict().items():
        assert torch.equal(tensor, rtn_layer.state_dict()[name]), name


def test_a_snapshot_keeps_each_tensor_in_the_narrowest_exact_dtype() -> None:
    """A CPU run widens a bf16 checkpoint's layer to fp32: the snapshot takes half its bytes and gives the same
    fp32 values back; a tensor no narrower dtype holds exactly stays as it is."""
    layer = torch.nn.Linear(64, 32)
    with torch.no_grad():
        layer.weight.copy_(layer.weight.to(torch.bfloat16))  # fp32 holding bf16 values, as a widened checkpoint
        layer.bias.add_(1e-9)  # fp32 values no 16-bit dtype holds
    original = Snapshot(layer)
    assert original.tensors["weight"].dtype == torch.bfloat16 and original.tensors["bias"].dtype == torch.float32
    for name, tensor in layer.state_dict().items():
        assert original[name].dtype == torch.float32 and torch.equal(original[name], tensor), name
    assert sum(t.numel() * t.element_size() for t in original.tensors.values()) == 64 * 32 * 2 + 32 * 4


def test_the_guard_makes_one_linear_weight_at_a_time(monkeypatch) -> None:
    """The original's and RTN's weights are made per linear as it runs and dropped after: the guard never holds a
    second copy of the layer's weights beside its snapshot (the GPU's budget for a DeepSeek-V3 layer of 22.5 GB)."""
    model = outlier_model("llama")
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16))
    ctx = layer_context(model, random_calibration(), index=1)
    original = Snapshot(ctx.layer)
    names = ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")
    results = {name: rtn_quantize(ctx.layer.get_submodule(name).weight, 4, 32, True, False) for name in names}
    live, most = set(), [0]

    def tracking(module, weight, x):
        def made():
            tensor = weight()
            live.add(id(tensor))
            most[0] = max(most[0], len(live))
            weakref.finalize(tensor, live.discard, id(tensor))
            return tensor
        return real(module, made, x)

    real = layer_guard._linear_with
    monkeypatch.setattr(layer_guard, "_linear_with", tracking)
    guard_layer(ctx, original, results, ctx.forward(), QuantConfig(method="gptq", group_size=32))
    assert most[0] == 1 and not live
    for name in names:  # the layer's own forwards are back
        assert "forward" not in ctx.layer.get_submodule(name).__dict__


@torch.no_grad()
def layer_outputs(ctx, layer) -> list[torch.Tensor]:
    outputs = [layer(x, **kwargs) for x, kwargs in zip(ctx.inputs, ctx.kwargs, strict=True)]
    return [first_output(out) for out in outputs]


class HarmfulAWQ(AWQ):
    """Folds wild per-channel scales (the layer's function unchanged, its weights hard to quantize)."""

    def smooth_layer(self, ctx) -> dict:
        gen = torch.Generator().manual_seed(ctx.index)
        for group in active_scaling_groups(ctx.layer, ctx.adapter):
            width = ctx.module(group.linears[0]).weight.shape[1]
            fold_scales(ctx.layer, ctx.adapter, group, torch.exp(3 * torch.randn(width, generator=gen)))
        return {}


def test_a_harmful_method_falls_back_to_rtn(monkeypatch, caplog) -> None:
    """Every layer of a method worse than RTN ends exactly as RTN leaves it, and says so."""
    reference = outlier_model("llama")
    calib = random_calibration()
    rtn_model = copy.deepcopy(reference)
    quantize_model(rtn_model, get_adapter(rtn_model), calib, QuantConfig(method="rtn", group_size=32),
                   device="cpu", show_progress=False)
    monkeypatch.setattr("quantkit.quantizers.base.METHODS", {"awq": HarmfulAWQ})
    model = copy.deepcopy(reference)
    with caplog.at_level(logging.WARNING, logger="quantkit"):
        report = quantize_model(model, get_adapter(model), calib,
                                QuantConfig(method="awq", group_size=32, options=AWQOptions(clip=False)),
                                device="cpu", show_progress=False)
    assert [layer["guard"]["fallback"] for layer in report.layers] == ["rtn"] * len(report.layers)
    assert sum("falls back to RTN" in r.message for r in caplog.records) == len(report.layers)
    for (name, tensor), expected in zip(model.state_dict().items(), rtn_model.state_dict().values(), strict=True):
        assert torch.equal(tensor, expected), name


def test_a_method_better_than_rtn_keeps_its_layers() -> None:
    model = outlier_model("llama")
    report = quantize_model(model, get_adapter(model), random_calibration(),
                            QuantConfig(method="awq", group_size=32), device="cpu", show_progress=False)
    for layer in report.layers:
        assert "fallback" not in layer["guard"]
        assert layer["guard"]["output_error"] <= layer["guard"]["rtn_output_error"]
