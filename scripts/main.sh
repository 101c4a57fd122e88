#!/usr/bin/env bash
# The main job on the embedded default: local Ray, local storage, embedded engine, torch
# trainer. Extra arguments go to examples/arithmetic/run.py (e.g. --fresh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PREFECT_SERVER_ANALYTICS_ENABLED=false
exec .venv/bin/python -m examples.arithmetic.run "$@"
