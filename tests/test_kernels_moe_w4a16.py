"""The grouped W4A16 MoE kernel against float64 (dequantize + per-expert matmul), under Triton's CPU interpreter."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels are decorated at import

import pytest
import torch
from quantkit.kernels.common import (
    StackedExperts,
    align_tokens,
    default_configs,
    moe_candidates,
    supports,
    with_moe_split,
)
from quantkit.kernels.layout import pack_along_rows
from quantkit.kernels.moe_w4a16 import moe_w4a16_forward, moe_w4a16_matmul, moe_w4a16_reference
from quantkit.kernels.spec import TileConfig
from test_kernels_w4a16 import (  # noqa: F401  (poisoned_outputs: a fixture)
    TOLERANCE,
    compile_for_sm90,
    poisoned_outputs,
    relative_error,
)

EXPERTS, TOP_K = 4, 2
SILENT = 3  # no token is routed to this expert


def random_experts(k: int, n: int, group: int, dtype: torch.dtype, sym: bool, seed: int = 0) -> StackedExperts:
    gen = torch.Generator().manual_seed(seed)
    group = k if group == -1 else group
    codes = torch.randint(0, 16, (EXPERTS, k, n), generator=gen, dtype=torch.uint8)
    qweight = torch.stack([pack_along_rows(c, 4) for c in codes])
    scales = (0.005 + 0.02 * torch.rand(EXPERTS, k // group, n, generator=gen)).to(dtype)
    zeros = None if sym else torch.randint(0, 16, (EXPERTS, k // group, n), generator=gen, dtype=torch.uint8)
    return StackedExperts(qweight, scales, zeros, group)


def routing(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """top-2 of experts 0..2 (expert SILENT gets none), weights in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(SILENT, generator=gen)[:TOP_K] for _ in range(tokens)])
    return ids, torch.rand(tokens, TOP_K, generator=gen)


def test_align_tokens_sorts_by_expert_and_pads() -> None:
    ids = torch.tensor([[2, 0], [0, 1], [2, 0]])
    aligned = align_tokens(ids, EXPERTS, 4)
    rows = 6
    assert aligned.sorted_rows.tolist()[:12] == [1, 2, 5, rows, 3, rows, rows, rows, 0, 4, rows, rows]
    assert aligned.block_expert.tolist()[:3] == [0, 1, 2]
    assert all(e == -1 for e in aligned.block_expert.tolist()[3:])
    assert aligned.sorted_rows.numel() == aligned.block_expert.numel() * 4 >= rows + 3 * 3  # 3 experts routed


@pytest.mark.usefixtures("poisoned_outputs")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [32, -1])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize(("tokens", "k", "block_m", "block_k"), [(1, 64, 16, 32), (7, 128, 16, 64), (20, 128, 32, 128)])
def test_grouped_matmul_matches_float64(dtype, group, sym, tokens, k, block_m, block_k) -> None:
    experts = random_experts(k, 64, group, dtype, sym)
    ids, weights = routing(tokens)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    aligned = align_tokens(ids, EXPERTS, block_m)
    config = TileConfig("moe_gemm", block_m, 32, block_k, 1, 4, 2)
    gate_up = moe_w4a16_matmul(x, experts, aligned, config)  # one input row per token, top_k output rows
    down_x = torch.randn(tokens * TOP_K, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    down = moe_w4a16_matmul(down_x, experts, aligned, config, weights.to(dtype))
    for out, ref in ((gate_up, moe_w4a16_reference(x, ids, experts)),
                     (down, moe_w4a16_reference(down_x, ids, experts, weights.to(dtype)))):
        assert out.shape == (tokens * TOP_K, 64) and out.dtype == dtype
        assert not out.isnan().any(), "an output row left unwritten"
        assert relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.usefixtures("poisoned_outputs")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("group", "sym", "split"), [(32, False, 2), (-1, True, 3), (32, True, 5)])
def test_split_k_matches_float64(dtype, group, sym, split) -> None:
    """K = 160 in five K tiles of 32: splits of 2 and 3 take uneven shares, 5 one tile each; expert SILENT has no
    token (its blocks exit), the down projection's routing weight multiplies every partial."""
    k, tokens = 160, 5
    experts = random_experts(k, 48, group, dtype, sym, seed=7)
    ids, weights = routing(tokens, seed=8)
    x = torch.randn(tokens * TOP_K, k, generator=torch.Generator().manual_seed(9)).to(dtype)
    aligned = align_tokens(ids, EXPERTS, 16)
    config = TileConfig("moe_gemm", 16, 32, 32, split, 4, 2)
    for routed in (None, weights.to(dtype)):
        out = moe_w4a16_matmul(x, experts, aligned, config, routed)
        assert not out.isnan().any(), "an output row left unwritten"
        assert relative_error(out, moe_w4a16_reference(x, ids, experts, routed)) < TOLERANCE[dtype]


