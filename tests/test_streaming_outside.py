"""The tensors outside the decoder layers while streaming (issue #29): real for the calibration capture,
on the meta device during the layers, re-read from the checkpoint for the export exactly as first loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_engine import random_calibration
from test_streaming import CONFIGS, _checkpoint

from quantkit.models import get_adapter
from quantkit.streaming import StreamedRun, open_streamed_model, quantize_streaming
from quantkit.streaming.skeleton import read_outside_tensor, release_outside_layers


def _outside(model) -> dict[str, torch.Tensor]:
    prefix = get_adapter(model).layers + "."
    return {n: t for n, t in model.state_dict(keep_vars=True).items() if not n.startswith(prefix)}


@pytest.mark.parametrize("tied", [False, True])
def test_released_then_read_back_as_loaded(tmp_path: Path, tied: bool) -> None:
    model, ckpt = open_streamed_model(str(_checkpoint(tmp_path / "src", tied=tied)), torch.float32)
    model.model.register_buffer("computed", torch.arange(3.0))  # persistent, not in the checkpoint: it stays
    loaded = {n: t.detach().clone() for n, t in _outside(model).items()}
    release_outside_layers(model, get_adapter(model), ckpt)
    outside = _outside(model)
    assert [n for n, t in outside.items() if not t.is_meta] == ["model.computed"]
    assert (outside["lm_head.weight"] is outside["model.embed_tokens.weight"]) == tied
    for name, expected in loaded.items():
        value = read_outside_tensor(model, ckpt, name)
        assert value.dtype == expected.dtype == torch.float32 and torch.equal(value, expected), name


def test_outside_tensors_released_while_the_layers_run(tmp_path: Path, single_thread) -> None:
    model, ckpt = open_streamed_model(str(_checkpoint(tmp_path / "src")), torch.float32)
    seen: list[bool] = []
    layer = get_adapter(model).get_layers(model)[0]
    handle = layer.register_forward_pre_hook(
        lambda *_: seen.append(model.get_input_embeddings().weight.is_meta))
    quantize_streaming(model, ckpt, None, random_calibration(),
                       StreamedRun(CONFIGS["gptq"], "gptq", tmp_path / "out", dtype="float16", device="cpu",
                                   show_progress=False))
    handle.remove()
    assert seen and all(seen)
