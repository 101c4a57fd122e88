"""A stopped (SIGSTOP) actor is SIGKILLed at once on a head without a dashboard (the tests'
heads have none): before, its pid came from `ray.util.state`, which asks the dashboard, so
nothing was killed and the engine's replacement waited for Ray to give up on it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import ray

from engines.cluster.actors import _kill_local_process


@ray.remote(num_cpus=0)
class Sleeper:
    def pid(self) -> int:
        return os.getpid()


def gone(pid: int) -> bool:
    """Exited (reaped, or a zombie its parent has yet to reap)."""
    status = Path(f"/proc/{pid}/status")
    try:
        return "\nState:\tZ" in status.read_text()
    except FileNotFoundError:
        return True


def test_a_stopped_actor_is_killed_within_a_second(ray_address: str) -> None:
    actor = Sleeper.remote()
    pid = ray.get(actor.pid.remote(), timeout=60)
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        _kill_local_process(actor)
        while not gone(pid) and time.monotonic() - started < 1.0:
            time.sleep(0.02)
        assert gone(pid), "the stopped actor's process is still there"
    finally:
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)
        ray.kill(actor)
