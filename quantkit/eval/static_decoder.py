"""Greedy decoding with a static KV cache, every step a fixed-shape computation that one CUDA graph can capture
(gpt-fast's recipe): how fast a quantized model runs end to end on quantkit's kernels (`quantkit eval --speed`,
benchmarks/bench_e2e.py). It runs the architectures whose entry in quantkit/models/adapters.py has decoder traits.

It runs the Hugging Face model's own modules (embeddings, norms, rotary tables, activation, and its linears:
nn.Linear or QuantLinear, whose kernels serve on CUDA) in the order of a Llama-family decoder layer, with q/k/v and
gate/up each fused into one linear as serving engines fuse them, and its own attention over the static cache:
- the cache holds [batch, kv_heads, max_len, head_dim] per layer, written at the step's positions (index_copy_);
- the query heads sharing a kv head attend as one block of rows: no copy of the cache per query head (at long
  contexts those copies would move more bytes than a 4-bit layer's weights);
- the mask admits cache positions up to each query's (and, in a sliding-window layer, past position - window),
  so a step's shapes never change; a decode step (at most 64 query rows per kv head, 32 with heads of 256) runs
  quantkit's split-cache kernel (kernels/decode_attention.py), which reads the cache only up to the step's
  positions (and from its window's start), longer steps (prefill) SDPA over the whole cache.
Batch rows share their positions (prompts of equal length, the benchmark's case).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.kernels import decode_attention_for, decode_attention_rows
from quantkit.models.adapters import ArchAdapter, DecoderTraits, find_adapter, supported_model_types
from quantkit.nn.qlinear import QuantLinear
from quantkit.qtensor import QuantizationError


def layer_types(config, traits: DecoderTraits) -> list[str]:
    """Each decoder layer's attention, "full_attention" or "sliding_attention", as transformers masks it."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    slides = traits.slides_without_layer_types and getattr(config, "sliding_window", None) is not None
    return ["sliding_attention" if slides else "full_attention"] * config.num_hidden_layers


def decoder_adapter(config) -> ArchAdapter:
    """The architecture entry of a model StaticDecoder runs (one with decoder traits); a clear error otherwise."""
    adapter = find_adapter(config.model_type)
    if adapter is None or adapter.decoder is None:
        raise QuantizationError(f"StaticDecoder runs model_type {', '.join(supported_model_types(decoder=True))}, "
                                f"not {config.model_type!r}")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise QuantizationError("StaticDecoder does not soft-cap attention logits (config.attn_logit_softcapping)")
    if getattr(config, "use_bidirectional_attention", False):
        raise QuantizationError("StaticDecoder runs causal attention, not config.use_bidirectional_attention")
    return adapter


def fuse_linears(linears: list[nn.Module]) -> nn.Module:
    """One linear whose output is the given linears' outputs side by side (q/k/v, gate/up). nn.Linear sources keep
    their parameters as views of the fused ones (fusing a 16-bit model costs no memory); QuantLinear sources drop
    their kernel forward and the GPU copy of the weight it holds (they compute on the reference path until their
    prepare_kernels() runs again, or the model moves): the GPU holds the fused layer's copy alone."""
    if all(isinstance(linear, QuantLinear) for linear in linears):
        fused = QuantLinear.concatenated(linears)
        for linear in linears:
            linear.release_kernels()
        return fused
    if not all(type(linear) is nn.Linear for linear in linears):
        raise ValueError(f"cannot fuse {sorted({type(linear).__name__ for linear in linears})}: all nn.Linear or "
                         "all QuantLinear")
    with torch.no_grad():
        weight = torch.cat([linear.weight for linear in linears])
        fused = nn.Linear(weight.shape[1], weight.shape[0], bias=any(linear.bias is not None for linear in linears),
                          device="meta")
        fused.weight = nn.Parameter(weight, requires_grad=False)
        if fused.bias is not None:
            fused.bias = nn.Parameter(torch.cat([linear.bias if linear.bias is not None else
                                                 weight.new_zeros(linear.out_features) for linear in linears]),
                                      requires_grad=False)
        start = 0
        for linear in linears:
            rows = slice(start, start + linear.out_features)
            linear.weight.data = fused.weight.data[rows]
            if linear.bias is not None:
                linear.bias.data = fused.bias.data[rows]
            start = rows.stop
    return fused


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class _Layer:
    """One decoder layer's modules, q/k/v and gate/up fused, its rotary tables [max_len, head_dim] and its sliding
    window (None: the layer attends to every earlier position of the cache)."""

    def __init__(self, layer: nn.Module, traits: DecoderTraits, rotary: tuple[torch.Tensor, torch.Tensor],
                 window: int | None) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.attention_norm = layer.input_layernorm
        self.attention_out_norm, self.mlp_out_norm = nn.Identity(), nn.Identity()
        self.mlp_norm = layer.post_attention_layernorm
        if traits.sandwich_norms:
            self.attention_out_norm, self.mlp_norm = layer.post_attention_layernorm, layer.pre_feedforward_layernorm
            self.mlp_out_norm = layer.post_feedforward_layernorm
        self.qkv = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o, self.down = attn.o_proj, mlp.down_proj
        self.gate_up = fuse_linears([mlp.gate_proj, mlp.up_proj])
        self.act = mlp.act_fn
        self.q_norm, self.k_norm = (attn.q_norm, attn.k_norm) if traits.qk_norm else (None, None)
        self.scaling = attn.scaling
        self.cos, self.sin = rotary
        self.window = window


