"""QQQ: adaptive smoothing (against a brute-force search, and function-preserving when folded), its weight
grids (per-channel [-7, 7]; two-level scales exact in int8), and W4A8 end to end against GPTQ and RTN."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
from quantkit.kernels import unsupported_reason
from quantkit.kernels.layout import int8_matmul
from realmodel import with_act_bits
from safetensors.torch import load_file
from test_adapters import TINY, tiny_model
from test_engine import random_calibration
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from quantkit.config import QuantConfig
from quantkit.engine import capture_layer_inputs, quantize_model
from quantkit.export import export_checkpoint, quantized_modules
from quantkit.models import get_adapter
from quantkit.nn.qlinear import QuantLinear, quantize_activations_per_token
from quantkit.qtensor import QuantizationError
from quantkit.quantizers.base import get_method
from quantkit.quantizers.context import LayerContext
from quantkit.quantizers.gptq import GPTQOptions, gptq_quantize
from quantkit.quantizers.qqq import QQQOptions, QQQQuantizer
from quantkit.quantizers.qqq_grids import Int8Weight, PerChannelGrid, make_grid, recover_channel_scales
from quantkit.quantizers.qqq_probe import SmoothingProbe, matmul_probe, module_probe
from quantkit.quantizers.qqq_search import (
    SmoothingChoice,
    candidate_thresholds,
    confirm_after_gptq,
    refine_on_grid,
    search_smoothing,
    threshold_scales,
)
from quantkit.reload import load_quantized
from quantkit.smoothing import active_scaling_groups

pytestmark = pytest.mark.usefixtures("single_thread")


def with_outliers(model: nn.Module) -> nn.Module:
    """A few input channels 20x larger after every norm, as LLM activations have."""
    with torch.no_grad():
        for layer in get_adapter(model).get_layers(model):
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[:3] *= 20
    return model


def qqq_config(group_size: int) -> QuantConfig:
    return QuantConfig(method="qqq", group_size=group_size, act_bits=8, options=QQQOptions(act_order=True))


def fake_int8_tokens(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(dim=-1, keepdim=True) / 127
    return torch.round(x / scale).clamp(-127, 127) * scale


@pytest.mark.parametrize("kind", ["llama-mha", "qwen2"])
def test_folded_smoothing_keeps_logits(kind: str) -> None:
    if kind == "llama-mha":  # no grouped-query attention: v -> o is smoothed too
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**{**TINY, "num_key_value_heads": 4})).eval()
    else:
        model = tiny_model(kind)
    model = with_outliers(model).double()
    reference = copy.deepcopy(model)
    adapter, calib = get_adapter(model), random_calibration(pad_from={1: 10})
    method = get_method(qqq_config(32))
    cpu = torch.device("cpu")
    inputs, layer_kwargs, masks = capture_layer_inputs(model, adapter, calib, cpu, batch_size=4)
    scaled = 0
    for i, layer in enumerate(adapter.get_layers(model)):
        ctx = LayerContext(i, layer, adapter, inputs, layer_kwargs[i], masks, cpu)
        report = method.smooth_layer(ctx)
        assert len(report) == (4 if kind == "llama-mha" else 3)
        scaled += sum(entry["scaled_channels"] for entry in report.values())
        inputs = ctx.forward()
    assert scaled > 0
    out, ref = model(calib.input_ids).logits, reference(calib.input_ids).logits
    assert ((out - ref).norm() / ref.norm()).item() < 1e-9


def test_int8_matmul_is_exact() -> None:
    """Against int64 sums, at the extremes (every product 127 * 128 in magnitude, all of one sign on some rows)
    and over a K past where one fp32 sum would round (3000 such products pass 2**24), and on random codes."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (9, 3000), dtype=torch.int8, generator=gen)
    b = torch.randint(-128, 113, (3000, 7), dtype=torch.int8, generator=gen)
    a[:3], b[:, :2] = 127, -128
    a[3] = -127
    exact = a.long() @ b.long()
    assert exact.abs().max() > 2**24
    out = int8_matmul(a, b)
    assert out.dtype == torch.int32
    assert torch.equal(out.long(), exact)


