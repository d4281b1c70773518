"""SmolLM2-135M (real weights, hidden 576) quantized on CPU with the default method, GPTQ and RTN in the scheme
the CLI picks for it (awq-gptq, W4A16, groups of 64: `--group-size auto`).

Asserted: orderings whose margin is several times their spread over three calibration seeds
(benchmarks/accuracy/SEEDS_SMOLLM2.md), what each method minimises measured on the model's own layers, and the default's
export: quantkit's reload, transformers and `quantkit eval` read it. Exactness against vLLM: test_vllm_formats.py
(SmolLM2-shaped random layers). AWQ: test_smollm2_awq.py. The full accuracy tables: benchmarks/accuracy/.
"""

from __future__ import annotations

import pytest
import torch
from export_checks import (
    check_reload_matches_the_in_memory_model,
    check_transformers_loads_the_compressed_tensors_export,
)
from realmodel import check_layers_at_or_below_rtn, check_scale_search_never_above_the_identity, mean
from rich.console import Console
from test_eval_report import _check_report_dir, _require
from test_gptq import output_error, quantize_gptq

from quantkit.config import QuantConfig, resolve_group_size
from quantkit.eval import task_data
from quantkit.eval.runner import load_prompts, run_eval
from quantkit.export import export_checkpoint
from quantkit.models import get_adapter
from quantkit.quantizers.rtn import rtn_quantize

pytestmark = pytest.mark.slow(seconds=300)  # this file's time in the suite, 2026-12-07: conftest.py orders by it
REPORT = "smollm2"  # QUANTKIT_TEST_REPORT=DIR: DIR/smollm2.json
GROUP = 64
DEFAULT = QuantConfig(group_size=GROUP)  # the CLI's scheme for SmolLM2 (test_the_cli_default_group_is_64)
GPTQ = QuantConfig(method="gptq", group_size=GROUP)
RTN = QuantConfig(method="rtn", group_size=GROUP)
FP8 = QuantConfig(method="fp8")
FP8_HEAD = QuantConfig(method="fp8", quantize_head=True)


def test_the_cli_default_group_is_64(smollm2_setup) -> None:
    model = smollm2_setup[0]
    assert resolve_group_size(model, get_adapter(model), "auto") == GROUP
    assert QuantConfig().method == DEFAULT.method == "awq-gptq"


def test_default_and_gptq_cost_less_perplexity_than_rtn(smollm2_runs) -> None:
    """Mean NLL of both texts; SEEDS_SMOLLM2.md: margins at least 10x their spread over three seeds (the
    default's over GPTQ is 1.2x its spread there: not asserted)."""
    fp, rtn, gptq, default = (smollm2_runs.fp.nll, smollm2_runs[RTN].nll, smollm2_runs[GPTQ].nll,
                              smollm2_runs[DEFAULT].nll)
    assert mean(default) < mean(rtn) and mean(gptq) < mean(rtn), (fp, rtn, gptq, default)


def test_default_perplexity_increase_is_bounded(smollm2_runs) -> None:
    """exp(delta NLL) - 1 below +40% per text (SEEDS_SMOLLM2.md: at most +31% in English, +3% in Korean)."""
    fp, default = smollm2_runs.fp.nll, smollm2_runs[DEFAULT].nll
    for text in fp:
        assert default[text] - fp[text] < torch.log1p(torch.tensor(0.4)).item(), (text, fp, default)


def test_fp8_costs_less_perplexity_than_the_default_and_little(smollm2_runs) -> None:
    """FP8 (W8A8-FP8) on real weights: below the default W4A16's mean NLL (SEEDS_SMOLLM2.md: margin 0.116-0.135,
    5.9x the default's spread over three seeds; FP8 needs no calibration) and within +5% perplexity of the fp32
    model per text (measured +2.4% English, +0.9% Korean). With the head (tied embeddings) in FP8 as well, still
    below the default (margin 0.10, 5x the default's spread)."""
    fp, fp8, default = smollm2_runs.fp.nll, smollm2_runs[FP8].nll, smollm2_runs[DEFAULT].nll
    assert mean(fp8) < mean(smollm2_runs[FP8_HEAD].nll) < mean(default), (fp8, default)
    for text in fp:
        assert fp8[text] - fp[text] < torch.log1p(torch.tensor(0.05)).item(), (text, fp, fp8)


