"""SmolLM2-135M in groups of 64, quantized on CPU (shared settings and checks: smollm2_checks.py).

GPTQ must raise held-out perplexity by less than RTN does and by a bounded amount; W4A8 with QQQ's smoothing
less than GPTQ W4A8, which beats RTN W4A8. The GPTQ exports (compressed-tensors, gptq) must reload, load in
transformers and in vLLM with matching greedy tokens. Per channel: test_smollm2_per_channel.py; AWQ:
test_smollm2_awq.py.
"""

from __future__ import annotations

import pytest
from smollm2_checks import (
    check_gptq_beats_rtn,
    check_gptq_increase_is_bounded,
    check_qqq_beats_plain_w4a8,
    check_reload_matches_the_in_memory_model,
    check_transformers_loads_the_compressed_tensors_export,
    check_vllm_greedy_tokens_match_quantkit,
    export,
    needs_vllm,
    w4a16_and_w4a8,
)

pytestmark = pytest.mark.slow(seconds=865)  # this file's time in the suite, 2026-12-05: conftest.py orders by it
REPORT = "smollm2_g64"  # QUANTKIT_TEST_REPORT=DIR: DIR/smollm2_g64.json
GROUP = 64
EXPORTED = ["gptq-ct", "gptq-gptq"]


@pytest.fixture(scope="module")
def results(smollm2_setup, smollm2_recorder):
    """Mean NLL on both held-out texts and the quantized model: fp, RTN and GPTQ W4A16 and W4A8, QQQ W4A8."""
    model, _, calib, _ = smollm2_setup
    return w4a16_and_w4a8(model, calib, smollm2_recorder, GROUP)


def test_gptq_costs_less_perplexity_than_rtn(results) -> None:
    """Without act-order GPTQ g64 won clearly on Korean but was slightly behind RTN on English alone (NLL 3.286 vs
    3.240, 2026-12-03; see the note in benchmarks/accuracy/RESULTS.md); with act-order it wins on both (3.142
    vs 3.240 English, 1.505 vs 1.850 Korean, 2026-12-04)."""
    check_gptq_beats_rtn(results, GROUP)


def test_qqq_smoothing_beats_plain_w4a8(results) -> None:
    check_qqq_beats_plain_w4a8(results, GROUP)


def test_gptq_perplexity_increase_is_bounded(results) -> None:
    """Below +60% per text. On the H200 with 32 x 512 calibration tokens GPTQ g64 cost +29% (English) and +16%
    (Korean) (benchmarks/README.md); this test calibrates on 16 x 256."""
    check_gptq_increase_is_bounded(results, GROUP, 0.6)


@pytest.fixture(scope="module")
def exports(results, smollm2_setup, tmp_path_factory):
    return export(results, smollm2_setup, tmp_path_factory.mktemp("smollm2"), EXPORTED)


@pytest.mark.parametrize("name", EXPORTED)
def test_reload_matches_the_in_memory_model(results, exports, smollm2_setup, name: str) -> None:
    check_reload_matches_the_in_memory_model(results[("gptq", GROUP)][1], exports[name], smollm2_setup)


def test_transformers_loads_the_compressed_tensors_export(exports, smollm2_setup) -> None:
    check_transformers_loads_the_compressed_tensors_export(exports["gptq-ct"], smollm2_setup, w4a8=False)


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("name", EXPORTED)
def test_vllm_greedy_tokens_match_quantkit(exports, smollm2_setup, tmp_path, name: str) -> None:
    check_vllm_greedy_tokens_match_quantkit(exports[name], smollm2_setup, tmp_path, name)
