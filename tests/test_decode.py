"""quantkit.eval.static_decoder: the static-cache decoder that times models end to end computes what transformers
computes."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from test_adapters import TINY, tiny_model
from torch import nn
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from quantkit.config import QuantConfig
from quantkit.data import CalibrationSet
from quantkit.engine import quantize_model
from quantkit.eval.report import speed_rows
from quantkit.eval.runner import run_eval
from quantkit.eval.static_decoder import StaticDecoder, fuse_linears
from quantkit.models import get_adapter
from quantkit.nn.qlinear import QuantLinear
from quantkit.qtensor import QuantizationError

PROMPT, STEPS = 7, 4


def random_ids(batch: int, tokens: int) -> torch.Tensor:
    return torch.randint(0, 128, (batch, tokens), generator=torch.Generator().manual_seed(1))


def check_against_transformers(model: nn.Module, atol: float = 1e-4) -> None:
    """Prefill logits at every position, then one decode step at a time, against transformers' forward over the
    whole sequence (no cache), fp32. Every step, the prefill's 7 tokens too, runs the decode attention kernel
    (interpreted; at most DECODE_ATTENTION_ROWS query rows per kv head)."""
    ids = random_ids(2, PROMPT + STEPS)
    with torch.no_grad():
        expected = model(ids).logits
    decoder = StaticDecoder(model, batch_size=2, max_len=16)
    assert decoder.decode_attention is not None
    logits = decoder(ids[:, :PROMPT], torch.arange(PROMPT))
    torch.testing.assert_close(logits, expected[:, :PROMPT], atol=atol, rtol=0)
    for position in range(PROMPT, PROMPT + STEPS):
        step = decoder(ids[:, position:position + 1], torch.tensor([position]))
        torch.testing.assert_close(step[:, 0], expected[:, position], atol=atol, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3"])
def test_decoder_logits_match_transformers(kind: str) -> None:
    """GQA (4 query heads on 2 kv heads), Qwen2's q/k/v bias, Qwen3's q/k norms."""
    check_against_transformers(tiny_model(kind))


def tiny_gemma3(**options) -> nn.Module:
    """Gemma 3 with a sliding layer (window 8: check_against_transformers' steps reach position 10) before a full
    one, each with its rotary base; scaled embeddings, sandwich norms, q/k norms, query_pre_attn_scalar."""
    config = Gemma3TextConfig(**TINY, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                              layer_types=["sliding_attention", "full_attention"], **options)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # Gemma's norms scale by 1 + weight, zero at initialization: make them count
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("options", [{}, {"final_logit_softcapping": 0.5}], ids=["gemma3", "gemma3-logit-cap"])
def test_gemma3_logits_match_transformers(options: dict) -> None:
    """Both layers on the kernel, the sliding one with its window (shorter than the cache); a final logit cap below
    the logits' size changes them (tanh)."""
    model = tiny_gemma3(**options)
    assert model.config.final_logit_softcapping == options.get("final_logit_softcapping")
    check_against_transformers(model)


def test_mistral_sliding_window_shorter_than_the_cache_matches_transformers() -> None:
    model = tiny_model("mistral")
    model.config.sliding_window = 8
    decoder_windows = [layer.window for layer in StaticDecoder(copy.deepcopy(model), 1, 16).layers]
    assert decoder_windows == [8, 8]
    assert [layer.window for layer in StaticDecoder(copy.deepcopy(model), 1, 8).layers] == [None, None]
    check_against_transformers(model)


@pytest.mark.parametrize("act_bits,group", [(16, 32), (8, -1)])
def test_decoder_on_quantized_layers_matches_transformers(act_bits: int, group: int) -> None:
    """RTN W4A16 g32 and W4A8 per channel: the fused q/k/v and gate/up QuantLinears compute the separate layers'
    function (W4A8: one per-token int8 rounding of the shared input, as each layer's own)."""
    model = tiny_model("qwen2")  # q/k/v biases: the fused layer carries them
    calib = CalibrationSet(random_ids(4, 16), torch.ones(4, 16, dtype=torch.long))
    config = QuantConfig(method="rtn", group_size=group, act_bits=act_bits)
    quantize_model(model, get_adapter(model), calib, config, device="cpu", show_progress=False)
    assert isinstance(model.model.layers[0].self_attn.q_proj, QuantLinear)
    check_against_transformers(model)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_a_long_prefill_runs_sdpa_and_the_steps_after_it_the_kernel(kind: str) -> None:
    """40 prompt tokens x 2 query heads per kv head = 80 rows > DECODE_ATTENTION_ROWS: the prefill attends with SDPA
    over the masked cache (Gemma 3's sliding layer under a window mask of 8), the decode steps after it with the
    kernel, on the cache the prefill wrote."""
    model = tiny_model("llama") if kind == "llama" else tiny_gemma3()
    ids = random_ids(1, 43)
    with torch.no_grad():
        expected = model(ids).logits
    decoder = StaticDecoder(model, batch_size=1, max_len=48)
    kernel, calls = decoder.decode_attention, []
    decoder.decode_attention = lambda *args: calls.append(args[0].shape) or kernel(*args)
    torch.testing.assert_close(decoder(ids[:, :40], torch.arange(40)), expected[:, :40], atol=1e-4, rtol=0)
    assert calls == []
    for position in range(40, 43):
        step = decoder(ids[:, position:position + 1], torch.tensor([position]))
        torch.testing.assert_close(step[:, 0], expected[:, position], atol=1e-4, rtol=0)
    assert len(calls) == 3 * len(decoder.layers) and calls[0][2] == 2


def test_greedy_generation_matches_transformers() -> None:
    model = tiny_model("llama")
    ids = random_ids(2, PROMPT)
    expected = model.generate(ids, max_new_tokens=5, do_sample=False, min_new_tokens=5)[:, PROMPT:]
    tokens = StaticDecoder(model, batch_size=2, max_len=PROMPT + 5).generate(ids, 5)
    assert torch.equal(tokens, expected)


def test_fused_quantlinear_outputs_are_the_sources_side_by_side() -> None:
    """The sources drop their kernel forwards (and its weight copy) and keep computing the same function."""
    torch.manual_seed(0)
    layers = []
    for out, bias in ((24, True), (8, False)):
        layer = QuantLinear(64, out, 4, 32, bias, act_bits=8, two_level=True, dtype=torch.float32)
        layer.qweight.copy_(torch.randint(-2**31, 2**31 - 1, layer.qweight.shape, dtype=torch.int32))
        layer.scales.copy_(torch.randint(1, 17, layer.scales.shape))
        layer.zeros.fill_(8)
        layer.channel_scales.copy_(torch.rand(out) / 100)
        if bias:
            layer.bias.copy_(torch.randn(out))
        layer._kernel = lambda x: x  # a kernel forward (CPU here): the fused layer's copy takes over
        layers.append(layer)
    fused = fuse_linears(layers)
    assert [layer._kernel for layer in layers] == [None, None]
    x = torch.randn(3, 64)
    assert torch.equal(fused.dequantized_weight(), torch.cat([layer.dequantized_weight() for layer in layers]))
    torch.testing.assert_close(fused(x), torch.cat([layer(x) for layer in layers], dim=-1), atol=1e-5, rtol=1e-5)
    assert torch.equal(fused.bias[24:], torch.zeros(8))


def test_fusing_mismatched_layers_fails_clearly() -> None:
    a, b = QuantLinear(64, 8, 4, 32, False), QuantLinear(64, 8, 4, 64, False)
    with pytest.raises(ValueError, match="group_size 32 and 64"):
        fuse_linears([a, b])
    with pytest.raises(ValueError, match="all nn.Linear or all QuantLinear"):
        fuse_linears([a, nn.Linear(64, 8)])


@pytest.mark.parametrize("model_type", ["opt", "gpt_bigcode"])
def test_an_architecture_the_decoder_does_not_run_is_refused_in_one_line(model_type: str) -> None:
    """OPT has an entry without decoder traits; gpt_bigcode has no entry: one line naming what the decoder runs."""
    model = tiny_model("opt")
    model.config.model_type = model_type
    with pytest.raises(QuantizationError) as err:
        StaticDecoder(model, 1, 16)
    assert str(err.value) == ("StaticDecoder runs model_type gemma3, gemma3_text, llama, mistral, qwen2, qwen3, "
                              f"not {model_type!r}")


def test_unsupported_models_and_caches_fail_clearly() -> None:
    with pytest.raises(ValueError, match="does not soft-cap attention logits"):
        StaticDecoder(tiny_gemma3(attn_logit_softcapping=50.0), 1, 16)
    with pytest.raises(ValueError, match="causal attention, not config.use_bidirectional_attention"):
        StaticDecoder(tiny_gemma3(use_bidirectional_attention=True), 1, 16)
    decoder = StaticDecoder(tiny_model("llama"), batch_size=1, max_len=8)
    with pytest.raises(ValueError, match="do not fit the cache of 1 x 8"):
        decoder.generate(random_ids(1, 6), 3)


def test_the_end_to_end_benchmark_runs_its_pieces_on_cpu() -> None:
    """benchmarks/bench_e2e.py on a tiny model (its graph timing needs CUDA): random QuantLinears in place of every
    decoder linear, the kernels-vs-reference check (both paths are the reference on CPU: no error), a step's bytes."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import bench_e2e
    finally:
        sys.path.pop(0)
    model = tiny_model("llama")
    bench_e2e.quantize_randomly(model, "w4a8", 32)
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, QuantLinear) and layer.mlp.down_proj.channel_scales is not None
    assert layer.mlp.down_proj.dequantized_weight().float().std().item() == pytest.approx(0.02, rel=1e-2)
    decoder = StaticDecoder(model, batch_size=2, max_len=16)
    assert bench_e2e.check_step(decoder, 6, 128) == dict(rel_err=0.0, prefill_rel_err=0.0, same_top_token=True,
                                                         nonfinite_kernels=0, nonfinite_reference=0)
    assert [bench_e2e.kernel_kind(name) for name in ("_w4a16_swap_gemv_kernel", "_quantize_rows_kernel",
                                                     "sm90_xmma_gemm_f16f16", "triton_red_fused_add_mean_0",
                                                     "fmha_cutlassF_f16", "void at::native::index_kernel")] == [
        "quantkit linears", "quantkit linears", "cuBLAS", "inductor fused", "attention", "other"]
    layers = bench_e2e.check_layers(decoder, (1, 3))
    assert set(layers) == {f"{name}_m{m}" for name in ("qkv", "o", "gate_up", "down") for m in (1, 3)}
    assert all(entry == dict(rel_err=0.0, nonfinite=0) for entry in layers.values())
    # per layer: codes (in x out / 2 bytes), fp16 group scales, fp32 channel scales; then lm_head and the cache
    linears = 64 * (64 + 2 * 32) + 64 * 64 + 2 * 64 * 128 + 128 * 64
    outputs = 64 + 2 * 32 + 64 + 2 * 128 + 64
    per_layer = linears // 2 + 2 * sum(n * k // 32 for n, k in [(128, 64), (64, 64), (256, 64), (64, 128)]) + 4 * outputs
    cache = 2 * 2 * 1 * 2 * 16 * 16 * 4  # layers, k and v, batch (check_step's), kv heads, positions, head dim, fp32
    assert bench_e2e.step_bytes(decoder) == 2 * per_layer + 128 * 64 * 4 + cache
    fp8 = tiny_model("llama")
    bench_e2e.quantize_randomly(fp8, "fp8", 32)
    bench_e2e.quantize_head(fp8, "fp8", 32)  # --quantize-head
    assert fp8.model.layers[1].self_attn.o_proj.fp8 and fp8.lm_head.fp8
    fp8_decoder = StaticDecoder(fp8, batch_size=2, max_len=16)
    assert bench_e2e.check_step(fp8_decoder, 6, 128)["rel_err"] == 0.0
    assert bench_e2e.step_bytes(fp8_decoder) == 2 * (linears + 4 * outputs) + 128 * 64 + 4 * 128 + cache


def test_fusing_16_bit_linears_shares_their_memory() -> None:
    linears = [nn.Linear(16, 8, bias=False), nn.Linear(16, 4, bias=True)]
    x = torch.randn(3, 16)
    expected = torch.cat([linear(x) for linear in linears], dim=-1)
    fused = fuse_linears(linears)
    torch.testing.assert_close(fused(x), expected, atol=0, rtol=0)
    assert linears[1].weight.data_ptr() == fused.weight.data_ptr() + 8 * 16 * 4  # a view: no copy left behind
    torch.testing.assert_close(torch.cat([linear(x) for linear in linears], dim=-1), expected, atol=0, rtol=0)


def test_eval_speed_times_each_model_and_reports_speedups(tmp_path, monkeypatch) -> None:
    """`quantkit eval --speed` (run_eval's speed_batches): decode steps at each batch size and a prefill per model
    (wall clock on CPU), the speedup over the first model, and a clear note for a model StaticDecoder cannot run."""
    monkeypatch.setenv("QUANTKIT_DECODE_ATTENTION", "0")  # SDPA: the interpreted kernel would take ~30 s here
    models = {"base": tiny_model("llama"), "w4": tiny_model("llama"), "opt": tiny_model("opt")}
    results = run_eval(list(models), texts=[], tasks=[], limit=None, num_fewshot=None, generations=False,
                       report_dir=tmp_path, json_path=None, batch_size=1, device="cpu", console=Console(quiet=True),
                       loader=lambda name: (models[name], None, name), speed_batches=[1, 2], speed_compile="eager")
    base, w4, opt = (m["speed"] for m in results["models"])
    assert set(base) == {"device", "compiled", "prompt", "attention", "decode_b1", "decode_b2", "prefill_512"}
    assert base["device"] == "cpu" and base["prompt"] == 512 and base["attention"] == "SDPA"
    assert base["compiled"] == "eager"  # Dynamo traced each decode step (no Inductor code generation in a test)
    assert all(base[cell]["ms"] > 0 for cell in ("decode_b1", "decode_b2", "prefill_512"))
    assert base["decode_b2"]["tokens_per_s"] == pytest.approx(2e3 / base["decode_b2"]["ms"])
    assert "not 'opt'" in opt["skipped"]
    rows = {row[0]: row for row in speed_rows(results)}
    assert rows["decode_b1"][3] == "n/a" and rows["decode_b1"][4] == f"{base['decode_b1']['ms'] / w4['decode_b1']['ms']:.2f}x"
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "## Speed" in markdown and "Not timed: opt: StaticDecoder runs" in markdown
    assert "a static KV cache of 512 + 1 positions; decode steps attend with SDPA" in markdown


def test_a_decode_step_traces_as_one_graph() -> None:
    """bench_e2e.py times decode steps through torch.compile(fullgraph=True): Dynamo must trace a whole step
    (quantized layers included) without a graph break; backend "eager" runs the traced graph as it is."""
    model = tiny_model("qwen3")
    calib = CalibrationSet(random_ids(2, 16), torch.ones(2, 16, dtype=torch.long))
    quantize_model(model, get_adapter(model), calib, QuantConfig(method="rtn", group_size=32, act_bits=8),
                   device="cpu", show_progress=False)
    decoder = StaticDecoder(model, batch_size=2, max_len=16)
    ids = random_ids(2, 5)
    expected = decoder(ids, torch.arange(5))
    decoder.new_cache(2)
    step = torch.compile(decoder.__call__, fullgraph=True, backend="eager")
    torch.testing.assert_close(step(ids, torch.arange(5)), expected, atol=1e-5, rtol=1e-5)
