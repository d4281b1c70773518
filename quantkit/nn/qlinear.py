"""QuantLinear: a linear layer that computes with packed low-bit weights.

Storage (our own, K-packed like GPTQ's `qweight`; exporters convert from/to the file formats):
  qweight         int32 [in * bits / 32, out]: element k of row r (bits k*b .. k*b+b-1) holds the
                  unsigned code of input (32/b)*r + k for output column o.
  scales          [n_groups, out] in the activation dtype (fp16/bf16/fp32).
  zeros           uint8 [n_groups, out], unsigned zero points (2**(bits-1) when symmetric).
  channel_scales  float32 [out] or None: QQQ's two-level W4A8 scheme, scales then hold group scales.
  act_bits        16 (weight-only) or 8 (per-token dynamic symmetric int8 activations: with integer weights,
                  two-level or per channel, the reference path computes the W4A8 kernels' integer function;
                  with one-level group scales, which no kernel takes, a fake-quantized matmul).
  fp8             W8A8-FP8: qweight packs float8 e4m3 bytes (8-bit codes), scales [1, out] float32, zeros unused;
                  activations float8 e4m3 per token (kernels/w8a8_fp8.py, its reference in kernels/reference.py).

On CUDA the Triton kernels in quantkit.kernels run it when they accept the shape, from their own copy of the
weight (on Hopper their only one: qweight then stays in host memory, see prepare_kernels); everywhere else (and as
the reference) the weight is dequantized and multiplied.
"""

from __future__ import annotations

import copy
import os

import torch
from torch import nn

from quantkit.kernels.layout import fp8_tokens, int8_tokens, pack_along_rows, unpack_along_rows
from quantkit.qtensor import QuantizedWeight, fp8_values


def quantize_activations_per_token(x: torch.Tensor) -> torch.Tensor:
    """Per-token symmetric int8 fake quantization: round(x / s) * s with s = max|x_token| / 127."""
    codes, scale = int8_tokens(x)
    return (codes * scale).to(x.dtype)


