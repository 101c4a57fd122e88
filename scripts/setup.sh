#!/usr/bin/env bash
# Create .venv and install rollflow into it; safe to run again (it only installs what changed).
# torch 2.13.0 goes in first: a bare `torch` requirement would pull GBs of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
stamp=.venv/.rollflow-installed
# the checkout's path too: the editable install points at it, so a moved checkout reinstalls
want="$( (cat pyproject.toml scripts/setup.sh; pwd) | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # uv installs what pip would (the same index), resolving and unpacking in parallel: about
  # 15 s on a 2-core machine against pip's 2 min (bench/RESULTS.md, "CI cost"); pip is the
  # fallback where uv cannot install. uv writes no bytecode unless told (pip does), and with
  # PYTHONDONTWRITEBYTECODE set no process writes it later: every process would then compile
  # torch's and transformers' sources at each import, 12.6 against 5.5 CPU-s for
  # `import torch, transformers.modeling_utils` (bench/RESULTS.md, "CI cost").
  .venv/bin/python -m pip install -q --upgrade pip uv
  uv=(.venv/bin/python -m uv pip install --python .venv/bin/python -q --compile-bytecode)
  links=${PIP_FIND_LINKS:-$(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true)}
  if [ -n "$links" ] && ls "$links"/torch-2.13.0+cpu-*.whl > /dev/null 2>&1; then
    # the CPU wheel pip's find-links holds (uv would not prefer it to the index's CUDA one)
    "${uv[@]}" --no-index --find-links "$links" --no-deps "torch==2.13.0" \
      || .venv/bin/python -m pip install -q "torch==2.13.0"
  else
    .venv/bin/python -m pip install -q "torch==2.13.0"
  fi
  "${uv[@]}" -e ".[dev,router,envs]" || .venv/bin/python -m pip install -q -e ".[dev,router,envs]"
  echo "$want" > "$stamp"
fi
# rollflow's own modules as bytecode, as uv does for the packages: where PYTHONDONTWRITEBYTECODE
# is set (this project's machines set it) no process writes any, and every actor, driver and
# test worker compiled the modules it imports from source at each start (compileall skips
# what is up to date: about 0.1 s when nothing changed).
.venv/bin/python -m compileall -q -j 0 flows tasks engines storage examples bench tests > /dev/null
# The embedded engine's compiled decode step, built once per machine (~30 s) rather than in a
# first run; without a compiler the engine uses its Python step, and says so. `--no-build`:
# the caller builds it (scripts/test.sh, beside the type check: each keeps one core busy).
[ "${1:-}" = "--no-build" ] && exit 0
.venv/bin/python -m engines.inference.fused_decode \
  || echo "setup: the fused decode step did not build; the embedded engine will use its Python step" >&2
