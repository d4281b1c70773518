"""The kernels' entry points, re-exported by the package (`quantkit.kernels`): see its docstring."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from .layout import k_blocked, layout_shape, repack_for_swap, repack_for_w4a8_swap
from .spec import REFERENCE_KERNEL, TileConfig, decode_attention_rows, hopper_gluon

log = logging.getLogger(__name__)

_OPS_REGISTERED = False


def _register_ops() -> None:
    """Define the custom ops once (needs Triton, hence not at import time)."""
    global _OPS_REGISTERED
    if _OPS_REGISTERED:
        return
    from .autotune import pick_config
    from .reference import fp8_reference, w4a8_reference, w4a16_reference

    @torch.library.custom_op("quantkit::w4a16_linear", mutates_args=())
    def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                     bias: torch.Tensor | None, group_size: int, swap_weight: torch.Tensor | None,
                     plain: bool = True) -> torch.Tensor:
        n, k = qweight.shape[1], x.shape[1]

        def run(cfg: TileConfig) -> torch.Tensor:
            return w4a16_run(x, qweight, scales, zeros, bias, group_size, swap_weight, cfg)

        def reference() -> torch.Tensor:
            return w4a16_reference(x, qweight, scales, zeros, bias, group_size)

        return run(pick_config("w4a16", x, n, k, group_size, run, zeros is not None, swap=swap_weight is not None,
                               reference=reference, swap_block=swap_block(swap_weight, k), plain=plain))

    @torch.library.custom_op("quantkit::w4a8_linear", mutates_args=())
    def w4a8_linear(x: torch.Tensor, qweight: torch.Tensor, channel_scales: torch.Tensor,
                    group_scales: torch.Tensor | None, zeros: torch.Tensor | None, bias: torch.Tensor | None,
                    group_size: int, swap_weight: torch.Tensor | None, plain: bool = True) -> torch.Tensor:
        n, k = qweight.shape[1], x.shape[1]

        def run(cfg: TileConfig) -> torch.Tensor:
            return w4a8_run(x, qweight, channel_scales, group_scales, zeros, bias, group_size, swap_weight, cfg)

        def reference() -> torch.Tensor:
            return w4a8_reference(x, qweight, channel_scales, group_scales, zeros, bias, group_size)

        return run(pick_config("w4a8", x, n, k, group_size, run, zeros is not None, group_scales is not None,
                               swap_weight is not None, reference, swap_block(swap_weight, k), plain))

    for op in (w4a16_linear, w4a8_linear):
        op.register_fake(lambda x, qweight, *args: x.new_empty(x.shape[0], qweight.shape[1]))

    @torch.library.custom_op("quantkit::fp8_linear", mutates_args=())
    def fp8_linear(x8: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor,
                   bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        n, k = weight.shape

        def run(cfg: TileConfig) -> torch.Tensor:
            return fp8_run(x8, x_scales, weight, weight_scales, bias, out_dtype, cfg)

        def reference() -> torch.Tensor:
            return fp8_reference(x8, x_scales, weight, weight_scales, bias, out_dtype)

        return run(pick_config("fp8", x8, n, k, k, run, reference=reference, dtype=out_dtype))

    fp8_linear.register_fake(lambda x8, x_scales, weight, weight_scales, bias, out_dtype:
                             x8.new_empty(x8.shape[0], weight.shape[0], dtype=out_dtype))
    _OPS_REGISTERED = True


def w4a16_run(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
              bias: torch.Tensor | None, group_size: int, swap_weight: torch.Tensor | None, cfg: TileConfig
              ) -> torch.Tensor:
    """One W4A16 call with an explicit config: its registered kernel on the weight layout it reads (or the plain torch
    reference, the tuner's last resort)."""
    from . import registry
    from .reference import w4a16_reference

    if cfg.kernel == REFERENCE_KERNEL:
        return w4a16_reference(x, qweight, scales, zeros, bias, group_size)
    spec = registry.kernel("w4a16", cfg.kernel)
    weight = swap_weight if spec.layout == "swap" else qweight
    return spec.launch(x, weight, scales, zeros, bias, group_size, cfg)


def w4a8_run(x: torch.Tensor, qweight: torch.Tensor, channel_scales: torch.Tensor,
             group_scales: torch.Tensor | None, zeros: torch.Tensor | None, bias: torch.Tensor | None,
             group_size: int, swap_weight: torch.Tensor | None, cfg: TileConfig) -> torch.Tensor:
    """One W4A8 call with an explicit config: its registered kernel on the weight layout it reads (or the plain torch
    reference, the tuner's last resort)."""
    from . import registry
    from .reference import w4a8_reference

    if cfg.kernel == REFERENCE_KERNEL:
        return w4a8_reference(x, qweight, channel_scales, group_scales, zeros, bias, group_size)
    spec = registry.kernel("w4a8", cfg.kernel)
    weight = swap_weight if spec.layout == "swap" else qweight
    return spec.launch(x, weight, channel_scales, group_scales, zeros, bias, group_size, cfg)


def fp8_run(x8: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor,
            bias: torch.Tensor | None, out_dtype: torch.dtype, cfg: TileConfig) -> torch.Tensor:
    """One FP8 call with an explicit config (kernels/w8a8_fp8.py), or the plain torch reference."""
    from . import registry
    from .reference import fp8_reference

    if cfg.kernel == REFERENCE_KERNEL:
        return fp8_reference(x8, x_scales, weight, weight_scales, bias, out_dtype)
    return registry.kernel("fp8", cfg.kernel).launch(x8, x_scales, weight, weight_scales, bias, out_dtype, cfg)


# The K blocks of the layers' swap-layout copies (layout.k_blocked), by activation bits. H200, every kernel on the
# plain layout and on blocks of 128 / 256 / 512 inputs:
# the wgmma kernels' 128-input K tiles gained 2.5-6% on average at 16 tokens from blocks of 128 (W4A8 2-12%) and
# ~0.4% from larger ones; the TMA gemv's 256-input tiles (which blocks of 128 cannot hold; its 128-input tiles lost
# ~10% on the large shapes) gained up to 5% / 9% on 70B gate_up / down at one token from blocks of 512 (2-4% more
# than from 256 on 70B gate_up, in both runs). W4A8 has no gemv: 128.
SWAP_BLOCK = {16: 512, 8: 128}


def decode_attention_for(device: torch.device, head_dim: int) -> Callable[..., torch.Tensor] | None:
    """The decode attention op (kernels/decode_attention.py; q [B, KVH, rows, D], caches, positions, scale, window)
    for a static-cache decoder on this device: on CUDA (on CPU only under TRITON_INTERPRET=1) with Triton and a head
    size it takes; None otherwise or with QUANTKIT_DECODE_ATTENTION=0 (then the decoder runs SDPA)."""
    if (os.environ.get("QUANTKIT_DECODE_ATTENTION", "1") == "0" or not decode_attention_rows(head_dim)
            or not (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")):
        return None
    try:
        from .common import tile_counters
        from .decode_attention import decode_attention_op
    except ImportError:  # no Triton
        return None
    tile_counters(device)  # the split programs' counters, allocated now, never inside a CUDA-graph capture
    return decode_attention_op


def swap_weight_for(layer: torch.nn.Module, symmetric: bool) -> torch.Tensor | None:
    """The swap kernels' copy of a layer's weight, on the scales' device, in K blocks of SWAP_BLOCK inputs (plain
    where K is no multiple of it), or None when the kernels cannot take the layer or QUANTKIT_SWAP_KERNEL=0."""
    from .w4a8_swap import w4a8_swap_supported
    from .w4a16_swap import swap_supported

    k, n, group = layer.in_features, layer.out_features, layer.group_size
    if os.environ.get("QUANTKIT_SWAP_KERNEL", "1") == "0":
        return None
    qweight = layer.qweight.to(layer.scales.device)  # (a plain copy kept in host memory comes back to be repacked)
    if layer.act_bits == 16:
        packed = repack_for_swap(qweight) if swap_supported(k, n, group) else None
    else:
        group_scales = layer.scales if layer.channel_scales is not None else None
        packed = repack_for_w4a8_swap(qweight) if w4a8_swap_supported(k, n, group, symmetric, group_scales) else None
    block = SWAP_BLOCK[layer.act_bits]
    return k_blocked(packed, k, block) if packed is not None and k % block == 0 else packed


def keeps_plain_copy(device: torch.device) -> bool:
    """Whether a layer with a swap-layout copy keeps its plain K-packed weight on the GPU too (0.5 byte per weight
    more), for the kernels that read that layout. Not on Hopper with Gluon (spec.hopper_gluon: its wgmma kernels
    read the swap layout at any M), where the swap-layout kernels won every tuned cell but four (dequantize + cuBLAS:
    8B o at 256 tokens, 8B qkv / gate_up and 70B gate_up at 1024, 0.72-0.83x):
    there the plain copy moves to host memory (for exports, state
    dicts and the reference path) and the GPU holds one copy of the weight. QUANTKIT_PLAIN_COPY=1 keeps it on any
    device, QUANTKIT_PLAIN_COPY=0 moves it on any."""
    chosen = os.environ.get("QUANTKIT_PLAIN_COPY")
    if chosen is not None:
        return chosen != "0"
    return not hopper_gluon(device)


def swap_block(swap_weight: torch.Tensor | None, k: int) -> int | None:
    """The K block of a layer's swap-layout copy (K itself for the plain layout), None without one."""
    return None if swap_weight is None else layout_shape(swap_weight, k)[1]


def unsupported_reason(layer: torch.nn.Module) -> str | None:
    """Why no kernel can run this QuantLinear, or None when one can."""
    k, n, group = layer.in_features, layer.out_features, layer.group_size
    if layer.fp8:
        return _fp8_unsupported_reason(layer)
    if layer.bits != 4:
        return f"{layer.bits}-bit weights (kernels are 4-bit only or FP8)"
    if layer.act_bits not in (8, 16):
        return f"act_bits={layer.act_bits} (kernels do 16 or 8)"
    if layer.scales.dtype not in (torch.float16, torch.bfloat16):
        return f"scales in {layer.scales.dtype} (kernels run fp16 or bf16)"
    if k % 32 or n % 8:
        return f"in_features {k} must be a multiple of 32 and out_features {n} of 8"
    if group != k and (group < 32 or group & (group - 1)):
        return f"group size {group} (kernels take per-channel or a power of two >= 32)"
    if layer.act_bits == 8 and layer.channel_scales is None and group != k:
        return "int8 activations with one-level group scales (W4A8 kernels are per-channel or two-level)"
    if not (layer.scales.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return "weights are not on a CUDA device"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


FP8_CAPABILITY = (8, 9)  # the first GPUs with fp8 tensor cores (Ada; Hopper is 9.0)


def _fp8_unsupported_reason(layer: torch.nn.Module) -> str | None:
    if layer.in_features % 16 or layer.out_features % 16:
        return f"in_features {layer.in_features} and out_features {layer.out_features} must be multiples of 16"
    device = layer.scales.device
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_CAPABILITY:
        return "a GPU without fp8 tensor cores (FP8 needs compute capability 8.9 or later)"
    if not (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        return "weights are not on a CUDA device"
    return None


def _fp8_forward(layer: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The FP8 forward: the layer's e4m3 bytes as [N, K] (the operand the fp8 MMAs read) on its device; the K-packed
    copy goes to host memory (the same bytes, for exports and the reference path)."""
    from .common import tile_counters
    from .layout import fp8_tokens, unpack_along_rows
    from .w8a8_fp8 import fp8_rows

    device = layer.scales.device
    tile_counters(device)  # the split-K counters, allocated now, never inside a CUDA-graph capture
    weight = unpack_along_rows(layer.qweight.to(device), 8).t().contiguous().view(torch.float8_e4m3fn)
    weight_scales = layer.scales[0].float().contiguous()
    bias, k, n = layer.bias, layer.in_features, layer.out_features

    def forward(x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, k).contiguous()
        # compiled: torch ops, which Inductor fuses into the norm before; else one launch, the same bytes
        x8, x_scales = fp8_tokens(x2) if torch.compiler.is_compiling() else fp8_rows(x2)
        out = torch.ops.quantkit.fp8_linear(x8, x_scales, weight, weight_scales, bias, x.dtype)
        return out.reshape(*x.shape[:-1], n)

    forward.plain_qweight = layer.qweight.to("cpu")
    return forward


def w4a8_operands(layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A W4A8 QuantLinear with integer weights (two-level or per channel) as the w4a8_linear op takes it: fp32
    channel scales [N]; group scales [G, N] (two-level) or None; zero points ([G, N] two-level, [N] per channel) or
    None when symmetric (the kernels' implicit 8)."""
    zeros = None if bool((layer.zeros == 8).all()) else layer.zeros
    if layer.channel_scales is not None:
        return layer.channel_scales.float().contiguous(), layer.scales, zeros
    return layer.scales[0].float().contiguous(), None, None if zeros is None else zeros[0].contiguous()


def two_level_int8_overflow(layer: torch.nn.Module) -> bool:
    """True if some round((q - z) * group_scale) leaves int8 for a code q in [0, 15] (QQQ would wrap it)."""
    z = layer.zeros.float()
    gs = layer.scales.float()
    low, high = torch.round(-z * gs), torch.round((15 - z) * gs)
    return bool((low < -128).any() or (high > 127).any())


def make_kernel_forward(layer: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A fast forward for a QuantLinear (on CUDA; on CPU only under TRITON_INTERPRET=1), or None to keep the
    reference path. Re-run after moving the layer: the forward holds the buffers it was made with. Its
    `plain_qweight` is the plain-layout weight it uses: in host memory where keeps_plain_copy says so (then only the
    swap-layout kernels run; QuantLinear.prepare_kernels lets the layer's own buffer go there too)."""
    reason = unsupported_reason(layer)
    two_level = layer.act_bits == 8 and layer.channel_scales is not None
    if reason is None and two_level and two_level_int8_overflow(layer):
        reason = "a group scale takes (q - zero) * scale outside int8"
    if reason is not None:
        log.info("QuantLinear(%s) keeps the reference path: %s", layer.extra_repr(), reason)
        return None
    _register_ops()
    if layer.fp8:
        return _fp8_forward(layer)
    from .autotune import swap_layout_serves
    from .common import tile_counters

    device = layer.scales.device
    tile_counters(device)  # allocated now, never inside a CUDA-graph capture
    k, n, group, dtype = layer.in_features, layer.out_features, layer.group_size, layer.scales.dtype
    zeros = None if bool((layer.zeros == 8).all()) else layer.zeros  # symmetric: the kernels use 8
    bias = layer.bias
    swap_weight = swap_weight_for(layer, zeros is None)
    plain = swap_weight is None or keeps_plain_copy(device) or not swap_layout_serves(
        "w4a16" if layer.act_bits == 16 else "w4a8", n, k, group, hopper_gluon(device), dtype == torch.float16,
        swap_block(swap_weight, k))
    qweight = layer.qweight.to(device if plain else "cpu")
    if layer.act_bits == 16:

        def run(x2: torch.Tensor) -> torch.Tensor:
            return torch.ops.quantkit.w4a16_linear(x2, qweight, layer.scales, zeros, bias, group, swap_weight, plain)
    else:
        channel, group_scales, channel_zeros = w4a8_operands(layer)

        def run(x2: torch.Tensor) -> torch.Tensor:
            return torch.ops.quantkit.w4a8_linear(x2, qweight, channel, group_scales, channel_zeros, bias, group,
                                                  swap_weight, plain)

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = run(x.reshape(-1, k).to(dtype).contiguous())
        return out.reshape(*x.shape[:-1], n).to(x.dtype)

    forward.plain_qweight = qweight
    return forward
