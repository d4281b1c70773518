"""The command line: the contract's option names, clear errors, nothing half-written."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, fields
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig
from typer.testing import CliRunner

import quantkit.cli as cli
from quantkit.cli import app, default_nsamples
from quantkit.config import METHOD_OPTIONS, MethodOptions, option, option_spec
from quantkit.formats import FORMATS
from quantkit.quantizers.base import METHODS, Method, method_class, registered_methods
from quantkit.reload import load_quantized

runner = CliRunner()


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    from quantkit.models.loading import load_tokenizer

    return load_tokenizer(str(smollm2_gguf))


def _save(model, tokenizer, folder: Path, safe: bool = True) -> Path:
    if safe:
        model.save_pretrained(folder)
    else:  # transformers 5 writes only safetensors: write the pickle file by hand
        folder.mkdir(parents=True)
        model.config.save_pretrained(folder)
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tokenizer) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=512)
    return _save(AutoModelForCausalLM.from_config(config), tokenizer, tmp_path_factory.mktemp("tiny") / "llama")


class _Result:
    """The CLI's exit code and its output with rich's line wrapping undone."""

    def __init__(self, args: list[str]) -> None:
        result = runner.invoke(app, args)
        self.exit_code, self.output = result.exit_code, " ".join(result.output.split())


def _quantize(*args: str) -> _Result:
    return _Result(["quantize", *args, "--nsamples", "4", "--seqlen", "64", "--no-eval"])


def test_quantize_writes_a_gptq_checkpoint(tiny_llama, tmp_path) -> None:
    out = tmp_path / "q"
    result = _quantize(str(tiny_llama), "--method", "gptq", "--group-size", "32", "--format", "gptq",
                       "--act-order", "--output", str(out))
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "gptq"
    assert config["quantization_config"]["group_size"] == 32
    assert (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file()
    meta = json.loads((out / "quantkit.json").read_text())
    assert meta["quant_config"]["options"]["act_order"] is True and len(meta["report"]["layers"]) == 2


def test_act_order_is_the_default_and_can_be_turned_off(tiny_llama, tmp_path) -> None:
    for flag, expected in (((), True), (("--no-act-order",), False)):
        out = tmp_path / f"q{expected}"
        result = _quantize(str(tiny_llama), "--group-size", "32", *flag, "--output", str(out))
        assert result.exit_code == 0, result.output
        assert json.loads((out / "quantkit.json").read_text())["quant_config"]["options"]["act_order"] is expected


def test_qqq_checks_its_smoothing_unless_told_not_to(tiny_llama, tmp_path) -> None:
    for flags, expected, search in (((), True, "refine"), (("--no-smooth-check", "--smooth-search", "grid"),
                                                           False, "grid")):
        out = tmp_path / f"q{expected}"
        result = _quantize(str(tiny_llama), "--method", "qqq", "--act-bits", "8", "--group-size", "32",
                           "--smooth-steps", "4", *flags, "--output", str(out))
        assert result.exit_code == 0, result.output
        meta = json.loads((out / "quantkit.json").read_text())
        options = meta["quant_config"]["options"]
        assert options["smooth_check"] is expected and options["smooth_search"] == search
        smoothing = [group for layer in meta["report"]["layers"] for group in layer["smoothing"].values()]
        assert all(group["thresholds_evaluated"] == 5 for group in smoothing)  # 4 steps: 5 thresholds, either way
        checked = [group["gptq_losses"] is not None for group in smoothing if group["scaled_channels"]
                   or group["rejected_threshold"] is not None]
        assert checked and (all(checked) if expected else not any(checked))


def test_rtn_records_no_act_order(tiny_llama, tmp_path) -> None:
    out = tmp_path / "q"
    assert _quantize(str(tiny_llama), "--method", "rtn", "--output", str(out)).exit_code == 0
    assert "act_order" not in json.loads((out / "quantkit.json").read_text())["quant_config"]["options"]


def test_default_calibration_samples_follow_the_device() -> None:
    assert default_nsamples("cuda") == 128 and default_nsamples("cuda:1") == 128
    assert default_nsamples("cpu") == 32


def test_asym_to_gptq_is_refused_before_any_work(tiny_llama, tmp_path) -> None:
    result = _quantize(str(tiny_llama), "--asym", "--format", "gptq", "--output", str(tmp_path / "q"))
    assert result.exit_code == 2 and "asymmetric" in result.output
    assert not (tmp_path / "q").exists()


def test_missing_model_path(tmp_path) -> None:
    result = _quantize(str(tmp_path / "nope"), "--output", str(tmp_path / "q"))
    assert result.exit_code == 2 and "does not exist" in result.output


def test_group_size_that_does_not_divide(tiny_llama, tmp_path) -> None:
    result = _quantize(str(tiny_llama), "--group-size", "128", "--output", str(tmp_path / "q"))
    assert result.exit_code == 2 and "does not divide the input size 64" in result.output
    assert list(tmp_path.iterdir()) == []


def test_bad_group_size_value(tiny_llama, tmp_path) -> None:
    result = _quantize(str(tiny_llama), "--group-size", "48", "--output", str(tmp_path / "q"))
    assert result.exit_code == 2 and "group size must be one of" in result.output


@pytest.mark.parametrize("content,message", [("", "empty"), ("one short line\n", "too short")])
def test_bad_calibration_text(tiny_llama, tmp_path, content: str, message: str) -> None:
    calib = tmp_path / "calib.txt"
    calib.write_text(content)
    result = _quantize(str(tiny_llama), "--calib", str(calib), "--output", str(tmp_path / "q"))
    assert result.exit_code == 2 and message in result.output
    assert not (tmp_path / "q").exists()


def test_missing_calibration_file(tiny_llama, tmp_path) -> None:
    result = _quantize(str(tiny_llama), "--calib", str(tmp_path / "none.txt"), "--output", str(tmp_path / "q"))
    assert result.exit_code == 2 and "neither a file nor one of" in result.output


def test_unsupported_architecture(tmp_path, tokenizer) -> None:
    config = GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=len(tokenizer))
    folder = _save(AutoModelForCausalLM.from_config(config), tokenizer, tmp_path / "gpt2")
    result = _quantize(str(folder), "--output", str(tmp_path / "q"))
    assert result.exit_code == 2 and "unsupported architecture 'gpt2'" in result.output
    assert "llama" in result.output


def test_pickle_weights_are_refused_unless_allowed(tmp_path, tokenizer) -> None:
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer))
    folder = _save(AutoModelForCausalLM.from_config(config), tokenizer, tmp_path / "pickled", safe=False)
    assert not list(folder.glob("*.safetensors"))
    result = _quantize(str(folder), "--output", str(tmp_path / "q"))
    assert result.exit_code == 2 and "pickle" in result.output
    result = _quantize(str(folder), "--allow-pickle", "--method", "rtn", "--output", str(tmp_path / "q"))
    assert result.exit_code == 0, result.output


def test_existing_output_is_not_overwritten(tiny_llama, tmp_path) -> None:
    (tmp_path / "q").mkdir()
    result = _quantize(str(tiny_llama), "--output", str(tmp_path / "q"))
    assert result.exit_code == 2 and "already exists" in result.output


def test_eval_compares_a_model_and_its_export(tiny_llama, tmp_path) -> None:
    out = tmp_path / "q"
    assert _quantize(str(tiny_llama), "--method", "rtn", "--group-size", "32", "--output", str(out)).exit_code == 0
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    result = _Result(["eval", str(tiny_llama), str(out), "--text", str(text), "--seqlen", "64",
                      "--max-windows", "2", "--json", str(tmp_path / "r.json"), "--device", "cpu",
                      "--speculative", "--draft-tokens", "1,3", "--max-new-tokens", "6"])
    assert result.exit_code == 0, result.output
    models = json.loads((tmp_path / "r.json").read_text())["models"]
    assert len(models) == 2 and "speculative" not in models[0] and models[0]["generations"] == []
    assert set(models[1]["speculative"]["greedy_tokens_per_pass"]) == {"1", "3"}  # the export drafts for the model
    ppl = [next(iter(m["perplexity"].values()))["ppl"] for m in models]
    assert all(p > 1 for p in ppl) and ppl[0] != ppl[1]


def test_default_method_is_awq_gptq_with_act_order(tiny_llama, tmp_path) -> None:
    """The README's choice: the most accurate method within the CPU and GPU time budgets."""
    result = _quantize(str(tiny_llama), "--group-size", "32", "--output", str(tmp_path / "q"))
    assert result.exit_code == 0, result.output
    quant_config = json.loads((tmp_path / "q" / "quantkit.json").read_text())["quant_config"]
    assert quant_config["method"] == "awq-gptq" and quant_config["options"]["act_order"] is True