@pytest.mark.parametrize("group_size", [-1, 32])
def test_int8_loss_is_the_fake_quantized_loss(group_size: int) -> None:
    """The probe runs the group's linears in int8 (int8_matmul) inside the model's own attention and MLP: the
    same loss as fake-quantized activations and weights in float64, q/k/v biases included (Qwen2)."""
    model = with_outliers(tiny_model("qwen2")).double()
    with torch.no_grad():  # initialised to 0
        for bias in (p for name, p in model.named_parameters() if name.endswith("proj.bias")):
            bias.copy_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(bias.numel())))
    adapter, calib, cpu = get_adapter(model), random_calibration(pad_from={1: 10}), torch.device("cpu")
    inputs, layer_kwargs, masks = capture_layer_inputs(model, adapter, calib, cpu, batch_size=4)
    layer = adapter.get_layers(model)[0]
    ctx = LayerContext(0, layer, adapter, inputs, layer_kwargs[0], masks, cpu)
    for group in active_scaling_groups(layer, adapter):
        probe = (module_probe if group.inspect else matmul_probe)(ctx, group, group_size, None)
        scales = threshold_scales(probe.channel_max, probe.channel_min, probe.bound() / 4)
        assert bool((scales != 1).any())
        smoothed = [w * scales.to(w) for w in probe.weights]
        weights = [Int8Weight.round_to_nearest(w, group_size).dequantize() for w in smoothed]
        for w, rtn in zip(smoothed, weights, strict=True):  # GPTQ with an identity Hessian is RTN on the grid
            expected = gptq_quantize(w, torch.eye(w.shape[1], dtype=w.dtype), qqq_config(group_size),
                                     make_grid(group_size)).dequantize(w.dtype)
            torch.testing.assert_close(rtn, expected, rtol=0, atol=0)
        linears = [ctx.module(name) for name in group.linears]
        originals = [linear.weight.data for linear in linears]
        total = 0.0
        for i, (x, target) in enumerate(zip(probe.inputs, probe.targets, strict=True)):
            fake_x = quantize_activations_per_token(x / scales)
            if group.inspect:  # the module computes with the fake-quantized weights
                for linear, weight in zip(linears, weights, strict=True):
                    linear.weight.data = weight
                out = probe.block(i, fake_x, None)
                for linear, weight in zip(linears, originals, strict=True):
                    linear.weight.data = weight
            else:
                out = torch.cat([fake_x @ w.T for w in weights], dim=-1)
            total += (out - target).square().sum().item()
        assert probe.loss(scales) == pytest.approx(total / probe.tokens, rel=1e-6)


def brute_force_loss(x: torch.Tensor, w: torch.Tensor, threshold: float) -> float:
    """Per-token int8 x / s times per-channel 4-bit (absmax / 7, fp16 scale) W * s, against x W^T."""
    cmx, cmn = x.amax(dim=0), x.amin(dim=0)
    s = torch.ones(x.shape[1], dtype=torch.float64)
    for j in range(x.shape[1]):
        if cmx[j] > threshold or cmn[j] < -threshold:
            s[j] = max(cmx[j] / threshold, cmn[j] / -threshold)
    ws = w * s
    scale = (ws.abs().amax(dim=1, keepdim=True) / 7).half().double()
    wq = torch.round(ws / scale).clamp(-7, 7) * scale
    return ((fake_int8_tokens(x / s) @ wq.T - x @ w.T) ** 2).sum().item() / x.shape[0]


