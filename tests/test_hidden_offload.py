"""Calibration hidden states on the device, in host memory or on disk (quantkit.streaming.hidden): the
placement follows the free memory, and all three give the same export bytes."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from test_streaming import CONFIGS, FORMATS, _checkpoint, _digest, _streamed

import quantkit.streaming.hidden as hidden
from quantkit.preflight import check_quantize_request, estimate_hidden_state_bytes
from quantkit.qtensor import QuantizationError

GIB = 2**30


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("src") / "llama")


@pytest.mark.parametrize("method", ["gptq", "qqq"])  # qqq also indexes ctx.inputs
def test_three_placements_give_the_same_bytes(sharded, tmp_path, single_thread, monkeypatch, caplog,
                                              method: str) -> None:
    digests = {}
    for placement in hidden.PLACEMENTS:
        monkeypatch.setattr(hidden, "choose_placement", lambda *_a, p=placement: p)
        offload = tmp_path / f"offload-{placement}"
        with caplog.at_level(logging.INFO, logger="quantkit"):
            out, _ = _streamed(sharded, CONFIGS[method], FORMATS[method], tmp_path / placement, offload_dir=offload)
        digests[placement] = _digest(out)
        if placement == "disk":
            assert offload.is_dir() and not any(offload.iterdir())  # the memory-mapped files are removed
    assert digests["host"] == digests["device"] and digests["disk"] == digests["device"]
    assert f"on {tmp_path / 'offload-disk'}" in caplog.text and "on host memory" in caplog.text


def test_disk_store_round_trips_and_recycles_its_files(tmp_path) -> None:
    with hidden.HiddenStore("disk", torch.device("cpu"), tmp_path) as store:
        first = [torch.randn(2, 5, 8, dtype=torch.bfloat16) for _ in range(3)]
        held = store.hold(first)
        assert [torch.equal(a, b) for a, b in zip(held, first, strict=True)] == [True] * 3
        assert torch.equal(held[-1], first[-1]) and len(held[:2]) == 2
        files = sorted(tmp_path.rglob("*.bin"))
        assert [f.stat().st_size for f in files] == [2 * 5 * 8 * 2] * 3
        held.release()
        second = store.hold([torch.randn(2, 5, 8, dtype=torch.bfloat16) for _ in range(3)])
        assert sorted(tmp_path.rglob("*.bin")) == files  # the next layer's outputs reuse the files
        assert len(second) == 3
    assert not list(tmp_path.rglob("*.bin"))


@pytest.mark.parametrize(("device_free", "host_free", "offload", "expected"), [
    (40 * GIB, 100 * GIB, None, "device"),  # 2 x 8 GiB + 3 x 2 GiB + reserve fits in 40
    (20 * GIB, 100 * GIB, None, "host"),
    (20 * GIB, 100 * GIB, "dir", "host"),
    (20 * GIB, 10 * GIB, "dir", "disk"),
    (20 * GIB, 10 * GIB, None, "host"),  # nowhere else allowed: host, and the OS may swap
])
def test_placement_follows_free_memory(monkeypatch, device_free: int, host_free: int, offload: str | None,
                                       expected: str) -> None:
    monkeypatch.setattr(hidden, "device_available", lambda _d: device_free)
    monkeypatch.setattr(hidden, "host_available", lambda: host_free)
    states, layer = 8 * GIB, 2 * GIB
    assert hidden.choose_placement(states, layer, torch.device("cuda"), offload and Path(offload)) == expected


def test_cpu_work_device_spills_to_disk_only_when_asked(monkeypatch) -> None:
    monkeypatch.setattr(hidden, "host_available", lambda: GIB)
    assert hidden.choose_placement(GIB, 0, torch.device("cpu"), None) == "device"
    assert hidden.choose_placement(GIB, 0, torch.device("cpu"), Path("x")) == "disk"


def _request(source: Path, tmp_path: Path, offload_dir: Path) -> None:
    check_quantize_request(source=str(source), calib=None, output=tmp_path / "out", overwrite=False, nsamples=4,
                           seqlen=64, batch_size=1, eval_windows=None, dtype="auto", bits=4, offload_dir=offload_dir)


def test_offload_dir_checked_before_loading(sharded, tmp_path, monkeypatch) -> None:
    assert estimate_hidden_state_bytes(sharded, 4, 64) == 2 * 4 * 64 * 64 * 4  # hidden 64, fp32
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(QuantizationError, match="--offload-dir .* is an existing file"):
        _request(sharded, tmp_path, a_file)
    monkeypatch.setattr("quantkit.preflight.estimate_hidden_state_bytes", lambda *_a: 2**60)
    with pytest.raises(QuantizationError, match="calibration hidden states in .* needs about"):
        _request(sharded, tmp_path, tmp_path / "offload")
