"""Exports are byte-identical to the recorded ones: every method x format on a tiny random Llama.

The hashes in golden_exports.json pin the bytes a refactor must not change (weights, packing, scales, the
quantization config vLLM reads). QUANTKIT_UPDATE_GOLDEN=1 rewrites them: only for an intended change of
output, said in the commit.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from test_adapters import tiny_model
from test_engine import random_calibration

from quantkit.config import QuantConfig
from quantkit.engine import quantize_model
from quantkit.export import export_checkpoint
from quantkit.formats import get_format
from quantkit.models import get_adapter
from quantkit.qtensor import QuantizationError

GOLDEN = Path(__file__).with_name("golden_exports.json")
CASES = [(method, fmt, sym, act_bits)
         for method in ("rtn", "gptq", "awq", "qqq")
         for fmt in ("compressed-tensors", "gptq", "awq")
         for sym, act_bits in ((True, 16), (False, 16), (True, 8))]


def _supported(method: str, fmt: str, sym: bool, act_bits: int) -> QuantConfig | None:
    if method == "qqq" and act_bits != 8:
        return None
    config = QuantConfig.from_dict(dict(method=method, group_size=32, sym=sym, act_bits=act_bits, smooth_steps=8))
    try:
        get_format(fmt).check(config.validate())
    except QuantizationError:
        return None
    return config


def _export_digest(tmp_path: Path, method: str, fmt: str, config: QuantConfig) -> dict[str, str]:
    model = tiny_model("llama").double()  # float64: the methods' searches never meet a near-tie that rounding
    # differences between CPUs (AVX2 and AVX-512 kernels sum in different orders) could break either way
    quantize_model(model, get_adapter(model), random_calibration(), config, device="cpu", show_progress=False)
    out = export_checkpoint(model, None, tmp_path / f"{method}-{fmt}", config, fmt, dtype="float16")
    hf_config = json.loads((out / "config.json").read_text())
    return {
        "model.safetensors": hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest(),
        "quantization_config": hashlib.sha256(
            json.dumps(hf_config["quantization_config"], sort_keys=True).encode()).hexdigest(),
    }


@pytest.mark.parametrize("method,fmt,sym,act_bits", CASES)
def test_export_bytes_unchanged(tmp_path, single_thread, method: str, fmt: str, sym: bool, act_bits: int) -> None:
    config = _supported(method, fmt, sym, act_bits)
    if config is None:
        pytest.skip("combination not supported")
    key = f"{method}/{fmt}/{'sym' if sym else 'asym'}/a{act_bits}"
    digest = _export_digest(tmp_path, method, fmt, config)
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    if os.environ.get("QUANTKIT_UPDATE_GOLDEN") == "1":
        golden[key] = digest
        GOLDEN.write_text(json.dumps(dict(sorted(golden.items())), indent=1) + "\n")
    assert golden.get(key) == digest, f"{key}: export bytes changed"


def test_every_method_and_format_is_pinned() -> None:
    golden = json.loads(GOLDEN.read_text())
    for method in ("rtn", "gptq", "awq", "qqq"):
        assert any(k.startswith(f"{method}/") for k in golden), method
    for fmt in ("compressed-tensors", "gptq", "awq"):
        assert any(f"/{fmt}/" in k for k in golden), fmt
