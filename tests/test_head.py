"""--quantize-head: lm_head quantized on the scheme's grid (round to nearest) or in FP8, untied from tied embeddings,
written by the one export writer whichever way the model came in (the streamed export has the in-memory bytes),
reloaded and scored layer by layer as the in-memory model computes it. vLLM and transformers loading it:
test_vllm_formats.py (its `head` cases)."""

from __future__ import annotations

import json

import pytest
import torch
from test_engine import random_calibration
from test_streaming import _checkpoint, _digest, _in_memory, _streamed

from quantkit.config import QuantConfig
from quantkit.engine import quantize_model
from quantkit.eval.layerwise import layerwise_scores
from quantkit.formats import get_format
from quantkit.models import get_adapter
from quantkit.nn.qlinear import QuantLinear
from quantkit.qtensor import QuantizationError, fp8_quantize
from quantkit.quantizers.rtn import rtn_quantize
from quantkit.reload import load_quantized

W4 = QuantConfig(method="gptq", group_size=32, quantize_head=True)
FP8 = QuantConfig(method="fp8", quantize_head=True)


@pytest.mark.parametrize("config", [W4, FP8], ids=["w4a16", "fp8"])
def test_a_tied_head_is_quantized_on_the_grid_and_untied(tmp_path, single_thread, config: QuantConfig) -> None:
    from transformers import AutoModelForCausalLM

    source = _checkpoint(tmp_path / "src", tied=True)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    embeddings = model.get_input_embeddings().weight.detach().clone()
    report = quantize_model(model, get_adapter(model), random_calibration(), config, device="cpu",
                            show_progress=False)
    assert report.head == {"shape": [128, 64], "method": "fp8" if config.fp8 else "rtn", "untied": True}
    assert isinstance(model.lm_head, QuantLinear) and not model.config.tie_word_embeddings
    assert torch.equal(model.get_input_embeddings().weight, embeddings)  # the embeddings stay as they were
    expected = fp8_quantize(embeddings) if config.fp8 else rtn_quantize(embeddings, 4, 32, True, False)
    torch.testing.assert_close(model.lm_head.dequantized_weight().float(), expected.dequantize(), rtol=0, atol=0)
    assert report.to_dict()["head"] == report.head


@pytest.mark.parametrize(("config", "fmt"), [(W4, "compressed-tensors"), (W4, "gptq"), (FP8, "compressed-tensors")],
                         ids=["w4a16-ct", "w4a16-gptq", "fp8-ct"])
def test_the_streamed_export_has_the_in_memory_bytes_and_reloads(tmp_path, single_thread, config, fmt) -> None:
    """One writer: the head packed from memory after the layers, in both paths; the config says untied and lists
    no ignored lm_head; quantkit reloads a QuantLinear head, and the layer-by-layer evaluation scores the export as
    the reloaded model computes it."""
    source = _checkpoint(tmp_path / "src", tied=True)
    expected = _in_memory(source, config, fmt, tmp_path / "memory")
    out, report = _streamed(source, config, fmt, tmp_path / "streamed")
    assert _digest(out) == _digest(expected) and report.head["untied"]
    hf_config = json.loads((out / "config.json").read_text())
    assert hf_config["tie_word_embeddings"] is False
    qconfig = hf_config["quantization_config"]
    if fmt == "gptq":
        assert qconfig["lm_head"] is True and "dynamic" not in qconfig
    else:
        assert qconfig["ignore"] == [] and "lm_head" in qconfig["config_groups"]["group_0"]["targets"]
    model, _ = load_quantized(out, dtype=torch.float32)
    assert isinstance(model.lm_head, QuantLinear)
    windows = {"random": torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))}
    scored = layerwise_scores([out], windows, device="cpu", dtype=torch.float32)["random"][0]
    with torch.no_grad():
        logits = model(windows["random"]).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, 128), windows["random"][:, 1:].reshape(-1))
    assert scored["nll"] == pytest.approx(nll.item(), rel=1e-5)


def test_a_head_the_scheme_or_format_cannot_hold_is_refused_in_one_line() -> None:
    with pytest.raises(QuantizationError, match="^--quantize-head takes weight-only schemes"):
        QuantConfig(method="qqq", quantize_head=True).validate()
    with pytest.raises(QuantizationError, match="^the AWQ format has no quantized lm_head"):
        get_format("awq").check(QuantConfig(method="awq", quantize_head=True).validate())
