"""Mixture-of-experts models: the per-expert form against transformers' fused blocks, per-expert calibration,
the low-token policy, export and reload (tiny random models: hidden 64, 4 experts, top-2, 2 layers)."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch
from test_engine import random_calibration
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    MixtralConfig,
    OlmoeConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from quantkit.config import QuantConfig
from quantkit.engine import quantize_model
from quantkit.export import export_checkpoint
from quantkit.models import get_adapter, loading
from quantkit.models.moe import UnfusedMoe, unfuse_experts
from quantkit.nn.qlinear import QuantLinear
from quantkit.qtensor import QuantizationError
from quantkit.quantizers.qqq import QQQOptions
from quantkit.reload import load_quantized
from quantkit.smoothing import active_scaling_groups, fold_scales

EXPERTS = 4
SILENT = EXPERTS - 1  # the expert no token is routed to
_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
               max_position_embeddings=512, num_experts_per_tok=2)
CONFIGS = {
    "qwen3_moe": lambda **kw: Qwen3MoeConfig(**{**_COMMON, "head_dim": 16, "num_experts": EXPERTS,
                                                 "moe_intermediate_size": 32, "intermediate_size": 96,
                                                 "norm_topk_prob": True, **kw}),
    "qwen2_moe": lambda **kw: Qwen2MoeConfig(**{**_COMMON, "num_experts": EXPERTS, "moe_intermediate_size": 32,
                                                 "shared_expert_intermediate_size": 64, "intermediate_size": 96,
                                                 **kw}),
    "mixtral": lambda **kw: MixtralConfig(**{**_COMMON, "num_local_experts": EXPERTS, "intermediate_size": 32,
                                             **kw}),
    "olmoe": lambda **kw: OlmoeConfig(**{**_COMMON, "num_experts": EXPERTS, "intermediate_size": 32,
                                         "norm_topk_prob": False, **kw}),
    # MLA with a q LoRA, a shared expert, sigmoid routing over 2 groups of 2 (both taken: the silent expert stays
    # silent; test_deepseek_router_limits_groups takes one), every layer sparse (first_k_dense_replace 0)
    "deepseek_v3": lambda **kw: DeepseekV3Config(**{
        **_COMMON, "num_key_value_heads": 4, "n_routed_experts": EXPERTS, "moe_intermediate_size": 32,
        "intermediate_size": 96, "n_shared_experts": 1, "n_group": 2, "topk_group": 2, "first_k_dense_replace": 0,
        "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, **kw}),
}
KINDS = list(CONFIGS)


def tiny_moe(kind: str, dtype: torch.dtype = torch.float32, silent_expert: bool = True, **config: object) -> nn.Module:
    """A random MoE model; with silent_expert, hidden channel 0 is a constant 10 in every layer's residual
    (embeddings, nothing writes to it) and the router's row of expert SILENT is -100 on it: never routed to."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[kind](**config), dtype=dtype).eval()
    model.set_experts_implementation("eager")  # the reference loop (grouped_mm has no float64)
    model.config.architectures = [type(model).__name__]  # what vLLM picks its model class by
    with torch.no_grad():
        for layer in [la for la in model.model.layers if hasattr(la.mlp, "experts")]:  # not dense MLP layers
            layer.mlp.gate.weight.normal_(0, 1)  # spread the routing (some routers start at zero)
            if silent_expert:
                layer.mlp.gate.weight[SILENT] = 0
                layer.mlp.gate.weight[SILENT, 0] = -100
                layer.self_attn.o_proj.weight[0] = 0
                layer.mlp.experts.down_proj[:, 0] = 0
                if hasattr(layer.mlp, "shared_expert"):
                    layer.mlp.shared_expert.down_proj.weight[0] = 0
        if silent_expert:
            model.model.embed_tokens.weight[:, 0] = 10
    return model


