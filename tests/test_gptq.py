"""GPTQ against a slow float64 reference of the same algorithm, against RTN, and on its failure paths."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
from torch import nn

from quantkit.config import QuantConfig
from quantkit.qtensor import QuantizationError, quantize_codes
from quantkit.quantizers import gptq
from quantkit.quantizers.base import get_method
from quantkit.quantizers.gptq import GPTQOptions, GPTQQuantizer, gptq_quantize
from quantkit.quantizers.rtn import find_qparams, rtn_quantize

pytestmark = pytest.mark.usefixtures("single_thread")


def make_layer(in_features: int, out_features: int, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        linear.weight.normal_(0, 0.05)
    return linear


def make_inputs(in_features: int, tokens: int, seed: int, dead: tuple[int, ...] = ()) -> torch.Tensor:
    """Correlated activations with a few dominant channels, like a transformer's hidden states."""
    gen = torch.Generator().manual_seed(seed)
    mixing = torch.randn(in_features, in_features, generator=gen) / in_features**0.5
    x = torch.randn(tokens, in_features, generator=gen) @ (torch.eye(in_features) + mixing)
    x[:, :3] *= 10  # outlier channels
    x[:, list(dead)] = 0
    return x


def quantize_gptq(linear: nn.Linear, x: torch.Tensor, config: QuantConfig, batches: int = 3):
    quantizer = get_method(config).linear_quantizer(linear)
    for chunk in x.chunk(batches):
        quantizer.add_batch(chunk)
    return quantizer.quantize()


