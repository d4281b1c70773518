"""Calibration and evaluation text: the shipped English + Korean set, local files, hub datasets."""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.qtensor import QuantizationError

log = logging.getLogger("quantkit")

CALIB_DIR = Path(__file__).resolve().parent / "calib_data"
if not CALIB_DIR.is_dir():  # running from a source checkout without installing
    CALIB_DIR = Path(__file__).resolve().parents[1] / "calib_data"

# name -> (dataset, config, split, text field) for users online
HUB_DATASETS = {
    "wikitext2": ("wikitext", "wikitext-2-raw-v1", "train", "text"),
    "wikitext2-test": ("wikitext", "wikitext-2-raw-v1", "test", "text"),
    "c4": ("allenai/c4", "en", "validation", "text"),
    "pileval": ("mit-han-lab/pile-val-backup", None, "validation", "text"),
}


def shipped_file(name: str) -> Path:
    return CALIB_DIR / name


def default_heldout_texts() -> dict[str, Path]:
    return {"heldout_en": shipped_file("heldout_en.txt"), "heldout_ko": shipped_file("heldout_ko.txt")}


def _read_passages(path: Path) -> list[str]:
    try:
        if path.suffix == ".jsonl":
            rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
            return [r["text"] if isinstance(r, dict) else str(r) for r in rows]
        return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError as err:
        raise QuantizationError(f"{path} is not UTF-8 text (byte {err.start}): convert it to UTF-8") from err
    except (json.JSONDecodeError, KeyError) as err:
        raise QuantizationError(f"{path}: each line must be a JSON string or an object with a \"text\" field "
                                f"({type(err).__name__}: {err})") from err
    except OSError as err:
        raise QuantizationError(f"{path} could not be read: {err.strerror or err}") from err


def _hub_passages(name: str) -> list[str]:
    import datasets

    repo, config, split, field = HUB_DATASETS[name]
    try:
        ds = datasets.load_dataset(repo, config, split=split)
    except Exception as err:  # offline, renamed, gated: the message matters more than the type
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise QuantizationError(f"could not load hub dataset {name!r} ({repo}): {first_line}") from err
    return [t for t in ds[field] if t and t.strip()]


def check_text_source(source: str | Path | None, option: str = "--calib") -> Path | None:
    """The local file a text source names (None for the default set and hub datasets); a missing one is refused."""
    if source is None or str(source) in ("default", *HUB_DATASETS):
        return None
    path = Path(source).expanduser()
    if not path.is_file():
        raise QuantizationError(
            f"{option} {str(source)!r} is neither a file nor one of: default, {', '.join(HUB_DATASETS)}"
        )
    return path


def load_passages(source: str | Path | None, option: str = "--calib") -> list[str]:
    """Text passages from the default set (None), a .txt/.jsonl file, or a hub dataset name.

    The default interleaves the shipped English and Korean calibration text 1:1.
    """
    if source is None or str(source) == "default":
        en = _read_passages(shipped_file("calib_en.txt"))
        ko = _read_passages(shipped_file("calib_ko.txt"))
        return [p for pair in zip(en, ko, strict=False) for p in pair]
    path = check_text_source(source, option)
    return _hub_passages(str(source)) if path is None else _read_passages(path)


def load_text(source: str | Path) -> str:
    """One evaluation text (passages joined by blank lines)."""
    return "\n\n".join(load_passages(source, "--text"))


@dataclass
class CalibrationSet:
    input_ids: torch.Tensor  # long [n, seqlen], right-padded
    attention_mask: torch.Tensor  # long [n, seqlen], 0 on padding

    @property
    def n_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def build_calibration_set(
    tokenizer,
    passages: list[str],
    nsamples: int = 128,
    seqlen: int = 512,
    seed: int = 0,
    chat_template: bool = False,
    min_tokens: int = 32,
) -> CalibrationSet:
    """nsamples sequences of up to seqlen tokens: passages, shuffled by seed, packed end to end.

    Each sample starts at a passage boundary; a sample shorter than seqlen (the text ran out) is
    right-padded and its padding masked out.
    """
    if not passages:
        raise QuantizationError("calibration data is empty: give a --calib file with text in it")
    order = list(range(len(passages)))
    random.Random(seed).shuffle(order)
    separator = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    samples: list[list[int]] = []
    current: list[int] = []
    for i in order:
        text = passages[i]
        if chat_template and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False)
        ids = tokenizer(text, add_special_tokens=not current)["input_ids"]
        current.extend((separator if current else []) + ids)
        while len(current) >= seqlen and len(samples) < nsamples:
            samples.append(current[:seqlen])
            current = []
        if len(samples) == nsamples:
            break
    if len(samples) < nsamples and len(current) >= min_tokens:
        samples.append(current[:seqlen])
    total = sum(map(len, samples))
    if not samples or total < min_tokens:
        raise QuantizationError(
            f"calibration data too short: {total} tokens; need at least {min_tokens} "
            f"(--nsamples {nsamples} x --seqlen {seqlen} asks for {nsamples * seqlen})"
        )
    if len(samples) < nsamples:
        log.warning("calibration text gave only %d of %d samples (%d tokens)", len(samples), nsamples, total)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(samples), seqlen), pad, dtype=torch.long)
    mask = torch.zeros((len(samples), seqlen), dtype=torch.long)
    for row, ids in enumerate(samples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        mask[row, : len(ids)] = 1
    return CalibrationSet(input_ids, mask)
