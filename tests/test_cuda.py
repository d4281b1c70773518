"""On a CUDA GPU only (skipped elsewhere; on the device: `python -P -m pytest -q tests/test_cuda.py`): QuantLinears
moved to the GPU as users move them run the compiled kernels right, eagerly, through torch.compile and from CUDA
graphs, and hold one copy of the weight where quantkit.kernels.keeps_plain_copy says so; the decode attention kernel
against float64, eagerly and from a graph."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
try:
    from bench_kernels import random_layer
finally:
    sys.path.pop(0)

from quantkit.kernels import keeps_plain_copy  # noqa: E402
from quantkit.kernels.common import tile_counters  # noqa: E402

from quantkit.nn.qlinear import QuantLinear  # noqa: E402
from quantkit.qtensor import fp8_quantize  # noqa: E402

K, N = 4096, 2048


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.fixture(autouse=True)
def _fresh_tuning_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTKIT_CACHE_DIR", str(tmp_path))


@pytest.mark.parametrize(("scheme", "group"), [("w4a16", 128), ("w4a8", 128), ("w4a8", -1)])
def test_a_layer_moved_to_the_gpu_runs_its_kernels_on_one_weight_copy(scheme: str, group: int) -> None:
    """Built on the CPU, then .cuda(): outputs match the reference path at 1 to 300 tokens eagerly, compiled and
    replayed from a graph; where the plain copy is not kept, qweight stays in host memory (state dict unchanged)
    and the GPU holds half the packed bytes a plain copy would add."""
    layer = random_layer(K, N, group, scheme, bias=True, device="cpu")
    packed = layer.qweight.clone()
    tile_counters(torch.device("cuda"))  # once per device: not the layer's
    before = torch.cuda.memory_allocated()
    layer.cuda()
    on_gpu = torch.cuda.memory_allocated() - before
    lean = not keeps_plain_copy(layer.scales.device)
    assert (layer.qweight.device.type == "cpu") == lean
    assert torch.equal(layer.state_dict()["qweight"].cpu(), packed)
    extra = sum(t.nbytes for t in (layer.scales, layer.zeros, layer.bias)) + (
        0 if layer.channel_scales is None else layer.channel_scales.nbytes)
    copies = on_gpu / packed.nbytes - extra / packed.nbytes
    assert copies < (1.3 if lean else 2.3), f"{on_gpu} bytes on the GPU for {packed.nbytes} packed"
    tolerance = 2e-3 if scheme == "w4a16" else 1e-2
    compiled = torch.compile(layer, fullgraph=True)
    for m in (1, 5, 64, 300):
        x = torch.randn(m, K, device="cuda", dtype=torch.float16)
        ref = layer.reference_forward(x)
        assert relative_error(layer(x), ref) < tolerance, m
        assert relative_error(compiled(x), ref) < tolerance, m
    x = torch.randn(16, K, device="cuda", dtype=torch.float16)
    layer(x)  # tuned outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert relative_error(out, layer.reference_forward(x)) < tolerance
    layer.cpu()
    assert layer._kernel is None and layer.qweight.device.type == "cpu"
    layer.cuda()
    assert relative_error(layer(x), layer.reference_forward(x)) < tolerance


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_an_fp8_layer_runs_its_tuned_kernel_on_one_weight_copy(dtype: torch.dtype, caplog) -> None:
    """FP8 on the GPU (sm_89+): every kernel config is checked against the reference path by the tuner, the chosen
    one matches it eagerly, compiled (rounding fused by Inductor) and from a graph at 1 to 300 tokens; the GPU holds
    the e4m3 weight once (the K-packed bytes stay in host memory)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no fp8 tensor cores")
    torch.manual_seed(0)
    layer = QuantLinear.from_quantized(fp8_quantize(torch.randn(N, K) * 0.02), torch.randn(N), dtype, act_bits=8)
    before = torch.cuda.memory_allocated()
    layer.cuda()
    on_gpu = torch.cuda.memory_allocated() - before
    with caplog.at_level(logging.WARNING, logger="quantkit.kernels.autotune"):
        compiled = torch.compile(layer, fullgraph=True)
        for m in (1, 5, 64, 300):
            x = torch.randn(m, K, device="cuda", dtype=dtype)
            ref = layer.reference_forward(x)
            assert relative_error(layer(x), ref) < 1e-2, m
            assert relative_error(compiled(x), ref) < 1e-2, m
    assert not [r for r in caplog.records if "wrong results" in r.getMessage()], caplog.text
    assert layer.qweight.device.type == "cpu" and on_gpu < 1.1 * N * K
    x = torch.randn(16, K, device="cuda", dtype=dtype)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert relative_error(out, layer.reference_forward(x)) < 1e-2