def reference_gptq(weight: torch.Tensor, H: torch.Tensor, config: QuantConfig):
    """Float64, column by column, Optimal Brain Surgeon form with an explicit inverse Hessian.

    After quantizing column j, its error (w - q) / Hinv_jj is spread with row j of Hinv, the inverse
    Hessian of the columns not yet quantized, and j is then eliminated from Hinv (paper eq. 2-3).
    The implementation uses lazy blocks and the Cholesky rows of Hinv instead; the updates are the same.
    Group parameters come from find_qparams (min-max or MSE search), checked by brute force in test_rtn.
    """
    W, H = weight.detach().double().clone(), H.double().clone()
    rows, cols = W.shape
    group = cols if config.group_size == -1 else config.group_size
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    static = config.options.act_order or group == cols
    scales = torch.zeros(rows, cols // group, dtype=torch.float64)
    zeros = torch.zeros(rows, cols // group, dtype=torch.float64)
    if static:
        for g in range(cols // group):
            chunk = W[:, g * group : (g + 1) * group]
            scales[:, g], zeros[:, g] = find_qparams(chunk, config.bits, config.sym, config.options.mse)
    order = (
        torch.argsort(torch.diag(H), descending=True, stable=True) if config.options.act_order else torch.arange(cols)
    )
    W, H = W[:, order], H[order][:, order]
    H += config.options.damp_percent * torch.diag(H).mean() * torch.eye(cols, dtype=torch.float64)
    Hinv = torch.linalg.inv(H)
    codes = torch.zeros(rows, cols, dtype=torch.float64)
    loss = 0.0
    for j in range(cols):
        g = int(order[j]) // group
        if not static and j % group == 0:
            scales[:, g], zeros[:, g] = find_qparams(W[:, j : j + group], config.bits, config.sym, config.options.mse)
        codes[:, j] = quantize_codes(W[:, j], scales[:, g], zeros[:, g], config.bits)
        err = W[:, j] - (codes[:, j] - zeros[:, g]) * scales[:, g]
        loss += float((err**2).sum() / Hinv[j, j] / 2)
        W[:, j:] -= torch.outer(err / Hinv[j, j], Hinv[j, j:])
        Hinv -= torch.outer(Hinv[:, j], Hinv[j, :]) / Hinv[j, j]
    return codes[:, torch.argsort(order)].to(torch.uint8), scales, zeros, loss


def hessian(x: torch.Tensor) -> torch.Tensor:
    return 2 * x.double().T @ x.double() / x.shape[0]


def output_error(x: torch.Tensor, weight: torch.Tensor, deq: torch.Tensor) -> float:
    return float(((x @ (weight.detach() - deq).T) ** 2).sum())


CONFIGS = [
    pytest.param(dict(bits=4, group_size=-1, sym=True, act_order=False), id="w4-perchannel-sym"),
    pytest.param(dict(bits=4, group_size=-1, sym=False, act_order=True), id="w4-perchannel-asym-actorder"),
    pytest.param(dict(bits=4, group_size=32, sym=True, act_order=False), id="w4-g32-sym"),
    pytest.param(dict(bits=4, group_size=32, sym=False, act_order=False), id="w4-g32-asym"),
    pytest.param(dict(bits=4, group_size=32, sym=True, act_order=True), id="w4-g32-sym-actorder"),
    pytest.param(dict(bits=4, group_size=64, sym=False, act_order=True), id="w4-g64-asym-actorder"),
    pytest.param(dict(bits=4, group_size=128, sym=True, act_order=False), id="w4-g128-sym"),
    pytest.param(dict(bits=8, group_size=32, sym=False, act_order=False), id="w8-g32-asym"),
    pytest.param(dict(bits=8, group_size=64, sym=True, act_order=True), id="w8-g64-sym-actorder"),
    pytest.param(dict(bits=4, group_size=32, sym=False, act_order=False, mse=True), id="w4-g32-asym-mse"),
    pytest.param(
        dict(bits=4, group_size=64, sym=True, act_order=True, mse=True), id="w4-g64-sym-actorder-mse"
    ),
]


@pytest.mark.parametrize("options", CONFIGS)
def test_gptq_beats_rtn_on_layer_output_error(options):
    linear, x = make_layer(256, 64, seed=1), make_inputs(256, 384, seed=2)
    config = QuantConfig.from_dict({"method": "gptq", **options})
    gptq = quantize_gptq(linear, x, config).dequantize()
    rtn = rtn_quantize(linear.weight, config.bits, config.group_size, config.sym, config.options.mse).dequantize()
    assert output_error(x, linear.weight, gptq) < 0.8 * output_error(x, linear.weight, rtn)


# On CUDA the block loop runs as a CUDA graph from the second block on; block 96 leaves a tail of 64.
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [32, 96, 128])
@pytest.mark.parametrize("options", CONFIGS)
def test_gptq_equals_float64_reference(options, block_size, device):
    """Run in float64 the implementation must reproduce the reference exactly: same codes, same scales."""
    # Dead channels 5 and 70 exercise the dead-input fix in both implementations.
    linear, x = make_layer(256, 48, seed=3), make_inputs(256, 300, seed=4, dead=(5, 70))
    config = QuantConfig.from_dict({"method": "gptq", "block_size": block_size, **options})
    result = gptq_quantize(linear.weight.double().to(device), hessian(x).to(device), config)
    codes, scales, zeros, loss = reference_gptq(linear.weight, hessian(x), config)
    assert result.codes.device.type == device
    assert torch.equal(result.codes.cpu(), codes)
    assert torch.equal(result.scales.double().cpu(), scales)
    assert torch.equal(result.zeros.cpu(), zeros.to(torch.uint8))
    assert result.info["loss"] == pytest.approx(loss, rel=1e-9)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", CONFIGS)
def test_gptq_fp32_close_to_float64_reference(options, device):
    """The production fp32 path. It can differ from fp64 where a value lies within ~1e-7 (relative) of a
    rounding boundary: a code, or a dynamic group's fp16 scale by one ulp. Such a flip changes the error
    spread over the rest of that row, so a few codes later in the same row may differ too (seen: at most
    one diverging row of 48, more likely at 8 bits where the boundaries are 16x denser)."""
    linear, x = make_layer(256, 48, seed=3), make_inputs(256, 300, seed=4, dead=(5, 70))
    config = QuantConfig.from_dict({"method": "gptq", **options})
    codes, scales, zeros, loss = reference_gptq(linear.weight, hessian(x), config)
    result = quantize_gptq(linear.to(device), x.to(device), config)
    result = replace(result, codes=result.codes.cpu(), scales=result.scales.cpu(), zeros=result.zeros.cpu())
    same_rows = (result.codes == codes).all(dim=1)
    assert same_rows.sum() >= 46
    assert torch.allclose(result.scales.double()[same_rows], scales[same_rows], rtol=1e-3, atol=0)
    g = result.group_index()
    deq_reference = ((codes.double() - zeros[:, g]) * scales[:, g])[same_rows]
    assert torch.allclose(result.dequantize().double()[same_rows], deq_reference, rtol=1e-3, atol=1e-9)
    assert result.info["loss"] == pytest.approx(loss, rel=1e-2)


@pytest.mark.parametrize("options", CONFIGS)
def test_one_solve_of_stacked_rows_is_each_weight_alone(options):
    """Weights reading one input (q/k/v, an expert's gate/up) are solved as one stack of rows: each result must be
    exactly the weight's own solve, loss included (rows are independent given H)."""
    x = make_inputs(256, 300, seed=4, dead=(5, 70))
    weights = [make_layer(256, rows, seed=rows).weight for rows in (48, 16, 32)]
    config = QuantConfig.from_dict({"method": "gptq", **options})
    together = gptq.gptq_solve([gptq.SharedInput(weights, hessian(x).float())], config)[0]
    for weight, joint in zip(weights, together, strict=True):
        alone = gptq_quantize(weight, hessian(x).float(), config)
        assert torch.equal(joint.codes, alone.codes) and torch.equal(joint.zeros, alone.zeros)
        assert torch.equal(joint.scales, alone.scales)
        assert joint.info["loss"] == pytest.approx(alone.info["loss"], rel=1e-6)


@pytest.mark.parametrize("options", CONFIGS)
def test_problems_solved_side_by_side_are_each_solved_alone(options):
    """An MoE layer's experts: one shape, each its own Hessian (other dead inputs, another act-order), solved in one
    batch; one whose Hessian no damping repairs falls back to RTN alone, the others are untouched by it."""
    config = QuantConfig.from_dict({"method": "gptq", **options})
    problems = []
    for e, dead in enumerate([(5, 70), (), (0, 1, 2), ()]):
        x = make_inputs(256, 300, seed=40 + e, dead=dead)
        weights = [make_layer(256, rows, seed=10 * e + rows).weight for rows in (32, 16)]
        problems.append(gptq.SharedInput(weights, hessian(x).float() if e != 3 else -torch.eye(256)))
    together = gptq.gptq_solve(problems, config)
    for problem, solved in zip(problems, together, strict=True):
        for weight, joint in zip(problem.weights, solved, strict=True):
            alone = gptq_quantize(weight, problem.hessian, config)
            assert torch.equal(joint.codes, alone.codes) and torch.equal(joint.scales, alone.scales)
            assert torch.equal(joint.zeros, alone.zeros)
            assert joint.info.get("fallback") == alone.info.get("fallback")
            assert joint.info["damp_percent"] == alone.info["damp_percent"]
    assert [r.info.get("fallback") for r in together[3]] == ["rtn", "rtn"]


@pytest.mark.parametrize("method", ["awq-gptq", "qqq"])
def test_sharing_quantizers_solve_together_as_alone(method):
    """The methods with their own grids (Hessian-weighted ranges; QQQ's two-level scales) through quantize_groups."""
    x = make_inputs(128, 200, seed=7)
    config = QuantConfig(method=method, group_size=32, bits=4, sym=method == "qqq")
    linears = [make_layer(128, rows, seed=rows) for rows in (32, 64)]
    owner, sharer = (get_method(config).linear_quantizer(linear) for linear in linears)
    owner.add_batch(x)
    sharer.take_statistics(owner)
    together = type(owner).quantize_groups([[owner, sharer]])[0]
    for linear, joint in zip(linears, together, strict=True):
        alone = quantize_gptq(linear, x, config, batches=1)
        assert torch.equal(joint.codes, alone.codes) and torch.equal(joint.scales, alone.scales)
        assert (joint.channel_scales is None) == (alone.channel_scales is None)
        if alone.channel_scales is not None:
            assert torch.equal(joint.channel_scales, alone.channel_scales)


def test_loss_is_the_damped_layer_output_error():
    linear, x = make_layer(128, 32, seed=5), make_inputs(128, 256, seed=6)
    config = QuantConfig(method="gptq", group_size=32, options=GPTQOptions(act_order=True))
    result = quantize_gptq(linear, x, config)
    H = hessian(x)
    H += config.options.damp_percent * torch.diag(H).mean() * torch.eye(128, dtype=torch.float64)
    delta = linear.weight.detach().double() - result.dequantize().double()
    assert result.info["loss"] == pytest.approx(float(torch.trace(delta @ H @ delta.T) / 2), rel=1e-3)
    assert result.info["damp_percent"] == config.options.damp_percent
    assert result.info["nsamples"] == 256
    assert "fallback" not in result.info


@pytest.mark.parametrize("n", [1, 300, gptq.PERMUTE_ROWS])
def test_permute_symmetric_is_rows_then_columns(n):
    gen = torch.Generator().manual_seed(n)
    matrix, order = torch.randn(n, n, generator=gen), torch.randperm(n, generator=gen)
    assert torch.equal(gptq.permute_symmetric(matrix, order), matrix[order][:, order])


def test_inverse_factor_in_place_is_the_out_of_place_factor():
    """The in-place Cholesky, inverse and upper Cholesky give LAPACK's out-of-place results bit for bit."""
    x = torch.randn(400, 96, generator=torch.Generator().manual_seed(0))
    hessian = x.T @ x / 400
    upper, damps, factored = gptq.inverse_hessian_factors(lambda members: hessian[None].clone(), 1, 0.01, ["test"])
    damped = hessian + 0.01 * hessian.diagonal().mean() * torch.eye(96)
    reference = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(damped)), upper=True)
    assert damps == [0.01] and factored == [True] and torch.equal(upper[0], reference)


