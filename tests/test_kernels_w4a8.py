"""W4A8 Triton kernels (per-token int8 activations, int32 accumulation) against a float64 reference that
follows the int8 semantics exactly; run by Triton's CPU interpreter on small shapes."""

from __future__ import annotations

import os
from dataclasses import replace

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels are decorated at import

import pytest
import torch
from quantkit.kernels.common import quantize_rows, row_segments
from quantkit.kernels.layout import unpack_along_rows
from quantkit.kernels.spec import TileConfig
from quantkit.kernels.w4a8 import int8_weight, w4a8_matmul
from test_kernels_w4a16 import poisoned_outputs, random_layer, relative_error  # noqa: F401

from quantkit.nn.qlinear import QuantLinear

TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def int8_codes(layer: QuantLinear) -> torch.Tensor:
    """[K, N] int weights: q - z (per-channel) or QQQ's round_half_even((q - z) * group_scale)."""
    q = unpack_along_rows(layer.qweight, 4).double()
    g = torch.arange(layer.in_features) // layer.group_size
    w = q - layer.zeros[g].double()
    return torch.round(w * layer.scales[g].double()) if layer.channel_scales is not None else w


def reference_w4a8(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-8) / 127.0
    xq = torch.round(x.float() / scale).clamp(-127, 127).double()
    channel = layer.channel_scales if layer.channel_scales is not None else layer.scales[0].float()
    out = (xq @ int8_codes(layer)) * scale.double() * channel.double()
    return out if layer.bias is None else out + layer.bias.double()


def run(layer: QuantLinear, x: torch.Tensor, config: dict) -> torch.Tensor:
    two_level = layer.channel_scales is not None
    zeros = None if bool((layer.zeros == 8).all()) else layer.zeros if two_level else layer.zeros[0]
    channel = layer.channel_scales if two_level else layer.scales[0].float()
    return w4a8_matmul(x, layer.qweight, channel, layer.scales if two_level else None, zeros, layer.bias,
                       layer.group_size, config)


GEMM = TileConfig("gemm", block_m=16, block_n=32, block_k=64, split_k=1, num_warps=4, num_stages=2)
GEMV = TileConfig("gemv", block_m=1, block_n=32, block_k=64, split_k=1, num_warps=4, num_stages=2)
CONFIGS = [(1, GEMM), (4, GEMM.with_split(3)), (21, replace(GEMM, block_m=32, block_k=128)),
           (3, replace(GEMM, kernel="gemm_sliced", block_k=256)), (1, GEMV), (3, GEMV.with_split(2)),
           (17, TileConfig("int_mm"))]  # torch._int_mm has a CPU kernel too


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("group", "two_level"), [(-1, False), (32, True), (64, True), (128, True)])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.usefixtures("poisoned_outputs")
def test_every_path_matches_int8_reference(dtype, group, two_level, sym):
    layer = random_layer(256, 40, group, dtype, sym, act_bits=8, two_level=two_level, seed=group + sym)
    for m, config in CONFIGS:
        x = (3 * torch.randn(m, 256, generator=torch.Generator().manual_seed(m))).to(dtype)
        out = run(layer, x, config)
        assert not out.isnan().any(), f"unwritten outputs with {config}"
        assert relative_error(out, reference_w4a8(layer, x)) < TOLERANCE[dtype], config


# row in registers; 3 blocks, 2 passes; without sums: the row in registers, 3 programs of 3072 inputs (the last 2856)
@pytest.mark.parametrize(("k", "one_pass_k", "sums"), [(96, 32768, True), (9000, 0, True), (9000, 32768, False)])
@pytest.mark.usefixtures("poisoned_outputs")
def test_activation_quantization_is_exact(k, one_pass_k, sums):
    x = torch.randn(5, k, dtype=torch.float16) * torch.tensor([1e-3, 1, 30, 500, 0.1]).half()[:, None]
    x[2, :] = 0  # an all-zero token: scale floors at 1e-8 / 127
    x[4, -1] = 3.0  # the row's max in the last, partial block
    x[3, 7] = -900.0  # the row's max in the first segment: the other programs must find it too
    xq, scale, total = quantize_rows(x, one_pass_k, sums, segments=3)
    ref_scale = x.abs().amax(dim=-1).float().clamp(min=1e-8) / 127.0
    ref_q = torch.round(x.float() / ref_scale[:, None]).clamp(-127, 127)
    torch.testing.assert_close(scale, ref_scale, rtol=0, atol=0)
    torch.testing.assert_close(xq.float(), ref_q, rtol=0, atol=0)
    if sums:
        torch.testing.assert_close(total, ref_q.sum(1).int(), rtol=0, atol=0)
    else:
        assert total is None