class QuantLinear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bits: int,
        group_size: int,
        bias: bool,
        act_bits: int = 16,
        two_level: bool = False,
        dtype: torch.dtype = torch.float16,
        fp8: bool = False,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.act_bits, self.fp8 = bits, act_bits, fp8
        self.group_size = in_features if group_size == -1 else group_size
        n_groups = in_features // self.group_size
        self.register_buffer("qweight", torch.zeros(in_features * bits // 32, out_features, dtype=torch.int32))
        self.register_buffer("scales", torch.zeros(n_groups, out_features, dtype=torch.float32 if fp8 else dtype))
        self.register_buffer("zeros", torch.zeros(n_groups, out_features, dtype=torch.uint8))
        self.register_buffer("channel_scales", torch.ones(out_features) if two_level else None)
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype) if bias else None)
        self._kernel = None  # set by quantkit.kernels on CUDA (see prepare_kernels)
        self.register_buffer("dense_weight", None, persistent=False)  # see cache_dense_weight

    @classmethod
    def from_quantized(
        cls, qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype, act_bits: int = 16
    ) -> QuantLinear:
        out_f, in_f = qw.shape
        layer = cls(in_f, out_f, qw.bits, qw.group_size, bias is not None, act_bits,
                    qw.channel_scales is not None, dtype, qw.fp8)
        layer.qweight.copy_(pack_along_rows(qw.codes.t().contiguous(), qw.bits))
        group_scales = qw.scales if qw.channel_scales is None else qw.scales / qw.channel_scales[:, None]
        layer.scales.copy_(group_scales.t().to(dtype))
        layer.zeros.copy_(qw.zeros.t())
        if qw.channel_scales is not None:
            layer.channel_scales.copy_(qw.channel_scales)
        if bias is not None:
            layer.bias.copy_(bias.to(dtype))
        return layer

    @classmethod
    def concatenated(cls, layers: list[QuantLinear]) -> QuantLinear:
        """One layer computing `layers` side by side (outputs concatenated), as serving engines fuse q/k/v and
        gate/up: every output column keeps its codes, scales and zero points, so each slice of the output is the
        same function of x as its source layer. The layers must share input size, bits, group, activation bits,
        dtype and scale scheme; a bias missing from some is zero there."""
        first = layers[0]
        for layer in layers[1:]:
            for attribute in ("in_features", "bits", "group_size", "act_bits", "fp8"):
                if getattr(layer, attribute) != getattr(first, attribute):
                    raise ValueError(f"cannot concatenate QuantLinears with {attribute} "
                                     f"{getattr(first, attribute)} and {getattr(layer, attribute)}")
            if (layer.scales.dtype, layer.channel_scales is None) != (first.scales.dtype, first.channel_scales is None):
                raise ValueError("cannot concatenate QuantLinears with different scale dtypes or scale schemes")
        has_bias = any(layer.bias is not None for layer in layers)
        with torch.device("meta"):  # every buffer is replaced below: allocate none of them
            fused = cls(first.in_features, sum(layer.out_features for layer in layers), first.bits, first.group_size,
                        False, first.act_bits, first.channel_scales is not None, first.scales.dtype, first.fp8)
        fused.qweight = torch.cat([layer.plain_qweight() for layer in layers], dim=1)
        fused.scales = torch.cat([layer.scales for layer in layers], dim=1)
        fused.zeros = torch.cat([layer.zeros for layer in layers], dim=1)
        if first.channel_scales is not None:
            fused.channel_scales = torch.cat([layer.channel_scales for layer in layers])
        if has_bias:
            fused.bias = torch.cat([layer.bias if layer.bias is not None else layer.scales.new_zeros(layer.out_features)
                                    for layer in layers])
        if fused._wants_kernel():
            fused.prepare_kernels()
        return fused

    def to_quantized(self) -> QuantizedWeight:
        channel = None if self.channel_scales is None else self.channel_scales.float()
        scales = self.scales.t().float()
        if channel is not None:
            scales = scales * channel[:, None]
        group_size = -1 if self.group_size == self.in_features else self.group_size
        return QuantizedWeight(
            codes=unpack_along_rows(self.plain_qweight(), self.bits).t().contiguous(),
            scales=scales,
            zeros=self.zeros.t().contiguous(),
            bits=self.bits,
            group_size=group_size,
            sym=self.fp8 or bool((self.zeros == 2 ** (self.bits - 1)).all()),
            channel_scales=channel,
            fp8=self.fp8,
        )

    def dequantized_weight(self) -> torch.Tensor:
        """[out, in] weight in the activation dtype (FP8: fp32), computed from the packed buffers."""
        if self.fp8:
            return self._e4m3_values() * self.scales.t()
        codes = unpack_along_rows(self.plain_qweight(), self.bits)  # [in, out]
        g = torch.arange(self.in_features, device=codes.device) // self.group_size
        q = codes.float() - self.zeros[g].float()
        if self.channel_scales is not None:
            # QQQ's two-level W4A8: the int8 weight is round-half-even((q - z) * group scale), as the
            # kernel (and QQQ's) computes it, then the per-channel scale.
            w8 = torch.round(q * self.scales[g].float()).clamp(-128, 127)
            return (w8 * self.channel_scales.float()).to(self.scales.dtype).t()
        return (q.to(self.scales.dtype) * self.scales[g]).t()

    @property
    def integer_w4a8(self) -> bool:
        """int8 activations and an int8 weight (two-level, or per channel): the W4A8 kernels' integer function."""
        return self.act_bits == 8 and (self.channel_scales is not None or self.group_size == self.in_features)

    def cache_dense_weight(self, enabled: bool = True) -> None:
        """Keep the dequantized weight (an integer W4A8 layer's int8 weight [in, out], in fp32): the same numerics, no
        unpacking per call, for evaluation of small models, where the per-call dequantize's kernel launches cost
        more than the matmul. While cached, forward uses it instead of the Triton kernels. Not saved; call again
        after changing the packed buffers."""
        if not enabled:
            self.dense_weight = None
        elif self.fp8:  # unscaled: the reference's operand
            self.dense_weight = self._e4m3_values()
        elif self.integer_w4a8:
            from quantkit.kernels import w4a8_operands
            from quantkit.kernels.reference import int8_weight_reference

            _, group_scales, zeros = w4a8_operands(self)
            self.dense_weight = int8_weight_reference(self.plain_qweight(), group_scales, zeros, self.group_size,
                                                      slice(None), self.scales.device).float()
        else:
            self.dense_weight = self.dequantized_weight()

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8:
            return self._fp8_forward(x)
        if self.integer_w4a8:
            return self._integer_w4a8_forward(x)
        return self.fake_quantized_forward(x, self.dense_weight)

    def fake_quantized_forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """x (with act_bits 8 rounded per token to int8 steps, in x's dtype) times `weight` or the dequantized weight,
        both in x's dtype: the reference of layers without integer weights, and the simulation of W4A8 that
        benchmarks/bench_w4a8_paths.py sets against the integer function."""
        if self.act_bits == 8:
            x = quantize_activations_per_token(x)
        weight = self.dequantized_weight() if weight is None else weight
        return nn.functional.linear(x, weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def _integer_w4a8_forward(self, x: torch.Tensor) -> torch.Tensor:
        """What the W4A8 kernels compute (kernels/reference.py): exact int8 x int8 sums, scaled in fp32, so that a
        CPU evaluation and the GPU's kernels run one function (a fake-quantized matmul in fp16 rounds the
        activations and weights first, and every next layer's int8 rounding turns those ulps into whole steps)."""
        from quantkit.kernels import w4a8_operands
        from quantkit.kernels.reference import int8_products, w4a8_epilogue, w4a8_reference

        channel, group_scales, zeros = w4a8_operands(self)
        flat = x.reshape(-1, self.in_features)
        if self.dense_weight is None:
            out = w4a8_reference(flat, self.plain_qweight(), channel, group_scales, zeros, self.bias, self.group_size)
        else:
            codes, token_scales = int8_tokens(flat)
            out = w4a8_epilogue(int8_products(codes, self.dense_weight), token_scales, channel, self.bias, x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _fp8_forward(self, x: torch.Tensor) -> torch.Tensor:
        """What the FP8 kernels compute (kernels/reference.fp8_reference): e4m3 tokens times the e4m3 weight, exact
        products summed in fp32, then the token and channel scales."""
        from quantkit.kernels.reference import fp8_reference

        weight = self._e4m3_values() if self.dense_weight is None else self.dense_weight
        x8, token_scales = fp8_tokens(x.reshape(-1, self.in_features))
        out = fp8_reference(x8, token_scales, weight, self.scales[0], self.bias, x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _e4m3_values(self) -> torch.Tensor:
        """An FP8 layer's e4m3 weight values [out, in] in fp32, unscaled."""
        return fp8_values(unpack_along_rows(self.plain_qweight(), 8)).t().contiguous()

    def prepare_kernels(self) -> None:
        """Build the Triton-kernel forward for this layer's device and shape, if one applies. Runs by
        itself whenever the layer moves (`model.to("cuda")`) or loads a state dict; call it again after
        editing the packed buffers in place (the forward decides symmetric vs zero points when built).
        Where the kernels run on their own copy of the weight alone (quantkit.kernels.keeps_plain_copy),
        `qweight` moves to host memory: the GPU holds one copy. QUANTKIT_KERNELS=0 keeps the reference path."""
        from quantkit.kernels import make_kernel_forward

        self._kernel = make_kernel_forward(self) if self.scales.is_cuda else None
        if self._kernel is not None:
            self.qweight = self._kernel.plain_qweight

    def release_kernels(self) -> None:
        """Drop the kernel forward and the weight copy it holds (qweight stays where it is: the reference path
        reads it from there)."""
        self._kernel = None

    def plain_qweight(self) -> torch.Tensor:
        """qweight on the layer's device (the scales'), wherever it is kept."""
        return self.qweight.to(self.scales.device)

    def _wants_kernel(self) -> bool:
        return self.scales.is_cuda and os.environ.get("QUANTKIT_KERNELS", "1") != "0"

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        self._kernel = None  # it holds the buffers of the old device / dtype
        if self._wants_kernel():
            self.prepare_kernels()
        return self

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        if self._wants_kernel():  # the new zero points may change the kernel's symmetric shortcut
            self.prepare_kernels()

    def __getstate__(self) -> dict:
        # the kernel forward is a closure over this layer's buffers: never copied or pickled, rebuilt
        return {**self.__dict__, "_kernel": None}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if self._wants_kernel():
            self.prepare_kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None and self.dense_weight is None and x.is_cuda:
            return self._kernel(x)
        return self.reference_forward(x)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, bits={self.bits}, "
                f"group={self.group_size}, act_bits={self.act_bits}" + (", fp8" if self.fp8 else ""))


def with_act_bits(model: nn.Module, act_bits: int) -> nn.Module:
    """A copy of a quantized model whose QuantLinears take act_bits activations: RTN's and GPTQ's weights do not
    depend on act_bits (test_qqq's test_rtn_and_gptq_weights_ignore_act_bits), so one quantization serves both."""
    model = copy.deepcopy(model)
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.act_bits = act_bits
    return model
