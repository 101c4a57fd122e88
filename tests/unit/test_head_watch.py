"""The line a driver ends with when its Ray head is gone names the command that resumes it,
as the user typed it."""

from __future__ import annotations

import threading
import time

from engines.cluster.head import watch_head
from flows.bookkeeping.head_watch import head_gone_line, resume_command


def test_resume_command_is_what_the_user_typed() -> None:
    venv = "/home/u/.venv/bin"
    assert resume_command([f"{venv}/python", f"{venv}/rollflow", "train", "--config", "my run.yaml"]) \
        == "rollflow train --config 'my run.yaml'"
    assert resume_command([f"{venv}/python", "-m", "flows.cli", "train", "--config", "a.yaml"]) \
        == "python -m flows.cli train --config a.yaml"
    assert resume_command([f"{venv}/python", "job.py", "--fresh"]) == f"{venv}/python job.py --fresh"


def test_the_line_names_head_run_and_command() -> None:
    line = head_gone_line("127.0.0.1:6379", "my-run", "rollflow train --config a.yaml")
    assert line.startswith("rollflow: the Ray head at 127.0.0.1:6379 is gone")
    assert "run my-run stopped" in line and line.endswith("Resume it with: rollflow train --config a.yaml")


def test_the_watch_calls_back_once_the_port_is_dead_and_not_after_it_is_stopped() -> None:
    lost: list[str] = []
    called = threading.Event()

    def on_lost(address: str) -> None:
        lost.append(address)
        called.set()

    watch_head("127.0.0.1:1", on_lost, interval_s=0.01, misses=2)  # nothing listens on port 1
    assert called.wait(5) and lost == ["127.0.0.1:1"]
    stopped: list[str] = []
    watch_head("127.0.0.1:1", stopped.append, interval_s=0.2, misses=3).set()
    time.sleep(1.0)
    assert stopped == []
