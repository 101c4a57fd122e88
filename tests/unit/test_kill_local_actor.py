"""`_kill_local_process` SIGKILLs a live actor's own worker and nothing else. The GCS's actor
table keeps a dead actor's pid, and on this machine pids wrap at 32768: a kill by that pid
could hit whatever process has it now (this one included, which took a CI worker down)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from engines.cluster import actors

NODE = "node-a"


class Handle:
    class _Id:
        def hex(self) -> str:
            return "actor-1"

    _actor_id = _Id()


@pytest.fixture
def table(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What the GCS says of the actor; this process runs on NODE."""
    entry: dict[str, Any] = {}
    monkeypatch.setattr(actors.ray._private.state, "actors", lambda actor_id: entry)

    class Context:
        def get_node_id(self) -> str:
            return NODE
    monkeypatch.setattr(actors.ray, "get_runtime_context", Context)
    return entry


@pytest.fixture
def worker() -> Iterator[subprocess.Popen[bytes]]:
    """A process named as Ray names an actor's worker."""
    proc = subprocess.Popen(["bash", "-c", "exec -a ray::EngineActor sleep 60"])
    deadline = time.monotonic() + 10
    while psutil.Process(proc.pid).cmdline()[:1] != ["ray::EngineActor"]:  # bash exec'd
        assert time.monotonic() < deadline, "the worker stand-in never took its name"
        time.sleep(0.01)
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def other() -> Iterator[subprocess.Popen[bytes]]:
    """Any other process (one that got a dead actor's pid, say)."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def _entry(pid: int, state: str) -> dict[str, Any]:
    return {"Pid": pid, "State": state, "Address": {"NodeID": NODE}}


def test_a_live_actor_s_worker_is_killed(table: dict[str, Any], worker: Any) -> None:
    table.update(_entry(worker.pid, "ALIVE"))
    actors._kill_local_process(Handle())
    assert worker.wait(timeout=10) == -9


@pytest.mark.parametrize("state", ["DEAD", "ALIVE"])
def test_no_other_process_is_killed(table: dict[str, Any], other: Any, worker: Any,
                                    state: str) -> None:
    """DEAD: the worker's pid may belong to anyone now. ALIVE: a pid that is not a Ray
    worker is not the actor's."""
    pid = worker.pid if state == "DEAD" else other.pid
    table.update(_entry(pid, state))
    actors._kill_local_process(Handle())
    for proc in (worker, other):  # (a SIGKILL sent lands before this wait ends)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)


def test_never_this_process(table: dict[str, Any]) -> None:
    table.update(_entry(os.getpid(), "ALIVE"))
    actors._kill_local_process(Handle())  # (a kill would end the test run here)