def test_split_rule_splits_decode_only() -> None:
    """Mixtral-8x7B's experts (hidden 4096, intermediate 14336, 8 experts, top-2): at one token two blocks leave the
    down projection's 64 N tiles far short of the SMs, K is split; at 256 tokens there are tiles enough."""
    def stacked(k: int, n: int) -> StackedExperts:
        return StackedExperts(torch.empty(8, k // 8, n, dtype=torch.int32), torch.empty(8, k // 128, n), None, 128)

    gate_up, down = stacked(4096, 2 * 14336), stacked(14336, 4096)
    decode = default_configs(2, gate_up, down)
    assert decode[0].block_m == decode[1].block_m and decode[1].split_k > 1
    assert all(c.split_k == 1 for c in default_configs(512, gate_up, down))
    config = with_moe_split(decode[1], 2, 8, 14336, 4096)
    assert config.split_k == decode[1].split_k and 14336 // config.block_k >= 2 * config.split_k


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_block_forward_matches_per_expert_loop(dtype) -> None:
    """gate/up stacked along N, SiLU, down with the routing weights, summed over slots: the per-expert loop."""
    hidden, inter, tokens = 64, 32, 9
    gate_up = random_experts(hidden, 2 * inter, 32, dtype, sym=False, seed=3)
    down = random_experts(inter, hidden, 32, dtype, sym=True, seed=4)
    ids, weights = routing(tokens, seed=5)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(6)).to(dtype)
    out = moe_w4a16_forward(x, ids, weights, gate_up, down, torch.nn.functional.silu)
    h = moe_w4a16_reference(x, ids, gate_up)
    a = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
    ref = moe_w4a16_reference(a, ids, down, weights).view(tokens, TOP_K, hidden).sum(dim=1)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    assert relative_error(out, ref) < 2 * TOLERANCE[dtype]


def test_candidates_fit_the_shape() -> None:
    for per_expert in (0.5, 40, 300):
        for group in (32, 128, 768):
            configs = moe_candidates(per_expert, 768, 2048, group)
            assert configs and all(768 % c.block_k == 0 and c.split_k == 1 for c in configs)
            assert all(group % c.block_k == 0 or c.block_k % group == 0 for c in configs)
    assert all(c.block_n <= 64 for c in moe_candidates(1, 128, 64, 128))
    assert [c.block_k for c in moe_candidates(1, 320, 64, 160)] == []  # a K tile would straddle two groups
    assert supports(320, 160) and not supports(80, 16) and not supports(96, 48)


def quantized_tiny_moe(kind: str, sym: bool, act_bits: int = 16, method: str = "rtn", group_size: int = 32):
    from test_engine import random_calibration
    from test_moe import tiny_moe

    from quantkit.config import QuantConfig
    from quantkit.engine import quantize_model
    from quantkit.models import get_adapter

    model = tiny_moe(kind)
    options = dict(smooth_steps=8) if method == "qqq" else {}  # QQQ's smoothing search, kept short
    config = QuantConfig.from_dict(dict(method=method, group_size=group_size, sym=sym, act_bits=act_bits, **options))
    quantize_model(model, get_adapter(model), random_calibration(), config, device="cpu", show_progress=False)
    return model


@pytest.mark.parametrize(("kind", "sym", "dtype"), [("qwen3_moe", True, torch.float16),
                                                    ("mixtral", False, torch.bfloat16)])
def test_quantized_moe_model_logits_through_the_grouped_kernel(monkeypatch, kind, sym, dtype) -> None:
    """The block's grouped path (CUDA only in use; forced here on the CPU, the kernel interpreted) gives the logits
    of its per-expert loop."""
    from quantkit.kernels import registry

    from quantkit.models.moe import UnfusedMoe

    model = quantized_tiny_moe(kind, sym).to(dtype)
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    calls = []
    monkeypatch.setitem(registry.MOE_FORWARDS, "w4a16",
                        lambda *args, real=registry.MOE_FORWARDS["w4a16"]: calls.append(1) or real(*args))
    with torch.no_grad():
        loop = model(ids).logits.double()
        assert not calls  # on the CPU the block keeps its loop
        monkeypatch.setattr(UnfusedMoe, "_wants_grouped", lambda self, x: True)
        grouped = model(ids).logits.double()
    assert len(calls) == len(model.model.layers)  # every block went through the kernel
    block = model.model.layers[0].mlp
    assert block.grouped_experts() is block.grouped_experts()  # stacked once, then reused
    assert relative_error(grouped, loop) < TOLERANCE[dtype]


def test_grouped_path_waits_for_quantization() -> None:
    from test_moe import tiny_moe

    from quantkit.models import get_adapter
    from quantkit.models.moe import unfuse_experts

    plain = tiny_moe("mixtral", torch.float16)
    unfuse_experts(plain, get_adapter(plain))
    block = plain.model.layers[0].mlp
    assert block.grouped_experts() is None and block._grouped is None  # decided again once quantized


def test_stacking_follows_the_expert_order() -> None:
    """gate_up's expert e holds expert e's gate then up projection, bit for bit; down likewise."""
    from quantkit.models.moe import _stack

    model = quantized_tiny_moe("qwen3_moe", sym=False).to(torch.float16)
    experts = model.model.layers[0].mlp.experts
    gate_up = _stack([[expert.gate_proj, expert.up_proj] for expert in experts])
    inter = experts[0].gate_proj.out_features
    for e, expert in enumerate(experts):
        for half, linear in ((slice(0, inter), expert.gate_proj), (slice(inter, None), expert.up_proj)):
            assert torch.equal(gate_up.qweight[e][:, half], linear.qweight)
            assert torch.equal(gate_up.scales[e][:, half], linear.scales)
            assert torch.equal(gate_up.zeros[e][:, half], linear.zeros)


MOE_COMPILE = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from quantkit.kernels.common import MOE_TILES
from quantkit.kernels.moe_w4a16 import _moe_w4a16_kernel

tiles = sorted({tile for group in MOE_TILES.values() for tile in group})
builds = ([("fp16", False, True, tile, 1) for tile in tiles] + [("bf16", True, False, tiles[0], 1)]
          + [("fp16", False, True, tiles[0], 4)])
for dtype, zeros, routed, (bm, bn, bk, warps, stages), split in builds:
    sig = {"x_ptr": "*" + dtype, "qw_ptr": "*i32", "s_ptr": "*" + dtype, "z_ptr": "*u8", "route_w_ptr": "*fp32",
           "out_ptr": "*" + dtype, "part_ptr": "*fp32", "count_ptr": "*i32", "sorted_rows_ptr": "*i32",
           "block_expert_ptr": "*i32", "N": "i32", "K": "i32", "rows": "i32", "X_ROW_DIV": "constexpr",
           "GROUP": "constexpr", "HAS_ZEROS": "constexpr", "MUL_ROUTED": "constexpr", "BLOCK_M": "constexpr",
           "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "SPLIT_K": "i32", "IS_SPLIT": "constexpr",
           "UPCAST_DOT": "constexpr", "DOT_PRECISION": "constexpr"}
    consts = {"X_ROW_DIV": 1 if routed else 8, "GROUP": 128, "HAS_ZEROS": zeros, "MUL_ROUTED": routed,
              "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "IS_SPLIT": split > 1, "UPCAST_DOT": False,
              "DOT_PRECISION": "tf32"}
    kernel = compile(ASTSource(fn=_moe_w4a16_kernel, signature=sig, constexprs=consts),
                     target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    ptx = kernel.asm["ptx"]
    assert ("mma.sync" in ptx or "wgmma" in ptx) and kernel.asm["cubin"], (dtype, bm, bn, bk, split)
print("compiled")
"""


def test_every_candidate_tile_compiles_for_sm90_on_tensor_cores() -> None:
    """The interpreter runs none of the compiled path (the early exit of an empty block, the static upcast branch,
    the int64 expert offsets): compile every candidate tile (fp16, routed) and a bf16 one with zero points for sm_90
    with Triton's bundled ptxas."""
    compile_for_sm90(MOE_COMPILE)


def test_bench_moe_tiny_runs_on_the_cpu(tmp_path) -> None:
    """benchmarks/bench_moe.py --tiny: every method's output checked against fp32 (W4A8: its own int8 math) and the
    grouped kernels timed, W4A16 with and without split K, W4A8."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root / "benchmarks"), "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "-P", str(root / "benchmarks" / "bench_moe.py"), "--tiny", "--out",
                          str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [r["tokens"] for r in rows] == [1, 5]
    ours = ("grouped", "grouped_splitk", "grouped_w4a8")
    for r in rows:
        assert {*ours, "dequant_loop", "fp16_loop"} <= set(r["times_us"])
        assert all(e < 1e-2 for m, e in r["errors"].items() if m in (*ours, "dequant_loop", "fp16_loop"))
        assert "SPLIT_K: 2" in r["best_config"]["grouped_splitk"]
    assert "| tiny | 5 |" in (tmp_path / "results.md").read_text()