@pytest.mark.parametrize("kind", KINDS)
def test_unfused_block_computes_what_transformers_computes(kind: str) -> None:
    model = tiny_moe(kind, torch.float64, silent_expert=False)
    x = torch.randn(2, 7, 64, dtype=torch.float64)
    reference = [layer.mlp(x) for layer in model.model.layers]
    ids = torch.randint(0, 128, (2, 9))
    logits = model(ids).logits
    unfuse_experts(model, get_adapter(model))
    for layer, expected in zip(model.model.layers, reference, strict=True):
        assert isinstance(layer.mlp, UnfusedMoe)
        assert isinstance(layer.mlp.gate, nn.Linear) or layer.mlp.router_routes  # DeepSeek's router kept whole
        torch.testing.assert_close(layer.mlp(x), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model(ids).logits, logits, rtol=1e-12, atol=1e-12)


def test_adapter_names_every_expert_linear() -> None:
    model = tiny_moe("qwen2_moe")
    adapter = get_adapter(model)
    unfuse_experts(model, adapter)
    layer = model.model.layers[0]
    linears = {n for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
    # every linear but the routers is quantized; the routers and the shared expert's gate never are
    assert linears - set(adapter.linear_names()) == {"mlp.gate", "mlp.shared_expert_gate"}
    assert ("mlp.experts.3.gate_proj", "mlp.experts.3.up_proj") in adapter.fused
    assert any(g.prev == "mlp.experts.2.up_proj" and g.linears == ("mlp.experts.2.down_proj",)
               for g in adapter.scaling_groups)


def test_deepseek_router_limits_groups_as_transformers_does() -> None:
    """The unfused block keeps DeepSeek's router module: sigmoid scores, the bias correction, the best topk_group
    of n_group groups, norm_topk_prob and routed_scaling_factor route every token to the experts transformers'
    block picks, with its weights; one dense first layer keeps its MLP."""
    model = tiny_moe("deepseek_v3", torch.float64, silent_expert=False, topk_group=1, first_k_dense_replace=1)
    layer = model.model.layers[1]
    with torch.no_grad():
        layer.mlp.gate.e_score_correction_bias.normal_(0, 0.5)
    x = torch.randn(2, 7, 64, dtype=torch.float64)
    with torch.no_grad():
        expected_logits, expected_weights, expected_index = layer.mlp.gate(x)
        expected = layer.mlp(x)
        unfuse_experts(model, get_adapter(model))
        weights, index = layer.mlp.route(x.reshape(-1, 64))
        torch.testing.assert_close(layer.mlp(x), expected)
    assert torch.equal(index, expected_index) and torch.equal(weights, expected_weights)
    groups = index // (EXPERTS // 2)
    assert bool((groups == groups[:, :1]).all())  # one group per token
    assert isinstance(layer.mlp, UnfusedMoe) and not isinstance(model.model.layers[0].mlp, UnfusedMoe)


def _routed_counts(model: nn.Module, calib) -> list[list[int]]:
    """Brute force: the real tokens each expert is routed to, per layer, from the unquantized model's own router."""
    counts, ids, mask = [], calib.input_ids, calib.attention_mask.bool()
    hidden = {}
    hooks = [layer.mlp.register_forward_pre_hook(lambda _m, a, i=i: hidden.__setitem__(i, a[0]))
             for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=calib.attention_mask)
    for h in hooks:
        h.remove()
    for i, layer in enumerate(model.model.layers):
        _, index = layer.mlp.route(hidden[i].reshape(-1, 64))
        real = index[mask.reshape(-1)]
        counts.append([int((real == e).sum()) for e in range(EXPERTS)])
    return counts


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", ["rtn", "gptq", "awq", "qqq"])
def test_every_expert_is_quantized_and_counted(kind: str, method: str) -> None:
    model = tiny_moe(kind)
    adapter = get_adapter(model)
    calib = random_calibration(pad_from={1: 10, 4: 3})
    config = QuantConfig.from_dict(dict(method=method, group_size=32, act_bits=8 if method == "qqq" else 16, smooth_steps=8))
    report = quantize_model(model, adapter, calib, config, device="cpu", show_progress=False)
    for i, layer in enumerate(model.model.layers):
        for e in range(EXPERTS):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert isinstance(layer.mlp.experts[e].get_submodule(proj), QuantLinear), (i, e, proj)
        assert not isinstance(layer.mlp.gate, QuantLinear)
        counts = report.layers[i]["expert_tokens"]["mlp"]
        assert counts[SILENT] == 0
        real = int(calib.attention_mask.sum()) if method != "rtn" else 0  # RTN runs no calibration pass
        assert sum(counts) == 2 * real  # top-2: each real token reaches two experts
    if method in ("gptq", "qqq"):
        silent = f"layer 0 mlp.experts.{SILENT}.gate_proj: rtn"
        assert silent in report.fallbacks


def test_expert_statistics_come_from_its_routed_real_tokens() -> None:
    """Each expert linear's GPTQ statistics hold exactly the real tokens its router sends it: brute force over
    the quantized model's own routers (the experts come after the router: quantizing them does not move it)."""
    model = tiny_moe("qwen3_moe")
    calib = random_calibration(pad_from={1: 10, 4: 3})
    report = quantize_model(model, get_adapter(model), calib, QuantConfig(method="gptq", group_size=32),
                            device="cpu", show_progress=False)
    for i, brute in enumerate(_routed_counts(model, calib)):
        assert report.layers[i]["expert_tokens"]["mlp"] == brute
        for e in range(EXPERTS):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert report.layers[i]["linears"][f"mlp.experts.{e}.{proj}"]["tokens"] == brute[e]


def test_all_tokens_option_calibrates_every_expert_on_every_real_token() -> None:
    model = tiny_moe("mixtral")
    calib = random_calibration(pad_from={1: 10})
    reference = copy.deepcopy(model)
    config = QuantConfig(method="gptq", group_size=32, moe_all_tokens=True)
    report = quantize_model(model, get_adapter(model), calib, config, device="cpu", show_progress=False)
    real = int(calib.attention_mask.sum())
    linears = report.layers[0]["linears"]
    assert all(linears[f"mlp.experts.{e}.up_proj"]["tokens"] == real for e in range(EXPERTS))
    assert not any("experts" in f for f in report.fallbacks)  # the silent expert got statistics too
    assert report.layers[0]["expert_tokens"]["mlp"][SILENT] == 0  # while the routing stayed the model's
    # the output still follows the routing: close to the unquantized model, as with the routed statistics
    with torch.no_grad():
        ids = calib.input_ids[:1, :10]
        error = (model(ids).logits - reference(ids).logits).abs().mean()
    assert error < 0.05


def test_few_tokens_raise_the_dampening() -> None:
    model = tiny_moe("qwen3_moe")
    calib = random_calibration(n=1, seqlen=12)  # 12 real tokens x top-2 over 3 routed experts: < 64 inputs
    report = quantize_model(model, get_adapter(model), calib, QuantConfig(method="gptq", group_size=32),
                            device="cpu", show_progress=False)
    linears = report.layers[0]["linears"]
    few = [e for e in range(EXPERTS) if 0 < linears[f"mlp.experts.{e}.gate_proj"]["tokens"] < 64]
    assert few
    for e in few:
        info = linears[f"mlp.experts.{e}.gate_proj"]
        assert info["damp_percent"] >= 0.1
        assert f"layer 0 mlp.experts.{e}.gate_proj: damp_percent 0.1: {info['tokens']} tokens < 64" \
            in report.fallbacks


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3"])
@pytest.mark.parametrize("fmt,sym,act_bits", [("compressed-tensors", True, 16), ("compressed-tensors", False, 16),
                                              ("compressed-tensors", True, 8), ("gptq", True, 16)])
def test_export_reloads_with_equal_logits(tmp_path, kind: str, fmt: str, sym: bool, act_bits: int) -> None:
    if fmt == "gptq" and kind in ("qwen2_moe", "olmoe", "deepseek_v3"):
        pytest.skip("one GPTQ export per expert layout is enough")
    model = tiny_moe(kind)
    config = QuantConfig(method="gptq", group_size=32, sym=sym, act_bits=act_bits)
    report = quantize_model(model, get_adapter(model), random_calibration(), config, device="cpu",
                            show_progress=False)
    out = export_checkpoint(model, None, tmp_path / kind, config, fmt, dtype="float32", report=report.to_dict())
    meta = json.loads((out / "quantkit.json").read_text())
    assert meta["report"]["layers"][0]["expert_tokens"]["mlp"][SILENT] == 0
    reloaded, _ = load_quantized(out, dtype=torch.float32)
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3"])
def test_transformers_loads_the_compressed_tensors_export(tmp_path, kind: str) -> None:
    """transformers decompresses the per-expert tensors into its fused 3-D experts: same logits as quantkit."""
    model = tiny_moe(kind)
    config = QuantConfig(method="gptq", group_size=32)
    quantize_model(model, get_adapter(model), random_calibration(), config, device="cpu", show_progress=False)
    out = export_checkpoint(model, None, tmp_path / kind, config, "compressed-tensors", dtype="float32")
    hf, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_no_expert_is_left_unquantized() -> None:
    """The model_type's entry (names with "*") is expanded for the model by the engine itself; an entry that
    missed an expert linear fails loudly instead of leaving it in full precision."""
    model = tiny_moe("mixtral")
    quantize_model(model, get_adapter("mixtral"), random_calibration(), QuantConfig(method="rtn", group_size=32),
                   device="cpu", show_progress=False)
    assert all(isinstance(m, QuantLinear) for m in model.model.layers[1].mlp.experts.modules()
               if isinstance(m, QuantLinear | nn.Linear))
    adapter = get_adapter(model)
    partial = replace(adapter, sequential=tuple(tuple(n for n in step if "experts.2." not in n)
                                                for step in adapter.sequential))
    with pytest.raises(QuantizationError, match=r"layer 0: expert linears left unquantized: mlp\.experts\.2"):
        quantize_model(tiny_moe("mixtral"), partial, random_calibration(), QuantConfig(method="rtn", group_size=32),
                       device="cpu", show_progress=False)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_dense_and_moe_layers_mixed(method: str) -> None:
    """Qwen's mlp_only_layers: a dense MLP layer quantizes its dense names, an MoE layer its experts."""
    model = tiny_moe("qwen3_moe", silent_expert=False, mlp_only_layers=[0])
    report = quantize_model(model, get_adapter(model), random_calibration(), QuantConfig(method=method, group_size=32),
                            device="cpu", show_progress=False)
    dense, sparse = model.model.layers
    assert all(isinstance(dense.mlp.get_submodule(p), QuantLinear) for p in ("gate_proj", "up_proj", "down_proj"))
    assert isinstance(sparse.mlp, UnfusedMoe)
    assert "expert_tokens" not in report.layers[0] and sum(report.layers[1]["expert_tokens"]["mlp"]) > 0


@pytest.mark.parametrize("kind", ["qwen2_moe", "mixtral"])
def test_folding_the_norm_scales_keeps_the_moe_block(kind: str) -> None:
    """The post-attention norm's group scales every expert's gate/up and the router (and the shared expert's
    gate) together: in float64 the layer, routing included, computes the same."""
    model = tiny_moe(kind, torch.float64, silent_expert=False)
    adapter = get_adapter(model)
    unfuse_experts(model, adapter)
    layer = model.model.layers[0]
    group = next(g for g in active_scaling_groups(layer, adapter) if g.passengers)
    assert group.input_of == "mlp.gate"
    assert set(group.linears) >= {f"mlp.experts.{e}.{p}" for e in range(EXPERTS) for p in ("gate_proj", "up_proj")}
    x = torch.randn(2, 7, 64, dtype=torch.float64)
    before = layer.mlp(layer.post_attention_layernorm(x))
    fold_scales(layer, adapter, group, torch.rand(64, dtype=torch.float64) + 0.5)
    torch.testing.assert_close(layer.mlp(layer.post_attention_layernorm(x)), before, rtol=1e-12, atol=1e-12)


def test_awq_searches_the_norm_to_experts_group_on_every_real_token() -> None:
    model = tiny_moe("qwen2_moe")
    calib = random_calibration(pad_from={1: 10})
    report = quantize_model(model, get_adapter(model), calib, QuantConfig(method="awq", group_size=32),
                            device="cpu", show_progress=False)
    search = report.layers[0]["smoothing"]["scales"]["post_attention_layernorm"]
    assert search["tokens"] == int(calib.attention_mask.sum())
    assert "mlp.experts.3.up_proj" in search["linears"] and "mlp.shared_expert.gate_proj" in search["linears"]
    assert "skipped" not in search


def test_load_model_gives_the_per_expert_form(tmp_path, monkeypatch) -> None:
    model = tiny_moe("qwen2_moe")
    model.save_pretrained(tmp_path)
    monkeypatch.setattr(loading, "load_tokenizer", lambda *_args: None)  # the tiny model has no tokenizer
    loaded, _ = loading.load_model(tmp_path)
    assert all(isinstance(layer.mlp, UnfusedMoe) for layer in loaded.model.layers)
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_unfused_block_in_bfloat16(kind: str) -> None:
    """In the dtype models run in, the routing weights are rounded where transformers rounds them."""
    model = tiny_moe(kind, torch.bfloat16, silent_expert=False)
    x = torch.randn(2, 7, 64, dtype=torch.bfloat16)
    reference = [layer.mlp(x) for layer in model.model.layers]
    unfuse_experts(model, get_adapter(model))
    for layer, expected in zip(model.model.layers, reference, strict=True):
        torch.testing.assert_close(layer.mlp(x), expected, rtol=0, atol=0)


def test_qqq_smooths_the_norm_to_experts_group_at_the_block_output() -> None:
    """QQQ measures the norm -> experts group's loss at the MoE block's output (each expert's down_proj sees only
    its own tokens), experts without tokens included."""
    model = tiny_moe("qwen2_moe")
    calib = random_calibration(pad_from={1: 10})
    config = QuantConfig(method="qqq", group_size=32, act_bits=8, options=QQQOptions(smooth_steps=8))
    report = quantize_model(model, get_adapter(model), calib, config, device="cpu", show_progress=False)
    for entry in report.layers:
        choice = entry["smoothing"]["post_attention_layernorm"]
        assert "skipped" not in choice, choice


def test_deepseek_keeps_its_latent_projections_in_16_bits(tmp_path) -> None:
    """q_a, kv_a and kv_b stay in the model's dtype (ArchAdapter.keeping): out of the steps and fused groups, named in
    the export's ignore list; the norm before q_a/kv_a still smooths q_proj where a model has no q LoRA, kv_a scaled
    along as a passenger."""
    adapter = get_adapter(tiny_moe("deepseek_v3"))
    kept = {"self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj"}
    assert not kept & set(adapter.linear_names()) and not any(kept & set(group) for group in adapter.fused)
    assert {"self_attn.q_b_proj", "self_attn.o_proj", "self_attn.q_proj"} <= set(adapter.linear_names())
    groups = {(g.prev, g.linears): g.passengers for g in adapter.scaling_groups}
    assert groups[("input_layernorm", ("self_attn.q_proj",))] == ("self_attn.kv_a_proj_with_mqa",)
    assert not any(g.prev == "self_attn.kv_a_layernorm" for g in adapter.scaling_groups)
    model = tiny_moe("deepseek_v3")
    quantize_model(model, get_adapter(model), random_calibration(vocab=128), QuantConfig(method="rtn", group_size=32),
                   device="cpu", show_progress=False)
    out = export_checkpoint(model, None, tmp_path / "ct", QuantConfig(method="rtn", group_size=32),
                            "compressed-tensors", dtype="float16")
    ignored = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert {f"model.layers.{i}.{name}" for i in range(2) for name in kept} <= set(ignored)
    assert "model.layers.0.self_attn.q_b_proj" not in ignored


@pytest.mark.parametrize("model_type,named", [("deepseek_v32", "indexer"), ("deepseek_v2", "softmax router"),
                                               ("kimi_k25", "vision-language")])
def test_deepseek_variants_without_an_entry_are_refused_naming_what_is_missing(model_type: str, named: str) -> None:
    with pytest.raises(QuantizationError, match=named) as err:
        get_adapter(model_type)
    assert "\n" not in str(err.value)


def test_a_deepseek_router_of_another_kind_is_refused_before_any_work() -> None:
    config = CONFIGS["deepseek_v3"]()
    config.topk_method = "group_limited_greedy"
    with pytest.raises(QuantizationError, match="topk_method='group_limited_greedy' is not covered"):
        get_adapter("deepseek_v3").for_config(config)
    config.topk_method, config.scoring_func = "noaux_tc", "sigmoid"  # V3's own config.json names both
    assert get_adapter("deepseek_v3").for_config(config).experts.router_settings
