"""Mixture-of-experts blocks in per-expert form, so calibration, export and reload see ordinary nn.Linears.

transformers 5 holds a sparse block's experts as fused 3-D parameters (see MoeExperts in adapters.py);
unfuse_experts() rewrites each such block into an UnfusedMoe: the router as an nn.Linear (never quantized; DeepSeek's
router module kept as it is), one ExpertMLP per expert with nn.Linear gate_proj / up_proj / down_proj (the names
on-disk checkpoints and vLLM's loaders use), and the shared expert with its sigmoid gate where the architecture has
one. Its forward computes what transformers' block computes: softmax over the router logits in fp32, top-k, the
top-k weights renormalised where the router does it (Mixtral always; Qwen and OLMoE per config.norm_topk_prob), or
the architecture's own router's choice (DeepSeek's grouped sigmoid top-k), each expert run on exactly the tokens
routed to it and its output scaled by that token's routing weight. A forward hook on an expert's linear therefore
sees exactly that expert's tokens.

The engine's calibration goes through an architecture's LayerCalibration (layer_calibration(adapter)), which for
MoE models is MoeCalibration: it attaches the engine's LayerContext to each block, which then sends experts only
the batch's real (non-padding) tokens (with `all_tokens` every expert runs on all of them for the statistics while
the layer's output still follows the routing); it counts the tokens routed to each expert for the report; and an
expert's linear whose statistics come from fewer tokens than its input width (its Hessian is then singular) gets
LowTokenGuard's policy: its method's few_tokens() adjustment (GPTQ/QQQ: damp_percent x10), logged; no token at
all: RTN, logged. Both are recorded as fallbacks in the report.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol, cast

import torch
from torch import nn

from quantkit.models.adapters import ArchAdapter, MoeExperts, find_adapter
from quantkit.nn.qlinear import QuantLinear
from quantkit.qtensor import QuantizationError, QuantizedWeight
from quantkit.quantizers.base import LinearQuantizer, Method

if TYPE_CHECKING:
    from quantkit.kernels.common import StackedExperts

log = logging.getLogger("quantkit")



class _MaskSource(Protocol):
    current_mask: torch.Tensor | None


class ExpertMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act_fn: nn.Module, like: torch.Tensor) -> None:
        super().__init__()
        kwargs = {"bias": False, "dtype": like.dtype, "device": like.device}
        self.gate_proj = nn.Linear(hidden, intermediate, **kwargs)
        self.up_proj = nn.Linear(hidden, intermediate, **kwargs)
        self.down_proj = nn.Linear(intermediate, hidden, **kwargs)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class UnfusedMoe(nn.Module):
    def __init__(self, gate: nn.Module, experts: nn.ModuleList, top_k: int, norm_topk_prob: bool,
                 shared: tuple[str, nn.Module, nn.Module | None] | None = None, fp32_routing_weights: bool = False,
                 router_routes: bool = False) -> None:
        """`shared`: the shared expert's attribute name, module and sigmoid gate (None: ungated, as DeepSeek's);
        `router_routes`: `gate` is the architecture's own router, returning (logits, weights, indices)."""
        super().__init__()
        self.fp32_routing_weights, self.router_routes = fp32_routing_weights, router_routes
        self.gate = gate
        self.experts = experts
        self.shared_name = None if shared is None else shared[0]
        if shared is not None:
            self.add_module(shared[0], shared[1])
            if shared[2] is not None:
                self.shared_expert_gate = shared[2]
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.all_tokens = False  # calibration: every expert's statistics from every real token
        self._calibration: weakref.ref[_MaskSource] | None = None
        self.token_counts: torch.Tensor | None = None  # routed real tokens per expert, while counting
        self._grouped: Callable | bool | None = None  # grouped_experts(): built on first use, False: not eligible

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k routing weights (fp32, or x's dtype) and expert indices, [tokens, top_k] each."""
        if self.router_routes:  # DeepSeek's sigmoid scores, bias correction, group-limited top-k, scaling factor
            _, weights, index = self.gate(x)
            return weights if self.fp32_routing_weights else weights.to(x.dtype), index
        logits = self.gate(x)
        weights, index = torch.topk(torch.softmax(logits.float(), dim=-1), self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights if self.fp32_routing_weights else weights.to(logits.dtype), index

    def _real_rows(self) -> torch.Tensor | None:
        source = self._calibration() if self._calibration is not None else None
        mask = None if source is None else source.current_mask
        return None if mask is None else mask.reshape(-1).nonzero().squeeze(1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        weights, index = self.route(x)
        grouped = self.grouped_experts() if self._wants_grouped(x) else None
        out = grouped(x, index, weights) if grouped is not None else self._expert_loop(x, weights, index)
        if self.shared_name is not None:
            shared = self.get_submodule(self.shared_name)(x)
            gate = getattr(self, "shared_expert_gate", None)
            out = out + (shared if gate is None else torch.sigmoid(gate(x)) * shared)
        return out.reshape(hidden_states.shape)

    def _expert_loop(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        real = self._real_rows()
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(index == e)
            if real is not None:
                keep = torch.isin(rows, real)
                rows, slot = rows[keep], slot[keep]
            if self.token_counts is not None:
                self.token_counts[e] += rows.numel()
            if real is not None and self.all_tokens:
                y = torch.zeros_like(x)
                y[real] = expert(x[real])  # statistics from every real token; the output keeps the routing
                y = y[rows]
            else:  # run even without tokens: calibration hooks then see that expert's empty input
                y = expert(x[rows])
            out.index_add_(0, rows, (y * weights[rows, slot, None]).to(out.dtype))
        return out

    def _wants_grouped(self, x: torch.Tensor) -> bool:
        """The grouped kernel serves inference on CUDA only: calibration needs the loop (its hooks see each expert's
        tokens), and on the CPU Triton has only its interpreter. QUANTKIT_KERNELS=0 keeps the loop, as for linears."""
        calibrating = self._calibration is not None and self._calibration() is not None
        return (x.is_cuda and not calibrating and self.token_counts is None
                and os.environ.get("QUANTKIT_KERNELS", "1") != "0")

    def grouped_experts(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """experts(x, topk_ids, topk_weights) through a grouped MoE kernel (quantkit.kernels.registry.MOE_FORWARDS:
        moe_w4a16 or moe_w4a8, one launch per projection for every expert), or None (then the per-expert loop)
        unless every expert is a QuantLinear triple of one scheme a grouped kernel takes. The experts' packed tensors
        are stacked once, on the first call, into a second copy (a quarter of the fp16 experts' bytes); moving the
        block (.to) or calling release_grouped() drops it."""
        if self._grouped is None:
            if not isinstance(self.experts[0].gate_proj, QuantLinear):
                return None  # not quantized (yet): decided once it is
            self._grouped = _grouped_forward(self.experts) or False
        return self._grouped or None

    def release_grouped(self) -> None:
        """Drop the stacked copy (call after editing the experts' packed buffers in place)."""
        self._grouped = None

    def _apply(self, fn, recurse: bool = True):
        self._grouped = None  # the stacked copy holds the old device's / dtype's tensors
        return super()._apply(fn, recurse)


def _grouped_scheme(linear: nn.Module) -> tuple | None:
    """What the grouped kernels need equal across experts, (act_bits, two_level, group, in, out, dtype), or None where
    a linear is no fp16/bf16 4-bit QuantLinear without bias of a scheme they compute: W4A16, or W4A8 per channel or
    QQQ's two-level with every weight in int8 (the dense W4A8 kernels' schemes, kernels.make_kernel_forward)."""
    from quantkit.kernels import two_level_int8_overflow

    if (not isinstance(linear, QuantLinear) or linear.bits != 4 or linear.act_bits not in (8, 16)
            or linear.bias is not None
            or linear.scales.dtype not in (torch.float16, torch.bfloat16)):  # fp32 would run tl.dot in tf32
        return None
    two_level = linear.channel_scales is not None
    if linear.act_bits == 8 and (two_level_int8_overflow(linear) if two_level
                                 else linear.group_size != linear.in_features):
        return None  # QQQ would wrap the weight; one-level group scales with int8 activations: no W4A8 kernel
    return linear.act_bits, two_level, linear.group_size, linear.in_features, linear.out_features, linear.scales.dtype


def _stack(linears: list[list[QuantLinear]]) -> StackedExperts:
    """Each expert's projections concatenated along N, the experts stacked; zeros None when all are 8 (symmetric).
    W4A8: the channel scales (per channel: the layer's one row of scales) apart, fp32 [E, N]."""
    from quantkit.kernels.common import StackedExperts

    def stacked(tensor: Callable[[QuantLinear], torch.Tensor]) -> torch.Tensor:
        return torch.stack([torch.cat([tensor(linear) for linear in projections], dim=1) for projections in linears])

    first = linears[0][0]
    qweight, scales, zeros = (stacked(lambda linear: linear.plain_qweight()), stacked(lambda linear: linear.scales),
                              stacked(lambda linear: linear.zeros))
    zeros = None if bool((zeros == 8).all()) else zeros
    if first.act_bits == 16:
        return StackedExperts(qweight, scales, zeros, first.group_size)
    if first.channel_scales is None:  # per channel: scales [E, 1, N] are the channel scales
        return StackedExperts(qweight, None, zeros, first.group_size, scales.flatten(1).float())
    channel = stacked(lambda linear: linear.channel_scales[None]).flatten(1).float()
    return StackedExperts(qweight, scales, zeros, first.group_size, channel)


def _grouped_forward(experts: nn.ModuleList) -> Callable | None:
    """The grouped kernel's forward over these experts (by their scheme, W4A16 or W4A8), or None (logged) where they
    are not all of one scheme a grouped kernel takes (gate and up alike, shapes it tiles) with one activation."""
    from quantkit.kernels.common import supports, tile_counters
    from quantkit.kernels.registry import MOE_FORWARDS

    projections = [[expert.gate_proj, expert.up_proj, expert.down_proj] for expert in experts]
    schemes = {tuple(_grouped_scheme(linear) for linear in triple) for triple in projections}
    acts = {type(expert.act_fn) for expert in experts}
    scheme = next(iter(schemes))
    if (len(schemes) != 1 or None in scheme or len(acts) != 1 or scheme[0] != scheme[1]
            or scheme[0][:2] != scheme[2][:2] or not all(supports(k, group) for _, _, group, k, _, _ in scheme)):
        log.info("MoE block: experts not all of one scheme a grouped kernel tiles; the per-expert loop runs")
        return None

    gate_up, down = _stack([triple[:2] for triple in projections]), _stack([triple[2:] for triple in projections])
    act, kind = experts[0].act_fn, "w4a16" if scheme[0][0] == 16 else "w4a8"
    tile_counters(gate_up.qweight.device)  # split K's tile counters, allocated now, never inside a graph capture

    def forward(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return MOE_FORWARDS[kind](x, index, weights.to(torch.float32), gate_up, down, act)

    return forward


def _unfuse_block(block: nn.Module, spec: MoeExperts) -> UnfusedMoe:
    fused, router = block.experts, block.gate
    count, hidden = router.weight.shape
    intermediate = fused.down_proj.shape[2]
    like = fused.down_proj
    if spec.router_routes:
        gate = router
    else:
        gate = nn.Linear(hidden, count, bias=False, dtype=like.dtype, device=like.device)
        gate.weight.data.copy_(router.weight.data)
    experts = nn.ModuleList(ExpertMLP(hidden, intermediate, fused.act_fn, like) for _ in range(count))
    for e, expert in enumerate(experts):
        gate_w, up_w = fused.gate_up_proj.data[e].chunk(2, dim=0)
        expert.gate_proj.weight.data.copy_(gate_w)
        expert.up_proj.weight.data.copy_(up_w)
        expert.down_proj.weight.data.copy_(fused.down_proj.data[e])
    shared = None
    if spec.shared_expert is not None:
        name = spec.shared_expert.rpartition(".")[2]
        gate_name = None if spec.shared_expert_gate is None else spec.shared_expert_gate.rpartition(".")[2]
        shared = (name, block.get_submodule(name), None if gate_name is None else block.get_submodule(gate_name))
    return UnfusedMoe(gate, experts, router.top_k, getattr(router, "norm_topk_prob", True), shared,
                      spec.fp32_routing_weights, spec.router_routes)


def _named_blocks(layer: nn.Module, adapter: ArchAdapter) -> list[tuple[str, UnfusedMoe]]:
    """The layer's unfused MoE block with its name, if it has one (dense layers: none)."""
    if adapter.experts is None:
        return []
    block = layer.get_submodule(adapter.experts.block)
    return [(adapter.experts.block, block)] if isinstance(block, UnfusedMoe) else []


def moe_blocks(layer: nn.Module, adapter: ArchAdapter) -> list[UnfusedMoe]:
    return [block for _, block in _named_blocks(layer, adapter)]


def unfuse_experts(model: nn.Module, adapter: ArchAdapter) -> None:
    """Rewrite every fused MoE block of the model into UnfusedMoe, in place (already unfused: left as is)."""
    spec = adapter.experts
    if spec is None:
        return
    if not spec.fused_experts:
        raise QuantizationError(f"{adapter.name}: only experts fused in 3-D parameters are supported")
    for layer in adapter.get_layers(model):
        block = layer.get_submodule(spec.block)
        if isinstance(block, UnfusedMoe) or not hasattr(block, "experts"):
            continue  # done already, or a dense MLP layer (Qwen's mlp_only_layers)
        parent, _, child = spec.block.rpartition(".")
        setattr(layer.get_submodule(parent) if parent else layer, child,
                _unfuse_block(block, spec))


def check_experts_quantized(layer: nn.Module, adapter: ArchAdapter, index: int) -> None:
    """No expert linear may stay in full precision unnoticed (e.g. a name missing from the entry)."""
    left = [f"{block_name}.experts.{name}" for block_name, block in _named_blocks(layer, adapter)
            for name, module in block.experts.named_modules() if isinstance(module, nn.Linear)]
    if left:
        raise QuantizationError(f"layer {index}: expert linears left unquantized: {', '.join(left[:4])}; "
                                f"the {adapter.name} entry's sequential steps do not name them")


@contextmanager
def count_routed_tokens(layer: nn.Module, adapter: ArchAdapter) -> Iterator[dict[str, list[int]]]:
    """While active, the real tokens routed to each expert, per MoE block name (filled on exit)."""
    blocks = _named_blocks(layer, adapter)
    counts: dict[str, list[int]] = {}
    for _, block in blocks:
        block.token_counts = torch.zeros(len(block.experts), dtype=torch.long)
    try:
        yield counts
    finally:
        for name, block in blocks:
            counts[name] = block.token_counts.tolist()
            block.token_counts = None


class LowTokenGuard(LinearQuantizer):
    """An expert linear's quantizer, counting the tokens it is calibrated on (see the module docstring)."""

    def __init__(self, inner: LinearQuantizer, label: str) -> None:
        super().__init__(inner.linear, inner.config)
        self.inner, self.label, self.tokens = inner, label, 0

    def add_batch(self, x: torch.Tensor) -> None:
        self.tokens += x.shape[0]
        self.inner.add_batch(x)

    def shares_statistics_with(self, owner: LinearQuantizer) -> bool:
        return isinstance(owner, LowTokenGuard) and self.inner.shares_statistics_with(owner.inner)

    def take_statistics(self, owner: LinearQuantizer) -> None:
        assert isinstance(owner, LowTokenGuard)
        self.tokens = owner.tokens
        self.inner.take_statistics(owner.inner)

    def quantize(self) -> QuantizedWeight:
        return self.quantize_groups([[self]])[0][0]

    @classmethod
    def quantize_groups(cls, groups: list[list[LinearQuantizer]]) -> list[list[QuantizedWeight]]:
        """A group's sharers took its owner's statistics, token count included: one policy per group, then the
        inner quantizers' groups are solved together as their method does (GPTQ: experts side by side)."""
        assert all(isinstance(g, LowTokenGuard) for group in groups for g in group)  # shares_statistics_with
        guards = cast(list[list[LowTokenGuard]], groups)
        notes = [group[0].low_token_policy(group) for group in guards]
        solved = type(guards[0][0].inner).quantize_groups([[g.inner for g in group] for group in guards])
        for group, results, note in zip(guards, solved, notes, strict=True):
            for result in results:
                if note is not None:
                    result.info.setdefault("fallback", note)
                result.info["tokens"] = group[0].tokens
        return solved

    def low_token_policy(self, group: list[LowTokenGuard]) -> str | None:
        """When the group saw fewer tokens than its input width, each quantizer adjusts to it as its method does
        (LinearQuantizer.few_tokens; GPTQ: 10x the dampening), logged; the note for the report. With enough
        tokens, or none (GPTQ and QQQ then quantize by RTN on their grid and log it), nothing."""
        threshold = self.linear.in_features
        if not 0 < self.tokens < threshold:
            return None
        notes = {guard.inner.few_tokens() for guard in group}
        note = next(iter(notes - {None}), None)
        if note is not None:
            log.warning("%s: %d calibration tokens < %d (input width); %s", " + ".join(g.label for g in group),
                        self.tokens, threshold, note)
            note = f"{note}: {self.tokens} tokens < {threshold}"
        return note

    def free(self) -> None:
        self.inner.free()

    def statistics_bytes(self) -> int:
        return self.inner.statistics_bytes()


class LayerCalibration:
    """What an architecture adds to the calibration of its layers; a dense one adds nothing. The engine calls
    these hooks and knows nothing of experts (MoeCalibration below)."""

    def prepare(self, model: nn.Module) -> None:  # noqa: B027 - optional hook
        """Once, before any layer (MoE: the per-expert form)."""

    def attach(self, layer: nn.Module, source: _MaskSource) -> None:  # noqa: B027 - optional hook
        """The layer is about to be calibrated on `source`'s batches."""

    def quantizer(self, method: Method, linear: nn.Linear, name: str, layer: int) -> LinearQuantizer:
        return method.linear_quantizer(linear)

    @contextmanager
    def counting(self, layer: nn.Module) -> Iterator[dict]:
        """While active, what the report gets of the layer's routing (filled on exit); nothing for a dense one."""
        yield {}

    def check(self, layer: nn.Module, index: int) -> None:  # noqa: B027 - optional hook
        """After the layer: nothing the architecture owns was left unquantized."""


class MoeCalibration(LayerCalibration):
    """Mixture of experts: blocks in per-expert form that route only the batch's real tokens (every expert sees all
    of them with `all_tokens`), the low-token policy on each expert linear's quantizer, the tokens routed to each
    expert counted for the report, and no expert linear left unquantized."""

    def __init__(self, adapter: ArchAdapter, all_tokens: bool) -> None:
        assert adapter.experts is not None
        self.adapter, self.experts, self.all_tokens = adapter, adapter.experts, all_tokens

    def prepare(self, model: nn.Module) -> None:
        unfuse_experts(model, self.adapter)

    def attach(self, layer: nn.Module, source: _MaskSource) -> None:
        for block in moe_blocks(layer, self.adapter):
            block._calibration, block.all_tokens = weakref.ref(source), self.all_tokens

    def quantizer(self, method: Method, linear: nn.Linear, name: str, layer: int) -> LinearQuantizer:
        """The method's quantizer; an expert linear's guarded where the method calibrates on tokens."""
        inner = method.linear_quantizer(linear)
        if not (self.experts.is_expert_linear(name) and method.needs_activations):
            return inner
        return LowTokenGuard(inner, f"layer {layer} {name}")

    @contextmanager
    def counting(self, layer: nn.Module) -> Iterator[dict]:
        """{"expert_tokens": real tokens routed to each expert, per MoE block name} (a dense layer of an MoE
        model: nothing)."""
        report: dict = {}
        with count_routed_tokens(layer, self.adapter) as counts:
            yield report
        if counts:
            report["expert_tokens"] = counts

    def check(self, layer: nn.Module, index: int) -> None:
        check_experts_quantized(layer, self.adapter, index)


def layer_calibration(adapter: ArchAdapter, all_tokens: bool = False) -> LayerCalibration:
    """The architecture's calibration context (`all_tokens`: --moe-all-tokens)."""
    return LayerCalibration() if adapter.experts is None else MoeCalibration(adapter, all_tokens)


def checkpoint_name(model: nn.Module, name: str, reverse: bool = False) -> str:
    """A name of the model's (a module's or tensor's) as checkpoints of its architecture write it (reverse: the
    checkpoint's name as quantkit's per-expert form has it)."""
    adapter = find_adapter(getattr(model.config, "model_type", ""))
    return name if adapter is None else adapter.checkpoint_name(name, reverse)
