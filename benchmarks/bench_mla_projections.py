"""Which MLA projections of a DeepSeek-V3-family model to quantize: each left in 16 bits in turn, on small random models.

    python benchmarks/bench_mla_projections.py --out benchmarks/accuracy/mla_projections.json

A random `deepseek_v3` model with DeepSeek-V3's head dimensions (q/k 128 + 64 rope, v 128), latent widths near its
ratios to the hidden width that g128 divides (q_lora = hidden / 4, kv_lora = hidden / 8; V3: / 4.7, / 14), a dense
first layer, routed experts plus a
shared one, is quantized with quantkit's default method (awq-gptq W4A16 g128) in variants that leave some
attention projections unquantized (`ArchAdapter.keeping` of the entry with every linear). Each variant's final logits are compared with the
original's on held-out random tokens: relative logit error and KL(original || quantized), per seed (the model's
weights and the tokens), with the share of the layer's attention weights each variant keeps. The experts and
MLPs are quantized in every variant.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DeepseekV3Config

from quantkit.config import QuantConfig
from quantkit.data import CalibrationSet
from quantkit.engine import quantize_model
from quantkit.models.adapters import DEEPSEEK_V3_EVERY_LINEAR, MLA_UNQUANTIZED

MLA = ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",
       "self_attn.o_proj")
VARIANTS = {
    "all quantized": (),
    "kv_b kept": ("self_attn.kv_b_proj",),
    "q_a + kv_a kept": ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),  # vLLM fuses them: one scheme
    "q_b kept": ("self_attn.q_b_proj",),
    "o kept": ("self_attn.o_proj",),
    "q_a + kv_a + kv_b kept (the default)": MLA_UNQUANTIZED,
    "attention kept": MLA,
}
HIDDEN, VOCAB, SEQLEN = 1024, 4096, 256


def config() -> DeepseekV3Config:
    return DeepseekV3Config(
        hidden_size=HIDDEN, num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=2816,
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=256, kv_lora_rank=128,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=16, num_experts_per_tok=4,
        n_group=4, topk_group=2, moe_intermediate_size=384, n_shared_experts=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, vocab_size=VOCAB, max_position_embeddings=2 * SEQLEN)


def random_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(), dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "experts"):
                layer.mlp.gate.weight.normal_(0, 0.02)  # the router starts at zero: spread the routing
    return model


def tokens(n: int, seed: int) -> CalibrationSet:
    ids = torch.randint(0, VOCAB, (n, SEQLEN), generator=torch.Generator().manual_seed(seed))
    return CalibrationSet(ids, torch.ones_like(ids))


@torch.no_grad()
def logits(model: torch.nn.Module, windows: CalibrationSet) -> torch.Tensor:
    return torch.cat([model(input_ids=ids[None]).logits[0].float() for ids in windows.input_ids])


def attention_share(model: torch.nn.Module, kept: tuple[str, ...]) -> float:
    """The kept projections' share of the attention weights of a layer."""
    layer = model.model.layers[0]
    sizes = {name: layer.get_submodule(name).weight.numel() for name in MLA}
    return sum(sizes[n] for n in kept) / sum(sizes.values())


def measure(seed: int, nsamples: int, log) -> list[dict]:
    model = random_model(seed)
    calib, heldout = tokens(nsamples, 100 + seed), tokens(8, 200 + seed)
    reference = logits(model, heldout)
    rows = []
    for name, kept in VARIANTS.items():
        quantized = copy.deepcopy(model)
        adapter = DEEPSEEK_V3_EVERY_LINEAR.for_config(quantized.config).keeping(kept)
        t0 = time.perf_counter()
        quantize_model(quantized, adapter, calib, QuantConfig(group_size=128), device="cpu", show_progress=False)
        out = logits(quantized, heldout)
        kl = F.kl_div(out.log_softmax(-1), reference.log_softmax(-1), log_target=True, reduction="batchmean")
        rows.append(dict(seed=seed, variant=name, kept=list(kept), attention_share_kept=attention_share(model, kept),
                         logit_rel_error=float((out - reference).norm() / reference.norm()), kl=float(kl),
                         seconds=time.perf_counter() - t0))
        log(f"seed {seed} {name}: logit error {rows[-1]['logit_rel_error']:.4f}, KL {rows[-1]['kl']:.2e}")
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per variant: mean and spread (min, max) over seeds of both figures."""
    out = []
    for name in VARIANTS:
        mine = [r for r in rows if r["variant"] == name]
        errors, kls = [r["logit_rel_error"] for r in mine], [r["kl"] for r in mine]
        out.append(dict(variant=name, attention_share_kept=mine[0]["attention_share_kept"],
                        logit_rel_error=statistics.mean(errors), logit_rel_error_range=[min(errors), max(errors)],
                        kl=statistics.mean(kls), kl_range=[min(kls), max(kls)]))
    return out


def markdown(result: dict) -> str:
    lines = ["| variant | attention weights kept in 16 bits | logit relative error (range) | KL (range) | KL vs all quantized |",
             "|---|---|---|---|---|"]
    base = result["summary"][0]["kl"]
    for row in result["summary"]:
        lines.append(f"| {row['variant']} | {row['attention_share_kept']:.1%} | {row['logit_rel_error']:.4f} "
                     f"({row['logit_rel_error_range'][0]:.4f}-{row['logit_rel_error_range'][1]:.4f}) | "
                     f"{row['kl']:.4f} ({row['kl_range'][0]:.4f}-{row['kl_range'][1]:.4f}) | "
                     f"{row['kl'] / base - 1:+.1%} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--nsamples", type=int, default=32, help=f"calibration windows of {SEQLEN} tokens")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = [row for seed in args.seeds for row in measure(seed, args.nsamples, print)]
    result = dict(date=time.strftime("%Y-%m-%d"), command=" ".join(sys.argv), config=config().to_dict(),
                  method=QuantConfig(group_size=128).label(), rows=rows, summary=summary(rows))
    args.out.write_text(json.dumps(result, indent=1))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
