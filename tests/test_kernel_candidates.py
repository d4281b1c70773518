"""The tuner's candidate lists, pinned: for every (scheme, tokens, shape, group, swap layout and its K block, Hopper,
fp16, plain copy) of a broad grid, the configs offered and their order must stay what they were before the kernel
registry (recorded from the rule chain it replaced), so tuning on the GPU picks among exactly the same configs."""

from __future__ import annotations

import hashlib
import itertools
import json

import pytest
from quantkit.kernels import autotune, registry
from quantkit.kernels.spec import M_BUCKETS, Problem, TileConfig

TOKENS = (1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
SHAPES = (  # (K, N): Llama-3 8B qkv / o / gate_up / down, 70B qkv / o / gate_up / down, then small and odd ones
    (4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (8192, 10240), (8192, 8192), (8192, 57344),
    (28672, 8192), (256, 512), (512, 256), (128, 96), (96, 64), (2048, 1536), (1536, 8960))
GROUPS = (32, 64, 128, -1)  # -1: per channel
FLAGS = (False, True)
# sha256 of the JSON of every grid point's arguments and candidate list, recorded before the refactor
EXPECTED = {
    "w4a16": "098a3ee28e8cd736f4fa1d90e2589b832074b089527cb88dfe643d8a5edf6793",
    "w4a8": "2d11e472a590ee40c7ccbcb9357cc8765f58a4c3fc4ff8b9dd1a938532e5f7e3",
}


def _configs(scheme: str, *args: object) -> list[dict]:
    return [c.as_dict() for c in autotune.candidates(scheme, *args)]


def _grid() -> itertools.product:
    return itertools.product(TOKENS, SHAPES, GROUPS, FLAGS, FLAGS, FLAGS, FLAGS)


@pytest.mark.parametrize("scheme", ["w4a16", "w4a8"])
def test_candidate_lists_unchanged(scheme: str) -> None:
    digest = hashlib.sha256()
    for m, (k, n), group, swap, hopper, fp16, plain in _grid():
        group = k if group == -1 else group
        for block in (None, 128, 512) if swap else (None,):
            args = (m, n, k, group, swap, hopper, fp16, block, plain)
            digest.update(json.dumps([args, _configs(scheme, *args)], sort_keys=True).encode())
    assert digest.hexdigest() == EXPECTED[scheme]


def test_spot_checks() -> None:
    """A few cells, readable: what leads and how many configs are timed."""
    one_token_8b_qkv = _configs("w4a16", 1, 6144, 4096, 128, True, True, True, 512, True)
    assert len(one_token_8b_qkv) == 55
    assert one_token_8b_qkv[0] == dict(kernel="swap_gemv", BLOCK_M=1, BLOCK_N=32, BLOCK_K=256, SPLIT_K=4,
                                       num_warps=4, num_stages=1)
    no_plain_copy = _configs("w4a16", 16, 4096, 14336, 128, True, True, True, 512, False)
    assert len(no_plain_copy) == 27 and {c["kernel"] for c in no_plain_copy} <= {"swap", "swap_gemv", "tma_gemv",
                                                                                  "wgmma"}
    many_tokens = [c["kernel"] for c in _configs("w4a8", 4096, 8192, 8192, 128, True, True, True, 128, True)]
    assert many_tokens[:6] == ["wgmma"] * 5 + ["int_mm"]
    plain_gemv = _configs("w4a8", 1, 4096, 4096, 4096, False, False, False, None, True)
    assert len(plain_gemv) == 30 and plain_gemv[0] == dict(kernel="gemv_h2", BLOCK_M=1, BLOCK_N=64, BLOCK_K=256,
                                                           SPLIT_K=8, num_warps=4, num_stages=3)


def test_the_preference_table_names_registered_kernels_and_covers_every_bucket() -> None:
    names = {spec.name for spec in registry.KERNELS}
    for row in autotune.PREFERENCES:
        assert {entry.partition("[")[0] for entry in row.order} <= names, row
    for swap, fp16, large, bucket in itertools.product(FLAGS, FLAGS, FLAGS, M_BUCKETS):
        problem = Problem("w4a16", bucket, 8192 if large else 1024, 8192, 128)
        assert autotune.preference(problem, swap, fp16) in autotune.PREFERENCES


def test_dispatch_finds_each_registered_kernel_by_scheme_and_name() -> None:
    assert len({(spec.scheme, spec.name) for spec in registry.KERNELS}) == len(registry.KERNELS)
    for spec in registry.KERNELS:
        assert registry.kernel(spec.scheme, spec.name) is spec
    assert registry.kernel("w4a8", "gemv_h2").launch is not registry.kernel("w4a16", "gemv_h2").launch
    with pytest.raises(ValueError, match="no w4a8 kernel 'gemm_h2'"):
        registry.kernel("w4a8", "gemm_h2")
    assert registry.SWAP_LAYOUT_KERNELS == {"swap", "swap_gemv", "tma_gemv", "wgmma"}


def test_tile_configs_keep_the_tuning_caches_dict_form() -> None:
    config = TileConfig("swap", 16, 128, 128, 4, 4, 4)
    assert config.as_dict() == dict(kernel="swap", BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, SPLIT_K=4, num_warps=4,
                                    num_stages=4)
    assert TileConfig.from_dict(config.as_dict()) == config
    assert TileConfig("int_mm").as_dict() == {"kernel": "int_mm"}
