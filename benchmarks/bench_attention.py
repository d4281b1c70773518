"""Decode attention alone: quantkit's split-cache kernel against SDPA as StaticDecoder ran it before (masked, over the
whole static cache), at Llama-3-8B's attention shapes (32 query heads on 8 kv heads, head_dim 128, fp16).

    source benchmarks/device_env.sh; QUANTKIT_COMMIT=<commit> python benchmarks/bench_attention.py --out DIR

A cell is a decode step of `batch` sequences at position `prompt` over a cache of prompt + 64 slots. Its timing is
one CUDA graph of LAYERS calls, each on its own cache (as a step's layers read theirs), replayed; the median replay
over LAYERS. GB/s counts the cache slots a step must read (0..prompt of each kv head, keys and values). Each cell's
kernel output is checked against SDPA's. Writes attention.json and attention.md (date, device, command, commit).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_kernels import graph_time, printing_log, relative_error, run_meta
from quantkit.kernels import decode_attention as attention_module
from quantkit.kernels.decode_attention import decode_attention

KV_HEADS, GROUP, HEAD_DIM, LAYERS, SLACK = 8, 4, 128, 32, 64


def cell(batch: int, prompt: int) -> dict:
    length = prompt + SLACK
    q = torch.randn(batch, KV_HEADS, GROUP, HEAD_DIM, device="cuda", dtype=torch.float16)
    caches = [(torch.randn(batch, KV_HEADS, length, HEAD_DIM, device="cuda", dtype=torch.float16),
               torch.randn(batch, KV_HEADS, length, HEAD_DIM, device="cuda", dtype=torch.float16))
              for _ in range(LAYERS)]
    positions = torch.tensor([prompt], device="cuda")
    mask = (torch.arange(length, device="cuda")[None] <= positions[:, None]).repeat(GROUP, 1)
    scale = HEAD_DIM ** -0.5

    def kernel(k, v):
        return decode_attention(q, k, v, positions, scale)

    def sdpa(k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    rel_err = relative_error(kernel(*caches[0]), sdpa(*caches[0]))
    t_kernel = graph_time([lambda k=k, v=v: kernel(k, v) for k, v in caches])
    t_sdpa = graph_time([lambda k=k, v=v: sdpa(k, v) for k, v in caches])
    read = batch * KV_HEADS * (prompt + 1) * HEAD_DIM * 2 * 2
    return dict(batch=batch, prompt=prompt, kernel_us=t_kernel * 1e6, sdpa_us=t_sdpa * 1e6,
                speedup=t_sdpa / t_kernel, kernel_GBps=read / t_kernel / 1e9, sdpa_GBps=read / t_sdpa / 1e9,
                rel_err_vs_sdpa=rel_err)


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# Decode attention, Llama-3-8B shapes, {meta['device']}", "", f"- date: {meta['date']}",
             f"- command: `{meta['command']}`", f"- git commit: {meta['commit']}",
             f"- torch {meta['torch']}, triton {meta['triton']}", "",
             "| programs per SM | batch | position | kernel us | SDPA us | speedup | kernel GB/s | SDPA GB/s | "
             "rel. err vs SDPA |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['programs_per_sm']} | {r['batch']} | {r['prompt']} | {r['kernel_us']:.2f} | {r['sdpa_us']:.2f} | {r['speedup']:.2f}x | "
              f"{r['kernel_GBps']:.0f} | {r['sdpa_GBps']:.0f} | {r['rel_err_vs_sdpa']:.1e} |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--programs-per-sm", type=int, nargs="+", default=[attention_module.PROGRAMS_PER_SM],
                        help="time the kernel at each of these split counts (decode_attention.PROGRAMS_PER_SM)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = printing_log(args.out / "log_attention.txt")
    meta, rows = run_meta(), []
    torch.manual_seed(0)
    for per_sm in args.programs_per_sm:
        attention_module.PROGRAMS_PER_SM = per_sm
        for batch in args.batches:
            for prompt in args.prompts:
                rows.append(dict(programs_per_sm=per_sm, **cell(batch, prompt)))
                log(json.dumps(rows[-1]))
                torch.cuda.empty_cache()
    (args.out / "attention.json").write_text(json.dumps(dict(meta=meta, results=rows), indent=1))
    (args.out / "attention.md").write_text(markdown(meta, rows))
    return int(any(not r["rel_err_vs_sdpa"] < 2e-3 for r in rows))


if __name__ == "__main__":
    sys.exit(main())
