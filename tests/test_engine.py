"""The calibration engine, export and reload on tiny random-weight models (fast, no model files)."""

from __future__ import annotations

import ast
import copy
import logging
from pathlib import Path

import pytest
import torch
from test_adapters import tiny_model
from torch import nn

import quantkit.quantizers
from quantkit.config import METHOD_OPTIONS, QuantConfig
from quantkit.data import CalibrationSet
from quantkit.engine import quantize_model
from quantkit.export import export_checkpoint, quantized_modules
from quantkit.models import get_adapter
from quantkit.nn.qlinear import QuantLinear
from quantkit.qtensor import QuantizationError
from quantkit.quantizers.base import METHODS, LinearQuantizer, Method, register
from quantkit.quantizers.rtn import rtn_quantize
from quantkit.reload import load_quantized


def random_calibration(n: int = 6, seqlen: int = 24, vocab: int = 128, pad_from: dict | None = None) -> CalibrationSet:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (n, seqlen), generator=gen)
    mask = torch.ones_like(ids)
    for row, start in (pad_from or {}).items():
        ids[row, start:] = 0
        mask[row, start:] = 0
    return CalibrationSet(ids, mask)


class _Recording(LinearQuantizer):
    seen: dict[int, int] = {}

    def add_batch(self, x: torch.Tensor) -> None:
        _Recording.seen[id(self.linear)] = _Recording.seen.get(id(self.linear), 0) + x.shape[0]

    def quantize(self):
        return rtn_quantize(self.linear.weight, 4, self.config.group_size, True, False)


@pytest.fixture
def recording_method():
    @register
    class RecordingMethod(Method):
        name = "test-recording"

        def linear_quantizer(self, linear: nn.Linear) -> LinearQuantizer:
            return _Recording(linear, self.config)

    yield RecordingMethod
    METHODS.pop("test-recording")
    METHOD_OPTIONS.pop("test-recording")


def test_padding_never_reaches_the_statistics(recording_method) -> None:
    model = tiny_model("llama")
    calib = random_calibration(pad_from={0: 10, 3: 5})
    _Recording.seen.clear()
    quantize_model(model, get_adapter(model), calib, QuantConfig(method="test-recording", group_size=32),
                   device="cpu", batch_size=4, show_progress=False)
    assert set(_Recording.seen.values()) == {calib.n_tokens}  # every linear saw exactly the real tokens
    assert calib.n_tokens == 6 * 24 - 14 - 19


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3", "opt"])
@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_quantized_model_runs_and_matches_reference_weights(kind: str, method: str) -> None:
    model = tiny_model(kind)
    original = copy.deepcopy(model)
    calib = random_calibration()
    report = quantize_model(model, get_adapter(model), calib, QuantConfig(method=method, group_size=32),
                            device="cpu", show_progress=False)
    qmodules = quantized_modules(model)
    assert len(qmodules) == len(get_adapter(model).linear_names()) * 2
    assert len(report.layers) == 2 and not report.fallbacks
    for name, q in qmodules.items():
        w = original.get_submodule(name).weight
        err = (q.dequantized_weight().float() - w).abs().max()
        assert err < 0.6 * w.abs().max(), name  # on the 4-bit grid, not garbage
    logits = model(calib.input_ids).logits
    ref = original(calib.input_ids).logits
    assert torch.isfinite(logits).all()
    assert torch.nn.functional.cosine_similarity(logits.flatten(), ref.flatten(), dim=0) > 0.9


@pytest.mark.parametrize("fmt,sym,group", [("compressed-tensors", True, 32), ("compressed-tensors", False, -1),
                                           ("gptq", True, 64), ("awq", False, 32)])
