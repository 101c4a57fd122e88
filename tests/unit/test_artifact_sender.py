"""Artifacts leave the caller's path inside `artifacts_in_background`, keep their order and
the caller's context, and a failed one is logged instead of failing the step."""

from __future__ import annotations

import contextvars
import logging
import threading

from tasks.artifact_sender import ArtifactSender, artifacts_in_background, send_artifact

RUN = contextvars.ContextVar("run", default="none")


def test_outside_the_block_an_artifact_is_sent_at_once_by_the_caller():
    seen = []
    send_artifact(lambda x: seen.append((x, threading.current_thread().name)), 1)
    assert seen == [(1, threading.current_thread().name)]


def test_inside_the_block_artifacts_are_sent_in_order_in_the_background_with_the_callers_context():
    seen: list[tuple[int, str, str]] = []
    release = threading.Event()

    def send(i: int) -> None:
        release.wait(5)
        seen.append((i, RUN.get(), threading.current_thread().name))

    with artifacts_in_background():
        for i in range(5):
            token = RUN.set(f"step-{i}")  # as the step flow run of each artifact
            send_artifact(send, i)
            RUN.reset(token)
        assert seen == []  # queued: the caller went on
        release.set()
    # leaving the block waited for all of them
    assert [(i, run) for i, run, _ in seen] == [(i, f"step-{i}") for i in range(5)]
    assert {thread for *_, thread in seen} != {threading.current_thread().name}
    assert all(thread.startswith("rollflow-artifacts") for *_, thread in seen)


def test_a_failed_artifact_is_logged_and_the_next_ones_still_go(caplog):
    seen = []

    def refused() -> None:
        raise RuntimeError("422 from the API")

    with caplog.at_level(logging.WARNING, "tasks.artifact_sender"), artifacts_in_background():
        send_artifact(refused)
        send_artifact(seen.append, "after")
    assert seen == ["after"]
    assert "422 from the API" in caplog.text


def test_closing_gives_up_on_an_artifact_that_does_not_finish(caplog):
    stuck, ran = threading.Event(), []
    sender = ArtifactSender()
    sender.submit(stuck.wait, 10)
    sender.submit(ran.append, "queued behind it")
    with caplog.at_level(logging.WARNING, "tasks.artifact_sender"):
        assert sender.close(timeout=0.2) == 2  # returns without waiting the 10 s
    stuck.set()
    for thread in threading.enumerate():
        if thread.name.startswith("rollflow-artifacts"):
            thread.join(5)
    assert ran == []  # cancelled, not sent late
    assert "not sent within" in caplog.text