def test_a_compiled_decoder_step_on_quantized_layers_matches_the_eager_one() -> None:
    """The static-cache decoder on a GPU: fused quantized q/k/v and gate/up, torch.compile(fullgraph) of a step."""
    from test_adapters import tiny_model

    from quantkit.config import QuantConfig
    from quantkit.data import CalibrationSet
    from quantkit.engine import quantize_model
    from quantkit.eval.speed import compiled_step
    from quantkit.eval.static_decoder import StaticDecoder
    from quantkit.models import get_adapter

    model = tiny_model("llama")
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    quantize_model(model, get_adapter(model), CalibrationSet(ids, torch.ones_like(ids)),
                   QuantConfig(method="rtn", group_size=32), device="cpu", show_progress=False)
    model.cuda().half()
    decoder = StaticDecoder(model, batch_size=2, max_len=16)
    prompt = ids[:2, :8].cuda()
    decoder(prompt, torch.arange(8, device="cuda"))
    step_ids, position = ids[:2, 8:9].cuda(), torch.tensor([8], device="cuda")
    eager = decoder(step_ids, position).float()
    decoder(prompt, torch.arange(8, device="cuda"))
    compiled = compiled_step(decoder)(step_ids, position).float()
    assert relative_error(compiled, eager) < 2e-2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 16])
def test_decode_attention_on_the_gpu_matches_float64_eagerly_and_from_a_graph(dtype: torch.dtype, batch: int) -> None:
    """The decode attention kernel at Llama-3-8B's decode shapes (8 kv heads of 4 query heads, head_dim 128, 576
    cache slots, a step at position 512), eagerly and replayed from a CUDA graph with the caches rewritten."""
    from quantkit.kernels.decode_attention import decode_attention, decode_attention_reference

    q, k, v = (torch.randn(batch, 8, n, 128, device="cuda", dtype=dtype) for n in (4, 576, 576))
    positions = torch.tensor([512], device="cuda")
    tol = 4e-3 if dtype == torch.float16 else 2e-2
    assert relative_error(decode_attention(q, k, v, positions, 128 ** -0.5),
                          decode_attention_reference(q, k, v, positions, 128 ** -0.5)) < tol
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, positions, 128 ** -0.5)
    k.normal_(), v.normal_(), positions.fill_(300)
    graph.replay()
    assert relative_error(out, decode_attention_reference(q, k, v, positions, 128 ** -0.5)) < tol


@pytest.mark.parametrize("head_dim,group,tokens", [(64, 3, 1), (128, 4, 8), (128, 4, 16), (256, 4, 1), (256, 4, 8)])
def test_decode_attention_on_the_gpu_takes_every_row_tile(head_dim: int, group: int, tokens: int) -> None:
    """The row tiles of 8 warps (kernels/decode_attention.py: tile_shape) and SmolLM2's 4 warps at heads of 64,
    Gemma 3's heads of 256, several tokens a step (a short prefill), against float64."""
    from quantkit.kernels.decode_attention import decode_attention, decode_attention_reference

    q, k, v = (torch.randn(2, 2, n, head_dim, device="cuda", dtype=torch.float16) for n in (group * tokens, 700, 700))
    positions = torch.arange(600, 600 + tokens, device="cuda")
    assert relative_error(decode_attention(q, k, v, positions, head_dim ** -0.5),
                          decode_attention_reference(q, k, v, positions, head_dim ** -0.5)) < 4e-3


def test_a_reloaded_qqq_export_runs_the_two_level_w4a8_kernels(tmp_path) -> None:
    """QQQ g64 quantized on the GPU (the no-harm guard's extra forwards there too), exported, reloaded and moved to
    the GPU: every layer is two-level again, has its kernel, and the kernels compute what the reference path does."""
    from test_adapters import tiny_model

    from quantkit.config import QuantConfig
    from quantkit.data import CalibrationSet
    from quantkit.engine import quantize_model
    from quantkit.export import export_checkpoint, quantized_modules
    from quantkit.models import get_adapter
    from quantkit.reload import load_quantized

    model = tiny_model("llama")
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    config = QuantConfig(method="qqq", group_size=32)
    quantize_model(model, get_adapter(model), CalibrationSet(ids, torch.ones_like(ids)), config, device="cuda",
                   show_progress=False)
    folder = export_checkpoint(model.cpu(), None, tmp_path / "qqq", config, "compressed-tensors", dtype="float16")
    reloaded, _ = load_quantized(folder, dtype=torch.float16)
    reloaded.cuda()
    for name, layer in quantized_modules(reloaded).items():
        x = torch.randn(3, layer.in_features, device="cuda", dtype=torch.float16)
        assert layer.channel_scales is not None and layer._kernel is not None, name
        assert relative_error(layer(x), layer.reference_forward(x)) < 1e-2, name
    awq = tiny_model("llama")
    report = quantize_model(awq, get_adapter(awq), CalibrationSet(ids, torch.ones_like(ids)),
                            QuantConfig(method="awq", group_size=32), device="cuda", show_progress=False)
    assert all("output_error" in layer["guard"] for layer in report.layers)


def test_fp8_block_scaled_weights_widen_on_the_gpu_to_the_cpu_bytes() -> None:
    """A streamed FP8 layer is widened on its work device: the same bf16 bytes as the host's widening."""
    from quantkit.streaming.checkpoint import BlockScaledFp8

    generator = torch.Generator().manual_seed(0)
    codes = (torch.randn(300, 520, generator=generator) * 4).to(torch.float8_e4m3fn)
    weight = BlockScaledFp8(codes, torch.rand(3, 5, generator=generator) + 0.1, (128, 128))
    assert torch.equal(weight.widen(torch.bfloat16, "cuda").cpu(), weight.widen(torch.bfloat16))