def test_hessian_is_running_mean_of_2xxT():
    x = make_inputs(64, 200, seed=7)
    quantizer = GPTQQuantizer(make_layer(64, 16, seed=0), QuantConfig(method="gptq", group_size=32))
    for chunk in torch.split(x, [13, 0, 100, 87]):  # uneven batches, one empty
        quantizer.add_batch(chunk)
    assert quantizer.nsamples == 200
    assert quantizer.H.dtype == torch.float32
    assert torch.allclose(quantizer.H.double(), hessian(x), rtol=1e-5, atol=1e-4)


def test_dead_inputs_get_zero_weights():
    dead = (0, 17, 40)
    linear, x = make_layer(64, 16, seed=8), make_inputs(64, 128, seed=9, dead=dead)
    for sym in (True, False):
        result = quantize_gptq(linear, x, QuantConfig(method="gptq", group_size=32, sym=sym, options=GPTQOptions(act_order=True)))
        assert torch.all(result.dequantize()[:, list(dead)] == 0)
        assert torch.isfinite(torch.tensor(result.info["loss"]))


def test_source_weight_untouched_and_types():
    linear, x = make_layer(128, 32, seed=10), make_inputs(128, 64, seed=11)
    before = linear.weight.detach().clone()
    result = quantize_gptq(linear, x, QuantConfig(method="gptq", group_size=64, options=GPTQOptions(act_order=True)))
    assert torch.equal(linear.weight, before)
    assert result.codes.dtype == torch.uint8 and result.codes.shape == (32, 128)
    assert result.scales.dtype == torch.float32 and result.scales.shape == (32, 2)
    assert result.zeros.dtype == torch.uint8 and torch.all(result.zeros == 8)
    assert result.group_size == 64 and result.bits == 4 and result.sym


