"""A signal, within one process, that a step's state changed in storage (a task record, a
commit, a failure), so code waiting on that state wakes when it is written instead of
reading storage in a tight loop.

In one_step and async modes the driver waits for a step's generate record before starting
the next step, and gates wait for commits (tasks/step_gates.py). Polling every 20 ms made
50 requests a second per waiter on S3. The steps run in the driver's process, so the writer
signals and the waiter wakes at once; a waiter still reads storage every `fallback_s`,
which covers a writer in another process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

_changed = threading.Condition()
_generation = 0


def step_state_written() -> None:
    """Wake every waiter of this process (called after the write)."""
    global _generation
    with _changed:
        _generation += 1
        _changed.notify_all()


def wait_for(ready: Callable[[], bool], timeout_s: float, fallback_s: float = 0.5) -> bool:
    """Until `ready()` (True) or `timeout_s` passed (False). `ready` is called again after
    each signal, and at least every `fallback_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        with _changed:
            seen = _generation
        if ready():
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        with _changed:
            if _generation == seen:
                _changed.wait(min(fallback_s, left))
