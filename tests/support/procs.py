"""Subprocesses that run rollflow as a user's shell would: their own ROLLFLOW_HOME, this
checkout on PYTHONPATH, none of the test session's Ray auth or niceness settings."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from storage.run_layout import RunLayout
from tests.support import REPO_ROOT


def rollflow_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_AUTH") and k != "RAY_worker_niceness"}
    return {**env, "ROLLFLOW_HOME": str(home), "PYTHONPATH": str(REPO_ROOT), **extra}


def python(code: str, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_until_committed(driver: subprocess.Popen[str], layout: RunLayout, step: int,
                         timeout_s: float) -> None:
    """Until `layout` has committed `step`; fails with the driver's output if it
    exits first, or after `timeout_s`."""
    deadline = time.time() + timeout_s
    while not layout.is_committed(step):
        assert driver.poll() is None, driver.stdout.read() if driver.stdout else ""
        assert time.time() < deadline, f"step {step} never committed"
        time.sleep(0.05)


def start_driver(config_path: str, prefect_api: str) -> subprocess.Popen[str]:
    """`rollflow train --config config_path` against `prefect_api`, stdout and stderr in one."""
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "train", "--config", config_path],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )



@contextmanager
def cpu_burner(processes: int = 1) -> Iterator[None]:
    """`processes` processes spinning at normal priority for the block: a guarantee tested
    under them holds on a busy machine, not only on an idle one (beside burners on this
    2-core machine, train.deterministic held only once the trainer ran torch's
    deterministic kernels)."""
    # each spins while its parent lives: a test process killed at its timeout leaves none
    spinning = [subprocess.Popen(
        [sys.executable, "-c", f"import os\nwhile os.getppid() == {os.getpid()}: pass"])
        for _ in range(processes)]
    try:
        yield
    finally:
        for process in spinning:
            process.kill()
            process.wait()
