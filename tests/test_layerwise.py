"""Layer-streamed perplexity and KL (quantkit.eval.layerwise) equal quantkit.eval.perplexity on the whole models."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_engine import random_calibration
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig

from quantkit.config import QuantConfig
from quantkit.engine import quantize_model
from quantkit.eval.layerwise import layerwise_perplexity
from quantkit.eval.perplexity import perplexity
from quantkit.export import export_checkpoint
from quantkit.models import get_adapter
from quantkit.reload import load_quantized
from quantkit.streaming.skeleton import StreamedLayers

VOCAB = 128
TEXT = "the quick brown fox jumps over the lazy dog; " * 40
OTHER = "pack my box with five dozen liquor jugs. " * 5


class CharTokenizer:
    """Characters as token ids, with a BOS: enough for heldout_windows."""

    bos_token_id = 1

    def __call__(self, text: str, add_special_tokens: bool, return_tensors: str) -> dict:
        return {"input_ids": torch.tensor([[2 + ord(c) % (VOCAB - 2) for c in text]])}


def _config(kind: str):
    common = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=VOCAB, max_position_embeddings=256)
    if kind == "llama":
        return LlamaConfig(**common, intermediate_size=128)
    return Gemma3TextConfig(**common, intermediate_size=128, sliding_window=16, final_logit_softcapping=30.0)


def _source(folder: Path, kind: str) -> Path:
    if kind in ("llama", "gemma3"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config(kind)).eval()
        model.config.architectures = [type(model).__name__]
    else:
        from test_moe import tiny_moe

        model = tiny_moe(kind, num_hidden_layers=3)
    model.save_pretrained(folder, max_shard_size="40KB")
    return folder


def _export(source: Path, folder: Path) -> Path:
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    config = QuantConfig(method="gptq", group_size=32)
    quantize_model(model, get_adapter(model), random_calibration(), config, device="cpu", show_progress=False)
    return export_checkpoint(model, None, folder, config, "compressed-tensors", dtype="float16")


@pytest.mark.parametrize("kind", ["llama", "gemma3", "qwen3_moe"])
def test_layerwise_scores_are_the_whole_models_scores(tmp_path, kind: str, monkeypatch) -> None:
    source = _source(tmp_path / "src", kind)
    export = _export(source, tmp_path / "export")
    live: list[int] = []
    original_load = StreamedLayers.load
    monkeypatch.setattr(StreamedLayers, "load",
                        lambda self, i, layer, device: (original_load(self, i, layer, device), live.append(self.live))[0])
    texts = {"text": TEXT, "other": OTHER}  # both in one pass through each model
    per_text = layerwise_perplexity([source, export], CharTokenizer(), texts, seqlen=64, max_windows=6,
                                    batch_size=4, device="cpu", dtype=torch.float32)
    assert live == [1, 1, 1]  # the original's layers, one at a time, once for both texts
    original = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    quantized, _ = load_quantized(export, dtype=torch.float32)
    for label, text in texts.items():
        streamed = per_text[label]
        whole = [perplexity(original, CharTokenizer(), text, seqlen=64, max_windows=6, batch_size=4),
                 perplexity(quantized, CharTokenizer(), text, seqlen=64, max_windows=6, batch_size=4,
                            reference=original)]
        for ours, reference in zip(streamed, whole, strict=True):
            assert ours["tokens"] == reference["tokens"] and ours["windows"] == reference["windows"]
            assert math.isclose(ours["nll"], reference["nll"], rel_tol=1e-5)
        assert "kl" not in streamed[0]
        assert streamed[1]["kl"] > 0 and math.isclose(streamed[1]["kl"], whole[1]["kl"], rel_tol=1e-4, abs_tol=1e-7)
    assert per_text["text"][0]["windows"] == 6 and per_text["other"][0]["windows"] == 3


def test_eval_goes_layer_by_layer_when_a_model_does_not_fit(tmp_path, smollm2_gguf, monkeypatch) -> None:
    """`quantkit eval ORIGINAL EXPORT` with too little free memory says so and scores layer by layer: the entries
    are layerwise_perplexity's, the report shows the KL; what needs the whole model is refused in one line."""
    import io
    import json

    from rich.console import Console

    from quantkit.eval import runner
    from quantkit.models.loading import load_tokenizer
    from quantkit.qtensor import QuantizationError

    tokenizer = load_tokenizer(str(smollm2_gguf))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(tokenizer), max_position_embeddings=256)).eval()
    model.save_pretrained(tmp_path / "src")
    tokenizer.save_pretrained(tmp_path / "src")
    source, export = tmp_path / "src", _export(tmp_path / "src", tmp_path / "export")
    text = tmp_path / "text.txt"
    text.write_text("Quantization keeps the model small. 양자화는 모델을 작게 유지한다. " * 30)
    monkeypatch.setattr(runner, "device_available", lambda device: 1)
    out = io.StringIO()
    kwargs = dict(texts=[str(text)], limit=None, num_fewshot=None, generations=False, batch_size=2, device="cpu",
                  seqlen=32, max_windows=3, console=Console(file=out, width=200))
    results = runner.run_eval([str(source), str(export)], tasks=[], report_dir=tmp_path / "report",
                              json_path=tmp_path / "r.json", **kwargs)
    assert "does not fit in the free memory of cpu" in out.getvalue()
    expected = layerwise_perplexity([source, export], tokenizer, {"text": text.read_text()}, seqlen=32,
                                    max_windows=3, batch_size=2, device="cpu")["text"]
    assert [m["perplexity"]["text"] for m in results["models"]] == expected
    assert json.loads((tmp_path / "r.json").read_text())["config"]["layerwise"] is True
    assert "Mean KL(first || model)" in (tmp_path / "report" / "report.md").read_text()
    with pytest.raises(QuantizationError, match="--tasks needs the whole model"):
        runner.run_eval([str(source), str(export)], tasks=["arc_easy"], report_dir=None, json_path=None, **kwargs)
