"""AWQ: scale and clip searches against brute force, function preservation, failure paths, end to end."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from test_adapters import tiny_model
from test_engine import random_calibration
from torch import nn

from quantkit.config import QuantConfig
from quantkit.engine import capture_layer_inputs, quantize_model
from quantkit.export import export_checkpoint
from quantkit.models import get_adapter
from quantkit.quantizers.awq import (
    CLIP_GRID,
    CLIP_STEPS,
    AWQOptions,
    _sample_inputs,
    clip_targets,
    scored_batch_count,
    search_clip,
    search_order,
    search_scales,
)
from quantkit.quantizers.base import get_method
from quantkit.quantizers.context import LayerContext
from quantkit.quantizers.rtn import rtn_quantize
from quantkit.reload import load_quantized
from quantkit.smoothing import active_scaling_groups

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("single_thread")


def outlier_model(kind: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A tiny random model with non-trivial norms and a few large activation channels, as real LLMs have."""
    model = tiny_model(kind).to(dtype)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.rand(p.shape, generator=gen, dtype=dtype) + 0.5)
                if "norm" in name:
                    p[:4] *= 8
    return model


def layer_context(model: nn.Module, calib, index: int = 0) -> LayerContext:
    """The LayerContext the engine would hand to smooth_layer for layer `index` of an unquantized model."""
    adapter = get_adapter(model)
    inputs, kwargs, masks = capture_layer_inputs(model, adapter, calib, CPU, batch_size=4)
    layers = adapter.get_layers(model)
    for i in range(index):
        inputs = LayerContext(i, layers[i], adapter, inputs, kwargs[i], masks, CPU).forward()
    return LayerContext(index, layers[index], adapter, inputs, kwargs[index], masks, CPU)


def smooth_only(model: nn.Module, calib, config: QuantConfig) -> list[dict]:
    """AWQ's per-layer smoothing over the whole model, without quantizing any linear."""
    adapter, method = get_adapter(model), get_method(config)
    inputs, kwargs, masks = capture_layer_inputs(model, adapter, calib, CPU, batch_size=4)
    reports = []
    for i, layer in enumerate(adapter.get_layers(model)):
        ctx = LayerContext(i, layer, adapter, inputs, kwargs[i], masks, CPU)
        reports.append(method.smooth_layer(ctx))
        inputs = ctx.forward()
    return reports


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3", "opt"])
def test_folding_searched_scales_keeps_logits(kind: str) -> None:
    """Catches wrong norm / bias handling: smoothing alone must not change the function."""
    model = outlier_model(kind, torch.float64)
    reference = copy.deepcopy(model)
    calib = random_calibration(pad_from={1: 9})
    reports = smooth_only(model, calib, QuantConfig(method="awq", group_size=32, sym=False, options=AWQOptions(clip=False)))
    ratios = [g["ratio"] for r in reports for g in r["scales"].values()]
    adapter = get_adapter(model)
    assert len(ratios) == 2 * len(active_scaling_groups(adapter.get_layers(model)[0], adapter))
    assert max(ratios) > 0  # scales were folded, not all left at 1
    out, ref = model(calib.input_ids).logits, reference(calib.input_ids).logits
    # Gemma's RMSNorm computes (1 + w) in fp32 internally, which loses digits once (1 + w) / s is small
    assert ((out - ref).norm() / ref.norm()).item() < (2e-5 if kind == "gemma3" else 1e-12)


