"""tests/support/own_process.py, the GPU suite's module-per-process runner, on a made-up suite
of sleeping modules (no GPU): every test's report reaches the parent, a failure included;
`at_once` modules run side by side, each with its slot's environment and a ROLLFLOW_HOME of
its own; the modules `first` ranks highest start first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support import REPO_ROOT

CONFTEST = '''
import os
from tests.support import own_process

def pytest_configure(config):
    own_process.register(
        config, lambda item: True, int(os.environ["AT_ONCE"]),
        lambda items, slot: {"MODULE_SLOT": str(slot)},
        lambda items: len(items),  # the module with more tests first
    )
'''

MODULE = '''
import json, os, time

def _record(name):
    start = time.time()
    time.sleep(3)  # long enough to overlap despite a loaded machine's start-up jitter
    with open(os.path.join(os.environ["LOG_DIR"], name + ".json"), "w") as f:
        json.dump({{"start": start, "end": time.time(), "slot": os.environ.get("MODULE_SLOT"),
                    "home": os.environ.get("ROLLFLOW_HOME"), "pid": os.getpid()}}, f)

{tests}
'''


def _suite(root: Path) -> None:
    (root / "conftest.py").write_text(CONFTEST)
    (root / "test_alpha.py").write_text(MODULE.format(tests="def test_a():\n    _record('a')\n"))
    (root / "test_beta.py").write_text(MODULE.format(tests=(
        "def test_b():\n    _record('b')\n\n"
        "def test_b_fails():\n    assert 1 == 2, 'beta fails on purpose'\n")))


def _run(root: Path, at_once: int) -> tuple[subprocess.CompletedProcess[str], dict[str, dict]]:
    logs = root / f"logs-{at_once}"
    logs.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "AT_ONCE": str(at_once),
           "LOG_DIR": str(logs)}
    env.pop("ROLLFLOW_TEST_REPORTS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", "-p",
         "no:xdist", "-p", "no:randomly", str(root)],
        cwd=root, env=env, capture_output=True, text=True, timeout=120)
    return proc, {p.stem: json.loads(p.read_text()) for p in logs.glob("*.json")}


def test_modules_run_side_by_side_and_report_every_test(tmp_path: Path) -> None:
    _suite(tmp_path)
    proc, rec = _run(tmp_path, at_once=2)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "1 failed, 2 passed" in out, out
    assert "beta fails on purpose" in out, out
    a, b = rec["a"], rec["b"]
    assert a["pid"] != b["pid"]  # each module in its own process
    assert a["start"] < b["end"] and b["start"] < a["end"], "the two modules did not overlap"
    assert {a["slot"], b["slot"]} == {"0", "1"}
    assert a["home"] != b["home"] and a["home"] and b["home"]


def test_one_at_a_time_runs_the_first_ranked_module_first(tmp_path: Path) -> None:
    _suite(tmp_path)
    proc, rec = _run(tmp_path, at_once=1)
    out = proc.stdout + proc.stderr
    assert "1 failed, 2 passed" in out, out
    a, b = rec["a"], rec["b"]
    assert b["end"] <= a["start"], "beta (two tests) should run, alone, before alpha"
    assert a["slot"] == b["slot"] == "0"
