"""SmolLM2-135M per output channel, quantized on CPU (shared settings and checks: smollm2_checks.py).

GPTQ must raise held-out perplexity by less than RTN does and by a bounded amount; W4A8 with QQQ's smoothing
less than GPTQ W4A8, which beats RTN W4A8. The QQQ export (compressed-tensors) must reload, load in transformers
and in vLLM with matching greedy tokens. Groups of 64: test_smollm2_g64.py; AWQ: test_smollm2_awq.py.
"""

from __future__ import annotations

import pytest
import torch
from realmodel import mean
from smollm2_checks import (
    check_reload_matches_the_in_memory_model,
    check_transformers_loads_the_compressed_tensors_export,
    check_vllm_greedy_tokens_match_quantkit,
    export,
    needs_vllm,
    w4a16_and_w4a8,
)

pytestmark = pytest.mark.slow(seconds=617)  # this file's time in the suite, 2026-12-05: conftest.py orders by it
REPORT = "smollm2_per_channel"  # QUANTKIT_TEST_REPORT=DIR: DIR/smollm2_per_channel.json
GROUP = -1


@pytest.fixture(scope="module")
def results(smollm2_setup, smollm2_recorder):
    """Mean NLL on both held-out texts and the quantized model: fp, RTN and GPTQ W4A16 and W4A8, QQQ W4A8."""
    model, _, calib, _ = smollm2_setup
    return w4a16_and_w4a8(model, calib, smollm2_recorder, GROUP)


def test_gptq_costs_less_perplexity_than_rtn(results) -> None:
    """On the held-out mix that matches the calibration mix (English + Korean, 1:1); GPTQ with act-order."""
    fp = results["fp"][0]
    rtn, gptq = results[("rtn", GROUP)][0], results[("gptq", GROUP)][0]
    assert mean(gptq) < mean(rtn), (fp, rtn, gptq)


def test_qqq_smoothing_beats_plain_w4a8(results) -> None:
    """W4A8 with QQQ's smoothing beats GPTQ + int8 activations without it, which beats RTN W4A8."""
    fp = results["fp"][0]
    rtn, gptq, qqq = (results[("w4a8", method, GROUP)][0] for method in ("rtn", "gptq", "qqq"))
    assert mean(qqq) < mean(gptq) < mean(rtn), (fp, rtn, gptq, qqq)


def test_gptq_perplexity_increase_is_bounded(results) -> None:
    """exp(delta NLL) - 1 = relative perplexity increase, here below +150% per text."""
    fp, gptq = results["fp"][0], results[("gptq", GROUP)][0]
    for text in fp:
        assert gptq[text] - fp[text] < torch.log1p(torch.tensor(1.5)).item(), (text, fp[text], gptq[text])


@pytest.fixture(scope="module")
def exports(results, smollm2_setup, tmp_path_factory):
    return export(results, smollm2_setup, tmp_path_factory.mktemp("smollm2"), ["qqq-ct"])


def test_reload_matches_the_in_memory_model(results, exports, smollm2_setup) -> None:
    check_reload_matches_the_in_memory_model(results[("w4a8", "qqq", GROUP)][1], exports["qqq-ct"],
                                             smollm2_setup)


def test_transformers_loads_the_compressed_tensors_export(exports, smollm2_setup) -> None:
    check_transformers_loads_the_compressed_tensors_export(exports["qqq-ct"], smollm2_setup, w4a8=True)


@pytest.mark.vllm
@needs_vllm
def test_vllm_greedy_tokens_match_quantkit(exports, smollm2_setup, tmp_path) -> None:
    check_vllm_greedy_tokens_match_quantkit(exports["qqq-ct"], smollm2_setup, tmp_path, "qqq-ct")
