"""Smoke test of tests/tools/vllm_greedy.py, the vLLM (CPU) runner: it loads a tiny GPTQ v1 checkpoint
packed here by hand after the published layout, reports that vLLM ran it through its GPTQ method, and the
weights vLLM holds after loading are exactly the ones packed. Needs the vLLM virtualenv made by
scripts/setup_vllm_venv.sh; skipped without it. One runner call: about a minute on a 2-core machine.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from export_checks import VLLM_FUSED, VLLM_PYTHON, VLLM_RUNNER, needs_vllm
from safetensors.torch import load_file, save_file

pytestmark = [
    pytest.mark.vllm,
    needs_vllm,
]

GROUP_SIZE = 64
MAX_TOKENS = 6
VOCAB_SIZE = 256
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_nibbles_along_rows(codes: torch.Tensor) -> torch.Tensor:
    """[rows, cols] codes 0..15 -> int32 [rows / 8, cols]; nibble j of packed row r is row 8r + j."""
    grouped = codes.to(torch.int64).reshape(-1, 8, codes.shape[1])
    return to_int32(sum(grouped[:, j] << (4 * j) for j in range(8))).contiguous()


def gptq_layer(out_features: int, in_features: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Random symmetric 4-bit layer in GPTQ v1 layout, plus "weight": its dequantized fp32 [out, in]."""
    groups = in_features // GROUP_SIZE
    codes = torch.randint(0, 16, (out_features, in_features), generator=generator)
    # bf16-exact scales: vLLM casts the fp16 scales to the bf16 it runs in, which must lose nothing here.
    scales = (torch.rand(out_features, groups, generator=generator) * 0.02 + 0.005).bfloat16().float()
    stored_zero = torch.full((out_features, groups), 8 - 1)  # v1 stores zero - 1
    return {
        "qweight": pack_nibbles_along_rows(codes.t()),
        "qzeros": pack_nibbles_along_rows(stored_zero).t().contiguous(),
        "scales": scales.t().contiguous().half(),
        "g_idx": (torch.arange(in_features) // GROUP_SIZE).to(torch.int32),
        "weight": (codes - 8) * scales.repeat_interleave(GROUP_SIZE, dim=1),
    }


def write_tiny_gptq_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """Saves a 2-layer Llama with GPTQ projections; returns the dequantized weight of each projection."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=512,  # the runner asks for a 512-token context
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    expected = {}
    for name in [n for n in state if n.endswith(".weight") and n.split(".")[-2] in PROJECTIONS]:
        prefix = name.removesuffix(".weight")
        layer = gptq_layer(*state.pop(name).shape, generator)
        expected[prefix] = layer.pop("weight")
        state.update({f"{prefix}.{key}": value for key, value in layer.items()})
    save_file(state, folder / "model.safetensors")
    config_json = json.loads((folder / "config.json").read_text())
    config_json["quantization_config"] = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": GROUP_SIZE,
        "desc_act": False,
        "sym": True,
        "checkpoint_format": "gptq",
    }
    (folder / "config.json").write_text(json.dumps(config_json))
    return expected


def vllm_view(name: str, expected: dict[str, torch.Tensor]) -> torch.Tensor:
    """Our weight for vLLM's module `name`, stacking the projections vLLM fuses."""
    prefix, leaf = name.rsplit(".", 1)
    return torch.cat([expected[f"{prefix}.{part}"] for part in VLLM_FUSED.get(leaf, (leaf,))])


@pytest.fixture(scope="module")
def runner_result(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, dict]:
    folder = tmp_path_factory.mktemp("tiny_gptq")
    expected = write_tiny_gptq_checkpoint(folder)
    prompts = folder / "prompts.json"
    prompts.write_text(json.dumps([[1, 2, 3, 4], [200, 100, 50]]))
    out, dump = folder / "result.json", folder / "weights.safetensors"
    command = [str(VLLM_PYTHON), str(VLLM_RUNNER), str(folder), "--prompts-json", str(prompts)]
    command += ["--max-tokens", str(MAX_TOKENS), "--out", str(out), "--dtype", "bfloat16"]
    command += ["--dump-weights", str(dump)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(out.read_text()), load_file(dump), expected


def test_vllm_runs_the_checkpoint_through_its_gptq_method(runner_result: tuple[dict, dict, dict]) -> None:
    result, _, _ = runner_result
    assert result["quantization"] == "auto_gptq"
    assert (
        result["linear_methods"]["AutoGPTQLinearMethod/CPUWNA16LinearKernel"] == 2 * 4
    )  # qkv, o, gate_up, down
    assert "UnquantizedLinearMethod" not in result["linear_methods"]


def test_vllm_holds_exactly_the_packed_weights(runner_result: tuple[dict, dict, dict]) -> None:
    _, dumped, expected = runner_result
    assert len(dumped) == 2 * 4
    for name, weight in dumped.items():
        assert torch.equal(weight, vllm_view(name, expected)), name


def test_greedy_decoding_gives_the_requested_tokens(runner_result: tuple[dict, dict, dict]) -> None:
    result, _, _ = runner_result
    assert [r["prompt_token_ids"] for r in result["results"]] == [[1, 2, 3, 4], [200, 100, 50]]
    for generated in result["results"]:
        assert len(generated["token_ids"]) == MAX_TOKENS
        assert all(0 <= token < VOCAB_SIZE for token in generated["token_ids"])
