"""Per-channel smoothing shared by AWQ and QQQ: fold a scale vector s between two ops so that
prev(x) / s feeds linears whose input columns are multiplied by s: the function is unchanged in
exact arithmetic, while the quantizer sees rescaled weights (AWQ) or activations (QQQ)."""

from __future__ import annotations

import torch
from torch import nn

from quantkit.models.adapters import ArchAdapter, ScalingGroup


def active_scaling_groups(layer: nn.Module, adapter: ArchAdapter) -> list[ScalingGroup]:
    """The adapter's scaling groups that apply to this layer.

    v -> o only when v's outputs map one-to-one onto o's inputs (not with grouped-query attention);
    OPT's post-norm variant (do_layer_norm_before=False) has no norm directly before its linears; a layer holds
    either a dense MLP or an MoE block (Qwen's mlp_only_layers), so groups of the other kind are absent.
    """
    modules = dict(layer.named_modules())
    groups = []
    for group in adapter.scaling_groups:
        prev = modules.get(group.prev)
        if prev is None or group.linears[0] not in modules:
            continue
        if group.requires_square:
            first = layer.get_submodule(group.linears[0])
            if prev.weight.shape[0] != first.weight.shape[1]:
                continue
        if getattr(layer, "do_layer_norm_before", True) is False and not isinstance(prev, nn.Linear):
            continue
        groups.append(group)
    return groups


def _wide(t: torch.Tensor) -> torch.Tensor:
    """At least fp32 for the arithmetic (bf16 weights), float64 kept as is."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


@torch.no_grad()
def fold_scales(layer: nn.Module, adapter: ArchAdapter, group: ScalingGroup, scales: torch.Tensor) -> None:
    """Divide the output channels of group.prev by `scales` and multiply the linears' inputs by them."""
    prev = layer.get_submodule(group.prev)
    s = _wide(scales.to(prev.weight.device))
    if isinstance(prev, nn.Linear):
        prev.weight.copy_(_wide(prev.weight).div(s[:, None]))
        if prev.bias is not None:
            prev.bias.copy_(_wide(prev.bias).div(s))
    elif adapter.norm == "rms_one_plus":  # Gemma: y = x̂ (1 + w)  ->  1 + w' = (1 + w) / s
        prev.weight.copy_((1 + _wide(prev.weight)).div(s) - 1)
    else:  # RMSNorm y = x̂ w, LayerNorm y = x̂ w + b
        prev.weight.copy_(_wide(prev.weight).div(s))
        if getattr(prev, "bias", None) is not None:
            prev.bias.copy_(_wide(prev.bias).div(s))
    for name in (*group.linears, *group.passengers):
        linear = layer.get_submodule(name)
        linear.weight.copy_(_wide(linear.weight).mul(s.to(linear.weight.device)[None, :]))
