"""The artifact thread: calls run in order, in the caller's context, off the caller's thread;
drain waits for them; a failing call is logged and the ones after it still run."""

from __future__ import annotations

import contextvars
import logging
import threading
import time

from tasks import artifact_queue

WHO = contextvars.ContextVar("who", default="nobody")


def test_calls_run_in_order_on_another_thread_in_the_callers_context():
    seen: list[tuple[int, str, str]] = []

    def record(i: int) -> None:
        time.sleep(0.01 if i % 2 else 0.0)  # uneven work must not reorder them
        seen.append((i, WHO.get(), threading.current_thread().name))

    token = WHO.set("step-3")
    try:
        for i in range(6):
            artifact_queue.later(record, i)
    finally:
        WHO.reset(token)
    artifact_queue.drain()
    assert [i for i, _, _ in seen] == list(range(6))
    assert {who for _, who, _ in seen} == {"step-3"}
    assert all(name.startswith("rollflow-artifacts") for _, _, name in seen)


def test_drain_waits_for_slow_calls():
    done = threading.Event()
    artifact_queue.later(lambda: (time.sleep(0.2), done.set()))
    artifact_queue.drain()
    assert done.is_set()


def test_a_failing_call_is_logged_and_the_next_ones_run(caplog):
    ran: list[str] = []

    def broken() -> None:
        raise ConnectionError("server busy")

    with caplog.at_level(logging.WARNING, logger=artifact_queue.__name__):
        artifact_queue.later(broken)
        artifact_queue.later(ran.append, "after")
        artifact_queue.drain()
    assert ran == ["after"]
    assert "could not publish a Prefect artifact (broken): server busy" in caplog.text


def test_progress_sends_a_repeated_value_once(monkeypatch):
    sent: list[float] = []
    bar = artifact_queue.ProgressArtifact("run-generation", "groups kept")
    monkeypatch.setattr(bar, "_publish", sent.append)
    for p in (0.0, 25.0, 25.0, 25.0, 100.0, 100.0):
        bar.set(p)
    artifact_queue.drain()
    assert sent == [0.0, 25.0, 100.0]
