"""QuantConfig: the shared scheme plus the method's options object; old flat quant_config dicts read back."""

from __future__ import annotations

import json

import pytest
import torch

from quantkit.config import AUTO_GROUP, QuantConfig, resolve_group_size
from quantkit.qtensor import QuantizationError
from quantkit.quantizers.awq import AWQOptions
from quantkit.quantizers.awq_gptq import AWQGPTQOptions
from quantkit.quantizers.gptq import GPTQOptions
from quantkit.quantizers.qqq import QQQOptions
from quantkit.quantizers.rtn import RTNOptions

# quant_config as quantkit.json held it before options were per method: every method's knobs side by side
OLD_DEFAULTS = {"method": "gptq", "bits": 4, "group_size": 128, "sym": True, "act_bits": 16, "act_order": False,
                "damp_percent": 0.01, "block_size": 128, "mse": False, "awq_duo_scaling": False, "awq_grid": 20,
                "awq_clip": True, "smooth_steps": None, "smooth_search": "refine", "smooth_samples": None,
                "smooth_check": True, "ignore": []}

OLD_AND_NEW = [
    pytest.param({"method": "rtn", "group_size": 32, "mse": True, "act_order": True},
                 QuantConfig(method="rtn", group_size=32, options=RTNOptions(mse=True)), id="rtn"),
    pytest.param({"method": "gptq", "group_size": 64, "sym": False, "act_order": True, "damp_percent": 0.05,
                  "block_size": 32, "awq_grid": 5, "smooth_steps": 7},
                 QuantConfig(method="gptq", group_size=64, sym=False,
                             options=GPTQOptions(act_order=True, damp_percent=0.05, block_size=32)), id="gptq"),
    pytest.param({"method": "awq", "group_size": -1, "awq_grid": 5, "awq_duo_scaling": True, "awq_clip": False,
                  "mse": True, "ignore": ["mlp.down_proj"]},  # a retired key no code ever read
                 QuantConfig(method="awq", group_size=-1,
                             options=AWQOptions(grid=5, duo_scaling=True, clip=False, mse=True)), id="awq"),
    pytest.param({"method": "qqq", "act_bits": 8, "act_order": True, "smooth_steps": 8, "smooth_search": "grid",
                  "smooth_samples": 16, "smooth_check": False, "awq_clip": False},
                 QuantConfig(method="qqq", group_size=128, act_bits=8, options=QQQOptions(
                     act_order=True, smooth_steps=8, smooth_search="grid", smooth_samples=16, smooth_check=False)),
                 id="qqq"),
]


@pytest.mark.parametrize("changes,expected", OLD_AND_NEW)
def test_an_old_flat_quant_config_reads_back_as_the_same_config(changes: dict, expected: QuantConfig) -> None:
    old = json.loads(json.dumps({**OLD_DEFAULTS, **changes}))  # as read from an older quantkit.json
    assert QuantConfig.from_dict(old) == expected


@pytest.mark.parametrize("changes,expected", OLD_AND_NEW)
def test_to_dict_reads_back(changes: dict, expected: QuantConfig) -> None:
    written = json.loads(json.dumps(expected.to_dict()))
    assert written["options"] == {f: getattr(expected.options, f) for f in written["options"]}
    assert QuantConfig.from_dict(written) == expected


def test_the_python_api_and_the_cli_share_their_defaults() -> None:
    """QuantConfig() is `quantkit quantize` without flags: the method, its options and every scheme field."""
    import inspect

    from quantkit import cli

    flags = {name: p.default for name, p in inspect.signature(cli.quantize).parameters.items()}
    default = QuantConfig()
    assert (default.method, default.bits, default.group_size, default.act_bits) == (
        flags["method"], flags["bits"], cli.parse_group_size(flags["group_size"]), flags["act_bits"])
    assert default.sym is not flags["asym"] and default.moe_all_tokens == flags["moe_all_tokens"]
    assert default.group_size == AUTO_GROUP


def test_quantize_model_resolves_the_default_group_size_as_the_cli_does() -> None:
    """The Python API's default group size, resolved once by quantize_model (64-wide layers: g64); the report
    carries the resolved scheme and the caller's config is left as it was."""
    from test_adapters import tiny_model
    from test_engine import random_calibration

    from quantkit.engine import quantize_model
    from quantkit.models import get_adapter

    model = tiny_model("llama")
    adapter = get_adapter(model)
    config = QuantConfig(method="rtn")
    report = quantize_model(model, adapter, random_calibration(), config, device="cpu", show_progress=False)
    assert report.scheme.group_size == resolve_group_size(model, adapter, AUTO_GROUP) == 64
    assert report.to_dict()["config"]["group_size"] == 64 and config.group_size == AUTO_GROUP  # never mutated


