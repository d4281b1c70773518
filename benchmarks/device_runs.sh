#!/usr/bin/env bash
# The device measurements, each one call of at most 10 minutes (the device tool's limit):
# `bash benchmarks/device_runs.sh PART COMMIT` with $OUT set (the device tool sets it), PART one of
#   check      the GPU tests (test_cuda.py, test_gptq.py on cuda) and the decode attention kernel alone against SDPA  (~3 min)
#   w4a16      the tuned W4A16 g128 grid, six shapes, M = 1 16 64 1024 4096                            (~4 min)
#   w4a8       the tuned W4A8 two-level g128 grid, M = 1 16 64 256 1024 4096                          (~4 min)
#   fp8        the FP8 GPU tests, then the tuned FP8 (W8A8, per channel) grid, M = 1 16 64 256 1024 4096 (~5 min)
#   e2e        the Llama-3-8B-shaped model end to end, compiled, with SDPA beside the kernel          (~4 min)
#   batches    the same, compiled at batch 1 8 16 64 (#42's bars), fp16 and one scheme (w4a16, w4a8 or fp8):
#              `... batches COMMIT SCHEME [--quantize-head]` (~8 min)
#   curve      fp16 and W4A16 compiled at batch 1 4 16 64 128: the throughput-latency curve, equal-latency speedups (~8 min)
#   e2e70b     the Llama-3-70B shape, 32 of its layers (what fits in fp16 beside the rest), compiled at batch 1 8 64:
#              `... e2e70b COMMIT SCHEME [--quantize-head]` (~6 min)
#   stream70b  streamed GPTQ of a Llama-3-70B-shaped checkpoint, 12 layers (~40 GB of local disk)    (~5 min)
#   stream235b streamed GPTQ of a Qwen3-235B-A22B-shaped checkpoint, 3 layers (~17 GB of local disk)  (~6 min)
#   deepseek   streamed GPTQ of a DeepSeek-V3-671B-shaped FP8 checkpoint, 2 layers (~52 GB of disk at peak) (~8 min)
#   reload70b  a Llama-3-70B-shaped W4A16 export (~37 GB) loaded onto the GPU by quantkit's reload    (~6 min)
#   layerwise70b  a 70B-shaped original (4 layers) against its export, perplexity and KL layer by layer (~4 min)
#   quantize   GPTQ and awq-gptq act-order on the Llama-3-8B shape, 128 x 2048 tokens                (~8 min)
#   ranks235b  the stream235b run under torchrun on N GPUs: `... ranks235b COMMIT N`, one call per N of 1 2 4 8 (~6 min)
#   ranks70b   the stream70b run (6 layers) under torchrun on N GPUs: `... ranks70b COMMIT N`, one call per N  (~4 min)
#   moe        the grouped MoE kernels against the per-expert loops and torch._grouped_mm (bf16), Qwen3-30B-A3B, Mixtral and DeepSeek-V3 shapes
# COMMIT is the code's commit (the device's checkout has no git history). Tuning results are cached in .devcache
# so a later part on the same warm machine does not re-tune.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
part=${1:?PART: check, w4a16, w4a8 or e2e}
export QUANTKIT_COMMIT=${2:?COMMIT} QUANTKIT_CACHE_DIR=$PWD/.devcache
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
mkdir -p "$QUANTKIT_CACHE_DIR" "$OUT"
case $part in
  check)
    PYTHONPATH=/tmp/qk python -P -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_gptq.py 2>&1 | tail -15 || true  # -P, PYTHONPATH without the checkout: its kernels/ never shadows PyPI kernels
    timeout 240 python benchmarks/bench_attention.py --out "$OUT/attention" --prompts 512 8192 32768 --batches 1 16 ;;
  w4a16)
    timeout 560 python benchmarks/bench_kernels.py --schemes w4a16 --ms 1 16 64 1024 4096 --out "$OUT/w4a16" ;;
  w4a8)
    timeout 560 python benchmarks/bench_kernels.py --schemes w4a8 --ms 1 16 64 256 1024 4096 --out "$OUT/w4a8" ;;
  fp8)
    PYTHONPATH=/tmp/qk timeout 150 python -P -m pytest -q -p no:cacheprovider tests/test_cuda.py -k fp8 2>&1 | tail -15 || true
    timeout 400 python benchmarks/bench_kernels.py --schemes fp8 --ms 1 16 64 256 1024 4096 --out "$OUT/fp8" ;;
  e2e)
    timeout 560 python benchmarks/bench_e2e.py --out "$OUT/e2e" --schemes w4a16 w4a8 --batches 1 16 \
      --compiled-batches 1 --profile --compare-attention ;;
  batches)
    scheme=${3:?batches needs a scheme: bash benchmarks/device_runs.sh batches COMMIT w4a16|w4a8}
    timeout 580 python benchmarks/bench_e2e.py --out "$OUT/batches_$scheme" --schemes "$scheme" --batches 1 8 16 64 \
      --compiled-batches 1 8 16 64 "${@:4}" ;;
  curve)
    timeout 580 python benchmarks/bench_e2e.py --out "$OUT/curve" --schemes w4a16 --batches 1 \
      --compiled-batches 1 4 16 64 128 ;;
  e2e70b)
    scheme=${3:?e2e70b needs a scheme: bash benchmarks/device_runs.sh e2e70b COMMIT w4a16|w4a8}
    timeout 580 python benchmarks/bench_e2e.py --out "$OUT/e2e70b_$scheme" --shape 70b --layers 32 --schemes "$scheme" \
      --batches 1 --compiled-batches 1 8 64 "${@:4}" ;;
  stream70b)
    df -h /tmp | tail -1
    timeout 570 python benchmarks/bench_streaming_device.py --shape 70b --layers 12 --out "$OUT/stream70b" ;;
  stream235b)
    df -h /tmp | tail -1
    timeout 570 python benchmarks/bench_streaming_device.py --shape qwen3-235b-a22b --layers 3 \
      --work-dir /tmp/quantkit-bench-235b --out "$OUT/stream235b" ;;
  deepseek)
    df -h /tmp | tail -1
    timeout 570 python benchmarks/bench_streaming_device.py --shape deepseek --layers 2 \
      --work-dir /tmp/quantkit-bench-deepseek --out "$OUT/deepseek" ;;
  ranks235b)
    n=${3:?ranks235b needs a GPU count: bash benchmarks/device_runs.sh ranks235b COMMIT N}
    timeout 570 python -m torch.distributed.run --standalone --nproc-per-node "$n" benchmarks/bench_streaming_device.py \
      --shape qwen3-235b-a22b --layers 3 --work-dir /tmp/quantkit-bench-235b --out "$OUT/ranks235b/$n" ;;
  ranks70b)
    n=${3:?ranks70b needs a GPU count: bash benchmarks/device_runs.sh ranks70b COMMIT N}
    timeout 570 python -m torch.distributed.run --standalone --nproc-per-node "$n" benchmarks/bench_streaming_device.py \
      --shape 70b --layers 6 --work-dir /tmp/quantkit-bench-70b --out "$OUT/ranks70b/$n" ;;
  layerwise70b)
    timeout 570 python benchmarks/bench_layerwise_device.py --layers 4 --out "$OUT/layerwise70b" ;;
  reload70b)
    df -h /tmp | tail -1
    timeout 280 python benchmarks/bench_reload_device.py --work /tmp/quantkit-reload-70b --out "$OUT/reload70b"
    QUANTKIT_PLAIN_COPY=1 timeout 280 python benchmarks/bench_reload_device.py --work /tmp/quantkit-reload-70b \
      --out "$OUT/reload70b" ;;
  quantize)
    mkdir -p "$OUT/quantize"
    for method in gptq awq-gptq; do
      timeout 290 python benchmarks/bench_quantize.py --method $method --act-order --nsamples 128 --seqlen 2048 \
        --batch-size 8 --out "$OUT/quantize/$method.json" || echo "$method: exit $?"
    done ;;
  moe)
    timeout 560 python benchmarks/bench_moe.py --out "$OUT/moe" ;;
  *) echo "unknown part $part: check, w4a16, w4a8, fp8, e2e, batches, curve, e2e70b, stream70b, stream235b, deepseek, ranks235b, ranks70b, reload70b, layerwise70b, quantize or moe" >&2; exit 2 ;;
esac
