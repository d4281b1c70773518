"""SmolLM2-135M (real weights) with AWQ at its defaults in AWQ's own scheme (asymmetric groups of 64), against RTN
in the same scheme, quantized on CPU.

Asserted: AWQ costs less held-out perplexity than RTN of its kind (a margin several times its spread over three
calibration seeds at this file's 8 x 128 calibration tokens: benchmarks/accuracy/SEEDS_SMOLLM2_AWQ.md), its scale
search never ends above the identity, and its exports
(awq, compressed-tensors) reload to the in-memory model and load in transformers. vLLM's view of an AWQ export:
test_vllm_formats.py.
"""

from __future__ import annotations

import pytest
from export_checks import (
    check_reload_matches_the_in_memory_model,
    check_transformers_loads_the_compressed_tensors_export,
    export,
)
from realmodel import check_scale_search_never_above_the_identity, mean

from quantkit.config import QuantConfig

pytestmark = pytest.mark.slow(seconds=120)  # this file's time in the suite, 2026-12-07: conftest.py orders by it
REPORT = "smollm2_awq"  # QUANTKIT_TEST_REPORT=DIR: DIR/smollm2_awq.json
CALIBRATION_SAMPLES = 8  # of 128 tokens (conftest.smollm2_setup): AWQ's search is most of the file's time
AWQ = QuantConfig(method="awq", group_size=64, sym=False)
RTN = QuantConfig(method="rtn", group_size=64, sym=False)
EXPORTED = ["awq", "compressed-tensors"]


def test_awq_costs_less_perplexity_than_rtn(smollm2_runs) -> None:
    """Mean NLL of both texts; SEEDS_SMOLLM2_AWQ.md: margin 0.099-0.128, 3.3x its spread over three seeds."""
    fp, rtn, awq = smollm2_runs.fp.nll, smollm2_runs[RTN].nll, smollm2_runs[AWQ].nll
    assert mean(awq) < mean(rtn), (fp, rtn, awq)


def test_scale_search_never_ends_above_the_identity(smollm2_runs) -> None:
    check_scale_search_never_above_the_identity(smollm2_runs[AWQ].report)


@pytest.fixture(scope="module")
def exports(smollm2_runs, smollm2_setup, tmp_path_factory):
    return export(smollm2_runs[AWQ].model, AWQ, smollm2_setup, tmp_path_factory.mktemp("smollm2"), EXPORTED)


@pytest.mark.parametrize("fmt", EXPORTED)
def test_reload_matches_the_in_memory_model(smollm2_runs, exports, smollm2_setup, fmt: str) -> None:
    check_reload_matches_the_in_memory_model(smollm2_runs[AWQ].model, exports[fmt], smollm2_setup)


def test_transformers_loads_the_compressed_tensors_export(exports, smollm2_setup) -> None:
    check_transformers_loads_the_compressed_tensors_export(exports["compressed-tensors"], smollm2_setup, w4a8=False)
