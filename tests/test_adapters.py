"""Architecture adapters: every entry names real modules of its architecture, unknown ones fail clearly."""

from __future__ import annotations

import inspect

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
from quantkit.models.adapters import supported_model_types
from quantkit.qtensor import QuantizationError

KINDS = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "opt"]
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


@pytest.mark.parametrize("kind", KINDS)
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
    outer = adapter.outer
    assert model.get_submodule(outer.embeddings[0]) is model.get_input_embeddings()
    assert model.get_submodule(outer.lm_head) is model.get_output_embeddings()
    for name in (*outer.embeddings[1:], outer.final_norm):
        model.get_submodule(name)
    rotaries = [name for name, module in model.named_modules() if "Rotary" in type(module).__name__]
    assert rotaries == ([outer.rotary] if outer.rotary else [])


@pytest.mark.parametrize("kind", KINDS)
def test_decoder_traits_agree_with_transformers_modules(kind: str) -> None:
    """Each trait against what transformers builds for the architecture (None: OPT, not a Llama-family layer)."""
    model = tiny_model(kind)
    adapter, config = get_adapter(model), model.config
    traits = adapter.decoder
    if traits is None:
        assert kind == "opt"
        return
    layer, rotary = adapter.get_layers(model)[0], model.get_submodule(adapter.outer.rotary)
    assert traits.qk_norm == hasattr(layer.self_attn, "q_norm") == hasattr(layer.self_attn, "k_norm")
    assert traits.sandwich_norms == hasattr(layer, "pre_feedforward_layernorm") == hasattr(
        layer, "post_feedforward_layernorm")
    assert traits.rope_per_layer_type == ("layer_type" in inspect.signature(rotary.forward).parameters)
    assert traits.slides_without_layer_types == (hasattr(config, "sliding_window")
                                                 and not hasattr(config, "layer_types"))


def test_every_model_type_resolves_to_its_entry() -> None:
    """Aliases included (Gemma 3: "gemma3_text", what Gemma3TextConfig says, and "gemma3"); the decoder's list is
    the entries with decoder traits."""
    for adapter in ADAPTERS:
        for model_type in adapter.model_types:
            assert get_adapter(model_type) is adapter
    assert get_adapter("gemma3") is get_adapter(tiny_model("gemma3"))
    assert supported_model_types() == sorted(t for a in ADAPTERS for t in a.model_types)
    assert supported_model_types(decoder=True) == ["gemma3", "gemma3_text", "llama", "mistral", "qwen2", "qwen3"]


def test_every_adapter_has_distinct_model_types() -> None:
    types = [t for a in ADAPTERS for t in a.model_types]
    assert len(types) == len(set(types))


def test_unsupported_architecture_lists_supported_ones() -> None:
    with pytest.raises(QuantizationError) as err:
        get_adapter("gpt_bigcode")
    message = str(err.value)
    assert "gpt_bigcode" in message and "llama" in message and "qwen3" in message
    assert "adapters.py" in message  # how to add one
