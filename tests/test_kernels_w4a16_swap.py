"""The swap-AB W4A16 kernel (register-operand wgmma) and its weight layout, under Triton's CPU interpreter."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels are decorated at import

import pytest
import torch
from quantkit.kernels.w4a16_swap import repack_for_swap, swap_layout_codes, swap_supported, w4a16_swap_matmul
from test_kernels_w4a16 import TOLERANCE, poisoned_outputs, random_layer, reference_w4a16, relative_error  # noqa: F401

from quantkit.nn.qlinear import unpack_along_rows


def test_repack_follows_the_layout_definition() -> None:
    gen = torch.Generator().manual_seed(0)
    qweight = torch.randint(-2**31, 2**31 - 1, (192 // 8, 24), generator=gen, dtype=torch.int32)
    packed = repack_for_swap(qweight)
    assert packed.shape == (24, 192 // 4) and packed.dtype == torch.int16
    assert torch.equal(swap_layout_codes(packed), unpack_along_rows(qweight, 4).to(torch.int32))
    with pytest.raises(ValueError, match="multiple of 64"):
        repack_for_swap(qweight[:4])


def test_supported_shapes() -> None:
    assert swap_supported(4096, 6144, 128, True) and swap_supported(4096, 4096, 4096, True)
    assert not swap_supported(4096, 4096, 128, False)  # zero points: a broadcast, no register operand
    assert not swap_supported(4096, 4096, 32, True) and not swap_supported(4096, 4100, 128, True)


_LAUNCH = dict(kernel="swap", num_warps=4, num_stages=2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [64, 128, -1])
@pytest.mark.usefixtures("poisoned_outputs")
def test_matches_float64(dtype: torch.dtype, group: int) -> None:
    layer = random_layer(256, 128, group, dtype, sym=True, seed=group + 3)
    packed = repack_for_swap(layer.qweight)
    for m, config in [(1, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, SPLIT_K=1)),
                      (19, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=2)),  # two M blocks, split K
                      (5, dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, SPLIT_K=4))]:
        if group != -1:  # a K tile never spans two groups
            config = {**config, "BLOCK_K": min(config["BLOCK_K"], group)}
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(dtype)
        out = w4a16_swap_matmul(x, packed, layer.scales, layer.bias, layer.group_size,
                                config | _LAUNCH)
        assert out.shape == (m, 128) and out.dtype == dtype and not out.isnan().any(), config
        assert relative_error(out, reference_w4a16(layer, x)) < TOLERANCE[dtype], config
    with pytest.raises(ValueError, match="K tile"):
        w4a16_swap_matmul(x, packed, layer.scales, None, 64, dict(config, BLOCK_K=128) | _LAUNCH)