def _help() -> str:
    result = runner.invoke(app, ["quantize", "--help"], env={"COLUMNS": "240"})
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


def _flags(options_class) -> list[str]:
    return [option_spec(f).flag_for(f.name, isinstance(f.default, bool)).split("/")[0]
            for f in fields(options_class)]


def test_quantize_offers_every_registered_method_format_and_option() -> None:
    text = _help()
    assert f"<{'|'.join(sorted(registered_methods()))}>" in text
    assert f"<{'|'.join(FORMATS)}>" in text
    for method in registered_methods().values():
        for flag in _flags(method.options_class):
            assert flag in text, (method.name, flag)
    # the flags of the command line before options were declared per method
    for flag in ("--damp", "--act-order", "--no-act-order", "--mse", "--duo-scaling", "--clip", "--no-clip",
                 "--smooth-steps", "--smooth-search", "--smooth-samples", "--smooth-check", "--no-smooth-check"):
        assert f" {flag} " in text, flag
    assert "gptq, qqq: act-order with static groups" in text  # which methods take act-order: their options


@dataclass(frozen=True)
class _WiggleOptions(MethodOptions):
    wiggle: int = option(3, "wiggles of the dummy method", minimum=0)


def test_a_registered_method_gets_its_flags(monkeypatch, tiny_llama, tmp_path) -> None:
    class Wiggle(Method):
        name = "test-wiggle"
        options_class = _WiggleOptions

        def linear_quantizer(self, linear):
            raise NotImplementedError

    monkeypatch.setitem(METHODS, Wiggle.name, Wiggle)
    monkeypatch.setitem(METHOD_OPTIONS, Wiggle.name, _WiggleOptions)
    monkeypatch.setattr(cli.quantize, "__signature__", cli.quantize_signature())
    text = _help()
    assert "test-wiggle" in text and "--wiggle" in text and "test-wiggle: wiggles of the dummy method" in text
    result = _quantize(str(tiny_llama), "--method", "test-wiggle", "--wiggle", "-1", "--output", str(tmp_path / "q"))
    assert result.exit_code == 2 and "error: wiggle must be at least 0, got -1" in result.output


