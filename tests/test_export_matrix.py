"""Every combination `quantkit quantize` accepts round-trips exactly; every other one is refused in one line.

The product is method x format x bits x activation bits x group size x symmetry, dense and MoE: each scheme a
method accepts is quantized once on a small random model, written in every format that holds it, and read back by
quantkit: the dequantized weights bit for bit, and the logits of the in-memory model (its fp parameters rounded to
the export's fp16) within float32 noise. Which formats vLLM and transformers serve is tested on a representative
set in test_vllm_formats.py (one vLLM process; each vLLM start-up costs seconds).
"""

from __future__ import annotations

import copy
import itertools
from functools import cache
from pathlib import Path

import pytest
import torch
from test_engine import random_calibration
from test_moe import tiny_moe
from transformers import AutoModelForCausalLM, LlamaConfig

from quantkit.config import SUPPORTED_GROUP_SIZES, QuantConfig
from quantkit.engine import quantize_model
from quantkit.export import export_checkpoint, quantized_modules
from quantkit.formats import get_format
from quantkit.models import get_adapter
from quantkit.qtensor import QuantizationError
from quantkit.quantizers.base import registered_methods
from quantkit.reload import load_quantized

FORMATS = ("compressed-tensors", "gptq", "awq")
DENSE = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=64, vocab_size=128, max_position_embeddings=64)
MOE_SIZE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64, num_hidden_layers=1)
PROMPT = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])


def requested_schemes():
    """Every scheme a user can ask for, as (method, bits, sym, act_bits, group)."""
    return itertools.product(sorted(registered_methods()), (4, 8), (True, False), (16, 8), SUPPORTED_GROUP_SIZES)


def build(method: str, bits: int, sym: bool, act_bits: int, group: int) -> QuantConfig:
    return QuantConfig(method=method, bits=bits, sym=sym, act_bits=act_bits, group_size=group).validate()


def accepted() -> list[tuple[QuantConfig, str]]:
    """(scheme, format) for every accepted combination, each scheme once (a method that fixes a field maps
    several requests to one scheme)."""
    seen, cases = set(), []
    for request in requested_schemes():
        try:
            config = build(*request)
        except QuantizationError:
            continue
        if config in seen:
            continue
        seen.add(config)
        for fmt in FORMATS:
            try:
                get_format(fmt).check(config)
            except QuantizationError:
                continue
            cases.append((config, fmt))
    return cases


CASES = accepted()
MOE_CASES = [(config, fmt) for config, fmt in CASES if (config.group_size == 32 and config.bits == 4) or config.fp8]


def case_id(case: tuple[QuantConfig, str]) -> str:
    config, fmt = case
    return config.label().replace(" ", "-") + "-" + fmt


@cache
def quantized(config: QuantConfig, moe: str | None) -> torch.nn.Module:
    """The model quantized with `config` once, shared by every format that holds the scheme."""
    if moe is None:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(DENSE).eval()
    else:
        model = tiny_moe(moe, **MOE_SIZE)
    quantize_model(model, get_adapter(model), random_calibration(n=4, seqlen=16), config, device="cpu",
                   show_progress=False)
    return model


def check_round_trip(model: torch.nn.Module, config: QuantConfig, fmt: str, folder: Path) -> None:
    export_checkpoint(model, None, folder, config, fmt, dtype="float16")
    reloaded, _ = load_quantized(folder, dtype=torch.float32)
    layers = quantized_modules(model)
    assert layers
    for name, layer in layers.items():
        theirs = reloaded.get_submodule(name)
        assert (theirs.bits, theirs.group_size, theirs.act_bits) == (layer.bits, layer.group_size, layer.act_bits)
        assert (theirs.channel_scales is None) == (layer.channel_scales is None), name
        torch.testing.assert_close(theirs.dequantized_weight(), layer.dequantized_weight().float(), rtol=0, atol=0)
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in rounded.parameters():  # the export's fp16 embeddings and norms
            parameter.copy_(parameter.half().float())
        torch.testing.assert_close(reloaded(PROMPT).logits, rounded(PROMPT).logits, rtol=1e-5, atol=1e-5)


def test_the_matrix_covers_every_method_and_format() -> None:
    assert {c.method for c, _ in CASES} == set(registered_methods())
    assert {f for _, f in CASES} == set(FORMATS)
    assert len(CASES) == 149  # the README says so: 4 methods x 5 schemes x 4 groups in 1-3 formats, + QQQ, + FP8


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_every_accepted_dense_export_reloads_exactly(case: tuple[QuantConfig, str], tmp_path) -> None:
    config, fmt = case
    check_round_trip(quantized(config, None), config, fmt, tmp_path / "export")


@pytest.mark.parametrize("moe", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("case", MOE_CASES, ids=case_id)
def test_every_accepted_moe_export_reloads_exactly(case: tuple[QuantConfig, str], moe: str, tmp_path) -> None:
    config, fmt = case
    check_round_trip(quantized(config, moe), config, fmt, tmp_path / "export")


@pytest.mark.parametrize("request_", list(requested_schemes()), ids=lambda r: "-".join(map(str, r)))
def test_every_refused_combination_is_refused_in_one_line(request_: tuple) -> None:
    """What the CLI checks before reading the model (cli._quantize: validate, then the format's check)."""
    for fmt in FORMATS:
        try:
            get_format(fmt).check(build(*request_))
        except QuantizationError as err:
            assert "\n" not in str(err) and str(err)
