"""Servers a run depends on, killed under it: a driver subprocess (`rollflow train` as a
user runs it), what it trained on, and the processes of a Prefect server or a Ray head."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from storage.batch_io import read_samples
from storage.run_layout import RunLayout
from tests.support import REPO_ROOT

Row = tuple[int, int, list[int], object, list[int]]


def trained_samples(layout: RunLayout) -> list[list[Row]]:
    """Per committed step, what it trained on: index, group, tokens, reward, loss mask."""
    return [[(s.index, s.group_index, list(s.tokens), s.reward, list(s.loss_mask or []))
             for s in read_samples(layout.store, f"steps/{k:06d}", "train.arrow")]
            for k in layout.committed_steps()]


def train_command(config_path: str, env: dict[str, str]) -> subprocess.Popen[str]:
    """`rollflow train --config config_path` in `env`, stdout and stderr in one."""
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "train", "--config", config_path],
        cwd=REPO_ROOT, env={**env, "PYTHONPATH": str(REPO_ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def wait_until(what: str, holds: Callable[[], bool], driver: subprocess.Popen[str],
               timeout_s: float = 300) -> None:
    """Poll `holds` while the driver runs; fail with its output if it ends first."""
    deadline = time.monotonic() + timeout_s
    while not holds():
        if driver.poll() is not None:
            out = driver.stdout.read() if driver.stdout else ""
            raise AssertionError(f"the driver ended before {what}: {out[-3000:]}")
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)


def kill_processes(match: Callable[[psutil.Process], bool]) -> list[int]:
    """kill -9 every process `match` accepts (never this one); their pids."""
    killed = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if proc.pid != os.getpid() and match(proc):
                proc.send_signal(signal.SIGKILL)
                killed.append(proc.pid)
        except psutil.Error:
            continue
    return killed


def head_processes_of(home: Path) -> Callable[[psutil.Process], bool]:
    """The Ray head rollflow started under ROLLFLOW_HOME `home`: GCS, raylet and the monitors
    name its session dir on their command line (engines/cluster/head.py)."""
    temp_dir = str(home / "ray")
    return lambda proc: any(temp_dir in arg for arg in proc.info["cmdline"] or [])


def prefect_servers_under(pid: int) -> Callable[[psutil.Process], bool]:
    """The driver `pid`'s own Prefect server (`start_local_server` in
    flows/servers/prefect_server.py)."""

    def match(proc: psutil.Process) -> bool:
        cmd = " ".join(proc.info["cmdline"] or [])
        return "flows.servers.prefect_app" in cmd and any(p.pid == pid for p in proc.parents())

    return match