def test_a_few_tokens_rows_are_quantized_in_segments():
    assert [row_segments(m, 14336) for m in (1, 16, 64, 256, 4096)] == [14, 14, 4, 1, 1]
    assert row_segments(1, 4096) == 4 and row_segments(2, 512) == 1


@pytest.mark.usefixtures("poisoned_outputs")
def test_two_level_int8_weight_rounds_half_to_even_like_qqq():
    layer = random_layer(64, 16, 32, torch.float16, sym=True, act_bits=8, two_level=True)
    layer.scales[0, :8] = 2.5  # (q - 8) * 2.5 hits .5 ties for odd q - 8
    w = int8_weight(layer.qweight, layer.scales, None, 32)
    torch.testing.assert_close(w.t().double(), int8_codes(layer), rtol=0, atol=0)


@pytest.mark.parametrize(("group", "two_level"), [(-1, False), (32, True), (128, True)])
@pytest.mark.parametrize("sym", [True, False])
def test_half2_gemv_numerics_match_float64(group, two_level, sym):
    """The W4A8 gemv_h2's fp16 word sums (emulated step by step; the PTX runs only on CUDA) stay within fp16
    tolerance of the exact int32 result, with activations at full int8 range (|x_int8| up to 127)."""
    from quantkit.kernels.w4a8 import half2_w4a8_gemv_reference

    layer = random_layer(512, 48, group, torch.float16, sym, bias=False, act_bits=8, two_level=two_level, seed=11)
    x = (20 * torch.randn(3, 512, generator=torch.Generator().manual_seed(2))).half()
    xq, token_scales, _ = quantize_rows(x)
    zeros = None if sym else layer.zeros if two_level else layer.zeros[0]
    channel = layer.channel_scales if two_level else layer.scales[0].float()
    out = half2_w4a8_gemv_reference(xq, token_scales, layer.qweight, channel, layer.scales if two_level else None,
                                    zeros, layer.group_size)
    assert relative_error(out, reference_w4a8(layer, x)) < TOLERANCE[torch.float16]


def test_dependent_launch_only_on_hopper_and_later(monkeypatch):
    """PDL (the GEMM launched as the quantization kernel's programmatic dependent) needs sm_90's griddepcontrol:
    never on the CPU, under the interpreter, or on older GPUs; QUANTKIT_PDL=0 turns it off."""
    from quantkit.kernels import common

    cuda = torch.device("cuda", 0)
    capability = {"now": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["now"])
    monkeypatch.setattr(common, "interpreting", lambda: False)
    cases = [((9, 0), None, True), ((10, 0), None, True), ((8, 0), None, False), ((9, 0), "0", False)]
    for cap, env, expected in cases:
        capability["now"] = cap
        if env is None:
            monkeypatch.delenv("QUANTKIT_PDL", raising=False)
        else:
            monkeypatch.setenv("QUANTKIT_PDL", env)
        common.dependent_launch.cache_clear()
        assert common.dependent_launch(cuda) is expected, (cap, env)
        # the GEMM waits (PDL constexpr) exactly when it is launched early (launch_pdl)
        assert common.dependent_launch_args(cuda) == (dict(PDL=True, launch_pdl=True) if expected else dict(PDL=False))
    common.dependent_launch.cache_clear()
    assert not common.dependent_launch(torch.device("cpu"))
    monkeypatch.setattr(common, "interpreting", lambda: True)
    common.dependent_launch.cache_clear()
    assert not common.dependent_launch(cuda)
    common.dependent_launch.cache_clear()
