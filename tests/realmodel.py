"""Shared by the real-model tests: quantize a copy on CPU once per configuration, measure held-out NLL, record
every figure.

The real-model tests assert only what holds with a margin several times its spread across calibration seeds
(benchmarks/accuracy/SEEDS_SMOLLM2.md and SEEDS_GEMMA3.md measure it, three seeds, as these tests calibrate); the
full accuracy tables are benchmarks, not tests (benchmarks/bench_accuracy.py). QUANTKIT_TEST_REPORT=DIR writes DIR/<REPORT>.json
({label: {"nll": {text: mean NLL}, "seconds": s}}).
"""

from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from quantkit.config import QuantConfig
from quantkit.engine import QuantReport, quantize_model
from quantkit.eval.perplexity import perplexity
from quantkit.models import get_adapter
from quantkit.nn.qlinear import with_act_bits


def mean(nll: dict[str, float]) -> float:
    return sum(nll.values()) / len(nll)


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

    def write_report(self) -> None:
        folder = os.environ.get("QUANTKIT_TEST_REPORT")
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / f"{self.name}.json").write_text(json.dumps(self.measured, indent=1))


@dataclass
class Run:
    nll: dict[str, float]  # mean NLL per held-out text
    model: object  # the quantized copy
    report: QuantReport | None  # None for fp and for W4A8 runs that reuse W4A16 weights


class RealRuns:
    """runs[config]: the source model quantized with config on the CPU, once per test file (the tests of one
    configuration live in one file, so nothing is quantized twice in the suite); RTN's and GPTQ's W4A8 runs
    evaluate their W4A16 weights, which do not depend on act_bits. runs.fp is the unquantized model's Run."""

    def __init__(self, model, calib, recorder: NLLRecorder, batch_size: int = 8) -> None:
        self.source, self.calib, self.recorder, self.batch_size = model, calib, recorder, batch_size
        self.done: dict[str, Run] = {}

    @property
    def fp(self) -> Run:
        if "fp" not in self.done:
            self.done["fp"] = Run(self.recorder.nll(self.source, "fp32"), self.source, None)
        return self.done["fp"]

    def __getitem__(self, config: QuantConfig) -> Run:
        key = json.dumps(config.to_dict(), sort_keys=True)
        if key not in self.done:
            self.done[key] = self._quantize(config)
        return self.done[key]

    def _quantize(self, config: QuantConfig) -> Run:
        if config.method in ("rtn", "gptq") and config.act_bits != 16:
            weight_only = self[QuantConfig.from_dict({**config.to_dict(), "act_bits": 16})]
            model = with_act_bits(weight_only.model, config.act_bits)
            return Run(self.recorder.nll(model, config.label()), model, None)
        model = copy.deepcopy(self.source)
        start = time.perf_counter()
        report = quantize_model(model, get_adapter(model), self.calib, config, device="cpu",
                                batch_size=self.batch_size, show_progress=False)
        return Run(self.recorder.nll(model, config.label(), time.perf_counter() - start), model, report)


def check_layers_at_or_below_rtn(report: QuantReport, fraction: float = 1.0) -> None:
    """The engine's guard entries: the layers' summed output error on the calibration batches below `fraction` of
    RTN's on the same inputs, and every layer at or below RTN's or fallen back to it."""
    guards = [layer["guard"] for layer in report.layers]
    assert sum(g["output_error"] for g in guards) < fraction * sum(g["rtn_output_error"] for g in guards), guards
    for g in guards:
        assert g["output_error"] <= g["rtn_output_error"] or g.get("fallback") == "rtn", g


def check_scale_search_never_above_the_identity(report: QuantReport) -> None:
    """AWQ's scale search (AWQ's or awq-gptq's): every group keeps scales whose loss is at most s = 1's."""
    groups = [group for layer in report.layers for group in layer["smoothing"]["scales"].values()]
    searched = [g for g in groups if "loss_awq" in g]
    assert searched and all(g["loss_awq"] <= g["loss_rtn"] for g in searched), searched
