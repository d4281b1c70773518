"""W4A16 Triton kernels against a float64 reference, run by Triton's CPU interpreter (small shapes)."""

from __future__ import annotations

import os
from dataclasses import replace

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels are decorated at import

import pytest
import torch
from quantkit.kernels.autotune import candidates, m_bucket
from quantkit.kernels.common import tile_counters
from quantkit.kernels.layout import pack_along_rows
from quantkit.kernels.spec import TileConfig
from quantkit.kernels.w4a16 import dequantize, w4a16_matmul

from quantkit.nn.qlinear import QuantLinear

TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def random_layer(k: int, n: int, group: int, dtype: torch.dtype, sym: bool, bias: bool = True,
                 act_bits: int = 16, two_level: bool = False, seed: int = 0) -> QuantLinear:
    """A QuantLinear with random codes, scales, zero points and bias (never zeros)."""
    gen = torch.Generator().manual_seed(seed)
    layer = QuantLinear(k, n, 4, group, bias, act_bits, two_level, dtype)
    groups = layer.scales.shape[0]
    layer.qweight.copy_(pack_along_rows(torch.randint(0, 16, (k, n), generator=gen, dtype=torch.uint8), 4))
    if two_level:  # QQQ-like: group scales in (1, 8.5), (q - 8) * scale stays inside int8
        layer.scales.copy_((1 + 7.5 * torch.rand(groups, n, generator=gen)).to(dtype))
        layer.channel_scales.copy_(0.001 + 0.01 * torch.rand(n, generator=gen))
    else:
        layer.scales.copy_((0.005 + 0.02 * torch.rand(groups, n, generator=gen)).to(dtype))
    zeros = torch.full((groups, n), 8) if sym else torch.randint(0, 16, (groups, n), generator=gen)
    layer.zeros.copy_(zeros.to(torch.uint8))
    if bias:
        layer.bias.copy_(torch.randn(n, generator=gen).to(dtype))
    return layer


def reference_w4a16(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """float64 x @ ((q - z) * s)^T + b, from the unpacked codes."""
    w = layer.dequantized_weight().double()  # exact: (q - z) * s in the scale dtype, then widened
    out = x.double() @ w.t()
    return out if layer.bias is None else out + layer.bias.double()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every torch.empty the kernels allocate starts as NaN (floats) or -77 (ints): unwritten elements show."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -77)

    monkeypatch.setattr(torch, "empty", poisoned)


def check(layer: QuantLinear, m: int, config: dict, seed: int = 1) -> None:
    x = torch.randn(m, layer.in_features, generator=torch.Generator().manual_seed(seed)).to(layer.scales.dtype)
    zeros = None if bool((layer.zeros == 8).all()) else layer.zeros
    out = w4a16_matmul(x, layer.qweight, layer.scales, zeros, layer.bias, layer.group_size, config)
    assert out.shape == (m, layer.out_features) and out.dtype == x.dtype
    assert not out.isnan().any(), f"unwritten outputs with {config}"
    assert relative_error(out, reference_w4a16(layer, x)) < TOLERANCE[x.dtype], config


GEMV = TileConfig("gemv", block_m=1, block_n=32, block_k=64, split_k=1, num_warps=4, num_stages=2)
GEMM = TileConfig("gemm", block_m=16, block_n=32, block_k=32, split_k=1, num_warps=4, num_stages=2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 64, 128, -1])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.usefixtures("poisoned_outputs")
def test_every_path_matches_float64(dtype, group, sym):
    layer = random_layer(256, 40, group, dtype, sym, seed=group + 7 * sym)  # N=40: a partial N tile
    for m, config in [(1, GEMV), (3, replace(GEMV, split_k=2, block_k=128)), (2, GEMM),
                      (5, replace(GEMM, block_k=64, split_k=3)), (19, replace(GEMM, block_n=64)),
                      (4, TileConfig("dequant_mm")), (3, replace(GEMM, kernel="gemm_sliced", block_k=128)),
                      (17, replace(GEMM, kernel="gemm_sliced", block_k=256, split_k=2))]:
        check(layer, m, config)


