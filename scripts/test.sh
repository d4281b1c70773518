#!/usr/bin/env bash
# The test command: set up (idempotent), lint, run the whole suite.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_dev.sh
python3 -m ruff check .
# -P: no repo root on sys.path, where kernels/ (installed as quantkit.kernels) would shadow the PyPI package
# `kernels` that transformers >= 5.25 requires and imports.
python3 -P -m pytest -q -p no:cacheprovider --durations=15 "$@"
