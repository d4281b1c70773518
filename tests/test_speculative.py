"""Speculative-decoding acceptance: the teacher-forced shortcut against real greedy speculative decoding run step
by step, alpha against sum_x min(p, q) in float64, and the bookkeeping at the edges."""

from __future__ import annotations

import pytest
import torch
from test_eval_report import fake_quantized
from test_eval_tasks import tiny_lm  # noqa: F401  (fixture)

from quantkit.eval.speculative import (
    acceptance,
    draft_agreement,
    expected_tokens_per_pass,
    run_target,
    target_passes,
)

pytestmark = pytest.mark.usefixtures("single_thread")
PROMPTS = ["Water boils at", "하늘이 파란 이유는", "The quick brown fox"]
NEW_TOKENS = 24


@torch.no_grad()
def greedy(model, ids: list[int]) -> int:
    return int(model(torch.tensor([ids])).logits[0, -1].argmax())


@torch.no_grad()
def speculative_decode(target, draft, prompt: list[int], length: int, k: int) -> tuple[list[int], int]:
    """Greedy speculative decoding as an engine runs it: the draft proposes k tokens autoregressively, one target
    pass scores them all, the longest agreeing prefix is kept plus the target's own next token."""
    out, passes = list(prompt), 0
    while len(out) - len(prompt) < length:
        proposal = list(out)
        for _ in range(k):
            proposal.append(greedy(draft, proposal))
        choices = target(torch.tensor([proposal])).logits[0, len(out) - 1:].argmax(dim=-1).tolist()
        passes += 1
        drafted = proposal[len(out):]
        accepted = 0
        while accepted < k and drafted[accepted] == choices[accepted]:
            accepted += 1
        out += drafted[:accepted] + [choices[accepted]]
    return out[len(prompt):len(prompt) + length], passes


@pytest.fixture(scope="module")
def pair(tiny_lm):  # noqa: F811
    """(target, a draft that agrees on some tokens only, tokenizer, the target's run)."""
    model, tokenizer = tiny_lm
    draft = fake_quantized(model, group_size=16)
    return model, draft, tokenizer, run_target(model, tokenizer, PROMPTS, NEW_TOKENS)


def test_target_passes_match_real_speculative_decoding(pair) -> None:
    target, draft, _, run = pair
    matches, _ = draft_agreement(draft, run)
    assert 0 < sum(map(sum, matches)) < sum(map(len, matches))  # a draft that agrees on some tokens only
    for prompt, continuation, row in zip(run.prompts, run.continuations, matches, strict=True):
        length = len(continuation)  # NEW_TOKENS unless the target chose its EOS
        assert [greedy(target, prompt + continuation[:i]) for i in range(length)] == continuation
        for k in (1, 2, 3, 5):
            tokens, passes = speculative_decode(target, draft, prompt, length, k)
            assert tokens == continuation  # greedy verification never changes the output
            assert target_passes(row, k) == passes, (k, row)


def test_alpha_is_the_overlap_of_the_two_distributions(pair) -> None:
    target, draft, _, run = pair
    _, alphas = draft_agreement(draft, run)
    with torch.no_grad():
        for prompt, continuation, row in zip(run.prompts, run.continuations, alphas, strict=True):
            ids = torch.tensor([prompt + continuation[:-1]])
            p = target(ids).logits[0, len(prompt) - 1:].softmax(dim=-1)
            q = draft(ids).logits[0, len(prompt) - 1:].softmax(dim=-1)
            torch.testing.assert_close(torch.tensor(row, dtype=torch.float64), torch.minimum(p, q).sum(dim=-1),
                                       atol=1e-6, rtol=0)


def test_a_model_drafting_for_itself_is_always_accepted(pair) -> None:
    target, _, tokenizer, run = pair
    result = acceptance(target, tokenizer, run, draft_tokens=(1, 4))
    lengths = [len(c) for c in run.continuations]
    assert result["tokens"] == sum(lengths) and result["greedy_match"] == 1
    assert result["alpha_t1"] == pytest.approx(1, abs=1e-6)
    for k in (1, 4):  # every pass gives k + 1 tokens, the last one what is left
        passes = sum(-(-n // (k + 1)) for n in lengths)
        assert result["greedy_tokens_per_pass"][k] == pytest.approx(sum(lengths) / passes)
    assert result["expected_tokens_per_pass_t1"][4] == pytest.approx(5, rel=1e-4)


def test_acceptance_summary_and_edges(pair) -> None:
    _, draft, tokenizer, run = pair
    result = acceptance(draft, tokenizer, run)
    matches, alphas = draft_agreement(draft, run)
    assert result["greedy_match"] == pytest.approx(sum(map(sum, matches)) / result["tokens"])
    assert [p["tokens"] for p in result["per_prompt"]] == [len(c) for c in run.continuations]
    assert 1 <= result["greedy_tokens_per_pass"][1] <= result["greedy_tokens_per_pass"][8] <= 9
    assert 0 < result["alpha_t1"] < 1
    assert target_passes([], 4) == 0 and target_passes([False] * 3, 4) == 3 and target_passes([True] * 8, 4) == 2
    assert expected_tokens_per_pass(0.0, 4) == 1 and expected_tokens_per_pass(0.5, 1) == 1.5
    with pytest.raises(ValueError, match="encodes the prompts differently"):
        acceptance(draft, tokenizer, type(run)(["other"] * 3, run.prompts, run.continuations, run.probabilities))
