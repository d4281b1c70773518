"""Where exports go and how they get there (quantkit.outputs), what a killed run leaves and what the next run
does with it, the export's permissions, progress lines, and results that outlive a failing report."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
from pathlib import Path

import pytest
from rich.console import Console
from test_adapters import tiny_model as tiny_module
from test_cli_errors import QUICK, cli, forkserver, snapshot, tiny_model  # noqa: F401  (fixtures)
from test_engine import random_calibration
from test_eval_tasks import tiny_lm  # noqa: F401  (fixture)

from quantkit import export
from quantkit.config import QuantConfig
from quantkit.engine import quantize_model
from quantkit.eval import report
from quantkit.eval.runner import run_eval
from quantkit.models import get_adapter
from quantkit.outputs import (
    MARKER,
    OLD_PREFIX,
    TMP_PREFIX,
    check_free_space,
    check_output_target,
    clean_stale,
    output_lock,
    staged_output,
)
from quantkit.qtensor import QuantizationError


def _export(folder: Path, content: str) -> Path:
    folder.mkdir()
    (folder / MARKER).write_text(content)
    return folder


def test_staged_output_replaces_a_previous_export(tmp_path) -> None:
    out = _export(tmp_path / "q", "old")
    with staged_output(out) as folder:
        assert folder.parent == tmp_path and folder.name.startswith(f"{TMP_PREFIX}q.")
        (folder / MARKER).write_text("new")
    assert (out / MARKER).read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["q"]


def test_a_failure_while_staging_leaves_the_old_export_and_no_leftover(tmp_path) -> None:
    out = _export(tmp_path / "q", "old")
    with pytest.raises(RuntimeError), staged_output(out) as folder:
        (folder / MARKER).write_text("half")
        raise RuntimeError("killed")
    assert (out / MARKER).read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["q"]


def test_overwrite_accepts_an_export_or_an_empty_folder_only(tmp_path) -> None:
    check_output_target(_export(tmp_path / "export", "x"), overwrite=True)
    (tmp_path / "empty").mkdir()
    check_output_target(tmp_path / "empty", overwrite=True)
    check_output_target(tmp_path / "new", overwrite=False)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("x")
    with pytest.raises(QuantizationError, match="not a quantkit export"):
        check_output_target(tmp_path / "mine", overwrite=True)


def test_stale_folders_of_killed_runs(tmp_path) -> None:
    dead_pid = 2**22 + 1  # above Linux's pid_max: no such process
    stale = tmp_path / f"{TMP_PREFIX}q.{dead_pid}-abcd1234"
    running = tmp_path / f"{TMP_PREFIX}q.{os.getppid()}-abcd1234"  # a live writer's folder stays
    other = tmp_path / f"{TMP_PREFIX}other.{dead_pid}-abcd1234"  # another output's: not ours to judge
    aside = _export(tmp_path / f"{OLD_PREFIX}q.{dead_pid}-abcd1234", "previous")
    for folder in (stale, running, other):
        folder.mkdir()
    said = clean_stale(tmp_path / "q")
    assert len(said) == 2 and any("restored" in line for line in said)
    assert not stale.exists() and not aside.exists() and running.is_dir() and other.is_dir()
    assert (tmp_path / "q" / MARKER).read_text() == "previous"  # a replace killed mid-way: the old export is back


def test_empty_leftovers_of_older_versions_are_removed(tmp_path) -> None:
    (tmp_path / ".q.a1b2c3d4").mkdir()  # what tempfile.mkdtemp(prefix=".q.") made before the prefix
    (tmp_path / ".q.e5f6g7h8").mkdir()
    (tmp_path / ".q.e5f6g7h8" / "model.safetensors").write_bytes(b"x")
    said = clean_stale(tmp_path / "q")
    assert not (tmp_path / ".q.a1b2c3d4").exists() and (tmp_path / ".q.e5f6g7h8" / "model.safetensors").is_file()
    assert len(said) == 2 and "older quantkit" in said[0] and "older quantkit" in said[1]


def test_free_space_is_checked(tmp_path) -> None:
    check_free_space(tmp_path, 1, "a tiny export")
    with pytest.raises(QuantizationError, match="free"):
        check_free_space(tmp_path / "not" / "yet", 2**60, "an exabyte export")


def test_a_full_disk_during_export_keeps_the_previous_export(tmp_path, monkeypatch) -> None:
    model = tiny_module("llama")
    config = QuantConfig(method="rtn", group_size=32)
    quantize_model(model, get_adapter(model), random_calibration(), config, device="cpu", show_progress=False)
    out = export.export_checkpoint(model, None, tmp_path / "q", config, "compressed-tensors")
    before = snapshot(tmp_path)

    def full_disk(path: Path, *_args) -> None:
        path.write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export, "write_safetensors", full_disk)
    with pytest.raises(QuantizationError, match="disk full while writing .*nothing was replaced"):
        export.export_checkpoint(model, None, out, config, "compressed-tensors", overwrite=True)
    assert snapshot(tmp_path) == before


def _modes(folder: Path) -> set[tuple[bool, int]]:
    return {(p.is_dir(), stat.S_IMODE(p.stat().st_mode)) for p in [folder, *folder.rglob("*")]}


def test_cli_export_permissions_progress_stale_folder_and_overwrite(tiny_model, tmp_path) -> None:  # noqa: F811
    """One real run under a 022 umask: a stale folder of a killed run is removed and mentioned, the export is
    readable by others (0755 folders, 0644 files), each layer and phase gets a log line; a second run with
    --overwrite replaces the export."""
    out = tmp_path / "q"
    stale = tmp_path / f"{TMP_PREFIX}q.{2**22 + 1}-deadbeef"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    first = cli("quantize", str(tiny_model), *QUICK, "--method", "rtn", "-o", str(out), cwd=tmp_path, umask=0o022)
    assert first.returncode == 0, first.stderr
    assert not stale.exists() and stale.name in " ".join(first.stderr.split())
    assert _modes(out) == {(True, 0o755), (False, 0o644)}
    log = " ".join(first.stderr.split())
    for line in ("reading the calibration text", "loading", "layer 1/2 quantized", "layer 2/2 quantized",
                 "exporting to"):
        assert line in log, first.stderr
    second = cli("quantize", str(tiny_model), *QUICK, "--method", "rtn", "--asym", "-o", str(out), "--overwrite",
                 cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert json.loads((out / MARKER).read_text())["quant_config"]["sym"] is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]


def test_a_failing_report_keeps_the_json(tiny_lm, tmp_path, monkeypatch) -> None:  # noqa: F811
    model, tokenizer = tiny_lm

    def broken_plots(results: dict, report_dir: Path) -> list[str]:
        raise RuntimeError("no display")

    monkeypatch.setattr(report, "write_plots", broken_plots)
    text = tmp_path / "sample.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    with pytest.raises(QuantizationError, match="the metrics are saved in") as failure:
        run_eval(["base"], texts=[str(text)], tasks=[], limit=None, num_fewshot=None, generations=False,
                 report_dir=tmp_path / "report", json_path=tmp_path / "metrics.json", batch_size=2, device="cpu",
                 seqlen=32, console=Console(quiet=True), loader=lambda name: (model, tokenizer, name))
    for saved in (tmp_path / "metrics.json", tmp_path / "report" / report.RESULTS_JSON):
        assert str(saved) in str(failure.value)
        assert json.loads(saved.read_text())["models"][0]["perplexity"]["sample"]["ppl"] > 1


def test_a_failing_second_model_keeps_the_first_ones_metrics(tiny_lm, tmp_path) -> None:  # noqa: F811
    model, tokenizer = tiny_lm

    def loader(name: str) -> tuple:
        if name == "broken":
            raise QuantizationError("could not load the model in broken")
        return model, tokenizer, name

    text = tmp_path / "sample.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    with pytest.raises(QuantizationError, match="broken"):
        run_eval(["base", "broken"], texts=[str(text)], tasks=[], limit=None, num_fewshot=None, generations=False,
                 report_dir=None, json_path=tmp_path / "metrics.json", batch_size=2, device="cpu", seqlen=32,
                 console=Console(quiet=True), loader=loader)
    models = json.loads((tmp_path / "metrics.json").read_text())["models"]
    assert [m["label"] for m in models] == ["base"] and models[0]["perplexity"]["sample"]["ppl"] > 1


def test_cli_failing_report_leaves_the_json(tiny_model, tmp_path) -> None:  # noqa: F811
    """The real command with a matplotlib that imports but cannot plot: exit 2, one line, the JSON is there."""
    fake = tmp_path / "fake"
    (fake / "matplotlib").mkdir(parents=True)
    (fake / "matplotlib" / "__init__.py").write_text("def use(backend):\n    raise RuntimeError('no backend')\n")
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    before = snapshot(tiny_model)
    result = cli("eval", str(tiny_model), "--text", str(text), "--seqlen", "32", "--max-windows", "2",
                 "--device", "cpu", "--json", str(tmp_path / "m.json"), "--report", str(tmp_path / "r"),
                 cwd=tmp_path, env={"PYTHONPATH": str(fake)})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert lines[-1].startswith("error: ") and "m.json" in lines[-1], result.stderr
    assert json.loads((tmp_path / "m.json").read_text())["models"][0]["perplexity"]["text"]["ppl"] > 1
    assert snapshot(tiny_model) == before



def test_one_run_per_output(tmp_path, caplog) -> None:
    """A second run on an output another run holds stops at once naming its process; the lock of a run that died
    (its file left, the kernel's lock gone) is taken over and logged; a finished run leaves no lock file."""
    output = tmp_path / "q"
    with output_lock(output) as path:
        assert path == tmp_path / ".q.quantkit-lock" and path.read_text() == f"{os.getpid()}\n"
        with pytest.raises(QuantizationError, match=rf"another quantkit run \(process {os.getpid()}\)"):
            with output_lock(output):
                pass
    assert not path.exists()
    path.write_text("999999999\n")  # what a killed run leaves
    with caplog.at_level(logging.WARNING, logger="quantkit"), output_lock(output):
        assert path.read_text() == f"{os.getpid()}\n"
    assert any("from process 999999999" in r.message for r in caplog.records)


def test_a_second_quantize_on_the_same_output_is_refused_before_work(tmp_path) -> None:
    from typer.testing import CliRunner

    from quantkit.cli import app

    output = tmp_path / "q"
    with output_lock(output):
        result = CliRunner().invoke(app, ["quantize", "--method", "rtn", "--output", str(output), "--no-eval"])
    assert result.exit_code == 2 and "is being written by another quantkit run" in result.output, result.output
    assert not output.exists()