@pytest.fixture(scope="module")
def real_linears(smollm2_setup) -> dict[str, tuple[torch.nn.Linear, torch.Tensor]]:
    """Every linear of SmolLM2's first two layers with its fp inputs on four calibration sequences."""
    model, _, calib, _ = smollm2_setup
    layers, inputs = model.model.layers[:2], {}

    def keep(name: str):
        def hook(_module, args, _output) -> None:
            inputs[name] = args[0].flatten(0, 1)
        return hook

    hooks = [module.register_forward_hook(keep(name))
             for name, module in layers.named_modules() if isinstance(module, torch.nn.Linear)]
    try:
        with torch.no_grad():
            model(calib.input_ids[:4], attention_mask=calib.attention_mask[:4])
    finally:
        for hook in hooks:
            hook.remove()
    return {name: (layers.get_submodule(name), x) for name, x in inputs.items()}


def test_gptq_lowers_each_real_linears_output_error_below_rtns(real_linears) -> None:
    """What GPTQ minimises, on real weights and their own inputs: ||(W - Q) x||^2 under the same grid (GPTQ's
    defaults, act-order), at most 0.8 of RTN's for every linear (measured 0.005 to 0.12 over seeds 0-2)."""
    for name, (linear, x) in real_linears.items():
        gptq = quantize_gptq(linear, x, GPTQ).dequantize()
        rtn = rtn_quantize(linear.weight, 4, GROUP, True, False).dequantize()
        assert output_error(x, linear.weight, gptq) < 0.8 * output_error(x, linear.weight, rtn), name


@pytest.mark.parametrize("config", [DEFAULT, GPTQ], ids=["default", "gptq"])
def test_each_layer_ends_at_or_below_rtns_output_error(smollm2_runs, config: QuantConfig) -> None:
    """Per decoder layer, the whole output error on the calibration batches (the engine's guard measures it beside
    RTN's on the same inputs): below RTN's summed over the model, and a layer where it is not falls back to RTN,
    so every kept layer is at or below RTN's. (awq-gptq's layer errors are above plain GPTQ's on the first layers,
    0.9 to 1.4x on layers 0-3 over three seeds, though its held-out NLL is lower: its smoothing trades calibration
    error for a grid that generalises, so no test asserts awq-gptq against GPTQ layer by layer.)"""
    check_layers_at_or_below_rtn(smollm2_runs[config].report, fraction=0.8)


def test_default_scale_search_never_ends_above_the_identity(smollm2_runs) -> None:
    check_scale_search_never_above_the_identity(smollm2_runs[DEFAULT].report)


@pytest.fixture(scope="module")
def default_export(smollm2_runs, smollm2_setup, tmp_path_factory):
    folder = tmp_path_factory.mktemp("smollm2") / "awq-gptq"  # `quantkit eval` labels a model by its folder
    return export_checkpoint(smollm2_runs[DEFAULT].model, smollm2_setup[1], folder, DEFAULT, "compressed-tensors",
                             dtype="float16")


def test_reload_matches_the_in_memory_model(smollm2_runs, default_export, smollm2_setup) -> None:
    check_reload_matches_the_in_memory_model(smollm2_runs[DEFAULT].model, default_export, smollm2_setup)


def test_transformers_loads_the_export(default_export, smollm2_setup) -> None:
    check_transformers_loads_the_compressed_tensors_export(default_export, smollm2_setup, w4a8=False)


def test_quantkit_eval_compares_the_gguf_with_its_export(smollm2_gguf, default_export, tmp_path) -> None:
    """`quantkit eval`'s own loaders on the GGUF and the default's export, a dozen items of two tasks: the report
    folder is complete and the export costs perplexity."""
    _require(task_data.WINOGRANDE)
    results = run_eval([str(smollm2_gguf), str(default_export)], texts=None, tasks=["arc_easy", "winogrande"],
                       limit=12, num_fewshot=None, generations=True, report_dir=tmp_path / "report", json_path=None,
                       batch_size=16, device="cpu", seqlen=128, console=Console(quiet=True),
                       prompts=load_prompts()[:2], max_new_tokens=8, max_windows=2)
    _check_report_dir(tmp_path / "report", results)
    fp, quantized = results["models"]
    assert quantized["label"] == "awq-gptq" and quantized["tasks"]["winogrande"]["n"] == 12
    assert fp["tasks"]["arc_easy"]["metrics"]["acc"]["value"] >= 0.3  # chance is 0.25
    assert 1 < fp["perplexity"]["heldout_en"]["ppl"] < 60
    assert quantized["perplexity"]["heldout_en"]["ppl"] > fp["perplexity"]["heldout_en"]["ppl"]
    assert all(fp["generations"]) and all(quantized["generations"])
