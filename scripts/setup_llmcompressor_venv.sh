#!/usr/bin/env bash
# Creates a separate virtualenv with llm-compressor (and the auto-round it pulls in), for
# benchmarks/bench_vs_llmcompressor.py's `llmc` step (llm-compressor's own oneshot; it needs no quantkit) and
# benchmarks/compare_llmcompressor.py (which imports quantkit too: `VENV/bin/pip install --no-deps -e .` into a
# venv of your own, since quantkit.kernels is mapped from kernels/ by the install, not by PYTHONPATH).
# Separate because llm-compressor pins transformers (<=5.17) and compressed-tensors to versions the main env
# must not be forced onto. Not part of the test set-up.
#
# Usage: scripts/setup_llmcompressor_venv.sh [VENV_DIR]    (default: /work/venv-llmc)
# Idempotent: does nothing when VENV_DIR already imports the pinned llm-compressor.
set -euo pipefail

LLMC_VERSION=0.14.0.1
# The CPU build of torch from the local wheel folder pip's config points at (find-links); PyPI's resolver
# would otherwise pull a multi-GB CUDA build.
TORCH_VERSION=2.13.0

venv_dir=${1:-/work/venv-llmc}
py="$venv_dir/bin/python"

llmc_is_ready() {
    [[ -x "$py" ]] && "$py" -c "import llmcompressor, gguf, sys; assert llmcompressor.__version__ == sys.argv[1]" \
        "$LLMC_VERSION" >/dev/null 2>&1
}

if llmc_is_ready; then
    echo "llmcompressor $LLMC_VERSION already installed in $venv_dir; nothing to do"
    exit 0
fi

python3 -m venv "$venv_dir"
# pip's config also lists local index folders that lack most packages: drop its warning per package.
"$py" -m pip install --quiet "torch==${TORCH_VERSION}" "llmcompressor==${LLMC_VERSION}" gguf \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
llmc_is_ready || { echo "error: llmcompressor does not import in $venv_dir" >&2; exit 1; }
echo "llmcompressor $LLMC_VERSION installed in $venv_dir ($(du -sh "$venv_dir" | cut -f1))"
