"""awq-gptq: AWQ's scale search folded per layer, then act-order GPTQ on the smoothed layer.

Tiny random models for the pieces and the exports; the claim on a real model (awq-gptq, the default, beats act-order
GPTQ and RTN on held-out NLL): test_smollm2.py.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace

import pytest
import torch
from test_awq import brute_force_losses, layer_context, outlier_model
from test_engine import random_calibration

from quantkit.config import QuantConfig
from quantkit.engine import quantize_model
from quantkit.export import export_checkpoint, quantized_modules
from quantkit.models import get_adapter
from quantkit.nn.qlinear import QuantLinear
from quantkit.qtensor import QuantizationError, compute_qparams, fake_quantize
from quantkit.quantizers.awq import AWQOptions, search_scales
from quantkit.quantizers.awq_gptq import (
    POST_NORMS,
    SHRINK_STEP,
    AWQGPTQOptions,
    HessianWeightedGrid,
    gptq_trial,
    hessian_grid,
)
from quantkit.quantizers.base import get_method
from quantkit.quantizers.gptq import GPTQOptions, gptq_quantize
from quantkit.reload import load_quantized
from quantkit.smoothing import active_scaling_groups

pytestmark = pytest.mark.usefixtures("single_thread")
def quantized(original, calib, config: QuantConfig):
    model = copy.deepcopy(original)
    report = quantize_model(model, get_adapter(model), calib, config, device="cpu", show_progress=False)
    return model, report


def logits_error(model, reference: torch.Tensor, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return ((model(ids).logits - reference).norm() / reference.norm()).item()


def test_defaults_are_act_order_and_awqs() -> None:
    options = AWQGPTQOptions()
    assert options.act_order and not options.clip and options.grid == 5
    assert options.damp_percent == 0.05 and not options.duo_scaling and AWQOptions().duo_scaling
    assert options.scale_score == "rtn" and options.range_steps == 16
    with pytest.raises(QuantizationError, match="range_steps must be at most 40"):
        AWQGPTQOptions(range_steps=41)
    config = QuantConfig(method="awq-gptq", group_size=32)
    assert config.label() == "awq-gptq W4A16 g32 sym act-order"
    assert QuantConfig.from_dict(config.to_dict()).options == options


def test_hessian_grid_is_the_best_shrunk_range_by_brute_force() -> None:
    """Per (row, group): the shrink of 1, 0.98, ... whose min-max grid minimises sum_j H_jj (w_j - q_j)^2."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 2, 16, generator=gen, dtype=torch.float64)
    w[0, 0, 3] = 9.0  # an outlier on an unimportant input channel: the search cuts it
    importance = torch.rand(32, generator=gen, dtype=torch.float64)
    importance[3] = 1e-3
    for sym in (True, False):
        config = QuantConfig(method="awq-gptq", group_size=16, sym=sym)
        scale, zero = HessianWeightedGrid(importance, config, steps=16).qparams(w)
        for row, group in itertools.product(range(6), range(2)):
            weights, h = w[row, group], importance[16 * group:16 * group + 16]
            errors = []
            for step in range(16):
                shrink = 1 - step * SHRINK_STEP
                s, z = compute_qparams(shrink * weights.min(), shrink * weights.max(), 4, sym)
                errors.append(((fake_quantize(weights, s, z, 4) - weights) ** 2 * h).sum().item())
            best = min(range(16), key=errors.__getitem__)
            lo, hi = (1 - best * SHRINK_STEP) * weights.min(), (1 - best * SHRINK_STEP) * weights.max()
            expected = compute_qparams(lo, hi, 4, sym)
            assert (scale[row, group], zero[row, group]) == pytest.approx(expected, abs=0), (sym, row, group)
        assert scale[0, 0] < compute_qparams(w[0, 0].min(), w[0, 0].max(), 4, sym)[0]  # the outlier was cut