def test_threshold_search_is_the_brute_force_argmin() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(160, 24, generator=gen, dtype=torch.float64)
    x[:, [2, 7]] *= torch.tensor([30.0, -12.0], dtype=torch.float64)  # one-sided outliers
    w = torch.randn(16, 24, generator=gen, dtype=torch.float64) * 0.05
    probe = SmoothingProbe.for_matmul([x[:100], x[100:]], [w], group_size=-1)
    choice = search_smoothing(probe, steps=None, search="grid")

    bound = x.abs().max().item()
    count = max(100, int(bound / 0.5))
    thresholds = [bound - i * (bound - 0.1) / count for i in range(count + 1)]
    losses = [brute_force_loss(x, w, t) for t in thresholds]
    best = min(range(len(losses)), key=losses.__getitem__)
    assert 0 < best  # smoothing pays off here
    assert choice.threshold == pytest.approx(thresholds[best], rel=1e-6)  # the probe keeps fp32 ranges
    assert choice.loss == pytest.approx(losses[best], rel=1e-5)
    assert len(candidate_thresholds(bound, 7)) == 8  # an explicit step count replaces the reference rule
    assert choice.loss_unsmoothed == pytest.approx(losses[0], rel=1e-5)
    assert int((choice.scales != 1).sum()) == sum(
        1 for j in range(24) if x[:, j].max() > choice.threshold or x[:, j].min() < -choice.threshold)
    assert choice.evaluated == count + 1

    # the default, coarse-to-fine: the same minimum here, from a third of the losses
    refined = search_smoothing(probe, steps=None)
    assert refined.threshold == choice.threshold and refined.loss == choice.loss
    assert refined.loss_unsmoothed == choice.loss_unsmoothed and refined.evaluated < (count + 1) / 2


def visits(losses: list[float], **options) -> dict[int, float]:
    """The grid indices refine_on_grid evaluates on these losses, with their losses."""
    seen: dict[int, float] = {}

    def loss(index: int) -> float:
        seen[index] = losses[index]
        return losses[index]

    refine_on_grid(loss, len(losses), **options)
    return seen


