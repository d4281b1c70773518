"""Shared by the real-model tests: quantize a copy on CPU, measure held-out NLL, record every figure.

QUANTKIT_TEST_REPORT=DIR writes DIR/<model>.json ({label: {"nll": {text: mean NLL}, "seconds": s}});
benchmarks/accuracy/ holds tables made from such reports.
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

from quantkit.config import QuantConfig
from quantkit.engine import quantize_model
from quantkit.eval.perplexity import perplexity
from quantkit.models import get_adapter
from quantkit.nn.qlinear import QuantLinear


def mean(nll: dict[str, float]) -> float:
    return sum(nll.values()) / len(nll)


def with_act_bits(quantized, act_bits: int):
    """A copy of an RTN / GPTQ quantized model whose linears take act_bits activations. Those methods' weights do
    not depend on act_bits (test_qqq's test_rtn_and_gptq_weights_ignore_act_bits): W4A8 reuses W4A16's."""
    model = copy.deepcopy(quantized)
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.act_bits = act_bits
    return model


class NLLRecorder:
    """Held-out mean NLL per text, with the same windows for every model, recorded under a label."""

    def __init__(self, name: str, tokenizer, texts: dict[str, str], windows: int, window_len: int = 512):
        self.name, self.tokenizer, self.texts = name, tokenizer, texts
        self.windows, self.window_len = windows, window_len
        self.measured: dict[str, dict] = {}

    def nll(self, model, label: str | None = None, seconds: float = 0.0) -> dict[str, float]:
        nll = {text_name: perplexity(model, self.tokenizer, text, self.window_len, max_windows=self.windows)["nll"]
               for text_name, text in self.texts.items()}
        if label is not None:
            self.measured[label] = {"nll": nll, "seconds": round(seconds, 1)}
        return nll

    def quantized(self, model, calib, config: QuantConfig, batch_size: int = 8):
        """(mean NLL per held-out text, quantized copy of the model); the source model stays untouched."""
        quantized = copy.deepcopy(model)
        start = time.perf_counter()
        quantize_model(quantized, get_adapter(quantized), calib, config, device="cpu", batch_size=batch_size,
                       show_progress=False)
        return self.nll(quantized, config.label(), time.perf_counter() - start), quantized

    def reused(self, quantized, config: QuantConfig):
        """quantized()'s result for `config` from a model RTN / GPTQ quantized with other act_bits (recorded
        with 0 seconds)."""
        model = with_act_bits(quantized, config.act_bits)
        return self.nll(model, config.label()), model

    def write_report(self) -> None:
        folder = os.environ.get("QUANTKIT_TEST_REPORT")
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / f"{self.name}.json").write_text(json.dumps(self.measured, indent=1))