def hessian_with_eigenvalues(eigenvalues: torch.Tensor, seed: int) -> torch.Tensor:
    n = eigenvalues.numel()
    basis, _ = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(seed)))
    return (basis * eigenvalues) @ basis.T


def test_cholesky_failure_raises_damping(caplog):
    linear = make_layer(64, 16, seed=12)
    quantizer = GPTQQuantizer(linear, QuantConfig(method="gptq", group_size=32, options=GPTQOptions(damp_percent=0.01)))
    eigenvalues = torch.ones(64)
    eigenvalues[-1] = -0.05  # 1% damping leaves it indefinite, 10% does not
    quantizer.H, quantizer.nsamples = hessian_with_eigenvalues(eigenvalues, seed=0), 100
    with caplog.at_level(logging.WARNING, logger="quantkit"):
        result = quantizer.quantize()
    assert result.info["damp_percent"] == pytest.approx(0.1)
    assert "fallback" not in result.info
    assert [r.message for r in caplog.records if "damp_percent=0.01" in r.message]
    assert not [r for r in caplog.records if "RTN" in r.message]


def test_cholesky_failure_everywhere_falls_back_to_rtn(caplog):
    linear = make_layer(64, 16, seed=13)
    config = QuantConfig(method="gptq", group_size=32, sym=False)
    quantizer = GPTQQuantizer(linear, config)
    quantizer.H, quantizer.nsamples = -torch.eye(64), 100  # negative definite: damping cannot help
    with caplog.at_level(logging.WARNING, logger="quantkit"):
        result = quantizer.quantize()
    expected = rtn_quantize(linear.weight, 4, 32, sym=False, mse=False)
    assert torch.equal(result.codes, expected.codes) and torch.equal(result.scales, expected.scales)
    assert result.info["fallback"] == "rtn"
    assert result.info["damp_percent"] == pytest.approx(10.0)
    messages = [r.message for r in caplog.records]
    assert sum("not positive definite" in m for m in messages) == 4
    assert any("falling back to RTN" in m for m in messages)