@pytest.mark.parametrize("count", [1, 2, 25, 101, 2001])
def test_refined_search_finds_a_valleys_floor(count: int) -> None:
    """A single valley, anywhere on the grid (ends included): the descent reaches its floor exactly."""
    for floor in sorted({0, count // 3, count - 1}):
        seen = visits([abs(i - floor) + 0.5 for i in range(count)])
        assert min(seen, key=seen.__getitem__) == floor
        assert len(seen) <= min(count, 25 + 3 * 2 * max(1, count).bit_length())


def test_refined_search_on_rugged_losses() -> None:
    """Every coarse candidate (every 5th of 101, both ends), a few refinements around them, never worse than the
    coarse pass; every index when the grid is no finer than the coarse pass."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        losses = (torch.rand(101, generator=gen) + torch.linspace(1, 0, 101) ** 2).tolist()
        seen = visits(losses)
        coarse = set(range(0, 101, 5))
        assert coarse <= set(seen) and len(seen) <= len(coarse) + 3 * 2 * 3  # 3 starts, steps 3, 2, 1
        assert min(seen.values()) <= min(losses[i] for i in coarse)
    assert set(visits(losses[:25])) == set(range(25))


def outlier_probe() -> tuple[SmoothingProbe, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(192, 32, generator=gen, dtype=torch.float64)
    x[:, [1, 9]] *= torch.tensor([25.0, -10.0], dtype=torch.float64)
    w = torch.randn(24, 32, generator=gen, dtype=torch.float64) * 0.05
    return SmoothingProbe.for_matmul([x[:96], x[96:]], [w], group_size=-1), x, w


def test_gptq_loss_is_gptq_on_the_smoothed_problem() -> None:
    """gptq_loss(s) = block loss of int8(x / s) through GPTQ(W * s) with H = 2 (x/s)^T (x/s) / tokens."""
    probe, x, w = outlier_probe()
    config = qqq_config(-1)
    scales = torch.ones(32, dtype=torch.float64)
    scales[[1, 9]] = torch.tensor([6.0, 3.0], dtype=torch.float64)
    xs = x / scales
    hessian = 2 * xs.T @ xs / x.shape[0]
    wq = gptq_quantize(w * scales, hessian, config, make_grid(-1)).dequantize(torch.float64)
    expected = ((fake_int8_tokens(xs) @ wq.T - x @ w.T) ** 2).sum().item() / x.shape[0]
    assert probe.gptq_loss(scales, config) == pytest.approx(expected, rel=1e-6)


def test_smoothing_is_kept_only_if_it_helps_after_gptq(monkeypatch: pytest.MonkeyPatch) -> None:
    probe, _, _ = outlier_probe()
    config = qqq_config(-1)
    choice = search_smoothing(probe, steps=50)
    assert bool((choice.scales != 1).any())
    kept = confirm_after_gptq(probe, choice, config)
    smoothed, unsmoothed = kept.gptq_losses
    assert smoothed == pytest.approx(probe.gptq_loss(choice.scales, config))
    assert unsmoothed == pytest.approx(probe.gptq_loss(torch.ones_like(choice.scales), config))
    assert (kept is choice) == (smoothed < unsmoothed)

    # GPTQ undoing the gain (here: forced) turns the smoothing down: s = 1 and the unsmoothed loss
    monkeypatch.setattr(SmoothingProbe, "gptq_loss", lambda self, s, c: float((s != 1).sum()))
    rejected = confirm_after_gptq(probe, choice, config)
    assert bool((rejected.scales == 1).all()) and rejected.rejected == choice.threshold
    assert rejected.loss == rejected.loss_unsmoothed == choice.loss_unsmoothed
    assert rejected.threshold == probe.bound()
    unscaled = SmoothingChoice(1.0, torch.ones(32), 2.0, 2.0)
    assert confirm_after_gptq(probe, unscaled, config) is unscaled  # nothing to check


def random_layer(out_features: int, in_features: int, seed: int) -> tuple[nn.Linear, torch.Tensor]:
    """Groups of very different magnitudes (a dead row too) and correlated inputs with outliers."""
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=gen) * 0.05)
        linear.weight[:, :32] *= 0.01
        linear.weight[:, -32:] *= 3
        linear.weight[5] = 0
    mixing = torch.eye(in_features) + torch.randn(in_features, in_features, generator=gen) / in_features**0.5
    x = torch.randn(256, in_features, generator=gen) @ mixing
    x[:, :2] *= 10
    return linear, x


def test_two_level_scales_reproduce_fake_quantized_weights_in_int8() -> None:
    linear, x = random_layer(48, 128, seed=5)
    quantizer = QQQQuantizer(linear, qqq_config(32))
    quantizer.add_batch(x)
    qw = quantizer.quantize()
    assert qw.channel_scales is not None and "fallback" not in qw.info
    assert bool((qw.zeros == 8).all()) and int(qw.codes.max()) <= 15
    multiple = qw.scales / qw.channel_scales[:, None]  # the group scales of the kernel
    assert torch.equal(multiple, multiple.round()) and multiple.min() >= 1 and multiple.max() <= 16
    int8 = (qw.codes.float() - 8) * multiple.repeat_interleave(32, dim=1)
    assert int8.min() >= -128 and int8.max() <= 127
    torch.testing.assert_close(int8 * qw.channel_scales[:, None], qw.dequantize(), rtol=0, atol=0)
    for dtype in (torch.float16, torch.bfloat16):  # exports store s_g in these: no rounding
        assert torch.equal(qw.scales.to(dtype).float(), qw.scales)
    # the largest group of a row uses most of the int8 range (s_ch is not needlessly coarse)
    assert multiple[qw.channel_scales > 2**-21].amax(dim=1).min() >= 14

    for dtype in (torch.float32, torch.float16):
        layer = QuantLinear.from_quantized(qw, None, dtype, act_bits=8)
        torch.testing.assert_close(layer.scales.float(), multiple.t(), rtol=0, atol=0)
        torch.testing.assert_close(layer.dequantized_weight(), qw.dequantize(dtype), rtol=0, atol=0)
    inputs = x[:7].double()
    expected = fake_int8_tokens(inputs) @ (int8.double() * qw.channel_scales.double()[:, None]).T
    layer = QuantLinear.from_quantized(qw, None, torch.float32, act_bits=8)
    torch.testing.assert_close(layer(inputs.float()).double(), expected, rtol=1e-5, atol=1e-6)


def test_per_channel_codes_stay_in_minus7_to_7() -> None:
    linear, _ = random_layer(48, 128, seed=6)
    gen = torch.Generator().manual_seed(6)  # strongly correlated inputs: large GPTQ updates
    x = torch.randn(256, 64, generator=gen) @ torch.randn(64, 128, generator=gen)
    x += 0.1 * torch.randn(256, 128, generator=gen)
    w = linear.weight.detach()
    rtn = gptq_quantize(w, torch.eye(128), qqq_config(-1), PerChannelGrid())  # identity Hessian: plain RTN
    scale = torch.where(w.abs().amax(dim=1) == 0, 1.0, w.abs().amax(dim=1) / 7).half().float()
    torch.testing.assert_close(rtn.scales[:, 0], scale, rtol=0, atol=0)
    torch.testing.assert_close(rtn.codes.float() - 8, torch.round(w / scale[:, None]), rtol=0, atol=0)

    quantizer = QQQQuantizer(linear, qqq_config(-1))
    quantizer.add_batch(x)
    qw = quantizer.quantize()  # GPTQ's updates push weights past -7.5 steps here (code 0 if not clamped)
    assert qw.channel_scales is None and bool((qw.zeros == 8).all())
    assert int(qw.codes.min()) == 1 and int(qw.codes.max()) == 15
    torch.testing.assert_close(qw.scales, rtn.scales, rtol=0, atol=0)


def test_fallback_stays_on_qqq_grid(caplog) -> None:
    linear, _ = random_layer(16, 64, seed=7)
    quantizer = QQQQuantizer(linear, qqq_config(32))
    quantizer.add_batch(torch.zeros(0, 64))
    with caplog.at_level(logging.WARNING, logger="quantkit"):
        qw = quantizer.quantize()
    assert qw.info["fallback"] == "rtn" and qw.channel_scales is not None
    multiple = qw.scales / qw.channel_scales[:, None]
    assert torch.equal(multiple, multiple.round())


def test_qqq_fixes_its_scheme_at_construction() -> None:
    """W4A8 with symmetric weights and act-order: fields left at their defaults take QQQ's values when the config is
    made (nothing changes it later); a field set against them is refused, in one line."""
    config = QuantConfig(method="qqq", group_size=32)
    assert (config.sym, config.options.act_order, config.act_bits) == (True, True, 8)
    assert config.method_fixes() == {"sym": True, "act_bits": 8}
    assert get_method(config).config == config
    with pytest.raises(QuantizationError, match=r"qqq needs sym=True; sym=False \(--asym\) contradicts it"):
        QuantConfig(method="qqq", sym=False)
    with pytest.raises(QuantizationError, match="--no-act-order contradicts it"):
        QQQOptions(act_order=False)
    with pytest.raises(QuantizationError, match="--mse does not apply"):
        QQQOptions(mse=True)
    with pytest.raises(QuantizationError, match="4-bit"):
        get_method(QuantConfig(method="qqq", bits=8))
    with pytest.raises(QuantizationError, match="smooth_search must be one of"):
        QQQOptions(smooth_search="golden")


@pytest.mark.parametrize("group_size", [-1, 32])
@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_rtn_and_gptq_weights_ignore_act_bits(method: str, group_size: int) -> None:
    """Calibration runs each layer with dequantized weights and unquantized activations, so W4A8 RTN / GPTQ
    quantize to W4A16's weights: the real-model tests evaluate one quantization both ways (realmodel.with_act_bits)."""
    original, calib = with_outliers(tiny_model("llama")), random_calibration()
    models = {}
    for act_bits in (16, 8):
        options = GPTQOptions(act_order=True) if method == "gptq" else None
        config = QuantConfig(method=method, group_size=group_size, act_bits=act_bits, options=options)
        models[act_bits] = copy.deepcopy(original)
        quantize_model(models[act_bits], get_adapter(original), calib, config, device="cpu", show_progress=False)
    w4a16, w4a8 = (models[bits].state_dict() for bits in (16, 8))
    assert w4a16.keys() == w4a8.keys()
    assert all(torch.equal(w4a16[name], w4a8[name]) for name in w4a16)
    reused = with_act_bits(models[16], 8)
    assert all(q.act_bits == 8 for q in quantized_modules(reused).values())
    with torch.no_grad():
        assert torch.equal(reused(calib.input_ids).logits, models[8](calib.input_ids).logits)


@pytest.mark.parametrize("group_size", [-1, 32])
def test_w4a8_end_to_end_beats_gptq_and_rtn_and_reloads(tmp_path, group_size: int) -> None:
    original = with_outliers(tiny_model("llama"))
    calib = random_calibration()
    reference = original(calib.input_ids).logits
    errors, models = {}, {}
    for method in ("rtn", "gptq", "qqq"):
        model = copy.deepcopy(original)
        config = QuantConfig(method=method, group_size=group_size, act_bits=8)  # QQQ's defaults
        report = quantize_model(model, get_adapter(model), calib, config, device="cpu", show_progress=False)
        assert all(q.act_bits == 8 for q in quantized_modules(model).values())
        if method == "qqq":  # what its search minimises: never above the unsmoothed layer's loss
            groups = [group for layer in report.layers for group in layer["smoothing"].values()]
            assert groups and all(g["loss"] <= g["loss_unsmoothed"] for g in groups), groups
        logits = model(calib.input_ids).logits
        errors[method] = ((logits - reference).norm() / reference.norm()).item()
        models[method] = (model, config)
    assert errors["qqq"] < errors["gptq"] < errors["rtn"], errors

    model, config = models["qqq"]
    out = export_checkpoint(model, None, tmp_path / "ckpt", config, "compressed-tensors", dtype="float16")
    scheme = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert scheme["input_activations"]["num_bits"] == 8 and scheme["weights"]["symmetric"]
    tensors = load_file(out / "model.safetensors")
    reloaded, _ = load_quantized(out, dtype=torch.float32)
    for name, q in quantized_modules(model).items():
        assert (q.channel_scales is not None) == (group_size != -1)
        qw = q.to_quantized()  # weight_scale is the effective scale s_g, exactly (fp16 holds it)
        torch.testing.assert_close(tensors[f"{name}.weight_scale"].float(), qw.scales, rtol=0, atol=0)
        r = reloaded.get_submodule(name)
        assert isinstance(r, QuantLinear) and r.act_bits == 8
        torch.testing.assert_close(r.dequantized_weight(), q.dequantized_weight().float(), rtol=0, atol=0)
        if group_size != -1:  # two-level again: the same int8 weights and per-channel scales, so the same kernels
            assert torch.equal(r.channel_scales, q.channel_scales) and torch.equal(r.scales, q.scales.float())
            assert "one-level" not in (unsupported_reason(r) or "")  # on a GPU: the two-level W4A8 kernels
    with torch.no_grad():  # the export stored embeddings and norms in fp16; int8 rounding magnifies that
        for p in model.parameters():
            p.copy_(p.half())
    torch.testing.assert_close(reloaded(calib.input_ids).logits, model(calib.input_ids).logits)


def test_channel_scales_are_read_back_from_two_level_group_scales() -> None:
    """Every row TwoLevelGrid makes gives its own s_ch back from the stored s_g = k * s_ch (fp16, as exported);
    group scales not made that way give None."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(64, 8, 32, generator=gen) * torch.logspace(-3, 1, 64)[:, None, None]
    grid = make_grid(32)
    group_scales, _ = grid.qparams(weight)
    stored = group_scales.to(torch.float16).float()
    assert torch.equal(stored, group_scales)  # exact in fp16
    assert torch.equal(recover_channel_scales(stored), grid.channel_scales)
    assert recover_channel_scales(stored * torch.linspace(1, 1.01, 8)) is None
