#!/usr/bin/env bash
# Debian's packages that some tests need, each skipped where it cannot be installed (nothing
# else needs them; a failed attempt is not repeated until .venv is rebuilt):
#   chromium    the browser test (tests/flow/test_browser_ui.py, marker `browser`), through
#               Playwright; the main job never needs a browser
#   bubblewrap  the code sandbox (engines/sandbox/bubblewrap.py: rollout.rm_type code_tests)
#               and its tests (tests/integration/test_code_sandbox.py)
# scripts/test.sh runs this.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v apt-get >/dev/null 2>&1 || exit 0
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo -n"
updated=""
install() {  # package, the file it brings, what is skipped without it
  local package=$1 file=$2 skipped=$3 tried=.venv/.$1-tried
  { [ -x "$file" ] || [ -e "$tried" ]; } && return 0
  touch "$tried"
  if [ -z "$updated" ]; then $sudo apt-get update -q >".venv/$package-install.log" 2>&1 || true; updated=1; fi
  if ! $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$package" \
      >>".venv/$package-install.log" 2>&1; then
    echo "test setup: could not install $package (see .venv/$package-install.log); $skipped" >&2
  fi
}
install chromium /usr/bin/chromium "the browser test will be skipped"
install bubblewrap /usr/bin/bwrap "the code sandbox's tests will be skipped"
