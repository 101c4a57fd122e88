"""storage/step_signals.py: a waiter wakes when this process writes a step's state, not at
its next poll."""

from __future__ import annotations

import threading
import time

from storage.run_layout import RunLayout
from storage.step_signals import step_state_written, wait_for


def later(work, delay_s: float = 0.1) -> threading.Thread:
    thread = threading.Timer(delay_s, work)
    thread.start()
    return thread


def test_a_waiter_wakes_on_the_signal_not_at_its_fallback_poll():
    flag = threading.Event()

    def write() -> None:
        flag.set()
        step_state_written()

    later(write)
    start = time.monotonic()
    assert wait_for(flag.is_set, timeout_s=30, fallback_s=20)
    assert time.monotonic() - start < 5


def test_without_the_signal_only_the_fallback_poll_sees_the_change():
    flag = threading.Event()
    later(flag.set)  # written where this process is not told (another process)
    start = time.monotonic()
    assert wait_for(flag.is_set, timeout_s=30, fallback_s=1.5)
    assert time.monotonic() - start >= 1.4


def test_a_saved_task_record_and_a_commit_signal(tmp_path):
    layout = RunLayout.open(str(tmp_path), "run")
    later(lambda: layout.save_task_record(3, "generate", {"groups": 1}))
    start = time.monotonic()
    assert wait_for(lambda: layout.task_record(3, "generate") is not None, 30, fallback_s=20)
    later(lambda: layout.mark_committed(3))
    assert wait_for(lambda: layout.is_committed(3), 30, fallback_s=20)
    assert time.monotonic() - start < 5