def test_a_scheme_the_method_or_format_contradicts_is_refused_before_work(tiny_llama, tmp_path) -> None:
    """QQQ fixes W4A8 with symmetric weights when the scheme is made: a format that cannot carry it, or a flag
    against it, stops the run in one line before the model is read; the default output name says W4A8."""
    for flags, message in ((("--format", "gptq"), "8-bit activations (W4A8, FP8) can only be exported as compressed-tensors"),
                           (("--asym",), "qqq needs sym=True; sym=False (--asym) contradicts it"),
                           (("--no-act-order",), "qqq runs GPTQ with act-order: --no-act-order contradicts it")):
        result = _quantize(str(tiny_llama), "--method", "qqq", *flags, "--output", str(tmp_path / "q"))
        assert result.exit_code == 2 and f"error: {message}" in result.output, result.output
        assert "Traceback" not in result.output and not (tmp_path / "q").exists()


def test_the_default_output_is_named_after_the_resolved_scheme(tiny_llama, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = _quantize(str(tiny_llama), "--method", "qqq", "--group-size", "32", "--smooth-steps", "2")
    assert result.exit_code == 0, result.output
    assert "qqq fixes sym=True, act_bits=8" in result.output
    assert (tmp_path / "out" / f"{tiny_llama.name}-qqq-w4a8-g32" / "quantkit.json").is_file()


def test_fp8_writes_a_float_quantized_checkpoint_named_after_its_scheme(tiny_llama, tmp_path, monkeypatch) -> None:
    """--method fp8 fixes its scheme (said on the console), runs no calibration, and writes e4m3 weights with fp32
    channel scales that quantkit reloads as FP8 layers; a group size or format against it stops the run first."""
    monkeypatch.chdir(tmp_path)
    result = _quantize(str(tiny_llama), "--method", "fp8")
    assert result.exit_code == 0, result.output
    assert "fp8 fixes fp8=True, bits=8, act_bits=8, group_size=-1" in result.output
    out = tmp_path / "out" / f"{tiny_llama.name}-fp8-w8a8-g-1"
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["format"] == "float-quantized"
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.get_slice("model.layers.0.mlp.down_proj.weight").get_dtype() == "F8_E4M3"
        assert f.get_slice("model.layers.0.mlp.down_proj.weight_scale").get_dtype() == "F32"
    model, _ = load_quantized(out, dtype=torch.float32)
    assert model.model.layers[0].mlp.down_proj.fp8
    for flags, message in ((("--group-size", "128"), "fp8 needs group_size=-1; group_size=128 (--group-size)"),
                           (("--format", "gptq"), "8-bit activations (W4A8, FP8) can only be exported as "
                                                 "compressed-tensors")):
        result = _quantize(str(tiny_llama), "--method", "fp8", *flags, "--output", str(tmp_path / "refused"))
        assert result.exit_code == 2 and f"error: {message}" in result.output, result.output
        assert not (tmp_path / "refused").exists()


def test_quantize_head_writes_a_quantized_lm_head(tiny_llama, tmp_path) -> None:
    out = tmp_path / "q"
    result = _quantize(str(tiny_llama), "--method", "rtn", "--group-size", "32", "--quantize-head", "--output", str(out))
    assert result.exit_code == 0, result.output
    meta = json.loads((out / "quantkit.json").read_text())
    assert meta["quant_config"]["quantize_head"] is True and meta["report"]["head"]["method"] == "rtn"
    model, _ = load_quantized(out, dtype=torch.float32)
    assert model.lm_head.bits == 4 and model.lm_head.group_size == 32
    result = _quantize(str(tiny_llama), "--method", "qqq", "--quantize-head", "--output", str(tmp_path / "refused"))
    assert result.exit_code == 2 and "error: --quantize-head takes weight-only schemes" in result.output


def test_invalid_method_options_fail_in_one_line(tiny_llama, tmp_path) -> None:
    result = _quantize(str(tiny_llama), "--damp", "2", "--output", str(tmp_path / "q"))
    assert result.exit_code == 2 and "error: damp_percent must be in (0, 1), got 2.0" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "q").exists()
    result = _quantize(str(tiny_llama), "--method", "qqq", "--smooth-search", "golden")
    assert result.exit_code == 2 and "golden" in result.output
    result = _quantize(str(tiny_llama), "--method", "golden")
    assert result.exit_code == 2 and "golden" in result.output


