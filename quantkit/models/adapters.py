"""One declarative entry per architecture: what calibration and the static-cache decoder need to know of it.

One architecture = one ArchAdapter, found by any of its config.json model_type values (get_adapter). `sequential`,
`fused` and `scaling_groups` name modules of a decoder layer; `layers` and `outer` name modules of the causal LM.
  layers          the decoder layers' nn.ModuleList.
  sequential      the order in which linears are quantized: each step's inputs are recomputed with
                  every earlier step already quantized (GPTQ's "true sequential").
  fused           linears that serving engines fuse into one GEMM (qkv, gate_up): they must share
                  one scheme (bits, group size, symmetry), and smoothing scales them together.
  scaling_groups  AWQ/QQQ smoothing: a per-channel scale s divides the output of `prev` (a norm or
                  a linear) and multiplies the input columns of `linears`; `inspect` is the module
                  whose output measures the loss (None: the linears themselves).
  norm            how `prev` norms hold their weight: "rms" (y = x̂·w), "rms_one_plus" (Gemma:
                  y = x̂·(1+w)), "layernorm" (y = x̂·w + b).
  outer           the modules outside the decoder layers (OuterModules): embeddings, final norm, lm_head,
                  rotary tables.
  decoder         how a Llama-family layer of this architecture differs from Llama's (DecoderTraits), for the
                  static-cache decoder (quantkit/eval/static_decoder.py); None: it does not run it.

To add an architecture: write one ArchAdapter in ADAPTERS below, with every model_type string of its config.json,
its decoder traits if quantkit/eval/static_decoder.py runs it, and add a random-weight model of it to
tests/test_adapters.py (which checks every name and trait against transformers' modules).

Mixture of experts: `experts` (MoeExperts) says where a layer's sparse block is, its expert count and its shared
expert. Names with "*" in `sequential`, `fused` and `scaling_groups` stand for every expert index: for_config()
expands them for a model's config (get_adapter(model) does), so each expert's linears are steps and groups of
their own. The names are those of quantkit's unfused form (quantkit/models/moe.py), which are also the names of
the checkpoints on disk and of vLLM's loaders.

What comes next extends an entry the same way, a nested frozen part per concern:
- streaming from a checkpoint: `outer` names what to load whole; the layers load one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from quantkit.qtensor import QuantizationError


@dataclass(frozen=True)
class ScalingGroup:
    prev: str
    linears: tuple[str, ...]
    inspect: str | None = None
    # v -> o is only valid when the shapes match (no GQA): checked at run time.
    requires_square: bool = False
    # modules that also read prev's output and are never quantized (an MoE router, the shared expert's gate):
    # scaled with the linears so that they compute the same, never searched or quantized
    passengers: tuple[str, ...] = ()

    @property
    def input_of(self) -> str:
        """A module whose input is the group's whole input (an expert's linears see only its routed tokens)."""
        return self.passengers[0] if self.passengers else self.linears[0]

    def expand(self, experts: int) -> tuple[ScalingGroup, ...]:
        """One group per expert when `prev` is an expert's ("*"); else the linears' "*" names expanded."""
        if "*" in self.prev:
            return tuple(replace(self, prev=self.prev.replace("*", str(e)),
                                 linears=tuple(n.replace("*", str(e)) for n in self.linears))
                         for e in range(experts))
        return (replace(self, linears=expand_names(self.linears, experts)),)


def expand_names(names: tuple[str, ...], experts: int) -> tuple[str, ...]:
    """Each name with a "*" replaced by one name per expert index, in place."""
    return tuple(n.replace("*", str(e)) if "*" in n else n
                 for n in names for e in (range(experts) if "*" in n else (0,)))


@dataclass(frozen=True)
class MoeExperts:
    """Where a decoder layer's sparse mixture-of-experts block is, and how transformers holds its experts.

    transformers 5.25 keeps every expert of these models in two fused 3-D parameters,
    `{block}.experts.gate_up_proj` [experts, 2 x intermediate, hidden] (the gate's rows first) and
    `{block}.experts.down_proj` [experts, hidden, intermediate], and the router in `{block}.gate` (a module with a
    `weight` [experts, hidden]). Checkpoints on disk and vLLM's loaders hold per-expert tensors,
    `{block}.experts.N.gate_proj` / `up_proj` / `down_proj` (Mixtral's original checkpoints: `block_sparse_moe.
    experts.N.w1` / `w3` / `w2`). quantkit/models/moe.py rewrites the block into that per-expert form
    (`fused_experts=False` below would mean transformers already holds one nn.Linear module per expert).
    The router and the shared expert's gate are never quantized.
    """

    count: str  # the config attribute holding the experts per MoE layer
    block: str = "mlp"
    fused_experts: bool = True
    shared_expert: str | None = None  # a dense MLP every token goes through (qwen2_moe, deepseek_v3)
    shared_expert_gate: str | None = None  # nn.Linear(hidden, 1): sigmoid-gates the shared expert's output
    # the block's router module computes the top-k itself, `gate(x) -> (logits, weights, indices)` (DeepSeek's
    # sigmoid scores with bias correction and group-limited top-k): kept as it is, never quantized
    router_routes: bool = False
    # Mixtral scales expert outputs by fp32 routing weights; Qwen and OLMoE first cast them to the model's dtype
    fp32_routing_weights: bool = False
    # config attributes the kept router module computes only with these values (DeepSeek-V3's noaux_tc top-k of
    # sigmoid scores): a config naming another is refused before any work
    router_settings: tuple[tuple[str, str], ...] = ()
    # (quantkit name part, checkpoint name part) pairs where on-disk checkpoints, and so vLLM's and transformers'
    # loaders, name this architecture's tensors otherwise; applied in order to every exported name
    checkpoint_names: tuple[tuple[str, str], ...] = ()

    def checkpoint_name(self, name: str, reverse: bool = False) -> str:
        """A quantkit module or tensor name as the checkpoints name it (reverse: the other way)."""
        for ours, theirs in self.checkpoint_names:
            name = name.replace(theirs, ours) if reverse else name.replace(ours, theirs)
        return name

    def is_expert_linear(self, name: str) -> bool:
        return name.startswith(f"{self.block}.experts.")


@dataclass(frozen=True)
class OuterModules:
    """The causal LM's modules outside its decoder layers, as transformers names them."""

    embeddings: tuple[str, ...]  # token embeddings first, then any learned position embeddings (OPT)
    final_norm: str
    lm_head: str = "lm_head"
    rotary: str | None = None  # the rotary tables' module (None: no rotary embedding)


@dataclass(frozen=True)
class DecoderTraits:
    """How a Llama-family decoder layer differs from Llama's (module names as in transformers)."""

    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head of q and k before the rotary embedding
    # Gemma 3: post_attention_layernorm normalizes the attention's output, pre_ / post_feedforward_layernorm the
    # MLP's input and output (elsewhere post_attention_layernorm is the MLP's input norm)
    sandwich_norms: bool = False
    rope_per_layer_type: bool = False  # Gemma 3: rotary_emb(x, positions, layer_type), a base per layer type
    slides_without_layer_types: bool = False  # Mistral: config.sliding_window (if set) applies to every layer


@dataclass(frozen=True)
class ArchAdapter:
    name: str
    model_types: tuple[str, ...]
    layers: str
    sequential: tuple[tuple[str, ...], ...]
    fused: tuple[tuple[str, ...], ...]
    scaling_groups: tuple[ScalingGroup, ...]
    outer: OuterModules
    norm: str = "rms"
    decoder: DecoderTraits | None = None
    experts: MoeExperts | None = None

    def for_config(self, config: object) -> ArchAdapter:
        """This entry with its "*" names expanded for the config's expert count (dense models: itself)."""
        if self.experts is None:
            return self
        self.check_router(config)
        count = getattr(config, self.experts.count)
        return replace(
            self,
            sequential=tuple(expand_names(step, count) for step in self.sequential),
            fused=tuple(tuple(n.replace("*", str(e)) for n in group)
                        for group in self.fused for e in (range(count) if "*" in group[0] else (0,))),
            scaling_groups=tuple(g for group in self.scaling_groups for g in group.expand(count)),
        )

    def check_router(self, config: object) -> None:
        """Refuses, in one line, a config whose router this entry does not compute (MoeExperts.router_settings)."""
        for key, value in () if self.experts is None else self.experts.router_settings:
            if getattr(config, key, value) != value:
                raise QuantizationError(f"{self.name}: the router's {key}={getattr(config, key)!r} is not covered "
                                        f"(the entry routes as {key}={value!r} only)")

    def keeping(self, unquantized: tuple[str, ...]) -> ArchAdapter:
        """This entry with the `unquantized` linears left in the model's dtype: out of the steps and fused groups;
        a smoothing group keeps them as passengers (scaled along, never quantized) and goes if none of its linears
        is left. Exports name them in their ignore lists (export.unquantized_linears)."""
        kept = set(unquantized)

        def left(names: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(n for n in names if n not in kept)

        groups = tuple(replace(g, linears=left(g.linears), passengers=(*g.passengers, *(n for n in g.linears if n in kept)))
                       for g in self.scaling_groups if left(g.linears))
        return replace(self, sequential=tuple(left(step) for step in self.sequential if left(step)),
                       fused=tuple(left(group) for group in self.fused if len(left(group)) > 1), scaling_groups=groups)

    def get_layers(self, model: nn.Module) -> nn.ModuleList:
        return model.get_submodule(self.layers)

    def linear_names(self) -> list[str]:
        return [name for step in self.sequential for name in step]

    def checkpoint_name(self, name: str, reverse: bool = False) -> str:
        """A model name as this architecture's checkpoints write it (reverse: the other way); MoE only."""
        return name if self.experts is None else self.experts.checkpoint_name(name, reverse)

    def quantized_input_widths(self, model: nn.Module) -> set[int]:
        """The input width of every linear that will be quantized, over every layer (MoE and MLA widths differ
        across layers), still-fused 3-D experts by the linears they will be unfused into."""
        widths: set[int] = set()
        for layer in self.get_layers(model):
            for name in self.linear_names():
                try:
                    widths.add(layer.get_submodule(name).in_features)
                except AttributeError:  # a linear this layer lacks (dense layers of an MoE model), or not a linear
                    pass
            widths |= self._fused_expert_widths(layer)
        return widths

    def _fused_expert_widths(self, layer: nn.Module) -> set[int]:
        if self.experts is None or not self.experts.fused_experts:
            return set()
        experts = getattr(layer.get_submodule(self.experts.block), "experts", None)
        down = getattr(experts, "down_proj", None)
        if not isinstance(down, torch.Tensor):  # unfused already: its linears are counted by name
            return set()
        return {down.shape[2], layer.get_submodule(self.experts.block).gate.weight.shape[1]}  # down reads inter


_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj")
_LLAMA_OUTER = OuterModules(embeddings=("model.embed_tokens",), final_norm="model.norm", rotary="model.rotary_emb")


def _llama_like(name: str, model_types: tuple[str, ...], decoder: DecoderTraits = DecoderTraits(),
                mlp_norm: str = "post_attention_layernorm", norm: str = "rms") -> ArchAdapter:
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
        outer=_LLAMA_OUTER,
        norm=norm,
        decoder=decoder,
    )


_OPT_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_EXPERT_GATE_UP = ("mlp.experts.*.gate_proj", "mlp.experts.*.up_proj")
# An attention's part of an entry: its sequential steps, fused groups and scaling groups.
_GQA = (
    (_ATTN, ("self_attn.o_proj",)),
    (_ATTN,),
    (ScalingGroup("input_layernorm", _ATTN, inspect="self_attn"),
     ScalingGroup("self_attn.v_proj", ("self_attn.o_proj",), requires_square=True)),
)
# Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): q through a low-rank pair with its own norm (or one q_proj
# where config.q_lora_rank is None), k and v from one compressed latent with its norm. q_a and kv_a read the layer's
# input (vLLM fuses them: fused_qkv_a_proj); each norm scales the b projection after it. o_proj reads per-head
# slices of kv_b_proj's interleaved k/v rows: no v -> o group.
_MLA_A = ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")
_MLA_Q = ("self_attn.q_proj", "self_attn.kv_a_proj_with_mqa")
_MLA = (
    (("self_attn.q_a_proj", "self_attn.q_proj", "self_attn.kv_a_proj_with_mqa"),
     ("self_attn.q_b_proj", "self_attn.kv_b_proj"), ("self_attn.o_proj",)),
    (_MLA_A, _MLA_Q),
    (ScalingGroup("input_layernorm", _MLA_A, inspect="self_attn"),
     ScalingGroup("input_layernorm", _MLA_Q, inspect="self_attn"),
     ScalingGroup("self_attn.q_a_layernorm", ("self_attn.q_b_proj",)),
     ScalingGroup("self_attn.kv_a_layernorm", ("self_attn.kv_b_proj",))),
)


# The MLA projections left in 16 bits by default: the latent ones. Measured on small random DeepSeek-V3 models
# (benchmarks/accuracy/MLA.md), keeping q_a + kv_a or kv_b removes several times more of the logits' error per
# weight kept than keeping q_b or o_proj; vLLM's MLA decode runs kv_b in 16 bits whatever the checkpoint holds
# (it dequantizes it into W_UK / W_UV), and the three are ~0.3% of a 671B model's weights.
MLA_UNQUANTIZED = ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj")


def _moe(name: str, model_types: tuple[str, ...], experts: MoeExperts,
         attention: tuple[tuple, tuple, tuple] = _GQA) -> ArchAdapter:
    """A Llama-like decoder whose MLP is a sparse MoE block (dense MLP layers, as Qwen's mlp_only_layers and
    DeepSeek's first_k_dense_replace, keep the dense names: each layer quantizes the names it has).

    Smoothing: the attention's groups (input_layernorm -> q/k/v, v -> o); the post-attention norm -> every expert's
    and the shared expert's gate/up together (the router and the shared expert's gate read the norm too: they are
    scaled along, unquantized; the loss is the whole MoE block's output); each expert's (and the shared expert's)
    up -> down on its own.
    """
    attention_steps, attention_fused, attention_groups = attention
    shared = experts.shared_expert
    shared_gate_up = () if shared is None else (f"{shared}.gate_proj", f"{shared}.up_proj")
    sparse_gate_up = (*_EXPERT_GATE_UP, *shared_gate_up)
    gate_up = (*_MLP, *sparse_gate_up)
    down = ("mlp.down_proj", "mlp.experts.*.down_proj", *(() if shared is None else (f"{shared}.down_proj",)))
    passengers = ("mlp.gate", *(() if experts.shared_expert_gate is None else (experts.shared_expert_gate,)))
    return ArchAdapter(
        name=name,
        model_types=model_types,
        layers="model.layers",
        sequential=(*attention_steps, gate_up, down),
        fused=(*attention_fused, _MLP, _EXPERT_GATE_UP, *(() if shared is None else (shared_gate_up,))),
        scaling_groups=(
            *attention_groups,
            ScalingGroup("post_attention_layernorm", _MLP, inspect="mlp"),  # dense MLP layers
            ScalingGroup("post_attention_layernorm", sparse_gate_up, inspect="mlp", passengers=passengers),
            ScalingGroup("mlp.up_proj", ("mlp.down_proj",)),
            ScalingGroup("mlp.experts.*.up_proj", ("mlp.experts.*.down_proj",)),
            *(() if shared is None else (ScalingGroup(f"{shared}.up_proj", (f"{shared}.down_proj",)),)),
        ),
        outer=_LLAMA_OUTER,
        decoder=None,
        experts=experts,
    )


# DeepSeek-V3/R1/V3.1 and Kimi-K2 (model_type kimi_k2 where its config says so): MLA attention, dense first layers,
# routed experts with one ungated shared MLP, the router kept whole (quantkit computes nothing of it); the entry keeps
# MLA_UNQUANTIZED in 16 bits (benchmarks/bench_mla_projections.py starts from every linear)
DEEPSEEK_V3_EVERY_LINEAR = _moe("deepseek_v3", ("deepseek_v3", "kimi_k2"), MoeExperts(
    count="n_routed_experts", shared_expert="mlp.shared_experts", router_routes=True, fp32_routing_weights=True,
    router_settings=(("topk_method", "noaux_tc"), ("scoring_func", "sigmoid"))), attention=_MLA)

ADAPTERS: tuple[ArchAdapter, ...] = (
    _llama_like("llama", ("llama",)),  # Llama 2/3, SmolLM2, Kanana
    _llama_like("mistral", ("mistral",), DecoderTraits(slides_without_layer_types=True)),
    _llama_like("qwen2", ("qwen2",)),
    # q_norm/k_norm act per head after the projections: calibration leaves them alone
    _llama_like("qwen3", ("qwen3",), DecoderTraits(qk_norm=True)),
    _llama_like("gemma3", ("gemma3_text", "gemma3"),
                DecoderTraits(qk_norm=True, sandwich_norms=True, rope_per_layer_type=True),
                mlp_norm="pre_feedforward_layernorm", norm="rms_one_plus"),
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
        outer=OuterModules(embeddings=("model.decoder.embed_tokens", "model.decoder.embed_positions"),
                           final_norm="model.decoder.final_layer_norm"),
        norm="layernorm",
    ),
    _moe("qwen3_moe", ("qwen3_moe",), MoeExperts(count="num_experts")),
    _moe("qwen2_moe", ("qwen2_moe",), MoeExperts(count="num_experts", shared_expert="mlp.shared_expert",
                                                 shared_expert_gate="mlp.shared_expert_gate")),
    _moe("mixtral", ("mixtral",), MoeExperts(count="num_local_experts", fp32_routing_weights=True, checkpoint_names=(
        (".mlp.", ".block_sparse_moe."), (".gate_proj", ".w1"), (".up_proj", ".w3"), (".down_proj", ".w2")))),
    _moe("olmoe", ("olmoe",), MoeExperts(count="num_experts")),
    DEEPSEEK_V3_EVERY_LINEAR.keeping(MLA_UNQUANTIZED),
)

# Architectures that look supported but need what no entry can say yet: refused with the reason.
REFUSED: dict[str, str] = {
    "deepseek_v32": "DeepSeek-V3.2's sparse attention (its lightning indexer and top-k key selection) has no entry; "
                    "the deepseek_v3 entry covers dense MLA only",
    "deepseek_v2": "DeepSeek-V2's softmax router (topk_method greedy / group_limited_greedy) has no entry; the "
                   "deepseek_v3 entry covers the sigmoid noaux_tc router only",
    "kimi_k25": "Kimi-K2.5 is a vision-language model; only its text form (model_type kimi_k2 / deepseek_v3) has an "
                "entry",
}


_BY_MODEL_TYPE = {model_type: adapter for adapter in ADAPTERS for model_type in adapter.model_types}


def supported_model_types(decoder: bool = False) -> list[str]:
    """The model_type values with an entry (decoder: only those the static-cache decoder runs)."""
    return sorted(t for t, adapter in _BY_MODEL_TYPE.items() if not decoder or adapter.decoder is not None)


def find_adapter(model_type: str) -> ArchAdapter | None:
    return _BY_MODEL_TYPE.get(model_type)


def get_adapter(model_or_type: nn.Module | str) -> ArchAdapter:
    """The entry of a model_type; for a model, expanded for its config (MoE: one name per expert)."""
    model_type = model_or_type if isinstance(model_or_type, str) else model_or_type.config.model_type
    adapter = find_adapter(model_type)
    if adapter is not None:
        return adapter if isinstance(model_or_type, str) else adapter.for_config(model_or_type.config)
    if model_type in REFUSED:
        raise QuantizationError(f"unsupported architecture {model_type!r}: {REFUSED[model_type]}")
    raise QuantizationError(
        f"unsupported architecture {model_type!r}. Supported model_type values: "
        f"{', '.join(supported_model_types())}. To add one, write an ArchAdapter entry in "
        "quantkit/models/adapters.py (its module docstring says how) and a random-weight test in "
        "tests/test_adapters.py."
    )
