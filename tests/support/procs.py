"""Subprocesses that run rollflow as a user's shell would: their own ROLLFLOW_HOME, this
checkout on PYTHONPATH, none of the test session's Ray auth or niceness settings."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support import REPO_ROOT


def rollflow_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_AUTH") and k != "RAY_worker_niceness"}
    return {**env, "ROLLFLOW_HOME": str(home), "PYTHONPATH": str(REPO_ROOT), **extra}


def python(code: str, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def start_driver(config_path: str, prefect_api: str) -> subprocess.Popen[str]:
    """`rollflow train --config config_path` against `prefect_api`, stdout and stderr in one."""
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "train", "--config", config_path],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )



@contextmanager
def cpu_burner() -> Iterator[None]:
    """One process spinning at normal priority for the block: a guarantee tested under it
    holds on a busy machine, not only on an idle one (two burners on this 2-core machine
    once broke determinism, with Ray's workers at nice 15)."""
    # it spins while its parent lives: a test process killed at its timeout leaves none
    spinning = subprocess.Popen(
        [sys.executable, "-c", f"import os\nwhile os.getppid() == {os.getpid()}: pass"])
    try:
        yield
    finally:
        spinning.kill()
        spinning.wait()
