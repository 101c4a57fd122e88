#!/usr/bin/env bash
# Lint, type-check, check the import layers and run the test suite (GPU tests are skipped
# without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PREFECT_SERVER_ANALYTICS_ENABLED=false RAY_AUTH_MODE=disabled
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/lint-imports  # flows -> tasks -> engines -> storage (pyproject [tool.importlinter])
exec .venv/bin/python -m pytest -q -m "not gpu" "$@"
