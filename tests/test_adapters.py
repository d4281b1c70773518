"""Architecture adapters: every entry names real modules of its architecture, unknown ones fail clearly."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    Qwen2Config,
    Qwen3Config,
)

from quantkit.models import ADAPTERS, get_adapter
from quantkit.qtensor import QuantizationError

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)


def tiny_model(kind: str) -> nn.Module:
    configs = {
        "llama": lambda: LlamaConfig(**TINY),
        "mistral": lambda: MistralConfig(**TINY),
        "qwen2": lambda: Qwen2Config(**TINY),
        "qwen3": lambda: Qwen3Config(**TINY, head_dim=16),
        "gemma3": lambda: Gemma3TextConfig(**TINY, head_dim=16, sliding_window=8),
        "opt": lambda: OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                                 vocab_size=128, max_position_embeddings=256, word_embed_proj_dim=64),
    }
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(configs[kind]()).eval()


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "gemma3", "opt"])
def test_adapter_names_exist(kind: str) -> None:
    model = tiny_model(kind)
    adapter = get_adapter(model)
    layers = adapter.get_layers(model)
    assert len(layers) == 2
    layer = layers[0]
    for name in adapter.linear_names():
        assert isinstance(layer.get_submodule(name), nn.Linear), name
    for group in adapter.scaling_groups:
        assert layer.get_submodule(group.prev) is not None
        if group.inspect:
            layer.get_submodule(group.inspect)
    # every linear of a decoder layer is covered by the sequential steps
    linears = {n for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
    assert linears == set(adapter.linear_names())


def test_every_adapter_has_distinct_model_types() -> None:
    types = [t for a in ADAPTERS for t in a.model_types]
    assert len(types) == len(set(types))


def test_unsupported_architecture_lists_supported_ones() -> None:
    with pytest.raises(QuantizationError) as err:
        get_adapter("gpt_bigcode")
    message = str(err.value)
    assert "gpt_bigcode" in message and "llama" in message and "qwen3" in message
    assert "adapters.py" in message  # how to add one
