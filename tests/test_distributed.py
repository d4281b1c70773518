"""Several processes (torchrun, gloo on the CPU): each rank runs its share of the calibration batches and solves its
share of every step, rank 0 writes; the export has one process's bytes, and a run whose rank is killed leaves no
export and resumes to those bytes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from test_streaming import PAUSE, _checkpoint, _command, _digest, _env, _moe_checkpoint

from quantkit.distributed import SINGLE, Ranks, _add_up, _interleaved, batch_share
from quantkit.streaming.workdir import PAUSE_MARK, work_dir_for

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch has no torch.distributed")


def test_groups_are_shared_by_cost_and_every_group_has_one_rank() -> None:
    groups = [["q", "k", "v"], ["o"], ["e0"], ["e1"], ["e2"]]
    cost = {"q": 30, "o": 10, "e0": 8, "e1": 8, "e2": 8}
    shares = [Ranks(rank, 2).share(groups, cost) for rank in range(2)]
    assert sorted(g[0] for share in shares for g in share) == sorted(g[0] for g in groups)
    assert shares[0] == [["q", "k", "v"]] and shares[1] == [["o"], ["e0"], ["e1"], ["e2"]]  # 30 against 34
    assert Ranks().share(groups, cost) == groups


def test_batches_go_round_robin_and_come_back_in_order() -> None:
    shares = [batch_share(Ranks(rank, 3), 7, split=True) for rank in range(3)]
    assert [share.ids for share in shares] == [[0, 3, 6], [1, 4], [2, 5]]
    assert {share.steps for share in shares} == {3}  # every rank takes part in every step, with a batch or not
    assert _interleaved([[f"b{i}" for i in share.ids] for share in shares], 7) == [f"b{i}" for i in range(7)]
    assert batch_share(Ranks(1, 3), 7, split=False).ids == list(range(7))  # a smoothing method: every batch
    assert batch_share(SINGLE, 7, split=True).split is False
    counts = [{"expert_tokens": {"mlp": [1, 0, 2]}}, {"expert_tokens": {"mlp": [0, 5, 1]}}]
    assert _add_up(counts) == {"expert_tokens": {"mlp": [1, 5, 3]}}


# Three batches of one sample: rank 0 runs batches 0 and 2, rank 1 batch 1 (and nothing at the second step).
SPLIT = ["--nsamples", "3", "--batch-size", "1"]


def _figures(folder: Path):
    """The export's report without its timings: every loss, error and token count at full precision, which an
    addition in another order would change where the weights' bytes may not."""
    def strip(entry):
        if isinstance(entry, dict):
            return {k: strip(v) for k, v in entry.items() if k not in ("seconds", "timings")}
        return [strip(v) for v in entry] if isinstance(entry, list) else entry

    return strip(json.loads((folder / "quantkit.json").read_text())["report"])


def _torchrun(command: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *command[1:]]


def _rank_pid(agent: int, rank: int) -> int | None:
    """The pid of torchrun's worker of local rank `rank` (a child of the agent whose environment says so)."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == agent and \
                    f"LOCAL_RANK={rank}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                return int(entry.name)
        except OSError:
            continue
    return None


@pytest.mark.parametrize("method,fmt", [("awq-gptq", "gptq"), ("qqq", "compressed-tensors")])
def test_two_ranks_give_one_process_bytes(smollm2_gguf, tmp_path, method: str, fmt: str) -> None:
    """A dense checkpoint. awq-gptq splits the batches: its scale search adds up each candidate's per-batch losses,
    its mean |x| and its clip samples in batch order, every linear's Hessian is accumulated by the rank that
    solves it from both ranks' batches in batch order (the quantized lm_head's too, from the last hidden states),
    and the guard's errors are summed in that order. QQQ runs every batch on both ranks and shares the solves.
    Either way the export is byte for byte the one process's."""
    from quantkit.models.loading import load_tokenizer

    tokenizer = load_tokenizer(str(smollm2_gguf))
    source = _checkpoint(tmp_path / "dense", layers=2, vocab=len(tokenizer), tokenizer=tokenizer)
    whole, out = tmp_path / "whole", tmp_path / "out"
    flags = [*SPLIT, "--method", method, "--format", fmt, *(["--quantize-head"] if method == "awq-gptq" else [])]
    subprocess.run([*_command(source, whole), *flags], env=_env(0), check=True, capture_output=True, timeout=120)
    ranks = subprocess.run(_torchrun([*_command(source, out), *flags]), env=_env(0), capture_output=True, text=True,
                           timeout=180)
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    log = " ".join(ranks.stderr.split())
    split = "rank 0 of 2: calibration batches [0, 2] of 3" in log and "rank 1 of 2: calibration batches [1] of 3" in log
    assert split == (method != "qqq")
    assert _digest(out) == _digest(whole) and _figures(out) == _figures(whole)
    assert ("head" in _figures(out)) == (method == "awq-gptq")


def test_two_ranks_killed_then_resumed_give_one_process_bytes(smollm2_gguf, tmp_path) -> None:
    """`torchrun --nproc-per-node 2 -m quantkit quantize ...` on the CPU: rank 1 is SIGKILLed while rank 0 writes
    layer 1 (torchrun stops rank 0); nothing is at the output; the rerun resumes from the finished layers and
    publishes the bytes of a one-process run. A Qwen3-MoE checkpoint: its dense steps (q/k/v, o: one group, solved
    by rank 0 while rank 1 takes no share) and its experts (spread over both ranks), the batches split."""
    from quantkit.models.loading import load_tokenizer

    source = _moe_checkpoint(tmp_path / "moe", "qwen3_moe", load_tokenizer(str(smollm2_gguf)))
    whole = tmp_path / "whole"
    subprocess.run([*_command(source, whole), *SPLIT], env=_env(0), check=True, capture_output=True, timeout=120)
    out = tmp_path / "out"
    proc = subprocess.Popen(_torchrun([*_command(source, out), *SPLIT]), env=_env(PAUSE), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    marks = 0
    for line in proc.stderr:
        marks += PAUSE_MARK in line
        if marks == 6:  # layer 0 committed, layer 1's file written
            os.kill(_rank_pid(proc.pid, 1), signal.SIGKILL)
            break
    proc.wait(timeout=60)
    proc.stderr.close()
    assert proc.returncode != 0 and not out.exists()
    assert (work_dir_for(out) / "layer-00000.safetensors").is_file()
    final = subprocess.run(_torchrun([*_command(source, out), *SPLIT]), env=_env(0), capture_output=True, text=True,
                           timeout=180)
    assert final.returncode == 0, final.stderr[-3000:]
    assert "resuming" in " ".join(final.stderr.split())
    assert _digest(out) == _digest(whole) and _figures(out) == _figures(whole) and not work_dir_for(out).exists()
