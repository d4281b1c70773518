"""Batched greedy generation with stop strings (GSM8K answers, side-by-side prompts)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList


class StopOnStrings(StoppingCriteria):
    """Stops each row once its generated text contains one of the stop strings."""

    def __init__(self, tokenizer, stop: Sequence[str], prompt_width: int):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.prompt_width = prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_width :])
        done = [any(s in text for s in self.stop) for text in texts]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def truncate_at_stop(text: str, stop: Sequence[str]) -> str:
    cut = min((text.find(s) for s in stop if s in text), default=len(text))
    return text[:cut]


def chat_prompt(tokenizer, prompt: str) -> str:
    """The prompt in the tokenizer's chat template when it has one (instruct models), else as is."""
    if not getattr(tokenizer, "chat_template", None):
        return prompt
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode(tokenizer, prompts: Sequence[str], chat: bool = False) -> list[list[int]]:
    """Token ids of the prompts, as is, or with chat: in the tokenizer's chat template (chat_prompt), which writes
    its own special tokens (the tokenizer adds its own only when there is no template)."""
    if not chat:
        return tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    templated = bool(getattr(tokenizer, "chat_template", None))
    return tokenizer([chat_prompt(tokenizer, p) for p in prompts], add_special_tokens=not templated)["input_ids"]


def generate(
    model,
    tokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    stop: Sequence[str] = (),
    batch_size: int = 8,
    chat: bool = False,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Greedy continuations of the prompts (encoded as `encode` does), cut at the first stop string, in the
    prompts' order."""
    encoded = encode(tokenizer, prompts, chat)
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]), reverse=True)
    outputs = [""] * len(prompts)
    for start in range(0, len(order), batch_size):
        indices = order[start : start + batch_size]
        texts = _generate_batch(model, tokenizer, [encoded[i] for i in indices], max_new_tokens, stop)
        for i, text in zip(indices, texts, strict=True):
            outputs[i] = truncate_at_stop(text, stop)
        if progress is not None:
            progress(len(indices))
    return outputs


def greedy_config(model, tokenizer, max_new_tokens: int) -> GenerationConfig:
    """Plain greedy decoding (none of the model's own sampling or penalty defaults), stopping at its EOS."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    if isinstance(pad, list):
        pad = pad[0]
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad)


@torch.no_grad()
def _generate_batch(
    model, tokenizer, rows: list[list[int]], max_new_tokens: int, stop: Sequence[str]
) -> list[str]:
    config = greedy_config(model, tokenizer, max_new_tokens)
    pad = config.pad_token_id
    width = max(map(len, rows))
    # Left padding: every row's next token is then predicted at the same (last) position.
    input_ids = torch.full((len(rows), width), pad if pad is not None else 0, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        input_ids[b, width - len(row) :] = torch.tensor(row)
        attention_mask[b, width - len(row) :] = 1
    device = next(model.parameters()).device
    criteria = StoppingCriteriaList([StopOnStrings(tokenizer, stop, width)] if stop else [])
    output = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        generation_config=config,
        stopping_criteria=criteria,
    )
    return tokenizer.batch_decode(output[:, width:], skip_special_tokens=True)
