"""Folding smoothing scales without quantization must leave the model's function unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
from test_adapters import tiny_model

from quantkit.models import get_adapter
from quantkit.smoothing import active_scaling_groups, fold_scales


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral", "gemma3", "opt"])
def test_folding_random_scales_keeps_logits(kind: str) -> None:
    model = tiny_model(kind).double()
    for p in model.parameters():  # non-trivial norms and biases, so wrong handling shows
        if p.dim() == 1:
            torch.nn.init.uniform_(p, 0.5, 1.5)
    reference = copy.deepcopy(model)
    adapter = get_adapter(model)
    gen = torch.Generator().manual_seed(0)
    for layer in adapter.get_layers(model):
        for group in active_scaling_groups(layer, adapter):
            width = layer.get_submodule(group.linears[0]).in_features
            fold_scales(layer, adapter, group, torch.rand(width, generator=gen, dtype=torch.float64) * 4 + 0.1)
    ids = torch.randint(0, 128, (2, 16), generator=gen)
    out, ref = model(ids).logits, reference(ids).logits
    # float64 model; Gemma's RMSNorm computes in fp32 internally, hence 1e-6 rather than 1e-12
    assert ((out - ref).norm() / ref.norm()).item() < 1e-6


def test_v_to_o_skipped_under_grouped_query_attention() -> None:
    model = tiny_model("llama")  # 4 heads, 2 kv heads
    adapter = get_adapter(model)
    names = [g.prev for g in active_scaling_groups(adapter.get_layers(model)[0], adapter)]
    assert "self_attn.v_proj" not in names and "mlp.up_proj" in names
