#!/usr/bin/env bash
# Debian's Chromium for the browser test (tests/flow/test_browser_ui.py, marker `browser`),
# which drives it through Playwright. scripts/test.sh runs this; the main job never needs a
# browser. Where Chromium cannot be installed the browser test is skipped, nothing else
# needs it; a failed attempt is not repeated until .venv is rebuilt.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x /usr/bin/chromium ] && exit 0
command -v apt-get >/dev/null 2>&1 || exit 0
tried=.venv/.chromium-tried
[ -e "$tried" ] && exit 0
touch "$tried"
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo -n"
if ! { $sudo apt-get update -q && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
    chromium; } >.venv/chromium-install.log 2>&1; then
  echo "test setup: could not install chromium (see .venv/chromium-install.log);" \
    "the browser test will be skipped" >&2
fi
