"""Speculative-decoding acceptance of a draft model (a quantized copy, say) against its target (the original).

Greedy verification: the draft proposes k tokens, the target keeps them up to its first disagreement with its own
greedy choice and adds one token of its own (the correction, or a bonus token after k accepted ones). While the
draft's tokens are accepted its context is the target's own continuation, so one teacher-forced pass of the draft
over the target's greedy continuation says, per position, whether the draft would propose the target's token;
replaying those matches for a draft length k gives the exact number of target passes greedy speculative decoding
needs (`target_passes`; the test replays real speculative decoding step by step against it).

Sampling at temperature 1 (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
Definition 3.1): a drafted token is accepted with probability alpha = sum_x min(p(x), q(x)) for target and draft
next-token distributions p and q; measured on the same contexts (the target's greedy continuations), with their
i.i.d. estimate (1 - alpha^(k + 1)) / (1 - alpha) of the tokens per target pass (their equation 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quantkit.eval.generation import encode, greedy_config

DEFAULT_DRAFT_TOKENS = (1, 2, 4, 8)


@dataclass
class TargetRun:
    """The target's greedy continuation of each prompt and its next-token probabilities along it."""

    texts: list[str]
    prompts: list[list[int]]  # token ids, chat template applied
    continuations: list[list[int]]
    probabilities: list[torch.Tensor]  # [len(continuation), vocab] float32, on the CPU


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def run_target(model, tokenizer, prompts: Sequence[str], max_new_tokens: int) -> TargetRun:
    """Greedy continuations, one prompt at a time (no padding), with the logits generation chose them from."""
    config = greedy_config(model, tokenizer, max_new_tokens)
    config.output_logits = config.return_dict_in_generate = True
    run = TargetRun(list(prompts), encode(tokenizer, prompts, chat=True), [], [])
    for ids in run.prompts:
        out = model.generate(input_ids=torch.tensor([ids], device=_device(model)), generation_config=config)
        run.continuations.append(out.sequences[0, len(ids):].tolist())
        run.probabilities.append(torch.cat(out.logits).float().softmax(dim=-1).cpu())
    return run


@torch.no_grad()
def draft_agreement(model, target: TargetRun) -> tuple[list[list[bool]], list[list[float]]]:
    """Per prompt and continuation position: does the draft's greedy token match the target's, and
    alpha = sum_x min(p(x), q(x)) of the two next-token distributions."""
    matches, alphas = [], []
    for ids, continuation, p in zip(target.prompts, target.continuations, target.probabilities, strict=True):
        if not continuation:
            matches.append([])
            alphas.append([])
            continue
        tokens = torch.tensor([ids + continuation[:-1]], device=_device(model))
        logits = model(tokens).logits[0, len(ids) - 1:].float().cpu()
        if logits.shape[-1] != p.shape[-1]:
            raise ValueError(f"the draft's vocabulary ({logits.shape[-1]}) is not the target's ({p.shape[-1]})")
        q = logits.softmax(dim=-1)
        matches.append((logits.argmax(dim=-1) == torch.tensor(continuation)).tolist())
        alphas.append(torch.minimum(p, q).sum(dim=-1).tolist())
    return matches, alphas


def target_passes(matches: Sequence[bool], draft_tokens: int) -> int:
    """Target forward passes that greedy speculative decoding with `draft_tokens` drafted tokens per pass needs to
    produce the continuation whose per-position draft matches these are."""
    position = passes = 0
    while position < len(matches):
        accepted = 0
        while accepted < draft_tokens and position + accepted < len(matches) and matches[position + accepted]:
            accepted += 1
        position += accepted + 1  # the accepted drafts and the target's own next token
        passes += 1
    return passes


def acceptance(model, tokenizer, target: TargetRun, draft_tokens: Sequence[int] = DEFAULT_DRAFT_TOKENS) -> dict:
    """The draft's acceptance against the target: greedy match rate, greedy tokens per target pass for each draft
    length, alpha at temperature 1 and its i.i.d. tokens per pass; overall and per prompt."""
    if encode(tokenizer, target.texts, chat=True) != target.prompts:
        raise ValueError("the draft's tokenizer encodes the prompts differently from the target's: speculative "
                         "decoding needs one vocabulary")
    matches, alphas = draft_agreement(model, target)
    flat_matches = [m for row in matches for m in row]
    flat_alphas = [a for row in alphas for a in row]
    tokens = len(flat_matches)
    alpha = sum(flat_alphas) / max(tokens, 1)
    return {
        "tokens": tokens,
        "greedy_match": sum(flat_matches) / max(tokens, 1),
        "greedy_tokens_per_pass": {k: tokens / max(sum(target_passes(row, k) for row in matches), 1)
                                   for k in draft_tokens},
        "alpha_t1": alpha,
        "expected_tokens_per_pass_t1": {k: expected_tokens_per_pass(alpha, k) for k in draft_tokens},
        "per_prompt": [{"tokens": len(m), "greedy_match": sum(m) / max(len(m), 1),
                        "alpha_t1": sum(a) / max(len(a), 1)} for m, a in zip(matches, alphas, strict=True)],
    }


def expected_tokens_per_pass(alpha: float, draft_tokens: int) -> float:
    """(1 - alpha^(k+1)) / (1 - alpha): tokens per target pass with i.i.d. acceptance alpha (k + 1 at alpha 1)."""
    return float(draft_tokens + 1) if alpha >= 1 else (1 - alpha ** (draft_tokens + 1)) / (1 - alpha)