@torch.no_grad()
def brute_force_losses(layer: nn.Module, ctx: LayerContext, group, config: QuantConfig) -> tuple[list, list]:
    """Per grid ratio, straight from the definition: candidate scales and the output MSE of the
    inspected module (or the linear) over the real tokens, with the linears set to Q(W s) / s."""
    target = layer.get_submodule(group.inspect or group.linears[0])
    first = layer.get_submodule(group.linears[0])
    seen: dict[str, list] = {"x": [], "y": []}
    h1 = first.register_forward_hook(lambda _m, a, _o: seen["x"].append(a[0]))
    h2 = target.register_forward_hook(lambda _m, _a, o: seen["y"].append(o[0] if isinstance(o, tuple) else o))

    def run() -> None:
        seen["x"].clear(), seen["y"].clear()
        for x, kwargs in zip(ctx.inputs, ctx.kwargs, strict=True):
            layer(x, **kwargs)

    def real(tensors) -> torch.Tensor:
        pairs = zip(tensors, ctx.token_masks, strict=True)
        return torch.cat([t.reshape(-1, t.shape[-1])[m.reshape(-1)] for t, m in pairs])

    run()
    x_mean, reference = real(seen["x"]).abs().mean(0), real(seen["y"])
    weights = [layer.get_submodule(n).weight.detach().clone() for n in group.linears]
    w_mean = torch.cat([w.abs().reshape(w.shape[0], -1, config.group_size) for w in weights])
    w_mean = (w_mean / (w_mean.amax(-1, keepdim=True) + 1e-6)).reshape(-1, weights[0].shape[1]).mean(0)
    candidates, losses = [], []
    for k in range(config.options.grid):
        r = k / config.options.grid
        s = x_mean**r / (w_mean ** (1 - r) + 1e-4) if config.options.duo_scaling else x_mean**r
        s = s.clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        for name, w in zip(group.linears, weights, strict=True):
            q = rtn_quantize(w * s, config.bits, config.group_size, config.sym, False).dequantize(w.dtype)
            layer.get_submodule(name).weight.data = q / s
        run()
        candidates.append(s)
        losses.append(float((real(seen["y"]) - reference).pow(2).mean()))
    h1.remove(), h2.remove()
    return candidates, losses


@pytest.mark.parametrize("kind", ["llama", "opt"])
@pytest.mark.parametrize("duo", [False, True])
def test_chosen_scale_minimises_the_loss_over_the_grid(kind: str, duo: bool) -> None:
    model = outlier_model(kind, torch.float64)
    config = QuantConfig(method="awq", group_size=32, sym=duo, options=AWQOptions(duo_scaling=duo, search="grid"))
    ctx = layer_context(model, random_calibration(pad_from={0: 7}), index=1)
    for group in active_scaling_groups(ctx.layer, ctx.adapter):
        result = search_scales(ctx, group, config)
        candidates, losses = brute_force_losses(copy.deepcopy(ctx.layer), ctx, group, config)
        assert [result.losses[k] for k in range(len(losses))] == pytest.approx(losses, rel=1e-9), group.prev
        best = min(range(len(losses)), key=losses.__getitem__)
        if losses[best] < result.rtn_loss:
            assert result.ratio == best / config.options.grid
            torch.testing.assert_close(result.scales, candidates[best], rtol=1e-12, atol=0)
        else:  # no scaling scored better than s = 1
            assert result.ratio is None and result.scales is None and result.loss == result.rtn_loss


@pytest.mark.parametrize("grid", [20, 5, 33])
def test_refine_search_finds_the_minimum_of_a_unimodal_loss(grid: int) -> None:
    for minimum in range(grid):
        scored = search_order(grid, "refine", lambda k, m=minimum: (k - m) ** 2 + 0.5 * k)
        assert min(scored, key=scored.__getitem__) == min(range(grid), key=lambda k, m=minimum: (k - m) ** 2 + 0.5 * k)
        assert len(scored) == grid if grid < 8 else len(scored) <= {20: 9, 33: 13}[grid], (grid, minimum, sorted(scored))
    assert sorted(search_order(grid, "grid", float)) == list(range(grid))


