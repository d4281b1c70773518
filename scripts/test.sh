#!/usr/bin/env bash
# The test command: set up (idempotent), lint, run the whole suite.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_dev.sh
python3 -m ruff check .
# Two workers, one test file each at a time (module fixtures quantize once); tests/conftest.py gives each worker
# its share of the cores and starts the slow real-model files first.
python3 -m pytest -q -p no:cacheprovider --durations=15 -n 2 --dist loadfile --no-loadscope-reorder "$@"
