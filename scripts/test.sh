#!/usr/bin/env bash
# The test command: set up (idempotent), lint, run the whole suite.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_dev.sh
python3 -m ruff check .
python3 -m pytest -q -p no:cacheprovider --durations=15 "$@"
