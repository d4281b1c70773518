"""Greedy decoding with a static KV cache, every step a fixed-shape computation that one CUDA graph can capture
(gpt-fast's recipe): how fast a quantized model runs end to end on quantkit's kernels (benchmarks/bench_e2e.py).

It runs the Hugging Face model's own modules (embeddings, norms, rotary tables, activation, and its linears:
nn.Linear or QuantLinear, whose kernels serve on CUDA) in the order of a Llama-family decoder layer, with q/k/v and
gate/up each fused into one linear as serving engines fuse them, and its own attention over the static cache:
- the cache holds [batch, kv_heads, max_len, head_dim] per layer, written at the step's positions (index_copy_);
- the query heads sharing a kv head attend as one block of rows: no copy of the cache per query head (at long
  contexts those copies would move more bytes than a 4-bit layer's weights);
- the mask admits cache positions up to each query's, so a step's shapes never change; a decode step (at most
  DECODE_ATTENTION_ROWS query rows per kv head) runs quantkit's split-cache kernel (kernels/decode_attention.py),
  which reads the cache only up to the step's positions, longer steps (prefill) SDPA over the whole cache.
Batch rows share their positions (prompts of equal length, the benchmark's case).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.kernels import DECODE_ATTENTION_ROWS, decode_attention_for
from quantkit.nn.qlinear import QuantLinear


@dataclass(frozen=True)
class DecoderArch:
    """How a Llama-family decoder layer differs between architectures (module names as in transformers)."""

    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before the rotary embedding


DECODER_ARCHS = {"llama": DecoderArch(), "mistral": DecoderArch(), "qwen2": DecoderArch(),
                 "qwen3": DecoderArch(qk_norm=True)}


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
    """One decoder layer's modules, q/k/v and gate/up fused."""

    def __init__(self, layer: nn.Module, arch: DecoderArch) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm, self.post_attention_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.qkv = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o, self.down = attn.o_proj, mlp.down_proj
        self.gate_up = fuse_linears([mlp.gate_proj, mlp.up_proj])
        self.act = mlp.act_fn
        self.q_norm, self.k_norm = (attn.q_norm, attn.k_norm) if arch.qk_norm else (None, None)
        self.scaling = attn.scaling


class StaticDecoder:
    """A Llama-family causal LM as fixed-shape steps over a static KV cache of batch_size x max_len tokens."""

    def __init__(self, model: nn.Module, batch_size: int, max_len: int) -> None:
        config = model.config
        arch = DECODER_ARCHS.get(config.model_type)
        if arch is None:
            raise ValueError(f"StaticDecoder runs {sorted(DECODER_ARCHS)}, not {config.model_type!r}")
        window = getattr(config, "sliding_window", None)
        slides = config.model_type == "mistral" or "sliding_attention" in (getattr(config, "layer_types", None) or ())
        if slides and window is not None and max_len > window:
            raise ValueError(f"max_len {max_len} exceeds the sliding window {window}: StaticDecoder attends to "
                             "every cached position")
        base = model.model
        self.embed, self.norm, self.lm_head = base.embed_tokens, base.norm, model.lm_head
        self.layers = [_Layer(layer, arch) for layer in base.layers]
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.max_len = max_len
        weight = self.embed.weight
        cos, sin = base.rotary_emb(weight[:1], torch.arange(max_len, device=weight.device)[None])
        self.cos, self.sin = cos[0], sin[0]  # [max_len, head_dim], the model's dtype: as transformers applies them
        self.slots = torch.arange(max_len, device=weight.device)
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

    def _attention(self, layer: _Layer, x: torch.Tensor, positions: torch.Tensor, index: int,
                   mask: torch.Tensor | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = layer.qkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q, k = q.view(batch, tokens, self.heads, self.head_dim), k.view(batch, tokens, self.kv_heads, self.head_dim)
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        cos, sin = self.cos[positions], self.sin[positions]  # [tokens, head_dim]
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        cache_k, cache_v = self.cache[index]
        cache_k.index_copy_(2, positions, k)
        cache_v.index_copy_(2, positions, v.view(batch, tokens, self.kv_heads, self.head_dim).transpose(1, 2))
        group = self.heads // self.kv_heads  # query head h reads kv head h // group (transformers' repeat_kv)
        q = q.reshape(batch, self.kv_heads, group * tokens, self.head_dim)
        if mask is None:
            out = self.decode_attention(q, cache_k, cache_v, positions, layer.scaling)
        else:
            out = F.scaled_dot_product_attention(q, cache_k, cache_v, attn_mask=mask, scale=layer.scaling)
        out = out.view(batch, self.heads, tokens, self.head_dim).transpose(1, 2).reshape(batch, tokens, q_size)
        return layer.o(out)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Logits [batch, tokens (1 if last_only), vocab] of ids [batch, tokens] at cache positions [tokens],
        whose keys and values it writes into the cache. No host synchronisation: a CUDA graph can capture it."""
        group = self.heads // self.kv_heads
        mask = None  # the decode attention kernel masks by positions itself
        if self.decode_attention is None or group * ids.shape[1] > DECODE_ATTENTION_ROWS:
            mask = (self.slots[None] <= positions[:, None]).repeat(group, 1)  # rows: query head group, then token
        h = self.embed(ids)
        for index, layer in enumerate(self.layers):
            h = h + self._attention(layer, layer.input_norm(h), positions, index, mask)
            gate, up = layer.gate_up(layer.post_attention_norm(h)).chunk(2, dim=-1)
            h = h + layer.down(layer.act(gate) * up)
        if last_only:
            h = h[:, -1:]
        return self.lm_head(self.norm(h))

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