class StaticDecoder:
    """A Llama-family causal LM as fixed-shape steps over a static KV cache of batch_size x max_len tokens."""

    def __init__(self, model: nn.Module, batch_size: int, max_len: int) -> None:
        config = model.config
        adapter = decoder_adapter(config)
        traits, outer = adapter.decoder, adapter.outer
        self.embed = model.get_submodule(outer.embeddings[0])
        self.norm, self.lm_head = model.get_submodule(outer.final_norm), model.get_submodule(outer.lm_head)
        rotary_emb = model.get_submodule(outer.rotary)
        self.logit_cap = getattr(config, "final_logit_softcapping", None)
        weight = self.embed.weight
        self.slots = torch.arange(max_len, device=weight.device)
        kinds = layer_types(config, traits)
        rotary = {}  # layer type -> (cos, sin) [max_len, head_dim], the model's dtype: as transformers applies them
        for kind in set(kinds):
            cos, sin = rotary_emb(weight[:1], self.slots[None], *([kind] if traits.rope_per_layer_type else []))
            rotary[kind] = cos[0], sin[0]
        window = getattr(config, "sliding_window", None)
        if window is not None and window >= max_len:
            window = None  # it masks nothing: sliding layers attend (and run the kernel) as full ones
        self.layers = [_Layer(layer, traits, rotary[kind], window if kind == "sliding_attention" else None)
                       for layer, kind in zip(adapter.get_layers(model), kinds, strict=True)]
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.max_len = max_len
        self.decode_attention = decode_attention_for(weight.device, self.head_dim)
        self.new_cache(batch_size)

    def new_cache(self, batch_size: int) -> None:
        """An empty cache for batch_size sequences (the fused linears stay)."""
        self.batch_size = batch_size
        self.cache = []  # the old cache's memory is free before the new one takes its own
        shape = (batch_size, self.kv_heads, self.max_len, self.head_dim)
        weight = self.embed.weight
        self.cache = [(weight.new_zeros(shape), weight.new_zeros(shape)) for _ in self.layers]

    def linears(self) -> list[nn.Module]:
        """The decoder layers' linears as this decoder runs them (q/k/v and gate/up fused)."""
        return [linear for layer in self.layers for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    def _masks(self, positions: torch.Tensor, tokens: int) -> dict[int | None, torch.Tensor | None]:
        """Per window of the layers (None: full attention) the SDPA mask [group * tokens, max_len] of the step at
        `positions` (rows: query head of the group, then token), or None for all when the decode attention kernel
        attends (it masks by positions and window itself)."""
        group = self.heads // self.kv_heads
        windows = {layer.window for layer in self.layers}
        if self.decode_attention is not None and group * tokens <= decode_attention_rows(self.head_dim):
            return dict.fromkeys(windows)
        masks = {}
        for window in windows:
            mask = self.slots[None] <= positions[:, None]
            if window is not None:  # transformers' sliding window: key position > query position - window
                mask = mask & (self.slots[None] > positions[:, None] - window)
            masks[window] = mask.repeat(group, 1)
        return masks

    def _attention(self, layer: _Layer, x: torch.Tensor, positions: torch.Tensor, index: int,
                   mask: torch.Tensor | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = layer.qkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q, k = q.view(batch, tokens, self.heads, self.head_dim), k.view(batch, tokens, self.kv_heads, self.head_dim)
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        cos, sin = layer.cos[positions], layer.sin[positions]  # [tokens, head_dim]
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        cache_k, cache_v = self.cache[index]
        cache_k.index_copy_(2, positions, k)
        cache_v.index_copy_(2, positions, v.view(batch, tokens, self.kv_heads, self.head_dim).transpose(1, 2))
        group = self.heads // self.kv_heads  # query head h reads kv head h // group (transformers' repeat_kv)
        q = q.reshape(batch, self.kv_heads, group * tokens, self.head_dim)
        if mask is None:
            out = self.decode_attention(q, cache_k, cache_v, positions, layer.scaling, layer.window or 0)
        else:
            out = F.scaled_dot_product_attention(q, cache_k, cache_v, attn_mask=mask, scale=layer.scaling)
        out = out.view(batch, self.heads, tokens, self.head_dim).transpose(1, 2).reshape(batch, tokens, q_size)
        return layer.o(out)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Logits [batch, tokens (1 if last_only), vocab] of ids [batch, tokens] at cache positions [tokens],
        whose keys and values it writes into the cache. No host synchronisation: a CUDA graph can capture it."""
        masks = self._masks(positions, ids.shape[1])
        h = self.embed(ids)
        for index, layer in enumerate(self.layers):
            attention = self._attention(layer, layer.attention_norm(h), positions, index, masks[layer.window])
            h = h + layer.attention_out_norm(attention)
            gate, up = layer.gate_up(layer.mlp_norm(h)).chunk(2, dim=-1)
            h = h + layer.mlp_out_norm(layer.down(layer.act(gate) * up))
        if last_only:
            h = h[:, -1:]
        logits = self.lm_head(self.norm(h))
        if self.logit_cap is not None:  # Gemma 2 / 3 configs may soft-cap the final logits
            logits = torch.tanh(logits / self.logit_cap) * self.logit_cap
        return logits

    def generate(self, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """Greedy continuation [batch, new_tokens] of the prompts ids [batch, tokens] (eager steps)."""
        batch, tokens = ids.shape
        if batch != self.batch_size or tokens + new_tokens > self.max_len:
            raise ValueError(f"{batch} prompts of {tokens} tokens + {new_tokens} new do not fit the cache of "
                             f"{self.batch_size} x {self.max_len}")
        out = []
        logits = self(ids, torch.arange(tokens, device=ids.device), last_only=True)
        for step in range(new_tokens):
            out.append(logits[:, -1].argmax(dim=-1, keepdim=True))
            if step + 1 < new_tokens:
                logits = self(out[-1], torch.tensor([tokens + step], device=ids.device))
        return torch.cat(out, dim=1)