@pytest.mark.parametrize("duo", [False, True])
def test_refine_search_scores_a_subset_of_the_grid_and_keeps_its_minimum(duo: bool) -> None:
    ctx = layer_context(outlier_model("llama", torch.float64), random_calibration(), index=1)
    grid = QuantConfig(method="awq", group_size=32, options=AWQOptions(duo_scaling=duo, search="grid"))
    refine = replace(grid, options=AWQOptions(duo_scaling=duo))  # the default
    for group in active_scaling_groups(ctx.layer, ctx.adapter):
        full, fast = search_scales(ctx, group, grid), search_scales(ctx, group, refine)
        assert 0 in fast.losses and len(fast.losses) < len(full.losses)
        assert fast.losses == pytest.approx({k: full.losses[k] for k in fast.losses}, rel=1e-12)
        assert fast.loss == min([fast.rtn_loss, *fast.losses.values()]) <= fast.rtn_loss


def test_a_search_where_every_scale_is_harmful_keeps_the_identity() -> None:
    """Every candidate but s = 1 scores worse than no scaling (a trial that adds noise to any scaled weight):
    the search ends at the identity and smooth_layer folds nothing."""
    model = outlier_model("llama")
    ctx = layer_context(model, random_calibration())
    noise = torch.Generator().manual_seed(4)

    def harmful(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        if torch.equal(scales, torch.ones_like(scales)):
            return weight
        return weight + 0.05 * torch.randn(weight.shape, generator=noise, dtype=weight.dtype)

    method = get_method(QuantConfig(method="awq", group_size=32, options=AWQOptions(clip=False)))
    method.trial_weight = lambda _ctx, _group: harmful
    before = copy.deepcopy(ctx.layer.state_dict())
    report = method.smooth_layer(ctx)
    assert report["unscaled_groups"] == len(report["scales"]) == 3 and report["skipped_groups"] == 0
    for entry in report["scales"].values():
        assert entry["ratio"] is None and entry["loss_awq"] == entry["loss_rtn"] == 0.0
    for name, tensor in ctx.layer.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_scored_batches_hold_at_most_the_search_tokens() -> None:
    tokens = [10, 8, 5]  # real tokens per batch
    assert [scored_batch_count(tokens, n) for n in (0, 1, 10, 17, 18, 22, 23, 100)] == [3, 1, 1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize("kind", ["llama", "opt"])
def test_scale_search_scores_only_the_first_batches(kind: str) -> None:
    """The calibration batches repeated twice and the search limited to the first copy: x̄ is the same, so the
    losses and the scales must be those of the search over one copy, every token scored."""
    ctx = layer_context(outlier_model(kind, torch.float64), random_calibration(pad_from={1: 9}), index=1)
    tokens = sum(int(m.sum()) for m in ctx.token_masks)
    twice = LayerContext(ctx.index, ctx.layer, ctx.adapter, ctx.inputs * 2, ctx.kwargs * 2, ctx.token_masks * 2, CPU)
    every = QuantConfig(method="awq", group_size=32, options=AWQOptions(search_tokens=0))
    first = replace(every, options=AWQOptions(search_tokens=tokens))
    for group in active_scaling_groups(ctx.layer, ctx.adapter):
        reference, limited = search_scales(ctx, group, every), search_scales(twice, group, first)
        assert (limited.tokens, limited.scored_tokens) == (2 * tokens, tokens)
        assert limited.losses == pytest.approx(reference.losses, rel=1e-12), group.prev
        assert limited.ratio == reference.ratio
        torch.testing.assert_close(limited.scales, reference.scales, rtol=1e-12, atol=0)


def test_scale_search_without_scored_tokens_leaves_the_scale() -> None:
    ctx = layer_context(outlier_model("llama"), random_calibration())
    masks = [torch.zeros_like(ctx.token_masks[0]), *ctx.token_masks[1:]]  # the first batch: padding only
    padded = LayerContext(ctx.index, ctx.layer, ctx.adapter, ctx.inputs, ctx.kwargs, masks, CPU)
    config = QuantConfig(method="awq", group_size=32, options=AWQOptions(search_tokens=1))
    result = search_scales(padded, active_scaling_groups(ctx.layer, ctx.adapter)[0], config)
    assert result.scales is None and "scored batches" in result.skipped and result.tokens > 0


def test_clip_search_minimises_each_groups_output_error() -> None:
    """Per group, the shrink minimising the group's partial output error (brute force); a row whose per-group
    choices give a larger whole-row output error than no clipping keeps every group unclipped."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(6, 48, generator=gen, dtype=torch.float64) * 0.05
    weight[:, 5] *= 6  # an outlier weight in group 0 of every row: clipping pays there
    x = torch.randn(40, 48, generator=gen, dtype=torch.float64)

    def quantized(row: int, limits: list[float]) -> torch.Tensor:
        clipped = weight[row:row + 1].clone()
        for g, limit in enumerate(limits):
            clipped[:, 16 * g:16 * g + 16] = clipped[:, 16 * g:16 * g + 16].clamp(-limit, limit)
        return rtn_quantize(clipped, 4, 16, sym, False).dequantize(torch.float64)

    kept_rows = 0
    for sym in (False, True):
        result, kept = search_clip(weight, x, QuantConfig(method="awq", group_size=16, sym=sym)), 0
        for row in range(weight.shape[0]):
            amax = [float(weight[row, 16 * g:16 * g + 16].abs().max()) for g in range(3)]
            best, best_errors, unclipped_errors = [], [], []
            for g in range(3):
                cols = slice(16 * g, 16 * g + 16)
                errors = []
                for step in range(CLIP_STEPS):
                    limits = [a * (1 - step / CLIP_GRID) if h == g else a for h, a in enumerate(amax)]
                    q = quantized(row, limits)
                    errors.append(float((x[:, cols] @ (q - weight[row:row + 1])[0, cols]).pow(2).mean()))
                k = min(range(CLIP_STEPS), key=errors.__getitem__)
                best.append(1 - k / CLIP_GRID), best_errors.append(errors[k]), unclipped_errors.append(errors[0])
            row_error = [float((x @ (quantized(row, [a * b for a, b in zip(amax, shrinks, strict=True)])
                                     - weight[row:row + 1]).T).pow(2).mean()) for shrinks in (best, [1.0] * 3)]
            if row_error[0] > row_error[1]:
                best, best_errors, kept = [1.0] * 3, unclipped_errors, kept + 1
            assert result.shrink[row].tolist() == best, (row, best)
            assert result.error[row].tolist() == pytest.approx(best_errors, rel=1e-9)
            assert result.unclipped_error[row].tolist() == pytest.approx(unclipped_errors, rel=1e-9)
        assert (result.shrink < 1).any() and result.kept_rows == kept
        kept_rows += kept
    assert kept_rows > 0  # both cases occur with this weight


def test_clip_samples_are_every_strided_real_token_over_the_batches(monkeypatch) -> None:
    """The clip search's samples: every stride-th real token entering each linear, counted across the batches (a
    batch's first sample depends on the rows before it), whatever the padding."""
    monkeypatch.setattr("quantkit.quantizers.awq.CLIP_TOKENS", 7)
    ctx = layer_context(outlier_model("llama"), random_calibration(n=7, pad_from={1: 5, 4: 17, 5: 0}))
    tokens = sum(int(m.sum()) for m in ctx.token_masks)
    names = clip_targets(ctx)
    with ctx.capture_inputs(names) as captured:
        ctx.forward()
    samples = _sample_inputs(ctx, names)
    assert sorted(samples) == sorted(names) and tokens // 7 > 1
    for name in names:
        everything = torch.cat(captured[name])
        assert everything.shape[0] == tokens
        assert torch.equal(samples[name], everything[::tokens // 7]), name


@torch.no_grad()
def logits_error(model: nn.Module, reference: nn.Module, ids: torch.Tensor) -> float:
    return float((model(ids).logits - reference(ids).logits).pow(2).mean())


@pytest.mark.parametrize("sym", [False, True])
def test_awq_beats_rtn_on_logits(sym: bool) -> None:
    reference = outlier_model("llama")
    calib = random_calibration(n=8, seqlen=32)
    heldout = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(9))
    errors = {}
    for method in ("rtn", "awq"):
        model = copy.deepcopy(reference)
        quantize_model(model, get_adapter(model), calib, QuantConfig(method=method, group_size=32, sym=sym),
                       device="cpu", show_progress=False)
        errors[method] = logits_error(model, reference, heldout)
    assert errors["awq"] < 0.8 * errors["rtn"], errors


def test_non_finite_activations_skip_the_group() -> None:
    model = outlier_model("llama")
    layer = get_adapter(model).get_layers(model)[0]
    with torch.no_grad():
        layer.post_attention_layernorm.weight[3] = float("inf")  # MLP inputs, hence down_proj's, turn inf/NaN
    before = copy.deepcopy(layer)
    ctx = layer_context(model, random_calibration())
    report = get_method(QuantConfig(method="awq", group_size=32)).smooth_layer(ctx)
    assert report["skipped_groups"] == 2
    assert report["scales"]["post_attention_layernorm"]["skipped"] == "non-finite activations"
    assert report["scales"]["mlp.up_proj"]["skipped"] == "non-finite activations"
    assert report["scales"]["input_layernorm"]["ratio"] is not None
    for name in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        assert report["clip"][name] == {"skipped": "non-finite activations"}
    state, old = layer.state_dict(), before.state_dict()
    for name in ("post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                 "mlp.down_proj.weight"):
        assert torch.equal(state[name], old[name]), name
    assert not torch.equal(state["input_layernorm.weight"], old["input_layernorm.weight"])
    assert all(torch.isfinite(p).all() for n, p in state.items() if n != "post_attention_layernorm.weight")


def test_group_without_tokens_keeps_unit_scale() -> None:
    model = outlier_model("qwen2")
    ctx = layer_context(model, random_calibration())
    ctx.token_masks = [torch.zeros_like(m) for m in ctx.token_masks]
    layer_before = copy.deepcopy(ctx.layer)
    report = get_method(QuantConfig(method="awq", group_size=32)).smooth_layer(ctx)
    assert report["skipped_groups"] == len(report["scales"]) == 3
    for entry in report["scales"].values():
        assert entry["skipped"] == "no calibration tokens" and entry["tokens"] == 0
    assert all(entry == {"skipped": "no calibration tokens"} for entry in report["clip"].values())
    for (name, p), q in zip(ctx.layer.state_dict().items(), layer_before.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_end_to_end_export_reload(tmp_path) -> None:
    model = outlier_model("llama")
    calib = random_calibration()
    config = QuantConfig(method="awq", group_size=32, sym=False)
    report = quantize_model(model, get_adapter(model), calib, config, device="cpu", show_progress=False)
    assert all(layer["smoothing"]["skipped_groups"] == 0 for layer in report.layers)
    out = export_checkpoint(model, None, tmp_path / "ckpt", config, "awq", dtype="float16")
    reloaded, _ = load_quantized(out, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(calib.input_ids).logits, model(calib.input_ids).logits,
                                   atol=5e-3, rtol=5e-3)  # embeddings and norms went through fp16


def test_duo_scaling_reports_plain_rtn_loss() -> None:
    ctx = layer_context(outlier_model("llama"), random_calibration())
    group = active_scaling_groups(ctx.layer, ctx.adapter)[0]
    config = QuantConfig(method="awq", group_size=32)
    duo = search_scales(ctx, group, config)  # AWQ's default
    plain = search_scales(ctx, group, replace(config, options=AWQOptions(duo_scaling=False)))
    assert duo.rtn_loss == plain.rtn_loss == plain.losses[0]  # ratio 0 of the plain grid is s = 1
    assert duo.loss <= duo.rtn_loss and plain.loss <= plain.rtn_loss
    assert duo.losses != plain.losses