def test_a_shared_flag_left_out_takes_each_methods_own_default(caplog) -> None:
    """--awq-grid and --clip belong to awq and awq-gptq with different defaults: left out, each method gets its own
    (the Python API's); given, the value; an option the method does not take is dropped with a warning."""
    for method in ("awq", "awq-gptq", "gptq"):
        options = method_class(method).options_class.from_dict(cli.method_options_for(method, {}))
        expected = method_class(method).options_class()
        assert options == (dataclasses.replace(expected, act_order=True) if method == "gptq" else expected), method
    assert cli.method_options_for("awq-gptq", {"grid": 9, "clip": None})["grid"] == 9
    assert cli.method_options_for("awq-gptq", {"clip": True})["clip"] is True
    with caplog.at_level(logging.WARNING, logger="quantkit"):
        assert "grid" not in cli.method_options_for("gptq", {"grid": 9})
    assert "--awq-grid is an option of awq, awq-gptq: --method gptq ignores it" in caplog.text
    assert "(default: awq 20, awq-gptq 5)" in _help() and "(default: awq on, awq-gptq off)" in _help()


def test_moe_all_tokens_reaches_the_calibration(tmp_path, tokenizer) -> None:
    """--moe-all-tokens: every expert calibrated on every real token (recorded in quantkit.json)."""
    from test_moe import EXPERTS, tiny_moe

    source = _save(tiny_moe("mixtral", vocab_size=len(tokenizer)), tokenizer, tmp_path / "moe")
    result = _quantize(str(source), "--group-size", "32", "--moe-all-tokens", "--output", str(tmp_path / "q"))
    assert result.exit_code == 0, result.output
    meta = json.loads((tmp_path / "q" / "quantkit.json").read_text())
    assert meta["quant_config"]["moe_all_tokens"] is True
    tokens = {meta["report"]["layers"][0]["linears"][f"mlp.experts.{e}.up_proj"]["tokens"] for e in range(EXPERTS)}
    assert tokens == {meta["report"]["calibration_tokens"]}


