"""Held-out perplexity and KL divergence to the unquantized model, against brute force in float64."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_adapters import tiny_model
from torch import nn

import quantkit.eval.perplexity as ppl_module
from quantkit.eval.perplexity import perplexity


class FixedTokenizer:
    """Tokenizes any text to the same ids (the metrics only window them)."""

    def __init__(self, ids: torch.Tensor, bos_token_id: int | None) -> None:
        self.ids, self.bos_token_id = ids, bos_token_id

    def __call__(self, _text: str, add_special_tokens: bool, return_tensors: str) -> dict:
        assert not add_special_tokens and return_tensors == "pt"
        return {"input_ids": self.ids[None]}


def _windows(ids: torch.Tensor, seqlen: int, count: int, bos: int | None) -> torch.Tensor:
    windows = ids[: count * seqlen].view(count, seqlen)
    return windows if bos is None else torch.cat([torch.full((count, 1), bos), windows], dim=1)


def _log_probs(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    return model.double()(input_ids=windows).logits[:, :-1].log_softmax(-1)


@pytest.fixture(autouse=True)
def small_slices(monkeypatch) -> None:
    monkeypatch.setattr(ppl_module, "NLL_CHUNK_ELEMENTS", 128 * 5)  # 5 rows a slice: windows split unevenly


@pytest.mark.parametrize("bos", [None, 1])
def test_perplexity_and_kl_are_the_brute_force_float64_means(bos: int | None) -> None:
    model = tiny_model("llama")
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ids = torch.randint(2, 128, (100,), generator=torch.Generator().manual_seed(0))
    tokenizer = FixedTokenizer(ids, bos)
    windows = _windows(ids, 16, 3, bos)  # 100 tokens: 6 windows of 16, the first 3 scored

    with torch.no_grad():
        reference, logp = _log_probs(copy.deepcopy(model), windows), _log_probs(copy.deepcopy(other), windows)
    targets = windows[:, 1:]
    nll = -logp.gather(-1, targets[..., None]).mean().item()
    kl = (reference.exp() * (reference - logp)).sum(-1).mean().item()

    alone = perplexity(other, tokenizer, "", seqlen=16, max_windows=3, batch_size=2)
    assert alone["tokens"] == targets.numel() and alone["windows"] == 3 and "kl" not in alone
    assert alone["nll"] == pytest.approx(nll, rel=1e-5) and alone["ppl"] == pytest.approx(math.exp(nll))
    measured = perplexity(other, tokenizer, "", seqlen=16, max_windows=3, batch_size=2, reference=model)
    assert measured["nll"] == alone["nll"] and measured["kl"] == pytest.approx(kl, rel=1e-4) and kl > 1e-3
    assert perplexity(model, tokenizer, "", 16, 3, reference=model)["kl"] == pytest.approx(0, abs=1e-6)


def test_a_text_shorter_than_a_window_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="fewer than one window of 16"):
        perplexity(tiny_model("llama"), FixedTokenizer(torch.arange(10), None), "", 16)
