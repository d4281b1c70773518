"""Declarative per-architecture entries: where the decoder layers are and how their linears group.

One architecture = one ArchAdapter. Module names are relative to a decoder layer.
  sequential      the order in which linears are quantized: each step's inputs are recomputed with
                  every earlier step already quantized (GPTQ's "true sequential").
  fused           linears that serving engines fuse into one GEMM (qkv, gate_up): they must share
                  one scheme (bits, group size, symmetry), and smoothing scales them together.
  scaling_groups  AWQ/QQQ smoothing: a per-channel scale s divides the output of `prev` (a norm or
                  a linear) and multiplies the input columns of `linears`; `inspect` is the module
                  whose output measures the loss (None: the linears themselves).
  norm            how `prev` norms hold their weight: "rms" (y = x̂·w), "rms_one_plus" (Gemma:
                  y = x̂·(1+w)), "layernorm" (y = x̂·w + b).

To add an architecture: write one ArchAdapter below, with the model_type strings of its
config.json, and add a random-weight model of it to tests/test_adapters.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from quantkit.qtensor import QuantizationError


@dataclass(frozen=True)
class ScalingGroup:
    prev: str
    linears: tuple[str, ...]
    inspect: str | None = None
    # v -> o is only valid when the shapes match (no GQA): checked at run time.
    requires_square: bool = False


@dataclass(frozen=True)
class ArchAdapter:
    name: str
    model_types: tuple[str, ...]
    layers: str
    sequential: tuple[tuple[str, ...], ...]
    fused: tuple[tuple[str, ...], ...]
    scaling_groups: tuple[ScalingGroup, ...]
    norm: str = "rms"

    def get_layers(self, model: nn.Module) -> nn.ModuleList:
        return model.get_submodule(self.layers)

    def linear_names(self) -> list[str]:
        return [name for step in self.sequential for name in step]


_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj")


def _llama_like(name: str, model_types: tuple[str, ...], mlp_norm: str = "post_attention_layernorm",
                norm: str = "rms") -> ArchAdapter:
    return ArchAdapter(
        name=name,
        model_types=model_types,
        layers="model.layers",
        sequential=(_ATTN, ("self_attn.o_proj",), _MLP, ("mlp.down_proj",)),
        fused=(_ATTN, _MLP),
        scaling_groups=(
            ScalingGroup("input_layernorm", _ATTN, inspect="self_attn"),
            ScalingGroup("self_attn.v_proj", ("self_attn.o_proj",), requires_square=True),
            ScalingGroup(mlp_norm, _MLP, inspect="mlp"),
            ScalingGroup("mlp.up_proj", ("mlp.down_proj",)),
        ),
        norm=norm,
    )


_OPT_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")

ADAPTERS: tuple[ArchAdapter, ...] = (
    _llama_like("llama", ("llama",)),  # Llama 2/3, SmolLM2, Kanana
    _llama_like("mistral", ("mistral",)),
    _llama_like("qwen2", ("qwen2",)),
    _llama_like("qwen3", ("qwen3",)),  # q_norm/k_norm act per head after the projections: not touched
    _llama_like("gemma3", ("gemma3_text", "gemma3"), mlp_norm="pre_feedforward_layernorm", norm="rms_one_plus"),
    ArchAdapter(
        name="opt",
        model_types=("opt",),
        layers="model.decoder.layers",
        sequential=(_OPT_ATTN, ("self_attn.out_proj",), ("fc1",), ("fc2",)),
        fused=(_OPT_ATTN,),
        scaling_groups=(
            ScalingGroup("self_attn_layer_norm", _OPT_ATTN, inspect="self_attn"),
            ScalingGroup("self_attn.v_proj", ("self_attn.out_proj",), requires_square=True),
            ScalingGroup("final_layer_norm", ("fc1",)),
            ScalingGroup("fc1", ("fc2",)),
        ),
        norm="layernorm",
    ),
)


def supported_model_types() -> list[str]:
    return sorted(t for a in ADAPTERS for t in a.model_types)


def get_adapter(model_or_type: nn.Module | str) -> ArchAdapter:
    model_type = model_or_type if isinstance(model_or_type, str) else model_or_type.config.model_type
    for adapter in ADAPTERS:
        if model_type in adapter.model_types:
            return adapter
    raise QuantizationError(
        f"unsupported architecture {model_type!r}. Supported model_type values: "
        f"{', '.join(supported_model_types())}. To add one, write an ArchAdapter entry in "
        "quantkit/models/adapters.py (decoder-layer path, sequential linear groups, fused groups, "
        "scaling groups) and a random-weight test in tests/test_adapters.py."
    )
