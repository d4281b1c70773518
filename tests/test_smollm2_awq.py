"""SmolLM2-135M with AWQ, quantized on CPU (shared settings and checks: smollm2_checks.py).

AWQ must raise held-out perplexity by no more than RTN in AWQ's scheme (asymmetric groups of 64), and by a
bounded amount; its exports (awq, compressed-tensors) must reload, load in transformers and in vLLM with
matching greedy tokens.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from realmodel import mean
from smollm2_checks import (
    AWQ,
    check_reload_matches_the_in_memory_model,
    check_transformers_loads_the_compressed_tensors_export,
    check_vllm_greedy_tokens_match_quantkit,
    export,
    needs_vllm,
)

pytestmark = pytest.mark.slow(seconds=288)  # this file's time in the suite, 2026-12-05: conftest.py orders by it
REPORT = "smollm2_awq"  # QUANTKIT_TEST_REPORT=DIR: DIR/smollm2_awq.json
EXPORTED = ["awq-awq", "awq-ct"]


@pytest.fixture(scope="module")
def results(smollm2_setup, smollm2_recorder):
    """fp, then RTN and AWQ in AWQ's scheme: (mean NLL on both held-out texts, the model)."""
    model, _, calib, _ = smollm2_setup
    out = {"fp": (smollm2_recorder.nll(model, "fp32"), model)}
    for method in ("rtn", "awq"):
        out[method] = smollm2_recorder.quantized(model, calib, replace(AWQ, method=method))
    return out


def test_awq_costs_no_more_perplexity_than_rtn(results) -> None:
    fp, rtn, awq = results["fp"][0], results["rtn"][0], results["awq"][0]
    assert mean(awq) <= mean(rtn), (fp, rtn, awq)
    assert mean(awq) - mean(fp) < torch.log1p(torch.tensor(0.6)).item(), (fp, awq)


@pytest.fixture(scope="module")
def exports(results, smollm2_setup, tmp_path_factory):
    return export(results, smollm2_setup, tmp_path_factory.mktemp("smollm2"), EXPORTED)


@pytest.mark.parametrize("name", EXPORTED)
def test_reload_matches_the_in_memory_model(results, exports, smollm2_setup, name: str) -> None:
    check_reload_matches_the_in_memory_model(results["awq"][1], exports[name], smollm2_setup)


def test_transformers_loads_the_compressed_tensors_export(exports, smollm2_setup) -> None:
    check_transformers_loads_the_compressed_tensors_export(exports["awq-ct"], smollm2_setup, w4a8=False)


@pytest.mark.vllm
@needs_vllm
def test_vllm_greedy_tokens_match_quantkit(exports, smollm2_setup, tmp_path) -> None:
    check_vllm_greedy_tokens_match_quantkit(exports["awq-awq"], smollm2_setup, tmp_path, "awq-awq")
