"""--quantize-head: lm_head quantized by the method (GPTQ on the normed last hidden states; RTN and FP8 without
calibration), untied from tied embeddings, written by the one export writer whichever way the model came in (the
streamed export has the in-memory bytes), reloaded and scored layer by layer as the in-memory model computes it.
vLLM and transformers loading it: test_vllm_formats.py (its `head` cases)."""

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
RTN = QuantConfig(method="rtn", group_size=32, quantize_head=True)
FP8 = QuantConfig(method="fp8", quantize_head=True)


def _tied_model(tmp_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(_checkpoint(tmp_path / "src", tied=True), dtype=torch.float32).eval()


@pytest.mark.parametrize("config", [RTN, FP8], ids=["rtn", "fp8"])
def test_a_calibration_free_head_is_its_grid_and_untied(tmp_path, single_thread, config: QuantConfig) -> None:
    model = _tied_model(tmp_path)
    embeddings = model.get_input_embeddings().weight.detach().clone()
    report = quantize_model(model, get_adapter(model), random_calibration(), config, device="cpu",
                            show_progress=False)
    assert report.head == {"shape": [128, 64], "method": config.method, "untied": True}
    assert isinstance(model.lm_head, QuantLinear) and not model.config.tie_word_embeddings
    assert torch.equal(model.get_input_embeddings().weight, embeddings)  # the embeddings stay as they were
    expected = fp8_quantize(embeddings) if config.fp8 else rtn_quantize(embeddings, 4, 32, True, False)
    torch.testing.assert_close(model.lm_head.dequantized_weight().float(), expected.dequantize(), rtol=0, atol=0)
    assert report.to_dict()["head"] == report.head


def test_gptq_calibrates_the_head_on_the_normed_last_hidden_states(tmp_path, single_thread) -> None:
    """The head is one more engine step: GPTQ's Hessian from the final norm's outputs on the quantized layers'
    hidden states (real tokens only), so its output error there is below RTN's on the same grid."""
    model = _tied_model(tmp_path)
    original = model.lm_head.weight.detach().clone()
    calib = random_calibration()
    report = quantize_model(model, get_adapter(model), calib, W4, device="cpu", show_progress=False)
    assert report.head["method"] == "gptq" and report.head["nsamples"] == int(calib.attention_mask.sum())
    normed = []
    hook = model.model.norm.register_forward_hook(lambda _m, _a, out: normed.append(out))
    with torch.no_grad():
        model(calib.input_ids, attention_mask=calib.attention_mask)
    hook.remove()
    x = normed[0][calib.attention_mask.bool()]
    reference = x @ original.t()

    def error(weight: torch.Tensor) -> float:
        return float((x @ weight.t() - reference).norm())

    rtn = rtn_quantize(original, 4, 32, True, False).dequantize()
    assert error(model.lm_head.dequantized_weight().float()) < 0.9 * error(rtn)


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