def test_non_finite_result_falls_back_to_rtn(caplog, monkeypatch):
    def overflowing_factor(working_hessians, count, damp_percent, labels):  # (w - q) / 1e-30 squares to inf
        hessians = working_hessians(list(range(count)))
        return torch.eye(hessians.shape[-1], dtype=hessians.dtype).expand_as(hessians) * 1e-30, \
            [damp_percent] * count, [True] * count

    monkeypatch.setattr(gptq, "inverse_hessian_factors", overflowing_factor)
    linear, x = make_layer(64, 16, seed=19), make_inputs(64, 32, seed=20)
    with caplog.at_level(logging.WARNING, logger="quantkit"):
        result = quantize_gptq(linear, x, QuantConfig(method="gptq", group_size=32))
    assert result.info["fallback"] == "rtn" and torch.isfinite(result.dequantize()).all()
    assert any("non-finite loss" in r.message for r in caplog.records)


def test_no_calibration_tokens_falls_back_to_rtn(caplog):
    linear = make_layer(64, 16, seed=14)
    quantizer = GPTQQuantizer(linear, QuantConfig(method="gptq", group_size=32))
    quantizer.add_batch(torch.zeros(0, 64))
    with caplog.at_level(logging.WARNING, logger="quantkit"):
        result = quantizer.quantize()
    assert result.info["fallback"] == "rtn" and result.info["nsamples"] == 0
    assert any("no calibration tokens" in r.message for r in caplog.records)


def test_bad_inputs_raise():
    linear, x = make_layer(96, 16, seed=17), make_inputs(96, 32, seed=18)
    with pytest.raises(QuantizationError, match="does not divide"):
        quantize_gptq(linear, x, QuantConfig(method="gptq", group_size=64))
    with torch.no_grad():
        linear.weight[3, 4] = float("nan")
    with pytest.raises(QuantizationError, match="NaN/Inf weights"):
        quantize_gptq(linear, x, QuantConfig(method="gptq", group_size=32))
    x[0, 0] = float("inf")
    with pytest.raises(QuantizationError, match="calibration inputs"):
        quantize_gptq(make_layer(96, 16, seed=17), x, QuantConfig(method="gptq", group_size=32))
