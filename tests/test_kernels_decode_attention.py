"""The split-cache decode attention kernel (kernels/decode_attention.py) against float64 attention, under Triton's
interpreter; its sm_90 compile (tensor-core mma, no spills); the errors for what it cannot take."""

from __future__ import annotations

import pytest
import torch
from quantkit.kernels import decode_attention_for
from quantkit.kernels.decode_attention import BLOCK_L, decode_attention, decode_attention_reference
from test_kernels_w4a16 import compile_for_sm90, poisoned_outputs  # noqa: F401  (a fixture)


def attention_inputs(batch: int, kv_heads: int, rows: int, length: int, head_dim: int, dtype: torch.dtype,
                     seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, kv_heads, n, head_dim, generator=gen).to(dtype) for n in (rows, length, length))
    return q, k, v


# (batch, kv heads, query heads per kv head, tokens, cache length, head dim, positions, window): GQA groups of
# 1 / 3 / 4, odd row counts, caches of one tile, of a partial last tile and of several chunks, positions at a chunk's
# first and last slots, several tokens of one step at consecutive positions (a prefill's rows); then sliding windows
# (0: none) shorter than a tile, of several tiles and chunks, starting at slot 0 and past it, several tokens (each
# row its own window start), positions that are not consecutive (the last split reads past the span).
CASES = [
    (1, 2, 4, 1, 200, 64, [137], 0),
    (2, 1, 3, 2, 130, 32, [63, 64], 0),
    (1, 2, 1, 3, 64, 16, [0, 1, 2], 0),
    (1, 1, 5, 1, 300, 128, [299], 0),
    (1, 1, 4, 8, 140, 256, list(range(100, 108)), 0),  # Gemma 3's heads of 256, 32 rows: 8 warps
    (2, 2, 4, 1, 300, 32, [250], 20),
    (2, 1, 3, 3, 400, 64, [390, 391, 392], 130),
    (2, 2, 2, 2, 200, 16, [5, 6], 64),
    (2, 1, 4, 2, 260, 32, [100, 230], 40),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.usefixtures("poisoned_outputs")  # a row or split left unwritten shows as NaN
def test_decode_attention_matches_float64(case, dtype: torch.dtype, splits: int | None) -> None:
    batch, kv_heads, group, tokens, length, head_dim, positions, window = case
    q, k, v = attention_inputs(batch, kv_heads, group * tokens, length, head_dim, dtype)
    positions = torch.tensor(positions)
    out = decode_attention(q, k, v, positions, head_dim ** -0.5, window, splits=splits)
    expected = decode_attention_reference(q, k, v, positions, head_dim ** -0.5, window)
    assert out.dtype == dtype and not out.isnan().any()
    tol = 2e-3 if dtype == torch.float16 else 1.6e-2  # p rounded to the cache's dtype, out to q's
    torch.testing.assert_close(out.double(), expected.double(), atol=tol, rtol=tol)
    if window and positions.max() >= window:  # a window that leaves slots out changes the output
        whole = decode_attention_reference(q, k, v, positions, head_dim ** -0.5)
        assert (whole.double() - expected.double()).abs().max() > 0.05


def test_slots_past_a_rows_position_do_not_count() -> None:
    """Garbage (huge values) after each row's position in the cache leaves the output as it is; with a window the
    slots before it are not read at all."""
    q, k, v = attention_inputs(1, 2, 8, 3 * BLOCK_L, 32, torch.float16)
    positions = torch.tensor([70, 71])
    clean = decode_attention(q, k, v, positions, 0.2)
    k[:, :, 72:], v[:, :, 72:] = 1e4, -1e4
    torch.testing.assert_close(decode_attention(q, k, v, positions, 0.2), clean, atol=0, rtol=0)
    windowed = decode_attention(q, k, v, positions, 0.2, 10)
    k[:, :, :61], v[:, :, :61] = float("nan"), float("nan")  # before every row's window (row 70 sees 61..70):
    # the kernel must not even read them (0 * NaN is NaN)
    torch.testing.assert_close(decode_attention(q, k, v, positions, 0.2, 10), windowed, atol=0, rtol=0)


def test_what_the_kernel_cannot_take_fails_clearly(monkeypatch) -> None:
    q, k, v = attention_inputs(1, 1, 4, 64, 48, torch.float16)
    with pytest.raises(ValueError, match="head_dim a power of two"):
        decode_attention(q, k, v, torch.tensor([3]), 1.0)
    q, k, v = attention_inputs(1, 1, 65, 64, 32, torch.float16)
    with pytest.raises(ValueError, match="at most 64 rows"):
        decode_attention(q, k, v, torch.tensor([3]), 1.0)
    q, k, v = attention_inputs(1, 1, 33, 64, 256, torch.float16)
    with pytest.raises(ValueError, match=r"\(32 at head_dim 256\)"):
        decode_attention(q, k, v, torch.tensor([3]), 1.0)
    q, k, v = attention_inputs(1, 1, 4, 64, 32, torch.float16)
    with pytest.raises(ValueError, match="window -1"):
        decode_attention(q, k, v, torch.tensor([3]), 1.0, -1)
    with pytest.raises(ValueError, match="do not match"):
        decode_attention(q, k[:, :, :, :16], v, torch.tensor([3]), 1.0)
    assert decode_attention_for(torch.device("cpu"), 48) is None  # the decoder keeps SDPA
    assert decode_attention_for(torch.device("cpu"), 64) is not None  # CPU: only under the interpreter (conftest)
    monkeypatch.setenv("QUANTKIT_DECODE_ATTENTION", "0")
    assert decode_attention_for(torch.device("cpu"), 64) is None


DECODE_ATTENTION_COMPILE = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from quantkit.kernels import decode_attention_rows
from quantkit.kernels.decode_attention import _decode_attention_kernel, tile_shape
from quantkit.kernels.sm90 import ptxas_report

# every head size and row tile the decoder can launch (fp16), and bf16 at Llama-3-8B's decode step (4 rows of 128)
shapes = [("fp16", head_dim, rows) for head_dim in (16, 32, 64, 128, 256) for rows in (16, 32, 64)
          if rows <= decode_attention_rows(head_dim)]
for (dtype, head_dim, rows), has_window in [(shape, False) for shape in shapes] + [(("bf16", 128, 4), False),
                                                                               (("fp16", 256, 16), True)]:
    block_r, num_warps = tile_shape(head_dim, rows)
    sig = {"q_ptr": "*" + dtype, "k_ptr": "*" + dtype, "v_ptr": "*" + dtype, "pos_ptr": "*i64", "out_ptr": "*" + dtype,
           "part_ptr": "*fp32", "lse_ptr": "*fp32", "count_ptr": "*i32", "scale": "fp32", "rows": "i32",
           "tokens": "i32", "length": "i32", "chunk": "i32", "window": "i32", "HEAD_DIM": "constexpr",
           "BLOCK_R": "constexpr", "BLOCK_L": "constexpr", "IS_SPLIT": "constexpr", "HAS_WINDOW": "constexpr",
           "UPCAST_DOT": "constexpr"}
    consts = {"HEAD_DIM": head_dim, "BLOCK_R": block_r, "BLOCK_L": 64, "IS_SPLIT": True, "HAS_WINDOW": has_window,
              "UPCAST_DOT": False}
    source = ASTSource(fn=_decode_attention_kernel, signature=sig, constexprs=consts)
    kernel = compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    ptx = kernel.asm["ptx"]
    assert "mma.sync" in ptx or "wgmma" in ptx, "q k^T and p v not on tensor cores"
    assert "atom.global.gpu.acq_rel.add" in ptx and "ld.global.cg" in ptx, "no in-kernel combine of the splits"
    report = ptxas_report(ptx)
    assert report["spill_bytes"] == 0, (dtype, head_dim, rows, has_window, report["text"][-2000:])
print("compiled")
"""


def test_decode_attention_compiles_for_sm90_on_tensor_cores() -> None:
    compile_for_sm90(DECODE_ATTENTION_COMPILE)