def test_gptq_trial_is_gptq_of_the_folded_linear() -> None:
    """The scale search's GPTQ candidate, from the unfolded Hessian, equals GPTQ on the folded linear and inputs."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(8, 32, generator=gen, dtype=torch.float64)
    x = torch.randn(64, 32, generator=gen, dtype=torch.float64) * torch.linspace(0.1, 4, 32, dtype=torch.float64)
    scales = torch.rand(32, generator=gen, dtype=torch.float64) + 0.5
    config = QuantConfig(method="awq-gptq", group_size=16)
    hessian = 2 / 64 * x.T @ x
    folded_x = x / scales
    folded_hessian = 2 / 64 * folded_x.T @ folded_x
    expected = gptq_quantize(weight * scales, folded_hessian, config, hessian_grid(folded_hessian, config))
    trial = gptq_trial(hessian, config)(weight, scales)
    torch.testing.assert_close(trial * scales, expected.dequantize(torch.float64), rtol=1e-12, atol=1e-12)


def test_smoothing_is_awqs_and_clipping_is_optional() -> None:
    """Layer 0 sees the same inputs under AWQ and awq-gptq scoring by RTN: its folded norms are AWQ's, to the bit."""
    original, calib = outlier_model("llama"), random_calibration()
    awq, _ = quantized(original, calib, QuantConfig(method="awq", group_size=32,
                                                    options=AWQOptions(duo_scaling=False)))  # awq-gptq's scales
    unclipped = QuantConfig(method="awq-gptq", group_size=32, options=AWQGPTQOptions(grid=20, scale_score="rtn"))
    ours, report = quantized(original, calib, unclipped)
    for norm in ("input_layernorm", "post_attention_layernorm"):
        expected = awq.model.layers[0].get_submodule(norm).weight
        assert torch.equal(ours.model.layers[0].get_submodule(norm).weight, expected), norm
        assert not torch.equal(expected, original.model.layers[0].get_submodule(norm).weight), norm
    assert all("clip" not in layer["smoothing"] for layer in report.layers)
    clipped = QuantConfig(method="awq-gptq", group_size=32, options=AWQGPTQOptions(clip=True))
    _, report = quantized(original, calib, clipped)
    assert all("clip" in layer["smoothing"] for layer in report.layers)


def test_post_norm_loss_scores_after_the_sandwich_norm() -> None:
    """Gemma 3: each candidate's loss is the MSE of the block's post-norm output (up -> down: the MLP's), by brute
    force over the whole layer; without sandwich norms (Llama) the option changes nothing."""
    options = AWQGPTQOptions(post_norm_loss=True)
    config = QuantConfig(method="awq-gptq", group_size=32, options=options)
    ctx = layer_context(outlier_model("gemma3", torch.float64), random_calibration(pad_from={0: 7}), index=1)
    for group in active_scaling_groups(ctx.layer, ctx.adapter):
        result = get_method(config).search_group(ctx, group)
        after_norm = replace(group, inspect=POST_NORMS[group.inspect or "mlp"])
        _, losses = brute_force_losses(copy.deepcopy(ctx.layer), ctx, after_norm, config)
        assert list(result.losses.values()) == pytest.approx(losses, rel=1e-6), group.prev
        unnormed = search_scales(ctx, group, config).losses
        assert list(result.losses.values()) != pytest.approx(list(unnormed.values()), rel=1e-3), group.prev
    ctx = layer_context(outlier_model("llama", torch.float64), random_calibration(), index=1)
    for group in active_scaling_groups(ctx.layer, ctx.adapter):
        assert get_method(config).search_group(ctx, group).losses == search_scales(ctx, group, config).losses


@pytest.mark.parametrize("act_bits", [16, 8])
def test_beats_gptq_and_rtn_on_logits(act_bits: int) -> None:
    original, calib = outlier_model("llama"), random_calibration(n=8, seqlen=32)
    heldout = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        reference = original(heldout).logits
    runs = {"rtn": ("rtn", None), "gptq": ("gptq", GPTQOptions(act_order=True)), "clipped": ("awq-gptq", AWQGPTQOptions(clip=True)),
            "awq-gptq": ("awq-gptq", None)}
    errors = {}
    for label, (method, options) in runs.items():
        config = QuantConfig(method=method, group_size=32, act_bits=act_bits, options=options)
        errors[label] = logits_error(quantized(original, calib, config)[0], reference, heldout)
    assert errors["awq-gptq"] < 0.95 * errors["gptq"] < 0.95 * 0.7 * errors["rtn"], errors
    # AWQ's clipping (RTN's best range) before GPTQ does not help: GPTQ compensates better unclipped
    assert errors["awq-gptq"] < errors["clipped"], errors


@pytest.mark.parametrize(("fmt", "sym", "act_bits"), [
    ("gptq", True, 16), ("awq", False, 16), ("awq", True, 16), ("compressed-tensors", False, 16),
    ("compressed-tensors", True, 8),
])
def test_every_format_exports_and_reloads(tmp_path, fmt: str, sym: bool, act_bits: int) -> None:
    original, calib = outlier_model("llama"), random_calibration()
    config = QuantConfig(method="awq-gptq", group_size=32, sym=sym, act_bits=act_bits)
    model, _ = quantized(original, calib, config)
    out = export_checkpoint(model, None, tmp_path / "ckpt", config, fmt, dtype="float16")
    reloaded, _ = load_quantized(out, dtype=torch.float32)
    for name, q in quantized_modules(model).items():
        r = reloaded.get_submodule(name)
        assert isinstance(r, QuantLinear) and r.act_bits == act_bits
        torch.testing.assert_close(r.dequantized_weight(), q.dequantized_weight().float(), rtol=0, atol=0)
