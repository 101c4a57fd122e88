#!/usr/bin/env bash
# Lint, type-check, check the import layers and run the test suite (GPU tests are skipped
# without a GPU). Arguments go to pytest: `scripts/test.sh tests/unit/test_cli.py -n 0`.
#
# Each test is marked by its cost (from its directory, tests/conftest.py):
#   unit         no processes, no Ray: `scripts/test.sh -m unit` is the fast subset (~2 min)
#   integration  starts processes or a Ray head, trains no run
#   flow         trains runs against the session's Ray head and Prefect server
#   e2e          embedded engines and the torch trainer on a tiny model
#   browser      drives Chromium through Playwright (skipped where it is missing)
#   gpu          needs a CUDA GPU (deselected here; `pytest -m gpu tests/gpu` on a GPU machine)
# The tests run side by side in ROLLFLOW_TEST_WORKERS pytest-xdist workers (default 3: the
# flow tests mostly wait), each with its own Ray head, Prefect server, moto server and
# temporary directories; a module's tests stay on one worker (`--dist loadfile`: they share
# module fixtures), and modules start in the order tests/conftest.py gives them, costliest
# first (`--no-loadscope-reorder`: xdist would otherwise start modules with many tests, the
# quick unit ones, first and leave the long flow tests for the end). `-n 0` runs everything
# in this process. The 15 slowest tests are listed at the end. A worker that crashes (a
# timeout ends it, pyproject's timeout_method) ends the run at once, naming the test
# (`--max-worker-restart 0`): a replaced worker under `--dist loadfile` can wait for ever
# (pytest-xdist 3.8; three CI runs hung so on 2026-11-29).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --no-build
# The fused decode step's build (one compiler process, ~30 s on a fresh clone) runs beside the
# Debian packages, lint and the type check (one process each): a fresh clone reached pytest
# 15 s sooner on 2 cores, 90 s against 105 (bench/RESULTS.md, "CI cost").
.venv/bin/python -m engines.inference.fused_decode > .venv/fused-decode-build.log 2>&1 &
build=$!
bash scripts/install_debian_packages.sh
export PREFECT_SERVER_ANALYTICS_ENABLED=false RAY_AUTH_MODE=disabled
# pytest caches each test module's assertion-rewritten bytecode unless PYTHONDONTWRITEBYTECODE
# is set; set, every xdist worker rewrites and compiles all of them again (2.5 of the 16 CPU-s
# a worker's collection takes on this project's machine, which sets it).
unset PYTHONDONTWRITEBYTECODE
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/lint-imports  # flows -> tasks -> engines -> storage (pyproject [tool.importlinter])
wait "$build" || { cat .venv/fused-decode-build.log >&2
  echo "test setup: the fused decode step did not build; the embedded engine will use its Python step" >&2; }
exec .venv/bin/python -m pytest -q -m "not gpu" -n "${ROLLFLOW_TEST_WORKERS:-3}" \
  --dist loadfile --no-loadscope-reorder --max-worker-restart 0 --durations=15 "$@"