def test_export_reload_roundtrip(tmp_path, fmt: str, sym: bool, group: int) -> None:
    model = tiny_model("llama")
    calib = random_calibration()
    config = QuantConfig(method="gptq", group_size=group, sym=sym)
    quantize_model(model, get_adapter(model), calib, config, device="cpu", show_progress=False)
    out = export_checkpoint(model, None, tmp_path / "ckpt", config, fmt, dtype="float16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary folder left behind
    reloaded, tokenizer = load_quantized(out, dtype=torch.float32)
    assert tokenizer is None
    for name, q in quantized_modules(model).items():
        r = reloaded.get_submodule(name)
        assert isinstance(r, QuantLinear)
        torch.testing.assert_close(r.dequantized_weight().float(), q.dequantized_weight().float())
    torch.testing.assert_close(reloaded(calib.input_ids).logits, model(calib.input_ids).logits,
                               atol=5e-3, rtol=5e-3)  # embeddings and norms went through fp16


def test_export_failure_leaves_nothing(tmp_path, monkeypatch) -> None:
    model = tiny_model("llama")
    config = QuantConfig(method="rtn", group_size=32)
    quantize_model(model, get_adapter(model), random_calibration(), config, device="cpu", show_progress=False)
    import quantkit.export as export

    def broken(*_a, **_k):
        raise OSError("disk full")

    monkeypatch.setattr(export, "write_safetensors", broken)
    with pytest.raises(OSError, match="disk full"):
        export_checkpoint(model, None, tmp_path / "ckpt", config, "compressed-tensors")
    assert list(tmp_path.iterdir()) == []


def test_nan_weights_fail_with_the_layer_named() -> None:
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    with pytest.raises(QuantizationError, match="NaN"):
        quantize_model(model, get_adapter(model), random_calibration(), QuantConfig(method="gptq", group_size=32),
                       device="cpu", show_progress=False)


def test_group_size_must_divide_inputs() -> None:
    model = tiny_model("llama")  # hidden 64
    with pytest.raises(QuantizationError, match="does not divide"):
        quantize_model(model, get_adapter(model), random_calibration(), QuantConfig(method="rtn", group_size=128),
                       device="cpu", show_progress=False)


def test_no_quantizer_module_imports_the_engine() -> None:
    """Methods see LayerContext (quantizers.context); the engine drives them and is never imported by them."""
    package = Path(quantkit.quantizers.__file__).parent
    for source in package.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            assert not any(n == "quantkit.engine" or n.startswith("quantkit.engine.") for n in names), source


def test_linears_reading_one_input_share_one_hessian(monkeypatch) -> None:
    """q/k/v and gate/up (per expert too) take the first one's Hessian, the same tensor: one accumulation each."""
    from test_moe import tiny_moe

    from quantkit.config import QuantConfig
    from quantkit.engine import quantize_model
    from quantkit.models import get_adapter
    from quantkit.quantizers import gptq
    from quantkit.quantizers.gptq import GPTQQuantizer

    fed: list[nn.Module] = []
    solved: dict[int, torch.Tensor] = {}
    solves: list[list[int]] = []
    original_add, original_solve = GPTQQuantizer.add_batch, gptq.gptq_solve

    def add_batch(self, x):
        fed.append(self.linear)
        original_add(self, x)

    def gptq_solve(problems, config):
        solves.append([len(p.weights) for p in problems])
        for p in problems:
            for weight in p.weights:
                solved[id(weight)] = p.hessian
        return original_solve(problems, config)

    monkeypatch.setattr(GPTQQuantizer, "add_batch", add_batch)
    monkeypatch.setattr(gptq, "gptq_solve", gptq_solve)
    from quantkit.models.moe import unfuse_experts

    model = tiny_moe("qwen3_moe", num_hidden_layers=1)
    unfuse_experts(model, get_adapter(model))  # the per-expert linears, named before they are replaced
    names = {id(m): n for n, m in model.model.layers[0].named_modules()}
    weight_names = {id(m.weight): n for n, m in model.model.layers[0].named_modules() if isinstance(m, nn.Linear)}
    quantize_model(model, get_adapter(model), random_calibration(), QuantConfig(method="gptq", group_size=32),
                   device="cpu", show_progress=False)
    fed_names = {names.get(id(m), "?") for m in fed}
    assert {"self_attn.q_proj", "self_attn.o_proj", "mlp.experts.0.gate_proj", "mlp.experts.0.down_proj"} <= fed_names
    assert not fed_names & {"self_attn.k_proj", "self_attn.v_proj", "mlp.experts.0.up_proj"}
    by_name = {weight_names[i]: h for i, h in solved.items() if i in weight_names}
    assert by_name["self_attn.k_proj"] is by_name["self_attn.q_proj"] is by_name["self_attn.v_proj"]
    assert by_name["mlp.experts.1.up_proj"] is by_name["mlp.experts.1.gate_proj"]
    # on the CPU each weight is a problem of its own (on a GPU a group's rows are one: gptq_quantize's tests), and
    # problems of one shape go side by side: the calibrated experts' gate, up and down projections
    assert all(set(batch) == {1} for batch in solves)
    assert sum(len(batch) > 1 for batch in solves) >= 3


@pytest.mark.parametrize("method", ["gptq", "awq-gptq"])
def test_a_step_gathered_in_parts_gives_the_same_weights(monkeypatch, caplog, method: str) -> None:
    """Where a step's statistics exceed the budget (an MoE layer's hundreds of Hessians), the step is gathered and
    solved a part at a time: the same weights, bit for bit."""
    from test_moe import tiny_moe

    import quantkit.engine

    def quantized(fraction: float) -> dict[str, torch.Tensor]:
        monkeypatch.setattr(quantkit.engine, "STATISTICS_FRACTION", fraction)
        model = tiny_moe("qwen3_moe", num_hidden_layers=1)
        quantize_model(model, get_adapter(model), random_calibration(), QuantConfig(method=method, group_size=32),
                       device="cpu", show_progress=False)
        return {k: v.clone() for k, v in model.state_dict().items()}

    whole = quantized(0.4)
    with caplog.at_level(logging.INFO, logger="quantkit"):
        parts = quantized(1e-12)  # one group of linears per part
    assert "gathered and solved in" in caplog.text
    assert whole.keys() == parts.keys() and all(torch.equal(whole[k], parts[k]) for k in whole)


def test_the_guard_is_skipped_and_said_where_its_copies_do_not_fit(monkeypatch, caplog) -> None:
    import quantkit.streaming.hidden

    model = tiny_model("llama")
    monkeypatch.setattr(quantkit.streaming.hidden, "device_available", lambda device: 1)
    with caplog.at_level(logging.WARNING, logger="quantkit"):
        report = quantize_model(model, get_adapter(model), random_calibration(), QuantConfig(method="gptq",
                                group_size=32), device="cpu", show_progress=False)
    assert all(e["guard"] == "skipped: the layer's copies do not fit" for e in report.layers)
    assert "no-harm guard needs" in caplog.text