def test_a_streamed_run_evaluates_its_export_layer_by_layer(tiny_llama, tmp_path, tokenizer) -> None:
    """--eval on a streamed run: each held-out text's perplexity before and after and the KL, computed one layer
    at a time, are what quantkit.eval.layerwise gives for the source and the export."""
    from quantkit.data import default_heldout_texts, load_text
    from quantkit.eval.layerwise import layerwise_perplexity

    out = tmp_path / "q"
    result = _Result(["quantize", str(tiny_llama), "--method", "rtn", "--output", str(out), "--nsamples", "4",
                      "--seqlen", "64", "--eval", "--eval-windows", "2", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "held-out perplexity" in result.output and "KL" in result.output
    name, path = next(iter(default_heldout_texts().items()))
    original, quantized = layerwise_perplexity([tiny_llama, out], tokenizer, {name: load_text(path)}, max_windows=2,
                                               device="cpu")[name]
    row = result.output[result.output.index(name):]
    assert row.split()[:9:2] == [name, f"{original['ppl']:.3f}", f"{quantized['ppl']:.3f}",
                                 f"{quantized['ppl'] - original['ppl']:+.3f}", f"{quantized['kl']:.4f}"]


def test_a_deepseek_variant_without_an_entry_is_refused_from_its_config_alone(tmp_path) -> None:
    """DeepSeek-V3.2 (sparse attention): refused in one line naming what is missing, before any weight is read (the
    folder holds a config.json only)."""
    folder = tmp_path / "v32"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "deepseek_v32", "n_routed_experts": 256}))
    result = _quantize(str(folder), "--output", str(tmp_path / "q"))
    assert result.exit_code == 2 and "lightning indexer" in result.output and not (tmp_path / "q").exists()


def test_speed_batches_default_to_the_gpu_sweep_and_one_sequence_on_a_cpu() -> None:
    assert cli._speed_batches("auto", "cuda") == [1, 2, 4, 8, 16, 32, 64, 128]
    assert cli._speed_batches("auto", "cuda:1") == cli._speed_batches("auto", "cuda")
    assert cli._speed_batches("auto", "cpu") == [1] and cli._speed_batches("1,16", "cpu") == [1, 16]
    for bad in ("0", "", "1,x"):
        with pytest.raises(cli.QuantizationError, match="--speed-batches"):
            cli._speed_batches(bad, "cpu")