def test_a_config_is_never_changed_in_place() -> None:
    with pytest.raises(AttributeError):
        QuantConfig().group_size = 32  # type: ignore[misc]


def test_auto_group_size_reads_every_layer() -> None:
    """A later layer's wider or narrower linear (here an MLP of 96, a multiple of 32 only) decides 'auto' too, and
    an explicit size it does not divide is refused before any work; fused MoE experts count by their 3-D shapes."""
    from test_adapters import tiny_model
    from test_moe import tiny_moe

    from quantkit.models import get_adapter

    model = tiny_model("llama")
    assert resolve_group_size(model, get_adapter(model), "auto") == 64
    mlp = model.model.layers[1].mlp
    mlp.gate_proj, mlp.up_proj, mlp.down_proj = torch.nn.Linear(64, 96), torch.nn.Linear(64, 96), torch.nn.Linear(96, 64)
    assert resolve_group_size(model, get_adapter(model), "auto") == 32
    with pytest.raises(QuantizationError, match="96"):
        resolve_group_size(model, get_adapter(model), 64)
    moe = tiny_moe("qwen3_moe", moe_intermediate_size=96)
    assert resolve_group_size(moe, get_adapter(moe), "auto") == 32


def test_defaults_are_the_methods_options() -> None:
    assert QuantConfig().method == "awq-gptq" and QuantConfig().options == AWQGPTQOptions()  # the CLI's default
    assert QuantConfig(method="awq").options == AWQOptions()
    assert QuantConfig.from_dict({"method": "qqq"}) == QuantConfig(method="qqq")


def _one_line_error(make) -> str:
    with pytest.raises(QuantizationError) as info:
        make()
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("make,message", [
    (lambda: GPTQOptions(damp_percent=0), "damp_percent must be in (0, 1), got 0 (--damp)"),
    (lambda: GPTQOptions(damp_percent=1.5), "damp_percent must be in (0, 1), got 1.5 (--damp)"),
    (lambda: GPTQOptions(block_size=0), "block_size must be at least 1, got 0 (--block-size)"),
    (lambda: QQQOptions(damp_percent=-1), "damp_percent must be in (0, 1), got -1 (--damp)"),  # GPTQ's check, inherited
    (lambda: AWQOptions(grid=0), "grid must be at least 1, got 0 (--awq-grid)"),
    (lambda: QQQOptions(smooth_steps=0), "smooth_steps must be at least 1, got 0 (--smooth-steps)"),
    (lambda: QQQOptions(smooth_samples=-2), "smooth_samples must be at least 1, got -2 (--smooth-samples)"),
    (lambda: QQQOptions(smooth_search="golden"), "smooth_search must be one of ('refine', 'grid'), got 'golden' (--smooth-search)"),
    (lambda: QuantConfig.from_dict({"method": "awq", "awq_grid": 0}), "grid must be at least 1, got 0 (--awq-grid)"),
    (lambda: QuantConfig(method="awq", options=GPTQOptions()), "method 'awq' takes AWQOptions, got GPTQOptions"),
    (lambda: QuantConfig(method="golden"), "unknown method 'golden'; available: awq, awq-gptq, fp8, gptq, qqq, rtn"),
    (lambda: QuantConfig.from_dict({"method": "gptq", "act_ordr": True}), "unknown quant_config keys: act_ordr"),
    (lambda: QuantConfig.from_dict({"method": "gptq", "options": {"grid": 5, "bogus": 1}}),
     "unknown quant_config keys: bogus"),
])
def test_invalid_options_are_one_clear_line(make, message: str) -> None:
    assert _one_line_error(make) == message


def test_label_names_act_order_only_where_it_is_a_choice() -> None:
    assert QuantConfig(method="gptq", group_size=64, options=GPTQOptions(act_order=True)).label() == "gptq W4A16 g64 sym act-order"
    assert QuantConfig(method="rtn", group_size=-1).label() == "rtn W4A16 per-channel sym"
    qqq = QuantConfig(method="qqq", group_size=128, act_bits=8, options=QQQOptions(act_order=True))
    assert qqq.label() == "qqq W4A8 g128 sym"


def test_a_quantizer_refuses_an_unresolved_group_size() -> None:
    from quantkit.quantizers.gptq import GPTQQuantizer

    with pytest.raises(QuantizationError, match="still 'auto'"):
        GPTQQuantizer(torch.nn.Linear(64, 16), QuantConfig(method="gptq"))