@pytest.mark.parametrize(("k", "n", "m"), [(96, 24, 7), (512, 64, 8), (160, 8, 1)])
@pytest.mark.usefixtures("poisoned_outputs")
def test_default_configs_for_odd_shapes(k, n, m):
    layer = random_layer(k, n, 32, torch.float16, sym=False, bias=False, seed=k)
    for config in candidates("w4a16", m, n, k, 32)[:3]:
        check(layer, m, config)


@pytest.mark.parametrize(("m", "split"), [(1, 1), (1, 3), (4, 4), (2, 8)])
@pytest.mark.usefixtures("poisoned_outputs")
def test_gemv_rows_and_runtime_splits(m, split):
    """The gemv path's x-row grid axis and runtime K split (uneven: 3 splits of 8 K tiles), partial N tile."""
    layer = random_layer(512, 40, 64, torch.float16, sym=False, seed=split)
    check(layer, m, replace(GEMV, block_n=64, split_k=split), seed=m)


@pytest.mark.parametrize("config", [replace(GEMV, split_k=3), replace(GEMM, block_k=64, split_k=4)])
def test_split_k_counters_reset_and_repeat_bit_exactly(config):
    """The in-kernel split-K reduce leaves every tile counter at zero (so the next call, or CUDA-graph
    replay, starts clean) and sums partials in a fixed order: repeated calls agree bit for bit."""
    layer = random_layer(512, 40, 64, torch.float16, sym=False, seed=3)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(4)).half()
    outs = [w4a16_matmul(x, layer.qweight, layer.scales, layer.zeros, layer.bias, 64, config) for _ in range(3)]
    assert not tile_counters(x.device).any()
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert relative_error(outs[0], reference_w4a16(layer, x)) < TOLERANCE[torch.float16]


