"""The second real model: Gemma-3-270M (gemma3: (1+w) RMSNorm, q/k norms, sliding-window layers, 262k vocab),
W4A8 with groups of 128, quantized on CPU.

GPTQ W4A8 and QQQ (smoothing + GPTQ) must cost less held-out perplexity than RTN W4A8, by a bounded amount;
the QQQ export must reload to the same logits and load in transformers; QQQ's smoothing must beat plain GPTQ
W4A8. QUANTKIT_TEST_REPORT=DIR writes every measured NLL to DIR/gemma3.json (benchmarks/accuracy/RESULTS.md
is such a table).
"""

from __future__ import annotations

import pytest
import torch
from realmodel import NLLRecorder, mean
from transformers import AutoModelForCausalLM

from quantkit.config import QuantConfig
from quantkit.data import build_calibration_set, default_heldout_texts, load_passages, load_text
from quantkit.export import export_checkpoint
from quantkit.models import load_model
from quantkit.quantizers.gptq import GPTQOptions
from quantkit.quantizers.qqq import QQQOptions
from quantkit.reload import load_quantized

pytestmark = pytest.mark.slow(seconds=792)  # this file's time in the suite, 2026-12-05: conftest.py orders by it
GROUP = 128
# QQQ with the default refined search on a grid of 100 thresholds (the reference rule's floor; its own rule gives
# Gemma's activations grids of up to ~670), smoothing loss on 8 of the 16 calibration sequences. Measured as CI
# runs it (one thread): mean NLL 3.138 (refined, 100), 3.147 (refined, reference rule), 3.150 (every one of 25).
RUNS = {
    "gptq-w4a16": QuantConfig(method="gptq", group_size=GROUP, options=GPTQOptions(act_order=True)),
    "rtn-w4a8": QuantConfig(method="rtn", group_size=GROUP, act_bits=8),
    "qqq-w4a8": QuantConfig(method="qqq", group_size=GROUP, act_bits=8,
                            options=QQQOptions(smooth_steps=100, smooth_samples=8)),
}
# GPTQ's weights do not depend on act_bits: W4A8 evaluates gptq-w4a16's (realmodel.with_act_bits)
GPTQ_W4A8 = QuantConfig(method="gptq", group_size=GROUP, act_bits=8, options=GPTQOptions(act_order=True))


@pytest.fixture(scope="module")
def gemma3(gemma3_gguf):
    model, tokenizer = load_model(gemma3_gguf)
    calib = build_calibration_set(tokenizer, load_passages(None), nsamples=16, seqlen=256, seed=0)
    return model, tokenizer, calib


@pytest.fixture(scope="module")
def results(gemma3):
    model, tokenizer, calib = gemma3
    texts = {name: load_text(path) for name, path in default_heldout_texts().items()}
    recorder = NLLRecorder("gemma3", tokenizer, texts, windows=4)
    out = {"fp": (recorder.nll(model, "fp32"), model)}
    out.update({name: recorder.quantized(model, calib, config) for name, config in RUNS.items()})
    out["gptq-w4a8"] = recorder.reused(out["gptq-w4a16"][1], GPTQ_W4A8)
    recorder.write_report()
    return out


def _w4a8(results) -> tuple[dict, ...]:
    return tuple(results[k][0] for k in ("fp", "rtn-w4a8", "gptq-w4a8", "qqq-w4a8"))


def test_gptq_and_qqq_w4a8_beat_rtn_w4a8(results) -> None:
    fp, rtn, gptq, qqq = _w4a8(results)
    assert max(mean(gptq), mean(qqq)) < mean(rtn), (fp, rtn, gptq, qqq)
    # bounded: W4A8 with smoothing costs less than +50% perplexity
    assert mean(qqq) - mean(fp) < torch.log1p(torch.tensor(0.5)).item(), (fp, qqq)


def test_qqq_smoothing_beats_plain_w4a8(results) -> None:
    """Only with the GPTQ check of each group's smoothing (QQQOptions.smooth_check, the default): without it
    QQQ measured 3.184 mean NLL against plain GPTQ W4A8's 3.167 (100 thresholds), with it 3.152 (100 thresholds)
    and 3.158 (25 thresholds; English alone 3.085 vs 3.083). As CI runs it (one thread per xdist worker, where
    GPTQ rounds differently): 3.150 (every one of 25 thresholds) vs 3.161, English alone 3.105 vs 3.077
    (benchmarks/accuracy/RESULTS.md); this test's refined search on 100: 3.138, English 3.070
    (2026-12-05)."""
    fp, rtn, gptq, qqq = _w4a8(results)
    assert mean(qqq) < mean(gptq), (fp, gptq, qqq)


def test_gptq_w4a16_is_bounded(results) -> None:
    fp, gptq = results["fp"][0], results["gptq-w4a16"][0]
    for text in fp:
        assert gptq[text] - fp[text] < torch.log1p(torch.tensor(0.5)).item(), (text, fp[text], gptq[text])


@pytest.fixture(scope="module")
def qqq_export(results, gemma3, tmp_path_factory):
    _, tokenizer, _ = gemma3
    folder = tmp_path_factory.mktemp("gemma3") / "qqq-ct"
    return export_checkpoint(results["qqq-w4a8"][1], tokenizer, folder, RUNS["qqq-w4a8"], "compressed-tensors",
                             dtype="float32")


def test_qqq_export_reloads_and_loads_in_transformers(results, gemma3, qqq_export) -> None:
    """fp32 export: quantkit's reload gives the in-memory model's logits; transformers loads every tensor."""
    _, _, calib = gemma3
    ids = calib.input_ids[:2, :64]
    with torch.no_grad():
        reference = results["qqq-w4a8"][1](ids).logits
        reloaded, _ = load_quantized(qqq_export, dtype=torch.float32)
        torch.testing.assert_close(reloaded(ids).logits, reference, atol=1e-3, rtol=1e-3)
        hf, info = AutoModelForCausalLM.from_pretrained(qqq_export, dtype=torch.float32, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        assert hf.eval()(ids).logits.isfinite().all()
