"""Shared by the tests that export a quantized model: the export, quantkit's reload against the in-memory model,
transformers' load, and the vLLM runner (tests/tools/vllm_greedy.py in .venv-vllm) with the rule its greedy tokens
are compared by."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from quantkit.config import QuantConfig
from quantkit.export import export_checkpoint
from quantkit.reload import load_quantized


def export(model, config: QuantConfig, setup, folder: Path, formats: list[str]) -> dict[str, Path]:
    """The quantized model exported in each format into folder/<format>, with fp16 embeddings and norms."""
    return {fmt: export_checkpoint(model, setup[1], folder / fmt, config, fmt, dtype="float16") for fmt in formats}


def check_reload_matches_the_in_memory_model(quantized, folder: Path, setup) -> None:
    """The export holds embeddings and norms in fp16: the in-memory model with its parameters rounded the same
    way must give the same logits. (Unrounded, W4A8 drifts by several logits: a rounding difference of one
    ulp in the embeddings flips per-token int8 roundings, and 30 layers amplify the flips.)"""
    ids = setup[2].input_ids[:2, :64]
    model = copy.deepcopy(quantized)
    with torch.no_grad():
        for parameter in model.parameters():  # QuantLinear keeps its packed weights in buffers, untouched here
            parameter.copy_(parameter.half().float())
        reference = model(ids).logits
        reloaded, _ = load_quantized(folder, dtype=torch.float32)
        torch.testing.assert_close(reloaded(ids).logits, reference, atol=1e-3, rtol=1e-3)


def check_transformers_loads_the_compressed_tensors_export(folder: Path, setup, w4a8: bool) -> None:
    """W4A16 exports match quantkit's reload. The W4A8 one loads with every tensor, but its logits are only
    checked to be finite: transformers' compressed-tensors path rounds the per-token int8 activations in
    its own order of operations, and through 30 layers any rounding flip drifts the logits by several units
    (max |diff| 9.0 measured 2026-12-03; see check_reload_matches_the_in_memory_model for the same effect)."""
    ids = setup[2].input_ids[:2, :64]
    hf, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        logits = hf.eval()(ids).logits
        if w4a8:
            assert logits.isfinite().all()
        else:
            ours, _ = load_quantized(folder, dtype=torch.float32)
            torch.testing.assert_close(logits, ours(ids).logits, atol=2e-3, rtol=2e-3)


VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
VLLM_RUNNER = Path(__file__).resolve().parent / "tools" / "vllm_greedy.py"
VLLM_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm: run scripts/setup_vllm_venv.sh")


# vLLM runs fp16 (and its own int8 activation rounding), quantkit fp32 here: where quantkit's top two logits are
# this close, either engine may pick either token. W4A8 needs more: an int8 rounding flip moves logits further
# (max |diff| 9.0 against transformers, check_transformers_loads_the_compressed_tensors_export). On
# test_vllm_formats.py's matrix (2026-12-07) every W4A16 case and the tiny W4A8 ones gave vLLM's greedy tokens
# exactly (margin 0); the SmolLM2-shaped QQQ W4A8 case had 21 of 24 steps exact and a largest margin of 0.10.
NEAR_TIE = 0.5
NEAR_TIE_W4A8 = 1.0


@torch.no_grad()
def teacher_forced_margins(folder: Path, prompt_ids: list[list[int]], tokens: list[list[int]]) -> list[list[float]]:
    """Per prompt and step, quantkit's logit gap between its own argmax and the given token, with the given
    tokens fed back (0 where quantkit picks the same token)."""
    model, _ = load_quantized(folder, dtype=torch.float32)
    margins = []
    for ids, theirs in zip(prompt_ids, tokens, strict=True):
        logits = model(torch.tensor([ids + theirs[:-1]])).logits[0, len(ids) - 1:]
        picked = logits.gather(1, torch.tensor(theirs)[:, None])[:, 0]
        margins.append((logits.max(dim=-1).values - picked).tolist())
    return margins