def test_gemv_default_split_fills_the_gpu_and_keeps_two_k_tiles():
    for k, n in ((4096, 4096), (14336, 4096), (4096, 28672), (8192, 57344)):
        gemvs = [c for c in candidates("w4a16", 1, n, k, 128) if c.kernel in ("gemv", "gemv_h2")]
        for cfg in gemvs:
            if cfg.with_split(2 * cfg.split_k) in gemvs:  # the extra half-depth split of a tile
                continue
            k_tiles, programs = k // cfg.block_k, -(-n // cfg.block_n) * cfg.split_k
            assert cfg.split_k == 1 or k_tiles >= 2 * cfg.split_k
            assert programs >= 4 * 132 or 2 * cfg.split_k > min(16, k_tiles // 2)  # as deep as it may go


def test_dequantize_is_the_reference_weight():
    layer = random_layer(128, 48, 64, torch.float16, sym=False)
    w = dequantize(layer.qweight, layer.scales, layer.zeros, 64)
    torch.testing.assert_close(w, layer.dequantized_weight().t(), rtol=0, atol=0)


def test_candidates_fit_shape_and_group():
    assert [m_bucket(m) for m in (1, 3, 16, 17, 5000)] == [1, 4, 16, 32, 4096]
    assert candidates("w4a16", 1, 4096, 4096, 128)[0].kernel == "gemv_h2"
    assert candidates("w4a16", 4096, 4096, 4096, 128)[0].kernel == "dequant_mm"
    for cfg in candidates("w4a16", 64, 64, 96, 32):
        assert 96 % cfg.block_k == 0


@pytest.mark.parametrize("x_scale", [1.0, 3e4])
@pytest.mark.parametrize("sym", [True, False])
def test_half2_gemv_numerics_match_float64(x_scale, sym):
    """gemv_h2's fp16 rounding (emulated step by step) stays within fp16 tolerance, and finite for
    activations near the top of the fp16 range (|x| up to 3e4 * 4): the 2**-6 pre-scale prevents overflow."""
    from quantkit.kernels.w4a16 import half2_gemv_reference

    layer = random_layer(512, 48, 128, torch.float16, sym, bias=False, seed=3)
    x = (torch.randn(3, 512, generator=torch.Generator().manual_seed(5)) * x_scale).clamp(-65000, 65000).half()
    zeros = None if sym else layer.zeros
    out = half2_gemv_reference(x, layer.qweight, layer.scales, zeros, 128)
    assert out.isfinite().all()
    assert relative_error(out, reference_w4a16(layer, x)) < TOLERANCE[torch.float16]


GEMV_H2_COMPILE = """
import sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from quantkit.kernels.w4a16 import _w4a16_gemm_kernel, _w4a16_gemv_kernel
from quantkit.kernels.w4a8 import _w4a8_gemv_kernel
common = {"qw_ptr": "*i32", "z_ptr": "*u8", "bias_ptr": "*fp16", "out_ptr": "*fp16", "part_ptr": "*fp32",
          "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "SPLIT_K": "i32", "GROUP": "constexpr",
          "HAS_ZEROS": "constexpr", "HAS_BIAS": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
          "IS_SPLIT": "constexpr", "HALF2": "constexpr"}
w4a16 = {**common, "x_ptr": "*fp16", "s_ptr": "*fp16"}
w4a8 = {**common, "xq_ptr": "*i8", "ts_ptr": "*fp32", "cs_ptr": "*fp32", "gs_ptr": "*fp16", "TWO_LEVEL": "constexpr"}
gemm = {**w4a16, "SPLIT_K": "constexpr", "BLOCK_M": "constexpr", "UPCAST_DOT": "constexpr", "SLICED": "constexpr"}
for zeros in (False, True):
    consts = {"GROUP": 128, "HAS_ZEROS": zeros, "HAS_BIAS": True, "BLOCK_N": 64, "BLOCK_K": 128,
              "IS_SPLIT": True, "HALF2": True}
    builds = [(_w4a16_gemv_kernel, w4a16, consts)] + [
        (_w4a8_gemv_kernel, w4a8, {**consts, "TWO_LEVEL": two, "GROUP": 128 if two else 4096}) for two in (0, 1)]
    builds += [(_w4a16_gemm_kernel, gemm, {"GROUP": group, "HAS_ZEROS": zeros, "HAS_BIAS": True, "BLOCK_M": 16,
                "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2, "UPCAST_DOT": False, "SLICED": True, "HALF2": True})
               for group in (128, 32)]  # one scale per tile (applied after the dots), per-row scales
    for fn, sig, constexprs in builds:
        sig = {name: sig[name] for name in fn.arg_names}
        kernel = compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))
        assert "lop3.b32" in kernel.asm["ptx"] and kernel.asm["cubin"], (fn, zeros)
        assert "atom" in kernel.asm["ptx"], "split-K counter missing"
print("compiled")
"""


def compile_for_sm90(script: str) -> None:
    """Runs a compile script with the interpreter off (a fresh process: kernels are decorated at import);
    it must print "compiled". Skips where Triton's bundled ptxas is missing."""
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    # -P: the repo root (cwd) off sys.path, so its kernels/ folder never shadows the PyPI package `kernels`
    run = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True, env=env, timeout=300)
    if run.returncode != 0 and ("ptxas" in run.stderr.lower() and "not found" in run.stderr.lower()):
        pytest.skip("Triton's ptxas is not available here")
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]


def test_gemv_h2_ptx_assembles_for_sm90():
    """The interpreter cannot run inline PTX: compile the W4A16 and W4A8 half2 gemvs (sym and asym, W4A8
    per-channel and two-level, split K) and gemm_h2 (tile and row scales) for sm_90 with Triton's bundled
    ptxas instead, which catches PTX errors without a GPU."""
    compile_for_sm90(GEMV_H2_COMPILE)
